"""The speculation gate: before drafting, decide whether a speculative step is expected to commit tokens faster
than a plain step at the current batch size, and skip drafting when it is not.

Why: a depth policy (D-cut, Algorithm 1) chooses how many drafts to verify only after the drafter has proposed,
so it can shrink the verify forward but never the drafting, and its smallest budget still verifies drafts. At a
large batch on a CPU the verify forward is compute-bound (every verified position costs), and at any batch a
drafter that is weak on the current prompts (low acceptance) costs more than it returns. The gate measures both
alternatives online and runs the better one; a skipped step is a plain decode step of the target that still
hands the drafter its taps (`Drafter.on_commit` with no drafts accepted), so the drafter's context stays
complete and speculation can resume at any step.

Rule, per batch-size bucket (1, 2, 3-4, 5-8, ...: the cost of a step grows smoothly with the batch):
    rate_spec = EMA over drafted steps of (committed tokens per active row) / (step seconds)
    rate_plain = EMA over skipped steps of 1 / (step seconds)
    draft  iff  fewer than `warmup` drafted steps were seen in the bucket, or no skipped step yet (one is run
                to measure it), or rate_spec > (1 + margin) * rate_plain and fewer than `probe_every` steps were
                drafted in a row, or the bucket's probe gap of steps was skipped in a row. Probes both ways keep
                both rates current: acceptance changes with the prompts (so the EMAs also weigh the newest step by
                half: with a slower EMA the gate kept skipping on the demo's maths prompts, where DFly wins, after
                learning on its code prompts, where it loses), and a plain step's cost changes with the machine's
                load (without plain probes one slow plain step early in a run, e.g. the first at a shape, kept a
                batch of 16 drafting for the rest of the run: 0.54x of AR where plain steps win).
    outliers    a step more than `outlier` (10) times slower than its kind's EMA of step seconds is left out of the
                EMAs (up to three in a row), and one more than 10 times faster replaces them: a compiled engine
                recompiles a graph mid-run now and then (a new shape), and such a step takes seconds where its kind
                takes milliseconds. Taken as a measurement, one of them made the gate believe plain steps (or
                drafted ones) ~1000x slower than they are, and it then kept the wrong kind of step for the rest of
                the run (compiled EAGLE-3 at batch 1 with the gate: 0.25x of AR on the maths prompts). A bucket
                measures plain steps until one of them counts.
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

from dataclasses import dataclass, field


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
