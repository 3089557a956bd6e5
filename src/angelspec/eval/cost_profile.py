"""The start-up cost profiler: measures the step-cost table (`decoding.policies.costmodel.CostTable`) that the
verification budgets read, by running the real engine, and caches it on disk.

`profile_costs` runs the engine on synthetic prompts and times whole speculative steps: draft + select + pack +
verify + commit, the interval between two consecutive verifications of a batch of B requests that verify N
positions in total (anchors included, the convention of `decoding/policies/budget.py`). The N positions are spread
over the rows the way a budget policy keeps them (every anchor, then drafts as evenly as possible), and the policy
declares itself data-dependent like D-cut, so the second host sync of the verify width is paid too. Each cell keeps
the median of `repeats` steps after `warmup` untimed ones (`CostSettings`).

`load_or_profile` is the `CostSource` the commands hand to `decoding.policies.factory.make_policy`: it reads the
cached table of the setup and re-profiles a missing, stale or foreign one, or raises `StaleCostTableError` naming
what differs when re-profiling is off.

Shape legend: B requests (batch rows), K draft depth, N verified positions per step (B <= N <= B(K+1)).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from angelspec.decoding.drafters.base import Drafter, DraftState, Proposal, full_depth_drafting
from angelspec.decoding.engine import EngineConfig, Request, SpecEngine, VerifyEvent
from angelspec.decoding.policies.costmodel import (
    CostSettings,
    CostTable,
    CostTableError,
    StaleCostTableError,
    default_table_path,
    usable_table,
)
from angelspec.models.decoder import Decoder


@dataclass(frozen=True)
class SpreadDepth:
    """Depth policy verifying `num_tokens` positions in total: every active row's anchor, then the drafts
    spread as evenly as possible (the first rows get one more). Declares itself data-dependent and
    proposal-reading, like D-cut, so the profiled step pays what a budget policy's step pays."""

    num_tokens: int
    uses_proposal: bool = True
    static_depth: int | None = None

    def __call__(self, proposal: Proposal, state: DraftState) -> Tensor:
        rows = state.active_rows
        q, r = divmod(max(self.num_tokens - len(rows), 0), len(rows))
        depth = [0] * state.seq_lens.shape[0]
        for j, row in enumerate(rows):
            depth[row] = min(q + (j < r), state.num_draft_tokens)
        return torch.tensor(depth, dtype=torch.int64, device=state.seq_lens.device)


class _Enough(Exception):
    """Raised by the step timer to end a profiling run once it has its samples."""


def token_grid(batch_size: int, k: int, token_counts: Sequence[int] | None = None) -> list[int]:
    """The N measured for one B: B(d+1) for every uniform depth d = 0..K by default; else `token_counts`
    clipped to [B, B(K+1)], always with both ends so interpolation covers the whole range."""
    lo, hi = batch_size, batch_size * (k + 1)
    ns = {batch_size * (d + 1) for d in range(k + 1)} if token_counts is None else \
        {min(max(int(n), lo), hi) for n in token_counts} | {lo, hi}
    return sorted(ns)


def profile_costs(target: Decoder, drafter: Drafter, settings: CostSettings, *,
                  clock: Callable[[], float] = time.perf_counter,
                  log: Callable[[str], None] | None = None) -> CostTable:
    """Measure C(B, N) for every B in `settings.batch_sizes` and N in `token_grid(B, K, settings.token_counts)`;
    with `settings.compile`, on a compiled engine (`EngineConfig.compile`: the table of a compiled engine).

    Per cell: B greedy requests on random prompts of `prompt_len` tokens (seeded), decoded by a `SpecEngine`
    whose `SpreadDepth(N)` policy verifies N positions per step; `clock` is read once per verification
    (the engine's `on_verify` hook), so consecutive readings are one whole step apart. The first `warmup`
    intervals are dropped, the median of the next `repeats` is kept. Every row drafts all K for the profile
    (`full_depth_drafting`: a draft LM's early stop is off, the n-gram lookup pads rows that matched nothing), so
    each step verifies N positions."""
    s = settings
    repeats, warmup, prompt_len, k = s.repeats, s.warmup, s.prompt_len, s.num_draft_tokens
    if repeats < 1 or warmup < 0 or prompt_len < 1 or k < 1:
        raise CostTableError(f"profile needs repeats >= 1, warmup >= 0, prompt_len >= 1 and K >= 1; got {repeats}, "
                             f"{warmup}, {prompt_len}, {k}")
    if not s.batch_sizes or any(b < 1 for b in s.batch_sizes):
        raise CostTableError(f"batch sizes must be positive integers, got {list(s.batch_sizes)}")
    intervals = warmup + repeats
    # A step commits at most K+1 tokens per row: with this budget no row finishes before the last reading.
    new_tokens = (intervals + 2) * (k + 1)
    context = min(target.config.max_position_embeddings, drafter.max_positions or target.config.max_position_embeddings)
    if prompt_len + new_tokens > context:
        raise CostTableError(f"profiling {intervals} steps at K={k} needs {prompt_len + new_tokens} positions, more "
                             f"than the context of {context}; lower repeats, warmup or prompt_len")
    gen = torch.Generator().manual_seed(s.seed)
    vocab = target.config.vocab_size
    rows: dict[int, tuple[tuple[int, float], ...]] = {}
    for b in sorted(set(s.batch_sizes)):
        requests = [Request(prompt_ids=torch.randint(0, vocab, (prompt_len,), generator=gen).tolist(),
                            max_new_tokens=new_tokens, stop_ids=()) for _ in range(b)]
        cells = []
        for n in token_grid(b, k, s.token_counts):
            times: list[float] = []

            def tick(_: VerifyEvent, times: list[float] = times) -> None:
                times.append(clock())
                if len(times) > intervals:
                    raise _Enough

            engine = SpecEngine(target, drafter, EngineConfig(max_batch_size=b, num_draft_tokens=k,
                                                              max_seq_len=prompt_len + new_tokens, compile=s.compile),
                                depth_policy=SpreadDepth(n), on_verify=tick)
            try:
                with full_depth_drafting(drafter):  # an early-stopping drafter would verify fewer than N
                    engine.generate(requests)
            except _Enough:
                pass
            steps = [t1 - t0 for t0, t1 in zip(times, times[1:], strict=False)][warmup:]
            if len(steps) < repeats:
                raise CostTableError(f"B={b}, N={n}: the run ended after {len(steps)} timed steps, {repeats} needed")
            cells.append((n, statistics.median(steps)))
            if log is not None:
                log(f"B={b} N={n}: {cells[-1][1] * 1e3:.2f} ms/step (median of {repeats})")
        rows[b] = tuple(cells)
    return CostTable(key=s.key(target, drafter), rows=rows,
                     settings={"repeats": repeats, "warmup": warmup, "prompt_len": prompt_len, "seed": s.seed,
                               "token_counts": None if s.token_counts is None else [int(n) for n in s.token_counts]})


def load_or_profile(target: Decoder, drafter: Drafter, settings: CostSettings,
                    path: str | Path | None = None, *, reprofile: bool = True, force: bool = False,
                    clock: Callable[[], float] = time.perf_counter,
                    log: Callable[[str], None] | None = None) -> tuple[CostTable, str]:
    """The cost table for this setup from `path` (default: `default_table_path` of its key), profiled and
    saved when missing, stale/foreign (other key), lacking a batch size, or when `force`. With
    `reprofile=False` a stale or missing table is an error instead (`load_cost_table`). A `CostSource`.
    Returns (table, what happened)."""
    expected = settings.key(target, drafter)
    path = Path(path) if path is not None else default_table_path(expected)
    if force:
        reason = "forced"
    else:
        table, reason = usable_table(path, expected, settings.batch_sizes)
        if table is not None:
            return table, reason
    if not reprofile:
        raise StaleCostTableError(f"no usable cost table at {path} ({reason}) and re-profiling is disabled")
    table = profile_costs(target, drafter, settings, clock=clock, log=log)
    table.save(path)
    return table, f"profiled ({reason}), wrote {path}"
