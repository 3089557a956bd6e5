"""The `angelspec` command line: `build_parser` and `main`; one module per command group.

- `generate.py`: generate. `evaluate.py`: eval, profile, calibrate, bench. `train.py`: train, features,
  feature-server, draft-vocab. `data.py`: rollout, decontam, target build. `export.py`: export, import.
  `common.py`: the flag blocks they share.

Every handler parses its flags, calls one library function (so each command's work is callable from Python
without argparse) and prints what it returns; heavy modules (torch, the engine, the trainers) are imported
inside the handlers so `angelspec --help` answers instantly. Errors that AngelSpec raises on purpose for bad
input (its own exception classes such as `CheckpointError`, `PromptFileError`, `UsageError`, plus
`FileExistsError` / `FileNotFoundError` and faults of the file system such as a full disk) become one line on
stderr and exit code 2; anything else is
a bug and keeps its traceback. `eval` exits 1 when speculative outputs at T=0 differ from AR outputs:
that is a bug in the engine, not bad input.
"""

from __future__ import annotations

import argparse
import sys

from angelspec import __version__
from angelspec.cli import data, evaluate, export, generate, train
from angelspec.cli.common import EXIT_BAD_INPUT, EXIT_INTERRUPTED, error_line
from angelspec.errors import is_user_error


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="angelspec",
        description="Train speculative-decoding drafters for a frozen target LLM and run them losslessly.",
    )
    parser.add_argument("--version", action="version", version=f"angelspec {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    generate.add_generate(sub)
    evaluate.add_eval(sub)
    train.add_train(sub)
    data.add_target(sub)
    evaluate.add_profile(sub)
    evaluate.add_calibrate(sub)
    train.add_draft_vocab(sub)
    train.add_features(sub)
    train.add_feature_server(sub)
    evaluate.add_bench(sub)
    data.add_rollout(sub)
    data.add_decontam(sub)
    data.add_prompt_pool(sub)
    evaluate.add_eval_server(sub)
    train.add_build_drafters(sub)
    export.add_export(sub)
    export.add_import(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse has already printed usage or help
        return e.code if isinstance(e.code, int) else EXIT_BAD_INPUT
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("angelspec: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as e:
        if not is_user_error(e):
            raise
        print(f"angelspec: error: {error_line(e)}", file=sys.stderr)
        return EXIT_BAD_INPUT
