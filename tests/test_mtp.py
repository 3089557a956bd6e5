"""MTP drafter with Training-Time Test (report §2): the fast TTT attention against its explicit-mask
reference, packing isolation and the depth-shift gate, lossless decoding through the engine with exact
draft-cache rollback (T=0 token for token, T=1 in distribution with negative controls), training/resume/save/load,
and bad input.

Models are tiny; the engine tests run in float64 so that batched and single-row arithmetic agree far below
any argmax gap."""

from __future__ import annotations

import json
import random

import pytest
import torch
from conftest import (
    RecordingMixin,
    assert_admissions_compile_nothing_mid_run,
    assert_two_calls_draft_as_joined,
    check_lossless_and_recorded,
    mtp_reference_drafts,
    random_requests,
    same_weights,
    train_log,
    write_conversations,
)
from conftest import tiny_decoder as tiny_target
from test_engine_spec import (  # noqa: F401  (dist_case is a fixture)
    WRONG_SAMPLERS,
    assert_t1_matches_target,
    assert_wrong_sampler_detected,
    dist_case,
)

from angelspec.data.packing import Doc, pack_documents
from angelspec.decoding.drafters import get_drafter
from angelspec.decoding.drafters.base import DrafterMismatchError
from angelspec.decoding.drafters.mtp import MTPDrafter
from angelspec.decoding.engine import EngineConfig, Request, SpecEngine, reference_generate
from angelspec.models import Decoder
from angelspec.models.decoder import TrainInputs
from angelspec.models.mtp import MTPConfig, MTPDraftModel
from angelspec.train.losses import LossConfig, get_loss
from angelspec.train.ttt import (
    RolloutMemory,
    depth0_inputs,
    mtp_loss_batch,
    teacher_for_depths,
    ttt_reference_mask,
    ttt_rollout,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_model(target: Decoder, depths: int = 3, seed: int = 1, std: float = 0.3) -> MTPDraftModel:
    model = MTPDraftModel(MTPConfig.for_target(target.config, num_depths=depths), target.embed_tokens, target.lm_head)
    model.init_weights(std=std, generator=torch.Generator().manual_seed(seed))
    return model.to(target.embed_tokens.weight.dtype)


def packed_docs(lengths: list[int], seq_len: int, vocab: int, seed: int = 0) -> tuple[list[Doc], object]:
    g = torch.Generator().manual_seed(seed)
    docs = []
    for n in lengths:
        mask = (torch.rand(n, generator=g) > 0.3).long()
        docs.append(Doc(torch.randint(0, vocab, (n,), generator=g), mask))
    return docs, pack_documents(docs, seq_len, pad_id=0)


# ---------------------------------------------------------------------------------------------------------
# TTT attention: fast == explicit (D·T)×(D·T) mask reference
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("dtype", "std"), [(torch.float64, 0.3), (torch.float32, 0.05)])
def test_fast_ttt_matches_explicit_mask_reference(dtype, std):
    """fp64 with large weights (sharp attention, 1e-10) and fp32 at a realistic init scale (1e-5)."""
    target = tiny_target(dtype=dtype)
    model = tiny_model(target, depths=4, std=std)
    _, packed = packed_docs([9, 7, 5, 12, 3], seq_len=20, vocab=64)
    assert packed.num_rows >= 2 and (packed.document_ids == -1).any()  # several docs per row and padding
    h = torch.randn(*packed.input_ids.shape, 32, dtype=dtype, generator=torch.Generator().manual_seed(2))
    args = (model, h, packed.input_ids, packed.positions, packed.document_ids, 4)
    fast, ref = ttt_rollout(*args, memory=RolloutMemory(query_chunk=6)), ttt_rollout(*args, attention="reference")
    assert torch.equal(fast.inputs, ref.inputs)  # same argmax chain
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(fast.hidden, ref.hidden, atol=tol, rtol=0)
    torch.testing.assert_close(fast.logits, ref.logits, atol=tol, rtol=0)
    # gradients agree too
    gf = torch.autograd.grad(fast.logits.square().mean(), model.proj.weight)[0]
    gr = torch.autograd.grad(ref.logits.square().mean(), model.proj.weight)[0]
    torch.testing.assert_close(gf, gr, atol=tol, rtol=1e-4)
    # per-depth activation checkpointing recomputes the same graph: bit-identical values and gradients
    ck = ttt_rollout(*args, memory=RolloutMemory(checkpoint_depths=True, query_chunk=6))
    assert torch.equal(ck.logits, fast.logits)
    assert torch.equal(torch.autograd.grad(ck.logits.square().mean(), model.proj.weight)[0], gf)


def test_prefix_attention_backward_matches_autograd():
    """The tiled document-masked attention (online softmax forward; backward with recomputed probabilities and the
    + ∂lse term) == the dense plain-autograd twin, for every tiling, and gradcheck."""
    from angelspec.models.attention import (
        document_first_index,
        document_prefix_attention,
        document_prefix_attention_reference,
    )

    g = torch.Generator().manual_seed(0)
    B, Hkv, G, T, Dh = 2, 2, 2, 7, 4
    q = torch.randn(B, Hkv * G, T, Dh, dtype=torch.float64, generator=g, requires_grad=True)
    k = torch.randn(B, Hkv, T, Dh, dtype=torch.float64, generator=g, requires_grad=True)
    v = torch.randn(B, Hkv, T, Dh, dtype=torch.float64, generator=g, requires_grad=True)
    doc = torch.tensor([[0, 0, 0, 1, 1, 1, -1], [0] * 7])
    last, first = torch.arange(T)[None], document_first_index(doc)
    w_out, w_lse = torch.randn(B, Hkv * G, T, Dh, dtype=torch.float64), torch.randn(B, Hkv * G, T, dtype=torch.float64)

    def loss(fn):
        out, lse = fn(q, k, v, last, doc, doc)
        return (out * w_out).sum() + (lse * w_lse).sum()

    ref = torch.autograd.grad(loss(document_prefix_attention_reference), (q, k, v))
    # several query chunks, exactly one, one larger than T; key tiles smaller than, equal to and above the query's
    for qc, kc in ((3, 3), (3, 2), (7, 7), (256, 1), (2, 5), (256, 1024)):
        def fast(*a, qc=qc, kc=kc):
            return document_prefix_attention(*a, q_first=first, q_chunk=qc, k_chunk=kc)

        got = torch.autograd.grad(loss(fast), (q, k, v))
        for a, b in zip(got, ref, strict=True):
            torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)
    assert torch.autograd.gradcheck(
        lambda q, k, v: document_prefix_attention(q, k, v, last, doc, doc, first, q_chunk=3, k_chunk=2), (q, k, v))


def test_reference_mask_is_the_ttt_pattern():
    doc = torch.tensor([[0, 0, 0, 1, 1]])
    m = ttt_reference_mask(doc, 1, 5, 3)[0, 0]  # [15, 15]
    T = 5
    # depth 2, position 2 (index 12): depth-0 keys 0..2, depth-1 key at 2, depth-2 key at 2
    assert m[2 * T + 2].nonzero().flatten().tolist() == [0, 1, 2, T + 2, 2 * T + 2]
    # depth 1, position 4 (second document): depth-0 keys 3..4 and the own diagonal key
    assert m[T + 4].nonzero().flatten().tolist() == [3, 4, T + 4]
    # depth 0 never sees a draft key
    assert not m[:T, T:].any()


def test_depth_alignment_and_teacher_shift():
    """Depth k at i fuses x_{i+1} (depth 0) and is scored against the target's logits at i+k+1 and label x_{i+k+2}."""
    ids = torch.arange(10)[None]
    doc = torch.tensor([[0] * 6 + [1] * 4])
    assert depth0_inputs(ids, doc, pad_id=99).tolist() == [[1, 2, 3, 4, 5, 99, 7, 8, 9, 99]]
    tl = torch.arange(10.0)[None, :, None].expand(1, 10, 2)  # "logits" holding their own position
    t = teacher_for_depths(tl, 3)  # [1, 10, 3, 2]
    assert t[0, 2, :, 0].tolist() == [3.0, 4.0, 5.0]


# ---------------------------------------------------------------------------------------------------------
# Packing: perturbing one document leaves every other document's losses bit-for-bit unchanged
# ---------------------------------------------------------------------------------------------------------


def _per_doc_losses(model, target, docs, seq_len):
    packed = pack_documents(docs, seq_len, pad_id=0)
    with torch.no_grad():
        tout = target(packed.input_ids, TrainInputs(positions=packed.positions, document_ids=packed.document_ids,
                                                    hidden_layers=[model.config.target_layer_id]))
        out = ttt_rollout(model, tout.hidden[0], packed.input_ids, packed.positions, packed.document_ids, 3)
    lb = mtp_loss_batch(out, packed, tout.logits)
    per_doc = {}
    for d in range(len(docs)):
        rows = (packed.document_ids.reshape(-1) == d)
        sub = type(lb)(student_logits=lb.student_logits[rows], mask=lb.mask[rows],
                       teacher_logits=lb.teacher_logits[rows], labels=lb.labels[rows])
        per_doc[d] = (get_loss("e2e_tv")(sub, LossConfig()).loss, get_loss("ce")(sub, LossConfig()).loss,
                      out.logits.reshape(-1, 3, out.logits.shape[-1])[rows])
    return per_doc, packed


def test_packed_documents_do_not_leak():
    target = tiny_target()
    model = tiny_model(target)
    docs, _ = packed_docs([9, 7, 5, 12, 3, 6], seq_len=24, vocab=64, seed=3)
    base, packed = _per_doc_losses(model, target, docs, 24)
    victim = packed.row_docs[0][0]
    assert len(packed.row_docs[0]) >= 2  # the victim shares its row
    changed = list(docs)
    ids = torch.as_tensor(docs[victim].input_ids).clone()
    ids[-1] = (ids[-1] + 1) % 64  # the last token: it is the depth-0 input of the previous position
    changed[victim] = Doc(ids, docs[victim].loss_mask)
    after, packed2 = _per_doc_losses(model, target, changed, 24)
    assert torch.equal(packed.document_ids, packed2.document_ids)
    for d in range(len(docs)):
        if d != victim:
            assert torch.equal(base[d][0], after[d][0]) and torch.equal(base[d][1], after[d][1])
            assert torch.equal(base[d][2], after[d][2])
    assert not torch.equal(base[victim][2], after[victim][2])


def test_depth_shift_gate_never_crosses_a_document_end():
    target = tiny_target()
    model = tiny_model(target)
    docs, packed = packed_docs([6, 5, 4], seq_len=16, vocab=64, seed=4)
    h = torch.zeros(*packed.input_ids.shape, 32, dtype=torch.float64)
    out = ttt_rollout(model, h, packed.input_ids, packed.positions, packed.document_ids, 3)
    lb = mtp_loss_batch(out, packed, None)
    mask = lb.mask.reshape(*packed.input_ids.shape, 3)
    doc = packed.document_ids
    T = doc.shape[1]
    for r in range(doc.shape[0]):
        for i in range(T):
            for k in range(3):
                j = i + k + 2
                ok = (j < T and doc[r, i] >= 0 and bool((doc[r, i:j + 1] == doc[r, i]).all())
                      and bool(packed.loss_mask[r, j]))
                assert bool(mask[r, i, k]) == ok
                if ok:
                    assert lb.labels.reshape(*doc.shape, 3)[r, i, k] == packed.input_ids[r, j]


# ---------------------------------------------------------------------------------------------------------
# Engine: lossless greedy decoding, and the incremental drafter == the training rollout (trap 4)
# ---------------------------------------------------------------------------------------------------------


class RecordingMTP(RecordingMixin, MTPDrafter):
    """Remembers each row's committed sequence and every greedy proposal made from it."""

    def allocate(self, *args, **kw):
        super().allocate(*args, **kw)
        self.start_recording()


@pytest.mark.parametrize(("vocab", "k", "batch"), [(64, 3, 6), (8, 5, 6), (8, 3, 1)])
def test_greedy_spec_decoding_is_lossless_and_drafts_match_training(vocab, k, batch):
    """Batch 1 runs a round's catch-up and its depths as one call (`caught_up_round`), larger batches apart."""
    target = tiny_target(vocab=vocab, heads=2, kv=1)
    drafter = RecordingMTP(tiny_model(target, depths=3))  # k=5 > D=3: the model is reused recurrently
    rng = random.Random(vocab)
    reqs = [Request([rng.randrange(vocab) for _ in range(rng.randint(1, 24))], max_new_tokens=64, stop_ids=())
            for _ in range(20)]
    # Some drafts are accepted, so rollback after partial accepts runs; it is exact iff every proposal equals the
    # from-scratch training rollout on the committed prefix.
    check_lossless_and_recorded(target, drafter, reqs, EngineConfig(max_batch_size=batch, num_draft_tokens=k), 5,
                                lambda seq: mtp_reference_drafts(drafter.model, target, seq, k))


def test_a_one_row_round_as_two_calls_drafts_what_the_joined_call_drafts():
    """`join_catch_up = False`: a one-row round's catch-up and its K depths as two calls."""
    target = tiny_target(heads=2, kv=1)
    model = tiny_model(target, depths=2)
    assert_two_calls_draft_as_joined(target, lambda: RecordingMTP(model), random_requests(64, 3, 16, seed=9))


@pytest.mark.parametrize("batch", [1, 2])
def test_compiled_mtp_is_lossless_and_drafts_as_eager(batch):
    """EngineConfig(compile=True): a one-row engine runs each greedy round as one graph (several cache writes and
    reads in it), a larger one each depth as one graph; both equal AR and propose exactly the eager drafts."""
    import warnings

    target = tiny_target(heads=2, kv=1)
    model = tiny_model(target, depths=2)
    rng = random.Random(7)
    reqs = [Request([rng.randrange(64) for _ in range(rng.randint(1, 12))], max_new_tokens=16, stop_ids=())
            for _ in range(3)]
    eager = RecordingMTP(model)
    SpecEngine(target, eager, EngineConfig(max_batch_size=batch, num_draft_tokens=3)).generate(reqs)
    compiled = RecordingMTP(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # try_compile warns when it falls back to eager
        got = SpecEngine(target, compiled, EngineConfig(max_batch_size=batch, num_draft_tokens=3, compile=True)
                         ).generate(reqs)
    assert [r.token_ids for r in got] == [r.token_ids for r in reference_generate(target, reqs)]
    assert compiled.proposals == eager.proposals


def test_compiled_mtp_admits_any_number_of_requests_without_compiling_mid_run():
    """Under load a request is admitted whenever one finishes: prefill runs the cached forward over 1, 2, ... rows
    and their longest prompt, shapes the run before never saw. Compiled, each cost a fresh graph mid-run (a compiled
    serving point at C=16 ran at 0.07x of AR); prefill now runs eagerly, so a second run with other admissions
    compiles nothing, and its outputs are still AR's. (EAGLE-3's adapter is this one.)"""
    target = tiny_target(heads=2, kv=1)
    assert_admissions_compile_nothing_mid_run(target, MTPDrafter(tiny_model(target, depths=2)), 64)


def test_sampling_smoke_t1():
    from angelspec.decoding.sampling import SamplingParams

    target = tiny_target(heads=2, kv=1)
    engine = SpecEngine(target, MTPDrafter(tiny_model(target)), EngineConfig(max_batch_size=3, num_draft_tokens=3))
    reqs = [Request([5, 6, 7][: i + 1], max_new_tokens=16, sampling=SamplingParams(temperature=1.0, seed=i),
                    stop_ids=()) for i in range(3)]
    out = engine.generate(reqs)
    assert [len(r.token_ids) for r in out] == [16, 16, 16]


def test_t1_sampled_drafts_keep_the_target_distribution(dist_case):  # noqa: F811
    """Standard speculative sampling with the MTP drafter's sampled drafts (T=1) emits the target's distribution:
    chi-square on the first three tokens of 4000 seeded requests against the target's exact softmax (alpha 1e-4).
    Depth 1's q is conditioned on the sampled depth-0 draft, so it must be the q that draft was drawn from."""
    tgt, _, joint = dist_case
    assert_t1_matches_target(tgt, MTPDrafter(tiny_model(tgt)), joint, "mtp")


@pytest.mark.parametrize("wrong", WRONG_SAMPLERS)
def test_t1_distribution_test_detects_a_wrong_sampler(dist_case, monkeypatch, wrong):  # noqa: F811
    """Negative control for the test above: the same drafter and statistics with the min(1, p/q) test removed,
    or with depth 1's q replaced by depth 0's, must fail."""
    tgt, _, joint = dist_case
    assert_wrong_sampler_detected(tgt, MTPDrafter(tiny_model(tgt)), joint, wrong, monkeypatch)


def test_registry_and_mismatch(tmp_path):
    from angelspec.models.mtp_io import save_mtp

    assert get_drafter("mtp") is MTPDrafter
    target = tiny_target(heads=2, kv=1)
    save_mtp(tiny_model(target), tmp_path / "d")
    drafter = MTPDrafter.from_pretrained(tmp_path / "d", target=target)
    assert drafter.target_layer_ids == (1,)
    other = tiny_target(vocab=96, heads=2, kv=1)
    with pytest.raises(DrafterMismatchError, match="fingerprint"):
        MTPDrafter.from_pretrained(tmp_path / "d", target=other)
    with pytest.raises(DrafterMismatchError, match="another tokenizer"):
        SpecEngine(other, drafter)  # the engine's own check, before any decoding


def test_cli_loads_an_mtp_folder_sharing_the_targets_modules(tmp_path):
    """`--drafter mtp:DIR` and a bare DIR go through the registry's `from_pretrained(DIR, target=...)`."""
    from angelspec.decoding.loading import resolve_drafter
    from angelspec.models import load_target, save_target
    from angelspec.models.mtp_io import save_mtp

    save_target(tiny_target(heads=2, kv=1, dtype=torch.float32), tmp_path / "t")
    target = load_target(tmp_path / "t")
    save_mtp(tiny_model(target), tmp_path / "m")
    for spec in (f"mtp:{tmp_path / 'm'}", str(tmp_path / "m")):
        drafter = resolve_drafter(spec, target, tmp_path / "t")
        assert isinstance(drafter, MTPDrafter) and drafter.model._shared[0] is target.embed_tokens


def test_mtp_model_state_dict_holds_only_its_own_weights():
    target = tiny_target()
    model = tiny_model(target)
    assert not any(k.startswith(("embed_tokens", "lm_head", "_shared")) for k in model.state_dict())
    h = torch.randn(1, 5, 32, dtype=torch.float64)
    model(h, torch.arange(5)[None], torch.arange(5)[None]).sum().backward()
    assert target.embed_tokens.weight.grad is None and model.proj.weight.grad is not None


# ---------------------------------------------------------------------------------------------------------
# Trainer
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def conversations(tmp_path_factory):
    return write_conversations(tmp_path_factory.mktemp("mtp_data") / "conv.jsonl", 60, seed=5)


def test_train_resume_exact_save_load(tmp_path, tiny_target_dir, conversations):
    from angelspec.models import load_target
    from angelspec.train.mtp import tiny_debug, train_mtp

    kw = dict(config=tiny_debug(), progress=False, log=lambda *_: None)
    report = train_mtp(tiny_target_dir, conversations, tmp_path / "a", **kw)
    assert report["steps"] == 3 and report["assistant_tokens"] > 0
    train_mtp(tiny_target_dir, conversations, tmp_path / "b", max_minutes=0, **kw)  # stops after step 1
    train_mtp(tiny_target_dir, conversations, tmp_path / "b", resume=True, **kw)
    a = same_weights(tmp_path / "a", tmp_path / "b")
    assert not any(k.startswith(("embed_tokens", "lm_head", "_shared")) for k in a)
    raw = json.loads((tmp_path / "a" / "config.json").read_text())
    assert raw["angelspec"]["drafter"] == "mtp"
    logs = train_log(tmp_path / "a")
    assert [r["objective"] for r in logs] == ["lk_alpha", "e2e_tv", "e2e_tv"]
    target = load_target(tiny_target_dir)
    drafter = MTPDrafter.from_pretrained(tmp_path / "a", target=target)
    drafter.check_compatible(target.config)
    with pytest.raises(FileExistsError, match="--force"):
        train_mtp(tiny_target_dir, conversations, tmp_path / "a", **kw)


def test_base_mtp_trains_one_depth_with_ce(tmp_path, tiny_target_dir, conversations):
    from dataclasses import replace

    from angelspec.train.mtp import mtp_base, tiny_debug, train_mtp

    cfg = replace(mtp_base(), **{k: getattr(tiny_debug(), k) for k in ("intermediate_size", "seq_len", "batch_size",
                                                                       "steps", "warmup", "ckpt_every", "log_every")})
    train_mtp(tiny_target_dir, conversations, tmp_path / "base", config=cfg, progress=False, log=lambda *_: None)
    logs = train_log(tmp_path / "base")
    assert {r["objective"] for r in logs} == {"ce"} and len(logs[0]["alpha_per_depth"]) == 1


def test_dataset_without_assistant_tokens_is_a_clear_error(tmp_path, tiny_target_dir):
    from angelspec.train.mtp import tiny_debug, train_mtp

    path = tmp_path / "no_assistant.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "hello there"}]}) + "\n")
    with pytest.raises(ValueError, match="no assistant tokens"):
        train_mtp(tiny_target_dir, path, tmp_path / "o", config=tiny_debug(), progress=False, log=lambda *_: None)


def test_resume_with_another_config_is_refused(tmp_path, tiny_target_dir, conversations):
    from dataclasses import replace

    from angelspec.train.checkpoint import ResumeError
    from angelspec.train.mtp import tiny_debug, train_mtp

    kw = dict(progress=False, log=lambda *_: None)
    train_mtp(tiny_target_dir, conversations, tmp_path / "r", config=tiny_debug(), max_minutes=0, **kw)
    with pytest.raises(ResumeError, match="num_depths"):
        train_mtp(tiny_target_dir, conversations, tmp_path / "r", config=replace(tiny_debug(), num_depths=2),
                  resume=True, **kw)
