"""What the ablation scripts (`mtp_ablation.py`, `block_ablation.py`) share: the default training data, the
command-line arguments common to both, input checks, train-or-reuse of a drafter under `--out`, evaluation of
the trained drafters against one AR baseline per temperature, the paper-average helper, claim verdicts and the
closing summary."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

DEFAULT_DATA = Path(".cache/draft-data/rollout/train.jsonl")
ROLLOUT_HINT = ("angelspec rollout --prompts .cache/draft-data/rollout_prompts.jsonl "
                "--out .cache/draft-data/rollout/train.jsonl")
DOMAINS = ("math", "code", "chat")


NOISE = 0.02  # MAL differences this small are within run-to-run noise at a dozen prompts per domain


def verdict(ok: bool, claim: str, detail: str, tie: bool = False) -> str:
    """One claim line: agrees / DISAGREES, or `tie` when the comparison it rests on is within NOISE."""
    label = "tie      " if tie else "agrees   " if ok else "DISAGREES"
    return f"{label} | {claim} ({detail})"


def within_noise(a: float, b: float) -> bool:
    return abs(a - b) <= NOISE


def domain_mean(values: list[float], domain: str, benchmarks: tuple[str, ...],
                paper_domains: dict[str, tuple[str, ...]]) -> float:
    """The mean of a per-benchmark paper row (in `benchmarks` order) over the benchmarks of one of our domains."""
    picked = [values[benchmarks.index(b)] for b in paper_domains[domain]]
    return sum(picked) / len(picked)


# ----- command line -----


def add_input_args(p: argparse.ArgumentParser) -> None:
    """--target, --data and --prompts."""
    p.add_argument("--target", metavar="DIR", help="target folder (default: the embedded target)")
    p.add_argument("--data", metavar="FILE", help=f"conversations JSONL (default: {DEFAULT_DATA})")
    p.add_argument("--prompts", metavar="FILE", help="evaluation prompts JSONL with a domain per line "
                   "(default: the shipped EVAL_PROMPTS)")


def add_eval_args(p: argparse.ArgumentParser) -> None:
    """--limit, --max-new-tokens and --batch-size."""
    p.add_argument("--limit", type=int, default=12, help="prompts per domain (default: 12)")
    p.add_argument("--max-new-tokens", type=int, default=96, help="per prompt (default: 96)")
    p.add_argument("--batch-size", type=int, default=8, help="concurrent requests (default: 8)")


def add_run_args(p: argparse.ArgumentParser) -> None:
    """--seed, --threads, --retrain and --quiet."""
    p.add_argument("--seed", type=int, default=0, help="sampling seed; request i uses seed + i")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--retrain", action="store_true", help="retrain drafters even if --out holds matching ones")
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def resolve_inputs(args: argparse.Namespace, prog: str, source: str) -> tuple[Path, Path] | None:
    """The target folder and the training data, or None after a line on stderr saying what is missing and how
    to make it (`source`: who trains on rollouts, "paper" or "report")."""
    from angelspec.assets import DEFAULT_TARGET

    target_dir = Path(args.target) if args.target else DEFAULT_TARGET
    if not (target_dir / "config.json").is_file():
        print(f"{prog}: {target_dir} has no config.json: the embedded target is not built yet. Build it "
              "with `make data-sources && angelspec target build`, or pass --target DIR.", file=sys.stderr)
        return None
    data = Path(args.data) if args.data else DEFAULT_DATA
    if not data.is_file():
        print(f"{prog}: no training data at {data}. The {source} trains on the target's own rollouts; make "
              f"them with\n    {ROLLOUT_HINT}\nor pass --data FILE (a conversations JSONL).", file=sys.stderr)
        return None
    return target_dir, data


def set_threads(threads: int | None) -> None:
    import torch

    if threads:
        torch.set_num_threads(threads)


# ----- training and evaluation -----


def train_or_reuse(name: str, out: Path, cfg: Any, data: Path, target_dir: Path, retrain: bool, announce: str,
                   train: Callable[[], dict[str, Any]], **stamp_extra: Any) -> tuple[Path, dict]:
    """`out` and its training report: reused when it was trained with these settings (`stamp_extra`, the config,
    the data and the target, kept in `ablation_settings.json`) unless `retrain`, else `train()` after printing
    `announce`."""
    stamp = {**stamp_extra, "config": json.loads(json.dumps(asdict(cfg))), "data": str(data),
             "target": str(target_dir)}
    stamp_path = out / "ablation_settings.json"
    if (not retrain and stamp_path.is_file() and _same_settings(json.loads(stamp_path.read_text()), stamp, cfg)
            and (out / "train_report.json").is_file()):
        print(f"[{name}] reusing {out}")
        return out, json.loads((out / "train_report.json").read_text())
    print(f"[{name}] training {announce}", flush=True)
    report = train()
    stamp_path.write_text(json.dumps(stamp, indent=1))
    return out, report


def _same_settings(saved: dict[str, Any], stamp: dict[str, Any], cfg: Any) -> bool:
    """Saved settings match when everything equals, except that a config field added to the code since (absent
    from `saved`) must hold its default: new options that change nothing keep old drafters reusable."""
    if {k: v for k, v in saved.items() if k != "config"} != {k: v for k, v in stamp.items() if k != "config"}:
        return False
    old, new = saved.get("config", {}), stamp["config"]
    if any(k not in new or old[k] != new[k] for k in old):
        return False
    defaults = json.loads(json.dumps(asdict(type(cfg)())))
    return all(new[k] == defaults.get(k) for k in new if k not in old)


def evaluate_drafters(target_dir: Path, drafters: dict[str, Path], depths: dict[str, int],
                      temperatures: list[float], args: argparse.Namespace,
                      baseline_k: int = 1) -> dict[float, dict[str, Any]]:
    """{T: {drafter: EvalReport}} on the held-out prompts (`--prompts`, else EVAL_PROMPTS), drafter `name`
    verified at K = depths[name]. One AR baseline per temperature (run with K = `baseline_k`), shared by every
    drafter: AR decoding does not depend on K."""
    from angelspec.assets import EVAL_PROMPTS
    from angelspec.data.prompts import load_prompts
    from angelspec.decoding.loading import load_target_and_tokenizer, resolve_drafter
    from angelspec.decoding.sampling import SamplingParams
    from angelspec.eval.prompts import eval_prompts
    from angelspec.eval.speculative import EvalSettings, evaluate, run_decoding

    model, tokenizer = load_target_and_tokenizer(target_dir)
    prompts_file = Path(args.prompts) if args.prompts else EVAL_PROMPTS
    prompts = eval_prompts(tokenizer, load_prompts(prompts_file), context=model.config.max_position_embeddings,
                           source=str(prompts_file), limit=args.limit)
    loaded = {name: resolve_drafter(str(path), model, target_dir) for name, path in drafters.items()}
    results: dict[float, dict[str, Any]] = {}
    for temp in temperatures:
        def settings(k: int, temp: float = temp) -> EvalSettings:
            return EvalSettings(max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, num_draft_tokens=k,
                                sampling=SamplingParams(temperature=temp, seed=args.seed),
                                warmup_tokens=min(16, args.max_new_tokens))

        baseline = run_decoding(model, prompts, settings(baseline_k), progress=not args.quiet, desc=f"AR T={temp}")
        results[temp] = {}
        for name, drafter in loaded.items():
            s = settings(depths[name])
            rep = evaluate(model, drafter, prompts, s, name=name, baseline=replace(baseline, settings=s),
                           progress=not args.quiet)
            if rep.lossless is False:
                print(f"WARNING: {name} at T=0 is not lossless: {rep.lossless_line()}", file=sys.stderr)
            results[temp][name] = rep
    return results


# ----- summary -----


def print_run_header(target_dir: Any, data: Any, args: Any, depths: str, trained: dict[str, tuple[Path, dict]],
                     t_train: float, t_eval: float) -> None:
    """The run's settings and how long training and evaluation took, above the tables."""
    print()
    print(f"target {target_dir}  data {data}  steps {args.steps}  prompts/domain {args.limit}  "
          f"max_new_tokens {args.max_new_tokens}  K {depths}")
    print("training: " + ", ".join(f"{n} {r.get('train_seconds', 0):.0f}s" for n, (_, r) in trained.items())
          + f" (total {t_train:.0f}s); evaluation {t_eval:.0f}s")


def print_summary(text: str, verdicts: list[str], caveat: str) -> None:
    """Our tables next to the paper's, a verdict line per claim and where to look when they disagree."""
    print(text)
    print("\nClaims (ours vs the paper):")
    print("\n".join(verdicts))
    print(caveat)


def write_results(out_dir: str | Path, name: str, payload: dict[str, Any], trained: dict[str, tuple[Path, dict]],
                  results: dict[float, dict[str, Any]], verdicts: list[str]) -> None:
    """`out_dir/name`: `payload` (run settings), the training reports, every EvalReport and the verdicts."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / name).write_text(json.dumps({
        **payload, "train_reports": {n: r for n, (_, r) in trained.items()},
        "results": {str(t): {n: rep.to_dict() for n, rep in reps.items()} for t, reps in results.items()},
        "verdicts": verdicts}, indent=1, default=str))
    print(f"wrote {out / name}")
