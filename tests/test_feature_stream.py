"""The disaggregated feature pipeline, file backend (train/stream.py): feature servers in processes of their own
stream the target's hidden states to a trainer with bounded buffering; training from the stream equals training
with the target inside the step, loss for loss and weight for weight, also when the server and the trainer are
killed with SIGKILL at unplanned moments and restarted; `train --feature-workers N` runs both sides from one
command.

Producers and trainers run as forked processes (real processes, real SIGKILL, no interpreter start-up), except
in the one-command test, which starts a real `angelspec feature-server` process.
"""

from __future__ import annotations

import importlib.util
import json
import multiprocessing
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import QUIET, same_weights, train_log, write_conversations

import angelspec
from angelspec.data.tokenizer import load_tokenizer
from angelspec.models import load_target
from angelspec.models.decoder import TrainInputs
from angelspec.train.data import dataset_identity, pack_conversations, pad_token_id
from angelspec.train.stream import (
    Cursor,
    FeatureProducer,
    FileFeatureStream,
    StreamError,
    StreamPlan,
    serve_files,
    stream_target_id,
    wanted_items,
)

pytestmark = pytest.mark.usefixtures("one_thread")
FORK = multiprocessing.get_context("fork")


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_conversations(tmp_path_factory.mktemp("stream_data") / "conv.jsonl", 40, seed=11)


def start(fn: Callable[..., object], *args: object, **kwargs: object) -> multiprocessing.Process:
    p = FORK.Process(target=fn, args=args, kwargs=kwargs, daemon=True)
    p.start()
    return p


def kill(p: multiprocessing.Process) -> None:
    os.kill(p.pid, signal.SIGKILL)
    p.join()
    assert p.exitcode == -signal.SIGKILL


def wait_for(cond: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def logged_steps(out: Path) -> int:
    path = out / "training" / "train_log.jsonl"
    return len(path.read_text().splitlines()) if path.is_file() else 0


def items(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if "item-" in p.name) if root.is_dir() else []


def test_the_window_bounds_each_rank_and_producers_share_it() -> None:
    published = {(3, 0), (5, 1)}
    cursors = {0: Cursor(2), 1: Cursor(4, end=6), 2: Cursor(0, finished=True)}
    assert wanted_items(cursors, 3, 3, published) == [(2, 0), (4, 0), (4, 1)]  # rank 1 stops at its end
    assert wanted_items({}, 2, 3, set()) == []  # no rank attached: nothing to make yet
    plan = StreamPlan("fp", (1,), {"rows": 8, "seq_len": 64, "digest": "d"}, False, 0, 2, world_size=3)
    every = [(s, r) for s in range(7) for r in range(3)]
    owners = [plan.owner(it, 4) for it in every]
    assert owners == [i % 4 for i in range(len(every))]  # round robin over (step, rank): each item one producer


@pytest.fixture(scope="module")
def plan(tiny_target_dir: Path, data: Path) -> StreamPlan:
    """What `train_mtp` with `tiny_debug` publishes (its tap 0 plus the last layer, 2 rows a step, one rank)."""
    target = load_target(tiny_target_dir)
    rows, _ = pack_conversations(load_tokenizer(tiny_target_dir), data, 64, False, pad_token_id(target.config), 0)
    return StreamPlan(stream_target_id(target, tiny_target_dir), (0, 1),
                      dataset_identity(rows.packed, source=str(data)), False, seed=0, batch_size=2, world_size=1)


def test_producers_stop_when_buffer_batches_wait_and_publish_the_inline_batch(
        tmp_path: Path, tiny_target_dir: Path, data: Path, plan: StreamPlan) -> None:
    root = tmp_path / "stream"
    consumer = FileFeatureStream(root, poll_s=0.005)
    consumer.attach(plan, rank=0, step=0, end=20, log=print)
    servers = [start(serve_files, root, tiny_target_dir, data, worker=w, workers=2, buffer=3, poll_s=0.005,
                     log=lambda *_: None) for w in range(2)]
    try:
        wait_for(lambda: len(items(root)) == 3, "3 batches")
        time.sleep(0.3)
        assert [n.split("-")[2] for n in items(root)] == ["s00000000", "s00000001", "s00000002"]  # and no more
        got = consumer.get(0)
        wait_for(lambda: "s00000003" in "".join(items(root)), "the 4th batch once one was read")
        time.sleep(0.3)
        assert len(items(root)) == 3
    finally:
        consumer.finish(1)
        for s in servers:
            s.join(20)
    assert [s.exitcode for s in servers] == [0, 0]  # they stop once the trainer has finished
    # The batch is the rows of step 0 through the target as one batch, exactly as the trainer's inline forward.
    rows, target = FeatureProducer(tiny_target_dir, data, plan).rows, load_target(tiny_target_dir)
    idx = rows.rows(0, 2)
    b = rows.take(idx)
    with torch.no_grad():
        out = target(b.input_ids, TrainInputs(positions=b.positions, document_ids=b.document_ids, hidden_layers=(0, 1)))
    assert got["rows"].tolist() == idx and torch.equal(got["input_ids"], b.input_ids)
    assert torch.equal(got["hidden.0"], out.hidden[0]) and torch.equal(got["hidden.1"], out.hidden[1])


def test_a_server_for_another_target_or_data_is_refused_and_the_trainer_says_why(
        tmp_path: Path, tiny_target_dir: Path, data: Path, plan: StreamPlan) -> None:
    from angelspec.train.mtp import tiny_debug, train_mtp

    other = write_conversations(tmp_path / "other.jsonl", 40, seed=12)
    with pytest.raises(StreamError, match="start the server with the trainer's --data"):
        FeatureProducer(tiny_target_dir, other, plan)
    with pytest.raises(StreamError, match="is not the trainer's"):
        FeatureProducer(tiny_target_dir, data, replace(plan, target_fingerprint="0" * 16))
    root = tmp_path / "stream"
    server = start(serve_files, root, tiny_target_dir, other, poll_s=0.005, log=lambda *_: None)
    with pytest.raises(StreamError, match="feature server of .* failed: .* start the server with the trainer's --data"):
        train_mtp(tiny_target_dir, data, tmp_path / "mtp", config=replace(tiny_debug(), features=f"stream:{root}"),
                  **QUIET)
    server.join(10)
    assert server.exitcode not in (0, None)


STEPS = 24


@pytest.fixture(scope="module")
def inline(tmp_path_factory: pytest.TempPathFactory, tiny_target_dir: Path, data: Path) -> Path:
    """The reference: MTP with the target inside the step, STEPS steps, a checkpoint every 5."""
    from angelspec.train.mtp import tiny_debug, train_mtp

    out = tmp_path_factory.mktemp("inline") / "mtp"
    train_mtp(tiny_target_dir, data, out, config=replace(tiny_debug(), steps=STEPS, ckpt_every=5), **QUIET)
    return out


def _train(target: Path, data: Path, out: Path, features: str) -> None:
    from angelspec.train.mtp import tiny_debug, train_mtp

    train_mtp(target, data, out, config=replace(tiny_debug(), steps=STEPS, ckpt_every=5, features=features),
              resume=True, **QUIET)


def assert_same_as_inline(out: Path, inline: Path) -> None:
    """Every step logged once, with the inline run's loss (bit for bit), and the same final weights."""
    log, ref = train_log(out), train_log(inline)
    assert [r["step"] for r in log] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in log] == [r["loss"] for r in ref]
    same_weights(out, inline)


def run_with_kills(start_server: Callable[[], multiprocessing.Process],
                   start_trainer: Callable[[], multiprocessing.Process], out: Path, kills: list[tuple[int, str]],
                   timeout_s: float = 60.0) -> None:
    """Start a feature server and a trainer; for each (step, who) of `kills`, once the trainer has logged `step`,
    SIGKILL the server or the trainer wherever it is and start it again; then wait for both to finish cleanly."""
    starters = {"server": start_server, "trainer": start_trainer}
    procs = {who: go() for who, go in starters.items()}
    try:
        for step, who in kills:
            wait_for(lambda s=step: logged_steps(out) >= s, f"step {step}", timeout_s)
            kill(procs[who])
            assert logged_steps(out) < STEPS  # the kill landed before the end
            procs[who] = starters[who]()
        procs["trainer"].join(120)
        procs["server"].join(30)
    finally:
        for p in procs.values():
            if p.is_alive():
                p.kill()
    assert procs["trainer"].exitcode == 0 and procs["server"].exitcode == 0


def test_sigkilled_server_and_trainer_resume_with_nothing_lost_or_repeated(
        tmp_path: Path, tiny_target_dir: Path, data: Path, inline: Path) -> None:
    root, out = tmp_path / "stream", tmp_path / "mtp"
    # The server dies computing, writing a batch or waiting on the full window; the trainer dies past its checkpoint
    # of step 5, so steps 6.. are trained again from the stream.
    run_with_kills(lambda: start(serve_files, root, tiny_target_dir, data, buffer=2, poll_s=0.005, log=lambda *_: None),
                   lambda: start(_train, tiny_target_dir, data, out, f"stream:{root}"), out,
                   kills=[(3, "server"), (8, "trainer"), (13, "server")])
    assert_same_as_inline(out, inline)
    assert json.loads((out / "train_report.json").read_text())["features"] == f"stream:{root}"
    assert items(root) == []  # every batch consumed, no temp file of a killed write left


@pytest.fixture
def ray_cluster() -> Iterator[str]:
    """A local Ray cluster (`ray start --head --block`, stopped by its pid) for the Ray backend; skipped without
    Ray (an optional extra: `pip install 'angelspec[ray]'`)."""
    if importlib.util.find_spec("ray") is None:
        pytest.skip("ray is not installed (pip install 'angelspec[ray]')")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    src = str(Path(angelspec.__file__).parents[1])  # the workers import this very package
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_enable_worker_prestart": "0",
           "PYTHONPATH": os.pathsep.join([src, *filter(None, [os.environ.get("PYTHONPATH")])])}
    temp = tempfile.mkdtemp(prefix="ray")  # short (socket paths) and ours: /tmp/ray/ray_current_cluster stays as is
    head = subprocess.Popen([str(Path(sys.executable).with_name("ray")), "start", "--head", "--block",
                             f"--port={port}", "--num-cpus=2", "--include-dashboard=false", "--disable-usage-stats",
                             f"--temp-dir={temp}"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    saved = os.environ.get("RAY_AUTH_MODE")
    os.environ["RAY_AUTH_MODE"] = "disabled"  # the forked drivers join the cluster as it was started
    try:
        yield f"127.0.0.1:{port}"
    finally:
        head.send_signal(signal.SIGTERM)  # `ray start --block` stops every process it started
        head.wait(60)
        shutil.rmtree(temp, ignore_errors=True)
        if saved is None:
            os.environ.pop("RAY_AUTH_MODE")
        else:
            os.environ["RAY_AUTH_MODE"] = saved


def _train_from_ray(target: Path, data: Path, out: Path, name: str, address: str) -> None:
    os.environ["RAY_ADDRESS"] = address
    _train(target, data, out, f"ray:{name}")


def _broker_checks(address: str, plan: StreamPlan, result: Path) -> None:
    """In a driver of its own: a `take` left waiting by a killed trainer never swallows the batch that its
    successor (the same rank, attached again) waits for, and a server's error reaches the waiting trainer."""
    import ray

    from angelspec.train.stream_ray import _actor, connect

    connect(address)
    broker = _actor("broker").remote(2, ("host", 0))
    first = ray.get(broker.attach.remote(plan.to_json(), 0, 0, 10))
    orphan = broker.take.remote(plan.key, 0, 0, first)  # the killed trainer's call, still waiting in the broker
    second = ray.get(broker.attach.remote(plan.to_json(), 0, 0, 10))
    waiting = broker.take.remote(plan.key, 0, 0, second)
    assert ray.get(broker.claim.remote(plan.key, 5.0)) == (0, 0)
    ray.get(broker.publish.remote(plan.key, 0, 0, [ray.put({"batch": 0})]))
    assert ray.get(orphan) == "stale"
    assert ray.get(ray.get(waiting)[0]) == {"batch": 0}
    ray.get(broker.fail.remote(plan.key, "bad --data"))
    assert ray.get(broker.take.remote(plan.key, 0, 1, second)) == "bad --data"
    result.write_text("ok")


def test_ray_stream_survives_sigkilled_server_and_trainer(ray_cluster: str, tmp_path: Path, tiny_target_dir: Path,
                                                          data: Path, inline: Path, plan: StreamPlan) -> None:
    from angelspec.train.stream_ray import serve_ray

    checks = start(_broker_checks, ray_cluster, plan, tmp_path / "checks")
    out, name = tmp_path / "mtp", "test-kills"
    # A killed server takes its broker and the batches it owns with it; the trainer waits for the next server.
    run_with_kills(lambda: start(serve_ray, name, tiny_target_dir, data, workers=1, buffer=2, address=ray_cluster,
                                 log=lambda *_: None),
                   lambda: start(_train_from_ray, tiny_target_dir, data, out, name, ray_cluster), out,
                   kills=[(3, "server"), (8, "trainer")], timeout_s=120)
    assert_same_as_inline(out, inline)
    checks.join(60)
    assert (tmp_path / "checks").is_file(), "the broker checks failed (see the captured stderr)"


def test_one_command_runs_server_and_trainer_as_separate_processes(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, tiny_target_dir: Path, data: Path) -> None:
    from angelspec.cli import main
    from angelspec.train.mtp import tiny_debug, train_mtp

    train_mtp(tiny_target_dir, data, tmp_path / "inline", config=tiny_debug(), **QUIET)
    out = tmp_path / "mtp"
    assert main(["train", "--drafter", "mtp", "--target", str(tiny_target_dir), "--data", str(data), "--out",
                 str(out), "--preset", "tiny_debug", "--quiet", "--feature-workers", "1"]) == 0
    printed = capsys.readouterr().out
    pid = int(printed.split("feature servers: pid ")[1].split(" ")[0])
    assert pid != os.getpid() and "published 3 feature batches" in (tmp_path / "mtp.feature-server.log").read_text()
    report = json.loads((out / "train_report.json").read_text())
    assert report["features"] == f"stream:{out / 'training' / 'feature-stream'}"
    assert [r["loss"] for r in train_log(out)] == [r["loss"] for r in train_log(tmp_path / "inline")]
    same_weights(out, tmp_path / "inline")


def test_feature_server_usage_errors_are_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                  tiny_target_dir: Path, data: Path) -> None:
    from angelspec.cli import main

    common = ["--target", str(tiny_target_dir), "--data", str(data)]
    for argv, needle in [
        (["feature-server", *common, "--stream", str(tmp_path), "--worker", "2", "--workers", "2"],
         "--worker must be in 0..1"),
        (["feature-server", *common, "--stream", str(tmp_path), "--buffer", "0"], "--buffer must be at least 1"),
        (["train", "--drafter", "mtp", *common, "--out", str(tmp_path / "o"), "--feature-workers", "1",
          f"features=stream:{tmp_path}"], "drop features="),
    ]:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert needle in err and len(err.strip().splitlines()) == 1, err


def test_the_ray_backend_without_ray_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                            tiny_target_dir: Path, data: Path) -> None:
    from angelspec.cli import main

    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` fails, as without the extra
    common = ["--target", str(tiny_target_dir), "--data", str(data)]
    for argv in (["feature-server", *common, "--ray", "feat"],
                 ["train", "--drafter", "mtp", *common, "--out", str(tmp_path / "o"), "--preset", "tiny_debug",
                  "--quiet", "features=ray:feat"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "pip install 'angelspec[ray]'" in err and len(err.strip().splitlines()) == 1, err
