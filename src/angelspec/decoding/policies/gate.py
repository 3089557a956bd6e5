"""The speculation gate: before drafting, decide whether a speculative step is expected to commit tokens faster
than a plain step at the current batch size, and skip drafting when it is not.

Why: a depth policy (D-cut, Algorithm 1) chooses how many drafts to verify only after the drafter has proposed,
so it can shrink the verify forward but never the drafting, and its smallest budget still verifies drafts. At a
large batch on a CPU the verify forward is compute-bound (every verified position costs), and at any batch a
drafter that is weak on the current prompts (low acceptance) costs more than it returns. The gate measures both
alternatives online and runs the better one; a skipped step is a plain decode step of the target that still
hands the drafter its taps (`Drafter.on_commit` with no drafts accepted), so the drafter's context stays
complete and speculation can resume at any step. (The serving gate below may instead let a long stretch of plain
steps skip that upkeep, and most of them make no taps at all: `ServingGate.upkeep`, `ServingGate.keep_taps`.)

Rule, per batch-size bucket (1, 2, 3-4, 5-8, ...: the cost of a step grows smoothly with the batch):
    rate_spec = EMA over drafted steps of (committed tokens per active row) / (step seconds)
    rate_plain = EMA over skipped steps of 1 / (step seconds)
    draft  iff  fewer than `warmup` drafted steps were seen in the bucket, or no skipped step yet (one is run
                to measure it), or rate_spec > (1 + margin) * rate_plain and fewer than `probe_every` steps were
                drafted in a row, or the bucket's probe gap of steps was skipped in a row. Probes both ways keep
                both rates current: acceptance changes with the prompts (so the EMAs also weigh the newest step by
                half), and a plain step's cost changes with the machine's load (one slow plain step early in a run,
                e.g. the first at a shape, must not decide the rest of it; what happened without: docs/design.md
                §12).
    outliers    a step more than `outlier` (10) times slower than its kind's EMA of step seconds is left out of the
                EMAs (up to three in a row), and one more than 10 times faster replaces them: a compiled engine
                recompiles a graph mid-run now and then (a new shape), and such a step takes seconds where its kind
                takes milliseconds; taken as a measurement, one of them would make the gate believe one kind of
                step ~1000x slower than it is and keep the other for the rest of the run (docs/design.md §12). A
                bucket measures plain steps until one of them counts.
    probe gap   `probe_every`; with `max_probe_every` set (off by default), doubled up to it by each probe after
                which speculation still runs below `backoff_below` (0.75) of the plain rate, back to `probe_every`
                when speculation wins. Meant for where drafting never pays (a batch of 16 on two cores: a fixed gap of
                8 makes every ninth step a slow drafted one), but off by default: a probe also pays the drafter's
                catch-up on every skipped step, which grows with the gap, so a probe's rate understates speculation.
                At batch 1 (shipped DFly, K = 7, eager, 6 prompts a domain) backoff to 64 took maths from 1.26x to
                1.00x of AR and code from 1.08x to 0.91x, while at C = 16 its gain was within the run-to-run noise.

Exactness: the decision reads only what earlier steps measured (timings and committed counts), never this
step's drafts or randomness, so every step is still an exact sampler of its tokens (T = 0: identical to AR; T > 0:
exact in distribution, docs/design.md trap 1). Because it reads wall-clock timings, which steps draft can differ
between runs: sampled outputs are then not bit-reproducible across runs (they are exact in distribution); leave
the gate off when a seeded run must repeat token for token.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from angelspec.decoding.policies.base import FixedDepth
from angelspec.decoding.policies.trials import LookupTrials

# drafted steps of a probe while drafting is off, and of the confirmation of one that won (the first pays the drafter's
# catch-up, the second is timed)
_PROBE_STEPS = 2


# the share of a request's time per output token its lookup steps may spend waiting on other rows' drafts
# (`ServingGate.latency_slack`, `--policy auto:slack=S`)
DEFAULT_LATENCY_SLACK = 0.05


def batch_bucket(num_active: int) -> int:
    """0 for 1 row, 1 for 2, 2 for 3-4, 3 for 5-8, ...: ceil(log2(num_active))."""
    if num_active < 1:
        raise ValueError(f"a step needs at least one active row, got {num_active}")
    return (num_active - 1).bit_length()


@dataclass
class _Kind:
    """The measurements of one kind of step (drafted or skipped) in one bucket."""

    rate: float = 0.0  # EMA of committed tokens per row per second
    seconds: float = 0.0  # EMA of the step's seconds (what outliers are judged against)
    samples: int = 0  # steps measured into the EMAs
    outliers: int = 0  # slow outliers in a row, left out of the EMAs


@dataclass
class _Bucket:
    spec: _Kind = field(default_factory=_Kind)  # drafted steps
    plain: _Kind = field(default_factory=_Kind)  # skipped steps
    drafted: int = 0
    skipped: int = 0
    skip_run: int = 0  # skipped steps since the last drafted one
    draft_run: int = 0  # drafted steps since the last skipped one
    gap: int = 0  # skipped steps in a row before a probe (set to probe_every on first use)
    probing: bool = False  # the last decision was a probe


@dataclass
class SpecGate:
    """Online draft/skip decision (module docstring). warmup: drafted steps per bucket before it may skip;
    probe_every: a drafted probe after this many skipped steps in a row; max_probe_every (None: no backoff, the
    default): the gap doubles up to it after each probe that loses by more than backoff_below; margin: required
    relative advantage of speculation; decay: EMA weight of the history (0 = only the newest step)."""

    warmup: int = 4
    probe_every: int = 8
    max_probe_every: int | None = None  # None: probe_every (no backoff, the default: see the module docstring)
    margin: float = 0.0
    decay: float = 0.5
    outlier: float = 10.0  # a step this many times slower than its kind's EMA is not a measurement of it
    backoff_below: float = 0.75  # a probe doubles the gap only if speculation runs below this share of plain steps
    _buckets: dict[int, _Bucket] = field(default_factory=dict, init=False, repr=False)
    lookup_only: ClassVar[bool] = False  # never asks for lookup steps (`ServingGate.lookup_only`)
    lookup_engine: ClassVar[bool] = False  # (`ServingGate.lookup_engine`)
    measure_only: ClassVar[bool] = False  # its probes commit what they accept (`ServingGate.measure_only`)
    lookup_costs: ClassVar[tuple[float, ...]] = ()
    upkeep: ClassVar[bool] = True  # a skipped step keeps the drafter's context (`ServingGate.upkeep`)
    keep_taps: ClassVar[bool] = True  # (`ServingGate.keep_taps`)

    def __post_init__(self) -> None:
        if self.warmup < 1 or self.probe_every < 1:
            raise ValueError(f"SpecGate needs warmup >= 1 and probe_every >= 1, got {self.warmup}, {self.probe_every}")
        if self.max_probe_every is not None and self.max_probe_every < self.probe_every:
            raise ValueError(f"SpecGate.max_probe_every ({self.max_probe_every}) must be >= probe_every "
                             f"({self.probe_every})")
        if not 0.0 <= self.decay < 1.0:
            raise ValueError(f"SpecGate.decay must lie in [0, 1), got {self.decay}")
        if self.margin < 0.0:
            raise ValueError(f"SpecGate.margin must be >= 0, got {self.margin}")
        if self.outlier <= 1.0:
            raise ValueError(f"SpecGate.outlier must be > 1, got {self.outlier}")

    def reset(self) -> None:
        """Forget every measurement (a new machine load, another drafter)."""
        self._buckets.clear()

    def should_draft(self, num_active: int) -> bool:
        b = self._bucket(num_active)
        b.probing = False
        if b.drafted < self.warmup:
            return True
        if b.plain.samples == 0:
            return False  # measure a plain step (again, if the first one was an outlier)
        if self._spec_wins(b):
            return b.draft_run < self.probe_every  # else a plain probe (module docstring)
        b.probing = b.skip_run >= b.gap
        return b.probing

    def _bucket(self, num_active: int) -> _Bucket:
        b = self._buckets.setdefault(batch_bucket(num_active), _Bucket())
        b.gap = b.gap or self.probe_every
        return b

    def _spec_wins(self, b: _Bucket) -> bool:
        return b.spec.rate > (1.0 + self.margin) * b.plain.rate

    def _measure(self, k: _Kind, other: _Kind, rate: float, seconds: float) -> None:
        """Fold one step into its kind's EMAs, robust to one-off slow steps: a step more than `outlier` times slower
        than the EMA (a torch.compile recompilation mid-run takes seconds against milliseconds; for a kind's first
        step, than the other kind's EMA) is left out, up to three in a row (then the kind really got slower: start
        again from it); and a step more than `outlier` times faster than the EMA replaces it (the earlier samples were
        such outliers, e.g. a first drafted step that compiled)."""
        ref = k.seconds if k.samples else other.seconds if other.samples else 0.0
        if ref and seconds > self.outlier * ref and k.outliers < 3:
            k.outliers += 1
            return
        fresh = k.samples == 0 or k.outliers >= 3 or seconds * self.outlier < k.seconds
        k.rate = rate if fresh else self.decay * k.rate + (1 - self.decay) * rate
        k.seconds = seconds if fresh else self.decay * k.seconds + (1 - self.decay) * seconds
        k.samples += 1
        k.outliers = 0

    def observe(self, num_active: int, drafted: bool, tokens_per_row: float, seconds: float) -> None:
        """Record one step: whether it drafted, the mean committed tokens per active row, and its seconds."""
        if seconds <= 0.0:
            return
        b = self._bucket(num_active)
        rate = tokens_per_row / seconds
        self._measure(*((b.spec, b.plain) if drafted else (b.plain, b.spec)), rate, seconds)
        if drafted:
            b.drafted += 1
            b.draft_run += 1
            b.skip_run = 0
            if b.probing:  # a clearly lost probe waits twice as long for the next; a won one resets the wait
                if self._spec_wins(b):
                    b.gap = self.probe_every
                elif b.spec.rate < self.backoff_below * b.plain.rate:
                    b.gap = min(2 * b.gap, self.max_probe_every or self.probe_every)
            elif self._spec_wins(b):
                b.gap = self.probe_every
            b.probing = False
        else:
            b.skipped += 1
            b.skip_run += 1
            b.draft_run = 0

    def summary(self) -> dict[str, dict[str, float]]:
        """Per bucket (label "rows a-b"): drafted and skipped step counts and the two rates (tokens/row/s)."""
        out = {}
        for k in sorted(self._buckets):
            b = self._buckets[k]
            lo, hi = (1, 1) if k == 0 else (2 ** (k - 1) + 1, 2 ** k)
            out[f"rows {lo}-{hi}"] = {"drafted": b.drafted, "skipped": b.skipped, "probe_gap": b.gap,
                                      "spec_rate": round(b.spec.rate, 2), "plain_rate": round(b.plain.rate, 2)}
        return out

    def choose_depth(self, num_active: int, num_draft_tokens: int) -> int:
        """The engine's per-step question: verify `num_draft_tokens` drafts (draft) or 0 (a plain step)."""
        return num_draft_tokens if self.should_draft(num_active) else 0

    def observe_step(self, num_active: int, depth: int, seconds: float, accepted: Sequence[int],
                     depths: Sequence[int]) -> None:
        """The engine's per-step report (the same for every gate): the depth it was given (0: skipped), the step's
        host seconds, and per active row the drafts accepted and verified."""
        self.observe(num_active, depth > 0, sum(accepted) / len(accepted) + 1.0 if accepted else 1.0, seconds)


# --------------------------------------------------------------------------------------------------------------
# The serving gate (policy `auto`)
# --------------------------------------------------------------------------------------------------------------
@dataclass
class _Lane:
    """What `ServingGate` measured in one batch-size bucket."""

    plain_s: float = 0.0  # EMA of a plain step's seconds / the cost table's for verifying 0 drafts (seconds without)
    plain_n: int = 0
    plain_out: int = 0  # slow outliers in a row, left out
    scale: float = 0.0  # EMA of a timed drafted step's seconds / the cost table's seconds for it (1 s without one)
    spec_n: int = 0
    spec_out: int = 0
    on: bool = False  # drafting (the state the hysteresis holds); off until drafted steps showed it wins
    run: int = 0  # steps since the last switch or probe
    gap: int = 0  # steps of the current state before the next probe of the other one
    probe: int = 0  # drafted probe steps still to run while off
    confirm: bool = False  # the last probe won: the two running now confirm it before drafting turns on
    deep: int = 0  # drafted steps since one verified past n*
    catch: float = 0.0  # EMA of a drafted step right after a plain one (with the catch-up), in `scale`'s units
    held_s: float = 0.0  # EMA of the engine's catch-up seconds per step without upkeep (`observe_catch_up`), per unit
    real_s: float = 0.0  # EMA of a drafted step's seconds per committed token per row, every cost in, `plain_s`'s units
    real_n: int = 0
    real_out: int = 0
    look_s: float = 0.0  # EMA of a lookup step's seconds, in `plain_s`'s units
    look_tok: float = 0.0  # decayed mean of a lookup step's committed tokens per row (over ~`memory` steps)
    look_seen: int = 0  # lookup steps whose tokens `look_tok` averaged
    look_n: int = 0
    look_out: int = 0
    # What a lookup step costs by the drafts it verifies in all, x (`ServingGate.lookup_cost_fit`), in `plain_s`'s
    # units: look0 an EMA of those verifying none (AR's step); decayed sums over those verifying some, of weight w, x,
    # x^2, seconds y and x * y, for the line y = fixed + slope * x
    look0: float = 0.0
    fit: list[float] = field(default_factory=lambda: [0.0] * 5)


@dataclass
class ServingGate:
    """Per step: how many drafts every row verifies, 0 for a plain step (`SpecEngine` asks `choose_depth`).

    The rule, per batch-size bucket (`batch_bucket`), host arithmetic only:

        s_k      = share of rows that accepted >= k drafts among those that verified >= k (all buckets: acceptance
                   does not depend on the batch), an exponentially decayed count over the last ~`memory` row-steps
                   (a probe's row-steps weigh 4x: they are all that is seen while drafting is off)
        A(n)     = 1 + s_1 + ... + s_n, expected committed tokens per row when verifying n drafts (Eq. 21)
        T(B, n)  = scale * cost(B, B (n + 1)): the cost table's seconds of a step verifying n drafts per row (D-cut's
                   C(B, rho) with a uniform depth), scaled by what drafted steps of the bucket took against the table
                   (the machine's load now); without a table only n = K, T = the measured seconds
        n*       = argmax_n A(n) / T(B, n): the depth that commits most tokens per second at this load
        drafted  = 1 / (EMA over drafted steps of seconds per committed token per row): what drafting delivered, every
                   cost in (the catch-up after plain steps, the drafting, the wider verify, the commit); before any
                   drafted step, the forecast A(n*) / T(B, n*)
        plain    = 1 / (EMA of a plain step's seconds); with a lookup drafter (`lookup`), a lookup step's tokens per
                   row per second once measured (`_base_step`: the step that runs while the model does not draft; in
                   an engine of more than `lookup_rows` rows only where `trials` found that epochs with lookup steps
                   commit more per wall second than epochs without, `policies/trials.py`)
                   (both measured as shares of the table's cost(B, B) when there is one, so the rows of one bucket
                   share them, and a bucket with nothing measured yet starts from its nearest measured neighbour's
                   shares instead of warming up)
        drafting turns on only once drafted > (1 + hysteresis) * plain, and stays on while drafted >= (1 - hold) *
        plain: noise inside that band never flips it. The band sits mostly above the plain rate: a drafted step's
        timing leaves out what drafting costs the steps around it (rows that commit different counts fall out of step,
        and requests then finish and join one at a time, in more and smaller prefills): lanes that stayed on down to
        0.9x plain ran 0.86-0.87x AR end to end at four rows on a 2-core CPU (`angelspec bench`).

    The forecast ranks the depths; the decision to draft at all reads what drafted steps delivered, since the forecast
    leaves out what differs between a profiled step and a serving one (on a 2-core CPU it was up to 1.4x optimistic, and
    a gate that trusted it drafted where it lost). So verification narrows with load (n* falls as T grows with the
    verified positions) before drafting stops, and the depth is a function of earlier steps only, the same for every
    row: no host sync, no packing, and standard speculative sampling stays exact (trap 1; `AutoDepth.uses_proposal` is
    False).

    Measuring: a bucket starts with drafting off and first runs `warmup` timed drafted steps (probes, so they only
    measure: see below) and `warmup` plain ones; drafting turns on as it would after a probe. A drafted step right after
    a plain one pays the drafter's catch-up over the skipped steps (`PendingCommits`): it counts in the drafted rate (a
    real cost of drafting after plain steps) but not in `scale` (the table's timing of a drafted step, which sizes the
    probes' cost). Probes keep the state that is not running measured: while off, two drafted steps (the second is
    timed) after `gap` plain ones; while on, one plain step after `gap` drafted ones. The gap starts at `probe_every`
    and grows after each probe that leaves the state as it was (doubling while the running state wins by more than
    `confident`, by half otherwise) up to `max_probe_every`: a probe pays the drafter's catch-up over the skipped steps,
    and one that changes nothing is wasted. A switch resets it. While off, the gap is also at least what keeps the
    probes' excess over plain steps within `probe_budget` (1%) of the plain steps between them (at a large batch a
    probe, catch-up included, costs several plain steps), up to `max_budget_gap`, and it is `max_budget_gap` while even
    the forecast loses to plain steps (`_off_gap`: such a probe can only confirm the loss). A probe that shows drafting
    winning is confirmed by two more drafted steps before drafting turns on: two steps' acceptance is a thin sample (a
    lucky pair turned drafting on at four rows on a 2-core CPU, where it then ran at about the plain rate for dozens of
    steps, and with its rows out of step those `angelspec bench` runs ran 0.86-0.87x AR). A drafted probe while off
    (with more than one row active; one row alone has nothing to fall out of step with) measures and commits nothing
    more (`measure_only`): the engine verifies its drafts, reports what each row accepted, and commits one token a row,
    the first of the verified ones (exact at any temperature: it is the target's own token at that position). Committing
    the accepted drafts would put the rows out of step for good, a cost no step's timing shows: every later step attends
    over the longest row, and requests finish and join one at a time, in more and smaller prefills. A step more than
    `outlier` times slower than its kind's EMA (a graph compiled mid-run, the core taken) is left out, up to three in a
    row.

    Upkeep: a plain step while drafting is on (a plain probe) hands the drafter its taps and its round of
    zero drafts, kept for the next drafted round (`PendingCommits`): a little host work per step. While drafting is
    off, `upkeep` is False: the engine runs the step as an AR step, and the next step that drafts first hands the
    drafter the positions it missed, in one commit (`engine.step.Step._resync`). A drafter that drafts well again from
    its newest positions (`Drafter.resume_window`, given to `begin`: 32 for the model drafters,
    `benchmarks/resume_window.py`) needs only their taps: a step without upkeep makes none (`keep_taps` False: AR's
    own decode forward; returning and holding taps cost a compiled plain step 3-6% over AR's at four to sixteen rows
    on a 2-core CPU, `benchmarks/plain_step.py`) unless the next drafted step is at most that window away: the last
    `window` plain steps before a probe hold their taps, and a drafted step the gate did not see coming (drafting
    turning on between probes, a new lane's warm-up) waits for `window` plain steps that hold theirs first. The
    drafter's context then runs on across the gap. Without a window every such step holds its taps. The same holds
    for lookup steps while drafting is off: only the lookup's history takes their tokens, the model catches up on its
    next drafted step; one where some row verifies a match holds the taps its verify forward returns anyway, one where
    no row does (no match, or none that pays) is AR's decode step when `keep_taps` is False.

    The gate lives as long as its policy (`AutoDepth.make_gate`): a server's engines share what it measured.

    Exactness: the depth reads only what earlier steps measured; timings differ between runs, so sampled outputs are
    exact in distribution but not bit-reproducible across runs (T = 0 outputs equal AR's)."""

    num_draft_tokens: int
    cost: Callable[[int, int], float] | None = None  # the step-cost table C(B, N) (budget.CostModel)
    lookup: bool = False  # the drafter can draft by lookup alone (`Drafter.lookup_drafts`): lookup steps are a choice
    # drafts a lookup step verifies at most (None: K); each row verifies its match only as deep as that match length's
    # measured acceptance pays for (`HybridDrafter`), so a cap only bounds what it may try
    lookup_depth: int | None = None
    lookup_rows: int = 2  # lookup steps without trials in engines of at most this many cache rows (`_lookup_here`)
    # a lookup step slows no request by more than this share of its time per output token waiting on the other rows'
    # drafts, as the step costs count it (`DraftState.lookup_slack`, `drafters.hybrid.LatencyBudget`); None: no bound
    latency_slack: float | None = DEFAULT_LATENCY_SLACK
    # above `lookup_rows`: lookup steps where epochs with them commit more per second than epochs without (None: none)
    trials: LookupTrials | None = field(default_factory=LookupTrials)
    warmup: int = 2
    hysteresis: float = 0.1  # drafting turns on above (1 + hysteresis) x the plain rate
    hold: float = 0.05  # ... and stays on down to (1 - hold) x it
    confident: float = 0.25
    probe_every: int = 8
    max_probe_every: int = 128
    max_budget_gap: int = 1024  # the most plain steps between drafted probes that `probe_budget` may ask for
    probe_budget: float = 0.01  # what drafted probes may cost, as a share of the plain steps between them
    decay: float = 0.7  # EMA weight of the history for step seconds
    memory: float = 16.0  # row-steps the acceptance estimate remembers
    outlier: float = 10.0
    _lanes: dict[tuple[int, int], _Lane] = field(default_factory=dict, init=False, repr=False)  # (rows, bucket)
    _rows: int = field(default=0, init=False, repr=False)  # the engine's batch (cache rows) now: `begin`
    _tried: list[float] = field(default_factory=list, init=False, repr=False)
    _passed: list[float] = field(default_factory=list, init=False, repr=False)
    _costs: dict[int, list[float]] = field(default_factory=dict, init=False, repr=False)
    _shares: dict[int, tuple[float, float]] = field(default_factory=dict, init=False, repr=False)  # `_table_shares`
    _after_plain: bool = field(default=False, init=False, repr=False)
    _window: int | None = field(default=None, init=False, repr=False)  # `begin`
    # steps since the last one that neither kept nor held the drafter's context (None: none since `begin`)
    _since_gap: int | None = field(default=None, init=False, repr=False)
    _due: int = field(default=0, init=False, repr=False)  # `_decide` with a plain step: steps before a drafted one
    _lookup_on: bool = field(default=True, init=False, repr=False)  # lookup steps allowed this step (`_lookup_here`)
    lookup_only: bool = field(default=False, init=False)  # the last `choose_depth` asked for a lookup step
    # with `lookup_only`: a step's cost verifying m = 0..B * depth drafts in all against none, as lookup steps measured
    # it (`lookup_cost_fit`, `DraftState.lookup_costs`; () without a table)
    lookup_costs: tuple[float, ...] = field(default=(), init=False)
    # False when the last `choose_depth` gave a plain step while drafting is off: the step need not keep the drafter's
    # context (class docstring, "Upkeep")
    upkeep: bool = field(default=True, init=False)
    # With `upkeep` False: the engine holds the step's taps for the drafter's catch-up. False only where the drafter
    # resumes from its newest `window` positions (`begin`) and the next step that may draft is further away (class
    # docstring, "Upkeep"): the step is then AR's own decode step (a lookup step: where no row verifies a draft).
    keep_taps: bool = field(default=True, init=False)
    # every active row decodes greedily this step (the engine sets it before `choose_depth`): lookup steps only then
    greedy: bool = field(default=True, init=False)
    # True when the last `choose_depth` gave a drafted probe while drafting is off: the engine verifies the drafts and
    # reports what was accepted, but commits one token a row, as a plain step does (class docstring, "Probes")
    measure_only: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        if isinstance(self.num_draft_tokens, bool) or not isinstance(self.num_draft_tokens, int) \
                or self.num_draft_tokens < 1:
            raise ValueError(f"ServingGate needs num_draft_tokens >= 1, got {self.num_draft_tokens!r}")
        if self.warmup < 1 or self.probe_every < 1 or self.max_probe_every < self.probe_every:
            raise ValueError(f"ServingGate needs warmup >= 1 and 1 <= probe_every <= max_probe_every, got "
                             f"{self.warmup}, {self.probe_every}, {self.max_probe_every}")
        if not 0.0 <= self.hysteresis < 1.0 or not 0.0 <= self.hold < 1.0 or self.confident < self.hysteresis:
            raise ValueError(f"ServingGate needs 0 <= hysteresis, hold < 1 and confident >= hysteresis, got "
                             f"{self.hysteresis}, {self.hold}, {self.confident}")
        if not 0.0 <= self.decay < 1.0 or self.memory < 1.0 or self.outlier <= 1.0:
            raise ValueError(f"ServingGate needs decay in [0, 1), memory >= 1, outlier > 1; got {self.decay}, "
                             f"{self.memory}, {self.outlier}")
        if self.lookup_depth is not None and self.lookup_depth < 1:
            raise ValueError(f"ServingGate needs lookup_depth >= 1, got {self.lookup_depth}")
        if self.latency_slack is not None and not self.latency_slack >= 0.0:
            raise ValueError(f"ServingGate needs latency_slack >= 0 or None, got {self.latency_slack}")
        k = self.num_draft_tokens
        self._tried, self._passed = [1.0] * (k + 1), [0.5] * (k + 1)  # prior s_k = 0.5, worth one row

    def reset(self) -> None:
        """Forget every measurement (a new machine load, another drafter)."""
        self._lanes.clear()
        self._costs.clear()
        self._shares.clear()
        if self.trials is not None:
            self.trials.reset()
        self.__post_init__()
        self._after_plain, self._since_gap = False, None

    def begin(self, rows: int, window: int | None = None) -> None:
        """An engine with `rows` cache rows starts a run. A step costs what the whole cache costs, whatever the active
        rows, so what was measured is kept per cache size: an engine of another size measures its own, one of the same
        size (the next run of a server, a warm-up before a timed run) starts from what the earlier ones settled.
        `window`: the drafter drafts again from the taps of its newest `window` missed positions
        (`Drafter.resume_window`); None: it needs them all, and every step without upkeep holds its taps."""
        if window is not None and window < 0:
            raise ValueError(f"ServingGate.begin needs window >= 0 or None, got {window}")
        self._rows, self._after_plain, self._window, self._since_gap = rows, False, window, None
        if self.trials is not None:
            self.trials.begin(rows)

    # ----- estimates -------------------------------------------------------------------------------------------
    def survival(self) -> list[float]:
        """[s_1, ..., s_K]: the estimated share of rows that accept at least k drafts (non-increasing)."""
        out, prev = [], 1.0
        for k in range(1, self.num_draft_tokens + 1):
            prev = min(prev, self._passed[k] / self._tried[k])
            out.append(prev)
        return out

    def _table(self, num_active: int) -> list[float]:
        """cost(B, B (n + 1)) for n = 0..K (cached: the table does not change during a run)."""
        got = self._costs.get(num_active)
        if got is None:
            assert self.cost is not None
            got = [float(self.cost(num_active, num_active * (n + 1))) for n in range(self.num_draft_tokens + 1)]
            if not all(math.isfinite(c) and c > 0 for c in got):
                raise ValueError(f"the cost table gave non-positive or non-finite step seconds at B={num_active}: "
                                 f"{got}")
            self._costs[num_active] = got
        return got

    def best_depth(self, num_active: int) -> tuple[int, float]:
        """(n*, its expected committed tokens per row per second) at this batch size from what was measured."""
        lane = self._lane(num_active)
        s = self.survival()
        if self.cost is None:
            return self.num_draft_tokens, (1.0 + sum(s)) / max(lane.scale, 1e-12)
        table, gain, best = self._table(num_active), 1.0, (self.num_draft_tokens, -1.0)
        for n in range(1, self.num_draft_tokens + 1):
            gain += s[n - 1]
            rate = gain / (max(lane.scale, 1e-12) * table[n])
            if rate > best[1]:
                best = (n, rate)
        return best

    # ----- decisions -------------------------------------------------------------------------------------------
    def choose_depth(self, num_active: int, num_draft_tokens: int) -> int:
        """Drafts every row verifies this step (0: a plain step); `num_draft_tokens` must be the gate's K."""
        if num_draft_tokens != self.num_draft_tokens:
            raise ValueError(f"ServingGate was built for K={self.num_draft_tokens}, the engine drafts "
                             f"{num_draft_tokens}")
        self.lookup_only, self.lookup_costs, self._due = False, (), 0
        self._lookup_on = not self._by_trials or self._tick()
        depth = self._decide(num_active)
        lane = self._lane(num_active)
        if depth == 0 and self._lookup_here():
            depth = self._base_step(lane, num_active)
        self.upkeep = (depth > 0 and not self.lookup_only) or lane.on
        self.keep_taps = True
        if depth > 0 and not self.lookup_only and self._short_context():
            # The model would draft from a context whose gap ends inside its window: plain steps that hold their taps
            # until it does not (the decision stands: `_decide` gives it again).
            depth, self.upkeep = 0, False
        elif not self.upkeep and self._window is not None:
            # (a lookup step where some row verifies a match returns its taps anyway; one where none does may not)
            self.keep_taps = self._due <= self._window
        self.measure_only = depth > 0 and not self.lookup_only and not lane.on and self._in_step(num_active)
        if not (self.upkeep or self.keep_taps):
            self._since_gap = 0
        elif self._since_gap is not None:
            self._since_gap += 1
        return depth

    def _short_context(self) -> bool:
        """Whether the drafter's context misses positions among its newest `window` (`begin`)."""
        return self._window is not None and self._since_gap is not None and self._since_gap < self._window

    @property
    def lookup_engine(self) -> bool:
        """This run's engine may run lookup steps (a drafter with lookup drafts; at most `lookup_rows` cache rows, or
        any with `trials`): the engine keeps the lookup's history current in its steps without upkeep only then;
        elsewhere the lookup catches up with the model."""
        return self.lookup and (self._rows <= self.lookup_rows or self.trials is not None)

    @property
    def _by_trials(self) -> bool:
        """This run's lookup steps are `trials`' to allow: a drafter with lookup drafts, more than `lookup_rows` cache
        rows, and trials."""
        return self.lookup and self._rows > self.lookup_rows and self.trials is not None

    def _trials(self) -> LookupTrials:
        assert self.trials is not None
        return self.trials

    def _tick(self) -> bool:
        """Whether this step of an engine above `lookup_rows` may be a lookup step (`trials`); while a row samples no
        step may, and the epoch in progress is dropped."""
        if not self.greedy:
            self._trials().pause()
            return False
        return self._trials().tick()

    def _lookup_here(self) -> bool:
        """Lookup steps in an engine of at most `lookup_rows` cache rows (0: not told, `begin`), and in a larger one
        where `trials` found that epochs with them commit more tokens per wall second than epochs without. A lookup
        step commits more tokens in some rows than in others, which puts the rows out of step for good: every later
        step attends over the longest row, and requests finish and join one or two at a time, in more prefills. The
        steps' own timing cannot see that (`benchmarks/batch_alignment.py` measures both costs), and what it costs
        depends on the machine: on one 2-core CPU n-gram lookup at every step ran 1.2x / 1.0-1.06x / 0.82-0.85x AR's
        throughput at 2 / 4 / 8 concurrent requests in `angelspec bench`, on another 1.0x / 1.5x / 1.1x. At two rows it
        paid on both: there lookup steps need no trial.

        And only while every row decodes greedily (`greedy`): sampled, the target kept few lookup drafts (MAL
        1.03-1.05 at T = 0.8 on the eval prompts) and a sampled verify costs more than the table's greedy one, so
        `auto` with lookup steps ran 0.91-0.92x AR at two rows, where plain steps ran 1.0x."""
        return self.lookup_engine and self.greedy and self._lookup_on

    def _decide(self, num_active: int) -> int:
        """The model's depth this step, or 0 for the base step (plain, or lookup: `_base_step`)."""
        lane = self._lane(num_active)
        if not (lane.spec_n and lane.plain_n):
            self._borrow(lane)
        if lane.spec_n < self.warmup:
            return self.best_depth(num_active)[0] if lane.spec_n else self.num_draft_tokens
        if lane.plain_n < self.warmup:
            return 0
        n, forecast = self.best_depth(num_active)
        rate = self._drafted_rate(lane, num_active, forecast)
        plain = self._base_rate(lane, num_active)
        if lane.probe > 0:
            return n
        if lane.on:
            if rate < (1.0 - self.hold) * plain:
                lane.on, lane.run = False, 0
                lane.gap = self._probe_gap(lane, num_active, n, self.probe_every)
                self._due = self._off_gap(lane, forecast, plain)
                return 0
            if lane.run >= lane.gap:  # a plain probe keeps the plain rate current
                lane.gap = self._next_gap(lane, rate > (1.0 + self.confident) * plain)
                lane.run = 0
                return 0
            return self._explore(lane, n)
        if rate > (1.0 + self.hysteresis) * plain:
            if not lane.confirm:  # a probe that wins is confirmed by two more drafted steps before drafting turns on
                lane.confirm, lane.probe = True, _PROBE_STEPS
                return n
            lane.on, lane.run, lane.gap, lane.confirm = True, 0, self.probe_every, False
            return n
        lane.confirm = False
        off_gap = self._off_gap(lane, forecast, plain)
        if lane.run >= off_gap:  # a drafted probe (two steps: the first pays the catch-up)
            lane.gap = self._probe_gap(lane, num_active, n, self._next_gap(lane, rate < (1.0 - self.confident) * plain))
            lane.run, lane.probe = 0, _PROBE_STEPS
            return n
        self._due = off_gap - lane.run
        return 0

    def _drafted_rate(self, lane: _Lane, num_active: int, forecast: float) -> float:
        """Tokens per row per second that drafted steps committed, as measured: every drafted step's seconds (the
        catch-up after plain steps, the drafting, the wider verify, the commit), not the cost table's forecast, which
        only ranks the depths. Forecasts missed by up to 1.4x on a CPU (steps that switch, the table's drafting share):
        a gate that trusts them drafts where it loses. `forecast`: the rate before any drafted step was measured."""
        return 1.0 / (lane.real_s * self._plain_unit(num_active)) if lane.real_n else forecast

    def _base_rate(self, lane: _Lane, num_active: int) -> float:
        """Tokens per row per second that the model's drafted steps must beat: a plain step's, or with lookup steps
        (which run instead of plain ones while the model does not draft) the better of the two once both are
        measured (a lookup step whose rows verify nothing is a plain step, and its rows verify matches only where they
        are expected to pay, so a lookup rate below the plain one is not the model's to beat)."""
        plain, looked = self._plain_and_lookup_rates(lane, num_active)
        return max(plain, looked) if self._lookup_here() and lane.look_n >= self.warmup else plain

    def _plain_and_lookup_rates(self, lane: _Lane, num_active: int) -> tuple[float, float]:
        """Tokens per row per second of a plain and of a lookup step as measured (0.0 for a kind not measured)."""
        unit = self._plain_unit(num_active)
        plain = 1.0 / (lane.plain_s * unit) if lane.plain_s else 0.0
        return plain, (lane.look_tok / (lane.look_s * unit) if lane.look_s else 0.0)

    def _base_step(self, lane: _Lane, num_active: int) -> int:
        """While the model does not draft (`lookup` gates only, after the plain warm-up): a lookup step of
        `lookup_depth` drafts a row (K by default), with `lookup_only` and `lookup_costs` set (`lookup_cost_fit`). The
        rows verify the drafts whose expected tokens pay for what they add to the step, none where nothing beats a
        plain step (`HybridDrafter`, `MatchAcceptance.plan`), so a lookup step where nothing pays costs a plain step
        and the choice follows the text from step to step. (Choosing between whole lookup and plain steps by their
        measured rates lagged the lookup's hit rate: a run of plain steps saw a returning repetition only at its next
        probe.)"""
        if lane.plain_n < self.warmup:
            return 0
        look = self.num_draft_tokens if self.lookup_depth is None else min(self.lookup_depth, self.num_draft_tokens)
        self.lookup_only = True
        if self.cost is not None:
            base, fixed, slope = self.lookup_cost_fit(num_active)
            self.lookup_costs = (1.0,) + tuple((fixed + slope * m) / base for m in range(1, num_active * look + 1))
        return look

    def lookup_cost_fit(self, num_active: int) -> tuple[float, float, float]:
        """(base, fixed, slope): a lookup step of this bucket costs `base` verifying no draft and fixed + slope * x
        verifying x drafts in all, in the units of the table's step verifying none. Measured on the lookup steps
        themselves: base from those that verified none (AR's step; the plain steps' until one did), the line by
        decayed least squares over those that verified some (`observe_step`), its slope pulled towards the table's per
        draft by one step's weight where their counts vary little (at one row a lookup step verifies K or nothing).
        Before any such step, the table's ratios (its step verifying x more positions over its step verifying none).

        Why not the table alone: its steps include the model's drafting, which a lookup step does not run, so the share
        a verified draft adds looks far smaller there than it is (in the shipped DFly's compiled table at one row, 8
        positions cost 1.17x one), and a step verifying drafts has a fixed price of its own over a plain step (the
        verify path's forward and host work) that the table's increments hide. The measured line says what
        a draft really adds, and how much the first one costs, on this machine now: a quieter machine made the
        one-token step much faster than the verify step (docs/performance.md), and the depth that pays moved with it."""
        lane = self._lane(num_active)
        base = lane.look0 or lane.plain_s or 1.0
        first, per_draft = self._table_shares(num_active)
        # the table's price of a draft, as the same share of the measured plain step (only the table's ratios are
        # read: its seconds may come from another machine, or from no machine at all, `LinearCost`)
        prior = per_draft * base
        w, sx, sxx, sy, sxy = lane.fit
        if w <= 0.0:  # nothing measured yet: the table's ratios
            return base, max(base * first - prior, base), prior
        mx, my = sx / w, sy / w
        slope = max(((sxy - w * mx * my) + prior) / (max(sxx - w * mx * mx, 0.0) + 1.0), 0.0)
        if my - slope * mx < base:  # no line through the measured mean starts below a plain step
            slope = max((my - base) / mx, 0.0)
        return base, max(my - slope * mx, base), slope

    def _table_shares(self, num_active: int) -> tuple[float, float]:
        """The table's step verifying one more position than rows, and the price of each further draft up to K a row,
        as shares of its step verifying none (cached: the table does not change during a run)."""
        got = self._shares.get(num_active)
        if got is None:
            table, n_pos = self._table(num_active), num_active * self.num_draft_tokens
            first = float(self.cost(num_active, num_active + 1)) / table[0]  # (table[K]: n_pos more positions)
            got = self._shares[num_active] = first, max((table[-1] / table[0] - first) / max(n_pos - 1, 1), 0.0)
        return got

    def _explore(self, lane: _Lane, n: int) -> int:
        """n, or n + 1 on every `probe_every`-th drafted step below K: acceptance past n* is measured only where it
        is verified, and it must stay current for n* to grow again when the prompts get easier."""
        lane.deep += 1
        if n < self.num_draft_tokens and lane.deep >= self.probe_every:
            lane.deep = 0
            return n + 1
        return n

    def _plain_unit(self, num_active: int) -> float:
        """What a plain step's seconds are measured in: the table's step verifying no draft (it grows with the batch
        as a plain step does, so a bucket's rows 9 and 16 share one scale), 1 s without a table."""
        return 1.0 if self.cost is None else self._table(num_active)[0]

    def _borrow(self, lane: _Lane) -> None:
        """A bucket with nothing measured starts from the nearest bucket's scales (with a cost table they are shares
        of the table's seconds, which the machine's load moves alike at every batch size): no warm-up of its own, which
        at the end of a run (the batch draining through every bucket) would cost a few slow steps per bucket. Across
        cache sizes only a full cache's bucket (every row active) lends, to another full cache's: there the table's
        cost at the active rows is the whole cache's in both. Such a lane keeps its own two drafted warm-up steps
        (they compile the drafter's graphs for this batch, in a benchmark's untimed warm-up run; a first drafted probe
        mid-run would compile them there) and then runs the lender's state with its probe gap, instead of learning
        again with probes 8, 16, 32, ... steps apart."""
        if self.cost is None:
            return
        key = next(k for k, v in self._lanes.items() if v is lane)

        def ready(v: _Lane) -> bool:
            return v is not lane and v.spec_n >= self.warmup and v.plain_n >= self.warmup

        def full(k: tuple[int, int]) -> bool:
            return k[0] >= 1 and k[1] == batch_bucket(k[0])

        donors = sorted((abs(k[1] - key[1]), k) for k, v in self._lanes.items() if ready(v) and k[0] == key[0])
        if not donors and full(key) and not lane.spec_n and not lane.plain_n:  # (once lent, plain_n > 0)
            donors = sorted((abs(k[1] - key[1]), k) for k, v in self._lanes.items() if ready(v) and full(k))
            if donors:  # another size's full cache: all but the drafted warm-up, which compiles the drafter here
                d = self._lanes[donors[0][1]]
                lane.scale, lane.real_s, lane.real_n = d.scale, d.real_s, d.real_n
                lane.plain_s, lane.plain_n, lane.on, lane.gap = d.plain_s, self.warmup, d.on, d.gap
                return
        if not donors:
            return
        d = self._lanes[donors[0][1]]
        if not lane.spec_n:
            lane.scale, lane.spec_n = d.scale, self.warmup
            lane.real_s, lane.real_n = d.real_s, d.real_n
        if not lane.plain_n:
            lane.plain_s, lane.plain_n = d.plain_s, self.warmup
        if not lane.look_n and d.look_n:
            lane.look_s, lane.look_n = d.look_s, d.look_n
            lane.look_tok, lane.look_seen = d.look_tok, d.look_seen
        lane.on = d.on

    def _off_gap(self, lane: _Lane, forecast: float, plain: float) -> int:
        """Plain steps before the next drafted probe while drafting is off: the lane's gap, or `max_budget_gap` while
        even the forecast loses to the base step. The forecast leaves costs out and is the optimistic side (at every
        load of a 2-core CPU it was at or above what drafted steps delivered), so while it loses a probe can only
        confirm the loss, and a probe costs more than its own steps: rows that commit different counts fall out of
        step for good (every later step attends over the longest row; requests finish and join one at a time, in
        more prefills: `benchmarks/batch_alignment.py`). The acceptance the forecast reads stays current from the
        loads where drafting runs; once the forecast is back above the base step, the lane's own gap applies again."""
        return lane.gap if forecast >= plain else max(lane.gap, self.max_budget_gap)

    def _probe_gap(self, lane: _Lane, num_active: int, n: int, gap: int) -> int:
        """`gap`, or more plain steps between drafted probes where a probe costs more than `probe_budget` of them:
        a probe's two drafted steps (the first with the drafter's catch-up) take longer than the plain steps that would
        commit their tokens (one a row where rows must stay in step, `measure_only`; what one row accepts where it
        decodes alone); and before them the engine hands the drafter the positions it missed (`observe_catch_up`), a
        cost that grows with the gap. At a large batch on a CPU a probe costs several plain steps, and its catch-up a
        share of every plain step between probes: the gap g keeps excess + g * held <= budget * g * plain, or is
        `max_budget_gap` where no gap can."""
        unit = 1.0 if self.cost is None else self._table(num_active)[n]
        plain_unit = self._plain_unit(num_active)
        plain_s = lane.plain_s * plain_unit
        catch = lane.catch or lane.scale
        tokens = 1.0 if self._in_step(num_active) else 1.0 + sum(self.survival()[:n])  # a probe step's tokens a row
        excess = (catch + lane.scale) * unit - 2.0 * tokens * plain_s  # seconds the drafted steps cost over plain ones
        room = self.probe_budget * plain_s - lane.held_s * plain_unit  # budget per plain step left after catch-up
        if plain_s <= 0.0 or (excess <= 0.0 and room >= 0.0):
            return gap
        if room <= 0.0:
            return max(gap, self.max_budget_gap)
        return max(gap, min(math.ceil(excess / room), self.max_budget_gap))

    @staticmethod
    def _in_step(num_active: int) -> bool:
        """Whether a drafted probe while drafting is off commits one token a row (`measure_only`) at this many active
        rows: rows must stay in step with each other; one row alone has nothing to fall out of step with."""
        return num_active > 1

    def _decayed(self, ema: float, x: float) -> float:
        """x folded into an EMA by `decay` (x itself while the EMA is still unset, 0)."""
        return x if not ema else self.decay * ema + (1.0 - self.decay) * x

    def _next_gap(self, lane: _Lane, confident: bool) -> int:
        """The gap after this probe: doubled where the running state wins by more than `confident`, else grown by
        half (a probe that does not change the state was not needed yet); a switch resets it to `probe_every`."""
        grown = 2 * lane.gap if confident else lane.gap + max(lane.gap // 2, 1)
        return min(grown, self.max_probe_every)

    def _lane(self, num_active: int) -> _Lane:
        lane = self._lanes.setdefault((self._rows, batch_bucket(num_active)), _Lane())
        lane.gap = lane.gap or self.probe_every
        return lane

    # ----- measurements ----------------------------------------------------------------------------------------
    def observe_catch_up(self, num_active: int, seconds: float, steps: int) -> None:
        """The engine handed the drafter what `steps` steps without upkeep missed (`Step._resync`) in `seconds`,
        before a drafted step: a cost of probing that grows with the gap (`_probe_gap`), not timed in the step itself
        (it says how long drafting was off, not what drafting delivers)."""
        if steps <= 0 or seconds <= 0.0:
            return
        lane = self._lane(num_active)
        x = seconds / steps / self._plain_unit(num_active)
        lane.held_s = self._decayed(lane.held_s, x)

    def observe_step(self, num_active: int, depth: int, seconds: float, accepted: Sequence[int],
                     depths: Sequence[int]) -> None:
        """One step: the depth `choose_depth` gave (0: plain), its host seconds, and per active row the drafts it
        accepted and verified."""
        lane = self._lane(num_active)
        if self._by_trials:  # (a measure-only probe committed one token a row)
            one_each = depth <= 0 or self.measure_only or not accepted
            self._trials().observe(None if one_each else [a + 1 for a in accepted], num_active)
        if self.lookup_only:  # a lookup step: the base kind's rate, not the model's acceptance or timing
            lane.run += not lane.on
            if seconds > 0:
                # Seconds and tokens apart: a step's seconds vary little, its tokens from 1 to all the drafts (one
                # match or none), so its tokens are averaged over the last ~`memory` lookup steps (a plain mean of the
                # first ones), not the timing's few.
                tokens = sum(accepted) / len(accepted) + 1.0 if accepted else 1.0
                lane.look_s, lane.look_n, lane.look_out = self._fold(lane.look_s, lane.look_n, lane.look_out,
                                                                     seconds / self._plain_unit(num_active))
                lane.look_seen += 1
                w = 1.0 / min(lane.look_seen, self.memory)
                lane.look_tok = (1.0 - w) * lane.look_tok + w * tokens
                self._fit_lookup(lane, sum(depths), seconds / self._plain_unit(num_active))
            self._after_plain = True  # the model sat it out: its next drafted step catches up
            return
        lane.run += (depth > 0) == lane.on  # steps of the running state since the last switch or probe
        if depth <= 0:
            if seconds > 0:
                lane.plain_s, lane.plain_n, lane.plain_out = self._fold(lane.plain_s, lane.plain_n, lane.plain_out,
                                                                        seconds / self._plain_unit(num_active))
                if lane.plain_n == self.warmup and lane.spec_n >= self.warmup:
                    lane.run = 0  # warmed up: the first probe gap starts now
            self._after_plain = True
            return
        if seconds > 0:
            tokens = sum(accepted) / len(accepted) + 1.0 if accepted else 1.0
            lane.real_s, lane.real_n, lane.real_out = self._fold(lane.real_s, lane.real_n, lane.real_out,
                                                                 seconds / tokens / self._plain_unit(num_active))
        if lane.probe > 0:
            lane.probe -= 1
        # A probe (drafting is off) weighs 4x: two steps every `gap` must be able to show that acceptance came back.
        self._count_accepts(accepted, depths, self.memory if lane.on else max(self.memory / 4.0, 2.0))
        unit = 1.0 if self.cost is None else self._table(num_active)[min(depth, self.num_draft_tokens)]
        if not self._after_plain and seconds > 0:  # a step right after a plain one paid the catch-up: not timed
            lane.scale, lane.spec_n, lane.spec_out = self._fold(lane.scale, lane.spec_n, lane.spec_out,
                                                                seconds / unit)
        elif seconds > 0:  # ... but what it cost sizes the gap between drafted probes (`_probe_gap`)
            x = seconds / unit
            lane.catch = self._decayed(lane.catch, x)
        self._after_plain = False

    def _fit_lookup(self, lane: _Lane, x: int, y: float) -> None:
        """A lookup step that verified x drafts in all took y (`plain_s`'s units): into `look0` (x = 0) or the line's
        sums (`lookup_cost_fit`), which forget at the pace of the acceptance estimate (~`memory` steps). A step more
        than `outlier` times the mean of those it holds (a graph compiled mid-run) is left out."""
        if x <= 0:
            if not lane.look0 or y < self.outlier * lane.look0:
                lane.look0 = self._decayed(lane.look0, y)
            return
        w, sx, sxx, sy, sxy = lane.fit
        if w > 0.0 and y > self.outlier * (sy / w):
            return
        keep = 1.0 - 1.0 / self.memory
        lane.fit = [keep * w + 1.0, keep * sx + x, keep * sxx + x * x, keep * sy + y, keep * sxy + x * y]

    def _fold(self, ema: float, n: int, out: int, x: float) -> tuple[float, int, int]:
        """x into an EMA (ema, samples, slow outliers in a row) -> the new triple (see the class docstring)."""
        if n and x > self.outlier * ema and out < 3:
            return ema, n, out + 1
        fresh = n == 0 or out >= 3 or x * self.outlier < ema
        return (x if fresh else self.decay * ema + (1.0 - self.decay) * x), n + 1, 0

    def _count_accepts(self, accepted: Sequence[int], depths: Sequence[int], memory: float) -> None:
        w = 1.0 - 1.0 / memory
        for k in range(1, self.num_draft_tokens + 1):
            tried = sum(d >= k for d in depths)
            if not tried:
                break
            passed = sum(a >= k for a, d in zip(accepted, depths, strict=True) if d >= k)
            f = w ** tried
            self._tried[k] = self._tried[k] * f + tried
            self._passed[k] = self._passed[k] * f + passed

    def summary(self) -> dict[str, dict[str, float]]:
        """Per bucket of the current cache size (label "rows a-b"): the state, n* and the two rates (tokens/row/s),
        and the survival estimate."""
        out: dict[str, Any] = {"survival": [round(x, 3) for x in self.survival()]}
        for rows, key in sorted(self._lanes):
            if rows != self._rows:
                continue
            lane = self._lanes[rows, key]
            lo, hi = (1, 1) if key == 0 else (2 ** (key - 1) + 1, 2 ** key)
            ready = lane.spec_n and lane.plain_n
            n, forecast = self.best_depth(hi) if ready else (self.num_draft_tokens, 0.0)
            rate = self._drafted_rate(lane, hi, forecast) if ready else 0.0
            plain, looked = self._plain_and_lookup_rates(lane, hi)
            out[f"rows {lo}-{hi}"] = {"drafting": lane.on, "depth": n, "spec_rate": round(rate, 2),
                                      "plain_rate": round(plain, 2), "probe_gap": lane.gap,
                                      **({"lookup_rate": round(looked, 2)} if self.lookup else {})}
        if self._by_trials:
            out["lookup_trials"] = self._trials().summary().get(f"rows {self._rows}", {})
        return out


@dataclass(frozen=True)
class AutoDepth(FixedDepth):
    """The depth policy `auto`: every row verifies what the engine's `ServingGate` (which this policy has the engine
    build, `make_gate`) chooses per step from the cost table and the measured acceptance, all K until it has measured
    anything; 0 is a plain step. Uniform depths from earlier steps only: `uses_proposal` stays False."""

    cost: Callable[[int, int], float] | None = None
    latency_slack: float | None = DEFAULT_LATENCY_SLACK  # `ServingGate.latency_slack` (`auto:slack=S`; None: none)
    _gates: dict[tuple[int, bool], ServingGate] = field(default_factory=dict, init=False, repr=False, compare=False,
                                                        hash=False)

    def make_gate(self, num_draft_tokens: int, lookup: bool = False) -> ServingGate:
        """The policy's gate for K = num_draft_tokens (with lookup steps where the drafter can draft by lookup alone),
        one per policy and K: what it measured lives as long as the policy does (a server's), across the engines
        that use it (one per batch shape) and their `generate` calls, so a new engine starts from the decisions the
        earlier ones settled instead of measuring again."""
        gate = self._gates.get((num_draft_tokens, lookup))
        if gate is None:
            gate = self._gates[num_draft_tokens, lookup] = ServingGate(num_draft_tokens, cost=self.cost, lookup=lookup,
                                                                       latency_slack=self.latency_slack)
        return gate
