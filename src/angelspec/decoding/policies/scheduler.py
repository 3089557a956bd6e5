"""DSpark's hardware-aware prefix scheduler (Uraion report §3.7, Algorithm 1) and its production variant.

Losslessness (docs/design.md trap 1): `PrefixScheduler` and `ProductionScheduler(allocation="current")` read
this round's confidences, so they declare `uses_proposal = True` and the engine verifies with the
deterministic-draft protocol. `ProductionScheduler(allocation="stale")` reads only confidences recorded
`lag >= 1` steps earlier and declares `uses_proposal = False`, so standard speculative sampling stays exact.

Shape legend: B batch rows (active and idle), K draft depth, N verified positions.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor

from angelspec.decoding.drafters.base import DraftState, Proposal
from angelspec.decoding.policies import budget as budget_maths
from angelspec.decoding.policies.budget import ConfidenceGuard, CostModel, LinearCost


def prefix_schedule(conf: Tensor, active: Tensor, num_active: int, cost: CostModel, *, tau_scale: float = 1.0,
                    eps: float = 1e-6, search: Literal["greedy", "global"] = "greedy",
                    lengths: Tensor | None = None) -> Tensor:
    """DSpark's hardware-aware prefix scheduler (Algorithm 1) -> depth [B] int64.

    Mapping to the pseudo-code (R requests, gamma = K drafts, 0-based j so that a_{r,j} covers drafts 0..j):
    * a_{r,j} <- prod_{i<=j} c_{r,i}: `prefix_survival` (columns 1..K).
    * C <- {(r,j) | a_{r,j} > eps}, sorted descending: `rank_positions` with ties to the shallower depth, so
      the "non-contiguous prefix: skip" branch can never fire (every candidate extends its row's prefix).
    * l_r <- 0, B <- R, tau <- R; Theta* <- tau * SPS(B): position m = 0 of the candidate walk.
    * admitting the m-th candidate: B <- R + m, tau <- R + (sum of the m best a), Theta_m = tau_m * SPS(R + m)
      with SPS(N) = tau_scale / cost(R, N) (`tau_scale` is a constant that does not move the argmax).
    * search="greedy": stop at the first m with Theta_m <= Theta* (early stop; keeps the m - 1 before it).
      search="global": the production variant's search, m* = argmax_m Theta_m over every m (ties to the
      smaller m), which escapes the plateaus of a staircase SPS curve.
    Computed for all m at once: a cumulative sum over the sorted candidates; the SPS values depend only on
    host integers, so nothing syncs with the host."""
    k = conf.shape[1]
    scores = budget_maths.masked_scores(conf, active, lengths)  # [B, K+1]
    drafts = scores[:, 1:].masked_fill(scores[:, 1:] <= eps, -1.0)
    scores = torch.cat([scores[:, :1], drafts], dim=1)  # anchors keep 1 (active) / -1 (idle)
    rank = budget_maths.rank_positions(scores)
    n_cand = num_active * k
    cand = torch.sort(drafts.flatten(), descending=True).values[:n_cand]  # [R*K] candidates, best first
    valid = torch.cat([torch.ones(1, dtype=torch.bool, device=conf.device), cand > 0])  # [R*K+1], m = 0..R*K
    tau = num_active + torch.cat([cand.new_zeros(1), cand.clamp(min=0).cumsum(0)])  # [R*K+1]
    host = budget_maths.host_costs(cost, num_active, range(num_active, num_active + n_cand + 1))
    sps = torch.tensor([tau_scale / c for c in host], dtype=tau.dtype, device=conf.device)  # SPS(R + m)
    theta = torch.where(valid, tau * sps, -math.inf)  # [R*K+1]
    if search == "greedy":
        rises = torch.cat([torch.ones(1, dtype=torch.bool, device=conf.device), theta[1:] > theta[:-1]])
        m = rises.long().cumprod(0).sum() - 1  # length of the leading run of strict increases
    elif search == "global":
        m = torch.argmax(theta)
    else:
        raise ValueError(f"search must be 'greedy' or 'global', got {search!r}")
    return budget_maths.kept_depth(scores, rank, num_active + m)


@dataclass(frozen=True)
class PrefixScheduler:
    """DSpark Algorithm 1 (greedy admission, early stop on Theta = tau * SPS(B)) as a depth policy.
    Reads this round's confidences: deterministic-draft protocol. `search="global"` replaces the early stop
    by the production variant's global search while keeping this round's confidences."""

    cost: CostModel = field(default_factory=LinearCost)
    search: Literal["greedy", "global"] = "greedy"
    eps: float = 1e-6
    guard: ConfidenceGuard = field(default_factory=ConfidenceGuard, compare=False)
    uses_proposal: bool = True
    static_depth: int | None = None

    def __post_init__(self) -> None:
        if self.search not in ("greedy", "global"):
            raise ValueError(f"PrefixScheduler.search must be 'greedy' or 'global', got {self.search!r}")
        if not self.uses_proposal:
            raise ValueError("PrefixScheduler reads this round's confidences; it cannot declare "
                             "uses_proposal=False (trap 1)")

    def __call__(self, proposal: Proposal, state: DraftState) -> Tensor:
        conf = self.guard(proposal.confidences, "PrefixScheduler")
        return prefix_schedule(conf, state.active, budget_maths.num_active_rows(state), self.cost, eps=self.eps,
                               search=self.search, lengths=proposal.lengths)


class ProductionScheduler:
    """DSpark's production scheduler: the budget N* (total verified positions) is sized from confidences
    `lag` steps old (the paper: two, because in a pipelined server the step being scheduled is launched
    before the previous one has returned) by a global search N* = argmax_N tau(N) * SPS(N) over every N in
    [R, R(K+1)], tau(N) = R + the N - R best stale scores (Algorithm 1's objective, no early stop).

    allocation="current": the N* positions go to the best (request, depth) pairs of THIS round's
        confidences (reads the proposal: uses_proposal = True, deterministic-draft protocol).
    allocation="stale": they go to the best pairs of the stale confidences too, so the depth depends on
        earlier steps only: uses_proposal = False and standard speculative sampling stays exact (trap 1).
    uses_proposal: None = as above; True forces the deterministic-draft protocol (safe with either allocation);
        False with allocation="current" is refused, as DCut and PrefixScheduler refuse it. Read-only afterwards:
        the engine reads the declaration once, when it is built.

    Rows without a record from exactly `lag` steps ago (new requests, the first steps) use the prior
    `cold_confidence` per draft. A record is matched by the row's `draft_round`, which the engine resets when
    a request joins, so a row never inherits another request's confidences. State: the last `lag` records.
    """

    static_depth: int | None = None

    def __init__(self, cost: CostModel | None = None, *, allocation: Literal["current", "stale"] = "stale",
                 lag: int = 2, cold_confidence: float = 0.5, eps: float = 1e-6,
                 uses_proposal: bool | None = None) -> None:
        if allocation not in ("current", "stale"):
            raise ValueError(f"ProductionScheduler.allocation must be 'current' or 'stale', got {allocation!r}")
        if allocation == "current" and uses_proposal is False:
            raise ValueError("ProductionScheduler(allocation='current') reads this round's confidences; it cannot "
                             "declare uses_proposal=False (trap 1)")
        if isinstance(lag, bool) or not isinstance(lag, int) or lag < 1:
            raise ValueError(f"ProductionScheduler.lag must be an int >= 1 (earlier steps only), got {lag!r}")
        if not 0.0 <= cold_confidence <= 1.0:
            raise ValueError(f"cold_confidence must be in [0, 1], got {cold_confidence!r}")
        self.cost = cost or LinearCost()
        self.allocation, self.lag, self.cold_confidence, self.eps = allocation, lag, cold_confidence, eps
        self._uses_proposal = allocation == "current" if uses_proposal is None else bool(uses_proposal)
        self.guard = ConfidenceGuard()
        self._history: deque[tuple[Tensor, Tensor]] = deque(maxlen=lag)  # (conf [B, K], draft_round [B])

    @property
    def uses_proposal(self) -> bool:
        """Whether the depth reads this round's proposal (fixed at construction; see the class docstring)."""
        return self._uses_proposal

    def stale_confidences(self, state: DraftState, k: int) -> Tensor:
        """[B, K]: each row's confidences from `lag` steps ago, or the cold prior where there is none."""
        prior = torch.full((state.seq_lens.shape[0], k), self.cold_confidence, device=state.seq_lens.device)
        if len(self._history) < self.lag:
            return prior
        old, old_round = self._history[0]
        if old.shape != prior.shape:  # another batch size or K (a new generate call)
            return prior
        same = state.draft_round == old_round + self.lag  # [B] same request, exactly lag rounds later
        return torch.where(same[:, None], old, prior)

    def __call__(self, proposal: Proposal, state: DraftState) -> Tensor:
        conf = self.guard(proposal.confidences, "ProductionScheduler")  # [B, K]
        k, r = conf.shape[1], budget_maths.num_active_rows(state)
        stale = self.stale_confidences(state, k)
        self._history.append((conf.clone(), state.draft_round.clone()))
        # Budget size N* = R + m* from the stale scores, global search (Algorithm 1's objective).
        size = prefix_schedule(stale, state.active, r, self.cost, eps=self.eps, search="global",
                               lengths=proposal.lengths)
        budget = r + size.sum()  # device scalar, no host sync
        alloc = conf if self.allocation == "current" else stale
        scores = budget_maths.masked_scores(alloc, state.active, proposal.lengths)
        return budget_maths.kept_depth(scores, budget_maths.rank_positions(scores), budget)
