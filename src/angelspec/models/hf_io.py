"""Load and save the Hugging Face checkpoint layout: `config.json` + `*.safetensors` (single file or a
sharded `model.safetensors.index.json`). The adapter maps HF parameter names to ours (fusing q/k/v
and gate/up on load, splitting them on save); it never imports transformers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from angelspec.fileio import replace_atomic, write_json_atomic
from angelspec.models.config import ConfigError, DecoderConfig, rope_inv_freq
from angelspec.models.decoder import Decoder

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A checkpoint folder that cannot be loaded; the message names the folder and the fix."""


def save_safetensors_atomic(
    tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None
) -> None:
    tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    replace_atomic(path, lambda tmp: save_file(tensors, tmp, metadata=metadata))


def read_config_json(path: Path, missing_hint: str, what: str = "folder") -> dict[str, Any]:
    """`path`/config.json as a dict; CheckpointError when it is missing (`missing_hint` says what the folder
    should have been) or not JSON (a half-written `what`)."""
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"{path} has no config.json: {missing_hint}")
    try:
        return json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_file} is not valid JSON ({e}); the {what} may be half-written") from None


def read_config(path: str | Path) -> DecoderConfig:
    path = Path(path)
    cfg_file = path / "config.json"
    if not path.is_dir():
        raise CheckpointError(f"target folder {path} does not exist; pass --target DIR with a HF checkpoint folder")
    raw = read_config_json(path, "is it a complete HF checkpoint folder?", "checkpoint")
    try:
        return DecoderConfig.from_hf_dict(raw)
    except ConfigError as e:
        raise CheckpointError(f"{cfg_file}: {e}") from None


def _read_state(path: Path) -> dict[str, torch.Tensor]:
    single, index = path / WEIGHTS_NAME, path / INDEX_NAME
    try:
        if single.is_file():
            return load_file(single)
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            state: dict[str, torch.Tensor] = {}
            for shard in sorted(set(weight_map.values())):
                shard_path = path / shard
                if not shard_path.is_file():
                    raise CheckpointError(f"{path}: shard {shard} listed in {INDEX_NAME} is missing; "
                                          "the download or copy is incomplete")
                state.update(load_file(shard_path))
            return state
    except (SafetensorError, OSError, json.JSONDecodeError, KeyError) as e:
        raise CheckpointError(f"{path}: weights are unreadable ({e}); the checkpoint may be half-written") from None
    raise CheckpointError(f"{path} has no {WEIGHTS_NAME} or {INDEX_NAME}; only safetensors checkpoints are "
                          "supported (never pickles)")


def hf_to_ours(cfg: DecoderConfig, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename and fuse a HF state dict into `Decoder`'s names."""
    out: dict[str, torch.Tensor] = {}

    def take(name: str) -> torch.Tensor:
        if name not in hf:
            raise CheckpointError(f"checkpoint is missing tensor {name!r}; does config.json match the weights?")
        return hf[name]

    out["embed_tokens.weight"] = take("model.embed_tokens.weight")
    out["norm.weight"] = take("model.norm.weight")
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = take("lm_head.weight")
    for i in range(cfg.num_hidden_layers):
        p, q = f"model.layers.{i}.", f"layers.{i}."
        out[q + "input_layernorm.weight"] = take(p + "input_layernorm.weight")
        out[q + "post_attention_layernorm.weight"] = take(p + "post_attention_layernorm.weight")
        a = p + "self_attn."
        out[q + "attn.qkv_proj.weight"] = torch.cat([take(a + f"{n}_proj.weight") for n in "qkv"])
        if cfg.qkv_bias:
            out[q + "attn.qkv_proj.bias"] = torch.cat([take(a + f"{n}_proj.bias") for n in "qkv"])
        out[q + "attn.o_proj.weight"] = take(a + "o_proj.weight")
        if cfg.o_bias:
            out[q + "attn.o_proj.bias"] = take(a + "o_proj.bias")
        if cfg.qk_norm:
            out[q + "attn.q_norm.weight"] = take(a + "q_norm.weight")
            out[q + "attn.k_norm.weight"] = take(a + "k_norm.weight")
        m = p + "mlp."
        out[q + "mlp.gate_up_proj.weight"] = torch.cat([take(m + "gate_proj.weight"), take(m + "up_proj.weight")])
        out[q + "mlp.down_proj.weight"] = take(m + "down_proj.weight")
        if cfg.mlp_bias:
            out[q + "mlp.gate_up_proj.bias"] = torch.cat([take(m + "gate_proj.bias"), take(m + "up_proj.bias")])
            out[q + "mlp.down_proj.bias"] = take(m + "down_proj.bias")
    return out


def ours_to_hf(cfg: DecoderConfig, ours: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of `hf_to_ours`: split fused weights back into HF names."""
    hq, hkv, dh, f = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size
    out = {"model.embed_tokens.weight": ours["embed_tokens.weight"], "model.norm.weight": ours["norm.weight"]}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = ours["lm_head.weight"]
    for i in range(cfg.num_hidden_layers):
        p, q = f"model.layers.{i}.", f"layers.{i}."
        out[p + "input_layernorm.weight"] = ours[q + "input_layernorm.weight"]
        out[p + "post_attention_layernorm.weight"] = ours[q + "post_attention_layernorm.weight"]
        a = p + "self_attn."
        for suffix in ("weight", "bias") if cfg.qkv_bias else ("weight",):
            qw, kw, vw = ours[q + f"attn.qkv_proj.{suffix}"].split((hq * dh, hkv * dh, hkv * dh))
            out[a + f"q_proj.{suffix}"], out[a + f"k_proj.{suffix}"], out[a + f"v_proj.{suffix}"] = qw, kw, vw
        out[a + "o_proj.weight"] = ours[q + "attn.o_proj.weight"]
        if cfg.o_bias:
            out[a + "o_proj.bias"] = ours[q + "attn.o_proj.bias"]
        if cfg.qk_norm:
            out[a + "q_norm.weight"] = ours[q + "attn.q_norm.weight"]
            out[a + "k_norm.weight"] = ours[q + "attn.k_norm.weight"]
        m = p + "mlp."
        for suffix in ("weight", "bias") if cfg.mlp_bias else ("weight",):
            g, u = ours[q + f"mlp.gate_up_proj.{suffix}"].split((f, f))
            out[m + f"gate_proj.{suffix}"], out[m + f"up_proj.{suffix}"] = g, u
            out[m + f"down_proj.{suffix}"] = ours[q + f"mlp.down_proj.{suffix}"]
    return out


def load_target(path: str | Path, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> Decoder:
    """Load a HF-layout causal-LM folder into our `Decoder` (eval mode, no grad needed)."""
    path = Path(path)
    cfg = read_config(path)
    state = hf_to_ours(cfg, _read_state(path))
    with torch.device("meta"):
        model = Decoder(cfg)
    model = model.to_empty(device=device)
    # Buffers created on meta must be rebuilt for real.
    model.register_buffer("inv_freq", rope_inv_freq(cfg)[0].to(device), persistent=False)
    missing, unexpected = model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=False, assign=True)
    missing = [m for m in missing if not (cfg.tie_word_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise CheckpointError(f"{path}: weights do not match config.json (missing {missing[:4]}, "
                              f"unexpected {unexpected[:4]})")
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    return model.to(dtype).eval()


def save_target(model: Decoder, path: str | Path, *, dtype: torch.dtype | None = None,
                max_shard_bytes: int = 2 * 1024**3) -> Path:
    """Save in the HF layout. Each file is written atomically; shards above `max_shard_bytes`."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = model.config
    own = {k: v for k, v in model.state_dict().items() if not (cfg.tie_word_embeddings and k == "lm_head.weight")}
    hf = ours_to_hf(cfg, own)
    if dtype is not None:
        hf = {k: v.to(dtype) for k, v in hf.items()}
    dtype_name = str(next(iter(hf.values())).dtype).removeprefix("torch.")
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in hf.items():
        nbytes = t.numel() * t.element_size()
        if size and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_safetensors_atomic(shards[0], path / WEIGHTS_NAME, meta)
    else:
        weight_map = {}
        for j, shard in enumerate(shards):
            fname = f"model-{j + 1:05d}-of-{len(shards):05d}.safetensors"
            save_safetensors_atomic(shard, path / fname, meta)
            weight_map.update({k: fname for k in shard})
        total = sum(t.numel() * t.element_size() for t in hf.values())
        write_json_atomic(path / INDEX_NAME, {"metadata": {"total_size": total}, "weight_map": weight_map})
    write_json_atomic(path / "config.json", cfg.to_hf_dict(dtype_name))
    return path
