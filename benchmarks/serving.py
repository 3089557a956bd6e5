"""The serving sweep of the issue "Runtime-adaptive verification and serving benchmarks": AR, MTP, DFlash, DFly under
the recommended serving setting `auto`, DFly, DFly + D-cut (the report's rho* = argmax U/C, and bounded to <= 3%
expected acceptance loss), DFly + Algorithm 1 and DFly + confidence threshold as closed-loop clients at concurrency
1..32, greedy, fixed-length generations
(AngelSpec report §4.4 Figure 4, §5 Eq. 25 / Table 8 in miniature).

Everything is measured by `angelspec.eval.serving` (the code behind `angelspec bench`); this script only
picks the configurations and their K: MTP verifies K = --mtp-k drafts (the report's MTP-3), the block
drafters their full block (K = block size - 1) unless --block-k says otherwise. A drafter folder that is
missing is skipped with the `angelspec train` command that makes it. D-cut, Algorithm 1, production and auto
read a cost table profiled once per drafter on first use (cached under .cache/angelspec-costs).

Timing needs an otherwise idle machine. The full sweep takes long on 2 CPU cores (an hour or more):

    .venv/bin/python benchmarks/serving.py                                  # everything, .cache/serving
    .venv/bin/python benchmarks/serving.py --concurrency 1,2 --max-new-tokens 8 --no-compile --out /tmp/serving

Writes results.json, results.md, serving.png, phases.png and latency.png into --out and prints the table, the auto
and D-cut goal lines and the break-even committed lengths (Eq. 25, MTP as the reference). With --vllm, vLLM (its
own venv, `make vllm-venv`) also serves the AR configuration's requests at each concurrency (the vLLM columns).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from angelspec.assets import resolve_target_dir
from angelspec.decoding.loading import load_target_and_tokenizer
from angelspec.errors import EXIT_BAD_INPUT, is_user_error
from angelspec.eval.serving import (
    DEFAULT_CONCURRENCY,
    DEFAULT_MAX_NEW_TOKENS,
    DRAFTER_MAX_DEPTH,
    BenchSettings,
    ServingConfig,
    bench,
    lossless,
    parse_concurrency,
)
from angelspec.eval.serving.vllm import open_vllm_column

TRAIN_DATA = ".cache/demo/rollout.jsonl"  # the demo's rollouts of the target (make demo writes them)


def train_hint(kind: str, folder: Path) -> str:
    return (f"skipped {kind}: {folder} has no drafter (no config.json); make it with `angelspec train --drafter "
            f"{kind} --data {TRAIN_DATA} --out {folder}` (or pass --{kind} DIR)")


def configs_for(args: argparse.Namespace) -> list[ServingConfig]:
    """The issue's configurations whose drafter folders exist; a skip line for each missing one."""
    block_k = DRAFTER_MAX_DEPTH if args.block_k is None else args.block_k
    configs = [ServingConfig("AR", "none")]
    present = {}
    for kind in ("mtp", "dflash", "dfly"):
        folder = Path(getattr(args, kind))
        if (folder / "config.json").is_file():
            present[kind] = folder
        else:
            print(train_hint(kind, folder))
    if "mtp" in present:
        configs.append(ServingConfig("MTP", f"mtp:{present['mtp']}", num_draft_tokens=args.mtp_k))
    if "dflash" in present:
        configs.append(ServingConfig("DFlash", f"dflash:{present['dflash']}", num_draft_tokens=block_k))
    if "dfly" in present:
        dfly = f"dfly:{present['dfly']}"
        configs += [ServingConfig("DFly auto", dfly, "auto", num_draft_tokens=block_k),  # the recommended setting
                    ServingConfig("DFly", dfly, num_draft_tokens=block_k),
                    ServingConfig("DFly+D-cut", dfly, "dcut", num_draft_tokens=block_k),
                    ServingConfig("DFly+D-cut<=3%", dfly, "dcut:max-loss=0.03", num_draft_tokens=block_k),
                    ServingConfig("DFly+Alg1", dfly, "alg1", num_draft_tokens=block_k),
                    ServingConfig("DFly+threshold", dfly, f"threshold:{args.threshold}", num_draft_tokens=block_k)]
    return configs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/serving.py", description=__doc__.splitlines()[0])
    parser.add_argument("--target", metavar="DIR", help="HF checkpoint folder (default: the embedded target)")
    parser.add_argument("--mtp", default=".cache/demo/mtp", metavar="DIR", help="(default: .cache/demo/mtp)")
    parser.add_argument("--dflash", default=".cache/serving/dflash", metavar="DIR",
                        help="(default: .cache/serving/dflash)")
    parser.add_argument("--dfly", default=".cache/demo/dfly", metavar="DIR", help="(default: .cache/demo/dfly)")
    parser.add_argument("--concurrency", default=",".join(map(str, DEFAULT_CONCURRENCY)), metavar="C,C,...",
                        help="(default: 1,2,4,8,16,32)")
    parser.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS, metavar="N",
                        help=f"per request (default: {DEFAULT_MAX_NEW_TOKENS})")
    parser.add_argument("--min-requests", type=int, default=16, metavar="N",
                        help="requests per point are max(4C, N) (default: 16)")
    parser.add_argument("--no-compile", dest="compile", action="store_false", help="run every configuration eager")
    parser.add_argument("--mtp-k", type=int, default=3, metavar="K", help="MTP drafts per step (default: 3)")
    parser.add_argument("--block-k", type=int, default=None, metavar="K",
                        help="DFlash / DFly drafts per step (default: the drafter's block size - 1)")
    parser.add_argument("--threshold", type=float, default=0.5, metavar="C",
                        help="confidence of the DFly+threshold configuration (default: 0.5)")
    parser.add_argument("--out", default=".cache/serving", metavar="DIR", help="(default: .cache/serving)")
    parser.add_argument("--vllm", nargs="?", const=".venv-vllm", default=None, metavar="DIR",
                        help="also run vLLM from this venv (default .venv-vllm, `make vllm-venv`) on the AR requests")
    parser.add_argument("--quiet", action="store_true", help="print only the tables")
    args = parser.parse_args(argv)
    try:
        concurrency = parse_concurrency(args.concurrency)
        configs = configs_for(args)
        target_dir = resolve_target_dir(args.target)
        log = None if args.quiet else print
        column = None if args.vllm is None else open_vllm_column(args.vllm, target_dir, Path(args.out) / "vllm.log",
                                                                 log=log)
        model, tokenizer = load_target_and_tokenizer(target_dir)
        settings = BenchSettings(concurrency=concurrency, max_new_tokens=args.max_new_tokens,
                                 min_requests=args.min_requests, compile=args.compile, breakeven=True)
        report = bench(model, tokenizer, target_dir, configs, settings, out_dir=Path(args.out), vllm=column, log=log)
    except Exception as e:
        if not is_user_error(e):
            raise
        print(f"serving: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return 1 if lossless(report) is False else 0


if __name__ == "__main__":
    sys.exit(main())
