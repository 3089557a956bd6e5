"""Saving and loading an MTP block folder: `config.json` + `model.safetensors` (the block's own weights only).

config.json:
    {"architectures": ["AngelSpecMTP"], "mtp_config": {...MTPConfig...},
     "angelspec": {"drafter": "mtp", "target_fingerprint": ..., "target_layer_ids": [tap], ...extra}}

The target's embedding and LM head are never written: `load_mtp` takes them from the target the caller
already holds, after checking the folder was trained for that target.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from angelspec.models.config import ConfigError
from angelspec.models.decoder import Decoder
from angelspec.models.hf_io import WEIGHTS_NAME, CheckpointError, save_safetensors_atomic, write_json_atomic
from angelspec.models.mtp import MTPBlock, MTPConfig

ARCHITECTURE = "AngelSpecMTP"


def save_mtp(block: MTPBlock, path: str | Path, extra: dict[str, Any] | None = None) -> Path:
    """Write `config.json` and `model.safetensors` (each atomically) into `path`."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = block.config
    save_safetensors_atomic(dict(block.state_dict()), path / WEIGHTS_NAME, {"format": "pt"})
    meta = {"drafter": "mtp", "target_fingerprint": cfg.target_fingerprint,
            "target_layer_ids": [cfg.target_layer_id], **(extra or {})}
    write_json_atomic(path / "config.json", {"architectures": [ARCHITECTURE], "mtp_config": cfg.to_dict(),
                                             "angelspec": meta})
    return path


def read_mtp_config(path: str | Path) -> tuple[MTPConfig, dict[str, Any]]:
    """-> (MTPConfig, the raw `angelspec` entry); clear errors for a folder that is not an MTP drafter."""
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"{path} has no config.json: is it an MTP drafter folder (angelspec train "
                              "--drafter mtp)?")
    try:
        raw = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_file} is not valid JSON ({e}); the folder may be half-written") from None
    meta = raw.get("angelspec") or {}
    if meta.get("drafter") != "mtp" or "mtp_config" not in raw:
        raise CheckpointError(f"{path} is not an MTP drafter (angelspec.drafter = {meta.get('drafter')!r})")
    try:
        return MTPConfig.from_dict(raw["mtp_config"]), meta
    except (TypeError, ConfigError) as e:
        raise CheckpointError(f"{cfg_file}: bad mtp_config ({e})") from None


def load_mtp(path: str | Path, target: Decoder, *, dtype: torch.dtype | None = None) -> MTPBlock:
    """Build the block on the target's device/dtype with the target's (frozen) embedding and LM head.

    Raises ConfigError when the folder was trained for another target."""
    cfg, _ = read_mtp_config(path)
    cfg.check_target(target.config)
    w = target.embed_tokens.weight
    block = MTPBlock(cfg, target.embed_tokens, target.lm_head)
    state = load_file(str(Path(path) / WEIGHTS_NAME), device=str(w.device))
    missing, unexpected = block.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise CheckpointError(f"{path}: weights do not match mtp_config (missing {missing[:4]}, "
                              f"unexpected {unexpected[:4]})")
    return block.to(device=w.device, dtype=dtype or w.dtype).eval()
