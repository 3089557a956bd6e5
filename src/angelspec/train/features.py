"""The target hidden-state features drafters train on, behind one contract (report §6; issue 4 "Data").

Every drafter family consumes the frozen target's outputs on the training tokens: MTP and EAGLE-3 read
hidden states of some layers, DFlash/DFly read several, KL-style losses read the teacher distribution.
:class:`FeatureSpec` says which; two producers honour it and give IDENTICAL batches (a test checks
``torch.equal`` on every tensor):

* :class:`OnlineFeatures`: the frozen target runs inside the training step under ``no_grad``. No disk,
  always fresh, but every epoch pays the target forward again.
* :class:`OfflineFeatureCache`: the same computation run once over the packed dataset and stored as
  sharded safetensors. Training then reads memory-mapped shards instead of running an 8B target, which
  is how the report's disaggregated design keeps trainers busy; the price is disk,
  ``rows * T * D * bytes * len(layer_ids)``: about 100 GB per 1k rows of 4k tokens for 3 bf16 layers of
  D=4096, while full fp32 logits of a 150k vocab would add 2.5 TB more; hence top-K teacher logits.

Cache layout (``DIR/``)::

    manifest.json            {"format", "spec", "target_weights", "target_dtype", "rows_per_shard", "dataset",
                              "complete", "num_batches",
                              "shards": [{"file", "batches", "rows", "bytes", "sha256", "inputs"}]}
    shard-00000.safetensors  tensors "{j}.{field}" for the j-th batch of the shard (fields of FeatureBatch.to_tensors)

A shard holds whole input batches (never split), so a batch read back is exactly the batch the online
path computes: splitting or merging rows could change float results through different matmul blocking.
Each shard is written atomically (temp file + rename) and only then recorded in the manifest (also
atomic), so after a kill the manifest lists only complete shards. ``resume=True`` skips listed shards
whose size (and input digest) match, and rebuilds a shard that is missing, truncated or unlisted. The
reader checks sizes on open (and every SHA-256 with ``verify=True``), each shard's SHA-256 before its first
read in any case (once per shard and process), and refuses a cache built from another target (its weights id,
`decoding.loading.target_weights_id`, and the dtype it ran in; a cache made before the weights id was recorded is
matched on its `"target_fingerprint"`, the fingerprint at the load dtype) or
with another spec.

Training from a cache (``train.mtp`` / ``train.block``, config ``features=DIR``; made by ``angelspec
features``, :func:`build_feature_cache`): a trainer gets its features from :func:`target_features`, a
:class:`TargetFeatures` that either runs the target or reads the cache. The cache holds the trainer's packed
rows, one row per stored batch, in packing order, and records the packed dataset (``dataset_identity``: rows,
seq_len, digest of the tokens). A trainer reads the rows of a step with :meth:`OfflineFeatureCache.rows` (any
order, so one cache serves every seed, batch size and data-parallel split) after
:meth:`OfflineFeatureCache.require` has checked the dataset and the layers. No teacher logits are stored: the
trainer recomputes them from the last layer's tap with the target's own final norm and LM head,
``lm_head(norm(h_{L-1}))``, the exact ops of the target's forward, so the batches equal the online ones while
the cache stays at D (not V) values per token and layer.

Training from a stream (config ``features=stream:DIR`` or ``features=ray:NAME``, :func:`open_stream`): feature
servers, processes or machines of their own, run the target over each step's batch and stream the taps to the
trainer as it trains (``train.stream``: the disaggregated pipeline, bounded and resumable); the same
:class:`TargetFeatures` reads them in step order and recomputes the teacher logits the same way.

It lives in ``train/``, not ``data/``, because it runs the target (``models``).

Shape legend: B rows, T row length, D model dim, K teacher top-k, V vocab.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor

from angelspec.data.fingerprint import file_sha256, model_fingerprint, tensors_fingerprint
from angelspec.data.packing import PackedBatch, packing_report
from angelspec.fileio import check_writable_path, refuse_same_file
from angelspec.models.decoder import Decoder, TrainInputs
from angelspec.models.device import Placement, placement_of
from angelspec.models.hf_io import (
    iter_state_dict,
    load_target,
    nonfinite_problem,
    save_safetensors_atomic,
    write_json_atomic,
)
from angelspec.train.data import PackedRows, dataset_identity, pack_conversations, packed_digest, pad_token_id
from angelspec.train.distributed import DistInfo
from angelspec.train.losses import TeacherHead
from angelspec.train.sequence_parallel import NO_SP, SequenceParallel, target_forward
from angelspec.train.stream import FeatureStream, FileFeatureStream, StreamPlan, stream_target_id

CACHE_FORMAT = "angelspec-features/1"
MANIFEST = "manifest.json"
_SHARD_RE = re.compile(r"shard-\d{5}\.safetensors")
_TEMP_RE = re.compile(r"\.shard-\d{5}\.safetensors\..*\.tmp")  # save_safetensors_atomic's temp files
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_name(dtype: torch.dtype) -> str:
    """The :attr:`FeatureSpec.dtype` name of a torch dtype (e.g. a target's, to store its taps unchanged)."""
    for name, t in _DTYPES.items():
        if t == dtype:
            return name
    raise ValueError(f"hidden states of dtype {dtype} cannot be cached; supported: {sorted(_DTYPES)}")


class FeatureCacheError(ValueError):
    """A feature cache that cannot be built, resumed or read; the message names the file and the fix."""


@dataclass(frozen=True)
class FeatureSpec:
    """Which target outputs a drafter needs.

    layer_ids: hidden-state taps, id i = OUTPUT of decoder layer i (HF ``hidden_states[i + 1]``;
        docs/design.md trap 2), in the order the drafter concatenates them.
    with_logits: False = no teacher; True = full logits [B, T, V] fp32; an int K = the teacher's top-K
        log-probabilities and ids [B, T, K] (what forward KL on the top-K support, Eq. 3, needs, at K/V of
        the storage).
    dtype: storage dtype of the hidden states ("float32", "bfloat16", "float16"); logits stay fp32.
    """

    layer_ids: tuple[int, ...]
    with_logits: bool | int = False
    dtype: str = "float32"

    def __post_init__(self) -> None:
        ids = self.layer_ids
        if not isinstance(ids, tuple) or not ids or any(isinstance(i, bool) or not isinstance(i, int) or i < 0
                                                          for i in ids):
            raise ValueError(f"FeatureSpec.layer_ids must be a non-empty tuple of ints >= 0, got {ids!r}")
        if len(set(ids)) != len(ids):
            raise ValueError(f"FeatureSpec.layer_ids has duplicates: {ids!r}")
        w = self.with_logits
        if not isinstance(w, bool) and (not isinstance(w, int) or w < 1):
            raise ValueError(f"FeatureSpec.with_logits must be a bool or a top-K int >= 1, got {w!r}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"FeatureSpec.dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")

    @property
    def topk(self) -> int:
        """K of the teacher top-K (0 = none or full logits)."""
        return 0 if isinstance(self.with_logits, bool) else self.with_logits

    @property
    def full_logits(self) -> bool:
        return self.with_logits is True

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    def check_target(self, target: Decoder) -> None:
        """Fail before any forward when the spec cannot be served by this target."""
        L, V = target.config.num_hidden_layers, target.config.vocab_size
        bad = [i for i in self.layer_ids if i >= L]
        if bad:
            raise FeatureCacheError(f"layer ids {bad} out of range: the target has {L} layers (ids 0..{L - 1})")
        if self.topk > V:
            raise FeatureCacheError(f"teacher top-K {self.topk} exceeds the target vocabulary {V}")

    def to_json(self) -> dict[str, Any]:
        # Spelled out: JSON (and Python's ==) would not tell `True` (full logits) from `1` (top-1).
        teacher = "full" if self.full_logits else "topk" if self.topk else "none"
        return {"layer_ids": list(self.layer_ids), "teacher": teacher, "topk": self.topk, "dtype": self.dtype}

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> FeatureSpec:
        teacher = {"none": False, "full": True, "topk": obj["topk"]}[obj["teacher"]]
        return cls(tuple(obj["layer_ids"]), teacher, obj["dtype"])


@dataclass
class FeatureBatch:
    """One packed batch with the target features a drafter trains on (all on one device)."""

    input_ids: Tensor  # [B, T] int64
    positions: Tensor  # [B, T] int64, document-local
    document_ids: Tensor  # [B, T] int64, -1 in padding
    loss_mask: Tensor  # [B, T] bool, assistant tokens
    labels: Tensor  # [B, T] int64, next token or IGNORE_INDEX (packing's document gate)
    hidden: dict[int, Tensor] = field(default_factory=dict)  # layer id -> [B, T, D] in spec.dtype
    teacher_topk_ids: Tensor | None = None  # [B, T, K] int64
    teacher_topk_vals: Tensor | None = None  # [B, T, K] fp32 teacher log-probs (log_softmax over all V)
    logits: Tensor | None = None  # [B, T, V] fp32

    def to_tensors(self) -> dict[str, Tensor]:
        """Flat name -> tensor (the safetensors keys of one batch)."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "hidden"}
        out.update({f"hidden.{i}": t for i, t in self.hidden.items()})
        return {k: v for k, v in out.items() if v is not None}

    @classmethod
    def from_tensors(cls, tensors: dict[str, Tensor], layer_ids: tuple[int, ...]) -> FeatureBatch:
        hidden = {i: tensors[f"hidden.{i}"] for i in layer_ids}  # spec order, as the online path builds it
        plain = {f.name: tensors.get(f.name) for f in fields(cls) if f.name != "hidden"}
        return cls(**plain, hidden=hidden)

    def to(self, device: torch.device | str) -> FeatureBatch:
        return FeatureBatch.from_tensors({k: v.to(device) for k, v in self.to_tensors().items()}, tuple(self.hidden))


class OnlineFeatures:
    """The frozen target's forward inside the training step: ``features = OnlineFeatures(target, spec)(packed)``.

    Runs under ``no_grad`` (not ``inference_mode``: inference tensors cannot be saved for the drafter's
    backward). Cost: one full target forward per step, plus a [B, T, V] logits tensor when a teacher is
    requested; skip logits entirely with ``with_logits=False``.
    """

    def __init__(self, target: Decoder, spec: FeatureSpec) -> None:
        spec.check_target(target)
        self.target, self.spec = target, spec
        self.device = target.embed_tokens.weight.device

    @torch.no_grad()
    def __call__(self, packed: PackedBatch) -> FeatureBatch:
        if packed.input_ids.dim() != 2:
            raise ValueError(f"packed.input_ids must be [B, T], got shape {tuple(packed.input_ids.shape)}")
        p = packed.to(self.device)
        spec = self.spec
        out = self.target(p.input_ids, TrainInputs(positions=p.positions, document_ids=p.document_ids,
                                                   hidden_layers=spec.layer_ids,
                                                   compute_logits=spec.with_logits is not False))
        batch = FeatureBatch(input_ids=p.input_ids, positions=p.positions, document_ids=p.document_ids,
                             loss_mask=p.loss_mask, labels=p.labels,
                             hidden={i: h.to(spec.torch_dtype) for i, h in zip(spec.layer_ids, out.hidden,
                                                                                strict=True)})
        if spec.full_logits:
            batch.logits = out.logits  # [B, T, V] fp32
        elif spec.topk:
            logprobs = torch.log_softmax(out.logits, dim=-1)  # [B, T, V]
            vals, ids = logprobs.topk(spec.topk, dim=-1)  # [B, T, K]
            batch.teacher_topk_vals, batch.teacher_topk_ids = vals, ids
        return batch


def _group(batches: Iterable[PackedBatch], rows_per_shard: int) -> Iterator[list[PackedBatch]]:
    """Whole batches into shards of at least ``rows_per_shard`` rows (the last shard may have fewer)."""
    group: list[PackedBatch] = []
    for b in batches:
        group.append(b)
        if sum(x.num_rows for x in group) >= rows_per_shard:
            yield group
            group = []
    if group:
        yield group


def _save_shard(tensors: dict[str, Tensor], path: Path, metadata: dict[str, str]) -> None:
    save_safetensors_atomic(tensors, path, metadata)


class OfflineFeatureCache:
    """A sharded, memory-mapped feature cache: :meth:`build` it once, :meth:`open` it to train.

    Iterating yields :class:`FeatureBatch` es in build order, each read lazily from its shard through
    ``safetensors.safe_open`` (memory-mapped: only the tensors of the batch in use are paged in).
    """

    def __init__(self, root: Path, manifest: dict[str, Any]) -> None:
        self.root, self.manifest = root, manifest
        self.spec = FeatureSpec.from_json(manifest["spec"])
        self._row_index: list[tuple[str, int, int]] | None = None  # global row -> (shard file, batch j, row in j)
        self._handles: dict[str, Any] = {}  # open safe_open handles, one per shard read by rows()
        self._keys: dict[str, set[str]] = {}  # tensor names of each open shard
        self._verified: set[str] = set()  # shards whose SHA-256 has been checked against the manifest

    # ----- producer -----
    @classmethod
    def build(cls, target: Decoder, spec: FeatureSpec, batches: Iterable[PackedBatch], root: str | Path, *,
              rows_per_shard: int = 256, resume: bool = False, force: bool = False, verify: bool = False,
              log: Any = None, dataset: dict[str, Any] | None = None) -> OfflineFeatureCache:
        """Run :class:`OnlineFeatures` over ``batches`` and write the cache (resumable, see the module doc).

        ``dataset``: what the batches are (e.g. :func:`dataset_identity`), recorded in the manifest for
        :meth:`require` and compared on resume.

        ``batches`` must come out the same on a resume (pack deterministically); each shard records a
        digest of its input tokens and a resume with different data is refused. ``log`` is a
        ``print``-like callable for rebuild notes (None = silent). On resume a listed shard is reused when
        its size matches; ``verify=True`` also re-hashes it (reads it once).
        """
        if isinstance(rows_per_shard, bool) or not isinstance(rows_per_shard, int) or rows_per_shard < 1:
            raise FeatureCacheError(f"rows_per_shard must be an int >= 1, got {rows_per_shard!r}")
        root = Path(root)
        online = OnlineFeatures(target, spec)
        manifest = cls._start_manifest(root, spec, target, rows_per_shard, dataset, resume=resume, force=force)
        old = {s["file"]: s for s in manifest["shards"]}
        shards: list[dict[str, Any]] = []
        num_batches = 0
        for k, group in enumerate(_group(batches, rows_per_shard)):
            name = f"shard-{k:05d}.safetensors"
            digest = packed_digest(group)  # a resume cannot splice two datasets
            prev = old.get(name)
            if prev is not None and prev["inputs"] != digest:
                raise FeatureCacheError(f"cannot resume {root}: the input batches of {name} differ from the "
                                        "interrupted run (data or packing changed); rebuild with force=True")
            problem = None if prev is None else _shard_problem(root, prev, verify=verify)
            if prev is not None and problem is None:
                shards.append(prev)
            else:
                if problem is not None and log is not None:
                    log(f"rebuilding {name}: {problem}")
                tensors = {}
                for j, packed in enumerate(group):
                    tensors.update({f"{j}.{key}": t for key, t in online(packed).to_tensors().items()})
                path = root / name
                # One metadata key only: safetensors writes metadata from a hash map, and two keys would come
                # out in random order, making identical shards differ in bytes (and in SHA-256).
                _save_shard(tensors, path, {"format": CACHE_FORMAT})
                shards.append({"file": name, "batches": len(group), "rows": sum(b.num_rows for b in group),
                               "bytes": path.stat().st_size, "sha256": file_sha256(path), "inputs": digest})
                # Keep not-yet-revisited entries of the old run: a kill now must not forget shards after k.
                manifest["shards"] = shards + [s for s in manifest["shards"]
                                               if s["file"] not in {x["file"] for x in shards}]
                write_json_atomic(root / MANIFEST, manifest)
            num_batches += len(group)
        stale = [s["file"] for s in manifest["shards"] if s["file"] not in {x["file"] for x in shards}]
        if stale:
            raise FeatureCacheError(f"cannot resume {root}: the interrupted run had more shards ({stale[:3]}) than "
                                    "the input now produces (data changed); rebuild with force=True")
        if not shards:
            raise FeatureCacheError("no batches to cache")
        manifest.update(shards=shards, complete=True, num_batches=num_batches)
        write_json_atomic(root / MANIFEST, manifest)
        return cls(root, manifest)

    @staticmethod
    def _start_manifest(root: Path, spec: FeatureSpec, target: Decoder, rows_per_shard: int,
                        dataset: dict[str, Any] | None, *, resume: bool, force: bool) -> dict[str, Any]:
        identity = target_identity(target)
        fresh = {"format": CACHE_FORMAT, "spec": spec.to_json(), **identity,
                 "rows_per_shard": rows_per_shard, "dataset": dataset, "complete": False, "num_batches": 0,
                 "shards": []}
        path = root / MANIFEST
        if root.exists() and not root.is_dir():
            raise FeatureCacheError(f"feature cache path {root} is a file, expected a folder")
        for tmp in root.glob(".shard-*.tmp") if root.is_dir() else ():
            if _TEMP_RE.fullmatch(tmp.name):  # a shard write that a kill interrupted before its rename
                tmp.unlink()
        if not path.is_file() or force:
            ours = [p for p in root.iterdir() if _SHARD_RE.fullmatch(p.name)] if root.is_dir() else []
            if ours and not force:
                raise FileExistsError(f"{root} holds feature shards but no {MANIFEST}; pass force=True to rebuild")
            for p in ours:  # only files this module writes; never the rest of the folder
                p.unlink()
            root.mkdir(parents=True, exist_ok=True)
            write_json_atomic(path, fresh)
            return fresh
        if not resume:
            raise FileExistsError(f"feature cache {root} already exists; pass resume=True (`angelspec features "
                                  "--resume`) to continue it or force=True (--force) to rebuild it")
        manifest = _read_manifest(root)
        if "target_weights" not in manifest and manifest.get("target_fingerprint") == model_fingerprint(target):
            manifest = {**{k: v for k, v in manifest.items() if k != "target_fingerprint"}, **identity}  # upgraded
        for key, want in (("spec", spec.to_json()), *identity.items(),
                          ("rows_per_shard", rows_per_shard), ("dataset", dataset)):
            have = manifest.get(key)
            if key == "dataset":  # its notes (e.g. the source path) may change; the data may not
                have, want = _compared(have), _compared(want)
            if have != want:
                raise FeatureCacheError(f"cannot resume {root}: {key} was {have!r}, now {want!r}; "
                                        "resume with the original target and settings or rebuild with force=True")
        manifest["complete"], manifest["dataset"] = False, dataset
        return manifest

    # ----- reader -----
    @classmethod
    def open(cls, root: str | Path, *, target: Decoder | None = None, spec: FeatureSpec | None = None,
             verify: bool = False, target_dir: str | Path | None = None) -> OfflineFeatureCache:
        """Open a complete cache; refuse it if it was built from another target or with another spec.

        ``target``'s weights id is compared (`decoding.loading.target_weights_id`, cheap: see
        :mod:`angelspec.data.fingerprint`) and the dtype it runs in; ``target_dir``: its checkpoint folder, for a
        target whose layers were not loaded (`parts="head"`). ``verify=True`` also re-hashes every shard (reads the
        whole cache once).
        """
        root = Path(root)
        manifest = _read_manifest(root)
        if not manifest.get("complete"):
            raise FeatureCacheError(f"feature cache {root} is incomplete (its build was interrupted); finish it "
                                    "with OfflineFeatureCache.build(..., resume=True)")
        problem = None if target is None else _other_target(manifest, target, target_dir)
        if problem is not None:
            raise FeatureCacheError(f"feature cache {root} was built from target {problem}; rebuild the cache for "
                                    "this target")
        if spec is not None and manifest["spec"] != spec.to_json():
            raise FeatureCacheError(f"feature cache {root} has spec {manifest['spec']}, but {spec.to_json()} is "
                                    "needed; rebuild the cache with this spec")
        for s in manifest["shards"]:
            problem = _shard_problem(root, s, verify=verify)
            if problem is not None:
                raise FeatureCacheError(f"feature cache {root}: {problem}; rebuild it with "
                                        "OfflineFeatureCache.build(..., resume=True)")
        cache = cls(root, manifest)
        if verify:
            cache._verified.update(s["file"] for s in manifest["shards"])
        return cache

    def _verify(self, file: str) -> None:
        """Check shard `file`'s SHA-256 against the manifest, once per shard and process, before its first read:
        a shard damaged in place (same size, other bytes) would otherwise train on garbage or NaN."""
        if file in self._verified:
            return
        shard = next((s for s in self.manifest["shards"] if s["file"] == file), None)
        path = self.root / file
        if shard is not None and shard.get("sha256"):
            try:
                digest = file_sha256(path)
            except OSError as e:
                raise _unreadable(path, e) from None
            if digest != shard["sha256"]:
                raise FeatureCacheError(f"feature shard {path} is damaged: its SHA-256 differs from the one in "
                                        f"{self.root / MANIFEST}; rebuild the cache (angelspec features ... --force "
                                        "with the flags that made it)")
        self._verified.add(file)

    def __len__(self) -> int:
        return self.manifest["num_batches"]

    def __iter__(self) -> Iterator[FeatureBatch]:
        for s in self.manifest["shards"]:
            path = self.root / s["file"]
            self._verify(s["file"])
            try:
                with safe_open(path, framework="pt") as f:
                    per_batch: list[list[str]] = [[] for _ in range(s["batches"])]
                    for key in f.keys():  # "{j}.{field}"
                        per_batch[int(key.split(".", 1)[0])].append(key)
                    for keys in per_batch:
                        tensors = {k.split(".", 1)[1]: f.get_tensor(k) for k in keys}
                        _check_finite(path, tensors)
                        yield FeatureBatch.from_tensors(tensors, self.spec.layer_ids)
            except (SafetensorError, OSError) as e:
                raise _unreadable(path, e) from None

    @property
    def num_rows(self) -> int:
        return sum(s["rows"] for s in self.manifest["shards"])

    def require(self, layer_ids: Iterable[int], dataset: dict[str, Any]) -> None:
        """Refuse a cache that cannot stand in for the online features of a training run: made from another
        packed dataset (``dataset``, from :func:`dataset_identity`: seq_len, row count, token digest) or
        without some of ``layer_ids``; the message says which (the trainer adds the command that makes a
        matching cache)."""
        have = self.manifest.get("dataset") or {}
        problem = None
        if not have:
            problem = "it records no training dataset (it was not made by `angelspec features`)"
        elif have.get("seq_len") != dataset["seq_len"]:
            problem = (f"it was made with seq_len={have.get('seq_len')}, but this run packs rows of "
                       f"seq_len={dataset['seq_len']}")
        elif (have.get("rows"), have.get("digest")) != (dataset["rows"], dataset["digest"]):
            problem = (f"it was made from another dataset or packing ({have.get('rows')} packed rows from "
                       f"{have.get('source', '?')}, digest {have.get('digest')}; this run packs {dataset['rows']} "
                       f"rows from {dataset.get('source', '?')}, digest {dataset['digest']}: other conversations, "
                       "chat template, enable_thinking or pad token)")
        elif missing := sorted(set(layer_ids) - set(self.spec.layer_ids)):
            problem = (f"it lacks target layer(s) {missing} that this drafter needs (it holds layers "
                       f"{list(self.spec.layer_ids)})")
        elif self.num_rows != dataset["rows"]:
            problem = f"its shards hold {self.num_rows} rows, but this run packs {dataset['rows']}"
        if problem is not None:
            raise FeatureCacheError(f"feature cache {self.root} does not fit this run: {problem}")

    def rows(self, idx: Iterable[int], layer_ids: Iterable[int] | None = None) -> FeatureBatch:
        """Global rows ``idx`` (counted over the stored batches in build order) as one batch [len(idx), T, ...],
        with the hidden states of ``layer_ids`` (default: all), read through memory-mapped slices: only the
        requested rows are paged in. All stored batches must share T (a training cache's rows do)."""
        layer_ids = self.spec.layer_ids if layer_ids is None else tuple(layer_ids)
        missing = [i for i in layer_ids if i not in self.spec.layer_ids]
        if missing:
            raise FeatureCacheError(f"feature cache {self.root} holds layers {list(self.spec.layer_ids)}, "
                                    f"not {missing}")
        index = self._rows_index()
        parts: list[dict[str, Tensor]] = []
        for g in idx:
            if not 0 <= g < len(index):
                raise IndexError(f"row {g} out of range: feature cache {self.root} holds {len(index)} rows")
            file, j, r = index[g]
            f = self._handle(file)
            names = [n for n in _ROW_FIELDS if f"{j}.{n}" in self._keys[file]]
            names += [f"hidden.{i}" for i in layer_ids]
            parts.append({n: f.get_slice(f"{j}.{n}")[r:r + 1] for n in names})
            _check_finite(self.root / file, parts[-1])
        if not parts:
            raise ValueError("rows() needs at least one row index")
        return FeatureBatch.from_tensors({n: torch.cat([p[n] for p in parts]) for n in parts[0]}, layer_ids)

    def _rows_index(self) -> list[tuple[str, int, int]]:
        if self._row_index is None:
            index: list[tuple[str, int, int]] = []
            for s in self.manifest["shards"]:
                f = self._handle(s["file"])
                for j in range(s["batches"]):
                    index += [(s["file"], j, r) for r in range(f.get_slice(f"{j}.input_ids").get_shape()[0])]
            self._row_index = index
        return self._row_index

    def _handle(self, file: str) -> Any:
        if file not in self._handles:
            path = self.root / file
            self._verify(file)
            try:
                self._handles[file] = safe_open(path, framework="pt")
            except (SafetensorError, OSError) as e:
                raise _unreadable(path, e) from None
            self._keys[file] = set(self._handles[file].keys())
        return self._handles[file]


_ROW_FIELDS = tuple(f.name for f in fields(FeatureBatch) if f.name != "hidden")  # stored as "{j}.{name}"


def _compared(dataset: dict[str, Any] | None) -> dict[str, Any] | None:
    """The part of a :func:`dataset_identity` that must match: rows, seq_len and digest, not the notes."""
    return None if dataset is None else {k: dataset.get(k) for k in ("rows", "seq_len", "digest")}


def _check_finite(path: Path, tensors: dict[str, Tensor]) -> None:
    """Refuse features holding a NaN or an infinity as they are read (a shard damaged in place keeps its size)."""
    for name, t in tensors.items():
        if (problem := nonfinite_problem(name, t)) is not None:
            raise FeatureCacheError(f"feature shard {path}: {problem}; the cache is damaged: delete it and build it "
                                    "again with `angelspec features`")


def _unreadable(path: Path, e: Exception) -> FeatureCacheError:
    return FeatureCacheError(f"feature shard {path} is unreadable ({e}); rebuild the cache with "
                             "OfflineFeatureCache.build(..., resume=True)")


def _read_manifest(root: Path) -> dict[str, Any]:
    path = root / MANIFEST
    if not path.is_file():
        raise FeatureCacheError(f"{root} is not a feature cache: {MANIFEST} is missing")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise FeatureCacheError(f"{path} is unreadable ({e}); rebuild the cache") from None
    if not isinstance(manifest, dict) or manifest.get("format") != CACHE_FORMAT:
        raise FeatureCacheError(f"{path} is not a {CACHE_FORMAT} manifest")
    return manifest


def _shard_problem(root: Path, shard: dict[str, Any], *, verify: bool) -> str | None:
    """Why a listed shard cannot be used (missing, wrong size, wrong hash), or None when it is fine."""
    path = root / shard["file"]
    if not path.is_file():
        return f"shard {shard['file']} is missing"
    size = path.stat().st_size
    if size != shard["bytes"]:
        return f"shard {shard['file']} is corrupt or half-written ({size} bytes, the manifest says {shard['bytes']})"
    if verify and file_sha256(path) != shard["sha256"]:
        return f"shard {shard['file']} is corrupt (SHA-256 differs from the manifest)"
    return None


# ----- a trainer's features: online or from an offline cache -----


class TargetFeatures:
    """The frozen target's taps and teacher logits for a step's rows: `taps, logits = features(batch, rows)`.

    Online (no `cache`, no `stream`): the target's forward under no_grad. Offline: the rows' hidden states read
    from an `OfflineFeatureCache` made by `build_feature_cache` (`angelspec features`). Streamed: the hidden states
    of the step's batch published by feature servers (`train.stream`, `features=stream:DIR` or `ray:NAME`), which
    run the target over the very batch the online path would. In both of the last two the teacher logits are
    recomputed from the last layer's tap as `lm_head(norm(h_{L-1})).float()`, the very ops of the target's forward,
    so D values per token and layer travel instead of V logits. The cache computes one row per forward and the
    online path a whole batch: the same values wherever the kernels treat rows independently (CPU: tested bit for
    bit, same losses and weights); elsewhere (e.g. GPU GEMMs picking tiles by batch size) they agree up to float
    rounding; a stream computes whole batches, like the online path. Cache and stream still need the target's
    embedding, final norm and LM head (the drafter shares them), not its layers' compute.

    A stream is read in step order: the trainer's loop calls `start` (its first step) before the first batch and
    `finish` after the last (`train.loop.train_drafter_steps`)."""

    def __init__(self, target: Decoder, layer_ids: list[int] | tuple[int, ...],
                 cache: OfflineFeatureCache | None = None, stream: FeatureStream | None = None,
                 plan: dict[str, Any] | None = None, sp: SequenceParallel = NO_SP, halo: int = 0) -> None:
        self.target, self.layer_ids, self.cache, self.stream = target, tuple(layer_ids), cache, stream
        self.last = target.config.num_hidden_layers - 1
        self._plan, self._step = plan, 0  # a stream's plan, less the batch split that `start` adds
        self.sp, self.halo = sp, halo  # sequence parallelism: this rank's shard, the teacher's halo after it

    @property
    def source(self) -> str:
        if self.stream is not None:
            return self.stream.source
        return "online" if self.cache is None else str(self.cache.root)

    def start(self, step: int, end: int, batch_size: int, info: DistInfo, log: Callable[[str], None]) -> None:
        """The training loop begins at `step` (its checkpoint's) and runs to `end`: a stream learns the plan
        (`StreamPlan`) and where this rank reads from. A no-op online or from a cache."""
        if self.stream is not None:
            assert self._plan is not None
            plan = StreamPlan(**self._plan, batch_size=batch_size, world_size=info.world_size)
            self.stream.attach(plan, info.rank, step, end, log)
            self._step = step

    def finish(self, step: int) -> None:
        """The training loop stopped at `step` (its end, or a time budget): a stream's servers may stop."""
        if self.stream is not None:
            self.stream.finish(step)

    @torch.no_grad()
    def __call__(self, batch: PackedBatch, rows: list[int]) -> tuple[list[torch.Tensor], TeacherHead]:
        """`batch` [B, T] = packed rows `rows` -> one tap [B, T, D] per layer id, and the teacher: the final-norm
        states [B, T, D] with the target's LM head (`train.losses.TeacherHead`; the loss chunks make the [B, T, V]
        fp32 logits a few rows at a time, so they never exist whole).

        Under sequence parallelism (`sp`, `train.sequence_parallel`): the taps of this rank's shard [B, T/N, D] and
        the teacher of the shard plus its `halo`, states [B, T/N + h, D] (h = `halo`, 0 on the last rank). Online,
        the target runs on the shard only (`target_forward`: Ulysses attention over the whole row); from a cache the
        shard is read out of the whole rows. Either way the halo's final-norm states come from the next rank
        (`SequenceParallel.halo_from_next`: the hidden size a position, not V logits) and the LM head runs on
        shard + halo. The target runs in its own dtype, outside the drafter's autocast (the trainer's
        `TrainRun.autocast`), so its taps equal a cache's or a stream's."""
        with torch.autocast(batch.input_ids.device.type, enabled=False):
            return self._features(batch, rows)

    def _features(self, batch: PackedBatch, rows: list[int]) -> tuple[list[torch.Tensor], torch.Tensor]:
        t, sp = self.target, self.sp
        if self.cache is None and self.stream is None:
            if sp.enabled:
                out = target_forward(sp, t, batch, self.layer_ids)
            else:
                out = t(batch.input_ids, TrainInputs(positions=batch.positions, document_ids=batch.document_ids,
                                                     hidden_layers=self.layer_ids, compute_logits=False))
            taps, last = list(out.hidden), out.last_hidden
        else:
            taps, last = self._stored(batch, rows)
        if sp.enabled:
            last = torch.cat([last, sp.halo_from_next(last, self.halo)], dim=1)
        return taps, TeacherHead(last, t.head_logits, t.config.vocab_size)

    def _stored(self, batch: PackedBatch, rows: list[int]) -> tuple[list[torch.Tensor], torch.Tensor]:
        """The taps and the final-norm states of `batch` from the cache or the stream (this rank's shard of them
        under sequence parallelism), after checking they hold these rows and tokens."""
        t, sp = self.target, self.sp
        dev = batch.input_ids.device
        if self.cache is not None:
            fb = self.cache.rows(rows, sorted({*self.layer_ids, self.last})).to(dev)
            hidden, input_ids, have_rows = fb.hidden, fb.input_ids, rows
            where, fix = f"feature cache {self.cache.root}: rows {rows}", "remake the cache with `angelspec features`"
        else:
            item = self.stream.get(self._step)
            hidden = {i: item[f"hidden.{i}"].to(dev) for i in {*self.layer_ids, self.last}}
            input_ids, have_rows = item["input_ids"].to(dev), item["rows"].tolist()
            where = f"feature stream {self.source}: the batch of step {self._step}"
            fix = "start the feature server with the trainer's --target and --data"
            self._step += 1
        if have_rows != rows or not torch.equal(input_ids, batch.input_ids):
            raise FeatureCacheError(f"{where} holds other rows or tokens than this run's packed rows {rows}; {fix}")
        if sp.enabled:
            hidden = {i: sp.shard(h) for i, h in hidden.items()}
        return [hidden[i] for i in self.layer_ids], t.norm(hidden[self.last])


def open_stream(spec: str) -> FeatureStream | None:
    """The feature stream a `features=` value names (`stream:DIR`: `train.stream.FileFeatureStream`; `ray:NAME`:
    `train.stream_ray.RayFeatureStream`), None for anything else (an offline cache)."""
    if spec.startswith("stream:"):
        return FileFeatureStream(spec.removeprefix("stream:"))
    if spec.startswith("ray:"):
        from angelspec.train.stream_ray import RayFeatureStream

        return RayFeatureStream(spec.removeprefix("ray:"))
    return None


def features_command(target_dir: Path, data: Path, out: str | Path, layer_ids: list[int], seq_len: int,
                     enable_thinking: bool) -> str:
    """The `angelspec features` command line that makes a cache for these settings."""
    layers = ",".join(str(i) for i in layer_ids)
    flags = (" --think" if enable_thinking else "") + (" --force" if Path(out).exists() else "")
    return (f"angelspec features --target {target_dir} --data {data} --out {out} --layers {layers} "
            f"--seq-len {seq_len}{flags}")


def target_identity(target: Decoder, target_dir: str | Path | None = None) -> dict[str, str]:
    """What a cache records of the target it was built from: its weights id (`target_weights_id`, the one every
    command shares; `target_dir` for a `parts="head"` load) and the dtype it ran in, which the features depend on."""
    from angelspec.decoding.loading import target_weights_id

    return {"target_weights": target_weights_id(target_dir or "", target),
            "target_dtype": dtype_name(target.embed_tokens.weight.dtype)}


def _other_target(manifest: dict[str, Any], target: Decoder, target_dir: str | Path | None) -> str | None:
    """None when the cache of `manifest` was built from `target`; else what differs, for "was built from target "."""
    if "target_weights" not in manifest:  # built before the weights id was recorded: its load-dtype fingerprint
        recorded = manifest.get("target_fingerprint")
        have = model_fingerprint(target) if target_dir is None else target_fingerprint(target, target_dir)
        return None if recorded == have else (f"{recorded}, but this target is {have}: the features belong to "
                                              "another model (or dtype)")
    have = target_identity(target, target_dir)
    if manifest["target_weights"] != have["target_weights"]:
        return (f"weights {manifest['target_weights']}, but this target's weights are {have['target_weights']}: the "
                "features belong to another model")
    if manifest.get("target_dtype", have["target_dtype"]) != have["target_dtype"]:
        return (f"in {manifest['target_dtype']}, but this run loads the target in {have['target_dtype']}, which "
                f"gives other features (train with --dtype {manifest['target_dtype']})")
    return None


def target_fingerprint(target: Decoder, target_dir: str | Path) -> str:
    """`model_fingerprint` of the target at its load dtype, also for one loaded with `parts="head"`: its layers,
    never loaded, are read from the checkpoint in `target_dir` one tensor at a time (`iter_state_dict`), so the id
    is the whole model's: what caches recorded before `target_identity`."""
    if all(t.device.type != "meta" for t in target.state_dict().values()):
        return model_fingerprint(target)
    return tensors_fingerprint(target.config, iter_state_dict(target, target_dir))


def target_features(target: Decoder, layer_ids: list[int], cache_dir: str | None, rows: PackedRows, *,
                    target_dir: Path, data: Path, enable_thinking: bool, sp: SequenceParallel = NO_SP,
                    halo: int = 0, halo_what: str = "") -> TargetFeatures:
    """The features of a training run: online when `cache_dir` is None, a feature stream when it is `stream:DIR`
    or `ray:NAME` (`open_stream`; its servers check the target and data against the run's plan),
    else the cache at `cache_dir` after checking that it was made from this target (fingerprint), this packed
    dataset (rows, seq_len, tokens) and holds `layer_ids` plus the last layer; FeatureCacheError (with the
    command that makes a matching cache) otherwise. Sequence parallelism: this rank's shard and the teacher's `halo`
    after it (`halo_what` says why that many, for the error when a shard is shorter); online, the target's query
    heads must divide over the SP ranks (UsageError otherwise)."""
    if sp.enabled:
        sp.check_halo(rows.packed.seq_len, halo, halo_what)
    if cache_dir is None:
        if any(p.device.type == "meta" for p in target.parameters()):
            raise ValueError("online features run the whole target; load it with parts='all'")
        if sp.enabled:
            sp.check_heads(target.config.num_attention_heads, "target")
        return TargetFeatures(target, layer_ids, sp=sp, halo=halo)
    need = sorted({*layer_ids, target.config.num_hidden_layers - 1})
    stream = open_stream(cache_dir)
    if stream is not None:
        plan = {"target_fingerprint": stream_target_id(target, target_dir), "layer_ids": tuple(need),
                "dataset": dataset_identity(rows.packed, source=str(data)), "enable_thinking": enable_thinking,
                "seed": rows.seed}
        return TargetFeatures(target, layer_ids, stream=stream, plan=plan, sp=sp, halo=halo)
    try:
        cache = OfflineFeatureCache.open(cache_dir, target=target, target_dir=target_dir)
        cache.require(need, dataset_identity(rows.packed))
    except FeatureCacheError as e:
        fix = features_command(target_dir, data, cache_dir, need, rows.packed.seq_len, enable_thinking)
        raise FeatureCacheError(f"features={cache_dir}: {e}. Make a matching cache with: {fix}") from None
    return TargetFeatures(target, layer_ids, cache, sp=sp, halo=halo)


def build_feature_cache(target_dir: str | Path, data: str | Path, out: str | Path, *,
                        layers: list[int] | tuple[int, ...] = (), seq_len: int = 512, enable_thinking: bool = False,
                        rows_per_shard: int = 32, resume: bool = False, force: bool = False,
                        log: Any = print, placement: Placement | None = None) -> OfflineFeatureCache:
    """`angelspec features`: the offline feature cache that `features=DIR` trains from.

    Tokenises and packs `data` exactly as the trainers do (`pack_conversations`: `PackedRows` with
    `seq_len` / `enable_thinking`), runs the target over every packed row (one row per forward, the row
    being the unit a trainer reads) and stores the hidden states of `layers` plus the last layer (its tap
    gives the teacher logits) in the target's dtype (bfloat16 for a bf16 target: half the disk of fp32).
    Resumable (`resume=True`) after a kill. `placement`: the target's device and dtype (None: the default of
    `angelspec.models.device.resolve_placement`); a trainer reads the cache with its target in the same dtype."""
    from angelspec.data.tokenizer import load_tokenizer

    target_dir, data, out = Path(target_dir), Path(data), Path(out)
    refuse_same_file(out, ("--data", data), ("--target", target_dir))
    check_writable_path(out / MANIFEST, "--out")
    where = placement_of(placement)
    where.use_attention()
    target = load_target(target_dir, dtype=where.dtype, device=where.device)
    rows, _ = pack_conversations(load_tokenizer(target_dir), data, seq_len, enable_thinking,
                                 pad_token_id(target.config), seed=0)
    ids = tuple(sorted({*layers, target.config.num_hidden_layers - 1}))
    spec = FeatureSpec(ids, with_logits=False, dtype=dtype_name(target.embed_tokens.weight.dtype))
    log(packing_report(rows.packed).format())
    log(f"caching layers {list(ids)} of {rows.packed.num_rows} rows to {out}")
    batches = (rows.take([r]) for r in range(rows.packed.num_rows))
    return OfflineFeatureCache.build(target, spec, batches, out, rows_per_shard=rows_per_shard, resume=resume,
                                     force=force, log=log,
                                     dataset=dataset_identity(rows.packed, source=str(data)))
