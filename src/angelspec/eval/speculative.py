"""Speculative decoding against plain autoregressive (AR) decoding on the same prompts, in one process.

Shared by `angelspec eval` and `make demo`, so both report the same numbers the same way:

* Both modes run through `SpecEngine` with the same batch size, token budget and sampling settings; the
  only difference is the drafter. Speed-up = speculative tokens/s / AR tokens/s, which at T=0 (identical
  outputs) is exactly the wall-clock ratio.
* Prompts are grouped by domain and each group is decoded as its own run, so per-domain tokens/s and
  speed-ups are measured rather than apportioned out of a mixed batch; "all" aggregates the runs (sum of
  tokens over sum of wall-clock, merged acceptance counts).
* Each engine first decodes one short untimed batch (warm-up), so one-time costs (allocator growth,
  kernel selection, the first forward of a draft model) are not billed to whichever mode runs first.
* At T=0 the speculative outputs must equal the AR outputs token for token (the engine's lossless
  guarantee); `EvalReport.lossless` says whether they did and `mismatches` where they did not. A departure
  where the target's own best logits nearly tie (`eval.lossless`: both tokens within a tolerance of the best
  logit, 1e-3 relative for fp32 targets, 4 machine epsilons for bf16 / fp16) is a near-tie: the verify and the AR
  step round the same logits differently there, so either token is the target's greedy choice. Near-ties are
  counted and reported (`near_ties`) and do not fail the check; every other difference does. At T>0
  the outputs are samples that agree in distribution only, so no token check is made.

`run_decoding` with no drafter is the AR baseline; pass it to `evaluate(..., baseline=...)` to compare
several drafters against one baseline (the demo does).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from tqdm.auto import tqdm

from angelspec.decoding.drafters.base import Drafter
from angelspec.decoding.engine import DepthPolicyFn, EngineConfig, Request, SpecEngine
from angelspec.decoding.metrics import PHASES, STALL_S, DecodeMetrics
from angelspec.decoding.sampling import SamplingParams
from angelspec.eval.lossless import TieCheck, check_divergence
from angelspec.eval.lossless import near_tie_rtol as default_rtol
from angelspec.models.decoder import Decoder

ALL = "all"  # the aggregate row's name in reports
MAX_MISMATCHES_SHOWN = 5


class EvalError(ValueError):
    """Evaluation settings or inputs that cannot be used (bad values, a baseline from other settings)."""


@dataclass(frozen=True)
class EvalPrompt:
    """One prompt, already rendered with the chat template and tokenized."""

    ids: list[int]
    domain: str = ALL
    line: int | None = None  # line in the prompts file, so a mismatch can be traced back


@dataclass(frozen=True)
class EvalSettings:
    """Decoding settings shared by the AR baseline and the speculative run.

    sampling.seed: request i uses seed + i (None: fresh randomness, only sensible at T=0).
    warmup_tokens: new tokens per request of the untimed warm-up batch (0 = no warm-up).
    compile: `EngineConfig(compile=True)` for both runs (AR and speculative): the target's forwards and the
    drafter's hot calls run compiled; the warm-up batch pays the compilation.
    spec_gate: `EngineConfig(spec_gate=True)` for the speculative run (it learns during the warm-up too).
    """

    max_new_tokens: int = 128
    batch_size: int = 8
    num_draft_tokens: int = 4
    sampling: SamplingParams = field(default_factory=SamplingParams)
    warmup_tokens: int = 16
    compile: bool = False
    spec_gate: bool = False

    def __post_init__(self) -> None:
        for name, low in (("max_new_tokens", 1), ("batch_size", 1), ("num_draft_tokens", 1), ("warmup_tokens", 0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise EvalError(f"EvalSettings.{name} must be an int >= {low}, got {v!r}")

    @property
    def greedy(self) -> bool:
        return self.sampling.is_greedy

    def to_dict(self) -> dict[str, Any]:
        s = self.sampling
        return {"max_new_tokens": self.max_new_tokens, "batch_size": self.batch_size,
                "num_draft_tokens": self.num_draft_tokens, "temperature": s.temperature, "top_k": s.top_k,
                "top_p": s.top_p, "seed": s.seed, "warmup_tokens": self.warmup_tokens, "compile": self.compile,
                "spec_gate": self.spec_gate}


@dataclass(frozen=True)
class DecodeRun:
    """One mode (AR or one drafter) decoded over every prompt: per-domain metrics and all outputs."""

    settings: EvalSettings
    num_prompts: int
    domains: dict[str, DecodeMetrics]  # in order of first appearance in the prompts
    outputs: list[list[int]]  # emitted token ids per prompt, in prompt order

    @property
    def overall(self) -> DecodeMetrics:
        return merge_metrics(list(self.domains.values()))


@dataclass(frozen=True)
class Mismatch:
    """Where a speculative output first departs from the AR output of the same prompt (T=0 only)."""

    index: int  # prompt index
    line: int | None
    domain: str
    position: int  # first differing token index in the completion
    ar_token: int | None  # None: that output ended here
    spec_token: int | None
    tie: TieCheck | None = None  # the target's logits there (`eval.lossless`); None: not checked or an output ended

    @property
    def near_tie(self) -> bool:
        """The target's best logits nearly tie here: either token is its greedy choice (module docstring)."""
        return self.tie is not None and self.tie.near_tie

    def describe(self) -> str:
        where = f"line {self.line}" if self.line is not None else f"prompt {self.index}"
        tie = f" ({self.tie.describe()})" if self.tie is not None else ""
        return (f"{where} ({self.domain}): first difference at completion token {self.position}: "
                f"AR {_tok(self.ar_token)} vs speculative {_tok(self.spec_token)}{tie}")

    def to_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in vars(self).items() if k != "tie"}
        out["near_tie"] = self.near_tie
        if self.tie is not None:
            out.update(best_logit=self.tie.best, ar_gap=self.tie.ar_gap, spec_gap=self.tie.spec_gap,
                       tolerance=self.tie.tolerance)
        return out


@dataclass(frozen=True)
class DomainResult:
    prompts: int
    ar: DecodeMetrics
    spec: DecodeMetrics
    identical: int | None  # outputs equal to AR's; None when not checked (T > 0)
    near_ties: int = 0  # the other outputs: they part from AR's at a near-tie of the target's logits

    @property
    def speedup(self) -> float:
        return self.spec.tokens_per_s / self.ar.tokens_per_s if self.ar.tokens_per_s > 0 else 0.0

    @property
    def cpu_speedup(self) -> float:
        """The speed-up in tokens per CPU-second of the decoding process: what the wall-clock one would be on a
        machine of its own, when other work (a trainer) shares the cores and stretches one run more than the
        other. Equal to `speedup` on a quiet machine with one thread."""
        ar = self.ar.tokens_per_cpu_s
        return self.spec.tokens_per_cpu_s / ar if ar > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"prompts": self.prompts, "speedup": self.speedup, "identical": self.identical,
                "near_ties": self.near_ties, "ar": self.ar.summary(), "spec": self.spec.summary()}


@dataclass(frozen=True)
class EvalReport:
    """AR vs one drafter on the same prompts: per domain, overall, and the T=0 lossless check."""

    drafter: str
    settings: EvalSettings
    domains: dict[str, DomainResult]
    overall: DomainResult
    mismatches: list[Mismatch]
    policy: str = "full"  # the depth-policy spec of the speculative run (`angelspec.decoding.policies.factory`)
    near_tie_rtol: float | None = None  # the tolerance the mismatches were checked with; None: not checked

    @property
    def lossless_checked(self) -> bool:
        return self.settings.greedy

    @property
    def near_ties(self) -> list[Mismatch]:
        """Departures where the target's best logits nearly tie (module docstring): reported, not failures."""
        return [m for m in self.mismatches if m.near_tie]

    @property
    def failures(self) -> list[Mismatch]:
        """Departures from AR that no near-tie explains: each one is a bug."""
        return [m for m in self.mismatches if not m.near_tie]

    @property
    def lossless(self) -> bool | None:
        """True / False at T=0 (near-ties do not count against it); None at T>0, where outputs are not expected to
        match token for token."""
        return not self.failures if self.lossless_checked else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "drafter": self.drafter,
            "policy": self.policy,
            "settings": self.settings.to_dict(),
            "prompts": self.overall.prompts,
            "speedup": self.overall.speedup,
            "lossless": {"checked": self.lossless_checked, "ok": self.lossless, "identical": self.overall.identical,
                         "total": self.overall.prompts, "near_ties": len(self.near_ties),
                         "near_tie_rtol": self.near_tie_rtol,
                         "mismatches": [m.to_dict() for m in self.mismatches]},
            "overall": self.overall.to_dict(),
            "domains": {d: r.to_dict() for d, r in self.domains.items()},
        }

    def lossless_line(self) -> str:
        n = self.overall.prompts
        if not self.lossless_checked:
            return "lossless: not checked at T>0 (sampled outputs match AR in distribution, not token for token)"
        ties = len(self.near_ties)
        tie_text = (f"{ties} near-tie{'s' if ties != 1 else ''} (outputs equal up to a position where the target's "
                    f"best logits lie within {self.near_tie_rtol:.3g} relative of each other)") if ties else ""
        if self.lossless:
            if not ties:
                return f"lossless: yes ({n}/{n} identical to AR)"
            return f"lossless: yes ({n - ties}/{n} identical to AR, {tie_text})"
        return (f"lossless: NO: {len(self.failures)}/{n} outputs differ from AR at T=0"
                + (f" (besides {tie_text})" if ties else "") + ". This is a bug: speculative decoding must reproduce "
                "greedy AR decoding token for token")

    def format(self) -> str:
        s, k = self.settings, self.settings.num_draft_tokens
        rows = [*self.domains.items()] + ([(ALL, self.overall)] if len(self.domains) > 1 else [])
        policy = "" if self.policy == "full" else f", policy {self.policy}"
        lines = [f"drafter {self.drafter}{policy}: K={k}, {_sampling_text(s.sampling)}, "
                 f"{self.overall.prompts} prompts, "
                 f"max {s.max_new_tokens} new tokens, batch {s.batch_size}", ""]
        head = f"{'domain':<8}{'prompts':>8}{'AR tok/s':>10}{'spec tok/s':>12}{'speed-up':>10}{'MAL':>7}  p_1..p_{k}"
        lines.append(head)
        for name, r in rows:
            acc = " ".join(f"{p:.2f}" for p in r.spec.acceptance)
            lines.append(f"{name:<8}{r.prompts:>8}{r.ar.tokens_per_s:>10.1f}{r.spec.tokens_per_s:>12.1f}"
                         f"{r.speedup:>9.2f}x{r.spec.mean_accepted_length:>7.2f}  {acc}")
        lines += ["", "acceptance-length histogram (share of verify steps accepting a drafts; "
                      "tokens per step = a + 1):",
                  f"{'domain':<8}" + "".join(f"{f'a={a}':>8}" for a in range(k + 1))]
        for name, r in rows:
            total = sum(r.spec.accept_hist) or 1
            lines.append(f"{name:<8}" + "".join(f"{100 * c / total:>7.1f}%" for c in r.spec.accept_hist))
        lines += ["", "time split (share of decoding wall-clock, all domains):"]
        for label, m in (("AR", self.overall.ar), ("spec", self.overall.spec)):
            split = "  ".join(f"{p} {100 * m.seconds[p] / m.wall_s if m.wall_s else 0:.0f}%" for p in PHASES)
            lines.append(f"  {label:<5}{m.wall_s:7.2f} s  {split}")
        for label, m in (("AR", self.overall.ar), (self.drafter, self.overall.spec)):
            slowest = m.slowest_step_seconds()
            if slowest > STALL_S:
                lines.append(f"WARNING: one step of the {label} run took {slowest:.1f} s (a graph compiled mid-run, or "
                             "the core was taken): its tokens/s and the speed-up are not representative; run it again")
        lines += ["", self.lossless_line()]
        shown = self.failures + self.near_ties  # the failures first
        lines += [f"  {m.describe()}" for m in shown[:MAX_MISMATCHES_SHOWN]]
        if len(shown) > MAX_MISMATCHES_SHOWN:
            lines.append(f"  ... and {len(shown) - MAX_MISMATCHES_SHOWN} more")
        return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------------------------------
def run_decoding(target: Decoder, prompts: Sequence[EvalPrompt], settings: EvalSettings, drafter: Drafter | None = None,
                 *, progress: bool = True, desc: str | None = None,
                 depth_policy: DepthPolicyFn | None = None) -> DecodeRun:
    """Decode every prompt with `drafter` (None = AR), one engine run per domain, after an untimed warm-up.
    depth_policy: how many drafts each row verifies (`decoding.policies.factory.make_policy`); None = all K.

    The engine is built before anything is decoded, so a drafter that does not fit the target
    (`DrafterMismatchError`) fails here with nothing spent.
    """
    prompts = list(prompts)
    context = target.config.max_position_embeddings
    engine = SpecEngine(target, drafter, EngineConfig(max_batch_size=settings.batch_size,
                                                      max_seq_len=_max_seq_len(target, prompts, settings),
                                                      num_draft_tokens=settings.num_draft_tokens,
                                                      compile=settings.compile,
                                                      spec_gate=settings.spec_gate and drafter is not None),
                        depth_policy=depth_policy)
    requests = [_request(p, i, settings, context) for i, p in enumerate(prompts)]
    if settings.warmup_tokens:
        warm = [_request(p, i, settings, context, budget=settings.warmup_tokens)
                for i, p in enumerate(prompts[: settings.batch_size])]
        engine.generate(warm)
    groups: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        groups.setdefault(p.domain, []).append(i)
    outputs: list[list[int]] = [[] for _ in prompts]
    domains: dict[str, DecodeMetrics] = {}
    bar = tqdm(total=len(prompts), desc=desc or ("AR" if drafter is None else "speculative"), unit="prompt",
               file=sys.stderr, disable=not progress)
    for domain, idx in groups.items():
        bar.set_postfix_str(domain)
        results = engine.generate([requests[i] for i in idx])
        for i, res in zip(idx, results, strict=True):
            outputs[i] = [int(t) for t in res.token_ids]
        domains[domain] = engine.metrics
        bar.update(len(idx))
    bar.close()
    return DecodeRun(settings=settings, num_prompts=len(prompts), domains=domains, outputs=outputs)


def evaluate(target: Decoder, drafter: Drafter, prompts: Sequence[EvalPrompt], settings: EvalSettings, *,
             name: str, baseline: DecodeRun | None = None, progress: bool = True,
             depth_policy: DepthPolicyFn | None = None, policy: str = "full",
             near_tie_rtol: float | None = None) -> EvalReport:
    """Decode `prompts` with AR (unless `baseline` holds that run already) and with `drafter`; compare.
    depth_policy: the speculative run's depth policy (None = all K); `policy` is its spec, for the report.
    near_tie_rtol: the near-tie tolerance of the T=0 check (None: the target dtype's default, `eval.lossless`).

    The speculative engine is built (and the drafter checked against the target) before the AR baseline
    runs, so a mismatched drafter costs nothing.
    """
    prompts = list(prompts)
    # AR decoding does not depend on the draft depth or the gate, so one baseline serves drafters of any K.
    if baseline is not None and (replace(baseline.settings, num_draft_tokens=settings.num_draft_tokens,
                                         spec_gate=settings.spec_gate) != settings
                                 or baseline.num_prompts != len(prompts)):
        raise EvalError("the AR baseline was decoded with other settings or prompts than this evaluation")
    drafter.check_compatible(target.config, _max_seq_len(target, prompts, settings))
    if baseline is None:
        baseline = run_decoding(target, prompts, settings, progress=progress, desc="AR")
    spec = run_decoding(target, prompts, settings, drafter, progress=progress, desc=name, depth_policy=depth_policy)
    return compare(baseline, spec, prompts, name=name, policy=policy, target=target, near_tie_rtol=near_tie_rtol)


def evaluate_many(target: Decoder, drafters: Sequence[tuple[str, Drafter, DepthPolicyFn | None, str]],
                  prompts: Sequence[EvalPrompt], settings: EvalSettings, *, progress: bool = True,
                  depths: Sequence[int] | None = None) -> tuple[DecodeRun, list[EvalReport]]:
    """Decode `prompts` with AR once, then with each drafter, given as (name, drafter, depth policy, policy spec);
    returns the AR run and one report per drafter. `depths`: each drafter's K (None: `settings.num_draft_tokens`
    for all). Every drafter is checked against the target before anything is decoded, so a mismatched one late in
    the list costs nothing."""
    prompts = list(prompts)
    ks = [settings.num_draft_tokens] * len(drafters) if depths is None else list(depths)
    if len(ks) != len(drafters):
        raise EvalError(f"{len(ks)} draft depths for {len(drafters)} drafters")
    bound = _max_seq_len(target, prompts, settings)
    for _, drafter, _, _ in drafters:
        drafter.check_compatible(target.config, bound)
    baseline = run_decoding(target, prompts, settings, progress=progress, desc="AR")
    reports = [evaluate(target, drafter, prompts, replace(settings, num_draft_tokens=k), name=name,
                        baseline=baseline, progress=progress, depth_policy=depth_policy, policy=policy)
               for (name, drafter, depth_policy, policy), k in zip(drafters, ks, strict=True)]
    return baseline, reports


def compare(ar: DecodeRun, spec: DecodeRun, prompts: Sequence[EvalPrompt], *, name: str,
            policy: str = "full", target: Decoder | None = None, near_tie_rtol: float | None = None) -> EvalReport:
    """Build the report from two runs over the same prompts. With `target`, each T=0 departure is checked for a
    near-tie of the target's logits (`eval.lossless`; `near_tie_rtol` None: the target dtype's default); without,
    every departure counts as a failure."""
    settings = spec.settings
    checked = settings.greedy
    mismatches = [m for i, p in enumerate(prompts)
                  if (m := _first_difference(i, p, ar.outputs[i], spec.outputs[i])) is not None] if checked else []
    rtol = None
    if target is not None and checked:
        rtol = near_tie_rtol if near_tie_rtol is not None else default_rtol(target.embed_tokens.weight.dtype)
        mismatches = [replace(m, tie=check_divergence(target, [*prompts[m.index].ids,
                                                               *ar.outputs[m.index][:m.position]],
                                                      m.ar_token, m.spec_token, rtol)) for m in mismatches]
    bad = {m.index for m in mismatches}
    ties = {m.index for m in mismatches if m.near_tie}
    domains: dict[str, DomainResult] = {}
    for domain, ar_m in ar.domains.items():
        idx = [i for i, p in enumerate(prompts) if p.domain == domain]
        domains[domain] = DomainResult(prompts=len(idx), ar=ar_m, spec=spec.domains[domain],
                                       identical=sum(i not in bad for i in idx) if checked else None,
                                       near_ties=sum(i in ties for i in idx))
    overall = DomainResult(prompts=len(prompts), ar=ar.overall, spec=spec.overall,
                           identical=len(prompts) - len(bad) if checked else None, near_ties=len(ties))
    return EvalReport(drafter=name, settings=settings, domains=domains, overall=overall, mismatches=mismatches,
                      policy=policy, near_tie_rtol=rtol)


def format_comparison(baseline: DecodeRun, reports: Sequence[EvalReport]) -> str:
    """One table per domain and overall: AR and every drafter side by side (tokens/s, MAL, speed-up, lossless)."""
    names = list(baseline.domains) + ([ALL] if len(baseline.domains) > 1 else [])
    labels = [f"{r.drafter} (K={r.settings.num_draft_tokens})" for r in reports]
    width = max([len("AR"), *(len(label) for label in labels)]) + 2
    lines = [f"{'domain':<8}{'decoding':<{width}}{'tokens/s':>10}{'MAL':>7}{'speed-up':>10}  lossless"]
    for domain in names:
        ar = baseline.overall if domain == ALL else baseline.domains[domain]
        lines.append(f"{domain:<8}{'AR':<{width}}{ar.tokens_per_s:>10.1f}{1.0:>7.2f}{1.0:>9.2f}x  (reference)")
        for rep, label in zip(reports, labels, strict=True):
            r = rep.overall if domain == ALL else rep.domains[domain]
            if r.identical is None:
                check = "not checked (T>0)"
            elif r.identical + r.near_ties == r.prompts:
                ties = f", {r.near_ties} near-tie{'s' if r.near_ties != 1 else ''}" if r.near_ties else ""
                check = f"identical to AR ({r.identical}/{r.prompts}{ties})"
            else:
                check = f"DIFFERS from AR ({r.prompts - r.identical - r.near_ties}/{r.prompts} outputs)"
            lines.append(f"{'':<8}{label:<{width}}{r.spec.tokens_per_s:>10.1f}"
                         f"{r.spec.mean_accepted_length:>7.2f}{r.speedup:>9.2f}x  {check}")
    return "\n".join(lines)


def merge_metrics(runs: Sequence[DecodeMetrics]) -> DecodeMetrics:
    """Aggregate runs of one mode: counts, histograms and seconds add up (per-step seconds are pooled); rates
    follow from the sums."""
    if not runs:
        raise EvalError("no runs to merge")
    k = runs[0].num_draft_tokens
    out = DecodeMetrics(num_draft_tokens=k)
    for m in runs:
        if m.num_draft_tokens != k:
            raise EvalError(f"cannot merge metrics with K={m.num_draft_tokens} into K={k}")
        for name in ("steps", "row_steps", "accepted_plus_one", "output_tokens", "prompt_tokens", "requests",
                     "skipped_steps", "wall_s", "cpu_s"):
            setattr(out, name, getattr(out, name) + getattr(m, name))
        out.accept_hist = [a + b for a, b in zip(out.accept_hist, m.accept_hist, strict=True)]
        out.depth_hist = [a + b for a, b in zip(out.depth_hist, m.depth_hist, strict=True)]
        for phase, sec in m.seconds.items():
            out.seconds[phase] = out.seconds.get(phase, 0.0) + sec
        for phase, per_step in m.step_seconds.items():
            out.step_seconds.setdefault(phase, []).extend(per_step)
        for proto, n in m.protocols.items():
            out.protocols[proto] = out.protocols.get(proto, 0) + n
    return out


def _max_seq_len(target: Decoder, prompts: list[EvalPrompt], settings: EvalSettings) -> int:
    """The engine's length bound: what these prompts need, so a draft model with a shorter context than
    the target still serves them. Also checks every prompt leaves room to generate."""
    if not prompts:
        raise EvalError("no prompts to evaluate")
    context = target.config.max_position_embeddings
    for p in prompts:
        if not 0 < len(p.ids) < context:
            where = f"line {p.line}" if p.line is not None else "a prompt"
            raise EvalError(f"{where} has {len(p.ids)} tokens; it must be 1..{context - 1} (the target's context)")
    return max(2, min(context, max(len(p.ids) for p in prompts) + settings.max_new_tokens))


def _request(p: EvalPrompt, i: int, settings: EvalSettings, context: int, budget: int | None = None) -> Request:
    s = settings.sampling
    seed = None if s.seed is None else s.seed + i
    new = min(budget or settings.max_new_tokens, settings.max_new_tokens, context - len(p.ids))
    return Request(prompt_ids=p.ids, max_new_tokens=new, sampling=SamplingParams(s.temperature, s.top_k, s.top_p, seed),
                   request_id=i)


def _first_difference(i: int, p: EvalPrompt, ar: list[int], spec: list[int]) -> Mismatch | None:
    if ar == spec:
        return None
    pos = next((j for j, (a, b) in enumerate(zip(ar, spec, strict=False)) if a != b), min(len(ar), len(spec)))
    return Mismatch(index=i, line=p.line, domain=p.domain, position=pos,
                    ar_token=ar[pos] if pos < len(ar) else None, spec_token=spec[pos] if pos < len(spec) else None)


def _tok(t: int | None) -> str:
    return "(end)" if t is None else str(t)


def _sampling_text(s: SamplingParams) -> str:
    if s.is_greedy:
        return "T=0 (greedy)"
    extra = "".join([f", top-k {s.top_k}" if s.top_k else "", f", top-p {s.top_p}" if s.top_p < 1 else ""])
    return f"T={s.temperature}{extra}, seed {s.seed}"
