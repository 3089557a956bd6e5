"""n-gram lookup in front of a model drafter (`decoding/drafters/hybrid.py`): outputs equal AR at T=0 with rounds of
every kind (all rows from the lookup, all from the model, mixed), the model's context stays exact across the rounds
it sat out (every later proposal equals a from-scratch recompute), T=1 keeps the target's distribution, and the
`SPEC+ngram` form of `--drafter` builds one or says why it cannot."""

from __future__ import annotations

import pytest
from conftest import tiny_decoder
from test_block_engine import sampling_block_drafter
from test_engine_spec import _sample_spec, assert_target_distributed, dist_case  # noqa: F401
from test_spec_gate import block_case, eagle3_case, mtp_case, requests

from angelspec.decoding.drafter_spec import split_hybrid_spec
from angelspec.decoding.drafters import DraftLMDrafter, NGramDrafter
from angelspec.decoding.drafters import hybrid as hybrid_module
from angelspec.decoding.drafters.hybrid import HybridDrafter
from angelspec.decoding.engine import EngineConfig, SpecEngine, reference_generate
from angelspec.decoding.loading import resolve_drafter
from angelspec.decoding.sampling import SamplingParams
from angelspec.errors import UsageError

pytestmark = pytest.mark.usefixtures("one_thread")


class CountingHybrid(HybridDrafter):
    """Records each drafted round's kind: how many active rows the lookup drafted, of how many."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.kinds: list[str] = []

    def propose(self, state):
        p = super().propose(state)
        if state.num_draft_tokens:
            hits = sum(1 for n in self._sources.values() if n)
            self.kinds.append("model" if hits == 0 else "lookup" if hits == len(state.active_rows) else "mixed")
        return p


@pytest.mark.parametrize("case", [block_case, mtp_case, eagle3_case], ids=["dfly", "mtp", "eagle3"])
@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize(("adaptive", "model_depth"), [(False, None), (True, None), (False, 2)],
                         ids=["fixed", "adaptive", "shallow-model"])
def test_hybrid_equals_ar_and_the_model_keeps_an_exact_context(case, batch, adaptive, model_depth):
    """Rounds drafted by the lookup commit up to K + 1 tokens while the model sits out: the model catches up on its
    next round, and every proposal it makes equals its from-scratch recompute on the committed sequence. With the
    measured choice (`adaptive`) as with the fixed rule (every match of min_match or more), and with the model
    drafting fewer than the lookup's K (`model_depth`)."""
    target, drafter, vocab, recompute = case()
    hybrid = CountingHybrid(drafter, NGramDrafter(max_ngram=2), min_match=2, adaptive=adaptive,
                            model_depth=model_depth)
    engine = SpecEngine(target, hybrid, EngineConfig(max_batch_size=batch, num_draft_tokens=3))
    reqs = requests(vocab, 6, 40, seed=2)
    got = engine.generate(reqs)
    assert [r.token_ids for r in got] == [r.token_ids for r in reference_generate(target, reqs)]
    kinds = set(hybrid.kinds)
    assert {"lookup", "model"} <= kinds and (batch == 1 or "mixed" in kinds), hybrid.kinds
    assert hybrid.lookup_rounds > 0 and hybrid.model_rounds > 0
    for rounds, seconds, tokens in hybrid.round_stats.by_kind.values():  # both kinds timed, >= one token a row-round
        assert rounds > 0 and seconds > 0 and tokens >= rounds
    assert sum(engine.metrics.accept_hist[2:]) > 0  # some rounds committed several tokens
    drafted = [(seq, drafts) for seq, drafts in drafter.proposals if drafts]  # the model's own rounds
    assert drafted and len(drafted) < len(drafter.proposals)  # it sat some rounds out (0 drafts)
    for seq, drafts in drafted[::2]:
        assert recompute(seq)[: len(drafts)] == drafts
    if model_depth is not None:  # the model drafted model_depth per round; lookup rounds still verified K
        assert {len(d) for _, d in drafted} == {model_depth}
        assert max(i for i, n in enumerate(engine.metrics.accept_hist) if n) > model_depth  # accepted drafts


@pytest.mark.parametrize("model_depth", [None, 1], ids=["model-K", "model-1"])
def test_t1_hybrid_keeps_the_target_distribution(dist_case, monkeypatch, model_depth):  # noqa: F811
    """T=1 with 4000 rows in one batch: rows with a lookup match take its drafts, the others a DFly drafter's
    argmax drafts (K of them, or one: `model_depth`), verified with the deterministic-draft protocol; the first
    three emitted tokens follow the target's exact distribution (chi-square, alpha 1e-4). (Three tokens are one
    round: the lookup may take it.)"""
    monkeypatch.setattr(hybrid_module, "MODEL_FIRST_ROUNDS", 0)
    tgt, _, joint = dist_case
    hybrid = CountingHybrid(sampling_block_drafter(tgt, "dfly"), NGramDrafter(max_ngram=2), min_match=1,
                            model_depth=model_depth)
    y, metrics = _sample_spec(tgt, hybrid, None)
    assert "mixed" in hybrid.kinds and set(metrics.protocols) == {"deterministic"}
    assert metrics.mean_accepted_length > 1.15 and metrics.acceptance[1] > 0.05  # second drafts get verified too
    assert_target_distributed(y, joint, "hybrid")


def test_hybrid_with_no_lookup_match_passes_the_models_sampled_drafts_through():
    """No row matches: the model's proposal is returned as it is, so sampled drafts keep standard speculative
    sampling (the choice of drafter depends on the committed prefix only)."""
    from test_block_engine import tiny_target

    target = tiny_target()
    hybrid = CountingHybrid(sampling_block_drafter(target, "dfly"), NGramDrafter(max_ngram=3), min_match=3)
    seen = []
    inner_propose = hybrid.inner.propose

    def record(state):
        p = inner_propose(state)
        seen.append(p)
        return p

    hybrid.inner.propose = record
    from angelspec.decoding.engine import Request
    from angelspec.decoding.sampling import SamplingParams

    engine = SpecEngine(target, hybrid, EngineConfig(max_batch_size=1, num_draft_tokens=3))
    engine.generate([Request([5, 6, 7], max_new_tokens=2, sampling=SamplingParams(temperature=1.0, seed=0),
                             stop_ids=())])
    assert hybrid.kinds[0] == "model" and not seen[0].deterministic and seen[0].probs is not None
    assert set(engine.metrics.protocols) == {"speculative"}


def test_hybrid_refuses_a_drafter_that_caches_its_own_drafts():
    with pytest.raises(ValueError, match="keeps its own drafts as context"):
        HybridDrafter(DraftLMDrafter(tiny_decoder(16)))
    with pytest.raises(ValueError, match=r"min_match must lie in \[1, 3\]"):
        HybridDrafter(block_case()[1], min_match=4)


def test_the_drafter_spec_builds_a_hybrid_or_names_the_problem(tmp_path):
    from test_block_engine import tiny_block_drafter, tiny_target

    from angelspec.models.block.io import save_block_drafter

    assert split_hybrid_spec("dfly:DIR+ngram") == ("dfly:DIR", (3, 1, None))
    assert split_hybrid_spec("DIR+ngram:5") == ("DIR", (5, 1, None))
    assert split_hybrid_spec("DIR+ngram:4:2") == ("DIR", (4, 2, None))
    assert split_hybrid_spec("DIR+ngram:4:2:3") == ("DIR", (4, 2, 3))
    assert split_hybrid_spec("a+ngramx/b") == ("a+ngramx/b", None)  # a folder name, not the suffix
    target = tiny_target()
    save_block_drafter(tiny_block_drafter(target, "dfly"), tmp_path / "d")
    built = resolve_drafter(f"{tmp_path / 'd'}+ngram:4", target, tmp_path)
    assert isinstance(built, HybridDrafter) and built.ngram.max_ngram == 4 and built.min_match == 1
    assert built.model_depth is None
    assert resolve_drafter(f"{tmp_path / 'd'}+ngram:3:1:2", target, tmp_path).model_depth == 2
    for spec, needle in (("ngram+ngram", "in front of a model drafter"),
                         ("none+ngram", "in front of a model drafter"),
                         (f"{tmp_path / 'd'}+ngram:0", "positive integer"),
                         (f"{tmp_path / 'd'}+ngram:3:x", "positive integer M"),
                         (f"{tmp_path / 'd'}+ngram:2:3", r"min_match must lie in \[1, 2\]"),
                         (f"{tmp_path / 'd'}+ngram:3:1:0", "positive integer D"),
                         (f"{tmp_path / 'd'}+ngram:3:1:1:1", r"SPEC\+ngram\[:N\[:M\[:D\]\]\]")):
        with pytest.raises(UsageError, match=needle):
            resolve_drafter(spec, target, tmp_path)


def test_a_draft_lm_with_lookup_in_front_is_refused_with_the_drafters_that_fit():
    from angelspec.assets import DEFAULT_DRAFT_LM, DEFAULT_TARGET
    from angelspec.decoding.loading import load_target_and_tokenizer

    target, _ = load_target_and_tokenizer(DEFAULT_TARGET)
    with pytest.raises(UsageError, match=r"keeps its own drafts as context.*\(MTP, EAGLE-3, DFlash"):
        resolve_drafter(f"draft-lm:{DEFAULT_DRAFT_LM}+ngram", target, DEFAULT_TARGET)


@pytest.mark.parametrize("case", [block_case, mtp_case], ids=["dfly", "mtp"])
def test_a_compiled_hybrid_compiles_nothing_when_requests_end_after_lookup_rounds(case):
    """A request that ends after lookup rounds leaves the model's commits waiting, and the catch-up before its row
    is reset ran through the compiled cached forward with that moment's shapes: a compiled MTP hybrid at batch 1
    recompiled in the middle of a timed eval (chat 0.35x of AR). The catch-up before rows change now runs eagerly:
    a second run with other requests compiles nothing, and every output is AR's."""
    from conftest import generate_twice_without_recompiles

    target, drafter, vocab, _ = case()
    hybrid = CountingHybrid(drafter, NGramDrafter(max_ngram=2), min_match=1)
    engine = SpecEngine(target, hybrid, EngineConfig(max_batch_size=1, num_draft_tokens=3, compile=True,
                                                     max_seq_len=64))  # one cache size for every call, as eval has
    first, second = requests(vocab, 2, 20, seed=5), requests(vocab, 6, 40, seed=6)
    got = generate_twice_without_recompiles(engine, first, second)
    assert [r.token_ids for r in got] == [r.token_ids for r in reference_generate(target, first + second)]
    assert {"lookup", "model"} <= set(hybrid.kinds)


def test_bench_configs_take_the_suffix_before_their_own():
    from angelspec.eval.serving.sweep import parse_config

    c = parse_config("DFly+NG=dfly:DIR+ngram:3:2@dcut+gate+compile")
    assert (c.drafter, c.policy, c.spec_gate, c.compile) == ("dfly:DIR+ngram:3:2", "dcut", True, True)
    c = parse_config("DFly+NG=DIR+ngram+compile")
    assert (c.drafter, c.policy, c.compile) == ("DIR+ngram", "auto", True)  # no @POLICY: the serving setting


def test_the_chooser_takes_the_lookup_while_it_pays_and_probes_it_when_it_does_not():
    from angelspec.decoding.drafters.hybrid import LookupChooser

    c = LookupChooser(3, row_alpha=1.0, global_alpha=1.0, probe_every=3)
    c.reset(2)
    assert c.prefers_lookup(0, 1)  # nothing measured: the free drafter
    c.observe_round(0.010, False)  # a lookup round takes 10 ms
    c.observe_round(0.015, True)  # a model round 15 ms
    c.observe_accepted(0, 0, 3)  # the model: 3 accepted -> 4 tokens in 15 ms
    c.observe_accepted(0, 1, 1)  # lookup after a 1-token match: 2 tokens in 10 ms: loses
    c.observe_accepted(0, 3, 2)  # after a 3-token match: 3 tokens in 10 ms: wins (0.30 vs 0.27 tokens/ms)
    assert c.prefers_lookup(0, 3)
    assert [c.prefers_lookup(0, 1) for _ in range(6)] == [False, False, True, False, False, True]  # probes
    c.start_row(1)  # a new request starts from the drafter-wide means
    assert c._rows[1]["model"] == 3 and c._rows[1]["lookup"][1] == 1
    assert not c.prefers_lookup(1, 1)
    c.observe_round(1.0, False)  # a compile-long round is left out of the mean
    assert c.lookup_round_s == 0.010


class ScriptedServing:
    """A serving gate that cycles through `pattern`: "model" (all K drafts), "probe" (all K drafts, measured but only
    one token a row committed: `ServingGate.measure_only`), "lookup" (a lookup step of 2 drafts), "plain" (0), or while
    drafting is off (no upkeep of the model's context) "off" (0), "bare" (0, making no taps: `ServingGate.keep_taps`
    False), "lookoff" (a lookup step of 2 drafts) and "lookbare" (one with `keep_taps` False), whatever was measured. An
    engine whose pattern has no lookup steps is one that runs none (`ServingGate.lookup_engine`): its steps without
    upkeep leave the lookup's history behind too."""

    LOOKUP, OFF = ("lookup", "lookoff", "lookbare"), ("off", "bare", "lookoff", "lookbare")

    def __init__(self, pattern: list[str], k: int) -> None:
        self.pattern, self.k, self.calls, self.lookup_only, self.upkeep = pattern, k, 0, False, True
        self.measure_only, self.keep_taps = False, True
        self.lookup_engine = any(kind in self.LOOKUP for kind in pattern)
        self.lookup_costs: tuple[float, ...] = ()  # handed to lookup steps (`DraftState.lookup_costs`)

    def choose_depth(self, num_active: int, k: int) -> int:
        kind = self.pattern[self.calls % len(self.pattern)]
        self.calls += 1
        self.lookup_only, self.upkeep = kind in self.LOOKUP, kind not in self.OFF
        self.measure_only, self.keep_taps = kind == "probe", kind not in ("bare", "lookbare")
        return {"model": k, "probe": k, "plain": 0, "off": 0, "bare": 0}.get(kind, 2)

    def observe_step(self, *args) -> None:
        pass


@pytest.mark.parametrize("case", [block_case, mtp_case], ids=["dfly", "mtp"])
@pytest.mark.parametrize("pattern", [["lookup", "lookup", "model", "plain", "lookup"],
                                     ["lookup", "off", "off", "model", "off", "lookup", "off", "off", "off"],
                                     ["lookoff", "off", "lookoff", "lookoff", "model", "lookoff", "off", "lookup",
                                      "lookoff", "lookoff", "lookoff", "plain", "model"],
                                     ["off", "off", "model", "off", "plain", "off", "off", "off", "model", "model"]],
                         ids=["upkeep", "lapses", "lookup-lapses", "no-lookup-steps"])
def test_lookup_steps_between_model_and_plain_steps_equal_ar_and_keep_the_models_context(case, pattern):
    """The serving gate's lookup steps (`DraftState.lookup_only`): only rows with a match verify drafts, the model
    sits them out and catches up on its next drafted round, outputs equal AR. Steps without upkeep (plain and lookup
    steps while the model is off) leave the model alone and tell only the lookup, which sees every committed token;
    the model's catch-up takes every position it missed, also those of lookup steps that committed several. In an
    engine that runs no lookup steps, the lookup is not told either, and catches up with the model."""
    target, drafter, vocab, recompute = case()
    hybrid = CountingHybrid(drafter, NGramDrafter(max_ngram=2), min_match=2)
    assert hybrid.lookup_drafts and not drafter.lookup_drafts
    engine = SpecEngine(target, hybrid, EngineConfig(max_batch_size=3, num_draft_tokens=3))
    engine.gate = ScriptedServing(pattern, 3)
    real_match = hybrid.ngram.match
    told = []
    real_tell = hybrid.on_lookup_commit
    hybrid.on_lookup_commit = lambda *args: (told.append(1), real_tell(*args))[1]

    def match(r: int, k: int):  # the lookup matches against the whole committed sequence, lapses or not
        slot = engine.rows.slots[r]
        assert hybrid.ngram._hist[r] == [*slot.request.prompt_ids, *slot.tokens]
        return real_match(r, k)

    hybrid.ngram.match = match
    reqs = requests(vocab, 5, 40, seed=2)
    got = engine.generate(reqs)
    assert [r.token_ids for r in got] == [r.token_ids for r in reference_generate(target, reqs)]
    assert hybrid.lookup_rounds > 0 and max(d for d, n in enumerate(engine.metrics.depth_hist) if n) >= 2
    assert bool(told) == (engine.gate.lookup_engine and any(kind in ("off", "lookoff") for kind in pattern))
    drafted = [(seq, drafts) for seq, drafts in drafter.proposals if drafts]
    assert drafted and len(drafted) < len(drafter.proposals) / 2.5  # the model drafted on model steps only
    for seq, drafts in drafted:
        assert recompute(seq)[: len(drafts)] == drafts


@pytest.mark.parametrize("pattern", [["model", "bare", "bare", "bare", "off", "model", "bare", "off", "off", "model"],
                                     ["lookoff", "bare", "bare", "lookoff", "off", "model", "bare", "bare", "model"],
                                     ["lookbare", "lookbare", "lookoff", "bare", "lookbare", "off", "model", "lookbare",
                                      "lookoff", "model"]],
                         ids=["no-lookup-steps", "lookup-steps", "tapless-lookup-steps"])
def test_the_lookup_sees_every_token_when_the_models_catch_up_leaves_positions_out(pattern):
    """Plain steps that make no taps leave positions out of the model's catch-up (`Drafter.resume_window`); the lookup
    still matches against the whole committed sequence: an engine with lookup steps tells it every step, one without
    hands it the tokens left out before the catch-up. Outputs equal AR's."""
    target, drafter, vocab, _ = block_case()
    hybrid = CountingHybrid(drafter, NGramDrafter(max_ngram=2), min_match=2)
    assert hybrid.resume_window == drafter.resume_window is not None
    engine = SpecEngine(target, hybrid, EngineConfig(max_batch_size=3, num_draft_tokens=3))
    engine.gate = ScriptedServing(pattern, 3)
    real_match, matched = hybrid.ngram.match, []

    def match(r: int, k: int):
        slot = engine.rows.slots[r]
        assert hybrid.ngram._hist[r] == [*slot.request.prompt_ids, *slot.tokens]
        matched.append(r)
        return real_match(r, k)

    hybrid.ngram.match = match
    reqs = requests(vocab, 5, 40, seed=2)
    got = engine.generate(reqs)
    assert [r.token_ids for r in got] == [r.token_ids for r in reference_generate(target, reqs)]
    off = sum(pattern[i % len(pattern)] in ScriptedServing.OFF for i in range(engine.gate.calls))  # without upkeep
    assert matched and off > engine.metrics.steps // 3


def test_lookup_steps_that_verify_nothing_make_no_taps_and_the_model_resumes_from_the_held_positions():
    """A lookup step while the model is away (no upkeep) where no row verifies a draft, and the gate needs no taps
    (`keep_taps` False), is AR's decode step: it makes no taps and drops those held so far. The model's catch-up then
    hands it only the positions held since (the lookup steps just before it drafts), its context runs on across the
    gap, and its drafts equal a from-scratch recompute over the target's taps at exactly those positions; outputs
    equal AR's."""
    from test_block_engine import tiny_block_drafter, tiny_target
    from test_serving_gate import assert_resumes_across_the_gap

    from angelspec.decoding.drafters.block import BlockDrafterAdapter

    target = tiny_target()
    drafter = BlockDrafterAdapter(tiny_block_drafter(target, "dfly"))
    hybrid = HybridDrafter(drafter, NGramDrafter(max_ngram=2))
    hybrid.ngram.match = lambda r, k: (0, [0] * k)  # no row ever matches: lookup steps verify nothing, the model drafts
    missing, held = 10, 3
    engine = SpecEngine(target, hybrid, EngineConfig(max_batch_size=1, num_draft_tokens=3))
    engine.gate = ScriptedServing(["model"] * 2 + ["lookbare"] * missing + ["lookoff"] * held + ["model"] * 200, 3)
    calls = {"decode": 0, "one_token": 0}
    for name in calls:
        real_forward = getattr(engine.forwards, name)
        setattr(engine.forwards, name, lambda *a, _real=real_forward, _name=name: calls.__setitem__(
            _name, calls[_name] + 1) or _real(*a))
    assert_resumes_across_the_gap(engine, drafter, missing, held)
    assert calls == {"decode": missing, "one_token": held}  # (every lookup step verified nothing)


@pytest.mark.parametrize("batch", [1, 3])
def test_a_lookup_step_where_no_row_would_verify_runs_as_a_plain_step_and_looks_up_each_row_once(batch):
    """A lookup step while the model is away where no row would verify a match (`Drafter.lookup_depths` all 0) runs
    as AR's step: no round is proposed, no verify forward runs, and it counts as a step that verified no drafts (not
    as one the gate skipped). One that verifies a match proposes the plan `lookup_depths` made: each active row is
    looked up once a step either way. Outputs equal AR's."""
    target, drafter, vocab, _ = block_case()
    hybrid = CountingHybrid(drafter, NGramDrafter(max_ngram=2), min_match=2)
    engine = SpecEngine(target, hybrid, EngineConfig(max_batch_size=batch, num_draft_tokens=3))
    engine.gate = ScriptedServing(["model", "model"] + ["lookoff"] * 300, 3)
    real_match, real_propose, looked, proposed = hybrid.ngram.match, hybrid.propose, [], []
    hybrid.ngram.match = lambda r, k: (looked.append(r), real_match(r, k))[1]
    hybrid.propose = lambda state: (proposed.append(state.lookup_only), real_propose(state))[1]
    verifies = []
    for name in ("greedy_verify", "greedy_packed_verify"):
        real = getattr(engine.forwards, name)
        setattr(engine.forwards, name, lambda *a, _real=real: (verifies.append(1), _real(*a))[1])
    reqs = requests(vocab, 2 * batch, 40, seed=2)
    got = engine.generate(reqs)
    assert [r.token_ids for r in got] == [r.token_ids for r in reference_generate(target, reqs)]
    m = engine.metrics
    lookup_steps = engine.gate.calls - 2
    verified_steps = sum(proposed)  # lookup steps that proposed: those where some row verifies a match
    assert 0 < verified_steps < lookup_steps  # both kinds ran
    assert len(verifies) == 2 + verified_steps  # (the model's two steps verify too)
    assert m.skipped_steps == 0 and m.steps == engine.gate.calls
    model_row_steps = 2 * batch  # (every row is busy in the model's two steps, whose rounds look nothing up)
    assert len(looked) == m.row_steps - model_row_steps
    assert hybrid.lookup_rounds == sum(n for d, n in enumerate(m.depth_hist) if d) - model_row_steps


@pytest.mark.parametrize(("costs", "verifies"), [((1.0, 1.1, 1.2), True), ((1.0, 2.5, 3.5), False)],
                         ids=["cheap", "dear"])
def test_a_lookup_step_verifies_a_match_only_to_a_depth_its_acceptance_pays_for(costs, verifies):
    """With the gate's costs (`DraftState.lookup_costs`), a lookup step verifies a row's match to the depth its match
    length's measured acceptance pays for: where verifying costs more than a certain draft returns, no match is
    verified and every lookup step is a one-token step; where it is cheap, matches are verified. Outputs equal AR's
    and the lookup learns acceptance from the rows it drafted."""
    target, drafter, vocab, _ = block_case()
    hybrid = CountingHybrid(drafter, NGramDrafter(max_ngram=2), min_match=1)
    engine = SpecEngine(target, hybrid, EngineConfig(max_batch_size=1, num_draft_tokens=3))
    engine.gate = ScriptedServing(["lookup"], 3)
    engine.gate.lookup_costs = costs
    reqs = requests(vocab, 3, 40, seed=2)
    got = engine.generate(reqs)
    assert [r.token_ids for r in got] == [r.token_ids for r in reference_generate(target, reqs)]
    verified = sum(n for d, n in enumerate(engine.metrics.depth_hist) if d)
    if verifies:
        assert hybrid.lookup_rounds > 0 and verified == hybrid.lookup_rounds
        assert any(t for t in hybrid.ngram.acceptance.trials if t)
    else:
        assert hybrid.lookup_rounds == 0 and verified == 0


@pytest.mark.parametrize("slack", [0.0, 1e9], ids=["no-slack", "unbounded"])
def test_with_no_latency_slack_waiting_for_other_rows_drafts_never_puts_a_row_behind_plain_decoding(slack):
    """The latency budget in an engine (`LatencyBudget`, the gate's `latency_slack` in `DraftState.lookup_slack`): a
    row that verifies nothing in a lookup step where others verify drafts pays the step's cost for one token. With no
    slack and no allowance the plan lets it wait only on what its own earlier accepted drafts saved (its debt never
    rises above zero, or above where its own failed drafts left it); with an unbounded slack, waiting puts rows
    behind. Outputs equal AR's either way."""
    target, drafter, vocab, _ = block_case()
    hybrid = HybridDrafter(drafter, NGramDrafter(max_ngram=2), min_match=1)
    budget = hybrid.budget
    budget.allowance = 0
    waiting: list[int] = []
    behind = []

    def watch(event):
        depth = event.depth.tolist()
        rows = [r for r, a in enumerate(event.active.tolist()) if a]
        waiting[:] = [r for r in rows if not depth[r]] if any(depth[r] for r in rows) else []

    charge = budget.charge

    def charged(cost, host_tokens):
        before = list(budget.debt)
        charge(cost, host_tokens)
        behind.extend(budget.debt[r] > max(before[r], 0.0) + 1e-9 for r in waiting)

    budget.charge = charged
    engine = SpecEngine(target, hybrid, EngineConfig(max_batch_size=2, num_draft_tokens=3), on_verify=watch)
    engine.gate = ScriptedServing(["lookup"], 3)
    engine.gate.lookup_costs = (1.0, 1.05, 1.1, 1.15, 1.2, 1.25, 1.3)  # a cheap verify: drafts pay for the batch
    engine.gate.latency_slack = slack
    reqs = requests(vocab, 4, 40, seed=2)
    got = engine.generate(reqs)
    assert [r.token_ids for r in got] == [r.token_ids for r in reference_generate(target, reqs)]
    assert behind  # rows waited on others' drafts
    assert any(behind) == (slack > 0)


@pytest.mark.parametrize("case", [block_case, mtp_case], ids=["dfly", "mtp"])
def test_sampled_outputs_do_not_depend_on_whether_lookup_steps_kept_the_models_context(case):
    """At T > 0, lookup and plain steps without the model's upkeep choose and verify with the same noise keys as with
    it, and the catch-up brings the rows' draft rounds to where upkeep would have: the same seed gives the same
    tokens either way, and the model is asked for fewer rounds."""
    target, drafter, vocab, _ = case()
    lapsed = ["model", "lookoff", "off", "lookoff", "lookoff", "model", "lookoff", "plain", "model", "off"]
    kept = [{"lookoff": "lookup", "off": "plain"}.get(kind, kind) for kind in lapsed]
    outs, rounds = [], []
    real = drafter.propose
    for pattern in (lapsed, kept):
        calls = []
        drafter.propose = lambda state, _calls=calls: _calls.append(state.num_draft_tokens) or real(state)
        hybrid = HybridDrafter(drafter, NGramDrafter(max_ngram=2), min_match=1)
        engine = SpecEngine(target, hybrid, EngineConfig(max_batch_size=3, num_draft_tokens=3, seed=11))
        engine.gate = ScriptedServing(pattern, 3)
        reqs = requests(vocab, 5, 30, seed=5, sampling=lambda i: SamplingParams(temperature=0.9))
        outs.append([r.token_ids for r in engine.generate(reqs)])
        rounds.append(len(calls))
        assert hybrid.lookup_rounds > 0
    assert outs[0] == outs[1] and rounds[0] < rounds[1]
