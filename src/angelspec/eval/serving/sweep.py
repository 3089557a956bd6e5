"""The closed-loop serving sweep: every configuration (AR or a drafter under a depth policy) run at every
concurrency level, the code behind `angelspec bench` (AngelSpec report §4.4, Figure 4).

Protocol, per configuration (name, drafter or None, policy spec) and concurrency C:

* N = max(4C, min_requests) requests drawn round-robin from a mixed chat / code / math workload (the shipped
  held-out prompts by default, interleaved by domain), greedy (T=0), every request exactly `max_new_tokens`
  new tokens (stop tokens ignored, like a benchmark client with ignore_eos), so every configuration does the
  same work.
* One `SpecEngine` with max_batch_size=C runs all N: continuous batching, so a finished request's row takes
  the next queued one at once, which is C closed-loop clients that each send their next request as soon as
  the last one returns. Per request: time to first token (admission to its prefill's token; in a closed loop a
  request arrives when a row frees) and time per output token after it, as p50 / p95 over the point's requests.
* Points run concurrency-major: at each C every configuration in turn, so each one's AR run is beside it in time
  (a machine whose load drifts moves both), and ratios are to the AR run of the same point.
* Each configuration decodes one short untimed batch first (warm-up); a compiled one (`+compile`) one per point, at
  that point's batch size (a compiled step specialises on a batch of one). Cost tables for the budget policies are
  loaded or profiled before anything is timed.
* With a vLLM column (vllm.py, `angelspec bench --vllm`), vLLM then serves the same requests at each point for every
  AR and full-depth n-gram configuration, timed the same way.

Each point becomes a `ServingRow` (base.py); the rows, with speed-up and the lossless check against the AR
configuration at the same C, make the `ServingReport` (report.py).

Shape legend: C concurrent requests (engine rows), N requests per point, K drafts proposed per step.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from angelspec.assets import EVAL_PROMPTS
from angelspec.eval.serving.base import (
    ServingError,
    ServingRow,
    paired_ratio,
    paired_tpot_p95,
    percentile,
    round_ratios,
)
from angelspec.eval.serving.report import ServingReport
from angelspec.eval.serving.vllm import VllmColumn, VllmSetup, add_vllm

if TYPE_CHECKING:
    from angelspec.decoding.drafters.base import Drafter
    from angelspec.decoding.policies.base import DepthPolicy
    from angelspec.eval.speculative import EvalPrompt
    from angelspec.models.decoder import Decoder

DEFAULT_CONCURRENCY: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
DEFAULT_MIN_REQUESTS = 8
DEFAULT_MAX_NEW_TOKENS = 128  # long enough for the gate and the depth policies to settle within a request
REQUESTS_PER_ROW = 4  # N = max(REQUESTS_PER_ROW * C, min_requests): every row serves a few requests in turn
DEFAULT_SERVING_POLICY = "auto"  # what a drafter configuration without @POLICY runs (factory.py: `auto`)
MAX_CONCURRENCY = 4096
DRAFTER_MAX_DEPTH = -1  # ServingConfig.num_draft_tokens: K = the drafter's own maximum (block size - 1)
# Eq. 25's two terms, as medians over decode steps (decoding/metrics.py `median_step_seconds`): T_exec the target's
# verification, T_sample the drafter's work (propose and on_commit) and the depth selection.
EXEC_PHASES, SAMPLE_PHASES = ("verify",), ("draft", "select", "on_commit")


# --------------------------------------------------------------------------------------------------
# Configurations
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ServingConfig:
    """One curve of the sweep: `drafter` as `--drafter` takes it ("none" = AR), `policy` a depth-policy spec,
    `num_draft_tokens` K (None = the sweep's default, DRAFTER_MAX_DEPTH = the drafter's `max_draft_tokens`;
    ignored for AR), `policy` `auto` for the recommended serving setting (`parse_config` gives it to drafters named
    without a policy), `spec_gate` the engine's speculation gate (`EngineConfig.spec_gate`), `compile` the engine's
    torch.compile of the target's forwards and the drafter's hot calls (`EngineConfig.compile`)."""

    name: str
    drafter: str = "none"
    policy: str = "full"
    num_draft_tokens: int | None = None
    spec_gate: bool = False
    compile: bool = False

    @property
    def is_ar(self) -> bool:
        return self.drafter == "none"


def parse_config(text: str) -> ServingConfig:
    """`NAME=SPEC[@POLICY][+gate][+compile]` -> ServingConfig, in the grammar of `decoding.drafter_spec`
    (`parse_bench_entry`; SPEC as `--drafter` takes it, `none` for AR; POLICY default `auto` for a drafter, the
    recommended serving setting (`@full` or any other policy runs a fixed one), full for AR; trailing `+gate` turns
    the speculation gate on, `+compile` the engine's torch.compile, in either order)."""
    from angelspec.decoding.drafter_spec import parse_bench_entry, parse_drafter_spec
    from angelspec.decoding.policies.factory import parse_policy
    from angelspec.errors import UsageError

    try:
        entry = parse_bench_entry(text)
        parse_drafter_spec(entry.drafter)
    except UsageError as e:
        raise ServingError(str(e)) from None
    policy = entry.policy
    if policy is None:
        policy = "full" if entry.drafter == "none" else DEFAULT_SERVING_POLICY
    parse_policy(policy)  # PolicyError names the valid forms
    return ServingConfig(name=entry.name, drafter=entry.drafter, policy=policy, spec_gate=entry.spec_gate,
                         compile=entry.compile)


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

    def vllm_setup(self) -> VllmSetup | None:
        """What vLLM runs for this configuration (vllm.py): AR, or n-gram prompt lookup at full depth without the
        gate, with our K and n-gram sizes; None where vLLM has nothing equivalent (depth policies, the gate, model
        drafters). Eager and compiled configurations map to the same setup."""
        from angelspec.decoding.drafters.base import unwrap
        from angelspec.decoding.drafters.ngram import NGramDrafter

        c = self.config
        if c.spec_gate or c.policy != "full":
            return None
        if self.drafter is None:
            return VllmSetup("ar")
        inner = unwrap(self.drafter)
        if self.kind != "ngram" or not isinstance(inner, NGramDrafter):
            return None
        return VllmSetup("ngram", self.num_draft_tokens, int(inner.max_ngram), int(inner.min_ngram))


def build_contenders(target: Decoder, target_dir: Path, configs: Sequence[ServingConfig], *,
                     concurrency: Sequence[int], num_draft_tokens: int | None = None,
                     cost_table_path: str | Path | None = None,
                     log: Callable[[str], None] | None = print) -> list[Contender]:
    """Load every drafter (checked against the target) and build every policy before anything is timed.
    Budget policies get a cost table covering every concurrency of the sweep (profiled once per drafter
    and cached; see `decoding.policies.factory.make_policy`)."""
    from angelspec.decoding.loading import draft_depth, resolve_drafter
    from angelspec.decoding.policies.costmodel import drafter_id
    from angelspec.decoding.policies.factory import make_policy, parse_policy
    from angelspec.eval.cost_profile import load_or_profile

    check_configs(configs)
    drafters: dict[str, Drafter | None] = {}
    warmed: set[str] = set()
    out = []
    for c in configs:
        if c.drafter not in drafters:
            drafters[c.drafter] = resolve_drafter(c.drafter, target, target_dir)
        drafter = drafters[c.drafter]
        k = 0 if drafter is None else (c.num_draft_tokens or num_draft_tokens or draft_depth(drafter))
        if drafter is not None:
            if k == DRAFTER_MAX_DEPTH:
                k = drafter.max_draft_tokens or draft_depth(drafter)
            try:
                drafter.check_depth(k)
            except ValueError as e:
                raise ServingError(f"configuration {c.name!r}: {e}") from None
        if drafter is not None and parse_policy(c.policy).needs_cost_model and c.drafter not in warmed:
            _warm_drafter(target, drafter, max(k, 1))  # a cold first profile cell would skew the cost table
            warmed.add(c.drafter)
        policy = make_policy(c.policy, target=target, drafter=drafter, num_draft_tokens=max(k, 1),
                             cost_table_path=cost_table_path, batch_sizes=sorted(set(concurrency)),
                             compile=c.compile, cost_source=load_or_profile, log=log)
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
                     think: bool = False, limit: int | None = None) -> list[EvalPrompt]:
    """Every prompt of `prompts_path` that leaves room for `max_new_tokens` (the first `limit` of each domain when
    given), rendered with the chat template and interleaved round-robin across domains (code, math, chat, code,
    ...), so any prefix of the list and any window of it mixes the domains."""
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
        if limit is not None and sum(k.domain == domain for k in kept) >= limit:
            continue
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
# Running
# --------------------------------------------------------------------------------------------------
def point_requests(concurrency: int, min_requests: int) -> int:
    """N, the requests of one point: max(4C, min_requests)."""
    return max(REQUESTS_PER_ROW * concurrency, min_requests)


def workload_requests(workload: Sequence[EvalPrompt], n: int, max_new_tokens: int, budget: int | None = None
                      ) -> list[Any]:
    """The first n requests of a point: the workload's prompts in order (cycled), `budget` or max_new_tokens each."""
    from angelspec.decoding.engine import Request

    return [Request(prompt_ids=workload[i % len(workload)].ids, max_new_tokens=budget or max_new_tokens, stop_ids=(),
                    request_id=i) for i in range(n)]


def _near_ties(target: Decoder, workload: Sequence[EvalPrompt], n: int, ar: list[list[int]],
               out: list[list[int]]) -> int:
    """How many of a point's n outputs part from AR's at a near-tie of the target's logits (`eval.lossless`); the
    requests are `_requests`' (request i: workload prompt i mod len)."""
    from angelspec.eval.lossless import check_divergence

    count = 0
    for i, (a, b) in enumerate(zip(ar, out, strict=True)):
        if a == b:
            continue
        pos = next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        tie = check_divergence(target, [*workload[i % len(workload)].ids, *a[:pos]], a[pos] if pos < len(a) else None,
                               b[pos] if pos < len(b) else None)
        count += int(tie is not None and tie.near_tie)
    return count


def run_point(target: Decoder, contender: Contender, workload: Sequence[EvalPrompt], concurrency: int, *,
              max_new_tokens: int, min_requests: int = DEFAULT_MIN_REQUESTS) -> tuple[ServingRow, list[list[int]]]:
    """N = max(4C, min_requests) requests through one engine with max_batch_size = C; -> (row without
    speed-up / lossless columns, the emitted tokens per request)."""
    n = point_requests(concurrency, min_requests)
    engine, requests = _engine(target, contender, workload, concurrency, n, max_new_tokens)
    results = engine.generate(requests)
    m = engine.metrics
    per_user = statistics.fmean(len(r.token_ids) / r.latency_s if r.latency_s > 0 else 0.0 for r in results)
    depth = sum(d * c for d, c in enumerate(m.depth_hist)) / m.row_steps if m.row_steps else 0.0
    c = contender.config
    row = ServingRow(config=c.name, drafter=c.drafter, kind=contender.kind, policy=c.policy,
                     num_draft_tokens=contender.num_draft_tokens, concurrency=concurrency, requests=n,
                     output_tokens=m.output_tokens, wall_s=m.wall_s, tokens_per_s=m.tokens_per_s,
                     per_user_tokens_per_s=per_user, mal=m.mean_accepted_length, mean_depth=depth, steps=m.steps,
                     exec_s_per_step=m.median_step_seconds(EXEC_PHASES),
                     sample_s_per_step=m.median_step_seconds(SAMPLE_PHASES),
                     seconds=dict(m.seconds), slowest_step_s=m.slowest_step_seconds(),
                     **latency_percentiles(results))
    return row, [list(map(int, r.token_ids)) for r in results]


def median_run(runs: Sequence[tuple[ServingRow, list[list[int]]]]) -> tuple[ServingRow, list[list[int]]]:
    """The run with the median throughput (the lower middle one of an even count), its row carrying every run's
    tokens/s and p95 TPOT; a run whose outputs differ from the others' is returned instead (a lossless failure must
    not hide)."""
    first = runs[0][1]
    odd = next((run for run in runs if run[1] != first), None)
    ranked = sorted(runs, key=lambda run: run[0].tokens_per_s)
    row, outputs = odd or ranked[(len(ranked) - 1) // 2]
    return replace(row, runs_tokens_per_s=tuple(run[0].tokens_per_s for run in runs),
                   runs_tpot_p95_s=tuple(run[0].tpot_p95_s for run in runs)), outputs


def latency_percentiles(results: Sequence[Any]) -> dict[str, float]:
    """p50 / p95 of the requests' time to first token and time per output token (`Result`), seconds."""
    ttft = [r.first_token_s for r in results]
    tpot = [r.time_per_output_token_s for r in results if len(r.token_ids) > 1]
    return {"ttft_p50_s": percentile(ttft, 50), "ttft_p95_s": percentile(ttft, 95),
            "tpot_p50_s": percentile(tpot, 50), "tpot_p95_s": percentile(tpot, 95)}


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

    requests = workload_requests(workload, n, max_new_tokens)
    max_len = max(len(r.prompt_ids) for r in requests) + max_new_tokens
    engine = SpecEngine(target, contender.drafter,
                        EngineConfig(max_batch_size=concurrency, max_seq_len=max_len,
                                     num_draft_tokens=contender.num_draft_tokens,
                                     spec_gate=contender.config.spec_gate, compile=contender.config.compile),
                        depth_policy=contender.policy)
    return engine, requests


def run_sweep(target: Decoder, contenders: Sequence[Contender], workload: Sequence[EvalPrompt], *,
              concurrency: Sequence[int] = DEFAULT_CONCURRENCY, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
              min_requests: int = DEFAULT_MIN_REQUESTS, warmup_tokens: int = 8,
              log: Callable[[str], None] | None = print, settings: dict[str, Any] | None = None,
              vllm: VllmColumn | None = None, repeats: int = 1) -> ServingReport:
    """Every contender at every concurrency (concurrency-major, each warmed up once per point when compiled);
    speed-up and the lossless check against the first AR contender at the same concurrency; with `vllm`, vLLM on
    the same requests for every contender it has a setup for (vllm.py). `repeats` > 1: each point's timed run
    `repeats` times per contender, the contenders in turn each round (in reverse order every other round, so that a
    machine speeding up or slowing down through a round favours no contender over two rounds), and the run with the
    median throughput is the point's row (`ServingRow.runs_tokens_per_s` keeps them all): on a machine whose speed
    drifts, the median of interleaved runs is a ratio one can repeat."""
    if max_new_tokens < 1 or min_requests < 1 or warmup_tokens < 0 or repeats < 1:
        raise ServingError(f"need max_new_tokens >= 1, min_requests >= 1, warmup_tokens >= 0, repeats >= 1; got "
                           f"{max_new_tokens}, {min_requests}, {warmup_tokens}, {repeats}")
    if not workload:
        raise ServingError("empty workload")
    concurrency = sorted(set(concurrency))
    raw: list[tuple[ServingRow, list[list[int]]]] = []
    warmed: set[str] = set()
    for c in concurrency:  # concurrency-major: every configuration's run beside the AR run of its point
        for ct in contenders:
            if ct.config.compile:  # compiled graphs specialise on a batch of one: warm each point's own shapes
                warm_up(target, ct, workload, batch=c, tokens=warmup_tokens)
            elif ct.config.name not in warmed:
                warm_up(target, ct, workload, batch=min(max(concurrency), 8), tokens=warmup_tokens)
            warmed.add(ct.config.name)
        runs: dict[str, list[tuple[ServingRow, list[list[int]]]]] = {ct.config.name: [] for ct in contenders}
        for r in range(repeats):
            for ct in contenders if r % 2 == 0 else contenders[::-1]:  # (drift through a round cancels in pairs)
                t0 = time.perf_counter()
                row, outputs = run_point(target, ct, workload, c, max_new_tokens=max_new_tokens,
                                         min_requests=min_requests)
                runs[ct.config.name].append((row, outputs))
                if log is not None:
                    log(f"{ct.config.name} C={c}{f' run {r + 1}/{repeats}' if repeats > 1 else ''}: "
                        f"{row.tokens_per_s:.1f} tok/s, per-user {row.per_user_tokens_per_s:.1f} tok/s, MAL "
                        f"{row.mal:.2f}, TPOT p50/p95 {row.tpot_p50_s * 1e3:.1f}/{row.tpot_p95_s * 1e3:.1f} ms "
                        f"({time.perf_counter() - t0:.1f} s)")
        raw += [median_run(point) for point in runs.values()]
    order = {ct.config.name: i for i, ct in enumerate(contenders)}
    raw.sort(key=lambda item: (order[item[0].config], item[0].concurrency))  # rows configuration-major
    ar_name = next((ct.config.name for ct in contenders if ct.drafter is None), None)
    ar = {row.concurrency: (row, out) for row, out in raw if row.config == ar_name}
    rows = []
    for row, out in raw:
        ref = ar.get(row.concurrency)
        if ref is None:
            rows.append(row)
            continue
        identical = sum(a == b for a, b in zip(ref[1], out, strict=True))
        near = _near_ties(target, workload, row.requests, ref[1], out) if identical < len(out) else 0
        rows.append(replace(row, speedup=paired_ratio(row, ref[0]), runs_speedup=round_ratios(row, ref[0]),
                            tpot_p95_vs_ar=paired_tpot_p95(row, ref[0]), identical=identical, near_ties=near))
    extra: dict[str, Any] = {}
    if vllm is not None:
        rows, extra["vllm"] = _vllm_column(vllm, contenders, workload, rows, [out for _, out in raw],
                                           concurrency=concurrency, max_new_tokens=max_new_tokens,
                                           min_requests=min_requests, warmup_tokens=warmup_tokens, log=log)
    domains: dict[str, int] = {}
    for p in workload:
        domains[p.domain] = domains.get(p.domain, 0) + 1
    base = {"max_new_tokens": max_new_tokens, "min_requests": min_requests, "warmup_tokens": warmup_tokens,
            "concurrency": list(concurrency), "temperature": 0.0, "workload_prompts": len(workload),
            "workload_domains": ", ".join(f"{d} {n}" for d, n in domains.items()),
            "configs": [{"name": ct.config.name, "drafter": ct.config.drafter, "policy": ct.config.policy,
                         "num_draft_tokens": ct.num_draft_tokens, "kind": ct.kind,
                         "spec_gate": ct.config.spec_gate, "compile": ct.config.compile} for ct in contenders],
            **_machine(target), **extra}
    return ServingReport(settings={**base, **(settings or {})}, rows=rows)


def _vllm_column(vllm: VllmColumn, contenders: Sequence[Contender], workload: Sequence[EvalPrompt],
                 rows: list[ServingRow], outputs: list[list[list[int]]], *, concurrency: Sequence[int],
                 max_new_tokens: int, min_requests: int, warmup_tokens: int,
                 log: Callable[[str], None] | None) -> tuple[list[ServingRow], dict[str, Any]]:
    """vLLM on each point's requests for every setup the contenders map to; -> (rows with the vLLM cells, what the
    settings record)."""
    setups = {ct.config.name: ct.vllm_setup() for ct in contenders}
    wanted = list(dict.fromkeys(s for s in setups.values() if s is not None))
    points = [(c, [list(r.prompt_ids)
                   for r in workload_requests(workload, point_requests(c, min_requests), max_new_tokens)])
              for c in concurrency]
    if not wanted and log is not None:
        log("vLLM column: no AR or full-depth n-gram configuration in this sweep, so nothing for vLLM to run")
    measured, error = vllm.measure(wanted, points, max_new_tokens=max_new_tokens, warmup_tokens=warmup_tokens,
                                   log=log)
    info = {**vllm.info, "setups": {name: s.label for name, s in setups.items() if s is not None},
            "engine_s": {f"{s.label} C={c}": round(p.engine_s, 1) for (s, c), p in measured.items()}}
    if error is not None:
        info["error"] = error
        if log is not None:
            log(f"vLLM column: {error}; the points measured before it are kept")
    return add_vllm(rows, outputs, setups, measured), info


def _machine(target: Decoder | None) -> dict[str, Any]:
    """What the numbers ran on: the device and dtype, plus the torch thread count of a CPU run (a GPU run's numbers
    do not depend on it, so it is not reported there); nothing for a sweep run without a target (stubbed points)."""
    import torch

    if target is None:
        return {}
    w = target.embed_tokens.weight
    out: dict[str, Any] = {"device": str(w.device), "dtype": str(w.dtype).removeprefix("torch.")}
    if w.device.type == "cpu":
        out["torch_threads"] = torch.get_num_threads()
    return out


@dataclass(frozen=True)
class BenchSettings:
    """The shape of a serving sweep, one value the command line builds from its flags: the `concurrency` levels,
    `max_new_tokens` per request, `num_draft_tokens` K for every drafter configuration that names none (None: the
    depth each was trained for), at least `min_requests` requests per point, `warmup_tokens` per warm-up request,
    `compile` every configuration (`+compile` on each), the workload from `prompts` (the first `limit` per domain
    when given), `breakeven`: also the break-even committed length (Eq. 25) in the table, and `repeats` timed runs
    per point and configuration, the median one reported (`run_sweep`)."""

    concurrency: tuple[int, ...] = DEFAULT_CONCURRENCY
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    num_draft_tokens: int | None = None
    min_requests: int = DEFAULT_MIN_REQUESTS
    warmup_tokens: int = 8
    compile: bool = False
    prompts: str | Path = EVAL_PROMPTS
    limit: int | None = None
    breakeven: bool = False
    repeats: int = 1


def bench(model: Decoder, tokenizer: Any, target_dir: Path, configs: Sequence[ServingConfig],
          settings: BenchSettings | None = None, *, workload: Sequence[EvalPrompt] | None = None,
          cost_table_path: str | Path | None = None, vllm: VllmColumn | None = None,
          out_dir: str | Path | None = None, log: Callable[[str], None] | None = print,
          out: Callable[[str], None] = print) -> ServingReport:
    """The whole benchmark on a loaded target, as `settings` say (`BenchSettings`; None: the defaults): check the
    configs, build the workload (`workload` when given, else every prompt of `settings.prompts` that fits), load
    drafters and policies, sweep (with vLLM on the same requests when `vllm` is given), print the table, write
    results into `out_dir`."""
    s = BenchSettings() if settings is None else settings
    concurrency, max_new_tokens = s.concurrency, s.max_new_tokens
    check_configs(configs)
    if s.compile:
        configs = [replace(c, compile=True) for c in configs]
    if any(c < 1 for c in concurrency) or not concurrency:
        raise ServingError(f"concurrency values must be positive integers, got {list(concurrency)}")
    if max_new_tokens < 1:
        raise ServingError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    prompts_path: str | Path = s.prompts
    if workload is None:
        workload = serving_workload(tokenizer, model.config.max_position_embeddings, max_new_tokens, prompts_path,
                                    limit=s.limit)
    else:
        workload = interleave_domains(workload)
        prompts_path = "(given workload)"
    contenders = build_contenders(model, target_dir, configs, concurrency=concurrency,
                                  num_draft_tokens=s.num_draft_tokens, cost_table_path=cost_table_path, log=log)
    t0 = time.perf_counter()
    report = run_sweep(model, contenders, workload, concurrency=concurrency, max_new_tokens=max_new_tokens,
                       min_requests=s.min_requests, warmup_tokens=s.warmup_tokens, log=log, vllm=vllm,
                       repeats=s.repeats,
                       settings={"target": str(target_dir), "prompts": str(prompts_path), "limit": s.limit,
                                 "repeats": s.repeats})
    report.settings["sweep_s"] = round(time.perf_counter() - t0, 2)
    out(report.format(breakeven=s.breakeven))
    if out_dir is not None:
        paths, note = report.write(out_dir, breakeven=s.breakeven)
        if note:
            out(note)
        out("wrote " + ", ".join(str(p) for p in paths))
    bad = [r for r in report.rows if r.lossless_ok is False]
    if bad:
        print(f"angelspec: LOSSLESS CHECK FAILED at T=0: {', '.join(f'{r.config} C={r.concurrency}' for r in bad)} "
              "differ from AR", file=sys.stderr)
    return report
