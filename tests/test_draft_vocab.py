"""Draft vocabularies (EAGLE-3's reduced draft vocabulary for the block drafters): the frequency choice, the
inference path over the chosen LM-head rows against the full-vocabulary one, losslessness in the engine at T=0
and T=1 (chi-square against the target's distribution, with negative controls), folder round trips, the trainer and the
`angelspec draft-vocab` command."""

from __future__ import annotations

import json
import random
import shutil
from dataclasses import replace
from pathlib import Path

import conftest
import pytest
import torch
from test_block_drafter import MASK, VOCAB, taps_of, tiny_drafter, tiny_target
from test_block_engine import sampling_block_drafter
from test_engine_spec import (  # noqa: F401  (dist_case is a fixture)
    WRONG_SAMPLERS,
    assert_t1_matches_target,
    assert_wrong_sampler_detected,
    dist_case,
)

from angelspec.data.packing import Doc
from angelspec.data.vocab import count_tokens, coverage, frequent_tokens, token_counts
from angelspec.decoding.drafters.block import BlockDrafterAdapter
from angelspec.decoding.drafters.block_propose import BlockProposer
from angelspec.decoding.engine import EngineConfig, Request, SpecEngine, reference_generate
from angelspec.models import ConfigError
from angelspec.models.block.drafter import BlockDrafter
from angelspec.models.block.io import load_block_drafter, save_block_drafter

pytestmark = pytest.mark.usefixtures("one_thread")


def test_frequent_tokens_counts_trained_tokens_keeps_forced_ids_and_breaks_ties_by_id():
    docs = [Doc([5, 5, 7, 9, 9, 9], [0, 1, 1, 1, 1, 1]), Doc([7, 3], None)]
    counts = token_counts(docs, 12)
    assert counts.tolist() == [0, 0, 0, 1, 0, 1, 0, 2, 0, 3, 0, 0]  # the masked-out 5 is not counted
    assert frequent_tokens(counts, 3).tolist() == [9, 7, 3]  # 3 and 5 tie: the lower id
    assert frequent_tokens(counts, 3, always=[11]).tolist() == [9, 7, 11]  # 11 replaces the least frequent
    assert coverage(counts, torch.tensor([9, 7])) == pytest.approx(5 / 7)
    assert count_tokens(torch.tensor([[1, 2], [2, 2]]), torch.tensor([[True, False], [True, True]]), 4).tolist() == [
        0, 1, 2, 0]
    with pytest.raises(ValueError, match="size must be in"):
        frequent_tokens(counts, 13)
    with pytest.raises(ValueError, match="more than the draft vocabulary"):
        frequent_tokens(counts, 1, always=[1, 2])
    with pytest.raises(ValueError, match="outside the target vocabulary"):
        token_counts([Doc([3, 40])], 12)


def with_vocab(model: BlockDrafter, ids: torch.Tensor) -> BlockDrafter:
    """The same drafter, drafting from `ids`."""
    sub = BlockDrafter(replace(model.config, draft_vocab_size=len(ids)), *model._shared)
    sub.load_state_dict(model.state_dict(), strict=False)
    sub.set_draft_vocab(ids)
    return sub.to(torch.float64).eval()


@pytest.mark.parametrize("head", ["none", "markov", "rnn", "hidden"])
@pytest.mark.parametrize("sampled", [False, True])
def test_draft_vocab_propose_is_the_full_head_restricted_to_the_vocabulary(head, sampled):
    target = tiny_target()
    full = tiny_drafter(target, conditioning="dflash" if head != "hidden" else "dfly", head=head, block_size=6,
                        confidence=head == "hidden")
    g = torch.Generator().manual_seed(3)
    B, T = 4, 10
    ids = torch.randint(6, VOCAB, (B, T + 1), generator=g)
    taps = taps_of(target, full, ids)
    lengths = torch.tensor([10, 6, 8, 3])
    perm = torch.randperm(VOCAB, generator=g)

    def select(logits, k):  # a pure function of (logits, k) over the whole vocabulary
        probs = torch.softmax(logits, dim=-1)
        u = torch.rand(B, VOCAB, generator=torch.Generator().manual_seed(50 + k), dtype=torch.float64)
        return (torch.log(u) / probs).argmax(-1), probs

    rule = select if sampled else None
    with torch.no_grad():
        ref = BlockProposer(full).propose_from_taps(taps, lengths, ids[:, T], select=rule)
        # A permuted whole vocabulary changes nothing but the index order.
        same = BlockProposer(with_vocab(full, perm)).propose_from_taps(taps, lengths, ids[:, T], select=rule)
        sub_ids = perm[: VOCAB // 4]
        sub = with_vocab(full, sub_ids)
        got = BlockProposer(sub).propose_from_taps(taps, lengths, ids[:, T], select=rule)
        slow = BlockProposer(sub).reference_propose(anchor_tokens=ids[:, T], cache=_cache_of(sub, taps, lengths),
                                                    kv_len=T, select=rule)
    assert torch.equal(same.tokens, ref.tokens)
    torch.testing.assert_close(same.logits, ref.logits[..., perm])
    assert torch.equal(sub.draft_vocab[got.token_index], got.tokens)
    assert torch.isin(got.tokens, sub_ids).all()
    assert torch.equal(got.tokens, slow.tokens)
    torch.testing.assert_close(got.logits, slow.logits)
    if sampled:
        outside = torch.ones(VOCAB, dtype=torch.bool)
        outside[sub_ids] = False
        assert got.probs[..., outside].abs().max() == 0
        torch.testing.assert_close(got.probs.sum(-1), torch.ones_like(got.probs[..., 0]))
    elif head in ("none", "hidden"):  # position 0 depends only on the anchor: the subset argmax of the full logits
        assert torch.equal(got.tokens[:, 0], sub_ids[ref.logits[:, 0, sub_ids].argmax(-1)])


def _cache_of(model: BlockDrafter, taps: torch.Tensor, lengths: torch.Tensor):
    cache = model.new_cache(taps.shape[0], taps.shape[1], slack=0, dtype=taps.dtype, device="cpu")
    model.append_context(taps, cache, num_new=lengths)
    return cache


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_draft_vocab_drafter_is_lossless_in_the_engine_and_round_trips(tmp_path, temperature):
    target = tiny_target()
    full = tiny_drafter(target, conditioning="dflash", head="markov", block_size=5)
    sub = with_vocab(full, torch.arange(VOCAB)[torch.randperm(VOCAB, generator=torch.Generator().manual_seed(1))][:24])
    save_block_drafter(sub, tmp_path / "d")
    back = load_block_drafter(tmp_path / "d", target)
    assert torch.equal(back.draft_vocab, sub.draft_vocab) and back.config.draft_vocab_size == 24
    rng = random.Random(0)
    from angelspec.decoding.sampling import SamplingParams

    reqs = [Request([rng.randrange(VOCAB) for _ in range(rng.randint(2, 12))], max_new_tokens=24, stop_ids=(),
                    sampling=SamplingParams(temperature=temperature, seed=i)) for i in range(6)]
    engine = SpecEngine(target, BlockDrafterAdapter(back), EngineConfig(max_batch_size=3, num_draft_tokens=4))
    got = engine.generate(reqs)
    if temperature == 0.0:
        assert [r.token_ids for r in got] == [r.token_ids for r in reference_generate(target, reqs)]
    else:  # the engine's own AR path draws the same per-request noise only for the bonus/AR tokens: check validity
        assert all(len(r.token_ids) == 24 for r in got)
        assert engine.metrics.protocols.get("speculative", 0) + engine.metrics.protocols.get("deterministic", 0) > 0


def test_bad_draft_vocabularies_are_clear_errors():
    target = tiny_target()
    full = tiny_drafter(target)
    with pytest.raises(ConfigError, match="drafts from the whole vocabulary"):
        full.set_draft_vocab([1, 2])
    sub = with_vocab(full, torch.arange(8))
    with pytest.raises(ConfigError, match="8 distinct target ids"):
        sub.set_draft_vocab([1, 1, 2, 3, 4, 5, 6, 7])
    with pytest.raises(ConfigError, match="draft_vocab_size must be an int in"):
        replace(full.config, draft_vocab_size=VOCAB + 1)
    assert MASK < VOCAB


@pytest.fixture(scope="module")
def conversations(tmp_path_factory):
    return conftest.write_conversations(tmp_path_factory.mktemp("vocab_data") / "conv.jsonl", 24, seed=3)


def test_trainer_and_cli_choose_the_most_frequent_assistant_tokens(capsys, tmp_path, tiny_target_dir, conversations):
    from angelspec.cli import main
    from angelspec.data.tokenizer import load_tokenizer
    from angelspec.models import load_target
    from angelspec.train.block import tiny_debug, train_block_drafter
    from angelspec.train.data import load_conversations

    target = load_target(tiny_target_dir)
    docs, _ = load_conversations(load_tokenizer(tiny_target_dir), conversations, 64)
    counts = token_counts(docs, target.config.vocab_size)
    want = frequent_tokens(counts, 40, always=target.config.eos_token_ids)
    train_block_drafter(tiny_target_dir, conversations, tmp_path / "t", config=replace(
        tiny_debug(), steps=1, seq_len=64, draft_vocab_size=40), progress=False, log=lambda *_: None)
    trained = load_block_drafter(tmp_path / "t", target)
    assert sorted(trained.draft_vocab.tolist()) == sorted(want.tolist())
    # The command gives an already trained full-vocabulary drafter one.
    train_block_drafter(tiny_target_dir, conversations, tmp_path / "f", config=replace(tiny_debug(), steps=1),
                        progress=False, log=lambda *_: None)
    code = main(["draft-vocab", "--target", str(tiny_target_dir), "--drafter", str(tmp_path / "f"), "--data",
                 str(conversations), "--size", "40", "--out", str(tmp_path / "v")])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "cover" in out
    meta = json.loads((tmp_path / "v" / "config.json").read_text())
    assert meta["block_drafter_config"]["draft_vocab_size"] == 40 and meta["angelspec"]["draft_vocab"]["size"] == 40
    assert sorted(load_block_drafter(tmp_path / "v", target).draft_vocab.tolist()) == sorted(
        frequent_tokens(token_counts(load_conversations(load_tokenizer(tiny_target_dir), conversations,
                                                        target.config.max_position_embeddings)[0],
                                     target.config.vocab_size), 40, always=target.config.eos_token_ids).tolist())
    assert main(["draft-vocab", "--target", str(tiny_target_dir), "--drafter", str(tmp_path / "f"), "--data",
                 str(conversations), "--size", "999999"]) == 2
    assert "exceeds the target vocabulary" in capsys.readouterr().err


def decode_inside_vocab(target, drafter, vocab: torch.Tensor, temperature: float, *, seed: int, num_requests: int,
                        max_new_tokens: int) -> list:
    """Decode random requests through the engine with `drafter`; at T=0 the outputs must equal AR, every draft
    must lie in `vocab` and every sampling distribution must be 0 outside it. -> the proposals seen."""
    from angelspec.decoding.sampling import SamplingParams

    seen = conftest.record_proposals(drafter)
    rng = random.Random(seed)
    reqs = [Request([rng.randrange(VOCAB) for _ in range(rng.randint(2, 10))], max_new_tokens=max_new_tokens,
                    stop_ids=(), sampling=SamplingParams(temperature=temperature, seed=i))
            for i in range(num_requests)]
    out = SpecEngine(target, drafter, EngineConfig(max_batch_size=2, num_draft_tokens=3)).generate(reqs)
    if temperature == 0.0:
        assert [r.token_ids for r in out] == [r.token_ids for r in reference_generate(target, reqs)]
    assert all(torch.isin(p.tokens, vocab).all() for p in seen)
    if temperature > 0:
        outside = torch.ones(VOCAB, dtype=torch.bool)
        outside[vocab] = False
        assert all(p.probs[..., outside].abs().max() == 0 for p in seen if p.probs is not None)
    return seen


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_draft_lm_with_a_draft_vocabulary_is_lossless_and_samples_inside_it(temperature):
    from angelspec.decoding.drafters import DraftLMDrafter

    target = conftest.tiny_decoder(vocab=VOCAB, layers=2, seed=0)
    draft = conftest.tiny_decoder(vocab=VOCAB, layers=1, seed=5)
    draft.load_state_dict(target.state_dict(), strict=False)
    vocab = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(2))[:20]
    drafter = DraftLMDrafter(draft, draft_vocab=vocab, stop_below=None)
    decode_inside_vocab(target, drafter, vocab, temperature, seed=1, num_requests=5, max_new_tokens=20)
    with pytest.raises(ValueError, match="distinct token ids"):
        DraftLMDrafter(draft, draft_vocab=[1, 1])


def test_cli_gives_a_draft_lm_folder_a_draft_vocabulary(capsys, tmp_path, tiny_target_dir, conversations):
    from angelspec.cli import main
    from angelspec.decoding.drafters import DraftLMDrafter
    from angelspec.models import Decoder, load_target, save_target

    cfg = load_target(tiny_target_dir).config
    save_target(Decoder(replace(cfg, num_hidden_layers=1)), tmp_path / "dlm")
    assert main(["draft-vocab", "--target", str(tiny_target_dir), "--drafter", str(tmp_path / "dlm"), "--data",
                 str(conversations), "--size", "30", "--force"]) == 0  # in place
    capsys.readouterr()
    drafter = DraftLMDrafter.from_pretrained(tmp_path / "dlm")
    assert drafter.draft_vocab is not None and drafter.draft_vocab.numel() == 30
    assert main(["draft-vocab", "--target", str(tiny_target_dir), "--drafter", str(tmp_path), "--data",
                 str(conversations), "--size", "30"]) == 2
    assert "neither a block drafter nor a draft LM" in capsys.readouterr().err
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "config.json").write_text('{"model_type": "qw')  # a copy cut short
    assert main(["draft-vocab", "--target", str(tiny_target_dir), "--drafter", str(tmp_path / "half"), "--data",
                 str(conversations), "--size", "30"]) == 2
    assert "is not valid JSON" in capsys.readouterr().err


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_draft_vocab_in_place_needs_force_and_is_refused_before_anything_is_written(capsys, tmp_path,
                                                                                   tiny_target_dir, conversations):
    """Without --out the command would replace the drafter the user trained: it needs --force, and without it
    nothing is written (the folder, spelled any way, stays byte for byte and nothing appears beside it)."""
    from angelspec.decoding.drafters import DraftLMDrafter
    from angelspec.models import Decoder, load_target, save_target

    dlm = tmp_path / "work" / "dlm"
    save_target(Decoder(replace(load_target(tiny_target_dir).config, num_hidden_layers=1)), dlm)
    (dlm / "training").mkdir()
    (dlm / "training" / "train_log.jsonl").write_text('{"step": 1}\n')  # a file the rewrite must keep
    before = _files(dlm)
    common = ["draft-vocab", "--target", tiny_target_dir, "--drafter", dlm, "--data", conversations, "--size", 30]
    for extra in ([], ["--out", dlm / "."], ["--out", tmp_path / "work" / ".." / "work" / "dlm"]):
        code, _, err = conftest.run_cli(capsys, *common, *extra)
        conftest.assert_bad_input(code, err, str(dlm), "in place", "--out DIR", "--force")
        assert _files(dlm) == before and sorted(p.name for p in dlm.parent.iterdir()) == ["dlm"]
    code, out, err = conftest.run_cli(capsys, *common, "--force")
    assert code == 0, err
    assert DraftLMDrafter.from_pretrained(dlm).draft_vocab.numel() == 30
    after = _files(dlm)
    assert after.pop("config.json") != before.pop("config.json") and after == before  # only the config changed
    assert sorted(p.name for p in dlm.parent.iterdir()) == ["dlm"]  # no temp or earlier folder left beside it


def test_a_killed_draft_vocab_leaves_the_drafter_whole(tmp_path, tiny_target_dir, conversations):
    """A kill at any rename or folder removal of an in-place rewrite (two files: weights and config) leaves the
    drafter as it was or complete with its draft vocabulary, never one file of each; after a kill between the
    swap's renames the earlier folder waits under the twin name, and the next run puts it back and finishes."""
    from test_checkpoint import Killed, kill_at

    from angelspec.models import load_target
    from angelspec.models.mtp_io import load_mtp, save_mtp
    from angelspec.train.draft_vocab import OLD_SUFFIX, apply_draft_vocab

    target = load_target(tiny_target_dir)
    pristine = save_mtp(_mtp_with_vocab("mtp", target, None), tmp_path / "pristine")
    before = _files(pristine)

    def run(folder: Path) -> None:
        apply_draft_vocab(folder, conversations, 40, target=tiny_target_dir, force=True)

    def new_and_whole(folder: Path) -> bool:
        return folder.is_dir() and load_mtp(folder, target).config.draft_vocab_size == 40

    kills = 0
    for n in range(1, 50):
        root = tmp_path / f"n{n}"
        folder = root / "mtp"
        shutil.copytree(pristine, folder)
        with kill_at(n, folder):
            try:
                run(folder)
            except Killed:
                kills += 1
            else:
                break
        twin = folder.with_name(folder.name + OLD_SUFFIX)
        if folder.is_dir():
            assert new_and_whole(folder) or _files(folder) == before, f"kill at call {n}: a mix"
        else:  # between the renames: the earlier folder, whole, under the twin name
            assert _files(twin) == before, f"kill at call {n}"
        run(folder)
        assert new_and_whole(folder) and [p.name for p in root.iterdir()] == ["mtp"], (n, list(root.iterdir()))
    assert kills >= 4  # both file writes and both renames of the swap were reached


# ---------------------------------------------------------------------------------------------------------
# The MTP family (MTP, EAGLE-3): the same draft vocabulary on the model's LM head
# ---------------------------------------------------------------------------------------------------------


def _mtp_with_vocab(kind: str, target, vocab: torch.Tensor | None):
    from angelspec.models.eagle3 import Eagle3Config
    from angelspec.models.mtp import MTPConfig
    from angelspec.models.mtp_io import build_mtp_model

    cls = {"mtp": MTPConfig, "eagle3": Eagle3Config}[kind]
    cfg = replace(cls.for_target(target.config, num_depths=2), draft_vocab_size=0 if vocab is None else len(vocab))
    model = build_mtp_model(cfg, target.embed_tokens, target.lm_head)
    model.init_weights(std=0.3, generator=torch.Generator().manual_seed(4))
    if vocab is not None:
        model.set_draft_vocab(vocab)
    return model.to(target.embed_tokens.weight.dtype).eval()


@pytest.mark.parametrize("kind", ["mtp", "eagle3"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_mtp_family_draft_vocab_is_lossless_restricted_and_round_trips(tmp_path, kind, temperature):
    """An MTP / EAGLE-3 model with a draft vocabulary scores exactly the full head's logits restricted to those
    ids, drafts and samples only inside them, stays lossless, and its folder keeps the ids."""
    from angelspec.decoding.drafters.mtp import MTPDrafter
    from angelspec.models.mtp_io import load_mtp, save_mtp

    target = conftest.tiny_decoder(vocab=VOCAB, layers=5, seed=0)
    vocab = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(6))[:24]
    sub = _mtp_with_vocab(kind, target, vocab)
    full = _mtp_with_vocab(kind, target, None)
    full.load_state_dict({k: v for k, v in sub.state_dict().items() if k != "draft_vocab"})
    save_mtp(sub, tmp_path / "d")
    back = load_mtp(tmp_path / "d", target, kind=kind)
    assert back.config.draft_vocab_size == 24 and torch.equal(back.draft_vocab, vocab)
    h = torch.randn(3, target.config.hidden_size, dtype=target.embed_tokens.weight.dtype)
    with torch.no_grad():
        restricted = back.draft_head(h)  # [3, 24]
        torch.testing.assert_close(restricted, full.logits(h)[:, vocab])
    seen = decode_inside_vocab(target, MTPDrafter(back), vocab, temperature, seed=2, num_requests=4,
                               max_new_tokens=16)
    if temperature > 0:
        assert any(p.probs is not None for p in seen)  # the sampled path was exercised
    assert all(((p.confidences > 0) & (p.confidences <= 1)).all() for p in seen)


def test_mtp_trainer_and_cli_give_an_mtp_drafter_a_draft_vocabulary(capsys, tmp_path, tiny_target_dir,
                                                                    conversations):
    from angelspec.cli import main
    from angelspec.data.tokenizer import load_tokenizer
    from angelspec.models import load_target
    from angelspec.models.mtp_io import load_mtp
    from angelspec.train.data import load_conversations
    from angelspec.train.mtp import tiny_debug, train_mtp

    target = load_target(tiny_target_dir)
    docs, _ = load_conversations(load_tokenizer(tiny_target_dir), conversations, 64)
    want = frequent_tokens(token_counts(docs, target.config.vocab_size), 40, always=target.config.eos_token_ids)
    quiet = {"progress": False, "log": lambda *_: None}
    train_mtp(tiny_target_dir, conversations, tmp_path / "t",
              config=replace(tiny_debug(), steps=1, draft_vocab_size=40), **quiet)
    assert sorted(load_mtp(tmp_path / "t", target).draft_vocab.tolist()) == sorted(want.tolist())
    train_mtp(tiny_target_dir, conversations, tmp_path / "f", config=replace(tiny_debug(), steps=1), **quiet)
    code = main(["draft-vocab", "--target", str(tiny_target_dir), "--drafter", str(tmp_path / "f"), "--data",
                 str(conversations), "--size", "40", "--out", str(tmp_path / "v")])
    out, err = capsys.readouterr()
    assert code == 0, err
    meta = json.loads((tmp_path / "v" / "config.json").read_text())
    assert meta["mtp_config"]["draft_vocab_size"] == 40 and meta["angelspec"]["draft_vocab"]["size"] == 40
    assert meta["angelspec"]["drafter"] == "mtp"
    back = load_mtp(tmp_path / "v", target)
    before = load_mtp(tmp_path / "f", target)
    assert back.config.draft_vocab_size == 40
    assert all(torch.equal(a, b) for (name, a), (_, b) in zip(
        sorted((k, v) for k, v in back.state_dict().items() if k != "draft_vocab"),
        sorted(before.state_dict().items()), strict=True))  # the weights are unchanged


def test_draft_index_table_is_cached_and_follows_a_new_vocabulary():
    target = tiny_target()
    model = BlockDrafter(replace(tiny_drafter(target).config, draft_vocab_size=8), target.embed_tokens,
                         target.lm_head)
    for ids in ([3, 9, 11, 20, 21, 40, 50, 63], [63, 2, 7, 30, 31, 32, 33, 6]):
        model.set_draft_vocab(ids)
        tokens = torch.tensor([[ids[5], ids[0]], [ids[7], ids[2]]])
        assert model.to_draft_index(tokens).tolist() == [[5, 0], [7, 2]]
        table = model._derived["draft index"][1]
        model.to_draft_index(tokens)
        assert model._derived["draft index"][1] is table  # not rebuilt for the same vocabulary


# ---------------------------------------------------------------------------------------------------------
# T = 1 in distribution: sampling inside a draft vocabulary keeps the target's distribution
# ---------------------------------------------------------------------------------------------------------


def _sampling_vocab_drafter(kind: str, target, joint: torch.Tensor):
    """An MTP or DSpark drafter on `dist_case`'s target drafting from the 10 most likely ids of the second emitted
    token (a frequency-chosen vocabulary, as `angelspec draft-vocab` picks one): q is 0 on the 6 other ids, which
    the target can still emit, so recovery from the residual max(0, p - q) is exercised."""
    from angelspec.decoding.drafters.mtp import MTPDrafter

    ids = joint.sum((0, 2)).argsort(descending=True)[:10]
    if kind == "mtp":
        return MTPDrafter(_mtp_with_vocab("mtp", target, ids))
    return BlockDrafterAdapter(with_vocab(sampling_block_drafter(target, "dspark").model, ids))


@pytest.mark.parametrize("kind", ["mtp", "dspark"])
def test_t1_draft_vocab_sampling_keeps_the_target_distribution(dist_case, kind):  # noqa: F811
    """Standard speculative sampling with drafts sampled inside a draft vocabulary (T=1): the first three emitted
    tokens of 4000 seeded requests follow the target's exact distribution (chi-square, alpha 1e-4)."""
    tgt, _, joint = dist_case
    assert_t1_matches_target(tgt, _sampling_vocab_drafter(kind, tgt, joint), joint, f"{kind} + draft vocab")


@pytest.mark.parametrize("wrong", WRONG_SAMPLERS)
def test_t1_draft_vocab_distribution_test_detects_a_wrong_sampler(dist_case, monkeypatch, wrong):  # noqa: F811
    """Negative control for the test above (MTP with a draft vocabulary): the min(1, p/q) test removed, or depth 1's
    q replaced by depth 0's, must fail."""
    tgt, _, joint = dist_case
    assert_wrong_sampler_detected(tgt, _sampling_vocab_drafter("mtp", tgt, joint), joint, wrong, monkeypatch)
