"""The training commands as library calls: `train_drafter` (`angelspec train`, its settings one `TrainSettings`),
`build_target_model` (`angelspec target build`), `cache_features` (`angelspec features`) and `serve_features`
(`angelspec feature-server`), plus the preset handling they share (`preset_config`: a named preset with
`key=value` overrides) and the summaries they print.

Each checks its settings before any data or weights are read. A bad field of `TrainSettings` raises a
`SettingError` that names the field (the command line shows its flag); the other messages name the command-line
flags, since that is where the values usually come from.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from angelspec.assets import DEFAULT_TARGET, resolve_target_dir
from angelspec.decoding.generate import preview_lines
from angelspec.errors import SettingError, UsageError, require_positive, require_range
from angelspec.fileio import available_memory_bytes
from angelspec.train.config import Parallelism
from angelspec.train.registry import BLOCK_DRAFTERS, SP_DRAFTERS, TRAINABLE_DRAFTERS, get_trainer
from angelspec.train.safety import check_not_input

if TYPE_CHECKING:
    from angelspec.models.device import Placement

MAX_SAMPLE_LINES = 12  # per sample printed; the full text is in build_info.json


def preset_config(presets: dict[str, Callable[[], Any]], preset: str | None, default: str,
                  overrides: Sequence[str] = (), max_minutes: float | None = None) -> Any:
    """The named preset (or `default`) with `key=value` overrides applied; also checks `max_minutes`."""
    from angelspec.train.overrides import parse_overrides, with_overrides
    from angelspec.train.safety import check_bounds, check_minutes

    name = preset or default
    if name not in presets:
        raise UsageError(f"unknown preset {name!r}; choose one of {', '.join(sorted(presets))}")
    check_minutes(max_minutes)
    try:
        parsed = parse_overrides(overrides)
        config = with_overrides(presets[name](), parsed)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if "target_layer_ids" in parsed and getattr(config, "taps_for_depth", None) is not None:
        from dataclasses import replace

        config = replace(config, taps_for_depth=None)  # taps named for this run are used as given
    check_bounds(config)
    return config


def check_seq_len(seq_len: int | None, target_dir: Path, flag: str = "seq_len=") -> None:
    """Refuse, before any data or weights are read, a training row longer than the target's context."""
    if seq_len is None:
        return
    from angelspec.models.hf_io import read_config

    context = read_config(target_dir).max_position_embeddings
    if seq_len > context:
        raise UsageError(f"{flag}{seq_len} is longer than the target's context ({context} tokens, "
                         f"max_position_embeddings in {target_dir}/config.json); pass {flag}{context} or less")


def fit_seq_len(config: Any, target_dir: Path, overrides: Sequence[str] = (),
                log: Callable[[str], None] = print) -> Any:
    """A preset's packed-row length cut to the target's context when it is longer (a small target with a short
    context), said through `log`; a `seq_len=` the run names itself is left to `check_seq_len`, which refuses it."""
    seq_len = getattr(config, "seq_len", None)
    if not seq_len or any(o.partition("=")[0].strip() == "seq_len" for o in overrides):
        return config
    from dataclasses import replace

    from angelspec.models.hf_io import read_config

    context = read_config(target_dir).max_position_embeddings
    if seq_len <= context:
        return config
    log(f"seq_len {context}: the preset's {seq_len}-token rows cut to the target's context")
    return replace(config, seq_len=context)


def step_memory_floor(batch_size: int, seq_len: int, vocab_size: int, hidden_size: int, num_layers: int) -> int:
    """Bytes one drafter-training step cannot do without on the host, whatever the drafter: the target's fp32
    logits over the batch (the teacher distribution, [B, T, V]) and its per-layer hidden states ([L, B, T, C]).
    A floor, not an estimate: the drafter's own activations and the loss come on top."""
    tokens = batch_size * seq_len
    return 4 * tokens * (vocab_size + num_layers * hidden_size)


def check_memory(config: Any, target_dir: Path, available: int | None = None,
                 placement: Placement | None = None) -> None:
    """Refuse, before any data or weights are read, a run whose step cannot fit in the memory this machine has
    (`step_memory_floor` above 90% of MemAvailable), instead of being OOM-killed minutes later without a word.
    Skipped where the memory cannot be read or the run trains on a GPU (`placement`, None: the default one)."""
    from angelspec.models.device import placement_of
    from angelspec.models.hf_io import read_config

    seq_len, batch = getattr(config, "seq_len", None), getattr(config, "batch_size", None)
    if not seq_len or not batch or placement_of(placement).device.type != "cpu":
        return
    available = available_memory_bytes() if available is None else available
    if available is None:
        return
    target = read_config(target_dir)
    need = step_memory_floor(batch, seq_len, target.vocab_size, target.hidden_size, target.num_hidden_layers)
    if need > 0.9 * available:
        gib = 1 << 30
        raise UsageError(f"batch_size={batch} x seq_len={seq_len} needs at least {need / gib:.1f} GiB per step (the "
                         f"target's fp32 logits over {target.vocab_size} tokens and its hidden states for "
                         f"{batch * seq_len} tokens), but this machine has {available / gib:.1f} GiB available; lower "
                         "batch_size or seq_len")


def check_shard_memory(rows_per_shard: int, seq_len: int, layers: int, hidden_size: int, vocab_size: int,
                       available: int | None = None) -> None:
    """Refuse, before the target is loaded, a feature cache whose shard cannot be held in memory before it is
    written: `rows_per_shard` rows of `seq_len` tokens times `layers` fp32 hidden states, plus one row's fp32
    logits; above 90% of MemAvailable (skipped where that cannot be read)."""
    available = available_memory_bytes() if available is None else available
    if available is None:
        return
    need = 4 * seq_len * (rows_per_shard * layers * hidden_size + vocab_size)
    if need > 0.9 * available:
        gib = 1 << 30
        raise UsageError(f"--rows-per-shard {rows_per_shard} x --seq-len {seq_len} needs at least {need / gib:.1f} GiB "
                         f"to hold a shard ({layers} layers of {hidden_size} values per token), but this machine has "
                         f"{available / gib:.1f} GiB available; lower --rows-per-shard or --seq-len")


def chosen_preset(kind: str, target_dir: Path, log: Callable[[str], None] = print) -> str:
    """The preset for `kind` when none is named, from the size of the target in `target_dir`
    (`train.registry.preset_for_target`); says which and why through `log`."""
    from angelspec.models.hf_io import read_config
    from angelspec.train.registry import REAL_SIZE_PARAMETERS, preset_for_target

    n = read_config(target_dir).num_parameters()
    name = preset_for_target(kind, n)
    size = "real-size (GPU)" if n >= REAL_SIZE_PARAMETERS else "small (CPU)"
    log(f"preset {name}: chosen for a {size} target of {n / 1e6:,.1f}M parameters (--preset NAME picks another)")
    return name


def with_mask_token(config: Any, target_dir: Path, log: Callable[[str], None] = print) -> Any:
    """A block-drafter run's config with its mask token settled before any data or weights are read:
    `mask_token_id=N` or the tokenizer's own mask token as they are; without either, the first free id
    (`train.block.mask_token_candidates`: a reserved special token such as Llama 3's
    <|reserved_special_token_0|>, else the first embedding row beyond the tokenizer, Qwen3's 151669), said through
    `log`. A target with no such id, or an id outside its vocabulary, is refused in one line."""
    from dataclasses import replace

    from angelspec.data.tokenizer import TokenizerError, load_tokenizer
    from angelspec.models.config import ConfigError
    from angelspec.models.hf_io import read_config
    from angelspec.train.block import mask_token_candidates, resolve_mask_token

    try:
        tokenizer = load_tokenizer(target_dir)
    except TokenizerError as e:
        raise UsageError(f"cannot load the target's tokenizer: {e}") from None
    vocab_size = read_config(target_dir).vocab_size
    override = getattr(config, "mask_token_id", None)
    if override is None and getattr(tokenizer, "mask_token_id", None) is None:
        candidates = mask_token_candidates(tokenizer, vocab_size, limit=1)
        if candidates:
            (token_id, what), = candidates
            log(f"mask token: id {token_id} ({what}); the tokenizer declares none (mask_token_id=N picks another)")
            return replace(config, mask_token_id=token_id)
    try:
        resolve_mask_token(tokenizer, override, vocab_size)
    except ConfigError as e:
        raise UsageError(str(e)) from None
    return config


@dataclass
class TrainResult:
    """What `train_drafter` wrote: the trainer's report, the folder and the steps the run planned."""

    report: dict[str, Any]
    out: Path
    planned_steps: int

    def format(self) -> str:
        """Human-readable summary, with how to use or continue the drafter."""
        report, out = self.report, self.out
        steps = report.get("steps", 0)
        lines = [f"{report.get('drafter', 'drafter')} written to {out}: {report.get('parameters', 0) / 1e6:.2f}M "
                 f"parameters, {steps} steps, {report.get('train_seconds', 0) / 60:.1f} min"]
        if steps < self.planned_steps:
            lines.append(f"stopped at step {steps} of {self.planned_steps}; continue with the same command and "
                         "--resume")
        losses = report.get("heldout_loss", {})
        if losses:
            lines.append("held-out loss per domain (nats/token): "
                         + ", ".join(f"{d} {loss:.3f}" for d, loss in losses.items()))
        lines.append(f"use it: angelspec eval --drafter {out}   (or angelspec generate --drafter {out} ...)")
        return "\n".join(lines)


@dataclass(frozen=True)
class TrainSettings:
    """How `train_drafter` trains, one value the command line builds from its flags.

    preset: the trainer's preset (None: chosen from the target's size; `confidence_only` with `only`); overrides:
    `key=value` preset fields; head: a block drafter's sequential head (the same as the override head=NAME);
    init_from / only: a block drafter folder to start from (the override init_from=DIR; `train.block`): its part
    `only` ("confidence") alone is trained, everything else frozen; without `only`, all of it trains on from its
    weights (a warm start, on the preset's schedule). resume / force: continue the run in the output folder / start
    over; max_minutes: stop at a checkpoint when the time runs out; progress: progress bars. parallel: data and
    sequence parallelism (`train.config.Parallelism`; distributed None = auto). feature_workers: run the target in
    that many feature servers of its own, separate processes that stream the features to this trainer
    (`train.stream`; feature_backend "files" or "ray"), instead of inside the training step."""

    preset: str | None = None
    overrides: tuple[str, ...] = ()
    head: str | None = None
    init_from: str | Path | None = None
    only: str | None = None
    resume: bool = False
    force: bool = False
    max_minutes: float | None = None
    progress: bool = True
    parallel: Parallelism = field(default_factory=Parallelism)
    feature_workers: int | None = None
    feature_backend: str = "files"


def train_drafter(kind: str, data: str | Path, out: str | Path, settings: TrainSettings | None = None, *,
                  target: str | Path | None = None, log: Callable[[str], None] = print,
                  placement: Placement | None = None) -> TrainResult:
    """Train a drafter of `kind` (one of `TRAINABLE_DRAFTERS`) for the target on `data` (a conversations JSONL
    file or a corpus folder) and write a self-describing drafter folder to `out`, as `settings` say
    (`TrainSettings`; None: the defaults).

    Sequence parallelism (`settings.parallel.sp` > 1) splits every packed row over sp processes of a torchrun launch
    (Ulysses, `train.sequence_parallel`; MTP family and block drafters). placement: the target's device and dtype
    (None: `angelspec.models.device.resolve_placement()`, a GPU in bfloat16 where torch sees one); the drafter keeps
    fp32 master weights on that device and computes under autocast when the dtype is 16-bit; under torchrun on CUDA
    each rank takes GPU LOCAL_RANK.
    """
    settings = TrainSettings() if settings is None else settings
    sp = settings.parallel.sp
    require_positive("sp", sp)
    if sp > 1 and kind not in SP_DRAFTERS:
        raise SettingError(f"{{sp}} {sp}: sequence parallelism trains {', '.join(SP_DRAFTERS)}, not {kind}; "
                           "drop {sp}")
    if sp > 1 and settings.feature_workers is not None:
        raise SettingError(f"{{sp}} {sp} does not read a feature stream yet; drop {{feature_workers}} (the target "
                           "then runs in the step)")
    if settings.feature_workers is not None:
        return _train_with_feature_servers(kind, data, out, settings, target=target, log=log, placement=placement)
    if kind not in TRAINABLE_DRAFTERS:
        hint = ("; n-gram lookup needs no training: pass --drafter ngram to generate or eval"
                if kind.partition(":")[0] == "ngram" else "")
        raise UsageError(f"cannot train drafter {kind!r}: the drafters that can be trained today are "
                         f"{', '.join(TRAINABLE_DRAFTERS)}{hint}")
    overrides, preset = list(settings.overrides), settings.preset
    for name, value in (("head", settings.head), ("init_from", settings.init_from), ("only", settings.only)):
        if value is not None:
            if kind not in BLOCK_DRAFTERS:
                raise SettingError(f"{{{name}}} applies to the block drafters ({', '.join(BLOCK_DRAFTERS)}), not "
                                   f"{kind}")
            overrides.append(f"{name}={value}")
    if settings.only is not None and preset is None:
        preset = "confidence_only"  # a part alone: the fine-tuning schedule, not a from-scratch one
    train_fn, presets, default_preset = get_trainer(kind)
    target_dir = resolve_target_dir(target)
    if preset is None:
        preset = chosen_preset(kind, target_dir, log)
    config = preset_config(presets, preset, default_preset, overrides, settings.max_minutes)
    data = Path(data)
    if not data.exists():
        raise FileNotFoundError(f"--data {data} does not exist; expected a JSONL file of conversations or a corpus "
                                "folder with <domain>/train.jsonl files (e.g. .cache/target-build/corpus)")
    config = fit_seq_len(config, target_dir, overrides, log)
    check_seq_len(getattr(config, "seq_len", None), target_dir)
    check_memory(config, target_dir, placement=placement)
    if kind in BLOCK_DRAFTERS and getattr(config, "init_from", None) is None:
        config = with_mask_token(config, target_dir, log)
    from angelspec.train.data import check_conversations

    check_conversations(data)
    out = Path(out)
    check_not_input(out, ("--data", data), ("--target", target_dir),
                    ("--init-from", getattr(config, "init_from", None)),
                    ("features=", _cache_dir(getattr(config, "features", None))))
    report = train_fn(target_dir, data, out, config=config, resume=settings.resume, force=settings.force,
                      progress=settings.progress, max_minutes=settings.max_minutes, log=log,
                      parallel=settings.parallel, placement=placement)
    return TrainResult(report=report, out=out, planned_steps=config.steps)


def _cache_dir(features: str | None) -> str | None:
    """The folder of an offline feature cache (`features=DIR`); None for none or a stream."""
    return None if features is None or features.startswith(("stream:", "ray:")) else features


def _train_with_feature_servers(kind: str, data: str | Path, out: str | Path, settings: TrainSettings, *,
                                target: str | Path | None, log: Callable[[str], None],
                                placement: Placement | None) -> TrainResult:
    """`train_drafter` with `settings.feature_workers`: the run's feature servers
    (`train.stream.spawn_feature_servers`, started by the main process only) beside the trainer, which reads them
    through `features=`; the servers exit after the trainer has finished, and are stopped if it fails."""
    import os

    from angelspec.train.loop import check_out_dir
    from angelspec.train.stream import run_feature_stream, spawn_feature_servers, stop_feature_servers

    workers, backend = settings.feature_workers, settings.feature_backend
    assert workers is not None
    require_range("feature_workers", workers, 1, 256, " (one target each)")
    if backend not in ("files", "ray"):
        raise SettingError(f"{{feature_backend}} must be files or ray, got {backend!r}")
    if any(o.startswith("features=") for o in settings.overrides):
        raise SettingError("{feature_workers} starts the run's own feature servers; drop features=... (or drop "
                           "{feature_workers} to read features you serve yourself)")
    check_out_dir(out, resume=settings.resume, force=settings.force)  # before the servers start beside it
    target_dir = resolve_target_dir(target)
    procs = []
    if os.environ.get("RANK", "0") == "0":  # one set of servers per run, from the main process under torchrun
        address = None
        if backend == "ray":
            from angelspec.train.stream_ray import connect

            # The trainer joins RAY_ADDRESS, else starts a Ray cluster of its own, and hands the server its address.
            address = connect(os.environ.get("RAY_ADDRESS") or "local")
        spec, procs = spawn_feature_servers(out, target_dir, data, workers, backend=backend, address=address,
                                            placement=placement)
        log(f"feature servers: pid {', '.join(str(p.pid) for p in procs)} ({backend}), read with features={spec}")
    else:
        spec = run_feature_stream(out, backend)
    ok = False
    try:
        inline = replace(settings, overrides=(*settings.overrides, f"features={spec}"), feature_workers=None)
        result = train_drafter(kind, data, out, inline, target=target_dir, log=log, placement=placement)
        ok = True
    finally:
        stop_feature_servers(procs, timeout_s=60.0 if ok else 0.0)
    return result


@dataclass
class BuildResult:
    """What `build_target_model` wrote: `build_target`'s report and the exported folder."""

    report: dict[str, Any]
    out: Path

    def format(self) -> str:
        """Human-readable summary: size, held-out loss per domain, greedy samples."""
        report = self.report
        lines = [f"target written to {self.out}: {report.get('parameters', 0) / 1e6:.2f}M parameters, "
                 f"{report.get('steps', '?')} steps, {report.get('build_seconds', 0) / 60:.1f} min"]
        losses, ppl = report.get("heldout_loss", {}), report.get("heldout_ppl", {})
        if losses:
            lines.append("held-out loss per domain (nats/token, perplexity):")
            lines += [f"  {d:<6} {loss:.3f}  ({ppl.get(d, float('nan')):.1f})" for d, loss in losses.items()]
        for domain, sample in report.get("samples", {}).items():
            lines.append(f"[{domain}] {sample['prompt']}")
            lines += preview_lines(sample["greedy"], MAX_SAMPLE_LINES)
        return "\n".join(lines)


def build_target_model(*, out: str | Path | None = None, work_dir: str | Path = ".cache/target-build",
                       preset: str | None = None, overrides: Sequence[str] = (), resume: bool = False,
                       force: bool = False, progress: bool = True, max_minutes: float | None = None,
                       log: Callable[[str], None] = print) -> BuildResult:
    """Build the corpus and tokenizer, train the target of `preset` (default embedded_target) with `overrides`
    and export a HF folder to `out` (None: the embedded target's folder), working in `work_dir`."""
    from angelspec.train.target import PRESETS, build_target

    config = preset_config(PRESETS, preset, "embedded_target", overrides, max_minutes)
    out = Path(out) if out is not None else DEFAULT_TARGET
    report = build_target(out, work_dir=Path(work_dir), config=config, resume=resume, force=force, progress=progress,
                          max_minutes=max_minutes, log=log)
    return BuildResult(report=report, out=out)


def cache_features(data: str | Path, out: str | Path, *, target: str | Path | None = None,
                   layers: Sequence[int] | str = (), seq_len: int = 512, think: bool = False,
                   rows_per_shard: int = 32, resume: bool = False, force: bool = False,
                   log: Callable[[str], None] = print, placement: Placement | None = None) -> Any:
    """Store the target's hidden states of `layers` (ids, or their comma-separated text) plus the last layer on
    every packed row of `data`, for `angelspec train ... features=DIR`, computed on `placement`'s device in its dtype
    (the cache's dtype); returns the `OfflineFeatureCache`."""
    from angelspec.train.features import build_feature_cache

    require_positive("--seq-len", seq_len)
    require_positive("--rows-per-shard", rows_per_shard)
    if rows_per_shard > 1 << 16:
        raise UsageError(f"--rows-per-shard must be at most {1 << 16}, got {rows_per_shard}")
    ids = list(layers) if not isinstance(layers, str) else None
    if ids is None:
        try:
            ids = [int(x) for x in layers.split(",")] if layers else []
        except ValueError:
            ids = [-1]
    if any(i < 0 for i in ids):
        raise UsageError(f"--layers must be comma-separated layer ids >= 0 (id i = output of decoder layer i), "
                         f"e.g. 1,3,5; got {layers!r}")
    data = Path(data)
    if not data.exists():
        raise FileNotFoundError(f"--data {data} does not exist; expected the JSONL file or corpus folder you train on")
    target_dir = resolve_target_dir(target)
    from angelspec.models.config import check_tap_ids
    from angelspec.models.hf_io import read_config

    tcfg = read_config(target_dir)
    check_tap_ids(ids, tcfg.num_hidden_layers, "--layers:")  # the layers first, then the length
    check_seq_len(seq_len, target_dir, "--seq-len ")
    check_shard_memory(rows_per_shard, seq_len, len({*ids, tcfg.num_hidden_layers - 1}), tcfg.hidden_size,
                       tcfg.vocab_size)
    from angelspec.train.data import check_conversations

    check_conversations(data)
    return build_feature_cache(target_dir, data, Path(out), layers=ids, seq_len=seq_len,
                               enable_thinking=think, rows_per_shard=rows_per_shard, resume=resume, force=force,
                               log=log, placement=placement)


def serve_features(data: str | Path, *, stream: str | Path | None = None, ray: str | None = None,
                   target: str | Path | None = None, worker: int = 0, workers: int = 1, buffer: int = 4,
                   address: str | None = None, idle_timeout_s: float = 3600.0,
                   log: Callable[[str], None] = print, placement: Placement | None = None) -> int:
    """`angelspec feature-server`: run the target over the batches of the trainer that reads `features=stream:DIR`
    (`stream`, a folder both see; this process is producer `worker` of `workers`) or `features=ray:NAME` (`ray`,
    `workers` target actors on the Ray cluster at `address`), `buffer` batches ahead of it, until it finishes;
    returns the number of batches published (`train.stream`). `placement`: the target's device and dtype, which must
    be the trainer's dtype (the stream refuses a target of another fingerprint)."""
    if (stream is None) == (ray is None):
        raise UsageError("give the stream to serve: --stream DIR (files, read with features=stream:DIR) or --ray NAME "
                         "(a Ray cluster, read with features=ray:NAME)")
    require_positive("--workers", workers)
    require_positive("--buffer", buffer)
    data = Path(data)
    if not data.exists():
        raise FileNotFoundError(f"--data {data} does not exist; give the JSONL file or corpus folder the trainer "
                                "reads")
    target_dir = resolve_target_dir(target)
    from angelspec.train.data import check_conversations

    check_conversations(data)
    if stream is not None:
        from angelspec.train.stream import serve_files

        return serve_files(stream, target_dir, data, worker=worker, workers=workers, buffer=buffer,
                           idle_timeout_s=idle_timeout_s, log=log, placement=placement)
    from angelspec.train.stream_ray import serve_ray

    return serve_ray(str(ray), target_dir, data, workers=workers, buffer=buffer, address=address,
                     idle_timeout_s=idle_timeout_s, log=log, placement=placement)
