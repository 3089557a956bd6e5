"""The end-of-step bookkeeping every trainer loop shares: gradient clipping under any parallelism, the JSONL
log line, the per-depth acceptance reduction across ranks, and the checkpoint / time-budget decision."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from angelspec.train.distributed import DistInfo, all_reduce_scalars, any_rank, clip_grad_norm


def clip_gradients(parameters: Iterable[nn.Parameter], max_norm: float, strategy: str) -> Tensor:
    """Clip to `max_norm` and return the total norm before clipping; FSDP2's sharded gradients need the
    gathered norm (`distributed.clip_grad_norm`), everything else uses torch's own."""
    if strategy == "fsdp2":
        return clip_grad_norm(parameters, max_norm)
    return torch.nn.utils.clip_grad_norm_(parameters, max_norm)


def reduce_depth_stats(mean_loss: float, tokens: int, alpha: Tensor, info: DistInfo
                       ) -> tuple[float, int, list[float]]:
    """Logged loss, token count and per-depth acceptance over all ranks: loss shares and tokens add up over
    ranks; α is the mean of the ranks' means (one sync per log interval)."""
    alpha_list = alpha.tolist()
    if info.enabled:
        summed = all_reduce_scalars({"loss": mean_loss, "tokens": tokens}, "sum")
        mean_loss, tokens = summed["loss"], int(summed["tokens"])
        averaged = all_reduce_scalars({str(k): a for k, a in enumerate(alpha_list)}, "mean")
        alpha_list = [averaged[str(k)] for k in range(len(alpha_list))]
    return mean_loss, tokens, alpha_list


def append_log(path: Path, record: dict[str, Any], is_main: bool) -> None:
    """One JSON line per log interval, written by the main rank only."""
    if is_main:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")


def checkpoint_or_stop(step: int, steps: int, ckpt_every: int, save: Callable[[int], None],
                       deadline: float | None, log: Callable[[str], None]) -> bool:
    """Save on the checkpoint interval and at the end; return True (after saving) when the time budget ran
    out on any rank before the last step, so every rank stops at the same step."""
    if step % ckpt_every == 0 or step == steps:
        save(step)
    if deadline is not None and any_rank(time.time() > deadline) and step < steps:
        save(step)
        log(f"time budget reached at step {step}/{steps}; resume with --resume")
        return True
    return False
