"""Block-drafter presets: the target shapes they are sized for (the embedded target, Qwen3-8B), their mask
tokens, and the configs of DFly and DSpark for them (report §3.5, Table 5; DSpark report §3). Training presets
(the `*_embedded` / `*_demo` runs) live in `train.block`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from angelspec.models.block.config import BlockDrafterConfig
from angelspec.models.config import DecoderConfig

EMBEDDED_MASK_TOKEN_ID = 5  # the embedded target's reserved mask token
QWEN3_MASK_TOKEN_ID = 151669  # the unused special token DFlash / DSpark checkpoints for Qwen3 use


def embedded_target_shape() -> DecoderConfig:
    """The shape of the embedded target (Qwen3, 6 × 256, vocab 8192; `angelspec target build`): the fields the
    fingerprint reads. Pass the real target's config instead wherever one is at hand."""
    return DecoderConfig(vocab_size=8192, hidden_size=256, intermediate_size=768, num_hidden_layers=6,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=1024,
                         model_type="qwen3", qk_norm=True)


def qwen3_8b_shape() -> DecoderConfig:
    """Qwen3-8B's published shape (36 × 4096, 32 / 8 heads of 128, MLP 12288, vocab 151936, rope θ 1e6)."""
    return DecoderConfig(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                         rope_theta=1_000_000.0, model_type="qwen3", qk_norm=True, tie_word_embeddings=False)


def dfly_embedded(target: DecoderConfig | None = None, *, mask_token_id: int = EMBEDDED_MASK_TOKEN_ID,
                  **overrides: Any) -> BlockDrafterConfig:
    """DFly for the embedded target: 2 draft layers of the target's width, block 8, taps (1, 3, 5) (low, mid and
    the last layer: on a 6-layer target the last layer carries most of the next-token signal), hidden-correction
    head, confidence head with a rank-64 W1. `overrides` replace any field (e.g. head="markov")."""
    cfg = BlockDrafterConfig.for_target(target or embedded_target_shape(), mask_token_id=mask_token_id,
                                        block_size=8, num_draft_layers=2, target_layer_ids=(1, 3, 5),
                                        conditioning="dfly", head="hidden", markov_rank=64, confidence_head=True)
    return replace(cfg, **overrides) if overrides else cfg


def qwen3_8b_dfly(target: DecoderConfig | None = None, *, mask_token_id: int = QWEN3_MASK_TOKEN_ID
                  ) -> BlockDrafterConfig:
    """The report's default DFly (§3.5, Table 5: L5-B8): 5 draft layers of the target's shape, block size 8, the
    DFlash taps (1, 9, 17, 25, 33 on Qwen3-8B), hybrid conditioning, hidden-correction head, confidence head.
    Pass a scaled-down `target` (and its mask token) to build the same design on a tiny model."""
    return BlockDrafterConfig.for_target(target or qwen3_8b_shape(), mask_token_id=mask_token_id, block_size=8,
                                         num_draft_layers=5, conditioning="dfly", head="hidden", markov_rank=256,
                                         confidence_head=True)


def qwen3_8b_dspark(target: DecoderConfig | None = None, *, mask_token_id: int = QWEN3_MASK_TOKEN_ID
                    ) -> BlockDrafterConfig:
    """DSpark (DSpark report §3): the DFlash backbone with same-layer injection (Uraion §3.3: draft layer i reads
    tap i), L5-B8, a rank-256 Markov head and the confidence head sharing its W1."""
    return BlockDrafterConfig.for_target(target or qwen3_8b_shape(), mask_token_id=mask_token_id, block_size=8,
                                         num_draft_layers=5, conditioning="dflash", head="markov", markov_rank=256,
                                         confidence_head=True)


PRESETS: dict[str, Callable[..., BlockDrafterConfig]] = {
    "dfly_embedded": dfly_embedded, "qwen3_8b_dfly": qwen3_8b_dfly, "qwen3_8b_dspark": qwen3_8b_dspark}
