"""Where a batched decode step's time goes, on the serving benchmark's workload (`angelspec bench`: the held-out
prompts interleaved by domain, N = 2C greedy requests of --new-tokens each, stop tokens ignored, C engine rows).

Per configuration (AR or n-gram prompt lookup, eager or `EngineConfig(compile=True)`) and concurrency C it prints
tokens per CPU second of `SpecEngine.generate`, CPU ms per decode step split into the engine's phases (prefill
amortised over the steps; the phases' shares of the run's wall time, scaled to the measured CPU time) and into op
classes from torch.profiler (shares of the profiled time, scaled the same way):

    gemm       mm / addmm: the projections, MLPs and LM head (decode and prefill)
    attention  scaled_dot_product_attention over the KV cache
    fused      the compiled graph's own kernels (norms, RoPE, cache writes, packing), or nothing when eager
    argmax     the greedy token choice over the vocabulary
    dynamo     per compiled call: Dynamo's guard check that the graph still applies, and its wrappers
    other      eager element-wise ops, indexing, allocation, host-side Python

CPU time (`time.process_time`, one compute thread) rather than wall time: on a shared machine the wall clock mostly
measures waiting for a core. Each point is the best of --repeats runs after an untimed warm-up. With --vllm DIR,
vLLM (its venv, as `angelspec bench --vllm`) serves the same requests at every AR and n-gram point of the same run,
and its tokens per CPU second of its timed generate (its whole process) are printed beside ours.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/batch_step.py                  # AR and n-gram, eager and compiled
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/batch_step.py --configs ngram+compile --concurrency 12,16
    OMP_NUM_THREADS=1 NUMBA_NUM_THREADS=1 .venv/bin/python benchmarks/batch_step.py --vllm .venv-vllm
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from angelspec.assets import resolve_target_dir
from angelspec.decoding.engine import EngineConfig, Request, SpecEngine
from angelspec.decoding.loading import load_target_and_tokenizer, resolve_drafter
from angelspec.eval.serving.sweep import serving_workload
from angelspec.eval.serving.vllm import SubprocessRunner, VllmSetup, find_vllm_python

CLASSES = {"gemm": ("aten::mm", "aten::addmm", "aten::bmm"),
           "attention": ("aten::_scaled_dot_product_flash_attention_for_cpu",
                         "aten::_scaled_dot_product_attention_math"),
           "fused": ("## Call CompiledFxGraph",), "argmax": ("aten::max", "aten::argmax"),
           "dynamo": ("TorchDynamo Cache Lookup", "Torch-Compiled Region", "Pregraph bytecode", "AOTDispatcher")}


def op_class(name: str) -> str:
    return next((c for c, prefixes in CLASSES.items() if name.startswith(prefixes)), "other")


def requests_for(workload, n: int, new: int) -> list[Request]:
    return [Request(prompt_ids=workload[i % len(workload)].ids, max_new_tokens=new, stop_ids=(), request_id=i)
            for i in range(n)]


def measure(engine: SpecEngine, requests: list[Request], repeats: int) -> tuple[float, dict[str, float], dict]:
    """-> (CPU seconds of the best run, its phase seconds, op-class shares of one profiled run)."""
    best = None
    for _ in range(repeats):
        t0 = time.process_time()
        engine.generate(requests)
        cpu = time.process_time() - t0
        if best is None or cpu < best[0]:
            best = (cpu, dict(engine.metrics.seconds), engine.metrics.steps, engine.metrics.output_tokens)
    with torch.profiler.profile() as prof:
        engine.generate(requests)
    shares: dict[str, float] = {}
    for e in prof.key_averages():
        shares[op_class(e.key)] = shares.get(op_class(e.key), 0.0) + e.self_cpu_time_total
    total = sum(shares.values()) or 1.0
    return best[0], best[1], {"steps": best[2], "tokens": best[3], **{k: v / total for k, v in shares.items()}}


def vllm_tokens_per_cpu_s(runner: SubprocessRunner, target_dir: Path, drafter_spec: str, args: argparse.Namespace,
                          concurrency: int, requests: list[Request]) -> float:
    """vLLM's tokens per CPU second on the same requests (AR, or n-gram with our K and n-gram sizes 1..3)."""
    setup = VllmSetup("ar") if drafter_spec == "none" else VllmSetup("ngram", args.num_draft_tokens, 3, 1)
    result = runner({"target": str(target_dir), "speculative_config": setup.speculative_config(),
                     "concurrency": concurrency, "prompts": [list(r.prompt_ids) for r in requests],
                     "max_new_tokens": args.new_tokens, "warmup_tokens": 8})
    return result["output_tokens"] / result["cpu_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", help="HF checkpoint folder (default: the embedded target)")
    ap.add_argument("--configs", default="none,none+compile,ngram,ngram+compile",
                    help="comma-separated: a --drafter spec (none = AR), +compile for EngineConfig(compile=True)")
    ap.add_argument("--concurrency", default="12,16")
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--num-draft-tokens", type=int, default=4)
    ap.add_argument("--limit", type=int, default=4, help="prompts per domain (as angelspec bench --limit)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--vllm", metavar="DIR", help="also run vLLM from this venv on the same requests")
    args = ap.parse_args()
    torch.set_num_threads(1)
    log = Path(tempfile.mkdtemp(prefix="batch-step-")) / "vllm.log"
    runner = SubprocessRunner(find_vllm_python(args.vllm), log) if args.vllm else None
    target_dir = resolve_target_dir(args.target)
    model, tokenizer = load_target_and_tokenizer(target_dir)
    workload = serving_workload(tokenizer, model.config.max_position_embeddings, args.new_tokens, limit=args.limit)
    print(f"{len(workload)} prompts, {args.new_tokens} new tokens, N = 2C requests; CPU ms per decode step")
    print(f"{'config':>14} {'C':>3} {'tok/CPU-s':>9} {'ms/step':>7} {'prefill':>7} {'draft':>6} {'verify':>6} "
          f"{'commit':>6} | " + " ".join(f"{c:>9}" for c in (*CLASSES, "other"))
          + (f" | {'vLLM tok/CPU-s':>14} {'ours/vLLM':>9}" if runner else ""))
    for spec in args.configs.split(","):
        drafter_spec, compiled = spec.removesuffix("+compile"), spec.endswith("+compile")
        for c in map(int, args.concurrency.split(",")):
            requests = requests_for(workload, 2 * c, args.new_tokens)
            max_len = max(len(r.prompt_ids) for r in requests) + args.new_tokens
            engine = SpecEngine(model, resolve_drafter(drafter_spec, model, target_dir),
                                EngineConfig(max_batch_size=c, max_seq_len=max_len, compile=compiled,
                                             num_draft_tokens=args.num_draft_tokens))
            engine.generate(requests_for(workload, c, 8))  # warm-up (and compilation)
            cpu, seconds, split = measure(engine, requests, args.repeats)
            per_step = 1e3 * cpu / split["steps"]
            phase = {k: per_step * v / (sum(seconds.values()) or 1.0) for k, v in seconds.items()}
            ours = split["tokens"] / cpu
            line = (f"{spec:>14} {c:>3} {ours:>9.0f} {per_step:>7.2f} {phase['prefill']:>7.2f} "
                    f"{phase['draft'] + phase['select']:>6.2f} {phase['verify']:>6.2f} {phase['commit']:>6.2f} | "
                    + " ".join(f"{per_step * split.get(k, 0.0):>9.2f}" for k in (*CLASSES, "other")))
            if runner is not None and drafter_spec in ("none", "ngram"):
                theirs = vllm_tokens_per_cpu_s(runner, target_dir, drafter_spec, args, c, requests)
                line += f" | {theirs:>14.0f} {ours / theirs:>8.2f}x"
            print(line, flush=True)


if __name__ == "__main__":
    main()
