"""The report's block-parallel drafting claims in miniature (report §3.4–3.5, Tables 3, 4, 5) on the embedded target.

Every drafter is trained for the same budget (same steps, global batch, rows per step, seed, hence the same rows
in the same order) on the target's own rollouts, then evaluated with `angelspec.eval.speculative.evaluate` on the
shipped held-out prompts (`EVAL_PROMPTS`, per domain) at T = 0 and T = 1, with verification depth
K = block_size − 1 for block drafters and the same K for MTP (which drafts recurrently past its trained depth):

* default (Tables 3 and 4): MTP (TTT, preset `mtp_embedded`, D = --mtp-depths), DFlash (shared fc context, no
  head), the DFly backbone (hybrid conditioning, Eq. 12, no head), DFly + Markov head (Eq. 14) and DFly + hidden
  correction (Eq. 15, the report's DFly); all block drafters L2-B8 with the same taps (1, 3, 5), the same
  objective (D-PACE LK cold start for 30 % of the steps, then e2e TV) and a confidence head.
* `--sweep` (Table 5): DFly + hidden correction over block sizes --sweep-blocks × draft depths --sweep-layers
  (default 4, 8, 16 × 1, 2), at T = 1 only (as Table 5), each verified at its own K = B − 1.

Both print our MAL per domain next to the paper's (its benchmarks averaged into our three domains: math =
Math500, GSM8K; code = HumanEval, MBPP, LiveCodeBench; chat = MT-Bench) and a line per qualitative claim saying
whether ours agree. Differences to expect: a 7M-parameter dense target instead of Hy3-A21B / Qwen3-8B, minutes
of CPU training instead of six epochs, 2 draft layers instead of 5 (1–2 in the sweep instead of 3–7), MTP-3 by
default (the report aligns MTP's TTT horizon with the 8-token block; pass --mtp-depths 7 for that, ~3.5× the MTP
training time), no data expansion row, and a few dozen prompts of our own held-out data instead of six public
benchmarks, so MAL differences of a few hundredths are within noise.

Data: `--data FILE` (conversations JSONL; default `.cache/draft-data/rollout/train.jsonl`). Make it with
    angelspec rollout --prompts .cache/draft-data/rollout_prompts.jsonl --out .cache/draft-data/rollout/train.jsonl

Run (the default table: 5 drafters, ~25 min of training on 1 thread; the sweep adds 5 more, ~15 min; evaluation
adds a few minutes each). Sizing, measured on 1 thread of a shared 2-core machine (rows of 2 × 512 tokens): MTP-3
1.3–1.6 s/step, each L2-B8 block drafter 0.35–0.9 s/step (0.35 when the other core was quiet), L1-B4 0.26, L2-B16
0.48; the default table ≈ 3.3 s per step of all five drafters, hence --steps 450 ≈ 25 min.
    .venv/bin/python benchmarks/block_ablation.py --threads 1
    .venv/bin/python benchmarks/block_ablation.py --threads 1 --sweep
Smoke run on the embedded target (about a minute):
    .venv/bin/python benchmarks/block_ablation.py --steps 2 --limit 1 --max-new-tokens 8 --threads 1 --quiet \\
        --out /tmp/block-ablation
and on any small target folder (seconds): add --target DIR --data FILE --prompts SHORT.jsonl seq_len=64
num_anchors=4 (`key=value` arguments override fields of every trained config that has them, e.g. lr=5e-4).
Trained drafters are kept under `--out` and reused by a rerun with the same settings (`--retrain` to redo).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _ablation  # noqa: E402  (a sibling module)
from _ablation import DOMAINS, verdict, within_noise  # noqa: E402  (a sibling module)

# The six benchmarks of Tables 3–5, in the paper's column order, and how they average into our domains.
BENCHMARKS = ("Math500", "GSM8K", "HumanEval", "MBPP", "LiveCodeBench", "MT-Bench")
PAPER_DOMAINS = {"math": ("Math500", "GSM8K"), "code": ("HumanEval", "MBPP", "LiveCodeBench"), "chat": ("MT-Bench",)}

# Table 3 (T = 1, no thinking): MAL per benchmark, per target.
PAPER_T3 = {
    "Hy3-A21B": {"mtp": [3.30, 3.30, 3.13, 3.04, 2.84, 2.40], "dflash": [4.01, 4.23, 4.36, 4.05, 3.10, 2.38],
                 "dfly_hidden": [5.23, 5.53, 5.52, 5.41, 4.07, 2.96]},
    "Qwen3-8B": {"mtp": [3.53, 3.56, 3.33, 3.22, 3.25, 2.57], "dflash": [4.97, 5.54, 4.77, 4.50, 4.46, 3.16],
                 "dfly_hidden": [6.06, 6.42, 5.60, 5.34, 5.36, 3.67]},
}
# Table 4 (Hy3, T = 0, cumulative ablation; the "+ DATA" row has no counterpart here).
PAPER_T4 = {"dflash": [4.27, 3.86, 4.27, 4.18, 3.46, 2.60], "dfly_none": [4.92, 4.88, 5.00, 5.03, 3.71, 2.88],
            "dfly_markov": [5.12, 5.13, 5.24, 4.98, 3.85, 3.03],
            "dfly_hidden": [5.13, 5.17, 5.26, 5.00, 4.00, 3.06]}
# Table 5 (T = 1): (draft layers, block size) -> MAL per benchmark.
PAPER_T5 = {(3, 5): [3.53, 3.72, 3.76, 3.52, 2.86, 2.32], (5, 5): [3.64, 3.84, 3.79, 3.64, 3.03, 2.42],
            (5, 8): [4.66, 5.10, 5.02, 4.58, 3.49, 2.66], (7, 8): [4.64, 5.05, 4.90, 4.59, 3.63, 2.67]}


@dataclass(frozen=True)
class Variant:
    """One drafter to train: a name, its trainer family ("mtp" | "block"), the preset it starts from and the
    config fields that differ from it."""

    name: str
    label: str
    family: str
    preset: str
    fields: tuple[tuple[str, Any], ...] = ()


TABLE = (Variant("mtp", "MTP (TTT)", "mtp", "mtp_embedded"),
         Variant("dflash", "DFlash", "block", "dflash_embedded"),
         Variant("dfly_none", "DFly backbone", "block", "dfly_embedded", (("head", "none"),)),
         Variant("dfly_markov", "DFly + Markov head", "block", "dfly_embedded", (("head", "markov"),)),
         Variant("dfly_hidden", "DFly + hidden corr.", "block", "dfly_embedded", (("head", "hidden"),)))


def sweep_variants(blocks: list[int], layers: list[int]) -> list[Variant]:
    """DFly + hidden correction for every (block size, draft depth); B8-L2 is the default table's DFly."""
    out = []
    for b in blocks:
        for n in layers:
            name = "dfly_hidden" if (b, n) == (8, 2) else f"dfly_b{b}_l{n}"
            out.append(Variant(name, f"DFly L{n}-B{b}", "block", "dfly_embedded",
                               (("head", "hidden"), ("block_size", b), ("draft_layers", n))))
    return out


def _paper_mal(values: list[float]) -> dict[str, float]:
    out = {d: _ablation.domain_mean(values, d, BENCHMARKS, PAPER_DOMAINS) for d in DOMAINS}
    out["all"] = sum(values) / len(values)
    return out


# ----- training -----


def build_config(variant: Variant, args: argparse.Namespace) -> Any:
    """The variant's preset with its fields, the shared budget (steps, 30 % cold start, batch, rows, seed) and the
    user's overrides. Every drafter sees the same rows in the same order: both families pack `seq_len`-token rows
    with `PackedRows(seed)` and take `batch_size` of them per step."""
    from angelspec.train.block import PRESETS as BLOCK_PRESETS
    from angelspec.train.mtp import PRESETS as MTP_PRESETS

    presets = MTP_PRESETS if variant.family == "mtp" else BLOCK_PRESETS
    cfg = presets[variant.preset]()
    shared = {"steps": args.steps, "switch_step": max(1, args.steps * 3 // 10), "batch_size": 2, "seq_len": 512,
              "warmup": min(10, max(1, args.steps // 10)), "seed": 0}
    if variant.family == "mtp":
        shared["num_depths"] = args.mtp_depths
    cfg = replace(cfg, **shared, **dict(variant.fields))
    return _apply_overrides(cfg, args.overrides)


def _apply_overrides(cfg: Any, overrides: list[str]) -> Any:
    """`key=value` overrides for the fields this config has (the others belong to the other trainer family)."""
    from angelspec.train.overrides import parse_overrides, with_overrides

    names = {f.name for f in fields(cfg)}
    return with_overrides(cfg, {k: v for k, v in parse_overrides(overrides).items() if k in names})


def check_overrides(overrides: list[str]) -> None:
    """Refuse a key that no trained config has (a typo would otherwise be silently ignored)."""
    from angelspec.train.block import BlockDrafterTrainConfig
    from angelspec.train.mtp import MTPTrainConfig
    from angelspec.train.overrides import parse_overrides

    known = {f.name for f in fields(MTPTrainConfig)} | {f.name for f in fields(BlockDrafterTrainConfig)}
    bad = sorted(set(parse_overrides(overrides)) - known)
    if bad:
        raise SystemExit(f"block_ablation: no trained config has the field(s) {bad}; valid keys are the fields of "
                         "MTPTrainConfig (train/mtp.py) and BlockDrafterTrainConfig (train/block.py)")


def train_variant(variant: Variant, target_dir: Path, data: Path, args: argparse.Namespace) -> tuple[Path, dict]:
    """Train (or reuse) one drafter; returns its folder and training report."""
    from angelspec.train.block import train_block_drafter
    from angelspec.train.mtp import train_mtp

    cfg = build_config(variant, args)
    out = Path(args.out) / variant.name
    shape = (f"D={cfg.num_depths}" if variant.family == "mtp" else
             f"L{cfg.draft_layers}-B{cfg.block_size}, head {cfg.resolved_head}")
    trainer = train_mtp if variant.family == "mtp" else train_block_drafter
    return _ablation.train_or_reuse(
        variant.name, out, cfg, data, target_dir, args.retrain,
        f"{variant.label} ({shape}): {cfg.steps} steps x {cfg.batch_size} rows x {cfg.seq_len} tokens",
        lambda: trainer(target_dir, data, out, config=cfg, force=True, progress=not args.quiet, log=lambda *_: None),
        family=variant.family)


# ----- evaluation -----


def evaluate_variants(target_dir: Path, drafters: dict[str, Path], depths: dict[str, int], temperatures: list[float],
                      args: argparse.Namespace) -> dict[float, dict[str, Any]]:
    """{T: {variant: EvalReport}} on the held-out prompts, drafter `name` verified at K = depths[name]. One AR
    baseline per temperature, shared by every drafter (AR decoding does not depend on K)."""
    return _ablation.evaluate_drafters(target_dir, drafters, depths, temperatures, args)


def _mal(rep: Any) -> dict[str, float]:
    out = {d: r.spec.mean_accepted_length for d, r in rep.domains.items()}
    out["all"] = rep.overall.spec.mean_accepted_length
    return out


def _row(label: str, mal: dict[str, float], cols: list[str]) -> str:
    return f"{label:<24}" + "".join(f"{mal[c]:>8.2f}" if c in mal else f"{'-':>8}" for c in cols)


def _ratio(a: dict[str, float], b: dict[str, float], col: str) -> float:
    return a[col] / b[col] if b.get(col) else float("nan")


def main_tables(results: dict[float, dict[str, Any]], k: int) -> tuple[str, list[str]]:
    """Our Tables 3/4 (MAL per domain per drafter per temperature), the paper's, and the claim checks."""
    lines, verdicts = [], []
    for temp, reps in results.items():
        cols = [d for d in DOMAINS if d in next(iter(reps.values())).domains] + ["all"]
        mal = {v.name: _mal(reps[v.name]) for v in TABLE if v.name in reps}
        lines += [f"Ours, T={temp:g}, K={k}: MAL per domain", f"{'drafter':<24}" + "".join(f"{c:>8}" for c in cols)]
        lines += [_row(v.label, mal[v.name], cols) for v in TABLE if v.name in mal]
        lines.append("")
        fly, flash, mtp, none = mal["dfly_hidden"], mal["dflash"], mal["mtp"], mal["dfly_none"]
        tag = f"T={temp:g}"
        r = _ratio(fly, flash, "all")
        paper_r = (_paper_mal(PAPER_T3["Hy3-A21B"]["dfly_hidden"])["all"] / _paper_mal(PAPER_T3["Hy3-A21B"]["dflash"])
                   ["all"] if temp > 0 else _paper_mal(PAPER_T4["dfly_hidden"])["all"] / _paper_mal(PAPER_T4["dflash"])
                   ["all"])
        verdicts.append(verdict(1.15 <= r <= 1.45, f"{tag}: DFly's MAL is ~1.3x DFlash's (1.15-1.45x)",
                                 f"ours {r:.2f}x, paper {paper_r:.2f}x"))
        verdicts.append(verdict(all(fly[d] > mtp[d] for d in cols), f"{tag}: DFly beats MTP in every domain",
                                 ", ".join(f"{d} {fly[d]:.2f} vs {mtp[d]:.2f}" for d in cols)))
        domains = [d for d in cols if d != "all"]
        if {"code", "math", "chat"} <= set(domains):
            for base_name, base in (("DFlash", flash), ("MTP", mtp)):
                gain = {d: _ratio(fly, base, d) for d in domains}
                verdicts.append(verdict(min(gain["code"], gain["math"]) > gain["chat"],
                                         f"{tag}: DFly's gain over {base_name} is largest on code and maths",
                                         " ".join(f"{d} {gain[d]:.2f}x" for d in domains)))
        if temp == 0:
            gain = {d: none[d] - flash[d] for d in domains}
            verdicts.append(verdict(none["all"] > flash["all"], f"{tag}: the DFly backbone beats DFlash (4.40 vs "
                                     "3.77)", f"{none['all']:.2f} vs {flash['all']:.2f}",
                                     tie=within_noise(none["all"], flash["all"])))
            if "code" in gain:
                verdicts.append(verdict(max(gain, key=gain.get) == "code",
                                         f"{tag}: the backbone's gain is largest on code",
                                         " ".join(f"{d} {g:+.2f}" for d, g in gain.items())))
        verdicts.append(verdict(mal["dfly_markov"]["all"] > none["all"],
                                 f"{tag}: the Markov head adds MAL to the backbone (paper T=0: 4.40 -> 4.56)",
                                 f"{none['all']:.2f} -> {mal['dfly_markov']['all']:.2f}",
                                 tie=within_noise(mal["dfly_markov"]["all"], none["all"])))
        verdicts.append(verdict(fly["all"] > none["all"],
                                 f"{tag}: hidden correction adds MAL to the backbone (paper T=0: 4.40 -> 4.60)",
                                 f"{none['all']:.2f} -> {fly['all']:.2f}"))
        verdicts.append(verdict(fly["all"] >= mal["dfly_markov"]["all"],
                                 f"{tag}: hidden correction >= Markov head (paper T=0: 4.60 vs 4.56)",
                                 f"{fly['all']:.2f} vs {mal['dfly_markov']['all']:.2f}",
                                 tie=within_noise(fly["all"], mal["dfly_markov"]["all"])))
    cols = [*DOMAINS, "all"]
    lines += ["Paper, Table 3 (T=1; its benchmarks averaged into our domains; 'all' = mean of six)",
              f"{'target / drafter':<24}" + "".join(f"{c:>8}" for c in cols)]
    short = {"mtp": "MTP", "dflash": "DFlash", "dfly_hidden": "DFly (hidden corr.)"}
    for tgt, rows in PAPER_T3.items():
        lines += [_row(f"{tgt.split('-')[0]} {short[name]}", _paper_mal(vals), cols) for name, vals in rows.items()]
    lines += ["", "Paper, Table 4 (Hy3, T=0, cumulative)", f"{'drafter':<24}" + "".join(f"{c:>8}" for c in cols)]
    lines += [_row(next(v.label for v in TABLE if v.name == n), _paper_mal(vals), cols) for n, vals in PAPER_T4.items()]
    return "\n".join(lines), verdicts


def sweep_table(reps: dict[str, Any], variants: list[Variant], temp: float) -> tuple[str, list[str]]:
    """Our Table 5 (MAL per domain per block size × depth) next to the paper's, and the claim checks."""
    shape = {v.name: (dict(v.fields)["draft_layers"], dict(v.fields)["block_size"]) for v in variants}
    cols = [d for d in DOMAINS if d in next(iter(reps.values())).domains] + ["all"]
    mal = {n: _mal(reps[n]) for n in shape}
    lines = [f"Ours, T={temp:g}: DFly + hidden correction, K = B-1", f"{'layers / block':<24}"
             + "".join(f"{c:>8}" for c in cols)]
    lines += [_row(f"L{n}-B{b} (K={b - 1})", mal[name], cols) for name, (n, b) in sorted(shape.items(),
                                                                                          key=lambda x: x[1])]
    lines += ["", "Paper, Table 5 (Hy3, T=1)", f"{'layers / block':<24}" + "".join(f"{c:>8}" for c in cols)]
    lines += [_row(f"L{n}-B{b}", _paper_mal(vals), cols) for (n, b), vals in PAPER_T5.items()]
    verdicts = []
    by_shape = {s: mal[n]["all"] for n, s in shape.items()}
    layers = sorted({n for n, _ in by_shape})
    blocks = sorted({b for _, b in by_shape})
    for n in layers:
        series = [by_shape[(n, b)] for b in blocks]
        if len(series) > 1:
            verdicts.append(verdict(series[1] > series[0], f"L{n}: a longer block raises MAL (paper B5 -> B8: "
                                     "3.39 -> 4.25)", " -> ".join(f"B{b} {m:.2f}" for b, m in zip(blocks, series,
                                                                                                strict=True)),
                                     tie=within_noise(series[1], series[0])))
    if len(layers) > 1 and len(blocks) > 1:
        depth_spread = max(abs(by_shape[(layers[-1], b)] - by_shape[(layers[0], b)]) for b in blocks)
        block_spread = max(max(by_shape[(n, b)] for b in blocks) - min(by_shape[(n, b)] for b in blocks)
                           for n in layers)
        verdicts.append(verdict(block_spread > depth_spread, "block size matters more than draft depth",
                                 f"largest spread over blocks {block_spread:.2f}, over depths {depth_spread:.2f}",
                                 tie=within_noise(block_spread, depth_spread)))
    return "\n".join(lines), verdicts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sweep", action="store_true", help="Table 5: DFly block size x draft depth instead of Tables 3-4")
    p.add_argument("--sweep-blocks", default="4,8,16", metavar="B,B", help="block sizes of --sweep (default 4,8,16)")
    p.add_argument("--sweep-layers", default="1,2", metavar="L,L", help="draft depths of --sweep (default 1,2)")
    _ablation.add_input_args(p)
    p.add_argument("--out", default=".cache/block-ablation", metavar="DIR", help="where drafters and results go")
    p.add_argument("--steps", type=int, default=450,
                   help="training steps per drafter (default: 450, about 25 min for the default table on 1 thread)")
    p.add_argument("--mtp-depths", type=int, default=3, help="MTP's TTT depth D (default 3, the report's MTP-3; "
                   "the report's Table 3 aligns it with the block: 7)")
    p.add_argument("--temperatures", default=None, metavar="T,T",
                   help="evaluation temperatures (default: 0,1; 1 with --sweep)")
    _ablation.add_eval_args(p)
    _ablation.add_run_args(p)
    p.add_argument("overrides", nargs="*", metavar="key=value", help="override fields of every trained config "
                   "that has them")
    args = p.parse_args(argv)

    inputs = _ablation.resolve_inputs(args, "block_ablation", "report")
    if inputs is None:
        return 2
    target_dir, data = inputs
    check_overrides(args.overrides)
    _ablation.set_threads(args.threads)
    temperatures = [float(t) for t in (args.temperatures or ("1" if args.sweep else "0,1")).split(",")]
    if args.sweep:
        variants = sweep_variants([int(b) for b in args.sweep_blocks.split(",")],
                                  [int(n) for n in args.sweep_layers.split(",")])
    else:
        variants = list(TABLE)
    t0 = time.time()
    trained = {v.name: train_variant(v, target_dir, data, args) for v in variants}
    t_train = time.time() - t0
    block_k = {n: r["block_size"] - 1 for n, (_, r) in trained.items() if "block_size" in r}
    table_k = block_k.get("dfly_hidden", max(block_k.values(), default=7))
    depths = {n: block_k.get(n, table_k) for n in trained}  # MTP verifies at the block drafters' K
    results = evaluate_variants(target_dir, {n: path for n, (path, _) in trained.items()}, depths, temperatures, args)
    t_eval = time.time() - t0 - t_train

    if args.sweep:
        parts = [sweep_table(reps, variants, temp) for temp, reps in results.items()]
        text = "\n\n".join(t for t, _ in parts)
        verdicts = [v for _, vs in parts for v in vs]
    else:
        text, verdicts = main_tables(results, table_k)
    _ablation.print_run_header(target_dir, data, args, ", ".join(f"{n} {k}" for n, k in depths.items()), trained,
                               t_train, t_eval)
    _ablation.print_summary(text, verdicts, "Where we disagree, suspect scale before method: a 7M-parameter "
                            f"target, minutes of CPU training, 1-2 draft layers and {args.limit} prompts per domain "
                            "(a few hundredths of MAL are noise).")
    _ablation.write_results(args.out, "table5_sweep.json" if args.sweep else "tables3_4_block.json",
                            {"target": str(target_dir), "data": str(data), "steps": args.steps,
                             "num_draft_tokens": depths}, trained, results, verdicts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
