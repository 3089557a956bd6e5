"""Block-parallel drafters (DFlash / DFlare / DFly / DSpark): one backbone pass drafts a whole block, then a
small head runs left to right over it (report §3.1–3.2, DSpark report §3).

`config` (BlockDrafterConfig, tap choice, distance prior), `heads` (Markov, gated, RNN, hidden-correction and
confidence heads), `drafter` (BlockDrafter: the training forward and the inference pieces, with slow references; the
drafting loop is `decoding/drafters/block_propose.py`), `targets` (anchors and teacher-forcing labels), `presets`
(target shapes and drafter configs), `io` (the saved folder).
"""

from angelspec.models.block.config import (
    CONDITIONINGS,
    DRAFTER_KINDS,
    HEADS,
    MARKOV_HEADS,
    BlockDrafterConfig,
    default_block_layer_ids,
    distance_prior,
)
from angelspec.models.block.drafter import BackboneOptions, BlockDrafter, BlockTrainOutput
from angelspec.models.block.heads import (
    HEAD_CLASSES,
    ConfidenceHead,
    GatedMarkovHead,
    HiddenCorrectionHead,
    MarkovHead,
    RNNHead,
)
from angelspec.models.block.io import load_block_drafter, read_block_config, save_block_drafter
from angelspec.models.block.presets import (
    EMBEDDED_MASK_TOKEN_ID,
    PRESETS,
    QWEN3_MASK_TOKEN_ID,
    dfly_embedded,
    embedded_target_shape,
    qwen3_8b_dfly,
    qwen3_8b_dspark,
    qwen3_8b_shape,
)
from angelspec.models.block.targets import BlockTargets, block_targets, sample_anchors

__all__ = [
    "CONDITIONINGS", "DRAFTER_KINDS", "EMBEDDED_MASK_TOKEN_ID", "HEADS", "HEAD_CLASSES", "MARKOV_HEADS", "PRESETS",
    "QWEN3_MASK_TOKEN_ID", "BackboneOptions", "BlockDrafter", "BlockDrafterConfig", "BlockTargets", "BlockTrainOutput",
    "ConfidenceHead", "GatedMarkovHead", "HiddenCorrectionHead", "MarkovHead", "RNNHead", "block_targets",
    "default_block_layer_ids", "dfly_embedded", "distance_prior", "embedded_target_shape", "load_block_drafter",
    "qwen3_8b_dfly", "qwen3_8b_dspark", "qwen3_8b_shape", "read_block_config", "sample_anchors", "save_block_drafter",
]
