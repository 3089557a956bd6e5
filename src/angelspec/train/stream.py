"""A disaggregated feature pipeline (AngelSpec §6): target workers run the frozen target over a trainer's batches
and publish their hidden states; the trainer, a separate process or machine, consumes them as they appear.

Contract. A trainer attaches to a stream with its plan (:class:`StreamPlan`: the target's fingerprint, the taps
to publish, the packed dataset's identity, seq_len, thinking mode, seed, global batch size and data-parallel world
size), its start step and its last step. Item (s, r) of the stream is data-parallel rank r's share of global batch
s, the rows ``PackedRows.local_rows(s, batch_size, rank r of world)``. A worker (:class:`FeatureProducer`) packs
the same data, runs the target over exactly those rows as ONE batch, as the trainer's inline forward does, and
publishes the taps; the trainer recomputes the teacher logits from the last layer's tap
(``train.features.TargetFeatures``). Same rows, same batch, same ops: the features are bit-identical to inline
ones (tests/test_feature_stream.py trains both ways and compares every loss).

Flow control. Producers make item (s, r) only while ``s < cursor_r + buffer`` (and ``s < end_r``), cursor_r being
the first step rank r has not consumed yet: at most ``buffer`` batches per rank wait, and producers block when
they are all there (backpressure). A consumed batch is dropped at once, so storage holds at most
``buffer * world_size`` batches.

Resume, after a SIGKILL anywhere. The trainer's record of what it consumed is its checkpoint: batch s is step s,
and ``trainer_state.json`` holds the step. A restarted trainer attaches at that step; batches it consumed after
its last checkpoint are made again (an item is a pure function of (plan, s, r): the same rows give the same
bytes), batches waiting in the stream are reused. The producers' record of what they published is the stream
itself: an item appears atomically (a rename, or one call to the Ray broker), and a producer keeps no other
state, so a restarted one rescans what is published and makes only what is missing in the window: nothing is
lost, and no batch is published twice while it waits.

Backends, behind one consumer interface (:class:`FeatureStream`) and one producer (:class:`FeatureProducer`):

* files (default, no extra dependency): ``features=stream:DIR``, a folder every machine sees (``DIR/plan.json``
  from the trainer, one ``consumer-<rank>.json`` cursor per trainer rank, one ``item-<plan>-s<step>-r<rank>
  .safetensors`` per published batch, all written atomically). Producers: ``angelspec feature-server --stream
  DIR [--worker I --workers N]``; worker I of N makes the items (s, r) with ``(s * world + r) % N == I``.
* Ray (``pip install 'angelspec[ray]'``): ``features=ray:NAME``, ``train.stream_ray``: target workers are Ray
  actors, batches travel through Ray's object store, a broker actor holds the index, the cursors and the
  backpressure; no shared storage needed.

It lives in ``train/`` because it runs the target (``models``) on the trainers' packed rows (``train.data``).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Container, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import Tensor

from angelspec.errors import require_range
from angelspec.fileio import read_json_object, write_json_atomic
from angelspec.models.decoder import Decoder, TrainInputs
from angelspec.models.device import Placement, dtype_label, placement_of
from angelspec.models.hf_io import load_target, nonfinite_problem, save_safetensors_atomic
from angelspec.train.data import PackedRows, dataset_identity, pack_conversations, pad_token_id
from angelspec.train.distributed import DistInfo, barrier

STREAM_FORMAT = "angelspec-feature-stream/1"
PLAN_FILE = "plan.json"
ERROR_FILE = "error.json"  # a feature server that cannot serve the plan says why here; the waiting trainer raises it
DEFAULT_BUFFER = 4
_ITEM_RE = re.compile(r"\.?item-([0-9a-f]+)-s(\d+)-r(\d+)\.safetensors(\..*\.tmp)?")  # items and their temp files
_CONSUMER_RE = re.compile(r"consumer-(\d+)\.json")

Item = tuple[int, int]  # (step, rank)


class StreamError(ValueError):
    """A feature stream that cannot be served or read; the message names the problem and the fix."""


@dataclass(frozen=True)
class StreamPlan:
    """What a trainer reads, as it tells its feature producers (module docstring): the target, the taps, the
    packed rows and the order and split in which it reads them."""

    target_fingerprint: str
    layer_ids: tuple[int, ...]  # taps published: the drafter's and the last layer (teacher logits)
    dataset: dict[str, Any]  # `train.data.dataset_identity` of the packed rows (rows, seq_len, digest, source)
    enable_thinking: bool
    seed: int
    batch_size: int  # global rows per step
    world_size: int  # data-parallel ranks, one item per rank and step

    @property
    def seq_len(self) -> int:
        return int(self.dataset["seq_len"])

    @property
    def key(self) -> str:
        """12 hex digits that name the plan (its items carry it); the dataset's notes (source path) do not count."""
        obj = {**asdict(self), "dataset": {k: self.dataset.get(k) for k in ("rows", "seq_len", "digest")}}
        return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:12]

    def to_json(self) -> dict[str, Any]:
        return {"format": STREAM_FORMAT, "key": self.key, **asdict(self), "layer_ids": list(self.layer_ids)}

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> StreamPlan:
        if obj.get("format") != STREAM_FORMAT:
            raise StreamError(f"not a {STREAM_FORMAT} plan (format {obj.get('format')!r}); use the same AngelSpec "
                              "version on the trainer and the feature servers")
        return cls(obj["target_fingerprint"], tuple(obj["layer_ids"]), obj["dataset"], obj["enable_thinking"],
                   obj["seed"], obj["batch_size"], obj["world_size"])

    def rows(self, rows: PackedRows, step: int, rank: int) -> list[int]:
        """The packed-row indices of item (step, rank): rank's share of global batch `step`, as the trainer reads it."""
        return rows.local_rows(step, self.batch_size, DistInfo(rank=rank, world_size=self.world_size))

    def owner(self, item: Item, workers: int) -> int:
        """Which of `workers` producers makes `item` (round robin over the items in step, rank order)."""
        step, rank = item
        return (step * self.world_size + rank) % workers


@dataclass(frozen=True)
class Cursor:
    """Where one trainer rank is: `step` = the first step it has not consumed, `end` = its last step (exclusive;
    None = open-ended), `finished` once its run has ended (a resumed run attaches again)."""

    step: int
    end: int | None = None
    finished: bool = False


def wanted_items(cursors: dict[int, Cursor], world_size: int, buffer: int, published: Container[Item]) -> list[Item]:
    """The items producers should make now, oldest first: for every attached rank r that is not finished, the
    steps cursor_r.step .. min(cursor_r.step + buffer, cursor_r.end) - 1 not yet `published`. An empty list means
    the window is full (backpressure) or nobody is waiting."""
    out = []
    for r in range(world_size):
        c = cursors.get(r)
        if c is None or c.finished:
            continue
        hi = c.step + buffer if c.end is None else min(c.step + buffer, c.end)
        out += [(s, r) for s in range(c.step, hi) if (s, r) not in published]
    return sorted(out)


def all_finished(cursors: dict[int, Cursor], world_size: int) -> bool:
    """Every rank of the plan has attached and ended its run."""
    return all(r in cursors and cursors[r].finished for r in range(world_size))


# ----- the producer: the frozen target over a plan's items (both backends) -----


def stream_target_id(target: Decoder, target_dir: str | Path) -> str:
    """What a stream's plan names as its target (`StreamPlan.target_fingerprint`): the weights id every command
    records (`decoding.loading.target_weights_id`) and the load dtype, which changes the features served."""
    from angelspec.decoding.loading import target_weights_id

    return f"{target_weights_id(target_dir, target)}/{dtype_label(target.embed_tokens.weight.dtype)}"


class FeatureProducer:
    """A target worker: the frozen target and the packed rows of `plan`, made from `target_dir` and `data` the way
    the trainer made them; `item(step, rank)` -> the tensors published for item (step, rank).

    Refuses (StreamError) a target other than the plan's (fingerprint, which covers the dtype: serve in the
    trainer's --dtype) and data that packs other rows. `placement`: the device and dtype the target runs in (None:
    the default of `angelspec.models.device.resolve_placement`)."""

    def __init__(self, target_dir: str | Path, data: str | Path, plan: StreamPlan,
                 placement: Placement | None = None) -> None:
        from angelspec.data.tokenizer import load_tokenizer

        self.plan = plan
        where = placement_of(placement)
        where.use_attention()
        self.target = load_target(target_dir, dtype=where.dtype, device=where.device)
        for p in self.target.parameters():
            p.requires_grad_(False)
        fp = stream_target_id(self.target, target_dir)
        if fp != plan.target_fingerprint:
            raise StreamError(f"the feature server's target {target_dir} (fingerprint {fp}) is not the trainer's "
                              f"({plan.target_fingerprint}); start the server with the trainer's --target")
        L = self.target.config.num_hidden_layers
        if any(not 0 <= i < L for i in plan.layer_ids):
            raise StreamError(f"the trainer asks for layers {list(plan.layer_ids)}, but the target has {L} layers")
        self.rows, _ = pack_conversations(load_tokenizer(target_dir), Path(data), plan.seq_len, plan.enable_thinking,
                                          pad_token_id(self.target.config), plan.seed)
        have = dataset_identity(self.rows.packed)
        want = plan.dataset
        if (have["rows"], have["digest"]) != (want["rows"], want["digest"]):
            raise StreamError(f"the feature server's --data {data} packs {have['rows']} rows (digest "
                              f"{have['digest']}), the trainer's {want.get('source', 'data')} {want['rows']} rows "
                              f"(digest {want['digest']}); start the server with the trainer's --data")

    @torch.no_grad()
    def item(self, step: int, rank: int) -> dict[str, Tensor]:
        """Rows of item (step, rank) as one batch through the target: {"rows": [B], "input_ids": [B, T],
        "hidden.{i}": [B, T, D] per published layer}, on the CPU."""
        idx = self.plan.rows(self.rows, step, rank)
        b = self.rows.take(idx)
        d = b.to(self.target.embed_tokens.weight.device)
        out = self.target(d.input_ids, TrainInputs(positions=d.positions, document_ids=d.document_ids,
                                                   hidden_layers=self.plan.layer_ids, compute_logits=False))
        tensors = {"rows": torch.tensor(idx, dtype=torch.int64), "input_ids": b.input_ids}
        tensors.update({f"hidden.{i}": h.cpu() for i, h in zip(self.plan.layer_ids, out.hidden, strict=True)})
        return tensors


# ----- the consumer interface -----


class FeatureStream(Protocol):
    """One trainer rank's end of a stream (`train.features.TargetFeatures` drives it)."""

    source: str  # what the report names: "stream:DIR" or "ray:NAME"

    def attach(self, plan: StreamPlan, rank: int, step: int, end: int | None, log: Callable[[str], None]) -> None:
        """Tell the producers what to make: `plan`, and that `rank` reads from `step` (its checkpoint) to `end`."""

    def get(self, step: int) -> dict[str, Tensor]:
        """Item (step, rank), waiting until it is published; it counts as consumed once returned."""

    def finish(self, step: int) -> None:
        """The run ended at `step` (producers stop once every rank has finished)."""


# ----- the file backend -----


def item_name(key: str, step: int, rank: int) -> str:
    return f"item-{key}-s{step:08d}-r{rank:03d}.safetensors"


def _read_plan(root: Path) -> StreamPlan | None:
    obj = read_json_object(root / PLAN_FILE)
    return None if obj is None else StreamPlan.from_json(obj)


def _read_cursors(root: Path, key: str) -> dict[int, Cursor]:
    """The cursors of the ranks attached to plan `key` (a cursor file of another plan is stale)."""
    out = {}
    for p in root.glob("consumer-*.json"):
        m = _CONSUMER_RE.fullmatch(p.name)
        obj = read_json_object(p) if m else None
        if obj is not None and obj.get("plan") == key:
            out[int(m.group(1))] = Cursor(obj["step"], obj.get("end"), bool(obj.get("finished")))
    return out


def _listing(root: Path) -> list[tuple[Path, str, int, int, bool]]:
    """Every item file and item temp file in `root`: (path, plan key, step, rank, is a temp file)."""
    out = []
    for p in root.iterdir() if root.is_dir() else ():
        m = _ITEM_RE.fullmatch(p.name)
        if m:
            out.append((p, m.group(1), int(m.group(2)), int(m.group(3)), m.group(4) is not None))
    return out


def _drop(paths: Iterable[Path]) -> None:
    for p in paths:
        p.unlink(missing_ok=True)


class FileFeatureStream:
    """The consumer end of a file stream in `root` (module docstring); `poll_s` is how often it looks for an item."""

    def __init__(self, root: str | Path, poll_s: float = 0.02) -> None:
        self.root, self.poll_s = Path(root), poll_s
        self.source = f"stream:{root}"
        self.plan: StreamPlan | None = None
        self.rank, self.end = 0, None
        self.log: Callable[[str], None] = print

    def _cursor(self, step: int, finished: bool = False) -> None:
        assert self.plan is not None
        write_json_atomic(self.root / f"consumer-{self.rank}.json",
                          {"plan": self.plan.key, "step": step, "end": self.end, "finished": finished})

    def attach(self, plan: StreamPlan, rank: int, step: int, end: int | None, log: Callable[[str], None]) -> None:
        self.plan, self.rank, self.end, self.log = plan, rank, end, log
        if rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            old = _read_plan(self.root) if (self.root / PLAN_FILE).is_file() else None
            if old is None or old.key != plan.key:  # a new plan: items and cursors of the old one are stale
                _drop(p for p, key, *_ in _listing(self.root) if key != plan.key)
                _drop(p for p in self.root.glob("consumer-*.json"))
                write_json_atomic(self.root / PLAN_FILE, plan.to_json())
            _drop([self.root / ERROR_FILE])  # a new attempt: a server that still cannot serve says so again
        barrier()  # every rank attaches after rank 0 has written the plan
        # Batches before `step` are no longer wanted (consumed, or left by a kill between consuming and dropping).
        _drop(p for p, key, s, r, _ in _listing(self.root) if key == plan.key and r == rank and s < step)
        self._cursor(step)

    def get(self, step: int) -> dict[str, Tensor]:
        assert self.plan is not None, "attach() first"
        path = self.root / item_name(self.plan.key, step, self.rank)
        t0 = last_note = time.monotonic()
        polls = 0
        while not path.is_file():
            polls += 1
            if polls % 25 == 0 and (err := read_json_object(self.root / ERROR_FILE)) is not None \
                    and err.get("plan") == self.plan.key:
                raise StreamError(f"the feature server of {self.root} failed: {err.get('error')}")
            if time.monotonic() - last_note > 60:
                last_note = time.monotonic()
                self.log(f"waiting {last_note - t0:.0f} s for the features of step {step} in {self.root}: is a "
                         f"feature server running (angelspec feature-server --stream {self.root} ...)?")
            time.sleep(self.poll_s)
        try:
            tensors = load_file(str(path))
        except (SafetensorError, OSError) as e:  # never for an atomic write; name the file if it happens
            raise StreamError(f"feature batch {path} is unreadable ({e}); delete it and a feature server remakes "
                              "it") from None
        for name, t in tensors.items():
            if (problem := nonfinite_problem(name, t)) is not None:
                raise StreamError(f"feature batch {path}: {problem}; the target's features are not finite (are "
                                  "its weights damaged?): delete the file and a feature server remakes it")
        # The cursor moves before the file goes, so a producer that finds the file missing also sees the new cursor
        # and does not make it again; a kill between the two leaves a file that the next attach drops.
        self._cursor(step + 1)
        path.unlink(missing_ok=True)
        return tensors

    def finish(self, step: int) -> None:
        self._cursor(step, finished=True)


MAX_WORKERS = 4096  # feature servers sharing one stream
MAX_BUFFER = 1024  # batches a server makes ahead of a trainer rank


def serve_files(root: str | Path, target_dir: str | Path, data: str | Path, *, worker: int = 0, workers: int = 1,
                buffer: int = DEFAULT_BUFFER, poll_s: float = 0.05, idle_timeout_s: float = 3600.0,
                log: Callable[[str], None] = print, placement: Placement | None = None) -> int:
    """`angelspec feature-server --stream DIR`: producer `worker` of `workers` for the file stream in `root`.

    Waits for a trainer's plan, then keeps the window of every attached rank full with the items it owns
    (`StreamPlan.owner`), blocking while the window is full; follows a new plan; returns the number of batches it
    published once every rank has finished (or after `idle_timeout_s` without a plan or a consumed batch).
    `placement`: the target's device and dtype (`FeatureProducer`)."""
    if not 0 <= worker < workers:
        raise StreamError(f"--worker must be in 0..{workers - 1} (of --workers {workers}), got {worker}")
    require_range("--workers", workers, 1, MAX_WORKERS)
    require_range("--buffer", buffer, 1, MAX_BUFFER, " (batches made ahead of each trainer rank)")
    require_range("--idle-timeout", idle_timeout_s, 0.01, 10**9, " (seconds)")
    root = Path(root)
    producer: FeatureProducer | None = None
    published, last_change, seen = 0, time.monotonic(), None
    while True:
        plan = _read_plan(root) if (root / PLAN_FILE).is_file() else None
        if plan is not None and (producer is None or producer.plan.key != plan.key):
            log(f"serving plan {plan.key} in {root}: {plan.dataset['rows']} packed rows, batch {plan.batch_size}, "
                f"{plan.world_size} rank(s), layers {list(plan.layer_ids)}; worker {worker} of {workers}, "
                f"buffer {buffer}")
            try:
                producer = FeatureProducer(target_dir, data, plan, placement)
            except StreamError as e:
                write_json_atomic(root / ERROR_FILE, {"plan": plan.key, "error": str(e)})
                raise
        todo: list[Item] = []
        if plan is not None:
            # The items first, the cursors second: a batch consumed in between is then already behind its rank's
            # cursor and is not made again (FileFeatureStream.get moves the cursor before dropping the file).
            listing = _listing(root)
            cursors = _read_cursors(root, plan.key)
            if all_finished(cursors, plan.world_size):
                log(f"every trainer rank has finished; published {published} batches")
                return published
            # Behind a cursor or of another plan: consumed, or left by a kill (a temp file, a batch made twice).
            _drop(p for p, key, s, r, _ in listing if key != plan.key or (r in cursors and s < cursors[r].step))
            ours = {(s, r) for _, key, s, r, tmp in listing if key == plan.key and not tmp}
            todo = [it for it in wanted_items(cursors, plan.world_size, buffer, ours)
                    if plan.owner(it, workers) == worker]
            if (plan.key, cursors) != seen:
                seen, last_change = (plan.key, cursors), time.monotonic()
        if not todo:
            if time.monotonic() - last_change > idle_timeout_s:
                log(f"no trainer progress in {root} for {idle_timeout_s:.0f} s; stopping after {published} batches")
                return published
            time.sleep(poll_s)
            continue
        assert plan is not None and producer is not None
        step, rank = todo[0]
        tensors = producer.item(step, rank)
        cursor = _read_cursors(root, plan.key).get(rank)
        if cursor is None or step < cursor.step:
            continue  # the trainer moved on (a restart at a later step, or a new plan) while this batch was made
        try:
            save_safetensors_atomic(tensors, root / item_name(plan.key, step, rank), {"format": STREAM_FORMAT})
        except FileNotFoundError:  # the stream folder was reset under us (a new plan): look again
            continue
        published += 1


# ----- one command: the trainer with its feature servers as separate processes -----


def run_feature_stream(out_dir: str | Path, backend: str) -> str:
    """The `features=` value of a training run's own feature servers (`train --feature-workers N`), fixed by the
    output folder so that a resumed run finds them again: `stream:OUT/training/feature-stream` or
    `ray:run-<hash of OUT>`."""
    if backend == "files":
        return f"stream:{Path(out_dir) / 'training' / 'feature-stream'}"
    if backend == "ray":
        return "ray:run-" + hashlib.sha256(str(Path(out_dir).resolve()).encode()).hexdigest()[:12]
    raise StreamError(f"unknown feature backend {backend!r}; choose files or ray")


def spawn_feature_servers(out_dir: str | Path, target_dir: str | Path | None, data: str | Path, workers: int, *,
                          backend: str = "files", buffer: int = DEFAULT_BUFFER, address: str | None = None,
                          placement: Placement | None = None) -> tuple[str, list[subprocess.Popen]]:
    """Start the feature servers of the training run in `out_dir` as processes of their own (`angelspec train
    --feature-workers N`) and return the `features=` value the trainer reads them with, and the processes.

    files: `workers` processes `angelspec feature-server --stream OUT/training/feature-stream --worker I --workers N`;
    ray: one `angelspec feature-server --ray NAME --workers N` driving N target actors on the Ray cluster at
    `address` (`train.stream_ray.connect`).
    Their output goes beside the run folder (`OUT.feature-server[-I].log`, which `--force` leaves alone); each exits
    once the trainer has finished (`stop_feature_servers` waits for them). `placement`: the trainer's device and
    dtype, passed on as --device and --dtype (None: the servers' own defaults)."""
    out_dir = Path(out_dir)
    spec = run_feature_stream(out_dir, backend)
    base = [sys.executable, "-m", "angelspec.cli", "feature-server", "--data", str(data), "--buffer", str(buffer)]
    if placement is not None:
        base += ["--device", str(placement.device), "--dtype", dtype_label(placement.dtype),
                 "--attention", placement.attention]
    if target_dir is not None:
        base += ["--target", str(target_dir)]
    if backend == "files":
        root = spec.removeprefix("stream:")
        cmds = [[*base, "--stream", root, "--worker", str(i), "--workers", str(workers)] for i in range(workers)]
    else:
        cmds = [[*base, "--ray", spec.removeprefix("ray:"), "--workers", str(workers),
                 *(["--address", address] if address else [])]]
    procs = []
    for i, cmd in enumerate(cmds):
        log = out_dir.with_name(f"{out_dir.name}.feature-server{f'-{i}' if len(cmds) > 1 else ''}.log")
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as f:
            procs.append(subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}))
    return spec, procs


def stop_feature_servers(procs: list[subprocess.Popen], timeout_s: float = 60.0) -> list[int | None]:
    """Wait up to `timeout_s` for the servers to exit (they do once the trainer has finished), then stop the rest
    (SIGTERM, then SIGKILL); -> their exit codes."""
    deadline = time.monotonic() + timeout_s
    for p in procs:
        try:
            p.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    return [p.returncode for p in procs]
