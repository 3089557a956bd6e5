"""Load and save the Hugging Face checkpoint layout: `config.json` + `*.safetensors` (single file or a
sharded `model.safetensors.index.json`). The adapter maps HF parameter names to ours (fusing q/k/v
and gate/up on load, splitting them on save); it never imports transformers.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable
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


_DTYPE_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2,
                "U16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "BOOL": 1}
_MAX_HEADER_BYTES = 100 * 1024**2


def read_safetensors_header(file: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """{tensor name: (shape, dtype)} from a safetensors file's header alone (8-byte length + JSON), without
    reading any tensor; CheckpointError for a file that is not safetensors or is shorter than its header says
    (a truncated copy)."""
    try:
        size = file.stat().st_size
        with file.open("rb") as f:
            head = f.read(8)
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
            if not 0 < n <= min(_MAX_HEADER_BYTES, size - 8):
                raise CheckpointError(f"{file} is not a complete safetensors file ({size} bytes); the checkpoint may "
                                      "be half-written: copy or download it again")
            header = json.loads(f.read(n))
        header.pop("__metadata__", None)
        out: dict[str, tuple[tuple[int, ...], str]] = {}
        end = 0
        for name, info in header.items():
            shape, dtype = tuple(int(d) for d in info["shape"]), str(info["dtype"])
            start, stop = (int(o) for o in info["data_offsets"])
            end = max(end, stop)
            out[name] = (shape, dtype)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, struct.error) as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"{file}: weights are unreadable ({e}); the checkpoint may be half-written") from None
    if 8 + n + end > size:
        raise CheckpointError(f"{file} is truncated: its header needs {8 + n + end} bytes, the file has {size}; the "
                              "checkpoint may be half-written: copy or download it again")
    return out


def _weight_files(path: Path) -> list[Path]:
    """The safetensors file(s) of a HF folder (one file or the shards of its index)."""
    single, index = path / WEIGHTS_NAME, path / INDEX_NAME
    if single.is_file():
        return [single]
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            shards = sorted(set(weight_map.values()))
        except (OSError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{path}: {INDEX_NAME} is unreadable ({e}); the checkpoint may be half-written"
                                  ) from None
        for shard in shards:
            if not (path / shard).is_file():
                raise CheckpointError(f"{path}: shard {shard} listed in {INDEX_NAME} is missing; "
                                      "the download or copy is incomplete")
        return [path / shard for shard in shards]
    raise CheckpointError(f"{path} has no {WEIGHTS_NAME} or {INDEX_NAME}; only safetensors checkpoints are "
                          "supported (never pickles)")


def expected_hf_shapes(cfg: DecoderConfig) -> dict[str, tuple[int, ...]]:
    """{HF tensor name: shape} that a checkpoint of `cfg` holds (the inverse view of `hf_to_ours`)."""
    d, f, hq, hkv, dh, v = (cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads,
                            cfg.num_key_value_heads, cfg.head_dim, cfg.vocab_size)
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,)}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (v, d)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = out[p + "post_attention_layernorm.weight"] = (d,)
        a = p + "self_attn."
        for n, rows in (("q", hq * dh), ("k", hkv * dh), ("v", hkv * dh)):
            out[a + f"{n}_proj.weight"] = (rows, d)
            if cfg.qkv_bias:
                out[a + f"{n}_proj.bias"] = (rows,)
        out[a + "o_proj.weight"] = (d, hq * dh)
        if cfg.o_bias:
            out[a + "o_proj.bias"] = (d,)
        if cfg.qk_norm:
            out[a + "q_norm.weight"] = out[a + "k_norm.weight"] = (dh,)
        m = p + "mlp."
        out[m + "gate_proj.weight"] = out[m + "up_proj.weight"] = (f, d)
        out[m + "down_proj.weight"] = (d, f)
        if cfg.mlp_bias:
            out[m + "gate_proj.bias"] = out[m + "up_proj.bias"] = (f,)
            out[m + "down_proj.bias"] = (d,)
    return out


def available_memory_bytes() -> int | None:
    """Physical memory of this machine (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _human(nbytes: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if nbytes < 1024 or unit == "TB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return f"{nbytes:.1f} TB"


def check_size_fits(source: Path, n_params: int, held_bytes: int, what: str, dtype_bytes: int = 4) -> None:
    """Refuse a config whose parameters (`n_params`, loaded at `dtype_bytes` each) could not fit this machine's
    memory, or that the weights on disk (`held_bytes`, at most 4 bytes a parameter) cannot possibly hold."""
    need = n_params * dtype_bytes
    if held_bytes and n_params > 8 * held_bytes:  # more than 8x the parameters even 1-byte weights could hold
        raise CheckpointError(f"{source}: {what} implies {n_params:,} parameters ({_human(need)}) but the weights "
                              f"hold only {_human(held_bytes)}; {what} does not describe these weights")
    mem = available_memory_bytes()
    if mem is not None and need > mem:
        raise CheckpointError(f"{source}: {what} implies {n_params:,} parameters ({_human(need)}), more than this "
                              f"machine's {_human(mem)} of memory; check the config or use a smaller model")


def check_weights(source: Path, found: dict[str, tuple[tuple[int, ...], str]],
                  expected: dict[str, tuple[int, ...]], what: str) -> None:
    """CheckpointError unless the tensor names in the weights are exactly `expected`'s and every shape matches
    (`what` names the config the shapes come from)."""
    missing = [k for k in expected if k not in found]
    unexpected = [k for k in found if k not in expected]
    if missing or unexpected:
        raise CheckpointError(f"{source}: weights do not match {what} (missing {missing[:4]}"
                              f"{f' and {len(missing) - 4} more' if len(missing) > 4 else ''}, unexpected "
                              f"{unexpected[:4]}{f' and {len(unexpected) - 4} more' if len(unexpected) > 4 else ''})"
                              "; is it the config of these weights?")
    for name, shape in expected.items():
        if tuple(found[name][0]) != tuple(shape):
            raise CheckpointError(f"{source}: weights do not match {what}: tensor {name!r} has shape "
                                  f"{list(found[name][0])} but {what} implies {list(shape)}; the config and the "
                                  "weights are of different models")


def validate_hf_folder(path: Path, cfg: DecoderConfig, dtype_bytes: int = 4) -> list[Path]:
    """Compare the weights' headers with what `cfg` implies before anything is allocated: sizes, names, shapes,
    truncation. -> the weight files."""
    files = _weight_files(path)
    found: dict[str, tuple[tuple[int, ...], str]] = {}
    for file in files:
        found.update(read_safetensors_header(file))
    held = sum(file.stat().st_size for file in files)
    check_size_fits(path, cfg.num_parameters(), held, "config.json", dtype_bytes)
    check_weights(path, found, expected_hf_shapes(cfg), "config.json")
    return files


def validate_module_file(source: Path, file: Path, layers: DecoderConfig, build: Callable[[], torch.nn.Module],
                         what: str) -> torch.nn.Module | None:
    """Before a drafter's weights are read: the safetensors `file` is complete, the draft `layers` (their
    `DecoderConfig`) fit in memory and in what the file holds, and the names and shapes of the model's state dict
    (`build()`, on the meta device where the model allows it) are exactly the file's. -> the model when it had to be
    built for real (the caller loads into it), else None."""
    if not file.is_file():
        raise CheckpointError(f"{source} has no {file.name}; the folder may be half-written: train it again")
    found = read_safetensors_header(file)
    draft_layers = layers.num_parameters() - layers.vocab_size * layers.hidden_size * (
        1 if layers.tie_word_embeddings else 2) - layers.hidden_size  # without the target's embedding and head
    check_size_fits(source, draft_layers, file.stat().st_size, what)
    real = None
    try:
        with torch.device("meta"):
            model = build()
    except (RuntimeError, NotImplementedError):  # initialisation that reads values (e.g. a prior from the config)
        model = real = build()
    check_weights(source, found, {k: tuple(v.shape) for k, v in model.state_dict().items()}, what)
    return real


def _read_state(path: Path, files: list[Path] | None = None) -> dict[str, torch.Tensor]:
    files = files if files is not None else _weight_files(path)
    state: dict[str, torch.Tensor] = {}
    try:
        for file in files:
            state.update(load_file(file))
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{path}: weights are unreadable ({e}); the checkpoint may be half-written") from None
    return state


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
    files = validate_hf_folder(path, cfg, torch.empty((), dtype=dtype).element_size())
    state = hf_to_ours(cfg, _read_state(path, files))
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
