"""The resumable causal-LM training loop shared by the embedded target build and the draft-LM baseline, and
their held-out loss.

Plain next-token cross-entropy on packed rows, AdamW, warm-up + cosine schedule, gradient clipping,
JSONL logs once per `log_every` steps, atomic checkpoints every `ckpt_every` steps. Resuming restores
the weights, the optimizer state and the step; the data order is a pure function of (seed, step), so a
resumed run follows the same loss curve as an uninterrupted one (tested bit for bit).

Data parallelism (`train.distributed`, opt-in by the caller): DDP or FSDP2 over the model, each rank takes its
slice of the global batch. Every row holds `seq_len` supervised tokens, so each rank's mean loss has the same
denominator and the averaged gradient is the single-process one (up to reduction order). Rank 0 alone
writes checkpoints, logs and the progress bar.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from angelspec.data.lm_data import PackedStream, TokenizedDomain
from angelspec.models.decoder import Decoder
from angelspec.models.device import autocast
from angelspec.models.hf_io import load_target, save_target
from angelspec.train.checkpoint import make_checkpoint_saver, resume_training, run_identity
from angelspec.train.config import LMRunConfig
from angelspec.train.distributed import (
    DistInfo,
    Strategy,
    all_reduce_scalars,
    barrier,
    load_full_state_dict,
    shard_rows,
    whole_copy,
    wrap_model,
)
from angelspec.train.loop import append_log, checkpoint_or_stop, clip_gradients, trim_log
from angelspec.train.optim import build_adamw, cosine_lr, set_lr
from angelspec.train.safety import stop_if_not_finite


@dataclass(frozen=True)
class LMRun:
    """Where a causal-LM run keeps its checkpoints (`ckpt_dir`) and its JSONL log (`log_path`), whether it
    `resume`s from them, its progress bar (`progress`, labelled `desc`) and log lines (`log`), the time budget
    (`max_minutes`: stop early at a checkpoint so the caller can export what exists and resume later), and its data
    parallelism (`strategy` / `dist_info`, module docstring: the caller has run `init_distributed` and guards its own
    writes by `dist_info.is_main`)."""

    ckpt_dir: Path
    log_path: Path
    resume: bool = False
    progress: bool = True
    max_minutes: float | None = None
    desc: str = "train"
    log: Callable[[str], None] = print
    strategy: Strategy = "none"
    dist_info: DistInfo | None = None


def train_causal_lm(model: Decoder, stream: PackedStream, cfg: LMRunConfig, run: LMRun, *,
                    save_model: Callable[[Decoder, Path], Any] = save_target, inputs: dict[str, Any] | None = None,
                    autocast_dtype: torch.dtype | None = None) -> int:
    """Train `model` in place as `run` says (`LMRun`: folders, resume, progress, time budget, data parallelism) and
    return the last step reached.

    The batches go to the model's device; the forward runs under autocast to bfloat16 when `cfg.bf16`, else to
    `autocast_dtype` when that is a 16-bit float (a drafter beside a bf16 target), with fp32 master weights.
    Under FSDP2 the model's parameters end as DTensor shards: get whole weights with
    `train.distributed.whole_copy`. `inputs`: what the checkpoint records of the run's inputs, and a resume must
    match (`train.loop.run_inputs`).
    """
    ckpt_dir, log_path, log, strategy = run.ckpt_dir, run.log_path, run.log, run.strategy
    info = run.dist_info or DistInfo()
    main = info.is_main
    wrapped = wrap_model(model, strategy, info)  # after the model is built; the optimizer after this
    opt = build_adamw(model, cfg.lr, cfg.weight_decay)
    settings = {"train_config": run_identity(cfg), **(inputs or {})}
    step, _ = resume_training(ckpt_dir, run.resume, settings,
                              lambda c: load_full_state_dict(model, load_target(c).state_dict()),
                              opt, log, model=model)
    trim_log(log_path, step, main)

    save = make_checkpoint_saver(ckpt_dir, lambda: whole_copy(model, lambda: Decoder(model.config)), save_model,
                                 settings, opt, is_main=main, barrier=barrier, model=model)

    deadline = None if run.max_minutes is None else time.time() + 60 * run.max_minutes
    device = model.embed_tokens.weight.device
    precision = torch.bfloat16 if cfg.bf16 else (autocast_dtype or torch.float32)
    model.train()
    bar = tqdm(total=cfg.steps, initial=step, desc=run.desc, disable=not (run.progress and main), unit="step")
    last_log, tok_seen = time.time(), 0
    losses: list[float] = []
    tokens_per_step = cfg.batch_size * cfg.seq_len
    while step < cfg.steps:
        batch = stream.batch(step, cfg.batch_size)  # [B, seq_len + 1]
        if info.enabled:
            batch = batch[shard_rows(range(batch.shape[0]), info)]  # [B / world, seq_len + 1]
        batch = batch.to(device)
        lr = cosine_lr(step, base_lr=cfg.lr, warmup=cfg.warmup, total=cfg.steps, min_ratio=cfg.min_lr_ratio)
        set_lr(opt, lr)
        with autocast(device, precision):
            logits = wrapped(batch[:, :-1]).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = clip_gradients(model.parameters(), cfg.grad_clip, strategy)
        # host sync: once per step, for the log and the non-finite guard (before the weights take the step)
        losses.append(stop_if_not_finite(loss, gnorm, step + 1, lr, ckpt_dir=ckpt_dir, distributed=info.enabled))
        opt.step()
        step += 1
        tok_seen += tokens_per_step
        bar.update(1)
        if step % cfg.log_every == 0 or step == cfg.steps:
            now = time.time()
            mean_loss = sum(losses) / len(losses)
            if info.enabled:  # equal token counts per rank: the mean of the ranks' means is the global mean
                mean_loss = all_reduce_scalars({"loss": mean_loss}, "mean")["loss"]
            rec = {"step": step, "loss": mean_loss, "lr": lr, "grad_norm": float(gnorm),
                   "tokens_per_s": tok_seen / max(now - last_log, 1e-9)}
            bar.set_postfix(loss=f"{rec['loss']:.3f}", tps=f"{rec['tokens_per_s']:.0f}")
            append_log(log_path, rec, main)
            losses, last_log, tok_seen = [], now, 0
        if checkpoint_or_stop(step, cfg.steps, cfg.ckpt_every, save, deadline, log):
            break
    bar.close()
    model.eval()
    return step


@torch.no_grad()
def heldout_loss(model: Decoder, dom: TokenizedDomain, max_docs: int, context: int, bf16: bool) -> float:
    """Mean next-token loss over whole held-out documents (each from position 0, no packing)."""
    total, count = 0.0, 0
    n = min(max_docs, len(dom.offsets) - 1)
    for i in range(n):
        ids = torch.from_numpy(dom.tokens[dom.offsets[i]: dom.offsets[i + 1]][:context].astype(np.int64))[None]
        if ids.shape[1] < 2:
            continue
        ids = ids.to(model.embed_tokens.weight.device)
        with autocast(ids.device, torch.bfloat16 if bf16 else torch.float32):
            logits = model(ids[:, :-1]).logits
        loss = F.cross_entropy(logits[0].float(), ids[0, 1:], reduction="sum")
        total += float(loss)
        count += ids.shape[1] - 1
    return total / max(count, 1)
