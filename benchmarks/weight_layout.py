"""What storing the linear weights transposed (`models.linear`) buys: the same decoding, side by side.

Two copies of the target are loaded: one keeps `nn.Linear`'s [out, in] rows (the engine's transposition is
switched off for it), the other is laid out as the engine does on CPU ([in, out] contiguous). Both decode the
same held-out prompts in one process, alternating, with AR and with the oracle drafter (every draft accepted, so
a step verifies K + 1 tokens), and optionally a real drafter folder. Printed per config: wall ms per step of the
verify forward and CPU ms of the whole run (the process's own time, so other jobs on a shared machine distort it
less than wall time) for each layout, best of --repeats, and the ratios. Outputs must be identical across layouts.

    .venv/bin/python benchmarks/weight_layout.py                       # eager, batch 1, K = 4 and 7
    .venv/bin/python benchmarks/weight_layout.py --compile --batch-sizes 1,16
    .venv/bin/python benchmarks/weight_layout.py --drafter src/angelspec/assets/drafters/dfly --ks 7
"""

from __future__ import annotations

import argparse
import copy
import time
from contextlib import contextmanager

import torch

from angelspec.assets import EVAL_PROMPTS, resolve_target_dir
from angelspec.data.prompts import load_prompts
from angelspec.decoding.engine import EngineConfig, Request, SpecEngine
from angelspec.decoding.loading import encode_prompts, load_target_and_tokenizer, resolve_drafter
from angelspec_research.oracle import OracleDrafter, greedy_continuations


@contextmanager
def row_major():
    """Engines built inside keep the weights as loaded (the engine's CPU transposition switched off)."""
    saved = SpecEngine._lay_out_weights
    SpecEngine._lay_out_weights = lambda self: None
    try:
        yield
    finally:
        SpecEngine._lay_out_weights = saved


def run(engine, prompts, new_tokens):
    c0, t0 = time.thread_time(), time.perf_counter()
    out = engine.generate([Request(p, max_new_tokens=new_tokens) for p in prompts])
    cpu, wall = time.thread_time() - c0, time.perf_counter() - t0
    m = engine.metrics
    return {"cpu": cpu, "wall": wall, "steps": m.steps, "verify": m.seconds["verify"],
            "tokens": [r.token_ids for r in out]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", help="HF checkpoint folder (default: the embedded target)")
    ap.add_argument("--drafter", help="also a drafter folder, as the engine loads it")
    ap.add_argument("--num-prompts", type=int, default=12)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--batch-sizes", default="1")
    ap.add_argument("--ks", default="4,7")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per layout and config, best kept")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    target_dir = resolve_target_dir(args.target)
    rows, tok = load_target_and_tokenizer(target_dir)
    cols = copy.deepcopy(rows)
    prompts = encode_prompts(tok, load_prompts(EVAL_PROMPTS)[: args.num_prompts],
                             context=rows.config.max_position_embeddings, think=False, source=str(EVAL_PROMPTS))
    with row_major():
        ar = SpecEngine(rows, None, EngineConfig(max_batch_size=len(prompts))).generate(
            [Request(p, max_new_tokens=args.new_tokens) for p in prompts])
    table = greedy_continuations(prompts, [r.token_ids for r in ar])

    def drafters(k: int) -> list[tuple[str, object, object]]:
        out: list[tuple[str, object, object]] = [(f"oracle K={k}", OracleDrafter(table), OracleDrafter(table))]
        if args.drafter:
            out.append((f"drafter K={k}", resolve_drafter(args.drafter, rows, target_dir),
                        resolve_drafter(args.drafter, cols, target_dir)))
        return out

    print(f"target {target_dir}, {len(prompts)} prompts x {args.new_tokens} new tokens, "
          f"{'compiled' if args.compile else 'eager'}, {args.threads} thread(s); best of {args.repeats}\n")
    print(f"{'B':>3}  {'config':<16}{'verify ms/step rows':>20}{'transposed':>11}{'ratio':>7}"
          f"{'run CPU ms rows':>17}{'transposed':>11}{'ratio':>7}")
    for b in [int(x) for x in args.batch_sizes.split(",")]:
        configs = [("AR", None, None, 1)] + [(n, dr, dc, k) for k in map(int, args.ks.split(","))
                                               for n, dr, dc in drafters(k)]
        for name, d_rows, d_cols, k in configs:
            cfg = EngineConfig(max_batch_size=b, num_draft_tokens=k, compile=args.compile)
            with row_major():
                engines = {"rows": SpecEngine(rows, d_rows, cfg)}
            engines["cols"] = SpecEngine(cols, d_cols, cfg)
            best: dict[str, dict] = {}
            for rep in range(args.repeats + 1):  # the first round warms up (and compiles); one engine per layout
                for layout, engine in engines.items():
                    r = run(engine, prompts, args.new_tokens)
                    if rep and (layout not in best or r["cpu"] < best[layout]["cpu"]):
                        best[layout] = r
            a, c = best["rows"], best["cols"]
            assert a["tokens"] == c["tokens"], f"{name}: outputs differ between weight layouts"
            va, vc = 1000 * a["verify"] / a["steps"], 1000 * c["verify"] / c["steps"]
            print(f"{b:>3}  {name:<16}{va:>20.3f}{vc:>11.3f}{vc / va:>6.2f}x"
                  f"{1000 * a['cpu']:>13.1f}{1000 * c['cpu']:>11.1f}{c['cpu'] / a['cpu']:>6.2f}x", flush=True)


if __name__ == "__main__":
    main()
