"""Verification budgets behind the engine's depth-policy hook: D-cut (AngelSpec report §4.2, Eq. 19-24) and
DSpark's hardware-aware prefix scheduler (Uraion report §3.7, Algorithm 1) with its production variant.

All three treat target verification as a batch-level resource: a request's anchor (its newest committed
token, whose logits give the bonus / recovered token) is always verified, and the remaining positions of the
verify forward go to the (request, depth) pairs with the highest prefix survival

    s_{i,0} = 1,   s_{i,k} = prod_{t<=k} c_{i,t}                                        (Eq. 20)

so the expected committed tokens of a row that verifies n_i drafts are A_i(n_i) = sum_{k=0}^{n_i} s_{i,k}
(Eq. 21; Algorithm 1's tau is the sum of these over the batch). Because c in [0, 1] makes s non-increasing
in k, ranking by score with ties broken towards the shallower depth keeps a contiguous prefix per row.

Losslessness (DESIGN.md trap 1): `DCut`, `PrefixScheduler` and `ProductionScheduler(allocation="current")`
read this round's confidences, so they declare `uses_proposal = True` and the engine verifies with the
deterministic-draft protocol. `ProductionScheduler(allocation="stale")` reads only confidences recorded
`lag >= 1` steps earlier and declares `uses_proposal = False`, so standard speculative sampling stays exact.

Costs: one `CostModel` serves both: `cost(num_requests, num_tokens)` = seconds of one speculative step
(draft + select + pack + verify) with `num_tokens` verified positions in total (anchors included). D-cut's
C(B, rho) = cost(B, K_rho(B)); Algorithm 1's SPS(N) = 1 / cost(R, N). The start-up profiler (a later task,
`spec/costmodel.py`) implements the same protocol from measurements; `LinearCost` is the analytic default.

No policy syncs with the host: budgets that depend on host-known quantities only (B, K, the cost table)
are evaluated on the host, everything that depends on confidences stays on the device.

Shape legend: B batch rows (active and idle), K draft depth (D in the report), N verified positions.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

import torch
from torch import Tensor

from angelspec.spec.drafter import DraftState, Proposal, sanitize_confidences

DCUT_RATIOS: tuple[float, ...] = (0.25, 0.5, 0.75, 1.0)  # the report's R


# ---------------------------------------------------------------------------------------------------------
# Cost model interface
# ---------------------------------------------------------------------------------------------------------


@runtime_checkable
class CostModel(Protocol):
    """Seconds of one speculative step for `num_requests` rows verifying `num_tokens` positions in total."""

    def __call__(self, num_requests: int, num_tokens: int) -> float: ...


@dataclass(frozen=True)
class LinearCost:
    """Analytic default when no profile exists: C = fixed + per_token * N (seconds)."""

    fixed: float = 1.0
    per_token: float = 0.01

    def __post_init__(self) -> None:
        if self.fixed < 0 or self.per_token < 0 or self.fixed + self.per_token <= 0:
            raise ValueError(f"LinearCost needs fixed, per_token >= 0, not both 0; got {self.fixed}, {self.per_token}")

    def __call__(self, num_requests: int, num_tokens: int) -> float:
        return self.fixed + self.per_token * num_tokens


@dataclass(frozen=True)
class StaircaseCost:
    """C = fixed + per_tile * ceil(N / tile): the step latency of a GPU that works in tiles of `tile` tokens.
    Its SPS curve is a staircase, the case where Algorithm 1's greedy early stop gets trapped."""

    fixed: float = 1.0
    per_tile: float = 0.1
    tile: int = 16

    def __call__(self, num_requests: int, num_tokens: int) -> float:
        return self.fixed + self.per_tile * math.ceil(num_tokens / self.tile)


def _host_costs(cost: CostModel, num_requests: int, num_tokens: Sequence[int]) -> list[float]:
    """cost(R, N) for each N, checked on the host (a zero or negative latency would make U / C meaningless)."""
    out = [float(cost(num_requests, n)) for n in num_tokens]
    bad = [(n, c) for n, c in zip(num_tokens, out, strict=True) if not (math.isfinite(c) and c > 0)]
    if bad:
        raise ValueError(f"cost model returned non-positive or non-finite step latencies (N, seconds): {bad[:3]}")
    return out


# ---------------------------------------------------------------------------------------------------------
# Pure functions
# ---------------------------------------------------------------------------------------------------------


def prefix_survival(conf: Tensor) -> Tensor:
    """conf [B, K] in [0, 1] -> s [B, K+1] with s[:, 0] = 1 and s[:, k] = prod_{t<=k} c_t (Eq. 20).

    Non-increasing along K exactly, also in floating point (rounding is monotone and c <= 1)."""
    ones = conf.new_ones(conf.shape[0], 1)  # s_{i,0}: the anchor always survives (also when K = 0)
    return torch.cat([ones, torch.cumprod(conf, dim=-1)], dim=-1)


def rank_positions(scores: Tensor) -> Tensor:
    """scores [B, K+1] -> rank [B, K+1] int64: 0 = best. Descending by score, ties to the shallower depth
    (then to the lower row). The kept set `rank < N` is then a contiguous prefix of every row whose scores
    are non-increasing: if (i, k+1) is kept, (i, k) has a score at least as high and a shallower depth."""
    b, k1 = scores.shape
    # Depth-major flattening + a stable descending sort breaks ties towards the shallower depth.
    flat = scores.t().reshape(-1)  # [(K+1) * B], index = k * B + i
    order = torch.sort(flat, descending=True, stable=True).indices
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel(), device=order.device)
    return rank.view(k1, b).t()  # [B, K+1]


def masked_scores(conf: Tensor, active: Tensor, lengths: Tensor | None) -> Tensor:
    """Prefix survival [B, K+1] with positions that cannot be verified (idle rows, past `lengths`) at -1,
    below every real score, so they rank last and are never kept."""
    s = prefix_survival(conf)  # [B, K+1]
    k = torch.arange(s.shape[1], device=s.device)  # [K+1]
    ok = active[:, None].expand_as(s)
    if lengths is not None:
        ok = ok & (k[None, :] <= lengths[:, None])
    return torch.where(ok, s, -1.0)


def kept_depth(scores: Tensor, rank: Tensor, budget: Tensor | int) -> Tensor:
    """Depth [B] int64 per row from keeping the `budget` best positions (anchors included): n_i = kept - 1,
    0 for rows with nothing kept (idle rows)."""
    kept = (rank < budget) & (scores >= 0)  # [B, K+1]
    return (kept.sum(dim=-1) - 1).clamp(min=0)


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
    costs = torch.tensor(_host_costs(cost, num_active, budgets), dtype=utility.dtype, device=conf.device)
    value = utility / costs
    if max_loss is not None:  # gain[-1]: every position kept = full verification's expected tokens
        allowed = utility >= (1.0 - max_loss) * gain[-1]
        largest = torch.zeros_like(allowed).index_fill_(0, torch.argmax(idx), True)
        value = torch.where(allowed | (~allowed.any() & largest), value, -math.inf)
    best = torch.argmax(value)  # first maximum = smaller ratio on ties
    budget = torch.tensor(budgets, device=conf.device)[best]
    return DCutDecision(depth=kept_depth(scores, rank, budget), ratio_index=best, utility=utility, cost=costs,
                        budgets=budgets)


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
    scores = masked_scores(conf, active, lengths)  # [B, K+1]
    drafts = scores[:, 1:].masked_fill(scores[:, 1:] <= eps, -1.0)
    scores = torch.cat([scores[:, :1], drafts], dim=1)  # anchors keep 1 (active) / -1 (idle)
    rank = rank_positions(scores)
    n_cand = num_active * k
    cand = torch.sort(drafts.flatten(), descending=True).values[:n_cand]  # [R*K] candidates, best first
    valid = torch.cat([torch.ones(1, dtype=torch.bool, device=conf.device), cand > 0])  # [R*K+1], m = 0..R*K
    tau = num_active + torch.cat([cand.new_zeros(1), cand.clamp(min=0).cumsum(0)])  # [R*K+1]
    host = _host_costs(cost, num_active, range(num_active, num_active + n_cand + 1))
    sps = torch.tensor([tau_scale / c for c in host], dtype=tau.dtype, device=conf.device)  # SPS(R + m)
    theta = torch.where(valid, tau * sps, -math.inf)  # [R*K+1]
    if search == "greedy":
        rises = torch.cat([torch.ones(1, dtype=torch.bool, device=conf.device), theta[1:] > theta[:-1]])
        m = rises.long().cumprod(0).sum() - 1  # length of the leading run of strict increases
    elif search == "global":
        m = torch.argmax(theta)
    else:
        raise ValueError(f"search must be 'greedy' or 'global', got {search!r}")
    return kept_depth(scores, rank, num_active + m)


# ---------------------------------------------------------------------------------------------------------
# Depth policies (the engine's hook)
# ---------------------------------------------------------------------------------------------------------


@dataclass
class ConfidenceGuard:
    """Sanitises confidences before any scheduler sees them and counts the bad entries on the device."""

    _bad: Tensor | None = None

    def __call__(self, conf: Tensor | None, policy: str) -> Tensor:
        if conf is None:
            raise ValueError(f"{policy} needs a drafter that reports confidences")
        clean, bad = sanitize_confidences(conf)
        self._bad = bad if self._bad is None or self._bad.device != bad.device else self._bad + bad
        return clean

    @property
    def bad_count(self) -> int:
        """Confidences replaced so far (NaN, inf, outside [0, 1]). Host sync: read it once per interval."""
        return 0 if self._bad is None else int(self._bad)


def _num_active(state: DraftState) -> int:
    return len(state.active_rows)


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
        return dcut_select(conf, state.active, _num_active(state), self.cost, self.ratios, proposal.lengths,
                           self.max_loss).depth


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
        return prefix_schedule(conf, state.active, _num_active(state), self.cost, eps=self.eps, search=self.search,
                               lengths=proposal.lengths)


class ProductionScheduler:
    """DSpark's production scheduler: the budget N* (total verified positions) is sized from confidences
    `lag` steps old (the paper: two, because in a pipelined server the step being scheduled is launched
    before the previous one has returned) by a global search N* = argmax_N tau(N) * SPS(N) over every N in
    [R, R(K+1)], tau(N) = R + the N - R best stale scores (Algorithm 1's objective, no early stop).

    allocation="current": the N* positions go to the best (request, depth) pairs of THIS round's
        confidences (reads the proposal: uses_proposal = True, deterministic-draft protocol).
    allocation="stale": they go to the best pairs of the stale confidences too, so the depth depends on
        earlier steps only: uses_proposal = False and standard speculative sampling stays exact (trap 1).

    Rows without a record from exactly `lag` steps ago (new requests, the first steps) use the prior
    `cold_confidence` per draft. A record is matched by the row's `draft_round`, which the engine resets when
    a request joins, so a row never inherits another request's confidences. State: the last `lag` records.
    """

    static_depth: int | None = None

    def __init__(self, cost: CostModel | None = None, *, allocation: Literal["current", "stale"] = "stale",
                 lag: int = 2, cold_confidence: float = 0.5, eps: float = 1e-6) -> None:
        if allocation not in ("current", "stale"):
            raise ValueError(f"ProductionScheduler.allocation must be 'current' or 'stale', got {allocation!r}")
        if isinstance(lag, bool) or not isinstance(lag, int) or lag < 1:
            raise ValueError(f"ProductionScheduler.lag must be an int >= 1 (earlier steps only), got {lag!r}")
        if not 0.0 <= cold_confidence <= 1.0:
            raise ValueError(f"cold_confidence must be in [0, 1], got {cold_confidence!r}")
        self.cost = cost or LinearCost()
        self.allocation, self.lag, self.cold_confidence, self.eps = allocation, lag, cold_confidence, eps
        self.uses_proposal = allocation == "current"
        self.guard = ConfidenceGuard()
        self._history: deque[tuple[Tensor, Tensor]] = deque(maxlen=lag)  # (conf [B, K], draft_round [B])

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
        k, r = conf.shape[1], _num_active(state)
        stale = self.stale_confidences(state, k)
        self._history.append((conf.clone(), state.draft_round.clone()))
        # Budget size N* = R + m* from the stale scores, global search (Algorithm 1's objective).
        size = prefix_schedule(stale, state.active, r, self.cost, eps=self.eps, search="global",
                               lengths=proposal.lengths)
        budget = r + size.sum()  # device scalar, no host sync
        alloc = conf if self.allocation == "current" else stale
        scores = masked_scores(alloc, state.active, proposal.lengths)
        return kept_depth(scores, rank_positions(scores), budget)
