"""What every exporter shares: its errors, its result, the output-folder rules, and the completeness / shape check
of an exported vLLM folder against the target's config, which needs no vLLM.

`check_vllm_folder` derives the tensors it expects from the exported `config.json` and the target's config alone
(not from the exporter's mapping), then compares names, shapes and dtypes with what `model.safetensors` holds, plus
vocabulary, hidden size, layer counts, tap ids and the draft-to-target map `d2t`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from angelspec.errors import UsageError
from angelspec.fileio import check_writable_path, same_path
from angelspec.models.config import DecoderConfig

WEIGHTS = "model.safetensors"
SPEC_CONFIG = "speculative_config.json"


class ExportRefused(ValueError):
    """The drafter (or the request) cannot be represented in the export format; the message says what does not fit."""


class ExportCheckError(ValueError):
    """An exported folder does not match what the format expects for this target (a bug in an exporter)."""


@dataclass
class ExportResult:
    """What an export wrote: the folder, the vLLM `speculative_config` dict, the source kind, and notes (parts of
    the drafter that were left out because the format has no use for them)."""

    out_dir: Path
    kind: str
    speculative_config: dict[str, Any]
    notes: list[str] = field(default_factory=list)
    engine: str = "vllm"  # "sglang": speculative_config holds SGLang's launch flags (flag -> value)

    def format(self) -> str:
        lines = [f"exported {self.kind} drafter to {self.out_dir}"]
        lines += [f"note: {n}" for n in self.notes]
        if self.engine == "sglang":
            lines.append("SGLang flags (python -m sglang.launch_server --model-path TARGET <these>):")
            lines.append(" ".join(f"{k} {v}" for k, v in self.speculative_config.items()))
        else:
            lines.append("speculative_config (vllm serve TARGET --speculative-config '<this>'):")
            lines.append(json.dumps(self.speculative_config))
        return "\n".join(lines)


def prepare_out_dir(src: Path, out: Path, force: bool, *, target_dir: Path | None = None) -> None:
    """Refuse, before anything is written, an output folder that is the source or the target (or holds one of
    them), a file, a non-empty folder without `force`, or one that cannot be written. The output is then written
    with `fileio.staged_folder`, which swaps it in whole: a failure leaves the previous contents as they were."""
    for flag, folder in (("the drafter folder", src), ("the target folder --target", target_dir)):
        if folder is None or not folder.exists():
            continue
        if out.exists() and same_path(out, folder):
            raise UsageError(f"OUT_DIR {out} is {flag} itself; writing it would destroy the input, so give another "
                             "folder")
        if folder.resolve().is_relative_to(out.resolve()):
            raise UsageError(f"OUT_DIR {out} contains {flag} {folder}; replacing it would destroy the input, so give "
                             "another folder")
    if out.exists() and not out.is_dir():
        raise UsageError(f"OUT_DIR {out} is a file; give a folder")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise FileExistsError(f"OUT_DIR {out} is not empty; pass --force to replace its contents")
    check_writable_path(out / "config.json", "OUT_DIR")


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not a dict)


# vLLM's EAGLE-3 class names: Qwen3 layer (q/k norm) and Llama layer (none; both names load `llama_eagle3.py`).
EAGLE3_QWEN3_ARCH = "Eagle3Qwen3ForCausalLM"
EAGLE3_LLAMA_ARCHS = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


def layer_model_type(arch: str | None, cfg: dict[str, Any] | None = None) -> str:
    """The draft layers' `model_type` an exported architecture implies: "llama" for the Llama EAGLE-3, the one its
    config names for the plugin's MTP (it builds either layer), else "qwen3" (vLLM's Qwen3 EAGLE-3, DFlash and
    DSpark classes and the plugin's DFly / DFlare)."""
    if arch in EAGLE3_LLAMA_ARCHS or (arch == "AngelSpecMTPEagle3" and (cfg or {}).get("model_type") == "llama"):
        return "llama"
    return "qwen3"


def _layer_specs(prefix: str, cfg: dict[str, Any], in_features: int, dtype: torch.dtype, qk_norm: bool = True
                 ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The tensors of one Qwen3 (`qk_norm`) or Llama decoder layer under `prefix` whose q/k/v read `in_features`
    inputs."""
    h, i, dh = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * dh, cfg["num_key_value_heads"] * dh
    shapes = {"input_layernorm.weight": (h,), "self_attn.q_proj.weight": (q, in_features),
              "self_attn.k_proj.weight": (kv, in_features), "self_attn.v_proj.weight": (kv, in_features),
              "self_attn.o_proj.weight": (h, q), "post_attention_layernorm.weight": (h,),
              "mlp.gate_proj.weight": (i, h), "mlp.up_proj.weight": (i, h), "mlp.down_proj.weight": (h, i)}
    if qk_norm:
        shapes.update({"self_attn.q_norm.weight": (dh,), "self_attn.k_norm.weight": (dh,)})
    return {f"{prefix}{name}": (shape, dtype) for name, shape in shapes.items()}


def _fused_block_specs(cfg: dict[str, Any], dtype: torch.dtype) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The tensors of the angelspec[vllm] plugin's DFly / DFlare class (config `angelspec_block`)."""
    h, layers, block = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["angelspec_block"]
    taps = len(cfg["dflash_config"]["target_layer_ids"])
    out = {"fusion_logits": ((layers, taps), torch.float32)}
    for n in range(layers):
        out[f"context_norms.{n}.weight"] = ((h,), dtype)
        out.update(_layer_specs(f"layers.{n}.", cfg, h, dtype))
    if block["conditioning"] == "dfly":
        out["fc.weight"] = ((h, taps * h), dtype)
        if block["fc_bias"]:
            out["fc.bias"] = ((h,), dtype)
    if block["head"] == "hidden":
        i = block["head_intermediate_size"]
        out.update({"head.z_norm.weight": ((h,), dtype), "head.e_norm.weight": ((h,), dtype),
                    "head.gate_up_proj.weight": ((2 * i, 2 * h), dtype), "head.down_proj.weight": ((h, i), dtype)})
    if block["anchor_fusion"]:
        out.update({"anchor_norm.weight": ((h,), dtype), "anchor_fuse.weight": ((h, 2 * h), dtype)})
    return out


def expected_tensors(cfg: dict[str, Any], dtype: torch.dtype) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every tensor a vLLM drafter folder with this config.json must hold: name -> (shape, dtype)."""
    arch = (cfg.get("architectures") or [None])[0]
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    vd = cfg.get("draft_vocab_size") or v
    out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {"norm.weight": ((h,), dtype)}
    if arch == EAGLE3_QWEN3_ARCH or arch in EAGLE3_LLAMA_ARCHS:
        taps = len(cfg["eagle_aux_hidden_state_layer_ids"])
        out["fc.weight"] = ((h, taps * h), dtype)
        out["midlayer.hidden_norm.weight"] = ((h,), dtype)
        out.update(_layer_specs("midlayer.", cfg, 2 * h, dtype, qk_norm=arch == EAGLE3_QWEN3_ARCH))
    elif arch in ("DFlashDraftModel", "Qwen3DSparkModel"):
        taps = len(cfg["dflash_config"]["target_layer_ids"])
        out["fc.weight"] = ((h, taps * h), dtype)
        out["hidden_norm.weight"] = ((h,), dtype)
        for n in range(cfg["num_hidden_layers"]):
            out.update(_layer_specs(f"layers.{n}.", cfg, h, dtype))
        if arch == "Qwen3DSparkModel":
            r = cfg["markov_rank"]
            out["markov_head.markov_w1.weight"] = ((v, r), dtype)
            out["markov_head.markov_w2.weight"] = ((vd, r), dtype)
            if cfg.get("enable_confidence_head"):
                width = h + (r if cfg.get("confidence_head_with_markov") else 0)
                out["confidence_head.proj.weight"] = ((1, width), dtype)
                out["confidence_head.proj.bias"] = ((1,), dtype)
    elif arch == "AngelSpecMTPEagle3":
        out.update({"hidden_norm.weight": ((h,), dtype), "embed_norm.weight": ((h,), dtype),
                    "proj.weight": ((h, 2 * h), dtype),
                    **_layer_specs("layers.0.", cfg, h, dtype, qk_norm=layer_model_type(arch, cfg) == "qwen3")})
    elif arch == "AngelSpecDFlyDFlash":
        out.update(_fused_block_specs(cfg, dtype))
    else:
        raise ExportCheckError(f"unknown exported architecture {arch!r}")
    if vd != v:
        out["lm_head.weight"] = ((vd, h), dtype)
        out["d2t"] = ((vd,), torch.int64)
    return out


def check_vllm_folder(out: Path, target: DecoderConfig, spec: dict[str, Any] | None = None, *,
                      final: Path | None = None) -> None:
    """Raise ExportCheckError unless `out` is a complete vLLM drafter folder for `target` (module docstring); `spec`
    is its vLLM speculative_config (default: read from speculative_config.json); `final`: the folder `out` is about
    to become, which the config names (default: `out`)."""
    problems: list[str] = []
    cfg = json.loads((out / "config.json").read_text(encoding="utf-8"))
    if spec is None:
        spec = json.loads((out / SPEC_CONFIG).read_text(encoding="utf-8"))
    if spec.get("method") == "draft_model":
        if cfg.get("vocab_size") != target.vocab_size:
            problems.append(f"draft model vocab_size {cfg.get('vocab_size')} != target's {target.vocab_size}")
        if not any(out.glob("*.safetensors")):
            problems.append("no safetensors weights")
        if problems:
            raise ExportCheckError(f"{out}: " + "; ".join(problems))
        return
    tensors = read_tensors(out / WEIGHTS)
    dtype = tensors["norm.weight"].dtype if "norm.weight" in tensors else torch.float32
    arch = (cfg.get("architectures") or [None])[0]
    for key, want in (("vocab_size", target.vocab_size), ("hidden_size", target.hidden_size),
                      ("model_type", layer_model_type(arch, cfg))):
        if cfg.get(key) != want:
            problems.append(f"config {key} = {cfg.get(key)!r}, expected {want!r}")
    try:
        expected = expected_tensors(cfg, dtype)
    except KeyError as e:
        raise ExportCheckError(f"{out}/config.json lacks {e}") from None
    missing = sorted(set(expected) - set(tensors))
    extra = sorted(set(tensors) - set(expected))
    if missing:
        problems.append(f"missing tensors {missing}")
    if extra:
        problems.append(f"unexpected tensors {extra}")
    for name in sorted(set(expected) & set(tensors)):
        shape, want_dtype = expected[name]
        t = tensors[name]
        if tuple(t.shape) != shape or t.dtype != want_dtype:
            problems.append(f"{name}: {tuple(t.shape)} {t.dtype}, expected {shape} {want_dtype}")
    layers = sorted({int(k.split(".")[1]) for k in tensors if k.startswith("layers.")})
    if arch in (EAGLE3_QWEN3_ARCH, *EAGLE3_LLAMA_ARCHS, "AngelSpecMTPEagle3"):
        ids = cfg["eagle_aux_hidden_state_layer_ids"]
        if cfg.get("num_hidden_layers") != 1:
            problems.append(f"EAGLE-3 num_hidden_layers = {cfg.get('num_hidden_layers')}, expected 1")
        if (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") != ids:
            problems.append("eagle_config.eagle_aux_hidden_state_layer_ids differs from the top-level ids")
        lo, hi = 1, target.num_hidden_layers  # "residual stream before layer i": 1..L
    else:
        ids = cfg["dflash_config"]["target_layer_ids"]
        if layers != list(range(cfg["num_hidden_layers"])):
            problems.append(f"layers {layers} do not match num_hidden_layers = {cfg['num_hidden_layers']}")
        if cfg.get("rope_theta") is None or (cfg.get("rope_parameters") or {}).get("rope_theta") != cfg["rope_theta"]:
            problems.append("rope_theta / rope_parameters.rope_theta missing or different")
        if cfg["dflash_config"].get("mask_token_id") is None \
                or not 0 <= cfg["dflash_config"]["mask_token_id"] < target.vocab_size:
            problems.append(f"dflash_config.mask_token_id {cfg['dflash_config'].get('mask_token_id')} not in the vocab")
        lo, hi = 0, target.num_hidden_layers - 1  # 0-based, vLLM adds one
    if not ids or list(ids) != sorted(set(ids)) or not all(lo <= i <= hi for i in ids):
        problems.append(f"tap ids {ids} are not increasing ids in [{lo}, {hi}] for a {target.num_hidden_layers}-layer "
                        "target")
    if spec.get("num_speculative_tokens", 0) < 1 or spec.get("model") != str((final or out).resolve()):
        problems.append(f"bad speculative_config {spec}")
    if "d2t" in tensors and "d2t" not in missing:
        d2t = tensors["d2t"]
        ids_t = torch.arange(d2t.numel()) + d2t
        if not bool(((ids_t >= 0) & (ids_t < target.vocab_size)).all()) or ids_t.unique().numel() != d2t.numel():
            problems.append("d2t does not map the draft ids to distinct target ids")
    if problems:
        raise ExportCheckError(f"{out} is not a valid vLLM export for this target: " + "; ".join(problems))
