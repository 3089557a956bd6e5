"""The attention of decode and verify steps on a CPU: SDPA under the cache's boolean mask against the native kernel
(`models/kernels/cached_attention.c`, the "native" attention backend that "auto" picks on a CPU where it is built).

Two parts, each measured side by side in one run (rounds interleave the two ways; a cell is the median over
--repeats rounds):

    kernel   one attention call per layer shape: the embedded target's (4 query heads, 2 kv heads, head dim 64) and
             an 8B-like layer's (32 / 8 / 128, Qwen3-8B), at batch B and T new positions a row (1: a decode step,
             5: a verify over four drafts), rows of the lengths serving leaves them at (uniform in [L / 2, L], the
             longest exactly L, as requests of different ages share a batch). us per call and native / sdpa.
    engine   the compiled AR engine on the embedded target, `2 x B` prompts x --new-tokens tokens at batch B, with
             every attention of the target on "sdpa" and on "native": ms per step, native / sdpa, and whether the
             two produced the same tokens (--no-engine skips it).

Speeds on a shared CPU swing with whatever else runs: compare the ratios, measured in one run on an idle machine.

    .venv/bin/python benchmarks/cached_attention.py                    # both parts, two threads
    .venv/bin/python benchmarks/cached_attention.py --batch-sizes 1,8 --repeats 2 --no-engine   # smoke test
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from angelspec.models import few_rows
from angelspec.models.attention import AttentionPlan

SHAPES = {"embedded": (4, 2, 64), "8B-like": (32, 8, 128)}  # query heads, kv heads, head dim


def _time(fn: Callable[[], object], iters: int) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t) / iters


def _ways(q, k, v, start) -> dict[str, Callable[[], object]]:
    """One cached attention call each way, as the engine plans it (the plan and its mask built outside the timing)."""
    T, S = q.shape[2], k.shape[2]
    plans = {way: AttentionPlan.cached(start, T, S, S, way, fresh=False) for way in ("sdpa", "native")}
    assert plans["native"].kind == "rows"
    return {way: (lambda plan=plan: plan(q, k, v)) for way, plan in plans.items()}


def kernel_rows(batch_sizes: list[int], news: list[int], length: int, repeats: int, iters: int) -> list[str]:
    lines = [f"kernel: one call, rows of lengths in [{length // 2}, {length}] (us per call; median of {repeats})",
             f"{'layer':<10}{'B':>4}{'T':>3}{'sdpa':>10}{'native':>10}{'native/sdpa':>13}"]
    g = torch.Generator().manual_seed(0)
    for name, (H, Hkv, D) in SHAPES.items():
        for T in news:
            for B in batch_sizes:
                q = torch.randn(B, T, H, D, generator=g).transpose(1, 2)
                k = torch.randn(B, Hkv, length + 16, D, generator=g)
                v = torch.randn(B, Hkv, length + 16, D, generator=g)
                start = torch.randint(length // 2 - T, length - T + 1, (B,), generator=g)
                start[0] = length - T
                ways = _ways(q, k[:, :, :length], v[:, :, :length], start)
                torch.testing.assert_close(ways["native"](), ways["sdpa"](), atol=1e-5, rtol=1e-4)
                got: dict[str, list[float]] = {w: [] for w in ways}
                for _ in range(repeats):
                    for w, fn in ways.items():
                        got[w].append(_time(fn, iters))
                s, n = (statistics.median(got[w]) * 1e6 for w in ways)
                lines.append(f"{name:<10}{B:>4}{T:>3}{s:>10.1f}{n:>10.1f}{n / s:>12.2f}x")
    return lines


def engine_rows(batch_sizes: list[int], new_tokens: int, repeats: int) -> list[str]:
    from angelspec.assets import EVAL_PROMPTS, resolve_target_dir
    from angelspec.data.prompts import load_prompts
    from angelspec.decoding.engine import EngineConfig, Request, SpecEngine
    from angelspec.decoding.loading import encode_prompts, load_target_and_tokenizer
    from angelspec.models.attention import set_attention_backend

    target, tok = load_target_and_tokenizer(str(resolve_target_dir(None)))
    prompts = encode_prompts(tok, load_prompts(EVAL_PROMPTS), context=target.config.max_position_embeddings,
                             think=False, source="eval prompts")

    def run(B: int, backend: str) -> tuple[float, list[list[int]]]:
        set_attention_backend(target, backend)
        engine = SpecEngine(target, None, EngineConfig(max_batch_size=B, compile=True))
        reqs = [Request(p, max_new_tokens=new_tokens) for p in prompts[:2 * B]]
        t = time.perf_counter()
        out = engine.generate(reqs)
        return 1e3 * (time.perf_counter() - t) / engine.metrics.steps, [o.token_ids for o in out]

    lines = [f"engine: compiled AR, 2 x B prompts x {new_tokens} tokens (ms per step; median of {repeats})",
             f"{'B':>4}{'sdpa':>10}{'native':>10}{'native/sdpa':>13}  same tokens"]
    for B in batch_sizes:
        for backend in ("sdpa", "native"):  # warm-up: compile both graphs
            run(B, backend)
        got: dict[str, list[float]] = {"sdpa": [], "native": []}
        same = True
        for _ in range(repeats):
            a, out_a = run(B, "sdpa")
            b, out_b = run(B, "native")
            got["sdpa"].append(a)
            got["native"].append(b)
            same = same and out_a == out_b
        s, n = statistics.median(got["sdpa"]), statistics.median(got["native"])
        lines.append(f"{B:>4}{s:>10.2f}{n:>10.2f}{n / s:>12.2f}x  {'yes' if same else 'no'}")
    set_attention_backend(target, "auto")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-sizes", default="1,2,4,8,16,32")
    p.add_argument("--new", default="1,5", help="new positions a row (kernel part)")
    p.add_argument("--length", type=int, default=200, help="the longest row's slots (kernel part)")
    p.add_argument("--new-tokens", type=int, default=128, help="tokens a request (engine part)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-engine", dest="engine", action="store_false")
    args = p.parse_args()
    if few_rows.attention_op() is None:
        raise SystemExit(f"the native kernel is not built here: {few_rows.status()}")
    torch.set_num_threads(args.threads)
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    print(f"torch {torch.__version__}, {args.threads} threads, {few_rows.status()}")
    for line in kernel_rows(sizes, [int(t) for t in args.new.split(",")], args.length, args.repeats, args.iters):
        print(line, flush=True)
    if args.engine:
        print()
        for line in engine_rows(sizes, args.new_tokens, args.repeats):
            print(line, flush=True)


if __name__ == "__main__":
    main()
