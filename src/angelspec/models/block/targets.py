"""Training-time helpers of the block drafters: the anchors of a packed row (`sample_anchors`) and the
teacher-forcing inputs and labels of their draft positions (`block_targets` -> `BlockTargets`).

Shape legend: R packed rows, T time, N anchors per row, B block size, K = B−1 draft positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class BlockTargets:
    """Teacher-forcing inputs and supervision of the K = B−1 draft positions of every anchor.

    Draft k (1..K) of anchor a predicts x_{a+k}; its predecessor is x_{a+k−1}; the target's teacher distribution
    for it is the target's logits at position a+k−1 (`source_index`)."""

    labels: Tensor  # [R, N, K] int64, x_{a+k} (clamped index where invalid)
    prev_tokens: Tensor  # [R, N, K] int64, x_{a+k−1}: the teacher-forced predecessor
    source_index: Tensor  # [R, N, K] int64, a+k−1: where to gather the target's (teacher) logits
    valid: Tensor  # [R, N, K] bool, inside the row, in the anchor's document, trained on, anchor valid


def block_targets(input_ids: Tensor, anchors: Tensor, block_size: int, *, document_ids: Tensor | None = None,
                  loss_mask: Tensor | None = None, anchor_valid: Tensor | None = None) -> BlockTargets:
    """input_ids [R, T], anchors [R, N] -> `BlockTargets`. A label is valid when a+k < T, it lies in the anchor's
    document (never across a packed document end) and `loss_mask` [R, T] (if given) trains on it."""
    R, T = input_ids.shape
    k = torch.arange(1, block_size, device=anchors.device)
    idx = anchors[..., None] + k  # [R, N, K]
    valid = idx < T
    idx_c = idx.clamp(max=T - 1)
    flat = idx_c.flatten(1)  # [R, N·K]
    labels = input_ids.gather(1, flat).view_as(idx)
    src = (idx - 1).clamp(max=T - 1)
    prev = input_ids.gather(1, src.flatten(1)).view_as(idx)
    if document_ids is not None:
        a_doc = document_ids.gather(1, anchors)[..., None]  # [R, N, 1]
        valid = valid & (document_ids.gather(1, flat).view_as(idx) == a_doc)
    if loss_mask is not None:
        valid = valid & loss_mask.bool().gather(1, flat).view_as(idx)
    if anchor_valid is not None:
        valid = valid & anchor_valid[..., None]
    return BlockTargets(labels=labels, prev_tokens=prev, source_index=src, valid=valid)


def sample_anchors(loss_mask: Tensor, num_anchors: int, *, document_ids: Tensor | None = None,
                   generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
    """Pick up to `num_anchors` distinct anchors per row, uniformly among positions a whose first draft x_{a+1}
    is trained on and in a's document. loss_mask [R, T] -> (anchors [R, N] sorted, anchor_valid [R, N]); rows
    with fewer candidates repeat a candidate (or 0) marked invalid."""
    R, T = loss_mask.shape
    cand = torch.zeros(R, T, dtype=torch.bool, device=loss_mask.device)
    cand[:, :-1] = loss_mask[:, 1:].bool()
    if document_ids is not None:
        cand[:, :-1] &= document_ids[:, 1:] == document_ids[:, :-1]
    score = torch.rand(R, T, generator=generator, device=loss_mask.device)
    score = torch.where(cand, score, -1.0)
    n = min(num_anchors, T)
    top, idx = score.topk(n, dim=1)  # [R, N]
    valid = top >= 0
    order = torch.where(valid, idx, T + idx).argsort(dim=1)  # valid anchors first, ascending
    return idx.gather(1, order), valid.gather(1, order)
