"""Atomic, resumable training checkpoints.

A checkpoint is a folder: `config.json` (what the model is), `*.safetensors` (weights), and for
resuming `trainer_state.json` (step, data position, config hash) plus `optimizer.pt` — our own
optimizer state, the only file ever read with `torch.load`, and then with `weights_only=True`.

Writes go to `<dir>.tmp-<pid>` and are swapped in with renames, so a kill at any moment leaves
either the previous checkpoint or the new one, never a mix: `latest/` is replaced by renaming
`latest` → `latest.old`, `tmp` → `latest`, then deleting `latest.old`. A reader that finds only
`latest.old` (a kill between the two renames) uses it.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from angelspec.models.hf_io import write_json_atomic

TRAINER_STATE = "trainer_state.json"
# Settings that only say how long to run or how often to save may change on resume (a run can be
# extended or shortened); every other setting must match the checkpoint exactly.
RUN_LENGTH_KEYS = ("steps", "ckpt_every", "log_every")
OPTIMIZER_STATE = "optimizer.pt"


class ResumeError(ValueError):
    """A resume that would silently train something else (different config or data)."""


def write_checkpoint(
    ckpt_dir: str | Path,
    write_model: Callable[[Path], None],
    trainer_state: dict[str, Any],
    optimizer: torch.optim.Optimizer | None = None,
) -> Path:
    """Write a complete checkpoint atomically. `write_model(tmp_dir)` writes config + safetensors."""
    final = Path(ckpt_dir)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f"{final.name}.tmp-{os.getpid()}")
    old = final.with_name(f"{final.name}.old")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    write_model(tmp)
    if optimizer is not None:
        torch.save(optimizer.state_dict(), tmp / OPTIMIZER_STATE)
    write_json_atomic(tmp / TRAINER_STATE, trainer_state)
    if old.exists():
        shutil.rmtree(old)
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    if old.exists():
        shutil.rmtree(old)
    return final


def find_checkpoint(ckpt_dir: str | Path) -> Path | None:
    """The newest complete checkpoint at `ckpt_dir` (or its `.old` twin after an unlucky kill)."""
    final = Path(ckpt_dir)
    for cand in (final, final.with_name(f"{final.name}.old")):
        if (cand / TRAINER_STATE).is_file():
            return cand
    return None


def read_trainer_state(ckpt: Path) -> dict[str, Any]:
    return json.loads((Path(ckpt) / TRAINER_STATE).read_text())


def load_optimizer_state(ckpt: Path, optimizer: torch.optim.Optimizer) -> None:
    path = Path(ckpt) / OPTIMIZER_STATE
    if not path.is_file():
        raise ResumeError(f"{ckpt} has no {OPTIMIZER_STATE}; cannot resume exactly (start fresh with --force)")
    optimizer.load_state_dict(torch.load(path, weights_only=True))


def check_resume_compatible(saved: dict[str, Any], current: dict[str, Any], keys: tuple[str, ...]) -> None:
    """Refuse to resume when a setting that changes the run differs from the checkpoint's."""
    diffs = [
        f"{k}: checkpoint {saved.get(k)!r} vs now {current.get(k)!r}" for k in keys if saved.get(k) != current.get(k)
    ]
    if diffs:
        raise ResumeError("cannot resume: the run's settings differ from the checkpoint's (" + "; ".join(diffs)
                          + "). Use the original settings, or --force to start over.")


def run_identity(cfg: Any) -> dict[str, Any]:
    """The JSON form of a (dataclass) config minus the run-length keys: what a resume must match."""
    return {k: v for k, v in json.loads(json.dumps(asdict(cfg))).items() if k not in RUN_LENGTH_KEYS}


def resume_training(
    ckpt_dir: str | Path,
    resume: bool,
    identity: dict[str, Any],
    load_weights: Callable[[Path], None],
    optimizer: torch.optim.Optimizer,
    log: Callable[[str], None],
) -> int:
    """The step a run starts from: 0 when not resuming (or nothing to resume), else the newest checkpoint's
    step after checking that `identity` (its `train_config` compared without the run-length keys) matches the
    checkpoint's and restoring the weights (`load_weights(ckpt)`) and the optimizer state."""
    ckpt = find_checkpoint(ckpt_dir) if resume else None
    if ckpt is None:
        if resume:
            log(f"no checkpoint in {ckpt_dir}; starting from scratch")
        return 0
    state = read_trainer_state(ckpt)
    saved = {**state, "train_config": {k: v for k, v in state.get("train_config", {}).items()
                                       if k not in RUN_LENGTH_KEYS}}
    check_resume_compatible(saved, identity, tuple(identity))
    load_weights(ckpt)
    load_optimizer_state(ckpt, optimizer)
    step = int(state["step"])
    log(f"resuming from step {step}")
    return step


def make_checkpoint_saver(
    ckpt_dir: str | Path,
    snapshot: Callable[[], Any],
    write_model: Callable[[Any, Path], None],
    identity: dict[str, Any],
    optimizer: torch.optim.Optimizer | None,
    *,
    is_main: bool = True,
    barrier: Callable[[], None] = lambda: None,
) -> Callable[[int], None]:
    """`save(step)` for a training loop: every rank calls `snapshot()` (whole weights; a collective under
    FSDP2), the main rank writes an atomic checkpoint with `write_model(snapshot, dir)`, the trainer state
    (`step` + `identity`) and the optimizer state (None: not resumable, e.g. FSDP2 shards), then all ranks
    meet at `barrier()`."""

    def save(step: int) -> None:
        whole = snapshot()
        if is_main:
            write_checkpoint(ckpt_dir, lambda p: write_model(whole, p), {"step": step, **identity}, optimizer)
        barrier()

    return save
