"""What a plain step of a speculative engine costs beside an AR step, with and without the drafter's upkeep.

While the serving gate (`--policy auto`) has drafting off, every step is a plain step. It should cost what an AR step
costs. Three engines over the same requests, end to end (`SpecEngine.generate`: the forward, the token choice, the
host bookkeeping, admissions), each in its own engine with the same cache size:

    AR          no drafter
    upkeep      the drafter, every step plain and keeping the drafter's context (its round of zero drafts, the commit
                kept for the next drafted round): what a plain probe does while drafting is on
    no upkeep   the drafter, every step plain as the gate runs them while drafting is off (an AR step that holds on
                to its taps), and one catch-up at the end of the run (a drafted step's first part: `Step._resync`)

Printed per concurrency C (C rows, 4C requests of 128 new tokens from the eval prompts): tokens/s and ms per step of
each, and each speculative engine's throughput as a share of AR's. Medians of interleaved repeats in one process (this
CPU's speed drifts between runs; the ratios hold).

    .venv/bin/python benchmarks/plain_step.py                        # shipped DFly, C = 1,4,16, compiled
    .venv/bin/python benchmarks/plain_step.py --drafter mtp:src/angelspec/assets/drafters/mtp --concurrency 8
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence
from pathlib import Path

import torch

from angelspec.assets import DEFAULT_DRAFTERS, DEFAULT_TARGET
from angelspec.decoding.engine import EngineConfig, Request, SpecEngine
from angelspec.decoding.loading import draft_depth, load_target_and_tokenizer, resolve_drafter
from angelspec.eval.serving.sweep import serving_workload, workload_requests


class AlwaysPlain:
    """A gate that never drafts; `upkeep` as given. The run's last step drafts (one draft: the catch-up runs once)."""

    lookup_only = lookup_engine = measure_only = False

    def __init__(self, upkeep: bool, steps: int) -> None:
        self.upkeep, self.steps, self.calls = upkeep, steps, 0

    def choose_depth(self, num_active: int, num_draft_tokens: int) -> int:
        self.calls += 1
        return 1 if self.calls == self.steps else 0

    def observe_step(self, *args: object) -> None:
        pass


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=str(DEFAULT_TARGET))
    p.add_argument("--drafter", default=f"dfly:{DEFAULT_DRAFTERS / 'dfly'}")
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-compile", dest="compile", action="store_false")
    args = p.parse_args()
    torch.manual_seed(0)
    target_dir = Path(args.target)
    model, tokenizer = load_target_and_tokenizer(target_dir)
    drafter = resolve_drafter(args.drafter, model, target_dir)
    if drafter is None:
        raise SystemExit("--drafter: name a drafter (this compares its plain steps with AR steps)")
    workload = serving_workload(tokenizer, model.config.max_position_embeddings, args.max_new_tokens)
    k = draft_depth(drafter)
    print(f"plain steps against AR steps: {args.drafter} (K = {k}), compile={args.compile}, "
          f"{args.max_new_tokens} new tokens, 4C requests, {torch.get_num_threads()} threads")
    print("| C | AR tok/s | AR ms/step | upkeep ms/step | no upkeep ms/step | upkeep / AR | no upkeep / AR |")
    print("|---|---|---|---|---|---|---|")
    for c in (int(x) for x in args.concurrency.split(",")):
        reqs = workload_requests(workload, 4 * c, args.max_new_tokens)
        max_len = max(len(r.prompt_ids) for r in reqs) + args.max_new_tokens
        config = EngineConfig(max_batch_size=c, max_seq_len=max_len, num_draft_tokens=k, compile=args.compile,
                              spec_gate=True)
        engines = {"AR": SpecEngine(model, None, config), "upkeep": SpecEngine(model, drafter, config),
                   "no upkeep": SpecEngine(model, drafter, config)}
        rates: dict[str, list[float]] = {name: [] for name in engines}
        steps: dict[str, list[float]] = {name: [] for name in engines}
        for rep in range(args.repeats + 1):  # the first round warms every engine up (compiles), untimed
            for name, engine in engines.items():
                tps, ms = run(engine, name, reqs if rep else reqs[:c])
                if rep:
                    rates[name].append(tps)
                    steps[name].append(ms)
        tps = {name: statistics.median(v) for name, v in rates.items()}
        ms = {name: statistics.median(v) for name, v in steps.items()}
        print(f"| {c} | {tps['AR']:.0f} | {ms['AR']:.3f} | {ms['upkeep']:.3f} | {ms['no upkeep']:.3f} | "
              f"{tps['upkeep'] / tps['AR']:.3f} | {tps['no upkeep'] / tps['AR']:.3f} |", flush=True)


def run(engine: SpecEngine, name: str, reqs: Sequence[Request]) -> tuple[float, float]:
    """One generate call -> (tokens/s, ms per step)."""
    if name != "AR":
        # every row makes a token a step, the first at admission: the drafted step is the run's last but one
        steps = sum(r.max_new_tokens - 1 for r in reqs) // engine.config.max_batch_size
        engine.gate = AlwaysPlain(upkeep=name == "upkeep", steps=steps - 1)
    engine.generate(reqs)
    m = engine.metrics
    if name != "AR" and m.skipped_steps != m.steps - 1:
        raise SystemExit(f"{name}: expected one drafted step in {m.steps}, got {m.steps - m.skipped_steps}")
    return m.tokens_per_s, 1e3 * m.wall_s / m.steps


if __name__ == "__main__":
    main()
