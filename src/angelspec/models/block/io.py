"""Saving and loading a block-drafter folder (DFlash / DFlare / DFly / DSpark): `config.json` + `model.safetensors`.

config.json:
    {"architectures": ["AngelSpecBlockDrafter"], "block_drafter_config": {...BlockDrafterConfig...},
     "angelspec": {"drafter": "dflash" | "dflare" | "dfly" | "dspark", "target_fingerprint": ...,
                   "target_layer_ids": [taps], "block_size": B, "head": ..., "conditioning": ...,
                   "mask_token_id": ..., "confidence_head": ..., ...extra}}

The safetensors hold only the drafter's own weights: the target's embedding and LM head are never written;
`load_block_drafter` takes them from the target the caller already holds, after checking the folder was trained
for that target (tap ids first, then the fingerprint) and, when asked, that it is the expected drafter kind / head.
Mirrors `models.mtp_io` and reuses its atomic writers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from angelspec.models import hf_io
from angelspec.models.block.config import DRAFTER_KINDS, HEADS, BlockDrafterConfig
from angelspec.models.block.drafter import BlockDrafter
from angelspec.models.config import ConfigError
from angelspec.models.decoder import Decoder
from angelspec.models.hf_io import WEIGHTS_NAME, CheckpointError

ARCHITECTURE = "AngelSpecBlockDrafter"
CONFIG_KEY = "block_drafter_config"
# The "angelspec" entries `save_block_drafter` derives from the config itself (the rest is the caller's `extra`).
BLOCK_META_KEYS = ("drafter", "target_fingerprint", "target_layer_ids", "block_size", "head", "conditioning",
                   "mask_token_id", "confidence_head")


def save_block_drafter(model: BlockDrafter, path: str | Path, extra: dict[str, Any] | None = None) -> Path:
    """Write `config.json` and `model.safetensors` (each atomically) into `path`; `extra` joins the "angelspec"
    entry (training step, loss recipe, ...)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = model.config
    hf_io.save_safetensors_atomic(dict(model.state_dict()), path / WEIGHTS_NAME, {"format": "pt"})
    derived = (cfg.drafter, cfg.target_fingerprint, list(cfg.target_layer_ids), cfg.block_size, cfg.head,
               cfg.conditioning, cfg.mask_token_id, cfg.confidence_head)
    meta = {**dict(zip(BLOCK_META_KEYS, derived, strict=True)), **(extra or {})}
    hf_io.write_json_atomic(path / "config.json", {"architectures": [ARCHITECTURE], CONFIG_KEY: cfg.to_dict(),
                                             "angelspec": meta})
    return path


def read_block_config(path: str | Path, *, drafter: str | None = None, head: str | None = None
                      ) -> tuple[BlockDrafterConfig, dict[str, Any]]:
    """-> (the config, the raw "angelspec" entry). `drafter` / `head`, when given, must match the folder's:
    a clear error names both, instead of a silent mismatch or a missing-weights error."""
    path = Path(path)
    cfg_file = path / "config.json"
    raw = hf_io.read_config_json(path, f"is it a block drafter folder (angelspec train --drafter {drafter or 'dfly'})?")
    meta = raw.get("angelspec") or {}
    if meta.get("drafter") not in DRAFTER_KINDS or CONFIG_KEY not in raw:
        raise CheckpointError(f"{path} is not a block drafter (angelspec.drafter = {meta.get('drafter')!r}; expected "
                              f"one of {', '.join(DRAFTER_KINDS)})")
    try:
        cfg = BlockDrafterConfig.from_dict(raw[CONFIG_KEY])
    except (TypeError, ConfigError) as e:
        raise CheckpointError(f"{cfg_file}: bad {CONFIG_KEY} ({e})") from None
    if drafter is not None and drafter != cfg.drafter:
        raise CheckpointError(f"{path} holds a {cfg.drafter} drafter, not {drafter}: pass --drafter {cfg.drafter} or "
                              "pick another folder")
    if head is not None:
        if head not in HEADS:
            raise ConfigError(f"unknown head {head!r}; choose one of {', '.join(HEADS)}")
        if head != cfg.head:
            raise CheckpointError(f"{path} was trained with the {cfg.head!r} head, not {head!r}: pass --head "
                                  f"{cfg.head} or train a drafter with the {head} head")
    return cfg, meta


def load_block_drafter(path: str | Path, target: Decoder, *, drafter: str | None = None, head: str | None = None,
                       dtype: torch.dtype | None = None) -> BlockDrafter:
    """Build the drafter on the target's device/dtype with the target's (frozen) embedding and LM head, in eval
    mode. Raises ConfigError when the folder was trained for another target, CheckpointError for a wrong kind or
    head (see `read_block_config`) or weights that do not match the config."""
    cfg, _ = read_block_config(path, drafter=drafter, head=head)
    cfg.check_target(target.config)
    w = target.embed_tokens.weight
    file = Path(path) / WEIGHTS_NAME
    with torch.device(w.device):  # built where the target lives, never a CPU copy first
        model = hf_io.validate_module_file(Path(path), file, cfg.layer_config(),
                                           lambda: BlockDrafter(cfg, target.embed_tokens, target.lm_head), CONFIG_KEY
                                           ) or BlockDrafter(cfg, target.embed_tokens, target.lm_head)
    state = hf_io.read_module_state(file, w.device)
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as e:  # a tensor of the right name but another shape (e.g. an edited head)
        raise CheckpointError(f"{path}: weights do not match {CONFIG_KEY} ({str(e).splitlines()[-1].strip()})"
                              ) from None
    if missing or unexpected:
        raise CheckpointError(f"{path}: weights do not match {CONFIG_KEY} (missing {missing[:4]}, unexpected "
                              f"{unexpected[:4]})")
    return model.to(device=w.device, dtype=dtype or w.dtype).eval()
