"""What the target's GEMMs cost for M rows against one row: how much of a verify forward's price over K + 1 positions
(`step_cost.py`'s fwd/AR) is the matrix multiplies, on the machine at hand.

One pass runs every linear layer of the target once (the weights one forward streams), with M rows of input,
M = 1..16 (a verify over K + 1 positions at batch 1 has M = K + 1; a decode step at batch B has M = B), three ways:

    engine    `models.linear.linear` on the stored transpose (x @ W^T) through the BLAS (aten.mm): what the engine
              runs on CPU for one row, for weights below `models.linear.PACK_MIN_ELEMENTS`, and with
              `EngineConfig(prepack=False)`
    F.linear  the row-major [out, in] weight, nn.Linear's own call
    oneDNN    weights prepacked once for oneDNN (`torch.ops.mkldnn._reorder_linear_weight` laid out for M rows, then
              `_linear_pointwise`), every weight: what the engine's prepacked layers call past the few-rows
              kernel's row limit (`models.linear.prepack_weights`, whose copies are laid out for 8 rows whatever M
              is, and which also pay the native op's call and a check per product)
    kernel    the few-rows kernel (`models.few_rows`, its native op) on row-major copies: what the prepacked
              layers call from one row up to `few_rows.max_rows()` (printed); absent where it is not built

Rounds interleave the ways and row counts; each cell is the median over --repeats rounds of the mean over --iters
passes, in ms per pass, and "/ x1" is a cell over the engine's one-row pass. A GEMM bound by reading the weights
costs the same for a few rows as for one; where "/ x1" grows with M, the BLAS's few-row kernel is the limit.

    .venv/bin/python benchmarks/gemm_rows.py                       # embedded target, one thread
    .venv/bin/python benchmarks/gemm_rows.py --rows 1,5,8 --repeats 3 --iters 5   # smoke test
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from torch import Tensor

from angelspec.assets import resolve_target_dir
from angelspec.decoding.loading import load_target_and_tokenizer
from angelspec.models import few_rows
from angelspec.models.linear import Linear, linear, transposed_copy


def weights(target_dir: str | None) -> list[Tensor]:
    """Every linear layer's [out, in] weight of the target (the LM head once), fp32."""
    target, _ = load_target_and_tokenizer(resolve_target_dir(target_dir))
    return [m.weight.detach().float().contiguous() for m in target.modules() if isinstance(m, Linear)]


def passes(ws: list[Tensor], m: int) -> dict[str, Callable[[], None]]:
    """One pass per way over ws with m rows of input."""
    xs = {w.shape[1]: torch.randn(m, w.shape[1]) for w in ws}
    engine = [transposed_copy(w) for w in ws]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, m) for w in ws]

    def run_engine() -> None:
        for w in engine:
            linear(xs[w.shape[1]], w)

    def run_linear() -> None:
        for w in ws:
            torch.nn.functional.linear(xs[w.shape[1]], w)

    def run_onednn() -> None:
        for w, p in zip(ws, packed, strict=True):
            torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None, "none", [], "")

    ways = {"engine": run_engine, "F.linear": run_linear, "oneDNN": run_onednn}
    if few_rows.available():
        def run_kernel() -> None:
            for w in ws:
                few_rows.linear(xs[w.shape[1]], w)

        ways["kernel"] = run_kernel
    return ways


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", help="HF checkpoint folder (default: the embedded target)")
    ap.add_argument("--rows", default="1,2,3,4,5,8,16", help="row counts M")
    ap.add_argument("--repeats", type=int, default=7, help="rounds (the median is kept)")
    ap.add_argument("--iters", type=int, default=20, help="passes per cell per round")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ws = weights(args.target)
    rows = [int(r) for r in args.rows.split(",")]
    cells = {m: passes(ws, m) for m in rows}
    times: dict[tuple[int, str], list[float]] = {}
    for _ in range(args.repeats + 1):  # the first round warms up
        for m in rows:
            for way, fn in cells[m].items():
                t0 = time.perf_counter()
                for _ in range(args.iters):
                    fn()
                times.setdefault((m, way), []).append(1e3 * (time.perf_counter() - t0) / args.iters)
    ms = {key: statistics.median(v[1:]) for key, v in times.items()}
    nbytes = sum(w.numel() * w.element_size() for w in ws)
    print(f"{len(ws)} weights, {nbytes / 2**20:.1f} MiB fp32; {args.threads} thread(s), "
          f"CPU capability {torch.backends.cpu.get_cpu_capability()}; median of {args.repeats} rounds; few-rows "
          f"kernel: {few_rows.status()}, engine uses it up to {few_rows.max_rows()} rows\n")
    ways = list(cells[rows[0]])
    print(f"{'M':>3}" + "".join(f"{w + ' ms':>13}{'/ x1':>7}" for w in ways))
    one = ms[(rows[0], "engine")] if rows[0] == 1 else None
    for m in rows:
        line = f"{m:>3}"
        for w in ways:
            line += f"{ms[(m, w)]:>13.3f}" + (f"{ms[(m, w)] / one:>6.2f}x" if one else f"{'':>7}")
        print(line)


if __name__ == "__main__":
    main()
