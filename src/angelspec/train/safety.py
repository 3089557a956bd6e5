"""Guards of a training run, so that nothing goes silently wrong and no work is lost.

* `stop_if_not_finite`: a step whose loss or gradient norm is NaN or infinite stops the run at once, before the
  optimizer step, naming the step and the likely causes (`TrainingDiverged`); the last checkpoint, written while
  the weights were finite, stays as it is and nothing is exported.
* `check_bounds`: every number of a run config (presets and `key=value` overrides alike) lies in a range, checked
  before anything is loaded; one line names the setting and the range.
* `run_guard`: one run per output folder at a time (`LOCK_NAME`, holding the pid; a lock whose process is gone is
  taken over), and file-system faults while the run writes (a full disk, a read-only or vanished folder) become
  one line naming the path and the fix instead of a traceback.
* `check_not_input`: an output folder that is one of the run's inputs, or holds one, is refused (`--force` would
  delete the input, and training would write over it).
* `unfinished_run`, `refuse_foreign_files`, `empty_folder`: what a killed run left in its folder, a folder that is
  not a run of ours, and `--force` emptying a run's folder: shared by `train` and `target build`.
"""

from __future__ import annotations

import errno
import math
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any

from angelspec.errors import UsageError
from angelspec.fileio import pid_alive, same_path

LOCK_NAME = ".train.lock"  # in the output folder; `TrainRun.clear_out_dir` keeps it


class TrainingDiverged(ValueError):
    """The loss or the gradient norm of a step is not finite: training cannot continue from these weights."""


# ----- non-finite steps -----


def stop_if_not_finite(loss: Any, grad_norm: Any, step: int, lr: float, *, ckpt_dir: Path,
                       features: str | None = None, distributed: bool = False) -> float:
    """The step's loss as a float (one host sync for loss and gradient norm together), or TrainingDiverged when
    either is NaN or infinite on any rank (`distributed`: every rank takes the same decision). `step` is the
    1-based number of the step, `lr` its learning rate, `features` where the target features come from (an offline
    cache is named as a suspect)."""
    import torch

    from angelspec.train.checkpoint import find_checkpoint, read_trainer_state

    pair = torch.stack([loss.detach().float().reshape(()), grad_norm.detach().float().reshape(()).to(loss.device)])
    loss_value, norm_value = pair.tolist()
    bad = not (math.isfinite(loss_value) and math.isfinite(norm_value))
    if distributed:
        from angelspec.train.distributed import any_rank

        bad = any_rank(bad)
    if not bad:
        return loss_value
    what = (f"the loss is {loss_value}" if not math.isfinite(loss_value)
            else f"the gradient norm is {norm_value} (loss {loss_value:.4g})")
    causes = [f"the learning rate is too high (lr at this step: {lr:.3g}; lower lr=)"]
    if features and not features.startswith(("stream:", "ray:")):
        causes.append(f"a damaged feature shard in features={features} (rebuild it: angelspec features ... --force)")
    causes.append("the target has non-finite weights (check --target)")
    ckpt = find_checkpoint(ckpt_dir)
    if ckpt is None:
        kept = "no checkpoint had been written yet"
    else:
        try:
            kept = f"the last good checkpoint (step {read_trainer_state(ckpt)['step']}) in {ckpt_dir} is kept"
        except ValueError:
            kept = f"the last checkpoint in {ckpt_dir} is kept"
    raise TrainingDiverged(f"training stopped at step {step}: {what}; likely causes: {', or '.join(causes)}. Nothing "
                           f"was exported; {kept}: fix the cause and rerun with --resume or --force")


# ----- bounds of the settings -----

_INT_MAX = 10**9
# name -> (lowest, highest, whether the lowest is excluded, a note on what the range means)
BOUNDS: dict[str, tuple[float, float, bool, str]] = {
    "lr": (0.0, 10.0, False, " (0 = the weights stay as they start)"),
    "min_lr_ratio": (0.0, 1.0, False, ""),
    "warmup": (0, _INT_MAX, False, ""),
    "weight_decay": (0.0, 10.0, False, ""),
    "grad_clip": (0.0, 1e6, False, " (0 = no clipping)"),
    "seed": (0, 2**63 - 1, False, ""),
    "steps": (1, _INT_MAX, False, ""),
    "ckpt_every": (1, _INT_MAX, False, ""),
    "log_every": (1, _INT_MAX, False, ""),
    "seq_len": (1, 1 << 20, False, " (and at most the target's context)"),
    "batch_size": (1, 1 << 20, False, ""),
    "switch_step": (0, _INT_MAX, False, ""),
    "top_k": (1, 1 << 24, False, " (none = the whole vocabulary)"),
    "init_std": (0.0, 10.0, False, ""),
    "draft_vocab_size": (0, 1 << 24, False, " (0 = the whole vocabulary)"),
    "num_attention_heads": (1, 1024, False, ""),
    "num_key_value_heads": (1, 1024, False, ""),
    "head_dim": (1, 4096, False, ""),
    "hidden_size": (1, 1 << 16, False, ""),
    "intermediate_size": (1, 1 << 18, False, ""),
    "head_intermediate_size": (1, 1 << 18, False, ""),
    "num_hidden_layers": (1, 1024, False, ""),
    "num_depths": (1, 64, False, ""),
    "draft_layers": (1, 1024, False, ""),
    "block_size": (1, 4096, False, ""),
    "num_anchors": (1, 1 << 16, False, ""),
    "markov_rank": (1, 1 << 16, False, ""),
    "num_taps": (1, 1024, False, ""),
    "target_layer_id": (0, 4096, False, ""),
    "target_layer_ids": (0, 4096, False, ""),
    "taps_for_depth": (1, 4096, False, " (the layer count of the target the taps were chosen for)"),
    "mask_token_id": (0, 1 << 24, False, ""),
    "ce_coef": (0.0, 1e6, False, ""),
    "tv_coef": (0.0, 1e6, False, ""),
    "conf_coef": (0.0, 1e6, False, ""),
    "gamma": (0.0, 1e6, False, ""),
    "confidence_temperatures": (0.0, 1e3, False, ""),
    "heldout_docs_per_domain": (0, 1 << 20, False, ""),
}
# Any other number of a config: finite, and no larger than this in magnitude.
DEFAULT_BOUND = (-1e9, 1e9)


def _numbers(value: Any) -> list[float]:
    if isinstance(value, bool) or value is None:
        return []
    if isinstance(value, int | float):
        return [value]
    if isinstance(value, tuple) and all(isinstance(v, int | float) and not isinstance(v, bool) for v in value):
        return list(value)
    return []


def _range_text(lo: float, hi: float, lo_open: bool) -> str:
    def num(x: float) -> str:
        return f"{x:g}" if isinstance(x, float) else str(x)
    return f"{'>' if lo_open else '>='} {num(lo)} and <= {num(hi)}"


def check_bounds(cfg: Any, error: type[Exception] = UsageError) -> None:
    """Raise `error` naming the first number of the dataclass `cfg` (ints, floats, tuples of them; None and
    booleans are skipped) outside its range: `BOUNDS`, else finite within `DEFAULT_BOUND`."""
    if not is_dataclass(cfg):
        return
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        for x in _numbers(value):
            lo, hi, lo_open, note = BOUNDS.get(f.name, (*DEFAULT_BOUND, False, ""))
            if isinstance(x, float) and not math.isfinite(x):
                raise error(f"{f.name}={x} is not a finite number; give {f.name} a value {_range_text(lo, hi, lo_open)}"
                            f"{note}")
            if x < lo or x > hi or (lo_open and x == lo):
                shown = ",".join(str(v) for v in value) if isinstance(value, tuple) else value
                raise error(f"{f.name}={shown} is out of range: {f.name} must be {_range_text(lo, hi, lo_open)}"
                            f"{note}")


def check_minutes(max_minutes: float | None) -> None:
    """--max-minutes: a finite, positive number of minutes (None: no limit)."""
    if max_minutes is not None and not (math.isfinite(max_minutes) and 0 < max_minutes <= 10**7):
        raise UsageError(f"--max-minutes must be a number of minutes > 0 and <= 10000000, got {max_minutes}")


# ----- the output folder -----


def check_not_input(out: str | os.PathLike[str], *inputs: tuple[str, str | os.PathLike[str] | None],
                    flag: str = "--out") -> None:
    """Refuse an output folder that is one of `inputs` ((flag, path) pairs; None skipped) or holds one: the run
    writes into it, and --force removes it first."""
    out = Path(out)
    for input_flag, path in inputs:
        if path is None:
            continue
        path = Path(path)
        inside = any(same_path(out, above) for above in (path, *path.resolve().parents))
        if inside:
            how = "the same path as" if same_path(out, path) else "a folder that holds"
            raise UsageError(f"{flag} {out} is {how} the input {input_flag} {path}: the input lies in {flag}, "
                             f"which training writes (and --force empties first), so give {flag} another folder")


TRAIN_LOG = "train_log.jsonl"  # in a run's work folder, beside `checkpoint/`


def unfinished_run(work: Path) -> str | None:
    """What a killed or stopped run left in its work folder `work` (a drafter run's `--out`/training, `target
    build`'s --work-dir): "its last checkpoint is at step N", "it stopped before its first checkpoint" (a log, no
    checkpoint) or "its checkpoint is damaged"; None when there is neither a checkpoint nor a log."""
    from angelspec.train.checkpoint import find_checkpoint, read_trainer_state

    ckpt = find_checkpoint(work / "checkpoint")
    if ckpt is None:
        return "it stopped before its first checkpoint" if (work / TRAIN_LOG).is_file() else None
    try:
        return f"its last checkpoint is at step {read_trainer_state(ckpt)['step']}"
    except ValueError:
        return "its checkpoint is damaged"


def refuse_foreign_files(folder: Path, ours: tuple[str, ...], flag: str = "--out", what: str = "training run") -> None:
    """Refuse (the caller skips it under --force) a `folder` that holds files but none of the names a run of ours
    writes there (`ours`): it is not a run of ours, and a run would mix its files with someone else's. Hidden
    names (the lock, temp files of atomic writes) do not count."""
    if not folder.is_dir():
        return
    names = sorted(p.name for p in folder.iterdir() if not p.name.startswith("."))
    if names and not any(name in ours for name in names):
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        raise UsageError(f"{flag} {folder} holds files that are not a {what} of AngelSpec ({shown}); give {flag} an "
                         f"empty or new folder, or pass --force to delete them")


def empty_folder(folder: Path) -> None:
    """Delete everything in `folder` but the run's lock (`--force` starting a run over an old one)."""
    for item in folder.iterdir():
        if item.name == LOCK_NAME:
            continue
        if item.is_dir() and not item.is_symlink():
            shutil.rmtree(item)
        else:
            item.unlink()


def _lock_owner(lock: Path) -> int | None:
    try:
        text = lock.read_text(encoding="utf-8").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def acquire_lock(out_dir: Path, flag: str = "--out") -> bool:
    """Take the output folder's lock for this process: True when taken now, False when this process holds it
    already (a nested call); UsageError (naming `flag`, the option that gave the folder) when another running
    process holds it. A lock left by a process that no longer runs (a killed run) is taken over."""
    lock = out_dir / LOCK_NAME
    out_dir.mkdir(parents=True, exist_ok=True)
    for _ in range(3):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            owner = _lock_owner(lock)
            if owner == os.getpid():
                return False
            if owner is not None and pid_alive(owner):
                raise UsageError(f"another training run (pid {owner}) is writing to {out_dir}; wait for it to "
                                 f"finish, stop it, or give {flag} another folder") from None
            lock.unlink(missing_ok=True)  # stale: its process is gone (or it never got to write its pid)
            continue
        with os.fdopen(fd, "w") as f:
            f.write(f"{os.getpid()}\n")
        return True
    raise UsageError(f"could not take the lock {lock} (other runs keep starting in {out_dir}); give {flag} another "
                     "folder")


def release_lock(out_dir: Path) -> None:
    """Remove the output folder's lock if this process holds it."""
    lock = out_dir / LOCK_NAME
    if _lock_owner(lock) == os.getpid():
        lock.unlink(missing_ok=True)


# Errors of the file system that are the machine's state, not a bug: one line with the path and the fix.
_FS_ERRORS = {errno.ENOSPC: "the disk is full: free some space",
              errno.EDQUOT: "the disk quota is exhausted: free some space",
              errno.EROFS: "the file system is read-only: give {flag} a writable folder",
              errno.EACCES: "permission denied: give {flag} a folder you can write to",
              errno.EPERM: "permission denied: give {flag} a folder you can write to",
              errno.ENOENT: "a folder of the run vanished while it ran: do not remove {flag} during training"}


def file_system_fault(e: OSError, out_dir: Path, flag: str = "--out") -> UsageError | None:
    """The one-line error for an OSError the run hit while writing under `out_dir` (given by the option `flag`;
    None: not such a fault)."""
    fix = _FS_ERRORS.get(e.errno)
    if fix is None:
        return None
    fix = fix.format(flag=flag)
    name = e.filename
    if e.errno == errno.ENOENT:
        if name is None or not str(Path(name).resolve()).startswith(str(out_dir.resolve())):
            return None  # a missing input: already reported by the checks before the run
    where = f" writing {name}" if name else ""
    return UsageError(f"training into {out_dir} stopped{where}: {e.strerror or e}; {fix}, then rerun with --resume "
                      "(the last complete checkpoint is kept, no half-written file is)")


FULL_BELOW = 1 << 20  # bytes free under which a failed write is put down to a full disk


def disk_full(folder: Path) -> bool:
    """Whether the file system holding `folder` (or the nearest folder above it that exists) is all but full."""
    for above in (folder, *folder.parents):
        if above.is_dir():
            try:
                return shutil.disk_usage(above).free < FULL_BELOW
            except OSError:
                return False
    return False


@contextmanager
def run_guard(out_dir: Path, main: bool = True, flag: str = "--out") -> Iterator[None]:
    """Hold `out_dir`'s lock for the run (`main`: this process writes the folder, rank 0 under torchrun; `flag`: the
    option that gave the folder, for the messages) and turn file-system faults under it into one line
    (`file_system_fault`)."""
    out_dir = Path(out_dir)
    taken, created = False, not out_dir.exists()
    if main:
        try:
            taken = acquire_lock(out_dir, flag)
        except OSError as e:
            raise file_system_fault(e, out_dir, flag) or e from None
    try:
        yield
    except OSError as e:
        fault = file_system_fault(e, out_dir, flag)
        if fault is None:
            raise
        raise fault from None
    except RuntimeError as e:  # torch.save and safetensors' writer report a full disk without an errno
        if not disk_full(out_dir):
            raise
        raise file_system_fault(OSError(errno.ENOSPC, f"{e}".splitlines()[0] if str(e) else "write failed"),
                                out_dir, flag) from None
    finally:
        if taken:
            release_lock(out_dir)
            if created and out_dir.is_dir() and not any(out_dir.iterdir()):
                out_dir.rmdir()  # refused before it wrote anything: leave no empty folder behind


def is_main_process() -> bool:
    """Rank 0 of a torchrun launch (or a plain process): the one that writes the output folder."""
    return os.environ.get("RANK", "0") == "0"
