"""The evaluation server (`angelspec.eval.server`): evaluates each new checkpoint of a run once, with the real
engine, into one consistent log, also across a killed-and-resumed trainer; never reads a half-replaced
checkpoint; draws the learning curve from the log.

The tiny 2-layer target and `tiny_debug` DFly runs of a few steps (seconds)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import QUIET, write_conversations, write_domain_prompts

from angelspec.data.prompts import load_prompts
from angelspec.decoding.loading import load_target_and_tokenizer
from angelspec.eval.prompts import eval_prompts
from angelspec.eval.server import (
    EvalServerSettings,
    latest_checkpoint,
    plot_learning_curves,
    read_eval_log,
    snapshot_checkpoint,
    watch,
)

pytestmark = pytest.mark.usefixtures("one_thread")
SETTINGS = EvalServerSettings(limit=1, max_new_tokens=12, poll_s=0.0)


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_conversations(tmp_path_factory.mktemp("server_data") / "conv.jsonl", 40, seed=5)


@pytest.fixture(scope="module")
def target_and_prompts(tmp_path_factory: pytest.TempPathFactory, tiny_target_dir: Path):
    model, tok = load_target_and_tokenizer(tiny_target_dir)
    path = write_domain_prompts(tmp_path_factory.mktemp("server_prompts") / "p.jsonl")
    prompts = eval_prompts(tok, load_prompts(path), context=model.config.max_position_embeddings, source=str(path))
    return model, prompts


def _train(tiny_target_dir: Path, data: Path, out: Path, steps: int, resume: bool = False) -> None:
    from angelspec.train.block import tiny_debug, train_dfly

    cfg = replace(tiny_debug(), steps=steps, ckpt_every=2)
    train_dfly(tiny_target_dir, data, out, config=cfg, resume=resume, **QUIET)


def test_each_checkpoint_is_evaluated_once_across_a_resumed_run(tmp_path, tiny_target_dir, data,
                                                                target_and_prompts) -> None:
    model, prompts = target_and_prompts
    run = tmp_path / "dfly"
    _train(tiny_target_dir, data, run, steps=2)
    assert watch(run, model, tiny_target_dir, prompts, SETTINGS, once=True, log=lambda *_: None) == 1
    # Nothing new: a second look (or a restarted server) evaluates nothing.
    assert watch(run, model, tiny_target_dir, prompts, SETTINGS, once=True, log=lambda *_: None) == 0
    _train(tiny_target_dir, data, run, steps=4, resume=True)  # the trainer resumed and went on
    # The run has finished (train_report.json), so the server stops by itself after the final checkpoint.
    assert watch(run, model, tiny_target_dir, prompts, SETTINGS, log=lambda *_: None) == 1
    log = read_eval_log(run)
    assert [r["step"] for r in log] == [2, 4]
    for rec in log:
        assert rec["temperature"] == 0.0
        assert rec["lossless"] is True  # the real engine at T=0: speculative output == AR output
        assert rec["mal"] >= 1.0 and len(rec["acceptance"]) == rec["num_draft_tokens"] == 4
        assert rec["tokens"] == rec["step"] * 2 * 64  # step x batch x seq_len of tiny_debug
        assert set(rec["domains"]) == {"code", "math", "chat"} and rec["speedup"] > 0
        assert rec["speedup_cpu"] > 0 and all(d["speedup_cpu"] > 0 for d in rec["domains"].values())
    # Snapshots are removed after evaluation; the trainer's own checkpoint is untouched.
    assert not any((run / "training" / "eval_snapshots").iterdir())
    assert latest_checkpoint(run)[1]["step"] == 4


def test_t1_on_request(tmp_path, tiny_target_dir, data, target_and_prompts) -> None:
    model, prompts = target_and_prompts
    run = tmp_path / "dfly"
    _train(tiny_target_dir, data, run, steps=2)
    watch(run, model, tiny_target_dir, prompts, replace(SETTINGS, temperatures=(0.0, 1.0)), once=True,
          log=lambda *_: None)
    log = read_eval_log(run)
    assert [(r["step"], r["temperature"]) for r in log] == [(2, 0.0), (2, 1.0)]
    assert log[1]["lossless"] is None  # not checked token for token at T > 0


def test_a_checkpoint_replaced_while_copying_is_not_used(tmp_path) -> None:
    src = tmp_path / "checkpoint"
    src.mkdir()
    (src / "config.json").write_text("{}")
    (src / "trainer_state.json").write_text(json.dumps({"step": 6}))  # the trainer moved on from step 4
    assert snapshot_checkpoint(src, 4, tmp_path / "snaps") is None
    assert not list((tmp_path / "snaps").iterdir())  # no half copy left behind
    snap = snapshot_checkpoint(src, 6, tmp_path / "snaps")
    assert snap is not None and json.loads((snap / "trainer_state.json").read_text())["step"] == 6


def test_a_torn_log_line_is_skipped_and_the_curve_is_drawn(tmp_path) -> None:
    for name, mals in (("a", [1.2, 1.5]), ("b", [1.1, 1.3])):
        work = tmp_path / name / "training"
        work.mkdir(parents=True)
        lines = [json.dumps({"step": s, "tokens": s * 1000, "temperature": 0.0, "mal": m})
                 for s, m in zip((10, 20), mals, strict=True)]
        (work / "eval_log.jsonl").write_text("\n".join(lines) + '\n{"step": 30, "tok')
        assert [r["step"] for r in read_eval_log(tmp_path / name)] == [10, 20]
    out = plot_learning_curves({"a": tmp_path / "a", "b": tmp_path / "b"}, tmp_path / "curve.png")
    assert out.is_file() and out.stat().st_size > 1000


def test_the_cpu_time_speedup_counts_tokens_per_cpu_second_and_merges() -> None:
    """A trainer sharing the cores stretches the wall clock of one run more than the other; the CPU-time speed-up
    compares tokens per CPU-second of the decoding process instead."""
    from angelspec.decoding.metrics import DecodeMetrics
    from angelspec.eval.server import EvalServerSettings
    from angelspec.eval.speculative import DomainResult, merge_metrics

    ar = DecodeMetrics(num_draft_tokens=4, output_tokens=100, wall_s=10.0, cpu_s=1.0)
    spec = merge_metrics([DecodeMetrics(num_draft_tokens=4, output_tokens=50, wall_s=0.5, cpu_s=0.25),
                          DecodeMetrics(num_draft_tokens=4, output_tokens=50, wall_s=0.5, cpu_s=0.25)])
    r = DomainResult(prompts=2, ar=ar, spec=spec, identical=2)
    assert spec.cpu_s == 0.5 and r.cpu_speedup == pytest.approx(2.0) and r.speedup == pytest.approx(10.0)
    assert DomainResult(prompts=1, ar=DecodeMetrics(), spec=spec, identical=1).cpu_speedup == 0.0
    assert EvalServerSettings().threads == 1
    from angelspec.errors import UsageError

    with pytest.raises(UsageError, match="threads must be at least 1"):
        EvalServerSettings(threads=0)


def test_a_missing_run_folder_is_a_clear_error(tmp_path) -> None:
    from angelspec.errors import UsageError
    from angelspec.eval.server import run_eval_server

    with pytest.raises(UsageError, match="does not exist"):
        run_eval_server(tmp_path / "nope")


def test_a_resumed_run_keeps_its_server_until_the_trainer_exits(tmp_path, tiny_target_dir, data,
                                                                target_and_prompts) -> None:
    """A run stopped by --max-minutes wrote train_report.json; when it is resumed, the server started beside the
    resumed trainer must not take that report for the end of the run: it watches until the trainer exits and
    evaluates the checkpoints written meanwhile."""
    import subprocess
    import sys

    model, prompts = target_and_prompts
    run = tmp_path / "dfly"
    _train(tiny_target_dir, data, run, steps=2)  # the first segment: its report and checkpoint are there
    assert watch(run, model, tiny_target_dir, prompts, SETTINGS, once=True, log=lambda *_: None) == 1
    trainer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    looks: list[int] = []

    def sleep(_: float) -> None:  # the resumed trainer makes progress between the server's looks, then exits
        looks.append(1)
        if len(looks) == 1:
            _train(tiny_target_dir, data, run, steps=4, resume=True)
        elif len(looks) == 2:
            trainer.kill()
            trainer.wait()

    try:
        n = watch(run, model, tiny_target_dir, prompts, SETTINGS, trainer_pid=trainer.pid, log=lambda *_: None,
                  sleep=sleep)
    finally:
        trainer.kill()
        trainer.wait()
    assert n == 1 and [r["step"] for r in read_eval_log(run)] == [2, 4]


def test_pid_alive_sees_an_unreaped_child_as_gone() -> None:
    import subprocess
    import sys
    import time

    from angelspec.fileio import pid_alive

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.time() + 30
    while pid_alive(child.pid) and time.time() < deadline:  # exited but not reaped: a zombie
        time.sleep(0.05)
    assert not pid_alive(child.pid)
    child.wait()
    assert not pid_alive(child.pid)


def test_one_server_per_run(tmp_path, tiny_target_dir, data, target_and_prompts) -> None:
    """A second server on the same run does nothing while the first holds the lock; a stale lock is taken over."""
    import os

    from angelspec.eval.server import LOCK

    model, prompts = target_and_prompts
    run = tmp_path / "dfly"
    _train(tiny_target_dir, data, run, steps=2)
    lock = run / "training" / LOCK
    lock.write_text(str(os.getppid()))  # a live process that is not us
    assert watch(run, model, tiny_target_dir, prompts, SETTINGS, once=True, log=lambda *_: None) == 0
    lock.write_text("999999999")  # no such process: the lock is stale
    assert watch(run, model, tiny_target_dir, prompts, SETTINGS, once=True, log=lambda *_: None) == 1
    assert not lock.exists()  # released on exit


def test_train_eval_every_starts_a_server_that_logs_every_checkpoint(tmp_path, tiny_target_dir, data) -> None:
    import subprocess
    import sys
    import time

    out = tmp_path / "run"
    prompts = write_domain_prompts(tmp_path / "p.jsonl")
    cmd = [sys.executable, "-m", "angelspec.cli", "train", "--drafter", "dfly", "--preset", "tiny_debug", "--target",
           str(tiny_target_dir), "--data", str(data), "--out", str(out), "--eval-every", "1",
           "--eval-prompts", str(prompts), "--quiet", "steps=2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "eval-server: pid" in proc.stdout
    deadline = time.time() + 240
    while time.time() < deadline and 2 not in [r["step"] for r in read_eval_log(out)]:
        time.sleep(1)
    # The final checkpoint is always evaluated; an earlier one the trainer replaced before the server (still
    # loading here) got to it is skipped: the server never holds the trainer back.
    steps = [r["step"] for r in read_eval_log(out)]
    assert steps[-1] == 2 and steps == sorted(set(steps)) and set(steps) <= {1, 2}
    log = out.with_name("run.eval-server.log").read_text()
    assert "evaluated 2 checkpoint(s)" in log or "step 2" in log
