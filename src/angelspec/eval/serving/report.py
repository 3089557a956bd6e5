"""The result of a serving sweep and its tables: `ServingReport` (rows, lookups, the D-cut goal, the markdown
table, results.json / results.md, and through breakeven.py and plots.py the Eq. 25 table and the PNGs).

Per point (a `ServingRow`): aggregate tokens/s = output tokens / wall-clock of the run; per-user tokens/s = the mean
over requests of emitted tokens / (admission to last token); p50 / p95 over requests of the time to first token
(TTFT) and of the time per output token after it (TPOT), and p95 TPOT over the AR run's at the same C; MAL; speed-up
over the AR configuration at the same C (with `--repeats`, the median over rounds of each round's ratio, and their
range: `base.paired_ratio`); mean verified drafts per request-step; per-step seconds of target
verification (`verify`, the report's execute_model) and of drafting + depth selection (`draft` + `select`, its
sample_tokens); and at T=0 whether every output equals the AR configuration's (it must: lossless). With a vLLM
column (vllm.py) four more: vLLM's tokens/s on the same requests, ours / vLLM, vLLM's MAL over its steps with
drafts, and how many of vLLM's outputs equal this configuration's.

Goal (AngelSpec report §4.4): at the highest concurrency, D-cut gives at least +10% throughput over full
verification of the same drafter and K while losing at most 3% MAL.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from angelspec.decoding.metrics import STALL_S
from angelspec.eval.serving.base import ServingRow, concurrency_levels, config_names, find_row, paired_ratio
from angelspec.eval.serving.breakeven import BreakEven, breakeven_json, compute_breakeven, format_breakeven
from angelspec.eval.serving.plots import plot_sweep
from angelspec.fileio import replace_atomic, write_json_atomic

GOAL_GAIN, GOAL_MAL_LOSS = 0.10, 0.03


@dataclass(frozen=True)
class Goal:
    """D-cut against full verification of the same drafter at the highest concurrency."""

    dcut: str
    full: str
    concurrency: int
    gain: float  # tokens/s ratio - 1
    mal_loss: float  # 1 - MAL ratio
    dcut_tps: float
    full_tps: float
    dcut_mal: float
    full_mal: float

    @property
    def met(self) -> bool:
        return self.gain >= GOAL_GAIN and self.mal_loss <= GOAL_MAL_LOSS



@dataclass
class ServingReport:
    """A sweep's settings (printed into results.md and results.json) and its rows, configuration-major."""

    settings: dict[str, Any]
    rows: list[ServingRow]

    # ----- lookups ---------------------------------------------------------------------------
    @property
    def configs(self) -> list[str]:
        return config_names(self.rows)

    @property
    def concurrency(self) -> list[int]:
        return concurrency_levels(self.rows)

    def row(self, config: str, concurrency: int) -> ServingRow | None:
        return find_row(self.rows, config, concurrency)

    # ----- goal ------------------------------------------------------------------------------
    def goal_pair(self) -> tuple[str, str] | None:
        """(D-cut config, full config of the same drafter and K), preferring DFly; None if there is none."""
        pairs = self.goal_pairs()
        return pairs[0] if pairs else None

    def goal_pairs(self) -> list[tuple[str, str]]:
        """Every (D-cut config, full config of the same drafter and K), DFly and the report's D-cut first."""
        from angelspec.decoding.policies.factory import parse_policy

        first = {r.config: r for r in self.rows}
        pairs = []
        for d in first.values():
            if parse_policy(d.policy).kind != "dcut":
                continue
            for f in first.values():
                if (f.policy == "full" and f.drafter == d.drafter and f.num_draft_tokens == d.num_draft_tokens
                        and f.kind != "ar"):
                    spec = parse_policy(d.policy)
                    pairs.append((d.kind != "dfly", spec.arg is not None, spec.max_loss is not None, d.config,
                                  f.config))
                    break
        return [(dcut, full) for *_, dcut, full in sorted(pairs)]

    def goal(self, pair: tuple[str, str] | None = None) -> Goal | None:
        """The goal's numbers for `pair` (default: `goal_pair`)."""
        pair = pair or self.goal_pair()
        if pair is None:
            return None
        dcut, full = pair
        common = [c for c in self.concurrency if self.row(dcut, c) and self.row(full, c)]
        if not common:
            return None
        c = common[-1]
        d, f = self.row(dcut, c), self.row(full, c)
        assert d is not None and f is not None
        return Goal(dcut=dcut, full=full, concurrency=c,
                    gain=d.tokens_per_s / f.tokens_per_s - 1 if f.tokens_per_s else 0.0,
                    mal_loss=1 - d.mal / f.mal if f.mal else 0.0, dcut_tps=d.tokens_per_s, full_tps=f.tokens_per_s,
                    dcut_mal=d.mal, full_mal=f.mal)

    def goal_line(self) -> str:
        text = (f"goal: at the highest concurrency: D-cut >= +{GOAL_GAIN:.0%} throughput over full verification "
                f"with <= {GOAL_MAL_LOSS:.0%} MAL loss")
        goals = [g for g in map(self.goal, self.goal_pairs()) if g is not None]
        if not goals:
            return f"{text}: not evaluated (needs a dcut configuration and a full one with the same drafter)"
        return "\n".join(
            f"{text}: {'MET' if g.met else 'NOT met'} (C={g.concurrency}: {g.dcut} {g.dcut_tps:.1f} tok/s vs "
            f"{g.full} {g.full_tps:.1f} tok/s = {g.gain:+.1%}; MAL {g.dcut_mal:.2f} vs {g.full_mal:.2f} = "
            f"{g.mal_loss:.1%} loss)" for g in goals)

    # ----- the serving setting `auto` ----------------------------------------------------------
    def auto_lines(self) -> list[str]:
        """Per configuration under the policy auto, per C: its throughput over AR's and over the best other
        configuration's (AR included), and its p95 TPOT over AR's; the goals: >= 0.97x AR and >= 0.95x the best."""
        lines = []
        for name in self.configs:
            first = next(r for r in self.rows if r.config == name)
            if not is_auto(first.policy):
                continue
            cells = []
            for c in self.concurrency:
                r = self.row(name, c)
                others = [o for o in self.rows if o.concurrency == c and not is_auto(o.policy)]
                if r is None or not others:
                    continue
                best = max(others, key=lambda o: o.tokens_per_s)
                ratio = paired_ratio(r, best) or 0.0
                ar = "" if r.speedup is None else f"{r.speedup:.2f}x AR, "
                tpot = "" if r.tpot_p95_vs_ar is None else f", p95 TPOT {r.tpot_p95_vs_ar:.2f}x AR's"
                cells.append(f"C={c} {ar}{ratio:.2f}x {best.config}{tpot}")
            if cells:
                lines.append(f"auto ({name}; goals >= 0.97x AR and >= 0.95x the best other config): "
                             + "; ".join(cells))
        return lines

    # ----- Eq. 25 (breakeven.py) ---------------------------------------------------------------
    def breakeven(self, reference: str | None = None) -> BreakEven | None:
        """Eq. 25 for every speculative configuration against `reference` (None = the first MTP
        configuration at full depth, else the first MTP one, else the first speculative one)."""
        return compute_breakeven(self.rows, reference)

    def format_breakeven(self, reference: str | None = None) -> str:
        return format_breakeven(self.rows, reference)

    # ----- output ----------------------------------------------------------------------------
    def to_json(self, reference: str | None = None) -> dict[str, Any]:
        g = self.goal()
        return {
            "format": "angelspec-serving-sweep", "version": 1, "settings": self.settings,
            "rows": [asdict(r) for r in self.rows],
            "breakeven": breakeven_json(self.rows, reference),
            "goal": None if g is None else {**asdict(g), "met": g.met, "line": self.goal_line()},
            "auto": self.auto_lines(),
        }

    @property
    def has_vllm(self) -> bool:
        return any(r.vllm_tokens_per_s is not None for r in self.rows)

    def format_table(self) -> str:
        """A markdown table, readable as plain text too (with the vLLM columns when a row has vLLM's numbers)."""
        head = ["config", "policy", "K", "C", "requests", "tok/s", "per-user tok/s", "speed-up", "MAL",
                "depth", "TTFT p50/p95 ms", "TPOT p50/p95 ms", "TPOT p95 vs AR", "verify ms/step",
                "draft+select ms/step", "lossless"]  # medians over steps (T_exec, T_sample)
        vllm = self.has_vllm
        if vllm:
            head += ["vLLM tok/s", "ours/vLLM", "vLLM MAL", "vLLM = ours"]
        body = []
        for name in self.configs:
            for c in self.concurrency:
                r = self.row(name, c)
                if r is None:
                    continue
                ties = f", {r.near_ties} near-tie{'s' if r.near_ties != 1 else ''}" if r.near_ties else ""
                lossless = "ref" if r.kind == "ar" and r.identical is not None else (
                    "-" if r.identical is None else f"yes{ties and f' ({ties[2:]})'}" if r.lossless_ok
                    else f"NO ({r.requests - r.identical - r.near_ties}/{r.requests} differ{ties})")
                body.append([r.config, r.policy, str(r.num_draft_tokens), str(c), str(r.requests),
                             f"{r.tokens_per_s:.1f}", f"{r.per_user_tokens_per_s:.1f}",
                             _speedup_cell(r), f"{r.mal:.2f}", f"{r.mean_depth:.2f}",
                             f"{r.ttft_p50_s * 1e3:.1f}/{r.ttft_p95_s * 1e3:.1f}",
                             f"{r.tpot_p50_s * 1e3:.2f}/{r.tpot_p95_s * 1e3:.2f}",
                             "-" if r.tpot_p95_vs_ar is None else f"{r.tpot_p95_vs_ar:.2f}x",
                             f"{r.exec_s_per_step * 1e3:.2f}", f"{r.sample_s_per_step * 1e3:.2f}", lossless])
                if vllm:
                    body[-1] += _vllm_cells(r)
        widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(head)]
        fmt = lambda cells: "| " + " | ".join(f"{x:<{w}}" for x, w in zip(cells, widths, strict=True)) + " |"  # noqa: E731
        return "\n".join([fmt(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(fmt, body)])

    def format(self, breakeven: bool = False) -> str:
        s = self.settings
        lines = [f"serving sweep: {s.get('max_new_tokens')} new tokens per request, greedy, closed loop, "
                 f"N = max(4C, {s.get('min_requests')}) requests per point from {s.get('workload_prompts')} "
                 f"prompts ({s.get('workload_domains')})", "", self.format_table(), "", *self._stall_lines(),
                 *self._vllm_lines(), *self.auto_lines(), self.goal_line()]
        if breakeven:
            lines += ["", self.format_breakeven()]
        return "\n".join(lines)

    # ----- files (plots.py) ------------------------------------------------------------------
    def plot(self, out_dir: str | Path) -> tuple[list[Path], str | None]:
        """serving.png (Figure 4's two panels), phases.png (median per-step verify vs draft+select) and latency.png
        (p50 / p95 TTFT and TPOT against concurrency) in `out_dir`.
        Returns (written paths, None) or ([], a one-line reason) when matplotlib is missing."""
        return plot_sweep(self.rows, out_dir, self.goal_pair())

    def write(self, out_dir: str | Path, *, breakeven: bool = False) -> tuple[list[Path], str | None]:
        """results.json, results.md (table, goal, break-even) and the plots into `out_dir`, each atomically.
        Returns (written paths, the plot note or None)."""
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        write_json_atomic(out_dir / "results.json", self.to_json())
        md = ["# Serving sweep", "", "```", *self._settings_lines(), "```", "", self.format_table(), "",
              *self._stall_lines(), *self._vllm_lines(), *self.auto_lines(), self.goal_line(), ""]
        if breakeven:
            md += ["```", self.format_breakeven(), "```", ""]
        replace_atomic(out_dir / "results.md", lambda tmp: tmp.write_text("\n".join(md), encoding="utf-8"))
        plots, note = self.plot(out_dir)
        return [out_dir / "results.json", out_dir / "results.md", *plots], note

    def _stall_lines(self) -> list[str]:
        """A warning per point with a step over `STALL_S` (with a blank line after); [] when there is none."""
        lines = [f"WARNING: {r.config} C={r.concurrency}: one step took {r.slowest_step_s:.1f} s, against a median of "
                 f"{r.exec_s_per_step * 1e3:.1f} ms to verify: a graph compiled mid-run, or the core was taken; this "
                 "point's throughput is not representative (run it again)"
                 for r in self.rows if r.slowest_step_s > STALL_S]
        return [*lines, ""] if lines else []

    def _vllm_lines(self) -> list[str]:
        """What the vLLM columns are (and a failed vLLM run), with a blank line after; [] without vLLM."""
        v = self.settings.get("vllm")
        if not isinstance(v, dict):
            return []
        lines = [f"vLLM columns: vLLM {v.get('version')} ({v.get('python')}), fp32, its default compilation, one "
                 "engine per point with max_num_seqs = C, the same requests after one warm-up generate, timed the "
                 "same way; ours/vLLM > 1: ours is faster; vLLM MAL counts only its steps with drafts; vLLM = ours: "
                 "its outputs equal to this configuration's. Rows with '-': no vLLM equivalent (depth policy, gate, "
                 "model drafter)."]
        if v.get("error"):
            lines.append(f"vLLM column FAILED: {v['error']}")
        return [*lines, ""]

    def _settings_lines(self) -> list[str]:
        lines = []
        for k, v in self.settings.items():
            if k == "configs" and isinstance(v, list):
                lines.append("configs:")
                lines += [f"  {c.get('name')}: drafter {c.get('drafter')}, policy {c.get('policy')}, "
                          f"K={c.get('num_draft_tokens')} ({c.get('kind')})" for c in v if isinstance(c, dict)]
            else:
                lines.append(f"{k}: {v}")
        return lines


def _speedup_cell(r: ServingRow) -> str:
    """'1.10x', or with `--repeats` '1.10x (0.96-1.15)': the median of the rounds' ratios to AR's run of the same round
    and their range (how far this machine's noise moved one round)."""
    if r.speedup is None:
        return "-"
    spread = f" ({min(r.runs_speedup):.2f}-{max(r.runs_speedup):.2f})" if r.runs_speedup else ""
    return f"{r.speedup:.2f}x{spread}"


def _vllm_cells(r: ServingRow) -> list[str]:
    """vLLM tok/s, ours/vLLM, vLLM MAL, vLLM = ours; '-' where vLLM was not run for this row."""
    if r.vllm_tokens_per_s is None:
        return ["-"] * 4
    same = "-" if r.vllm_identical is None else "yes" if r.vllm_identical == r.requests else (
        f"NO ({r.requests - r.vllm_identical}/{r.requests} differ)")
    ratio = r.vs_vllm
    return [f"{r.vllm_tokens_per_s:.1f}", "-" if ratio is None else f"{ratio:.2f}x",
            "-" if r.vllm_mal is None else f"{r.vllm_mal:.2f}", same]


def lossless(report: ServingReport) -> bool | None:
    """True when every checked output equals AR's or parts from it at a near-tie of the target's logits
    (`eval.lossless`), None when nothing was checked (no AR configuration)."""
    checked = [r for r in report.rows if r.identical is not None]
    return None if not checked else all(r.lossless_ok for r in checked)


def is_auto(policy: str) -> bool:
    """Whether a row's policy spec is the serving setting `auto` (with or without its `slack=S`)."""
    return policy.partition(":")[0].strip().lower() == "auto"
