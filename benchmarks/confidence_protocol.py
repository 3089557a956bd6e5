"""D-cut's predicted vs measured committed tokens per step, at T = 0 and T = 1 (our issue 15).

D-cut verifies the prefix of drafts whose prefix survival Π c ranks high; the tokens it expects a row to commit are
A(n) = Σ_{k=0}^{n} Π_{t≤k} c_t (AngelSpec Eq. 21). A confidence head trained on α = 1 − TV (the acceptance of
standard speculative sampling at T = 1, `confidence_target` "tv": DSpark's recipe and every drafter trained before
the option) predicts something else than what D-cut's argmax drafts achieve: a top-1 match at T = 0, p_T(draft) at
T > 0. A "protocol" head (the default for new runs) is trained on exactly those, per temperature. This decodes the
held-out prompts with each --drafter under the depth policy (default D-cut with the measured cost table) at each
temperature and prints, per (drafter, temperature), the mean predicted committed tokens per row-step (from the
confidences D-cut used: calibrated when the folder holds a calibration.json, unless --raw) against the mean measured
ones (accepted + 1), and their ratio (> 1: over-confident).

Compare an old and a new head of the same drafter (e.g. the shipped DFly and its confidence-only fine-tune):
    angelspec train --drafter dfly --init-from src/angelspec/assets/drafters/dfly --only confidence \\
        --data .cache/shipped/rollouts.jsonl --out .cache/dfly-protocol
    .venv/bin/python benchmarks/confidence_protocol.py --drafter src/angelspec/assets/drafters/dfly \\
        --drafter .cache/dfly-protocol --limit 8 --max-new-tokens 96
Smoke run (seconds): add --limit 1 --max-new-tokens 8 --policy dcut:0.5 --quiet.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

DEFAULT_DRAFTER = "src/angelspec/assets/drafters/dfly"


def confidence_label(folder: str) -> str:
    """What the folder's confidence head was trained on ("tv" for folders from before the option), and its
    temperature grid."""
    raw = json.loads((Path(folder) / "config.json").read_text())
    cfg = raw.get("block_drafter_config") or {}
    if not cfg.get("confidence_head", False):
        return "no head"
    target = cfg.get("confidence_target", "tv")
    temps = cfg.get("confidence_temperatures") or []
    return target if not temps else f"{target} @ {','.join(f'{t:g}' for t in temps)}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drafter", action="append", metavar="DIR",
                   help=f"drafter folder, repeatable (default: {DEFAULT_DRAFTER})")
    p.add_argument("--target", metavar="DIR", help="target folder (default: the embedded target)")
    p.add_argument("--prompts", metavar="FILE", help="prompts JSONL with a domain per line (default: EVAL_PROMPTS)")
    p.add_argument("--limit", type=int, default=4, help="prompts per domain (default: 4)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="per prompt (default: 64)")
    p.add_argument("--batch-size", type=int, default=4, help="concurrent requests (default: 4)")
    p.add_argument("--num-draft-tokens", type=int, default=None,
                   help="K (default: each drafter's block size - 1)")
    p.add_argument("--temperatures", default="0,1", help="comma-separated sampling temperatures (default: 0,1)")
    p.add_argument("--policy", default="dcut", help="depth policy spec (default: dcut, with the measured cost "
                   "table, profiled on first use; dcut:RHO needs none)")
    p.add_argument("--raw", action="store_true", help="ignore a calibration.json (raw confidences)")
    p.add_argument("--seed", type=int, default=0, help="request i samples with seed SEED + i (default: 0)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--quiet", action="store_true", help="no cost-table progress")
    args = p.parse_args(argv)

    import torch

    from angelspec.assets import EVAL_PROMPTS, resolve_target_dir
    from angelspec.data.prompts import load_prompts
    from angelspec.decoding.drafters.calibrated import CalibratedDrafter
    from angelspec.decoding.generate import build_depth_policy, parse_depth_policy
    from angelspec.decoding.loading import load_target_and_tokenizer, resolve_drafter
    from angelspec.eval.cost_profile import load_or_profile
    from angelspec.eval.prompts import eval_prompts
    from angelspec_research.commit_prediction import predicted_vs_measured

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        temperatures = [float(t) for t in args.temperatures.split(",")]
    except ValueError:
        print(f"--temperatures: expected numbers separated by commas, got {args.temperatures!r}", file=sys.stderr)
        return 2
    folders = args.drafter or [DEFAULT_DRAFTER]
    for folder in folders:
        if not (Path(folder) / "config.json").is_file():
            print(f"--drafter {folder}: not a drafter folder (no config.json)", file=sys.stderr)
            return 2
    spec = parse_depth_policy(args.policy, folders[0])
    target_dir = resolve_target_dir(args.target)
    target, tokenizer = load_target_and_tokenizer(target_dir)
    prompts_file = Path(args.prompts) if args.prompts else EVAL_PROMPTS
    prompts = eval_prompts(tokenizer, load_prompts(prompts_file), context=target.config.max_position_embeddings,
                           source=str(prompts_file), limit=args.limit)
    ids = [q.ids for q in prompts]
    log = None if args.quiet else print
    print(f"{len(ids)} prompts, policy {args.policy}, max {args.max_new_tokens} new tokens, batch {args.batch_size}")
    header = (f"{'drafter':<40}{'confidence':<26}{'T':>5}{'row-steps':>11}{'predicted':>11}{'measured':>10}"
              f"{'pred/meas':>11}{'depth':>7}")
    print(header)
    for folder in folders:
        drafter = resolve_drafter(folder, target, target_dir)
        assert drafter is not None
        calibrated = isinstance(drafter, CalibratedDrafter)
        if calibrated and args.raw:
            drafter = drafter.inner
        k = args.num_draft_tokens or drafter.max_draft_tokens  # a calibrated drafter's is its inner drafter's
        policy = build_depth_policy(spec, target=target, drafter=drafter, num_draft_tokens=k,
                                    batch_size=args.batch_size, cost_source=load_or_profile, log=log)
        label = confidence_label(folder) + (" +STS" if calibrated and not args.raw else "")
        for t in temperatures:
            r = predicted_vs_measured(target, drafter, ids, depth_policy=policy, temperature=t, num_draft_tokens=k,
                                      batch_size=args.batch_size, max_new_tokens=args.max_new_tokens, seed=args.seed)
            print(f"{folder[-40:]:<40}{label:<26}{t:>5g}{r.row_steps:>11}{r.predicted:>11.3f}{r.measured:>10.3f}"
                  f"{r.ratio:>11.3f}{r.depth:>7.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
