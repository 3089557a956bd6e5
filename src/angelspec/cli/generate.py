"""`angelspec generate`: its parser, and a handler that calls `angelspec.decoding.generate.generate_completions`."""

from __future__ import annotations

import argparse

from angelspec.cli import common


def add_generate(sub: common.Subparsers) -> None:
    """Complete every line of a JSONL prompts file ({"prompt": str} or {"messages": [...]}, rendered with the target's
    chat template) and write one JSON line per prompt with completion, token_ids and finish_reason."""
    p = sub.add_parser("generate", help="complete a JSONL file of prompts with the target",
                       description=add_generate.__doc__)
    p.add_argument("--prompts", required=True, metavar="FILE.jsonl", help="input prompts, one JSON object per line")
    p.add_argument("--out", required=True, metavar="FILE.jsonl", help="output file (refused if it exists)")
    p.add_argument("--force", action="store_true", help="overwrite --out if it exists")
    common.add_target_flag(p)
    common.add_device_flags(p)
    p.add_argument("--drafter", default="none", metavar="SPEC", help=f"{common.DRAFTER_SPECS} (default: none)")
    common.add_num_draft_tokens_flag(p, "drafts proposed and verified per step; ignored without a drafter")
    common.add_sampling_flags(p, seed=None, seed_help="request i uses seed S+i (default: random)")
    p.add_argument("--max-new-tokens", type=int, default=256, metavar="N", help="per prompt (default: 256)")
    common.add_batch_size_flag(p)
    common.add_think_flag(p)
    common.add_policy_flags(p)
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_generate)


def cmd_generate(args: argparse.Namespace) -> int:
    """`angelspec generate`: complete every prompt of a JSONL file with the target (optionally a drafter)."""
    from angelspec.decoding.drafter_spec import parse_drafter_spec
    from angelspec.decoding.generate import generate_completions
    from angelspec.eval.cost_profile import load_or_profile

    summary = generate_completions(
        args.prompts, args.out, parse_drafter_spec(args.drafter), common.decode_settings(args), target=args.target,
        force=args.force, progress=not args.quiet, log=None if args.quiet else print, warn=common.warn,
        placement=common.placement(args), cost_source=load_or_profile)
    print(summary.format())
    return 0
