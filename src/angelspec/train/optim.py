"""Optimizer and learning-rate schedule shared by every trainer."""

from __future__ import annotations

import math

import torch
from torch import nn


def build_adamw(model: nn.Module, lr: float, weight_decay: float, betas: tuple[float, float] = (0.9, 0.95)
                ) -> torch.optim.AdamW:
    """AdamW with decay on matrices only (norm weights, biases and embeddings are not decayed)."""
    decay, no_decay = [], []
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        (decay if p.dim() >= 2 and "embed" not in name else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=betas, foreach=True)


def cosine_lr(step: int, *, base_lr: float, warmup: int, total: int, min_ratio: float = 0.1) -> float:
    """Linear warm-up to `base_lr`, then cosine decay to `min_ratio * base_lr` at `total`."""
    if step < warmup:
        return base_lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return base_lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
