"""Atomic checkpoints (`angelspec.train.checkpoint`) under a kill at any moment.

A kill is simulated by making the Nth rename (`os.replace` / `os.rename`) or tree removal (`shutil.rmtree`, which
first removes one file, as a real kill mid-removal would leave) raise, for every N a save makes. After each such
kill `find_checkpoint` must return a complete checkpoint holding the newest step that was swapped in, the next
save must succeed (also when it is killed in turn) and leave nothing but the checkpoint folder behind.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from angelspec.train import checkpoint as ckpt_mod
from angelspec.train.checkpoint import find_checkpoint, read_trainer_state, write_checkpoint


class Killed(BaseException):
    """The simulated kill (a BaseException, like the signal's exit: no `except Exception` swallows it)."""


def _weights(step: int) -> Callable[[Path], None]:
    def write(folder: Path) -> None:
        (folder / "config.json").write_text(json.dumps({"step": step}))
        (folder / "model.safetensors").write_text(f"weights of step {step}")
    return write


def save(ckpt: Path, step: int) -> None:
    write_checkpoint(ckpt, _weights(step), {"step": step})


def complete_step(ckpt: Path) -> int:
    """The step of the checkpoint `find_checkpoint` picks, after checking every file of it is there and agrees."""
    found = find_checkpoint(ckpt)
    assert found is not None, sorted(p.name for p in ckpt.parent.iterdir())
    step = read_trainer_state(found)["step"]
    assert json.loads((found / "config.json").read_text()) == {"step": step}
    assert (found / "model.safetensors").read_text() == f"weights of step {step}"
    return step


@contextmanager
def kill_at(n: int, ckpt: Path) -> Iterator[dict[str, object]]:
    """Raise `Killed` at the `n`th rename or tree removal; yields what happened (calls made, whether the new
    folder reached the final name)."""
    seen: dict[str, object] = {"calls": 0, "swapped": False}
    real_replace, real_rename, real_rmtree = os.replace, os.rename, shutil.rmtree

    def count() -> bool:
        seen["calls"] = int(seen["calls"]) + 1  # type: ignore[call-overload]
        return seen["calls"] == n

    def moved(real: Callable[..., None]) -> Callable[..., None]:
        def go(src: object, dst: object, *a: object, **kw: object) -> None:
            if count():
                raise Killed
            real(src, dst, *a, **kw)
            if Path(dst) == ckpt and ".tmp-" in Path(src).name:
                seen["swapped"] = True
        return go

    def rmtree(path: object, *a: object, **kw: object) -> None:
        if count():
            files = sorted(p for p in Path(path).rglob("*") if p.is_file())  # type: ignore[arg-type]
            if files:
                files[0].unlink()  # half removed
            raise Killed
        real_rmtree(path, *a, **kw)  # type: ignore[arg-type]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(os, "replace", moved(real_replace))
        mp.setattr(os, "rename", moved(real_rename))
        mp.setattr(shutil, "rmtree", rmtree)
        yield seen


def killed_save(ckpt: Path, step: int, n: int) -> tuple[bool, bool]:
    """Save `step` with a kill at the `n`th call; (was it killed, did the new folder reach the final name)."""
    with kill_at(n, ckpt) as seen:
        try:
            save(ckpt, step)
        except Killed:
            return True, bool(seen["swapped"])
    return False, True


def leftovers(ckpt: Path) -> list[str]:
    return sorted(p.name for p in ckpt.parent.iterdir() if p.name != ckpt.name)


@pytest.mark.parametrize("name", ["checkpoint", "ckpt.v2"])
def test_a_kill_at_any_rename_or_removal_leaves_a_complete_checkpoint(tmp_path: Path, name: str) -> None:
    cases = 0
    for n in range(1, 100):
        base = tmp_path / f"n{n}"
        ckpt = base / name
        save(ckpt, 1)
        save(ckpt, 2)
        killed, swapped = killed_save(ckpt, 3, n)
        if not killed:
            break
        newest = 3 if swapped else 2
        assert complete_step(ckpt) == newest, f"kill at call {n}"
        # The next save, itself killed at each of its calls, still leaves the newest complete checkpoint ...
        for m in range(1, 100):
            again = tmp_path / f"n{n}-again{m}" / name
            shutil.copytree(base, again.parent)
            killed2, swapped2 = killed_save(again, 4, m)
            assert complete_step(again) == (4 if swapped2 else newest), f"kill at call {n}, then at call {m}"
            # ... and a save after it completes and cleans up.
            save(again, 5)
            assert complete_step(again) == 5 and leftovers(again) == [], (n, m, leftovers(again))
            cases += 1
            if not killed2:
                break
        save(ckpt, 4)
        assert complete_step(ckpt) == 4 and leftovers(ckpt) == [], (n, leftovers(ckpt))
    assert cases > 20  # every kill point of two saves was reached


def test_a_kill_between_the_renames_is_repaired_by_the_next_save(tmp_path: Path) -> None:
    ckpt = tmp_path / "checkpoint"
    save(ckpt, 1)
    ckpt.rename(tmp_path / "checkpoint.old")  # the kill: only the previous checkpoint, under its .old name
    assert complete_step(ckpt) == 1
    # A run that resumes from .old and is killed again before its first save must still find it.
    with kill_at(1, ckpt):
        with pytest.raises(Killed):
            save(ckpt, 2)
    assert complete_step(ckpt) == 1
    save(ckpt, 2)
    assert complete_step(ckpt) == 2 and leftovers(ckpt) == []


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_stale_temp_folders_of_dead_writers_are_removed(tmp_path: Path) -> None:
    ckpt = tmp_path / "checkpoint"
    save(ckpt, 1)
    dead = tmp_path / f"checkpoint.tmp-{_dead_pid()}"
    shutil.copytree(ckpt, dead)  # a complete temp folder whose writer was killed before swapping it in
    half = tmp_path / f"checkpoint.trash-{_dead_pid()}-abc"
    (half / "sub").mkdir(parents=True)  # a removal that was killed half way
    alive = tmp_path / f"checkpoint.tmp-{os.getppid()}"  # another live process's write in progress: not ours
    alive.mkdir()
    alive_trash = tmp_path / f"checkpoint.trash-{os.getppid()}-abc"
    alive_trash.mkdir()
    other = tmp_path / "other.tmp-1"  # not a sibling of this checkpoint
    other.mkdir()
    save(ckpt, 2)
    assert complete_step(ckpt) == 2
    assert leftovers(ckpt) == sorted([alive.name, alive_trash.name, other.name])


def test_find_checkpoint_ignores_incomplete_folders(tmp_path: Path) -> None:
    ckpt = tmp_path / "checkpoint"
    assert find_checkpoint(ckpt) is None
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")  # no trainer_state.json: not complete
    assert find_checkpoint(ckpt) is None
    save(ckpt, 3)
    assert complete_step(ckpt) == 3 and leftovers(ckpt) == []


def test_module_uses_the_patched_functions() -> None:
    """The kill simulation patches `os` and `shutil` themselves, which the module calls through."""
    assert ckpt_mod.os is os and ckpt_mod.shutil is shutil


# ----- the training log after a resume ----------------------------------------------------------------------------
def _train(kind: str, tiny_target_dir: Path, data: Path, out: Path, **kw: object) -> None:
    quiet = dict(progress=False, log=lambda *_: None)
    if kind == "mtp":
        from dataclasses import replace

        from angelspec.train.mtp import tiny_debug, train_mtp

        train_mtp(tiny_target_dir, data, out, config=replace(tiny_debug(), steps=4), **quiet, **kw)
    else:
        from dataclasses import replace

        from angelspec.train.draft_lm import draft_lm_tiny_debug, train_draft_lm

        train_draft_lm(tiny_target_dir, data, out, config=replace(draft_lm_tiny_debug(), steps=4), **quiet, **kw)


def _train_killed_after_step_3(loop: Any, kind: str, tiny_target_dir: Path, data: Path, out: Path,
                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Train `kind` for 4 steps (a checkpoint every 2) and kill it right after `loop` logs step 3."""
    append_log = loop.append_log

    def killed_after_step_3(path: Path, record: dict, is_main: bool) -> None:
        append_log(path, record, is_main)
        if record["step"] == 3:
            raise Killed

    monkeypatch.setattr(loop, "append_log", killed_after_step_3)
    with pytest.raises(Killed):
        _train(kind, tiny_target_dir, data, out)
    monkeypatch.setattr(loop, "append_log", append_log)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize(("kind", "module"), [("mtp", "angelspec.train.loop"), ("draft-lm", "angelspec.train.lm")])
def test_a_resumed_run_logs_each_step_once(tmp_path: Path, tiny_target_dir: Path, kind: str, module: str,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """4 steps, a checkpoint every 2, a log line every step; killed right after logging step 3 (checkpoint at 2):
    the resumed run logs steps 3 and 4 again, so the log keeps steps 1, 2 and then the resumed 3, 4."""
    import importlib

    from conftest import train_log, write_conversations

    data = write_conversations(tmp_path / "conv.jsonl", 40, seed=3)
    out = tmp_path / "run"
    _train_killed_after_step_3(importlib.import_module(module), kind, tiny_target_dir, data, out, monkeypatch)
    assert read_trainer_state(find_checkpoint(out / "training" / "checkpoint"))["step"] == 2
    assert [r["step"] for r in train_log(out)] == [1, 2, 3]
    with (out / "training" / "train_log.jsonl").open("a") as f:
        f.write('{"step": 4, "loss": 1.')  # and a line the kill cut short
    _train(kind, tiny_target_dir, data, out, resume=True)
    assert [r["step"] for r in train_log(out)] == [1, 2, 3, 4]


@pytest.mark.usefixtures("one_thread")
def test_a_resumed_run_reports_the_training_time_of_all_its_segments(tmp_path: Path, tiny_target_dir: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """train_report.json's train_seconds covers every segment of a resumed run, not only the last: each checkpoint
    records the time so far and a resumed run carries on from it (the shipped drafters' reports say how long they
    trained)."""
    from conftest import write_conversations

    import angelspec.train.loop as loop

    data = write_conversations(tmp_path / "conv.jsonl", 40, seed=3)
    out = tmp_path / "run"
    _train_killed_after_step_3(loop, "mtp", tiny_target_dir, data, out, monkeypatch)
    ckpt = find_checkpoint(out / "training" / "checkpoint")
    state = read_trainer_state(ckpt)
    assert state["step"] == 2 and 0 < state["train_seconds"] < 600
    state["train_seconds"] = 5000.0  # as if the first segment had trained for 83 minutes
    (ckpt / "trainer_state.json").write_text(json.dumps(state))
    _train("mtp", tiny_target_dir, data, out, resume=True)
    seconds = json.loads((out / "train_report.json").read_text())["train_seconds"]
    assert 5000.0 < seconds < 5600.0
