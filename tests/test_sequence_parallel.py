"""Ulysses sequence parallelism (`train.sequence_parallel`, `angelspec train ... --sp N`) trains the single-process
drafter: on packed rows where a document crosses the boundary between the two ranks' shards, the loss and every
parameter gradient of one step equal one process's (fp32, 1e-5), for MTP with TTT (D = 3), EAGLE-3 and a DFly block
drafter (anchors whose blocks run past the shard end, kv heads fewer than the SP ranks); the all-to-all's autograd
function moves exactly the right pieces both ways; and `--sp 2` composes with FSDP2 (and DDP) end to end.

Two gloo processes on CPU: one launch of this file as a script runs the step and exchange checks on both ranks (each
rank also computes the single-process reference itself, on the whole rows, with the same weights); the end-to-end
runs launch the CLI. The tolerance: SP adds the same per-token terms in another order (two shards plus an
all-reduce, other chunks), about 1e-7 relative in fp32.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from angelspec.models.decoder import TrainInputs

D = 3  # TTT depths
RTOL = 1e-5


# ----- the checks one rank runs (under torchrun: `python -m torch.distributed.run ... test_sequence_parallel.py`) -----


def _packed(vocab: int, seq_len: int, half: int):
    """Packed rows whose first row holds a document running across position `half` (the shard boundary), with
    an untrained prompt part, plus padding in the last row."""
    from angelspec.data.packing import Doc, pack_documents

    g = torch.Generator().manual_seed(4)
    docs = [Doc(torch.randint(6, vocab, (n,), generator=g), (torch.rand(n, generator=g) > 0.2).long())
            for n in (10, 9, 5, 8, 7, 3)]
    packed = pack_documents(docs, seq_len, pad_id=0)
    doc = packed.document_ids
    crossing = (doc[:, half - 1] == doc[:, half]) & (doc[:, half] >= 0)
    assert bool(crossing.any()) and bool((doc < 0).any()), doc  # a document crosses the shards; some padding
    return packed


def _grads(model) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def _summed(grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each rank's gradient, summed over ranks (what DDP / FSDP2 do, up to their 1/world scale)."""
    import torch.distributed as dist

    for g in grads.values():
        dist.all_reduce(g)
    return grads


def _same(loss, grads, ref_loss, ref_grads, what: str) -> None:
    torch.testing.assert_close(loss, ref_loss, rtol=RTOL, atol=1e-7, msg=lambda m: f"{what} loss: {m}")
    assert grads.keys() == ref_grads.keys() and len(ref_grads) > 5, what
    for n, g in ref_grads.items():
        assert g.abs().max() > 0, n
        torch.testing.assert_close(grads[n], g, rtol=RTOL, atol=RTOL * float(g.abs().max()),
                                   msg=lambda m, n=n: f"{what} {n}: {m}")


def _features(target, layer_ids, packed, sp=None, halo: int = 0):
    """The trainer's features (`TargetFeatures`, online): (joined taps, teacher logits); under `sp` the shard's taps
    and the teacher of shard + halo, from the target's sequence-parallel forward and the next rank's halo."""
    from angelspec.models.mtp import concat_taps
    from angelspec.train.features import TargetFeatures
    from angelspec.train.sequence_parallel import SequenceParallel

    taps, teacher = TargetFeatures(target, layer_ids, sp=sp or SequenceParallel(), halo=halo)(
        packed, list(range(packed.num_rows)))
    return concat_taps(taps), teacher


def _check_target(sp) -> None:
    """The target's SP forward (embedding, layers, norm on the shard; Ulysses attention over the whole row, one kv
    head for four query heads, so the kv repeat path runs) gives the whole-row forward's taps and final states on the
    shard, and the trainer's features add the teacher logits of the next D + 1 positions from the next rank, online
    and from an offline feature cache."""
    import torch.distributed as dist
    from conftest import tiny_decoder

    from angelspec.train.features import FeatureSpec, OfflineFeatureCache, TargetFeatures
    from angelspec.train.losses import teacher_logits
    from angelspec.train.sequence_parallel import target_forward

    vocab, T = 64, 24
    target = tiny_decoder(vocab=vocab, dtype=torch.float32, heads=4, kv=1, layers=3)
    packed = _packed(vocab, T, T // 2)
    with torch.no_grad():
        ref = target(packed.input_ids, TrainInputs(positions=packed.positions, document_ids=packed.document_ids,
                                                   hidden_layers=(0, 1, 2)))
    out = target_forward(sp, target, packed, (0, 1, 2))

    def close(got, want, what: str) -> None:  # 1e-5 of the tensor's scale (another summation order: ~1e-7)
        torch.testing.assert_close(got, want, rtol=RTOL, atol=RTOL * float(want.abs().max()),
                                   msg=lambda m: f"{what}: {m}")

    for i, (got, want) in enumerate(zip((*out.hidden, out.last_hidden), (*ref.hidden, ref.last_hidden), strict=True)):
        close(got, sp.shard(want), f"target output {i}")
    taps, teacher = _features(target, (0, 2), packed, sp, D + 1)
    close(taps, sp.shard(torch.cat([ref.hidden[0], ref.hidden[2]], dim=-1)), "taps")
    assert teacher.shape[1] == (T // 2 + D + 1 if sp.rank == 0 else T // 2)  # the last rank: no halo
    close(teacher_logits(teacher), ref.logits[:, sp.columns(T, D + 1)], "teacher")
    with tempfile.TemporaryDirectory() as tmp:  # from an offline cache: the shard of the stored rows, the same halo
        cache = OfflineFeatureCache.build(target, FeatureSpec((0, 2)), [packed], Path(tmp) / "cache")
        stored, stored_teacher = TargetFeatures(target, (0, 2), cache, sp=sp, halo=D + 1)(
            packed, list(range(packed.num_rows)))
        close(torch.cat(stored, dim=-1), taps, "cached taps")
        close(teacher_logits(stored_teacher), teacher_logits(teacher), "cached teacher")
    x = torch.arange(2 * 5 * 3.0).view(2, 5, 3) + 100 * sp.rank  # the halo: the next rank's first positions
    halo = sp.halo_from_next(x, 2)
    assert torch.equal(halo, x[:, :2] + 100) if sp.rank == 0 else halo.shape == (2, 0, 3)
    dist.barrier()


def _check_exchange(sp) -> None:
    """to_heads / to_sequence against the gathered whole tensor, their round trip, and their gradients."""
    import torch.distributed as dist

    B, H, S, Dh = 2, 4, 3, 5
    x = torch.randn(B, H, S, Dh, generator=torch.Generator().manual_seed(10 + sp.rank), requires_grad=True)
    parts = [torch.empty_like(x) for _ in range(sp.size)]
    dist.all_gather(parts, x.detach())
    whole = torch.cat(parts, dim=2)  # [B, H, T, Dh], every rank's tokens in order
    n = H // sp.size
    y = sp.to_heads(x)
    assert torch.equal(y, whole[:, sp.rank * n:(sp.rank + 1) * n]), "to_heads"
    assert torch.equal(sp.to_sequence(y), x), "round trip"
    w = torch.randn(y.shape, generator=torch.Generator().manual_seed(20 + sp.rank))
    (y * w).sum().backward()  # d/dx of Σ_ranks <to_heads(x), w> = the w's of my tokens, from every head group
    ws = [torch.empty_like(w) for _ in range(sp.size)]
    dist.all_gather(ws, w)
    want = torch.cat(ws, dim=1)[:, :, sp.rank * S:(sp.rank + 1) * S]  # [B, H, S, Dh]
    assert torch.equal(x.grad, want), "to_heads backward"
    z = torch.randn(B, n, sp.size * S, Dh, generator=torch.Generator().manual_seed(30 + sp.rank), requires_grad=True)
    (sp.to_sequence(z) * w.new_ones(B, H, S, Dh)).sum().backward()
    assert torch.equal(z.grad, torch.ones_like(z)), "to_sequence backward"
    kv = torch.randn(B, 1, S, Dh)  # one kv head for 4 query heads over 2 ranks: repeated per query head first
    assert torch.equal(sp.to_heads(kv, H), sp.to_heads(kv.repeat_interleave(H, dim=1)))


def _check_mtp(sp, kind: str) -> None:
    """One MTP-TTT step (D = 3; MTP: e2e TV and LK^α, and e2e TV on a 16-token draft vocabulary, train_vocab "draft";
    EAGLE-3: e2e TV), chunked head + loss and checkpointed depths as the trainer runs it: SP shares add up to the
    one-process loss and gradients."""
    from conftest import tiny_decoder

    from angelspec.models.eagle3 import Eagle3Config, Eagle3DraftModel
    from angelspec.models.mtp import MTPConfig, MTPDraftModel
    from angelspec.train.distributed import global_sum
    from angelspec.train.losses import LOSSES, LossConfig, global_denominators
    from angelspec.train.ttt import RolloutMemory, mtp_chunked_loss_batch, ttt_rollout

    vocab, T = 64, 24
    target = tiny_decoder(vocab=vocab, dtype=torch.float32, heads=4, kv=2, layers=3)
    if kind == "mtp":
        cfg = replace(MTPConfig.for_target(target.config, num_depths=D), draft_vocab_size=16)
        model = MTPDraftModel(cfg, target.embed_tokens, target.lm_head)
    else:
        cfg = Eagle3Config.for_target(target.config, num_depths=D, target_layer_ids=(0, 1, 2))
        model = Eagle3DraftModel(cfg, target.embed_tokens, target.lm_head)
    model.init_weights(std=0.2, generator=torch.Generator().manual_seed(1))
    if kind == "mtp":
        model.set_draft_vocab(torch.arange(0, vocab, 4))
    packed = _packed(vocab, T, T // 2)
    layers = model.config.target_layer_ids
    whole, sharded = _features(target, layers, packed), _features(target, layers, packed, sp, D + 1)
    config = LossConfig(depth_weights=(0.5, 0.3, 0.2))

    def step(name, vocab_, sp_=None):
        h, t = whole if sp_ is None else sharded  # the target's taps and teacher: whole rows, or SP's shard + halo
        out = ttt_rollout(model, h, packed.input_ids, packed.positions, packed.document_ids, D, sp=sp_,
                          train_vocab=vocab_,
                          memory=RolloutMemory(keep_logits=False, checkpoint_depths=True, query_chunk=5, key_chunk=8))
        clb = mtp_chunked_loss_batch(model, out, packed, t, max_logits=5 * D * vocab, sp=sp_, train_vocab=vocab_)
        with global_denominators(global_sum) if sp_ is not None else nullcontext():
            loss = LOSSES[name](clb, config).loss
        loss.backward()
        return loss.detach(), _grads(model)

    cases = (("e2e_tv", "full"), ("lk_alpha", "full"), ("e2e_tv", "draft")) if kind == "mtp" else (("e2e_tv", "full"),)
    for name, vocab_ in cases:
        ref_loss, ref_grads = step(name, vocab_)
        share, grads = step(name, vocab_, sp)
        _same(global_sum(share), _summed(grads), ref_loss, ref_grads, f"{kind} {name} {vocab_}")


def _check_block(sp) -> None:
    """One DFly step (hidden-correction head, confidence head, D-PACE LK + the confidence term), anchors whose blocks
    cross the shard boundary and invalid ones, one kv head for two query heads, on the whole vocabulary and on a
    16-token draft vocabulary (train_vocab "draft"): SP equals one process."""
    from conftest import tiny_decoder

    from angelspec.models.block.config import BlockDrafterConfig
    from angelspec.models.block.drafter import BlockDrafter
    from angelspec.models.config import DraftShape
    from angelspec.train.block import block_chunked_loss_batch, block_forward_train
    from angelspec.train.distributed import global_sum
    from angelspec.train.losses import LOSSES, LossConfig, global_denominators, with_confidence_term

    vocab, T, Bk = 64, 24, 4
    target = tiny_decoder(vocab=vocab, dtype=torch.float32, layers=4, heads=4, kv=2)
    cfg = BlockDrafterConfig.for_target(target.config, mask_token_id=5, block_size=Bk, num_draft_layers=2,
                                        target_layer_ids=(0, 2, 3), conditioning="dfly", head="hidden", markov_rank=8,
                                        confidence_head=True, draft_vocab_size=16,
                                        shape=DraftShape(num_attention_heads=2, num_key_value_heads=1))
    model = BlockDrafter(cfg, target.embed_tokens, target.lm_head)
    model.init_weights(std=0.2, generator=torch.Generator().manual_seed(1))
    model.set_draft_vocab(torch.arange(1, vocab, 4))
    with torch.no_grad():  # the zero-initialised correction would hide the head
        model.head.down_proj.weight.normal_(0.0, 0.3, generator=torch.Generator().manual_seed(2))
        # Equal fusion weights make their gradient a near-cancelling difference of the taps, where the taps' fp32
        # rounding (SP's target adds in another order) shows at 1.5e-5 of it; in float64 SP matches to 1e-9.
        model.fusion_logits.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(3))
    packed = _packed(vocab, T, T // 2)
    R = packed.num_rows
    # Anchors: blocks ending past the boundary (10, 11), at the boundary (12), near both ends, and two invalid.
    anchors = torch.tensor([[1, 4, 10, 11, 12, 15, 19, 2]] * R)
    valid = torch.ones_like(anchors, dtype=torch.bool)
    valid[:, -1] = False
    valid[-1, 2] = False
    whole, sharded = _features(target, cfg.target_layer_ids, packed), \
        _features(target, cfg.target_layer_ids, packed, sp, Bk - 1)
    objective = with_confidence_term(LOSSES["dpace_lk"], 1.0)
    config = LossConfig()

    def step(vocab_, sp_=None):
        h, t = whole if sp_ is None else sharded  # the target's taps and teacher: whole rows, or SP's shard + halo
        out = block_forward_train(model, h, packed, anchors, valid, sp_, checkpoint_layers=True)
        clb = block_chunked_loss_batch(model, out, t, max_logits=3 * (Bk - 1) * vocab, train_vocab=vocab_)
        with global_denominators(global_sum) if sp_ is not None else nullcontext():
            loss = objective(clb, config).loss
        loss.backward()
        return loss.detach(), _grads(model)

    for vocab_ in ("full", "draft"):
        ref_loss, ref_grads = step(vocab_)
        share, grads = step(vocab_, sp)
        assert any(n.startswith("confidence") for n in ref_grads) and any("fusion" in n for n in ref_grads)
        _same(global_sum(share), _summed(grads), ref_loss, ref_grads, f"dfly {vocab_}")
    assert model.layers[0].attn.n_kv % sp.size  # the kv-head repeat path ran


def _worker() -> None:
    """Entry point of each rank of the launch in `test_one_step_equals_one_process_and_the_exchange_is_exact`."""
    from angelspec.train.distributed import init_distributed, shutdown
    from angelspec.train.sequence_parallel import init_sequence_parallel

    torch.set_num_threads(1)
    info = init_distributed()
    sp = init_sequence_parallel(2, info, "ddp")
    assert sp.size == 2 and sp.rank == info.rank and sp.dp.world_size == 1
    _check_exchange(sp)
    _check_target(sp)
    _check_mtp(sp, "mtp")
    _check_mtp(sp, "eagle3")
    _check_block(sp)
    print(f"rank {info.rank}: ok", flush=True)
    shutdown(info)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    _worker()
    sys.exit(0)


# ----- the tests -----

from test_distributed import _check, _free_port, needs_gloo  # noqa: E402


def _launch(args: list[str], nproc: int = 2, timeout: int = 180) -> subprocess.CompletedProcess:
    """`torchrun --nproc_per_node nproc` with this interpreter, one thread per rank, a free port; gloo and the CPU
    even on a GPU machine."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr",
           "127.0.0.1", "--master_port", str(_free_port()), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ANGELSPEC_DIST_BACKEND": "gloo", "ANGELSPEC_DEVICE": "cpu"}
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


@needs_gloo
def test_one_step_equals_one_process_and_the_exchange_is_exact(tmp_path):
    proc = _launch([__file__])
    _check(proc, tmp_path)
    assert proc.stdout.count(": ok") == 2, proc.stdout


@pytest.fixture(scope="module")
def conversations(tmp_path_factory):
    from conftest import write_conversations

    return write_conversations(tmp_path_factory.mktemp("sp_data") / "conv.jsonl", 60, seed=7)


def _cli_train(drafter: str, strategy: str, target, data, out, *extra: str, nproc: int = 2
               ) -> subprocess.CompletedProcess:
    return _launch(["-m", "angelspec.cli", "train", "--drafter", drafter, "--target", str(target), "--data",
                    str(data), "--out", str(out), "--preset", "tiny_debug", "--quiet", "--distributed", strategy,
                    "--sp", "2", *extra], nproc)


@pytest.fixture(scope="module")
def single_process(tmp_path_factory, tiny_target_dir, conversations):
    """`single_process(drafter)`: the folder of a one-process run of the tiny 3-step preset (made once per kind)."""
    from angelspec.train.registry import get_trainer

    done = {}

    def run(drafter: str):
        if drafter not in done:
            train_fn, presets, _ = get_trainer(drafter)
            done[drafter] = tmp_path_factory.mktemp("sp_ref") / drafter
            n = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                train_fn(tiny_target_dir, conversations, done[drafter], config=presets["tiny_debug"](),
                         progress=False, log=lambda *_: None)
            finally:
                torch.set_num_threads(n)
        return done[drafter]

    return run


@pytest.fixture(scope="module")
def launched(tmp_path_factory, tiny_target_dir, conversations):
    """`launched(drafter, strategy, nproc)`: the folder of an uninterrupted `--sp 2` CLI run on nproc processes
    (made once per module: the 2-process FSDP2 MTP run is also the reference of the resume test)."""
    done = {}

    def run(drafter: str, strategy: str, nproc: int = 2):
        key = drafter, strategy, nproc
        if key not in done:
            out = tmp_path_factory.mktemp("sp_runs") / f"{drafter}-{strategy}-{nproc}"
            _check(_cli_train(drafter, strategy, tiny_target_dir, conversations, out, nproc=nproc), out.parent)
            done[key] = out
        return done[key]

    return run


def _logs(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "training" / "train_log.jsonl").read_text().splitlines()]


@needs_gloo
@pytest.mark.parametrize(("drafter", "strategy", "nproc"), [("mtp", "fsdp2", 2), ("dfly", "ddp", 2),
                                                             ("dfly", "fsdp2", 4)])
def test_sp2_run_trains_the_single_process_drafter(drafter, strategy, nproc, launched, single_process):
    """`torchrun --nproc_per_node N ... train --sp 2` ends the tiny 3-step preset at the single-process weights, with
    the same logged losses; the report records the SP size. N = 2: every row split over both processes, the drafter
    sharded by FSDP2 or replicated by DDP over the same two. N = 4: two SP groups of two (ranks 0-1, 2-3) times
    two-way data parallelism (each group one row of the 2-row global batch, its own block anchors), FSDP2 sharding
    the drafter over all four."""
    from safetensors.torch import load_file

    ref, out = single_process(drafter), launched(drafter, strategy, nproc)
    a, b = load_file(str(ref / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=RTOL, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")
    report = json.loads((out / "train_report.json").read_text())
    assert report["sequence_parallel"] == 2 and report["distributed"] == strategy and report["world_size"] == nproc
    logs = [_logs(ref), _logs(out)]
    assert len(logs[0]) == len(logs[1]) == 3
    for x, y in zip(*logs, strict=True):
        assert y["loss"] == pytest.approx(x["loss"], rel=RTOL)


@needs_gloo
def test_sp2_run_stopped_mid_way_resumes_exactly(tmp_path, tiny_target_dir, conversations, launched):
    """A 2-process `--sp 2` FSDP2 MTP run stopped after step 1 by the time budget (a checkpoint at step 1, the
    schedule unchanged, as after a kill) and resumed with `--sp 2 --resume` ends with the uninterrupted `--sp 2` run's
    weights and logged losses, bit for bit."""
    from safetensors.torch import load_file

    full, cut = launched("mtp", "fsdp2"), tmp_path / "cut"
    _check(_cli_train("mtp", "fsdp2", tiny_target_dir, conversations, cut, "--max-minutes", "1e-9"), tmp_path)
    assert json.loads((cut / "train_report.json").read_text())["steps"] == 1
    assert (cut / "training" / "checkpoint" / "optimizer.pt").is_file()
    _check(_cli_train("mtp", "fsdp2", tiny_target_dir, conversations, cut, "--resume"), tmp_path)
    a, b = load_file(str(full / "model.safetensors")), load_file(str(cut / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((cut / "train_report.json").read_text())["steps"] == 3
    assert [x["loss"] for x in _logs(cut)] == [x["loss"] for x in _logs(full)]


# ----- errors, no process group -----


def test_bad_sp_settings_are_one_line_errors(capsys, tiny_target_dir, conversations, tmp_path):
    """Not under torchrun, a world size or seq_len or head count that --sp does not divide, a drafter without SP:
    one line naming the problem and the fix (exit 2 from the CLI)."""
    from conftest import assert_bad_input, run_cli

    from angelspec.errors import UsageError
    from angelspec.train.distributed import DistInfo
    from angelspec.train.sequence_parallel import SequenceParallel, init_sequence_parallel

    def train(drafter: str, sp: str, out: str) -> tuple[int, str]:
        code, _, err = run_cli(capsys, "train", "--target", tiny_target_dir, "--data", conversations, "--preset",
                               "tiny_debug", "--quiet", "--drafter", drafter, "--out", tmp_path / out, "--sp", sp)
        return code, err

    assert_bad_input(*train("mtp", "2", "a"), "--sp 2", "torchrun --nproc_per_node 2")
    assert not (tmp_path / "a").exists()
    assert_bad_input(*train("draft-lm", "2", "b"), "draft-lm", "drop --sp")
    assert_bad_input(*train("mtp", "0", "c"), "--sp")
    with pytest.raises(UsageError, match="3 processes"):
        init_sequence_parallel(2, DistInfo(rank=0, world_size=3, launched=True), "ddp")
    with pytest.raises(UsageError, match="ddp or fsdp2"):
        init_sequence_parallel(2, DistInfo(rank=0, world_size=2, launched=True), "none")
    sp = SequenceParallel(size=2, rank=1)
    with pytest.raises(UsageError, match="seq_len=25 .* multiple of 2"):
        sp.bounds(25)
    with pytest.raises(UsageError, match="3 attention heads .* --sp 2"):
        sp.check_heads(3)
    with pytest.raises(UsageError, match="target's 3 attention heads .* --sp 2 .* another target"):
        sp.check_heads(3, "target")
    with pytest.raises(UsageError, match=r"seq_len=6 .* shards of 3 tokens, fewer than the 4 .* \(D \+ 1 for the 3 "
                                         r"TTT depths\); use a seq_len of at least 8"):
        sp.check_halo(6, 4, "D + 1 for the 3 TTT depths")
    sp.check_halo(8, 4, "")  # a shard as long as the halo: the next rank holds all of it
    assert sp.bounds(24) == (12, 24) and sp.columns(24, 4) == slice(12, 24) and sp.columns(24, 0) == slice(12, 24)
    assert SequenceParallel(size=2, rank=0).columns(24, 4) == slice(0, 16)
    one = init_sequence_parallel(1, DistInfo(), "none")
    x = torch.randn(2, 3, 4, 5)
    assert not one.enabled and one.to_heads(x) is x and one.to_sequence(x) is x


def test_target_forward_of_one_rank_is_the_whole_row_forward():
    """With no SP the target's sequence-parallel forward is the whole row through the tiled document-masked
    attention (`TrainInputs.attend`): the whole-row forward's taps and final states within 1e-5; `attend`
    with a mask of the model's own (document_ids, a cache, keep) is refused."""
    from conftest import tiny_decoder

    from angelspec.train.sequence_parallel import NO_SP, target_attention, target_forward

    target = tiny_decoder(vocab=64, dtype=torch.float32, heads=4, kv=2, layers=2)
    packed = _packed(64, 24, 12)
    with torch.no_grad():
        ref = target(packed.input_ids, TrainInputs(positions=packed.positions, document_ids=packed.document_ids,
                                                   hidden_layers=(0, 1)))
    out = target_forward(NO_SP, target, packed, (0, 1))
    assert out.logits is None
    for got, want in zip((*out.hidden, out.last_hidden), (*ref.hidden, ref.last_hidden), strict=True):
        torch.testing.assert_close(got, want, rtol=RTOL, atol=RTOL * float(want.abs().max()))
    with pytest.raises(ValueError, match="attend= .* own mask"):
        target(packed.input_ids, TrainInputs(document_ids=packed.document_ids,
                                             attend=target_attention(NO_SP, packed.document_ids)))


def test_anchors_go_to_the_rank_holding_them_padded_to_one_count():
    """Valid anchors split by position over the shards (invalid ones dropped), every rank's list padded to the same
    length with invalid entries, the exchanged layout rank after rank in whole-row positions."""
    from angelspec.train.sequence_parallel import SequenceParallel, shard_anchors

    anchors = torch.tensor([[1, 5, 7, 9], [2, 3, 4, 0]])
    valid = torch.tensor([[True, True, True, True], [True, True, True, False]])
    parts = [shard_anchors(anchors, valid, SequenceParallel(size=2, rank=r), 12) for r in range(2)]
    assert parts[0].local.tolist() == [[1, 5, 0], [2, 3, 4]]
    assert parts[0].local_valid.tolist() == [[True, True, False], [True, True, True]]
    assert parts[1].local.tolist() == [[1, 3, 0], [0, 0, 0]]  # positions 7, 9 of row 0 are 1, 3 of shard 1
    assert parts[1].local_valid.tolist() == [[True, True, False], [False, False, False]]
    assert torch.equal(parts[0].layout, parts[1].layout)
    assert parts[0].layout.tolist() == [[1, 5, 0, 7, 9, 6], [2, 3, 4, 6, 6, 6]]
