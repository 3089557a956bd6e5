"""Import a vLLM-format EAGLE-3 or DFlash drafter folder (an `angelspec export --format vllm` output, or one trained
elsewhere for a Qwen3 or Llama target) as an AngelSpec drafter folder, so `angelspec eval --drafter OUT_DIR` measures
it on our engine and depth policies (`angelspec import --format vllm VLLM_DIR OUT_DIR`).

The inverse of `export.vllm`, with the same name tables (`FUSED`, `RENAMED`, `QK_NORM`): q/k/v and gate/up are fused
again, tap ids go back to our counting (EAGLE-3's `eagle_aux_hidden_state_layer_ids` minus one; DFlash's 0-based
`dflash_config.target_layer_ids` as they are, or the top-level aux ids minus one when a folder has them, since vLLM
reads those first), `d2t` becomes our draft vocabulary. Read from vLLM 0.32's loaders (`qwen3_eagle3.py`,
`llama_eagle3.py`, `qwen3_dflash.py`): without aux ids EAGLE-3 taps the target's default (2, L//2, L-3) in vLLM's
counting, and DFlash without `rope_theta` uses 1e6; an import reproduces both.

Our drafters share the target's embedding and LM head, so a folder's own `embed_tokens` or `lm_head` is imported
only when it equals the target's (rows): a drafter trained with its own head is refused, by name. So is everything
our EAGLE-3 / DFlash cannot compute: more than one EAGLE-3 layer, fc norms, attention biases, sliding windows,
non-causal options beyond DFlash's block, a separate mask embedding. The EAGLE-3 layout must be the target family's
(the Qwen3 one, with q/k norm, for a Qwen3 target; the LLaMA one, without, for a Llama target), as our exporter writes
it; DFlash (Qwen3 draft layers) imports for either target.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from angelspec.assets import resolve_target_dir
from angelspec.decoding.loading import other_weights, target_weights_id
from angelspec.export.checks import (
    EAGLE3_LLAMA_ARCHS,
    EAGLE3_QWEN3_ARCH,
    SPEC_CONFIG,
    ExportRefused,
    layer_model_type,
    prepare_out_dir,
    read_tensors,
)
from angelspec.export.vllm import _target_lm_head, fuse_layer, target_tensor
from angelspec.fileio import staged_folder
from angelspec.models.block.config import BlockDrafterConfig
from angelspec.models.block.drafter import BlockDrafter
from angelspec.models.block.io import BLOCK_META_KEYS, save_block_drafter
from angelspec.models.config import ConfigError, DecoderConfig
from angelspec.models.eagle3 import Eagle3Config, Eagle3DraftModel
from angelspec.models.hf_io import read_config, read_config_json
from angelspec.models.mtp_io import MTP_META_KEYS, save_mtp

EAGLE3_ARCH, DFLASH_ARCH = EAGLE3_QWEN3_ARCH, "DFlashDraftModel"
EAGLE3_FOR_TARGET = {"qwen3": EAGLE3_QWEN3_ARCH, "llama": EAGLE3_LLAMA_ARCHS[0]}  # target family -> EAGLE-3 layout
DFLASH_DEFAULT_ROPE_THETA = 1_000_000.0  # vLLM's DFlash: set_default_rope_theta(config, default_theta=1000000)
EAGLE3_DEFAULT_DEPTHS = 3  # num_depths when the folder has no speculative_config.json (inference picks K anyway)
# config.json switches of vLLM's EAGLE-3 / DFlash classes that change the computation; our models have none of them.
UNSUPPORTED_FLAGS = ("norm_before_fc", "fc_norm", "norm_output", "norm_before_residual", "attention_bias",
                     "use_sliding_window", "layer_types", "use_swa", "causal", "attention_sink_bias",
                     "attention_value_scale", "parallel_drafting")


class ImportRefused(ExportRefused):
    """The folder is not a vLLM drafter that AngelSpec can compute exactly; the message says what does not fit."""


@dataclass
class ImportResult:
    """What an import wrote: the AngelSpec drafter folder, its kind, and notes."""

    out_dir: Path
    kind: str
    notes: list[str] = field(default_factory=list)

    def format(self) -> str:
        lines = [f"imported a {self.kind} drafter to {self.out_dir}", *(f"note: {n}" for n in self.notes)]
        lines.append(f"use it with: angelspec eval --drafter {self.out_dir}")
        return "\n".join(lines)


def _flag_values(cfg: dict[str, Any]) -> dict[str, Any]:
    """The switches of UNSUPPORTED_FLAGS that are set, at the top level or in eagle_config / dflash_config."""
    found = {}
    for where in (cfg, cfg.get("eagle_config") or {}, cfg.get("dflash_config") or {}):
        found.update({k: where[k] for k in UNSUPPORTED_FLAGS if where.get(k) not in (None, False, [], "")})
    if found.get("layer_types") and all(t == "full_attention" for t in found["layer_types"]):
        del found["layer_types"]
    return found


def _shape(cfg: dict[str, Any], target: DecoderConfig, rope_default: float | None,
           model_type: str = "qwen3") -> dict[str, Any]:
    """The `LayerShape` fields of a vLLM drafter config.json (layers of `model_type`: "qwen3" with q/k norm, "llama"
    without), checked against the target's width and vocabulary."""
    try:
        shape = DecoderConfig.from_hf_dict({**cfg, "architectures": [], "model_type": model_type})
    except (ConfigError, ValueError, TypeError) as e:
        raise ImportRefused(f"config.json does not describe {model_type} layers ({e})") from None
    if shape.rope_scaling is not None:
        raise ImportRefused(f"RoPE scaling {shape.rope_scaling} is not supported in a drafter")
    if (shape.vocab_size, shape.hidden_size) != (target.vocab_size, target.hidden_size):
        raise ImportRefused(f"the drafter has vocab {shape.vocab_size} / hidden {shape.hidden_size}, the target "
                            f"{target.vocab_size} / {target.hidden_size}: it was trained for another target")
    target_hidden = cfg.get("target_hidden_size")
    if target_hidden not in (None, target.hidden_size):
        raise ImportRefused(f"target_hidden_size {target_hidden} differs from the target's {target.hidden_size}")
    out = shape.layer_shape()
    has_theta = "rope_theta" in cfg or "rope_theta" in (cfg.get("rope_parameters") or {})
    if rope_default is not None and not has_theta:
        out["rope_theta"] = rope_default
    return out


def _shared_tensor(state: dict[str, torch.Tensor], name: str, want: torch.Tensor | None, what: str) -> None:
    """Drop `name` from `state` if it equals `want` (compared in the lower of the two precisions); refuse otherwise."""
    have = state.pop(name, None)
    if have is None:
        return
    if want is None:
        raise ImportRefused(f"the drafter has {name} but the target folder holds no {what} to compare it with")
    low = have.dtype if have.dtype.itemsize <= want.dtype.itemsize else want.dtype
    if have.shape != want.shape or not torch.equal(have.to(low), want.to(low)):
        raise ImportRefused(f"{name} differs from the target's {what}: AngelSpec drafters share the target's "
                            f"embedding and LM head, so a drafter trained with its own {name} cannot be imported")


def _draft_vocab(state: dict[str, torch.Tensor], cfg: dict[str, Any], target: DecoderConfig, target_dir: Path
                 ) -> list[int] | None:
    """The draft vocabulary (target ids) from `d2t` and `lm_head.weight`, None for the whole vocabulary; the head
    must be the target's rows of those ids."""
    size = int(cfg.get("draft_vocab_size") or target.vocab_size)
    d2t = state.pop("d2t", None)
    state.pop("t2d", None)  # vLLM ignores it too; d2t carries the map
    if size == target.vocab_size and d2t is None:
        ids = None
    elif d2t is None:
        raise ImportRefused(f"draft_vocab_size is {size} but there is no d2t tensor to map draft ids to target ids")
    else:
        ids_t = torch.arange(d2t.numel()) + d2t.to(torch.int64)
        if d2t.numel() != size or ids_t.unique().numel() != size or not bool(
                ((ids_t >= 0) & (ids_t < target.vocab_size)).all()):
            raise ImportRefused(f"d2t does not map {size} draft ids to distinct target ids")
        ids = ids_t.tolist()
    if "lm_head.weight" in state:
        head = _target_lm_head(target_dir)
        _shared_tensor(state, "lm_head.weight", head if ids is None else head[torch.tensor(ids)], "LM head rows")
    elif ids is not None:
        raise ImportRefused("a draft vocabulary needs lm_head.weight (vLLM builds the draft head from it)")
    return ids if ids is not None and size != target.vocab_size else None


def _shared_embedding(state: dict[str, torch.Tensor], target_dir: Path) -> None:
    """A drafter's own `embed_tokens.weight` must be the target's (vLLM shares the target's when there is none)."""
    if "embed_tokens.weight" in state:
        _shared_tensor(state, "embed_tokens.weight", target_tensor(target_dir, ("model.embed_tokens.weight",)),
                       "embedding")


def _placeholders(target: DecoderConfig) -> tuple[nn.Embedding, nn.Linear]:
    """Shape-only stand-ins for the target's embedding and LM head: a drafter only references them, never saves them."""
    return (nn.Embedding(target.vocab_size, target.hidden_size, device="meta"),
            nn.Linear(target.hidden_size, target.vocab_size, bias=False, device="meta"))


def _load(model: nn.Module, tensors: dict[str, torch.Tensor], src: Path) -> None:
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    missing = [m for m in missing if m != "draft_vocab"]
    if missing or unexpected:
        raise ImportRefused(f"{src}: the tensors do not fit the config (missing {missing[:4]}, unexpected "
                            f"{unexpected[:4]})")


def _eagle3(cfg: dict[str, Any], state: dict[str, torch.Tensor], spec: dict[str, Any], target: DecoderConfig,
            target_dir: Path) -> tuple[nn.Module, list[str]]:
    model_type = layer_model_type((cfg.get("architectures") or [None])[0])
    if cfg.get("num_hidden_layers", 1) != 1:
        raise ImportRefused(f"an EAGLE-3 with {cfg['num_hidden_layers']} layers; ours has one (midlayer)")
    if (cfg.get("eagle_config") or {}).get("use_aux_hidden_state") is False:
        raise ImportRefused("use_aux_hidden_state is false: our EAGLE-3 always conditions on three target taps")
    notes = []
    ids = cfg.get("eagle_aux_hidden_state_layer_ids") or (cfg.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids")
    if not ids:
        n = target.num_hidden_layers
        ids = [2, n // 2, n - 3]
        notes.append(f"no eagle_aux_hidden_state_layer_ids: vLLM's default {ids} for a {n}-layer target")
    taps = [int(i) - 1 for i in ids]  # vLLM counts the residual stream before layer i (trap 2)
    vocab = _draft_vocab(state, cfg, target, target_dir)
    _shared_embedding(state, target_dir)
    depths = int(spec.get("num_speculative_tokens") or EAGLE3_DEFAULT_DEPTHS)
    def build() -> tuple[Eagle3Config, dict[str, torch.Tensor]]:
        config = Eagle3Config(**_shape(cfg, target, None, model_type), target_layer_ids=tuple(taps),
                              target_fingerprint=target.fingerprint(), target_num_layers=target.num_hidden_layers,
                              draft_vocab_size=len(vocab) if vocab else 0, num_depths=depths)
        tensors = {"fc.weight": state.pop("fc.weight"), "hidden_norm.weight": state.pop("midlayer.hidden_norm.weight"),
                   **fuse_layer(state, "midlayer.", "layer.", config.qk_norm), "norm.weight": state.pop("norm.weight")}
        return config, tensors

    return _assemble("EAGLE-3", build, Eagle3DraftModel, target, spec, vocab), notes


def _dflash(cfg: dict[str, Any], state: dict[str, torch.Tensor], spec: dict[str, Any], target: DecoderConfig,
            target_dir: Path) -> tuple[nn.Module, list[str]]:
    dflash = cfg.get("dflash_config") or {}
    if dflash.get("use_aux_hidden_state", cfg.get("use_aux_hidden_state", True)) is False:
        raise ImportRefused("use_aux_hidden_state is false: our DFlash always conditions on target taps")
    aux = cfg.get("eagle_aux_hidden_state_layer_ids")  # vLLM reads these before dflash_config's
    taps = [int(i) - 1 for i in aux] if aux else [int(i) for i in dflash.get("target_layer_ids") or []]
    if not taps:
        raise ImportRefused("the config names no target layers (dflash_config.target_layer_ids)")
    mask = dflash.get("mask_token_id", cfg.get("mask_token_id"))
    if mask is None:
        raise ImportRefused("the config has no mask token (dflash_config.mask_token_id)")
    block = cfg.get("block_size") or (int(spec["num_speculative_tokens"]) + 1 if spec.get("num_speculative_tokens")
                                      else None)
    if not block:
        raise ImportRefused("neither block_size in config.json nor num_speculative_tokens in speculative_config.json")
    if "mask_embedding" in state:
        raise ImportRefused("a separate mask_embedding tensor: our DFlash embeds the mask token with the target's "
                            "embedding")
    notes = [] if "rope_theta" in cfg or "rope_theta" in (cfg.get("rope_parameters") or {}) else [
        f"no rope_theta: vLLM's DFlash default {DFLASH_DEFAULT_ROPE_THETA:g}"]
    vocab = _draft_vocab(state, cfg, target, target_dir)
    _shared_embedding(state, target_dir)
    layers = int(cfg.get("num_hidden_layers", 0))
    def build() -> tuple[BlockDrafterConfig, dict[str, torch.Tensor]]:
        config = BlockDrafterConfig(**_shape(cfg, target, DFLASH_DEFAULT_ROPE_THETA), target_layer_ids=tuple(taps),
                                    mask_token_id=int(mask), block_size=int(block), num_draft_layers=layers,
                                    conditioning="dflash", head="none", confidence_head=False,
                                    context_injection="shared", fc_bias=False,  # vLLM's DFlash: one fc, no bias
                                    target_fingerprint=target.fingerprint(),
                                    target_num_layers=target.num_hidden_layers,
                                    draft_vocab_size=len(vocab) if vocab else 0)
        tensors = {"fc.weight": state.pop("fc.weight"), "hidden_norm.weight": state.pop("hidden_norm.weight"),
                   "norm.weight": state.pop("norm.weight")}
        for n in range(layers):
            tensors.update(fuse_layer(state, f"layers.{n}.", f"layers.{n}."))
        return config, tensors

    return _assemble("DFlash", build, BlockDrafter, target, spec, vocab), notes


def _assemble(what: str, build: Callable[[], tuple[Any, dict[str, torch.Tensor]]], model_cls: Callable[..., nn.Module],
              target: DecoderConfig, spec: dict[str, Any], vocab: list[int] | None) -> nn.Module:
    """Our drafter from `build()`'s (config, tensors), with the config and missing-tensor errors as one-line
    refusals, its draft vocabulary set."""
    try:
        config, tensors = build()
    except ConfigError as e:
        raise ImportRefused(f"the {what} config does not fit the target ({e})") from None
    except KeyError as e:
        raise ImportRefused(f"the weights lack {e.args[0]}") from None
    model = model_cls(config, *_placeholders(target))
    _load(model, tensors, Path(spec.get("model", "")))
    if vocab:
        model.set_draft_vocab(vocab)  # type: ignore[operator]
    return model


def import_vllm(src_dir: str | Path, out_dir: str | Path, *, target: str | Path | None = None,
                force: bool = False) -> ImportResult:
    """Write the AngelSpec drafter folder `out_dir` from the vLLM-format EAGLE-3 or DFlash folder `src_dir`, for the
    target `target` (default: the embedded target); refuse what our models cannot compute exactly (module
    docstring)."""
    src, out = Path(src_dir), Path(out_dir)
    cfg = read_config_json(src, "is it a vLLM drafter folder?", "drafter folder")
    target_dir = resolve_target_dir(target)
    target_cfg = read_config(target_dir)
    arch = (cfg.get("architectures") or [None])[0]
    if target_cfg.model_type not in EAGLE3_FOR_TARGET:
        raise ImportRefused(f"import reads drafters for {' and '.join(EAGLE3_FOR_TARGET)} targets; the target is "
                            f"{target_cfg.model_type!r}")
    eagle3 = EAGLE3_FOR_TARGET[target_cfg.model_type]
    is_eagle3 = arch in (EAGLE3_QWEN3_ARCH, *EAGLE3_LLAMA_ARCHS)
    if not is_eagle3 and arch != DFLASH_ARCH:
        raise ImportRefused(f"{src} holds a {arch!r} drafter; import reads {eagle3} and {DFLASH_ARCH} for a "
                            f"{target_cfg.model_type} target")
    if is_eagle3 and layer_model_type(arch) != layer_model_type(eagle3):
        layout = "LLaMA EAGLE-3 layout (no q/k norm)" if arch in EAGLE3_LLAMA_ARCHS else \
            "Qwen3 EAGLE-3 layout (q/k norm)"
        raise ImportRefused(f"{src} holds the {layout}, {arch}; our EAGLE-3 for a {target_cfg.model_type} target "
                            f"takes the target's layer ({eagle3})")
    flags = _flag_values(cfg)
    if flags:
        raise ImportRefused(f"{src}: {', '.join(f'{k}={v}' for k, v in flags.items())} changes the drafter in ways "
                            f"AngelSpec's {'EAGLE-3' if is_eagle3 else 'DFlash'} cannot compute")
    meta = cfg.get("angelspec") or {}
    if meta.get("target_fingerprint") not in (None, target_cfg.fingerprint()):
        raise ImportRefused(f"{src} was exported for a target with fingerprint {meta['target_fingerprint']}, this "
                            f"target's is {target_cfg.fingerprint()}: pass --target with the drafter's target")
    target_weights = target_weights_id(target_dir)  # recorded in OUT_DIR, so a later load checks the weights too
    problem = other_weights(meta.get("target_weights"), target_weights)
    if problem is not None:
        raise ImportRefused(f"{src} was exported for a target with {problem}: pass --target with the drafter's target")
    weights = sorted(src.glob("*.safetensors"))
    if not weights:
        raise ImportRefused(f"{src} has no safetensors weights")
    state = {k: v for f in weights for k, v in read_tensors(f).items()}
    spec_file = src / SPEC_CONFIG
    spec = json.loads(spec_file.read_text(encoding="utf-8")) if spec_file.is_file() else {}
    build = _eagle3 if is_eagle3 else _dflash
    model, notes = build(cfg, state, {**spec, "model": str(src)}, target_cfg, target_dir)
    if state:
        raise ImportRefused(f"{src} holds tensors AngelSpec's drafter has no place for: {sorted(state)[:6]}")
    derived = MTP_META_KEYS if is_eagle3 else BLOCK_META_KEYS
    extra = {k: v for k, v in meta.items() if k not in derived and k != "exported_from"}
    extra.update(imported_from=str(src.resolve()), imported_format=f"vllm:{arch}", target_weights=target_weights)
    prepare_out_dir(src, out, force, target_dir=target_dir)
    with staged_folder(out) as stage:  # swapped in whole once written: a failure leaves OUT_DIR as it was
        (save_mtp if is_eagle3 else save_block_drafter)(model, stage, extra)  # type: ignore[operator]
    return ImportResult(out, model.config.drafter, notes)
