"""How the serving setting `auto` plans its lookup steps: on what lookup steps measured to cost, over the step's rows
together (the engine's way), against the cost table's costs with each row deciding alone (the way before it), or
against the engine's own plan without its latency budget.

While the model does not draft, `auto` runs lookup steps: each row with an n-gram match verifies some of its drafts.
How many depends on what a verified draft is expected to return (its match length's acceptance so far) against what
it adds to the step:

    measured    `ServingGate.lookup_cost_fit`: lookup steps timed by the drafts they verified in all, AR's step when
                none, a fixed price for verifying plus a price per draft when some; `MatchAcceptance.plan` keeps the
                surest drafts of all rows while the step's expected committed tokens per second rise
    table       the cost table's step verifying d drafts in every row against one verifying none (its steps include
                the model's drafting), each row choosing its own depth as if the step were its alone
    unbounded   (`--against unbounded`) measured, without the latency budget that keeps each request's wait on the
                other rows' drafts within 5% of its time (`hybrid.LatencyBudget`; `--policy auto:slack=none`)

The two run the same drafter (the shipped DFly with the lookup in front) over the same requests, each with its own
policy and gate, beside AR, through `angelspec bench`'s sweep with repeats (`eval.serving.sweep.run_sweep`: the
engines in turn each round, every other round in reverse order). Printed per concurrency C (C rows, 4C requests of 128
new tokens from the eval prompts): AR's tokens/s (median run); each plan's throughput and p95 time per output token
over AR's of the same round (medians over rounds, and the range of the throughput ratio), its committed tokens per
row-step (MAL) and drafts verified per row-step in its median run; and measured over the other per round (median).
Outputs are checked equal to AR's.

    .venv/bin/python benchmarks/lookup_plan.py                       # C = 1,2,4, 5 rounds, compiled
    .venv/bin/python benchmarks/lookup_plan.py --concurrency 2 --repeats 9
    .venv/bin/python benchmarks/lookup_plan.py --against unbounded --concurrency 2,4 --repeats 7
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

import torch

from angelspec.assets import DEFAULT_DRAFTERS, DEFAULT_TARGET
from angelspec.decoding.drafters.hybrid import HybridDrafter
from angelspec.decoding.loading import load_target_and_tokenizer
from angelspec.decoding.policies.gate import ServingGate, _Lane
from angelspec.eval.serving.base import ServingRow, paired_ratio
from angelspec.eval.serving.sweep import build_contenders, parse_config, run_sweep, serving_workload


class TableCosts(ServingGate):
    """The serving gate, but its lookup steps carry the cost table's cost of verifying d = 0..K drafts in every row
    against none (the table's steps include the model's drafting)."""

    def _base_step(self, lane: _Lane, num_active: int) -> int:
        look = super()._base_step(lane, num_active)
        if look and self.cost is not None:
            table = self._table(num_active)
            self.lookup_costs = tuple(c / table[0] for c in table[: look + 1])
        return look


class PerRowPlan(HybridDrafter):
    """The hybrid drafter, but each row with a match verifies the depth d that maximizes (1 + its expected accepted
    drafts) / costs[d] on its own, none where no depth beats 1 / costs[0] (costs per uniform depth: `TableCosts`)."""

    def _make_plan(self, active_rows: Sequence[int], k: int, costs: tuple[float, ...], slack: float | None
                   ) -> tuple[tuple, dict[int, tuple[int, list[int], int]]]:
        plan = {}
        for r in active_rows:
            n, drafts = self.ngram.match(r, k)
            if n < self.min_match:
                continue
            est = self.ngram.acceptance.estimate(n, k)
            depth, rate, alive, expected = 0, 1.0 / costs[0], 1.0, 1.0
            for d in range(1, min(k, len(costs) - 1) + 1):
                alive *= est[d - 1]
                expected += alive
                if expected / costs[d] > rate:
                    depth, rate = d, expected / costs[d]
            if depth:
                plan[r] = (n, drafts, depth)
        return self._plan_key(active_rows, k, costs, slack), plan


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=str(DEFAULT_TARGET))
    p.add_argument("--drafter", default=str(DEFAULT_DRAFTERS / "dfly+ngram"), help="a DIR+ngram drafter")
    p.add_argument("--concurrency", default="1,2,4")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--against", choices=("table", "unbounded"), default="table",
                   help="the plan beside the engine's: the table's per row (default), or the engine's own without the "
                        "latency budget (auto:slack=none)")
    p.add_argument("--no-compile", dest="compile", action="store_false")
    args = p.parse_args()
    torch.manual_seed(0)
    target_dir = Path(args.target)
    model, tokenizer = load_target_and_tokenizer(target_dir)
    concurrency = [int(x) for x in args.concurrency.split(",")]
    compiled = "+compile" if args.compile else ""
    spec = args.drafter if "+ngram" in args.drafter else f"{args.drafter}+ngram"
    # two configurations of the same drafter, each loaded on its own (a drafter keeps what its lookup learned)
    other = args.against
    ar, measured, table = build_contenders(
        model, target_dir, [parse_config(f"AR=none{compiled}"), parse_config(f"measured={spec}{compiled}"),
                            parse_config(f"{other}=./{spec}{compiled}" if not spec.startswith(("/", ".")) else
                                         f"{other}={Path(spec).parent}/./{Path(spec).name}{compiled}")],
        concurrency=concurrency, log=None)
    if not isinstance(table.drafter, HybridDrafter) or table.drafter is measured.drafter:
        raise SystemExit(f"--drafter {args.drafter!r}: name a model drafter's folder (the lookup goes in front)")
    k = table.num_draft_tokens
    if other == "unbounded":
        assert table.policy is not None
        table.policy._gates[k, True] = ServingGate(k, cost=table.policy.cost, lookup=True, latency_slack=None)
    else:
        table.drafter.__class__ = PerRowPlan
        assert table.policy is not None and table.policy.cost is not None  # `auto` with the cost table
        table.policy._gates[k, True] = TableCosts(k, cost=table.policy.cost, lookup=True)
    workload = serving_workload(tokenizer, model.config.max_position_embeddings, args.max_new_tokens)
    print(f"lookup plans: {spec} (K = {k}), compile={args.compile}, {args.max_new_tokens} new tokens, 4C requests, "
          f"{args.repeats} rounds, {torch.get_num_threads()} threads")
    print(f"| C | AR tok/s | measured / AR (range) | {other} / AR (range) | measured / {other} | p95 TPOT / AR's: "
          f"measured, {other} | MAL: measured, {other} | drafts a row-step: measured, {other} |")
    print("|---|---|---|---|---|---|---|---|")
    for c in concurrency:
        report = run_sweep(model, (ar, measured, table), workload, concurrency=(c,), max_new_tokens=args.max_new_tokens,
                           log=None, repeats=args.repeats)
        base, m, t = (report.row(name, c) for name in ("AR", "measured", other))
        for row in (m, t):
            if not row.lossless_ok:
                raise SystemExit(f"{row.config} at C = {c}: outputs differ from AR's (a bug)")
        print(f"| {c} | {base.tokens_per_s:.0f} | {m.speedup:.3f} ({span(m)}) | "
              f"{t.speedup:.3f} ({span(t)}) | {paired_ratio(m, t):.3f} | "
              f"{m.tpot_p95_vs_ar:.2f}, {t.tpot_p95_vs_ar:.2f} | {m.mal:.2f}, {t.mal:.2f} | "
              f"{m.mean_depth:.2f}, {t.mean_depth:.2f} |", flush=True)


def span(row: ServingRow) -> str:
    """The range of a row's per-round throughput ratios to AR's (one round: its ratio)."""
    runs = row.runs_speedup or (row.speedup,)
    return f"{min(runs):.2f}-{max(runs):.2f}"


if __name__ == "__main__":
    main()
