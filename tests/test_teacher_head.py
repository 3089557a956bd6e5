"""The teacher at real vocabularies: a trainer's teacher is the target's final-norm states and LM head
(`train.losses.TeacherHead`), applied inside each loss chunk to the rows the chunk needs, so no [B, T, V] teacher
tensor exists in a step; and the losses run without a host sync (no `x[mask]`: every shape is static, so they run on
the `meta` device).

Each drafter family's chunked loss with a `TeacherHead` gives the loss and every gradient of the same chunked loss
fed the whole [B, T, V] teacher logits (what the trainers held before), for every objective; fp32, 1e-5 relative
(the head's matmul adds over C in another blocking: ~1e-7)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from test_block_memory import _setup as block_setup
from test_train_vocab import _mtp_setup as draft_mtp_setup
from test_ttt_memory import _assert_same, _grads
from test_ttt_memory import _setup as mtp_setup
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from angelspec.models.block.drafter import BackboneOptions, BlockDrafter
from angelspec.models.decoder import TrainInputs
from angelspec.train.block import block_chunked_loss_batch
from angelspec.train.confidence import confidence_targets
from angelspec.train.losses import (
    HOST_MAX_LOGITS,
    LOSSES,
    LossBatch,
    LossConfig,
    TeacherHead,
    loss_chunk_logits,
    teacher_logits,
    with_confidence_term,
)
from angelspec.train.ttt import (
    RolloutMemory,
    depth_teacher_rows,
    mtp_chunked_loss_batch,
    teacher_for_depths,
    ttt_rollout,
)

pytestmark = pytest.mark.usefixtures("one_thread")

D = 3
C = 16


def _teacher_head(shape: tuple[int, int], vocab: int, seed: int = 7, dtype: torch.dtype = torch.float32
                  ) -> TeacherHead:
    """Random final-norm states [B, T, C] and a random bias-free LM head C -> V, logits of a few units."""
    g = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(C, vocab, bias=False, dtype=dtype)
    with torch.no_grad():
        head.weight.normal_(0.0, 1.0, generator=g)
    head.requires_grad_(False)
    return TeacherHead(torch.randn(*shape, C, generator=g, dtype=dtype),
                       lambda h: head(h).to(torch.promote_types(h.dtype, torch.float32)), vocab)


# ----- the teacher's rows -----


@pytest.mark.parametrize("length", [None, 9])
def test_depth_teacher_rows_of_the_head_are_the_depth_shifted_logits(length):
    """Every slice (one row, a row boundary, the last row's end, a sequence-parallel shard of `length` positions
    with its halo after it) gets the rows `teacher_for_depths` holds, zeros past a row end included."""
    B, T, V = 3, 12, 40
    head = _teacher_head((B, T), V)
    full = head.full()
    L = T if length is None else length  # a shard's first L positions of each row, its halo after them
    ref = teacher_for_depths(full, D)[:, :L].reshape(B * L, D, V)
    from_head, from_logits = depth_teacher_rows(head, D, length), depth_teacher_rows(full, D, length)
    for r in (slice(0, 1), slice(0, B * L), slice(L - 2, L + 3), slice(B * L - 1, B * L), slice(4, 5)):
        torch.testing.assert_close(from_head(r), ref[r], rtol=1e-5, atol=1e-6)
        assert torch.equal(from_logits(r), ref[r])


def test_map_positions_gives_every_position_in_chunks():
    head = _teacher_head((2, 7), 30)
    got = head.map_positions(lambda t: t.log_softmax(-1)[:, :5], max_logits=3 * 30)  # 3 positions per chunk
    torch.testing.assert_close(got, head.full().log_softmax(-1)[..., :5])


def test_trainer_features_give_the_teacher_as_states_and_head():
    from conftest import tiny_decoder

    from angelspec.data.packing import Doc, pack_documents
    from angelspec.train.features import TargetFeatures

    target = tiny_decoder(vocab=48, dtype=torch.float32, layers=2)
    g = torch.Generator().manual_seed(0)
    packed = pack_documents([Doc(torch.randint(0, 48, (n,), generator=g), torch.ones(n, dtype=torch.long))
                             for n in (7, 5, 9)], 12, pad_id=0)
    _, teacher = TargetFeatures(target, [0])(packed, list(range(packed.num_rows)))
    assert isinstance(teacher, TeacherHead) and teacher.shape == (*packed.input_ids.shape, 48)
    assert teacher.states.shape[-1] == target.config.hidden_size  # D values a position travel, not V
    with torch.no_grad():
        ref = target(packed.input_ids, TrainInputs(positions=packed.positions, document_ids=packed.document_ids)).logits
    torch.testing.assert_close(teacher_logits(teacher), ref)


# ----- old path (whole teacher logits) vs new (the head per chunk), every family and objective -----


def _mtp_step(model, packed, hidden, teacher, name, config, train_vocab="full"):
    out = ttt_rollout(model, hidden, packed.input_ids, packed.positions, packed.document_ids, D,
                      train_vocab=train_vocab,
                      memory=RolloutMemory(keep_logits=False, checkpoint_depths=True, query_chunk=5, key_chunk=8))
    clb = mtp_chunked_loss_batch(model, out, packed, teacher, max_logits=7 * D * 64, track_alpha=True,
                                 train_vocab=train_vocab)
    lo = LOSSES[name](clb, config)
    lo.loss.backward()
    return lo, _grads(model)


@pytest.mark.parametrize("name", sorted(LOSSES))
@pytest.mark.parametrize("top_k", [None, 7])
def test_mtp_teacher_head_equals_the_whole_teacher_logits(name, top_k):
    model, packed, hidden, _ = mtp_setup()
    head = _teacher_head(packed.input_ids.shape, 64)
    config = LossConfig(top_k=top_k, depth_weights=(0.5, 0.3, 0.2))
    old, old_grads = _mtp_step(model, packed, hidden, head.full(), name, config)
    new, new_grads = _mtp_step(model, packed, hidden, head, name, config)
    _assert_same(new.loss.detach(), new_grads, old.loss.detach(), old_grads)
    torch.testing.assert_close(new.parts["alpha_per_depth"], old.parts["alpha_per_depth"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["mtp", "eagle3"])
def test_mtp_family_teacher_head_on_the_draft_vocabulary(kind):
    """train_vocab "draft": the draft space's teacher is made from the head a chunk of positions at a time."""
    model, packed, hidden, _ = draft_mtp_setup(kind, draft=torch.arange(0, 64, 3))  # float64
    head = _teacher_head(packed.input_ids.shape, 64, dtype=torch.float64)
    for name in ("e2e_tv", "dpace_lk", "kl"):
        old, old_grads = _mtp_step(model, packed, hidden, head.full(), name, LossConfig(), train_vocab="draft")
        new, new_grads = _mtp_step(model, packed, hidden, head, name, LossConfig(), train_vocab="draft")
        _assert_same(new.loss.detach(), new_grads, old.loss.detach(), old_grads)


BLOCK_CASES = [("hidden", "dfly", True, "dpace_lk", "full"), ("hidden", "dfly", True, "e2e_tv", "draft"),
               ("none", "dflare", False, "lk_alpha", "full"), ("markov", "dflash", True, "dspark", "full"),
               ("rnn", "dflash", True, "dspark", "draft"), ("hidden", "dfly", "protocol", "kl", "full")]


@pytest.mark.parametrize(("head", "conditioning", "confidence", "name", "vocab"), BLOCK_CASES)
def test_block_teacher_head_equals_the_whole_teacher_logits(head, conditioning, confidence, name, vocab):
    model, packed, anchor, valid, taps, _ = block_setup(head, conditioning, confidence)
    if vocab == "draft":  # the same weights, drafting from 16 ids
        drafter = BlockDrafter(replace(model.config, draft_vocab_size=16), *model._shared)
        drafter.load_state_dict(model.state_dict(), strict=False)
        drafter.set_draft_vocab(torch.arange(1, 64, 4))
        model = drafter.float()
    teacher = _teacher_head(packed.input_ids.shape, 64)
    config = LossConfig(top_k=9)
    objective = with_confidence_term(LOSSES[name], 0.7) if confidence and name != "dspark" else LOSSES[name]

    def targets(lb):
        return confidence_targets(model.config, lb.student_logits.detach(), lb.teacher_logits, lb.mask, config.top_k,
                                  model.draft_vocab if model.config.draft_vocab_size else None,
                                  draft_columns=lb.draft_vocab is not None)

    def step(t):
        out = model.forward_train(taps, packed.input_ids, packed.positions, anchor, document_ids=packed.document_ids,
                                  loss_mask=packed.loss_mask, anchor_valid=valid, compute_logits=False,
                                  backbone=BackboneOptions(checkpoint_layers=True))
        K = model.config.block_size - 1
        clb = block_chunked_loss_batch(model, out, t, max_logits=5 * K * 64, confidence_targets=targets,
                                       train_vocab=vocab)
        loss = objective(clb, config).loss
        loss.backward()
        return loss.detach(), _grads(model)

    old_loss, old_grads = step(teacher.full())
    new_loss, new_grads = step(teacher)
    _assert_same(new_loss, new_grads, old_loss, old_grads)


# ----- no [B, T, V] tensor, no host sync -----


class _LargestLogits(TorchDispatchMode):
    """The most elements of any tensor of `vocab`-wide rows an op makes."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab, self.numel = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.numel = max([self.numel, *(t.numel() for t in tree_leaves(out)
                                        if isinstance(t, torch.Tensor) and t.dim() and t.shape[-1] == self.vocab)])
        return out


def test_a_step_with_the_teacher_head_never_holds_the_whole_teacher():
    V = 80  # no other width of the step is 80
    model, packed, hidden, _ = mtp_setup(seq_len=48, lengths=(9, 7, 5, 12, 3, 6, 10, 20, 14) * 2, vocab=V)
    B, T = packed.input_ids.shape
    head = _teacher_head((B, T), V)
    with _LargestLogits(V) as seen:  # chunks of 5 rows (7 · D · 64 logits); the LM head's weight seen as [C, V]
        _mtp_step(model, packed, hidden, head, "e2e_tv", LossConfig())
    assert 0 < seen.numel <= max(5 * D * V, 32 * V) <= B * T * V // 6, (seen.numel, B * T * V)
    with _LargestLogits(V) as seen:  # the whole teacher logits: the step holds [B, T, V]
        _mtp_step(model, packed, hidden, head.full(), "e2e_tv", LossConfig())
    assert seen.numel >= B * T * V


def _meta_batch(draft: bool) -> LossBatch:
    N, K, V = 6, 3, 50
    dev = "meta"
    vocab = torch.arange(0, V, 5, device=dev) if draft else None
    return LossBatch(torch.randn(N, K, 10 if draft else V, device=dev, requires_grad=True),
                     torch.ones(N, K, dtype=torch.bool, device=dev), torch.randn(N, K, V, device=dev),
                     torch.zeros(N, K, dtype=torch.long, device=dev),
                     torch.randn(N, K, device=dev, requires_grad=True), draft_vocab=vocab)


@pytest.mark.parametrize("name", [*sorted(LOSSES), "kl+confidence"])
@pytest.mark.parametrize("draft", [False, True])
def test_every_loss_runs_without_a_host_sync(name, draft):
    """On `meta` tensors a data-dependent shape (`x[mask]`, `nonzero`) or a read of a value (`.item()`, `int()`)
    raises: the forward and backward of every loss, with and without top-K, in the whole and the draft space."""
    objective = with_confidence_term(LOSSES["kl"], 1.0) if name == "kl+confidence" else LOSSES[name]
    for top_k in (None, 7):
        b = _meta_batch(draft)
        out = objective(b, LossConfig(top_k=top_k, depth_weights=(0.5, 0.3, 0.2)))
        assert out.loss.device.type == "meta"
        out.loss.backward()
        assert b.student_logits.grad is not None


def test_chunk_budget_from_the_device():
    assert loss_chunk_logits("cpu") == HOST_MAX_LOGITS == loss_chunk_logits(torch.device("meta"))
    if torch.cuda.is_available():
        total = torch.cuda.get_device_properties(0).total_memory
        assert loss_chunk_logits("cuda") == max(1 << 20, total // 8 // 48)
