"""Drafter training in memory linear in T (docs/design.md "Memory linear in T"): the TTT rollout with the tiled
document-masked attention, the chunked LM head + loss, and per-depth activation checkpointing give the same loss
and the same gradient of every parameter as the reference path (explicit (D·T)×(D·T) mask, whole [N, D, V]
logits, no checkpointing) on packed rows of several documents, for every objective; no tensor of a training step
is [T, T] or holds the whole logits; and the MTP trainer runs this path by default.

fp32 throughout: the two paths add the same terms in another order (tiles, chunks), which moves a gradient entry
by ~1e-7 of its tensor's largest entry; the tolerance is 1e-5 relative, elementwise or to that largest entry."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from conftest import same_weights, write_conversations
from conftest import tiny_decoder as tiny_target
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from angelspec.data.packing import Doc, pack_documents
from angelspec.models.eagle3 import Eagle3Config, Eagle3DraftModel
from angelspec.models.mtp import MTPConfig, MTPDraftModel
from angelspec.train.losses import LOSSES, LossConfig, acceptance_per_depth
from angelspec.train.ttt import RolloutMemory, mtp_chunked_loss_batch, mtp_loss_batch, ttt_rollout

pytestmark = pytest.mark.usefixtures("one_thread")

D = 3
RTOL, ATOL = 1e-5, 1e-7


def _setup(kind: str = "mtp", lengths=(9, 7, 5, 12, 3, 6, 10), seq_len: int = 24, seed: int = 0, vocab: int = 64):
    """A random fp32 drafter of `kind`, packed rows holding several documents (and padding), random target taps
    and teacher logits."""
    target = tiny_target(vocab=vocab, dtype=torch.float32, std=0.3, layers=2 if kind == "mtp" else 3)
    if kind == "mtp":
        model = MTPDraftModel(MTPConfig.for_target(target.config, num_depths=D), target.embed_tokens, target.lm_head)
        taps = 1
    else:
        cfg = Eagle3Config.for_target(target.config, num_depths=D, target_layer_ids=(0, 1, 2))
        model = Eagle3DraftModel(cfg, target.embed_tokens, target.lm_head)
        taps = 3
    model.init_weights(std=0.2, generator=torch.Generator().manual_seed(1))
    g = torch.Generator().manual_seed(seed)
    docs = [Doc(torch.randint(0, vocab, (n,), generator=g), (torch.rand(n, generator=g) > 0.2).long()) for n in lengths]
    packed = pack_documents(docs, seq_len, pad_id=0)
    assert packed.num_rows >= 2 and max(len(r) for r in packed.row_docs) >= 2
    hidden = torch.randn(*packed.input_ids.shape, 32 * taps, generator=g)
    teacher = torch.randn(*packed.input_ids.shape, vocab, generator=g) * 3
    return model, packed, hidden, teacher


def _grads(model) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def _reference_step(model, packed, hidden, teacher, name, config):
    """Today's reference path: explicit-mask attention, whole logits, `mtp_loss_batch`."""
    out = ttt_rollout(model, hidden, packed.input_ids, packed.positions, packed.document_ids, D, attention="reference")
    lb = mtp_loss_batch(out, packed, teacher)
    loss = LOSSES[name](lb, config).loss
    loss.backward()
    return loss.detach(), _grads(model), lb


def _linear_step(model, packed, hidden, teacher, name, config, max_logits=7 * D * 64, **kw):
    """The linear path (as the trainer runs it): tiled attention, checkpointed depths, chunked head + loss (7 rows
    per chunk here: several chunks and a remainder)."""
    out = ttt_rollout(model, hidden, packed.input_ids, packed.positions, packed.document_ids, D,
                      memory=RolloutMemory(keep_logits=False, checkpoint_depths=True, query_chunk=5, key_chunk=8))
    assert out.logits is None
    clb = mtp_chunked_loss_batch(model, out, packed, teacher, max_logits=max_logits, **kw)
    lo = LOSSES[name](clb, config)
    lo.loss.backward()
    return lo, _grads(model)


def _assert_same(lin_loss, lin_grads, ref_loss, ref_grads):
    torch.testing.assert_close(lin_loss, ref_loss, rtol=RTOL, atol=ATOL)
    assert lin_grads.keys() == ref_grads.keys() and len(ref_grads) > 5
    for n, g in ref_grads.items():
        assert g.abs().max() > 0, n
        torch.testing.assert_close(lin_grads[n], g, rtol=RTOL, atol=RTOL * float(g.abs().max()),
                                   msg=lambda m, n=n: f"{n}: {m}")


@pytest.mark.parametrize("name", sorted(LOSSES))
@pytest.mark.parametrize("top_k", [None, 7])
def test_linear_path_equals_the_reference_loss_and_every_gradient(name, top_k):
    model, packed, hidden, teacher = _setup()
    config = LossConfig(top_k=top_k, depth_weights=(0.5, 0.3, 0.2))
    ref_loss, ref_grads, _ = _reference_step(model, packed, hidden, teacher, name, config)
    lo, grads = _linear_step(model, packed, hidden, teacher, name, config)
    _assert_same(lo.loss.detach(), grads, ref_loss, ref_grads)


def test_eagle3_linear_path_equals_the_reference():
    model, packed, hidden, teacher = _setup("eagle3")
    config = LossConfig()
    ref_loss, ref_grads, _ = _reference_step(model, packed, hidden, teacher, "e2e_tv", config)
    lo, grads = _linear_step(model, packed, hidden, teacher, "e2e_tv", config)
    _assert_same(lo.loss.detach(), grads, ref_loss, ref_grads)
    assert any(n.startswith("fc.") for n in grads)  # the fc over three taps gets its gradient through the rollout


def test_chunk_size_changes_nothing_and_alpha_is_logged_from_the_chunks():
    """One row per chunk, several, all rows in one chunk: the same loss; α per depth (recorded in the forward
    only) equals `acceptance_per_depth` on the whole logits; without checkpointing the values are the same."""
    model, packed, hidden, teacher = _setup()
    config = LossConfig(top_k=7)
    *_, lb = _reference_step(model, packed, hidden, teacher, "lk_alpha", config)
    alpha_ref = acceptance_per_depth(lb.student_logits.detach(), lb.teacher_logits, lb.mask, 7)
    losses = []
    for rows in (1, 7, 10_000):
        lo, _ = _linear_step(model, packed, hidden, teacher, "lk_alpha", config, max_logits=rows * D * 64,
                             track_alpha=True)
        torch.testing.assert_close(lo.parts["alpha_per_depth"], alpha_ref, rtol=RTOL, atol=ATOL)
        losses.append(lo.loss.detach())
    for x in losses[1:]:
        torch.testing.assert_close(x, losses[0], rtol=RTOL, atol=ATOL)
    out = ttt_rollout(model, hidden, packed.input_ids, packed.positions, packed.document_ids, D,
                      memory=RolloutMemory(keep_logits=False))
    clb = replace(mtp_chunked_loss_batch(model, out, packed, teacher, max_logits=7 * D * 64), checkpoint=False)
    torch.testing.assert_close(LOSSES["lk_alpha"](clb, config).loss.detach(), losses[0], rtol=RTOL, atol=ATOL)


class _Shapes(TorchDispatchMode):
    """Records the shape of every tensor an op allocates (forward and backward; views of an input are not new)."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        seen = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
                self.shapes.append((str(func), tuple(t.shape)))
        return out


def test_a_training_step_creates_no_t_by_t_tensor_and_never_the_whole_logits():
    """Forward and backward of rollout + head + loss at T = 256: no tensor has two axes of length >= T (the old
    fast path built a [B, 1, T, T] document gate), and none holds a quarter of the B·T·D·V student logits (the
    old path held them all, and the [B, T, D, V] teacher)."""
    T = 256
    V = 640  # no axis of the teacher [B·T, V] view equals T by chance
    model, packed, hidden, teacher = _setup(lengths=(100, 90, 60, 6, 200, 40), seq_len=T, vocab=V)
    B = packed.num_rows
    with _Shapes() as rec:
        out = ttt_rollout(model, hidden, packed.input_ids, packed.positions, packed.document_ids, D,
                          memory=RolloutMemory(keep_logits=False, checkpoint_depths=True, query_chunk=32, key_chunk=64))
        clb = mtp_chunked_loss_batch(model, out, packed, teacher, max_logits=B * T * D * V // 8)
        LOSSES["e2e_tv"](clb, LossConfig()).loss.backward()
    assert len(rec.shapes) > 500
    square = [(f, s) for f, s in rec.shapes if sum(d >= T for d in s) >= 2]
    assert not square, square[:5]
    big = [(f, s) for f, s in rec.shapes if torch.Size(s).numel() >= B * T * D * V // 4]
    assert not big, big[:5]


# ---------------------------------------------------------------------------------------------------------
# The trainer runs the linear path by default
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def conversations(tmp_path_factory):
    return write_conversations(tmp_path_factory.mktemp("linmem_data") / "conv.jsonl", 60, seed=5)


def test_every_preset_checkpoints_its_depths():
    """Measured to pay at every depth count (benchmarks/ttt_memory.py), base MTP's single depth included."""
    from angelspec.train.eagle3 import PRESETS as EAGLE3_PRESETS
    from angelspec.train.mtp import PRESETS

    for name, preset in {**PRESETS, **{f"eagle3:{k}": v for k, v in EAGLE3_PRESETS.items()}}.items():
        assert preset().activation_checkpointing is True, name


def test_trainer_runs_the_linear_path(tmp_path, tiny_target_dir, conversations, monkeypatch):
    import angelspec.train.mtp as mtp

    seen = []
    rollout, chunked = mtp.ttt_rollout, mtp.mtp_chunked_loss_batch

    def spy_rollout(*a, **kw):
        seen.append(("rollout", kw["memory"].keep_logits, kw["memory"].checkpoint_depths))
        return rollout(*a, **kw)

    def spy_chunked(*a, **kw):
        seen.append(("chunked", kw["track_alpha"]))
        return chunked(*a, **kw)

    monkeypatch.setattr(mtp, "ttt_rollout", spy_rollout)
    monkeypatch.setattr(mtp, "mtp_chunked_loss_batch", spy_chunked)
    mtp.train_mtp(tiny_target_dir, conversations, tmp_path / "m", config=mtp.tiny_debug(), progress=False,
                  log=lambda *_: None)
    assert seen == [("rollout", False, True), ("chunked", True)] * 3  # log_every=1: α logged at every step


def test_a_run_saved_without_checkpointing_resumes_under_the_default(tmp_path, tiny_target_dir, conversations):
    """`activation_checkpointing` changes memory only, so a checkpoint written with it off resumes with it on and
    ends bit-identical to an uninterrupted run."""
    from angelspec.train.mtp import tiny_debug, train_mtp

    kw = dict(progress=False, log=lambda *_: None)
    train_mtp(tiny_target_dir, conversations, tmp_path / "a", config=tiny_debug(), **kw)
    off = replace(tiny_debug(), activation_checkpointing=False)
    train_mtp(tiny_target_dir, conversations, tmp_path / "b", config=off, max_minutes=0, **kw)  # stops after step 1
    train_mtp(tiny_target_dir, conversations, tmp_path / "b", config=tiny_debug(), resume=True, **kw)
    same_weights(tmp_path / "a", tmp_path / "b")
