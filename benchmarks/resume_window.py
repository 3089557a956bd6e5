"""How well a drafter drafts again from only its newest positions after a stretch of plain steps that made no taps.

While the serving gate has drafting off, a plain step can run AR's own decode forward (no taps) as long as the drafter,
when it drafts again, needs only the taps of its newest `resume_window` positions (`Drafter.resume_window`): the gate
holds the taps of that many steps before each drafted probe (`ServingGate.keep_taps`), and the drafter's context runs
on across the gap. This measures what the gap costs in acceptance, through the engine itself: per drafter, one request
at a time, a cycle of `--gap` plain steps of which the last W hold their taps, then one probe (its drafts verified, one
token committed, as the gate's probes are), repeated over the requests; the probes' mean accepted drafts for each W,
and with every step's taps held (the drafter's whole context), and the share of it each W keeps. T = 0, so every
engine commits AR's tokens and the probes land on the same positions.

    .venv/bin/python benchmarks/resume_window.py                               # the shipped drafters
    .venv/bin/python benchmarks/resume_window.py --drafters dfly --windows 4,8,16,32,64 --gap 96
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

import torch

from angelspec.assets import DEFAULT_DRAFTERS, DEFAULT_TARGET
from angelspec.decoding.engine import EngineConfig, SpecEngine
from angelspec.decoding.loading import draft_depth, load_target_and_tokenizer, resolve_drafter
from angelspec.decoding.policies.gate import ServingGate
from angelspec.eval.serving.sweep import serving_workload, workload_requests


class CycleGate(ServingGate):
    """`gap` plain steps without upkeep (the last `window` holding their taps; None: all of them), then a probe of K
    drafts that commits one token (`measure_only`); records what each probe accepted."""

    def __init__(self, k: int, gap: int, window: int | None) -> None:
        super().__init__(k)
        self.gap, self.window, self.calls, self.accepted = gap, window, 0, []

    def choose_depth(self, num_active: int, num_draft_tokens: int) -> int:
        at = self.calls % (self.gap + 1)
        self.calls += 1
        probe = at == self.gap
        self.upkeep = self.measure_only = probe
        self.keep_taps = probe or self.window is None or self.gap - at <= self.window
        return num_draft_tokens if probe else 0

    def observe_step(self, num_active: int, depth: int, seconds: float, accepted: Sequence[int],
                     depths: Sequence[int]) -> None:
        if depth:
            self.accepted.extend(accepted)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=str(DEFAULT_TARGET))
    p.add_argument("--drafters", default="dfly,dspark,mtp,eagle3",
                   help="shipped drafter names, or KIND:DIR specs, comma-separated")
    p.add_argument("--windows", default="0,8,16,32")
    p.add_argument("--gap", type=int, default=64, help="plain steps between probes")
    p.add_argument("--requests", type=int, default=12)
    p.add_argument("--max-new-tokens", type=int, default=128)
    args = p.parse_args()
    torch.manual_seed(0)
    target_dir = Path(args.target)
    model, tokenizer = load_target_and_tokenizer(target_dir)
    workload = serving_workload(tokenizer, model.config.max_position_embeddings, args.max_new_tokens)
    reqs = workload_requests(workload, args.requests, args.max_new_tokens)
    max_len = max(len(r.prompt_ids) for r in reqs) + args.max_new_tokens
    windows: list[int | None] = [int(w) for w in args.windows.split(",")]
    print(f"probes after {args.gap} plain steps, {args.requests} requests of {args.max_new_tokens} new tokens, "
          f"one at a time, T = 0; mean accepted drafts per probe")
    print("| drafter | K | resume_window | " + " | ".join(f"W = {w}" for w in windows) + " | every step's taps | "
          + " | ".join(f"W = {w} / all" for w in windows) + " |")
    print("|---" * (4 + 2 * len(windows)) + "|")
    for name in args.drafters.split(","):
        spec = name if ":" in name else f"{name}:{DEFAULT_DRAFTERS / name}"
        drafter = resolve_drafter(spec, model, target_dir)
        assert drafter is not None
        k = draft_depth(drafter)
        means: list[float] = []
        for window in [*windows, None]:
            engine = SpecEngine(model, drafter, EngineConfig(max_batch_size=1, max_seq_len=max_len, num_draft_tokens=k,
                                                             spec_gate=True))
            gate = engine.gate = CycleGate(k, args.gap, window)
            engine.generate(reqs)
            means.append(sum(gate.accepted) / max(len(gate.accepted), 1))
        full = means[-1]
        print(f"| {name} | {k} | {drafter.resume_window} | " + " | ".join(f"{m:.2f}" for m in means) + " | "
              + " | ".join(f"{m / full:.2f}" for m in means[:-1]) + " |", flush=True)


if __name__ == "__main__":
    main()
