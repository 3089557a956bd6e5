"""What one speculative step costs beyond one target forward, measured with oracle drafters.

The oracle drafts the target's own greedy continuation (from an AR run of the same prompts), so at T=0 every
draft is accepted (MAL = K + 1) and proposing costs one gather; its `reject` twin drafts a wrong token at every
position (MAL = 1). Both run through the real engine beside plain AR decoding in one process, per batch size
and depth K, and the step is split into phases:

    forward   the target's verify forward over K + 1 tokens per row
    verify    the verification sampler (speculative / deterministic acceptance); at T=0 the greedy acceptance runs
              inside the forward's call (one compiled graph), so it counts in "forward" and this reads 0
    policy    the depth policy and the verify-width read
    commit    rollback, host read of the committed tokens, bookkeeping (engine side)
    drafter   propose + on_commit (≈ 0 for the oracle; the same split applies to a real drafter)

Printed per batch size first: what a step without drafts costs over an AR step ("skip/AR": the engine's speculative
step with the speculation gate skipping every round, as it does where drafting does not pay; 1.0 means a skipped
step costs exactly a plain decode step). Then per (B, K): the oracle's speed-up over AR, its efficiency (speed-up /
MAL: 1.0 would mean a step of K + 1 verified tokens costs exactly one AR step), the reject twin's step time over AR's
step time (the pure overhead of a speculative step that gains nothing), and the phase split in ms per step. Two more
columns say what bounds the speed-up on the machine at hand:

    ceiling   the oracle's speed-up if a step cost nothing but its target forward: AR's wall time over
              (the oracle run's prefill + its steps x its measured forward per step). Engine work (verify,
              policy, commit, drafter, host reads) is the gap between "oracle x" and this; what is left below
              the goal is the forward itself (K + 1 tokens per row cost more than one on a compute-bound CPU).
    fwd/AR    the verify forward over K + 1 tokens per row, in AR decode forwards (1.0: verifying is free)
    prefill   prefill's share of the oracle run's wall time (the same prompts are prefilled on both sides)

    .venv/bin/python benchmarks/step_cost.py                         # embedded target, fp32, eager
    .venv/bin/python benchmarks/step_cost.py --compile --batch-sizes 1 --ks 4,7
    .venv/bin/python benchmarks/step_cost.py --temperature 1.0       # the same at T > 0 (deterministic protocol)
    .venv/bin/python benchmarks/step_cost.py --policy dcut           # with a depth policy on
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from angelspec.assets import EVAL_PROMPTS, resolve_target_dir
from angelspec.data.prompts import load_prompts
from angelspec.decoding.drafters.ngram import NGramDrafter
from angelspec.decoding.engine import EngineConfig, Request, SpecEngine
from angelspec.decoding.loading import encode_prompts, load_target_and_tokenizer
from angelspec.decoding.policies.gate import SpecGate
from angelspec.decoding.sampling import SamplingParams
from angelspec_research.oracle import OracleDrafter, greedy_continuations

PHASES = ("forward", "verify", "policy", "commit", "drafter")


class NeverDraft(SpecGate):
    """The speculation gate, skipping drafting on every step (a round of 0 drafts)."""

    def should_draft(self, num_active: int) -> bool:
        return False


class PhaseClock:
    """Splits an engine's step phases further with host timers around the verification sampler (`Step._accept`) and
    the drafter's `propose` / `on_commit`. The engine's own "verify" phase is the target forward plus the
    sampler, so forward = verify - sampler (it also holds two small tensor ops: the token concat and a length
    copy; at T=0 also the greedy acceptance, which runs inside the forward's call and never calls `_accept`). On
    CPU every op is synchronous, so host time is compute time."""

    def __init__(self, engine: SpecEngine) -> None:
        self.seconds = {"verify": 0.0, "drafter": 0.0}
        self.engine = engine
        self._wrap(engine.step, "_accept", "verify")
        if engine.drafter is not None:
            self._wrap(engine.drafter, "propose", "drafter")
            self._wrap(engine.drafter, "on_commit", "drafter")

    def _wrap(self, obj: object, name: str, phase: str) -> None:
        inner = getattr(obj, name)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds[phase] += time.perf_counter() - t0

        setattr(obj, name, timed)

    def split(self) -> dict[str, float]:
        """Seconds per phase of `PHASES` over the run's speculative steps."""
        m = self.engine.metrics.seconds
        return {"forward": max(m["verify"] - self.seconds["verify"], 0.0), "verify": self.seconds["verify"],
                "policy": m["select"], "commit": max(m["draft"] + m["commit"] - self.seconds["drafter"], 0.0),
                "drafter": self.seconds["drafter"]}


def run(target, prompts, k, batch_size, drafter, sampling, compile_, policy=None, repeats=2, skip_all=False):
    """Best-of-`repeats` run (after a warm-up): (tokens/s, steps, MAL, phase seconds per step, outputs).
    skip_all: the speculation gate skips drafting on every step."""
    best = None
    for rep in range(repeats + 1):
        engine = SpecEngine(target, drafter, EngineConfig(max_batch_size=batch_size, num_draft_tokens=k,
                                                          compile=compile_, spec_gate=skip_all), depth_policy=policy)
        if skip_all:
            engine.gate = NeverDraft()
        clock = PhaseClock(engine) if drafter is not None else None
        reqs = [Request(p, max_new_tokens=NEW_TOKENS, sampling=sampling(i)) for i, p in enumerate(prompts)]
        t0 = time.perf_counter()
        out = engine.generate(reqs)
        wall = time.perf_counter() - t0
        m = engine.metrics
        tokens = sum(len(r.token_ids) for r in out)
        steps = max(m.steps, 1)
        split = {p: s / steps for p, s in (clock.split() if clock else {}).items()}
        if drafter is None:
            split = {"forward": m.seconds["verify"] / steps, "commit": m.seconds["commit"] / steps}
        res = {"tokens_per_s": tokens / wall, "steps": steps, "wall_s": wall, "mal": m.mean_accepted_length,
               "prefill_s": m.seconds["prefill"], "tokens": tokens,
               "ms_per_step": 1000 * wall / steps, "split_ms": {p: 1000 * s for p, s in split.items()},
               "outputs": [r.token_ids for r in out]}
        if rep > 0 and (best is None or res["tokens_per_s"] > best["tokens_per_s"]):
            best = res
    return best


NEW_TOKENS = 96


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", help="HF checkpoint folder (default: the embedded target)")
    ap.add_argument("--prompts", default=str(EVAL_PROMPTS), help="held-out prompts file")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--batch-sizes", default="1,4,16")
    ap.add_argument("--ks", default="1,2,4,7")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--policy", default="full", help="a --policy spec (full, fixed:N, dcut, alg1, production)")
    ap.add_argument("--compile", action="store_true", help="torch.compile the target forwards (both sides)")
    ap.add_argument("--repeats", type=int, default=2, help="timed runs per cell, best kept (after a warm-up)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    global NEW_TOKENS
    NEW_TOKENS = args.new_tokens
    torch.set_num_threads(args.threads)

    target_dir = resolve_target_dir(args.target)
    target, tok = load_target_and_tokenizer(target_dir)
    records = load_prompts(args.prompts)[: args.num_prompts]
    prompts = encode_prompts(tok, records, context=target.config.max_position_embeddings, think=False,
                             source=args.prompts)
    greedy = args.temperature == 0

    def sampling(i: int) -> SamplingParams:
        return SamplingParams() if greedy else SamplingParams(temperature=args.temperature, seed=1000 + i)

    # The oracle's table: the greedy continuation of every prompt (one AR run, batched).
    ar_greedy = SpecEngine(target, None, EngineConfig(max_batch_size=len(prompts))).generate(
        [Request(p, max_new_tokens=NEW_TOKENS) for p in prompts])
    table = greedy_continuations(prompts, [r.token_ids for r in ar_greedy])
    vocab = target.config.vocab_size

    policy_obj = None
    results, skipped = [], []
    print(f"target {target_dir}, {len(prompts)} prompts x {NEW_TOKENS} new tokens, T={args.temperature:g}, "
          f"policy {args.policy}, {'compiled' if args.compile else 'eager'}, {args.threads} thread(s)\n")
    head = (f"{'B':>3}{'K':>3}{'AR ms/step':>11}{'oracle x':>9}{'MAL':>6}{'eff':>6}{'reject/AR':>10}  "
            + f"{'ceiling':>8}{'fwd/AR':>7}{'prefill':>8}  "
            + "  ".join(f"{p:>8}" for p in PHASES) + "   (oracle ms/step)")
    print(head)
    for b in [int(x) for x in args.batch_sizes.split(",")]:
        ar = run(target, prompts, 1, b, None, sampling, args.compile, repeats=args.repeats)
        skip = run(target, prompts, 4, b, OracleDrafter(table), sampling, args.compile, repeats=args.repeats,
                   skip_all=True)
        if greedy:
            assert skip["outputs"] == ar["outputs"], "gate-skipped output differs from AR"
        skipped.append({"batch_size": b, "skip_step_over_ar_step": skip["ms_per_step"] / ar["ms_per_step"],
                        "skip_split_ms": skip["split_ms"], "ar_split_ms": ar["split_ms"]})
        print(f"{b:>3}  skip/AR {skip['ms_per_step'] / ar['ms_per_step']:.2f}x  (AR {ar['ms_per_step']:.3f}, "
              f"skipped {skip['ms_per_step']:.3f} ms/step: "
              + ", ".join(f"{p} {v:.3f}" for p, v in skip["split_ms"].items()) + ")")
        for k in [int(x) for x in args.ks.split(",")]:
            if args.policy != "full":
                from angelspec.decoding.policies.factory import cost_batch_sizes, make_policy
                from angelspec.eval.cost_profile import load_or_profile

                # The oracle drafts only the prompts it knows, so the cost table (D-cut, Algorithm 1) is profiled
                # with the n-gram lookup drafting every row on the profiler's random prompts: the same verify
                # forwards, and a proposal that costs about as little.
                policy_obj = make_policy(args.policy, target=target, drafter=OracleDrafter(table),
                                         num_draft_tokens=k, batch_sizes=cost_batch_sizes(b), compile=args.compile,
                                         cost_drafter=NGramDrafter(), cost_source=load_or_profile, log=None)
            acc = run(target, prompts, k, b, OracleDrafter(table), sampling, args.compile, policy_obj, args.repeats)
            rej = run(target, prompts, k, b, OracleDrafter(table, reject=True, vocab_size=vocab), sampling,
                      args.compile, policy_obj, args.repeats)
            if greedy:
                assert acc["outputs"] == ar["outputs"] == rej["outputs"], "speculative output differs from AR"
            speedup = acc["tokens_per_s"] / ar["tokens_per_s"]
            row = {"batch_size": b, "k": k, "ar_ms_per_step": ar["ms_per_step"], "oracle_speedup": speedup,
                   "oracle_mal": acc["mal"], "efficiency": speedup / acc["mal"],
                   "reject_step_over_ar_step": rej["ms_per_step"] / ar["ms_per_step"],
                   "oracle_split_ms": acc["split_ms"], "reject_split_ms": rej["split_ms"],
                   "ar_split_ms": ar["split_ms"]}
            results.append(row)
            fwd_ar = ar["split_ms"]["forward"]
            fwd_oracle = acc["split_ms"]["forward"]
            ceiling = ar["wall_s"] / (acc["prefill_s"] + acc["steps"] * fwd_oracle / 1000)
            row.update(ceiling_speedup=ceiling, forward_over_ar_forward=fwd_oracle / fwd_ar,
                       oracle_prefill_share=acc["prefill_s"] / acc["wall_s"])
            eff = speedup / acc["mal"]
            print(f"{b:>3}{k:>3}{ar['ms_per_step']:>11.2f}{speedup:>8.2f}x{acc['mal']:>6.2f}{eff:>6.2f}"
                  f"{row['reject_step_over_ar_step']:>9.2f}x{ceiling:>7.2f}x{fwd_oracle / fwd_ar:>7.2f}"
                  f"{100 * row['oracle_prefill_share']:>7.0f}%  "
                  + "  ".join(f"{acc['split_ms'].get(p, 0.0):>8.3f}" for p in PHASES))
    if args.json:
        report = {"settings": vars(args), "results": results, "skipped": skipped}
        Path(args.json).write_text(json.dumps(report, indent=1))
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
