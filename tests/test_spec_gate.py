"""The speculation gate (`decoding/policies/gate.py`): its draft/skip rule, and that an engine whose gate skips
drafting stays exact — token for token at T=0, and at T=1 a skipped step samples exactly what plain decoding
samples — while the drafter's context stays complete across skipped steps (every later proposal equals a
from-scratch recompute)."""

from __future__ import annotations

import copy
import random

import pytest
from conftest import RecordingMixin, mtp_reference_drafts, tiny_decoder

from angelspec.decoding.drafters import DraftLMDrafter
from angelspec.decoding.drafters.block import BlockDrafterAdapter, reference_drafts
from angelspec.decoding.engine import EngineConfig, Request, SpecEngine, reference_generate
from angelspec.decoding.policies.gate import SpecGate, batch_bucket
from angelspec.decoding.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")


class ScriptedGate(SpecGate):
    """Drafts on the steps `pattern` marks True (cycled), whatever was measured; records every observation."""

    def __init__(self, pattern: list[bool]) -> None:
        super().__init__()
        self.pattern, self.calls, self.seen = pattern, 0, []

    def should_draft(self, num_active: int) -> bool:
        self.calls += 1
        return self.pattern[(self.calls - 1) % len(self.pattern)]

    def observe(self, num_active, drafted, tokens_per_row, seconds):
        self.seen.append((num_active, drafted, tokens_per_row))
        super().observe(num_active, drafted, tokens_per_row, seconds)


def perfect_draft_lm(target) -> DraftLMDrafter:
    """A draft LM equal to the target, drafting all K every step: every draft is accepted while its cache is exact."""
    return DraftLMDrafter(copy.deepcopy(target), stop_below=None)


def gated_engine(target, drafter, gate: SpecGate, **config) -> SpecEngine:
    engine = SpecEngine(target, drafter, EngineConfig(spec_gate=True, **config))
    assert engine.gate is not None
    engine.gate = gate
    return engine


# ---------------------------------------------------------------------------------------------------------
# The rule
# ---------------------------------------------------------------------------------------------------------


def test_buckets_group_batch_sizes_by_powers_of_two():
    assert [batch_bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 16, 17)] == [0, 1, 2, 2, 3, 3, 4, 4, 5]
    with pytest.raises(ValueError, match="at least one active row"):
        batch_bucket(0)


def test_gate_warms_up_measures_a_plain_step_then_runs_the_faster_and_probes():
    gate = SpecGate(warmup=2, probe_every=3, decay=0.0)
    assert gate.should_draft(16)
    gate.observe(16, True, 2.0, 0.04)  # speculation: 2 tokens per row in 40 ms = 50 tokens/row/s
    assert gate.should_draft(16)
    gate.observe(16, True, 2.0, 0.04)
    assert not gate.should_draft(16)  # warmed up, no plain step measured yet: measure one
    gate.observe(16, False, 1.0, 0.01)  # plain: 100 tokens/row/s, faster
    assert not gate.should_draft(16)
    gate.observe(16, False, 1.0, 0.01)
    gate.observe(16, False, 1.0, 0.01)
    assert gate.should_draft(16)  # three skipped in a row: a drafted probe
    gate.observe(16, True, 6.0, 0.04)  # acceptance went up: 150 tokens/row/s
    assert gate.should_draft(16)
    assert gate.should_draft(1)  # another bucket warms up on its own
    assert gate.summary()["rows 9-16"] == {"drafted": 3, "skipped": 3, "probe_gap": 3, "spec_rate": 150.0,
                                          "plain_rate": 100.0}


def test_gate_backs_off_probing_while_speculation_keeps_losing_and_resets_when_it_wins():
    gate = SpecGate(warmup=1, probe_every=2, max_probe_every=8, decay=0.0)

    def run(spec_tokens: float) -> list[bool]:
        """Steps until the gate drafts (a probe), observing plain steps at 100 tokens/s and the probe at
        spec_tokens per 40 ms; -> the decisions."""
        decisions = []
        while True:
            d = gate.should_draft(16)
            decisions.append(d)
            gate.observe(16, d, spec_tokens if d else 1.0, 0.04 if d else 0.01)
            if d:
                return decisions

    gate.observe(16, True, 2.0, 0.04)  # warm-up: 50 tokens/row/s
    assert run(2.0) == [False] * 2 + [True]  # first plain step measured, one more, then a probe at gap 2
    assert run(2.0) == [False] * 4 + [True]  # lost: the gap doubles
    assert run(2.0) == [False] * 8 + [True]
    assert run(2.0) == [False] * 8 + [True]  # capped at max_probe_every
    assert gate.summary()["rows 9-16"]["probe_gap"] == 8
    assert run(8.0) == [False] * 8 + [True]  # this probe wins (200 tokens/row/s): draft on, gap back to 2
    assert gate.summary()["rows 9-16"]["probe_gap"] == 2
    assert gate.should_draft(16)
    gate.observe(16, True, 3.6, 0.04)  # 90 tokens/row/s: speculation loses, but by less than backoff_below
    assert run(3.6) == [False] * 2 + [True]
    assert run(3.6) == [False] * 2 + [True]  # near-even losses keep the gap


def test_while_speculation_wins_a_plain_probe_keeps_the_plain_rate_current():
    """One slow plain step must not keep the gate drafting for the rest of a run: after probe_every drafted steps in
    a row a plain step is run, and once plain steps are measured faster the gate skips."""
    gate = SpecGate(warmup=1, probe_every=4, decay=0.0)
    gate.observe(16, True, 2.0, 0.04)  # 50 tokens/row/s
    assert not gate.should_draft(16)
    gate.observe(16, False, 1.0, 0.05)  # an unlucky plain step: 20 tokens/row/s
    decisions = []
    for _ in range(10):
        decisions.append(gate.should_draft(16))
        plain_ms = 0.05 if len(decisions) < 6 else 0.01  # plain steps get fast (100 tokens/row/s)
        gate.observe(16, decisions[-1], 2.0 if decisions[-1] else 1.0, 0.04 if decisions[-1] else plain_ms)
    assert decisions[:5] == [True] * 4 + [False]  # speculation wins: a plain probe after 4 drafted steps
    assert decisions[5:] == [True] * 4 + [False]  # still winning against the slow probe; the next one is fast
    assert not gate.should_draft(16)  # plain steps now win
    assert gate.summary()["rows 9-16"]["plain_rate"] == 100.0


def test_the_default_gate_probes_at_a_fixed_gap():
    """Backoff is opt-in (max_probe_every): a probe pays the catch-up of every skipped step, so it understates
    speculation, and doubling the gap made batch-1 decoding skip where drafting wins."""
    gate = SpecGate(warmup=1, decay=0.0)
    gate.observe(1, True, 2.0, 0.04)
    for _ in range(3):
        decisions = []
        while not decisions or not decisions[-1]:
            decisions.append(gate.should_draft(1))
            gate.observe(1, decisions[-1], 2.0 if decisions[-1] else 1.0, 0.04 if decisions[-1] else 0.01)
        assert decisions.count(False) in (8, 9)  # the first round also measures its first plain step
    assert gate.summary()["rows 1-1"]["probe_gap"] == 8


def test_gate_leaves_one_off_slow_steps_out_of_its_rates():
    """A step that recompiled a graph takes seconds, not milliseconds: it must not become the rate of its kind."""
    gate = SpecGate(warmup=2, decay=0.5)
    gate.observe(16, True, 2.0, 5.0)  # the first drafted step compiled: 0.4 tokens/row/s
    gate.observe(16, True, 2.0, 0.02)  # 100x faster than that EMA: it replaces it
    assert gate.summary()["rows 9-16"]["spec_rate"] == 100.0
    assert not gate.should_draft(16)  # warmed up: measure a plain step
    gate.observe(16, False, 1.0, 3.0)  # ... which compiled too: left out (0.33 tokens/row/s would end speculation)
    assert not gate.should_draft(16)  # no plain measurement yet: another plain step
    gate.observe(16, False, 1.0, 0.005)  # 200 tokens/row/s
    assert gate.summary()["rows 9-16"]["plain_rate"] == 200.0
    for _ in range(3):  # three slow steps in a row are left out ...
        gate.observe(16, False, 1.0, 0.5)
    assert gate.summary()["rows 9-16"]["plain_rate"] == 200.0
    gate.observe(16, False, 1.0, 0.5)  # ... a fourth means plain steps really are that slow now
    assert gate.summary()["rows 9-16"]["plain_rate"] == 2.0
    assert gate.should_draft(16)


def test_gate_margin_keeps_plain_steps_unless_speculation_clearly_wins():
    gate = SpecGate(warmup=1, margin=0.5, decay=0.0)
    gate.observe(1, True, 1.2, 0.01)
    gate.observe(1, False, 1.0, 0.01)
    assert not gate.should_draft(1)  # 120 vs 100 tokens/s: not 1.5x
    gate.observe(1, True, 1.6, 0.01)
    assert gate.should_draft(1)


@pytest.mark.parametrize("kwargs, match", [({"warmup": 0}, "warmup"), ({"decay": 1.0}, "decay"),
                                           ({"margin": -0.1}, "margin"),
                                           ({"probe_every": 8, "max_probe_every": 4}, "max_probe_every"),
                                           ({"outlier": 1.0}, "outlier")])
def test_gate_refuses_bad_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SpecGate(**kwargs)


def test_the_engine_builds_a_gate_only_when_asked_and_only_with_a_drafter():
    target = tiny_decoder(64, layers=2, heads=2, kv=1)
    assert SpecEngine(target, perfect_draft_lm(target)).gate is None
    assert SpecEngine(target, config=EngineConfig(spec_gate=True)).gate is None
    assert isinstance(SpecEngine(target, perfect_draft_lm(target),
                                 EngineConfig(spec_gate=True)).gate, SpecGate)


# ---------------------------------------------------------------------------------------------------------
# Exactness with skipped steps
# ---------------------------------------------------------------------------------------------------------


def requests(vocab: int, n: int, new: int, seed: int, sampling=None) -> list[Request]:
    rng = random.Random(seed)
    return [Request([rng.randrange(vocab) for _ in range(rng.randint(2, 12))], max_new_tokens=new, stop_ids=(),
                    sampling=sampling(i) if sampling else SamplingParams()) for i in range(n)]


def test_skipped_steps_are_exact_at_t0_and_a_perfect_draft_lm_stays_in_sync():
    """A draft LM equal to the target accepts every draft only if its own cache followed the skipped steps."""
    target = tiny_decoder(64, layers=2, heads=2, kv=1)
    gate = ScriptedGate([True, False, False, True, False])
    engine = gated_engine(target, perfect_draft_lm(target), gate, max_batch_size=3, num_draft_tokens=3)
    reqs = requests(64, 5, 30, seed=0)
    got = engine.generate(reqs)
    assert [r.token_ids for r in got] == [r.token_ids for r in reference_generate(target, reqs)]
    m = engine.metrics
    assert m.skipped_steps > 0 and m.summary()["skipped_steps"] == m.skipped_steps
    drafted = [t for _, d, t in gate.seen if d]
    assert drafted and min(drafted) > 3.0  # K + 1 = 4 per row, fewer only where a row ran out of tokens
    assert all(t == 1.0 for _, d, t in gate.seen if not d)


class RecordingBlock(RecordingMixin, BlockDrafterAdapter):
    def __init__(self, model) -> None:
        super().__init__(model)
        self.start_recording()


def block_case():
    from test_block_engine import tiny_block_drafter, tiny_target

    target = tiny_target()
    drafter = RecordingBlock(tiny_block_drafter(target, "dfly"))
    return target, drafter, 16, lambda seq: reference_drafts(drafter.model, target, seq, 3)


def mtp_case():
    from test_mtp import RecordingMTP, tiny_model

    target = tiny_decoder(12, heads=2, kv=1)
    drafter = RecordingMTP(tiny_model(target, depths=3))
    return target, drafter, 12, lambda seq: mtp_reference_drafts(drafter.model, target, seq, 3)


def eagle3_case():
    from test_eagle3 import RecordingEagle3, tiny_model, tiny_target

    target = tiny_target(vocab=12)
    drafter = RecordingEagle3(tiny_model(target, depths=3))
    return target, drafter, 12, lambda seq: mtp_reference_drafts(drafter.model, target, seq, 3)


@pytest.mark.parametrize("case", [block_case, mtp_case, eagle3_case], ids=["dfly", "mtp", "eagle3"])
def test_a_drafters_context_is_complete_after_skipped_steps(case):
    """Rows refill, drafts get partially accepted, and steps without drafts come in runs: every later proposal
    still equals the drafter's from-scratch recompute on the committed sequence."""
    target, drafter, vocab, recompute = case()
    engine = gated_engine(target, drafter, ScriptedGate([False, True, False, False, True]), max_batch_size=4,
                          num_draft_tokens=3)
    reqs = requests(vocab, 8, 40, seed=1)
    got = engine.generate(reqs)
    assert [r.token_ids for r in got] == [r.token_ids for r in reference_generate(target, reqs)]
    assert sum(engine.metrics.accept_hist[1:]) > 0
    drafted = [(seq, drafts) for seq, drafts in drafter.proposals if drafts]  # skipped steps propose 0 drafts
    assert engine.metrics.skipped_steps > 0 and drafted and len(drafted) < len(drafter.proposals)
    for seq, drafts in drafted[::3]:
        assert recompute(seq) == drafts


@pytest.mark.parametrize("case", [block_case, mtp_case, eagle3_case], ids=["dfly", "mtp", "eagle3"])
def test_skipped_rounds_cost_the_drafter_no_model_call_and_are_caught_up_in_one(case):
    """Context upkeep waits for the next drafted round (`PendingCommits`): `on_commit` and a round of 0 drafts run
    no drafter model call, and a drafted round appends every waiting commit's positions in one call (block drafters:
    one `append_context`; the MTP family: one `forward_cached`, then its K - 1 draft-chain steps)."""
    target, drafter, vocab, _ = case()
    block = isinstance(drafter, BlockDrafterAdapter)
    name = "append_context" if block else "forward_cached"
    model_call = getattr(drafter.model, name)
    rounds: list[list] = [["prefill", 0]]  # per drafter call: [phase, model calls]

    def counted(*args, **kwargs):
        rounds[-1][1] += 1
        return model_call(*args, **kwargs)

    def phase(label, method):
        def call(arg):
            rounds.append([label(arg), 0])
            out = method(arg)
            rounds.append(["other", 0])
            return out
        return call

    setattr(drafter.model, name, counted)
    drafter.propose = phase(lambda state: f"propose {state.num_draft_tokens}", drafter.propose)
    drafter.on_commit = phase(lambda commit: "on_commit", drafter.on_commit)
    engine = gated_engine(target, drafter, ScriptedGate([True, False, False, True, False]), max_batch_size=1,
                          num_draft_tokens=3)
    reqs = requests(vocab, 2, 30, seed=3)
    assert [r.token_ids for r in engine.generate(reqs)] == [r.token_ids for r in reference_generate(target, reqs)]
    assert engine.metrics.skipped_steps > 0
    assert all(n == 0 for label, n in rounds if label in ("on_commit", "propose 0"))
    drafted = [n for label, n in rounds if label == "propose 3"]
    chain = 0 if block else 3 - 1  # the MTP family's draft-chain calls of one round
    assert drafted and all(n <= 1 + chain for n in drafted)
    assert sum(n == 1 + chain for n in drafted) >= len(drafted) - len(reqs)  # all but a request's first round


def test_waiting_commits_join_each_rows_new_entries_first_in_order():
    import torch

    from angelspec.decoding.drafters.base import PendingCommits

    pending = PendingCommits()
    assert pending.take() is None
    a = torch.tensor([[10, 11, 12], [20, 21, 22]])  # row 0 keeps 2 entries, row 1 keeps 1
    pending.add((a, a[..., None].float()), torch.tensor([2, 1]))
    one = pending.take()
    assert one is not None and one[0][0] is a and not pending  # a single commit comes back as it was added
    pending.add((a, a[..., None].float()), torch.tensor([2, 1]))
    pending.add((a[:, :1] + 5, a[:, :1, None] + 5.0), torch.tensor([1, 0]))  # a skipped round: row 1 idle
    (ids, feats), count = pending.take()
    assert count.tolist() == [3, 1]
    assert ids[0, :3].tolist() == [10, 11, 15] and ids[1, :1].tolist() == [20]
    assert torch.equal(feats[..., 0], ids.float()) and not pending
    # One waiting commit of one position (a gate-skipped step): padded to two columns, so that a compiled catch-up
    # never meets a width of 1 (torch.compile specialises it: a fresh compilation mid-run); the count is unchanged.
    pending.add((a[:, :1], a[:, :1, None].float()), torch.tensor([1, 0]))
    (ids, feats), count = pending.take()
    assert ids.tolist() == [[10, 0], [20, 0]] and feats.shape == (2, 2, 1) and count.tolist() == [1, 0]


def test_at_t1_a_gate_that_never_drafts_samples_exactly_what_plain_decoding_samples():
    """Skipped steps draw the target's token with the same counter-based noise as plain decoding, so with the same
    seeds the outputs are identical token for token (not only in distribution)."""
    target = tiny_decoder(64, layers=2, heads=2, kv=1, std=0.1)
    reqs = requests(64, 6, 24, seed=2, sampling=lambda i: SamplingParams(temperature=1.0, seed=40 + i))
    plain = SpecEngine(target, config=EngineConfig(max_batch_size=4)).generate(reqs)
    engine = gated_engine(target, perfect_draft_lm(target), ScriptedGate([False]), max_batch_size=4)
    gated = engine.generate(reqs)
    assert [r.token_ids for r in gated] == [r.token_ids for r in plain]
    assert engine.metrics.skipped_steps == engine.metrics.steps > 0
    assert len({t for r in plain for t in r.token_ids}) > 10  # really sampled, not a near-greedy target


def test_merged_metrics_keep_the_skipped_steps():
    from angelspec.decoding.metrics import DecodeMetrics
    from angelspec.eval.speculative import merge_metrics

    a, b = DecodeMetrics(num_draft_tokens=3), DecodeMetrics(num_draft_tokens=3)
    a.skipped_steps, b.skipped_steps = 2, 5
    assert merge_metrics([a, b]).skipped_steps == 7


def test_skipped_steps_in_a_mixed_batch_sample_what_plain_decoding_samples():
    """Greedy rows beside sampled rows with top-k and top-p (the "deterministic" protocol, not greedy): a step without
    drafts chooses each row's token as the AR step does, with the same noise key, so with the same seeds the
    outputs equal plain decoding's token for token."""
    target = tiny_decoder(64, layers=2, heads=2, kv=1, std=0.1)
    kinds = [SamplingParams(), SamplingParams(temperature=0.7, top_k=20, seed=7),
             SamplingParams(temperature=1.2, top_p=0.9, seed=8)]
    reqs = requests(64, 9, 20, seed=4, sampling=lambda i: kinds[i % 3])
    plain = SpecEngine(target, config=EngineConfig(max_batch_size=3)).generate(reqs)
    engine = gated_engine(target, perfect_draft_lm(target), ScriptedGate([False]), max_batch_size=3)
    assert [r.token_ids for r in engine.generate(reqs)] == [r.token_ids for r in plain]
    assert engine.metrics.skipped_steps == engine.metrics.steps > 0
