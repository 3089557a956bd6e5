"""What a plain step of a speculative engine costs beside an AR step, with and without the drafter's upkeep.

While the serving gate (`--policy auto`) has drafting off, every step is a plain step. It should cost what an AR step
costs. Engines over the same requests, end to end (`SpecEngine.generate`: the forward, the token choice, the host
bookkeeping, admissions), each in its own engine with the same cache size:

    AR          no drafter
    upkeep      the drafter, every step plain and keeping the drafter's context (its round of zero drafts, the commit
                kept for the next drafted round): what a plain probe does while drafting is on
    held        the drafter, every step plain without upkeep, each holding its taps for the catch-up (what the gate
                runs for a drafter that needs every missed position, `resume_window` None), and one drafted step near
                the end of the run that catches up on all of them (`Step._resync`)
    no taps     the drafter, every step plain without upkeep as the gate runs them for a drafter that resumes from its
                newest positions: AR's decode forward, no taps, but for the drafter's window of steps before the one
                drafted step, which hold theirs (`ServingGate.keep_taps`)
    lookup      the drafter with n-gram lookup in front (`HybridDrafter`), every step a lookup step without upkeep as
                the gate runs them while the model is off, at costs under which no match pays: every row looks its
                match up and verifies none (`Drafter.lookup_depths`), so the step should cost an AR step

Printed per concurrency C (C rows, 4C requests of 128 new tokens from the eval prompts): tokens/s and ms per step of
each, each speculative engine's throughput as a share of AR's, and the split of a step: the target forward alone
(`forwards.decode` and `forwards.one_token`, timed around the call) and the rest (the token choice, the gate, the host
bookkeeping, admissions, the catch-up), in ms per step. Medians of interleaved repeats in one process (this CPU's speed
drifts between runs; the ratios hold).

    .venv/bin/python benchmarks/plain_step.py                        # shipped DFly, C = 1,4,16, compiled
    .venv/bin/python benchmarks/plain_step.py --drafter mtp:src/angelspec/assets/drafters/mtp --concurrency 8
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from angelspec.assets import DEFAULT_DRAFTERS, DEFAULT_TARGET
from angelspec.decoding.drafters import NGramDrafter
from angelspec.decoding.drafters.hybrid import HybridDrafter
from angelspec.decoding.engine import EngineConfig, Request, SpecEngine
from angelspec.decoding.engine.forwards import TargetForwards
from angelspec.decoding.loading import draft_depth, load_target_and_tokenizer, resolve_drafter
from angelspec.eval.serving.sweep import serving_workload, workload_requests


class AlwaysPlain:
    """A gate that never drafts, but on its `steps`-th step (one draft: the catch-up runs once), keeping the
    drafter's context as `upkeep` says on the others, and (without upkeep) holding the taps of every step, or with
    `window` only of the `window` steps before the drafted one."""

    lookup_only = lookup_engine = measure_only = False

    def __init__(self, upkeep: bool, steps: int, window: int | None = None) -> None:
        self.keep, self.steps, self.window, self.calls = upkeep, steps, window, 0

    @property
    def upkeep(self) -> bool:
        """Read after `choose_depth`: the drafted step keeps the context (it catches up first)."""
        return self.keep or self.calls == self.steps

    @property
    def keep_taps(self) -> bool:
        return self.window is None or self.steps - self.calls <= self.window

    def choose_depth(self, num_active: int, num_draft_tokens: int) -> int:
        self.calls += 1
        return 1 if self.calls == self.steps else 0

    def observe_step(self, *args: object) -> None:
        pass


class LookupNothing(AlwaysPlain):
    """`AlwaysPlain` without upkeep whose steps are the serving gate's lookup steps, with costs (`lookup_costs`) under
    which verifying any draft costs more than it can return: each row looks its match up and verifies none."""

    lookup_engine = True

    def __init__(self, steps: int, window: int | None, k: int) -> None:
        super().__init__(upkeep=False, steps=steps, window=window)
        self.lookup_only, self.lookup_costs = False, (1.0,) + (1e3,) * k

    def choose_depth(self, num_active: int, num_draft_tokens: int) -> int:
        drafted = super().choose_depth(num_active, num_draft_tokens)
        self.lookup_only = not drafted
        return drafted or num_draft_tokens


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
    hybrid = HybridDrafter(drafter, NGramDrafter())
    names = ("AR", "upkeep", "held", "no taps", "lookup")
    print("| C | AR tok/s | " + " | ".join(f"{n} ms/step (forward + rest)" for n in names) + " | "
          + " | ".join(f"{n} / AR" for n in names[1:]) + " |")
    print("|---" * (2 + 2 * len(names) - 1) + "|")
    for c in (int(x) for x in args.concurrency.split(",")):
        reqs = workload_requests(workload, 4 * c, args.max_new_tokens)
        max_len = max(len(r.prompt_ids) for r in reqs) + args.max_new_tokens
        config = EngineConfig(max_batch_size=c, max_seq_len=max_len, num_draft_tokens=k, compile=args.compile,
                              spec_gate=True)
        engines = {"AR": SpecEngine(model, None, config)}
        engines.update({name: SpecEngine(model, hybrid if name == "lookup" else drafter, config)
                        for name in names[1:]})
        clocks = {name: ForwardClock(engine) for name, engine in engines.items()}
        rates: dict[str, list[float]] = {name: [] for name in engines}
        steps: dict[str, list[tuple[float, float]]] = {name: [] for name in engines}
        for rep in range(args.repeats + 1):  # the first round warms every engine up (compiles), untimed
            for name, engine in engines.items():
                clocks[name].seconds = 0.0
                tps, ms = run(engine, name, reqs if rep else reqs[:c], drafter.resume_window)
                if rep:
                    rates[name].append(tps)
                    steps[name].append((ms, 1e3 * clocks[name].seconds / engine.metrics.steps))
        tps = {name: statistics.median(v) for name, v in rates.items()}
        split = {name: (statistics.median(m for m, _ in v), statistics.median(f for _, f in v))
                 for name, v in steps.items()}
        cells = [f"{m:.3f} ({f:.3f} + {m - f:.3f})" for m, f in (split[n] for n in names)]
        ratios = [f"{tps[n] / tps['AR']:.3f}" for n in names[1:]]
        print(f"| {c} | {tps['AR']:.0f} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |", flush=True)


class ForwardClock:
    """Times an engine's target forwards of a plain step (`decode`, and `one_token` with a drafter)."""

    def __init__(self, engine: SpecEngine) -> None:
        self.seconds = 0.0
        for name in ("decode",) if engine.drafter is None else ("decode", "one_token"):
            self._wrap(engine.forwards, name)

    def _wrap(self, forwards: TargetForwards, name: str) -> None:
        forward: Callable[..., object] = getattr(forwards, name)

        def timed(*args: object) -> object:
            t = time.perf_counter()
            out = forward(*args)
            self.seconds += time.perf_counter() - t
            return out

        setattr(forwards, name, timed)


def run(engine: SpecEngine, name: str, reqs: Sequence[Request], window: int | None) -> tuple[float, float]:
    """One generate call -> (tokens/s, ms per step)."""
    drafts = 0 if name == "AR" else 1
    if name != "AR":
        # every row makes a token a step, the first at admission: the drafted step is the run's last but one
        steps = sum(r.max_new_tokens - 1 for r in reqs) // engine.config.max_batch_size
        engine.gate = LookupNothing(steps - 1, window, engine.k) if name == "lookup" else AlwaysPlain(
            upkeep=name == "upkeep", steps=steps - 1, window=window if name == "no taps" else None)
    engine.generate(reqs)
    m = engine.metrics
    skipped = m.steps - drafts if name not in ("AR", "lookup") else 0  # (a lookup step verifying nothing is no skip)
    if m.skipped_steps != skipped or (name == "lookup" and sum(m.depth_hist[1:]) > engine.config.max_batch_size):
        raise SystemExit(f"{name}: expected {drafts} drafted step in {m.steps}, got {m.steps - m.skipped_steps} "
                         f"({m.skipped_steps} skipped, drafts verified per row {m.depth_hist})")
    return m.tokens_per_s, 1e3 * m.wall_s / m.steps


if __name__ == "__main__":
    main()
