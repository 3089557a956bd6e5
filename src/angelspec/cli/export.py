"""`angelspec export`: its parser, and a handler that calls `angelspec.export.export_drafter`."""

from __future__ import annotations

import argparse

from angelspec.cli import common


def add_export(sub: common.Subparsers) -> None:
    """Write a drafter folder in the layout a serving engine loads (vLLM 0.32: EAGLE-3, DFlash, DSpark with the plain
    Markov head, or a draft LM), plus speculative_config.json, the dict to pass as --speculative-config. Drafters the
    format cannot represent (MTP, DFly/DFlare, hidden-correction, gated or RNN heads) are refused."""
    p = sub.add_parser("export", help="export a drafter for a serving engine (vLLM)", description=add_export.__doc__)
    p.add_argument("--format", default="vllm", choices=["vllm"], help="target format (default: vllm)")
    p.add_argument("drafter_dir", metavar="DRAFTER_DIR", help="the trained drafter folder")
    p.add_argument("out_dir", metavar="OUT_DIR", help="the folder to write (refused if not empty)")
    common.add_target_flag(p, "the target the drafter was trained for (default: the embedded target)")
    p.add_argument("--force", action="store_true", help="replace the contents of a non-empty OUT_DIR")
    p.set_defaults(func=cmd_export)


def cmd_export(args: argparse.Namespace) -> int:
    """`angelspec export`: export DRAFTER_DIR into OUT_DIR and print the speculative_config."""
    from angelspec.export import export_drafter

    result = export_drafter(args.drafter_dir, args.out_dir, format=args.format, target=args.target, force=args.force)
    print(result.format())
    return 0
