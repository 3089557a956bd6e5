"""Verification budgets shared by D-cut (`dcut.py`, AngelSpec report §4.2, Eq. 19-24) and DSpark's
hardware-aware prefix scheduler (`scheduler.py`, Uraion report §3.7, Algorithm 1).

Both treat target verification as a batch-level resource: a request's anchor (its newest committed
token, whose logits give the bonus / recovered token) is always verified, and the remaining positions of the
verify forward go to the (request, depth) pairs with the highest prefix survival

    s_{i,0} = 1,   s_{i,k} = prod_{t<=k} c_{i,t}                                        (Eq. 20)

so the expected committed tokens of a row that verifies n_i drafts are A_i(n_i) = sum_{k=0}^{n_i} s_{i,k}
(Eq. 21; Algorithm 1's tau is the sum of these over the batch). Because c in [0, 1] makes s non-increasing
in k, ranking by score with ties broken towards the shallower depth keeps a contiguous prefix per row.

Costs: one `CostModel` serves both: `cost(num_requests, num_tokens)` = seconds of one speculative step
(draft + select + pack + verify) with `num_tokens` verified positions in total (anchors included). D-cut's
C(B, rho) = cost(B, K_rho(B)); Algorithm 1's SPS(N) = 1 / cost(R, N). The start-up profiler
(`costmodel.py`) implements the same protocol from measurements; `LinearCost` is the analytic default.

No policy syncs with the host: budgets that depend on host-known quantities only (B, K, the cost table)
are evaluated on the host, everything that depends on confidences stays on the device.

Shape legend: B batch rows (active and idle), K draft depth (D in the report), N verified positions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from angelspec.decoding.drafters.base import DraftState
from angelspec.decoding.policies.base import sanitize_confidences


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


def host_costs(cost: CostModel, num_requests: int, num_tokens: Sequence[int]) -> list[float]:
    """cost(R, N) for each N, checked on the host (a zero or negative latency would make U / C meaningless)."""
    out = [float(cost(num_requests, n)) for n in num_tokens]
    bad = [(n, c) for n, c in zip(num_tokens, out, strict=True) if not (math.isfinite(c) and c > 0)]
    if bad:
        raise ValueError(f"cost model returned non-positive or non-finite step latencies (N, seconds): {bad[:3]}")
    return out


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


def num_active_rows(state: DraftState) -> int:
    return len(state.active_rows)
