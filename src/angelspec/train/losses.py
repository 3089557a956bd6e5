"""Distillation and acceptance losses for drafter training: pure functions on logits.

Report §2.3 (Eq. 3–9), §3.3 (D-PACE, Eq. 16–18, two-stage schedule) and the DSpark three-term loss
(UraionSpec §3 "Training Objective"). Every trainer selects its objective by name from `LOSSES`.

Layout
------
Shape legend: N training positions (batch × time, flattened), K prediction depths (the TTT depths
k = 0..D−1 of an MTP/EAGLE drafter, or the positions of a DSpark/DFlash block), V vocabulary, M valid
(position, depth) rows. Every loss takes student logits q and teacher logits p as `[N, K, V]`, a boolean
validity mask `[N, K]` (column k is the report's I_k) and, where needed, hard labels `[N, K]`. A
single-depth loss is K = 1. The size of the teacher's top-K support is called `top_k`, to keep it apart
from the depth axis.

Masking
-------
Valid rows are gathered (`x[mask]`) before any softmax, so prompt tokens, padding and depth shifts that
cross a document end cost no compute and cannot leak: whatever the masked rows hold (even NaN), the loss
and every gradient are bit-for-bit unchanged, and masked rows get exactly zero gradient. The gather costs
one host sync and a copy of the valid rows per call, affordable for a loss computed once per step. A
batch without a single valid row returns a 0 that is still attached to the graph, so `backward()` runs
and leaves zero gradients instead of NaN.

Numerics
--------
Logits may arrive in bf16; everything is computed in fp32 (fp64 stays fp64, which the gradchecks use)
through log-softmax. The teacher is detached inside every function: the target is frozen.

Top-K support (Eq. 3)
---------------------
S = the teacher's `top_k` largest logits. The teacher is renormalised on S, p̃ = softmax(p_logits[S]);
only `[M, top_k]` teacher probabilities exist. The student is *not* renormalised: log q(v) is the
log-softmax over the full vocabulary, gathered at S (its log-normaliser is one fp32 pass over V, which
autograd keeps for the backward). Then

    KL_S = Σ_{v∈S} p̃(v) (log p̃(v) − log q(v)) = KL(p̃ ‖ q / q(S)) − log q(S),

which is exactly KL(p̃ ‖ q) with p̃ extended by zeros: ≥ 0, zero iff q = p̃, and its −log q(S) term pushes
student mass that sits outside S back onto S. Renormalising the student on S would drop that term and let
the student park mass off S for free — mass that verification rejects. With top_k ≥ V, S is the whole
vocabulary and KL_S is the full KL. TV and α use the same pair (p̃, q):

    α_S = Σ_{v∈S} min(p̃(v), q(v)),    TV_S = 1 − α_S = ½ (Σ_{v∈S} |p̃(v) − q(v)| + 1 − q(S)),

the exact TV between p̃ and the full student, computed without materialising q off S.

Data parallelism
----------------
Every loss is Σ (per-token terms) / (a detached count or weight sum over the batch). Under DDP / FSDP2 each
rank sees only its slice of the global batch, and averaging per-rank means is not the global mean when the
ranks hold different numbers of valid tokens. Inside `global_denominators(sum_fn)` every denominator is
first summed over ranks by `sum_fn`, so each rank's loss is its exact share of the global-batch loss
(their sum is the single-process loss). Outside it (the default) nothing changes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

# ---------------------------------------------------------------------------------------------------------
# Config, inputs, outputs
# ---------------------------------------------------------------------------------------------------------


# DSpark's L_TV as a multiple of TV = ½‖p − q‖₁ = 1 − α: the report's full L1 distance, or TV itself.
TV_NORMS: dict[str, float] = {"l1": 2.0, "half_l1": 1.0}


@dataclass(frozen=True)
class LossConfig:
    """Hyper-parameters of every loss in `LOSSES`; each loss reads only the fields it needs.

    `top_k`: teacher support size for KL / TV / α (None = full vocabulary; the report uses 10000).
    `depth_weights`: w_k of Eq. 3 (normalised by `normalize_depth_weights`; None = uniform).
    `eta`: λ = exp(−η·sg[α]) of Eq. 6.  `eps`: ε of Eq. 7 and Eq. 18.
    `rho`: D-PACE smoothing ρ of Eq. 16.  `gamma`: DSpark decay γ of w_k = exp(−(k−1)/γ) (None = K).
    `ce_coef`, `tv_coef`, `conf_coef`: the DSpark coefficients 0.1 / 0.9 / 1.0.
    `tv_norm`: DSpark's L_TV (TV_NORMS): "l1" = ‖p − q‖₁ as the DSpark report writes it (the default), "half_l1" =
    ½‖p − q‖₁ = TV (half the weight against CE; what the DSpark loss used before this option existed).
    The report fixes none of η, ε, ρ; the defaults here are our choices.
    """

    top_k: int | None = None
    depth_weights: tuple[float, ...] | None = None
    eta: float = 3.0
    eps: float = 1e-6
    rho: float = 0.5
    gamma: float | None = None
    ce_coef: float = 0.1
    tv_coef: float = 0.9
    conf_coef: float = 1.0
    tv_norm: str = "l1"

    def __post_init__(self) -> None:
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1 or None, got {self.top_k}")
        if not self.eta >= 0:
            raise ValueError(f"eta must be >= 0, got {self.eta}")
        if not self.eps > 0:
            raise ValueError(f"eps must be > 0, got {self.eps}")
        if not 0 <= self.rho <= 1:
            raise ValueError(f"rho must lie in [0, 1], got {self.rho}")
        if self.gamma is not None and not self.gamma > 0:
            raise ValueError(f"gamma must be > 0 or None, got {self.gamma}")
        if min(self.ce_coef, self.tv_coef, self.conf_coef) < 0:
            raise ValueError("DSpark coefficients must be >= 0")
        if self.tv_norm not in TV_NORMS:
            raise ValueError(f"unknown tv_norm {self.tv_norm!r}; choose one of {', '.join(TV_NORMS)} (the DSpark "
                             "report's L_TV is the full L1 distance, l1)")


@dataclass(frozen=True)
class LossBatch:
    """The tensors a loss may need; which ones are required depends on the loss (see `LOSSES`)."""

    student_logits: Tensor  # [N, K, V] drafter logits
    mask: Tensor  # [N, K] bool, True where (position, depth) has valid supervision
    teacher_logits: Tensor | None = None  # [N, K, V] frozen target logits aligned with the student
    labels: Tensor | None = None  # [N, K] int, ground-truth token ids (any value where mask is False)
    confidence_logits: Tensor | None = None  # [N, K] DSpark confidence-head logits (pre-sigmoid), or [N, K, n]
    confidence_targets: Tensor | None = None  # same shape: what the head is fitted to (None: α of each position)


class LossOutput(NamedTuple):
    loss: Tensor  # [] scalar to backpropagate
    parts: dict[str, Tensor]  # detached components for logging, e.g. the three DSpark terms


# ---------------------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------------------

_DENOMINATOR_SUM: ContextVar[Callable[[Tensor], Tensor] | None] = ContextVar("angelspec_denominator_sum",
                                                                              default=None)


@contextmanager
def global_denominators(sum_fn: Callable[[Tensor], Tensor]) -> Iterator[None]:
    """Within the block, loss denominators are `sum_fn(local denominator)`, e.g. an all-reduce SUM over
    data-parallel ranks (module docstring, "Data parallelism"). `sum_fn` must not modify its input."""
    token = _DENOMINATOR_SUM.set(sum_fn)
    try:
        yield
    finally:
        _DENOMINATOR_SUM.reset(token)


def _denominator(local: Tensor) -> Tensor:
    """The local denominator, or its sum over ranks inside `global_denominators`."""
    sum_fn = _DENOMINATOR_SUM.get()
    return local if sum_fn is None else sum_fn(local.detach())



def _compute_dtype(*tensors: Tensor) -> torch.dtype:
    dtype = torch.float32
    for t in tensors:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def _check(student_logits: Tensor, mask: Tensor, teacher_logits: Tensor | None = None,
           labels: Tensor | None = None) -> None:
    if student_logits.dim() != 3:
        raise ValueError(f"student_logits must be [N, K, V], got shape {tuple(student_logits.shape)}")
    n, k, _ = student_logits.shape
    if mask.shape != (n, k) or mask.dtype != torch.bool:
        raise ValueError(f"mask must be a bool [N, K] = [{n}, {k}] tensor, got {mask.dtype} {tuple(mask.shape)}")
    if teacher_logits is not None and teacher_logits.shape != student_logits.shape:
        raise ValueError(f"teacher_logits {tuple(teacher_logits.shape)} must match student_logits "
                         f"{tuple(student_logits.shape)}")
    if labels is not None and (labels.shape != (n, k) or labels.dtype.is_floating_point or labels.dtype == torch.bool):
        raise ValueError(f"labels must be an integer [N, K] = [{n}, {k}] tensor, got {labels.dtype} "
                         f"{tuple(labels.shape)}")


def _unrows(values: Tensor, mask: Tensor) -> Tensor:
    """Inverse of `x[mask]` for one value per row: [M] -> [N, K], zeros where the mask is False."""
    return values.new_zeros(mask.shape).masked_scatter(mask, values)


class _Support(NamedTuple):
    log_p: Tensor  # [M, S] teacher log-probs renormalised on the support (detached)
    log_q: Tensor  # [M, S] student log-probs over the full vocabulary, gathered on the support


def _support(student_logits: Tensor, teacher_logits: Tensor, top_k: int | None) -> _Support:
    """Teacher and student log-probs on the teacher's top-K support (module docstring); rows [M, V]."""
    dtype = _compute_dtype(student_logits, teacher_logits)
    teacher_logits = teacher_logits.detach()
    if top_k is None:
        return _Support(F.log_softmax(teacher_logits.to(dtype), -1), F.log_softmax(student_logits.to(dtype), -1))
    top_logits, ids = teacher_logits.topk(min(top_k, teacher_logits.shape[-1]), dim=-1, sorted=False)  # [M, S]
    log_p = F.log_softmax(top_logits.to(dtype), -1)
    log_z = torch.logsumexp(student_logits.to(dtype), -1, keepdim=True)  # [M, 1], the one full-V fp32 pass
    log_q = student_logits.gather(-1, ids).to(dtype) - log_z
    return _Support(log_p, log_q)


def _kl(s: _Support) -> Tensor:
    """[M] Σ p̃ (log p̃ − log q); entries with p̃ = 0 contribute 0 even where a log-prob is −inf."""
    p = s.log_p.exp()
    return torch.where(p > 0, p * (s.log_p - s.log_q), 0.0).sum(-1)


def _alpha(s: _Support) -> Tensor:
    """[M] Σ min(p̃, q) = Σ exp(min(log p̃, log q)) (Eq. 5)."""
    return torch.minimum(s.log_p, s.log_q).exp().sum(-1)


def _depth_mean(values: Tensor, mask: Tensor, depth_weights: Sequence[float] | Tensor | None) -> Tensor:
    """Eq. 3's reduction Σ_k w_k · (1/|I_k|) Σ_{i∈I_k} values[i, k]; values [N, K] are 0 where masked.

    w is normalised over all K depths once; a depth with no valid row in this batch contributes 0 rather
    than having its weight redistributed, so the loss scale does not depend on the batch's composition.
    """
    w = normalize_depth_weights(depth_weights, mask.shape[1], dtype=values.dtype, device=values.device)  # [K]
    count = _denominator(mask.sum(0)).clamp_min(1).to(values.dtype)  # [K]
    return (w * values.sum(0) / count).sum()


def normalize_depth_weights(weights: Sequence[float] | Tensor | None, depth: int, *,
                            dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> Tensor:
    """Per-depth weights w_k of Eq. 3 as a [K] tensor summing to 1; None gives uniform 1/K.

    Weights are constants of the objective (detached); they must be finite, non-negative and not all 0.
    """
    if depth < 1:
        raise ValueError(f"depth must be >= 1, got {depth}")
    if weights is None:
        return torch.full((depth,), 1.0 / depth, dtype=dtype, device=device)
    w = torch.as_tensor(weights, dtype=dtype, device=device).detach()
    if w.shape != (depth,):
        raise ValueError(f"expected {depth} depth weights, got shape {tuple(w.shape)}")
    if not bool(torch.isfinite(w).all()) or bool((w < 0).any()) or not bool(w.sum() > 0):
        raise ValueError(f"depth weights must be finite, >= 0 and not all 0, got {w.tolist()}")
    return w / w.sum()


def dspark_position_weights(depth: int, gamma: float | None = None, *, dtype: torch.dtype = torch.float32,
                            device: torch.device | str | None = None) -> Tensor:
    """DSpark position weights w_k = exp(−(k−1)/γ) for 1-based block positions k = 1..K, as [K]; γ = K if None."""
    gamma = float(depth) if gamma is None else gamma
    return torch.exp(-torch.arange(depth, dtype=dtype, device=device) / gamma)


# ---------------------------------------------------------------------------------------------------------
# Per-token terms: [..., V] -> [...], no masking
# ---------------------------------------------------------------------------------------------------------


def token_ce(student_logits: Tensor, labels: Tensor) -> Tensor:
    """−log q(y) per token: student_logits [..., V], labels [...] -> [...]."""
    dtype = _compute_dtype(student_logits)
    picked = student_logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1).to(dtype)
    return torch.logsumexp(student_logits.to(dtype), -1) - picked


def token_kl(student_logits: Tensor, teacher_logits: Tensor, top_k: int | None = None) -> Tensor:
    """Forward KL(p ‖ q) per token (the summand of Eq. 3), on the teacher's top-K support: [..., V] -> [...]."""
    lead = student_logits.shape[:-1]
    v = student_logits.shape[-1]
    return _kl(_support(student_logits.reshape(-1, v), teacher_logits.reshape(-1, v), top_k)).reshape(lead)


def token_alpha(student_logits: Tensor, teacher_logits: Tensor, top_k: int | None = None) -> Tensor:
    """Acceptance probability α(p, q) = Σ_v min(p(v), q(v)) per token (Eq. 5): [..., V] -> [...]."""
    lead = student_logits.shape[:-1]
    v = student_logits.shape[-1]
    return _alpha(_support(student_logits.reshape(-1, v), teacher_logits.reshape(-1, v), top_k)).reshape(lead)


def token_tv(student_logits: Tensor, teacher_logits: Tensor, top_k: int | None = None) -> Tensor:
    """TV(p, q) = ½ Σ_v |p(v) − q(v)| = 1 − α (Eq. 4–5) per token: [..., V] -> [...].

    Computed as 1 − α: equal in value and, since softmax logit-gradients are blind to constant shifts of
    the per-vocab derivative, equal in logit-gradient too.
    """
    return 1.0 - token_alpha(student_logits, teacher_logits, top_k)


# ---------------------------------------------------------------------------------------------------------
# Masked losses on [N, K, V]
# ---------------------------------------------------------------------------------------------------------


def cross_entropy(student_logits: Tensor, labels: Tensor, mask: Tensor,
                  depth_weights: Sequence[float] | Tensor | None = None) -> Tensor:
    """Hard-label CE with Eq. 3's reduction: Σ_k w_k (1/|I_k|) Σ_{i∈I_k} −log q_{i,k}(y_{i,k}).

    student_logits [N, K, V], labels [N, K], mask [N, K] -> [].
    """
    _check(student_logits, mask, labels=labels)
    ce = token_ce(student_logits[mask], labels[mask])  # [M]
    return _depth_mean(_unrows(ce, mask), mask, depth_weights)


def forward_kl(student_logits: Tensor, teacher_logits: Tensor, mask: Tensor,
               depth_weights: Sequence[float] | Tensor | None = None, top_k: int | None = None) -> Tensor:
    """Eq. 3: L_KL = Σ_k w_k (1/|I_k|) Σ_{i∈I_k} KL(p_{i,k} ‖ q_{i,k}), on the teacher's top-K support.

    [N, K, V] logits, mask [N, K] -> []. Teacher renormalised on its top-K, student full-vocab (module doc).
    """
    _check(student_logits, mask, teacher_logits)
    kl = _kl(_support(student_logits[mask], teacher_logits[mask], top_k))  # [M]
    return _depth_mean(_unrows(kl, mask), mask, depth_weights)


def tv_loss(student_logits: Tensor, teacher_logits: Tensor, mask: Tensor,
            depth_weights: Sequence[float] | Tensor | None = None, top_k: int | None = None) -> Tensor:
    """Per-token TV (Eq. 4) with Eq. 3's per-depth reduction. [N, K, V] logits, mask [N, K] -> []."""
    _check(student_logits, mask, teacher_logits)
    tv = 1.0 - _alpha(_support(student_logits[mask], teacher_logits[mask], top_k))  # [M]
    return _depth_mean(_unrows(tv, mask), mask, depth_weights)


def _token_lk_lambda(s: _Support, eta: float) -> Tensor:
    alpha = _alpha(s)  # [M]
    lam = torch.exp(-eta * alpha.detach())  # λ = exp(−η·sg[α])
    return lam * _kl(s) + (1.0 - lam) * (1.0 - alpha)


def lk_lambda_loss(student_logits: Tensor, teacher_logits: Tensor, mask: Tensor,
                   depth_weights: Sequence[float] | Tensor | None = None, top_k: int | None = None,
                   eta: float = 3.0) -> Tensor:
    """Eq. 6: L^λ_LK = λ·KL(p‖q) + (1−λ)·TV(p, q), λ = exp(−η·sg[α]), with Eq. 3's per-depth reduction.

    λ → 1 (pure KL) while the overlap α is small, λ → exp(−η) (mostly TV) as α → 1. No gradient flows
    through λ. [N, K, V] logits, mask [N, K] -> [].
    """
    _check(student_logits, mask, teacher_logits)
    lk = _token_lk_lambda(_support(student_logits[mask], teacher_logits[mask], top_k), eta)  # [M]
    return _depth_mean(_unrows(lk, mask), mask, depth_weights)


def lk_alpha_loss(student_logits: Tensor, teacher_logits: Tensor, mask: Tensor,
                  depth_weights: Sequence[float] | Tensor | None = None, top_k: int | None = None,
                  eps: float = 1e-6) -> Tensor:
    """Eq. 7: L^α_LK = −log(α(p, q) + ε), with Eq. 3's per-depth reduction. [N, K, V], mask [N, K] -> [].

    Its gradient is ∇TV / (α + ε) per token (Eq. 8): the TV direction, amplified where overlap is low.
    """
    _check(student_logits, mask, teacher_logits)
    alpha = _alpha(_support(student_logits[mask], teacher_logits[mask], top_k))  # [M]
    return _depth_mean(_unrows(-torch.log(alpha + eps), mask), mask, depth_weights)


def e2e_tv_loss(student_logits: Tensor, teacher_logits: Tensor, mask: Tensor, top_k: int | None = None) -> Tensor:
    """Eq. 9: L_e2e = 1 − (1 / (|I|·D)) Σ_{i∈I} Σ_{m=0}^{D−1} Π_{k=0}^{m} α_{i,k}, with D = K.

    I is the set of positions valid at *all* K depths (rows of `mask` that are all True); a position valid
    at only some depths is left out entirely, since its prefix products are undefined past the gap. The
    per-depth weights w_k do not apply: the prefix products already weight shallow depths more. With I
    empty the loss is 0 (attached to the graph), not the formula's 1. [N, K, V] logits, mask [N, K] -> [].
    """
    _check(student_logits, mask, teacher_logits)
    full = mask.all(-1)  # [N]
    n_full, depth, v = int(full.sum()), student_logits.shape[1], student_logits.shape[2]
    rows_s = student_logits[full].reshape(-1, v)  # [|I|·K, V]
    rows_t = teacher_logits[full].reshape(-1, v)
    alpha = _alpha(_support(rows_s, rows_t, top_k)).reshape(n_full, depth)  # [|I|, K]
    survive = torch.cumprod(alpha, dim=1)  # [|I|, K] Π_{k≤m} α_{i,k}
    return (1.0 - survive.mean(1)).sum() / max(int(_denominator(full.sum())), 1)


def dpace_weights(student_logits: Tensor, labels: Tensor, mask: Tensor, rho: float = 0.5) -> Tensor:
    """D-PACE weights, Eq. 16–17, detached: [N, K, V] logits, labels [N, K], mask [N, K] -> [N, K].

        s_{i,k} = exp(−CE_{i,k}) = q_{i,k}(y_{i,k})           (student confidence in the label)
        s̃_{i,k} = (1 − ρ)·s_{i,k} + ρ                          (Eq. 16)
        w̄_{i,k} = Σ_{m=k}^{K−1} 1[(i,m) valid] · Π_{r=0}^{m} s̃_{i,r}   (Eq. 17: suffix sum of prefix products)

    Masking: an invalid (i, r) enters the prefix products as s̃ = 1 (it neither kills nor scales later
    depths) and its own term is dropped from the suffix sums; w̄ = 0 where the mask is False. For the usual
    monotone mask (depths 0..L_i−1 valid) this is Eq. 17 with the sum stopped at the last valid depth.
    """
    _check(student_logits, mask, labels=labels)
    with torch.no_grad():
        s = torch.exp(-token_ce(student_logits[mask], labels[mask]))  # [M]
        s_tilde = (1.0 - rho) * s + rho
        s_tilde = s_tilde.new_ones(mask.shape).masked_scatter(mask, s_tilde)  # [N, K], 1 where invalid
        prefix = torch.cumprod(s_tilde, dim=1) * mask  # [N, K] Π_{r≤m} s̃_{i,r}, 0 where (i, m) invalid
        return prefix.flip(1).cumsum(1).flip(1) * mask  # [N, K] Σ_{m≥k}


def dpace_lk_loss(student_logits: Tensor, teacher_logits: Tensor, labels: Tensor, mask: Tensor,
                  top_k: int | None = None, eta: float = 3.0, rho: float = 0.5, eps: float = 1e-6) -> Tensor:
    """Eq. 18: L_cold = Σ_{k,i∈I_k} sg[w̄_{i,k}] L^λ_LK(p_{i,k}, q_{i,k}) / (Σ_{k,i∈I_k} sg[w̄_{i,k}] + ε).

    w̄ from `dpace_weights` (Eq. 16–17), L^λ_LK from Eq. 6. The D-PACE weights replace Eq. 3's w_k.
    [N, K, V] logits, labels [N, K], mask [N, K] -> [].
    """
    _check(student_logits, mask, teacher_logits, labels)
    w = dpace_weights(student_logits, labels, mask, rho)  # [N, K], detached
    lk = _unrows(_token_lk_lambda(_support(student_logits[mask], teacher_logits[mask], top_k), eta), mask)
    w = w.to(lk.dtype)
    return (w * lk).sum() / (_denominator(w.sum()) + eps)


def dspark_loss(student_logits: Tensor, teacher_logits: Tensor, labels: Tensor, mask: Tensor,
                confidence_logits: Tensor | None = None, top_k: int | None = None, gamma: float | None = None,
                ce_coef: float = 0.1, tv_coef: float = 0.9, conf_coef: float = 1.0, tv_norm: str = "l1",
                confidence_targets: Tensor | None = None) -> LossOutput:
    """DSpark three-term loss: ce_coef·L_CE + tv_coef·L_TV + conf_coef·BCE(c, sg[1 − TV]).

    Every term is a position-weighted mean over valid (i, k) with w_k = exp(−(k−1)/γ), k = 1..K:
    Σ_{i,k valid} w_k ℓ_{i,k} / Σ_{i,k valid} w_k. The confidence head is trained on the analytic
    acceptance c* = 1 − TV = α of the same position (Eq. 5), detached, so it never pulls the drafter's
    distribution; `confidence_logits` are pre-sigmoid (BCE-with-logits). L_TV is the report's ‖p_d − p_t‖₁ = 2·TV
    with `tv_norm` "l1" (the default), TV = ½‖p − q‖₁ with "half_l1"; the confidence target is α = 1 − ½‖p − q‖₁
    either way, as the report writes c*. The logged part "tv" is L_TV as weighted in the loss.
    [N, K, V] logits, labels [N, K], mask [N, K], confidence_logits [N, K] or None (no confidence term).
    `confidence_targets` replaces c* (a "protocol" head's, `train.confidence`): [N, K], or [N, K, n] with
    confidence_logits [N, K, n] (the BCE averaged over the n outputs).
    """
    if tv_norm not in TV_NORMS:
        raise ValueError(f"unknown tv_norm {tv_norm!r}; choose one of {', '.join(TV_NORMS)}")
    _check(student_logits, mask, teacher_logits, labels)
    n, depth, _ = student_logits.shape
    if confidence_logits is not None and confidence_logits.shape[:2] != (n, depth):
        raise ValueError(f"confidence_logits must be [N, K] = [{n}, {depth}], got {tuple(confidence_logits.shape)}")
    rows_s = student_logits[mask]  # [M, V]
    ce = _unrows(token_ce(rows_s, labels[mask]), mask)  # [N, K]
    alpha = _unrows(_alpha(_support(rows_s, teacher_logits[mask], top_k)), mask)  # [N, K]
    tv = (TV_NORMS[tv_norm] * (1.0 - alpha)) * mask  # ‖p − q‖₁ = 2·TV ("l1") or TV ("half_l1")
    w = dspark_position_weights(depth, gamma, dtype=ce.dtype, device=ce.device) * mask  # [N, K]
    # 0 only when nothing is valid (then numerators are 0)
    denom = _denominator(w.sum()).clamp_min(torch.finfo(w.dtype).tiny)
    ce_term = (w * ce).sum() / denom
    tv_term = (w * tv).sum() / denom
    loss = ce_coef * ce_term + tv_coef * tv_term
    parts = {"ce": ce_term.detach(), "tv": tv_term.detach()}
    if confidence_logits is not None:
        target = alpha[mask].detach() if confidence_targets is None else confidence_targets[mask]  # [M] c* = 1 − TV
        bce = confidence_bce(confidence_logits[mask], target)  # [M]
        conf_term = (w * _unrows(bce, mask)).sum() / denom
        loss = loss + conf_coef * conf_term
        parts["conf"] = conf_term.detach()
    return LossOutput(loss, parts)


def confidence_bce(logits: Tensor, target: Tensor) -> Tensor:
    """BCE-with-logits of confidence logits against a detached target, per row: [M] or [M, n] (a "protocol" head's
    n sampling temperatures, averaged) -> [M]."""
    if logits.shape != target.shape:
        raise ValueError(f"confidence targets {tuple(target.shape)} must match the confidence logits "
                         f"{tuple(logits.shape)}")
    target = target.detach().to(_compute_dtype(target))
    bce = F.binary_cross_entropy_with_logits(logits.to(target.dtype), target, reduction="none")
    return bce if bce.dim() == 1 else bce.mean(-1)


@torch.no_grad()
def acceptance_per_depth(student_logits: Tensor, teacher_logits: Tensor, mask: Tensor,
                         top_k: int | None = None) -> Tensor:
    """Mean α (Eq. 5) over the valid positions of each depth, for logging: [N, K, V], mask [N, K] -> [K]."""
    _check(student_logits, mask, teacher_logits)
    alpha = _unrows(_alpha(_support(student_logits[mask], teacher_logits[mask], top_k)), mask)  # [N, K]
    return alpha.sum(0) / mask.sum(0).clamp_min(1).to(alpha.dtype)


# ---------------------------------------------------------------------------------------------------------
# Registry: one signature, selected by config
# ---------------------------------------------------------------------------------------------------------

LossFn = Callable[[LossBatch, LossConfig], LossOutput]


def _need(batch: LossBatch, name: str, *fields: str) -> None:
    missing = [f for f in fields if getattr(batch, f) is None]
    if missing:
        raise ValueError(f"loss {name!r} needs {', '.join(missing)} in the LossBatch")


def _ce(b: LossBatch, c: LossConfig) -> LossOutput:
    _need(b, "ce", "labels")
    return LossOutput(cross_entropy(b.student_logits, b.labels, b.mask, c.depth_weights), {})


def _kl_entry(b: LossBatch, c: LossConfig) -> LossOutput:
    _need(b, "kl", "teacher_logits")
    return LossOutput(forward_kl(b.student_logits, b.teacher_logits, b.mask, c.depth_weights, c.top_k), {})


def _tv(b: LossBatch, c: LossConfig) -> LossOutput:
    _need(b, "tv", "teacher_logits")
    return LossOutput(tv_loss(b.student_logits, b.teacher_logits, b.mask, c.depth_weights, c.top_k), {})


def _lk_lambda(b: LossBatch, c: LossConfig) -> LossOutput:
    _need(b, "lk_lambda", "teacher_logits")
    loss = lk_lambda_loss(b.student_logits, b.teacher_logits, b.mask, c.depth_weights, c.top_k, c.eta)
    return LossOutput(loss, {})


def _lk_alpha(b: LossBatch, c: LossConfig) -> LossOutput:
    _need(b, "lk_alpha", "teacher_logits")
    loss = lk_alpha_loss(b.student_logits, b.teacher_logits, b.mask, c.depth_weights, c.top_k, c.eps)
    return LossOutput(loss, {})


def _e2e_tv(b: LossBatch, c: LossConfig) -> LossOutput:
    _need(b, "e2e_tv", "teacher_logits")
    return LossOutput(e2e_tv_loss(b.student_logits, b.teacher_logits, b.mask, c.top_k), {})


def _dpace_lk(b: LossBatch, c: LossConfig) -> LossOutput:
    _need(b, "dpace_lk", "teacher_logits", "labels")
    loss = dpace_lk_loss(b.student_logits, b.teacher_logits, b.labels, b.mask, c.top_k, c.eta, c.rho, c.eps)
    return LossOutput(loss, {})


def _dspark(b: LossBatch, c: LossConfig) -> LossOutput:
    _need(b, "dspark", "teacher_logits", "labels")
    return dspark_loss(b.student_logits, b.teacher_logits, b.labels, b.mask, b.confidence_logits, c.top_k,
                       c.gamma, c.ce_coef, c.tv_coef, c.conf_coef, c.tv_norm, b.confidence_targets)


LOSSES: dict[str, LossFn] = {
    "ce": _ce,
    "kl": _kl_entry,
    "tv": _tv,
    "lk_lambda": _lk_lambda,
    "lk_alpha": _lk_alpha,
    "e2e_tv": _e2e_tv,
    "dpace_lk": _dpace_lk,
    "dspark": _dspark,
}


def get_loss(name: str) -> LossFn:
    """The registered loss `name`, or a ValueError listing the known names."""
    try:
        return LOSSES[name]
    except KeyError:
        raise ValueError(f"unknown loss {name!r}; known: {', '.join(sorted(LOSSES))}") from None


@dataclass(frozen=True)
class LossSchedule:
    """Two-stage objective (§2.3, §3.3): `cold_start` while step < switch_step, then `final` (Eq. 9).

    The report's MTP recipe cold-starts with LK^α ("lk_alpha", §2.3); its DFly recipe with the
    D-PACE-weighted LK^λ ("dpace_lk", §3.3). switch_step = 0 means the final objective from the start.
    """

    cold_start: str = "lk_alpha"
    switch_step: int = 0
    final: str = "e2e_tv"
    config: LossConfig = field(default_factory=LossConfig)

    def __post_init__(self) -> None:
        get_loss(self.cold_start)
        get_loss(self.final)
        if self.switch_step < 0:
            raise ValueError(f"switch_step must be >= 0, got {self.switch_step}")

    def name_at(self, step: int) -> str:
        return self.cold_start if step < self.switch_step else self.final

    def loss(self, step: int, batch: LossBatch) -> LossOutput:
        return LOSSES[self.name_at(step)](batch, self.config)

