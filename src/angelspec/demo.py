"""`make demo`: the AngelSpec story on the embedded target, as a list of stages.

Today the story is: load the target, then decode a few prompts per domain (code, maths, chat) greedily
through the engine and report tokens/s. Later stages (train a drafter, evaluate acceptance, benchmark
against AR and peers) are appended to `STAGES`; each stage reads what earlier ones left in the shared
`DemoState` and returns a few numbers for the closing report.

Run with `python -m angelspec.demo [--target DIR] [--max-new-tokens N]`.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from angelspec.cli import (
    EXIT_BAD_INPUT,
    MAX_SAMPLE_LINES,
    encode_prompts,
    is_user_error,
    load_target_and_tokenizer,
    preview_lines,
    resolve_target_dir,
    run_engine,
)

# A few prompts per domain, in the style of the embedded target's training data.
DEMO_PROMPTS: dict[str, list[str]] = {
    "code": [
        "Write a Python function `is_palindrome(s)` that returns True if the string reads the same backwards.",
        "Write a Python function that returns the n-th Fibonacci number.",
    ],
    "maths": [
        "Tom has 3 boxes with 12 apples each. He gives away 9 apples. How many apples does he have left?",
        "A train travels 60 km per hour for 3 hours. How far does it travel?",
    ],
    "chat": [
        "What are some tips for staying productive when working from home?",
        "Can you explain what a cache is in simple terms?",
    ],
}


@dataclass
class DemoState:
    """What stages hand to each other: settings in, loaded objects and measurements out."""

    target: str | None
    max_new_tokens: int
    target_dir: Path | None = None
    model: Any = None
    tokenizer: Any = None
    outputs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Stage:
    name: str
    run: Callable[[DemoState], dict[str, str]]  # returns short "key: value" facts for the closing report


def stage_load_target(state: DemoState) -> dict[str, str]:
    state.target_dir = resolve_target_dir(state.target)
    state.model, state.tokenizer = load_target_and_tokenizer(state.target_dir)
    cfg = state.model.config
    return {"target": str(state.target_dir),
            "model": f"{cfg.architecture}, {cfg.num_parameters() / 1e6:.2f}M params, {cfg.num_hidden_layers} layers, "
                     f"context {cfg.max_position_embeddings}"}


def stage_generate_ar(state: DemoState) -> dict[str, str]:
    """Greedy autoregressive decoding of every demo prompt in one batch: the baseline later stages beat."""
    from angelspec.spec.sampling import SamplingParams

    prompts = [{"line": i + 1, "messages": [{"role": "user", "content": text}], "domain": domain}
               for i, (domain, text) in enumerate((d, t) for d, ts in DEMO_PROMPTS.items() for t in ts)]
    context = state.model.config.max_position_embeddings
    ids = encode_prompts(state.tokenizer, prompts, context=context, think=False, source="demo prompts")
    results, metrics = run_engine(state.model, ids, max_new_tokens=state.max_new_tokens,
                                  sampling=[SamplingParams()] * len(ids), batch_size=len(ids))
    for p, res in zip(prompts, results, strict=True):
        text = state.tokenizer.decode([int(t) for t in res.token_ids], skip_special_tokens=True)
        print(f"\n[{p['domain']}] {p['messages'][0]['content']}")
        print("\n".join(preview_lines(text, MAX_SAMPLE_LINES)))
        print(f"    -- {len(res.token_ids)} tokens, finish_reason={res.finish_reason}")
    state.outputs["ar_metrics"] = metrics
    return {"prompts": f"{len(prompts)} ({', '.join(DEMO_PROMPTS)})",
            "AR greedy": f"{metrics.output_tokens} tokens in {metrics.wall_s:.2f} s = {metrics.tokens_per_s:.1f} "
                         f"tokens/s (batch {len(prompts)}, {metrics.steps} decode steps)"}


STAGES: list[Stage] = [
    Stage("load target", stage_load_target),
    Stage("generate (autoregressive, greedy)", stage_generate_ar),
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
    parser.add_argument("--max-new-tokens", type=int, default=96, metavar="N", help="per prompt (default: 96)")
    args = parser.parse_args(argv)
    state = DemoState(target=args.target, max_new_tokens=args.max_new_tokens)
    try:
        report = run_demo(state)
    except Exception as e:
        if not is_user_error(e):
            raise
        print(f"demo: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(format_report(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
