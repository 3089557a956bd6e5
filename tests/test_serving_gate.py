"""The serving gate behind the depth policy `auto` (`decoding/policies/gate.py`: `ServingGate`, `AutoDepth`): its
per-step depth from synthetic timings and acceptances (deterministic, no wall clock), and that an engine whose
depth it narrows or zeroes stays exact and keeps the drafter's context complete."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_decoder
from test_engine_spec import (  # noqa: F401 (dist_case: a fixture)
    PROMPT,
    accept_every_draft,
    assert_bias_detected,
    assert_target_distributed,
    dist_case,
)
from test_spec_gate import block_case, eagle3_case, gated_engine, mtp_case, perfect_draft_lm, requests

from angelspec.decoding.drafters import DraftLMDrafter
from angelspec.decoding.engine import EngineConfig, Request, SpecEngine, reference_generate
from angelspec.decoding.policies.budget import LinearCost
from angelspec.decoding.policies.factory import make_policy, parse_policy
from angelspec.decoding.policies.gate import AutoDepth, ServingGate
from angelspec.decoding.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")
K = 4


class Machine:
    """A synthetic machine: a drafted step at batch B verifying n drafts per row takes `table(B, B (n + 1))` seconds
    times `load`, a plain step `plain(B)` times `load`, the first drafted step after a plain one `catch_up` more;
    rows accept `accept` drafts (an int, or a pattern cycled over row-steps), at most the depth."""

    def __init__(self, table, plain, accept, load: float = 1.0, catch_up: float = 0.0) -> None:
        self.table, self.plain, self.load, self.catch_up = table, plain, load, catch_up
        self.accept = [accept] if isinstance(accept, int) else list(accept)
        self.after_plain, self.rows = False, 0

    def step(self, gate: ServingGate, b: int, jitter: float = 0.0) -> int:
        n = gate.choose_depth(b, K)
        if n == 0:
            seconds = self.plain(b)
        else:
            seconds = self.table(b, b * (n + 1)) + (self.catch_up if self.after_plain else 0.0)
        self.after_plain = n == 0
        seconds *= self.load * (1.0 + jitter)
        accepted = [min(self.accept[(self.rows + i) % len(self.accept)], n) for i in range(b)]
        self.rows += b
        gate.observe_step(b, n, seconds, accepted, [n] * b)
        return n


def cpu_like(b: int, n: int) -> float:
    """A drafted step verifying n positions: 10 ms plus 1.5 ms a position (cheap at batch 1, compute-bound at 32)."""
    return 0.010 + 0.0015 * n


def plain_cost(b: int) -> float:
    return 0.009 + 0.001 * b


def test_warms_up_with_drafted_then_plain_steps_then_drafts_where_it_wins():
    gate = ServingGate(K, cost=cpu_like)
    m = Machine(cpu_like, plain_cost, accept=3)
    decisions = [m.step(gate, 1) for _ in range(12)]
    assert decisions[0] == K and decisions[1] > 0 and decisions[2:4] == [0, 0]  # two timed steps of each kind
    assert all(d > 0 for d in decisions[4:12])  # ~3.7 tokens in 15 ms against 1 in 10 ms: draft
    assert gate.summary()["rows 1-1"]["drafting"]


def test_verification_narrows_with_load_before_drafting_stops():
    """The same acceptance (s = 7/8, 6/8, 4/8, 2/8) at batch 1, 4 and 32 on a machine where every verified position
    costs: the depth falls with the batch, and where no depth pays, the gate runs plain steps."""
    depths = {}
    for b in (1, 4, 32):
        gate = ServingGate(K, cost=cpu_like)
        m = Machine(cpu_like, plain_cost, accept=[4, 3, 2, 1, 0, 4, 2, 3])
        run = [m.step(gate, b) for _ in range(60)]
        depths[b] = max(set(run[20:]), key=run[20:].count)  # the depth it settles on
    assert depths[1] >= 3 and 0 < depths[4] < depths[1] and depths[32] == 0, depths


def test_noise_within_the_margin_never_flips_the_decision():
    """Drafting turned on while it clearly won (plain steps at 15 ms); then plain steps win by ~1% (inside the 5% it
    may lose before it turns off): drafting stays on under +-2% noise on every step. Where plain steps win by ~15%
    from the start, drafting stays off under the same noise."""
    def flat(b, n):
        return 0.02 if n > b else 0.01

    for accept, plain_s, expect_on in ((1, 0.0099, True), (1, 0.0085, False)):
        gate = ServingGate(K, cost=flat, probe_every=4)
        # rate(drafting) = (1 + s_1) / 20 ms, s_1 -> 1 with one accepted draft a row: ~100 tokens/s
        plain = {"s": 0.015 if expect_on else plain_s}
        m = Machine(flat, lambda b, p=plain: p["s"], accept=accept)
        states = []
        for i in range(360):
            if i == 60:
                plain["s"] = plain_s
            m.step(gate, 1, jitter=0.02 * (-1) ** i)
            states.append(gate.summary()["rows 1-1"]["drafting"])
        assert states[59] is expect_on  # (on while drafting wins by half)
        settled = states[120:]  # once the plain steps' new timing is in their EMA
        assert len(set(settled)) == 1 and settled[0] is expect_on, (accept, plain_s, settled.count(True))


def test_the_catch_up_step_after_plain_steps_is_not_timed():
    """The drafter's catch-up over skipped steps is a cost of switching: a probe that pays it must not make
    speculation look slower than it is."""
    gate = ServingGate(K, cost=cpu_like, probe_every=4)
    m = Machine(cpu_like, plain_cost, accept=K, catch_up=1.0)  # a catch-up that takes a whole second
    run = [m.step(gate, 1) for _ in range(60)]
    assert run[-20:].count(0) <= 3  # drafting stays on (plain probes only)
    assert gate.summary()["rows 1-1"]["drafting"]


def test_probes_back_off_while_one_kind_clearly_wins():
    """At a load where drafting never pays, drafted probes get rarer (the gap doubles up to max_probe_every, and
    further, up to max_budget_gap, where a probe costs more than `probe_budget` of the plain steps between them);
    where drafting clearly wins, plain probes do."""
    for budget_gap, gap in ((32, 32), (1024, 318)):  # a probe at batch 32 costs ~3.2 plain steps more: 318 at 1%
        gate = ServingGate(K, cost=cpu_like, probe_every=4, max_probe_every=32, max_budget_gap=budget_gap)
        m = Machine(cpu_like, plain_cost, accept=0)
        steps = 1100  # (the forecast loses: the first probe after the warm-up comes max_budget_gap steps later)
        run = [m.step(gate, 32) for _ in range(steps)]
        assert sum(d > 0 for d in run[100:]) <= 2 * (steps - 100) // 32 + 2  # two steps per probe, one per 32
        assert gate.summary()["rows 17-32"]["probe_gap"] == gap
    gate = ServingGate(K, cost=cpu_like, probe_every=4, max_probe_every=32)
    m = Machine(cpu_like, plain_cost, accept=K)
    run = [m.step(gate, 1) for _ in range(300)]
    assert run[100:].count(0) <= 200 // 32 + 1


def test_the_catch_up_before_a_probe_counts_in_the_probe_budget():
    """The engine's catch-up before a drafted probe (`observe_catch_up`: seconds per step without upkeep) grows with
    the plain steps since the last probe: the gap keeps the probe and its catch-up within `probe_budget` of the plain
    steps between probes, so a catch-up costing half the budget per step doubles the gap, and one costing the whole
    budget leaves only `max_budget_gap`."""
    gate = ServingGate(K, cost=cpu_like, probe_every=4, max_probe_every=16, max_budget_gap=5000)
    m = Machine(cpu_like, plain_cost, accept=0)
    for _ in range(20):
        m.step(gate, 32)
    lane, plain_s = gate._lane(32), plain_cost(32)
    alone = gate._probe_gap(lane, 32, 1, 4)
    assert 100 < alone < 5000
    gate.observe_catch_up(32, 0.5 * gate.probe_budget * plain_s * 200, 200)  # half the budget per held step
    assert gate._probe_gap(lane, 32, 1, 4) == pytest.approx(2 * alone, rel=0.02)
    lane.held_s = 0.0
    gate.observe_catch_up(32, 1.1 * gate.probe_budget * plain_s * 200, 200)
    assert gate._probe_gap(lane, 32, 1, 4) == 5000


def test_the_engine_reports_its_catch_up_to_the_gate():
    """Each catch-up before a drafted step (`Step._resync`) reports its seconds and the steps without upkeep it made
    up for."""
    target, drafter, vocab, _ = block_case()
    seen = []

    class Reporting(ScriptedLapseGate):
        def observe_catch_up(self, num_active, seconds, steps):
            seen.append((num_active, seconds, steps))

    engine = gated_engine(target, drafter, Reporting([3, -1, -1, -1, 2, 0]), max_batch_size=2, num_draft_tokens=3)
    engine.generate(requests(vocab, 2, 20, seed=0))
    assert seen and all(rows >= 1 and seconds > 0 and steps == 3 for rows, seconds, steps in seen[:-1])


def test_no_drafted_probes_while_even_the_forecast_loses():
    """A probe where the cost table's forecast (the optimistic side) loses to plain steps can only confirm the loss,
    and it puts the rows out of step: such a lane waits `max_budget_gap` between probes, not its own gap. When the
    acceptance comes back, the next of those probes sees it and drafting resumes."""
    gate = ServingGate(K, cost=cpu_like, probe_every=4, max_probe_every=16, max_budget_gap=400)
    m = Machine(cpu_like, plain_cost, accept=0)
    run = [m.step(gate, 4) for _ in range(300)]
    assert not gate.summary()["rows 3-4"]["drafting"]
    assert sum(d > 0 for d in run[50:]) == 0  # the lane's own gap (<= 16) would have probed ~15 times
    m.accept = [K]
    run += [m.step(gate, 4) for _ in range(800)]  # (after the first probe that sees it, probes at the budget's gap)
    first = next(i for i in range(300, 1100) if run[i] > 0)
    assert first <= 50 + 400 + 2  # the next probe, at most max_budget_gap after the last one
    assert gate.summary()["rows 3-4"]["drafting"] and run[-20:].count(0) <= 2


def test_plain_steps_keep_the_drafters_context_only_while_drafting_is_on():
    """A plain step while drafting is on (a plain probe) keeps the drafter's context; one while it is off (the warm-up
    too) keeps none (the engine runs an AR step and catches the drafter up when it drafts again); so does a lookup step
    of a gate with lookup steps (only the lookup's history takes its tokens)."""
    def upkeeps(gate, b, steps, accept):
        m, out = Machine(cpu_like, plain_cost, accept=accept), []
        for _ in range(steps):
            n = m.step(gate, b)
            if gate.lookup_only:
                n = -n  # (a lookup step: negative)
            out.append((n, gate.upkeep, gate.summary()[f"rows {b}-{b}"]["drafting"] if b == 1 else None))
        return out

    off = upkeeps(ServingGate(K, cost=cpu_like, probe_every=4, max_probe_every=16), 1, 200, accept=0)
    assert all(keep for n, keep, _ in off if n > 0) and [n > 0 for n, _, _ in off[:4]] == [True, True, False, False]
    assert all(keep == on for n, keep, on in off if n == 0) and sum(not keep for _, keep, _ in off) > 150
    on = upkeeps(ServingGate(K, cost=cpu_like, probe_every=4, max_probe_every=16), 1, 200, accept=K)
    plain = [keep for n, keep, _ in on[4:] if n == 0]
    assert plain and all(plain)  # the plain probes of a lane that drafts
    looked = upkeeps(ServingGate(K, cost=cpu_like, probe_every=4, max_probe_every=16, lookup=True), 1, 200, accept=0)
    assert all(keep for n, keep, _ in looked if n > 0) and all(keep == on for n, keep, on in looked if n <= 0)
    assert sum(not keep for n, keep, _ in looked if n <= 0) > 150 and any(not keep for n, keep, _ in looked if n < 0)


def kept_or_held(seen: list[tuple[int, bool, bool]], i: int, window: int) -> bool:
    """Whether the `window` steps before step i of `seen` ((depth, upkeep, keep_taps) per step) all kept or held the
    drafter's context."""
    return all(upkeep or keep for _, upkeep, keep in seen[i - window:i])


def test_steps_without_upkeep_make_taps_only_within_the_drafters_window_before_it_drafts():
    """While drafting is off a plain step makes no taps (`keep_taps` False: the engine runs AR's decode forward) unless
    the next drafted step (a probe) is at most the drafter's window away (`begin(rows, window)`): every drafted step
    after steps without upkeep finds its newest `window` steps held. Where drafting turns on unannounced (plain steps
    got slower), the gate first runs `window` plain steps that hold their taps. A drafter without a window
    (`resume_window` None) has every step's taps held."""
    window = 8
    gate = ServingGate(K, cost=cpu_like, probe_every=4, max_probe_every=64, max_budget_gap=64)
    gate.begin(4, window=window)
    m, seen = Machine(cpu_like, plain_cost, accept=0), []
    for _ in range(600):
        n = m.step(gate, 4)
        seen.append((n, gate.upkeep, gate.keep_taps))
    drafted = [i for i, (n, _, _) in enumerate(seen) if n > 0 and i > 20]  # (after the warm-up)
    assert len(drafted) >= 10 and all(kept_or_held(seen, i, window) for i in drafted)
    bare = sum(not upkeep and not keep for _, upkeep, keep in seen)
    assert bare > 400  # most plain steps make no taps
    changed = len(seen)
    m.plain = lambda b: 4 * plain_cost(b)  # plain steps slow down: drafting wins now, ahead of the next probe
    for _ in range(100):
        n = m.step(gate, 4)
        seen.append((n, gate.upkeep, gate.keep_taps))
    first = next(i for i in range(changed, len(seen)) if seen[i][0] > 0)
    assert kept_or_held(seen, first, window) and first - changed <= window + 2
    assert gate.summary()["rows 3-4"]["drafting"]

    gate = ServingGate(K, cost=cpu_like, probe_every=4, max_probe_every=64, max_budget_gap=64)
    gate.begin(4)  # no window: the drafter needs every missed position
    m = Machine(cpu_like, plain_cost, accept=0)
    for _ in range(300):
        m.step(gate, 4)
        assert gate.keep_taps


def test_lookup_steps_without_upkeep_need_taps_only_within_the_drafters_window_before_it_drafts():
    """A gate with lookup steps keeps the same window: a lookup step while drafting is off needs no taps (`keep_taps`
    False: where no row verifies a match, the engine runs AR's decode step) unless the next drafted step is at most
    the drafter's window away, so every drafted step finds its newest `window` steps kept or held."""
    window = 8
    gate = ServingGate(K, cost=cpu_like, probe_every=4, max_probe_every=64, max_budget_gap=64, lookup=True)
    gate.begin(1, window=window)
    m, seen = Machine(cpu_like, plain_cost, accept=0), []
    for _ in range(600):
        n = m.step(gate, 1)
        seen.append((-n if gate.lookup_only else n, gate.upkeep, gate.keep_taps))  # (a lookup step: negative)
    drafted = [i for i, (n, _, _) in enumerate(seen) if n > 0 and i > 20]  # (after the warm-up)
    assert len(drafted) >= 8 and all(kept_or_held(seen, i, window) for i in drafted)
    tapless = sum(n < 0 and not upkeep and not keep for n, upkeep, keep in seen)
    assert tapless > 400  # most lookup steps need no taps


def test_only_drafted_probes_while_drafting_is_off_are_measure_only():
    """Drafted steps while drafting is on commit what they accept; drafted probes while it is off only measure
    (`measure_only`), and their acceptance still turns drafting back on once it returns. One row alone has no other
    row to fall out of step with: its probes commit what they accept."""
    for b in (2, 1):
        gate = ServingGate(K, cost=cpu_like, probe_every=4, max_probe_every=16, max_budget_gap=16)
        m = Machine(cpu_like, plain_cost, accept=0)
        seen = []
        for i in range(160):
            if i == 80:
                m.accept = [K]
            n = m.step(gate, b)
            seen.append((n, gate.summary()[f"rows {b}-{b}"]["drafting"], gate.measure_only))  # (the state it ran in)
        assert all(measure == (n > 0 and not on and b > 1) for n, on, measure in seen)
        assert any(n > 0 and not on for n, on, _ in seen[:80]) and gate.summary()[f"rows {b}-{b}"]["drafting"]


def test_a_lucky_probe_does_not_turn_drafting_on_until_two_more_steps_confirm_it():
    """While off, one probe whose two steps accept everything is followed by two more drafted steps before drafting
    turns on; when those accept nothing, drafting stays off. When acceptance is back for good, drafting turns on
    after the confirmation."""
    def cheap(b, n):  # a verified draft costs a tenth of a plain step: two accepted in a row look like a clear win
        return 0.010 + 0.001 * (n - b)

    gate = ServingGate(K, cost=cheap, probe_every=4, max_probe_every=16, max_budget_gap=16)
    m = Machine(cheap, lambda b: 0.010, accept=0)
    for _ in range(80):
        m.step(gate, 1)
    assert not gate.summary()["rows 1-1"]["drafting"]
    drafted, run, states = 0, [], []
    for _ in range(60):  # the next probe's two steps accept all K drafts, every later step none
        m.accept = [K] if drafted < 2 else [0]
        run.append(m.step(gate, 1))
        drafted += run[-1] > 0
        states.append(gate.summary()["rows 1-1"]["drafting"])
    first = next(i for i, n in enumerate(run) if n > 0)
    assert all(n > 0 for n in run[first:first + 4]) and run[first + 4] == 0  # the probe and its confirmation
    assert not any(states)
    m.accept = [K]
    run = [m.step(gate, 1) for _ in range(40)]
    assert gate.summary()["rows 1-1"]["drafting"] and run[-10:].count(0) <= 1


def test_acceptance_changes_move_the_decision_within_a_request():
    """Prompts change mid-run (maths where the drafter hits, then code where it misses, then maths again): the gate
    turns drafting off and back on within a few dozen steps at batch 1 (the acceptance estimate remembers ~16
    row-steps: one row's acceptance is too noisy to follow faster)."""
    gate = ServingGate(K, cost=cpu_like, probe_every=4, max_probe_every=16)
    machine = Machine(cpu_like, plain_cost, accept=K)
    for _ in range(30):
        machine.step(gate, 1)
    assert gate.summary()["rows 1-1"]["drafting"]
    machine.accept = [0]
    run = [machine.step(gate, 1) for _ in range(50)]
    assert not gate.summary()["rows 1-1"]["drafting"] and run[-12:].count(0) >= 8  # probes: 2 drafted steps in 6
    machine.accept = [K]
    run = [machine.step(gate, 1) for _ in range(50)]
    assert gate.summary()["rows 1-1"]["drafting"] and run[-8:].count(0) <= 1


def test_without_a_cost_table_it_verifies_all_drafts_or_none():
    gate = ServingGate(K)
    m = Machine(cpu_like, plain_cost, accept=2)
    assert {m.step(gate, 1) for _ in range(30)} <= {0, K}


def test_serving_gate_refuses_bad_settings_and_another_k():
    for kwargs in ({"num_draft_tokens": 0}, {"num_draft_tokens": K, "warmup": 0},
                   {"num_draft_tokens": K, "probe_every": 8, "max_probe_every": 4},
                   {"num_draft_tokens": K, "hysteresis": 1.0}, {"num_draft_tokens": K, "hold": -0.1},
                   {"num_draft_tokens": K, "decay": 1.0}):
        with pytest.raises(ValueError):
            ServingGate(**kwargs)
    with pytest.raises(ValueError, match="K=4"):
        ServingGate(K).choose_depth(1, 3)


# ---------------------------------------------------------------------------------------------------------
# The policy and the engine
# ---------------------------------------------------------------------------------------------------------
def test_auto_is_a_policy_spec_that_needs_a_drafter_and_a_cost_table():
    spec = parse_policy("auto")
    assert spec.kind == "auto" and spec.needs_cost_model and spec.uses_drafts
    target = tiny_decoder(64, layers=2, heads=2, kv=1)
    with pytest.raises(ValueError, match="no drafter"):
        make_policy("auto", target=target, drafter=None, num_draft_tokens=K)
    with pytest.raises(ValueError, match="auto takes slack=S"):  # its one setting is named: auto:slack=S
        parse_policy("auto:2")


def test_an_auto_engine_builds_its_serving_gate_and_verifies_all_k_at_first():
    target = tiny_decoder(64, layers=2, heads=2, kv=1)
    engine = SpecEngine(target, perfect_draft_lm(target), EngineConfig(num_draft_tokens=3),
                        depth_policy=AutoDepth(cost=LinearCost()))
    assert isinstance(engine.gate, ServingGate) and engine.gate.num_draft_tokens == 3
    assert engine.step.static_depth == 3 and not engine.step.uses_proposal  # uniform depth: no host sync, trap 1 safe


class ScriptedDepthGate(ServingGate):
    """Gives the depths of `pattern` (cycled) whatever was measured."""

    def __init__(self, pattern: list[int]) -> None:
        super().__init__(3)
        self.pattern, self.calls = pattern, 0

    def choose_depth(self, num_active: int, num_draft_tokens: int) -> int:
        self.calls += 1
        return self.pattern[(self.calls - 1) % len(self.pattern)]


def test_narrowed_and_skipped_steps_are_exact_at_t0_and_a_perfect_draft_lm_stays_in_sync():
    target = tiny_decoder(64, layers=2, heads=2, kv=1)
    engine = gated_engine(target, perfect_draft_lm(target), ScriptedDepthGate([3, 1, 0, 2, 0, 0, 3]),
                          max_batch_size=3, num_draft_tokens=3)
    reqs = requests(64, 5, 30, seed=0)
    assert [r.token_ids for r in engine.generate(reqs)] == [r.token_ids for r in reference_generate(target, reqs)]
    m = engine.metrics
    assert m.skipped_steps > 0
    hist = m.depth_hist
    assert hist[1] > 0 and hist[2] > 0 and hist[3] > 0  # every depth of the pattern ran
    # A draft LM equal to the target accepts every draft it verified, at every depth, after skipped steps too.
    assert sum(a * c for a, c in enumerate(m.accept_hist)) == sum(d * c for d, c in enumerate(hist))


@pytest.mark.parametrize("case", [block_case, mtp_case, eagle3_case], ids=["dfly", "mtp", "eagle3"])
def test_a_drafters_context_is_complete_after_narrowed_and_skipped_steps(case):
    target, drafter, vocab, recompute = case()
    engine = gated_engine(target, drafter, ScriptedDepthGate([1, 0, 3, 2, 0, 0, 3]), max_batch_size=4,
                          num_draft_tokens=3)
    reqs = requests(vocab, 8, 40, seed=1)
    assert [r.token_ids for r in engine.generate(reqs)] == [r.token_ids for r in reference_generate(target, reqs)]
    drafted = [(seq, drafts) for seq, drafts in drafter.proposals if drafts]
    assert {len(d) for _, d in drafted} >= {1, 2, 3}
    for seq, drafts in drafted[::3]:
        assert recompute(seq)[:len(drafts)] == drafts


class ScriptedLapseGate(ScriptedDepthGate):
    """`ScriptedDepthGate` where -1 is a plain step while drafting is off: no upkeep of the drafter's context."""

    def choose_depth(self, num_active: int, num_draft_tokens: int) -> int:
        depth = super().choose_depth(num_active, num_draft_tokens)
        self.upkeep = depth >= 0
        return max(depth, 0)


LAPSES = [3, -1, -1, 2, 0, -1, -1, -1, -1, -1, 1, -1, 3, 3]


@pytest.mark.parametrize("case", [block_case, mtp_case, eagle3_case], ids=["dfly", "mtp", "eagle3"])
def test_steps_without_upkeep_leave_the_drafter_alone_and_it_catches_up_exactly(case):
    """While drafting is off a plain step is an AR step: the drafter is neither asked for a round nor told the commit.
    The next step that drafts hands it every position it missed in one commit (taps from one forward over them), so
    its context is complete again: its drafts equal a from-scratch recompute, across requests joining and leaving in
    the lapses, and outputs equal AR's."""
    target, drafter, vocab, recompute = case()
    calls = {"propose": 0, "on_commit": 0}
    for name in calls:
        real = getattr(drafter, name)
        setattr(drafter, name, lambda *a, _real=real, _name=name: calls.__setitem__(_name, calls[_name] + 1)
                or _real(*a))
    engine = gated_engine(target, drafter, ScriptedLapseGate(LAPSES), max_batch_size=4, num_draft_tokens=3)
    reqs = requests(vocab, 9, 40, seed=3)
    assert [r.token_ids for r in engine.generate(reqs)] == [r.token_ids for r in reference_generate(target, reqs)]
    m = engine.metrics
    assert m.skipped_steps > m.steps // 2
    # one round per drafted or upkeep step, and one more per return from a lapse: far fewer than the steps
    assert calls["propose"] < m.steps - m.skipped_steps // 2 and calls["propose"] == calls["on_commit"]
    checked = [(seq, drafts) for seq, drafts in drafter.proposals if drafts]
    assert {len(d) for _, d in checked} >= {1, 2, 3}
    for seq, drafts in checked[::2]:
        assert recompute(seq)[:len(drafts)] == drafts


@pytest.mark.parametrize("case", [block_case, mtp_case], ids=["dfly", "mtp"])
def test_sampled_outputs_do_not_depend_on_whether_skipped_steps_kept_the_context(case):
    """At T > 0 a plain step without upkeep chooses its token with the same noise key as one with it, and the catch-up
    brings the rows' draft rounds to where upkeep would have: the same seed gives the same tokens either way."""
    target, drafter, vocab, _ = case()
    outs = []
    for pattern in (LAPSES, [max(d, 0) for d in LAPSES]):
        engine = gated_engine(target, drafter, ScriptedLapseGate(pattern), max_batch_size=3, num_draft_tokens=3,
                              seed=11)
        reqs = requests(vocab, 5, 30, seed=5, sampling=lambda i: SamplingParams(temperature=0.9))
        outs.append([r.token_ids for r in engine.generate(reqs)])
    assert outs[0] == outs[1]


class ScriptedTapsGate(ScriptedLapseGate):
    """`ScriptedLapseGate` where -1 is a plain step while drafting is off that makes no taps (`keep_taps` False) and
    -2 one that holds them."""

    def choose_depth(self, num_active: int, num_draft_tokens: int) -> int:
        self.keep_taps = self.pattern[self.calls % len(self.pattern)] != -1
        return super().choose_depth(num_active, num_draft_tokens)


def test_a_block_drafter_resumes_from_the_positions_held_after_steps_that_made_no_taps():
    """Plain steps without taps leave a gap in the drafter's context: the catch-up hands it only the positions whose
    taps were held (the steps just before it drafts), and its context runs on across the gap. Its drafts equal a
    from-scratch recompute over the target's taps at exactly the positions it was given; outputs equal AR's."""
    from test_block_engine import tiny_block_drafter, tiny_target

    from angelspec.decoding.drafters.block import BlockDrafterAdapter

    target = tiny_target()
    drafter = BlockDrafterAdapter(tiny_block_drafter(target, "dfly"))
    missing, held = 10, 3
    engine = gated_engine(target, drafter, ScriptedTapsGate([3, 3] + [-1] * missing + [-2] * held + [3] * 200),
                          max_batch_size=1, num_draft_tokens=3)
    assert_resumes_across_the_gap(engine, drafter, missing, held)


def assert_resumes_across_the_gap(engine: SpecEngine, drafter, missing: int, held: int) -> None:
    """Run one request through `engine` (one row, K = 3), whose gate drafts twice, then runs `missing` steps that make
    no taps and `held` that hold theirs, then drafts: outputs equal AR's, and every proposal of the block `drafter`
    equals a from-scratch recompute over the target's taps at exactly the positions its context holds (all of them
    but the `missing` ones of the gap)."""
    from angelspec.decoding.drafters.block_propose import BlockProposer
    from angelspec.models.decoder import TrainInputs
    from angelspec.models.mtp import concat_taps

    target, seen, real = engine.target, [], drafter.propose

    def propose(state):
        prop = real(state)
        if state.num_draft_tokens:
            slot = engine.rows.slots[0]
            seen.append(([*slot.request.prompt_ids, *slot.tokens], prop.tokens[0].tolist(),
                         int(drafter.cache.lengths[0])))
        return prop

    drafter.propose = propose
    reqs = requests(16, 1, 48, seed=2)
    assert [r.token_ids for r in engine.generate(reqs)] == [r.token_ids for r in reference_generate(target, reqs)]
    assert len(seen) > 4
    resumed = len(seen[2][0])  # the first drafted step after the lapse: its anchor is position resumed - 1
    gap = range(resumed - 1 - missing - held, resumed - 1 - held)  # the positions whose taps were never made
    for i, (seq, drafts, cached) in enumerate(seen):
        kept = [p for p in range(len(seq) - 1) if i < 2 or p not in gap]
        assert cached == len(kept)
        ids = torch.tensor([seq])
        with torch.no_grad():
            hidden = target(ids, TrainInputs(hidden_layers=list(drafter.target_layer_ids), compute_logits=False)).hidden
            want = BlockProposer(drafter.model).propose_from_taps(concat_taps(hidden)[:, kept],
                                                                  torch.tensor([len(kept)]), ids[:, -1])
        assert want.tokens[0, :3].tolist() == drafts


@pytest.mark.parametrize("case", [block_case, mtp_case, eagle3_case], ids=["dfly", "mtp", "eagle3"])
def test_steps_that_make_no_taps_leave_outputs_equal_to_ar(case):
    """Plain steps without taps among held ones, drafted steps and probes, with requests joining and leaving in the
    lapses: outputs equal AR's, and every drafter keeps drafting after its catch-ups."""
    target, drafter, vocab, _ = case()
    gate = ScriptedTapsGate([3, -1, -1, -1, -2, -2, 2, 0, -1, -2, 1, -1, -1, 3, 3])
    engine = gated_engine(target, drafter, gate, max_batch_size=4, num_draft_tokens=3)
    reqs = requests(vocab, 9, 40, seed=3)
    assert [r.token_ids for r in engine.generate(reqs)] == [r.token_ids for r in reference_generate(target, reqs)]
    assert engine.metrics.skipped_steps > engine.metrics.steps // 3 and sum(engine.metrics.accept_hist[1:]) > 0


def test_compiled_plain_steps_without_taps_run_a_decode_graph_warmed_up_before_the_run():
    """An engine whose serving gate may run plain steps without taps (a drafter with `resume_window`) warms AR's decode
    graph up with the others (`Step.bare_decode`), so those steps compile nothing mid-run; outputs equal AR's. A drafter
    that needs every position (n-gram lookup alone) does not warm it."""
    from conftest import generate_twice_without_recompiles
    from test_block_engine import tiny_block_drafter, tiny_target

    from angelspec.decoding.drafters import NGramDrafter
    from angelspec.decoding.drafters.block import BlockDrafterAdapter

    target = tiny_target()
    drafter = BlockDrafterAdapter(tiny_block_drafter(target, "dfly"))
    engine = gated_engine(target, drafter, ScriptedTapsGate([3, -1, -1, -2, -2, 3, -1, 0]), max_batch_size=2,
                          num_draft_tokens=3, compile=True, max_seq_len=64)
    assert engine.step.bare_decode
    first, second = requests(16, 2, 8, seed=4), requests(16, 4, 30, seed=5)
    got = generate_twice_without_recompiles(engine, first, second)
    assert (2, "decode") in engine.forwards.warmed
    want = reference_generate(target, first) + reference_generate(target, second)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    lookup = gated_engine(target, NGramDrafter(), ScriptedTapsGate([3]), max_batch_size=2, num_draft_tokens=3)
    assert not lookup.step.bare_decode


PROBE = 100  # in a `ScriptedProbeGate` pattern: PROBE + d is a drafted probe of d drafts while drafting is off


class ScriptedProbeGate(ScriptedLapseGate):
    """`ScriptedLapseGate` where PROBE + d is a probe while drafting is off (`ServingGate.measure_only`): d drafts
    verified, one token a row committed. Records, per probe, the tokens the rows held before it and after it, and the
    acceptances it was told (`engine` set by the test)."""

    def __init__(self, pattern: list[int]) -> None:
        super().__init__(pattern)
        self.engine: SpecEngine | None = None
        self.probes: list[tuple[int, int, int, list[int]]] = []  # (active rows, tokens before, tokens after, accepted)

    def _held(self) -> int:
        assert self.engine is not None
        return sum(len(s.tokens) for s in self.engine.rows.slots if s is not None)

    def choose_depth(self, num_active: int, num_draft_tokens: int) -> int:
        depth = super().choose_depth(num_active, num_draft_tokens)
        self.measure_only = depth >= PROBE
        if self.measure_only:
            self._before = self._held()
        return depth - PROBE if self.measure_only else depth

    def observe_step(self, num_active, depth, seconds, accepted, depths) -> None:
        if self.measure_only:
            self.probes.append((num_active, self._before, self._held(), list(accepted)))
        super().observe_step(num_active, depth, seconds, accepted, depths)


def test_a_probe_while_drafting_is_off_commits_one_token_a_row_and_reports_what_was_accepted():
    """A drafted probe while drafting is off must not put the rows out of step: it verifies its drafts, reports what
    each row accepted (a draft LM equal to the target: all of them), and commits one token a row, the target's own;
    outputs equal AR's and the draft LM's cache stays exact for the drafted steps after it."""
    target = tiny_decoder(64, layers=2, heads=2, kv=1)
    gate = ScriptedProbeGate([-1, -1, PROBE + 3, PROBE + 3, -1, 3, 0, PROBE + 2, -1, 2])
    engine = gated_engine(target, perfect_draft_lm(target), gate, max_batch_size=3, num_draft_tokens=3)
    gate.engine = engine
    reqs = requests(64, 5, 30, seed=0)
    assert [r.token_ids for r in engine.generate(reqs)] == [r.token_ids for r in reference_generate(target, reqs)]
    assert len(gate.probes) >= 6
    for rows, before, after, accepted in gate.probes:
        assert after - before == rows  # one token a row
        assert len(accepted) == rows and max(accepted) >= 2  # reported: what the rows accepted, not what was kept
    m = engine.metrics  # what was committed: every draft of the drafted steps, none of the probes'
    drafted = sum(d * c for d, c in enumerate(m.depth_hist))
    assert drafted > 0 and sum(a * c for a, c in enumerate(m.accept_hist)) == drafted


@pytest.mark.parametrize("case", [block_case, mtp_case, eagle3_case], ids=["dfly", "mtp", "eagle3"])
def test_a_drafters_context_is_complete_after_probes_while_drafting_is_off(case):
    """Probes between steps without upkeep: the drafter catches up before the probe, is told the probe's one token a
    row, and its later drafts still equal a from-scratch recompute; outputs equal AR's."""
    target, drafter, vocab, recompute = case()
    gate = ScriptedProbeGate([-1, -1, PROBE + 3, PROBE + 3, -1, -1, 3, -1, PROBE + 1, 2, 0])
    engine = gated_engine(target, drafter, gate, max_batch_size=4, num_draft_tokens=3)
    gate.engine = engine
    reqs = requests(vocab, 8, 40, seed=1)
    assert [r.token_ids for r in engine.generate(reqs)] == [r.token_ids for r in reference_generate(target, reqs)]
    assert gate.probes and all(after - before == rows for rows, before, after, _ in gate.probes)
    drafted = [(seq, drafts) for seq, drafts in drafter.proposals if drafts]
    assert drafted
    for seq, drafts in drafted[::2]:
        assert recompute(seq)[:len(drafts)] == drafts


@pytest.mark.parametrize("broken", [False, True], ids=["exact", "negative-control"])
def test_tokens_committed_by_probes_are_distributed_as_the_target(broken, dist_case, monkeypatch):  # noqa: F811
    """At T = 1, every step a probe with sampled drafts (standard speculative sampling): the one token a row it
    commits is the first of the verified ones, distributed as the target's next token, whether the draft was accepted
    or resampled. Negative control: a verifier that accepts every draft makes the probes emit the drafter's tokens,
    and the test sees it."""
    if broken:
        accept_every_draft(monkeypatch)
    tgt, draft, joint = dist_case
    n = 4000
    gate = ScriptedProbeGate([PROBE + 3])
    engine = SpecEngine(tgt, DraftLMDrafter(draft, stop_below=None),
                        EngineConfig(max_batch_size=n, num_draft_tokens=3, spec_gate=True))
    engine.gate = gate
    gate.engine = engine
    out = engine.generate([Request(PROMPT, max_new_tokens=3, sampling=SamplingParams(temperature=1.0, seed=i),
                                   stop_ids=()) for i in range(n)])
    assert len(gate.probes) >= 2 and engine.metrics.skipped_steps == 0
    y = torch.tensor([r.token_ids for r in out])  # [N, 3]
    if broken:
        assert_bias_detected(y, joint)
    else:
        assert_target_distributed(y, joint, "probes")


def test_while_drafting_is_off_joining_requests_cost_a_block_drafter_nothing():
    """A request's prompt taps wait with the commits (a row that leaves drops its waiting entries): an engine whose
    gate never drafts calls no drafter model at admission either; outputs stay AR's."""
    target, drafter, vocab, _ = block_case()
    calls = []
    real = drafter.model.append_context
    drafter._eager_append = lambda *a, **k: calls.append("prefill") or real(*a, **k)
    drafter.model.append_context = lambda *a, **k: calls.append("append") or real(*a, **k)
    engine = gated_engine(target, drafter, ScriptedDepthGate([0]), max_batch_size=2, num_draft_tokens=3)
    reqs = requests(vocab, 5, 12, seed=4)
    assert [r.token_ids for r in engine.generate(reqs)] == [r.token_ids for r in reference_generate(target, reqs)]
    assert calls == []


def test_waiting_prompt_entries_bound_the_joined_width():
    import torch

    from angelspec.decoding.drafters.base import PendingCommits

    p = PendingCommits()
    x = torch.arange(2 * 3, dtype=torch.float32).view(2, 3, 1)
    p.add([x], torch.tensor([2, 1]), [2, 1])  # a commit of width 3
    p.drop_rows([1])  # row 1's request left ...
    prompt = torch.full((2, 10, 1), -1.0)
    p.add([prompt], torch.tensor([0, 4]), [0, 4])  # ... and a prompt of 4 (padded to 10) joined it
    p.add([x + 100], torch.tensor([1, 1]), [1, 1])
    (joined,), count = p.take()
    assert count.tolist() == [3, 5]
    assert joined.shape[1] == 5  # the longest row's entries, not the widths added (3 + 10 + 3)
    assert joined[0, :3, 0].tolist() == [0.0, 1.0, 100.0] and joined[1, :5, 0].tolist() == [-1.0] * 4 + [103.0]


def test_the_gate_lives_with_its_policy_and_keeps_what_it_measured_per_cache_size():
    """One gate per `auto` policy and K (a server's engines share it); its measurements are kept per cache size, since
    a step costs what the whole cache costs: an engine of the same size starts from them, one of another size does
    not (but for a full cache: `test_a_new_cache_size_starts_from_another_full_caches_measurements`)."""
    policy = AutoDepth(cost=cpu_like)
    gate = policy.make_gate(K)
    assert policy.make_gate(K) is gate and policy.make_gate(K + 1) is not gate
    gate.begin(8)
    m = Machine(cpu_like, plain_cost, accept=3)
    for _ in range(600):  # (drafting wins by ~17%: on at a probe once its estimate clears the 10% hysteresis; probes
        # cost 4 plain steps more here, so they come every few hundred steps: `probe_budget`)
        m.step(gate, 8)
    settled = gate.summary()
    assert settled["rows 5-8"]["drafting"]
    gate.begin(32)  # another engine size: nothing measured for it
    assert "rows 5-8" not in gate.summary() and gate.choose_depth(8, K) == K  # warming up again, all K
    gate.begin(8)  # the first size again: it goes on from what it settled
    assert gate.summary()["rows 5-8"] == settled["rows 5-8"]


@pytest.mark.parametrize("accept", [0, K])
def test_a_new_cache_size_starts_from_another_full_caches_measurements(accept):
    """An engine of a size the gate has not seen, with every row active, starts from the nearest full cache's shares
    of the cost table, state and probe gap: after its own drafted warm-up (the steps that compile the drafter's graphs
    for the batch, in a benchmark's untimed warm-up run) it runs the settled state at once, with no plain warm-up and
    no probes at short gaps. Buckets of a cache that is not full do not borrow across sizes."""
    gate = AutoDepth(cost=cpu_like).make_gate(K)
    gate.begin(8)
    m = Machine(cpu_like, plain_cost, accept=accept)
    for _ in range(300):
        m.step(gate, 8)
    settled = gate.summary()["rows 5-8"]
    assert settled["drafting"] == (accept == K)
    gate.begin(16)
    first = [m.step(gate, 16) for _ in range(40)]
    assert first[0] == K and first[1] > 0 and gate.summary()["rows 9-16"]["drafting"] == settled["drafting"]
    if settled["drafting"]:
        assert first[2:].count(0) <= 2
    else:
        assert first[2:].count(0) == 38 and gate.summary()["rows 9-16"]["probe_gap"] == settled["probe_gap"]
    gate.begin(32)
    assert gate.choose_depth(8, K) == K  # 8 active rows of 32: nothing borrowed from another size, a warm-up


@pytest.mark.parametrize(("look_tokens", "look_cost"), [(1.8, 1.1), (1.0, 1.05)])
def test_a_lookup_gate_runs_lookup_steps_with_their_measured_costs_while_the_model_loses(look_tokens, look_cost):
    """A drafter that can draft by lookup alone: where the model's steps lose (no acceptance), the steps after the
    plain warm-up are lookup steps, whatever they commit (the drafter verifies a match only where its measured
    acceptance pays, `test_hybrid.py`, so where nothing pays a lookup step is a plain step), with the cost of
    verifying m = 0..K drafts against none: the table's ratios until a lookup step verified some, then what those
    steps took. The model is probed rarely, and lookup steps never move its acceptance
    estimate."""
    gate = ServingGate(K, cost=cpu_like, lookup=True)
    kinds, looked = [], 0
    for i in range(300):
        n = gate.choose_depth(1, K)
        kind = "lookup" if gate.lookup_only else "model" if n else "plain"
        kinds.append(kind)
        if kind == "lookup":
            assert n == K and len(gate.lookup_costs) == K + 1 and gate.lookup_costs[0] == 1.0
            assert list(gate.lookup_costs) == sorted(gate.lookup_costs)
            if not looked:  # the table's ratios
                assert gate.lookup_costs == pytest.approx([cpu_like(1, 1 + m) / cpu_like(1, 1) for m in range(K + 1)])
            else:  # every lookup step verified K drafts and took look_cost plain steps
                assert gate.lookup_costs[K] == pytest.approx(look_cost)
            looked += 1
            seconds, accepted = plain_cost(1) * look_cost, [round(2 * (look_tokens - 1)) if i % 2 else 0]
        elif kind == "model":
            assert gate.lookup_costs == ()
            seconds, accepted = cpu_like(1, n + 1), [0]
        else:
            seconds, accepted = plain_cost(1), []
        gate.observe_step(1, n, seconds, accepted, [n])
    settled = kinds[150:]
    assert settled.count("lookup") >= 145 and "plain" not in settled, settled
    assert gate.survival()[0] < 0.2  # only the model's zero acceptance counted
    assert ServingGate(K, lookup=True).lookup_costs == ()


def test_a_lookup_lane_with_nothing_measured_starts_from_its_neighbours_lookup_rates():
    """Rows leave a lookup engine (`lookup_rows` = 4) and the batch drains into buckets with nothing measured: each
    starts from the nearest bucket's measurements, lookup steps included, so it runs lookup steps at once (no
    warm-up of its own at the end of a run)."""
    gate = ServingGate(K, cost=cpu_like, lookup=True, lookup_rows=4)
    gate.begin(4)
    for _ in range(40):
        n = gate.choose_depth(4, K)
        seconds = plain_cost(4) * (1.2 if gate.lookup_only else 1.0) if not n or gate.lookup_only \
            else cpu_like(4, 4 * (n + 1))
        gate.observe_step(4, n, seconds, [1 if gate.lookup_only else 0] * 4, [n] * 4)
    assert gate.lookup_only
    for b in (2, 1):
        n = gate.choose_depth(b, K)
        assert gate.lookup_only and n == K
        assert gate.summary()[f"rows {b}-{b}"]["lookup_rate"] > 0


@pytest.mark.parametrize(("rows", "lookup"), [(4, False), (16, False), (2, True), (1, True)])
def test_lookup_steps_run_only_in_engines_of_at_most_two_rows_by_default(rows, lookup):
    """Rows that fall out of step cost every later step (longer attention, split prefills), which a lookup step's own
    timing cannot show, and a row that matches nothing waits for the others' verifies: in an engine of more than two
    cache rows the gate chooses between plain and model steps only."""
    gate = ServingGate(K, cost=cpu_like, lookup=True)
    gate.begin(rows)
    seen = set()
    for _ in range(50):
        n = gate.choose_depth(rows, K)
        seen.add(gate.lookup_only)
        seconds = plain_cost(rows) if not n or gate.lookup_only else cpu_like(rows, rows * (n + 1))
        gate.observe_step(rows, n, seconds, [1 if gate.lookup_only else 0] * rows if n else [], [n] * rows)
    assert (True in seen) == lookup


def test_lookup_steps_run_only_while_every_row_is_greedy():
    """Sampled rows keep few lookup drafts and a sampled verify costs more than the table's greedy one: while the
    engine has a sampled row (`greedy` False, set by the engine each step) the gate runs plain and model steps only,
    and lookup steps again once every row is greedy."""
    gate = ServingGate(K, cost=cpu_like, lookup=True)
    gate.begin(1)
    for greedy in (False, True):
        gate.greedy, seen = greedy, set()
        for _ in range(30):
            n = gate.choose_depth(1, K)
            seen.add(gate.lookup_only)
            gate.observe_step(1, n, plain_cost(1) if not n or gate.lookup_only else cpu_like(1, n + 1),
                              [1 if gate.lookup_only else 0] if n else [], [n])
        assert (True in seen) == greedy


def test_lookup_costs_follow_what_lookup_steps_took_by_the_drafts_they_verified():
    """`ServingGate.lookup_cost_fit`: a lookup step verifying nothing sets the base (AR's step), those verifying x
    drafts in all a line fixed + slope * x (least squares), and `lookup_costs` hands the drafter their ratio to the
    base for m = 0..B * K drafts; a step far slower than the line (a graph compiled mid-run) is left out."""
    gate = ServingGate(K, cost=cpu_like, lookup=True)
    gate.begin(2)
    unit = cpu_like(2, 2)  # the table's step verifying none: the gate's unit of seconds
    gate.lookup_only = True
    for i, x in enumerate([0, 2, 7, 14, 0, 5, 9, 1] * 8):
        gate.observe_step(2, K, unit * (0.5 if x == 0 else 0.75 + 0.02 * x), [0, 0], [x // 2, x - x // 2])
        if i == 20:
            gate.observe_step(2, K, unit * 100.0, [0, 0], [3, 3])
    base, fixed, slope = gate.lookup_cost_fit(2)
    assert base == pytest.approx(0.5) and fixed == pytest.approx(0.75, rel=0.02)
    assert slope == pytest.approx(0.02, rel=0.05)
    for _ in range(gate.warmup):  # the plain warm-up, then the steps are lookup steps (the model has no drafts yet)
        gate._lanes[2, 1].plain_n += 1
    gate._lanes[2, 1].spec_n = gate.warmup
    assert gate._base_step(gate._lanes[2, 1], 2) == K
    assert len(gate.lookup_costs) == 2 * K + 1 and gate.lookup_costs[0] == 1.0
    assert gate.lookup_costs[1] == pytest.approx((fixed + slope) / base)
    assert gate.lookup_costs[2 * K] == pytest.approx((fixed + slope * 2 * K) / base)
