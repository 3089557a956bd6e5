"""What the load-time check of every tensor for NaN and infinity (`models.hf_io.check_finite`) costs: loading the
shipped target and a drafter with and without it, side by side.

Printed: CPU ms (this process's own time, so other jobs on a shared machine distort it less than wall time) of
`load_target` on the shipped target and `MTPDrafter.from_pretrained` on the shipped MTP drafter, with the check and
with it switched off, best of --repeats, and the ratio; then the check alone against the float32 conversion a
load does anyway, on one large synthetic tensor (an embedding of --big-rows x 4096 in bfloat16), where the chunked
reduction keeps the temporaries small. safetensors memory-maps the file, so the check is also what pages it in.

    .venv/bin/python benchmarks/load_checks.py
    .venv/bin/python benchmarks/load_checks.py --big-rows 150000 --repeats 3
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path

import torch

from angelspec.assets import DEFAULT_DRAFTERS, DEFAULT_TARGET
from angelspec.decoding.drafters.mtp import MTPDrafter
from angelspec.models import hf_io, load_target, mtp_io


def best_cpu_ms(fn: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.process_time()
        fn()
        best = min(best, time.process_time() - t0)
    return 1e3 * best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--big-rows", type=int, default=32000, help="rows of the synthetic 4096-wide embedding")
    args = parser.parse_args()
    torch.set_num_threads(1)
    target = load_target(DEFAULT_TARGET)
    loads = {"load_target(shipped target)": lambda: load_target(DEFAULT_TARGET),
             "MTPDrafter.from_pretrained(shipped mtp)":
                 lambda: MTPDrafter.from_pretrained(DEFAULT_DRAFTERS / "mtp", target=target)}
    check = hf_io.check_finite
    print(f"{'what':<42} {'checked ms':>11} {'unchecked ms':>13} {'ratio':>7}")
    for name, load in loads.items():
        with_check = best_cpu_ms(load, args.repeats)
        hf_io.check_finite = mtp_io.check_finite = lambda file, tensors: None
        try:
            without = best_cpu_ms(load, args.repeats)
        finally:
            hf_io.check_finite = mtp_io.check_finite = check
        print(f"{name:<42} {with_check:>11.1f} {without:>13.1f} {with_check / without:>6.2f}x")
    big = {"embed": torch.randn(args.big_rows, 4096).to(torch.bfloat16)}
    alone = best_cpu_ms(lambda: check(Path("synthetic"), big), args.repeats)
    convert = best_cpu_ms(lambda: big["embed"].to(torch.float32), args.repeats)
    print(f"{f'check [{args.big_rows}, 4096] bf16 vs .float()':<42} {alone:>11.1f} {convert:>13.1f} "
          f"{alone / convert:>6.2f}x")


if __name__ == "__main__":
    main()
