"""Training on the draft vocabulary (`train_vocab="draft"`, train.losses "Draft vocabulary"): the drafter's head
scores only V', the losses see the teacher on V' plus one outside bucket and a drafter with zero mass outside V'.

- With V' the whole vocabulary (in another order) every objective, and a whole MTP / EAGLE-3 / block-drafter
  training step, gives the full-vocabulary loss and every gradient (fp64, 1e-6).
- With a small V', α and TV equal a brute-force computation over the whole vocabulary with q zeroed outside V'
  (and e2e TV / LK^α follow from them; KL is against p renormalised on V'); every loss and gradient is finite,
  labels outside V' included.
- TTT's next-depth tokens are argmaxes over V', so always draft-vocabulary ids.
- The trainers run it (under sequence parallelism: tests/test_sequence_parallel.py); a checkpoint refuses a resume
  that switches the key, and one written before the key existed resumes only as "full".
"""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch
from conftest import QUIET, tiny_decoder, write_conversations
from test_block_drafter import tiny_drafter
from test_block_drafter import tiny_target as block_target
from test_block_memory import _forward, _protocol
from test_ttt_memory import _grads

from angelspec.data.packing import Doc, pack_documents
from angelspec.models.block.drafter import BackboneOptions, BlockDrafter
from angelspec.models.block.targets import sample_anchors
from angelspec.models.eagle3 import Eagle3Config, Eagle3DraftModel
from angelspec.models.mtp import MTPConfig, MTPDraftModel
from angelspec.models.vocab import expand_logits
from angelspec.train.block import block_chunked_loss_batch
from angelspec.train.confidence import confidence_targets
from angelspec.train.losses import (
    LOSSES,
    LossBatch,
    LossConfig,
    to_draft_space,
    token_alpha,
    with_confidence_term,
)
from angelspec.train.ttt import RolloutMemory, mtp_chunked_loss_batch, mtp_loss_batch, ttt_rollout

pytestmark = pytest.mark.usefixtures("one_thread")

TOL = dict(rtol=1e-6, atol=1e-9)


def _same(loss, grads, ref_loss, ref_grads):
    torch.testing.assert_close(loss, ref_loss, **TOL)
    assert grads.keys() == ref_grads.keys() and len(ref_grads) > 3
    for n, g in ref_grads.items():
        assert g.abs().max() > 0, n
        torch.testing.assert_close(grads[n], g, rtol=1e-6, atol=1e-6 * float(g.abs().max()),
                                   msg=lambda m, n=n: f"{n}: {m}")


def _batch(n=12, k=3, v=10, seed=0):
    """Random fp64 student / teacher logits [n, k, v], a mask with invalid rows, labels, confidence logits."""
    g = torch.Generator().manual_seed(seed)
    student = torch.randn(n, k, v, generator=g, dtype=torch.float64) * 2
    teacher = torch.randn(n, k, v, generator=g, dtype=torch.float64) * 3
    mask = torch.rand(n, k, generator=g) > 0.25
    mask[0] = True  # e2e TV needs rows valid at every depth
    labels = torch.randint(0, v, (n, k), generator=g)
    conf = torch.randn(n, k, generator=g, dtype=torch.float64)
    return student, teacher, mask, labels, conf


def _loss(name, student, teacher, mask, labels, conf, config, draft_vocab=None):
    """LOSSES[name] (the "dfly" objectives with the α confidence term) and its gradient in the student logits."""
    student = student.detach().requires_grad_(True)
    lb = LossBatch(student_logits=student, mask=mask, teacher_logits=teacher, labels=labels,
                   confidence_logits=conf if name == "dspark" else None, draft_vocab=draft_vocab)
    objective = LOSSES[name] if name == "dspark" else with_confidence_term(LOSSES[name], 0.5)
    if name != "dspark":
        lb = replace(lb, confidence_logits=conf)
    loss = objective(lb, config).loss
    loss.backward()
    return loss.detach(), student.grad


# ----- the losses -----


@pytest.mark.parametrize("name", sorted(LOSSES))
@pytest.mark.parametrize("top_k", [None, 4])
def test_the_whole_vocabulary_as_draft_vocabulary_gives_the_full_loss(name, top_k):
    student, teacher, mask, labels, conf = _batch()
    perm = torch.randperm(10, generator=torch.Generator().manual_seed(3))
    config = LossConfig(top_k=top_k)
    ref_loss, ref_grad = _loss(name, student, teacher, mask, labels, conf, config)
    loss, grad = _loss(name, student[..., perm], teacher, mask, labels, conf, config, draft_vocab=perm)
    torch.testing.assert_close(loss, ref_loss, **TOL)
    torch.testing.assert_close(grad, ref_grad[..., perm], **TOL)


def _brute_force(student, teacher, vocab):
    """α and TV over the whole vocabulary with q = 0 outside `vocab`, and KL(p renormalised on vocab ‖ q)."""
    q = torch.softmax(expand_logits(student, vocab, teacher.shape[-1]), -1)
    p = torch.softmax(teacher, -1)
    alpha = torch.minimum(p, q).sum(-1)
    tv = 0.5 * (p - q).abs().sum(-1)
    p_in = p[..., vocab] / p[..., vocab].sum(-1, keepdim=True)
    kl = (p_in * (p_in.log() - q[..., vocab].log())).sum(-1)
    return alpha, tv, kl


def test_a_small_draft_vocabulary_gives_the_acceptance_of_a_drafter_with_nothing_outside_it():
    student_full, teacher, mask, labels, conf = _batch(v=16, seed=1)
    vocab = torch.tensor([9, 2, 14, 5, 0])
    student = student_full[..., vocab]
    labels[1] = vocab[1]  # some labels inside V', most outside it
    alpha, tv, kl = _brute_force(student, teacher, vocab)
    torch.testing.assert_close(tv, 1 - alpha, rtol=0, atol=1e-12)
    ds = to_draft_space(LossBatch(student_logits=student, mask=mask, teacher_logits=teacher, labels=labels,
                                  draft_vocab=vocab))
    assert ds.student_logits.shape == (12, 3, 6) and ds.in_draft_space
    torch.testing.assert_close(token_alpha(ds.student_logits[mask], ds.teacher_logits[mask]), alpha[mask], **TOL)
    m = mask.double()

    def loss(name, **kw):
        return _loss_plain(name, student, teacher, mask, labels, vocab, **kw)

    per_depth = (tv * m).sum(0) / m.sum(0)
    torch.testing.assert_close(loss("tv"), per_depth.mean(), **TOL)
    lk = (-torch.log(alpha + 1e-6) * m).sum(0) / m.sum(0)
    torch.testing.assert_close(loss("lk_alpha"), lk.mean(), **TOL)
    full = mask.all(-1)
    e2e = 1 - torch.cumprod(alpha[full], 1).mean(1)
    torch.testing.assert_close(loss("e2e_tv"), e2e.mean(), **TOL)
    torch.testing.assert_close(loss("kl"), ((kl * m).sum(0) / m.sum(0)).mean(), **TOL)
    inside = mask & torch.isin(labels, vocab)  # CE covers the labels the drafter can propose
    q_lab = torch.log_softmax(expand_logits(student, vocab, 16), -1).gather(-1, labels[..., None])[..., 0]
    ce = (torch.where(inside, -q_lab, 0.0).sum(0) / inside.sum(0).clamp_min(1))
    torch.testing.assert_close(loss("ce"), ce.mean(), **TOL)


def _loss_plain(name, student, teacher, mask, labels, vocab, top_k=None):
    lb = LossBatch(student_logits=student, mask=mask, teacher_logits=teacher, labels=labels, draft_vocab=vocab)
    return LOSSES[name](lb, LossConfig(top_k=top_k)).loss


@pytest.mark.parametrize("top_k", [None, 3])
def test_every_loss_and_gradient_is_finite_with_a_small_draft_vocabulary(top_k):
    student_full, teacher, mask, labels, conf = _batch(v=16, seed=2)
    vocab = torch.tensor([4, 11, 7])
    teacher[2, 0, :] = -30.0  # a row whose teacher mass lies almost all outside V'
    teacher[2, 0, 8] = 30.0
    for name in sorted(LOSSES):
        loss, grad = _loss(name, student_full[..., vocab], teacher, mask, labels, conf, LossConfig(top_k=top_k),
                           draft_vocab=vocab)
        assert torch.isfinite(loss) and bool(torch.isfinite(grad).all()), name
        assert grad.abs().max() > 0, name


# ----- TTT, MTP / EAGLE-3 steps -----


def _mtp_setup(kind="mtp", vocab=64, draft=None, seed=0):
    """A float64 MTP / EAGLE-3 block with a draft vocabulary of `draft` ids (default: all, permuted), packed rows
    of several documents, random taps and teacher logits."""
    target = tiny_decoder(vocab=vocab, layers=2 if kind == "mtp" else 3)
    if draft is None:
        draft = torch.randperm(vocab, generator=torch.Generator().manual_seed(5))
    if kind == "mtp":
        cfg = replace(MTPConfig.for_target(target.config, num_depths=3), draft_vocab_size=len(draft))
        model = MTPDraftModel(cfg, target.embed_tokens, target.lm_head)
        taps = 1
    else:
        cfg = Eagle3Config.for_target(target.config, num_depths=3, target_layer_ids=(0, 1, 2))
        model = Eagle3DraftModel(replace(cfg, draft_vocab_size=len(draft)), target.embed_tokens, target.lm_head)
        taps = 3
    model.init_weights(std=0.2, generator=torch.Generator().manual_seed(1))
    model = model.double()
    model.set_draft_vocab(draft)
    g = torch.Generator().manual_seed(seed)
    docs = [Doc(torch.randint(0, vocab, (n,), generator=g), (torch.rand(n, generator=g) > 0.2).long())
            for n in (9, 7, 5, 12, 3, 6, 10)]
    packed = pack_documents(docs, 24, pad_id=0)
    hidden = torch.randn(*packed.input_ids.shape, 32 * taps, generator=g, dtype=torch.float64)
    teacher = torch.randn(*packed.input_ids.shape, vocab, generator=g, dtype=torch.float64) * 3
    return model, packed, hidden, teacher


def _mtp_step(model, packed, hidden, teacher, name, train_vocab):
    out = ttt_rollout(model, hidden, packed.input_ids, packed.positions, packed.document_ids, 3,
                      train_vocab=train_vocab,
                      memory=RolloutMemory(keep_logits=False, checkpoint_depths=True, query_chunk=5, key_chunk=8))
    clb = mtp_chunked_loss_batch(model, out, packed, teacher, max_logits=7 * 3 * 64, train_vocab=train_vocab,
                                 track_alpha=True)
    lo = LOSSES[name](clb, LossConfig())
    lo.loss.backward()
    return lo, _grads(model)


@pytest.mark.parametrize(("kind", "name"), [("mtp", "e2e_tv"), ("mtp", "lk_lambda"), ("mtp", "dpace_lk"),
                                            ("mtp", "ce"), ("eagle3", "lk_alpha")])
def test_an_mtp_step_on_the_whole_vocabulary_as_draft_vocabulary_equals_the_full_step(kind, name):
    model, packed, hidden, teacher = _mtp_setup(kind)
    ref, ref_grads = _mtp_step(model, packed, hidden, teacher, name, "full")
    lo, grads = _mtp_step(model, packed, hidden, teacher, name, "draft")
    _same(lo.loss.detach(), grads, ref.loss.detach(), ref_grads)
    torch.testing.assert_close(lo.parts["alpha_per_depth"], ref.parts["alpha_per_depth"], **TOL)


def test_ttt_next_depth_tokens_are_draft_vocabulary_ids():
    vocab = torch.tensor([3, 17, 40, 8, 61, 25])
    model, packed, hidden, teacher = _mtp_setup(draft=vocab)
    args = (model, hidden, packed.input_ids, packed.positions, packed.document_ids, 3)
    full = ttt_rollout(*args, memory=RolloutMemory(keep_logits=False))
    assert not bool(torch.isin(full.inputs[:, :, 1:], vocab).all())  # the full head picks ids outside V' here
    for keep in (False, True):
        out = ttt_rollout(*args, train_vocab="draft", memory=RolloutMemory(keep_logits=keep))
        assert bool(torch.isin(out.inputs[:, :, 1:], vocab).all())
    assert out.logits.shape[-1] == len(vocab)
    # the kept-logits reference and the chunked path agree in the draft space too
    lb = mtp_loss_batch(out, packed, teacher, draft_vocab=model.draft_vocab)
    ref = LOSSES["e2e_tv"](lb, LossConfig()).loss
    chunked = ttt_rollout(*args, train_vocab="draft", memory=RolloutMemory(keep_logits=False))
    got = LOSSES["e2e_tv"](mtp_chunked_loss_batch(model, chunked, packed, teacher, max_logits=5 * 3 * 64,
                                                  train_vocab="draft"), LossConfig()).loss
    torch.testing.assert_close(got, ref, **TOL)


# ----- block drafters -----


@pytest.mark.parametrize(("head", "conditioning", "confidence", "name"),
                         [("hidden", "dfly", "tv", "dpace_lk"), ("hidden", "dfly", "tv", "e2e_tv"),
                          ("markov", "dflash", "protocol", "dspark")])
def test_a_block_step_on_the_whole_vocabulary_as_draft_vocabulary_equals_the_full_step(head, conditioning,
                                                                                       confidence, name):
    target = block_target()
    base = tiny_drafter(target, conditioning=conditioning, head=head)
    base = _protocol(base) if confidence == "protocol" else base
    V = target.config.vocab_size
    model = BlockDrafter(replace(base.config, draft_vocab_size=V), *base._shared).double()
    model.load_state_dict(base.state_dict(), strict=False)
    model.set_draft_vocab(torch.randperm(V, generator=torch.Generator().manual_seed(2)))
    g = torch.Generator().manual_seed(4)
    docs = [Doc(torch.randint(6, V, (n,), generator=g), (torch.rand(n, generator=g) > 0.2).long())
            for n in (9, 7, 5, 12, 3, 6, 10)]
    packed = pack_documents(docs, 24, pad_id=0)
    anchor, valid = sample_anchors(packed.loss_mask, 6, document_ids=packed.document_ids, generator=g)
    taps = torch.randn(*packed.input_ids.shape, model.config.num_taps * 32, generator=g, dtype=torch.float64)
    teacher = torch.randn(*packed.input_ids.shape, V, generator=g, dtype=torch.float64) * 3
    K = model.config.block_size - 1

    def step(train_vocab):
        def targets(lb):  # as the trainer's `chunk_targets`
            return confidence_targets(model.config, lb.student_logits.detach(), lb.teacher_logits, lb.mask, None,
                                      model.draft_vocab, draft_columns=lb.draft_vocab is not None)

        out = _forward(model, packed, anchor, valid, taps, compute_logits=False,
                       backbone=BackboneOptions(checkpoint_layers=True))
        clb = block_chunked_loss_batch(model, out, teacher, max_logits=5 * K * V, confidence_targets=targets,
                                       train_vocab=train_vocab)
        objective = LOSSES[name] if name == "dspark" else with_confidence_term(LOSSES[name], 0.7)
        lo = objective(clb, LossConfig())
        lo.loss.backward()
        return lo.loss.detach(), _grads(model)

    ref_loss, ref_grads = step("full")
    loss, grads = step("draft")
    _same(loss, grads, ref_loss, ref_grads)


# ----- the trainers, the config and resume -----


@pytest.fixture(scope="module")
def conversations(tmp_path_factory):
    return write_conversations(tmp_path_factory.mktemp("dvocab_data") / "conv.jsonl", 40, seed=11)


def test_train_vocab_is_checked():
    from angelspec.models.config import ConfigError
    from angelspec.train.block import tiny_debug as block_debug
    from angelspec.train.mtp import tiny_debug

    with pytest.raises(ValueError, match="train_vocab=draft .* has none: set draft_vocab_size=N"):
        replace(tiny_debug(), train_vocab="draft")
    with pytest.raises(ValueError, match="unknown train_vocab 'some'; choose one of full, draft"):
        replace(tiny_debug(), train_vocab="some")
    with pytest.raises(ConfigError, match="train_vocab=draft"):
        replace(block_debug(), train_vocab="draft")
    replace(block_debug(), train_vocab="draft", draft_vocab_size=16)


@pytest.mark.parametrize("drafter", ["mtp", "dfly"])
def test_the_cli_refuses_train_vocab_draft_without_a_draft_vocabulary(capsys, tmp_path, tiny_target_dir,
                                                                      conversations, drafter):
    from conftest import assert_bad_input, run_cli

    common = ["--target", tiny_target_dir, "--data", conversations, "--quiet", "--preset", "tiny_debug"]
    code, _, err = run_cli(capsys, "train", "--drafter", drafter, "--out", tmp_path / "x", *common, "train_vocab=draft")
    assert_bad_input(code, err, "train_vocab=draft", "draft_vocab_size=N")
    code, _, err = run_cli(capsys, "train", "--drafter", drafter, "--out", tmp_path / "x", *common, "train_vocab=top")
    assert_bad_input(code, err, "unknown train_vocab 'top'")
    assert not (tmp_path / "x").exists()


def test_trainers_train_on_the_draft_vocabulary_and_a_resume_cannot_switch_it(tmp_path, tiny_target_dir,
                                                                             conversations):
    from angelspec.train.block import tiny_debug as block_debug
    from angelspec.train.block import train_dfly
    from angelspec.train.checkpoint import TRAINER_STATE, ResumeError
    from angelspec.train.mtp import tiny_debug, train_mtp

    draft = replace(tiny_debug(), draft_vocab_size=16, train_vocab="draft", ckpt_every=1)
    train_mtp(tiny_target_dir, conversations, tmp_path / "d", config=draft, max_minutes=0, **QUIET)  # one step
    with pytest.raises(ResumeError, match="train_vocab: checkpoint 'draft' vs now 'full'"):
        train_mtp(tiny_target_dir, conversations, tmp_path / "d", config=replace(draft, train_vocab="full"),
                  resume=True, **QUIET)
    report = train_mtp(tiny_target_dir, conversations, tmp_path / "d", config=draft, resume=True, **QUIET)
    assert report["steps"] == 3
    log = [json.loads(line) for line in (tmp_path / "d" / "training" / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2, 3]
    assert all(math.isfinite(r["loss"]) and 0 < min(r["alpha_per_depth"]) for r in log)

    # a checkpoint written before the key existed trained on the whole vocabulary: it resumes as "full" only
    full = replace(draft, train_vocab="full")
    train_mtp(tiny_target_dir, conversations, tmp_path / "old", config=full, max_minutes=0, **QUIET)
    state_file = tmp_path / "old" / "training" / "checkpoint" / TRAINER_STATE
    state = json.loads(state_file.read_text())
    del state["train_config"]["train_vocab"]
    state_file.write_text(json.dumps(state))
    with pytest.raises(ResumeError, match="train_vocab: checkpoint 'full' vs now 'draft'"):
        train_mtp(tiny_target_dir, conversations, tmp_path / "old", config=draft, resume=True, **QUIET)
    train_mtp(tiny_target_dir, conversations, tmp_path / "old", config=full, resume=True, **QUIET)

    dfly = replace(block_debug(), steps=2, draft_vocab_size=16, train_vocab="draft")
    report = train_dfly(tiny_target_dir, conversations, tmp_path / "b", config=dfly, **QUIET)
    assert report["steps"] == 2
