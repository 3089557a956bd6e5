"""Block-drafter training in memory linear in T (docs/design.md "Memory linear in T"): the mask-free anchored
attention, the chunked head + loss (with the confidence term) and per-layer checkpointing give the loss and every
parameter gradient of the reference path (SDPA under the index-built [R, 1, N·B, T + N·B] mask, whole
[R·N, K, V] logits, `confidence_loss`) on packed rows of several documents, for each objective and head; and a
step with N·B >= T anchors' entries creates no [T, T]-sized tensor and never the whole logits.

fp32; the two paths add the same terms in another order: 1e-5 relative, elementwise or to the tensor's largest
entry (as tests/test_ttt_memory.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from test_block_drafter import tiny_drafter, tiny_target
from test_ttt_memory import _assert_same, _grads, _Shapes

from angelspec.data.packing import Doc, pack_documents
from angelspec.models import Decoder, attention
from angelspec.models.block.drafter import BackboneOptions, BlockDrafter
from angelspec.models.block.targets import sample_anchors
from angelspec.train.block import block_chunked_loss_batch, block_loss_batch, confidence_loss
from angelspec.train.confidence import confidence_targets
from angelspec.train.losses import LOSSES, LossConfig, with_confidence_term

pytestmark = pytest.mark.usefixtures("one_thread")


def _target(vocab: int) -> Decoder:
    """`tiny_target`'s shape with another vocabulary."""
    cfg = replace(tiny_target().config, vocab_size=vocab)
    torch.manual_seed(0)
    model = Decoder(cfg)
    model.init_weights(std=0.3)
    return model.double().eval()


def _protocol(model: BlockDrafter) -> BlockDrafter:
    """`model` with a "protocol" confidence head (three temperatures), a fresh non-zero one."""
    cfg = replace(model.config, confidence_target="protocol", confidence_temperatures=(0.0, 0.5, 1.0))
    out = BlockDrafter(cfg, *model._shared)
    out.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith("confidence.")},
                        strict=False)
    with torch.no_grad():
        out.confidence.proj.weight.normal_(0.0, 0.3, generator=torch.Generator().manual_seed(3))
    return out.to(next(model.parameters()).dtype)


def _setup(head: str, conditioning: str, confidence: bool | str, lengths=(9, 7, 5, 12, 3, 6, 10), seq_len: int = 24,
           anchors: int = 6, block_size: int = 4, vocab: int = 64):
    target = tiny_target() if vocab == 64 else _target(vocab)
    model = tiny_drafter(target, conditioning=conditioning, head=head, confidence=bool(confidence),
                         block_size=block_size)
    model = (_protocol(model) if confidence == "protocol" else model).float()
    target.float()
    g = torch.Generator().manual_seed(4)
    docs = [Doc(torch.randint(6, vocab, (n,), generator=g), (torch.rand(n, generator=g) > 0.2).long())
            for n in lengths]
    packed = pack_documents(docs, seq_len, pad_id=0)
    assert packed.num_rows >= 2 and max(len(r) for r in packed.row_docs) >= 2
    anchor, valid = sample_anchors(packed.loss_mask, anchors, document_ids=packed.document_ids, generator=g)
    taps = torch.randn(*packed.input_ids.shape, model.config.num_taps * 32, generator=g)
    teacher = torch.randn(*packed.input_ids.shape, vocab, generator=g) * 3
    return model, packed, anchor, valid, taps, teacher


def _forward(model, packed, anchor, valid, taps, **kw):
    return model.forward_train(taps, packed.input_ids, packed.positions, anchor, document_ids=packed.document_ids,
                               loss_mask=packed.loss_mask, anchor_valid=valid, **kw)


CASES = [("hidden", "dfly", True, "dpace_lk"), ("hidden", "dfly", True, "e2e_tv"), ("none", "dflare", False, "e2e_tv"),
         ("markov", "dflash", True, "dspark"), ("rnn", "dflash", True, "dspark"), ("gated", "dflash", False, "dspark"),
         ("hidden", "dfly", "protocol", "e2e_tv"), ("markov", "dflash", "protocol", "dspark")]


@pytest.mark.parametrize(("head", "conditioning", "confidence", "name"), CASES)
def test_linear_path_equals_the_reference_loss_and_every_gradient(head, conditioning, confidence, name):
    """confidence True: a "tv" head (target α); "protocol": one output per temperature, fitted to the protocol
    targets (`train.confidence`), which the chunked path computes from each chunk's logits."""
    model, packed, anchor, valid, taps, teacher = _setup(head, conditioning, confidence)
    config = LossConfig(top_k=9, tv_norm="half_l1" if confidence == "protocol" else "l1")
    with_conf = bool(confidence) and name != "dspark"  # the trainer's "dfly" objective adds the confidence term

    def targets(lb):
        return confidence_targets(model.config, lb.student_logits.detach(), lb.teacher_logits, lb.mask, config.top_k)

    dense = _forward(model, packed, anchor, valid, taps, backbone=BackboneOptions(attention="dense"))
    ref = block_loss_batch(dense, teacher, targets)
    assert (ref.confidence_targets is None) == (not confidence)
    loss = LOSSES[name](ref, config).loss
    if with_conf:
        loss = loss + 0.7 * confidence_loss(ref.confidence_logits, ref.confidence_targets, ref.mask, ref.mask.sum())
    loss.backward()
    ref_loss, ref_grads = loss.detach(), _grads(model)

    out = _forward(model, packed, anchor, valid, taps, compute_logits=False,
                   backbone=BackboneOptions(checkpoint_layers=True))
    assert out.logits is None
    K = model.config.block_size - 1
    clb = block_chunked_loss_batch(model, out, teacher, max_logits=5 * K * 64,  # 5 anchors per chunk
                                   confidence_targets=targets)
    objective = with_confidence_term(LOSSES[name], 0.7) if with_conf else LOSSES[name]
    lo = objective(clb, config)
    lo.loss.backward()
    _assert_same(lo.loss.detach(), _grads(model), ref_loss, ref_grads)


def test_a_block_step_creates_no_t_by_t_tensor_and_never_the_whole_logits(monkeypatch):
    """T = 160 with N·B = 160 block entries per row (feature widths stay below 160): the dense mask would be
    [R, 1, 160, 320] and SDPA's scores [R, H, 160, 320]; the linear path's largest tensors are tiles and chunks."""
    T, N, Bk, V = 160, 20, 8, 640
    model, packed, anchor, valid, taps, teacher = _setup("hidden", "dfly", True, lengths=(70, 50, 38, 60, 90),
                                                         seq_len=T, anchors=N, block_size=Bk, vocab=V)
    R, K = packed.num_rows, Bk - 1
    monkeypatch.setattr(attention, "DEFAULT_Q_CHUNK", 32)  # tiles far below T, as they are at real lengths
    monkeypatch.setattr(attention, "DEFAULT_K_CHUNK", 64)
    with _Shapes() as rec:
        out = _forward(model, packed, anchor, valid, taps, compute_logits=False,
                   backbone=BackboneOptions(checkpoint_layers=True))
        clb = block_chunked_loss_batch(model, out, teacher, max_logits=R * N * K * V // 8)
        with_confidence_term(LOSSES["e2e_tv"], 1.0)(clb, LossConfig()).loss.backward()
    square = [(f, s) for f, s in rec.shapes if sum(d >= T for d in s) >= 2]
    assert not square, square[:5]
    big = [(f, s) for f, s in rec.shapes if torch.Size(s).numel() >= R * N * K * V // 4]
    assert not big, big[:5]


def test_block_trainer_runs_the_linear_path(tmp_path, tiny_target_dir, monkeypatch):
    """`angelspec train --drafter dfly` (tiny_debug): mask-free attention, checkpointed layers, no logits from
    the backbone pass, the chunked head + loss with α logged from the chunks."""
    from conftest import write_conversations

    import angelspec.train.block as block
    from angelspec.models.block.drafter import BlockDrafter

    seen = []
    forward_train, chunked = BlockDrafter.forward_train, block.block_chunked_loss_batch

    def spy_forward(self, *a, **kw):
        backbone = kw.get("backbone") or BackboneOptions()
        seen.append(("forward", backbone.attention, kw["compute_logits"], backbone.checkpoint_layers))
        return forward_train(self, *a, **kw)

    def spy_chunked(*a, **kw):
        seen.append(("chunked", kw["track_alpha"]))
        return chunked(*a, **kw)

    monkeypatch.setattr(BlockDrafter, "forward_train", spy_forward)
    monkeypatch.setattr(block, "block_chunked_loss_batch", spy_chunked)
    data = write_conversations(tmp_path / "conv.jsonl", 60, seed=5)
    block.train_dfly(tiny_target_dir, data, tmp_path / "d", config=block.tiny_debug(), progress=False,
                     log=lambda *_: None)
    assert seen == [("forward", "linear", False, True), ("chunked", True)] * 3
