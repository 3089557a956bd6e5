"""What D-cut's depth choice costs per step: `DCut` (the depths worked out on the host, `dcut_depths`) against the
same choice made with eager tensor ops (`dcut_select`, which the policy called before), side by side in one run.

Both get the same random confidences for B rows and K drafts, every row active, the linear cost model; each is
called in blocks of `--calls`, alternating, `--rounds` times, and the best block's time per call is printed with
the ratio host / tensor. They decide the same depths (checked here once per shape, and in tests/test_budget.py on
random cases with ties). On one CPU thread the tensor path is ~25 small eager ops, about 0.1 ms: 5% of a compiled
batch-1 step of the embedded target.

Run: OMP_NUM_THREADS=1 .venv/bin/python benchmarks/dcut_cost.py [--shapes 1x4,1x7,16x4] [--rounds 5]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from angelspec.decoding.drafters.base import DraftState, Proposal
from angelspec.decoding.policies.budget import LinearCost
from angelspec.decoding.policies.dcut import DCut, dcut_select


def best_us(fn: Callable[[], object], calls: int, rounds: list[float]) -> None:
    for _ in range(calls // 10):  # warm
        fn()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    rounds.append((time.perf_counter() - t0) / calls * 1e6)


def measure(b: int, k: int, calls: int, rounds: int) -> tuple[float, float]:
    conf = torch.rand(b, k, generator=torch.Generator().manual_seed(b * 100 + k))
    proposal = Proposal(tokens=torch.zeros(b, k, dtype=torch.int64), confidences=conf, deterministic=True)
    state = DraftState(last_tokens=torch.zeros(b, dtype=torch.int64), seq_lens=torch.ones(b, dtype=torch.int64),
                       active=torch.ones(b, dtype=torch.bool), active_rows=tuple(range(b)), sampling=None,
                       draft_round=torch.zeros(b, dtype=torch.int64), num_draft_tokens=k, deterministic=True,
                       all_greedy=True, seq_len_bound=1)
    policy = DCut(cost=LinearCost())

    def tensor_path() -> torch.Tensor:
        clean = policy.guard(proposal.confidences, "DCut")
        return dcut_select(clean, state.active, b, policy.cost, policy.ratios, proposal.lengths).depth

    def host_path() -> torch.Tensor:
        return policy(proposal, state)

    if tensor_path().tolist() != host_path().tolist():
        raise SystemExit(f"B={b} K={k}: the two paths chose different depths")
    times: dict[str, list[float]] = {"tensor": [], "host": []}
    for _ in range(rounds):
        best_us(tensor_path, calls, times["tensor"])
        best_us(host_path, calls, times["host"])
    return min(times["tensor"]), min(times["host"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="1x4,1x7,4x4,16x4", help="BxK pairs (default: 1x4,1x7,4x4,16x4)")
    p.add_argument("--calls", type=int, default=300, help="calls per timed block (default: 300)")
    p.add_argument("--rounds", type=int, default=5, help="alternating blocks per path (default: 5)")
    args = p.parse_args()
    torch.set_num_threads(1)
    print(f"{'B':>3} {'K':>3} {'tensor us':>10} {'host us':>9} {'host/tensor':>12}")
    for shape in args.shapes.split(","):
        b, k = (int(x) for x in shape.lower().split("x"))
        tensor_us, host_us = measure(b, k, args.calls, args.rounds)
        print(f"{b:>3} {k:>3} {tensor_us:>10.1f} {host_us:>9.1f} {host_us / tensor_us:>11.2f}x")


if __name__ == "__main__":
    main()
