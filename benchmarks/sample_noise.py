"""What a sampled token draw costs at a real vocabulary: `sampling.sample` (float32 exponentials from the keyed hash,
`exponential_noise`) against the float64 uniforms it drew before (`uniform_noise`, then -log in float64), side by
side in one run on the same probabilities and keys. Both are the exponential race argmax(p / E); the float64 one
is written out here as it was. Prints the best time per call, the ratio float64 / float32, and the bytes of noise
per call; on a GPU (`--device cuda`) float64 runs at a fraction of float32's throughput on most parts.

Run: OMP_NUM_THREADS=1 .venv/bin/python benchmarks/sample_noise.py [--shapes 16x152064,16x5x152064] [--rounds 5]
    [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from functools import partial

import torch

from angelspec.decoding.sampling import NoiseStream, exponential_noise, sample, uniform_noise


def float64_sample(probs: torch.Tensor, seeds: torch.Tensor, counters: torch.Tensor, stream: int) -> torch.Tensor:
    """The float64 draw: uniforms in float64, E = -log u in float64, argmax(p / E)."""
    u = uniform_noise(seeds, counters, stream, probs.shape[-1])
    return torch.argmax(probs / u.log_().neg_(), dim=-1)


def best_ms(fn: Callable[[], object], rounds: int, sync: Callable[[], None]) -> float:
    fn()
    sync()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return min(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="1x152064,16x152064,16x5x152064", help="B x V or B x K x V, comma-separated")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    print(f"device {dev}, torch {torch.__version__}, threads {torch.get_num_threads()}")
    print(f"{'shape':>16} {'float64 ms':>11} {'float32 ms':>11} {'f64 / f32':>10} {'noise MB f64 / f32':>20} same")
    for spec in args.shapes.split(","):
        shape = tuple(int(x) for x in spec.split("x"))
        gen = torch.Generator().manual_seed(0)
        probs = torch.softmax(torch.randn(shape, generator=gen) * 3, dim=-1).to(dev)
        b = shape[0]
        seeds = torch.arange(b, dtype=torch.int64, device=dev) + 1000
        counters = torch.full(shape[:-1], 17, dtype=torch.int64, device=dev)
        if len(shape) == 3:
            counters = counters + torch.arange(shape[1], device=dev)
        call = (probs, seeds, counters, int(NoiseStream.TARGET))
        old = best_ms(partial(float64_sample, *call), args.rounds, sync)
        new = best_ms(partial(sample, *call), args.rounds, sync)
        n = probs.numel()
        same = float((float64_sample(*call) == sample(*call)).float().mean())
        stream = call[-1]
        assert exponential_noise(seeds, counters, stream, 1).dtype == torch.float32
        print(f"{spec:>16} {old:>11.2f} {new:>11.2f} {old / new:>9.2f}x {n * 8 / 2**20:>9.1f} / {n * 4 / 2**20:<8.1f}"
              f" {same:.3f}")
    print("same: share of draws where both give the same token. The two noises share the hash's top 23 bits; where "
          "the winner has a tiny E the float32 grid picks another sample (a different draw of the same distribution)")


if __name__ == "__main__":
    main()
