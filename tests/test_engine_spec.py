"""Speculative decoding through `SpecEngine`: losslessness at T=0 (token for token against AR), at T=1
(empirical distribution against the exact AR distribution, for every verification protocol, and a
demonstration that the biased combination of docs/design.md trap 1 is caught), KV rollback (trap 4), edge cases,
drafter compatibility, the registry and bad input.

Models are tiny and float64 so that the verify forward (K+1 tokens at once) and AR decoding (one token at
a time) agree far below any argmax gap."""

from __future__ import annotations

import copy
import json
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace

import pytest
import torch
from conftest import generate_twice_without_recompiles
from torch import Tensor

from angelspec.decoding.drafters import (
    DrafterFamily,
    DraftLMDrafter,
    NGramDrafter,
    get_drafter,
    register_family,
    registered_drafters,
)
from angelspec.decoding.drafters.base import (
    Commit,
    Drafter,
    DrafterMismatchError,
    DraftState,
    Proposal,
)
from angelspec.decoding.drafters.ngram import MatchAcceptance, reference_lookup
from angelspec.decoding.engine import EngineConfig, Request, SpecEngine, reference_generate
from angelspec.decoding.policies.base import ConfidenceThreshold, FixedDepth
from angelspec.decoding.sampling import SamplingParams
from angelspec.models import Decoder, DecoderConfig, save_target

V = 64
EOS = 3


def tiny_decoder(*, vocab: int = V, layers: int = 2, seed: int = 0, std: float = 0.3, context: int = 512,
                 eos: int | None = EOS, dtype: torch.dtype = torch.float64) -> Decoder:
    cfg = DecoderConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=context,
                        eos_token_id=eos)
    torch.manual_seed(seed)
    model = Decoder(cfg)
    model.init_weights(std=std)
    return model.to(dtype).eval()


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target() -> Decoder:
    return tiny_decoder()


# ---------------------------------------------------------------------------------------------------------
# Test drafters and policies
# ---------------------------------------------------------------------------------------------------------


class OracleDrafter(Drafter):
    """Knows each prompt's AR greedy continuation and proposes it, corrupting each draft with probability
    `error` (confidence 0.9 when kept, 0.2 when corrupted, so confidence policies see a signal).
    `ragged` also reports random per-row lengths."""

    def __init__(self, continuations: dict[tuple[int, ...], list[int]], error: float, seed: int = 0,
                 ragged: bool = False) -> None:
        self.continuations, self.error, self.ragged = continuations, error, ragged
        self.rng = random.Random(seed)

    def allocate(self, batch_size: int, max_len: int, *, device: torch.device, slack: int) -> None:
        self.rows: list[tuple[list[int], list[int]] | None] = [None] * batch_size  # (full truth, history)

    def prefill(self, rows, prompts, first_tokens, target_hidden) -> None:
        for r, p, t in zip(rows, prompts, first_tokens, strict=True):
            self.rows[r] = (list(p) + self.continuations[tuple(p)], list(p) + [t])

    def propose(self, state: DraftState) -> Proposal:
        k, b = state.num_draft_tokens, state.seq_lens.shape[0]
        tokens, conf, lengths = [[0] * k for _ in range(b)], [[0.0] * k for _ in range(b)], [k] * b
        for r in state.active_rows:
            truth, hist = self.rows[r]
            for j in range(k):
                pos = len(hist) + j
                t = truth[pos] if pos < len(truth) else self.rng.randrange(V)
                if self.rng.random() < self.error:
                    tokens[r][j], conf[r][j] = (t + 1 + self.rng.randrange(V - 1)) % V, 0.2
                else:
                    tokens[r][j], conf[r][j] = t, 0.9
            if self.ragged:
                lengths[r] = self.rng.randint(0, k)
        return Proposal(tokens=torch.tensor(tokens, dtype=torch.int64).view(b, k),
                        confidences=torch.tensor(conf, dtype=torch.float32).view(b, k),
                        lengths=torch.tensor(lengths) if self.ragged else None, deterministic=True)

    def on_commit(self, commit: Commit) -> None:
        for r, toks in enumerate(commit.host_tokens):
            if toks:
                truth, hist = self.rows[r]
                hist.extend(toks)
                # Greedy lossless: whatever is committed is the AR continuation (as far as it is known).
                n = min(len(hist), len(truth))
                assert hist[:n] == truth[:n], "committed tokens diverge from AR greedy"

    def reset_rows(self, rows: Sequence[int]) -> None:
        for r in rows:
            self.rows[r] = None


@dataclass(frozen=True)
class PositionHashDepth:
    """Mixed per-row depths that depend on the committed state only (never on this round's drafts)."""

    uses_proposal: bool = False
    static_depth: int | None = None

    def __call__(self, proposal: Proposal, state: DraftState) -> Tensor:
        # +1 position and +1 round move the depth by 9 (mod K+1), so no row gets stuck at one depth.
        return (state.seq_lens * 7 + state.draft_round * 2) % (state.num_draft_tokens + 1)


@dataclass(frozen=True)
class DishonestConfidenceDepth:
    """Reads this round's confidences but claims it does not: the biased combination of docs/design.md trap 1
    (sampled drafts + standard speculative sampling + a depth that depends on the sampled drafts)."""

    threshold: float
    uses_proposal: bool = False
    static_depth: int | None = None

    def __call__(self, proposal: Proposal, state: DraftState) -> Tensor:
        return torch.where(proposal.confidences[:, 0] >= self.threshold, state.num_draft_tokens, 0)


class AlwaysSampledDraftLM(DraftLMDrafter):
    """Samples its drafts even when the engine asks for argmax drafts."""

    def propose(self, state: DraftState) -> Proposal:
        return super().propose(DraftState(**{**state.__dict__, "deterministic": False}))


# ---------------------------------------------------------------------------------------------------------
# T = 0: token-for-token equality with AR
# ---------------------------------------------------------------------------------------------------------

N_PROMPTS, N_NEW = 50, 256


@pytest.fixture(scope="module")
def greedy_case(target):
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, V, (int(torch.randint(1, 24, (1,), generator=g)),), generator=g).tolist()
               for _ in range(N_PROMPTS)]
    requests = [Request(p, max_new_tokens=N_NEW, stop_ids=()) for p in prompts]
    ar = SpecEngine(target, config=EngineConfig(max_batch_size=N_PROMPTS)).generate(requests)
    continuations = {tuple(p): r.token_ids for p, r in zip(prompts, ar, strict=True)}
    return requests, [r.token_ids for r in ar], continuations


@pytest.mark.parametrize("batch_size, k, policy, ragged", [
    (1, 4, FixedDepth(), False),
    (7, 4, PositionHashDepth(), True),
    (16, 6, ConfidenceThreshold(0.5, min_depth=1), False),
    (50, 3, FixedDepth(2), True),
], ids=["b1-fixed", "b7-hash-ragged", "b16-confidence", "b50-fixed2-ragged"])
def test_greedy_spec_equals_ar(target, greedy_case, batch_size, k, policy, ragged):
    requests, ar_tokens, continuations = greedy_case
    drafter = OracleDrafter(continuations, error=0.3, seed=batch_size, ragged=ragged)
    engine = SpecEngine(target, drafter, EngineConfig(max_batch_size=batch_size, num_draft_tokens=k),
                        depth_policy=policy)
    out = engine.generate(requests)
    assert [r.token_ids for r in out] == ar_tokens
    m = engine.metrics
    assert m.protocols == {"greedy": m.steps}
    assert 1.3 < m.mean_accepted_length < k + 1  # sometimes right, sometimes wrong
    assert sum(m.depth_hist[1:]) > 0 and m.accept_hist[0] > 0
    if ragged or not isinstance(policy, FixedDepth):
        assert sum(n > 0 for n in m.depth_hist) >= 3  # mixed depths


@pytest.mark.parametrize("dense", [True, False])
def test_dense_packed_verification_is_used_for_ragged_depths_and_stays_exact(target, greedy_case, dense, monkeypatch):
    """With per-row depths (and rows idle at the tail of the queue) the verify forward packs only the verified
    positions; on or off, the output is AR's, token for token."""
    requests, ar_tokens, continuations = greedy_case
    packed_calls, forward = [], target.forward_cached

    def spy(ids, inputs):
        if inputs.keep is not None and inputs.num_new is None:  # a (packed) prefill passes num_new
            packed_calls.append(int(inputs.keep.sum()))
        return forward(ids, inputs)

    monkeypatch.setattr(target, "forward_cached", spy)
    engine = SpecEngine(target, OracleDrafter(continuations, error=0.3, seed=5, ragged=True),
                        EngineConfig(max_batch_size=7, num_draft_tokens=4, dense_verify=dense),
                        depth_policy=PositionHashDepth())
    assert [r.token_ids for r in engine.generate(requests)] == ar_tokens
    if dense:
        assert len(packed_calls) > 0.5 * engine.metrics.steps and min(packed_calls) >= 1
    else:
        assert packed_calls == []


@pytest.mark.parametrize("drafter_name", ["ngram", "draft-lm"])
def test_greedy_baseline_drafters_equal_ar(target, greedy_case, drafter_name):
    requests, ar_tokens, _ = greedy_case
    requests, ar_tokens = requests[:12], ar_tokens[:12]
    if drafter_name == "ngram":
        drafter = get_drafter("ngram")(max_ngram=3)
    else:
        draft = tiny_decoder(layers=1, seed=5)
        draft.load_state_dict(target.state_dict(), strict=False)  # layer 0 + embeddings: a fair, imperfect drafter
        drafter = get_drafter("draft-lm")(draft)
    engine = SpecEngine(target, drafter, EngineConfig(max_batch_size=5, num_draft_tokens=4))
    out = engine.generate(requests)
    assert [r.token_ids for r in out] == ar_tokens
    assert engine.metrics.mean_accepted_length > 1.2


@pytest.mark.parametrize("stop_below", [None, 0.0, 0.3, 1.0])
def test_draft_lm_early_stop_stays_exact_and_saves_draft_steps(target, greedy_case, stop_below, monkeypatch):
    """The draft LM ends a row's proposal at its first draft below `stop_below` and stops drafting once every row
    has ended: outputs equal AR for any threshold; 1.0 drafts one token per step, 0.0 / None always K."""
    requests, ar_tokens, _ = greedy_case
    requests, ar_tokens = requests[:12], ar_tokens[:12]
    draft = tiny_decoder(layers=1, seed=5)
    draft.load_state_dict(target.state_dict(), strict=False)
    drafter = DraftLMDrafter(draft, stop_below=stop_below)
    calls, forward = [], draft.forward_cached
    monkeypatch.setattr(draft, "forward_cached", lambda *a, **kw: calls.append(1) or forward(*a, **kw))
    engine = SpecEngine(target, drafter, EngineConfig(max_batch_size=1, num_draft_tokens=4))
    assert [r.token_ids for r in engine.generate(requests)] == ar_tokens
    m = engine.metrics
    per_step = (len(calls) - len(requests)) / m.steps  # draft forwards per step, the 12 prefills excluded
    if stop_below == 1.0:
        assert m.depth_hist[2:] == [0] * (len(m.depth_hist) - 2) and per_step < 1.5
    elif stop_below in (None, 0.0):
        assert per_step > 3.5 and m.depth_hist[4] > 0
    else:
        assert 1.5 < per_step < 3.5 and m.depth_hist[1] > 0 and m.depth_hist[4] > 0  # mixed lengths
    with pytest.raises(ValueError, match="stop_below must be a confidence in"):
        DraftLMDrafter(draft, stop_below=1.5)


def test_draft_lm_rollback_keeps_an_exact_drafter_exact(target, greedy_case):
    """docs/design.md trap 4: a draft LM identical to the target must have every verified draft accepted, also
    after partial verifies (depth < K) force its cache to roll back. A stale draft-cache entry would
    change its proposals and lower acceptance without breaking T=0 equality."""
    requests, ar_tokens, _ = greedy_case
    requests, ar_tokens = requests[:10], ar_tokens[:10]
    engine = SpecEngine(target, DraftLMDrafter(copy.deepcopy(target)),
                        EngineConfig(max_batch_size=4, num_draft_tokens=5), depth_policy=PositionHashDepth())
    out = engine.generate(requests)
    assert [r.token_ids for r in out] == ar_tokens
    m = engine.metrics
    assert m.accept_hist == m.depth_hist and 0 < m.depth_hist[5] < m.row_steps  # full and partial verifies


# ---------------------------------------------------------------------------------------------------------
# Edge cases
# ---------------------------------------------------------------------------------------------------------


def _oracle_engine(target, greedy_case, error, k=4, batch_size=4, **kw):
    return SpecEngine(target, OracleDrafter(greedy_case[2], error=error), EngineConfig(max_batch_size=batch_size,
                      num_draft_tokens=k), **kw)


def test_k0_equals_ar(target, greedy_case):
    requests, ar_tokens, _ = greedy_case
    for drafter in (NGramDrafter(), DraftLMDrafter(tiny_decoder(layers=1, seed=2)), None):
        engine = SpecEngine(target, drafter, EngineConfig(max_batch_size=3, num_draft_tokens=0))
        out = engine.generate(requests[:5])
        assert [r.token_ids for r in out] == ar_tokens[:5]
        assert engine.metrics.mean_accepted_length == 1.0


def test_all_accepted(target, greedy_case):
    requests, ar_tokens, _ = greedy_case
    k, n_new = 4, 41  # prefill emits 1 token, then 8 steps of K+1 = 5
    reqs = [Request(r.prompt_ids, n_new, stop_ids=()) for r in requests[:6]]
    engine = _oracle_engine(target, greedy_case, error=0.0, k=k)
    out = engine.generate(reqs)
    assert [r.token_ids for r in out] == [t[:n_new] for t in ar_tokens[:6]]
    assert all(r.num_steps == 1 + 8 for r in out)
    assert engine.metrics.accept_hist == [0, 0, 0, 0, 6 * 8] and engine.metrics.mean_accepted_length == k + 1
    assert engine.metrics.acceptance == [1.0] * k


def test_first_rejected(target, greedy_case):
    requests, ar_tokens, _ = greedy_case
    engine = _oracle_engine(target, greedy_case, error=1.0)
    out = engine.generate(requests[:6])
    assert [r.token_ids for r in out] == ar_tokens[:6]
    m = engine.metrics
    assert m.mean_accepted_length == 1.0 and m.accept_hist[0] == m.row_steps and m.acceptance == [0.0] * 4


def test_stop_and_length_inside_an_accepted_block(target, greedy_case):
    requests, ar_tokens, _ = greedy_case
    k = 4
    prompt, truth = requests[0].prompt_ids, ar_tokens[0]
    # Stop at index 7 = the 2nd token of the second fully accepted block (indices 6..10).
    stop = truth[7]
    first = truth.index(stop)
    reqs = [Request(prompt, N_NEW, stop_ids=(stop,)), Request(prompt, 9, stop_ids=())]
    engine = _oracle_engine(target, greedy_case, error=0.0, k=k, batch_size=2)
    out = engine.generate(reqs)
    assert out[0].token_ids == truth[: first + 1] and out[0].finish_reason == "stop"
    assert out[1].token_ids == truth[:9] and out[1].finish_reason == "length"
    assert out[1].num_steps == 3  # prefill (1) + 5 + 5 (truncated to 3)


# ---------------------------------------------------------------------------------------------------------
# T = 1: the output distribution is the target's
# ---------------------------------------------------------------------------------------------------------

DV = 16  # tiny vocab so the distribution of the first emitted tokens can be compared cell by cell
PROMPT = [1, 2, 3]
N_SAMPLES = 4000


def chi2_crit(df: int, alpha_z: float = 3.719) -> float:
    """Upper quantile of chi-square(df) at alpha = 1e-4 (z = 3.719), Wilson-Hilferty approximation."""
    h = 2.0 / (9.0 * df)
    return df * (1.0 - h + alpha_z * math.sqrt(h)) ** 3


def chi2(samples: Tensor, probs: Tensor) -> tuple[float, int]:
    """Pearson chi-square of samples [N] (cell ids) against probs [C]; cells expecting < 5 are pooled."""
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    expected = probs.double().flatten() * samples.numel()
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    assert counts[expected == 0].sum() == 0, "a token with zero target probability was emitted"
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    return stat, int(keep.sum()) - 1


@pytest.fixture(scope="module")
def dist_case():
    """A target with moderate entropy and an overconfident drafter (the target with its logits scaled x1.8),
    plus the exact AR distributions of emitted tokens 1..3 after PROMPT."""
    tgt = tiny_decoder(vocab=DV, seed=0, context=64, eos=None)
    draft = copy.deepcopy(tgt)
    with torch.no_grad():
        draft.norm.weight.mul_(1.8)
        p1 = torch.softmax(tgt(torch.tensor([PROMPT])).logits[0, -1], -1)  # [V]
        p2 = torch.softmax(tgt(torch.tensor([PROMPT + [a] for a in range(DV)])).logits[:, -1], -1)  # [V, V]
        seqs = torch.tensor([PROMPT + [a, b] for a in range(DV) for b in range(DV)])
        p3 = torch.softmax(tgt(seqs).logits[:, -1], -1).view(DV, DV, DV)
    joint = p1[:, None, None] * p2[:, :, None] * p3  # [V, V, V] exact P(y1, y2, y3)
    return tgt, draft, joint


def _sample_spec(tgt, drafter, policy, k=3, n=N_SAMPLES):
    engine = SpecEngine(tgt, drafter, EngineConfig(max_batch_size=n, num_draft_tokens=k), depth_policy=policy)
    out = engine.generate([Request(PROMPT, max_new_tokens=3, sampling=SamplingParams(temperature=1.0, seed=i),
                                   stop_ids=()) for i in range(n)])
    return torch.tensor([r.token_ids for r in out]), engine.metrics  # [N, 3]


def _distribution_stats(y: Tensor, joint: Tensor) -> dict[str, tuple[float, int]]:
    return {
        "y2": chi2(y[:, 1], joint.sum((0, 2))),
        "y3": chi2(y[:, 2], joint.sum((0, 1))),
        "y1y2": chi2(y[:, 0] * DV + y[:, 1], joint.sum(2)),
        "y2y3": chi2(y[:, 1] * DV + y[:, 2], joint.sum(0)),
    }


def assert_target_distributed(y: Tensor, joint: Tensor, label: str) -> None:
    """Every statistic of `_distribution_stats` passes at alpha = 1e-4 (a false failure is practically impossible
    with a fixed seed set: the samples are deterministic)."""
    for name, (stat, df) in _distribution_stats(y, joint).items():
        assert stat < chi2_crit(df), f"{label}: {name} chi2 = {stat:.1f} >= {chi2_crit(df):.1f} (df {df})"


def assert_bias_detected(y: Tensor, joint: Tensor, factor: float = 3.0, stat_name: str = "y2") -> None:
    """Negative control: one statistic (default: the second emitted token's) is far past the critical value
    (p << 1e-4)."""
    stat, df = _distribution_stats(y, joint)[stat_name]
    assert stat > factor * chi2_crit(df), f"bias not detected: {stat_name} chi2 = {stat:.1f} (df {df})"


def accept_every_draft(monkeypatch: pytest.MonkeyPatch) -> None:
    """A deliberately wrong sampler for negative controls: the engine's standard speculative sampling without the
    min(1, p/q) test. The target's distributions at the draft positions are replaced by the drafter's q (ratio 1),
    so every verified draft is accepted and the drafted tokens are distributed as q, not as the target."""
    from angelspec.decoding.engine import step as engine_module

    real = engine_module.verify_speculative

    def accept_all(drafts, draft_probs, target_probs, depth, seeds, counters):
        n = draft_probs.shape[1]
        fake = torch.cat([draft_probs.to(target_probs.dtype), target_probs[:, n:]], dim=1)  # bonus stays p
        return real(drafts, draft_probs, fake, depth, seeds, counters)

    monkeypatch.setattr(engine_module, "verify_speculative", accept_all)


def report_first_q_for_second_draft(drafter: Drafter) -> None:
    """A deliberately wrong drafter for negative controls: it samples as before but reports draft 1's q for draft 2,
    i.e. the q it returns for draft 2 ignores the sampled draft 1 it was conditioned on (the bug a sequential head
    such as a Markov head or an MTP depth step could have)."""
    propose = drafter.propose

    def wrong(state: DraftState) -> Proposal:
        p = propose(state)
        if p.probs is None:
            return p
        probs = p.probs.clone()
        probs[:, 1] = p.probs[:, 0]
        return replace(p, probs=probs)

    drafter.propose = wrong  # type: ignore[method-assign]


WRONG_SAMPLERS = ("accept-every-draft", "first-q-for-second-draft")


def assert_t1_matches_target(tgt: Decoder, drafter: Drafter, joint: Tensor, label: str) -> None:
    """T=1 standard speculative sampling with `drafter`'s sampled drafts: the first three emitted tokens of
    N_SAMPLES seeded requests follow the target's exact distribution `joint`. Tokens 2 and 3 come from one
    speculative step, so drafts 1 and 2 (and draft 2's q, conditioned on the sampled draft 1) are both verified."""
    y, metrics = _sample_spec(tgt, drafter, None)
    assert set(metrics.protocols) == {"speculative"}
    assert metrics.mean_accepted_length > 1.3 and metrics.acceptance[1] > 0.05, metrics.acceptance
    assert_target_distributed(y, joint, label)


def assert_wrong_sampler_detected(tgt: Decoder, drafter: Drafter, joint: Tensor, wrong: str,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control of `assert_t1_matches_target`: the same drafter and statistics with one of WRONG_SAMPLERS
    must fail, far past the critical value (the statistics have power against that bug)."""
    if wrong == "accept-every-draft":
        accept_every_draft(monkeypatch)  # tokens 2-3 follow q: seen in the second token already
        stat_name = "y2"
    else:
        report_first_q_for_second_draft(drafter)  # only draft 2's verification is wrong: seen in (y2, y3)
        stat_name = "y2y3"
    y, metrics = _sample_spec(tgt, drafter, None)
    assert set(metrics.protocols) == {"speculative"}
    if wrong == "accept-every-draft":
        assert metrics.acceptance[:2] == [1.0, 1.0]
    assert_bias_detected(y, joint, factor=2.0, stat_name=stat_name)


@pytest.mark.parametrize("case", ["standard", "deterministic-confidence", "sampled-drafts-confidence", "ngram"])
def test_t1_distribution_matches_ar(dist_case, case):
    tgt, draft, joint = dist_case
    drafter, policy, protocol = {
        "standard": (DraftLMDrafter(draft), None, "speculative"),
        "deterministic-confidence": (DraftLMDrafter(draft), ConfidenceThreshold(0.3), "deterministic"),
        "sampled-drafts-confidence": (AlwaysSampledDraftLM(draft), ConfidenceThreshold(0.3), "deterministic"),
        "ngram": (NGramDrafter(max_ngram=2), None, "deterministic"),
    }[case]
    y, metrics = _sample_spec(tgt, drafter, policy)
    assert set(metrics.protocols) == {protocol}
    if case != "ngram":
        assert metrics.mean_accepted_length > 1.3  # drafts get accepted, so the test exercises verification
    assert_target_distributed(y, joint, case)


def test_t1_test_detects_the_biased_combination(dist_case):
    """Trap 1: sampled drafts, standard speculative sampling and a depth chosen from the sampled drafts'
    confidences is biased (TV ~0.1 on y2 for this pair); the same statistics must reject it."""
    tgt, draft, joint = dist_case
    y, metrics = _sample_spec(tgt, DraftLMDrafter(draft), DishonestConfidenceDepth(0.3))
    assert set(metrics.protocols) == {"speculative"}
    assert_bias_detected(y, joint)


class SampledDraftLMWithLengths(AlwaysSampledDraftLM):
    """Samples its drafts, then ends each row's proposal before its first draft of confidence < 0.3: per-row
    lengths read from the sampled drafts (the draft LM's early stop applied to sampled drafts, trap 1)."""

    def propose(self, state: DraftState) -> Proposal:
        p = super().propose(state)
        return replace(p, lengths=(p.confidences >= 0.3).long().cumprod(dim=-1).sum(dim=-1))


def test_lengths_of_sampled_drafts_are_refused_under_standard_sampling(dist_case, monkeypatch):
    """Trap 1: `Proposal.lengths` cap the verified depth, so lengths chosen after sampling bias standard speculative
    sampling exactly like a depth policy reading the sampled drafts (`test_t1_test_detects_the_biased_combination`).
    The engine refuses such a proposal before the verify forward. The same drafter stays usable where lengths are
    harmless: greedy rows, and a proposal-reading policy (deterministic-draft protocol, exact for any depth)."""
    tgt, draft, joint = dist_case
    engine = SpecEngine(tgt, SampledDraftLMWithLengths(draft), EngineConfig(max_batch_size=2, num_draft_tokens=3))
    calls, forward = [], tgt.forward_cached
    monkeypatch.setattr(tgt, "forward_cached", lambda *a, **kw: calls.append(a[0].shape[1]) or forward(*a, **kw))
    sampled = [Request(PROMPT, 3, SamplingParams(temperature=1.0, seed=0), stop_ids=()),
               Request(PROMPT, 3, stop_ids=())]  # one sampled row is enough for standard sampling
    with pytest.raises(ValueError, match=r"lengths.*standard speculative sampling.*trap 1"):
        engine.generate(sampled)
    assert calls == [len(PROMPT)]  # the prefill only: refused before any verify forward
    monkeypatch.undo()
    greedy = engine.generate([Request(PROMPT, 6, stop_ids=())])
    assert greedy[0].token_ids == reference_generate(tgt, [Request(PROMPT, 6, stop_ids=())])[0].token_ids
    y, metrics = _sample_spec(tgt, SampledDraftLMWithLengths(draft), ConfidenceThreshold(0.0))
    assert set(metrics.protocols) == {"deterministic"}
    assert sum(c > 0 for c in metrics.depth_hist) >= 2, metrics.depth_hist  # the lengths really vary the depth
    assert_target_distributed(y, joint, "lengths")


def test_t1_spec_is_seeded_and_batch_independent(dist_case):
    tgt, draft, _ = dist_case
    reqs = [Request(PROMPT + [i % DV], max_new_tokens=12, sampling=SamplingParams(temperature=1.0, seed=100 + i),
                    stop_ids=()) for i in range(6)]
    runs = [SpecEngine(tgt, DraftLMDrafter(draft), EngineConfig(max_batch_size=b, num_draft_tokens=3)).generate(reqs)
            for b in (1, 4, 6)]
    assert [r.token_ids for r in runs[0]] == [r.token_ids for r in runs[1]] == [r.token_ids for r in runs[2]]


# ---------------------------------------------------------------------------------------------------------
# The library's oracle drafters (benchmarks/step_cost.py): every draft accepted, or every draft rejected
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("batch_size, k", [(1, 4), (5, 7), (16, 2)])
def test_library_oracle_accepts_everything_and_its_reject_twin_nothing(target, greedy_case, batch_size, k):
    from angelspec_research.oracle import OracleDrafter as LibOracle
    from angelspec_research.oracle import greedy_continuations

    requests, ar_tokens, _ = greedy_case
    table = greedy_continuations([r.prompt_ids for r in requests], ar_tokens)
    n_new = 1 + 6 * (k + 1)  # prefill emits one token, then six full blocks
    reqs = [Request(r.prompt_ids, n_new, stop_ids=()) for r in requests[:8]]
    engine = SpecEngine(target, LibOracle(table), EngineConfig(max_batch_size=batch_size, num_draft_tokens=k))
    out = engine.generate(reqs)
    assert [r.token_ids for r in out] == [t[:n_new] for t in ar_tokens[:8]]
    m = engine.metrics
    assert m.mean_accepted_length == k + 1 and m.acceptance == [1.0] * k and set(m.protocols) == {"greedy"}
    engine = SpecEngine(target, LibOracle(table, reject=True, vocab_size=V),
                        EngineConfig(max_batch_size=batch_size, num_draft_tokens=k))
    out = engine.generate(reqs)
    assert [r.token_ids for r in out] == [t[:n_new] for t in ar_tokens[:8]]
    assert engine.metrics.mean_accepted_length == 1.0 and engine.metrics.acceptance == [0.0] * k


def test_library_oracle_refuses_an_unknown_prompt(target):
    from angelspec_research.oracle import OracleDrafter as LibOracle

    engine = SpecEngine(target, LibOracle({(1, 2): [5]}), EngineConfig(max_batch_size=1))
    with pytest.raises(KeyError, match="no continuation"):
        engine.generate([Request([7, 8, 9], 4, stop_ids=())])
    with pytest.raises(ValueError, match="vocabulary size"):
        LibOracle({}, reject=True)


@pytest.mark.parametrize("reject", [False, True], ids=["oracle", "oracle-reject"])
def test_t1_library_oracle_matches_ar(dist_case, reject):
    """At T=1 the oracle's greedy drafts go through the deterministic-draft protocol: exact in distribution."""
    from angelspec_research.oracle import OracleDrafter as LibOracle

    tgt, _, joint = dist_case
    greedy = SpecEngine(tgt, config=EngineConfig(max_batch_size=1)).generate([Request(PROMPT, 8, stop_ids=())])
    drafter = LibOracle({tuple(PROMPT): greedy[0].token_ids}, reject=reject, vocab_size=DV)
    y, metrics = _sample_spec(tgt, drafter, None)
    assert set(metrics.protocols) == {"deterministic"}
    if not reject:
        assert metrics.mean_accepted_length > 1.1  # some greedy drafts are accepted at T=1: verification is exercised
    assert_target_distributed(y, joint, f"oracle (reject={reject})")


# ---------------------------------------------------------------------------------------------------------
# Drafter compatibility, registry, n-gram matching, bad input
# ---------------------------------------------------------------------------------------------------------


def test_drafter_mismatch_raises_before_decoding(target, tmp_path):
    with pytest.raises(DrafterMismatchError, match="vocab size 65 but the target has 64"):
        SpecEngine(target, DraftLMDrafter(tiny_decoder(vocab=V + 1, layers=1)))
    with pytest.raises(DrafterMismatchError, match="eos/special token ids"):
        SpecEngine(target, DraftLMDrafter(tiny_decoder(layers=1, eos=7)))
    with pytest.raises(DrafterMismatchError, match="at most 64 positions"):
        SpecEngine(target, DraftLMDrafter(tiny_decoder(layers=1, context=64)))
    # A drafter folder that records the fingerprint of another target.
    save_target(tiny_decoder(layers=1, dtype=torch.float32), tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["angelspec"] = {"target_fingerprint": "0123456789abcdef"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DrafterMismatchError, match="fingerprint 0123456789abcdef"):
        SpecEngine(target, DraftLMDrafter.from_pretrained(tmp_path, dtype=torch.float64))
    cfg["angelspec"] = {"target_fingerprint": target.config.fingerprint()}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    SpecEngine(target, DraftLMDrafter.from_pretrained(tmp_path, dtype=torch.float64))

    class WantsLayer9(NGramDrafter):
        target_layer_ids = (9,)

    with pytest.raises(DrafterMismatchError, match="wants target layer 9"):
        SpecEngine(target, WantsLayer9())


def test_registry():
    assert {"ngram", "draft-lm"} <= set(registered_drafters())
    assert get_drafter("ngram") is NGramDrafter and get_drafter("draft-lm") is DraftLMDrafter
    with pytest.raises(KeyError, match="unknown drafter 'nope'"):
        get_drafter("nope")
    with pytest.raises(ValueError, match="already registered"):
        register_family(DrafterFamily("ngram", OracleDrafter, None))
    with pytest.raises(TypeError, match="Drafter subclass"):
        DrafterFamily("not-a-drafter", int, None)


def test_ngram_lookup_matches_reference():
    """The incremental index (prefill, then commits in random chunks) agrees with a brute-force scan."""
    rng = random.Random(0)
    for trial in range(300):
        vocab = rng.choice([2, 3, 5])
        hist = [rng.randrange(vocab) for _ in range(rng.randint(2, 30))]
        max_n = rng.randint(1, 4)
        min_n, k = rng.randint(1, max_n), rng.randint(1, 6)
        d = NGramDrafter(max_ngram=max_n, min_ngram=min_n)
        d.allocate(2, 64, device=torch.device("cpu"), slack=0)
        split = rng.randint(1, len(hist) - 1)
        d.prefill([1], [hist[:split]], [hist[split]], ())
        done = split + 1
        while done < len(hist):
            step = hist[done: done + rng.randint(1, 4)]
            d.on_commit(_host_commit([(), tuple(step)]))
            done += len(step)
        assert d.lookup(1, k) == reference_lookup(hist, k, max_n, min_n), (trial, hist, max_n, min_n, k)
    d = NGramDrafter()
    d.allocate(1, 64, device=torch.device("cpu"), slack=0)
    d.prefill([0], [[5, 6, 7, 5, 6]], [7], ())
    assert d.lookup(0, 4) == [5, 6, 7, 5]  # continues the loop past the end of the history


def test_ngram_acceptance_counts_only_the_drafts_that_were_tried():
    """Depth m after an n-token match is tried iff every draft before it was accepted and the policy verified it."""
    acc = MatchAcceptance(3, cap=4.0)
    assert acc.estimate(2, 3) == [1.0, 1.0, 1.0]  # optimistic until seen to fail
    acc.observe(2, verified=4, accepted=1)  # depth 0 accepted, depth 1 rejected, depths 2-3 never tried
    assert acc.estimate(2, 4) == [1.0, 0.5, 1.0, 1.0]
    acc.observe(2, verified=2, accepted=2)  # both accepted; depth 2 was cut by the policy, not rejected
    assert acc.estimate(2, 3) == [1.0, 2 / 3, 1.0]
    assert acc.estimate(1, 2) == [1.0, 1.0]  # other match lengths are counted apart
    for _ in range(5):  # the fifth trial passes the cap: the cell's counts are halved
        acc.observe(1, verified=1, accepted=0)
    assert acc.trials[1] == [2.5] and acc.hits[1] == [0.0]
    assert acc.estimate(1, 1) == [pytest.approx(1 / 3.5)]


def test_ngram_confidences_learn_from_the_depths_the_engine_verified(target, greedy_case):
    """In a run with every row cut to 2 verified drafts of K = 4, the drafter counts depths 0-1 only, and its next
    proposal carries what it counted; the outputs stay AR's."""
    requests, ar_tokens, _ = greedy_case
    drafter = NGramDrafter()
    engine = SpecEngine(target, drafter, EngineConfig(max_batch_size=3, num_draft_tokens=4),
                        depth_policy=FixedDepth(2))
    assert [r.token_ids for r in engine.generate(requests[:6])] == ar_tokens[:6]
    trials = drafter.acceptance.trials
    assert sum(t[0] for t in trials if t) > 0 and all(len(t) <= 2 for t in trials)
    drafter.allocate(1, 64, device=torch.device("cpu"), slack=0)
    drafter.prefill([0], [[5, 6, 7, 5, 6]], [7], ())  # a 3-token match
    state = DraftState(last_tokens=torch.tensor([7]), seq_lens=torch.tensor([6]), active=torch.tensor([True]),
                       active_rows=(0,), sampling=None, draft_round=torch.zeros(1, dtype=torch.int64),
                       num_draft_tokens=4, deterministic=True, all_greedy=True, seq_len_bound=6)
    proposal = drafter.propose(state)
    assert proposal.confidences[0].tolist() == pytest.approx(drafter.acceptance.estimate(3, 4))
    assert proposal.lengths.tolist() == [4]


def test_a_match_is_verified_to_the_depth_its_measured_acceptance_pays_for():
    """`MatchAcceptance.plan` for one row: (1 + expected accepted drafts) / cost per number of drafts against a step
    verifying none. An unseen match length is verified as deep as any depth pays (the estimate starts at 1.0); one
    whose first draft the target keeps rejecting is not verified; one right for two drafts and then wrong stops at 2."""
    acc = MatchAcceptance(3)
    costs = (1.0, 1.3, 1.6, 1.9, 2.2)
    assert acc.plan({0: 3}, 1, 4, costs) == {0: 4}
    assert acc.plan({0: 3}, 1, 4, (1.0, 2.5, 3.5)) == {}  # verifying costs more than a certain draft returns
    assert acc.plan({0: 3}, 1, 4, (1.0, 1.1, 1.2)) == {0: 2}  # at most len(costs) - 1 drafts
    for _ in range(20):
        acc.observe(1, 4, 0)
        acc.observe(2, 4, 2)
    assert acc.plan({0: 1}, 1, 4, costs) == {}
    assert acc.plan({0: 2}, 1, 4, costs) == {0: 2}
    assert acc.plan({0: 3}, 1, 4, costs) == {0: 4}


def test_a_lookup_plan_weighs_what_a_rows_drafts_cost_the_whole_step():
    """`MatchAcceptance.plan` over a batch: a verify step's fixed price slows every row in it, so a draft that pays for
    its own row alone does not pay in a batch of two where the other row verifies nothing, and does where the other
    row's drafts already pay for the verify step; the surest drafts go first, across rows."""
    acc = MatchAcceptance(3)
    for _ in range(40):
        acc.observe(1, 4, 0)
        acc.observe(1, 4, 1)  # a 1-token match: its first draft right half the time, its second never
    costs = (1.0,) + tuple(1.3 + 0.05 * m for m in range(1, 9))  # a fixed 0.3, then 0.05 a draft
    assert acc.plan({0: 1}, 1, 1, costs) == {0: 1}  # alone: (1 + 0.5) / 1.35 > 1
    assert acc.plan({0: 1}, 2, 1, costs) == {}  # beside a row that verifies none: (2 + 0.5) / 1.35 < 2
    assert acc.plan({0: 1, 1: 3}, 2, 4, costs) == {0: 1, 1: 4}  # the other row's sure drafts pay the fixed price
    assert acc.plan({0: 1, 1: 3}, 2, 4, costs[:4]) == {1: 3}  # three drafts in all: the sure ones


def test_a_lookup_plan_keeps_what_it_costs_every_row_within_the_rows_latency_room():
    """`room` (`LatencyBudget`): a plan that pays for the batch is kept only as far as its cost to each row, beyond what
    the row is expected to gain, fits the row's room; a row out of room takes only what pays for itself."""
    acc = MatchAcceptance(3)
    for _ in range(40):
        acc.observe(3, 4, 4)  # after a 3-token match every draft was accepted
        acc.observe(1, 4, 0)
        acc.observe(1, 4, 1)  # after a 1-token match the first draft half the time, the second never
    costs = (1.0,) + tuple(1.3 + 0.05 * m for m in range(1, 9))  # a fixed 0.3, then 0.05 a draft
    # row 1's sure drafts pay the fixed price for both rows; row 0 matches nothing and only waits
    assert acc.plan({1: 3}, 2, 4, costs) == {1: 4}
    assert acc.plan({1: 3}, 2, 4, costs, room={0: 0.5, 1: 0.0}) == {1: 4}  # costs row 0 0.5 plain steps: it has them
    assert acc.plan({1: 3}, 2, 4, costs, room={0: 0.42, 1: 0.0}) == {1: 2}  # only 1.4: two drafts
    assert acc.plan({1: 3}, 2, 4, costs, room={0: 0.2, 1: 5.0}) == {}  # less than the fixed price: none
    assert acc.plan({1: 3}, 2, 4, costs, room={0: -3.0, 1: 5.0}) == {}  # out of room: as none
    # alone and out of room, a row still verifies what its own expected gain pays for, and nothing that does not
    assert acc.plan({0: 3}, 1, 4, costs, room={0: -1.0}) == {0: 4}
    assert acc.plan({0: 1}, 1, 4, costs, room={0: -1.0}) == {0: 1}  # 1.35 against 1 + 0.5
    assert acc.plan({0: 1}, 1, 4, (1.0, 1.6, 1.7), room={0: -1.0}) == {}


def test_the_latency_budget_charges_each_row_what_lookup_steps_cost_it_beyond_their_tokens():
    from angelspec.decoding.drafters.hybrid import LatencyBudget

    budget = LatencyBudget(allowance=20)
    budget.reset(3)
    budget.start_row(0, 10)
    budget.start_row(1, 10)
    assert budget.room(0, 10, 0.05) == pytest.approx(1.0)  # 5% of the allowance's 20 tokens, from the first
    budget.charge(1.4, [(5,), (6, 7, 8), ()])  # 1.4 plain steps: row 0 got one token, row 1 three, row 2 is idle
    assert budget.debt == pytest.approx([0.4, -1.6, 0.0])
    assert budget.room(0, 11, 0.05) == pytest.approx(0.6) and budget.room(1, 13, 0.05) == pytest.approx(2.6)
    assert budget.room(0, 50, 0.05) == pytest.approx(0.05 * 40 - 0.4)  # past the allowance: 5% of its tokens
    assert budget.room(0, 50, 0.1) == pytest.approx(0.1 * 40 - 0.4)  # the slack is the plan's to say
    budget.start_row(0, 60)  # a new request in the row
    assert budget.room(0, 60, 0.05) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="slack"):
        budget.room(0, 60, -0.1)
    with pytest.raises(ValueError, match="allowance"):
        LatencyBudget(-1)


@pytest.mark.parametrize("drafter_kind", ["ngram", "oracle"])
def test_a_full_depth_step_reads_nothing_back_to_size_its_verify_forward(target, greedy_case, monkeypatch,
                                                                         drafter_kind):
    """The default policy verifies all K drafts, so the verify width needs no host read: not for a drafter without
    lengths (the oracle), nor for the n-gram lookup, whose lengths come with their host copy. Outputs stay AR's."""
    import sys

    requests, ar_tokens, continuations = greedy_case
    reads = []
    tolist = torch.Tensor.tolist

    def spy(self, *args, **kwargs):
        reads.append(sys._getframe(1).f_code.co_name)
        return tolist(self, *args, **kwargs)

    drafter = NGramDrafter() if drafter_kind == "ngram" else OracleDrafter(continuations, error=0.3, seed=1)
    engine = SpecEngine(target, drafter, EngineConfig(max_batch_size=3, num_draft_tokens=3))
    assert engine.step.static_depth == 3
    monkeypatch.setattr(torch.Tensor, "tolist", spy)
    out = engine.generate(requests[:6])
    assert [r.token_ids for r in out] == ar_tokens[:6]
    assert engine.metrics.steps > 0 and "_select" not in reads


def test_host_lengths_must_come_with_lengths_for_every_row():
    tokens = torch.zeros(2, 3, dtype=torch.int64)
    Proposal(tokens=tokens, lengths=torch.tensor([3, 0]), host_lengths=(3, 0)).check(2, 3, V)
    with pytest.raises(ValueError, match="host_lengths must come with lengths"):
        Proposal(tokens=tokens, host_lengths=(3, 0)).check(2, 3, V)
    with pytest.raises(ValueError, match="B = 2 values"):
        Proposal(tokens=tokens, lengths=torch.tensor([3, 0]), host_lengths=(3,)).check(2, 3, V)


def _host_commit(host_tokens: list[tuple[int, ...]]) -> Commit:
    b = len(host_tokens)
    zeros = torch.zeros(b, dtype=torch.int64)
    return Commit(tokens=zeros[:, None], num_accepted=zeros, seq_lens=zeros,
                  active=torch.tensor([bool(t) for t in host_tokens]), host_tokens=tuple(host_tokens),
                  target_hidden=())


def test_bad_depth_and_config(target, greedy_case):
    requests = greedy_case[0][:2]
    with pytest.raises(ValueError, match="FixedDepth.depth"):
        FixedDepth(-1)
    with pytest.raises(ValueError, match="threshold"):
        ConfidenceThreshold(1.5)
    with pytest.raises(ValueError, match="verifies 5 drafts but num_draft_tokens is 4"):
        SpecEngine(target, NGramDrafter(), EngineConfig(num_draft_tokens=4), depth_policy=FixedDepth(5))
    with pytest.raises(ValueError, match="needs a drafter"):
        SpecEngine(target, depth_policy=FixedDepth(1))

    def too_deep(proposal, state):
        return torch.full_like(state.seq_lens, state.num_draft_tokens + 1)

    def not_integer(proposal, state):
        return torch.ones_like(state.seq_lens, dtype=torch.float32)

    for policy, match in ((too_deep, r"must lie in \[0, K=4\]"), (not_integer, "integer tensor")):
        engine = SpecEngine(target, OracleDrafter(greedy_case[2], error=0.5), EngineConfig(num_draft_tokens=4),
                            depth_policy=policy)
        with pytest.raises(ValueError, match=match):
            engine.generate(requests)


def test_sampled_drafts_without_probs_are_rejected(target, greedy_case):
    class NoProbs(OracleDrafter):
        def propose(self, state):
            p = super().propose(state)
            return Proposal(tokens=p.tokens, deterministic=False)

    engine = SpecEngine(target, NoProbs(greedy_case[2], error=0.5), EngineConfig(num_draft_tokens=2))
    with pytest.raises(ValueError, match="without probs"):
        engine.generate([Request(greedy_case[0][0].prompt_ids, 5, SamplingParams(temperature=1.0, seed=0))])


def test_compiled_verify_and_draft_lm_steps_stay_exact(target, greedy_case):
    """EngineConfig(compile=True) with a drafter compiles the verify forward and the draft LM's steps; the
    output must still be AR's, and the compile must not have fallen back to eager (a warning)."""
    import warnings

    requests, ar_tokens, _ = greedy_case
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # try_compile warns when it falls back to eager
        engine = SpecEngine(target, DraftLMDrafter(tiny_decoder(layers=1, seed=2)),
                            EngineConfig(max_batch_size=3, num_draft_tokens=3, compile=True))
        out = engine.generate(requests[:4])
    assert [r.token_ids for r in out] == ar_tokens[:4]


class SometimesSilentOracle(OracleDrafter):
    """The oracle with ragged lengths; once `silent` is set, every other round drafts nothing for any row."""

    silent = False
    silent_rounds = 0

    def propose(self, state: DraftState) -> Proposal:
        p = super().propose(state)
        if self.silent and int(state.draft_round.max()) % 2:
            self.silent_rounds += 1
            return replace(p, lengths=torch.zeros_like(p.lengths))
        return p


def is_step_forward(inputs) -> bool:
    """Whether a target forward (its `CacheInputs`) is a decoding step's (verify, packed verify or one-token):
    prefill, which runs eagerly by design, always passes logits_index or compute_logits=False
    (`decoding.batching.prefill_rows`)."""
    return inputs.logits_index is None and inputs.compute_logits


def _compiled_run_then_silent_run_without_recompiles(engine, drafter, first, second) -> list:
    """`first` with the drafter as it is, then `second` with it silent every other round, under
    fail_on_recompile; any fallback of try_compile to eager (a UserWarning) fails too. Both runs' results."""
    return generate_twice_without_recompiles(engine, first, second, between=lambda: setattr(drafter, "silent", True))


def test_compiled_packed_verify_forward_stays_exact_and_never_recompiles_mid_run(target, greedy_case, monkeypatch):
    """With compile=True, ragged depths (the n-gram drafter's usual case) run the packed verify forward compiled as
    well: no step's forward (packed, padded or one-token) ever runs eagerly, and the output is still AR's, token for
    token, without a fallback to eager. Steps where no row has a draft (a width of 0) run the one-token forward, whose
    graph the engine compiles when a run starts: none is compiled in the middle of serving (torch.compile
    specialises a size of 1, which used to cost a fresh compilation, about 20 s on a CPU, the first time it
    happened)."""

    requests, ar_tokens, continuations = greedy_case
    forward = target.forward_cached

    def spy(ids, inputs):  # no side effect under tracing (is_compiling() is a constant there): no guards
        if is_step_forward(inputs) and not torch.compiler.is_compiling():
            raise AssertionError(f"a step's forward ran eagerly (keep={inputs.keep is not None})")
        return forward(ids, inputs)

    monkeypatch.setattr(target, "forward_cached", spy)
    drafter = SometimesSilentOracle(continuations, error=0.3, seed=5, ragged=True)
    engine = SpecEngine(target, drafter, EngineConfig(max_batch_size=5, num_draft_tokens=4, compile=True),
                        depth_policy=PositionHashDepth())
    out = _compiled_run_then_silent_run_without_recompiles(engine, drafter, requests[:10], requests[10:16])
    assert [r.token_ids for r in out] == ar_tokens[:16]
    assert drafter.silent_rounds > 5


def test_a_compiled_engine_with_a_length_bound_compiles_nothing_when_a_longer_call_follows_a_short_one():
    """`angelspec eval --compile` warms up with a few tokens per prompt, then decodes the full length with the same
    engine. Its caches were sized per call, so the timed run brought new cache shapes and the draft LM's graphs
    recompiled inside it. With EngineConfig.max_seq_len set, every call gets caches of that size: a short call
    compiles what a long one uses, and the long one's outputs are still AR's."""
    target = tiny_decoder()
    drafter = DraftLMDrafter(tiny_decoder(layers=1, seed=2), stop_below=None)
    rng = random.Random(4)
    prompts = [[rng.randrange(V) for _ in range(rng.randint(3, 10))] for _ in range(3)]
    engine = SpecEngine(target, drafter, EngineConfig(max_batch_size=1, max_seq_len=48, num_draft_tokens=3,
                                                      compile=True))
    long = [Request(p, max_new_tokens=30, stop_ids=()) for p in prompts]
    warm_up = [Request(p, max_new_tokens=4, stop_ids=()) for p in prompts]
    got = generate_twice_without_recompiles(engine, warm_up, long)[len(warm_up):]
    assert [r.token_ids for r in got] == [r.token_ids for r in reference_generate(target, long)]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_compiled_engine_compiles_its_verify_graphs_up_front_for_any_cache_capacity(temperature):
    """`angelspec bench --compile` warms every point up on an engine of its own with a short cache, then times another.
    Two things compiled inside the timed run (12-20 s each, 0.09x of AR at batch 4 with n-gram drafts): the warm-up's
    cache capacity equalled the head_dim, so duck sizing tied them and its graphs took only that capacity; and a short
    warm-up at batch 4 never had every row draft at once, so the dense verify graph was first needed in the run. Now
    an engine compiles its greedy verify graphs when a run starts (here: one that drafts nothing) and with duck sizing
    off, so a second engine with another capacity compiles nothing, counted by dynamo, and stays AR's (at T = 1 the
    sampled verify graphs are compiled up front as well)."""
    import warnings

    from torch._dynamo.utils import counters

    target = tiny_decoder(seed=7)
    k = 3
    rng = random.Random(5)
    reqs = [Request([rng.randrange(V) for _ in range(4)] * 3, max_new_tokens=24, stop_ids=(),
                    sampling=SamplingParams(temperature=temperature, seed=i)) for i in range(8)]
    capacity_of_head_dim = target.config.head_dim - (k + 2)  # the engine adds K + 2 slack positions
    first = SpecEngine(target, NGramDrafter(), EngineConfig(max_batch_size=4, num_draft_tokens=k, compile=True,
                                                            max_seq_len=capacity_of_head_dim))
    second = SpecEngine(target, NGramDrafter(), EngineConfig(max_batch_size=4, num_draft_tokens=k, compile=True,
                                                             max_seq_len=60))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # try_compile warns when it falls back to eager
        first.generate([replace(r, prompt_ids=r.prompt_ids[:4], max_new_tokens=1) for r in reqs[:4]])
        compiled = counters["frames"]["ok"]
        # the step without drafts and the verify graphs of this run's kind only (a step is greedy only if every row is)
        assert first.forwards.warmed == {(2, "plain"), (2, "sampled" if temperature else "greedy")}
        out = second.generate(reqs)
    assert counters["frames"]["ok"] == compiled
    if temperature == 0:
        assert [r.token_ids for r in out] == [r.token_ids for r in reference_generate(target, reqs)]
    assert all(len(r.token_ids) == 24 for r in out)
    hist = second.metrics.depth_hist
    assert hist[k] > 0 and sum(hist[:k]) > 0  # full-depth and shallower rows: the dense and the packed graph


def test_a_new_compiled_engine_over_a_warmed_target_runs_no_warm_up_forwards(monkeypatch):
    """The step graphs an engine warmed up are dynamo's, shared by every engine over the same target: the next engine
    (a server's for another batch shape, a benchmark's next run) neither runs the warm-up's forwards again (they would
    be timed as part of its run) nor compiles anything; an engine over another target warms its own."""
    from torch._dynamo.utils import counters

    target = tiny_decoder(seed=11)
    rng = random.Random(3)
    reqs = [Request([rng.randrange(V) for _ in range(4)] * 3, max_new_tokens=12, stop_ids=()) for _ in range(4)]
    config = EngineConfig(max_batch_size=4, num_draft_tokens=3, compile=True, max_seq_len=40)
    SpecEngine(target, NGramDrafter(), config).generate(reqs)
    compiled = counters["frames"]["ok"]
    second = SpecEngine(target, NGramDrafter(), config)
    assert second.forwards.warmed == {(2, "plain"), (2, "greedy")}
    calls = []
    with torch.inference_mode():  # (as in `generate`: a cache made outside it would guard differently)
        cache = second.rows.setup(4, 40)
        monkeypatch.setattr(cache, "reset", lambda: calls.append(1))  # the warm-up empties the cache after a forward
        second.forwards.warm_up(cache, 3, greedy=True, sampled=False, packed=True)
    assert not calls
    monkeypatch.undo()
    out = second.generate(reqs)
    assert counters["frames"]["ok"] == compiled
    assert [r.token_ids for r in out] == [r.token_ids for r in reference_generate(target, reqs)]
    assert SpecEngine(tiny_decoder(seed=12), NGramDrafter(), config).forwards.warmed == set()


def test_at_batch_1_a_step_without_drafts_runs_compiled_and_compiles_nothing_mid_run(target, greedy_case, monkeypatch):
    """Batch 1, compile=True: a step where the drafter proposes nothing (n-gram without a match, a gate-skipped
    step) runs the compiled one-token verify forward, not an eager one (that made n-gram's no-match steps cost an
    eager AR step each), and that graph is compiled when the run starts, never in the middle of it."""

    requests, ar_tokens, continuations = greedy_case
    forward = target.forward_cached
    eager_calls = []

    def spy(ids, inputs):
        if is_step_forward(inputs) and not torch.compiler.is_compiling():
            eager_calls.append(inputs.num_keep)
        return forward(ids, inputs)

    monkeypatch.setattr(target, "forward_cached", spy)
    drafter = SometimesSilentOracle(continuations, error=0.3, seed=5, ragged=True)
    engine = SpecEngine(target, drafter, EngineConfig(max_batch_size=1, num_draft_tokens=3, compile=True))
    out = _compiled_run_then_silent_run_without_recompiles(engine, drafter, requests[:2], requests[2:5])
    assert [r.token_ids for r in out] == ar_tokens[:5]
    assert drafter.silent_rounds > 5
    assert eager_calls == []


class SwitchedDepth:
    """Every row verifies `depth` drafts (None: all K); the test changes it between runs."""

    uses_proposal = False
    static_depth = None

    def __init__(self) -> None:
        self.depth: int | None = None

    def __call__(self, proposal: Proposal, state: DraftState) -> torch.Tensor:
        return torch.full_like(state.seq_lens, state.num_draft_tokens if self.depth is None else self.depth)


def test_a_compiled_engine_narrowed_to_one_draft_mid_run_compiles_nothing(target, greedy_case):
    """A serving policy may narrow every row to one draft at any step: verifying two tokens a row, whose greedy
    acceptance dynamo guards apart from longer ones. The engine compiles that graph before the run (it used to
    compile mid-run, 15 s on a 2-core CPU, the first time `auto` chose depth 1)."""
    requests, ar_tokens, continuations = greedy_case
    policy = SwitchedDepth()
    engine = SpecEngine(target, OracleDrafter(continuations, error=0.3, seed=1),
                        EngineConfig(max_batch_size=4, num_draft_tokens=4, compile=True), depth_policy=policy)
    out = generate_twice_without_recompiles(engine, requests[:4], requests[4:8],
                                            between=lambda: setattr(policy, "depth", 1))
    assert [r.token_ids for r in out] == ar_tokens[:8]
    assert engine.metrics.depth_hist[1] > 0 and not any(engine.metrics.depth_hist[2:])
