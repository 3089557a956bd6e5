"""`angelspec train --drafter mtp`: the shared-parameter MTP drafter with Training-Time Test (report §2).

Per step: a batch of packed rows (document-aware packing, §6.3) -> frozen target forward under no_grad
(online features: the tap h_i and the teacher logits; or, with `features=DIR`, the same tensors read from an
offline cache made by `angelspec features`, see `TargetFeatures`) -> TTT rollout of the MTP block for D depths
(`train.ttt`) -> a loss from `train.losses` chosen by name, by default the report's two-stage recipe
(LK^α cold start, then e2e TV, via `LossSchedule`) -> AdamW, warm-up + cosine, gradient clipping.

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

EAGLE-3 (`train.eagle3`) is trained by this same loop: only the block (`Eagle3Block`, three target taps joined
by `concat_taps`) and the presets differ.

Output folder: `config.json` (`"angelspec": {"drafter": "mtp" | "eagle3", "target_fingerprint": ..., ...}`) and
`model.safetensors` with the block's own weights (the embedding and LM head stay the target's).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from angelspec.data.chat import encode_conversation
from angelspec.data.features import (
    FeatureCacheError,
    FeatureSpec,
    OfflineFeatureCache,
    dataset_identity,
    dtype_name,
)
from angelspec.data.lm_data import read_jsonl
from angelspec.data.packing import Doc, PackedBatch, pack_documents, packing_report
from angelspec.data.vocab import count_tokens, frequent_tokens
from angelspec.models.config import DecoderConfig
from angelspec.models.decoder import Decoder
from angelspec.models.hf_io import load_target
from angelspec.models.mtp import MTPConfig, concat_taps
from angelspec.models.mtp import MTPDraftModel as MTPBlock
from angelspec.models.mtp import MTPFamilyConfig as DraftBlockConfig
from angelspec.models.mtp_io import build_mtp_model as build_block
from angelspec.models.mtp_io import save_mtp
from angelspec.train.distributed import DistInfo, FunctionModule, shard_rows, shutdown, wrap_model
from angelspec.train.draft_lm import _data_domains
from angelspec.train.loop import TrainRun, drafter_checkpoints, scheduled_loss, start_run, train_drafter_steps
from angelspec.train.losses import LossBatch, LossConfig, LossSchedule, get_loss
from angelspec.train.optim import build_adamw
from angelspec.train.ttt import TTTOutput, mtp_loss_batch, ttt_rollout


@dataclass(frozen=True)
class BlockTrainConfig:
    """Block shape (None = the target's), objective and optimisation of one MTP-family training run.

    Subclasses add the target taps and build the block config (`block_config`): `MTPTrainConfig` (one tap),
    `train.eagle3.Eagle3TrainConfig` (three); `train_mtp` trains either."""

    num_depths: int = 3  # D, the TTT unroll (the report's MTP-3)
    ttt: bool = True  # False: teacher-forced base MTP, one depth
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    intermediate_size: int | None = None
    loss: str = "e2e_tv"  # final objective, a name in train.losses.LOSSES
    cold_start_loss: str | None = "lk_alpha"  # None: `loss` from the first step
    switch_step: int = 100
    top_k: int | None = None  # teacher support for KL / TV / α (None = full vocabulary)
    enable_thinking: bool = False
    activation_checkpointing: bool = False  # recompute each depth in the backward (ttt_rollout checkpoint_depths)
    seq_len: int = 512
    batch_size: int = 4  # packed rows per step
    steps: int = 300
    lr: float = 1e-3
    min_lr_ratio: float = 0.05
    warmup: int = 20
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    init_std: float = 0.02
    seed: int = 0
    ckpt_every: int = 50
    log_every: int = 10
    features: str | None = None  # an offline feature cache (`angelspec features`) instead of the target forward
    draft_vocab_size: int = 0  # >0: inference drafts from the N most frequent trained-on tokens (data.vocab)

    def __post_init__(self) -> None:
        get_loss(self.loss)
        if self.cold_start_loss is not None:
            get_loss(self.cold_start_loss)
        for name in ("num_depths", "seq_len", "batch_size", "steps", "ckpt_every", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{type(self).__name__}.{name} must be >= 1, got {getattr(self, name)}")

    def block_config(self, target: DecoderConfig) -> DraftBlockConfig:
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
class MTPTrainConfig(BlockTrainConfig):
    """An MTP run: the block conditions on one target tap."""

    target_layer_id: int | None = None  # None: the target's last layer

    def block_config(self, target: DecoderConfig) -> MTPConfig:
        return MTPConfig.for_target(target, num_depths=self.num_depths, target_layer_id=self.target_layer_id,
                                    num_attention_heads=self.num_attention_heads,
                                    num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
                                    intermediate_size=self.intermediate_size)


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


def mtp_base() -> MTPTrainConfig:
    """The base-MTP comparison point of Table 2: teacher-forced, one depth, hard-label CE."""
    return MTPTrainConfig(ttt=False, num_depths=1, loss="ce", cold_start_loss=None)


def tiny_debug() -> MTPTrainConfig:
    """Seconds: 3 steps on 2 short rows, switching objective after step 1."""
    return MTPTrainConfig(intermediate_size=64, seq_len=64, batch_size=2, steps=3, warmup=1, switch_step=1,
                          ckpt_every=2, log_every=1)


PRESETS = {"mtp_embedded": mtp_embedded, "mtp_demo": mtp_demo, "mtp_base": mtp_base, "tiny_debug": tiny_debug}


# ----- data -----


def load_conversations(tokenizer: Any, data: Path, seq_len: int, enable_thinking: bool = False
                       ) -> tuple[list[Doc], dict[str, int]]:
    """Tokenise every conversation with the chat template + assistant loss mask, cut to `seq_len` tokens.

    Returns the documents (in file order) and counts; raises ValueError when no assistant token is left."""
    docs: list[Doc] = []
    stats = {"conversations": 0, "skipped_no_assistant": 0, "truncated": 0, "assistant_tokens": 0}
    for name, (train_path, _) in _data_domains(Path(data)).items():
        for i, rec in enumerate(read_jsonl(train_path)):
            stats["conversations"] += 1
            messages = rec.get("messages") if isinstance(rec, dict) else None
            if not isinstance(messages, list):
                raise ValueError(f"{train_path} record {i}: expected {{\"messages\": [...]}}")
            if not any(isinstance(m, dict) and m.get("role") == "assistant" for m in messages):
                stats["skipped_no_assistant"] += 1
                continue
            enc = encode_conversation(tokenizer, messages, enable_thinking=enable_thinking, max_length=seq_len)
            stats["truncated"] += enc.num_truncated > 0
            # Only tokens that some depth can predict count: x_{i+2} needs i >= 0, so not the first two.
            trained = int(sum(enc.loss_mask[2:]))
            stats["assistant_tokens"] += trained
            if trained:
                docs.append(Doc.from_encoded(enc, doc_id=f"{name}:{i}"))
    if not docs:
        raise ValueError(f"{data}: no assistant tokens to train on ({stats['conversations']} conversations, "
                         f"{stats['skipped_no_assistant']} without an assistant message); MTP training needs "
                         "conversations with non-empty assistant turns")
    return docs, stats


class PackedRows:
    """All documents packed once (first-fit decreasing); step s reads rows s·B .. s·B+B-1 of a per-epoch
    shuffle keyed by (seed, epoch): a pure function of (seed, step), so resuming replays the same batches."""

    def __init__(self, docs: list[Doc], seq_len: int, pad_id: int, seed: int) -> None:
        self.packed = pack_documents(docs, seq_len, pad_id=pad_id)
        self.seed = seed
        self._perm: tuple[int, np.ndarray] | None = None

    def _permutation(self, epoch: int) -> np.ndarray:
        if self._perm is None or self._perm[0] != epoch:
            self._perm = (epoch, np.random.default_rng([self.seed, epoch]).permutation(self.packed.num_rows))
        return self._perm[1]

    def rows(self, step: int, batch_size: int) -> list[int]:
        """The packed-row indices of global batch `step`."""
        out = []
        for g in range(step * batch_size, (step + 1) * batch_size):
            epoch, r = divmod(g, self.packed.num_rows)
            out.append(int(self._permutation(epoch)[r]))
        return out

    def local_rows(self, step: int, batch_size: int, dist_info: DistInfo | None = None) -> list[int]:
        """The row indices of global batch `step`, or of this rank's slice of it when `dist_info` is given."""
        idx = self.rows(step, batch_size)
        return shard_rows(idx, dist_info) if dist_info is not None and dist_info.enabled else idx

    def batch(self, step: int, batch_size: int, dist_info: DistInfo | None = None) -> PackedBatch:
        """Global batch `step`, or this rank's slice of it when `dist_info` is given."""
        return self.take(self.local_rows(step, batch_size, dist_info))

    def take(self, idx: list[int]) -> PackedBatch:
        """Packed rows `idx` as one batch [len(idx), seq_len]."""
        p = self.packed
        t = torch.tensor(idx)
        return PackedBatch(input_ids=p.input_ids[t], labels=p.labels[t], loss_mask=p.loss_mask[t],
                           document_ids=p.document_ids[t], positions=p.positions[t],
                           row_docs=tuple(p.row_docs[i] for i in idx),
                           num_tokens=int((p.document_ids[t] >= 0).sum()), num_truncated=0, truncated_tokens=0)


def pad_token_id(cfg: DecoderConfig) -> int:
    """The id that fills packed rows: the target's pad token, else its first EOS token, else 0."""
    return cfg.pad_token_id if cfg.pad_token_id is not None else (cfg.eos_token_ids or (0,))[0]


# ----- target features: online or from an offline cache -----


class TargetFeatures:
    """The frozen target's taps and teacher logits for a step's rows: `taps, logits = features(batch, rows)`.

    Online (`cache` None): the target's forward under no_grad. Offline: the rows' hidden states read from an
    `OfflineFeatureCache` made by `build_feature_cache` (`angelspec features`), and the teacher logits
    recomputed from the last layer's tap as `lm_head(norm(h_{L-1})).float()`, the very ops of the target's
    forward, while the cache stores D values per token and layer instead of V logits. The cache computes one
    row per forward and the online path a whole batch: the same values wherever the kernels treat rows
    independently (CPU: tested bit for bit, same losses and weights); elsewhere (e.g. GPU GEMMs picking tiles
    by batch size) they agree up to float rounding. The offline path still needs the target's embedding, final
    norm and LM head (the drafter shares them), not its layers' compute."""

    def __init__(self, target: Decoder, layer_ids: list[int] | tuple[int, ...],
                 cache: OfflineFeatureCache | None = None) -> None:
        self.target, self.layer_ids, self.cache = target, tuple(layer_ids), cache
        self.last = target.config.num_hidden_layers - 1

    @property
    def source(self) -> str:
        return "online" if self.cache is None else str(self.cache.root)

    @torch.no_grad()
    def __call__(self, batch: PackedBatch, rows: list[int]) -> tuple[list[torch.Tensor], torch.Tensor]:
        """`batch` [B, T] = packed rows `rows` -> one tap [B, T, D] per layer id, teacher logits [B, T, V] fp32."""
        t = self.target
        if self.cache is None:
            out = t(batch.input_ids, positions=batch.positions, document_ids=batch.document_ids,
                    hidden_layers=self.layer_ids)
            return list(out.hidden), out.logits
        fb = self.cache.rows(rows, sorted({*self.layer_ids, self.last})).to(batch.input_ids.device)
        if not torch.equal(fb.input_ids, batch.input_ids):
            raise FeatureCacheError(f"feature cache {self.cache.root}: rows {rows} hold other tokens than this run's "
                                    "packed rows; remake the cache with `angelspec features`")
        return [fb.hidden[i] for i in self.layer_ids], t.lm_head(t.norm(fb.hidden[self.last])).float()


def features_command(target_dir: Path, data: Path, out: str | Path, layer_ids: list[int], seq_len: int,
                     enable_thinking: bool) -> str:
    """The `angelspec features` command line that makes a cache for these settings."""
    layers = ",".join(str(i) for i in layer_ids)
    flags = (" --think" if enable_thinking else "") + (" --force" if Path(out).exists() else "")
    return (f"angelspec features --target {target_dir} --data {data} --out {out} --layers {layers} "
            f"--seq-len {seq_len}{flags}")


def target_features(target: Decoder, layer_ids: list[int], cache_dir: str | None, rows: PackedRows, *,
                    target_dir: Path, data: Path, enable_thinking: bool) -> TargetFeatures:
    """The features of a training run: online when `cache_dir` is None, else the cache at `cache_dir` after
    checking that it was made from this target (fingerprint), this packed dataset (rows, seq_len, tokens) and
    holds `layer_ids` plus the last layer; FeatureCacheError (with the command that makes a matching cache)
    otherwise."""
    if cache_dir is None:
        return TargetFeatures(target, layer_ids)
    need = sorted({*layer_ids, target.config.num_hidden_layers - 1})
    try:
        cache = OfflineFeatureCache.open(cache_dir, target=target)
        cache.require(need, dataset_identity(rows.packed))
    except FeatureCacheError as e:
        fix = features_command(target_dir, data, cache_dir, need, rows.packed.seq_len, enable_thinking)
        raise FeatureCacheError(f"features={cache_dir}: {e}. Make a matching cache with: {fix}") from None
    return TargetFeatures(target, layer_ids, cache)


def build_feature_cache(target_dir: str | Path, data: str | Path, out: str | Path, *,
                        layers: list[int] | tuple[int, ...] = (), seq_len: int = 512, enable_thinking: bool = False,
                        rows_per_shard: int = 32, resume: bool = False, force: bool = False,
                        log: Any = print) -> OfflineFeatureCache:
    """`angelspec features`: the offline feature cache that `features=DIR` trains from.

    Tokenises and packs `data` exactly as the trainers do (`load_conversations`, `PackedRows` with
    `seq_len` / `enable_thinking`), runs the target over every packed row (one row per forward, the row
    being the unit a trainer reads) and stores the hidden states of `layers` plus the last layer (its tap
    gives the teacher logits) in the target's dtype. Resumable (`resume=True`) after a kill."""
    from angelspec.data.tokenizer import load_tokenizer
    from angelspec.models.hf_io import load_target

    target_dir, data = Path(target_dir), Path(data)
    target = load_target(target_dir)
    docs, _ = load_conversations(load_tokenizer(target_dir), data, seq_len, enable_thinking)
    rows = PackedRows(docs, seq_len, pad_token_id(target.config), seed=0)
    ids = tuple(sorted({*layers, target.config.num_hidden_layers - 1}))
    spec = FeatureSpec(ids, with_logits=False, dtype=dtype_name(target.embed_tokens.weight.dtype))
    log(packing_report(rows.packed).format())
    log(f"caching layers {list(ids)} of {rows.packed.num_rows} rows to {out}")
    batches = (rows.take([r]) for r in range(rows.packed.num_rows))
    return OfflineFeatureCache.build(target, spec, batches, out, rows_per_shard=rows_per_shard, resume=resume,
                                     force=force, log=log,
                                     dataset=dataset_identity(rows.packed, source=str(data)))


# ----- training -----


def train_mtp(
    target_dir: str | Path,
    data: str | Path,
    out_dir: str | Path,
    *,
    config: BlockTrainConfig | None = None,
    resume: bool = False,
    force: bool = False,
    progress: bool = True,
    max_minutes: float | None = None,
    log: Any = print,
    distributed: str | None = None,
) -> dict[str, Any]:
    """Train an MTP-family drafter for the target at `target_dir` on `data`, write it to `out_dir`; returns a
    report. The kind follows the config: `MTPTrainConfig` (default `mtp_embedded()`) trains MTP,
    `Eagle3TrainConfig` EAGLE-3 (`train.eagle3.train_eagle3`).

    `distributed`: "auto"/None (DDP under a multi-process torchrun, else single process), "none", "ddp" or
    "fsdp2" (module docstring). `batch_size` is the global batch; it must divide by the number of processes."""
    cfg = config or mtp_embedded()
    run = start_run(target_dir, out_dir, batch_size=cfg.batch_size, distributed=distributed, log=log, force=force,
                    resume=resume)
    run.clear_out_dir(force, resume)
    target, tok = frozen_target(run.target_dir)
    tcfg = target.config
    pad_id = pad_token_id(tcfg)
    rows, stats = packed_conversations(tok, Path(data), cfg, pad_id, run.log)

    mcfg = replace(cfg.block_config(tcfg), draft_vocab_size=cfg.draft_vocab_size)
    features = target_features(target, list(mcfg.target_layer_ids), cfg.features, rows, target_dir=run.target_dir,
                               data=Path(data), enable_thinking=cfg.enable_thinking)
    kind = mcfg.drafter
    block = build_block(mcfg, target.embed_tokens, target.lm_head)
    block.init_weights(std=cfg.init_std, generator=torch.Generator().manual_seed(cfg.seed))
    if mcfg.draft_vocab_size:  # inference only: training still scores the whole vocabulary
        counts = count_tokens(rows.packed.input_ids, rows.packed.loss_mask, tcfg.vocab_size)
        block.set_draft_vocab(frequent_tokens(counts, mcfg.draft_vocab_size, always=tcfg.eos_token_ids))

    def rollout(b: MTPBlock, hidden: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor,
                document_ids: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
        out = ttt_rollout(b, hidden, input_ids, positions, document_ids, cfg.train_depths, pad_id=pad_id,
                          checkpoint_depths=cfg.activation_checkpointing)
        return out.logits, out.inputs, out.hidden  # a tuple, so DDP / FSDP2 find the outputs to hook

    # Parallelism is applied to the built block (the target stays unwrapped); the optimizer comes after,
    # since FSDP2 replaces the block's parameters by DTensor shards.
    model = wrap_model(FunctionModule(block, rollout), run.strategy, run.info)
    opt = build_adamw(block, cfg.lr, cfg.weight_decay)
    schedule = cfg.schedule()
    meta = {"train_config": json.loads(json.dumps(asdict(cfg)))}
    step, block_to_save, save_ckpt = drafter_checkpoints(
        run, cfg, tcfg.fingerprint(), block, lambda: build_block(mcfg, target.embed_tokens, target.lm_head),
        lambda m, p: save_mtp(m, p, meta), opt, resume)

    def step_loss(wrapped: torch.nn.Module, step: int, batch: PackedBatch, idx: list[int]
                  ) -> tuple[torch.Tensor, LossBatch, dict[str, Any]]:
        taps, teacher = features(batch, idx)  # the frozen target's taps and teacher logits, no grad
        out = TTTOutput(*wrapped(concat_taps(taps), batch.input_ids, batch.positions, batch.document_ids))
        lb = mtp_loss_batch(out, batch, teacher)
        return scheduled_loss(schedule, step, lb, run.info), lb, {}

    step = train_drafter_steps(run, cfg, step, model=block, wrapped=model, rows=rows, opt=opt, schedule=schedule,
                               step_loss=step_loss, save=save_ckpt, desc=kind, progress=progress,
                               max_minutes=max_minutes)
    final = block_to_save()
    report = drafter_report(run, {"drafter": kind, "steps": step, "ttt": cfg.ttt, "num_depths": cfg.num_depths},
                            block, stats, rows, tcfg, features)
    run.finish(report, lambda: save_mtp(final, run.out_dir, meta))
    del model  # the DDP / FSDP2 wrapper must go before its process group (shutdown collects it)
    shutdown(run.info)
    return report


def frozen_target(target_dir: Path) -> tuple[Decoder, Any]:
    """The target at `target_dir` with every parameter frozen, and its tokenizer."""
    from angelspec.data.tokenizer import load_tokenizer

    target = load_target(target_dir)
    for p in target.parameters():
        p.requires_grad_(False)
    return target, load_tokenizer(target_dir)


def packed_conversations(tokenizer: Any, data: Path, cfg: Any, pad_id: int, log: Any
                         ) -> tuple[PackedRows, dict[str, int]]:
    """`data`'s conversations (`load_conversations`) packed as the run's `cfg` says (seq_len, enable_thinking,
    seed), and their counts; logs the packing report."""
    docs, stats = load_conversations(tokenizer, data, cfg.seq_len, cfg.enable_thinking)
    rows = PackedRows(docs, cfg.seq_len, pad_id, cfg.seed)
    log(packing_report(rows.packed).format())
    return rows, stats


def drafter_report(run: TrainRun, head: dict[str, Any], model: torch.nn.Module, stats: dict[str, int],
                   rows: PackedRows, tcfg: DecoderConfig, features: TargetFeatures) -> dict[str, Any]:
    """A drafter trainer's report: `head` (kind, steps, design), then the parameter count, the data counts and
    packing, the training time, the target and where the features came from."""
    return {**head, "parameters": sum(p.numel() for p in model.parameters()), **stats,
            "packing_efficiency": round(rows.packed.efficiency, 4), "train_seconds": round(time.time() - run.t0, 1),
            "target": str(run.target_dir), "target_fingerprint": tcfg.fingerprint(), "features": features.source}
