"""Closed-loop serving sweep: aggregate and per-user throughput against concurrency, for AR and for drafters
under any depth policy (AngelSpec report §4.4, Figure 4; §5, Eq. 25 and Table 8 in miniature).

Protocol, per configuration (name, drafter or None, policy spec) and concurrency C:

* N = max(2C, min_requests) requests drawn round-robin from a mixed chat / code / math workload (the shipped
  held-out prompts by default, interleaved by domain), greedy (T=0), every request exactly `max_new_tokens`
  new tokens (stop tokens ignored, like a benchmark client with ignore_eos), so every configuration does the
  same work.
* One `SpecEngine` with max_batch_size=C runs all N: continuous batching, so a finished request's row takes
  the next queued one at once, which is C closed-loop clients that each send their next request as soon as
  the last one returns.
* Each configuration decodes one short untimed batch first (warm-up); cost tables for the budget policies
  are loaded or profiled before anything is timed.

Per point: aggregate tokens/s = output tokens / wall-clock of the run; per-user tokens/s = the mean over
requests of emitted tokens / (admission to last token); MAL; speed-up over the AR configuration at the
same C; mean verified drafts per request-step; per-step seconds of target verification (`verify`, the
report's execute_model) and of drafting + depth selection (`draft` + `select`, its sample_tokens); and
at T=0 whether every output equals the AR configuration's (it must: lossless).

Break-even committed length (Eq. 25): C_BE_m(b) = 3 (T_exec,m(b) + T_sample,m(b)) / (T_exec,ref(b) +
T_sample,ref(b)), the reference being an MTP configuration when one is present (the report's Hy3-MTP3,
assumed to commit 3 tokens per step), else the first speculative configuration; we also give the variant
that uses the reference's measured MAL instead of 3. A method is predicted to beat the reference at
concurrency b when its measured MAL exceeds C_BE_m(b).

Shape legend: C concurrent requests (engine rows), N requests per point, K drafts proposed per step.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from angelspec.assets import EVAL_PROMPTS
from angelspec.fileio import replace_atomic, write_json_atomic

if TYPE_CHECKING:
    from angelspec.decoding.drafters.base import Drafter
    from angelspec.decoding.policies.base import DepthPolicy
    from angelspec.eval.speculative import EvalPrompt
    from angelspec.models.decoder import Decoder

DEFAULT_CONCURRENCY: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
DEFAULT_MIN_REQUESTS = 8
MAX_CONCURRENCY = 4096
DRAFTER_MAX_DEPTH = -1  # ServingConfig.num_draft_tokens: K = the drafter's own maximum (block size - 1)
REFERENCE_COMMIT = 3.0  # tokens per step the report assumes for its MTP3 reference (Eq. 25)
GOAL_GAIN, GOAL_MAL_LOSS = 0.10, 0.03
BENCH_EXTRA_HINT = "pip install 'angelspec[bench]'"
EXEC_PHASES, SAMPLE_PHASES = ("verify",), ("draft", "select")


class ServingError(ValueError):
    """Serving-benchmark input that cannot be used: configurations, concurrency values, workload."""


# --------------------------------------------------------------------------------------------------
# Configurations
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ServingConfig:
    """One curve of the sweep: `drafter` as `--drafter` takes it ("none" = AR), `policy` a depth-policy spec,
    `num_draft_tokens` K (None = the sweep's default, DRAFTER_MAX_DEPTH = the drafter's `max_draft_tokens`;
    ignored for AR)."""

    name: str
    drafter: str = "none"
    policy: str = "full"
    num_draft_tokens: int | None = None

    @property
    def is_ar(self) -> bool:
        return self.drafter == "none"


def parse_config(text: str) -> ServingConfig:
    """`NAME=SPEC[@POLICY]` -> ServingConfig (SPEC as `--drafter` takes it, `none` for AR; POLICY default full)."""
    from angelspec.decoding.policies.factory import parse_policy

    name, sep, rest = text.partition("=")
    name, rest = name.strip(), rest.strip()
    if not sep or not name or not rest:
        raise ServingError(f"--config {text!r}: expected NAME=SPEC[@POLICY], e.g. AR=none, DFly=dfly:DIR or "
                           "DFly+D-cut=dfly:DIR@dcut")
    spec, at, policy = rest.rpartition("@")
    if not at:
        spec, policy = rest, "full"
    if not spec.strip():
        raise ServingError(f"--config {text!r}: the drafter SPEC before '@' is empty; expected NAME=SPEC[@POLICY]")
    parse_policy(policy)  # PolicyError names the valid forms
    return ServingConfig(name=name, drafter=spec.strip(), policy=policy.strip())


def parse_concurrency(text: str) -> tuple[int, ...]:
    """'1,2,4' -> (1, 2, 4): distinct positive integers, sorted."""
    values = []
    for part in text.split(","):
        try:
            c = int(part.strip())
        except ValueError:
            raise ServingError(f"--concurrency {text!r}: {part.strip()!r} is not an integer; give comma-separated "
                               f"request counts such as {','.join(map(str, DEFAULT_CONCURRENCY))}") from None
        if not 1 <= c <= MAX_CONCURRENCY:
            raise ServingError(f"--concurrency {text!r}: {c} is not a usable number of concurrent requests "
                               f"(1..{MAX_CONCURRENCY})")
        values.append(c)
    if len(set(values)) != len(values):
        raise ServingError(f"--concurrency {text!r} lists a value twice")
    return tuple(sorted(values))


def check_configs(configs: Sequence[ServingConfig]) -> None:
    """Refuse an empty list and duplicate names (each name is one curve and one key of results.json)."""
    if not configs:
        raise ServingError("no configuration to benchmark; pass --config NAME=SPEC[@POLICY] at least once")
    seen: set[str] = set()
    for c in configs:
        if c.name in seen:
            raise ServingError(f"configuration name {c.name!r} is used twice; give every --config its own NAME")
        seen.add(c.name)
        if c.is_ar and c.policy != "full":
            raise ServingError(f"configuration {c.name!r}: AR (drafter none) has no drafts to verify, so its "
                               f"policy must be full, not {c.policy!r}")


@dataclass
class Contender:
    """A configuration with its drafter loaded and its depth policy built (cost table ready)."""

    config: ServingConfig
    drafter: Drafter | None
    policy: DepthPolicy | None
    num_draft_tokens: int  # K (0 for AR)
    kind: str  # "ar" or the drafter's registry kind (mtp, dfly, ...)


def build_contenders(target: Decoder, target_dir: Path, configs: Sequence[ServingConfig], *,
                     concurrency: Sequence[int], num_draft_tokens: int = 4,
                     cost_table_path: str | Path | None = None,
                     log: Callable[[str], None] | None = print) -> list[Contender]:
    """Load every drafter (checked against the target) and build every policy before anything is timed.
    Budget policies get a cost table covering every concurrency of the sweep (profiled once per drafter
    and cached; see `spec.policies.make_policy`)."""
    from angelspec.decoding.loading import resolve_drafter
    from angelspec.decoding.policies.costmodel import drafter_id
    from angelspec.decoding.policies.factory import make_policy, parse_policy

    check_configs(configs)
    drafters: dict[str, Drafter | None] = {}
    warmed: set[str] = set()
    out = []
    for c in configs:
        if c.drafter not in drafters:
            drafters[c.drafter] = resolve_drafter(c.drafter, target, target_dir)
        drafter = drafters[c.drafter]
        inner = getattr(drafter, "inner", drafter)
        k = 0 if drafter is None else (c.num_draft_tokens or num_draft_tokens)
        if k == DRAFTER_MAX_DEPTH:
            k = int(getattr(inner, "max_draft_tokens", num_draft_tokens))
        if drafter is not None:
            check = getattr(inner, "check_depth", None)
            if callable(check):
                try:
                    check(k)
                except ValueError as e:
                    raise ServingError(f"configuration {c.name!r}: {e}") from None
        if drafter is not None and parse_policy(c.policy).needs_cost_model and c.drafter not in warmed:
            _warm_drafter(target, drafter, max(k, 1))  # a cold first profile cell would skew the cost table
            warmed.add(c.drafter)
        policy = make_policy(c.policy, target=target, drafter=drafter, num_draft_tokens=max(k, 1),
                             cost_table_path=cost_table_path, batch_sizes=sorted(set(concurrency)), log=log)
        kind = "ar" if drafter is None else drafter_id(drafter).split(":")[0]
        out.append(Contender(config=c, drafter=drafter, policy=policy, num_draft_tokens=k, kind=kind))
    return out


def _warm_drafter(target: Decoder, drafter: Drafter, k: int, tokens: int = 8) -> None:
    """A few untimed speculative steps on one synthetic prompt (first forwards, allocator growth)."""
    from angelspec.decoding.engine import EngineConfig, Request, SpecEngine

    prompt = [i % target.config.vocab_size for i in range(1, 17)]
    SpecEngine(target, drafter, EngineConfig(max_batch_size=1, num_draft_tokens=k, max_seq_len=len(prompt) + tokens)
               ).generate([Request(prompt_ids=prompt, max_new_tokens=tokens, stop_ids=())])


# --------------------------------------------------------------------------------------------------
# Workload
# --------------------------------------------------------------------------------------------------
def serving_workload(tokenizer: Any, context: int, max_new_tokens: int, prompts_path: str | Path = EVAL_PROMPTS,
                     think: bool = False) -> list[EvalPrompt]:
    """Every prompt of `prompts_path` that leaves room for `max_new_tokens`, rendered with the chat template
    and interleaved round-robin across domains (code, math, chat, code, ...), so any prefix of the list and
    any window of it mixes the domains."""
    from angelspec.data.prompts import load_prompts
    from angelspec.eval.speculative import ALL, EvalPrompt

    kept: list[EvalPrompt] = []
    too_long = 0
    for p in load_prompts(prompts_path):
        ids = tokenizer.apply_chat_template(p["messages"], add_generation_prompt=True, enable_thinking=think)
        if len(ids) + max_new_tokens > context:
            too_long += 1
            continue
        domain = p["record"].get("domain", ALL)
        domain = domain if isinstance(domain, str) and domain else ALL
        kept.append(EvalPrompt(ids=list(ids), domain=domain, line=p["line"]))
    if not kept:
        raise ServingError(f"no prompt of {prompts_path} fits the target's context of {context} tokens with "
                           f"{max_new_tokens} new tokens ({too_long} too long); lower --max-new-tokens")
    return interleave_domains(kept)


def interleave_domains(prompts: Sequence[EvalPrompt]) -> list[EvalPrompt]:
    """Round-robin over domains in order of first appearance: [c0, c1, m0, h0] -> [c0, m0, h0, c1]."""
    by_domain: dict[str, list[EvalPrompt]] = {}
    for p in prompts:
        by_domain.setdefault(p.domain, []).append(p)
    queues = list(by_domain.values())
    mixed: list[EvalPrompt] = []
    for i in range(max(len(q) for q in queues)):
        mixed += [q[i] for q in queues if i < len(q)]
    return mixed


# --------------------------------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ServingRow:
    """One (configuration, concurrency) point. Seconds per step are per batched engine step."""

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
    exec_s_per_step: float  # target verify forward + verification (the report's execute_model)
    sample_s_per_step: float  # drafting + depth selection (the report's sample_tokens)
    seconds: dict[str, float] = field(default_factory=dict)  # whole run, per phase
    speedup: float | None = None  # tokens/s over the AR configuration's at the same concurrency
    identical: int | None = None  # outputs equal to the AR configuration's (T=0); None without an AR config

    @property
    def step_s(self) -> float:
        """Eq. 25's decode-step latency proxy: T_exec + T_sample."""
        return self.exec_s_per_step + self.sample_s_per_step


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


@dataclass(frozen=True)
class BreakEven:
    """Eq. 25 per concurrency: values[config][C] = C_BE with the report's 3-token reference,
    measured_ref[config][C] = the same with the reference's measured MAL instead of 3."""

    reference: str
    why: str
    values: dict[str, dict[int, float]]
    measured_ref: dict[str, dict[int, float]]
    mal: dict[str, dict[int, float]]


@dataclass
class ServingReport:
    settings: dict[str, Any]
    rows: list[ServingRow]

    # ----- lookups ---------------------------------------------------------------------------
    @property
    def configs(self) -> list[str]:
        return list(dict.fromkeys(r.config for r in self.rows))

    @property
    def concurrency(self) -> list[int]:
        return sorted({r.concurrency for r in self.rows})

    def row(self, config: str, concurrency: int) -> ServingRow | None:
        return next((r for r in self.rows if r.config == config and r.concurrency == concurrency), None)

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

    # ----- Eq. 25 ----------------------------------------------------------------------------
    def breakeven(self, reference: str | None = None) -> BreakEven | None:
        """Eq. 25 for every speculative configuration against `reference` (None = the first MTP
        configuration at full depth, else the first MTP one, else the first speculative one)."""
        spec = [c for c in self.configs if self._first(c).kind != "ar"]
        if not spec:
            return None
        if reference is not None:
            if reference not in spec:
                raise ServingError(f"break-even reference {reference!r} is not a speculative configuration of this "
                                   f"sweep ({', '.join(spec) or 'none'})")
            why = "chosen"
        else:
            mtp = [c for c in spec if self._first(c).kind == "mtp"]
            full_mtp = [c for c in mtp if self._first(c).policy == "full"]
            reference = (full_mtp or mtp or spec)[0]
            why = "the MTP configuration" if mtp else "no MTP configuration in the sweep: the first speculative one"
        values: dict[str, dict[int, float]] = {}
        measured: dict[str, dict[int, float]] = {}
        mal: dict[str, dict[int, float]] = {}
        for name in spec:
            values[name], measured[name], mal[name] = {}, {}, {}
            for c in self.concurrency:
                m, ref = self.row(name, c), self.row(reference, c)
                if m is None or ref is None or ref.step_s <= 0:
                    continue
                ratio = m.step_s / ref.step_s
                values[name][c] = REFERENCE_COMMIT * ratio
                measured[name][c] = ref.mal * ratio
                mal[name][c] = m.mal
        return BreakEven(reference=reference, why=why, values=values, measured_ref=measured, mal=mal)

    def format_breakeven(self, reference: str | None = None) -> str:
        be = self.breakeven(reference)
        if be is None:
            return "break-even committed length (Eq. 25): no speculative configuration"
        names = list(be.values)
        w = max(15, *(len(n) + 3 for n in names))
        lines = [f"break-even committed length C_BE (Eq. 25): reference {be.reference!r} ({be.why}), assumed to "
                 f"commit {REFERENCE_COMMIT:g} tokens per step as in the report; per cell: C_BE / measured MAL "
                 "(the method is predicted to beat the reference where MAL > C_BE). T_exec = verify, "
                 "T_sample = draft + select, per step.",
                 f"{'C':>5}" + "".join(f"{n:>{w}}" for n in names)]
        for c in self.concurrency:
            cells = "".join(f"{_be_cell(be.values[n].get(c), be.mal[n].get(c)):>{w}}" for n in names)
            lines.append(f"{c:>5}{cells}")
        avg = "".join(f"{_be_cell(_mean(be.values[n].values()), _mean(be.mal[n].values())):>{w}}" for n in names)
        lines.append(f"{'Avg.':>5}{avg}")
        lines.append("with the reference's measured MAL instead of 3: "
                     + "; ".join(f"{n} {_mean(be.measured_ref[n].values()):.2f}" for n in names if n != be.reference))
        return "\n".join(lines)

    # ----- output ----------------------------------------------------------------------------
    def to_json(self, reference: str | None = None) -> dict[str, Any]:
        be = self.breakeven(reference)
        g = self.goal()
        return {
            "format": "angelspec-serving-sweep", "version": 1, "settings": self.settings,
            "rows": [asdict(r) for r in self.rows],
            "breakeven": None if be is None else {
                "reference": be.reference, "why": be.why, "reference_commit": REFERENCE_COMMIT,
                "values": {n: {str(c): v for c, v in d.items()} for n, d in be.values.items()},
                "with_measured_reference_mal": {n: {str(c): v for c, v in d.items()}
                                                for n, d in be.measured_ref.items()}},
            "goal": None if g is None else {**asdict(g), "met": g.met, "line": self.goal_line()},
        }

    def format_table(self) -> str:
        """A markdown table, readable as plain text too."""
        head = ["config", "policy", "K", "C", "requests", "tok/s", "per-user tok/s", "speed-up", "MAL",
                "depth", "verify ms/step", "draft+select ms/step", "lossless"]
        body = []
        for name in self.configs:
            for c in self.concurrency:
                r = self.row(name, c)
                if r is None:
                    continue
                lossless = "ref" if r.kind == "ar" and r.identical is not None else (
                    "-" if r.identical is None else "yes" if r.identical == r.requests
                    else f"NO ({r.requests - r.identical}/{r.requests} differ)")
                body.append([r.config, r.policy, str(r.num_draft_tokens), str(c), str(r.requests),
                             f"{r.tokens_per_s:.1f}", f"{r.per_user_tokens_per_s:.1f}",
                             "-" if r.speedup is None else f"{r.speedup:.2f}x", f"{r.mal:.2f}", f"{r.mean_depth:.2f}",
                             f"{r.exec_s_per_step * 1e3:.2f}", f"{r.sample_s_per_step * 1e3:.2f}", lossless])
        widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(head)]
        fmt = lambda cells: "| " + " | ".join(f"{x:<{w}}" for x, w in zip(cells, widths, strict=True)) + " |"  # noqa: E731
        return "\n".join([fmt(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(fmt, body)])

    def format(self, breakeven: bool = False) -> str:
        s = self.settings
        lines = [f"serving sweep: {s.get('max_new_tokens')} new tokens per request, greedy, closed loop, "
                 f"N = max(2C, {s.get('min_requests')}) requests per point from {s.get('workload_prompts')} "
                 f"prompts ({s.get('workload_domains')})", "", self.format_table(), "", self.goal_line()]
        if breakeven:
            lines += ["", self.format_breakeven()]
        return "\n".join(lines)

    def _first(self, config: str) -> ServingRow:
        return next(r for r in self.rows if r.config == config)

    # ----- plots -----------------------------------------------------------------------------
    def plot(self, out_dir: str | Path) -> tuple[list[Path], str | None]:
        """serving.png (Figure 4's two panels) and phases.png (per-step verify vs draft+select) in `out_dir`.
        Returns (written paths, None) or ([], a one-line reason) when matplotlib is missing."""
        try:
            from matplotlib.figure import Figure
        except ImportError:
            return [], f"plots skipped: matplotlib is not installed ({BENCH_EXTRA_HINT})"
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        pair = self.goal_pair()
        fig = Figure(figsize=(12, 4.8), layout="constrained")
        ax_frontier, ax_conc = fig.subplots(1, 2)
        for name in self.configs:
            rows = [r for c in self.concurrency if (r := self.row(name, c)) is not None]
            tps = [r.tokens_per_s for r in rows]
            (line,) = ax_frontier.plot([r.per_user_tokens_per_s for r in rows], tps, marker="o", label=name)
            for r in rows:
                ax_frontier.annotate(f"c{r.concurrency}", (r.per_user_tokens_per_s, r.tokens_per_s), fontsize=7,
                                     textcoords="offset points", xytext=(3, 3), color=line.get_color())
            ax_conc.plot([r.concurrency for r in rows], tps, marker="o", label=name, color=line.get_color())
            if pair is not None and name == pair[0]:
                for r in rows:
                    f = self.row(pair[1], r.concurrency)
                    if f is not None and f.tokens_per_s > 0:
                        ax_conc.annotate(f"{r.tokens_per_s / f.tokens_per_s - 1:+.0%}", (r.concurrency, r.tokens_per_s),
                                         fontsize=7, textcoords="offset points", xytext=(0, 6), ha="center",
                                         color=line.get_color())
        ax_frontier.set(xlabel="per-user decode speed (tokens/s)", ylabel="aggregate throughput (tokens/s)",
                        title="(a) throughput vs per-user speed")
        ax_conc.set(xlabel="concurrency (requests)", ylabel="aggregate throughput (tokens/s)",
                    title="(b) throughput vs concurrency" + (f" (labels: {pair[0]} vs {pair[1]})" if pair else ""))
        if len(self.concurrency) > 1:
            ax_conc.set_xscale("log", base=2)
            ax_conc.set_xticks(self.concurrency, [str(c) for c in self.concurrency])
        for ax in (ax_frontier, ax_conc):
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        paths = [_save(fig, out_dir / "serving.png")]

        fig = Figure(figsize=(12, 4.8), layout="constrained")
        ax_exec, ax_sample = fig.subplots(1, 2)
        for name in self.configs:
            rows = [r for c in self.concurrency if (r := self.row(name, c)) is not None]
            xs = [r.concurrency for r in rows]
            ax_exec.plot(xs, [r.exec_s_per_step * 1e3 for r in rows], marker="o", label=name)
            ax_sample.plot(xs, [r.sample_s_per_step * 1e3 for r in rows], marker="o", label=name)
        ax_exec.set(xlabel="concurrency (requests)", ylabel="ms per step", title="target verify (T_exec)")
        ax_sample.set(xlabel="concurrency (requests)", ylabel="ms per step", title="draft + select (T_sample)")
        for ax in (ax_exec, ax_sample):
            if len(self.concurrency) > 1:
                ax.set_xscale("log", base=2)
                ax.set_xticks(self.concurrency, [str(c) for c in self.concurrency])
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        paths.append(_save(fig, out_dir / "phases.png"))
        return paths, None

    def write(self, out_dir: str | Path, *, breakeven: bool = False) -> tuple[list[Path], str | None]:
        """results.json, results.md (table, goal, break-even) and the plots into `out_dir`, each atomically.
        Returns (written paths, the plot note or None)."""
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        write_json_atomic(out_dir / "results.json", self.to_json())
        md = ["# Serving sweep", "", "```", *self._settings_lines(), "```", "", self.format_table(), "",
              self.goal_line(), ""]
        if breakeven:
            md += ["```", self.format_breakeven(), "```", ""]
        replace_atomic(out_dir / "results.md", lambda tmp: tmp.write_text("\n".join(md), encoding="utf-8"))
        plots, note = self.plot(out_dir)
        return [out_dir / "results.json", out_dir / "results.md", *plots], note

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


def _save(fig: Any, path: Path) -> Path:
    replace_atomic(path, lambda tmp: fig.savefig(tmp, format="png", dpi=120))
    return path


def _mean(values: Any) -> float | None:
    values = list(values)
    return statistics.fmean(values) if values else None


def _be_cell(value: float | None, mal: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.2f}" + ("" if mal is None else f" / {mal:.2f}")


# --------------------------------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------------------------------
def _requests(workload: Sequence[EvalPrompt], n: int, max_new_tokens: int, budget: int | None = None) -> list[Any]:
    from angelspec.decoding.engine import Request

    return [Request(prompt_ids=workload[i % len(workload)].ids, max_new_tokens=budget or max_new_tokens, stop_ids=(),
                    request_id=i) for i in range(n)]


def run_point(target: Decoder, contender: Contender, workload: Sequence[EvalPrompt], concurrency: int, *,
              max_new_tokens: int, min_requests: int = DEFAULT_MIN_REQUESTS) -> tuple[ServingRow, list[list[int]]]:
    """N = max(2C, min_requests) requests through one engine with max_batch_size = C; -> (row without
    speed-up / lossless columns, the emitted tokens per request)."""
    n = max(2 * concurrency, min_requests)
    engine, requests = _engine(target, contender, workload, concurrency, n, max_new_tokens)
    results = engine.generate(requests)
    m = engine.metrics
    steps = max(m.steps, 1)
    per_user = statistics.fmean(len(r.token_ids) / r.latency_s if r.latency_s > 0 else 0.0 for r in results)
    depth = sum(d * c for d, c in enumerate(m.depth_hist)) / m.row_steps if m.row_steps else 0.0
    c = contender.config
    row = ServingRow(config=c.name, drafter=c.drafter, kind=contender.kind, policy=c.policy,
                     num_draft_tokens=contender.num_draft_tokens, concurrency=concurrency, requests=n,
                     output_tokens=m.output_tokens, wall_s=m.wall_s, tokens_per_s=m.tokens_per_s,
                     per_user_tokens_per_s=per_user, mal=m.mean_accepted_length, mean_depth=depth, steps=m.steps,
                     exec_s_per_step=sum(m.seconds.get(p, 0.0) for p in EXEC_PHASES) / steps,
                     sample_s_per_step=sum(m.seconds.get(p, 0.0) for p in SAMPLE_PHASES) / steps,
                     seconds=dict(m.seconds))
    return row, [list(map(int, r.token_ids)) for r in results]


def warm_up(target: Decoder, contender: Contender, workload: Sequence[EvalPrompt], *, batch: int,
            tokens: int) -> None:
    """One short untimed batch (allocator growth, kernel selection, the drafter's first forward)."""
    if tokens <= 0:
        return
    engine, requests = _engine(target, contender, workload, batch, batch, tokens)
    engine.generate(requests)


def _engine(target: Decoder, contender: Contender, workload: Sequence[EvalPrompt], concurrency: int, n: int,
            max_new_tokens: int) -> tuple[Any, list[Any]]:
    """A `SpecEngine` with `concurrency` rows for the contender, and n requests of the workload."""
    from angelspec.decoding.engine import EngineConfig, SpecEngine

    requests = _requests(workload, n, max_new_tokens)
    max_len = max(len(r.prompt_ids) for r in requests) + max_new_tokens
    engine = SpecEngine(target, contender.drafter,
                        EngineConfig(max_batch_size=concurrency, max_seq_len=max_len,
                                     num_draft_tokens=contender.num_draft_tokens),
                        depth_policy=contender.policy)
    return engine, requests


def run_sweep(target: Decoder, contenders: Sequence[Contender], workload: Sequence[EvalPrompt], *,
              concurrency: Sequence[int] = DEFAULT_CONCURRENCY, max_new_tokens: int = 64,
              min_requests: int = DEFAULT_MIN_REQUESTS, warmup_tokens: int = 8,
              log: Callable[[str], None] | None = print, settings: dict[str, Any] | None = None) -> ServingReport:
    """Every contender at every concurrency (contender-major, each warmed up once); speed-up and the
    lossless check against the first AR contender at the same concurrency."""
    if max_new_tokens < 1 or min_requests < 1 or warmup_tokens < 0:
        raise ServingError(f"need max_new_tokens >= 1, min_requests >= 1, warmup_tokens >= 0; got {max_new_tokens}, "
                           f"{min_requests}, {warmup_tokens}")
    if not workload:
        raise ServingError("empty workload")
    concurrency = sorted(set(concurrency))
    raw: list[tuple[ServingRow, list[list[int]]]] = []
    for ct in contenders:
        warm_up(target, ct, workload, batch=min(max(concurrency), 8), tokens=warmup_tokens)
        for c in concurrency:
            t0 = time.perf_counter()
            row, outputs = run_point(target, ct, workload, c, max_new_tokens=max_new_tokens, min_requests=min_requests)
            raw.append((row, outputs))
            if log is not None:
                log(f"{ct.config.name} C={c}: {row.tokens_per_s:.1f} tok/s, per-user {row.per_user_tokens_per_s:.1f} "
                    f"tok/s, MAL {row.mal:.2f} ({time.perf_counter() - t0:.1f} s)")
    ar_name = next((ct.config.name for ct in contenders if ct.drafter is None), None)
    ar = {row.concurrency: (row, out) for row, out in raw if row.config == ar_name}
    rows = []
    for row, out in raw:
        ref = ar.get(row.concurrency)
        if ref is None:
            rows.append(row)
            continue
        speedup = row.tokens_per_s / ref[0].tokens_per_s if ref[0].tokens_per_s > 0 else None
        identical = sum(a == b for a, b in zip(ref[1], out, strict=True))
        rows.append(_replace(row, speedup=speedup, identical=identical))
    domains: dict[str, int] = {}
    for p in workload:
        domains[p.domain] = domains.get(p.domain, 0) + 1
    base = {"max_new_tokens": max_new_tokens, "min_requests": min_requests, "warmup_tokens": warmup_tokens,
            "concurrency": list(concurrency), "temperature": 0.0, "workload_prompts": len(workload),
            "workload_domains": ", ".join(f"{d} {n}" for d, n in domains.items()),
            "configs": [{"name": ct.config.name, "drafter": ct.config.drafter, "policy": ct.config.policy,
                         "num_draft_tokens": ct.num_draft_tokens, "kind": ct.kind} for ct in contenders],
            "torch_threads": _torch_threads()}
    return ServingReport(settings={**base, **(settings or {})}, rows=rows)


def _replace(row: ServingRow, **changes: Any) -> ServingRow:
    from dataclasses import replace

    return replace(row, **changes)


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def bench(model: Decoder, tokenizer: Any, target_dir: Path, configs: Sequence[ServingConfig], *,
          concurrency: Sequence[int] = DEFAULT_CONCURRENCY, max_new_tokens: int = 64, num_draft_tokens: int = 4,
          min_requests: int = DEFAULT_MIN_REQUESTS, warmup_tokens: int = 8, out_dir: str | Path | None = None,
          breakeven: bool = False, prompts_path: str | Path = EVAL_PROMPTS,
          workload: Sequence[EvalPrompt] | None = None, cost_table_path: str | Path | None = None,
          log: Callable[[str], None] | None = print, out: Callable[[str], None] = print) -> ServingReport:
    """The whole benchmark on a loaded target: check the configs, build the workload (`workload` when given,
    else every prompt of `prompts_path` that fits), load drafters and policies, sweep, print the table (and
    Eq. 25 with `breakeven`), write results into `out_dir`."""
    check_configs(configs)
    if any(c < 1 for c in concurrency) or not concurrency:
        raise ServingError(f"concurrency values must be positive integers, got {list(concurrency)}")
    if max_new_tokens < 1:
        raise ServingError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    if workload is None:
        workload = serving_workload(tokenizer, model.config.max_position_embeddings, max_new_tokens, prompts_path)
    else:
        workload = interleave_domains(workload)
        prompts_path = "(given workload)"
    contenders = build_contenders(model, target_dir, configs, concurrency=concurrency,
                                  num_draft_tokens=num_draft_tokens, cost_table_path=cost_table_path, log=log)
    t0 = time.perf_counter()
    report = run_sweep(model, contenders, workload, concurrency=concurrency, max_new_tokens=max_new_tokens,
                       min_requests=min_requests, warmup_tokens=warmup_tokens, log=log,
                       settings={"target": str(target_dir), "prompts": str(prompts_path)})
    report.settings["sweep_s"] = round(time.perf_counter() - t0, 2)
    out(report.format(breakeven=breakeven))
    if out_dir is not None:
        paths, note = report.write(out_dir, breakeven=breakeven)
        if note:
            out(note)
        out("wrote " + ", ".join(str(p) for p in paths))
    bad = [r for r in report.rows if r.identical is not None and r.identical != r.requests]
    if bad:
        print(f"angelspec: LOSSLESS CHECK FAILED at T=0: {', '.join(f'{r.config} C={r.concurrency}' for r in bad)} "
              "differ from AR", file=sys.stderr)
    return report


def lossless(report: ServingReport) -> bool | None:
    """True when every checked output equals AR's, None when nothing was checked (no AR configuration)."""
    checked = [r for r in report.rows if r.identical is not None]
    return None if not checked else all(r.identical == r.requests for r in checked)


__all__ = ["DEFAULT_CONCURRENCY", "BreakEven", "Contender", "Goal", "ServingConfig", "ServingError", "ServingReport",
           "ServingRow", "bench", "build_contenders", "check_configs", "lossless", "parse_concurrency", "parse_config",
           "interleave_domains", "run_point", "run_sweep", "serving_workload"]
