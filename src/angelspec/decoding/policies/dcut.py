"""D-cut (AngelSpec report §4.2, Eq. 19-24): a verification budget K_rho(B) = max(B, ceil(rho B (K+1))) per
step, filled with the (request, depth) pairs of highest prefix survival, rho chosen per step to maximise
expected committed tokens per second U(B, rho) / C(B, rho).

Losslessness (docs/design.md trap 1): `DCut` reads this round's confidences, so it declares
`uses_proposal = True` and the engine verifies with the deterministic-draft protocol.

Shape legend: B batch rows (active and idle), K draft depth (D in the report).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from angelspec.decoding.drafters.base import DraftState, Proposal
from angelspec.decoding.policies.budget import (
    ConfidenceGuard,
    CostModel,
    LinearCost,
    host_costs,
    kept_depth,
    masked_scores,
    num_active_rows,
    rank_positions,
)

DCUT_RATIOS: tuple[float, ...] = (0.25, 0.5, 0.75, 1.0)  # the report's R


def dcut_budget(batch_size: int, num_draft_tokens: int, ratio: float) -> int:
    """K_rho(B) = max(B, ceil(rho * B * (D+1))) (Eq. 22): B active requests, D drafts each, +1 for the
    anchor/bonus position every request verifies. Never less than B: every request keeps its anchor."""
    # round() first: 0.75 * 3 * 4 must be 9, not ceil(9.000000000000002) = 10.
    return max(batch_size, math.ceil(round(ratio * batch_size * (num_draft_tokens + 1), 9)))


@dataclass(frozen=True)
class DCutDecision:
    depth: Tensor  # [B] int64, drafts each row verifies
    ratio_index: Tensor  # 0-dim int64, index of rho* in the ratios
    utility: Tensor  # [R] float, U(B, rho) per ratio (Eq. 23)
    cost: Tensor  # [R] float, C(B, rho) per ratio
    budgets: tuple[int, ...]  # K_rho(B) per ratio


def dcut_select(conf: Tensor, active: Tensor, num_active: int, cost: CostModel,
                ratios: tuple[float, ...] = DCUT_RATIOS, lengths: Tensor | None = None,
                max_loss: float | None = None) -> DCutDecision:
    """D-cut for one step. conf [B, K] clean confidences, active [B] bool, num_active = B of the report.

    U(B, rho) = sum_i A_i(n_i^rho) = sum of the K_rho(B) best scores (Eq. 21, 23: the kept positions are
    contiguous prefixes, so their scores sum to the per-row A_i), C(B, rho) = cost(B, K_rho(B)),
    rho* = argmax U / C (Eq. 24, ties to the smaller ratio). One sort serves every ratio.

    max_loss (beyond the report): only ratios whose expected committed tokens U(B, rho) stay within
    (1 - max_loss) of full verification's (every position kept) compete, so the step trades at most that
    share of its expected acceptance for speed (with calibrated confidences, a bound on the MAL loss); when
    no ratio qualifies, the largest budget is used."""
    if conf.dim() != 2 or active.shape != conf.shape[:1]:
        raise ValueError(f"dcut_select wants conf [B, K] and active [B], got {tuple(conf.shape)}, "
                         f"{tuple(active.shape)}")
    k = conf.shape[1]
    scores = masked_scores(conf, active, lengths)  # [B, K+1]
    rank = rank_positions(scores)
    budgets = tuple(dcut_budget(num_active, k, r) for r in ratios)
    gain = torch.sort(scores.clamp(min=0).flatten(), descending=True).values.cumsum(0)  # [B(K+1)] top-N sums
    idx = torch.tensor([n - 1 for n in budgets], device=conf.device).clamp(max=gain.numel() - 1)
    utility = gain[idx]  # [R]
    costs = torch.tensor(host_costs(cost, num_active, budgets), dtype=utility.dtype, device=conf.device)
    value = utility / costs
    if max_loss is not None:  # gain[-1]: every position kept = full verification's expected tokens
        allowed = utility >= (1.0 - max_loss) * gain[-1]
        largest = torch.zeros_like(allowed).index_fill_(0, torch.argmax(idx), True)
        value = torch.where(allowed | (~allowed.any() & largest), value, -math.inf)
    best = torch.argmax(value)  # first maximum = smaller ratio on ties
    budget = torch.tensor(budgets, device=conf.device)[best]
    return DCutDecision(depth=kept_depth(scores, rank, budget), ratio_index=best, utility=utility, cost=costs,
                        budgets=budgets)


def dcut_depths(conf: Sequence[Sequence[float]], active: Sequence[bool], num_active: int, cost: CostModel,
                ratios: tuple[float, ...] = DCUT_RATIOS, lengths: Sequence[int] | None = None,
                max_loss: float | None = None) -> list[int]:
    """`dcut_select(...).depth` worked out on the host, in double precision: conf B rows of K clean confidences,
    active [B] and lengths [B] (None = K) as host values. The same ranking (descending prefix survival, ties to the
    shallower depth, then the lower row), budgets, utilities and choice of ratio as `dcut_select` on float64 tensors
    (tested), in plain Python: for a batch of a few rows that is cheaper than `dcut_select`'s ~25 small eager ops
    (numbers: docs/design.md §12)."""
    k = len(conf[0]) if conf else 0
    flat: list[tuple[float, int]] = []  # (score, row), depth-major: index = depth * B + row, as `rank_positions`
    scores = []
    for i, row in enumerate(conf):
        limit = k if lengths is None else lengths[i]
        s, survival = 1.0, [1.0]
        for c in row:
            s = s * c
            survival.append(s)
        scores.append([v if active[i] and j <= limit else -1.0 for j, v in enumerate(survival)])
    for j in range(k + 1):
        flat += [(scores[i][j], i) for i in range(len(conf))]
    order = sorted(range(len(flat)), key=lambda idx: -flat[idx][0])  # stable: ties keep depth-major order
    gain, total = [], 0.0  # gain[n - 1]: the n best scores (clamped at 0, still in descending order), summed
    for idx in order:
        total += max(flat[idx][0], 0.0)
        gain.append(total)
    budgets = [dcut_budget(num_active, k, r) for r in ratios]
    utility = [gain[min(n - 1, len(gain) - 1)] for n in budgets]
    value = [u / c for u, c in zip(utility, host_costs(cost, num_active, budgets), strict=True)]
    if max_loss is not None:
        allowed = [u >= (1.0 - max_loss) * gain[-1] for u in utility]
        largest = budgets.index(max(budgets))
        value = [v if ok or (not any(allowed) and r == largest) else -math.inf
                 for r, (v, ok) in enumerate(zip(value, allowed, strict=True))]
    budget = budgets[value.index(max(value))]  # first maximum = smaller ratio on ties
    kept = [0] * len(conf)
    for idx in order[:budget]:
        score, row = flat[idx]
        if score >= 0:
            kept[row] += 1
    return [max(n - 1, 0) for n in kept]


@dataclass(frozen=True)
class DCut:
    """D-cut (Eq. 19-24) as a depth policy. Reads this round's confidences: deterministic-draft protocol."""

    cost: CostModel = field(default_factory=LinearCost)
    ratios: tuple[float, ...] = DCUT_RATIOS
    max_loss: float | None = None  # see `dcut_select`
    guard: ConfidenceGuard = field(default_factory=ConfidenceGuard, compare=False)
    uses_proposal: bool = True
    static_depth: int | None = None

    def __post_init__(self) -> None:
        if not self.ratios or any(not 0 < r <= 1 for r in self.ratios):
            raise ValueError(f"DCut.ratios must be non-empty values in (0, 1], got {self.ratios!r}")
        if self.max_loss is not None and not 0.0 <= self.max_loss < 1.0:
            raise ValueError(f"DCut.max_loss must lie in [0, 1) (a share of the expected committed tokens), got "
                             f"{self.max_loss!r}")
        if not self.uses_proposal:
            raise ValueError("DCut reads this round's confidences; it cannot declare uses_proposal=False (trap 1)")

    def __call__(self, proposal: Proposal, state: DraftState) -> Tensor:
        conf = self.guard(proposal.confidences, "DCut")
        active = [False] * conf.shape[0]
        for r in state.active_rows:
            active[r] = True
        lengths = None if proposal.lengths is None else proposal.lengths.tolist()
        depths = dcut_depths(conf.tolist(), active, num_active_rows(state), self.cost, self.ratios, lengths,
                             self.max_loss)  # host reads; the engine reads the depths back once anyway
        return torch.tensor(depths, dtype=torch.int64, device=conf.device)
