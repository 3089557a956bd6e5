"""PNG plots of a serving sweep: serving.png (AngelSpec report §4.4, Figure 4's two panels: throughput against
per-user speed and against concurrency), phases.png (median per-step T_exec = verify and T_sample =
draft + select, the drafter's on_commit included: the two terms of Eq. 25) and latency.png (p50 / p95 time per
output token and time to first token against concurrency). matplotlib is an optional dependency
(the `bench` extra), imported only when plotting.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from angelspec.eval.serving.base import ServingRow, concurrency_levels, config_names, find_row
from angelspec.fileio import replace_atomic

BENCH_EXTRA_HINT = "pip install 'angelspec[bench]'"


def plot_sweep(rows: Sequence[ServingRow], out_dir: str | Path,
               pair: tuple[str, str] | None = None) -> tuple[list[Path], str | None]:
    """serving.png (Figure 4's two panels), phases.png (median per-step verify vs draft+select) and latency.png (p50 /
    p95 TPOT and TTFT) in `out_dir`;
    `pair` = (D-cut config, full config) labels the D-cut curve with its gain over full verification.
    Returns (written paths, None) or ([], a one-line reason) when matplotlib is missing."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return [], f"plots skipped: matplotlib is not installed ({BENCH_EXTRA_HINT})"
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    concurrency = concurrency_levels(rows)
    fig = Figure(figsize=(12, 4.8), layout="constrained")
    ax_frontier, ax_conc = fig.subplots(1, 2)
    for name in config_names(rows):
        series = _series(rows, name, concurrency)
        tps = [r.tokens_per_s for r in series]
        (line,) = ax_frontier.plot([r.per_user_tokens_per_s for r in series], tps, marker="o", label=name)
        for r in series:
            ax_frontier.annotate(f"c{r.concurrency}", (r.per_user_tokens_per_s, r.tokens_per_s), fontsize=7,
                                 textcoords="offset points", xytext=(3, 3), color=line.get_color())
        ax_conc.plot([r.concurrency for r in series], tps, marker="o", label=name, color=line.get_color())
        if pair is not None and name == pair[0]:
            for r in series:
                f = find_row(rows, pair[1], r.concurrency)
                if f is not None and f.tokens_per_s > 0:
                    ax_conc.annotate(f"{r.tokens_per_s / f.tokens_per_s - 1:+.0%}", (r.concurrency, r.tokens_per_s),
                                     fontsize=7, textcoords="offset points", xytext=(0, 6), ha="center",
                                     color=line.get_color())
    ax_frontier.set(xlabel="per-user decode speed (tokens/s)", ylabel="aggregate throughput (tokens/s)",
                    title="(a) throughput vs per-user speed")
    ax_conc.set(xlabel="concurrency (requests)", ylabel="aggregate throughput (tokens/s)",
                title="(b) throughput vs concurrency" + (f" (labels: {pair[0]} vs {pair[1]})" if pair else ""))
    _concurrency_axis(ax_conc, concurrency)
    for ax in (ax_frontier, ax_conc):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    paths = [_save(fig, out_dir / "serving.png")]

    fig = Figure(figsize=(12, 4.8), layout="constrained")
    ax_exec, ax_sample = fig.subplots(1, 2)
    for name in config_names(rows):
        series = _series(rows, name, concurrency)
        xs = [r.concurrency for r in series]
        ax_exec.plot(xs, [r.exec_s_per_step * 1e3 for r in series], marker="o", label=name)
        ax_sample.plot(xs, [r.sample_s_per_step * 1e3 for r in series], marker="o", label=name)
    ax_exec.set(xlabel="concurrency (requests)", ylabel="median ms per step", title="target verify (T_exec)")
    ax_sample.set(xlabel="concurrency (requests)", ylabel="median ms per step",
                  title="draft (propose + on_commit) + select (T_sample)")
    for ax in (ax_exec, ax_sample):
        _concurrency_axis(ax, concurrency)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    paths.append(_save(fig, out_dir / "phases.png"))

    fig = Figure(figsize=(12, 4.8), layout="constrained")
    ax_tpot, ax_ttft = fig.subplots(1, 2)
    for name in config_names(rows):
        series = _series(rows, name, concurrency)
        xs = [r.concurrency for r in series]
        (line,) = ax_tpot.plot(xs, [r.tpot_p50_s * 1e3 for r in series], marker="o", label=f"{name} p50")
        ax_tpot.plot(xs, [r.tpot_p95_s * 1e3 for r in series], marker="^", linestyle="--", color=line.get_color(),
                     label=f"{name} p95")
        ax_ttft.plot(xs, [r.ttft_p50_s * 1e3 for r in series], marker="o", color=line.get_color(), label=f"{name} p50")
        ax_ttft.plot(xs, [r.ttft_p95_s * 1e3 for r in series], marker="^", linestyle="--", color=line.get_color(),
                     label=f"{name} p95")
    ax_tpot.set(xlabel="concurrency (requests)", ylabel="ms per output token", title="time per output token (TPOT)")
    ax_ttft.set(xlabel="concurrency (requests)", ylabel="ms", title="time to first token (TTFT)")
    for ax in (ax_tpot, ax_ttft):
        _concurrency_axis(ax, concurrency)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    paths.append(_save(fig, out_dir / "latency.png"))
    return paths, None


def _series(rows: Sequence[ServingRow], config: str, concurrency: Sequence[int]) -> list[ServingRow]:
    """`config`'s rows in ascending concurrency."""
    return [r for c in concurrency if (r := find_row(rows, config, c)) is not None]


def _concurrency_axis(ax: Any, concurrency: Sequence[int]) -> None:
    """A log2 x axis ticked at the measured concurrency values (left linear for a single value)."""
    if len(concurrency) > 1:
        ax.set_xscale("log", base=2)
        ax.set_xticks(concurrency, [str(c) for c in concurrency])


def _save(fig: Any, path: Path) -> Path:
    replace_atomic(path, lambda tmp: fig.savefig(tmp, format="png", dpi=120))
    return path
