"""Whether lookup steps run in a batch, decided end to end: epochs with and without them, compared in committed
tokens per wall second.

Why not per step: a lookup step commits more tokens in some rows than in others, which puts the rows out of step
for good. Every later step then attends over the longest row, and requests finish and join one or two at a time, in
more and smaller prefills. A lookup step's own timing sees none of that, and what it costs depends on the machine: on
one 2-core CPU n-gram lookup at every step ran 0.82-0.85x AR's throughput at 8 concurrent requests and 0.73x at 16
(while beating plain steps in the engine's own timing), on another 1.5x at 4 and 1.1x at 8 (`angelspec bench`). So
above `ServingGate.lookup_rows` cache rows the serving gate asks this record, which times whole epochs instead.

The rule, per cache size (an engine's rows; what one size measured is kept for the next engine of that size):

    epoch     `epoch_steps` consecutive steps, timed from the start of its first step to the start of the step
              after its last: the admissions, the drafter's catch-up and the host work between steps are in. A run's
              last epoch ends with its last step and counts if it has a quarter of the steps: it holds the drain,
              where rows that lookup steps put out of step finish one at a time and the batch runs with rows idle
              (rows in step finish together)
    rate      committed tokens per second of the epoch, every row's; per arm a decayed sum of tokens over a decayed
              sum of seconds (`decay` per epoch), so a few epochs average the admissions that fall in one or another
    arms      off: no lookup steps (the gate's plain steps); on: lookup steps where the model does not draft
    measured  an on epoch always; an off epoch only while the rows are in step (no step since the run began committed
              different counts in different rows): what lookup steps must beat is the batch as plain decoding runs it,
              not plain steps in a batch that lookup steps already put out of step (that cost stays with them). A
              step where no lookup step may run whatever the arm (a sampled row: `ServingGate.greedy`) drops the
              epoch in progress (`pause`)
    order     a new size runs one off epoch, then one on epoch (a trial), then the winner: on iff
              rate_on > (1 + margin) * rate_off in `confirm` (2) on trials in a row, each after an off epoch of its
              own (a trial puts the rows out of step, so the next one waits for the next run): epoch rates on a
              shared 2-core CPU drift by more than the margin (AR's own runs moved up to 1.3x inside one
              `angelspec bench` point), and one trial that won by drift let lookup steps in at four rows that then
              ran 0.89x AR end to end. An off trial that loses turns them off at once. The winner runs `gap` epochs
              (1, doubled up to `max_gap` by each plain trial that leaves the state as it was, back to 1 when one
              changes it), then the other arm gets a trial epoch. After an on trial that lost the next waits
              `max_gap`: such a trial costs more than its epoch (below), where a plain one costs what plain decoding
              does. A size larger than one where lookup steps lost waits as long before its first trial: a larger
              batch verifies at a higher cost (it is nearer compute-bound) and pays more for rows out of step (in
              `angelspec bench` n-gram lookup's speed-up fell with the batch from four rows on, on both 2-core CPUs
              measured). A win not yet confirmed is not a loss there.
              Only measured epochs count: after an on trial that lost, the off epochs left in the run (out of step)
              do not, and the next run measures off again first. An off trial can only be measured in step: while on,
              it waits for the next run (`begin`), whose first epoch it takes.

What a trial costs: the rows an on trial put out of step stay so for the rest of the run, so where lookup steps
lose (a large batch on a CPU: `angelspec bench` at 16 and 32 rows on a 2-core CPU, where each run of four requests a
row held one trial, ran 0.86-0.91x AR) the trial costs the run's remaining epochs too; hence the long wait after one
that lost. The margin (10%) is for what an epoch does not see: the requests a trial put out of step still
join apart after it ends, and a run's last epoch counts only if long enough. A graph compiled in the middle of an
epoch (a new shape) makes that epoch slow: the arm it ran in may lose a trial it would have won, and wins the next.

Exactness: whether a step may be a lookup step reads only earlier steps' timings and counts, never this step's
drafts, so every step is still an exact sampler (as the rest of the gate, `ServingGate`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class _Size:
    """What one cache size measured."""

    on: bool = False  # the state: lookup steps run (the winner so far)
    tokens: list[float] = field(default_factory=lambda: [0.0, 0.0])  # decayed sums per arm [off, on]
    seconds: list[float] = field(default_factory=lambda: [0.0, 0.0])
    epochs: list[int] = field(default_factory=lambda: [0, 0])  # epochs measured per arm
    run: int = 0  # epochs of the state since the last trial or switch
    gap: int = 1  # epochs of the state before the next trial
    wins: int = 0  # on trials won in a row while off (`LookupTrials.confirm`)

    def rate(self, arm: bool) -> float:
        return self.tokens[arm] / self.seconds[arm] if self.seconds[arm] > 0 else 0.0


@dataclass
class LookupTrials:
    """Lookup steps on or off per cache size, from timed epochs of each (module docstring). epoch_steps: steps of an
    epoch; margin: how much more an on epoch must commit per second; confirm: on trials that must win in a row, each
    after a plain epoch of its own, before lookup steps run; max_gap: the most epochs of the state between trials;
    decay: per-epoch weight of the history in the arms' sums; clock: seconds (a test's fake one)."""

    epoch_steps: int = 128
    margin: float = 0.1
    confirm: int = 2
    max_gap: int = 16
    decay: float = 0.7
    clock: Callable[[], float] = field(default=time.perf_counter, repr=False, compare=False)
    _sizes: dict[int, _Size] = field(default_factory=dict, init=False, repr=False)
    _rows: int = field(default=0, init=False, repr=False)
    _in_step: bool = field(default=True, init=False, repr=False)  # no step of this run committed unequal counts
    _arm: bool = field(default=False, init=False, repr=False)  # the epoch in progress: lookup steps or not
    _start: float | None = field(default=None, init=False, repr=False)  # its start (None: no epoch in progress)
    _end: float = field(default=0.0, init=False, repr=False)  # the end of its newest step
    _steps: int = field(default=0, init=False, repr=False)
    _tokens: float = field(default=0.0, init=False, repr=False)

    def __post_init__(self) -> None:
        if (self.epoch_steps < 1 or self.max_gap < 1 or self.confirm < 1 or self.margin < 0.0
                or not 0.0 <= self.decay < 1.0):
            raise ValueError(f"LookupTrials needs epoch_steps >= 1, max_gap >= 1, confirm >= 1, margin >= 0 and decay "
                             f"in [0, 1); got {self.epoch_steps}, {self.max_gap}, {self.confirm}, {self.margin}, "
                             f"{self.decay}")

    def reset(self) -> None:
        """Forget every measurement."""
        self._sizes.clear()
        self._start = None

    def begin(self, rows: int) -> None:
        """An engine of `rows` cache rows starts a run (every row admitted together: in step). The last run's last
        epoch ends with its last step."""
        if self._start is not None and self._steps >= max(self.epoch_steps // 4, 1):
            self._close(self._end - self._start)
        self._rows, self._in_step, self._start = rows, True, None

    def pause(self) -> None:
        """A step that may not be a lookup step whatever the arm (a sampled row is active): the epoch in progress
        is dropped, since an epoch of lookup steps without them would measure plain decoding as the lookup's."""
        self._start = None

    def tick(self) -> bool:
        """The start of a step -> whether it may be a lookup step. Closes the epoch in progress once it has its
        steps, and starts the next."""
        now = self.clock()
        if self._start is not None and self._steps >= self.epoch_steps:
            self._close(now - self._start)
            self._start = None
        if self._start is None:
            self._start, self._steps, self._tokens, self._arm = now, 0, 0.0, self._next_arm()
        return self._arm

    def observe(self, committed: list[int] | None, num_active: int) -> None:
        """The step's committed tokens per active row (None: one each, a plain step or a measure-only probe)."""
        if committed is not None and len(set(committed)) > 1:
            self._in_step = False
        if self._start is None:
            return
        self._steps += 1
        self._tokens += num_active if committed is None else sum(committed)
        self._end = self.clock()

    def _size(self) -> _Size:
        s = self._sizes.get(self._rows)
        if s is None:
            s = self._sizes[self._rows] = _Size()
            if any(rows < self._rows and t.epochs[True] and not t.on and not t.wins for rows, t in self._sizes.items()):
                s.gap = self.max_gap  # lookup steps lost at a smaller batch: the first trial waits too
        return s

    def _next_arm(self) -> bool:
        s = self._size()
        if not s.epochs[False]:  # first the batch as plain decoding runs it (then the trial)
            return False
        if s.run < s.gap or (s.on and not self._in_step):  # the state; an off trial needs rows in step
            return s.on
        return not s.on

    def _close(self, seconds: float) -> None:
        s, arm = self._size(), self._arm
        if seconds <= 0.0 or (not arm and not self._in_step):  # an off epoch out of step measures nothing
            return
        s.tokens[arm] = self.decay * s.tokens[arm] + self._tokens
        s.seconds[arm] = self.decay * s.seconds[arm] + seconds
        s.epochs[arm] += 1
        if arm == s.on:  # the state ran (the first epoch of a size: plain decoding, then the trial)
            s.run += 1
            return
        won = s.rate(True) > (1.0 + self.margin) * s.rate(False)
        if won and not s.on:  # an on trial won: lookup steps run once `confirm` have in a row
            s.wins += 1
            if s.wins < self.confirm:
                s.gap, s.run = 1, 0  # the next trial follows the next plain epoch measured (in step: the next run)
                return
        s.wins = 0
        if won != s.on:
            s.gap = 1
        elif not won:  # an on trial lost: it cost the rest of its run too
            s.gap = self.max_gap
        else:
            s.gap = min(2 * s.gap, self.max_gap)
        s.on, s.run = won, 0

    def summary(self) -> dict[str, dict[str, float]]:
        """Per cache size (label "rows N"): the state, the two arms' rates (tokens/s) and epochs, the gap."""
        return {f"rows {rows}": {"lookup": s.on, "rate_off": round(s.rate(False), 2), "rate_on": round(s.rate(True), 2),
                                 "epochs_off": s.epochs[False], "epochs_on": s.epochs[True], "gap": s.gap}
                for rows, s in sorted(self._sizes.items())}
