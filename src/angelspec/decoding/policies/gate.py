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
                to measure it), or rate_spec > (1 + margin) * rate_plain, or the bucket's probe gap of steps was
                skipped in a row (a drafted probe keeps rate_spec current: acceptance changes with the prompts, so
                the EMAs weigh the newest step by half: with a slower EMA the gate kept skipping on the demo's
                maths prompts, where DFly wins, after learning on its code prompts, where it loses).
    probe gap   `probe_every` at first; doubled (up to `max_probe_every`) by each probe after which speculation
                still loses, back to `probe_every` when speculation wins. Where drafting never pays (a batch of 16
                on two cores, where a drafted step costs about twice a plain one) a fixed gap of 8 made every
                ninth step a slow one, ~12% of the throughput; the doubling brings that to a few per cent
                within a few probes, while a bucket where speculation wins keeps probing at the short gap.

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
class _Bucket:
    spec_rate: float = 0.0  # EMA of committed tokens per row per second, drafted steps
    plain_rate: float = 0.0  # EMA of tokens per row per second (= 1 / seconds), skipped steps
    drafted: int = 0
    skipped: int = 0
    skip_run: int = 0  # skipped steps since the last drafted one
    gap: int = 0  # skipped steps in a row before a probe (set to probe_every on first use)
    probing: bool = False  # the last decision was a probe


@dataclass
class SpecGate:
    """Online draft/skip decision (module docstring). warmup: drafted steps per bucket before it may skip;
    probe_every: a drafted probe after this many skipped steps in a row, doubled after each probe that loses up to
    max_probe_every; margin: required relative advantage of speculation; decay: EMA weight of the history (0 = only
    the newest step)."""

    warmup: int = 4
    probe_every: int = 8
    max_probe_every: int = 64
    margin: float = 0.0
    decay: float = 0.5
    _buckets: dict[int, _Bucket] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.warmup < 1 or self.probe_every < 1:
            raise ValueError(f"SpecGate needs warmup >= 1 and probe_every >= 1, got {self.warmup}, {self.probe_every}")
        if self.max_probe_every < self.probe_every:
            raise ValueError(f"SpecGate.max_probe_every ({self.max_probe_every}) must be >= probe_every "
                             f"({self.probe_every})")
        if not 0.0 <= self.decay < 1.0:
            raise ValueError(f"SpecGate.decay must lie in [0, 1), got {self.decay}")
        if self.margin < 0.0:
            raise ValueError(f"SpecGate.margin must be >= 0, got {self.margin}")

    def reset(self) -> None:
        """Forget every measurement (a new machine load, another drafter)."""
        self._buckets.clear()

    def should_draft(self, num_active: int) -> bool:
        b = self._bucket(num_active)
        b.probing = False
        if b.drafted < self.warmup:
            return True
        if b.skipped == 0:
            return False  # measure a plain step once
        if self._spec_wins(b):
            return True
        b.probing = b.skip_run >= b.gap
        return b.probing

    def _bucket(self, num_active: int) -> _Bucket:
        b = self._buckets.setdefault(batch_bucket(num_active), _Bucket())
        b.gap = b.gap or self.probe_every
        return b

    def _spec_wins(self, b: _Bucket) -> bool:
        return b.spec_rate > (1.0 + self.margin) * b.plain_rate

    def observe(self, num_active: int, drafted: bool, tokens_per_row: float, seconds: float) -> None:
        """Record one step: whether it drafted, the mean committed tokens per active row, and its seconds."""
        if seconds <= 0.0:
            return
        b = self._bucket(num_active)
        rate = tokens_per_row / seconds
        if drafted:
            b.spec_rate = rate if b.drafted == 0 else self.decay * b.spec_rate + (1 - self.decay) * rate
            b.drafted += 1
            b.skip_run = 0
            if b.probing:  # a lost probe waits twice as long for the next; a won one resets the wait
                b.gap = self.probe_every if self._spec_wins(b) else min(2 * b.gap, self.max_probe_every)
            elif self._spec_wins(b):
                b.gap = self.probe_every
            b.probing = False
        else:
            b.plain_rate = rate if b.skipped == 0 else self.decay * b.plain_rate + (1 - self.decay) * rate
            b.skipped += 1
            b.skip_run += 1

    def summary(self) -> dict[str, dict[str, float]]:
        """Per bucket (label "rows a-b"): drafted and skipped step counts and the two rates (tokens/row/s)."""
        out = {}
        for k in sorted(self._buckets):
            b = self._buckets[k]
            lo, hi = (1, 1) if k == 0 else (2 ** (k - 1) + 1, 2 ** k)
            out[f"rows {lo}-{hi}"] = {"drafted": b.drafted, "skipped": b.skipped, "probe_gap": b.gap,
                                      "spec_rate": round(b.spec_rate, 2), "plain_rate": round(b.plain_rate, 2)}
        return out
