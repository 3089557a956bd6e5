"""`angelspec train --drafter mtp`: the shared-parameter MTP drafter with Training-Time Test (report §2).

Per step: a batch of packed rows (document-aware packing, §6.3, `train.data`) -> frozen target forward under
no_grad (online features: the tap h_i and the teacher logits; or, with `features=DIR`, the same tensors read
from an offline cache made by `angelspec features`, see `train.features.TargetFeatures`) -> TTT rollout of the
MTP block for D depths (`train.ttt`) -> a loss from `train.losses` chosen by name, by default the report's
two-stage recipe (LK^α cold start, then e2e TV, via `LossSchedule`) -> AdamW, warm-up + cosine, gradient
clipping. Rollout, LM head and loss run in memory linear in T (tiled document-masked attention, the head and
loss a chunk of positions at a time, each depth recomputed in the backward: docs/design.md section 7).

`ttt=False` trains the teacher-forced base MTP of Table 2: one depth (k = 0, no self-conditioned
rollout), typically with `loss="ce"` (preset `mtp_base`). The drafter still drafts K tokens at inference
by invoking the block recurrently; it has just never seen its own predictions in training.

Data: JSONL conversations (`{"messages": [...]}`), a file or a corpus folder of `<domain>/train.jsonl`,
rendered with the target's chat template; the loss covers assistant tokens only (labels x_{i+k+2} must be
assistant tokens of the same document). Conversations without an assistant message are skipped and
counted; a dataset with no assistant token at all is an error.

Resuming is exact: the data order is a pure function of (seed, step), the rollout has no randomness, and
the checkpoint holds the block's weights and the optimizer state (tested bit for bit).

Data parallelism (`train.distributed`): under `torchrun --nproc_per_node N` the block is wrapped with DDP
(the default) or FSDP2 (`distributed="fsdp2"`), each rank takes its slice of the same global batch, and
losses are normalised over the global batch, so N processes train the single-process model (up to
reduction order; tested). The frozen target is not wrapped: every rank runs its own copy. Rank 0 alone
writes checkpoints, logs and the progress bar. Checkpoints hold the optimizer state whole and keyed by
parameter name (`train.checkpoint`), so DDP and FSDP2 runs resume exactly, under any strategy.

Sequence parallelism (`train.sequence_parallel`, `--sp N`): each rank of an SP group rolls out its T/N tokens of
every row, with the attention of each depth head-sharded over whole rows between two all-to-alls; the labels come
from the shard plus a halo of D + 1 tokens, and so does the teacher: the frozen target runs sequence-parallel too
(its taps and teacher of the shard; the halo's final-norm states from the next rank). Same model as one process
(tested).

EAGLE-3 (`train.eagle3`) is trained by this same loop: only the block (`Eagle3DraftModel`, three target taps joined
by `concat_taps`) and the presets differ.

Output folder: `config.json` (`"angelspec": {"drafter": "mtp" | "eagle3", "target_fingerprint": ..., ...}`) and
`model.safetensors` with the block's own weights (the embedding and LM head stay the target's).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from angelspec.data.packing import PackedBatch
from angelspec.data.vocab import count_tokens, frequent_tokens
from angelspec.models.config import DecoderConfig
from angelspec.models.mtp import MTPConfig, MTPDraftModel, MTPFamilyConfig, concat_taps
from angelspec.models.mtp_io import build_mtp_model, save_mtp
from angelspec.train.config import DrafterRunConfig, TrainJob, trainer
from angelspec.train.data import packed_conversations, pad_token_id
from angelspec.train.distributed import FunctionModule, shutdown, wrap_model
from angelspec.train.features import target_features
from angelspec.train.loop import (
    Trainee,
    drafter_checkpoints,
    logs_after,
    scheduled_loss,
    start_run,
    train_drafter_steps,
)
from angelspec.train.losses import LossConfig, LossSchedule, Teacher, get_loss
from angelspec.train.optim import build_adamw
from angelspec.train.ttt import RolloutMemory, mtp_chunked_loss_batch, ttt_rollout


@dataclass(frozen=True)
class MTPFamilyTrainConfig(DrafterRunConfig):
    """Block design and objective of one MTP-family training run (the optimisation, the layer shapes, None =
    the target's, and the data settings come from `DrafterRunConfig`).

    Subclasses add the target taps and build the draft model config (`model_config`): `MTPTrainConfig` (one tap),
    `train.eagle3.Eagle3TrainConfig` (three); `train_mtp` trains either."""

    num_depths: int = 3  # D, the TTT unroll (the report's MTP-3)
    ttt: bool = True  # False: teacher-forced base MTP, one depth
    loss: str = "e2e_tv"  # final objective, a name in train.losses.LOSSES
    cold_start_loss: str | None = "lk_alpha"  # None: `loss` from the first step
    # Recompute each depth in the backward (ttt_rollout checkpoint_depths; memory only, bit-identical). It pays at
    # every depth count (benchmarks/ttt_memory.py, docs/design.md "Memory linear in T"): D = 3 at 16k tokens
    # peaks at 0.31x of the same step without it; even one depth peaks at 0.48x, because the loss chunks'
    # backward then runs before the depth's activations are rebuilt instead of on top of them.
    activation_checkpointing: bool = True
    batch_size: int = 4  # packed rows per step

    def __post_init__(self) -> None:
        get_loss(self.loss)
        if self.cold_start_loss is not None:
            get_loss(self.cold_start_loss)
        self.require_positive(("num_depths", "seq_len", "batch_size", "steps", "ckpt_every", "log_every"))
        self.check_train_vocab()

    def model_config(self, target: DecoderConfig) -> MTPFamilyConfig:
        """The block's config for `target`."""
        raise NotImplementedError

    @property
    def train_depths(self) -> int:
        return self.num_depths if self.ttt else 1

    def schedule(self) -> LossSchedule:
        cold = self.cold_start_loss
        return LossSchedule(cold_start=cold or self.loss, switch_step=self.switch_step if cold else 0,
                            final=self.loss, config=LossConfig(top_k=self.top_k))


@dataclass(frozen=True)
class MTPTrainConfig(MTPFamilyTrainConfig):
    """An MTP run: the block conditions on one target tap."""

    target_layer_id: int | None = None  # None: the target's last layer

    def model_config(self, target: DecoderConfig) -> MTPConfig:
        return MTPConfig.for_target(target, num_depths=self.num_depths, target_layer_id=self.target_layer_id,
                                    shape=self.layer_shape())


def mtp_embedded() -> MTPTrainConfig:
    """MTP-3 with TTT for the embedded target (6-layer Qwen3, hidden 256, vocab 8192), sized for a few CPU
    minutes by a FLOP estimate (~75 GFLOP per step of 2×512 tokens, mostly the target forward and the three
    LM-head passes); not yet timed against the shipped target."""
    return MTPTrainConfig(batch_size=2, steps=200, switch_step=60, warmup=10)


def mtp_demo() -> MTPTrainConfig:
    """`make demo`'s few-minute MTP-3 run on the embedded target's rollouts: short schedule, early switch
    from the LK^alpha cold start to e2e TV, drafting from the 1024 most frequent answer tokens (as `dfly_demo`:
    98.8% of the demo rollouts' assistant tokens, an eighth of the LM-head work per draft). A taste of the
    pipeline, not a converged drafter."""
    return MTPTrainConfig(batch_size=2, steps=150, switch_step=50, warmup=10, ckpt_every=50, log_every=10,
                          draft_vocab_size=1024)


def mtp_shipped() -> MTPTrainConfig:
    """The MTP-3 (TTT) that ships with the embedded target (`assets/drafters/mtp`, `make drafters`): `mtp_demo`'s
    shape (1024-token draft vocabulary) on the 20k-prompt pool's rollouts, 4,800 steps of 4 × 512 tokens (9.8M
    tokens), LK^alpha cold start for the first 800 steps, then e2e TV."""
    return replace(mtp_demo(), batch_size=4, steps=4800, switch_step=800, warmup=50, ckpt_every=200, log_every=20)


def mtp_shipped_dv() -> MTPTrainConfig:
    """`mtp_shipped` trained on its draft vocabulary (train_vocab "draft", `train.losses` "Draft vocabulary"): the
    head scores the 1024 draft rows instead of 8192 in every step, the objective is the acceptance of the drafter
    inference runs, and TTT feeds each depth a token inference could propose. For a fresh run (`mtp_shipped` keeps
    "full", so that its run resumes unchanged)."""
    return replace(mtp_shipped(), train_vocab="draft")


def mtp_base() -> MTPTrainConfig:
    """The base-MTP comparison point of Table 2: teacher-forced, one depth, hard-label CE."""
    return MTPTrainConfig(ttt=False, num_depths=1, loss="ce", cold_start_loss=None)


def tiny_debug() -> MTPTrainConfig:
    """Seconds: 3 steps on 2 short rows, switching objective after step 1."""
    return MTPTrainConfig(intermediate_size=64, seq_len=64, batch_size=2, steps=3, warmup=1, switch_step=1,
                          ckpt_every=2, log_every=1)


PRESETS = {"mtp_embedded": mtp_embedded, "mtp_demo": mtp_demo, "mtp_shipped": mtp_shipped,
           "mtp_shipped_dv": mtp_shipped_dv, "mtp_base": mtp_base, "tiny_debug": tiny_debug}


# ----- training -----


def train_mtp_job(job: TrainJob, cfg: MTPFamilyTrainConfig) -> dict[str, Any]:
    """Train the MTP-family drafter of `cfg` for `job` (the `Trainer` arguments): the kind follows the config,
    `MTPTrainConfig` trains MTP, `Eagle3TrainConfig` EAGLE-3. Data parallelism: module docstring."""
    run = start_run(job, batch_size=cfg.batch_size, seq_len=cfg.seq_len)
    sp = run.sp
    run.clear_out_dir()
    target, tok = run.frozen_target(cfg.features)
    tcfg = target.config
    pad_id = pad_token_id(tcfg)
    mcfg = replace(cfg.model_config(tcfg), draft_vocab_size=cfg.draft_vocab_size)
    sp.check_heads(mcfg.layer_config().num_attention_heads)
    rows, stats = packed_conversations(tok, job.data, cfg, pad_id, run.log)

    features = target_features(target, list(mcfg.target_layer_ids), cfg.features, rows, target_dir=run.target_dir,
                               data=job.data, enable_thinking=cfg.enable_thinking, sp=sp, halo=cfg.train_depths + 1,
                               halo_what=f"D + 1 for the {cfg.train_depths} TTT depths")
    kind = mcfg.drafter
    block = build_mtp_model(mcfg, target.embed_tokens, target.lm_head)
    block.init_weights(std=cfg.init_std, generator=torch.Generator().manual_seed(cfg.seed))
    if mcfg.draft_vocab_size:  # inference drafts from it; training too under train_vocab "draft"
        counts = count_tokens(rows.packed.input_ids, rows.packed.loss_mask, tcfg.vocab_size)
        block.set_draft_vocab(frequent_tokens(counts, mcfg.draft_vocab_size, always=tcfg.eos_token_ids))
    block.to(run.device)  # initialised on the host (the same weights on every device); fp32 master weights

    def forward_loss(b: MTPDraftModel, hidden: torch.Tensor, batch: PackedBatch, teacher: Teacher | None,
                     step: int, log_alpha: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Rollout, LM head and loss in one forward, in memory linear in T: no [T, T] tensor, no [N, D, V] logits
        (`ttt_rollout` without kept logits, `mtp_chunked_loss_batch`). The head runs inside the wrapped forward,
        where FSDP2 has the block's parameters gathered. -> (this rank's share of the loss, α per depth or [])."""
        out = ttt_rollout(b, hidden, batch.input_ids, batch.positions, batch.document_ids, cfg.train_depths,
                          pad_id=pad_id, memory=RolloutMemory(keep_logits=False,
                                                              checkpoint_depths=cfg.activation_checkpointing),
                          sp=sp, train_vocab=cfg.train_vocab)
        clb = mtp_chunked_loss_batch(b, out, batch, teacher, track_alpha=log_alpha, sp=sp, train_vocab=cfg.train_vocab)
        lo = scheduled_loss(schedule, step, clb, run.info)
        return lo.loss, lo.parts.get("alpha_per_depth", lo.loss.new_zeros(0))  # tensors, so DDP / FSDP2 hook them

    # Parallelism is applied to the built block (the target stays unwrapped); the optimizer comes after,
    # since FSDP2 replaces the block's parameters by DTensor shards.
    model = wrap_model(FunctionModule(block, forward_loss), run.strategy, run.info)
    opt = build_adamw(block, cfg.lr, cfg.weight_decay)
    schedule = cfg.schedule()
    meta = {"target_weights": run.target_weights(target), "train_config": json.loads(json.dumps(asdict(cfg)))}
    step, block_to_save, save_ckpt = drafter_checkpoints(
        run, cfg, tcfg.fingerprint(), block, lambda: build_mtp_model(mcfg, target.embed_tokens, target.lm_head),
        lambda m, p: save_mtp(m, p, meta), opt, target=target, rows=rows)

    def step_loss(wrapped: torch.nn.Module, step: int, batch: PackedBatch, idx: list[int]
                  ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        # The frozen target's taps and teacher (its final-norm states and LM head: the loss chunks make the logits),
        # no grad; under SP this rank's shard of the taps and the teacher of its shard and halo (`TargetFeatures`,
        # train.sequence_parallel).
        taps, teacher = features(batch, idx)
        loss, alpha = wrapped(concat_taps(taps), batch, teacher, step, logs_after(step + 1, cfg))
        return loss, alpha, {}

    step = train_drafter_steps(run, cfg, step, Trainee(block, model, opt, save_ckpt), rows=rows, schedule=schedule,
                               step_loss=step_loss, desc=kind, features=features)
    final = block_to_save()
    report = run.drafter_report({"drafter": kind, "steps": step, "ttt": cfg.ttt, "num_depths": cfg.num_depths},
                                block, stats, rows, tcfg, features)
    run.finish(report, lambda: save_mtp(final, run.out_dir, meta))
    del model  # the DDP / FSDP2 wrapper must go before its process group (shutdown collects it)
    shutdown(run.info)
    return report


train_mtp = trainer(train_mtp_job, mtp_embedded, "train_mtp",
                    "`angelspec train --drafter mtp` (`train.config.Trainer`; default preset `mtp_embedded`); a "
                    "`train.eagle3.Eagle3TrainConfig` trains EAGLE-3.")
