"""n-gram lookup in front of a model drafter (`decoding/drafters/hybrid.py`) against each part alone, side by side.

In one process, per round, for each drafter folder: the lookup alone (`ngram`), the model alone and the hybrid at
each `--min-match` (the shortest n-gram match that replaces the model's drafts; every such match does, the default
rule) and, with `--measured`, the adaptive rule too (a match drafts where it has paid so far:
`HybridDrafter(adaptive=True)`), all at the drafter's K. Printed per config and round: speed-up over that config's
own AR run, MAL, per-domain speed-ups, the share of row-rounds the lookup drafted, and whether every output equals
AR's (T=0). Every config is timed right after an AR run on the same prompts and its speed-up is over that run;
rounds interleave the configs. (This machine's speed drifts by a third within minutes: measured against one AR run
at the start of a round, whole rounds moved together.) Run it with the other core idle: a second process there slows
the drafters' wide verify forwards far more than AR's steps, which the pairing does not cancel. Read the mean over
rounds at the end.

    .venv/bin/python benchmarks/hybrid.py --compile                                  # shipped DFly, K = 7
    .venv/bin/python benchmarks/hybrid.py --compile --drafters mtp,eagle3 --ks 3,3
    .venv/bin/python benchmarks/hybrid.py --compile --drafters dfly,mtp --measured --rounds 2
    .venv/bin/python benchmarks/hybrid.py --compile --min-match 1,2,3 --limit 6 --rounds 2

Per round kind, each config also prints what a round costs and commits: for the lookup alone, rounds where it
found a match against rounds without one (plain steps); for a hybrid, rounds every row took from the lookup against
rounds the model drafted in (`HybridDrafter.round_stats`, without each request's first two rounds). Rounds over a
second (a compile) are left out; the warm-up's other rounds count. "AR" is the config's own AR run's time per token,
so "tokens per AR" above 1 is a round kind that pays, and the hybrid beats the lookup alone when its model rounds
pay more than the lookup's rounds without a match. `--model-depths 3,7` also runs hybrids whose model drafts at
most D per round while the lookup drafts K (`HybridDrafter(model_depth=D)`). At the end, the lookup's learned
acceptance per match length and depth (its confidences, `NGramDrafter.acceptance`).
"""

from __future__ import annotations

import argparse
import itertools
import time
from collections import defaultdict
from statistics import mean

import torch

from angelspec.assets import DEFAULT_DRAFTERS, EVAL_PROMPTS, resolve_target_dir
from angelspec.data.prompts import load_prompts
from angelspec.decoding.drafters.base import Drafter
from angelspec.decoding.drafters.hybrid import HybridDrafter, RoundStats
from angelspec.decoding.drafters.ngram import NGramDrafter
from angelspec.decoding.loading import load_target_and_tokenizer, resolve_drafter
from angelspec.eval.prompts import eval_prompts
from angelspec.eval.speculative import EvalSettings, compare, run_decoding


class SplitNGram(NGramDrafter):
    """n-gram lookup that keeps, like `HybridDrafter.round_stats`, what each kind of round cost: "match" (every
    active row's lookup found a match), "no match" (some row drafts nothing)."""

    def __init__(self, max_ngram: int = 3) -> None:
        super().__init__(max_ngram=max_ngram)
        self.round_stats = RoundStats(("match", "no match"))
        self._round: tuple[float, str, tuple[int, ...]] | None = None

    def propose(self, state):
        start = time.perf_counter()
        proposal = super().propose(state)
        matched = all(self._matched[r] for r in state.active_rows)  # the match lengths propose just found
        self._round = (start, "match" if matched else "no match", state.active_rows)
        return proposal

    def on_commit(self, commit) -> None:
        if self._round is not None:
            start, kind, rows = self._round
            self.round_stats.add(kind, time.perf_counter() - start, sum(len(commit.host_tokens[r]) for r in rows))
            self._round = None
        super().on_commit(commit)


def round_split(before: dict[str, list[float]], after: dict[str, list[float]], ar_ms_per_token: float) -> str:
    """'kind: n rounds, ms per round (in AR tokens' time), tokens per round, tokens per AR token's time' per kind."""
    parts = []
    for kind, (n1, s1, t1) in after.items():
        n0, s0, t0 = before[kind]
        n, ms, tokens = n1 - n0, 1000 * (s1 - s0), t1 - t0
        if n:
            cost = ms / n / ar_ms_per_token
            parts.append(f"{kind}: {n:.0f} rounds, {ms / n:.2f} ms ({cost:.2f} AR), {tokens / n:.2f} tokens, "
                         f"{tokens / n / cost:.2f} tokens per AR")
    return "; ".join(parts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafters", default="dfly", help="shipped drafter names or folders, comma-separated")
    ap.add_argument("--ks", default=None, help="K per drafter, comma-separated (default: 7 for block drafters, 3 else)")
    ap.add_argument("--min-match", default="1", help="hybrid variants to run, comma-separated (default: 1)")
    ap.add_argument("--model-depths", default="", help="hybrid variants whose model drafts at most D per round, "
                    "comma-separated (default: only D = K)")
    ap.add_argument("--measured", action="store_true", help="also run each variant with the adaptive rule")
    ap.add_argument("--limit", type=int, default=None, help="prompts per domain (default: all 24)")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--compile", action="store_true", help="torch.compile both sides (the warm-up pays)")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    target_dir = resolve_target_dir(None)
    model, tok = load_target_and_tokenizer(target_dir)
    prompts = eval_prompts(tok, load_prompts(EVAL_PROMPTS), context=model.config.max_position_embeddings,
                           source=str(EVAL_PROMPTS), limit=args.limit)
    names = [n.strip() for n in args.drafters.split(",") if n.strip()]
    folders = [str(DEFAULT_DRAFTERS / n) if (DEFAULT_DRAFTERS / n).is_dir() else n for n in names]
    block = {"dfly", "dflash", "dflare", "dspark"}
    ks = ([int(k) for k in args.ks.split(",")] if args.ks else [7 if n in block else 3 for n in names])
    if len(ks) != len(names):
        raise SystemExit(f"--ks gives {len(ks)} depths for {len(names)} drafters")
    matches = [int(m) for m in args.min_match.split(",")]
    depths = [int(d) for d in args.model_depths.split(",")] if args.model_depths else [None]

    configs: dict[str, tuple[int, Drafter]] = {}  # label -> (K, drafter), in run order
    for name, folder, k in zip(names, folders, ks, strict=True):
        if f"ngram K={k}" not in configs:  # the lookup alone once per K
            configs[f"ngram K={k}"] = (k, SplitNGram())
        configs[f"{name} K={k}"] = (k, resolve_drafter(folder, model, target_dir))
        for m, d, adaptive in itertools.product(matches, depths, (False, True) if args.measured else (False,)):
            inner = resolve_drafter(folder, model, target_dir)
            rule = ("measured" if adaptive else "fixed") + ("" if d is None or d >= k else f", model D={d}")
            configs[f"{name}+ngram ({rule}, min {m}) K={k}"] = (k, HybridDrafter(inner, min_match=m, adaptive=adaptive,
                                                                                  model_depth=d))
    kept = [(label, k, d) for label, (k, d) in configs.items()]
    print(f"target {target_dir}, {len(prompts)} prompts x {args.max_new_tokens} new tokens, batch 1, T=0, "
          f"{'compiled' if args.compile else 'eager'}, {args.threads} thread(s), {args.rounds} round(s)\n")
    width = max(len(label) for label, _, _ in kept) + 2
    speedups: dict[str, list[float]] = defaultdict(list)
    settings = {k: EvalSettings(max_new_tokens=args.max_new_tokens, batch_size=1, num_draft_tokens=k,
                                compile=args.compile) for k in sorted(set(ks))}
    for rnd in range(args.rounds):
        print(f"round {rnd + 1}:")
        for label, k, drafter in kept:
            ar = run_decoding(model, prompts, settings[k], None, progress=False)  # the config's own AR run
            before = (drafter.lookup_rounds, drafter.model_rounds) if isinstance(drafter, HybridDrafter) else None
            stats = getattr(drafter, "round_stats", None)
            stats_before = None if stats is None else stats.snapshot()
            spec = run_decoding(model, prompts, settings[k], drafter, progress=False)
            rep = compare(ar, spec, prompts, name=label)
            o = rep.overall
            speedups[label].append(o.speedup)
            domains = "  ".join(f"{d} {r.speedup:.2f}x" for d, r in rep.domains.items())
            share = ""
            if isinstance(drafter, HybridDrafter) and before is not None:
                lookup, model_rounds = drafter.lookup_rounds - before[0], drafter.model_rounds - before[1]
                share = f"  lookup {lookup / max(lookup + model_rounds, 1):.0%} of row-rounds"
            same = "identical" if o.identical == o.prompts else f"DIFFERS ({o.prompts - o.identical})"
            print(f"  {label:<{width}}{o.speedup:>6.2f}x  MAL {o.spec.mean_accepted_length:.2f}  ({domains}){share}"
                  f"  {same}  (AR {o.ar.tokens_per_s:.0f} tokens/s)", flush=True)
            if stats is not None and stats_before is not None:
                print(f"      {round_split(stats_before, stats.by_kind, 1000 / o.ar.tokens_per_s)}", flush=True)
    print("\nmean speed-up over rounds:")
    for label, values in speedups.items():
        print(f"  {label:<{width}}{mean(values):>6.2f}x")
    for label, k, drafter in kept:
        if isinstance(drafter, SplitNGram):  # what the lookup learned over every round (its confidences)
            print(f"\n{label}: learned acceptance of depths 1..{k}, each given the earlier ones accepted "
                  "(`NGramDrafter.acceptance`; trials in brackets):")
            for n in range(1, drafter.max_ngram + 1):
                est = " ".join(f"{a:.2f}" for a in drafter.acceptance.estimate(n, k))
                trials = " ".join(f"{t:.0f}" for t in drafter.acceptance.trials[n])
                print(f"  after a {n}-token match: {est}  [{trials}]")


if __name__ == "__main__":
    main()
