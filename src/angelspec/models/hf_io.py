"""Load and save the Hugging Face checkpoint layout: `config.json` + `*.safetensors` (single file or a
sharded `model.safetensors.index.json`). The adapter maps HF parameter names to ours (fusing q/k/v
and gate/up on load, splitting them on save); it never imports transformers.
"""

from __future__ import annotations

import json
import os
import re
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from angelspec.fileio import human_bytes, replace_atomic, write_json_atomic
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

    def write(tmp: Path) -> None:
        try:
            save_file(tensors, tmp, metadata=metadata)
        except SafetensorError as e:  # the writer's own error type, also for a full disk: an OSError of its code
            code = re.search(r"os error (\d+)", str(e))
            if code is None:
                raise
            raise OSError(int(code.group(1)), os.strerror(int(code.group(1))), str(path)) from None
    replace_atomic(path, write)


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
    if raw.get("eos_token_id") is None:  # generation would never stop at the end of a reply
        raw["eos_token_id"] = end_tokens_beside(path)
    try:
        return DecoderConfig.from_hf_dict(raw)
    except ConfigError as e:
        raise CheckpointError(f"{cfg_file}: {e}") from None


def _json_or_none(file: Path) -> Any:
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def end_tokens_beside(path: Path) -> list[int] | None:
    """The end tokens the files beside a config.json without `eos_token_id` name, as transformers would find them:
    generation_config.json's `eos_token_id`, else tokenizer_config.json's `eos_token` looked up in tokenizer.json
    (its added tokens, then its vocabulary). None when neither names one."""
    gen = _json_or_none(path / "generation_config.json")
    ids = gen.get("eos_token_id") if isinstance(gen, dict) else None
    ids = [ids] if isinstance(ids, int) and not isinstance(ids, bool) else ids
    if isinstance(ids, list) and ids and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        return ids
    tok_config = _json_or_none(path / "tokenizer_config.json")
    token = tok_config.get("eos_token") if isinstance(tok_config, dict) else None
    token = token.get("content") if isinstance(token, dict) else token
    tokenizer = _json_or_none(path / "tokenizer.json") if isinstance(token, str) else None
    if not isinstance(tokenizer, dict):
        return None
    for added in tokenizer.get("added_tokens") or []:
        if isinstance(added, dict) and added.get("content") == token and isinstance(added.get("id"), int):
            return [added["id"]]
    vocab = (tokenizer.get("model") or {}).get("vocab")
    found = vocab.get(token) if isinstance(vocab, dict) else None
    return [found] if isinstance(found, int) else None


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


# Dtypes a model computes in (FP8 needs scales, integers are quantised codes: read as floats they would be garbage).
FLOAT_DTYPES = {"F16": "float16", "BF16": "bfloat16", "F32": "float32", "F64": "float64"}
_TORCH_NAMES = {"float16": "F16", "half": "F16", "bfloat16": "BF16", "float32": "F32", "float": "F32",
                "float64": "F64", "double": "F64"}


def check_dtypes(source: Path, found: dict[str, tuple[tuple[int, ...], str]], *,
                 config_dtype: object = None, ints: frozenset[str] = frozenset()) -> None:
    """CheckpointError for a tensor the model cannot compute with: one whose dtype is not a float type (`ints` names
    the tensors that are integer buffers by design), or, where config.json names a `torch_dtype`, a float tensor of
    another dtype (the config and the weights are of different conversions)."""
    want = _TORCH_NAMES.get(str(config_dtype).removeprefix("torch.")) if config_dtype is not None else None
    for name, (_, dtype) in found.items():
        if name in ints:
            if dtype in FLOAT_DTYPES:
                raise CheckpointError(f"{source}: tensor {name!r} is {dtype}, but the model keeps it as integers; the "
                                      "file was written by another program: save the drafter again")
            continue
        if dtype not in FLOAT_DTYPES:
            raise CheckpointError(f"{source}: tensor {name!r} is {dtype}, not a float type the model can use "
                                  f"({', '.join(FLOAT_DTYPES)}); quantised or converted weights need converting back "
                                  "to floats first")
        if want is not None and dtype != want:
            raise CheckpointError(f"{source}: tensor {name!r} is {dtype}, but config.json says torch_dtype "
                                  f"{config_dtype}; the config and the weights come from different conversions: set "
                                  f"torch_dtype to {FLOAT_DTYPES[dtype]} if these weights are the right ones")


_FINITE_CHUNK = 1 << 24


def nonfinite_problem(name: str, tensor: torch.Tensor) -> str | None:
    """'tensor NAME holds N NaN or infinite value(s) of M' for a float tensor that is not all finite, else None (one
    reduction over the values: cheap next to reading them, `benchmarks/load_checks.py`)."""
    if not tensor.is_floating_point():
        return None
    flat = tensor.detach().reshape(-1)
    chunks = flat.split(_FINITE_CHUNK)  # bounds the temporaries of a large tensor (an embedding)
    acc = torch.float64 if flat.dtype == torch.float64 else torch.float32
    # A NaN or an infinity makes the sum non-finite, so a finite sum clears a chunk in one reduction, without a mask.
    if all(bool(torch.isfinite(c.sum(dtype=acc))) for c in chunks):
        return None
    bad = sum(int((~torch.isfinite(c)).sum()) for c in chunks)
    if not bad:  # the sum of finite values overflowed
        return None
    return f"tensor {name!r} holds {bad} NaN or infinite value(s) of {tensor.numel()}"


def check_finite(file: Path, tensors: dict[str, torch.Tensor]) -> None:
    """CheckpointError naming the first tensor of `file` that holds a NaN or an infinity: a model that computes with
    one gives empty or garbage output without any error."""
    for name, t in tensors.items():
        problem = nonfinite_problem(name, t)
        if problem is not None:
            raise CheckpointError(f"{file}: {problem}; the weights are damaged (a diverged training run or a "
                                  "corrupted copy): restore them from a good copy or retrain")


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
    """{HF tensor name: shape} that a checkpoint of `cfg` holds (the checkpoint side of `hf_slices`)."""
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


def check_size_fits(source: Path, n_params: int, held_bytes: int, what: str, dtype_bytes: int = 4,
                    host: bool = True) -> None:
    """Refuse a config whose parameters (`n_params`, loaded at `dtype_bytes` each) could not fit this machine's
    memory (`host`: they are loaded into host memory, not onto an accelerator), or that the weights on disk
    (`held_bytes`, at most 4 bytes a parameter) cannot possibly hold."""
    need = n_params * dtype_bytes
    size = human_bytes(need, "KB")
    if held_bytes and n_params > 8 * held_bytes:  # more than 8x the parameters even 1-byte weights could hold
        raise CheckpointError(f"{source}: {what} implies {n_params:,} parameters ({size}) but the weights hold only "
                              f"{human_bytes(held_bytes, 'KB')}; {what} does not describe these weights")
    mem = available_memory_bytes() if host else None
    if mem is not None and need > mem:
        raise CheckpointError(f"{source}: {what} implies {n_params:,} parameters ({size}), more than this machine's "
                              f"{human_bytes(mem, 'KB')} of memory; check the config or use a smaller model")


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


def validate_hf_folder(path: Path, cfg: DecoderConfig, dtype_bytes: int = 4, host: bool = True) -> list[Path]:
    """Compare the weights' headers with what `cfg` implies before anything is allocated: sizes (against the host's
    memory when `host`: the weights are loaded there), names, shapes, truncation. -> the weight files."""
    files = _weight_files(path)
    found: dict[str, tuple[tuple[int, ...], str]] = {}
    for file in files:
        found.update(read_safetensors_header(file))
    held = sum(file.stat().st_size for file in files)
    check_size_fits(path, cfg.num_parameters(), held, "config.json", dtype_bytes, host)
    check_weights(path, found, expected_hf_shapes(cfg), "config.json")
    raw = read_config_json(path, "is it a complete HF checkpoint folder?", "checkpoint")
    check_dtypes(path, found, config_dtype=raw.get("torch_dtype", raw.get("dtype")))
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
    state = model.state_dict()
    check_weights(source, found, {k: tuple(v.shape) for k, v in state.items()}, what)
    check_dtypes(source, found, ints=frozenset(k for k, v in state.items() if not v.is_floating_point()))
    return real


def ours_to_hf(cfg: DecoderConfig, ours: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our state dict in HF names: fused weights split back (the inverse of `hf_slices`)."""
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


def read_module_state(file: Path, device: torch.device) -> dict[str, torch.Tensor]:
    """A drafter's safetensors file read straight onto `device`; on the meta device, empty tensors of the file's
    shapes (a layout-only load reads no weight)."""
    if device.type == "meta":
        return {k: torch.empty(shape, device="meta") for k, (shape, _) in read_safetensors_header(file).items()}
    try:
        state = load_file(str(file), device=str(device))
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{file}: weights are unreadable ({e}); the folder may be half-written") from None
    check_finite(file, state)
    return state


def hf_slices(cfg: DecoderConfig) -> dict[str, tuple[str, int]]:
    """{HF tensor name: (our parameter name, first row)}: where each checkpoint tensor lands in `Decoder`'s fused
    parameters (q/k/v stacked into qkv_proj, gate/up into gate_up_proj; every other tensor whole, at row 0)."""
    hq, hkv, dh, f = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size
    out: dict[str, tuple[str, int]] = {"model.embed_tokens.weight": ("embed_tokens.weight", 0),
                                       "model.norm.weight": ("norm.weight", 0)}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = ("lm_head.weight", 0)
    for i in range(cfg.num_hidden_layers):
        p, q = f"model.layers.{i}.", f"layers.{i}."
        for norm in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            out[p + norm] = (q + norm, 0)
        a, m = p + "self_attn.", p + "mlp."
        for suffix in ("weight", "bias") if cfg.qkv_bias else ("weight",):
            for n, row in (("q", 0), ("k", hq * dh), ("v", (hq + hkv) * dh)):
                out[a + f"{n}_proj.{suffix}"] = (q + f"attn.qkv_proj.{suffix}", row)
        out[a + "o_proj.weight"] = (q + "attn.o_proj.weight", 0)
        if cfg.o_bias:
            out[a + "o_proj.bias"] = (q + "attn.o_proj.bias", 0)
        if cfg.qk_norm:
            out[a + "q_norm.weight"] = (q + "attn.q_norm.weight", 0)
            out[a + "k_norm.weight"] = (q + "attn.k_norm.weight", 0)
        for suffix in ("weight", "bias") if cfg.mlp_bias else ("weight",):
            out[m + f"gate_proj.{suffix}"] = (q + f"mlp.gate_up_proj.{suffix}", 0)
            out[m + f"up_proj.{suffix}"] = (q + f"mlp.gate_up_proj.{suffix}", f)
            out[m + f"down_proj.{suffix}"] = (q + f"mlp.down_proj.{suffix}", 0)
    return out


def _stream_into(model: Decoder, path: Path, files: list[Path], slices: dict[str, tuple[str, int]]) -> None:
    """Copy every checkpoint tensor into its (slice of a) parameter of `model`, one tensor at a time: each is read
    from the memory-mapped file, moved to the parameter's device and cast there, so the host holds about one
    tensor, never the whole state dict; q/k/v and gate/up are fused in place on the device."""
    params = dict(model.named_parameters())
    device = model.embed_tokens.weight.device
    read_on = "cpu" if device.type in ("cpu", "meta") else str(device)  # safetensors reads straight to a GPU
    try:
        for file in files:
            with safe_open(str(file), framework="pt", device=read_on) as f:
                for name in f.keys():  # noqa: SIM118 (a safe_open handle is not a dict)
                    if name not in slices:
                        continue
                    ours, row = slices[name]
                    t = f.get_tensor(name)
                    check_finite(file, {name: t})
                    dst = params[ours]
                    with torch.no_grad():
                        dst[row:row + t.shape[0]].copy_(t, non_blocking=True)
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{path}: weights are unreadable ({e}); the checkpoint may be half-written") from None


TARGET_PARTS = ("all", "head")  # `load_target(parts=...)`: every weight, or the embedding, final norm and LM head


def load_target(path: str | Path, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                parts: str = "all") -> Decoder:
    """Load a HF-layout causal-LM folder into our `Decoder` on `device` in `dtype` (eval mode, no grad needed).

    The model is built on the meta device and given its storage once, on `device`, in `dtype`; the checkpoint's
    tensors are then streamed into it (`_stream_into`): no full-size copy on the host, no throw-away allocation.
    `device="meta"` gives the model's layout without reading a weight. `parts="head"` loads only the embedding,
    the final norm and the LM head, and leaves the decoder layers on the meta device (no memory, never read): what
    a trainer reading the target's hidden states from a cache or a stream needs of it."""
    if parts not in TARGET_PARTS:
        raise ValueError(f"parts must be one of {TARGET_PARTS}, got {parts!r}")
    path = Path(path)
    device = torch.device(device)
    cfg = read_config(path)
    # Streamed onto an accelerator, the weights never sit in host memory whole: its size is no limit there.
    files = validate_hf_folder(path, cfg, torch.empty((), dtype=dtype).element_size(), host=device.type == "cpu")
    with torch.device("meta"):
        model = Decoder(cfg).to(dtype)
    if cfg.tie_word_embeddings:  # untied while storage is given, so the head gets none of its own, then tied again
        del model.lm_head._parameters["weight"]
    for module in [model] if parts == "all" else [model.embed_tokens, model.norm, model.lm_head]:
        module.to_empty(device=device)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    # Buffers created on meta are rebuilt for real (the rotary frequencies stay fp32).
    model.register_buffer("inv_freq", rope_inv_freq(cfg)[0].to(device), persistent=False)
    if device.type != "meta":
        slices = {k: v for k, v in hf_slices(cfg).items() if parts == "all" or not v[0].startswith("layers.")}
        _stream_into(model, path, files, slices)
    return model.eval()


def iter_state_dict(model: Decoder, path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """`model.state_dict()` in sorted name order, every tensor left on the meta device (the layers of a
    `parts="head"` load) read from the checkpoint folder `path` on the host and fused, one at a time: what
    fingerprinting the whole model needs, in the memory of one tensor."""
    path = Path(path)
    pieces: dict[str, list[tuple[str, int]]] = {}
    for hf_name, (ours, row) in hf_slices(model.config).items():
        pieces.setdefault(ours, []).append((hf_name, row))
    where = {name: file for file in _weight_files(path) for name in read_safetensors_header(file)}
    embedding = None  # a tied LM head is the embedding (a layout wholly on meta has neither loaded)
    for name, t in sorted(model.state_dict().items()):
        if t.device.type != "meta":
            yield name, t
            continue
        if name == "lm_head.weight" and name not in pieces and embedding is not None:
            yield name, embedding
            continue
        out = torch.empty(t.shape, dtype=t.dtype)
        for hf_name, row in pieces[name]:
            with safe_open(str(where[hf_name]), framework="pt") as f:
                piece = f.get_tensor(hf_name)
                check_finite(where[hf_name], {hf_name: piece})
            out[row:row + piece.shape[0]].copy_(piece)
        if name == "embed_tokens.weight" and model.config.tie_word_embeddings:
            embedding = out
        yield name, out


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
