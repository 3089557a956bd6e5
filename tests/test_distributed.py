"""Data-parallel drafter training under torchrun equals single-process training on the same global batch.

Two gloo processes on CPU (about 6 s per launch on 2 cores) train a tiny preset with a global batch of 4 rows,
2 per rank; a single process trains the same 4 rows per step: the MTP drafter for 3 steps (LK^α cold start for
one step, then e2e TV; its losses need the global-batch denominators) and the draft LM for 4 steps (the causal-LM
loop). An FSDP2 run stopped after its first step resumes bit-identical to an uninterrupted one (the optimizer state
is saved whole and re-sharded). The unit tests of the helpers need no process group.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from conftest import synthetic_sentences


def _gloo_available() -> bool:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        return False
    try:
        import torch.distributed.run  # noqa: F401
    except ImportError:
        return False
    return True


needs_gloo = pytest.mark.skipif(not _gloo_available(), reason="torch.distributed with the gloo backend (and "
                                "torch.distributed.run, i.e. torchrun) is not available in this torch build")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def conversations(tmp_path_factory):
    path = tmp_path_factory.mktemp("dist_data") / "conv.jsonl"
    lines = list(synthetic_sentences(60, seed=7))
    with open(path, "w") as f:
        for q, a in zip(lines[::2], lines[1::2], strict=False):
            f.write(json.dumps({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]})
                    + "\n")
    return path


@pytest.fixture(scope="module")
def single_process_runs(tmp_path_factory, tiny_target_dir, conversations):
    """The references, one process each, global batch 4: {drafter kind: output folder}."""
    from angelspec.train.draft_lm import draft_lm_tiny_debug, train_draft_lm
    from angelspec.train.mtp import tiny_debug, train_mtp

    root = tmp_path_factory.mktemp("dist_ref")
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train_mtp(tiny_target_dir, conversations, root / "mtp", config=replace(tiny_debug(), batch_size=4),
                  progress=False, log=lambda *_: None)
        train_draft_lm(tiny_target_dir, conversations, root / "draft-lm", config=draft_lm_tiny_debug(),
                       progress=False, log=lambda *_: None)
    finally:
        torch.set_num_threads(n)
    return {"mtp": root / "mtp", "draft-lm": root / "draft-lm"}


def _torchrun(drafter: str, strategy: str, target, data, out, *extra: str) -> subprocess.CompletedProcess:
    """`torchrun --nproc_per_node 2` with this interpreter (same venv), one thread per rank, a free port; `extra`
    CLI arguments go after the fixed ones."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(_free_port()), "-m", "angelspec.cli", "train", "--drafter", drafter,
           "--target", str(target), "--data", str(data), "--out", str(out), "--preset", "tiny_debug", "--quiet",
           "--distributed", strategy, *extra, "batch_size=4"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ANGELSPEC_DIST_BACKEND": "gloo",  # gloo and the CPU on a GPU host
           "ANGELSPEC_DEVICE": "cpu"}
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def launched(tmp_path_factory, tiny_target_dir, conversations):
    """`launched(drafter, strategy)`: the output folder of an uninterrupted 2-process run, launched once per module
    (the FSDP2 MTP run is also the reference of the resume test)."""
    done = {}

    def run(drafter: str, strategy: str):
        if (drafter, strategy) not in done:
            out = tmp_path_factory.mktemp("dist_runs") / f"{drafter}-{strategy}"
            _check(_torchrun(drafter, strategy, tiny_target_dir, conversations, out), out.parent)
            done[drafter, strategy] = out
        return done[drafter, strategy]

    return run


@needs_gloo
@pytest.mark.parametrize("drafter", ["mtp", "draft-lm"])
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_two_processes_train_the_single_process_model(strategy, drafter, launched, single_process_runs):
    """Tolerance: the two runs add the same per-token terms in a different order (two half-batch sums plus an
    all-reduce vs one full-batch sum), so gradients differ by float32 rounding (~1e-7 relative); AdamW's
    normalised update passes that on almost unchanged over 3-4 steps. 1e-5 relative (atol 1e-6 for entries near
    0) is two orders above that and far below one AdamW update (about lr, 1e-4 to 1e-3 per step here)."""
    from safetensors.torch import load_file

    out = launched(drafter, strategy)
    ref_dir = single_process_runs[drafter]
    ref = load_file(str(ref_dir / "model.safetensors"))
    got = load_file(str(out / "model.safetensors"))
    assert ref.keys() == got.keys()
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")
    report = json.loads((out / "train_report.json").read_text())
    assert report["distributed"] == strategy and report["world_size"] == 2
    assert report["steps"] == json.loads((ref_dir / "train_report.json").read_text())["steps"]
    logs = [json.loads(x) for x in (out / "training" / "train_log.jsonl").read_text().splitlines()]
    ref_logs = [json.loads(x) for x in (ref_dir / "training" / "train_log.jsonl").read_text().splitlines()]
    assert len(logs) == len(ref_logs) == report["steps"]  # log_every=1; rank 0 alone writes the log
    for a, b in zip(logs, ref_logs, strict=True):  # the logged loss is the global-batch loss
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)


def _check(proc: subprocess.CompletedProcess, tmp_path) -> None:
    """Fail with the end of stderr (the whole output goes to a file) when a torchrun launch failed."""
    if proc.returncode != 0:
        log = tmp_path / f"torchrun-{_free_port()}.log"
        log.write_text(f"$ {' '.join(proc.args)}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}")
        pytest.fail(f"torchrun exited with {proc.returncode} (full output in {log}); stderr ends:\n"
                    f"{proc.stderr[-4000:]}")


@needs_gloo
def test_fsdp2_run_stopped_mid_way_resumes_exactly(tmp_path, tiny_target_dir, conversations, launched,
                                                   single_process_runs):
    """Three 2-process FSDP2 launches of the 3-step MTP preset: uninterrupted; stopped after step 1 by the time
    budget (a checkpoint at step 1, the schedule unchanged, as after a kill); resumed from that checkpoint. The
    checkpoint's optimizer state is whole (every AdamW moment has its parameter's full shape, keyed by name, though
    each rank held half of it), and the resumed run ends with the uninterrupted run's weights and losses, bit for
    bit: without the AdamW moments the steps after the resume would differ. The same checkpoint also resumes in a
    single process (the state does not depend on the world size), ending at the single-process run's weights up to
    reduction order (tolerance as above)."""
    import shutil

    from safetensors.torch import load_file

    from angelspec.train.mtp import tiny_debug, train_mtp

    full, cut = launched("mtp", "fsdp2"), tmp_path / "cut"
    _check(_torchrun("mtp", "fsdp2", tiny_target_dir, conversations, cut, "--max-minutes", "1e-9"), tmp_path)
    assert json.loads((cut / "train_report.json").read_text())["steps"] == 1
    ckpt = cut / "training" / "checkpoint"
    weights = load_file(str(ckpt / "model.safetensors"))
    state = torch.load(ckpt / "optimizer.pt", weights_only=True)["state"]
    assert state.keys() == weights.keys()
    assert all(s["exp_avg"].shape == s["exp_avg_sq"].shape == weights[k].shape for k, s in state.items())
    assert all(int(s["step"]) == 1 for s in state.values())
    shutil.copytree(cut, tmp_path / "single")
    train_mtp(tiny_target_dir, conversations, tmp_path / "single", config=replace(tiny_debug(), batch_size=4),
              resume=True, progress=False, log=lambda *_: None)
    ref, got = (load_file(str(d / "model.safetensors")) for d in (single_process_runs["mtp"], tmp_path / "single"))
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")
    _check(_torchrun("mtp", "fsdp2", tiny_target_dir, conversations, cut, "--resume"), tmp_path)
    a, b = load_file(str(full / "model.safetensors")), load_file(str(cut / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    losses = [[json.loads(x)["loss"] for x in (d / "training" / "train_log.jsonl").read_text().splitlines()]
              for d in (full, cut)]
    assert losses[0] == losses[1] and len(losses[0]) == 3


@needs_gloo
def test_fsdp2_draft_lm_run_stopped_mid_way_resumes_exactly(tmp_path, tiny_target_dir, conversations, launched):
    """The causal-LM loop (draft LM, embedded target build) resumes an FSDP2 run exactly too."""
    full, cut = launched("draft-lm", "fsdp2"), tmp_path / "cut"
    _check(_torchrun("draft-lm", "fsdp2", tiny_target_dir, conversations, cut, "--max-minutes", "1e-9"), tmp_path)
    assert (cut / "training" / "checkpoint" / "optimizer.pt").is_file()
    _check(_torchrun("draft-lm", "fsdp2", tiny_target_dir, conversations, cut, "--resume"), tmp_path)
    from safetensors.torch import load_file

    a, b = (load_file(str(d / "model.safetensors")) for d in (full, cut))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ----- helpers, no process group -----


def test_single_process_is_a_no_op(monkeypatch):
    from angelspec.train.distributed import DistInfo, init_distributed, resolve_strategy, shard_rows, wrap_model

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    info = init_distributed()
    assert info == DistInfo() and not info.enabled and info.is_main
    assert resolve_strategy(None, info) == resolve_strategy("auto", info) == "none"
    with pytest.raises(ValueError, match="torchrun"):
        resolve_strategy("ddp", info)
    with pytest.raises(ValueError, match="unknown"):
        resolve_strategy("zero3", info)
    m = torch.nn.Linear(2, 2)
    assert wrap_model(m, "none", info) is m
    assert shard_rows([3, 1, 4, 1], info) == [3, 1, 4, 1]


def test_rows_are_contiguous_slices_of_the_global_batch():
    from angelspec.train.distributed import DistInfo, shard_rows

    rows = [7, 2, 9, 4, 0, 5]
    parts = [shard_rows(rows, DistInfo(rank=r, world_size=3, launched=True)) for r in range(3)]
    assert parts == [[7, 2], [9, 4], [0, 5]]
    with pytest.raises(ValueError, match="multiple"):
        shard_rows(rows, DistInfo(rank=0, world_size=4, launched=True))


def test_global_denominators_make_rank_shares_add_up_to_the_full_batch_loss():
    """Two 'ranks' with different valid-token counts: shares computed with summed denominators add up to the
    loss of the whole batch, for every registered loss (the mean of per-rank means would not)."""
    from angelspec.train.losses import LOSSES, LossBatch, LossConfig, global_denominators

    g = torch.Generator().manual_seed(0)
    n, k, v = 10, 3, 11
    student, teacher = torch.randn(n, k, v, generator=g), torch.randn(n, k, v, generator=g)
    labels = torch.randint(0, v, (n, k), generator=g)
    mask = torch.rand(n, k, generator=g) > 0.3
    mask[:6, :] = mask[:6, :] | (torch.arange(k) < 2)  # uneven counts between the halves
    conf = torch.randn(n, k, generator=g)

    def batch(sl: slice) -> LossBatch:
        return LossBatch(student[sl], mask[sl], teacher[sl], labels[sl], conf[sl])

    halves = (slice(0, 6), slice(6, n))
    assert mask[halves[0]].sum() != mask[halves[1]].sum()
    for name, fn in LOSSES.items():
        full = fn(batch(slice(None)), LossConfig()).loss
        shares = []
        for mine, other in (halves, halves[::-1]):
            seen: list[torch.Tensor] = []  # the other rank's local denominators, in call order
            with global_denominators(lambda t, seen=seen: seen.append(t) or t):
                fn(batch(other), LossConfig())
            it = iter(seen)
            with global_denominators(lambda t, it=it: t + next(it)):  # stands in for the all-reduce SUM
                shares.append(fn(batch(mine), LossConfig()).loss)
        torch.testing.assert_close(shares[0] + shares[1], full, rtol=1e-5, atol=1e-6, msg=name)
