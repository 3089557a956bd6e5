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
Masked (row, depth) entries are replaced by placeholders (0 logits, label 0) before any softmax and their
per-token values by exact zeros after it (`_valid`, `_unrows`: `torch.where`, never `x[mask]`), so prompt
tokens, padding and depth shifts that cross a document end cannot leak: whatever the masked rows hold (even
NaN), the loss and every gradient are bit-for-bit unchanged, and masked rows get exactly zero gradient. Every
shape is static, so a loss runs without a single host sync (it runs on the `meta` device; tested): on a GPU
the chunks of a step queue up without waiting for each other. The price is the softmax work of the masked
entries, small next to the LM head that makes them. A batch without a single valid row returns a 0 that is
still attached to the graph, so `backward()` runs and leaves zero gradients instead of NaN.

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

Draft vocabulary (train_vocab "draft")
--------------------------------------
A drafter with a draft vocabulary V' (`models.vocab.DraftVocabulary`) proposes only tokens of V'. Trained under
train_vocab "draft", its head scores only V' (`LossBatch.draft_vocab`: the student logits are [N, K, V'], the
teacher logits stay [N, K, V]), and every objective runs in the draft space of V' + 1 atoms (`to_draft_space`): the
teacher is p on V' plus one "outside" atom holding 1 − Σ_{V'} p (`draft_space_teacher`, computed once, detached),
the student is q on V' with zero mass outside (a −inf logit). Then

    α = Σ_{v∈V'} min(p(v), q(v)),    TV = ½ (Σ_{v∈V'} |p(v) − q(v)| + p(outside)) = 1 − α

are exactly α and TV over the whole vocabulary with q = 0 outside V': the acceptance of the drafter inference
runs. LK^α, e2e TV, the TV part of LK^λ, D-PACE's products and DSpark's L_TV and confidence target follow from α.
What has no finite value with q = 0 outside V' is defined instead:
- KL (Eq. 3, and LK^λ's KL part) is taken against p renormalised on V' (the outside atom left out), so it pulls
  q towards the teacher's shape inside V'; how much mass falls outside is what TV / α see.
- hard-label CE ("ce", DSpark's CE term) leaves out rows whose label lies outside V' (they count for α / TV);
  "ce" averages over the rows it keeps, DSpark's CE shares the position-weight denominator of its other terms.
- D-PACE's confidence s = q(y) is 0 for a label outside V' (what the drafter gives it), so s̃ = ρ there.
With top_k the support is the teacher's top-K of the V' + 1 atoms (the outside atom may be among them). With V'
the whole vocabulary every loss equals the full-vocabulary one (tested).

Data parallelism
----------------
Every loss is Σ (per-token terms) / (a detached count or weight sum over the batch). Under DDP / FSDP2 each
rank sees only its slice of the global batch, and averaging per-rank means is not the global mean when the
ranks hold different numbers of valid tokens. Inside `global_denominators(sum_fn)` every denominator is
first summed over ranks by `sum_fn`, so each rank's loss is its exact share of the global-batch loss
(their sum is the single-process loss). Outside it (the default) nothing changes.

Chunks
------
Every registered loss is an `Objective`: `sums` maps a batch to sums over its rows (`LossSums`: numerators with
gradient, detached denominators — valid-row counts, or D-PACE's and DSpark's weight sums), and `finish` turns
the totals into the loss. Rows interact only through those denominators (e2e TV's and D-PACE's products run over
one row's depths), so the sums of row chunks add up to the batch's. `ChunkedLossBatch` uses that to run the
LM head and the loss a chunk of rows at a time under `torch.utils.checkpoint`: the [N, K, V] student and teacher
logits never exist whole, and loss and gradients equal the whole-batch computation up to summation order. The
trainers' teacher is a `TeacherHead` (the target's final-norm states and LM head), so its logits too are made per
chunk, for the chunk's rows only, and no [B, T, V] teacher exists; `loss_chunk_logits` sizes the chunks from the
device's memory.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

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
    # train_vocab "draft": the target ids [V'] of student_logits' columns, the drafter's draft vocabulary (q = 0 at
    # every other id); teacher_logits and labels stay over / in the whole vocabulary. Every objective then runs in
    # the draft space (`to_draft_space`; "Draft vocabulary" in the module docstring).
    draft_vocab: Tensor | None = None
    in_draft_space: bool = False  # the vocabulary axis is V' plus the outside column (`to_draft_space`'s output)


class LossOutput(NamedTuple):
    loss: Tensor  # [] scalar to backpropagate
    parts: dict[str, Tensor]  # detached components for logging, e.g. the three DSpark terms


class LossSums(NamedTuple):
    """A batch's (or a chunk of rows') share of a loss: sums over its rows, added up over chunks ("Chunks")."""

    num: Tensor  # [J] numerators, attached to the graph
    den: Tensor  # [J'] denominators: valid-row counts or detached weight sums


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


def _valid(x: Tensor, mask: Tensor, fill: float | int = 0) -> Tensor:
    """`x` [N, K, ...] with every masked (row, depth) entry replaced by `fill` (module docstring, "Masking"): the
    masked entries' content (even NaN or an out-of-range label) cannot reach a result, and they get exactly zero
    gradient. Shapes stay static: no host sync, unlike `x[mask]`."""
    m = mask.reshape(*mask.shape, *([1] * (x.dim() - mask.dim())))
    return torch.where(m, x, torch.tensor(fill, dtype=x.dtype, device=x.device))


def _rows(x: Tensor) -> Tensor:
    """[N, K, V] -> [N·K, V] (the per-token functions' rows)."""
    return x.reshape(-1, x.shape[-1])


def _unrows(values: Tensor, mask: Tensor) -> Tensor:
    """One value per (row, depth), [N·K] (or [N, K]) -> [N, K], exactly 0 where the mask is False."""
    return torch.where(mask, values.reshape(mask.shape), 0.0)


def _masked_support(student_logits: Tensor, teacher_logits: Tensor, mask: Tensor, top_k: int | None,
                    outside: bool = False) -> _Support:
    """`_support` of every (row, depth), rows [N·K, ...], the masked ones computed on placeholders (`_valid`)."""
    return _support(_rows(_valid(student_logits, mask)), _rows(_valid(teacher_logits.detach(), mask)), top_k,
                    outside)


class _Support(NamedTuple):
    log_p: Tensor  # [M, S] teacher log-probs renormalised on the support (detached)
    log_q: Tensor  # [M, S] student log-probs over the full vocabulary, gathered on the support
    kl_log_p: Tensor  # [M, S] the teacher KL compares against: log_p, or in the draft space log_p without the
    #                   outside column, renormalised ("Draft vocabulary" in the module docstring)


def _support(student_logits: Tensor, teacher_logits: Tensor, top_k: int | None, outside: bool = False) -> _Support:
    """Teacher and student log-probs on the teacher's top-K support (module docstring); rows [M, V]. `outside`: the
    last column is the draft space's outside bucket (`to_draft_space`)."""
    dtype = _compute_dtype(student_logits, teacher_logits)
    teacher_logits = teacher_logits.detach()
    if top_k is None:
        log_p, log_q = F.log_softmax(teacher_logits.to(dtype), -1), F.log_softmax(student_logits.to(dtype), -1)
        bucket = None if not outside else torch.arange(log_p.shape[-1], device=log_p.device) == log_p.shape[-1] - 1
    else:
        top_logits, ids = teacher_logits.topk(min(top_k, teacher_logits.shape[-1]), dim=-1, sorted=False)  # [M, S]
        log_p = F.log_softmax(top_logits.to(dtype), -1)
        log_z = torch.logsumexp(student_logits.to(dtype), -1, keepdim=True)  # [M, 1], the one full-V fp32 pass
        log_q = student_logits.gather(-1, ids).to(dtype) - log_z
        bucket = None if not outside else ids == teacher_logits.shape[-1] - 1
    if bucket is None:
        return _Support(log_p, log_q, log_p)
    kl_log_p = F.log_softmax(log_p.masked_fill(bucket, float("-inf")), -1)
    return _Support(log_p, log_q, kl_log_p.masked_fill(kl_log_p.isnan(), float("-inf")))  # NaN: nothing but bucket


def _kl(s: _Support) -> Tensor:
    """[M] Σ p̃ (log p̃ − log q) with p̃ = `kl_log_p`; entries with p̃ = 0 contribute 0 even where a log-prob is −inf."""
    p = s.kl_log_p.exp()
    return torch.where(p > 0, p * (s.kl_log_p - s.log_q), 0.0).sum(-1)


def _alpha(s: _Support) -> Tensor:
    """[M] Σ min(p̃, q) = Σ exp(min(log p̃, log q)) (Eq. 5)."""
    return torch.minimum(s.log_p, s.log_q).exp().sum(-1)


def _depth_mean(values: Tensor, mask: Tensor, depth_weights: Sequence[float] | Tensor | None) -> Tensor:
    """Eq. 3's reduction Σ_k w_k · (1/|I_k|) Σ_{i∈I_k} values[i, k]; values [N, K] are 0 where masked.

    w is normalised over all K depths once; a depth with no valid row in this batch contributes 0 rather
    than having its weight redistributed, so the loss scale does not depend on the batch's composition.
    """
    return _depth_finish(_depth_sums(values, mask), depth_weights)


def _depth_sums(values: Tensor, mask: Tensor) -> LossSums:
    """`_depth_mean`'s row sums: per depth, Σ_i values[i, k] [K] and the valid-row count |I_k| [K]."""
    return LossSums(values.sum(0), mask.sum(0))


def _depth_finish(sums: LossSums, depth_weights: Sequence[float] | Tensor | None) -> Tensor:
    """`_depth_mean` from its row sums."""
    w = normalize_depth_weights(depth_weights, sums.num.shape[0], dtype=sums.num.dtype, device=sums.num.device)
    count = _denominator(sums.den).clamp_min(1).to(sums.num.dtype)  # [K]
    return (w * sums.num / count).sum()


def normalize_depth_weights(weights: Sequence[float] | Tensor | None, depth: int, *,
                            dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> Tensor:
    """Per-depth weights w_k of Eq. 3 as a [K] tensor summing to 1; None gives uniform 1/K.

    Weights are constants of the objective (detached); they must be finite, non-negative and not all 0.
    """
    if depth < 1:
        raise ValueError(f"depth must be >= 1, got {depth}")
    if weights is None:
        return torch.full((depth,), 1.0 / depth, dtype=dtype, device=device)
    # Checked where the weights are (a config's tuple: on the host, so no device sync), then moved.
    w = weights.detach().to(dtype) if isinstance(weights, Tensor) else torch.as_tensor(weights, dtype=dtype)
    if w.shape != (depth,):
        raise ValueError(f"expected {depth} depth weights, got shape {tuple(w.shape)}")
    if not bool(torch.isfinite(w).all()) or bool((w < 0).any()) or not bool(w.sum() > 0):
        raise ValueError(f"depth weights must be finite, >= 0 and not all 0, got {w.tolist()}")
    return (w / w.sum()).to(device)


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
    return _depth_mean(_ce_values(student_logits, labels, mask), mask, depth_weights)


def _ce_values(student_logits: Tensor, labels: Tensor, mask: Tensor) -> Tensor:
    """Per-(row, depth) CE [N, K], 0 where masked (in the draft space, pass `_label_mask`: a label outside the draft
    vocabulary has q = 0, so no finite CE)."""
    _check(student_logits, mask, labels=labels)
    return _unrows(token_ce(_rows(_valid(student_logits, mask)), _valid(labels, mask).reshape(-1)), mask)


def forward_kl(student_logits: Tensor, teacher_logits: Tensor, mask: Tensor,
               depth_weights: Sequence[float] | Tensor | None = None, top_k: int | None = None) -> Tensor:
    """Eq. 3: L_KL = Σ_k w_k (1/|I_k|) Σ_{i∈I_k} KL(p_{i,k} ‖ q_{i,k}), on the teacher's top-K support.

    [N, K, V] logits, mask [N, K] -> []. Teacher renormalised on its top-K, student full-vocab (module doc).
    """
    return _depth_mean(_kl_values(student_logits, teacher_logits, mask, top_k), mask, depth_weights)


def _kl_values(student_logits: Tensor, teacher_logits: Tensor, mask: Tensor, top_k: int | None,
               outside: bool = False) -> Tensor:
    """Per-(row, depth) KL_S [N, K], 0 where masked (`outside`: the draft space's, `_support`)."""
    _check(student_logits, mask, teacher_logits)
    return _unrows(_kl(_masked_support(student_logits, teacher_logits, mask, top_k, outside)), mask)


def tv_loss(student_logits: Tensor, teacher_logits: Tensor, mask: Tensor,
            depth_weights: Sequence[float] | Tensor | None = None, top_k: int | None = None) -> Tensor:
    """Per-token TV (Eq. 4) with Eq. 3's per-depth reduction. [N, K, V] logits, mask [N, K] -> []."""
    return _depth_mean(_tv_values(student_logits, teacher_logits, mask, top_k), mask, depth_weights)


def _tv_values(student_logits: Tensor, teacher_logits: Tensor, mask: Tensor, top_k: int | None) -> Tensor:
    """Per-(row, depth) TV_S [N, K], 0 where masked."""
    _check(student_logits, mask, teacher_logits)
    return _unrows(1.0 - _alpha(_masked_support(student_logits, teacher_logits, mask, top_k)), mask)


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
    return _depth_mean(_lk_lambda_values(student_logits, teacher_logits, mask, top_k, eta), mask, depth_weights)


def _lk_lambda_values(student_logits: Tensor, teacher_logits: Tensor, mask: Tensor, top_k: int | None,
                      eta: float, outside: bool = False) -> Tensor:
    """Per-(row, depth) LK^λ [N, K], 0 where masked (`outside`: the draft space's, `_support`)."""
    _check(student_logits, mask, teacher_logits)
    return _unrows(_token_lk_lambda(_masked_support(student_logits, teacher_logits, mask, top_k, outside), eta), mask)


def lk_alpha_loss(student_logits: Tensor, teacher_logits: Tensor, mask: Tensor,
                  depth_weights: Sequence[float] | Tensor | None = None, top_k: int | None = None,
                  eps: float = 1e-6) -> Tensor:
    """Eq. 7: L^α_LK = −log(α(p, q) + ε), with Eq. 3's per-depth reduction. [N, K, V], mask [N, K] -> [].

    Its gradient is ∇TV / (α + ε) per token (Eq. 8): the TV direction, amplified where overlap is low.
    """
    return _depth_mean(_lk_alpha_values(student_logits, teacher_logits, mask, top_k, eps), mask, depth_weights)


def _lk_alpha_values(student_logits: Tensor, teacher_logits: Tensor, mask: Tensor, top_k: int | None,
                     eps: float) -> Tensor:
    """Per-(row, depth) LK^α [N, K], 0 where masked."""
    _check(student_logits, mask, teacher_logits)
    alpha = _alpha(_masked_support(student_logits, teacher_logits, mask, top_k))  # [N·K]
    return _unrows(-torch.log(alpha + eps), mask)


def e2e_tv_loss(student_logits: Tensor, teacher_logits: Tensor, mask: Tensor, top_k: int | None = None) -> Tensor:
    """Eq. 9: L_e2e = 1 − (1 / (|I|·D)) Σ_{i∈I} Σ_{m=0}^{D−1} Π_{k=0}^{m} α_{i,k}, with D = K.

    I is the set of positions valid at *all* K depths (rows of `mask` that are all True); a position valid
    at only some depths is left out entirely, since its prefix products are undefined past the gap. The
    per-depth weights w_k do not apply: the prefix products already weight shallow depths more. With I
    empty the loss is 0 (attached to the graph), not the formula's 1. [N, K, V] logits, mask [N, K] -> [].
    """
    return _e2e_tv_finish(_e2e_tv_sums(student_logits, teacher_logits, mask, top_k))


def _e2e_tv_sums(student_logits: Tensor, teacher_logits: Tensor, mask: Tensor, top_k: int | None) -> LossSums:
    """Eq. 9's row sums: Σ_{i∈I} (1 − mean_m Π_{k≤m} α_{i,k}) [1] and |I| [1]."""
    _check(student_logits, mask, teacher_logits)
    full = mask.all(-1)  # [N]
    alpha = _unrows(_alpha(_masked_support(student_logits, teacher_logits, mask, top_k)), mask)  # [N, K]
    survive = torch.cumprod(alpha, dim=1)  # [N, K] Π_{k≤m} α_{i,k}
    return LossSums(torch.where(full, 1.0 - survive.mean(1), 0.0).sum()[None], full.sum()[None])


def _e2e_tv_finish(sums: LossSums) -> Tensor:
    return sums.num[0] / _denominator(sums.den[0]).clamp_min(1).to(sums.num.dtype)


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
        s = torch.exp(-token_ce(_rows(_valid(student_logits, mask)), _valid(labels, mask).reshape(-1)))  # [N·K]
        s_tilde = torch.where(mask, ((1.0 - rho) * s + rho).reshape(mask.shape), 1.0)  # [N, K], 1 where invalid
        prefix = torch.cumprod(s_tilde, dim=1) * mask  # [N, K] Π_{r≤m} s̃_{i,r}, 0 where (i, m) invalid
        return prefix.flip(1).cumsum(1).flip(1) * mask  # [N, K] Σ_{m≥k}


def dpace_lk_loss(student_logits: Tensor, teacher_logits: Tensor, labels: Tensor, mask: Tensor,
                  top_k: int | None = None, eta: float = 3.0, rho: float = 0.5, eps: float = 1e-6) -> Tensor:
    """Eq. 18: L_cold = Σ_{k,i∈I_k} sg[w̄_{i,k}] L^λ_LK(p_{i,k}, q_{i,k}) / (Σ_{k,i∈I_k} sg[w̄_{i,k}] + ε).

    w̄ from `dpace_weights` (Eq. 16–17), L^λ_LK from Eq. 6. The D-PACE weights replace Eq. 3's w_k.
    [N, K, V] logits, labels [N, K], mask [N, K] -> [].
    """
    return _dpace_lk_finish(_dpace_lk_sums(student_logits, teacher_logits, labels, mask, top_k, eta, rho), eps)


def _dpace_lk_sums(student_logits: Tensor, teacher_logits: Tensor, labels: Tensor, mask: Tensor,
                   top_k: int | None, eta: float, rho: float, outside: bool = False) -> LossSums:
    """Eq. 18's row sums: Σ sg[w̄]·L^λ_LK [1] and Σ sg[w̄] [1] (w̄ is per row, over its depths only). In the draft
    space (`outside`) a label outside the draft vocabulary has s = q(y) = 0, so s̃ = ρ there."""
    _check(student_logits, mask, teacher_logits, labels)
    w = dpace_weights(student_logits, labels, mask, rho)  # [N, K], detached
    lk = _lk_lambda_values(student_logits, teacher_logits, mask, top_k, eta, outside)
    w = w.to(lk.dtype)
    return LossSums((w * lk).sum()[None], w.sum()[None])


def _dpace_lk_finish(sums: LossSums, eps: float) -> Tensor:
    return sums.num[0] / (_denominator(sums.den[0]) + eps)


def dspark_loss(student_logits: Tensor, teacher_logits: Tensor, labels: Tensor, mask: Tensor,
                confidence_logits: Tensor | None = None, config: LossConfig | None = None,
                confidence_targets: Tensor | None = None) -> LossOutput:
    """DSpark three-term loss: ce_coef·L_CE + tv_coef·L_TV + conf_coef·BCE(c, sg[1 − TV]), with `config`'s top_k,
    gamma, coefficients and tv_norm (`LossConfig`; None: the defaults).

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
    c = LossConfig() if config is None else config
    sums = _dspark_sums(student_logits, teacher_logits, labels, mask, confidence_logits, c.top_k, c.gamma, c.tv_norm,
                        confidence_targets)
    return _dspark_finish(sums, c.ce_coef, c.tv_coef, c.conf_coef)


def _dspark_sums(student_logits: Tensor, teacher_logits: Tensor, labels: Tensor, mask: Tensor,
                 confidence_logits: Tensor | None, top_k: int | None, gamma: float | None, tv_norm: str = "l1",
                 confidence_targets: Tensor | None = None, ce_mask: Tensor | None = None) -> LossSums:
    """The DSpark terms' row sums: Σ w·CE, Σ w·L_TV (and Σ w·BCE with a confidence head) [2|3], and Σ w [1].
    `ce_mask` (default `mask`): the rows the CE term covers (`_label_mask`)."""
    if tv_norm not in TV_NORMS:
        raise ValueError(f"unknown tv_norm {tv_norm!r}; choose one of {', '.join(TV_NORMS)}")
    _check(student_logits, mask, teacher_logits, labels)
    n, depth, _ = student_logits.shape
    if confidence_logits is not None and confidence_logits.shape[:2] != (n, depth):
        raise ValueError(f"confidence_logits must be [N, K] = [{n}, {depth}], got {tuple(confidence_logits.shape)}")
    ce = _ce_values(student_logits, labels, mask if ce_mask is None else ce_mask)  # [N, K]
    alpha = _unrows(_alpha(_masked_support(student_logits, teacher_logits, mask, top_k)), mask)  # [N, K]
    tv = (TV_NORMS[tv_norm] * (1.0 - alpha)) * mask  # ‖p − q‖₁ = 2·TV ("l1") or TV ("half_l1")
    w = dspark_position_weights(depth, gamma, dtype=ce.dtype, device=ce.device) * mask  # [N, K]
    terms = [(w * ce).sum(), (w * tv).sum()]
    if confidence_logits is not None:
        target = alpha.detach() if confidence_targets is None else confidence_targets  # [N, K(, n)] c* = 1 − TV
        terms.append((w * _masked_bce(confidence_logits, target, mask)).sum())
    return LossSums(torch.stack(terms), w.sum()[None])


def _dspark_finish(sums: LossSums, ce_coef: float, tv_coef: float, conf_coef: float) -> LossOutput:
    # 0 only when nothing is valid (then numerators are 0)
    denom = _denominator(sums.den[0]).clamp_min(torch.finfo(sums.den.dtype).tiny)
    ce_term = sums.num[0] / denom
    tv_term = sums.num[1] / denom
    loss = ce_coef * ce_term + tv_coef * tv_term
    parts = {"ce": ce_term.detach(), "tv": tv_term.detach()}
    if sums.num.shape[0] == 3:
        conf_term = sums.num[2] / denom
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


def _masked_bce(confidence_logits: Tensor, targets: Tensor, mask: Tensor) -> Tensor:
    """`confidence_bce` of every (row, depth): logits and targets [N, K] or [N, K, n] -> [N, K], 0 where masked."""
    n, k = mask.shape
    logits, targets = _valid(confidence_logits, mask), _valid(targets.detach(), mask)
    return _unrows(confidence_bce(logits.reshape(n * k, *logits.shape[2:]), targets.reshape(n * k, *targets.shape[2:])),
                   mask)


@torch.no_grad()
def acceptance_per_depth(student_logits: Tensor, teacher_logits: Tensor, mask: Tensor,
                         top_k: int | None = None) -> Tensor:
    """Mean α (Eq. 5) over the valid positions of each depth, for logging: [N, K, V], mask [N, K] -> [K]."""
    alpha_sum, count = _acceptance_sums(student_logits, teacher_logits, mask, top_k)
    return alpha_sum / count.clamp_min(1).to(alpha_sum.dtype)


@torch.no_grad()
def _acceptance_sums(student_logits: Tensor, teacher_logits: Tensor, mask: Tensor, top_k: int | None
                     ) -> tuple[Tensor, Tensor]:
    """Σ_{i∈I_k} α_{i,k} [K] and |I_k| [K]."""
    _check(student_logits, mask, teacher_logits)
    alpha = _unrows(_alpha(_masked_support(student_logits, teacher_logits, mask, top_k)), mask)  # [N, K]
    return alpha.sum(0), mask.sum(0)


# ---------------------------------------------------------------------------------------------------------
# Draft vocabulary: losses over V' columns plus one outside column (module docstring)
# ---------------------------------------------------------------------------------------------------------


def draft_space_teacher(teacher_logits: Tensor, draft_vocab: Tensor) -> Tensor:
    """The teacher in the draft space, detached: logits [..., V] -> log-probs [..., V' + 1]: log p at the ids of
    `draft_vocab` [V'] in its order, then the log of the mass outside them, 1 − Σ_{V'} p (≈ 0 for V' = V)."""
    t = teacher_logits.detach().to(_compute_dtype(teacher_logits))
    inside = t.index_select(-1, draft_vocab) - t.logsumexp(-1, keepdim=True)
    outside = torch.log((-torch.expm1(inside.logsumexp(-1, keepdim=True))).clamp_min(0))
    return torch.cat([inside, outside], -1)


def draft_space_student(student_logits: Tensor) -> Tensor:
    """The drafter in the draft space: logits over V' [..., V'] -> [..., V' + 1], −inf in the outside column."""
    return torch.cat([student_logits, student_logits.new_full((*student_logits.shape[:-1], 1), float("-inf"))], -1)


def draft_space_labels(labels: Tensor, draft_vocab: Tensor) -> Tensor:
    """Target ids [...] -> their index along `draft_vocab` [V'], V' (the outside column) for an id outside it."""
    ordered, order = draft_vocab.sort()
    at = torch.searchsorted(ordered, labels.contiguous()).clamp_max(ordered.numel() - 1)
    return torch.where(ordered[at] == labels, order[at], ordered.numel())


def to_draft_space(batch: LossBatch) -> LossBatch:
    """A batch whose student covers a draft vocabulary only (`LossBatch.draft_vocab`) in the draft space: student
    [N, K, V' + 1] (`draft_space_student`), teacher log-probs [N, K, V' + 1] on the valid rows (zeros elsewhere;
    `draft_space_teacher`), labels as indices along it (`draft_space_labels`). Any other batch as it is."""
    v = batch.draft_vocab
    if v is None:
        return batch
    if batch.student_logits.shape[-1] != v.numel():
        raise ValueError(f"student logits over {batch.student_logits.shape[-1]} ids for a draft vocabulary of "
                         f"{v.numel()}")
    teacher = batch.teacher_logits
    if teacher is not None:
        teacher = _valid(draft_space_teacher(_valid(teacher.detach(), batch.mask), v), batch.mask)  # [N, K, V' + 1]
    return replace(batch, student_logits=draft_space_student(batch.student_logits), teacher_logits=teacher,
                   labels=None if batch.labels is None else draft_space_labels(batch.labels, v),
                   draft_vocab=None, in_draft_space=True)


def _label_mask(batch: LossBatch) -> Tensor:
    """The rows a hard-label term (CE) covers: the valid ones, and in the draft space only those whose label lies
    in the draft vocabulary (q = 0 outside it: no finite CE)."""
    if not batch.in_draft_space:
        return batch.mask
    return batch.mask & (batch.labels != batch.student_logits.shape[-1] - 1)


# ---------------------------------------------------------------------------------------------------------
# Registry: one signature, selected by config
# ---------------------------------------------------------------------------------------------------------

LossFn = Callable[["LossBatch | ChunkedLossBatch", LossConfig], LossOutput]


def _need(batch: LossBatch, name: str, *fields: str) -> None:
    missing = [f for f in fields if getattr(batch, f) is None]
    if missing:
        raise ValueError(f"loss {name!r} needs {', '.join(missing)} in the LossBatch")


@dataclass(frozen=True)
class Objective:
    """A registered loss, split at its only cross-row step ("Chunks" in the module docstring): `sums` of a batch
    (or a chunk of its rows; sums of chunks add up) and `finish` from the total. Called on a `LossBatch` it is
    the plain function; on a `ChunkedLossBatch` it runs chunk by chunk (`ChunkedLossBatch.evaluate`)."""

    name: str
    needs: tuple[str, ...]  # LossBatch fields beyond the student logits and mask
    row_sums: Callable[[LossBatch, LossConfig], LossSums]
    finish: Callable[[LossSums, LossConfig], LossOutput]

    def sums(self, batch: LossBatch, config: LossConfig) -> LossSums:
        _need(batch, self.name, *self.needs)
        return self.row_sums(to_draft_space(batch), config)

    def __call__(self, batch: LossBatch | ChunkedLossBatch, config: LossConfig) -> LossOutput:
        if isinstance(batch, ChunkedLossBatch):
            return batch.evaluate(self, config)
        return self.finish(self.sums(batch, config), config)


def _depth_objective(name: str, needs: tuple[str, ...], values: Callable[[LossBatch, LossConfig], Tensor],
                     rows: Callable[[LossBatch], Tensor] = lambda b: b.mask) -> Objective:
    """A loss of Eq. 3's form: per-(row, depth) `values` [N, K] reduced by `_depth_mean` over the `rows` [N, K]."""
    return Objective(name, needs, lambda b, c: _depth_sums(values(b, c), rows(b)),
                     lambda s, c: LossOutput(_depth_finish(s, c.depth_weights), {}))


# No drafter loss: `with_confidence_term(NO_LOSS, coef)` is the confidence term alone (a confidence-only run).
NO_LOSS = Objective("none", (), lambda b, c: LossSums(b.student_logits.new_zeros(0), b.student_logits.new_zeros(0)),
                    lambda s, c: LossOutput(s.num.sum(), {}))


def with_confidence_term(objective: Objective, coef: float) -> Objective:
    """`objective` + coef · Σ_valid BCE(c, sg[target]) / |valid| for a drafter's confidence head: the batch's
    `confidence_targets` when given (a "protocol" head's, [N, K, n] with logits [N, K, n], the BCE averaged over
    the n outputs; `train.confidence`), else the detached acceptance α of the same position (Eq. 5). One more
    numerator and count in the row sums, so the sum chunks like any objective. Needs `confidence_logits` and the
    teacher."""

    def row_sums(b: LossBatch, c: LossConfig) -> LossSums:
        s = objective.sums(b, c)
        if b.confidence_targets is not None:
            target = b.confidence_targets  # [N, K] or [N, K, n]
        else:
            with torch.no_grad():
                target = _unrows(_alpha(_masked_support(b.student_logits, b.teacher_logits, b.mask, c.top_k)),
                                 b.mask)  # [N, K]
        bce = _masked_bce(b.confidence_logits, target, b.mask).sum()
        return LossSums(torch.cat([s.num, bce[None].to(s.num.dtype)]),
                        torch.cat([s.den, b.mask.sum()[None].to(s.den.dtype)]))

    def finish(s: LossSums, c: LossConfig) -> LossOutput:
        out = objective.finish(LossSums(s.num[:-1], s.den[:-1]), c)
        conf = s.num[-1] / _denominator(s.den[-1]).clamp_min(1)
        return LossOutput(out.loss + coef * conf, {**out.parts, "conf": conf.detach()})

    return Objective(f"{objective.name}+confidence", (*objective.needs, "teacher_logits", "confidence_logits"),
                     row_sums, finish)


LOSSES: dict[str, Objective] = {
    "ce": _depth_objective("ce", ("labels",), lambda b, c: _ce_values(b.student_logits, b.labels, _label_mask(b)),
                           _label_mask),
    "kl": _depth_objective("kl", ("teacher_logits",),
                           lambda b, c: _kl_values(b.student_logits, b.teacher_logits, b.mask, c.top_k,
                                                   b.in_draft_space)),
    "tv": _depth_objective("tv", ("teacher_logits",),
                           lambda b, c: _tv_values(b.student_logits, b.teacher_logits, b.mask, c.top_k)),
    "lk_lambda": _depth_objective(
        "lk_lambda", ("teacher_logits",),
        lambda b, c: _lk_lambda_values(b.student_logits, b.teacher_logits, b.mask, c.top_k, c.eta,
                                       b.in_draft_space)),
    "lk_alpha": _depth_objective(
        "lk_alpha", ("teacher_logits",),
        lambda b, c: _lk_alpha_values(b.student_logits, b.teacher_logits, b.mask, c.top_k, c.eps)),
    "e2e_tv": Objective("e2e_tv", ("teacher_logits",),
                        lambda b, c: _e2e_tv_sums(b.student_logits, b.teacher_logits, b.mask, c.top_k),
                        lambda s, c: LossOutput(_e2e_tv_finish(s), {})),
    "dpace_lk": Objective("dpace_lk", ("teacher_logits", "labels"),
                          lambda b, c: _dpace_lk_sums(b.student_logits, b.teacher_logits, b.labels, b.mask, c.top_k,
                                                      c.eta, c.rho, b.in_draft_space),
                          lambda s, c: LossOutput(_dpace_lk_finish(s, c.eps), {})),
    "dspark": Objective("dspark", ("teacher_logits", "labels"),
                        lambda b, c: _dspark_sums(b.student_logits, b.teacher_logits, b.labels, b.mask,
                                                  b.confidence_logits, c.top_k, c.gamma, c.tv_norm,
                                                  b.confidence_targets,
                                                  _label_mask(b) if b.in_draft_space else None),
                        lambda s, c: _dspark_finish(s, c.ce_coef, c.tv_coef, c.conf_coef)),
}


def get_loss(name: str) -> Objective:
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

    def loss(self, step: int, batch: LossBatch | ChunkedLossBatch) -> LossOutput:
        return LOSSES[self.name_at(step)](batch, self.config)


# ---------------------------------------------------------------------------------------------------------
# Chunks: the LM head and the loss over a few rows at a time
# ---------------------------------------------------------------------------------------------------------


# fp32 [rows, K, V] buffers one loss chunk holds at its peak (student and teacher logits, their softmaxes and the
# gradients of the backward's recompute): turns a memory budget into logits per chunk. benchmarks/teacher_memory.py
# measures the peak of a chunk against this.
CHUNK_BUFFERS = 12
# Logits per chunk where the device reports no memory size (the host): 32 MiB per fp32 buffer (1,024 rows of the
# embedded target's 8k vocabulary at one depth; 55 rows at 152k), what CPU training has always used.
HOST_MAX_LOGITS = 1 << 23
DEVICE_MEMORY_FRACTION = 1 / 8  # of a GPU's memory for one chunk's transient buffers


def loss_chunk_logits(device: torch.device | str, fraction: float = DEVICE_MEMORY_FRACTION) -> int:
    """Logits per loss chunk (`ChunkedLossBatch.rows_for`'s budget) for training on `device`: on a CUDA device
    `fraction` of its memory over the `CHUNK_BUFFERS` fp32 buffers a chunk holds at its peak, elsewhere
    `HOST_MAX_LOGITS`. From the device's total memory, not what is free at the moment, so that a run (and its
    resume) splits every step into the same chunks: the losses do not depend on what else the device holds."""
    device = torch.device(device)
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        return max(1 << 20, int(total * fraction) // (4 * CHUNK_BUFFERS))
    return HOST_MAX_LOGITS


@dataclass(frozen=True)
class TeacherHead:
    """The frozen target's teacher without its [B, T, V] logits: the target's final-norm states and the LM head that
    turns them into logits. The trainers' loss chunks (`ChunkedLossBatch.teacher`) apply the head to the few rows a
    chunk needs, so a step holds [B, T, C] states instead of [B, T, V] fp32 logits (at C = 4096, V = 152k: 37x
    less); the head runs again in the chunk's recompute for the backward. `logits` is the target's own head
    (`Decoder.head_logits`), so the values are the ones its forward gives, up to the matmul's summation order."""

    states: Tensor  # [B, T, C] final-norm states of the target, detached
    head: Callable[[Tensor], Tensor]  # [..., C] -> fp32 logits [..., V]
    vocab_size: int

    @property
    def shape(self) -> tuple[int, int, int]:
        """[B, T, V]: the shape of the logits it stands for."""
        return (*self.states.shape[:2], self.vocab_size)

    @property
    def device(self) -> torch.device:
        return self.states.device

    def logits(self, states: Tensor) -> Tensor:
        """Teacher logits of some of its states [..., C] -> fp32 [..., V], no gradient (the target is frozen)."""
        with torch.no_grad():
            return self.head(states.detach()).float()

    def full(self) -> Tensor:
        """All [B, T, V] logits at once: the reference (and what the trainers held before chunking)."""
        return self.logits(self.states)

    def map_positions(self, fn: Callable[[Tensor], Tensor], max_logits: int) -> Tensor:
        """`fn` (no gradient) of every position's logits [n, V] -> [n, W], a chunk of positions of at most
        `max_logits` logits at a time -> [B, T, W]: e.g. the draft space's teacher, V' + 1 wide, without the V one."""
        B, T, _ = self.shape
        flat = self.states.reshape(B * T, -1)
        with torch.no_grad():
            parts = [fn(self.logits(c)) for c in flat.split(max(1, max_logits // self.vocab_size))]
        return torch.cat(parts).view(B, T, -1)


Teacher = Tensor | TeacherHead  # a trainer's teacher: [B, T, V] logits, or the states and head that make them


def teacher_logits(teacher: Teacher) -> Tensor:
    """The [B, T, V] logits of a `Teacher` (all of them: for references and small batches)."""
    return teacher.full() if isinstance(teacher, TeacherHead) else teacher


@dataclass(frozen=True)
class ChunkedLossBatch:
    """A `LossBatch` whose [N, K, V] student logits (and teacher logits) are never held whole.

    It holds the student's states before the LM head, K × [N, C], and a `head` that maps a chunk of them to
    logits. `Objective.__call__` then runs `evaluate`: per chunk of `chunk_rows` rows, logits -> the loss's row
    sums, each chunk under `torch.utils.checkpoint` (autograd keeps only the chunk's [n, C] inputs; its logits
    are recomputed in the backward), and `finish` on the summed row sums. Loss and gradients equal the
    `LossBatch` path up to summation order (tested). Transient memory: one chunk's [chunk_rows, K, V] logits
    and the loss's buffers of the same size, in the forward and again in the backward."""

    hidden: tuple[Tensor, ...]  # K × [N, C] (views are fine), the student's states at each depth / block position
    head: Callable[[Tensor, slice], Tensor]  # (states [n, K, C], the rows) -> fp32 logits [n, K, V] ([.., V'])
    mask: Tensor  # [N, K] bool
    chunk_rows: int  # rows per chunk
    teacher: Callable[[slice], Tensor] | None = None  # the rows -> teacher logits [n, K, V]
    labels: Tensor | None = None  # [N, K]
    confidence_logits: Tensor | None = None  # [N, K], or [N, K, n] for a "protocol" head
    # The confidence head's targets (None: α, see `LossBatch`): [N, K(, n)], or a chunk's `LossBatch` -> its targets
    # (`train.confidence.confidence_targets` of the chunk's logits, which exist only inside the chunk).
    confidence_targets: Tensor | Callable[[LossBatch], Tensor] | None = None
    checkpoint: bool = True  # False: keep every chunk's graph (same values; memory of the LossBatch path)
    draft_vocab: Tensor | None = None  # [V']: `head` scores only these target ids (`LossBatch.draft_vocab`)
    # With draft_vocab: `teacher` gives the draft space's teacher [n, K, V' + 1] (`draft_space_teacher`, computed by
    # the caller once per position rather than per chunk, depth and recompute), so each chunk's batch is built in the
    # draft space directly (the confidence targets, if any, then see that batch).
    draft_teacher: bool = False
    track_alpha: bool = False  # also log the mean α per depth (parts["alpha_per_depth"], needs a teacher)

    def __post_init__(self) -> None:
        if self.chunk_rows < 1:
            raise ValueError(f"chunk_rows must be >= 1, got {self.chunk_rows}")
        if len(self.hidden) != self.mask.shape[1]:
            raise ValueError(f"{len(self.hidden)} state tensors for a mask of {self.mask.shape[1]} depths")
        if self.draft_teacher and self.draft_vocab is None:
            raise ValueError("draft_teacher needs the draft_vocab the teacher was restricted to")

    @staticmethod
    def rows_for(max_logits: int, depths: int, vocab: int) -> int:
        """Rows per chunk so that a chunk's logits hold at most `max_logits` values (at least one row)."""
        return max(1, max_logits // max(1, depths * vocab))

    def chunk(self, rows: slice, states: Sequence[Tensor], confidence_logits: Tensor | None) -> LossBatch:
        """The `LossBatch` of `rows`: states K × [n, C] (slices of `hidden`) through the head."""
        logits = self.head(torch.stack(list(states), dim=1), rows)
        labels = None if self.labels is None else self.labels[rows]
        lb = LossBatch(student_logits=logits, mask=self.mask[rows],
                       teacher_logits=None if self.teacher is None else self.teacher(rows), labels=labels,
                       confidence_logits=confidence_logits, draft_vocab=self.draft_vocab)
        if self.draft_teacher and self.draft_vocab is not None:  # the teacher is in the draft space already
            lb = replace(lb, student_logits=draft_space_student(logits), draft_vocab=None, in_draft_space=True,
                         labels=None if labels is None else draft_space_labels(labels, self.draft_vocab))
        targets = self.confidence_targets
        if targets is None or confidence_logits is None:
            return lb
        with torch.no_grad():
            targets = targets[rows] if isinstance(targets, Tensor) else targets(lb)
        return replace(lb, confidence_targets=targets)

    def evaluate(self, objective: Objective, config: LossConfig) -> LossOutput:
        """`objective` over all rows, chunk by chunk (class docstring)."""
        record = [self.track_alpha and self.teacher is not None]  # α only in the forward, not in recomputes
        alpha: list[tuple[Tensor, Tensor]] = []

        def run(r0: int, r1: int, confidence_logits: Tensor | None, *states: Tensor) -> tuple[Tensor, Tensor]:
            lb = to_draft_space(self.chunk(slice(r0, r1), states, confidence_logits))
            if record[0]:
                alpha.append(_acceptance_sums(lb.student_logits.detach(), lb.teacher_logits, lb.mask, config.top_k))
            s = objective.sums(lb, config)
            return s.num, s.den

        total: LossSums | None = None
        for r0 in range(0, self.mask.shape[0], self.chunk_rows):
            r1 = min(r0 + self.chunk_rows, self.mask.shape[0])
            conf = None if self.confidence_logits is None else self.confidence_logits[r0:r1]
            args = (r0, r1, conf, *(h[r0:r1] for h in self.hidden))
            if self.checkpoint and torch.is_grad_enabled():
                num, den = checkpoint(run, *args, use_reentrant=False)
            else:
                num, den = run(*args)
            total = LossSums(num, den) if total is None else LossSums(total.num + num, total.den + den)
        record[0] = False
        if total is None:
            raise ValueError("a ChunkedLossBatch needs at least one row")
        out = objective.finish(total, config)
        if alpha:
            a_sum = torch.stack([a for a, _ in alpha]).sum(0)
            count = torch.stack([c for _, c in alpha]).sum(0)
            out.parts["alpha_per_depth"] = a_sum / count.clamp_min(1).to(a_sum.dtype)
        return out

