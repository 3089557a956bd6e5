"""What every trainer shares: the run set-up (process group, strategy, output folder, rank-0 logging, the frozen
target), the end-of-step bookkeeping (gradient clipping under any parallelism, the JSONL log line, the per-depth
acceptance reduction across ranks, the checkpoint / time-budget decision), the drafter trainers' resumable step
loop with its checkpoints, and the closing report (`TrainRun.finish`, `TrainRun.drafter_report`)."""

from __future__ import annotations

import errno
import json
import os
import time
from collections.abc import Callable, Iterable
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file
from torch import Tensor, nn
from tqdm.auto import tqdm

from angelspec.data.packing import PackedBatch
from angelspec.errors import SettingError, UsageError
from angelspec.fileio import check_writable_path, replace_atomic
from angelspec.models.config import DecoderConfig
from angelspec.models.decoder import Decoder
from angelspec.models.device import Placement, autocast, enable_tf32, placement_of
from angelspec.models.hf_io import load_target, write_json_atomic
from angelspec.train.checkpoint import (
    make_checkpoint_saver,
    refuse_resume_over_model,
    resume_training,
    run_identity,
)
from angelspec.train.config import DrafterRunConfig, TrainJob
from angelspec.train.data import PackedRows
from angelspec.train.distributed import (
    DistInfo,
    Strategy,
    all_reduce_scalars,
    any_rank,
    barrier,
    clip_grad_norm,
    global_sum,
    init_distributed,
    load_full_state_dict,
    rank_device,
    resolve_strategy,
    whole_copy,
)
from angelspec.train.losses import (
    ChunkedLossBatch,
    LossBatch,
    LossOutput,
    LossSchedule,
    Objective,
    acceptance_per_depth,
    global_denominators,
)
from angelspec.train.optim import cosine_lr, set_lr
from angelspec.train.safety import (
    TRAIN_LOG,
    empty_folder,
    refuse_foreign_files,
    stop_if_not_finite,
    unfinished_run,
)
from angelspec.train.sequence_parallel import SequenceParallel, init_sequence_parallel

if TYPE_CHECKING:
    from angelspec.train.features import TargetFeatures


def silent(*_: Any) -> None:
    """The log function of ranks other than 0."""


# ----- run set-up and close -----


@dataclass(frozen=True)
class TrainRun:
    """A trainer's call (`job`), process-group view and folders: `out_dir` gets the model, `work` the log and
    checkpoints. `placement`: this rank's device and the target's dtype; the drafter keeps fp32 master weights there
    and its forward runs under `autocast()` (bf16 / fp16 matmuls when the target's dtype is 16-bit)."""

    job: TrainJob
    info: DistInfo
    strategy: Strategy
    log: Callable[[str], None]  # `silent` on ranks other than 0
    t0: float
    sp: SequenceParallel = SequenceParallel()  # the sequence-parallel group (size 1: none)
    # Training seconds of the segments before this one (a resumed run: what its checkpoint recorded).
    seconds_before: list[float] = field(default_factory=lambda: [0.0])
    placement: Placement = Placement(torch.device("cpu"), torch.float32)
    _weights_ids: dict[int, str] = field(default_factory=dict, repr=False)  # `target_weights`, per target object

    @property
    def device(self) -> torch.device:
        return self.placement.device

    def autocast(self) -> Any:
        """The drafter forward's precision context: autocast to the target's dtype when it is 16-bit."""
        return autocast(self.placement.device, self.placement.dtype)

    def train_seconds(self) -> float:
        """The run's training wall time so far, across resumed segments: the checkpoint's record plus this
        process's time since `t0`."""
        return self.seconds_before[0] + time.time() - self.t0

    @property
    def main(self) -> bool:
        return self.info.is_main

    @property
    def target_dir(self) -> Path:
        return self.job.target_dir

    @property
    def out_dir(self) -> Path:
        return self.job.out_dir

    @property
    def work(self) -> Path:
        return self.out_dir / "training"  # as `check_out_dir`

    @property
    def ckpt_dir(self) -> Path:
        return self.work / "checkpoint"

    def clear_out_dir(self) -> None:
        """`force` without `resume`: rank 0 empties the old output folder (all but the run's lock), once every rank
        has looked at it."""
        barrier()
        if self.main and self.job.force and not self.job.resume and self.out_dir.exists():
            empty_folder(self.out_dir)  # all but the run's lock (`train.safety.run_guard`)
        barrier()

    def frozen_target(self, features: str | None = None) -> tuple[Decoder, Any]:
        """The run's target on this rank's device in the run's dtype, every parameter frozen, and its tokenizer.
        `features`: the run's `features=` (an offline cache or a stream): the hidden states come from there, so only
        the embedding, final norm and LM head are loaded (`load_target(parts="head")`; the layers stay on meta)."""
        from angelspec.data.tokenizer import load_tokenizer

        target = load_target(self.target_dir, dtype=self.placement.dtype, device=self.placement.device,
                             parts="all" if features is None else "head")
        for p in target.parameters():
            p.requires_grad_(False)
        return target, load_tokenizer(self.target_dir)

    def target_weights(self, target: Decoder) -> str:
        """The target's `target_weights_fingerprint` (what the drafter records and a resume compares), also for a
        `parts="head"` load: its layers, left on meta, are read from the checkpoint one tensor at a time (once)."""
        from angelspec.decoding.loading import target_weights_id

        if id(target) not in self._weights_ids:
            self._weights_ids[id(target)] = target_weights_id(self.target_dir, target)
        return self._weights_ids[id(target)]

    def drafter_report(self, head: dict[str, Any], model: nn.Module, stats: dict[str, int], rows: PackedRows,
                       tcfg: DecoderConfig, features: TargetFeatures) -> dict[str, Any]:
        """A drafter trainer's report: `head` (kind, steps, design), then the parameter count, the data counts
        and packing, the training time, the target and where the features came from."""
        return {**head, "parameters": sum(p.numel() for p in model.parameters()), **stats,
                "packing_efficiency": round(rows.packed.efficiency, 4),
                "train_seconds": round(self.train_seconds(), 1), "target": str(self.target_dir),
                "target_fingerprint": tcfg.fingerprint(), "features": features.source}

    def finish(self, report: dict[str, Any], write_model: Callable[[], None] | None = None) -> dict[str, Any]:
        """Add the parallelism to `report`; rank 0 writes the model (`write_model()`) and `train_report.json`;
        all ranks meet. The caller drops its DDP / FSDP2 wrapper and calls `shutdown` after this."""
        if self.info.enabled:
            report.update(distributed=self.strategy, world_size=self.info.world_size)
        if self.sp.enabled:
            report.update(sequence_parallel=self.sp.size)
        if self.main:
            if write_model is not None:
                write_model()
            write_json_atomic(self.out_dir / "train_report.json", report)
        barrier()
        return report


def start_run(job: TrainJob, *, batch_size: int, seq_len: int | None = None,
              error: type[Exception] = ValueError) -> TrainRun:
    """Join the process group, resolve `job.parallel.distributed` and check, before anything is loaded or written,
    that the global `batch_size` divides over the data-parallel ranks (else `error`) and that `job.out_dir` may be
    written (`check_out_dir`). `seq_len`: the row length a sequence-parallel run (`job.parallel.sp` > 1) shards,
    which must divide by the group size; None: the trainer has no sequence parallelism and refuses sp > 1."""
    sp_size = job.parallel.sp
    if sp_size != 1 and seq_len is None:
        raise SettingError(f"{{sp}} {sp_size}: sequence parallelism trains the MTP family and the block drafters, "
                           "not this model; drop {sp}")
    info = init_distributed()
    strategy = resolve_strategy(job.parallel.distributed, info)
    sp = init_sequence_parallel(sp_size, info, strategy)
    if seq_len is not None and sp.enabled:
        sp.bounds(seq_len)
    dp = sp.dp.world_size
    if batch_size % dp:
        raise error(f"batch_size={batch_size} is the global batch and must divide over {dp} data-parallel ranks")
    where = placement_of(job.placement)
    placement = Placement(rank_device(where.device, info), where.dtype, where.attention)  # torchrun + CUDA: LOCAL_RANK
    if placement.attention == "flex" and placement.device.type == "cpu":
        raise UsageError("--attention flex cannot train on a CPU (FlexAttention has no CPU backward); leave "
                         "--attention at auto (the tiled kernels here) or train on a GPU")
    placement.use_attention()
    if placement.device.type == "cuda":
        torch.cuda.set_device(placement.device)
    enable_tf32(placement.device)  # the drafter's fp32 matmuls outside autocast
    run = TrainRun(job, info, strategy, job.log if info.is_main else silent, time.time(), sp, placement=placement)
    check_out_dir(run.out_dir, resume=job.resume, force=job.force)
    return run


RUN_FILES = ("config.json", "model.safetensors", "train_report.json", "training")  # what a run writes in --out


def check_out_dir(out_dir: str | Path, *, resume: bool, force: bool) -> None:
    """Refuse a training run's output folder, before anything is loaded or written: one that is a file or cannot
    be written (UsageError); one that holds files but none a run writes (`RUN_FILES`) while `force` is not given
    (UsageError: not a training run); one that holds a model while neither `force` nor `resume` is given
    (FileExistsError); one that holds an unfinished run (a checkpoint or a training log, no model yet) while
    neither is given (UsageError: a fresh run would overwrite its checkpoint and log); and a `resume` (without
    `force`) that finds a model but no checkpoint to continue from (ResumeError): training from scratch would
    overwrite the finished model."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise UsageError(f"--out {out_dir} is a file; give --out a folder (the drafter folder to write)")
    check_writable_path(out_dir / "config.json", "--out")
    if force:
        return
    work = out_dir / "training"
    refuse_foreign_files(out_dir, RUN_FILES)
    if not (out_dir / "config.json").exists():
        if resume:
            return
        where = unfinished_run(work)
        if where is not None:
            raise UsageError(f"--out {out_dir} holds an unfinished training run ({where}); pass --resume to "
                             "continue it, or --force to start over (it deletes that run)")
        return
    if not resume:
        raise FileExistsError(f"{out_dir} already holds a model; pass --force to overwrite it or --resume")
    refuse_resume_over_model(out_dir, work / "checkpoint")


def run_inputs(kind: str | None, target_weights: str | None, packed: PackedBatch | None) -> dict[str, Any]:
    """What a checkpoint records of a run's inputs, and a resume must match (`train.checkpoint.INPUT_KEYS`): the
    drafter kind, the target's weights (`data.fingerprint.target_weights_fingerprint`, the id the drafter's
    config.json records too) and the packed training data (rows, seq_len, token digest); each only when known."""
    from angelspec.train.data import dataset_identity

    out: dict[str, Any] = {}
    if kind is not None:
        out["drafter"] = kind
    if target_weights is not None:
        out["target_weights"] = target_weights
    if packed is not None:
        out["dataset"] = dataset_identity(packed)
    return out


# ----- end-of-step bookkeeping -----


def clip_gradients(parameters: Iterable[nn.Parameter], max_norm: float, strategy: str) -> Tensor:
    """Clip to `max_norm` (0: no clipping, the norm is still measured) and return the total norm before clipping;
    FSDP2's sharded gradients need the gathered norm (`distributed.clip_grad_norm`), everything else uses torch's
    own."""
    if max_norm <= 0:
        max_norm = float("inf")  # grad_clip=0 turns clipping off (a negative one is refused before the run)
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
    """One JSON line per log interval, written by the main rank only; a write that fails (a full disk) is cut
    back off, so the log never ends in half a line."""
    if not is_main:
        return
    line = (json.dumps(record) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    try:
        size = os.fstat(fd).st_size
        try:
            if os.write(fd, line) != len(line):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        except OSError:
            os.ftruncate(fd, size)
            raise
    finally:
        os.close(fd)


def trim_log(path: Path, step: int, is_main: bool) -> None:
    """Before a run starts (or resumes) at `step`, the main rank drops the log lines of later steps (a killed run
    logged past its last checkpoint, and the resumed run logs those steps again) and any line a kill cut short;
    the file is replaced atomically, and only when something is dropped."""
    if not is_main or not path.is_file():
        return
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    keep = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] > step:
            continue
        keep.append(line if line.endswith("\n") else line + "\n")
    if keep != lines:
        replace_atomic(path, lambda tmp: tmp.write_text("".join(keep), encoding="utf-8"))


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


# ----- the drafter trainers' loop (MTP family and block drafters) -----


# (the wrapped model, step, this rank's rows, their row indices) -> (this rank's share of the loss, the loss
# batch its α is logged from or, from a chunked loss, that α per depth itself (`ChunkedLossBatch.track_alpha`,
# when `logs_after(step + 1, cfg)`), extra log fields: tensors are read at log time only)
StepLoss = Callable[[nn.Module, int, "PackedBatch", list[int]], tuple[Tensor, LossBatch | Tensor, dict[str, Any]]]


def logs_after(step: int, cfg: DrafterRunConfig) -> bool:
    """Whether the loop writes a log line once `step` steps are done (so step `step - 1` must report its α)."""
    return step % cfg.log_every == 0 or step == cfg.steps


def scheduled_loss(schedule: LossSchedule, step: int, lb: LossBatch | ChunkedLossBatch, info: DistInfo,
                   objective: Objective | None = None) -> LossOutput:
    """The schedule's loss at `step` (or `objective`'s, with the schedule's config); under data parallelism its
    denominators are sums over the global batch."""
    with global_denominators(global_sum) if info.enabled else nullcontext():
        return schedule.loss(step, lb) if objective is None else objective(lb, schedule.config)


def drafter_checkpoints(run: TrainRun, cfg: DrafterRunConfig, target_fingerprint: str, model: nn.Module,
                        rebuild: Callable[[], nn.Module], write_model: Callable[[Any, Path], None],
                        opt: torch.optim.Optimizer, *, target: nn.Module | None = None,
                        rows: PackedRows | None = None) -> tuple[int, Callable[[], Any], Callable[[int], None]]:
    """The start step (when `run.job.resume`: the newest checkpoint's, after checking it was made with this config,
    drafter kind, target and data, restoring `model.safetensors` and the optimizer state), the whole-weights
    snapshot (a collective under FSDP2: every rank calls it, rank 0 writes; `rebuild()` makes an empty model) and
    the checkpoint saver. `target` (its weights' `model_fingerprint`) and `rows` (the packed data's
    `dataset_identity`) join the identity a resume must match when given."""
    identity = {"train_config": run_identity(cfg), "target_fingerprint": target_fingerprint,
                **run_inputs(getattr(getattr(model, "config", None), "drafter", None),
                             None if target is None else run.target_weights(target),
                             None if rows is None else rows.packed)}
    step, run.seconds_before[0] = resume_training(
        run.ckpt_dir, run.job.resume, identity,
        lambda c: load_full_state_dict(model, load_file(str(c / "model.safetensors"))), opt, run.log, model=model,
        saved_defaults=cfg.checkpoint_defaults())

    def snapshot() -> Any:
        return whole_copy(model, rebuild)

    save = make_checkpoint_saver(run.ckpt_dir, snapshot, write_model, identity, opt, is_main=run.main,
                                 barrier=barrier, model=model, seconds=run.train_seconds)
    return step, snapshot, save


@dataclass(frozen=True)
class Trainee:
    """What a drafter-training loop updates: the `model`, the same under DDP / FSDP2 (`wrapped`; `model` itself
    without), its optimizer `opt` and `save(step)`, which writes a checkpoint (`drafter_checkpoints`)."""

    model: nn.Module
    wrapped: nn.Module
    opt: torch.optim.Optimizer
    save: Callable[[int], None]


def train_drafter_steps(run: TrainRun, cfg: DrafterRunConfig, step: int, trainee: Trainee, *, rows: PackedRows,
                        schedule: LossSchedule, step_loss: StepLoss, desc: str, alpha_label: str = "a0",
                        features: TargetFeatures | None = None) -> int:
    """Steps `step` .. `cfg.steps` of a drafter trainer and the last step reached: per step the rows of global
    batch `step` (this rank's share), warm-up + cosine lr, `step_loss(trainee.wrapped, ...)`, the backward
    (× world size: DDP / FSDP2 average gradients), clipping and AdamW; every
    `log_every` steps a JSONL line with the loss, lr, gradient norm and per-depth α over all ranks; checkpoints
    and the `run.job.max_minutes` budget as `checkpoint_or_stop`; a progress bar when `run.job.progress`.
    `features` (the ones `step_loss` reads) is told where the loop starts and stops, which a feature stream needs
    (`TargetFeatures.start` / `.finish`)."""
    info, model, wrapped, opt, save = run.info, trainee.model, trainee.wrapped, trainee.opt, trainee.save
    if features is not None and features.stream is not None and run.sp.enabled:
        raise SettingError(f"{{sp}} {run.sp.size} does not read a feature stream yet (features={features.source}); "
                           "train with the target in the step or from an offline cache (features=DIR)")
    if features is not None:
        features.start(step, cfg.steps, cfg.batch_size, info, run.log)
    run.work.mkdir(parents=True, exist_ok=True)
    log_path = run.work / TRAIN_LOG
    trim_log(log_path, step, run.main)
    max_minutes = run.job.max_minutes
    deadline = None if max_minutes is None else time.time() + 60 * max_minutes
    model.train()
    bar = tqdm(total=cfg.steps, initial=step, desc=desc, disable=not (run.job.progress and run.main), unit="step")
    losses: list[float] = []
    last_log, tok_seen = time.time(), 0
    while step < cfg.steps:
        idx = rows.local_rows(step, cfg.batch_size, run.sp.dp)  # an SP group's ranks read the same rows
        batch = rows.take(idx).to(run.device)
        lr = cosine_lr(step, base_lr=cfg.lr, warmup=cfg.warmup, total=cfg.steps, min_ratio=cfg.min_lr_ratio)
        set_lr(opt, lr)
        opt.zero_grad(set_to_none=True)
        with run.autocast():
            loss, lb, extra = step_loss(wrapped, step, batch, idx)
        (loss * info.world_size if info.enabled else loss).backward()
        gnorm = clip_gradients(model.parameters(), cfg.grad_clip, run.strategy)
        # host sync: once per step, for the log and the non-finite guard (before the weights take the step)
        losses.append(stop_if_not_finite(loss, gnorm, step + 1, lr, ckpt_dir=run.ckpt_dir, features=cfg.features,
                                         distributed=info.enabled))
        opt.step()
        step += 1
        tok_seen += run.sp.shard_tokens(batch)
        bar.update(1)
        if logs_after(step, cfg):
            now = time.time()
            alpha = lb if isinstance(lb, Tensor) else \
                acceptance_per_depth(lb.student_logits.detach(), lb.teacher_logits, lb.mask, cfg.top_k)
            mean_loss, tok_seen, alpha_list = reduce_depth_stats(sum(losses) / len(losses), tok_seen, alpha, info)
            rec = {"step": step, "objective": schedule.name_at(step - 1), "loss": mean_loss, "lr": lr,
                   "grad_norm": float(gnorm), "alpha_per_depth": [round(a, 4) for a in alpha_list],
                   **{k: v.item() if isinstance(v, Tensor) else v for k, v in extra.items()},
                   "tokens_per_s": tok_seen / max(now - last_log, 1e-9)}
            bar.set_postfix(loss=f"{rec['loss']:.3f}", **{alpha_label: f"{rec['alpha_per_depth'][0]:.2f}"})
            append_log(log_path, rec, run.main)
            losses, last_log, tok_seen = [], now, 0
        if checkpoint_or_stop(step, cfg.steps, cfg.ckpt_every, save, deadline, run.log):
            break
    bar.close()
    if features is not None:
        features.finish(step)
    model.eval()
    return step
