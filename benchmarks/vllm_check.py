"""`make vllm-check`: serve the embedded target in vLLM 0.32 with each drafter our exporter writes and compare with our
engine (outputs identical to AR at T=0, p_1..p_K within 0.05), the same for an EAGLE-3, an MTP and a DFly on a
Llama-shaped target,
check `rollout --engine vllm` against ours, and load a DSpark export through vLLM's model class. The work is
`angelspec.pipelines.vllm_check`; this script sets the process up for vLLM on CPU and prints the table.

    .venv-vllm/bin/python benchmarks/vllm_check.py [--out runs/vllm-check] [--dflash-data FILE.jsonl]
        [--only llama | --only llama-eagle3 | --only llama-mtp | --only llama-dfly | --no-llama]

Needs the vLLM venv (`make vllm-venv`). Exit code 0 when every check passes, 1 otherwise.
"""

from __future__ import annotations

import os

from angelspec.decoding.vllm_engine import CPU_ENV  # imports neither torch nor vLLM

# Before torch or vLLM is imported (the check starts one engine per drafter in this process; CPU_ENV says why).
for key, value in CPU_ENV.items():
    os.environ.setdefault(key, value)

import argparse  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from angelspec.errors import EXIT_BAD_INPUT, is_user_error  # noqa: E402
from angelspec.pipelines.vllm_check import LLAMA_ONLY, VllmCheckSettings, run_vllm_check  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    defaults = VllmCheckSettings()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, default=defaults.out_dir, help=f"results folder (default: {defaults.out_dir})")
    p.add_argument("--per-domain", type=int, default=defaults.per_domain, help="held-out prompts per domain")
    p.add_argument("--max-new-tokens", type=int, default=defaults.max_new_tokens)
    p.add_argument("--dflash-data", type=Path, default=None,
                   help="conversations to train the DFlash on (default: make drafters' rollouts if present, else "
                        "the check's own rollouts)")
    p.add_argument("--dflash-minutes", type=float, default=defaults.dflash_minutes)
    which = p.add_mutually_exclusive_group()
    which.add_argument("--only", choices=list(LLAMA_ONLY), default=None,
                       help="llama: only the Llama-shaped target's drafters (EAGLE-3, MTP, DFly; no rollout, Qwen3 "
                            "drafters or DSpark); llama-eagle3 / llama-mtp / llama-dfly: one of them")
    which.add_argument("--no-llama", action="store_true", help="leave the Llama-shaped target out")
    args = p.parse_args(argv)
    settings = VllmCheckSettings(out_dir=args.out, per_domain=args.per_domain, max_new_tokens=args.max_new_tokens,
                                 dflash_data=args.dflash_data, dflash_minutes=args.dflash_minutes,
                                 llama=not args.no_llama, only=args.only)
    try:
        report = run_vllm_check(settings, log=lambda line: print(line, flush=True))
    except Exception as e:
        if not is_user_error(e):
            raise
        print(f"vllm_check: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(report.format())
    print(f"wrote {settings.out_dir / 'vllm_check.json'}")
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
