"""Drafter step latency vs one target verification step (issue 5, "Inference"): goal <= 25% at batch 1 on the
embedded target.

What is measured, per drafter kind and batch size (1 and 16):

    draft   one `Drafter.propose` (K drafts per row): block drafters K = block_size - 1 = 7 (one backbone pass
            over [last, m, ..., m], then the sequential head; `--block-k 4` drafts 4, as `make demo` does: the
            backbone still runs over the whole block, the head over 4 positions), MTP and the draft LM K = 4 (K
            recurrent steps)
    commit  one `Drafter.on_commit`, reported separately, not part of the goal. The block and MTP drafters only
            keep the commit there: appending the newly committed positions' target taps to the draft context runs at
            the start of the next drafting `propose` (in "draft"), so draft + commit is what a step pays either way;
            the draft LM rolls its cache back
    verify  one target verify forward over [last, d_1..d_K] (K + 1 tokens) against the KV cache, with the taps
            the drafter asks for, plus the greedy verification

The drafters: `dfly` (the `dfly_embedded` preset: 2 draft layers, taps (1, 3, 5), hybrid conditioning, hidden-
correction head, confidence head), `dflash` (same shape, shared-fc conditioning, no head, no confidence head),
`dspark` (DFlash backbone + rank-64 Markov head + confidence head), `mtp` (one MTP draft model, `MTPConfig.for_target`
with D = 3, drafting K = 4 recurrently) and the shipped draft LM (`assets/draft_lm`, 1 layer); on request also
`dfly-plain`, DFly with `factor_hidden_head = False` (the per-position head the factored one replaces). The block and
MTP drafters are randomly initialised: latency does not depend on their weights (acceptance does, and is ~0
here, which only means every step commits one token; every head runs a fixed number of operations, so trained
weights cost the same).

`--draft-vocab 1024 --draft-layers 1 --draft-intermediate 512 --head-intermediate 128` is the shape of the
`dfly_demo` preset `make demo` trains.

`--skip-pattern DSSS` also runs every drafter under a scripted speculation gate (D: draft, S: skip, cycled) and
reports what the drafter costs per gate-skipped step (`propose` of 0 drafts + `on_commit`: ideally nothing over a
plain AR step) and per drafted step (which then catches up on the skipped steps' context), both over the verify
step of the ungated run.

How: each drafter runs inside a real `SpecEngine` on greedy requests (EOS disabled) whose prompts are
`--context` random tokens, so the caches hold ~256 tokens when decoding starts (and ~256 + new tokens at the
end). The engine already times every speculative step's phases (`metrics.seconds`: draft = propose, verify =
target forward + verification); `on_commit` is wrapped with a timer because the engine bills it to "commit"
together with its own bookkeeping. A generation's per-step cost is its phase total / its step count; drafters
and batch sizes are interleaved and each number is the best of `--repeats` generations (the most stable
statistic on a shared machine). This measures exactly what a speculative step pays, with the engine's shapes
(`kv_len` bounds, taps, padding rows) rather than a re-implementation of them.

    .venv/bin/python benchmarks/drafter_cost.py
    .venv/bin/python benchmarks/drafter_cost.py --new-tokens 16 --repeats 1      # smoke test
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from angelspec.assets import DEFAULT_DRAFT_LM
from angelspec.decoding.drafters.base import Drafter
from angelspec.decoding.drafters.block import BlockDrafterAdapter
from angelspec.decoding.drafters.draft_lm import DraftLMDrafter
from angelspec.decoding.drafters.mtp import MTPDrafter
from angelspec.decoding.engine import EngineConfig, Request, SpecEngine
from angelspec.decoding.policies.gate import SpecGate
from angelspec.models import Decoder, load_target
from angelspec.models.block.drafter import BlockDrafter
from angelspec.models.block.presets import dfly_embedded
from angelspec.models.mtp import MTPConfig, MTPDraftModel

sys.path.insert(0, str(Path(__file__).parent))
from ar_decode import DTYPES, make_prompts, resolve_target  # noqa: E402

GOAL = 0.25  # drafter propose / verify at batch 1
DRAFTERS = ("dfly", "dflash", "dspark", "mtp", "draft-lm")
EXTRA = ("dfly-plain",)  # only when asked for: DFly with its hidden-correction head unfactored (the A/B of it)


def build_drafter(kind: str, target: Decoder, dtype: torch.dtype, draft_lm: Path,
                  draft_vocab: int = 0, draft_layers: int = 2, block_k: int = 0, draft_intermediate: int = 0,
                  head_intermediate: int = 0) -> tuple[Drafter, int]:
    """A drafter of `kind` for `target` and the K it drafts per step (model drafters: `block_k`, default B−1,
    drafting from the first `draft_vocab` ids when > 0, as MTP does: latency depends on the size, not on which
    ids; draft-layer and head MLP widths from `draft_intermediate` / `head_intermediate` when > 0)."""
    gen = torch.Generator().manual_seed(0)
    if kind in ("dfly", "dfly-plain", "dflash", "dspark"):
        overrides = {"dfly": {}, "dfly-plain": {},
                     "dflash": {"conditioning": "dflash", "head": "none", "confidence_head": False},
                     "dspark": {"conditioning": "dflash", "head": "markov", "confidence_head": True}}[kind]
        widths = {"intermediate_size": draft_intermediate or target.config.intermediate_size,
                  "head_intermediate_size": head_intermediate or None}
        cfg = dfly_embedded(target.config, draft_vocab_size=draft_vocab, num_draft_layers=draft_layers, **widths,
                            **overrides)
        model = BlockDrafter(cfg, target.embed_tokens, target.lm_head)
        model.init_weights(generator=gen)
        adapter = BlockDrafterAdapter(model.to(dtype))
        adapter.proposer.factor_hidden_head = kind != "dfly-plain"
        assert adapter.kind == kind.removesuffix("-plain"), (adapter.kind, kind)
        return adapter, block_k or cfg.num_drafts
    if kind == "mtp":
        mcfg = replace(MTPConfig.for_target(target.config, num_depths=3), draft_vocab_size=draft_vocab)
        model = MTPDraftModel(mcfg, target.embed_tokens, target.lm_head)
        model.init_weights(generator=gen)
        return MTPDrafter(model.to(dtype)), 4
    if kind == "draft-lm":
        if not (draft_lm / "config.json").is_file():
            raise SystemExit(f"drafter_cost: no draft LM at {draft_lm} (pass --draft-lm DIR or drop draft-lm)")
        return DraftLMDrafter.from_pretrained(draft_lm, dtype=dtype), 4
    raise ValueError(f"unknown drafter {kind!r}")


@dataclass
class Cell:
    """Best-of-N per-step seconds of one (drafter, batch) pair."""

    k: int
    draft_s: float = float("inf")
    commit_s: float = float("inf")
    verify_s: float = float("inf")
    steps: list[int] = field(default_factory=list)
    mal: float = 0.0

    def ratio(self) -> float:
        return self.draft_s / self.verify_s


class CommitTimer:
    """Wraps a drafter's `on_commit` (instance attribute) and sums its wall time."""

    def __init__(self, drafter: Drafter) -> None:
        self.seconds = 0.0
        inner: Callable = drafter.on_commit

        @functools.wraps(inner)
        def timed(commit):  # noqa: ANN001, ANN202 - same signature as Drafter.on_commit
            t0 = time.perf_counter()
            inner(commit)
            self.seconds += time.perf_counter() - t0

        drafter.on_commit = timed  # type: ignore[method-assign]


class ScriptedGate(SpecGate):
    """Drafts on the steps `pattern` marks "D" and skips on "S" (cycled), whatever was measured."""

    def __init__(self, pattern: str) -> None:
        super().__init__()
        self.pattern, self.calls = pattern, 0

    def should_draft(self, num_active: int) -> bool:
        self.calls += 1
        return self.pattern[(self.calls - 1) % len(self.pattern)] == "D"


class DrafterClock:
    """Sums a drafter's `propose` + following `on_commit` wall time, split into drafted and skipped (0-draft) steps."""

    def __init__(self, drafter: Drafter) -> None:
        self.seconds = {"drafted": 0.0, "skipped": 0.0}
        self.steps = {"drafted": 0, "skipped": 0}
        self._kind = "drafted"
        propose, on_commit = drafter.propose, drafter.on_commit

        def timed_propose(state):  # noqa: ANN001, ANN202 - same signature as Drafter.propose
            self._kind = "drafted" if state.num_draft_tokens else "skipped"
            self.steps[self._kind] += 1
            t0 = time.perf_counter()
            out = propose(state)
            self.seconds[self._kind] += time.perf_counter() - t0
            return out

        def timed_commit(commit):  # noqa: ANN001, ANN202
            t0 = time.perf_counter()
            on_commit(commit)
            self.seconds[self._kind] += time.perf_counter() - t0

        drafter.propose, drafter.on_commit = timed_propose, timed_commit  # type: ignore[method-assign]

    def per_step(self, kind: str) -> float:
        return self.seconds[kind] / max(self.steps[kind], 1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", help="HF-layout target folder (default: the embedded target)")
    p.add_argument("--draft-lm", type=Path, default=DEFAULT_DRAFT_LM, help="draft-LM folder (default: shipped)")
    p.add_argument("--drafters", type=lambda s: s.split(","), default=list(DRAFTERS),
                   help=f"comma-separated subset of {','.join(DRAFTERS + EXTRA)} (default: all but "
                        f"{','.join(EXTRA)})")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--batch-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16])
    p.add_argument("--context", type=int, default=256, help="prompt tokens already in the caches")
    p.add_argument("--new-tokens", type=int, default=48, help="tokens generated per timed run")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads (default 1: on a shared 2-core machine a second thread makes "
                        "OpenMP barriers spin whenever the other core is busy)")
    p.add_argument("--json", type=Path, help="also write the numbers here")
    p.add_argument("--draft-vocab", type=int, default=0, metavar="N",
                   help="block and MTP drafters draft from N of the target's tokens (`angelspec draft-vocab`; "
                        "default 0: all; the shipped draft LM always uses its own)")
    p.add_argument("--draft-layers", type=int, default=2, metavar="L",
                   help="block drafters' backbone depth (default 2, the dfly_embedded preset)")
    p.add_argument("--draft-intermediate", type=int, default=0, metavar="N",
                   help="block drafters' draft-layer MLP width (default 0: the target's, 768 on the embedded one)")
    p.add_argument("--head-intermediate", type=int, default=0, metavar="N",
                   help="DFly's hidden-correction SwiGLU width (default 0: the hidden size)")
    p.add_argument("--block-k", type=int, default=0, metavar="K",
                   help="block drafters draft K <= B-1 per step (the head runs over those K positions only; default "
                        "0: the whole block, K = B-1 = 7). MTP and the draft LM always draft 4, as in `make demo`")
    p.add_argument("--compile", action="store_true",
                   help="EngineConfig(compile=True): the verify forward and each drafter's hot calls compiled "
                        "(the untimed warm-up run pays the compilation)")
    p.add_argument("--skip-pattern", default="", metavar="DS..",
                   help="also run each drafter under a scripted speculation gate (D: draft, S: skip, cycled, e.g. "
                        "DSSS) and report its cost per skipped and per drafted step")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.skip_pattern and (set(args.skip_pattern) - {"D", "S"} or "D" not in args.skip_pattern):
        p.error(f"--skip-pattern takes D (draft) and S (skip) with at least one D, got {args.skip_pattern!r}")
    bad = sorted(set(args.drafters) - set(DRAFTERS + EXTRA))
    if bad:
        p.error(f"unknown drafters {bad}; choose from {', '.join(DRAFTERS + EXTRA)}")

    dtype = DTYPES[args.dtype]
    with tempfile.TemporaryDirectory() as tmp:
        target_dir, desc = resolve_target(args.target, Path(tmp))
        target = load_target(target_dir, dtype=dtype)
    cfg = target.config
    avoid = set(cfg.eos_token_ids)
    drafters = {kind: build_drafter(kind, target, dtype, args.draft_lm, args.draft_vocab, args.draft_layers,
                                    args.block_k, args.draft_intermediate, args.head_intermediate)
                for kind in args.drafters}
    timers = {kind: CommitTimer(d) for kind, (d, _) in drafters.items()}
    engines = {(kind, b): SpecEngine(target, d, EngineConfig(max_batch_size=b, num_draft_tokens=k, seed=0,
                                                             compile=args.compile))
               for kind, (d, k) in drafters.items() for b in args.batch_sizes}
    prompts = {b: make_prompts(b, args.context, cfg.vocab_size, avoid, seed=4321) for b in args.batch_sizes}
    cells = {key: Cell(k=drafters[key[0]][1]) for key in engines}
    gated: dict[tuple[str, int], tuple[SpecEngine, DrafterClock]] = {}
    if args.skip_pattern:  # a second drafter of each kind (same weights: build_drafter is seeded) behind a gate
        for kind in args.drafters:
            d, k = build_drafter(kind, target, dtype, args.draft_lm, args.draft_vocab, args.draft_layers, args.block_k,
                                 args.draft_intermediate, args.head_intermediate)
            clock = DrafterClock(d)
            for b in args.batch_sizes:
                engine = SpecEngine(target, d, EngineConfig(max_batch_size=b, num_draft_tokens=k, seed=0,
                                                            compile=args.compile, spec_gate=True))
                engine.gate = ScriptedGate(args.skip_pattern)
                gated[(kind, b)] = (engine, clock)
    skip_best: dict[tuple[str, int], list[float]] = {key: [float("inf")] * 2 for key in gated}

    def run_gated(key: tuple[str, int]) -> None:
        engine, clock = gated[key]
        clock.seconds = dict.fromkeys(clock.seconds, 0.0)
        clock.steps = dict.fromkeys(clock.steps, 0)
        engine.gate.calls = 0  # type: ignore[union-attr]
        engine.generate([Request(pr, max_new_tokens=args.new_tokens, stop_ids=()) for pr in prompts[key[1]]])
        best = skip_best[key]
        best[0] = min(best[0], clock.per_step("skipped"))
        best[1] = min(best[1], clock.per_step("drafted"))

    def run(key: tuple[str, int]) -> None:
        kind, b = key
        engine, timer, cell = engines[key], timers[kind], cells[key]
        timer.seconds = 0.0
        engine.generate([Request(pr, max_new_tokens=args.new_tokens, stop_ids=()) for pr in prompts[b]])
        m = engine.metrics
        cell.draft_s = min(cell.draft_s, m.seconds["draft"] / m.steps)
        cell.verify_s = min(cell.verify_s, m.seconds["verify"] / m.steps)
        cell.commit_s = min(cell.commit_s, timer.seconds / m.steps)
        cell.steps.append(m.steps)
        cell.mal = m.accepted_plus_one / m.row_steps

    t_start = time.perf_counter()
    for key in engines:  # warm-up outside the timed runs
        run(key)
    for key in gated:
        run_gated(key)
    for cell in cells.values():
        cell.draft_s = cell.commit_s = cell.verify_s = float("inf")
        cell.steps.clear()
    for best in skip_best.values():
        best[:] = [float("inf")] * 2
    for r in range(args.repeats):
        for key in engines:  # interleaved: drafters and batch sizes share the machine's state evenly
            run(key)
            if key in gated:
                run_gated(key)
        print(f"  repeat {r + 1}/{args.repeats} done ({time.perf_counter() - t_start:.0f} s)", file=sys.stderr,
              flush=True)

    print(f"\nDrafter step vs target verify step: target = {desc}, {args.dtype}; context {args.context} tokens "
          f"(+ up to {args.new_tokens} generated), greedy, per-step means of a generation, best of {args.repeats}, "
          f"{args.threads} thread(s), torch {torch.__version__}{', compiled' if args.compile else ', eager'}"
          + (f", block and MTP drafters' draft vocabulary {args.draft_vocab}" if args.draft_vocab else "")
          + f", block drafters L{args.draft_layers}" + (f" K={args.block_k}" if args.block_k else "")
          + (f" MLP {args.draft_intermediate}" if args.draft_intermediate else "")
          + (f", DFly head SwiGLU {args.head_intermediate}" if args.head_intermediate else ""))
    head = (f"{'drafter':9} {'batch':>5} {'K':>2} {'draft ms':>9} {'ms/draft':>9} {'commit ms':>10} "
            f"{'verify ms':>10} {'draft/verify':>13} {'(draft+commit)/verify':>22} {'MAL':>5}")
    print(head)
    print("-" * len(head))
    for (kind, b), c in cells.items():
        print(f"{kind:9} {b:>5} {c.k:>2} {c.draft_s * 1e3:>9.2f} {c.draft_s * 1e3 / c.k:>9.3f} "
              f"{c.commit_s * 1e3:>10.2f} {c.verify_s * 1e3:>10.2f} {c.ratio():>12.1%} "
              f"{(c.draft_s + c.commit_s) / c.verify_s:>21.1%} {c.mal:>5.2f}")
    if gated:
        print(f"\nunder a scripted speculation gate ({args.skip_pattern}, cycled): the drafter's propose + on_commit "
              "per step, over the verify step above")
        head2 = (f"{'drafter':9} {'batch':>5} {'skipped ms':>11} {'skipped/verify':>15} {'drafted ms':>11} "
                 f"{'drafted/verify':>15}")
        print(head2)
        print("-" * len(head2))
        for key, (skipped, drafted) in skip_best.items():
            v = cells[key].verify_s
            print(f"{key[0]:9} {key[1]:>5} {skipped * 1e3:>11.3f} {skipped / v:>14.1%} {drafted * 1e3:>11.3f} "
                  f"{drafted / v:>14.1%}")
    print(f"\ngoal: one propose <= {GOAL:.0%} of one verify step at batch 1")
    for kind in args.drafters:
        c = cells.get((kind, 1))
        if c is None:
            print(f"  {kind:9} batch 1 not measured")
            continue
        verdict = "MET" if c.ratio() <= GOAL else "NOT met"
        print(f"  {kind:9} {verdict:7} propose/verify = {c.ratio():.1%} "
              f"(with on_commit: {(c.draft_s + c.commit_s) / c.verify_s:.1%})")
    if args.json:
        args.json.write_text(json.dumps({
            "target": desc, "args": {k: str(v) for k, v in vars(args).items()},
            "rows": [{"drafter": kind, "batch": b, "k": c.k, "draft_ms": c.draft_s * 1e3,
                      "commit_ms": c.commit_s * 1e3, "verify_ms": c.verify_s * 1e3, "ratio": c.ratio(),
                      "mal": c.mal, "steps": c.steps} for (kind, b), c in cells.items()],
            "gated": [{"drafter": kind, "batch": b, "pattern": args.skip_pattern, "skipped_ms": sk * 1e3,
                       "drafted_ms": dr * 1e3} for (kind, b), (sk, dr) in skip_best.items()]}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
