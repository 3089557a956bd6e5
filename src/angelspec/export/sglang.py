"""Export to SGLang (Qwen3 targets), checked offline: DFlash (`DFlashDraftModel`, `--speculative-algorithm DFLASH`)
and a draft LM (`--speculative-algorithm STANDALONE`). Written by the vLLM exporter, whose DFlash layout is the one
SGLang's loader reads (names, `dflash_config`, 0-based tap ids), then screened for what SGLang cannot load and
given SGLang's launch flags (`sglang_args.json`) instead of vLLM's speculative_config.json.

What SGLang's public source shows (docs/design.md, "SGLang export", names the files):
- DFlash: `models/dflash.py` loads `layers.N.{input_layernorm, self_attn.{q,k,v}_proj, q_norm, k_norm, o_proj,
  post_attention_layernorm, mlp.*}`, `fc.weight` without bias, `hidden_norm`, `norm`, and neither an embedding nor
  an LM head (so no draft vocabulary); `speculative/dflash_utils.py` reads `block_size`, `dflash_config.
  {target_layer_ids (0-based, after layer i), mask_token_id}`; `--speculative-num-draft-tokens` is the block size.
- EAGLE-3: its draft class `LlamaForCausalLMEagle3` (`models/llama_eagle3.py`) is a LLaMA layer without q/k norm;
  ours is a Qwen3 layer, and its `load_weights` would skip q_norm / k_norm silently. Refused.
- MTP: SGLang's MTP drafts are a target's own built-in next-n layers, chosen by rewriting the target architecture
  (`configs/model_config.py`, `_config_draft_model`: DeepSeek-V3, Qwen3-Next, ...); none for a dense Qwen3. Refused.
- DSpark: SGLang's DSPARK path wants a `DSparkDraftModel` checkpoint, not vLLM's `Qwen3DSparkModel`. Refused.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from angelspec.assets import resolve_target_dir
from angelspec.export.checks import SPEC_CONFIG, ExportCheckError, ExportRefused, ExportResult, check_vllm_folder
from angelspec.export.vllm import ANCHOR_FUSION_REFUSED, export_vllm
from angelspec.fileio import write_json_atomic
from angelspec.models.block.config import BlockDrafterConfig
from angelspec.models.config import DecoderConfig
from angelspec.models.hf_io import read_config

if TYPE_CHECKING:
    import torch

SGLANG_ARGS = "sglang_args.json"
ALGORITHM = {"dflash": "DFLASH", "draft_model": "STANDALONE"}  # vLLM method -> SGLang --speculative-algorithm
FLAG_ALGO, FLAG_PATH, FLAG_STEPS, FLAG_TOPK, FLAG_TOKENS = (
    "--speculative-algorithm", "--speculative-draft-model-path", "--speculative-num-steps",
    "--speculative-eagle-topk", "--speculative-num-draft-tokens")


def _screen(kind: str, raw: dict[str, Any]) -> None:
    """Refuse, in one line naming why, what SGLang's loaders cannot read (module docstring)."""
    if kind == "mtp":
        raise ExportRefused("MTP drafters cannot be exported to SGLang: its MTP loads a model's own built-in next-n "
                            "layers (DeepSeek-V3, Qwen3-Next, ...); a separate MTP folder for a Qwen3 target has no "
                            "loader. Serve a DFlash drafter or a draft LM instead")
    if kind == "eagle3" and not (raw.get("eagle3_config") or {}).get("qk_norm", True):
        raise ExportRefused("the SGLang exporter writes DFlash and draft-LM folders only; this Llama-layer EAGLE-3 "
                            "(no q/k norm) fits vLLM's LlamaForCausalLMEagle3: export it with --format vllm")
    if kind == "eagle3":
        raise ExportRefused("EAGLE-3 cannot be exported to SGLang: its only EAGLE-3 draft class, "
                            "LlamaForCausalLMEagle3, is a LLaMA layer without the q/k norm our Qwen3 EAGLE-3 layer "
                            "has (it would drop q_norm / k_norm silently); export it with --format vllm "
                            "(Eagle3Qwen3ForCausalLM)")
    if kind == "draft-lm" or "block_drafter_config" not in raw:
        return
    cfg = BlockDrafterConfig.from_dict(raw["block_drafter_config"])
    if cfg.anchor_fusion:
        raise ExportRefused(ANCHOR_FUSION_REFUSED.format(engine="SGLang's DFlashDraftModel"))
    if cfg.conditioning != "dflash" or cfg.head != "none" or not cfg.has_fc:
        what = "a DSpark Markov head" if cfg.head == "markov" else (
            f"head {cfg.head}" if cfg.head != "none" else f"conditioning {cfg.conditioning} / context_injection "
            f"{cfg.context_injection}")
        raise ExportRefused(f"this {cfg.drafter} drafter ({what}) cannot be exported to SGLang: its DFlashDraftModel "
                            "holds plain DFlash only (one shared fc context, no head), and its DSPARK path wants a "
                            "DSparkDraftModel checkpoint; export it with --format vllm")
    if cfg.draft_vocab_size:
        raise ExportRefused(f"this dflash drafter drafts from a {cfg.draft_vocab_size}-token draft vocabulary; "
                            "SGLang's DFlashDraftModel has no LM head or d2t and drafts with the target's head, so "
                            "it would change. Train it without a draft vocabulary or export with --format vllm")


def sglang_flags(spec: dict[str, Any]) -> dict[str, Any]:
    """SGLang's launch flags (flag -> value) for the vLLM speculative_config `spec` of the same folder: DFLASH
    verifies a block of `block_size` = num_speculative_tokens + 1 tokens in one step; STANDALONE drafts a chain
    (top-k 1) of `num_speculative_tokens` steps, verifying steps + 1 tokens."""
    steps = spec["num_speculative_tokens"]
    return {FLAG_ALGO: ALGORITHM[spec["method"]], FLAG_PATH: spec["model"],
            FLAG_STEPS: 1 if spec["method"] == "dflash" else steps, FLAG_TOPK: 1, FLAG_TOKENS: steps + 1}


def check_sglang_folder(out: Path, target: DecoderConfig, *, final: Path | None = None) -> None:
    """Raise ExportCheckError unless `out` is a complete SGLang drafter folder for `target`: the vLLM-layout check
    (every tensor, shapes, dtypes, tap ids) on the spec its flags imply, plus the flags and SGLang's own limits;
    `final`: the folder `out` is about to become, which the flags name (default: `out`)."""
    flags = json.loads((out / SGLANG_ARGS).read_text(encoding="utf-8"))
    methods = {v: k for k, v in ALGORITHM.items()}
    if flags.get(FLAG_ALGO) not in methods:
        raise ExportCheckError(f"{out}: {FLAG_ALGO} {flags.get(FLAG_ALGO)!r} is not one of {sorted(methods)}")
    method = methods[flags[FLAG_ALGO]]
    steps = flags.get(FLAG_TOKENS, 0) - 1
    check_vllm_folder(out, target, {"method": method, "model": flags.get(FLAG_PATH), "num_speculative_tokens": steps},
                      final=final)
    problems = []
    if flags.get(FLAG_TOPK) != 1 or flags.get(FLAG_STEPS) != (1 if method == "dflash" else steps):
        problems.append(f"steps / top-k {flags.get(FLAG_STEPS)} / {flags.get(FLAG_TOPK)} do not match "
                        f"{FLAG_TOKENS} {flags.get(FLAG_TOKENS)}")
    if method == "dflash":
        cfg = json.loads((out / "config.json").read_text(encoding="utf-8"))
        if cfg["architectures"] != ["DFlashDraftModel"]:
            problems.append(f"architectures {cfg['architectures']}, SGLang's DFLASH loads DFlashDraftModel")
        if cfg.get("block_size") != flags[FLAG_TOKENS]:
            problems.append(f"block_size {cfg.get('block_size')} != {FLAG_TOKENS} {flags[FLAG_TOKENS]}")
        if (cfg.get("draft_vocab_size") or cfg["vocab_size"]) != cfg["vocab_size"]:
            problems.append("a draft vocabulary: SGLang's DFlashDraftModel has no LM head or d2t")
    if problems:
        raise ExportCheckError(f"{out} is not a valid SGLang export for this target: " + "; ".join(problems))


def export_sglang(drafter_dir: str | Path, out_dir: str | Path, *, target: str | Path | None = None,
                  force: bool = False, dtype: torch.dtype | None = None) -> ExportResult:
    """Write `out_dir` (config.json, weights, sglang_args.json) for SGLang from the drafter folder `drafter_dir`
    trained for `target` (default: the embedded target); refuse what SGLang cannot load (module docstring); check
    the result (`check_sglang_folder`). `dtype`: the written weights' dtype (None: the drafter's own)."""
    def finish(folder: Path, result: ExportResult) -> ExportResult:
        flags = sglang_flags(result.speculative_config)
        (folder / SPEC_CONFIG).unlink()  # vLLM's file: an SGLang folder carries SGLang's flags instead
        write_json_atomic(folder / SGLANG_ARGS, flags)
        check_sglang_folder(folder, read_config(resolve_target_dir(target)), final=result.out_dir)
        return ExportResult(result.out_dir, result.kind, flags, result.notes, engine="sglang")

    return export_vllm(drafter_dir, out_dir, target=target, force=force, screen=_screen, dtype=dtype, then=finish)
