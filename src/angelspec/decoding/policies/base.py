"""Depth policies: how many of a round's K drafts each row verifies (the engine's hook).

The protocol, the two simple policies (a fixed depth, a cumulative-confidence threshold) and the
confidence sanitiser every confidence-driven policy shares. The batch-level budgets live beside this file:
D-cut (`dcut.py`), DSpark's Algorithm 1 and its production variant (`scheduler.py`), their shared
maths and cost models (`budget.py`, `costmodel.py`), STS calibration (`sts.py`), and the `--policy`
string parser (`factory.py`).

Shape legend: B batch rows, K draft depth.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from angelspec.decoding.drafters.base import DraftState, Proposal


@runtime_checkable
class DepthPolicy(Protocol):
    """`policy(proposal, state) -> depth [B] int64 in [0, K]`.

    `uses_proposal` says whether the depth reads this round's drafts (tokens, confidences, probs). If it
    does and the drafts were sampled, standard speculative sampling would be biased (docs/design.md trap 1), so
    the engine then verifies with the deterministic-draft protocol and asks the drafter for argmax drafts.
    A plain callable without the attribute is treated as `uses_proposal = True` (the safe choice).
    `uses_proposal = False` is a promise the engine trusts and cannot check: such a policy must compute depths
    from `DraftState` and earlier steps only. It may read `proposal.lengths`, which the engine refuses under
    standard speculative sampling (see `Proposal`). The declaration is fixed at construction (a frozen field or
    a read-only property: the engine reads it once), and a policy that reads this round's proposal refuses
    `uses_proposal=False` (`DCut`, `PrefixScheduler`, `ProductionScheduler(allocation="current")`).

    `static_depth`: a host int when every row always gets the same depth (lets the engine skip a host sync
    for the verify width), else None. Adaptive policies (D-cut, DSpark's scheduler) plug in here.
    """

    uses_proposal: bool
    static_depth: int | None

    def __call__(self, proposal: Proposal, state: DraftState) -> Tensor: ...


@dataclass(frozen=True)
class FixedDepth:
    """Every row verifies `depth` drafts (None = all K)."""

    depth: int | None = None
    uses_proposal: bool = False

    def __post_init__(self) -> None:
        if self.depth is not None and (isinstance(self.depth, bool) or not isinstance(self.depth, int)
                                       or self.depth < 0):
            raise ValueError(f"FixedDepth.depth must be an int >= 0 or None (= K), got {self.depth!r}")

    @property
    def static_depth(self) -> int | None:
        return self.depth

    def __call__(self, proposal: Proposal, state: DraftState) -> Tensor:
        k = state.num_draft_tokens if self.depth is None else min(self.depth, state.num_draft_tokens)
        return torch.full_like(state.seq_lens, k)


def sanitize_confidences(conf: Tensor) -> tuple[Tensor, Tensor]:
    """conf [B, K] -> (clean [B, K] float32 in [0, 1], number of bad entries as a 0-dim int64 tensor).

    NaN and -inf become 0 (do not spend verification on a draft nobody vouches for), +inf and values above 1
    become 1, negatives 0. The count stays on the device (reading it is a host sync)."""
    c = conf.float()
    bad = ~((c >= 0) & (c <= 1))  # NaN fails both comparisons
    clean = torch.nan_to_num(c, nan=0.0, posinf=1.0, neginf=0.0).clamp(0.0, 1.0)
    return clean, bad.sum()


@dataclass(frozen=True)
class ConfidenceThreshold:
    """Verify the longest prefix whose cumulative confidence prod_{t<=k} c_t stays >= `threshold`
    (D-cut's per-request score s_{i,k}, without the batch-level budget), at least `min_depth` drafts.

    Reads this round's confidences, so the engine verifies with the deterministic-draft protocol."""

    threshold: float
    min_depth: int = 0
    uses_proposal: bool = True
    static_depth: int | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"ConfidenceThreshold.threshold must be in [0, 1], got {self.threshold!r}")
        if self.min_depth < 0:
            raise ValueError(f"ConfidenceThreshold.min_depth must be >= 0, got {self.min_depth!r}")
        if not self.uses_proposal:
            raise ValueError("ConfidenceThreshold reads this round's confidences; it cannot declare "
                             "uses_proposal=False (trap 1)")

    def __call__(self, proposal: Proposal, state: DraftState) -> Tensor:
        if proposal.confidences is None:
            raise ValueError("ConfidenceThreshold needs a drafter that reports confidences")
        conf, _ = sanitize_confidences(proposal.confidences)  # NaN / out of range never reach the decision
        score = torch.cumprod(conf, dim=-1)  # [B, K] s_{i,k}
        depth = (score >= self.threshold).long().cumprod(dim=-1).sum(dim=-1)  # leading run
        return depth.clamp(min=min(self.min_depth, state.num_draft_tokens))


def policy_uses_proposal(policy: Callable[..., Tensor]) -> bool:
    return bool(getattr(policy, "uses_proposal", True))


def policy_static_depth(policy: Callable[..., Tensor]) -> int | None:
    return getattr(policy, "static_depth", None)
