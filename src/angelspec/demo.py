"""`make demo`: the AngelSpec story on the embedded target, as a list of stages.

The story: load the target; decode a few held-out prompts per domain (code, maths, chat) greedily with
plain autoregressive (AR) decoding, the baseline; the headline: what the README recommends, measured on this machine
(compiled, n-gram lookup in front of the shipped model drafters, each at its trained depth, beside n-gram lookup
alone), with the machine named and the best drafter per domain; then, eager, the same prompts
with n-gram prompt lookup, the
shipped draft LM and the drafters shipped with the embedded target (MTP-3 and EAGLE-3 with TTT, DFly, DSpark,
DFly with D-cut; `make drafters` rebuilds them); train a DFly drafter for a few minutes to show the training
pipeline; run a small serving sweep; close with one table per domain of tokens/s, mean accepted length (MAL),
speed-up over AR, and whether the speculative outputs are identical to AR's (they must be, at T=0).
The measuring is `angelspec.eval.speculative`, the same code as `angelspec eval`, so the demo's numbers
mean what `eval`'s numbers mean.

Each stage reads what earlier ones left in the shared `DemoState` and returns a few facts for the
closing report; later work appends stages (train a drafter, benchmark against peers) to `STAGES`.

Run with `python -m angelspec.demo [--target DIR] [--draft-lm DIR] [--per-domain N] [--max-new-tokens N]
[--batch-size B] [--no-compile] [--device DEV] [--dtype DTYPE] [--attention KERNEL]`.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from angelspec.assets import DEFAULT_DRAFT_LM, DEFAULT_DRAFTERS, EVAL_PROMPTS, TRAIN_PROMPTS, resolve_target_dir
from angelspec.decoding.generate import preview_lines
from angelspec.decoding.loading import load_target_and_tokenizer, resolve_drafter
from angelspec.errors import EXIT_BAD_INPUT, UsageError, is_user_error

PREVIEW_LINES = 6  # of the one sample completion shown per domain


@dataclass
class DemoState:
    """What stages hand to each other: settings in, loaded objects and measurements out."""

    target: str | None
    max_new_tokens: int = 96
    per_domain: int = 6
    batch_size: int = 1
    num_draft_tokens: int = 4
    draft_lm: Path = DEFAULT_DRAFT_LM
    drafters: Path = DEFAULT_DRAFTERS  # the shipped drafters, one folder each (dfly, mtp, eagle3, dspark)
    train_minutes: float = 2.0  # the short DFly training stage; 0 skips it
    rollout_data: Path | None = None
    train_prompts: Path = TRAIN_PROMPTS
    work_dir: Path = Path(".cache/demo")
    placement: Any = None  # the target's device and dtype (angelspec.models.device.Placement; None: the default)
    target_dir: Path | None = None
    model: Any = None
    tokenizer: Any = None
    prompts: list[Any] = field(default_factory=list)  # EvalPrompt
    questions: list[str] = field(default_factory=list)  # the user message of each prompt, for previews
    settings: Any = None  # EvalSettings
    baseline: Any = None  # DecodeRun of AR decoding
    reports: list[Any] = field(default_factory=list)  # EvalReport per drafter, in stage order
    compile: bool = True  # the headline runs compiled, as the README recommends
    headline: list[Any] = field(default_factory=list)  # EvalReport per headline configuration
    best_per_domain: str = ""  # the headline's fastest configuration per domain, for the closing report


@dataclass(frozen=True)
class Stage:
    name: str
    run: Callable[[DemoState], dict[str, str]]  # returns short "key: value" facts for the closing report


def stage_load_target(state: DemoState) -> dict[str, str]:
    state.target_dir = resolve_target_dir(state.target)
    state.model, state.tokenizer = load_target_and_tokenizer(state.target_dir, state.placement)
    cfg = state.model.config
    w = state.model.embed_tokens.weight
    return {"target": str(state.target_dir), "device": f"{w.device} {str(w.dtype).removeprefix('torch.')}",
            "model": f"{cfg.architecture}, {cfg.num_parameters() / 1e6:.2f}M params, {cfg.num_hidden_layers} layers, "
                     f"context {cfg.max_position_embeddings}"}


def select_prompts(state: DemoState) -> tuple[list[Any], list[str]]:
    """The first `per_domain` held-out prompts of each domain that leave room for the whole token budget,
    so every request decodes the same number of tokens in every mode (a small target's context may be
    shorter than some prompts)."""
    from angelspec.data.prompts import load_prompts
    from angelspec.eval.speculative import EvalPrompt

    room = state.model.config.max_position_embeddings - state.max_new_tokens
    chosen: list[EvalPrompt] = []
    questions: list[str] = []
    counts: dict[str, int] = {}
    for p in load_prompts(EVAL_PROMPTS):
        domain = p["record"].get("domain", "other")
        if counts.get(domain, 0) >= state.per_domain:
            continue
        ids = state.tokenizer.apply_chat_template(p["messages"], add_generation_prompt=True, enable_thinking=False)
        if len(ids) <= room:
            chosen.append(EvalPrompt(ids=ids, domain=domain, line=p["line"]))
            questions.append(p["messages"][-1]["content"])
            counts[domain] = counts.get(domain, 0) + 1
    if not chosen:
        raise UsageError(f"no prompt of {EVAL_PROMPTS} fits the target's context with {state.max_new_tokens} new "
                         "tokens; lower --max-new-tokens")
    return chosen, questions


def stage_ar_baseline(state: DemoState) -> dict[str, str]:
    """Greedy AR decoding of the demo prompts: the reference every drafter must reproduce and beat."""
    from angelspec.eval.speculative import EvalSettings, run_decoding

    state.prompts, state.questions = select_prompts(state)
    state.settings = EvalSettings(max_new_tokens=state.max_new_tokens, batch_size=state.batch_size,
                                  num_draft_tokens=state.num_draft_tokens)
    state.baseline = run_decoding(state.model, state.prompts, state.settings, desc="AR")
    shown: set[str] = set()
    for prompt, question, out in zip(state.prompts, state.questions, state.baseline.outputs, strict=True):
        if prompt.domain in shown:
            continue
        shown.add(prompt.domain)
        first_line = question.strip().splitlines()[0] if question.strip() else ""
        print(f"\n[{prompt.domain}] {first_line[:100]}")
        print("\n".join(preview_lines(state.tokenizer.decode(out, skip_special_tokens=True), PREVIEW_LINES)))
    m = state.baseline.overall
    counts = ", ".join(f"{d} {sum(p.domain == d for p in state.prompts)}" for d in state.baseline.domains)
    return {"prompts": f"{len(state.prompts)} held-out ({counts}), greedy, {state.max_new_tokens} new tokens, "
                       f"batch {state.batch_size}",
            "AR": f"{m.output_tokens} tokens in {m.wall_s:.2f} s = {m.tokens_per_s:.1f} tokens/s"}


# The headline: what the README recommends (n-gram lookup in front of a model drafter), beside n-gram lookup alone,
# each at the depth it was trained for, compiled; the model drafters alone are in the eager table (each compiled
# configuration costs its own compilation, 30-60 s on 2 cores). (shipped folder or None for n-gram, `--drafter`
# suffix, table name)
HEADLINE_ROWS = ((None, "", "n-gram lookup"), ("dfly", "+ngram", "DFly + n-gram lookup"),
                 ("dspark", "+ngram", "DSpark + n-gram lookup"), ("mtp", "+ngram", "MTP-3 + n-gram lookup"))


def machine_description() -> str:
    """The machine the numbers come from: CPU model, cores, compute threads, torch version (and GPU, if any)."""
    import os
    import platform

    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = f", GPU {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else ""
    return (f"{cpu}, {os.cpu_count()} cores, {torch.get_num_threads()} compute thread(s), torch {torch.__version__}"
            f"{gpu}")


def best_per_domain(baseline: Any, reports: list[Any]) -> dict[str, tuple[str, float]]:
    """Domain -> (name, speed-up over AR) of the fastest configuration among `reports` (plain AR when none is
    faster), over the baseline's domains and all of them together."""
    from angelspec.eval.speculative import ALL

    best: dict[str, tuple[str, float]] = {}
    for domain in [*baseline.domains, ALL]:
        scored = [(r.drafter, (r.overall if domain == ALL else r.domains[domain]).speedup) for r in reports
                  if domain == ALL or domain in r.domains]
        name, speedup = max(scored, key=lambda s: s[1], default=("AR", 1.0))
        best[domain] = (name, speedup) if speedup > 1.0 else ("AR (no drafter was faster)", 1.0)
    return best


def stage_headline(state: DemoState) -> dict[str, str]:
    """The configuration the README recommends, measured here: AR and each drafter compiled (`EngineConfig(
    compile=True)`; each run's untimed warm-up pays the compilation), every drafter at the depth it was trained
    for, n-gram lookup in front of the model drafters; then the best drafter per domain on this machine."""
    from dataclasses import replace

    from angelspec.decoding.drafters.base import DrafterMismatchError
    from angelspec.decoding.loading import draft_depth
    from angelspec.eval.speculative import evaluate, format_comparison, run_decoding

    if not state.prompts:
        state.prompts, state.questions = select_prompts(state)
    settings = replace(state.settings, compile=state.compile)
    mode = "compiled" if state.compile else "eager (--no-compile)"
    machine = machine_description()
    print(f"machine: {machine}\nheadline runs: {mode}, batch {state.batch_size}, {len(state.prompts)} prompts")
    baseline = run_decoding(state.model, state.prompts, settings, desc=f"AR ({mode})")
    facts = {"machine": machine}
    for folder_name, suffix, name in HEADLINE_ROWS:
        if folder_name is None:
            spec = "ngram"
        else:
            folder = shipped_folder(state, folder_name)
            if folder is None:
                facts[name] = f"skipped: no drafter in {state.drafters / folder_name} (`make drafters` builds it)"
                print(f"{name}: {facts[name]}")
                continue
            spec = f"{folder}{suffix}"
        try:
            drafter = resolve_drafter(spec, state.model, state.target_dir)
        except DrafterMismatchError as e:
            facts[name] = f"skipped: {e}"
            print(f"{name}: {facts[name]}")
            continue
        print(f"\n--- {name} ({mode}) ---", flush=True)
        report = evaluate(state.model, drafter, state.prompts,
                          replace(settings, num_draft_tokens=draft_depth(drafter)), name=name, baseline=baseline)
        state.headline.append(report)
        r = report.overall
        facts[name] = (f"{r.speedup:.2f}x vs AR, MAL {r.spec.mean_accepted_length:.2f} "
                       f"(K={report.settings.num_draft_tokens}); {report.lossless_line()}")
    if state.headline:
        print(f"\nheadline ({mode}, {machine}):")
        print(format_comparison(baseline, state.headline))
    best = best_per_domain(baseline, state.headline)
    lines = [f"{domain}: {name} ({speedup:.2f}x)" for domain, (name, speedup) in best.items()]
    print("best drafter per domain on this machine: " + "; ".join(lines))
    facts["best per domain"] = state.best_per_domain = "; ".join(lines)
    facts["AR"] = f"{baseline.overall.tokens_per_s:.1f} tokens/s ({mode})"
    return facts


def _speculative_stage(state: DemoState, spec: str, name: str, *, k: int | str | None = None,
                       policy: str = "full", spec_gate: bool = False) -> dict[str, str]:
    """Decode the demo prompts with drafter `spec` (`--drafter` syntax) at depth `k` (default: the demo's K;
    "natural": what the drafter was trained for, `draft_depth`) and depth policy `policy`, with the speculation
    gate when `spec_gate`, against the AR baseline."""
    from dataclasses import replace

    from angelspec.decoding.policies.factory import cost_batch_sizes, make_policy
    from angelspec.eval.cost_profile import load_or_profile
    from angelspec.eval.speculative import evaluate

    drafter = resolve_drafter(spec, state.model, state.target_dir)
    if k == "natural":
        from angelspec.decoding.loading import draft_depth

        k = draft_depth(drafter)
    settings = replace(state.settings, num_draft_tokens=k or state.num_draft_tokens, spec_gate=spec_gate)
    depth_policy = None
    if policy != "full":
        depth_policy = make_policy(policy, target=state.model, drafter=drafter,
                                   num_draft_tokens=settings.num_draft_tokens,
                                   cost_table_path=state.work_dir / f"{name}-cost-table.json",
                                   batch_sizes=cost_batch_sizes(state.batch_size), compile=settings.compile,
                                   cost_source=load_or_profile, log=print)
    report = evaluate(state.model, drafter, state.prompts, settings, name=name, baseline=state.baseline,
                      depth_policy=depth_policy, policy=policy)
    state.reports.append(report)
    print(report.format())
    r = report.overall
    skipped = r.spec.skipped_steps
    gated = f", {skipped} of {r.spec.steps} steps without drafting" if spec_gate else ""
    return {name: f"{r.spec.tokens_per_s:.1f} tokens/s, MAL {r.spec.mean_accepted_length:.2f} "
                  f"(K={settings.num_draft_tokens}{gated}), {r.speedup:.2f}x vs AR; {report.lossless_line()}"}


# The shipped drafters the headline table measures: (folder name, `--drafter` suffix, table name, depth policy,
# speculation gate), each at the depth it was trained for. The gated rows show what `--spec-gate` makes of a drafter
# that loses to AR (MTP-3) and of the best one (DFly + D-cut); "+ngram" puts n-gram lookup in front of DFly.
SHIPPED_ROWS = (("mtp", "", "MTP-3 (shipped)", "full", False), ("eagle3", "", "EAGLE-3 (shipped)", "full", False),
                ("dfly", "", "DFly (shipped)", "full", False), ("dspark", "", "DSpark (shipped)", "full", False),
                ("dfly", "", "DFly+D-cut (shipped)", "dcut", False),
                ("dfly", "+ngram", "DFly+n-gram lookup (shipped)", "full", False),
                ("mtp", "", "MTP-3+gate (shipped)", "full", True),
                ("dfly", "", "DFly+D-cut+gate (shipped)", "dcut", True))


def shipped_folder(state: DemoState, name: str) -> Path | None:
    folder = state.drafters / name
    return folder if (folder / "config.json").is_file() else None


def stage_shipped(state: DemoState) -> dict[str, str]:
    """The drafters shipped with the embedded target, trained on its own rollouts of a 20k-prompt pool (their
    train reports and learning curves sit beside the weights). Each is skipped with a note when its folder is
    missing (`make drafters` builds them) or was trained for another target."""
    from angelspec.decoding.drafters.base import DrafterMismatchError

    facts: dict[str, str] = {}
    for folder_name, suffix, name, policy, gate in SHIPPED_ROWS:
        folder = shipped_folder(state, folder_name)
        if folder is None:
            facts[name] = f"skipped: no drafter in {state.drafters / folder_name} (`make drafters` builds it)"
            print(facts[name])
            continue
        print(f"\n--- {name} ---")
        try:
            facts.update(_speculative_stage(state, f"{folder}{suffix}", name, k="natural", policy=policy,
                                            spec_gate=gate))
        except DrafterMismatchError as e:
            facts[name] = f"skipped: {e}"
            print(facts[name])
    return facts


def stage_ngram(state: DemoState) -> dict[str, str]:
    """Prompt lookup: no model and no training, strong wherever outputs copy from the prompt (code)."""
    return _speculative_stage(state, "ngram", "n-gram")


def stage_draft_lm(state: DemoState) -> dict[str, str]:
    """The shipped one-layer draft LM; skipped with a note when it has not been trained yet, or when it was
    trained for another target than the one the demo runs."""
    from angelspec.decoding.drafters.base import DrafterMismatchError

    folder = state.draft_lm
    if not (folder / "config.json").is_file():
        note = (f"skipped: {folder} has no draft LM yet; train it with `angelspec train --drafter draft-lm "
                f"--data .cache/target-build/corpus --out {folder}` (a few minutes on CPU)")
        print(note)
        return {"draft LM": note}
    try:
        return _speculative_stage(state, f"draft-lm:{folder}", "draft-LM")
    except DrafterMismatchError as e:
        note = f"skipped: {e}"
        print(note)
        return {"draft LM": note}


def demo_rollout(state: DemoState) -> Path:
    """Roll out the shipped training prompts with the target once (the drafters train on its own answers)."""
    from angelspec.train.rollout import RolloutSettings, rollout

    if state.rollout_data is None:
        state.work_dir.mkdir(parents=True, exist_ok=True)
        data = state.work_dir / "rollout.jsonl"
        settings = RolloutSettings(max_new_tokens=state.max_new_tokens, batch_size=16)
        summary = rollout(state.target_dir, state.train_prompts, data, settings, force=True, progress=True,
                          placement=state.placement)
        print(summary.format())
        state.rollout_data = data
    return state.rollout_data


def _train_and_decode(state: DemoState, kind: str, name: str) -> dict[str, str]:
    """Train drafter `kind` with its demo preset for `state.train_minutes` on the rollouts, then decode."""
    from dataclasses import replace

    from angelspec.train.registry import trainable

    if state.train_minutes <= 0:
        return {name: "skipped (--train-minutes 0)"}
    train_fn, presets = trainable(kind).load()
    data = demo_rollout(state)
    out = state.work_dir / kind
    config = presets[f"{kind}_demo"]()
    taps = getattr(config, "target_layer_ids", None)
    if taps and max(taps) >= state.model.config.num_hidden_layers:
        # The demo presets tap the embedded target's layers; another (shallower) --target gets the default taps.
        config = replace(config, target_layer_ids=None)
    if getattr(config, "draft_vocab_size", 0) >= state.model.config.vocab_size:  # a small --target: whole vocab
        config = replace(config, draft_vocab_size=0)
    train_fn(state.target_dir, data, out, config=config, force=True, max_minutes=state.train_minutes, progress=True,
             log=print, placement=state.placement)
    return {"rollout": str(data), **_speculative_stage(state, f"{kind}:{out}", name, k="natural")}


def stage_train_dfly(state: DemoState) -> dict[str, str]:
    """The training pipeline in miniature: roll out the shipped training prompts with the target, train a DFly
    block drafter on its answers for a few minutes, measure it like the others. A taste, not the shipped one:
    `make drafters` trains those for an hour each on 20k prompts."""
    return _train_and_decode(state, "dfly", "DFly (2-min demo training)")


SERVING_CONCURRENCY = (1, 4, 16)
SERVING_NEW_TOKENS = 32  # the demo's own small settings (`angelspec bench` defaults to 128 tokens, compiled)
SERVING_MIN_REQUESTS = 4  # N = max(4C, 4) requests per point
SERVING_K = None  # every drafter at the depth it was trained for (`Drafter.trained_depth`: DFly 7, MTP-3 3)


def stage_serving(state: DemoState) -> dict[str, str]:
    """Serving in miniature (AngelSpec report Figure 4): AR, the shipped MTP and DFly verifying every draft, and DFly
    under the recommended serving setting `auto` (per step the depth that commits most tokens per second at the
    current load, plain steps where none beats them), as closed-loop clients at concurrency 1, 4 and 16, short greedy
    generations, eager (a minute or two on 2 CPU cores; the full sweep is `angelspec bench` or
    `benchmarks/serving.py`)."""
    from angelspec.decoding.drafters.base import DrafterMismatchError
    from angelspec.eval.serving import BenchSettings, ServingConfig, bench, lossless

    mtp, dfly = state.drafters / "mtp", state.drafters / "dfly"
    missing = [str(d) for d in (mtp, dfly) if not (d / "config.json").is_file()]
    if missing:
        note = f"skipped (no drafter in {', '.join(missing)}; `make drafters` builds them): the serving sweep " \
               "needs the shipped MTP and DFly"
        print(note)
        return {"serving": note}
    configs = [ServingConfig("AR", "none"), ServingConfig("MTP", f"mtp:{mtp}"), ServingConfig("DFly", f"dfly:{dfly}"),
               ServingConfig("DFly auto", f"dfly:{dfly}", "auto")]
    out_dir = state.work_dir / "serving"
    try:
        settings = BenchSettings(concurrency=SERVING_CONCURRENCY,
                                 max_new_tokens=min(SERVING_NEW_TOKENS, state.max_new_tokens),
                                 num_draft_tokens=SERVING_K, min_requests=SERVING_MIN_REQUESTS, warmup_tokens=4)
        report = bench(state.model, state.tokenizer, state.target_dir, configs, settings, out_dir=out_dir,
                       workload=state.prompts, cost_table_path=out_dir / "dfly-cost-table.json")
    except DrafterMismatchError as e:
        note = f"skipped: {e}"
        print(note)
        return {"serving": note}
    top = max(SERVING_CONCURRENCY)
    cells = []
    for name in report.configs:
        r = report.row(name, top)
        if r is not None:
            cells.append(f"{name} {r.tokens_per_s:.1f} tok/s" + ("" if r.speedup is None else f" ({r.speedup:.2f}x)"))
    ok = lossless(report)
    return {"serving": f"at concurrency {top}: " + ", ".join(cells),
            "serving auto": "; ".join(report.auto_lines()) or "not measured",
            "serving lossless": "every output identical to AR" if ok else "OUTPUTS DIFFER FROM AR",
            "serving results": str(out_dir)}


def stage_report(state: DemoState) -> dict[str, str]:
    """AR and every drafter side by side, per domain (eager); the headline's best drafter per domain again."""
    from angelspec.eval.speculative import format_comparison

    print(format_comparison(state.baseline, state.reports))
    ok = all(r.lossless for r in [*state.reports, *state.headline])
    facts = {"lossless": "every speculative output identical to AR" if ok else "SPECULATIVE OUTPUTS DIFFER FROM AR"}
    if state.best_per_domain:
        facts["use (headline, this machine)"] = state.best_per_domain
    return facts


STAGES: list[Stage] = [
    Stage("load target", stage_load_target),
    Stage("AR baseline (greedy, eager)", stage_ar_baseline),
    Stage("headline: the recommended configuration (compiled unless --no-compile, n-gram lookup in front of the "
          "model drafters, trained depths)", stage_headline),
    Stage("speculative decoding: n-gram prompt lookup", stage_ngram),
    Stage("speculative decoding: draft LM", stage_draft_lm),
    Stage("speculative decoding: the shipped drafters (MTP-3, EAGLE-3, DFly, DSpark, DFly + D-cut; MTP-3 and "
          "DFly + D-cut with the speculation gate)", stage_shipped),
    Stage("train a DFly block drafter for a few minutes, then decode with it", stage_train_dfly),
    Stage("serving sweep: throughput vs concurrency (AR, shipped MTP, DFly, DFly under the serving setting auto)",
          stage_serving),
    Stage("AR vs drafters, per domain (eager)", stage_report),
]


def run_demo(state: DemoState, stages: list[Stage] = STAGES) -> list[tuple[str, float, dict[str, str]]]:
    """Run the stages in order, each under a header; returns (name, seconds, facts) per stage."""
    report = []
    for i, stage in enumerate(stages, start=1):
        print(f"\n=== [{i}/{len(stages)}] {stage.name} ===", flush=True)
        t0 = time.perf_counter()
        facts = stage.run(state)
        report.append((stage.name, time.perf_counter() - t0, facts))
    return report


def format_report(report: list[tuple[str, float, dict[str, str]]]) -> str:
    lines = ["", "=== demo report ==="]
    for name, seconds, facts in report:
        lines.append(f"{name} ({seconds:.1f} s)")
        lines += [f"  {k}: {v}" for k, v in facts.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m angelspec.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--target", metavar="DIR", help="HF checkpoint folder (default: the embedded target)")
    parser.add_argument("--draft-lm", default=str(DEFAULT_DRAFT_LM), metavar="DIR",
                        help="draft LM folder for the draft-LM stage (default: the shipped one)")
    parser.add_argument("--per-domain", type=int, default=6, metavar="N", help="prompts per domain (default: 6)")
    parser.add_argument("--max-new-tokens", type=int, default=96, metavar="N", help="per prompt (default: 96)")
    parser.add_argument("--batch-size", type=int, default=1, metavar="B",
                        help="concurrent requests (default: 1, the latency setting speculative decoding is for; "
                             "on CPU, batched AR is already cheap per token)")
    parser.add_argument("--drafters", default=str(DEFAULT_DRAFTERS), metavar="DIR",
                        help="the shipped drafters, one folder each (default: the package's assets/drafters)")
    parser.add_argument("--train-minutes", type=float, default=2.0, metavar="M",
                        help="training budget of the demo's DFly training stage in minutes; 0 skips it "
                             "(default: 2)")
    parser.add_argument("--train-prompts", default=str(TRAIN_PROMPTS), metavar="FILE",
                        help="prompts the DFly training stage rolls out and trains on (default: the shipped training "
                             "prompts)")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                        help="run the headline table compiled, as recommended (default: --compile; the eager "
                             "comparison follows either way)")
    parser.add_argument("--work-dir", default=".cache/demo", metavar="DIR",
                        help="where the training stages write rollouts and drafters (default: .cache/demo)")
    parser.add_argument("--device", default=None, metavar="DEV",
                        help="cpu, cuda, cuda:N or mps (default: cuda:0 where torch sees a GPU, else cpu)")
    parser.add_argument("--dtype", default=None, metavar="DTYPE",
                        help="float32, bfloat16 or float16 of the target (default: bfloat16 on a GPU, float32 "
                             "elsewhere)")
    parser.add_argument("--attention", default=None, metavar="KERNEL",
                        help="attention kernels: auto, sdpa, native, flex or expand (default auto: FlexAttention on a "
                             "GPU, our native kernel for decode and verify steps on a CPU)")
    args = parser.parse_args(argv)
    for flag, value in (("--per-domain", args.per_domain), ("--max-new-tokens", args.max_new_tokens),
                        ("--batch-size", args.batch_size)):
        if value < 1:
            parser.error(f"{flag} must be at least 1, got {value}")
    try:
        from angelspec.models.device import resolve_placement

        state = DemoState(target=args.target, max_new_tokens=args.max_new_tokens, per_domain=args.per_domain,
                          batch_size=args.batch_size, draft_lm=Path(args.draft_lm), train_minutes=args.train_minutes,
                          drafters=Path(args.drafters), compile=args.compile, work_dir=Path(args.work_dir),
                          train_prompts=Path(args.train_prompts),
                          placement=resolve_placement(args.device, args.dtype, args.attention))
        report = run_demo(state)
    except Exception as e:
        if not is_user_error(e):
            raise
        print(f"demo: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(format_report(report))
    return 0 if all(r.lossless is not False for r in state.reports) else 1


if __name__ == "__main__":
    sys.exit(main())
