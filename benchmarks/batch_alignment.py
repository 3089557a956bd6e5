"""What a batch whose rows are out of step costs, beside one whose rows move together.

A closed-loop sweep of fixed-length requests (`angelspec bench`) keeps AR's rows in lock-step: every row was admitted
in the same prefill and is at the same position, so each step attends over the longest prompt plus the tokens made
so far, and every C requests finish together and join in one prefill. Any step that commits more tokens in one row
than in another (a drafted or lookup step) puts the rows out of step for good, and two costs follow that no
per-step comparison inside the speculative engine can see (both kinds of step pay them):

    kv_len    a step attends over the longest active row (`kv_len`, a dense [B, kv_len] attention): rows at
              different positions make it longer on average. Printed: the compiled one-token forward (a plain step)
              at batch B over kv_len = L for each L, in ms and as a share of the shortest.
    admission requests finish one or two at a time and join in as many prefills: printed, the prefill of B prompts
              in one call against B calls of one prompt each (the same prompts), in ms and as a ratio.

    .venv/bin/python benchmarks/batch_alignment.py                  # embedded target, B = 16, fp32, compiled
    .venv/bin/python benchmarks/batch_alignment.py --batch 8 --kv-lens 64,128,256

Timings are medians of interleaved repeats in one process (this CPU's speed drifts between runs; ratios hold).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from angelspec.assets import DEFAULT_TARGET, EVAL_PROMPTS
from angelspec.decoding.batching import prefill_rows
from angelspec.decoding.engine.forwards import TargetForwards
from angelspec.decoding.loading import load_target_and_tokenizer
from angelspec.models.kv_cache import StaticKVCache
from angelspec.models.linear import lay_out_weights


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=str(DEFAULT_TARGET))
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--kv-lens", default="100,150,200,300")
    p.add_argument("--steps", type=int, default=100, help="forwards per timing")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--no-compile", dest="compile", action="store_false")
    args = p.parse_args()
    torch.manual_seed(0)
    model, tokenizer = load_target_and_tokenizer(Path(args.target))
    lay_out_weights(model)  # as the engine lays weights out on a CPU
    b, lens = args.batch, [int(x) for x in args.kv_lens.split(",")]
    fwd = TargetForwards(model, (), speculative=True, compile=args.compile, cuda_graphs=False)
    cache = StaticKVCache(model.config, b, max(lens) + 8, slack=8, dtype=torch.float32, device="cpu")
    last = torch.randint(0, model.config.vocab_size, (b,))
    ones = torch.ones(b, dtype=torch.int64)

    def forward_ms(kv_len: int) -> float:
        cache.lengths.fill_(kv_len - 1)
        t = time.perf_counter()
        for _ in range(args.steps):
            fwd.one_token(last, cache, kv_len, ones)
            cache.lengths.fill_(kv_len - 1)
        return (time.perf_counter() - t) / args.steps * 1e3

    from angelspec.data.prompts import load_prompts

    prompts = [tokenizer.apply_chat_template(r["messages"], add_generation_prompt=True)
               for r in load_prompts(EVAL_PROMPTS)][:b]

    def prefill_ms(together: bool) -> float:
        cache.reset()
        t = time.perf_counter()
        if together:
            prefill_rows(model, cache, list(range(b)), prompts)
        else:
            for r in range(b):
                prefill_rows(model, cache, [r], [prompts[r]])
        return (time.perf_counter() - t) * 1e3

    with torch.inference_mode():
        for kv_len in lens:  # warm-up: compile and first touches
            forward_ms(kv_len)
        prefill_ms(True), prefill_ms(False)
        times: dict[int, list[float]] = {kv_len: [] for kv_len in lens}
        admit: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(args.repeats):
            for kv_len in lens:
                times[kv_len].append(forward_ms(kv_len))
            for together in (True, False):
                admit[together].append(prefill_ms(together))
    base = statistics.median(times[lens[0]])
    print(f"one-token forward at batch {b} ({'compiled' if args.compile else 'eager'}, {torch.get_num_threads()} "
          f"threads), median of {args.repeats} x {args.steps}:")
    for kv_len in lens:
        ms = statistics.median(times[kv_len])
        print(f"  kv_len {kv_len:4d}: {ms:6.2f} ms  {ms / base:.2f}x")
    one, apart = statistics.median(admit[True]), statistics.median(admit[False])
    print(f"prefill of {b} prompts ({sum(map(len, prompts))} tokens): one call {one:.1f} ms, {b} calls {apart:.1f} ms "
          f"({apart / one:.2f}x)")


if __name__ == "__main__":
    main()
