"""Export to vLLM 0.32 (Qwen3 and Llama targets): EAGLE-3 (`Eagle3Qwen3ForCausalLM` for a Qwen3 layer with q/k
norm, `LlamaForCausalLMEagle3` for a Llama layer without), DFlash (`DFlashDraftModel`), DSpark (`Qwen3DSparkModel`,
plain Markov head) and a draft LM (`method: "draft_model"`, copied as it is), all vLLM's own classes; and, for the
angelspec[vllm] plugin (`angelspec_vllm`, which registers the classes with vLLM), MTP (`AngelSpecMTPEagle3`, driven
by vLLM's EAGLE-3 proposer) and DFly / DFlare (`AngelSpecDFlyDFlash`, driven by its DFlash proposer: per-layer
fusion, hidden-correction head, fused anchor input). Those two keep our tensor names, the decoder layers split into
vLLM's as below (`_mtp_plugin`, `_fused_block_plugin`).

The EAGLE-3 (and plugin MTP) layer follows the drafter's own layer: ours takes the target's layer shape, so a Llama
target's drafter has no q/k norm and is written as vLLM's `llama_eagle3.py` reads it (`midlayer.*` without `q_norm` /
`k_norm`, `model_type: llama`). vLLM's DFlash and DSpark classes (and the plugin's DFly / DFlare, built on them) make
Qwen3 draft layers (`qwen3_dflash.py`) whatever the target, so a block drafter exports only when its layers have q/k
norm (every new block drafter has, for every target, `BlockDrafterConfig.for_target`); one without is refused.

Name mapping (ours -> vLLM, no `model.` prefix; a fused q/k/v or gate/up projection is split by rows):

  EAGLE-3   fc.weight -> fc.weight; hidden_norm -> midlayer.hidden_norm; layer.* -> midlayer.* (attn -> self_attn);
            norm -> norm
  DFlash    fc.weight -> fc.weight (no fc.bias, or a zero one: vLLM's fc has none; new DFlash / DSpark drafters
            are built without it); hidden_norm -> hidden_norm;
            layers.N.* -> layers.N.* (attn -> self_attn); norm -> norm
  DSpark    DFlash + head.embed -> markov_head.markov_w1 [V, r]; head.out -> markov_head.markov_w2 [V', r];
            confidence.proj -> confidence_head.proj (input [h; W1 x_prev]: confidence_head_with_markov); vLLM's head
            has one output and no temperature input, so a "protocol" head (one output per sampling temperature) is
            written as its output at T = 0, the greedy acceptance (a note says so). Only with
            the shared fused context: Qwen3DSparkModel is DFlash's backbone, so same-layer injection is refused

A draft vocabulary (`draft_vocab` buffer: draft index -> target id) becomes `lm_head.weight` = the target's LM-head
rows [V', C] and `d2t` (int64, target id = draft id + d2t[draft id]); without one the head is the target's (vLLM
shares it). Tap ids: EAGLE-3's `eagle_aux_hidden_state_layer_ids` count "the residual stream before layer i", so
our tap i is written i + 1; DFlash's `dflash_config.target_layer_ids` are 0-based like ours (vLLM adds one).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from angelspec.assets import resolve_target_dir
from angelspec.decoding.loading import other_weights, target_weights_id
from angelspec.export.checks import (
    EAGLE3_LLAMA_ARCHS,
    EAGLE3_QWEN3_ARCH,
    SPEC_CONFIG,
    WEIGHTS,
    ExportRefused,
    ExportResult,
    check_vllm_folder,
    prepare_out_dir,
    read_tensors,
)
from angelspec.fileio import staged_folder, write_json_atomic
from angelspec.models.block.config import DRAFTER_KINDS, BlockDrafterConfig
from angelspec.models.block.heads import temperature_weights
from angelspec.models.config import DecoderConfig
from angelspec.models.hf_io import read_config, read_config_json, save_safetensors_atomic
from angelspec.models.mtp_io import MTP_FAMILY

DRAFT_LM_TOKENS = 4  # num_speculative_tokens written for a draft LM (the engine's default)


# Our `DecoderLayer` tensor names -> vLLM's Qwen3 / Llama layer names: the fused projections (ours, vLLM's parts in
# row order), then the tensors that are only renamed (QK_NORM only in a layer with q/k norm). `_split_layer` and its
# inverse `fuse_layer` both read these.
FUSED = (("attn.qkv_proj.weight", ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")),
         ("mlp.gate_up_proj.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight")))
RENAMED = (("input_layernorm.weight", "input_layernorm.weight"),
           ("post_attention_layernorm.weight", "post_attention_layernorm.weight"),
           ("mlp.down_proj.weight", "mlp.down_proj.weight"), ("attn.o_proj.weight", "self_attn.o_proj.weight"))
QK_NORM = (("attn.q_norm.weight", "self_attn.q_norm.weight"), ("attn.k_norm.weight", "self_attn.k_norm.weight"))
# vLLM's EAGLE-3 classes: one for a Qwen3 draft layer (q/k norm), one for a Llama draft layer (llama_eagle3.py,
# registered under two names; public Llama EAGLE-3 checkpoints say LlamaForCausalLMEagle3, written here).
EAGLE3_LLAMA = EAGLE3_LLAMA_ARCHS[0]
EXPORT_TARGETS = ("qwen3", "llama")  # target families whose exports follow vLLM's loaders as read (module docstring)


def _renamed(qk_norm: bool) -> tuple[tuple[str, str], ...]:
    return RENAMED + QK_NORM if qk_norm else RENAMED


def _split_layer(state: dict[str, torch.Tensor], src: str, dst: str, cfg: Any) -> dict[str, torch.Tensor]:
    """One of our `DecoderLayer`s under `src` -> vLLM's layer names under `dst` (q/k/v and gate/up split; q/k norm
    when `cfg.qk_norm`)."""
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    sizes = ([q, kv, kv], [cfg.intermediate_size] * 2)
    out = {}
    for (ours, parts), split in zip(FUSED, sizes, strict=True):
        out.update(zip((dst + p for p in parts), state.pop(src + ours).split(split, dim=0), strict=True))
    out.update({dst + theirs: state.pop(src + ours) for ours, theirs in _renamed(cfg.qk_norm)})
    return out


def fuse_layer(state: dict[str, torch.Tensor], src: str, dst: str, qk_norm: bool = True) -> dict[str, torch.Tensor]:
    """The inverse of `_split_layer`: vLLM's layer names under `src` -> ours under `dst` (KeyError names a missing
    tensor)."""
    out = {dst + ours: torch.cat([state.pop(src + p) for p in parts], dim=0) for ours, parts in FUSED}
    out.update({dst + ours: state.pop(src + theirs) for ours, theirs in _renamed(qk_norm)})
    return out


def _shape_config(cfg: Any, target: DecoderConfig, num_layers: int, dtype: torch.dtype) -> dict[str, Any]:
    """The shape entries of a drafter config.json (plain RoPE with our rope_theta, written explicitly); model_type
    "qwen3" for layers with q/k norm, "llama" for layers without."""
    torch_dtype = str(dtype).removeprefix("torch.")
    layer = DecoderConfig(**{**cfg.layer_shape(), "model_type": "qwen3" if cfg.qk_norm else "llama"},
                          num_hidden_layers=num_layers)
    out = layer.to_hf_dict(torch_dtype)
    out.update(vocab_size=target.vocab_size, draft_vocab_size=cfg.draft_vocab_size or target.vocab_size,
               tie_word_embeddings=False, rope_theta=cfg.rope_theta,
               rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta}, rope_scaling=None)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        out[key] = getattr(target, key)
    return out


def _vocab_tensors(state: dict[str, torch.Tensor], cfg: Any, target_dir: Path, dtype: torch.dtype
                   ) -> dict[str, torch.Tensor]:
    """`lm_head.weight` (the target's rows of the draft vocabulary) and `d2t`, or nothing without a draft vocab."""
    vocab = state.pop("draft_vocab", None)
    if not cfg.draft_vocab_size:
        return {}
    vocab = vocab.to(torch.int64)
    head = _target_lm_head(target_dir)
    if tuple(head.shape) != (cfg.vocab_size, cfg.hidden_size):
        raise ExportRefused(f"the target's LM head is {tuple(head.shape)}, the drafter expects "
                            f"[{cfg.vocab_size}, {cfg.hidden_size}]")
    return {"lm_head.weight": head[vocab].to(dtype).contiguous(),
            "d2t": vocab - torch.arange(vocab.numel(), dtype=torch.int64)}


def _target_lm_head(target_dir: Path) -> torch.Tensor:
    """The target's LM head [V, C]: `lm_head.weight`, or the embedding when the head is tied."""
    head = target_tensor(target_dir, ("lm_head.weight", "model.embed_tokens.weight"))
    if head is None:
        raise ExportRefused(f"{target_dir} holds neither lm_head.weight nor model.embed_tokens.weight: the draft "
                            "vocabulary's LM head cannot be written")
    return head


def target_tensor(target_dir: Path, names: tuple[str, ...]) -> torch.Tensor | None:
    """The first of `names` the target folder's safetensors hold, read lazily (one tensor, not the model); None if
    it holds none of them."""
    index = target_dir / "model.safetensors.index.json"
    weight_map = json.loads(index.read_text())["weight_map"] if index.is_file() else None
    for name in names:
        file = target_dir / (weight_map.get(name, "") if weight_map is not None else WEIGHTS)
        if not file.is_file():
            continue
        with safe_open(str(file), framework="pt") as f:
            if name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                return f.get_tensor(name)
    return None


def _left(state: dict[str, torch.Tensor], kind: str) -> None:
    if state:
        raise ExportRefused(f"the {kind} drafter holds tensors the vLLM format has no place for: {sorted(state)}")


def _mtp_family(raw: dict[str, Any], kind: str, state: dict[str, torch.Tensor], target: DecoderConfig,
                target_dir: Path, out: Path) -> tuple[dict, dict, dict, list[str]]:
    if kind == "mtp":
        return _mtp_plugin(raw, state, target, target_dir, out)
    cfg = MTP_FAMILY[kind][0].from_dict(raw[f"{kind}_config"])
    cfg.check_target(target)
    dtype = state["norm.weight"].dtype
    tensors = {"fc.weight": state.pop("fc.weight"), "midlayer.hidden_norm.weight": state.pop("hidden_norm.weight"),
               **_split_layer(state, "layer.", "midlayer.", cfg), "norm.weight": state.pop("norm.weight")}
    tensors.update(_vocab_tensors(state, cfg, target_dir, dtype))
    _left(state, kind)
    ids = [i + 1 for i in cfg.target_layer_ids]  # vLLM counts the residual stream before layer i (trap 2)
    config = _shape_config(cfg, target, 1, dtype)
    config.update(architectures=[EAGLE3_QWEN3_ARCH if cfg.qk_norm else EAGLE3_LLAMA],
                  target_hidden_size=target.hidden_size,
                  eagle_aux_hidden_state_layer_ids=ids,
                  eagle_config={"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True})
    spec = {"method": "eagle3", "model": str(out.resolve()), "num_speculative_tokens": cfg.num_depths}
    return config, tensors, spec, []


ANCHOR_FUSION_REFUSED = ("the fused anchor input (anchor_fuse, anchor_norm: anchor_fusion=true) has no place in "
                         "{engine}, which embeds a block's anchor alone; train the drafter with anchor_fusion=false "
                         "to export it (vLLM: the angelspec[vllm] plugin serves it in DFly / DFlare drafters)")


def _block(raw: dict[str, Any], state: dict[str, torch.Tensor], target: DecoderConfig, target_dir: Path,
           out: Path) -> tuple[dict, dict, dict, list[str]]:
    cfg = BlockDrafterConfig.from_dict(raw["block_drafter_config"])
    cfg.check_target(target)
    if not cfg.qk_norm:
        raise ExportRefused(f"this {cfg.drafter} drafter's layers have no q/k norm (they took the {target.model_type} "
                            "target's layer shape), but vLLM 0.32's DFlash-based classes (DFlash, DSpark and the "
                            "angelspec[vllm] plugin's DFly / DFlare) build Qwen3 draft layers with q/k norm "
                            "(qwen3_dflash.py); train the drafter again (new block drafters get Qwen3 layers for "
                            "every target) to export it")
    if cfg.conditioning in PLUGIN_CONDITIONINGS:
        return _fused_block_plugin(cfg, state, target, target_dir, out)
    if cfg.conditioning != "dflash":
        raise ExportRefused(f"a {cfg.conditioning} drafter cannot be exported to vLLM: no vLLM class (nor the "
                            "angelspec[vllm] plugin) serves that conditioning")
    if not cfg.has_fc:
        raise ExportRefused("this dspark drafter injects each draft layer's own target tap (context_injection="
                            "same_layer, Uraion §3.3); vLLM 0.32's Qwen3DSparkModel is DFlash's backbone with one "
                            "shared fc context, so it cannot serve it. Train the drafter with context_injection=shared "
                            "to export it")
    if cfg.head == "hidden":
        raise ExportRefused("the hidden-correction head (head.*, Eq. 15) on the DFlash backbone has no vLLM class; "
                            "the angelspec[vllm] plugin serves it with the dfly conditioning (DFly); export a dflash "
                            "drafter with head none (DFlash) or markov (DSpark)")
    if cfg.anchor_fusion:
        raise ExportRefused(ANCHOR_FUSION_REFUSED.format(engine="vLLM's DFlash / DSpark draft model"))
    if cfg.head in ("gated", "rnn"):
        raise ExportRefused(f"the {cfg.head} Markov head cannot be exported: vLLM 0.32's Qwen3DSparkModel serves the "
                            "plain Markov head only (head markov)")
    bias = state.pop("fc.bias", None)
    if bias is not None and bool(bias.ne(0).any()):
        raise ExportRefused(f"the context projection has a non-zero bias fc.bias (max |b| = "
                            f"{bias.abs().max().item():.3g}); vLLM's (and SGLang's) DFlash fc has no bias, so the "
                            "drafter would change. Train it with fc_bias=false (the default for new dflash / dspark "
                            "drafters)")
    dtype = state["norm.weight"].dtype
    tensors = {"fc.weight": state.pop("fc.weight"), "hidden_norm.weight": state.pop("hidden_norm.weight")}
    for n in range(cfg.num_draft_layers):
        tensors.update(_split_layer(state, f"layers.{n}.", f"layers.{n}.", cfg))
    tensors["norm.weight"] = state.pop("norm.weight")
    vocab = state.get("draft_vocab")
    notes = []
    config = _shape_config(cfg, target, cfg.num_draft_layers, dtype)
    config.update(block_size=cfg.block_size,
                  dflash_config={"mask_token_id": cfg.mask_token_id, "target_layer_ids": list(cfg.target_layer_ids)})
    if cfg.head == "markov":
        w2 = state.pop("head.out.weight")
        tensors["markov_head.markov_w1.weight"] = state.pop("head.embed.weight")
        tensors["markov_head.markov_w2.weight"] = w2[vocab] if vocab is not None else w2
        config.update(architectures=["Qwen3DSparkModel"], markov_rank=cfg.markov_rank, markov_head_type="vanilla",
                      enable_confidence_head=cfg.confidence_head, confidence_head_with_markov=cfg.confidence_head,
                      sample_from_anchor=False)
        if cfg.confidence_head:
            weight, bias = state.pop("confidence.proj.weight"), state.pop("confidence.proj.bias")
            if cfg.confidence_temperatures:  # a "protocol" head, read at T = 0 (module docstring)
                mix = temperature_weights(torch.zeros(1), cfg.confidence_temperatures).to(weight.dtype)  # [1, n]
                weight, bias = mix @ weight, mix @ bias
                notes.append(f"the confidence head's T = 0 output was exported (it has one per sampling temperature "
                             f"{list(cfg.confidence_temperatures)}; vLLM's has one)")
            tensors["confidence_head.proj.weight"], tensors["confidence_head.proj.bias"] = weight, bias
        method = "dspark"
    else:
        config["architectures"] = ["DFlashDraftModel"]
        if cfg.confidence_head:
            for name in ("confidence.proj.weight", "confidence.proj.bias", "confidence_embed.weight"):
                state.pop(name)
            notes.append("the confidence head was left out: vLLM's DFlash drafts without one")
        method = "dflash"
    tensors.update(_vocab_tensors(state, cfg, target_dir, dtype))
    _left(state, cfg.drafter)
    spec = {"method": method, "model": str(out.resolve()), "num_speculative_tokens": cfg.block_size - 1}
    return config, tensors, spec, notes


# ----- drafters served by the angelspec[vllm] plugin (`angelspec_vllm`): classes registered with vLLM -----
MTP_ARCH = "AngelSpecMTPEagle3"  # vLLM's EAGLE-3 proposer drives it (`angelspec_vllm.mtp`)
BLOCK_ARCH = "AngelSpecDFlyDFlash"  # vLLM's DFlash proposer drives it (`angelspec_vllm.dfly`)
PLUGIN_CONDITIONINGS = ("dfly", "dflare")
PLUGIN_NOTE = ("served by the angelspec[vllm] plugin (pip install angelspec[vllm] beside vLLM 0.32; it registers "
               "{arch} with vLLM)")


def _mtp_plugin(raw: dict[str, Any], state: dict[str, torch.Tensor], target: DecoderConfig, target_dir: Path,
                out: Path) -> tuple[dict, dict, dict, list[str]]:
    """MTP (Eq. 1-2) for the plugin's AngelSpecMTPEagle3: our names with the layer split into vLLM's (layers.0.*),
    the one tap as EAGLE-3's only auxiliary hidden state (our id + 1), method eagle3."""
    cfg = MTP_FAMILY["mtp"][0].from_dict(raw["mtp_config"])
    cfg.check_target(target)
    dtype = state["norm.weight"].dtype
    tensors = {name: state.pop(name) for name in ("hidden_norm.weight", "embed_norm.weight", "proj.weight")}
    tensors.update(_split_layer(state, "layer.", "layers.0.", cfg))
    tensors["norm.weight"] = state.pop("norm.weight")
    tensors.update(_vocab_tensors(state, cfg, target_dir, dtype))
    _left(state, "mtp")
    ids = [i + 1 for i in cfg.target_layer_ids]
    config = _shape_config(cfg, target, 1, dtype)
    config.update(architectures=[MTP_ARCH], target_hidden_size=target.hidden_size,
                  eagle_aux_hidden_state_layer_ids=ids,
                  eagle_config={"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True})
    spec = {"method": "eagle3", "model": str(out.resolve()), "num_speculative_tokens": cfg.num_depths}
    return config, tensors, spec, [PLUGIN_NOTE.format(arch=MTP_ARCH)]


def _fused_block_plugin(cfg: BlockDrafterConfig, state: dict[str, torch.Tensor], target: DecoderConfig,
                        target_dir: Path, out: Path) -> tuple[dict, dict, dict, list[str]]:
    """DFly / DFlare (per-layer tap fusion, Eq. 11-12; hidden-correction head, Eq. 15; fused anchor input) for the
    plugin's AngelSpecDFlyDFlash: our names with the draft layers split into vLLM's, method dflash."""
    if cfg.head not in ("none", "hidden"):
        raise ExportRefused(f"a {cfg.conditioning} drafter with the {cfg.head} head cannot be exported to vLLM: the "
                            "angelspec[vllm] plugin serves the block drafters' heads none and hidden (Eq. 15)")
    dtype = state["norm.weight"].dtype
    names = ["fusion_logits", *(f"context_norms.{i}.weight" for i in range(cfg.num_draft_layers)), "norm.weight"]
    if cfg.conditioning == "dfly":
        names += ["fc.weight"] + (["fc.bias"] if cfg.fc_bias else [])
    if cfg.head == "hidden":
        names += [f"head.{n}.weight" for n in ("z_norm", "e_norm", "gate_up_proj", "down_proj")]
    if cfg.anchor_fusion:
        names += ["anchor_norm.weight", "anchor_fuse.weight"]
    tensors = {n: state.pop(n) for n in names}
    tensors["fusion_logits"] = tensors["fusion_logits"].float()
    for n in range(cfg.num_draft_layers):
        tensors.update(_split_layer(state, f"layers.{n}.", f"layers.{n}.", cfg))
    notes = [PLUGIN_NOTE.format(arch=BLOCK_ARCH)]
    if cfg.confidence_head:
        for name in ("confidence.proj.weight", "confidence.proj.bias", "confidence_embed.weight"):
            state.pop(name, None)
        notes.append("the confidence head was left out: vLLM's DFlash proposer drafts a fixed K without one")
    tensors.update(_vocab_tensors(state, cfg, target_dir, dtype))
    _left(state, cfg.drafter)
    config = _shape_config(cfg, target, cfg.num_draft_layers, dtype)
    config.update(architectures=[BLOCK_ARCH], block_size=cfg.block_size,
                  dflash_config={"mask_token_id": cfg.mask_token_id, "target_layer_ids": list(cfg.target_layer_ids)},
                  angelspec_block={"conditioning": cfg.conditioning, "head": cfg.head, "fc_bias": cfg.fc_bias,
                                   "anchor_fusion": cfg.anchor_fusion,
                                   "head_intermediate_size": cfg.head_intermediate_size or cfg.hidden_size})
    spec = {"method": "dflash", "model": str(out.resolve()), "num_speculative_tokens": cfg.block_size - 1}
    return config, tensors, spec, notes


def _cast(state: dict[str, torch.Tensor], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """The floating-point tensors of `state` in `dtype` (None: as they are); integer tensors (ids) unchanged."""
    if dtype is None:
        return state
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}


def _cast_folder(out: Path, dtype: torch.dtype | None) -> None:
    """Rewrite the safetensors files of an HF folder copied to `out` in `dtype` (and its config's torch_dtype), one
    file at a time; nothing when `dtype` is None or every tensor has it already."""
    if dtype is None:
        return
    changed = False
    for file in sorted(out.glob("*.safetensors")):
        state = read_tensors(file)
        if all(not v.is_floating_point() or v.dtype == dtype for v in state.values()):
            continue
        save_safetensors_atomic(_cast(state, dtype), file, {"format": "pt"})
        changed = True
    if changed:
        raw = json.loads((out / "config.json").read_text())
        raw["torch_dtype"] = str(dtype).removeprefix("torch.")
        write_json_atomic(out / "config.json", raw)


def export_vllm(drafter_dir: str | Path, out_dir: str | Path, *, target: str | Path | None = None,
                force: bool = False, screen: Callable[[str, dict[str, Any]], None] | None = None,
                dtype: torch.dtype | None = None,
                then: Callable[[Path, ExportResult], ExportResult] | None = None) -> ExportResult:
    """Write `out_dir` (config.json, model.safetensors, speculative_config.json) for vLLM 0.32 from the drafter
    folder `drafter_dir`, trained for `target` (default: the embedded target); refuse what vLLM cannot represent;
    check the result against the target's config (`checks.check_vllm_folder`). `screen(kind, config)`, if given,
    runs before anything is written and raises ExportRefused for what another engine reading the same layout
    (SGLang, `export/sglang.py`) cannot load. `dtype`: the dtype of the written weights (None: the drafter's own;
    a drafter trains with fp32 master weights, and engines serve bf16). `then(folder, result)`, if given, finishes
    the folder before it is swapped in (the result it returns is this call's). The folder is written beside
    `out_dir` and replaces it whole once complete and checked (`fileio.staged_folder`): a failure, a full disk
    included, leaves `out_dir` as it was."""
    src, out = Path(drafter_dir), Path(out_dir)
    raw = read_config_json(src, "is it an AngelSpec drafter folder?", "drafter folder")
    target_dir = resolve_target_dir(target)
    target_cfg = read_config(target_dir)
    meta = raw.get("angelspec") or {}
    kind = meta.get("drafter")
    is_lm = kind not in MTP_FAMILY and kind not in DRAFTER_KINDS and "model_type" in raw and "architectures" in raw
    if screen is not None:
        screen("draft-lm" if is_lm else kind, raw)
    tensors: dict[str, torch.Tensor] | None = None
    if kind in MTP_FAMILY or kind in DRAFTER_KINDS:
        if target_cfg.model_type not in EXPORT_TARGETS:
            raise ExportRefused(f"the vLLM exporter writes drafters for {' and '.join(EXPORT_TARGETS)} targets (the "
                                f"families whose vLLM loaders it follows); the target is {target_cfg.model_type!r}")
        state = _cast(read_tensors(src / WEIGHTS), dtype)
        if kind in MTP_FAMILY:
            config, tensors, spec, notes = _mtp_family(raw, kind, state, target_cfg, target_dir, out)
        else:
            config, tensors, spec, notes = _block(raw, state, target_cfg, target_dir, out)
        config["angelspec"] = {**meta, "exported_from": str(src.resolve())}
    elif is_lm:  # a draft LM: vLLM serves the HF folder as it is
        kind = "draft-lm"
        if raw.get("vocab_size") != target_cfg.vocab_size:
            raise ExportRefused(f"the draft LM's vocab_size {raw.get('vocab_size')} differs from the target's "
                                f"{target_cfg.vocab_size}; vLLM's draft_model needs the target's vocabulary")
        spec = {"method": "draft_model", "model": str(out.resolve()), "num_speculative_tokens": DRAFT_LM_TOKENS}
        notes = ["its draft vocabulary (angelspec.draft_vocab) is not read by the engine's draft-model path (vLLM's "
                 "draft_model, SGLang's STANDALONE), which drafts from the whole vocabulary"
                 ] if meta.get("draft_vocab") else []
    else:
        raise ExportRefused(f"{src} is not a drafter the vLLM exporter knows (angelspec.drafter = {kind!r})")
    # The config fingerprint was checked above (`check_target`); the weights, when the drafter records them, here.
    problem = other_weights(meta.get("target_weights"), lambda: target_weights_id(target_dir))
    if problem is not None:
        raise ExportRefused(f"{src} was trained for a target with {problem}; pass --target with the drafter's own "
                            "target (the engine would serve it against this one's hidden states)")
    prepare_out_dir(src, out, force, target_dir=target_dir)
    with staged_folder(out) as stage:
        if tensors is not None:
            save_safetensors_atomic(tensors, stage / WEIGHTS, {"format": "pt"})
            write_json_atomic(stage / "config.json", config)
        else:
            shutil.copytree(src, stage, dirs_exist_ok=True)
            _cast_folder(stage, dtype)
        write_json_atomic(stage / SPEC_CONFIG, spec)
        check_vllm_folder(stage, target_cfg, final=out)
        result = ExportResult(out, kind, spec, notes)
        if then is not None:
            result = then(stage, result)
    return result
