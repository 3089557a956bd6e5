"""`angelspec train --drafter {dflash,dflare,dfly,dspark}`: the block-parallel drafters (report §3; DSpark report §3).

Per step: a batch of packed rows (document-aware packing, `train.data.PackedRows`) -> frozen target
forward under no_grad (online features: the taps `target_layer_ids` and the teacher logits; or the same tensors
from an offline cache with `features=DIR`, `train.features.TargetFeatures`) -> N random anchors
per row inside assistant spans (`sample_anchors`: the first draft after the anchor must be a trained token of the
anchor's document) -> ONE index-masked backbone pass over all N blocks of a row plus the teacher-forced head
(`BlockDrafter.forward_train`) -> the objective -> AdamW, warm-up + cosine, gradient clipping.

Objectives (`objective`, selectable per run):

    "dfly"    report §3.3: the D-PACE-weighted LK^λ cold start (Eq. 16–18, "dpace_lk") for `switch_step` steps,
              then end-to-end TV (Eq. 9, "e2e_tv"); the block position is the depth axis.
    "dspark"  DSpark report: ce_coef·CE + tv_coef·L_TV + conf_coef·BCE(c, sg[α]) with position weights
              w_k = exp(−(k−1)/γ) (`train.losses.dspark_loss`); L_TV = ‖p − q‖₁ as the report writes it
              (`tv_norm` "l1"), or ½‖p − q‖₁ = TV (`tv_norm` "half_l1", what runs made before the option had).

Under "dfly" a drafter that has a confidence head also gets the confidence term conf_coef·BCE(c, sg[target]) (mean
over valid positions; the target is detached, as in DSpark's loss, so it never moves with the drafter), so the
engine's `Proposal.confidences` are trained whatever the objective. The target (`confidence_target`,
`train.confidence`): "protocol" (the default) = the acceptance of the argmax draft that confidence-driven policies
verify, one head output per temperature of `confidence_temperatures`; "tv" = α = 1 − TV, DSpark's recipe (the
acceptance of standard sampling at T = 1), under either objective.

Confidence-only runs (`only=confidence`, `init_from=DIR`; the CLI's --only / --init-from): the drafter in DIR with its
backbone and head frozen, only the confidence head trained, on BCE(c, sg[target]) alone; the design comes from DIR
(the preset's design fields are ignored), the optimisation and data settings from the preset (`confidence_only`).
Resumable like any run; the output is a new drafter folder.

New drafters (`BlockDrafterConfig.for_target`): a DSpark injects each draft layer's own target tap (Uraion §3.3,
`context_injection` "same_layer"; "shared" keeps DFlash's fused context, Eq. 10), and the DFlash backbone's fc has
no bias (`fc_bias`), since vLLM's DFlash / DSpark fc has none (`export.vllm`). None takes these defaults.

Teacher alignment: draft k of anchor a predicts x_{a+k}; its teacher is the target's distribution at position
a+k−1 (`BlockTargets.source_index`), gathered from the [R, T, V] teacher logits.

Resuming is exact: the data order and the anchors are pure functions of (seed, step, global row), the model has
no dropout, and the checkpoint holds the drafter's weights and the optimizer state (tested bit for bit).

Data parallelism as in `train.mtp`: DDP (default under torchrun) or FSDP2 over the drafter only; anchors are
drawn per global row, so N processes see the single-process batch; losses normalise over the global batch
(checkpoints hold the optimizer state whole, keyed by parameter name: DDP and FSDP2 runs resume exactly).
Sequence parallelism (`--sp N`, `block_forward_train`): each rank holds T/N context tokens of every row and the
anchors among them; attention runs head-sharded over whole rows, the blocks' labels and teacher come from the shard
plus a halo of B − 1 tokens (the target runs sequence-parallel too, the halo's teacher states come from the next
rank; tested equal to one process).

Output folder: `config.json` (`"angelspec": {"drafter": kind, "target_fingerprint": ..., "head": ...}`) and
`model.safetensors` with the drafter's own weights (`models.block.io`).

Shape legend: R packed rows, T time, N anchors per row, K = B−1 draft positions, V vocab.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from angelspec.data.packing import PackedBatch
from angelspec.data.vocab import count_tokens, frequent_tokens
from angelspec.models.block.config import (
    CONTEXT_INJECTIONS,
    DEFAULT_CONFIDENCE_TEMPERATURES,
    HEADS,
    MARKOV_HEADS,
    BlockDrafterConfig,
    check_confidence_target,
)
from angelspec.models.block.drafter import BackboneOptions, BlockDrafter, BlockTrainOutput
from angelspec.models.block.io import save_block_drafter
from angelspec.models.block.targets import block_targets, sample_anchors
from angelspec.models.config import ConfigError, DecoderConfig
from angelspec.models.decoder import Decoder
from angelspec.models.mtp import concat_taps
from angelspec.train.confidence import (
    confidence_only_drafter,
    confidence_targets,
    init_from_drafter,
    new_block_drafter,
)
from angelspec.train.config import DrafterRunConfig, Trainer, TrainJob, trainer
from angelspec.train.data import packed_conversations, pad_token_id
from angelspec.train.distributed import FunctionModule, shard_rows, shutdown, wrap_model
from angelspec.train.features import target_features
from angelspec.train.loop import (
    Trainee,
    drafter_checkpoints,
    logs_after,
    scheduled_loss,
    start_run,
    train_drafter_steps,
)
from angelspec.train.losses import (
    NO_LOSS,
    ChunkedLossBatch,
    LossBatch,
    LossConfig,
    LossSchedule,
    Objective,
    Teacher,
    TeacherHead,
    confidence_bce,
    get_loss,
    loss_chunk_logits,
    with_confidence_term,
)
from angelspec.train.losses import teacher_logits as as_teacher_logits
from angelspec.train.optim import build_adamw
from angelspec.train.sequence_parallel import SequenceParallel, block_attention, shard_anchors

# kind -> (default head, backbone conditioning, default objective)
KINDS: dict[str, tuple[str, str, str]] = {
    "dflash": ("none", "dflash", "dfly"),
    "dflare": ("none", "dflare", "dfly"),
    "dfly": ("hidden", "dfly", "dfly"),
    "dspark": ("markov", "dflash", "dspark"),
}
OBJECTIVES = ("dfly", "dspark")
ONLY = ("confidence",)  # the parts a run may train alone (`only`), from an existing drafter (`init_from`)


@dataclass(frozen=True)
class BlockDrafterTrainConfig(DrafterRunConfig):
    """Design and objective of one block-drafter run (the optimisation, the layer shapes, None = the target's,
    and the data settings come from `DrafterRunConfig`). `drafter` / `head` / `objective` None take the kind's
    defaults (`KINDS`; the kind is the CLI's `--drafter`, else "dfly"); taps default to DFlash's choice
    (`default_block_layer_ids`, one per draft layer); `mask_token_id` None = the tokenizer's mask token."""

    drafter: str | None = None
    head: str | None = None
    block_size: int = 8  # B, counting the anchor: B−1 drafts per step
    draft_layers: int = 2
    target_layer_ids: tuple[int, ...] | None = None
    num_taps: int | None = None
    # The depth of the target `target_layer_ids` were chosen for (the embedded presets: 6). On a target of another
    # depth they would tap the wrong layers (or none at all), so the taps follow that target instead: as many,
    # spread over its layers by DFlash's rule (`default_block_layer_ids`). None: the taps are used as given.
    taps_for_depth: int | None = None
    mask_token_id: int | None = None
    markov_rank: int = 64
    confidence_head: bool = True
    head_intermediate_size: int | None = None
    num_anchors: int = 16  # N blocks per packed row
    # Recompute each draft layer in the backward (memory only, bit-identical). On: benchmarks/block_memory.py
    # measures 15% less peak at 1-4k tokens and 31% at 16k (half the per-token growth), for one more backbone
    # forward (a few % of a step next to the target forward and the LM head).
    activation_checkpointing: bool = True
    objective: str | None = None  # "dfly" | "dspark"
    switch_step: int = 60  # "dfly": D-PACE LK cold start before, e2e TV from here
    gamma: float | None = None  # DSpark position decay (None = K)
    ce_coef: float = 0.1
    tv_coef: float = 0.9
    conf_coef: float = 1.0
    tv_norm: str = "l1"  # DSpark's L_TV: "l1" = ‖p − q‖₁ (the report), "half_l1" = ½‖p − q‖₁ (before the option)
    context_injection: str | None = None  # None: "same_layer" for dspark, else "shared" (models.block.config)
    fc_bias: bool | None = None  # None: a bias only for dfly (vLLM's DFlash / DSpark fc has none)
    confidence_target: str = "protocol"  # "protocol" | "tv" (`train.confidence`)
    confidence_temperatures: tuple[float, ...] = DEFAULT_CONFIDENCE_TEMPERATURES  # the "protocol" head's grid
    anchor_fusion: bool = False  # the fused anchor input (`BlockDrafter.anchor_input`)
    # An existing drafter folder to start from: with only=confidence its confidence head alone trains; without, the
    # whole drafter trains on from its weights (a warm start: design and draft vocabulary are the folder's, plus
    # the fused anchor input when anchor_fusion is set, which starts at zero, so the run starts from the folder's
    # drafter exactly).
    init_from: str | None = None
    only: str | None = None  # "confidence": train the confidence head alone, everything else frozen
    batch_size: int = 2
    steps: int = 200
    warmup: int = 10

    def __post_init__(self) -> None:
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size < 2:
            raise ConfigError(f"block_size must be an int >= 2 (the anchor plus at least one draft), got "
                              f"{self.block_size!r}")
        self.require_positive(("draft_layers", "num_anchors", "markov_rank", "seq_len", "batch_size", "steps",
                               "ckpt_every", "log_every"), ConfigError)
        if self.drafter is not None and self.drafter not in KINDS:
            raise ConfigError(f"unknown block drafter {self.drafter!r}; choose one of {', '.join(KINDS)}")
        if self.head is not None and self.head not in HEADS:
            raise ConfigError(f"unknown head {self.head!r}; choose one of {', '.join(HEADS)}")
        if self.objective is not None and self.objective not in OBJECTIVES:
            raise ConfigError(f"unknown objective {self.objective!r}; choose one of {', '.join(OBJECTIVES)}")
        if self.switch_step < 0:
            raise ConfigError(f"switch_step must be >= 0, got {self.switch_step}")
        if self.context_injection not in (None, *CONTEXT_INJECTIONS):
            raise ConfigError(f"unknown context_injection {self.context_injection!r}; choose one of "
                              f"{', '.join(CONTEXT_INJECTIONS)} (or none: the kind's default)")
        self.loss_config()  # validates top_k, gamma and the coefficients
        self.check_train_vocab(ConfigError, name_only=self.init_from is not None)  # init_from: the folder's vocabulary
        try:
            check_confidence_target(self.confidence_target, self.protocol_temperatures)
        except ConfigError as e:
            raise ConfigError(f"{e} (settings confidence_target, confidence_temperatures)") from None
        if self.only is not None and self.only not in ONLY:
            raise ConfigError(f"only={self.only!r}: a run can train these parts alone: {', '.join(ONLY)}")
        if self.only is not None and self.init_from is None:
            raise ConfigError("only=confidence needs init_from=DIR (the drafter whose confidence head to train): pass "
                              "both (--init-from DIR --only confidence)")
        if self.drafter is not None:
            self._check_head(self.drafter, self.resolved_head)

    @staticmethod
    def _check_head(kind: str, head: str) -> None:
        if kind == "dspark" and head not in MARKOV_HEADS:
            raise ConfigError(f"dspark drafts with a Markov-family head ({', '.join(MARKOV_HEADS)}), not {head!r}; "
                              f"pass head=markov or another --drafter")
        if kind == "dflash" and head in MARKOV_HEADS:
            raise ConfigError(f"the DFlash backbone with a {head} head is DSpark: pass --drafter dspark")

    # ----- derived values -----
    @property
    def kind(self) -> str:
        return self.drafter or "dfly"

    @property
    def resolved_head(self) -> str:
        return self.head or KINDS[self.kind][0]

    @property
    def resolved_objective(self) -> str:
        if self.only == "confidence":
            return "confidence"
        return self.objective or KINDS[self.kind][2]

    @property
    def protocol_temperatures(self) -> tuple[float, ...]:
        """The confidence head's temperature grid: `confidence_temperatures` for "protocol", none for "tv"."""
        return tuple(self.confidence_temperatures) if self.confidence_target == "protocol" else ()

    def for_kind(self, kind: str) -> BlockDrafterTrainConfig:
        """This config for the CLI's `--drafter kind`; a preset of another kind is refused."""
        if kind not in KINDS:
            raise ConfigError(f"unknown block drafter {kind!r}; choose one of {', '.join(KINDS)}")
        if self.drafter not in (None, kind):
            raise ConfigError(f"this preset trains a {self.drafter} drafter, not {kind}: pass --drafter "
                              f"{self.drafter} or pick a {kind} preset")
        return replace(self, drafter=kind)

    def loss_config(self) -> LossConfig:
        try:
            return LossConfig(top_k=self.top_k, gamma=self.gamma, ce_coef=self.ce_coef, tv_coef=self.tv_coef,
                              conf_coef=self.conf_coef, tv_norm=self.tv_norm)
        except ValueError as e:
            raise ConfigError(str(e)) from None

    def schedule(self) -> LossSchedule:
        if self.resolved_objective == "dspark":
            return LossSchedule(cold_start="dspark", switch_step=0, final="dspark", config=self.loss_config())
        return LossSchedule(cold_start="dpace_lk", switch_step=self.switch_step, final="e2e_tv",
                            config=self.loss_config())

    def taps_for(self, target: DecoderConfig) -> tuple[tuple[int, ...] | None, int | None]:
        """(target_layer_ids, num_taps) for `target`: the configured taps, unless they were chosen for a target of
        another depth (`taps_for_depth`); then None and as many taps as the target has room for, so
        `BlockDrafterConfig.for_target` spreads them over its layers."""
        ids, depth = self.target_layer_ids, self.taps_for_depth
        if ids is None or depth is None or depth == target.num_hidden_layers:
            return ids, self.num_taps
        return None, min(len(ids), target.num_hidden_layers)

    def model_config(self, target: DecoderConfig, mask_token_id: int) -> BlockDrafterConfig:
        """The drafter's config for `target` (raises ConfigError for taps the target lacks, a bad mask id, ...)."""
        _, conditioning, _ = KINDS[self.kind]
        taps, num_taps = self.taps_for(target)
        return BlockDrafterConfig.for_target(
            target, mask_token_id=mask_token_id, block_size=self.block_size, num_draft_layers=self.draft_layers,
            target_layer_ids=taps, num_taps=num_taps, conditioning=conditioning,
            head=self.resolved_head, markov_rank=self.markov_rank, confidence_head=self.confidence_head,
            head_intermediate_size=self.head_intermediate_size, draft_vocab_size=self.draft_vocab_size,
            context_injection=self.context_injection, fc_bias=self.fc_bias,
            confidence_target=self.confidence_target, confidence_temperatures=self.protocol_temperatures,
            anchor_fusion=self.anchor_fusion, shape=self.layer_shape())

    def checkpoint_defaults(self) -> dict[str, Any]:
        """What a checkpoint written before `tv_norm`, `context_injection` and `fc_bias` existed ran with, for
        `resume`: the old behaviour (½‖p − q‖₁, the shared fused context, an fc bias) where this run's settings
        change it, else this run's own value (a setting that does not change the run, e.g. tv_norm outside the
        dspark objective, or DFly's fc bias, which has not changed)."""
        kind = self.kind
        changes = {
            "tv_norm": self.resolved_objective == "dspark" and self.tv_norm != "half_l1",
            "context_injection": kind == "dspark" and self.context_injection != "shared",
            "fc_bias": kind in ("dflash", "dspark") and self.fc_bias is not True,
        }
        old = {"tv_norm": "half_l1", "context_injection": "shared", "fc_bias": True}
        return {k: old[k] if changed else getattr(self, k) for k, changed in changes.items()}


# ----- presets -----

EMBEDDED_TAPS = (1, 3, 5)  # low, mid and last layer of the 6-layer embedded target (models.block)
EMBEDDED_DEPTH = 6  # the embedded target's layers: on another target the embedded presets' taps follow it


def dfly_embedded() -> BlockDrafterTrainConfig:
    """DFly with the hidden-correction head for the embedded target (6 × 256, vocab 8192): L2-B8, taps (1, 3, 5),
    16 anchors per 512-token row, D-PACE LK cold start for 60 steps then e2e TV. Sized like `mtp_embedded` (a
    few CPU minutes, by a FLOP estimate: the target forward dominates); not yet timed."""
    return BlockDrafterTrainConfig(drafter="dfly", head="hidden", target_layer_ids=EMBEDDED_TAPS,
                                   taps_for_depth=EMBEDDED_DEPTH)


def dfly_demo() -> BlockDrafterTrainConfig:
    """`make demo`'s few-minute DFly run on the embedded target's rollouts (same recipe as `dfly_embedded`,
    600 steps (~2 min on 2 CPU cores), objective switch at 200), sized for a cheap draft step on CPU:
    - one draft layer (the Table 5 sweep of `benchmarks/block_ablation.py` finds L1-B8 within noise of L2-B8 at
      this scale, at half the backbone cost);
    - drafting from the 1024 most frequent answer tokens (98.8% of the demo rollouts' assistant tokens; an
      eighth of the LM-head work per draft; on the trained demo DFly, `angelspec eval --limit 8
      --num-draft-tokens 7` gives the same acceptance histogram at 2048, 1024 and 512);
    - a 512-wide draft-layer MLP (the target's is 768) and a 128-wide hidden-correction SwiGLU (default: 256):
      trained side by side on the same rollouts (one run each), `angelspec eval --batch-size 1
      --max-new-tokens 96` gave MAL 1.62 vs 1.63 at K = 4 (1.66 vs 1.68 at K = 7) over the 72 held-out prompts,
      every domain within 0.02; on the 18 the demo decodes (`--limit 6`) 1.46 vs 1.53 (chat 1.16 vs 1.25).
      `benchmarks/drafter_cost.py` puts the smaller step at 23% of a verify step (the goal is ≤ 25%), the
      wider one at 30%.
    A taste of the pipeline, not a converged drafter."""
    return replace(dfly_embedded(), steps=600, switch_step=200, draft_layers=1, draft_vocab_size=1024,
                   intermediate_size=512, head_intermediate_size=128)


def dfly_shipped() -> BlockDrafterTrainConfig:
    """The DFly that ships with the embedded target (`assets/drafters/dfly`, `make drafters`): `dfly_demo`'s
    CPU-cheap shape (one draft layer, 512-wide MLP, 128-wide hidden-correction head, 1024-token draft vocabulary,
    block 8 = K 7) trained on the 20k-prompt pool's rollouts for 6,800 steps of 4 × 512 tokens (13.9M tokens),
    with 32 anchors per row (the target forward dominates a step, so more blocks per row buy supervision
    cheaply), the LK cold start for the first 800 steps, then e2e TV. (The shipped weights got these steps as a
    4,800-step cosine cycle, then a warm restart resumed with steps=6800; a fresh run is one 6,800-step cycle.)
    Its confidence head predates the
    "protocol" target and keeps α ("tv"), so `make drafters` keeps resuming its run (re-fit the head alone with
    `train --init-from DIR --only confidence`)."""
    return replace(dfly_demo(), batch_size=4, num_anchors=32, steps=6800, switch_step=800, warmup=50,
                   ckpt_every=200, log_every=20, confidence_target="tv")


def dfly_shipped_dv() -> BlockDrafterTrainConfig:
    """`dfly_shipped` for a fresh run: trained on its 1024-token draft vocabulary (train_vocab "draft",
    `train.losses` "Draft vocabulary": the head scores 1024 rows instead of 8192, the objective is the acceptance of
    the drafter inference runs) and with a new run's "protocol" confidence head (`dfly_shipped` keeps "full" and
    "tv", so that its run resumes unchanged)."""
    return replace(dfly_shipped(), train_vocab="draft", confidence_target="protocol")


def dfly_shipped_af() -> BlockDrafterTrainConfig:
    """The second stage of the shipped DFly: `dfly_shipped`'s drafter (pass it as init_from) warm-started with the
    fused anchor input (anchor_fusion, zero at the start) and trained on for 4,000 more steps of the same rows
    (8.2M tokens) on e2e TV alone (the LK cold start was the first stage's), on a cosine from lr 5e-4. From
    scratch on `dfly_shipped_dv`'s schedule, the fused input raised the evaluation server's first-draft acceptance
    from 0.45 to 0.60 and MAL by about 0.2 at 600-800 steps (`.cache/exp/dfly_af` against `dfly_dv`)."""
    return replace(dfly_shipped(), anchor_fusion=True, steps=4000, switch_step=0, lr=5e-4, warmup=50)


def dflash_embedded() -> BlockDrafterTrainConfig:
    """DFlash (no sequential head) with the same budget and taps as `dfly_embedded`: the ablation's baseline."""
    return BlockDrafterTrainConfig(drafter="dflash", head="none", target_layer_ids=EMBEDDED_TAPS,
                                   taps_for_depth=EMBEDDED_DEPTH)


def dflare_embedded() -> BlockDrafterTrainConfig:
    """DFlare (per-layer fusion, no head) with the same budget and taps as `dfly_embedded`."""
    return BlockDrafterTrainConfig(drafter="dflare", head="none", target_layer_ids=EMBEDDED_TAPS,
                                   taps_for_depth=EMBEDDED_DEPTH)


def dspark_embedded() -> BlockDrafterTrainConfig:
    """DSpark for the embedded target: DFlash backbone, rank-64 Markov head, confidence head, the three-term
    DSpark loss with w_k = exp(−(k−1)/γ), γ = K."""
    return BlockDrafterTrainConfig(drafter="dspark", head="markov", target_layer_ids=EMBEDDED_TAPS,
                                   taps_for_depth=EMBEDDED_DEPTH, objective="dspark")


def dspark_shipped() -> BlockDrafterTrainConfig:
    """The DSpark that ships with the embedded target: `dspark_embedded`'s recipe (Markov head, confidence head,
    three-term loss) in `dfly_shipped`'s shape and data, for a third of the flagships' 10M-token budget (1,650
    steps, 3.4M tokens; its first 520 steps ran on a 2,300-step cosine, then the run was resumed with steps=1650).
    It was trained before the DSpark defaults changed, so the preset keeps what it was trained with (and `make
    drafters` keeps resuming its run): DFlash's shared fused context with an fc bias, L_TV = ½‖p − q‖₁ and the
    "tv" confidence head."""
    return replace(dspark_embedded(), draft_layers=1, intermediate_size=512, draft_vocab_size=1024, batch_size=4,
                   num_anchors=32, steps=1650, warmup=50, ckpt_every=200, log_every=20,
                   context_injection="shared", fc_bias=True, tv_norm="half_l1", confidence_target="tv")


def dspark_shipped_af() -> BlockDrafterTrainConfig:
    """The second stage of the shipped DSpark: `dspark_shipped`'s drafter (pass it as init_from) warm-started with
    the fused anchor input (see `dfly_shipped_af`) and trained on for 4,000 more steps (8.2M tokens; with the first
    stage's 3.4M, 11.6M in all) on a cosine from lr 5e-4. (The shipped weights ran the first 1,600 steps on a
    1,600-step cosine; the run was then resumed with steps=4000, its curve still rising: the rate went back up to
    about two thirds of its peak and annealed again.)"""
    return replace(dspark_shipped(), anchor_fusion=True, steps=4000, lr=5e-4, warmup=50)


def confidence_only() -> BlockDrafterTrainConfig:
    """The schedule of a confidence-only run (`--init-from DIR --only confidence`, any block kind; the default preset
    there): 4 × 512-token rows with 32 anchors per step, as `dfly_shipped`, for 200 steps at lr 3e-3 (the head is
    a linear layer over frozen features, so a larger rate is safe). The design comes from the folder. On the shipped
    DFly and its rollouts (one thread on a busy 2-core machine: about 2 s a step, 7 minutes in all), 50 steps already
    cut the T = 1 over-prediction of D-cut's committed tokens from 28% to 9% on the held-out prompts
    (`benchmarks/confidence_protocol.py`); 200 steps bring the in-distribution cumulative ECE to 0.026 / 0.024 at
    T = 0 / 1 (the tv head: 0.034 / 0.071)."""
    return BlockDrafterTrainConfig(batch_size=4, num_anchors=32, steps=200, lr=3e-3, warmup=20, ckpt_every=50,
                                   log_every=20)


def tiny_debug() -> BlockDrafterTrainConfig:
    """Seconds: 3 steps on 2 short rows, block 5 (K = 4 drafts, the CLI's default depth), one draft layer, 4
    anchors; switches objective after step 1. The kind (and its default head) comes from --drafter."""
    return BlockDrafterTrainConfig(block_size=5, draft_layers=1, intermediate_size=64, markov_rank=8, num_anchors=4,
                                   seq_len=64, batch_size=2, steps=3, warmup=1, switch_step=1, ckpt_every=2,
                                   log_every=1)


QWEN3_TOP_K = 10_000  # the report's teacher support K (§2.3); at V = 152k full-vocabulary targets are ~15x larger


def qwen3_8b_dfly() -> BlockDrafterTrainConfig:
    """The report's DFly for Qwen3-8B (§3.5, L5-B8), and the preset `train` picks for any target of 0.5B
    parameters or more: 5 draft layers of the target's shape, DFlash taps (1, 9, 17, 25, 33 on Qwen3-8B's 36
    layers; spread over any target's depth), hidden-correction head, the mask token from the tokenizer (on Qwen3,
    which declares none, its reserved row 151669; `train.runs.with_mask_token`), 3k-token rows with 64 anchors, the
    teacher's top 10,000 tokens as the distillation support (the report's K; the whole 152k vocabulary would hold
    [rows, anchors, K, V] teacher probabilities). The schedule is a starting point for a GPU run, not a tuned
    recipe."""
    return BlockDrafterTrainConfig(drafter="dfly", head="hidden", block_size=8, draft_layers=5, markov_rank=256,
                                   num_anchors=64, seq_len=3072, batch_size=8,
                                   steps=20_000, switch_step=2_000, lr=6e-4, warmup=500, ckpt_every=1_000,
                                   log_every=50, top_k=QWEN3_TOP_K)


def qwen3_8b_dspark() -> BlockDrafterTrainConfig:
    """DSpark for Qwen3-8B (DSpark report §3): DFlash backbone L5-B8 with same-layer injection, rank-256 Markov head,
    confidence head, the three-term loss; same data budget and teacher top-K as `qwen3_8b_dfly`."""
    return replace(qwen3_8b_dfly(), drafter="dspark", head="markov", objective="dspark")


PRESETS = {"dfly_embedded": dfly_embedded, "dfly_demo": dfly_demo, "dfly_shipped": dfly_shipped,
           "dfly_shipped_dv": dfly_shipped_dv, "dfly_shipped_af": dfly_shipped_af,
           "dspark_shipped": dspark_shipped, "dspark_shipped_af": dspark_shipped_af, "confidence_only": confidence_only,
           "dflash_embedded": dflash_embedded,
           "dflare_embedded": dflare_embedded, "dspark_embedded": dspark_embedded, "tiny_debug": tiny_debug,
           "qwen3_8b_dfly": qwen3_8b_dfly, "qwen3_8b_dspark": qwen3_8b_dspark}


# ----- pieces -----


MASK_TOKEN_WORDS = ("mask", "reserved", "unused")  # names of special tokens a mask token can be taken from


def mask_token_candidates(tokenizer: Any, vocab_size: int, limit: int = 3) -> list[tuple[int, str]]:
    """Ids a block drafter could use as its mask token, as (id, description): the tokenizer's special tokens whose
    names say they are free (`MASK_TOKEN_WORDS`, e.g. Llama 3's <|reserved_special_token_0|>), then the first
    embedding row beyond the tokenizer's tokens (Qwen3's 151669, DFlash's choice), at most `limit`."""
    out: list[tuple[int, str]] = []
    backend = getattr(tokenizer, "backend", None)
    added = backend.get_added_tokens_decoder() if hasattr(backend, "get_added_tokens_decoder") else {}
    for token_id, token in sorted(added.items()):
        content = str(getattr(token, "content", token))
        if getattr(token, "special", True) and any(w in content.lower() for w in MASK_TOKEN_WORDS) \
                and token_id < vocab_size:
            out.append((int(token_id), content))
    size = len(tokenizer) if hasattr(tokenizer, "__len__") else vocab_size
    if size < vocab_size:
        out.append((size, "an embedding row no token of the tokenizer uses"))
    return out[:limit]


def resolve_mask_token(tokenizer: Any, override: int | None, vocab_size: int) -> int:
    """The mask token id: `override`, else the tokenizer's `mask_token_id`; ConfigError when there is none (naming
    the ids that could serve, `mask_token_candidates`) or it lies outside the target's vocabulary (its embedding
    rows: a reserved row that no token of the tokenizer uses, as Qwen3's 151669, is a valid mask token)."""
    mask = override if override is not None else getattr(tokenizer, "mask_token_id", None)
    if mask is None:
        candidates = mask_token_candidates(tokenizer, vocab_size)
        hint = ("; candidates: " + ", ".join(f"mask_token_id={i} ({what})" for i, what in candidates)
                if candidates else "")
        raise ConfigError("the target's tokenizer has no mask token: block drafters fill the draft positions with "
                          f"the embedding of a reserved token; pass mask_token_id=<an unused special token id>{hint}")
    if not 0 <= mask < vocab_size:
        raise ConfigError(f"mask token id {mask} is not in the target's vocabulary (ids 0..{vocab_size - 1}): "
                          "pick a reserved special token")
    return int(mask)


def row_anchors(batch: PackedBatch, num_anchors: int, seed: int, step: int, global_rows: list[int]
                ) -> tuple[Tensor, Tensor]:
    """Anchors [R, N] and their validity [R, N] for this rank's rows, on the batch's device; row r's draw depends only
    on (seed, step, its position in the global batch), so resume and data parallelism replay it exactly. The draw runs
    on the host with a CPU generator (the same anchors on every device) and the result is moved."""
    loss_mask, document_ids = batch.loss_mask.cpu(), batch.document_ids.cpu()
    out = []
    for r, g in enumerate(global_rows):
        gen = torch.Generator().manual_seed(((seed * 1_000_003 + step) * 4_099 + g) % (2**63))
        out.append(sample_anchors(loss_mask[r: r + 1], num_anchors, document_ids=document_ids[r: r + 1],
                                  generator=gen))
    device = batch.loss_mask.device
    return torch.cat([a for a, _ in out]).to(device), torch.cat([v for _, v in out]).to(device)


ConfidenceTargets = Callable[[LossBatch], Tensor]  # a batch (or chunk) -> its confidence head's targets


def block_loss_batch(out: BlockTrainOutput, teacher_logits: Teacher,
                     confidence_targets: ConfidenceTargets | None = None) -> LossBatch:
    """The losses' [N, K, V] layout of a `forward_train` run with compute_logits=True, N = R·N anchors; teacher of
    draft k of anchor a: the target's distribution at a+k−1; the confidence head's targets from
    `confidence_targets` of the batch (None: α). The reference for `block_chunked_loss_batch`: it holds the whole
    [R·N, K, V] student and teacher logits."""
    assert out.logits is not None
    R, N, K, V = out.logits.shape
    t = out.targets
    teacher_logits = as_teacher_logits(teacher_logits)
    teacher = teacher_logits.gather(1, t.source_index.flatten(1)[..., None].expand(-1, -1, V)).view(R, N, K, V)
    lb = LossBatch(student_logits=out.logits.flatten(0, 1), mask=t.valid.flatten(0, 1),
                   teacher_logits=teacher.flatten(0, 1), labels=t.labels.flatten(0, 1),
                   confidence_logits=None if out.confidence_logits is None else out.confidence_logits.flatten(0, 1))
    if confidence_targets is None or lb.confidence_logits is None:
        return lb
    with torch.no_grad():
        return replace(lb, confidence_targets=confidence_targets(lb))


def block_chunked_loss_batch(model: BlockDrafter, out: BlockTrainOutput, teacher_logits: Teacher, *,
                             max_logits: int | None = None, track_alpha: bool = False,
                             confidence_targets: ConfidenceTargets | None = None,
                             train_vocab: str = "full") -> ChunkedLossBatch:
    """`block_loss_batch` without the [R·N, K, V] logits: a `forward_train(compute_logits=False)` run's backbone
    states go through `model.head_logits` a chunk of anchors at a time (whole blocks, so the RNN head sees its K
    positions together), at most `max_logits` logits per chunk (default: from the device's memory,
    `train.losses.loss_chunk_logits`; `train.losses.ChunkedLossBatch`); the confidence targets, too, come from each
    chunk's logits. The teacher is the target's logits [R, T, V] or, as the trainer passes it, a `TeacherHead`: its
    LM head then runs inside each chunk on the chunk's K positions per anchor (no [R, T, V] tensor). `train_vocab`
    "draft": the head scores the draft vocabulary only and the losses run in the draft space
    (`train.losses.to_draft_space`); chunks stay sized by the teacher's whole vocabulary."""
    t = out.targets
    R, N, K, _ = out.hidden.shape
    T, V = teacher_logits.shape[1:]
    prev = t.prev_tokens.flatten(0, 1)  # [R·N, K]
    src = (t.source_index + T * torch.arange(R, device=prev.device)[:, None, None]).flatten(0, 1)  # [R·N, K] flat
    if isinstance(teacher_logits, TeacherHead):
        head, flat_states = teacher_logits, teacher_logits.states.reshape(R * T, -1)

        def teacher(rows: slice) -> Tensor:
            return head.logits(flat_states[src[rows]])  # [n, K, V]
    else:
        flat_teacher = teacher_logits.reshape(R * T, V)

        def teacher(rows: slice) -> Tensor:
            return flat_teacher[src[rows]]
    max_logits = loss_chunk_logits(prev.device) if max_logits is None else max_logits
    draft = train_vocab == "draft" and bool(model.config.draft_vocab_size)
    return ChunkedLossBatch(
        hidden=tuple(out.hidden.flatten(0, 1).unbind(1)),
        head=lambda z, rows: model.head_logits(z, prev[rows], confidence=False, draft_vocab=draft)[0],
        mask=t.valid.flatten(0, 1), chunk_rows=ChunkedLossBatch.rows_for(max_logits, K, V),
        teacher=teacher, labels=t.labels.flatten(0, 1),
        confidence_logits=None if out.confidence_logits is None else out.confidence_logits.flatten(0, 1),
        confidence_targets=confidence_targets, track_alpha=track_alpha,
        draft_vocab=model.draft_vocab if draft else None)


def check_sp_design(cfg: BlockDrafterConfig, sp: SequenceParallel) -> None:
    """Raise ConfigError for a design sequence parallelism cannot train: the fused anchor input reads each anchor's
    previous position, which a shard lacks for its first anchor."""
    if sp.enabled and cfg.anchor_fusion:
        raise ConfigError("anchor_fusion needs each anchor's previous position, which a sequence-parallel shard "
                          "lacks for its first anchor: train it without sequence parallelism (--sp 1), or with "
                          "anchor_fusion=false")


def block_forward_train(model: BlockDrafter, taps: Tensor, batch: PackedBatch, anchors: Tensor, valid: Tensor,
                        sp: SequenceParallel | None = None, *, checkpoint_layers: bool = False) -> BlockTrainOutput:
    """`model.forward_train` of a training step without logits (the trainer's head runs in chunks): taps [R, T, n·C]
    of `batch`'s rows, anchors and valid [R, N] drawn on the whole rows (`row_anchors`).

    Under sequence parallelism (`sp`, `train.sequence_parallel`) taps hold only this rank's shard [R, T/N, n·C]: the
    backbone runs for the valid anchors inside the shard (`shard_anchors`, padded to the same count on every rank)
    with the Ulysses attention over all ranks' anchors and the whole rows' context, and their labels, predecessors
    and teacher positions come from the shard plus its halo of B − 1 tokens (`SequenceParallel.window`; index the
    teacher logits of `sp.columns(T, B − 1)` with them)."""
    if sp is None or not sp.enabled:
        return model.forward_train(taps, batch.input_ids, batch.positions, anchors, document_ids=batch.document_ids,
                                   loss_mask=batch.loss_mask, anchor_valid=valid, compute_logits=False,
                                   backbone=BackboneOptions(checkpoint_layers=checkpoint_layers))
    check_sp_design(model.config, sp)
    Bk = model.config.block_size
    mine = shard_anchors(anchors, valid, sp, batch.seq_len)
    win = sp.window(batch, Bk - 1)
    targets = block_targets(win.input_ids, mine.local, Bk, document_ids=win.document_ids, loss_mask=win.loss_mask,
                            anchor_valid=mine.local_valid)
    return model.forward_train(taps, sp.shard(batch.input_ids), sp.shard(batch.positions), mine.local,
                               anchor_valid=mine.local_valid, compute_logits=False, targets=targets,
                               backbone=BackboneOptions(checkpoint_layers=checkpoint_layers,
                                                        block_attention=block_attention(sp, mine, Bk,
                                                                                        batch.document_ids)))


def confidence_loss(confidence_logits: Tensor, targets: Tensor, mask: Tensor, denominator: Tensor) -> Tensor:
    """Σ_valid BCE(c, sg[target]) / denominator: confidence logits and their targets (`train.confidence.
    confidence_targets`) [M, K] or [M, K, n] (averaged over a "protocol" head's n temperatures), mask [M, K] -> [].
    The reference for `train.losses.with_confidence_term`, which the trainer runs chunk by chunk."""
    return confidence_bce(confidence_logits[mask], targets[mask]).sum() / denominator.clamp_min(1)


def check_init_from(cfg: BlockDrafterTrainConfig, out_dir: Path) -> None:
    """Refuse an `init_from` folder that is missing or that the run would overwrite (--out, or inside it)."""
    if cfg.init_from is None:
        return
    source = Path(cfg.init_from)
    if not (source / "config.json").is_file():
        raise ConfigError(f"init_from={source} is not a drafter folder (no config.json): pass the folder of a "
                          "trained block drafter")
    src, out = source.resolve(), out_dir.resolve()
    if src == out or out in src.parents:
        raise ConfigError(f"init_from={source} lies in --out {out_dir}, which the run writes: pick another --out")


def check_init_weights(cfg: BlockDrafterTrainConfig, weights: Callable[[], str]) -> None:
    """Refuse an `init_from` folder whose config.json records the weights of another target than this run's
    (`weights()`: its `target_weights_id`, computed only when the folder records one); a folder that records none is
    checked on the config fingerprint alone (when it is loaded)."""
    if cfg.init_from is None:
        return
    from angelspec.decoding.loading import other_weights
    from angelspec.fileio import read_json_object

    meta = (read_json_object(Path(cfg.init_from) / "config.json") or {}).get("angelspec")
    problem = other_weights(meta.get("target_weights") if isinstance(meta, dict) else None, weights)
    if problem is not None:
        raise ConfigError(f"init_from={cfg.init_from} was trained for a target with {problem}; pass --target with "
                          "the drafter's own target, or train this one from scratch (no --init-from)")


def warm_start_drafter(folder: str | Path, target: Decoder, *, kind: str, anchor_fusion: bool, seed: int,
                       init_std: float) -> BlockDrafter:
    """The block drafter in `folder` (of `kind`, trained for `target`) to train on, on the target's device and dtype:
    its design, weights and draft vocabulary, plus the fused anchor input when `anchor_fusion` asks for it and the
    folder has none (W_a at zero: the drafter proposes exactly what the folder's does until training moves it).
    Raises ConfigError for a folder of another kind or target."""
    source = init_from_drafter(folder, target, kind=kind)
    cfg = replace(source.config, anchor_fusion=source.config.anchor_fusion or anchor_fusion)
    model = new_block_drafter(cfg, target, seed=seed, init_std=init_std)
    missing, unexpected = model.load_state_dict(source.state_dict(), strict=False)
    assert not unexpected and set(missing) <= {"anchor_fuse.weight", "anchor_norm.weight"}, (missing, unexpected)
    return model


# ----- training -----


def train_block_job(job: TrainJob, cfg: BlockDrafterTrainConfig) -> dict[str, Any]:
    """Train the block-parallel drafter of `cfg` (kind `cfg.drafter`) for `job` (the `Trainer` arguments)."""
    check_init_from(cfg, job.out_dir)
    run = start_run(job, batch_size=cfg.batch_size, seq_len=cfg.seq_len, error=ConfigError)
    info, sp = run.info, run.sp
    target, tok = run.frozen_target(cfg.features)
    tcfg = target.config
    # Everything about the design is checked before anything is written.
    if cfg.only is not None:  # only=confidence: the design and weights are the folder's
        model = confidence_only_drafter(cfg.init_from, target, kind=cfg.kind, confidence_target=cfg.confidence_target,
                                        temperatures=cfg.protocol_temperatures, seed=cfg.seed, init_std=cfg.init_std)
        mcfg = model.config
    elif cfg.init_from is not None:  # a warm start: the folder's drafter, all of it trained
        model = warm_start_drafter(cfg.init_from, target, kind=cfg.kind, anchor_fusion=cfg.anchor_fusion,
                                   seed=cfg.seed, init_std=cfg.init_std)
        mcfg = model.config
    else:
        mcfg = cfg.model_config(tcfg, resolve_mask_token(tok, cfg.mask_token_id, tcfg.vocab_size))
    check_init_weights(cfg, lambda: run.target_weights(target))  # after the folder's config check, which is clearer
    kind = mcfg.drafter
    sp.check_heads(mcfg.layer_config().num_attention_heads)
    check_sp_design(mcfg, sp)
    cfg.check_train_vocab(ConfigError, draft_vocab_size=mcfg.draft_vocab_size)  # init_from: the folder's vocabulary
    run.clear_out_dir()
    rows, stats = packed_conversations(tok, job.data, cfg, pad_token_id(tcfg), run.log)
    features = target_features(target, list(mcfg.target_layer_ids), cfg.features, rows, target_dir=run.target_dir,
                               data=job.data, enable_thinking=cfg.enable_thinking, sp=sp, halo=mcfg.block_size - 1,
                               halo_what=f"B - 1 for blocks of {mcfg.block_size}")

    if cfg.init_from is None:
        model = new_block_drafter(mcfg, target, seed=cfg.seed, init_std=cfg.init_std)
    if mcfg.draft_vocab_size and cfg.init_from is None:  # inference drafts from it; training too under "draft"
        counts = count_tokens(rows.packed.input_ids, rows.packed.loss_mask, tcfg.vocab_size)
        model.set_draft_vocab(frequent_tokens(counts, mcfg.draft_vocab_size, always=tcfg.eos_token_ids))

    def objective_at(step: int) -> Objective:
        """The schedule's objective at `step`, with the confidence term under "dfly" when there is a head; the
        confidence term alone in a confidence-only run ("dspark" has its own)."""
        base = NO_LOSS if objective == "confidence" else get_loss(schedule.name_at(step))
        return with_confidence_term(base, cfg.conf_coef) if mcfg.confidence_head and objective != "dspark" else base

    def chunk_targets(m: BlockDrafter, lb: LossBatch) -> Tensor:
        """What the confidence head is fitted to (`train.confidence`), from a chunk's logits, detached."""
        return confidence_targets(mcfg, lb.student_logits.detach(), lb.teacher_logits, lb.mask, cfg.top_k,
                                  m.draft_vocab if mcfg.draft_vocab_size else None,
                                  draft_columns=lb.draft_vocab is not None)

    def forward_loss(m: BlockDrafter, taps: Tensor, batch: PackedBatch, anchors: Tensor, valid: Tensor,
                     teacher: Teacher, step: int, log_alpha: bool) -> tuple[Tensor, Tensor]:
        """Backbone, head and loss in one forward, in memory linear in T: no mask, no [R·N, K, V] logits
        (`anchored_block_attention`, `block_chunked_loss_batch`); inside the wrapped forward, where FSDP2 has the
        parameters gathered. -> (this rank's share of the loss, α per block position or [])."""
        o = block_forward_train(m, taps, batch, anchors, valid, sp, checkpoint_layers=cfg.activation_checkpointing)
        clb = block_chunked_loss_batch(m, o, teacher, track_alpha=log_alpha,
                                       confidence_targets=lambda lb: chunk_targets(m, lb), train_vocab=cfg.train_vocab)
        lo = scheduled_loss(schedule, step, clb, info, objective_at(step))
        return lo.loss, lo.parts.get("alpha_per_depth", lo.loss.new_zeros(0))  # tensors, so DDP / FSDP2 hook them

    wrapped = wrap_model(FunctionModule(model, forward_loss), run.strategy, info)
    opt = build_adamw(model, cfg.lr, cfg.weight_decay)
    schedule, objective = cfg.schedule(), cfg.resolved_objective
    meta = {"target_weights": run.target_weights(target), "train_config": json.loads(json.dumps(asdict(cfg))),
            "objective": objective,
            "confidence_target": mcfg.confidence_target}
    global_rows = list(range(cfg.batch_size))
    if sp.dp.enabled:
        global_rows = shard_rows(global_rows, sp.dp)  # an SP group's ranks draw the same anchors
    step, model_to_save, save_ckpt = drafter_checkpoints(
        run, cfg, tcfg.fingerprint(), model, lambda: BlockDrafter(mcfg, target.embed_tokens, target.lm_head),
        lambda m, p: save_block_drafter(m, p, meta), opt, target=target, rows=rows)

    def step_loss(wrapped: torch.nn.Module, step: int, batch: PackedBatch, idx: list[int]
                  ) -> tuple[Tensor, Tensor, dict[str, Any]]:
        # The frozen target's taps and teacher (its final-norm states and LM head: the loss chunks make the logits),
        # no grad; under SP this rank's shard of the taps and the teacher of its shard and halo (`TargetFeatures`,
        # train.sequence_parallel).
        taps, teacher_logits = features(batch, idx)
        anchors, anchor_valid = row_anchors(batch, cfg.num_anchors, cfg.seed, step, global_rows)  # [R, N] each
        loss, alpha = wrapped(concat_taps(taps), batch, anchors, anchor_valid, teacher_logits, step,
                              logs_after(step + 1, cfg))
        extra: dict[str, Any] = {"valid_anchors": anchor_valid.sum()}
        if objective == "confidence":  # the confidence head alone: no drafter loss
            extra["objective"] = objective
        return loss, alpha, extra

    step = train_drafter_steps(run, cfg, step, Trainee(model, wrapped, opt, save_ckpt), rows=rows, schedule=schedule,
                               step_loss=step_loss, desc=kind, alpha_label="a1", features=features)
    final = model_to_save()
    report = run.drafter_report({"drafter": kind, "steps": step, "head": mcfg.head, "block_size": mcfg.block_size,
                                 "draft_layers": mcfg.num_draft_layers,
                                 "target_layer_ids": list(mcfg.target_layer_ids), "objective": objective},
                                model, stats, rows, tcfg, features)
    run.finish(report, lambda: save_block_drafter(final, run.out_dir, meta))
    del wrapped  # the DDP / FSDP2 wrapper must go before its process group (shutdown collects it)
    shutdown(info)
    return report


train_block_drafter = trainer(train_block_job, dfly_embedded, "train_block_drafter",
                              "A block-parallel drafter of the config's kind (`train.config.Trainer`; default preset "
                              "`dfly_embedded`).")


def _kind_trainer(kind: str, default: Callable[[], BlockDrafterTrainConfig]) -> Trainer:
    """The entry point `angelspec train --drafter KIND` calls: `train_block_job` with the kind pinned to `kind` (a
    preset of another kind is refused) and `default` as the default preset."""
    return trainer(lambda job, cfg: train_block_job(job, cfg.for_kind(kind)), default, f"train_{kind}",
                   f"`angelspec train --drafter {kind}` (`train.config.Trainer`; default preset `{default.__name__}`).")


train_dflash = _kind_trainer("dflash", dflash_embedded)
train_dflare = _kind_trainer("dflare", dflare_embedded)
train_dfly = _kind_trainer("dfly", dfly_embedded)
train_dspark = _kind_trainer("dspark", dspark_embedded)
KIND_TRAINERS = {"dflash": train_dflash, "dflare": train_dflare, "dfly": train_dfly, "dspark": train_dspark}
