"""Closed-loop serving benchmark: aggregate and per-user throughput against concurrency, for AR and for drafters
under any depth policy (AngelSpec report §4.4, Figure 4; §5, Eq. 25 and Table 8 in miniature).

    base.py       ServingError, ServingRow (one measured point) and lookups over rows
    sweep.py      configurations, the workload, running every configuration at every concurrency, `bench`
    report.py     ServingReport: the D-cut goal, the table, results.json / results.md, `lossless`
    breakeven.py  the break-even committed length C_BE (Eq. 25)
    plots.py      serving.png, phases.png and latency.png (matplotlib, optional, imported only when plotting)
"""

from angelspec.eval.serving.base import ServingError, ServingRow
from angelspec.eval.serving.breakeven import REFERENCE_COMMIT, BreakEven, compute_breakeven, format_breakeven
from angelspec.eval.serving.plots import BENCH_EXTRA_HINT, plot_sweep
from angelspec.eval.serving.report import GOAL_GAIN, GOAL_MAL_LOSS, Goal, ServingReport, lossless
from angelspec.eval.serving.sweep import (
    DEFAULT_CONCURRENCY,
    DEFAULT_MAX_NEW_TOKENS,
    DEFAULT_MIN_REQUESTS,
    DEFAULT_SERVING_POLICY,
    DRAFTER_MAX_DEPTH,
    EXEC_PHASES,
    MAX_CONCURRENCY,
    SAMPLE_PHASES,
    BenchSettings,
    Contender,
    ServingConfig,
    bench,
    build_contenders,
    check_configs,
    interleave_domains,
    parse_concurrency,
    parse_config,
    run_point,
    run_sweep,
    serving_workload,
    warm_up,
)

__all__ = ["BENCH_EXTRA_HINT", "DEFAULT_CONCURRENCY", "DEFAULT_MAX_NEW_TOKENS", "DEFAULT_MIN_REQUESTS",
           "DEFAULT_SERVING_POLICY", "DRAFTER_MAX_DEPTH", "EXEC_PHASES",
           "GOAL_GAIN", "GOAL_MAL_LOSS", "MAX_CONCURRENCY", "REFERENCE_COMMIT", "SAMPLE_PHASES", "BenchSettings",
           "BreakEven", "Contender", "Goal", "ServingConfig", "ServingError", "ServingReport", "ServingRow", "bench",
           "build_contenders", "check_configs", "compute_breakeven", "format_breakeven", "interleave_domains",
           "lossless", "parse_concurrency", "parse_config", "plot_sweep", "run_point", "run_sweep",
           "serving_workload", "warm_up"]
