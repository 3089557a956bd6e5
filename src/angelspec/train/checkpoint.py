"""Atomic, resumable training checkpoints.

A checkpoint is a folder: `config.json` (what the model is), `*.safetensors` (weights), and for
resuming `trainer_state.json` (step, data position, config hash) plus `optimizer.pt` — our own
optimizer state, the only file ever read with `torch.load`, and then with `weights_only=True`.

Two forms of `optimizer.pt`: `optimizer.state_dict()` (parameters numbered in optimizer order; what a
caller gets without `model=`), and with `model=` the FULL state keyed by parameter name
(`torch.distributed.checkpoint.state_dict.get_optimizer_state_dict(..., full_state_dict=True)`). The
named form is what makes FSDP2 resumable: every rank's DTensor shards of the AdamW moments are gathered
into whole tensors (a collective; rank 0 keeps them, on CPU) and written once, and on resume every rank
reads the file and keeps its own shard (`set_optimizer_state_dict`). It does not depend on the number
of processes or the strategy (tests/test_distributed.py: a stopped 2-process FSDP2 run resumes
bit-identical to an uninterrupted one, and its checkpoint also resumes in a single process).

Writes go to `<dir>.tmp-<pid>` and are swapped in with renames, so a kill at any moment leaves
either the previous checkpoint or the new one, never a mix: `latest/` is replaced by renaming
`latest` → `latest.old`, `tmp` → `latest`, then `latest.old` → `latest.trash-<pid>-<random>`, which is only
then removed; no folder is ever removed under a name a reader looks at. A reader that finds only `latest.old`
(a kill between the first two renames) uses it. Each write first repairs what a killed one left: `latest.old`
is renamed back when `latest` is missing (or dropped when `latest` is complete), and trash folders and the
temp folders of writers that no longer run are removed. `replace_folder` is that swap for any folder (a drafter
folder rewritten in place by `angelspec draft-vocab`, say), with its own test of what counts as complete.
"""

from __future__ import annotations

import glob
import json
import os
import pickle
import shutil
import uuid
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from torch import nn

from angelspec.fileio import pid_alive
from angelspec.models.block.config import DEFAULT_CONFIDENCE_TEMPERATURES
from angelspec.models.hf_io import write_json_atomic
from angelspec.train.distributed import has_dtensors

TRAINER_STATE = "trainer_state.json"
# Settings that only say how long to run or how often to save may change on resume (a run can be
# extended or shortened); every other setting must match the checkpoint exactly.
RUN_LENGTH_KEYS = ("steps", "ckpt_every", "log_every")
# ... and so may where the target features come from: online, or an offline cache of the same target and data
# (the trainer checks that), which holds the very tensors the online forward computes; and whether activations
# are recomputed in the backward, which changes memory only (the same graph again, bit-identical; tested); and
# the path of the folder an `init_from` run started from, which a resumed run no longer reads (its weights come
# from the checkpoint, checked against the model built): the work folder may have moved, or been named
# relatively once and absolutely the next time.
# taps_for_depth only says which target the configured taps were chosen for; the taps a run trains with are in its
# drafter config.
RESUME_FREE_KEYS = (*RUN_LENGTH_KEYS, "features", "activation_checkpointing", "init_from", "taps_for_depth")
# Settings a checkpoint may predate, with the value that reproduces how such a run trained: a checkpoint whose
# train_config lacks one reads as having that value, so a run started before the setting existed resumes when the
# setting is passed at it (e.g. a block drafter begun before `confidence_target`: confidence_target=tv; a drafter
# begun before `train_vocab` scored the whole vocabulary: train_vocab=full, and is refused under train_vocab=draft).
PREDATED_SETTINGS: dict[str, Any] = {"confidence_target": "tv",
                                     "confidence_temperatures": list(DEFAULT_CONFIDENCE_TEMPERATURES),
                                     "init_from": None, "only": None, "train_vocab": "full"}
OPTIMIZER_STATE = "optimizer.pt"


class ResumeError(ValueError):
    """A resume that would silently train something else (different config or data)."""


def write_checkpoint(
    ckpt_dir: str | Path,
    write_model: Callable[[Path], None],
    trainer_state: dict[str, Any],
    optimizer: torch.optim.Optimizer | dict[str, Any] | None = None,
) -> Path:
    """Write a complete checkpoint atomically. `write_model(tmp_dir)` writes config + safetensors; `optimizer`
    is an optimizer (its `state_dict()` is saved), an already gathered state dict, or None (not resumable)."""
    def write(tmp: Path) -> None:
        write_model(tmp)
        if optimizer is not None:
            state = optimizer.state_dict() if isinstance(optimizer, torch.optim.Optimizer) else optimizer
            torch.save(state, tmp / OPTIMIZER_STATE)
        write_json_atomic(tmp / TRAINER_STATE, trainer_state)

    return replace_folder(ckpt_dir, write)


def replace_folder(folder: str | Path, write: Callable[[Path], None],
                   complete: Callable[[Path], bool] | None = None, old_suffix: str = ".old") -> Path:
    """Write the folder `folder` atomically: `write(tmp)` fills `<folder>.tmp-<pid>`, which is then swapped in with
    renames (module docstring), so a kill at any moment leaves the previous folder or the new one, never a mix.
    `complete(f)` says whether a folder left under `folder`'s name or its `.old` twin is whole (default: a checkpoint,
    whose trainer state is written last); `repair_folder` decides with it what a killed write's leftovers become.
    `old_suffix` names the twin: a folder a user names gets one no user folder beside it is likely to have (the
    repair removes the twin when `folder` is complete)."""
    final = Path(folder)
    final.parent.mkdir(parents=True, exist_ok=True)
    old = _old(final, old_suffix)
    repair_folder(final, complete, old_suffix)
    tmp = final.with_name(f"{final.name}.tmp-{os.getpid()}")
    tmp.mkdir()
    try:
        write(tmp)
    except BaseException:  # a full disk, say: leave the previous folder as it was and no half-written one beside it
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if final.exists():
        os.replace(final, old)  # `repair_folder` left no `old`: this never replaces a whole folder
    os.replace(tmp, final)
    _discard(old, final)
    return final


def _old(final: Path, suffix: str = ".old") -> Path:
    return final.with_name(f"{final.name}{suffix}")


def _complete(folder: Path) -> bool:
    return (folder / TRAINER_STATE).is_file()  # written last, atomically


def _discard(folder: Path, final: Path) -> None:
    """Remove `folder` (`final` or its `.old` twin) without ever leaving it half-removed under a name a reader looks
    at: rename it to a unique `final.trash-*` name first (a kill during the removal leaves trash that the next
    write clears)."""
    if not folder.exists():
        return
    trash = final.with_name(f"{final.name}.trash-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    os.replace(folder, trash)
    shutil.rmtree(trash)


def repair_folder(final: Path, complete: Callable[[Path], bool] | None = None, old_suffix: str = ".old") -> None:
    """Undo what a killed `replace_folder` left beside `final`: put a complete `final.old` back when `final` is not
    complete (a kill between the first two renames), drop it when `final` is (a kill after the swap), and remove
    trash and temp folders that this process, or one that no longer runs, left behind. `complete`, `old_suffix`: as
    in `replace_folder`."""
    complete = complete or _complete
    old = _old(final, old_suffix)
    if complete(old):
        if not complete(final):
            _discard(final, final)  # only ever an incomplete leftover: a complete one has trainer_state.json
            os.replace(old, final)
        else:
            _discard(old, final)
    elif old.exists():
        _discard(old, final)  # incomplete: never a checkpoint anyone can use
    for sibling in final.parent.glob(f"{glob.escape(final.name)}.*"):
        kind, _, rest = sibling.name[len(final.name) + 1:].partition("-")  # tmp-<pid>, trash-<pid>-<random>
        pid = rest.partition("-")[0]
        if kind in ("tmp", "trash") and pid.isdigit() and sibling.is_dir() and (
                int(pid) == os.getpid() or not pid_alive(int(pid))):
            shutil.rmtree(sibling)


def find_checkpoint(ckpt_dir: str | Path) -> Path | None:
    """The newest complete checkpoint at `ckpt_dir` (or its `.old` twin after an unlucky kill)."""
    final = Path(ckpt_dir)
    for cand in (final, _old(final)):
        if _complete(cand):
            return cand
    return None


def refuse_resume_over_model(out_dir: str | Path, ckpt_dir: str | Path) -> None:
    """A resume (without --force) whose output `out_dir` holds a model (config.json) while `ckpt_dir` holds no
    checkpoint has nothing to resume: it would train from scratch and overwrite the finished model, so refuse
    (ResumeError) before anything is written. With no model there, a resume starts from scratch: a run killed before
    its first checkpoint stays resumable."""
    out_dir, ckpt_dir = Path(out_dir), Path(ckpt_dir)
    if (out_dir / "config.json").exists() and find_checkpoint(ckpt_dir) is None:
        raise ResumeError(f"cannot resume: {out_dir} holds a finished model but there is no checkpoint to resume "
                          f"from ({ckpt_dir}/{TRAINER_STATE}), so there is nothing to resume; pass --force instead of "
                          "--resume to start a new training run over it (it overwrites the model)")


def _unreadable(file: Path, why: object) -> ResumeError:
    return ResumeError(f"cannot resume: {file} is unreadable ({why}); the checkpoint may be half-written or "
                       "edited: pass --force instead of --resume to start over (it overwrites the model)")


def read_trainer_state(ckpt: Path) -> dict[str, Any]:
    """`ckpt`/trainer_state.json; ResumeError (naming the file and --force) when it is not a JSON object with an
    integer `step`."""
    file = Path(ckpt) / TRAINER_STATE
    try:
        state = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise _unreadable(file, e) from None
    if not isinstance(state, dict) or not isinstance(state.get("step"), int) or state["step"] < 0 or not isinstance(
            state.get("train_config", {}), dict):
        raise _unreadable(file, "expected a JSON object with a step count and the train_config")
    return state


def check_checkpoint_weights(ckpt: Path) -> None:
    """ResumeError naming the file when a `*.safetensors` of `ckpt` is not a complete safetensors file."""
    from angelspec.models.hf_io import CheckpointError, read_safetensors_header

    for file in sorted(Path(ckpt).glob("*.safetensors")):
        try:
            read_safetensors_header(file)
        except CheckpointError as e:
            raise _unreadable(file, str(e).removeprefix(f"{file}").strip(" :;")) from None


def optimizer_state(optimizer: torch.optim.Optimizer, model: nn.Module | None = None) -> dict[str, Any]:
    """What `optimizer.pt` holds: `optimizer.state_dict()` when `model` is None, else the full state keyed by
    `model`'s parameter names (module docstring). With `model` it is a collective under FSDP2 (every rank calls
    it; rank 0 gets the whole state on CPU, the other ranks an empty dict)."""
    if model is None:
        return optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True,
                                                                               cpu_offload=True))


def load_optimizer_state(ckpt: Path, optimizer: torch.optim.Optimizer, model: nn.Module | None = None) -> None:
    """Restore `optimizer` from `ckpt/optimizer.pt` (either form, see the module docstring). A named (full)
    state needs `model`, the module the optimizer's parameters belong to; under FSDP2 each rank keeps its
    shards of it."""
    path = Path(ckpt) / OPTIMIZER_STATE
    if not path.is_file():
        raise ResumeError(f"{ckpt} has no {OPTIMIZER_STATE}; cannot resume exactly (start fresh with --force)")
    try:
        # Read onto the host whatever device wrote it (a GPU run resumed on another machine or GPU); loading into the
        # optimizer moves each state tensor to its parameter's device.
        state = torch.load(path, weights_only=True, map_location="cpu")
    except (RuntimeError, EOFError, OSError, ValueError, pickle.UnpicklingError) as e:
        raise _unreadable(path, str(e).splitlines()[0] if str(e) else type(e).__name__) from None
    if not isinstance(state, dict):
        raise _unreadable(path, f"expected an optimizer state dict, got {type(state).__name__}")
    named = any(isinstance(k, str) for k in state.get("state", {})) or any(
        isinstance(p, str) for g in state.get("param_groups", ()) for p in g.get("params", ()))
    if not named:
        if model is not None and has_dtensors(model):
            raise ResumeError(f"{path} holds per-process optimizer state numbered by parameter, which an FSDP2 "
                              "run cannot shard; resume it with the strategy that wrote it, or start fresh with "
                              "--force")
        optimizer.load_state_dict(state)
        return
    if model is None:
        raise ResumeError(f"{path} holds an optimizer state keyed by parameter name; this trainer cannot load it "
                          "(start fresh with --force)")
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))


def _differences(saved: dict[str, Any], current: dict[str, Any], keys: Any, prefix: str = "") -> list[str]:
    """`key: checkpoint A vs now B` for each of `keys` that differs, naming the settings inside a differing dict."""
    out = []
    for k in keys:
        a, b = saved.get(k), current.get(k)
        if a == b:
            continue
        if isinstance(a, dict) and isinstance(b, dict):
            out += _differences(a, b, dict.fromkeys([*a, *b]), f"{prefix}{k}.")
        else:
            out.append(f"{prefix}{k}: checkpoint {a!r} vs now {b!r}")
    return out


def check_resume_compatible(saved: dict[str, Any], current: dict[str, Any], keys: tuple[str, ...]) -> None:
    """Refuse to resume when a setting that changes the run differs from the checkpoint's."""
    diffs = _differences(saved, current, keys)
    if diffs:
        raise ResumeError("cannot resume: the run's settings differ from the checkpoint's (" + "; ".join(diffs)
                          + "). Use the original settings, or --force to start over.")


# The run's inputs a checkpoint records beside its train_config (`train.loop.run_inputs`), with what a resume
# that differs in one of them names. A checkpoint written before one was recorded lacks it and resumes (its
# train_config and config fingerprint are still compared).
INPUT_KEYS = {
    "drafter": "it trains a {saved} drafter, not a {now} one: resume with --drafter {saved}",
    "target_weights": ("it was trained against another target (weights fingerprint {saved}; this --target has "
                       "{now}): resume with the run's own --target"),
    "dataset": ("its --data packed other training rows ({saved_rows} rows, digest {saved_digest}; this --data "
                "packs {now_rows} rows, digest {now_digest}): resume with the run's own --data"),
}


def check_resume_inputs(ckpt: Path, saved: dict[str, Any], identity: dict[str, Any]) -> None:
    """ResumeError naming the first input (`INPUT_KEYS`: drafter kind, target weights, data) in which this run
    differs from the checkpoint's; an input the checkpoint does not record is skipped, and so is one this run
    does not know."""
    for key, why in INPUT_KEYS.items():
        a, b = saved.get(key), identity.get(key)
        if a is None or b is None or a == b:
            continue
        if key == "dataset" and dict(a).get("seq_len") != dict(b).get("seq_len"):
            continue  # other rows because of another seq_len: the train_config comparison names that
        if key == "dataset":
            a, b = dict(a), dict(b)
            text = why.format(saved_rows=a.get("rows"), saved_digest=a.get("digest"), now_rows=b.get("rows"),
                              now_digest=b.get("digest"))
        else:
            text = why.format(saved=a, now=b)
        raise ResumeError(f"cannot resume from {ckpt}: {text}, or pass --force instead of --resume to start over")
    for key in INPUT_KEYS:
        if identity.get(key) is not None and saved.get(key) is None:
            saved[key] = identity[key]  # not recorded (an older checkpoint): nothing to compare


def run_identity(cfg: Any) -> dict[str, Any]:
    """The JSON form of a (dataclass) config minus the run-length keys: what a resume must match."""
    return {k: v for k, v in json.loads(json.dumps(asdict(cfg))).items() if k not in RESUME_FREE_KEYS}


def resume_training(
    ckpt_dir: str | Path,
    resume: bool,
    identity: dict[str, Any],
    load_weights: Callable[[Path], None],
    optimizer: torch.optim.Optimizer,
    log: Callable[[str], None],
    *,
    model: nn.Module | None = None,
    saved_defaults: dict[str, Any] | None = None,
) -> tuple[int, float]:
    """The step a run starts from and the training seconds its earlier segments took: (0, 0.0) when not resuming
    (or nothing to resume), else the newest checkpoint's step and recorded `train_seconds` (0.0 for a checkpoint
    written before that was recorded) after checking that `identity` (its `train_config` compared without the
    run-length keys) matches the checkpoint's and restoring the weights (`load_weights(ckpt)`) and the optimizer
    state (`model`: the module of the optimizer's parameters, for the named form; see `load_optimizer_state`).
    `saved_defaults` fill the settings a checkpoint written before they existed lacks
    (`DrafterRunConfig.checkpoint_defaults`)."""
    ckpt = find_checkpoint(ckpt_dir) if resume else None
    if ckpt is None:
        if resume:
            log(f"no checkpoint in {ckpt_dir}; starting from scratch")
        return 0, 0.0
    state = read_trainer_state(ckpt)
    old, now = state.get("train_config", {}), identity.get("train_config", {})
    predated = {k: v for k, v in PREDATED_SETTINGS.items() if k in now and k not in old}
    saved_config = {**predated, **(saved_defaults or {}), **old}
    saved = {**state, "train_config": {k: v for k, v in saved_config.items() if k not in RESUME_FREE_KEYS}}
    check_resume_inputs(ckpt, saved, identity)
    check_resume_compatible(saved, identity, tuple(identity))
    check_checkpoint_weights(ckpt)
    try:
        load_weights(ckpt)
    except SafetensorError as e:
        raise _unreadable(Path(ckpt), e) from None
    load_optimizer_state(ckpt, optimizer, model)
    step = int(state["step"])
    log(f"resuming from step {step}")
    return step, float(state.get("train_seconds", 0.0))


def make_checkpoint_saver(
    ckpt_dir: str | Path,
    snapshot: Callable[[], Any],
    write_model: Callable[[Any, Path], None],
    identity: dict[str, Any],
    optimizer: torch.optim.Optimizer | None,
    *,
    is_main: bool = True,
    barrier: Callable[[], None] = lambda: None,
    model: nn.Module | None = None,
    seconds: Callable[[], float] | None = None,
) -> Callable[[int], None]:
    """`save(step)` for a training loop: every rank calls `snapshot()` (whole weights; a collective under
    FSDP2) and gathers the optimizer state (`optimizer_state(optimizer, model)`: with `model`, the named full
    form, which FSDP2 needs; None: not resumable), the main rank writes an atomic checkpoint with
    `write_model(snapshot, dir)`, the trainer state (`step` + `identity`, and `train_seconds` from `seconds()`: the
    run's training time so far, which a resumed run carries on from) and that state, then all ranks meet at
    `barrier()`."""

    def save(step: int) -> None:
        whole = snapshot()
        opt_state = None if optimizer is None else optimizer_state(optimizer, model)
        if is_main:
            state = {"step": step, **identity}
            if seconds is not None:
                state["train_seconds"] = round(seconds(), 3)  # ms: a short segment must not record 0
            write_checkpoint(ckpt_dir, lambda p: write_model(whole, p), state, opt_state)
        barrier()

    return save
