"""Evaluation during training (AngelSpec report §6, the evaluation server).

A process beside the trainer watches a run folder. Each time the trainer writes a new checkpoint, the server
copies it aside (the trainer replaces its checkpoint folder atomically, so a copy is either the old or the new
one, and is checked against the step it announced), loads it as a drafter and decodes held-out prompts with the
real engine, AR and speculative side by side in one process. It appends one JSON line per (checkpoint,
temperature) to `<run>/training/eval_log.jsonl`:

    {"step", "tokens", "temperature", "mal", "acceptance" (p_1..p_K), "speedup", "speedup_cpu", "lossless",
     "domains": {...}, "num_draft_tokens", "prompts", "max_new_tokens", "seconds", "time"}

("speedup" is tokens per wall-second over AR's, "speedup_cpu" per CPU-second of the server: beside a busy
trainer the second is the one to read; null for a GPU run, whose host CPU time measures waiting, not decoding.)

and, when `torch.utils.tensorboard` imports (the optional `tensorboard` package), the same scalars to
`<run>/training/tensorboard/`. The log is keyed by step: a server restarted after a kill, or a trainer that
was killed and resumed, never evaluates a step twice, so the log stays one consistent curve. The server
evaluates the newest checkpoint it finds; one that the trainer replaces while the server is still busy with
the previous one is skipped (checkpoint as often as the evaluation takes, or more rarely), and the final
checkpoint of a run is always evaluated. One server per run (a lock file in the run's `training/` folder).

The server never blocks the trainer: it only reads the trainer's files, and runs in its own process
(`angelspec eval-server --watch RUN_DIR`, or started by `angelspec train --eval-every N`), niced where the
platform allows. It stops once the run has finished (`train_report.json` written) and the final checkpoint is
evaluated, or after `idle_timeout_s` without a new checkpoint.

The checkpoint folder layout read here is the trainer's (train/checkpoint.py): `<run>/training/checkpoint/`
(or `checkpoint.old/` after a kill between its two renames) holds `config.json`, `model.safetensors` and
`trainer_state.json` with the step and the run's training config.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from angelspec.decoding.limits import check_counts
from angelspec.decoding.loading import draft_depth, resolve_drafter
from angelspec.decoding.sampling import SamplingParams
from angelspec.errors import UsageError, require_range
from angelspec.eval.speculative import ALL, EvalPrompt, EvalReport, EvalSettings, evaluate
from angelspec.fileio import pid_alive, read_json_object

if TYPE_CHECKING:
    from angelspec.models.device import Placement

EVAL_LOG = "eval_log.jsonl"
LOCK = "eval_server.lock"  # the pid of the server watching this run: one server per run
TRAINER_STATE = "trainer_state.json"
TRAIN_REPORT = "train_report.json"

MAX_THREADS = 1024  # torch threads of the server


@dataclass(frozen=True)
class EvalServerSettings:
    """What each checkpoint is evaluated on. `num_draft_tokens` None: the drafter's natural depth (a block
    drafter's block size - 1), else 4."""

    limit: int = 4  # held-out prompts per domain
    max_new_tokens: int = 64
    batch_size: int = 1
    num_draft_tokens: int | None = None
    temperatures: tuple[float, ...] = (0.0,)
    seed: int = 0
    poll_s: float = 10.0
    idle_timeout_s: float | None = None  # stop after this long without a new checkpoint (None: wait for the run)
    # torch threads of the server (None: torch's default). One by default: beside a trainer, a niced server's
    # several threads wait on each other whenever the trainer holds a core, which stretched its decoding runs
    # up to 15-fold at random and made the wall-clock speed-up meaningless.
    threads: int | None = 1

    def __post_init__(self) -> None:
        check_counts(max_new_tokens=self.max_new_tokens, batch_size=self.batch_size,
                     num_draft_tokens=self.num_draft_tokens, limit=self.limit)
        if self.threads is not None:
            require_range("--threads", self.threads, 1, MAX_THREADS)
        if not self.temperatures or not all(math.isfinite(t) and t >= 0 for t in self.temperatures):
            raise UsageError(f"--temperatures must be finite numbers >= 0 (0 = greedy), got {self.temperatures}")
        require_range("--poll", self.poll_s, 0, 86400, " (seconds)")
        if self.idle_timeout_s is not None:
            require_range("--idle-timeout", self.idle_timeout_s, 0, 10**9, " (seconds)")


def work_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "training"


def eval_log_path(run_dir: str | Path) -> Path:
    return work_dir(run_dir) / EVAL_LOG


def read_eval_log(run_dir: str | Path) -> list[dict[str, Any]]:
    """The run's evaluation records, oldest first (a torn last line from a kill is skipped)."""
    path = eval_log_path(run_dir)
    if not path.is_file():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").split("\n"):  # JSONL: newline-separated only
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def latest_checkpoint(run_dir: str | Path) -> tuple[Path, dict[str, Any]] | None:
    """(folder, trainer state) of the run's newest complete checkpoint, or None."""
    base = work_dir(run_dir) / "checkpoint"
    for cand in (base, base.with_name(f"{base.name}.old")):
        state = read_json_object(cand / TRAINER_STATE)
        if state is not None and isinstance(state.get("step"), int):
            return cand, state
    return None


def tokens_seen(state: dict[str, Any]) -> int | None:
    """Training tokens up to the checkpoint's step: step x global batch x row length, from its config."""
    cfg = state.get("train_config") or {}
    batch, seq_len = cfg.get("batch_size"), cfg.get("seq_len")
    if isinstance(batch, int) and isinstance(seq_len, int):
        return state["step"] * batch * seq_len
    return None


def snapshot_checkpoint(src: Path, step: int, dest_root: Path) -> Path | None:
    """Copy checkpoint `src` (announced at `step`) to `dest_root/step-<step>`; None when the trainer replaced it
    while copying (the copied trainer state says another step, or files vanished): try again next poll."""
    dest = dest_root / f"step-{step}"
    if (dest / TRAINER_STATE).is_file():
        return dest
    tmp = dest_root / f".step-{step}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        shutil.copytree(src, tmp, ignore=shutil.ignore_patterns("optimizer.pt"))
        copied = json.loads((tmp / TRAINER_STATE).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, shutil.Error):
        shutil.rmtree(tmp, ignore_errors=True)
        return None
    if copied.get("step") != step or not (tmp / "config.json").is_file():
        shutil.rmtree(tmp, ignore_errors=True)
        return None
    shutil.rmtree(dest, ignore_errors=True)
    os.replace(tmp, dest)
    return dest


def _cpu_speedup(comparison: Any) -> float | None:
    """The speed-up per CPU-second (`cpu_speedup`), None for a GPU run (its engine measures no CPU time)."""
    return round(comparison.cpu_speedup, 4) if comparison.ar.cpu_s > 0 else None


def record_from_report(report: EvalReport, *, step: int, tokens: int | None, temperature: float,
                       seconds: float) -> dict[str, Any]:
    """One eval-log line from an `EvalReport`."""
    overall = report.overall
    return {
        "step": step, "tokens": tokens, "temperature": temperature,
        "mal": round(overall.spec.mean_accepted_length, 4),
        "acceptance": [round(p, 4) for p in overall.spec.acceptance],
        "speedup": round(overall.speedup, 4),
        "speedup_cpu": _cpu_speedup(overall),
        "lossless": report.lossless,
        "domains": {d: {"mal": round(r.spec.mean_accepted_length, 4), "speedup": round(r.speedup, 4),
                        "speedup_cpu": _cpu_speedup(r)}
                    for d, r in report.domains.items() if d != ALL},
        "num_draft_tokens": report.settings.num_draft_tokens, "prompts": overall.prompts,
        "max_new_tokens": report.settings.max_new_tokens, "seconds": round(seconds, 2), "time": time.time(),
    }


def evaluate_checkpoint(target: Any, target_dir: Path, ckpt: Path, prompts: Sequence[EvalPrompt],
                        settings: EvalServerSettings, *, step: int, tokens: int | None,
                        progress: bool = False) -> list[dict[str, Any]]:
    """Decode `prompts` with the checkpoint's drafter at every temperature of `settings`; one record each."""
    drafter = resolve_drafter(str(ckpt), target, target_dir)
    k = draft_depth(drafter, settings.num_draft_tokens or None)
    records = []
    for temperature in settings.temperatures:
        t0 = time.time()
        es = EvalSettings(max_new_tokens=settings.max_new_tokens, batch_size=settings.batch_size,
                          num_draft_tokens=k, sampling=SamplingParams(temperature=temperature, seed=settings.seed),
                          warmup_tokens=8)
        report = evaluate(target, drafter, prompts, es, name=f"step {step}", progress=progress)
        records.append(record_from_report(report, step=step, tokens=tokens, temperature=temperature,
                                          seconds=time.time() - t0))
    return records


class _TensorBoard:
    """The same scalars to TensorBoard when it is installed; a no-op otherwise."""

    def __init__(self, folder: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except Exception:  # tensorboard not installed: the JSONL log is the record
            self.writer = None
            return
        self.writer = SummaryWriter(str(folder))

    def add(self, rec: dict[str, Any]) -> None:
        if self.writer is None:
            return
        x = rec["tokens"] if rec.get("tokens") is not None else rec["step"]
        tag = f"T={rec['temperature']:g}"
        self.writer.add_scalar(f"{tag}/mal", rec["mal"], x)
        self.writer.add_scalar(f"{tag}/speedup", rec["speedup"], x)
        for j, p in enumerate(rec["acceptance"], start=1):
            self.writer.add_scalar(f"{tag}/p_{j}", p, x)
        self.writer.flush()


def _claim(run_dir: Path) -> bool:
    """Take the run's server lock (one server per run, so the log never gets a step twice); False when a live
    server holds it. A lock left by a killed server is taken over."""
    lock = work_dir(run_dir) / LOCK
    for _ in range(2):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:
                pid = int(lock.read_text().strip() or 0)
                os.kill(pid, 0)  # raises when no such process
                if pid != os.getpid():
                    return False
                return True
            except (ValueError, ProcessLookupError, PermissionError, OSError):
                lock.unlink(missing_ok=True)  # stale: its server is gone
                continue
        with os.fdopen(fd, "w") as f:
            f.write(str(os.getpid()))
        return True
    return False


def _release(run_dir: Path) -> None:
    lock = work_dir(run_dir) / LOCK
    try:
        if int(lock.read_text().strip() or 0) == os.getpid():
            lock.unlink()
    except (OSError, ValueError):
        pass


def _nice() -> None:
    try:
        os.nice(10)  # the trainer comes first on a shared machine
    except (AttributeError, OSError):
        pass


def watch(run_dir: str | Path, target: Any, target_dir: Path, prompts: Sequence[EvalPrompt],
          settings: EvalServerSettings = EvalServerSettings(), *, once: bool = False, trainer_pid: int | None = None,
          log: Callable[[str], None] = print, sleep: Callable[[float], None] = time.sleep) -> int:
    """Evaluate every new checkpoint of `run_dir` until the run finishes (or once, with `once`); returns the
    number of checkpoints evaluated. Records go to `<run>/training/eval_log.jsonl` (see the module docstring).
    The run has finished when `train_report.json` exists, or, given `trainer_pid` (a server started beside its
    trainer), when that process has exited: a resumed run still holds the report its previous segment wrote
    (`--max-minutes`), which must not stop the server before the resumed trainer's checkpoints."""
    run_dir = Path(run_dir)
    work_dir(run_dir).mkdir(parents=True, exist_ok=True)
    if not _claim(run_dir):
        log(f"eval-server: another server already watches {run_dir} ({work_dir(run_dir) / LOCK}); not starting")
        return 0
    try:
        return _watch(run_dir, target, target_dir, prompts, settings, once=once, trainer_pid=trainer_pid, log=log,
                      sleep=sleep)
    finally:
        _release(run_dir)


def _watch(run_dir: Path, target: Any, target_dir: Path, prompts: Sequence[EvalPrompt],
           settings: EvalServerSettings, *, once: bool, trainer_pid: int | None, log: Callable[[str], None],
           sleep: Callable[[float], None]) -> int:
    snapshots = work_dir(run_dir) / "eval_snapshots"
    snapshots.mkdir(exist_ok=True)
    board = _TensorBoard(work_dir(run_dir) / "tensorboard")
    evaluated, last_new = 0, time.time()
    while True:
        # The log is the record of what was evaluated (re-read each time: `train --force` may have cleared it).
        done_steps = {r["step"] for r in read_eval_log(run_dir) if isinstance(r.get("step"), int)}
        # Read before the checkpoint, so the final one is then visible.
        finished = (run_dir / TRAIN_REPORT).is_file() if trainer_pid is None else not pid_alive(trainer_pid)
        found = latest_checkpoint(run_dir)
        if found is not None and found[1]["step"] not in done_steps:
            src, state = found
            step = state["step"]
            snap = snapshot_checkpoint(src, step, snapshots)
            if snap is not None:
                records = evaluate_checkpoint(target, target_dir, snap, prompts, settings, step=step,
                                              tokens=tokens_seen(state))
                with open(eval_log_path(run_dir), "a", encoding="utf-8") as f:
                    for rec in records:
                        f.write(json.dumps(rec) + "\n")
                for rec in records:
                    board.add(rec)
                    per_cpu = "" if rec["speedup_cpu"] is None else f" ({rec['speedup_cpu']:.2f}x per CPU-second)"
                    log(f"eval-server: step {step} ({rec['tokens'] or '?'} tokens) T={rec['temperature']:g}: "
                        f"MAL {rec['mal']:.2f}, p {' '.join(f'{p:.2f}' for p in rec['acceptance'])}, "
                        f"speed-up {rec['speedup']:.2f}x{per_cpu}, lossless {rec['lossless']}")
                shutil.rmtree(snap, ignore_errors=True)
                evaluated += 1
                last_new = time.time()
                continue  # look again at once: the trainer may have moved on while we decoded
        if once or (finished and (found is None or found[1]["step"] in done_steps)):
            return evaluated
        if settings.idle_timeout_s is not None and time.time() - last_new > settings.idle_timeout_s:
            log(f"eval-server: no new checkpoint for {settings.idle_timeout_s:.0f} s; stopping")
            return evaluated
        sleep(settings.poll_s)


def run_eval_server(run_dir: str | Path, target_dir: str | Path | None = None, *,
                    prompts_path: str | Path | None = None, settings: EvalServerSettings = EvalServerSettings(),
                    once: bool = False, nice: bool = True, wait_s: float = 0.0, trainer_pid: int | None = None,
                    log: Callable[[str], None] = print, placement: Placement | None = None) -> int:
    """`angelspec eval-server --watch RUN_DIR`: load the target and the held-out prompts, then `watch`.
    wait_s: how long to wait for RUN_DIR to appear (a server started beside a trainer that creates it);
    trainer_pid: stop once that process has exited (`watch`); placement: the target's device and dtype (None: the
    default of `angelspec.models.device.resolve_placement`)."""
    from angelspec.assets import EVAL_PROMPTS, resolve_target_dir
    from angelspec.data.prompts import load_prompts
    from angelspec.decoding.loading import load_target_and_tokenizer
    from angelspec.eval.prompts import eval_prompts

    run_dir = Path(run_dir)
    require_range("--wait", wait_s, 0, 10**9, " (seconds)")
    if trainer_pid is not None:  # 0 and negative ids name process groups: "alive" for as long as this one runs
        require_range("--trainer-pid", trainer_pid, 1, 2**31 - 1, " (a process id)")
    deadline = time.time() + wait_s
    while not work_dir(run_dir).is_dir() and time.time() < deadline:  # a trainer starting there makes training/
        time.sleep(min(settings.poll_s, 5.0) or 1.0)
    if not run_dir.is_dir():
        raise UsageError(f"eval-server: run folder {run_dir} does not exist; pass the --out folder of "
                         "`angelspec train`")
    if not work_dir(run_dir).is_dir():  # else it would wait forever, and make training/ in a folder of another use
        raise UsageError(f"eval-server: {run_dir} is not a training run (it has no training/ folder); pass the --out "
                         "folder of `angelspec train` (and --wait S for a run that is about to start there)")
    if nice:
        _nice()
    if settings.threads is not None:
        import torch

        torch.set_num_threads(settings.threads)
    tdir = resolve_target_dir(target_dir)
    from angelspec.decoding.limits import check_fits_target

    model, tokenizer = load_target_and_tokenizer(tdir, placement)
    w = model.embed_tokens.weight
    check_fits_target(model.config, rows=settings.batch_size, num_draft_tokens=settings.num_draft_tokens,
                      dtype_bytes=w.element_size(), device=w.device)
    source = Path(prompts_path) if prompts_path is not None else EVAL_PROMPTS
    prompts = eval_prompts(tokenizer, load_prompts(source), context=model.config.max_position_embeddings,
                           source=str(source), limit=settings.limit)
    return watch(run_dir, model, tdir, prompts, settings, once=once, trainer_pid=trainer_pid, log=log)


def plot_learning_curves(runs: dict[str, str | Path | list[dict[str, Any]]], out: str | Path, *,
                         temperature: float = 0.0) -> Path:
    """MAL against training tokens, one line per run (drafter), from the runs' eval logs (a run folder, or the
    records themselves: a drafter trained in stages); a PNG at `out`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for name, run in runs.items():
        if isinstance(run, list):  # in training order already (a staged run's steps restart)
            recs = [r for r in run if r.get("temperature") == temperature]
        else:
            recs = sorted((r for r in read_eval_log(run) if r.get("temperature") == temperature),
                          key=lambda r: r["step"])
        if not recs:
            continue
        xs = [(r["tokens"] if r.get("tokens") is not None else r["step"]) / 1e6 for r in recs]
        ax.plot(xs, [r["mal"] for r in recs], marker="o", markersize=3, label=name)
    ax.set_xlabel("training tokens (millions)")
    ax.set_ylabel(f"mean accepted length (T={temperature:g})")
    ax.grid(alpha=0.3)
    ax.legend()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def spawn_eval_server(run_dir: str | Path, target_dir: str | Path | None = None, *, limit: int = 4,
                      max_new_tokens: int = 64, temperatures: Sequence[float] = (0.0,),
                      prompts_path: str | Path | None = None, log_path: str | Path | None = None,
                      idle_timeout_s: float = 3600.0, device: str | None = None,
                      dtype: str | None = None, attention: str | None = None) -> subprocess.Popen:
    """Start `angelspec eval-server --watch RUN_DIR` as its own process beside a trainer (`train --eval-every`):
    it waits for the run folder, evaluates each checkpoint and exits once this process (the trainer) has exited
    and its final checkpoint is evaluated (or after `idle_timeout_s` without a new checkpoint). Its output goes to
    `log_path` (default: `RUN_DIR.eval-server.log`, beside the run folder, which `--force` may clear). `device`,
    `dtype` and `attention`: its --device, --dtype and --attention (None: its defaults)."""
    run_dir = Path(run_dir)
    log_path = Path(log_path) if log_path is not None else run_dir.with_name(f"{run_dir.name}.eval-server.log")
    cmd = [sys.executable, "-m", "angelspec.cli", "eval-server", "--watch", str(run_dir), "--wait", "600",
           "--limit", str(limit), "--max-new-tokens", str(max_new_tokens),
           "--temperatures", ",".join(f"{t:g}" for t in temperatures), "--idle-timeout", f"{idle_timeout_s:g}",
           "--trainer-pid", str(os.getpid())]
    if target_dir is not None:
        cmd += ["--target", str(target_dir)]
    if prompts_path is not None:
        cmd += ["--prompts", str(prompts_path)]
    for flag, value in (("--device", device), ("--dtype", dtype), ("--attention", attention)):
        if value is not None:
            cmd += [flag, value]
    with open(log_path, "ab") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
