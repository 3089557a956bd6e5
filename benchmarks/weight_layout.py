"""What the engine's CPU weight layout (`models.linear`) buys: the same decoding, side by side.

Five copies of the target are loaded: "rows" keeps `nn.Linear`'s [out, in] rows (the engine's layout is switched
off for it), "transposed" is stored [in, out] contiguous (`EngineConfig(prepack=False)`), "python-op" is prepacked
as where the native op cannot be built (every product of two rows or more through oneDNN's prepacked copies, called
from the op written in Python in `models.linear`), "oneDNN" the same through the native op with its few-rows kernel
switched off, and "prepacked" is laid out as the engine does by default on a CPU (transposed, and the large weights
multiplied through the native op: the few-rows kernel up to its row limit, one row included, and oneDNN past it,
`models.few_rows`). All decode the same
held-out prompts in one process, alternating, with AR and with the oracle drafter (every draft accepted, so a step
verifies K + 1 tokens), and optionally a real drafter folder. Printed per config: wall ms per step of the verify
forward (the AR decode forward for AR) and CPU ms of the whole run (the process's own time, every thread's, so
other jobs on a shared machine distort it less than wall time) for each layout, best of --repeats, each layout's
ratio to "rows", oneDNN over python-op (what calling from C++ instead of Python saves) and prepacked over oneDNN
(what the kernel changes). Outputs must be identical across layouts.

    .venv/bin/python benchmarks/weight_layout.py                       # eager, batch 1, K = 4 and 7
    .venv/bin/python benchmarks/weight_layout.py --compile --batch-sizes 1,16
    .venv/bin/python benchmarks/weight_layout.py --drafter src/angelspec/assets/drafters/dfly --ks 7
"""

from __future__ import annotations

import argparse
import copy
import time
from contextlib import contextmanager, nullcontext

import torch

from angelspec.assets import EVAL_PROMPTS, resolve_target_dir
from angelspec.data.prompts import load_prompts
from angelspec.decoding.engine import EngineConfig, Request, SpecEngine
from angelspec.decoding.loading import encode_prompts, load_target_and_tokenizer, resolve_drafter
from angelspec.models import few_rows
from angelspec_research.oracle import OracleDrafter, greedy_continuations

LAYOUTS = ("rows", "transposed", "python-op", "oneDNN", "prepacked")


@contextmanager
def row_major():
    """Engines built inside keep the weights as loaded (the engine's CPU transposition switched off)."""
    saved = SpecEngine._lay_out_weights
    SpecEngine._lay_out_weights = lambda self: None
    try:
        yield
    finally:
        SpecEngine._lay_out_weights = saved


def run(engine, prompts, new_tokens, layout):
    few_rows.set_enabled(layout == "prepacked", native=layout != "python-op")
    c0, t0 = time.process_time(), time.perf_counter()
    out = engine.generate([Request(p, max_new_tokens=new_tokens) for p in prompts])
    cpu, wall = time.process_time() - c0, time.perf_counter() - t0
    few_rows.set_enabled(True)
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
    # Four targets of the same shapes through the same compiled functions: one graph each per batch size (their
    # weight strides and keys differ), more than dynamo's default of 8 before it falls back to eager.
    torch._dynamo.config.recompile_limit = 64

    target_dir = resolve_target_dir(args.target)
    first, tok = load_target_and_tokenizer(target_dir)
    targets = {"rows": first, **{n: copy.deepcopy(first) for n in LAYOUTS[1:]}}
    prompts = encode_prompts(tok, load_prompts(EVAL_PROMPTS)[: args.num_prompts],
                             context=first.config.max_position_embeddings, think=False, source=str(EVAL_PROMPTS))
    with row_major():
        ar = SpecEngine(first, None, EngineConfig(max_batch_size=len(prompts))).generate(
            [Request(p, max_new_tokens=args.new_tokens) for p in prompts])
    table = greedy_continuations(prompts, [r.token_ids for r in ar])

    def drafters(k: int) -> list[tuple[str, dict[str, object]]]:
        out: list[tuple[str, dict[str, object]]] = [(f"oracle K={k}", {n: OracleDrafter(table) for n in LAYOUTS})]
        if args.drafter:
            out.append((f"drafter K={k}", {n: resolve_drafter(args.drafter, t, target_dir)
                                            for n, t in targets.items()}))
        return out

    print(f"target {target_dir}, {len(prompts)} prompts x {args.new_tokens} new tokens, "
          f"{'compiled' if args.compile else 'eager'}, {args.threads} thread(s); best of {args.repeats}; "
          f"few-rows kernel: {few_rows.status()}, up to {few_rows.max_rows()} rows\n")
    width = 11 * len(LAYOUTS) + 47
    print(f"{'':>21}{'verify ms/step':^{width}}{'run CPU ms':^{width}}")
    print(f"{'B':>3}  {'config':<16}" + 2 * ("".join(f"{n:>11}" for n in LAYOUTS) + f"  {'vs rows':<29}"
                                             f"{'native':<8}{'kernel':<8}"))
    for b in [int(x) for x in args.batch_sizes.split(",")]:
        configs = [("AR", dict.fromkeys(LAYOUTS), 1)] + [(n, ds, k) for k in map(int, args.ks.split(","))
                                                           for n, ds in drafters(k)]
        for name, ds, k in configs:
            engines = {}
            for layout in LAYOUTS:
                cfg = EngineConfig(max_batch_size=b, num_draft_tokens=k, compile=args.compile,
                                   prepack=layout in ("python-op", "oneDNN", "prepacked"))
                with row_major() if layout == "rows" else nullcontext():
                    engines[layout] = SpecEngine(targets[layout], ds[layout], cfg)
            best: dict[str, dict] = {}
            for rep in range(args.repeats + 1):  # the first round warms up (and compiles); one engine per layout
                for layout, engine in engines.items():
                    r = run(engine, prompts, args.new_tokens, layout)
                    if rep and (layout not in best or r["cpu"] < best[layout]["cpu"]):
                        best[layout] = r
            for layout in LAYOUTS[1:]:
                assert best[layout]["tokens"] == best["rows"]["tokens"], f"{name}: outputs differ ({layout} vs rows)"
            verify = {n: 1000 * r["verify"] / r["steps"] for n, r in best.items()}
            cpu = {n: 1000 * r["cpu"] for n, r in best.items()}
            line = f"{b:>3}  {name:<16}"
            for col in (verify, cpu):
                line += "".join(f"{col[n]:>11.3f}" for n in LAYOUTS)
                line += "  " + " / ".join(f"{col[n] / col['rows']:.2f}x" for n in LAYOUTS[1:])
                line += f"  {col['oneDNN'] / col['python-op']:.2f}x   {col['prepacked'] / col['oneDNN']:.2f}x  "
            print(line, flush=True)


if __name__ == "__main__":
    main()
