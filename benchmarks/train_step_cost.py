"""Training tokens/s of drafter presets with train_vocab "full" vs "draft" (train.losses "Draft vocabulary"), side by
side in one process.

Each variant is a real run of the preset's trainer (`angelspec train`, in-process: the frozen target's forward,
rollout / backbone, chunked LM head + loss, backward, AdamW) for `--steps` steps with `log_every=1`, so every step
writes its own tokens/s line (`train_log.jsonl`); the first `--skip` steps of a run are warm-up and dropped.
The presets differ only in `train_vocab` (and `switch_step`, set for the objective asked for: `--objective final`
trains the final objective from step 0, e2e TV for both shipped recipes; `cold` stays in the cold start). Runs are
interleaved (`--rounds`, the order flipped every round), since the machine may be shared; the table gives the
median tokens/s of each variant over all its measured steps and the draft/full ratio, with the per-round ratios
for spread.

    .venv/bin/python benchmarks/train_step_cost.py --data /tmp/roll2k.jsonl
    .venv/bin/python benchmarks/train_step_cost.py --data FILE --presets mtp:mtp_shipped --rounds 4 --steps 6
Smoke run on any small target folder (seconds):
    .venv/bin/python benchmarks/train_step_cost.py --target DIR --data FILE --presets mtp:tiny_debug --steps 3 \\
        --skip 1 --rounds 1 draft_vocab_size=16
Extra `key=value` arguments override fields of every preset (e.g. `batch_size=2`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from angelspec.assets import resolve_target_dir
from angelspec.train.overrides import parse_overrides, with_overrides
from angelspec.train.registry import get_trainer

VOCABS = ("full", "draft")


def run_steps(kind: str, cfg: Any, target: Path, data: Path, out: Path, skip: int) -> list[float]:
    """Train `cfg` into `out` (overwritten) and return the tokens/s of each step after the first `skip`."""
    get_trainer(kind)[0](target, data, out, config=cfg, force=True, progress=False, log=lambda *_: None)
    records = [json.loads(line) for line in (out / "training" / "train_log.jsonl").read_text().splitlines()]
    return [r["tokens_per_s"] for r in records[skip:]]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default=None, help="target folder (default: the embedded target)")
    ap.add_argument("--data", required=True, help="conversations JSONL (e.g. the first 2000 shipped rollouts)")
    ap.add_argument("--presets", default="mtp:mtp_shipped,dfly:dfly_shipped", help="KIND:PRESET,...")
    ap.add_argument("--steps", type=int, default=5, help="steps per run, warm-up included")
    ap.add_argument("--skip", type=int, default=2, help="warm-up steps dropped from each run")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--objective", choices=("final", "cold"), default="final")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None, help="folder for the runs (default: a temporary one)")
    args, overrides = ap.parse_known_args(argv)
    if args.steps <= args.skip:
        ap.error("--steps must exceed --skip")
    torch.set_num_threads(args.threads)
    target, data = resolve_target_dir(args.target), Path(args.data)
    variants: list[tuple[str, str, str, Any]] = []
    for item in args.presets.split(","):
        kind, name = item.split(":")
        base = with_overrides(get_trainer(kind)[1][name](), parse_overrides(overrides))
        switch = 0 if args.objective == "final" else args.steps + 1
        for vocab in VOCABS:
            cfg = replace(base, train_vocab=vocab, steps=args.steps, log_every=1, ckpt_every=args.steps,
                          switch_step=switch)
            variants.append((kind, item, vocab, cfg))
    work = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="train_step_cost_"))
    speeds: dict[tuple[str, str], list[list[float]]] = {(n, v): [] for _, n, v, _ in variants}
    for r in range(args.rounds):
        for kind, name, vocab, cfg in variants if r % 2 == 0 else variants[::-1]:
            steps = run_steps(kind, cfg, target, data, work / f"{name.replace(':', '-')}-{vocab}", args.skip)
            speeds[(name, vocab)].append(steps)
            print(f"round {r + 1} {name:<20} {vocab:<5} tokens/s per step: "
                  + " ".join(f"{s:.0f}" for s in steps), flush=True)
    print(f"\n{args.threads} thread(s), {args.steps - args.skip} measured steps per run x {args.rounds} rounds, "
          f"objective {args.objective}; median tokens/s")
    print(f"{'kind:preset':<20} {'full':>8} {'draft':>8} {'draft/full':>11}  per round")
    for name in dict.fromkeys(n for _, n, _, _ in variants):
        med = {v: statistics.median(s for run in speeds[(name, v)] for s in run) for v in VOCABS}
        per_round = [statistics.median(d) / statistics.median(f)
                     for f, d in zip(speeds[(name, "full")], speeds[(name, "draft")], strict=True)]
        print(f"{name:<20} {med['full']:>8.0f} {med['draft']:>8.0f} {med['draft'] / med['full']:>10.2f}x  "
              + " ".join(f"{x:.2f}" for x in per_round))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
