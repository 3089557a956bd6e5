"""`angelspec train` loses no work and trains nothing silently wrong: a non-finite loss stops the run at once and
exports nothing; a damaged feature shard is refused; an unfinished or running run in --out is protected; --resume
refuses other data, another target or another drafter kind; every number has a bound checked before work starts;
and file-system faults (full disk, read-only or vanished folder) are one line that leaves nothing half-written.
Each probe goes through `main([...])` on copies of tiny targets, edited in tmp_path."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import assert_bad_input, run_cli, write_conversations
from safetensors.torch import load_file, save_file

from angelspec.train import checkpoint as checkpoint_module
from angelspec.train import lm as lm_module
from angelspec.train import loop as loop_module
from angelspec.train.safety import LOCK_NAME

pytestmark = pytest.mark.usefixtures("one_thread")


def train(capsys: pytest.CaptureFixture[str], target: Path, data: Path, out: Path, *extra: object,
          kind: str = "mtp") -> tuple[int, str, str]:
    return run_cli(capsys, "train", "--drafter", kind, "--target", target, "--data", data, "--out", out,
                   "--preset", "tiny_debug", "--quiet", *extra)


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_conversations(tmp_path_factory.mktemp("data") / "conv.jsonl", 20, seed=1)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory, tiny_target_dir: Path, data: Path) -> Path:
    """A finished tiny MTP run (3 steps, checkpoints at 2 and 3), copied by each test that edits it."""
    from angelspec.cli import main

    out = tmp_path_factory.mktemp("finished") / "out"
    assert main(["train", "--drafter", "mtp", "--target", str(tiny_target_dir), "--data", str(data), "--out",
                 str(out), "--preset", "tiny_debug", "--quiet"]) == 0
    return out


def unfinished_copy(finished: Path, dst: Path) -> Path:
    """`finished` as a killed run leaves it: checkpoint and log, no exported model yet."""
    shutil.copytree(finished, dst)
    for name in ("config.json", "model.safetensors", "train_report.json"):
        (dst / name).unlink()
    return dst


def checkpoint_step(out: Path) -> int:
    return json.loads((out / "training" / "checkpoint" / "trainer_state.json").read_text())["step"]


def assert_not_exported(out: Path) -> None:
    assert not (out / "config.json").exists() and not (out / "train_report.json").exists()
    assert not (out / LOCK_NAME).exists()
    leftovers = [p.name for p in (out / "training").glob("checkpoint.*")] if (out / "training").is_dir() else []
    assert leftovers == [], leftovers


# ----- 1. non-finite loss -----


@pytest.mark.parametrize("kind", ["mtp", "draft-lm"])
def test_a_non_finite_loss_stops_at_once_and_exports_nothing(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                             tiny_target_dir: Path, data: Path,
                                                             monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    """From step 3 on the learning rate is 1e30 (a schedule gone wrong): the weights blow up, the next loss is
    NaN, and the run stops there, naming the step and the causes, keeping the step-2 checkpoint (finite weights)
    and exporting nothing. Without the guard it exits 0 with an all-NaN drafter marked finished."""
    real = loop_module.cosine_lr

    def exploding(step: int, **kw: float) -> float:
        return 1e30 if step >= 2 else real(step, **kw)

    monkeypatch.setattr(loop_module, "cosine_lr", exploding)
    monkeypatch.setattr(lm_module, "cosine_lr", exploding)
    out = tmp_path / "out"
    code, _, err = train(capsys, tiny_target_dir, data, out, "steps=6", kind=kind)
    assert_bad_input(code, err, "training stopped at step 4", "learning rate", "non-finite weights",
                     "last good checkpoint (step 2)", "Nothing was exported", "--resume")
    assert_not_exported(out)
    assert checkpoint_step(out) == 2
    weights = load_file(str(out / "training" / "checkpoint" / "model.safetensors"))
    assert all(torch.isfinite(t).all() for t in weights.values())
    log = [json.loads(line) for line in (out / "training" / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2, 3]  # the NaN step logs nothing


@pytest.fixture(scope="module")
def feature_cache(tmp_path_factory: pytest.TempPathFactory, tiny_target_dir: Path, data: Path) -> Path:
    from angelspec.cli import main

    cache = tmp_path_factory.mktemp("features") / "cache"
    assert main(["features", "--target", str(tiny_target_dir), "--data", str(data), "--out", str(cache),
                 "--seq-len", "64", "--rows-per-shard", "2"]) == 0
    return cache


def test_a_feature_shard_damaged_in_place_is_refused(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                     tiny_target_dir: Path, data: Path, feature_cache: Path) -> None:
    """Same size, other bytes: only the manifest's SHA-256 tells, and it is checked before the shard is read."""
    cache = shutil.copytree(feature_cache, tmp_path / "cache")
    shard = sorted(cache.glob("shard-*.safetensors"))[0]
    raw = bytearray(shard.read_bytes())
    raw[-64:] = b"\xff" * 64  # NaN bit patterns in the last tensor's data
    shard.write_bytes(bytes(raw))
    out = tmp_path / "out"
    code, _, err = train(capsys, tiny_target_dir, data, out, f"features={cache}")
    assert_bad_input(code, err, f"feature shard {shard} is damaged", "SHA-256", "angelspec features")
    assert_not_exported(out)


def test_a_non_finite_feature_cache_stops_training_naming_it(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                            tiny_target_dir: Path, data: Path,
                                                            feature_cache: Path) -> None:
    """A cache whose hidden states are NaN with a consistent manifest (made from a broken target, say) is refused as
    its first batch is read, before any step, naming the shard and the tensor; nothing is exported."""
    from angelspec.data.fingerprint import file_sha256

    cache = shutil.copytree(feature_cache, tmp_path / "cache")
    manifest = json.loads((cache / "manifest.json").read_text())
    for entry in manifest["shards"]:
        path = cache / entry["file"]
        tensors = load_file(str(path))
        save_file({k: torch.full_like(v, float("nan")) if k.split(".", 1)[1].startswith("hidden") else v
                   for k, v in tensors.items()}, str(path), {"format": "angelspec-features-v1"})
        entry["sha256"], entry["bytes"] = file_sha256(path), path.stat().st_size
    (cache / "manifest.json").write_text(json.dumps(manifest))
    out = tmp_path / "out"
    code, _, err = train(capsys, tiny_target_dir, data, out, f"features={cache}")
    assert_bad_input(code, err, f"feature shard {cache}/shard-", "'hidden.", "NaN or infinite", "build it again")
    assert_not_exported(out)


# ----- 2. run protection -----


def test_an_unfinished_run_is_refused_without_resume_or_force(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                             tiny_target_dir: Path, data: Path,
                                                             finished_run: Path) -> None:
    out = unfinished_copy(finished_run, tmp_path / "out")
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    code, _, err = train(capsys, tiny_target_dir, data, out)
    assert_bad_input(code, err, f"--out {out} holds an unfinished training run", "last checkpoint is at step 3",
                     "--resume", "--force")
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before  # nothing overwritten
    code, _, err = train(capsys, tiny_target_dir, data, out, "--resume")
    assert code == 0, err
    assert (out / "train_report.json").is_file()


def test_a_finished_run_is_refused_without_force(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                 tiny_target_dir: Path, data: Path, finished_run: Path) -> None:
    out = shutil.copytree(finished_run, tmp_path / "out")
    code, _, err = train(capsys, tiny_target_dir, data, out)
    assert_bad_input(code, err, "already holds a model", "--force")
    code, _, err = train(capsys, tiny_target_dir, data, out, "--force")
    assert code == 0, err


def test_one_run_per_out_folder(capsys: pytest.CaptureFixture[str], tmp_path: Path, tiny_target_dir: Path,
                                data: Path) -> None:
    """A lock held by a live process refuses the second run (even with --force); a lock left by a process that
    is gone is taken over, and the run removes it when it ends."""
    out = tmp_path / "out"
    out.mkdir()
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (out / LOCK_NAME).write_text(f"{alive.pid}\n")
        code, _, err = train(capsys, tiny_target_dir, data, out, "--force")
        assert_bad_input(code, err, f"another training run (pid {alive.pid}) is writing to {out}")
        assert not (out / "training").exists()
    finally:
        alive.kill()
        alive.wait()
    (out / LOCK_NAME).write_text(f"{alive.pid}\n")  # its process has exited: a stale lock
    code, _, err = train(capsys, tiny_target_dir, data, out)
    assert code == 0, err
    assert not (out / LOCK_NAME).exists() and (out / "train_report.json").is_file()


@pytest.mark.parametrize("resume", [False, True])
def test_an_out_folder_that_is_not_a_training_run_is_refused_without_force(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, tiny_target_dir: Path, data: Path, resume: bool) -> None:
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("my notes")
    (out / "photos").mkdir()
    code, _, err = train(capsys, tiny_target_dir, data, out, *(["--resume"] if resume else []))
    assert_bad_input(code, err, f"--out {out} holds files that are not a training run of AngelSpec (notes.txt, "
                     "photos)", "empty or new folder", "--force")
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt", "photos"]
    if not resume:
        code, _, err = train(capsys, tiny_target_dir, data, out, "--force")
        assert code == 0, err
        assert (out / "train_report.json").is_file() and not (out / "notes.txt").exists()


def _target_build(capsys: pytest.CaptureFixture[str], out: Path, work: Path, *extra: object) -> tuple[int, str, str]:
    return run_cli(capsys, "target", "build", "--out", out, "--work-dir", work, "--preset", "tiny_debug", "--quiet",
                   *extra)


def test_target_build_refuses_an_unfinished_build_a_foreign_work_dir_and_a_running_build(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """The drafter runs' protection (train.safety), for `target build`'s --work-dir: an unfinished build needs
    --resume or --force, a folder that is not a build needs --force, and one build at a time."""
    out, work = tmp_path / "t", tmp_path / "w"
    work.mkdir()
    (work / "train_log.jsonl").write_text('{"step": 1}\n')  # killed before its first checkpoint
    code, _, err = _target_build(capsys, out, work)
    assert_bad_input(code, err, f"--work-dir {work} holds an unfinished target build (it stopped before its first "
                     "checkpoint)", "--resume", "--force")
    assert (work / "train_log.jsonl").read_text() == '{"step": 1}\n' and not out.exists()
    (work / "train_log.jsonl").unlink()
    (work / "thesis.tex").write_text("mine")
    code, _, err = _target_build(capsys, out, work)
    assert_bad_input(code, err, f"--work-dir {work} holds files that are not a target build of AngelSpec (thesis.tex)",
                     "--force")
    (work / "thesis.tex").unlink()
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (work / LOCK_NAME).write_text(f"{alive.pid}\n")
        code, _, err = _target_build(capsys, out, work, "--force")
        assert_bad_input(code, err, f"another training run (pid {alive.pid}) is writing to {work}",
                         "give --work-dir another folder")
    finally:
        alive.kill()
        alive.wait()
    assert sorted(p.name for p in work.iterdir()) == [LOCK_NAME] and not out.exists()


def test_resume_with_other_data_is_refused(capsys: pytest.CaptureFixture[str], tmp_path: Path, tiny_target_dir: Path,
                                           data: Path, finished_run: Path) -> None:
    out = unfinished_copy(finished_run, tmp_path / "out")
    other = write_conversations(tmp_path / "other.jsonl", 20, seed=7)
    code, _, err = train(capsys, tiny_target_dir, other, out, "--resume")
    assert_bad_input(code, err, "cannot resume", "its --data packed other training rows", "the run's own --data",
                     "--force")


def test_draft_lm_resume_with_other_data_is_refused(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                   tiny_target_dir: Path, data: Path) -> None:
    out = tmp_path / "out"
    code, _, err = train(capsys, tiny_target_dir, data, out, kind="draft-lm")
    assert code == 0, err
    unfinished = unfinished_copy(out, tmp_path / "unfinished")
    other = write_conversations(tmp_path / "other.jsonl", 20, seed=7)
    code, _, err = train(capsys, tiny_target_dir, other, unfinished, "--resume", kind="draft-lm")
    assert_bad_input(code, err, "cannot resume", "its --data packed other training rows", "--force")
    code, _, err = train(capsys, tiny_target_dir, data, unfinished, "--resume", kind="draft-lm")
    assert code == 0, err


def test_resume_with_another_target_of_the_same_shape_is_refused(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                                  tiny_target_dir: Path, data: Path,
                                                                  finished_run: Path) -> None:
    """Same config (so the same config fingerprint), one weight changed: the weights fingerprint tells."""
    target = shutil.copytree(tiny_target_dir, tmp_path / "target")
    weights = load_file(str(target / "model.safetensors"))
    name = next(k for k in sorted(weights) if k.endswith("mlp.down_proj.weight"))
    weights[name] = weights[name] * 1.5
    save_file(weights, str(target / "model.safetensors"), {"format": "pt"})
    out = unfinished_copy(finished_run, tmp_path / "out")
    code, _, err = train(capsys, target, data, out, "--resume")
    assert_bad_input(code, err, "cannot resume", "trained against another target", "the run's own --target")


def test_resume_as_another_drafter_kind_is_refused(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                   tiny_target_dir: Path, data: Path, finished_run: Path) -> None:
    out = unfinished_copy(finished_run, tmp_path / "out")
    code, _, err = train(capsys, tiny_target_dir, data, out, "--resume", kind="dflash")
    assert_bad_input(code, err, "cannot resume", "it trains a mtp drafter, not a dflash one", "--drafter mtp")


def test_resume_from_a_checkpoint_that_predates_the_input_records(capsys: pytest.CaptureFixture[str],
                                                                  tmp_path: Path, tiny_target_dir: Path, data: Path,
                                                                  finished_run: Path) -> None:
    """A checkpoint written before kind, target weights and data were recorded still resumes."""
    out = unfinished_copy(finished_run, tmp_path / "out")
    state_file = out / "training" / "checkpoint" / "trainer_state.json"
    state = json.loads(state_file.read_text())
    for key in checkpoint_module.INPUT_KEYS:
        del state[key]
    state_file.write_text(json.dumps(state))
    code, _, err = train(capsys, tiny_target_dir, data, out, "--resume")
    assert code == 0, err


# ----- 3. bounds -----


@pytest.mark.parametrize(("setting", "needles"), [
    ("grad_clip=-1", ("grad_clip=-1.0 is out of range", ">= 0", "(0 = no clipping)")),
    ("lr=1e30", ("lr=1e+30 is out of range", ">= 0", "<= 10")),
    ("lr=-1", ("lr=-1.0 is out of range", ">= 0")),
    ("lr=nan", ("lr=nan is not a finite number",)),
    ("steps=0", ("steps", ">= 1", "0")),
    ("batch_size=0", ("batch_size", ">= 1", "0")),
    ("warmup=-5", ("warmup=-5 is out of range", ">= 0")),
    ("min_lr_ratio=2", ("min_lr_ratio=2.0 is out of range", "<= 1")),
    ("intermediate_size=1000000000", ("intermediate_size=1000000000 is out of range", "<= 262144")),
    ("num_depths=100000", ("num_depths=100000 is out of range",)),
    ("ckpt_every=0", ("ckpt_every", ">= 1", "0")),
    ("seed=-1", ("seed=-1 is out of range",)),
])
def test_settings_out_of_range_are_refused_before_work(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                       tiny_target_dir: Path, data: Path, setting: str,
                                                       needles: tuple[str, ...]) -> None:
    out = tmp_path / "out"
    code, _, err = train(capsys, tiny_target_dir, data, out, setting)
    assert_bad_input(code, err, *needles)
    assert not out.exists()


def test_a_block_drafters_tap_depth_is_bounded(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                               tiny_target_dir: Path, data: Path) -> None:
    code, _, err = train(capsys, tiny_target_dir, data, tmp_path / "out", "taps_for_depth=-5", kind="dfly")
    assert_bad_input(code, err, "taps_for_depth=-5 is out of range", ">= 1", "the layer count of the target")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("minutes", ["nan", "inf", "0", "-1"])
def test_max_minutes_must_be_a_finite_positive_number(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                      tiny_target_dir: Path, data: Path, minutes: str) -> None:
    code, _, err = train(capsys, tiny_target_dir, data, tmp_path / "out", "--max-minutes", minutes)
    assert_bad_input(code, err, "--max-minutes must be a number of minutes > 0")


def test_features_seq_len_beyond_the_context_is_refused(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                        tiny_target_dir: Path, data: Path) -> None:
    from conftest import TINY_CONTEXT

    out = tmp_path / "cache"
    code, _, err = run_cli(capsys, "features", "--target", tiny_target_dir, "--data", data, "--out", out,
                           "--seq-len", 10**8)
    assert_bad_input(code, err, "--seq-len 100000000 is longer than the target's context",
                     f"--seq-len {TINY_CONTEXT} or less")
    assert not out.exists()


def test_a_feature_shard_larger_than_memory_is_refused_before_work(capsys: pytest.CaptureFixture[str],
                                                                   tmp_path: Path, tiny_target_dir: Path,
                                                                   data: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from angelspec.train import runs

    monkeypatch.setattr(runs, "available_memory_bytes", lambda: 1 << 30)  # a 1 GiB machine
    out = tmp_path / "cache"
    code, _, err = run_cli(capsys, "features", "--target", tiny_target_dir, "--data", data, "--out", out,
                           "--seq-len", 256, "--rows-per-shard", 60000)
    assert_bad_input(code, err, "--rows-per-shard 60000 x --seq-len 256", "1.0 GiB available",
                     "lower --rows-per-shard or --seq-len")
    assert not out.exists()


def test_every_shipped_preset_is_within_the_bounds() -> None:
    from angelspec.train.registry import TRAINABLE_DRAFTERS, get_trainer
    from angelspec.train.safety import check_bounds
    from angelspec.train.target import PRESETS as TARGET_PRESETS

    for kind in TRAINABLE_DRAFTERS:
        _, presets, _ = get_trainer(kind)
        for make in presets.values():
            check_bounds(make())
    for make in TARGET_PRESETS.values():
        check_bounds(make())


def test_grad_clip_zero_measures_the_norm_without_clipping() -> None:
    p = torch.nn.Parameter(torch.zeros(4))
    p.grad = torch.full((4,), 3.0)
    norm = loop_module.clip_gradients([p], 0.0, "none")
    assert float(norm) == pytest.approx(6.0)
    assert torch.equal(p.grad, torch.full((4,), 3.0))


# ----- 4. file-system faults -----


def _fail_when(predicate, err: int = errno.ENOSPC):  # noqa: ANN001, ANN202 - a test double
    def fake(*args: object, **kwargs: object) -> None:
        if predicate(*args):
            raise OSError(err, os.strerror(err), str(args[0]))
        return real(*args, **kwargs)
    real = checkpoint_module.write_json_atomic
    return fake


def test_a_full_disk_while_checkpointing_is_one_line_and_leaves_nothing_half_written(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, tiny_target_dir: Path, data: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The second checkpoint (step 3) hits a full disk: one line, the step-2 checkpoint intact, no temp folder
    beside it, no model exported, the lock gone; once there is room, --resume finishes the run."""
    calls = []

    def second_trainer_state(path: object, *_: object) -> bool:
        if Path(str(path)).name == checkpoint_module.TRAINER_STATE:
            calls.append(path)
            return len(calls) == 2
        return False

    monkeypatch.setattr(checkpoint_module, "write_json_atomic", _fail_when(second_trainer_state))
    out = tmp_path / "out"
    code, _, err = train(capsys, tiny_target_dir, data, out)
    assert_bad_input(code, err, f"training into {out} stopped", "No space left on device", "free some space",
                     "--resume")
    assert_not_exported(out)
    assert checkpoint_step(out) == 2
    monkeypatch.undo()
    code, _, err = train(capsys, tiny_target_dir, data, out, "--resume")
    assert code == 0, err


def test_a_writer_that_fails_on_a_full_disk_without_an_errno_is_one_line(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, tiny_target_dir: Path, data: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.save reports a full disk as a RuntimeError: with the disk (nearly) full that is one line too, and the
    temp checkpoint folder is gone; on a disk with room the same error stays a bug with its traceback."""
    from angelspec.train import safety

    def failing_save(*_: object, **__: object) -> None:
        raise RuntimeError("[enforce fail at inline_container.cc] PytorchStreamWriter failed writing file data/0")

    monkeypatch.setattr(checkpoint_module.torch, "save", failing_save)
    monkeypatch.setattr(safety, "disk_full", lambda folder: True)
    out = tmp_path / "out"
    code, _, err = train(capsys, tiny_target_dir, data, out)
    assert_bad_input(code, err, "PytorchStreamWriter failed writing file", "the disk is full")
    assert_not_exported(out)
    monkeypatch.setattr(safety, "disk_full", lambda folder: False)
    with pytest.raises(RuntimeError, match="PytorchStreamWriter"):
        train(capsys, tiny_target_dir, data, tmp_path / "out2")


def test_a_read_only_file_system_mid_run_is_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                     tiny_target_dir: Path, data: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(checkpoint_module, "write_json_atomic", _fail_when(lambda *_: True, errno.EROFS))
    out = tmp_path / "out"
    code, _, err = train(capsys, tiny_target_dir, data, out)
    assert_bad_input(code, err, "Read-only file system", "give --out a writable folder")
    assert_not_exported(out)


def test_an_unwritable_out_folder_is_refused_before_work(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                         tiny_target_dir: Path, data: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "out"
    out.mkdir()
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if Path(p) == out else real(p, mode, **kw))
    code, _, err = train(capsys, tiny_target_dir, data, out)
    assert_bad_input(code, err, f"--out {out / 'config.json'}", "is not writable")
    assert list(out.iterdir()) == []


def test_an_out_folder_removed_during_the_run_is_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                          tiny_target_dir: Path, data: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "out"
    real = loop_module.checkpoint_or_stop

    def then_vanish(step: int, *args: object) -> bool:
        stop = real(step, *args)
        if step == 1:
            shutil.rmtree(out / "training")
        return stop

    monkeypatch.setattr(loop_module, "checkpoint_or_stop", then_vanish)
    code, _, err = train(capsys, tiny_target_dir, data, out)
    assert_bad_input(code, err, "vanished while it ran", "do not remove --out during training")
    assert not (out / "config.json").exists()


def test_a_log_line_that_cannot_be_written_is_cut_back_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log = tmp_path / "train_log.jsonl"
    loop_module.append_log(log, {"step": 1}, True)
    real = os.write

    def half(fd: int, data: bytes) -> int:
        real(fd, data[: len(data) // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "write", half)
    with pytest.raises(OSError):
        loop_module.append_log(log, {"step": 2, "loss": 1.0}, True)
    assert log.read_text() == '{"step": 1}\n'


@pytest.mark.parametrize("which", ["data", "target", "data inside"])
def test_out_may_not_be_an_input(capsys: pytest.CaptureFixture[str], tmp_path: Path, tiny_target_dir: Path,
                                 data: Path, which: str) -> None:
    target = shutil.copytree(tiny_target_dir, tmp_path / "target")
    if which == "data":
        out, flag = data, "--data"
    elif which == "target":
        out, flag = target, "--target"
    else:
        out, flag = tmp_path / "run", "--data"
        out.mkdir()
        data = Path(shutil.copy(data, out / "conv.jsonl"))
    before = sorted(p.name for p in out.iterdir()) if out.is_dir() else None
    code, _, err = train(capsys, target, data, out, "--force")
    assert_bad_input(code, err, f"--out {out} is", f"the input {flag}", "give --out another folder")
    assert (sorted(p.name for p in out.iterdir()) if out.is_dir() else None) == before


# ----- the target a drafter records: its weights -----


def _shipped_target_with_other_weights(dst: Path) -> Path:
    """A copy of the shipped target with one MLP weight scaled: the same config (and config fingerprint)."""
    from angelspec.assets import DEFAULT_TARGET

    target = shutil.copytree(DEFAULT_TARGET, dst)
    weights = load_file(str(target / "model.safetensors"))
    name = next(k for k in sorted(weights) if k.endswith("mlp.down_proj.weight"))
    weights[name] = weights[name] * 1.5
    save_file(weights, str(target / "model.safetensors"), {"format": "pt"})
    return target


def test_shipped_drafters_load_with_the_shipped_target_and_are_refused_with_another(tmp_path: Path) -> None:
    from angelspec.assets import DEFAULT_DRAFTERS, DEFAULT_TARGET
    from angelspec.decoding.drafters.base import DrafterMismatchError
    from angelspec.decoding.loading import resolve_drafter
    from angelspec.models.hf_io import load_target

    folders = [*sorted(p for p in Path(DEFAULT_DRAFTERS).iterdir() if (p / "config.json").is_file()),
               Path(DEFAULT_TARGET).parent / "draft_lm"]
    assert len(folders) >= 5
    shipped = load_target(DEFAULT_TARGET)
    other_dir = _shipped_target_with_other_weights(tmp_path / "target")
    other = load_target(other_dir)
    assert other.config.fingerprint() == shipped.config.fingerprint()
    for folder in folders:
        assert resolve_drafter(str(folder), shipped, DEFAULT_TARGET) is not None
        with pytest.raises(DrafterMismatchError, match="trained for a target with weights fingerprint"):
            resolve_drafter(str(folder), other, other_dir)


def test_generate_with_a_drafter_for_other_weights_is_one_line(capsys: pytest.CaptureFixture[str],
                                                              tmp_path: Path) -> None:
    from angelspec.assets import DEFAULT_DRAFTERS

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "def add(x, y):"}) + "\n")
    target = _shipped_target_with_other_weights(tmp_path / "target")
    code, _, err = run_cli(capsys, "generate", "--prompts", prompts, "--out", tmp_path / "o.jsonl", "--target", target,
                           "--drafter", Path(DEFAULT_DRAFTERS) / "mtp", "--max-new-tokens", 2, "--quiet")
    assert_bad_input(code, err, "does not fit the target", "weights fingerprint", "--target")


def test_the_weights_fingerprint_follows_the_weights_not_the_load_dtype(tiny_target_dir: Path,
                                                                       finished_run: Path) -> None:
    """fp32 and bf16 loads of one target share the id the drafter records, which is also what its checkpoint
    records for --resume."""
    from angelspec.data.fingerprint import target_weights_fingerprint
    from angelspec.models.hf_io import load_target

    fp32 = target_weights_fingerprint(load_target(tiny_target_dir))
    assert target_weights_fingerprint(load_target(tiny_target_dir, dtype=torch.bfloat16)) == fp32
    meta = json.loads((finished_run / "config.json").read_text())["angelspec"]
    assert meta["target_weights"] == fp32
    assert json.loads((finished_run / "training" / "checkpoint" / "trainer_state.json").read_text())[
        "target_weights"] == fp32


# ----- one weights fingerprint everywhere: export, import, --init-from, rollout, feature caches -----


def test_the_weights_id_of_a_folder_is_the_loaded_models(tmp_path: Path) -> None:
    """`target_weights_id` reads the weights from the folder (nothing loaded: an export, an import) and gives the id
    of a loaded model and the one the shipped drafters record, tied LM head included."""
    from angelspec.assets import DEFAULT_DRAFTERS, DEFAULT_TARGET
    from angelspec.data.fingerprint import target_weights_fingerprint
    from angelspec.decoding.loading import target_weights_id
    from angelspec.models.hf_io import load_target

    fp = target_weights_id(DEFAULT_TARGET)
    assert fp == target_weights_fingerprint(load_target(DEFAULT_TARGET))
    assert fp == target_weights_id(DEFAULT_TARGET, load_target(DEFAULT_TARGET, parts="head"))
    assert json.loads((Path(DEFAULT_DRAFTERS) / "mtp" / "config.json").read_text())["angelspec"][
        "target_weights"] == fp
    assert target_weights_id(_shipped_target_with_other_weights(tmp_path / "other")) != fp


@pytest.mark.parametrize("name", ["mtp", "eagle3", "dfly", "draft_lm"])
def test_export_for_a_target_with_other_weights_is_refused(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                          name: str) -> None:
    from angelspec.assets import DEFAULT_DRAFTERS, DEFAULT_TARGET

    drafter = Path(DEFAULT_TARGET).parent / name if name == "draft_lm" else Path(DEFAULT_DRAFTERS) / name
    other = _shipped_target_with_other_weights(tmp_path / "target")
    code, _, err = run_cli(capsys, "export", drafter, tmp_path / "out", "--target", other)
    assert_bad_input(code, err, "was trained for a target with weights fingerprint", "--target")
    assert not (tmp_path / "out").exists()
    code, _, err = run_cli(capsys, "export", drafter, tmp_path / "out")  # its own target
    assert code == 0, err


def test_import_for_a_target_with_other_weights_is_refused_and_records_the_weights(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from angelspec.assets import DEFAULT_DRAFTERS, DEFAULT_TARGET
    from angelspec.decoding.loading import target_weights_id

    code, _, err = run_cli(capsys, "export", Path(DEFAULT_DRAFTERS) / "eagle3", tmp_path / "vllm")
    assert code == 0, err
    other = _shipped_target_with_other_weights(tmp_path / "target")
    code, _, err = run_cli(capsys, "import", tmp_path / "vllm", tmp_path / "back", "--target", other)
    assert_bad_input(code, err, "was exported for a target with weights fingerprint", "--target")
    assert not (tmp_path / "back").exists()
    vllm_cfg = tmp_path / "vllm" / "config.json"  # a folder trained elsewhere records no weights: the target's
    raw = json.loads(vllm_cfg.read_text())
    del raw["angelspec"]
    vllm_cfg.write_text(json.dumps(raw))
    code, _, err = run_cli(capsys, "import", tmp_path / "vllm", tmp_path / "back", "--target", other)
    assert code == 0, err
    meta = json.loads((tmp_path / "back" / "config.json").read_text())["angelspec"]
    assert meta["target_weights"] == target_weights_id(other) != target_weights_id(DEFAULT_TARGET)


def test_draft_vocab_for_a_target_with_other_weights_is_refused(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                                data: Path) -> None:
    from angelspec.assets import DEFAULT_DRAFTERS

    other = _shipped_target_with_other_weights(tmp_path / "target")
    code, _, err = run_cli(capsys, "draft-vocab", "--drafter", Path(DEFAULT_DRAFTERS) / "mtp", "--data", data,
                           "--size", 64, "--target", other, "--out", tmp_path / "out")
    assert_bad_input(code, err, "was trained for a target with weights fingerprint", "--target")
    assert not (tmp_path / "out").exists()


def test_init_from_a_drafter_for_other_weights_is_refused(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                         data: Path) -> None:
    from angelspec.assets import DEFAULT_DRAFTERS

    other = _shipped_target_with_other_weights(tmp_path / "target")
    code, _, err = run_cli(capsys, "train", "--drafter", "dfly", "--target", other, "--data", data, "--out",
                           tmp_path / "out", "--init-from", Path(DEFAULT_DRAFTERS) / "dfly", "--only", "confidence",
                           "--quiet", "steps=1")
    assert_bad_input(code, err, f"init_from={Path(DEFAULT_DRAFTERS) / 'dfly'} was trained for a target with weights "
                     "fingerprint", "--target")
    assert not (tmp_path / "out").exists()


def _rollout(capsys: pytest.CaptureFixture[str], target: Path, prompts: Path, out: Path,
             *extra: object) -> tuple[int, str, str]:
    return run_cli(capsys, "rollout", "--target", target, "--prompts", prompts, "--out", out, "--max-new-tokens", 2,
                   "--quiet", *extra)


def _kill_after_first_line(out: Path) -> None:
    """`out` as a kill leaves it after its first chunk of one line (a rollout run with --batch-size 1)."""
    progress = out.with_name(out.name + ".progress.json")
    state = json.loads(progress.read_text())
    first = out.read_bytes().split(b"\n")[0] + b"\n"
    out.write_bytes(first)
    state.update(lines_done=1, bytes=len(first), complete=False)
    progress.write_text(json.dumps(state))


def test_rollout_records_the_weights_id_and_refuses_to_resume_with_other_weights(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, tiny_target_dir: Path, data: Path) -> None:
    from angelspec.data.fingerprint import model_fingerprint
    from angelspec.decoding.loading import target_weights_id
    from angelspec.models.hf_io import load_target

    out = tmp_path / "r.jsonl"
    code, _, err = _rollout(capsys, tiny_target_dir, data, out, "--batch-size", 1)
    assert code == 0, err
    whole = out.read_bytes()
    progress = out.with_name(out.name + ".progress.json")
    config = json.loads(progress.read_text())["config"]
    assert config["target_weights"] == target_weights_id(tiny_target_dir) and config["target_dtype"] == "float32"
    _kill_after_first_line(out)
    target = shutil.copytree(tiny_target_dir, tmp_path / "target")
    weights = load_file(str(target / "model.safetensors"))
    name = next(k for k in sorted(weights) if k.endswith("mlp.down_proj.weight"))
    weights[name] = weights[name] * 1.5
    save_file(weights, str(target / "model.safetensors"), {"format": "pt"})
    code, _, err = _rollout(capsys, target, data, out, "--batch-size", 1, "--resume")
    assert_bad_input(code, err, "cannot resume", "target_weights", "--force")
    # A sidecar written before the weights id (its load-dtype fingerprint under "target") still resumes.
    state = json.loads(progress.read_text())
    for key in ("target_weights", "target_dtype"):
        del state["config"][key]
    state["config"]["target"] = model_fingerprint(load_target(tiny_target_dir))
    progress.write_text(json.dumps(state))
    code, _, err = _rollout(capsys, tiny_target_dir, data, out, "--batch-size", 1, "--resume")
    assert code == 0, err
    assert out.read_bytes() == whole


def test_a_feature_cache_records_the_weights_id_and_dtype_and_old_caches_still_open(
        tiny_target_dir: Path, tmp_path: Path, data: Path) -> None:
    from angelspec.data.fingerprint import model_fingerprint
    from angelspec.decoding.loading import target_weights_id
    from angelspec.models.hf_io import load_target
    from angelspec.train.features import FeatureCacheError, OfflineFeatureCache, build_feature_cache

    cache = tmp_path / "cache"
    build_feature_cache(tiny_target_dir, data, cache, seq_len=64, log=lambda *_: None)
    manifest_file = cache / "manifest.json"
    manifest = json.loads(manifest_file.read_text())
    assert manifest["target_weights"] == target_weights_id(tiny_target_dir) and manifest["target_dtype"] == "float32"
    assert "target_fingerprint" not in manifest
    fp32, bf16 = load_target(tiny_target_dir), load_target(tiny_target_dir, dtype=torch.bfloat16)
    OfflineFeatureCache.open(cache, target=fp32)
    with pytest.raises(FeatureCacheError, match="in float32, but this run loads the target in bfloat16"):
        OfflineFeatureCache.open(cache, target=bf16)  # same weights id, features of another dtype
    head = load_target(tiny_target_dir, parts="head")
    OfflineFeatureCache.open(cache, target=head, target_dir=tiny_target_dir)
    legacy = {k: v for k, v in manifest.items() if k not in ("target_weights", "target_dtype")}
    manifest_file.write_text(json.dumps({**legacy, "target_fingerprint": model_fingerprint(fp32)}))
    OfflineFeatureCache.open(cache, target=head, target_dir=tiny_target_dir)
    with pytest.raises(FeatureCacheError, match="another model"):
        OfflineFeatureCache.open(cache, target=bf16)
