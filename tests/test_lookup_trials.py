"""Lookup steps in a batch, decided end to end (`decoding/policies/trials.py`): a cache size first times an epoch of
plain decoding and then one with lookup steps, runs the one that commits more tokens per wall second (by a margin;
lookup steps only once two trials in a row won, each in a run of its own),
and tries the other again after a gap that grows while the state holds (the longest at once after lookup steps lost);
plain epochs count only while the rows are in step, and a run's last epoch (its drain) when it has a quarter of the
steps. In the serving gate the trials decide above `lookup_rows` (and measure nothing while a row samples); at or
below it lookup steps need none. An engine of four rows runs lookup steps once they won, with AR's outputs."""

from __future__ import annotations

import itertools

import pytest
from test_serving_gate import LinearCost
from test_spec_gate import block_case, requests

from angelspec.decoding.drafters import NGramDrafter
from angelspec.decoding.drafters.hybrid import HybridDrafter
from angelspec.decoding.engine import EngineConfig, SpecEngine, reference_generate
from angelspec.decoding.policies.gate import AutoDepth, ServingGate
from angelspec.decoding.policies.trials import LookupTrials

pytestmark = pytest.mark.usefixtures("one_thread")

ROWS, EPOCH = 4, 5


class Clock:
    """Fake seconds: a step of an epoch with lookup steps takes `on`, one without `off` (`run` adds them)."""

    def __init__(self, on: float, off: float) -> None:
        self.now, self.on, self.off = 0.0, on, off

    def __call__(self) -> float:
        return self.now


def run(trials: LookupTrials, clock: Clock, steps: int, tokens_on: list[int] | None, active: int = ROWS) -> list[bool]:
    """`steps` steps of `active` rows: each asks `tick`, takes its arm's seconds and commits `tokens_on` per row in a
    lookup epoch (one each otherwise) -> the arm of each step."""
    arms = []
    for _ in range(steps):
        arm = trials.tick()
        arms.append(arm)
        clock.now += clock.on if arm else clock.off
        trials.observe(tokens_on if arm else None, active)
    return arms


def new(clock: Clock, **kw) -> LookupTrials:
    trials = LookupTrials(epoch_steps=EPOCH, clock=clock, **kw)
    trials.begin(ROWS)
    return trials


def test_a_new_size_times_plain_decoding_then_trials_and_keeps_lookup_steps_that_win_twice():
    """One trial that wins is not enough (a 2-core CPU's speed drifts between epochs by more than the margin): the
    rest of its run is plain (out of step, so not measured); the next run measures plain decoding again, then a
    second trial, and lookup steps run once that one wins too."""
    clock = Clock(on=1.0, off=1.0)  # a lookup step costs a plain one and commits 1.5x its tokens
    trials = new(clock)
    arms = run(trials, clock, 4 * EPOCH, [2, 1, 2, 1])
    assert arms == [False] * EPOCH + [True] * EPOCH + [False] * 2 * EPOCH
    s = trials.summary()["rows 4"]
    assert not s["lookup"] and s["rate_off"] == 4.0 and s["rate_on"] == 6.0 and s["epochs_off"] == 1
    trials.begin(ROWS)
    arms = run(trials, clock, 5 * EPOCH, [2, 1, 2, 1])
    assert arms == [False] * EPOCH + [True] * 4 * EPOCH
    s = trials.summary()["rows 4"]
    assert s["lookup"] and s["epochs_off"] == 2
    once = new(Clock(on=1.0, off=1.0), confirm=1)
    assert run(once, once.clock, 3 * EPOCH, [2, 1, 2, 1]) == [False] * EPOCH + [True] * 2 * EPOCH


def test_a_trial_that_loses_after_one_that_won_starts_the_count_again():
    clock = Clock(on=1.0, off=1.0)
    trials = new(clock, max_gap=2)
    run(trials, clock, 2 * EPOCH, [2, 1, 2, 1])  # won (1.5x)
    trials.begin(ROWS)
    clock.on = 3.0  # lost (0.5x)
    run(trials, clock, 2 * EPOCH, [2, 1, 2, 1])
    trials.begin(ROWS)  # (the trial's epoch ends with its run)
    s = trials.summary()["rows 4"]
    assert not s["lookup"] and s["gap"] == 2
    clock.on = 1.0
    for _ in range(2):  # after the gap: two more wins needed, each in a run of its own
        trials.begin(ROWS)
        assert not trials.summary()["rows 4"]["lookup"]
        run(trials, clock, 3 * EPOCH, [3, 3, 3, 3])
    assert trials.summary()["rows 4"]["lookup"]


@pytest.mark.parametrize("seconds_on", [2.0, 1.0], ids=["outright", "inside-margin"])
def test_lookup_steps_that_lose_stop_and_the_rest_of_the_run_out_of_step_measures_nothing(seconds_on):
    """The trial put the rows out of step: the plain epochs after it are not what plain decoding delivers, so they
    neither count nor bring the next trial nearer; the next run measures plain decoding again first. The next trial
    waits `max_gap` measured epochs (a lost trial costs the rest of its run), whether it lost outright or inside the
    margin."""
    clock = Clock(on=seconds_on, off=1.0)  # 1.5x the tokens at half the speed (0.75x) or at the same (1.5x)
    gap = 3
    trials = new(clock, margin=0.6, max_gap=gap, confirm=1)
    arms = run(trials, clock, 6 * EPOCH, [2, 1, 2, 1])
    assert arms == [False] * EPOCH + [True] * EPOCH + [False] * 4 * EPOCH
    s = trials.summary()["rows 4"]
    assert not s["lookup"] and s["epochs_off"] == 1 and s["gap"] == gap
    trials.begin(ROWS)  # in step again
    arms = run(trials, clock, (gap + 2) * EPOCH, [2, 1, 2, 1])
    assert arms == [False] * gap * EPOCH + [True] * EPOCH + [False] * EPOCH  # `gap` measured, then the trial


@pytest.mark.parametrize(("margin", "won"), [(0.1, True), (0.3, False)])
def test_lookup_steps_must_win_by_the_margin(margin, won):
    clock = Clock(on=1.0, off=1.0)
    trials = new(clock, margin=margin, confirm=1)
    run(trials, clock, 3 * EPOCH, [2, 1, 1, 1])  # 1.25x the tokens per second
    assert trials.summary()["rows 4"]["lookup"] is won


def test_while_lookup_steps_run_a_plain_trial_waits_for_rows_in_step():
    """Once on, the plain trial is due after `gap` epochs, but plain epochs can only be measured in step: it runs as
    the next run's first epoch, and lookup steps that still win go on with twice the gap."""
    clock = Clock(on=1.0, off=1.0)
    trials = new(clock, confirm=1)
    arms = run(trials, clock, 5 * EPOCH, [3, 1, 1, 1])  # 1.5x: on after the first trial
    assert arms == [False] * EPOCH + [True] * 4 * EPOCH
    trials.begin(ROWS)
    arms = run(trials, clock, 3 * EPOCH, [3, 1, 1, 1])
    assert arms == [False] * EPOCH + [True] * 2 * EPOCH
    s = trials.summary()["rows 4"]
    assert s["lookup"] and s["epochs_off"] == 2 and s["gap"] == 2


def test_a_runs_last_epoch_counts_with_its_drain_when_it_has_a_quarter_of_the_steps():
    """Rows that lookup steps put out of step finish one at a time at the end of a run, and the batch drains with rows
    idle: the run's last epoch holds that cost, and it counts once it has a quarter of an epoch's steps."""
    clock = Clock(on=1.0, off=1.0)
    trials = LookupTrials(epoch_steps=8, clock=clock)
    trials.begin(ROWS)
    run(trials, clock, 8, None)
    trials.begin(ROWS)  # the next run: the last one's epoch ends with its last step
    assert trials.summary()["rows 4"]["epochs_off"] == 1
    run(trials, clock, 1, [2, 1, 2, 1])  # the trial: one step, then the run ends
    trials.begin(ROWS)
    assert trials.summary()["rows 4"]["epochs_on"] == 0  # too short to say anything
    run(trials, clock, 2, [2, 1, 2, 1])  # 1.5x the tokens while every row is busy ...
    run(trials, clock, 2, [1], active=1)  # ... and then three rows idle
    trials.begin(ROWS)
    s = trials.summary()["rows 4"]
    assert s["epochs_on"] == 1 and s["rate_on"] == 3.5 and not s["lookup"]
    trials.begin(8)
    assert trials.tick() is False  # another size starts from plain decoding
    assert trials.summary()["rows 4"]["gap"] == 16  # (the trial lost: `max_gap`)


def test_a_larger_batch_than_one_where_lookup_steps_lost_waits_before_its_first_trial():
    """A larger batch verifies at a higher cost and pays more for rows out of step: after lookup steps lost at 4 rows,
    8 rows measure `max_gap` plain epochs before their trial; 2 rows (smaller) and a size beside a win try at once."""
    clock = Clock(on=2.0, off=1.0)  # lookup steps lose (0.75x)
    trials = new(clock, max_gap=3)
    run(trials, clock, 2 * EPOCH, [2, 1, 2, 1])
    assert not trials.summary()["rows 4"]["lookup"]
    for rows, first_trial in ((8, 3), (2, 1)):
        trials.begin(rows)
        arms = run(trials, clock, (first_trial + 1) * EPOCH, [2, 1, 2, 1])
        assert arms == [False] * first_trial * EPOCH + [True] * EPOCH, rows
    won = new(Clock(on=1.0, off=1.0))
    run(won, won.clock, 2 * EPOCH, [2, 1, 2, 1])  # (a win not yet confirmed: not a loss)
    won.begin(8)
    assert run(won, won.clock, 2 * EPOCH, [2, 1, 2, 1]) == [False] * EPOCH + [True] * EPOCH


@pytest.mark.parametrize("bad", [{"epoch_steps": 0}, {"max_gap": 0}, {"margin": -0.1}, {"decay": 1.0},
                                 {"confirm": 0}])
def test_bad_settings_are_refused(bad):
    with pytest.raises(ValueError, match="LookupTrials needs"):
        LookupTrials(**bad)


def gate_steps(gate: ServingGate, steps: int, rows: int) -> list[bool]:
    """`steps` steps of `rows` active rows through the gate with every lookup step committing 3 / 1 / 1 / ... tokens
    -> whether each was a lookup step."""
    kinds = []
    for _ in range(steps):
        depth = gate.choose_depth(rows, 3)
        kinds.append(gate.lookup_only)
        accepted = [2] + [0] * (rows - 1) if gate.lookup_only else [0] * rows if depth else []
        gate.observe_step(rows, depth, 0.01, accepted, [depth] * rows if depth else [])
    return kinds


def test_the_serving_gate_asks_the_trials_only_above_lookup_rows():
    clock = Clock(on=0.01, off=0.01)
    gate = ServingGate(3, lookup=True, trials=LookupTrials(epoch_steps=EPOCH, clock=clock, confirm=1))
    gate.begin(2)
    assert gate.lookup_engine and any(gate_steps(gate, 20, 2))  # two rows: lookup steps without trials
    assert "lookup_trials" not in gate.summary()
    gate.begin(ROWS)
    kinds = []
    for _ in range(8 * EPOCH):
        kinds += gate_steps(gate, 1, ROWS)
        clock.now += 0.01
    assert gate.lookup_engine and gate.summary()["lookup_trials"]["lookup"]
    assert any(kinds) and kinds.index(True) >= EPOCH  # none in the plain epoch first
    sampled = ServingGate(3, lookup=True, trials=LookupTrials(epoch_steps=EPOCH, clock=clock))
    sampled.begin(ROWS)
    sampled.greedy = False  # a sampled row: no lookup steps, and no epoch is measured
    assert not any(gate_steps(sampled, 4 * EPOCH, ROWS)) and sampled.summary()["lookup_trials"] == {}
    off = ServingGate(3, lookup=True, trials=None)
    off.begin(ROWS)
    assert not off.lookup_engine and not any(gate_steps(off, 40, ROWS))


def test_an_engine_of_four_rows_runs_lookup_steps_once_they_win_with_ars_outputs():
    """A DFly + n-gram engine of four rows under `auto`: after the plain epoch and a trial that commits more per second
    (the fake clock times every step alike), its steps include lookup steps, and every output equals AR's."""
    target, drafter, vocab, _ = block_case()
    hybrid = HybridDrafter(drafter, NGramDrafter(max_ngram=2), min_match=2)
    policy = AutoDepth(cost=LinearCost())
    engine = SpecEngine(target, hybrid, EngineConfig(max_batch_size=ROWS, num_draft_tokens=3), depth_policy=policy)
    seconds = itertools.count()  # every step takes a second
    engine.gate.trials = trials = LookupTrials(epoch_steps=EPOCH, margin=0.0, confirm=1,
                                               clock=lambda: float(next(seconds)))
    reqs = requests(vocab, 12, 40, seed=2)
    got = engine.generate(reqs)
    assert [r.token_ids for r in got] == [r.token_ids for r in reference_generate(target, reqs)]
    assert trials.summary()["rows 4"]["epochs_on"] >= 1 and hybrid.lookup_rounds > 0
