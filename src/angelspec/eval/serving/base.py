"""What every part of the serving sweep shares: `ServingError`, `ServingRow` (one measured (configuration,
concurrency) point, AngelSpec report §4.4 / Eq. 25's T_exec and T_sample per step) and the lookups over a
list of rows that the report, the break-even analysis and the plots all use.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field


class ServingError(ValueError):
    """Serving-benchmark input that cannot be used: configurations, concurrency values, workload."""


@dataclass(frozen=True)
class ServingRow:
    """One (configuration, concurrency) point. Seconds per step are per batched engine step, the median over the
    point's steps (AngelSpec §5: typical-step latencies, not moved by an occasional slow step)."""

    config: str
    drafter: str  # the --drafter spec
    kind: str  # "ar" or the drafter kind
    policy: str
    num_draft_tokens: int
    concurrency: int
    requests: int
    output_tokens: int
    wall_s: float
    tokens_per_s: float  # aggregate: output tokens / wall
    per_user_tokens_per_s: float  # mean over requests of len(token_ids) / latency_s
    mal: float  # mean committed tokens per request-step (1.0 for AR)
    mean_depth: float  # verified drafts per request-step
    steps: int
    exec_s_per_step: float  # target verify forward + verification (the report's execute_model), median
    sample_s_per_step: float  # drafting (propose + on_commit) + depth selection (its sample_tokens), median
    seconds: dict[str, float] = field(default_factory=dict)  # whole run, per phase
    slowest_step_s: float = 0.0  # the longest step; over `metrics.STALL_S`: a graph compiled mid-run
    # Per-request latency (closed loop: a request arrives when its client's previous one returns, i.e. at admission):
    # TTFT = admission to the first token (its prefill); TPOT = the seconds per token after it. Percentiles over the
    # point's requests (linear interpolation).
    ttft_p50_s: float = 0.0
    ttft_p95_s: float = 0.0
    tpot_p50_s: float = 0.0
    tpot_p95_s: float = 0.0
    # tokens/s over the AR configuration's at the same concurrency (with `--repeats`: the median of `runs_speedup`)
    speedup: float | None = None
    runs_speedup: tuple[float, ...] = ()  # with `--repeats`: each round's run over the AR run of the same round
    # p95 TPOT over the AR configuration's at the same concurrency (< 1: faster); with `--repeats`, the median over
    # rounds of the ratio of the two runs of a round (`paired_tpot_p95`)
    tpot_p95_vs_ar: float | None = None
    identical: int | None = None  # outputs equal to the AR configuration's (T=0); None without an AR config
    near_ties: int = 0  # other outputs: they part from AR's where the target's best logits nearly tie (eval.lossless)
    # vLLM on the same requests (`angelspec bench --vllm`, vllm.py); None where it was not run or has no equivalent
    vllm_tokens_per_s: float | None = None
    vllm_mal: float | None = None  # vLLM's accepted drafts + 1 per verify step that had drafts
    vllm_identical: int | None = None  # vLLM outputs equal to this configuration's
    runs_tokens_per_s: tuple[float, ...] = ()  # every timed run's tokens/s with `--repeats` (the row is the median)
    runs_tpot_p95_s: tuple[float, ...] = ()  # every timed run's p95 TPOT with `--repeats`, in the same order

    @property
    def lossless_ok(self) -> bool | None:
        """Every output equals AR's or parts from it at a near-tie; None without an AR configuration."""
        return None if self.identical is None else self.identical + self.near_ties == self.requests

    @property
    def vs_vllm(self) -> float | None:
        """Our tokens/s over vLLM's on the same requests (> 1: ours is faster)."""
        return self.tokens_per_s / self.vllm_tokens_per_s if self.vllm_tokens_per_s else None

    @property
    def step_s(self) -> float:
        """Eq. 25's decode-step latency proxy: T_exec + T_sample, the sum of the two medians (as in the report, not
        the median of the steps' sums)."""
        return self.exec_s_per_step + self.sample_s_per_step


def paired_ratio(a: ServingRow, b: ServingRow) -> float | None:
    """a's throughput over b's at one point. With `--repeats` (both rows hold every round's run), the median over rounds
    of the ratio of the two runs of the same round: the runs of a round ran back to back, so a machine whose speed
    drifts from round to round moves both alike and the ratio cancels it; else the two rows' own throughputs. None
    where b measured nothing."""
    return _paired(a.runs_tokens_per_s, b.runs_tokens_per_s, a.tokens_per_s, b.tokens_per_s)


def round_ratios(a: ServingRow, b: ServingRow) -> tuple[float, ...]:
    """Per round of `--repeats`, a's run's throughput over b's run of the same round (() unless both rows hold the
    same number of runs, more than one, and b's all measured something)."""
    return _per_round(a.runs_tokens_per_s, b.runs_tokens_per_s)


def paired_tpot_p95(a: ServingRow, b: ServingRow) -> float | None:
    """a's p95 time per output token over b's at one point. With `--repeats`, the median over rounds of the ratio of
    the two runs of the same round, as for throughput (`paired_ratio`): each row is its median-throughput run, and the
    two rows' runs may come from rounds minutes apart, between which a drifting machine moves a p95 over a few requests
    by more than the 5% a latency goal allows; else the two rows' own p95s. None where b measured nothing."""
    return _paired(a.runs_tpot_p95_s, b.runs_tpot_p95_s, a.tpot_p95_s, b.tpot_p95_s)


def _paired(xa: Sequence[float], xb: Sequence[float], a: float, b: float) -> float | None:
    """The median of xa[i] / xb[i] over rounds (`_per_round`), else a / b; None where b is not positive."""
    rounds = _per_round(xa, xb)
    if rounds:
        return statistics.median(rounds)
    return a / b if b > 0 else None


def _per_round(xa: Sequence[float], xb: Sequence[float]) -> tuple[float, ...]:
    """xa[i] / xb[i] per round (() unless both hold the same number of runs, more than one, and xb's are all > 0)."""
    if len(xa) < 2 or len(xa) != len(xb) or min(xb) <= 0:
        return ()
    return tuple(x / y for x, y in zip(xa, xb, strict=True))


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (q in [0, 100]) of `values` with linear interpolation between ranks (numpy's default);
    0.0 for no values."""
    if not values:
        return 0.0
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def config_names(rows: Sequence[ServingRow]) -> list[str]:
    """The configurations in the order the sweep ran them (first appearance)."""
    return list(dict.fromkeys(r.config for r in rows))


def concurrency_levels(rows: Sequence[ServingRow]) -> list[int]:
    """Every concurrency measured, ascending."""
    return sorted({r.concurrency for r in rows})


def find_row(rows: Sequence[ServingRow], config: str, concurrency: int) -> ServingRow | None:
    """The row of `config` at `concurrency`, None when that point was not measured."""
    return next((r for r in rows if r.config == config and r.concurrency == concurrency), None)


def first_rows(rows: Sequence[ServingRow]) -> dict[str, ServingRow]:
    """config -> its first row (kind, drafter, policy and K are the same in every row of a configuration)."""
    first: dict[str, ServingRow] = {}
    for r in rows:
        first.setdefault(r.config, r)
    return first
