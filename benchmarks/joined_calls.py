"""A/B of the joined drafter calls at batch 1 (issue 14, "cut the overhead", docs/design.md section 9): a greedy
round's catch-up (appending the newly committed positions to the draft context) and its drafting pass as ONE
compiled call (`join_catch_up = True`, the default of the block and MTP-family drafters) against the same two
steps as two calls (`join_catch_up = False`, how they ran before).

Why it can matter: at batch 1 on a CPU a compiled call has a fixed cost (dynamo's guard check, ~90 us here) that is
a visible share of a ~2 ms step, and the catch-up happens on every drafted step.

How: one compiled engine per drafter (batch 1, T=0, fp32, its weights as shipped), decoding the same held-out prompts
with the flag on and off in alternation, `--rounds` times each, after an untimed warm-up of both paths (so both
graphs are compiled before anything is timed). Reported per setting: the best and the median run's process CPU
seconds per generated token, and wall seconds per token; then the ratio on/off (below 1: the joined call is
cheaper). CPU time is the steadier measure on a shared machine (docs/design.md section 9); run with
`OMP_NUM_THREADS=1` when anything else is running. Outputs must be identical both ways and to AR (the script
checks and exits 1 otherwise).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/joined_calls.py                 # dfly, mtp, eagle3, 12 prompts
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/joined_calls.py --drafters dfly --limit 2 --rounds 1  # smoke
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from angelspec.assets import DEFAULT_DRAFTERS, resolve_target_dir
from angelspec.decoding.engine import EngineConfig, Request, SpecEngine
from angelspec.decoding.loading import load_target_and_tokenizer, resolve_drafter
from angelspec.eval.serving.sweep import serving_workload

DEPTH = {"dfly": 7, "dspark": 7, "mtp": 3, "eagle3": 3}  # each at the depth it was trained for


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--drafters", default="dfly,mtp,eagle3",
                   help=f"shipped drafters to measure, of {','.join(sorted(DEPTH))} (default: dfly,mtp,eagle3)")
    p.add_argument("--limit", type=int, default=4, help="held-out prompts per domain (default 4: 12 prompts)")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--rounds", type=int, default=4, help="timed runs per setting, alternating (default 4)")
    return p.parse_args(argv)


def run(engine: SpecEngine, requests: list[Request]) -> tuple[list[list[int]], float, float, int]:
    """-> (outputs, process CPU seconds, wall seconds, generated tokens) of one generation."""
    c0, w0 = time.process_time(), time.perf_counter()
    out = engine.generate(requests)
    cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    return [list(r.token_ids) for r in out], cpu, wall, sum(len(r.token_ids) for r in out)


def measure(kind: str, target, target_dir: Path, requests: list[Request], ar: list[list[int]], rounds: int
            ) -> dict[str, dict[str, float]]:
    drafter = resolve_drafter(str(DEFAULT_DRAFTERS / kind), target, target_dir)
    inner = getattr(drafter, "inner", drafter)
    if not hasattr(inner, "join_catch_up"):
        raise SystemExit(f"{kind}: its drafter has no joined catch-up call to switch off")
    engine = SpecEngine(target, drafter, EngineConfig(max_batch_size=1, num_draft_tokens=DEPTH[kind], compile=True,
                                                      max_seq_len=max(len(r.prompt_ids) for r in requests)
                                                      + requests[0].max_new_tokens))
    per: dict[bool, dict[str, list[float]]] = {True: {"cpu": [], "wall": []}, False: {"cpu": [], "wall": []}}
    for joined in (True, False):  # warm-up: both paths' graphs compiled before anything is timed
        inner.join_catch_up = joined
        run(engine, requests[:2])
    for _ in range(rounds):
        for joined in (True, False):
            inner.join_catch_up = joined
            outs, cpu, wall, n = run(engine, requests)
            if outs != ar:
                raise SystemExit(f"{kind} (join_catch_up={joined}): outputs differ from AR (a bug)")
            per[joined]["cpu"].append(cpu / n)
            per[joined]["wall"].append(wall / n)
    inner.join_catch_up = True
    return {("joined" if j else "two calls"): {f"{k}_{stat}": 1e3 * fn(v) for k, v in d.items()
                                               for stat, fn in (("best", min), ("median", statistics.median))}
            for j, d in per.items()}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    kinds = [k.strip() for k in args.drafters.split(",") if k.strip()]
    unknown = [k for k in kinds if k not in DEPTH]
    if unknown:
        print(f"unknown drafter(s) {unknown}: pass some of {','.join(sorted(DEPTH))}", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    target_dir = resolve_target_dir(None)
    target, tok = load_target_and_tokenizer(target_dir)
    workload = serving_workload(tok, target.config.max_position_embeddings, args.max_new_tokens, limit=args.limit)
    requests = [Request(prompt_ids=p.ids, max_new_tokens=args.max_new_tokens) for p in workload]
    ar = [list(r.token_ids) for r in SpecEngine(target, config=EngineConfig(max_batch_size=1)).generate(requests)]
    print(f"joined catch-up + round vs two calls: batch 1, compiled, T=0, {len(requests)} held-out prompts, "
          f"{args.max_new_tokens} new tokens, {args.rounds} alternating runs each, torch threads "
          f"{torch.get_num_threads()}")
    print("| drafter (K) | setting | CPU ms/token best | median | wall ms/token best | median |")
    print("|---|---|---|---|---|---|")
    ratios = []
    for kind in kinds:
        res = measure(kind, target, target_dir, requests, ar, args.rounds)
        for setting, r in res.items():
            print(f"| {kind} ({DEPTH[kind]}) | {setting} | {r['cpu_best']:.3f} | {r['cpu_median']:.3f} | "
                  f"{r['wall_best']:.3f} | {r['wall_median']:.3f} |")
        j, t = res["joined"], res["two calls"]
        ratios.append(f"{kind}: joined / two calls = {j['cpu_median'] / t['cpu_median']:.3f} CPU (median), "
                      f"{j['cpu_best'] / t['cpu_best']:.3f} (best), {j['wall_median'] / t['wall_median']:.3f} wall")
    print("\n".join(ratios))
    print("outputs identical to AR both ways")
    return 0


if __name__ == "__main__":
    sys.exit(main())
