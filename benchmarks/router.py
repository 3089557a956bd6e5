"""Workload routing on the embedded target: MTP for chat, DFly for code/maths, against the best single drafter.

The mixed held-out workload (the shipped `EVAL_PROMPTS`, code / math / chat, shuffled into one queue with
`--seed`) is decoded five ways, every one through `angelspec_research.router.route_and_generate` so the bookkeeping
is identical (tokens/s = output tokens over the summed engine wall-clock of the drafter pools, MAL = tokens
committed per verify step):

    mtp only, dfly only        single drafters (`WorkloadRouter.fixed`), the whole queue in one engine run
    static (classifier)        `classify_prompt` on the prompt text -> the static rule (chat -> mtp, else dfly)
    static (oracle domains)    the same rule on the prompts' true domains (what a perfect classifier would give)
    online (classifier)        waves of --wave-size requests; per (domain, drafter) running MAL and tokens/s from
                               finished requests; each drafter tried on the first --explore requests per domain,
                               then the best measured tokens/s (the static rule as prior until then)

It prints the classifier's accuracy on the held-out prompts, one table per configuration (overall and per TRUE
domain), the router's gain over the best single drafter, and at T=0 whether every configuration produced the
same outputs (each engine is lossless, so they must). Tokens/s on a shared CPU is noisy: close other jobs, and
compare gains larger than the spread between reruns.

Drafters: `.cache/demo/mtp` and `.cache/demo/dfly`, trained by `make demo` (pass --mtp / --dfly for others).

Run (full workload: 24 prompts per domain, each configuration decoded 3 times, median tokens/s reported):
    .venv/bin/python benchmarks/router.py --threads 1 --repeats 3 --out .cache/router.json
Smoke run (seconds):
    .venv/bin/python benchmarks/router.py --limit 1 --max-new-tokens 8 --batch-size 2 --threads 1 --quiet
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

DEFAULT_MTP = Path(".cache/demo/mtp")
DEFAULT_DFLY = Path(".cache/demo/dfly")


def load_workload(tokenizer: Any, prompts_file: Path, context: int, limit: int | None,
                  seed: int) -> tuple[list[list[int]], list[str], list[str]]:
    """(prompt ids, prompt texts, true domains) of the held-out prompts, at most `limit` per domain, shuffled
    into one mixed queue with `seed`."""
    from angelspec.data.prompts import load_prompts
    from angelspec.eval.prompts import eval_prompts

    records = load_prompts(prompts_file)
    prompts = eval_prompts(tokenizer, records, context=context, source=str(prompts_file), limit=limit)
    text_of = {r["line"]: "\n".join(m["content"] for m in r["messages"] if m["role"] == "user") for r in records}
    order = list(range(len(prompts)))
    random.Random(seed).shuffle(order)
    return ([prompts[i].ids for i in order], [text_of[prompts[i].line] for i in order],
            [prompts[i].domain for i in order])


def format_run(name: str, run: Any, domains: list[str]) -> list[str]:
    """One configuration: overall and per true domain tokens/s and MAL, where requests went."""
    by_domain = run.stats_by(domains)
    o = run.overall
    cells = "  ".join(f"{d} {by_domain[d].tokens_per_s:6.1f} tok/s MAL {by_domain[d].mean_accepted_length:4.2f}"
                      for d in sorted(by_domain))
    routing = "; ".join(f"{d}: " + ", ".join(f"{k} {v}" for k, v in sorted(c.items()))
                        for d, c in sorted(run.routing_table().items()))
    return [f"{name:<24}{o.tokens_per_s:8.1f} tok/s  MAL {o.mean_accepted_length:4.2f}  ({o.output_tokens} tokens, "
            f"{o.seconds:.1f} s, {run.waves} wave(s))", f"{'':<24}{cells}", f"{'':<24}routed: {routing}"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", metavar="DIR", help="target folder (default: the embedded target)")
    p.add_argument("--mtp", default=str(DEFAULT_MTP), metavar="DIR", help=f"MTP drafter (default: {DEFAULT_MTP})")
    p.add_argument("--dfly", default=str(DEFAULT_DFLY), metavar="DIR",
                   help=f"DFly drafter (default: {DEFAULT_DFLY})")
    p.add_argument("--prompts", metavar="FILE", help="prompts JSONL with a domain per line (default: EVAL_PROMPTS)")
    p.add_argument("--limit", type=int, default=None, help="prompts per domain (default: all)")
    p.add_argument("--max-new-tokens", type=int, default=96, help="per prompt (default: 96)")
    p.add_argument("--batch-size", type=int, default=8, help="concurrent requests per drafter pool (default: 8)")
    p.add_argument("--num-draft-tokens", type=int, default=4, help="K for MTP (default: 4, as the demo)")
    p.add_argument("--dfly-draft-tokens", type=int, default=None,
                   help="K for DFly (default: --num-draft-tokens; at most its block size - 1)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default: 0)")
    p.add_argument("--seed", type=int, default=0, help="workload order and sampling seed (request i: seed + i)")
    p.add_argument("--explore", type=int, default=2, help="online router: requests per drafter and domain "
                   "before it routes by measurement (default: 2)")
    p.add_argument("--wave-size", type=int, default=None,
                   help="online router: requests routed per wave (default: --batch-size)")
    p.add_argument("--warmup-tokens", type=int, default=16, help="untimed warm-up tokens per engine (default: 16)")
    p.add_argument("--repeats", type=int, default=1, help="decode every configuration this many times and report "
                   "the median tokens/s (default: 1; 3 on a machine with other load)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--out", metavar="FILE", help="also write the results as JSON here")
    p.add_argument("--quiet", action="store_true", help="no per-configuration progress lines")
    args = p.parse_args(argv)

    import torch

    from angelspec.assets import DEFAULT_TARGET, EVAL_PROMPTS
    from angelspec.decoding.engine import EngineConfig, Request
    from angelspec.decoding.loading import load_target_and_tokenizer, resolve_drafter
    from angelspec.decoding.sampling import SamplingParams
    from angelspec_research.router import WorkloadRouter, classifier_accuracy, classify_prompt, route_and_generate

    target_dir = Path(args.target) if args.target else DEFAULT_TARGET
    for flag, path in (("--mtp", args.mtp), ("--dfly", args.dfly)):
        if not (Path(path) / "config.json").is_file():
            print(f"router: {flag} {path} holds no drafter (no config.json). Train the demo drafters with "
                  f"`make demo`, or pass {flag} DIR.", file=sys.stderr)
            return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_target_and_tokenizer(target_dir)
    prompts_file = Path(args.prompts) if args.prompts else EVAL_PROMPTS
    ids, texts, domains = load_workload(tokenizer, prompts_file, model.config.max_position_embeddings, args.limit,
                                        args.seed)
    drafters = {"mtp": resolve_drafter(f"mtp:{args.mtp}", model, target_dir),
                "dfly": resolve_drafter(f"dfly:{args.dfly}", model, target_dir)}
    context = model.config.max_position_embeddings
    requests = [Request(prompt_ids=x, max_new_tokens=min(args.max_new_tokens, context - len(x)),
                        sampling=SamplingParams(temperature=args.temperature, seed=args.seed + i), request_id=i)
                for i, x in enumerate(ids)]
    config = EngineConfig(max_batch_size=args.batch_size, num_draft_tokens=args.num_draft_tokens,
                          max_seq_len=min(context, max(len(x) for x in ids) + args.max_new_tokens))
    k = {"mtp": args.num_draft_tokens, "dfly": args.dfly_draft_tokens or args.num_draft_tokens}

    acc, confusion = classifier_accuracy(texts, domains)
    all_records = [json.loads(line) for line in prompts_file.read_text().splitlines() if line.strip()]
    acc_all, _ = classifier_accuracy([r.get("prompt", "") for r in all_records],
                                     [r.get("domain", "chat") for r in all_records], classify_prompt)

    def configs() -> dict[str, dict[str, Any]]:
        """Fresh routers (an online router's tracker must not carry over between repeats)."""
        return {
            "mtp only": dict(router=WorkloadRouter.fixed("mtp")),
            "dfly only": dict(router=WorkloadRouter.fixed("dfly")),
            "static (classifier)": dict(router=WorkloadRouter(["mtp", "dfly"]), prompt_texts=texts),
            "static (oracle domains)": dict(router=WorkloadRouter(["mtp", "dfly"]), domains=domains),
            "online (classifier)": dict(router=WorkloadRouter(["mtp", "dfly"], online=True, explore=args.explore),
                                        prompt_texts=texts, wave_size=args.wave_size or args.batch_size),
        }

    repeats: dict[str, list[tuple[Any, WorkloadRouter]]] = {}
    t0 = time.time()
    for rep in range(args.repeats):  # repeats interleave the configurations, so machine drift hits them alike
        for name, kw in configs().items():
            if not args.quiet:
                print(f"[{name}] repeat {rep + 1}/{args.repeats}: decoding {len(requests)} requests ...", flush=True)
            run = route_and_generate(model, drafters, requests, config=config, num_draft_tokens=k,
                                     warmup_tokens=args.warmup_tokens, **kw)
            repeats.setdefault(name, []).append((run, kw["router"]))
    # Per configuration, the repeat with the median overall tokens/s (and the spread over repeats).
    median = {n: sorted(rs, key=lambda x: x[0].overall.tokens_per_s)[(len(rs) - 1) // 2] for n, rs in repeats.items()}
    runs = {n: run for n, (run, _) in median.items()}
    spread = {n: [r.overall.tokens_per_s for r, _ in rs] for n, rs in repeats.items()}

    print()
    mix = ", ".join(f"{d} {domains.count(d)}" for d in sorted(set(domains)))
    print(f"target {target_dir}  prompts {len(requests)} ({mix})"
          f"  max_new_tokens {args.max_new_tokens}  batch {args.batch_size}  K mtp {k['mtp']} / dfly {k['dfly']}  "
          f"T={args.temperature}  threads {torch.get_num_threads()}  ({time.time() - t0:.0f} s)")
    print(f"classifier accuracy: {100 * acc:.1f}% on this workload, {100 * acc_all:.1f}% on all of "
          f"{prompts_file.name}; confusion {json.dumps(confusion)}")
    print()
    for name, run in runs.items():
        print("\n".join(format_run(name, run, domains)))
        if args.repeats > 1:
            print(f"{'':<24}tokens/s over {args.repeats} repeats: min {min(spread[name]):.1f}, "
                  f"max {max(spread[name]):.1f} (median shown)")
    best_single = max(("mtp only", "dfly only"), key=lambda n: runs[n].overall.tokens_per_s)
    base = runs[best_single].overall.tokens_per_s
    print()
    gains = {}
    for name in ("static (classifier)", "static (oracle domains)", "online (classifier)"):
        gains[name] = runs[name].overall.tokens_per_s / base - 1 if base > 0 else 0.0
        print(f"gain of {name:<24} over the best single drafter ({best_single}): {100 * gains[name]:+.1f}% tokens/s")
    online = median["online (classifier)"][1]
    print("\nonline tracker at the end (per classified domain):\n" + online.table())
    lossless = None
    if args.temperature == 0:
        ref = [r.token_ids for r in runs["mtp only"].results]
        same = {n: [r.token_ids for r in run.results] == ref for n, run in runs.items()}
        lossless = all(same.values())
        print("\nT=0: every configuration's outputs identical: " + ("yes" if lossless else
              "NO (a bug: each engine is lossless) " + json.dumps(same)))
    if args.out:
        Path(args.out).write_text(json.dumps({
            "settings": vars(args), "classifier_accuracy": acc, "classifier_accuracy_file": acc_all,
            "confusion": confusion, "best_single": best_single, "gains": gains, "lossless": lossless,
            "tokens_per_s_repeats": spread,
            "runs": {n: {**run.to_dict(), "by_true_domain": {d: s.to_dict() for d, s in run.stats_by(domains).items()}}
                     for n, run in runs.items()}}, indent=1))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
