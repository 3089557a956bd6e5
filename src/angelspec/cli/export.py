"""`angelspec export`: its parser, and a handler that calls `angelspec.export.export_drafter`."""

from __future__ import annotations

import argparse

from angelspec.cli import common


def add_export(sub: common.Subparsers) -> None:
    """Write a drafter folder in the layout a serving engine loads (vLLM 0.32: EAGLE-3, DFlash, DSpark with the plain
    Markov head, or a draft LM, and, through the angelspec[vllm] plugin, MTP and DFly / DFlare, plus
    speculative_config.json, the dict to pass as --speculative-config; SGLang: DFlash or a draft LM, plus
    sglang_args.json, the --speculative-* flags to pass, checked offline only). Drafters the format cannot represent
    (gated or RNN heads, a hidden-correction head on the DFlash backbone, same-layer DSpark; for SGLang also MTP,
    EAGLE-3, DFly, DSpark and draft vocabularies) are refused. docs/deployment.md has the serve commands."""
    p = sub.add_parser("export", help="export a drafter for a serving engine (vLLM, SGLang)",
                       description=add_export.__doc__)
    _folder_flags(p, ("vllm", "sglang"), "target format", ("drafter_dir", "DRAFTER_DIR", "the trained drafter folder"),
                  "the folder to write (refused if not empty)", "the target the drafter was trained for")
    p.add_argument("--dtype", default="bfloat16", metavar="DTYPE",
                   help="dtype of the exported weights: bfloat16, float16 or float32 (default: bfloat16, what GPU "
                        "engines serve; float32 for an engine that runs the target in fp32, e.g. vLLM on a CPU)")
    p.set_defaults(func=cmd_export)


def _folder_flags(p: argparse.ArgumentParser, formats: tuple[str, ...], format_help: str, src: tuple[str, str, str],
                  out_help: str, target_help: str) -> None:
    """The flags `export` and `import` share: --format (one of `formats`), the source (dest, metavar, help), OUT_DIR,
    --target, --force."""
    p.add_argument("--format", default="vllm", choices=list(formats), help=f"{format_help} (default: vllm)")
    p.add_argument(src[0], metavar=src[1], help=src[2])
    p.add_argument("out_dir", metavar="OUT_DIR", help=out_help)
    common.add_target_flag(p, f"{target_help} (default: the embedded target)")
    p.add_argument("--force", action="store_true", help="replace the contents of a non-empty OUT_DIR")


def cmd_export(args: argparse.Namespace) -> int:
    """`angelspec export`: export DRAFTER_DIR into OUT_DIR and print the speculative_config (vLLM) or the launch
    flags (SGLang)."""
    from angelspec.export import export_drafter

    result = export_drafter(args.drafter_dir, args.out_dir, format=args.format, target=args.target, force=args.force,
                            dtype=args.dtype)
    print(result.format())
    return 0


def add_import(sub: common.Subparsers) -> None:
    """Read a drafter folder in a serving engine's layout (vLLM 0.32: EAGLE-3, Eagle3Qwen3ForCausalLM for a Qwen3
    target or LlamaForCausalLMEagle3 for a Llama target, or DFlash, DFlashDraftModel; an `angelspec export` output or
    one trained elsewhere) and write it as an AngelSpec drafter folder, so `angelspec eval --drafter OUT_DIR`
    measures it on our engine and policies. Folders our models cannot compute exactly (their own LM head or
    embedding, an EAGLE-3 layout other than the target's layer, fc norms, sliding windows, ...) are refused with what
    does not fit."""
    p = sub.add_parser("import", help="import a vLLM-format EAGLE-3 or DFlash drafter", description=add_import.__doc__)
    _folder_flags(p, ("vllm",), "source format",
                  ("src_dir", "VLLM_DIR", "the vLLM drafter folder (config.json + safetensors)"),
                  "the AngelSpec drafter folder to write (refused if not empty)", "the target the drafter serves")
    p.set_defaults(func=cmd_import)


def cmd_import(args: argparse.Namespace) -> int:
    """`angelspec import`: import VLLM_DIR into OUT_DIR and print how to use it."""
    from angelspec.export.vllm_import import import_vllm

    print(import_vllm(args.src_dir, args.out_dir, target=args.target, force=args.force).format())
    return 0
