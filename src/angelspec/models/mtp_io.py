"""Saving and loading an MTP-family drafter folder: `config.json` + `model.safetensors` (the model's own weights).

config.json, with KIND the model's drafter kind ("mtp" or "eagle3"):
    {"architectures": ["AngelSpecMTP" | "AngelSpecEagle3"], "<KIND>_config": {...MTPFamilyConfig fields...},
     "angelspec": {"drafter": KIND, "target_fingerprint": ..., "target_layer_ids": [taps], ...extra}}

The target's embedding and LM head are never written: `load_mtp` takes them from the target the caller
already holds, after checking the folder was trained for that target (tap ids first, then the fingerprint).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from angelspec.models.config import ConfigError
from angelspec.models.decoder import Decoder
from angelspec.models.eagle3 import Eagle3Config, Eagle3DraftModel
from angelspec.models.hf_io import (
    WEIGHTS_NAME,
    CheckpointError,
    read_config_json,
    read_module_state,
    save_safetensors_atomic,
    validate_module_file,
    write_json_atomic,
)
from angelspec.models.mtp import MTPConfig, MTPDraftModel, MTPFamilyConfig

ARCHITECTURE = "AngelSpecMTP"
MTP_META_KEYS = ("drafter", "target_fingerprint", "target_layer_ids")  # what `save_mtp` derives from the config
# drafter kind -> (config class, model class, architecture name in config.json)
MTP_FAMILY: dict[str, tuple[type[MTPFamilyConfig], type[MTPDraftModel], str]] = {
    "mtp": (MTPConfig, MTPDraftModel, ARCHITECTURE),
    "eagle3": (Eagle3Config, Eagle3DraftModel, "AngelSpecEagle3"),
}


def build_mtp_model(cfg: MTPFamilyConfig, embed_tokens: nn.Embedding, lm_head: nn.Linear) -> MTPDraftModel:
    """The model class of `cfg`'s kind around the target's (frozen) embedding and LM head."""
    return MTP_FAMILY[cfg.drafter][1](cfg, embed_tokens, lm_head)


def save_mtp(model: MTPDraftModel, path: str | Path, extra: dict[str, Any] | None = None) -> Path:
    """Write `config.json` and `model.safetensors` (each atomically) into `path`."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = model.config
    kind = cfg.drafter
    save_safetensors_atomic(dict(model.state_dict()), path / WEIGHTS_NAME, {"format": "pt"})
    derived = (kind, cfg.target_fingerprint, list(cfg.target_layer_ids))
    meta = {**dict(zip(MTP_META_KEYS, derived, strict=True)), **(extra or {})}
    write_json_atomic(path / "config.json", {"architectures": [MTP_FAMILY[kind][2]], f"{kind}_config": cfg.to_dict(),
                                             "angelspec": meta})
    return path


def read_mtp_config(path: str | Path, kind: str = "mtp") -> tuple[MTPFamilyConfig, dict[str, Any]]:
    """-> (the `kind` model config, the raw `angelspec` entry); clear errors for a folder of another kind."""
    path = Path(path)
    cfg_file = path / "config.json"
    raw = read_config_json(path, f"is it a {kind} drafter folder (angelspec train --drafter {kind})?")
    meta = raw.get("angelspec") or {}
    key = f"{kind}_config"
    if meta.get("drafter") != kind or key not in raw:
        raise CheckpointError(f"{path} is not a {kind} drafter (angelspec.drafter = {meta.get('drafter')!r})")
    try:
        return MTP_FAMILY[kind][0].from_dict(raw[key]), meta
    except (TypeError, ConfigError) as e:
        raise CheckpointError(f"{cfg_file}: bad {key} ({e})") from None


def load_mtp(path: str | Path, target: Decoder, *, dtype: torch.dtype | None = None, kind: str = "mtp"
             ) -> MTPDraftModel:
    """Build the `kind` model on the target's device/dtype with the target's (frozen) embedding and LM head.

    Raises ConfigError when the folder was trained for another target."""
    cfg, _ = read_mtp_config(path, kind)
    cfg.check_target(target.config)
    w = target.embed_tokens.weight
    file = Path(path) / WEIGHTS_NAME
    with torch.device(w.device):  # built where the target lives, never a CPU copy first
        model = validate_module_file(Path(path), file, cfg.layer_config(),
                                     lambda: build_mtp_model(cfg, target.embed_tokens, target.lm_head),
                                     f"{kind}_config") or build_mtp_model(cfg, target.embed_tokens, target.lm_head)
    state = read_module_state(file, w.device)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise CheckpointError(f"{path}: weights do not match {kind}_config (missing {missing[:4]}, "
                              f"unexpected {unexpected[:4]})")
    return model.to(device=w.device, dtype=dtype or w.dtype).eval()
