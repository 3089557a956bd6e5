"""Plain autoregressive decoding speed: AngelSpec's engine vs HF transformers `generate` (and vLLM when it
is importable), same checkpoint folder, same dtype, same prompts, greedy, a fixed number of new tokens with
EOS disabled for everyone. One run prints one table:

    batch 1:      ms per generated token (prefill amortised in; lower is better)
    batch 8, 32:  generated tokens per second (higher is better)

Ours is measured eager and with `EngineConfig(compile=True)` (torch.compile of the decode step; its
compile time is printed). Timings interleave the contenders and keep the best of `--repeats` runs, which is
the most stable statistic on a shared machine. The goal: our batch-1 latency <= 0.5x HF's.

    .venv/bin/python benchmarks/ar_decode.py                       # default target, bf16 and fp32
    .venv/bin/python benchmarks/ar_decode.py --dtype bf16 --new-tokens 64 --repeats 2 --no-compile
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from angelspec.assets import DEFAULT_TARGET
from angelspec.decoding.engine import EngineConfig, Request, SpecEngine
from angelspec.models import Decoder, DecoderConfig, load_target, save_target

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def embedded_preset() -> DecoderConfig:
    """The shape of the embedded target (Qwen3, ~6.8M parameters), used when no trained target ships."""
    return DecoderConfig(vocab_size=8192, hidden_size=256, intermediate_size=768, num_hidden_layers=6,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=1024,
                         model_type="qwen3", tie_word_embeddings=True, eos_token_id=[1, 2], pad_token_id=0)


def resolve_target(arg: str | None, workdir: Path) -> tuple[Path, str]:
    if arg is not None:
        return Path(arg), f"{arg}"
    if (DEFAULT_TARGET / "config.json").is_file():
        return DEFAULT_TARGET, f"embedded target ({DEFAULT_TARGET})"
    torch.manual_seed(0)
    model = Decoder(embedded_preset())
    model.init_weights()
    save_target(model, workdir)
    return workdir, "random weights, embedded-target shape (no trained target in assets/target yet)"


@dataclass
class Timing:
    best_s: float = float("inf")

    def add(self, seconds: float) -> None:
        self.best_s = min(self.best_s, seconds)


def make_prompts(batch: int, prompt_len: int, vocab: int, avoid: set[int], seed: int = 1234) -> list[list[int]]:
    """`batch` random prompts of ids in [3, vocab), none of them in `avoid` (EOS), seeded by seed + batch."""
    g = torch.Generator().manual_seed(seed + batch)
    ids = torch.randint(3, vocab, (batch, prompt_len), generator=g).tolist()
    return [[t if t not in avoid else 3 for t in row] for row in ids]


def run_ours(engine: SpecEngine, prompts: list[list[int]], new: int) -> list[list[int]]:
    out = engine.generate([Request(p, max_new_tokens=new, stop_ids=()) for p in prompts])
    return [r.token_ids for r in out]


def run_hf(model, prompts: list[list[int]], new: int) -> list[list[int]]:
    ids = torch.tensor(prompts)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                         do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[:, ids.shape[1]:].tolist()


def vllm_runner(target_dir: Path, dtype: str):
    """A callable running vLLM greedy generation, or None when vLLM is not importable (optional extra)."""
    if importlib.util.find_spec("vllm") is None:
        return None
    import vllm  # noqa: PLC0415 - optional dependency

    llm = vllm.LLM(model=str(target_dir), dtype="bfloat16" if dtype == "bf16" else "float32",
                   skip_tokenizer_init=True, enforce_eager=False)

    def run(prompts: list[list[int]], new: int) -> list[list[int]]:
        params = vllm.SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    return run


def bench_dtype(args: argparse.Namespace, target_dir: Path, dtype_name: str) -> list[dict]:
    import transformers

    dtype = DTYPES[dtype_name]
    ours_model = load_target(target_dir, dtype=dtype)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(target_dir, dtype=dtype).eval()
    cfg = ours_model.config
    avoid = set(cfg.eos_token_ids)
    vllm_run = vllm_runner(target_dir, dtype_name)
    rows = []
    for batch in args.batch_sizes:
        prompts = make_prompts(batch, args.prompt_len, cfg.vocab_size, avoid)
        contenders = {"ours": SpecEngine(ours_model, config=EngineConfig(max_batch_size=batch))}
        if args.compile:
            contenders["ours+compile"] = SpecEngine(ours_model, config=EngineConfig(max_batch_size=batch, compile=True))
        runners = {name: partial(run_ours, e, prompts, args.new_tokens) for name, e in contenders.items()}
        runners["hf"] = partial(run_hf, hf_model, prompts, args.new_tokens)
        if vllm_run is not None:
            runners["vllm"] = partial(vllm_run, prompts, args.new_tokens)
        tokens, warm = {}, {}
        with torch.inference_mode():
            for name, fn in runners.items():  # warm-up (and compilation) outside the timed runs
                t0 = time.perf_counter()
                tokens[name] = fn()
                warm[name] = time.perf_counter() - t0
            timings = {name: Timing() for name in runners}
            for _ in range(args.repeats):
                for name, fn in runners.items():
                    t0 = time.perf_counter()
                    fn()
                    timings[name].add(time.perf_counter() - t0)
        n_tok = batch * args.new_tokens
        same = sum(a == b for a, b in zip(tokens["ours"], tokens["hf"], strict=True))
        row = {"dtype": dtype_name, "batch": batch, "new_tokens": args.new_tokens,
               "seconds": {k: t.best_s for k, t in timings.items()},
               "ms_per_token": {k: t.best_s / args.new_tokens * 1e3 for k, t in timings.items()},
               "tokens_per_s": {k: n_tok / t.best_s for k, t in timings.items()},
               "warmup_s": warm, "rows_equal_to_hf": f"{same}/{batch}"}
        if "ours+compile" in tokens:
            row["compiled_rows_equal_to_eager"] = \
                f"{sum(a == b for a, b in zip(tokens['ours'], tokens['ours+compile'], strict=True))}/{batch}"
        rows.append(row)
        print(f"  done {dtype_name} batch {batch}: " + ", ".join(
            f"{k} {row['ms_per_token'][k]:.2f} ms/step" for k in runners), file=sys.stderr, flush=True)
    return rows


def print_table(rows: list[dict], names: list[str]) -> None:
    head = f"{'dtype':5} {'batch':>5} {'metric':11}" + "".join(f"{n:>14}" for n in names) + \
        f"{'best ours/HF':>14}  same tokens as HF"
    print(head)
    print("-" * len(head))
    for r in rows:
        ours_best = min(v for k, v in r["seconds"].items() if k.startswith("ours"))
        ratio = ours_best / r["seconds"]["hf"]
        if r["batch"] == 1:
            metric, vals = "ms/token", r["ms_per_token"]
            ratio_s = f"{ratio:.2f}x time"
        else:
            metric, vals = "tokens/s", r["tokens_per_s"]
            ratio_s = f"{1 / ratio:.2f}x speed"
        cells = "".join(f"{vals[n]:>14.2f}" if n in vals else f"{'n/a':>14}" for n in names)
        print(f"{r['dtype']:5} {r['batch']:>5} {metric:11}{cells}{ratio_s:>14}  {r['rows_equal_to_hf']}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", help="HF-layout target folder (default: the embedded target, else a random model "
                                    "of its shape)")
    p.add_argument("--dtype", choices=["bf16", "fp32", "both"], default="both")
    p.add_argument("--batch-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32])
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads for everyone (default 1: on a shared 2-core machine a second "
                        "thread makes OpenMP barriers spin whenever the other core is busy)")
    p.add_argument("--no-compile", dest="compile", action="store_false", help="skip the torch.compile column")
    p.add_argument("--json", type=Path, help="also write the numbers here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        target_dir, desc = resolve_target(args.target, Path(tmp))
        dtypes = ["bf16", "fp32"] if args.dtype == "both" else [args.dtype]
        rows = []
        for d in dtypes:
            rows += bench_dtype(args, target_dir, d)
    names = ["ours"] + (["ours+compile"] if args.compile else []) + ["hf"] + \
        (["vllm"] if any("vllm" in r["seconds"] for r in rows) else [])
    print(f"\nAR decoding, greedy, EOS disabled: target = {desc}; prompt {args.prompt_len} tokens, "
          f"{args.new_tokens} new tokens, best of {args.repeats}, {args.threads} thread(s), torch {torch.__version__}")
    if importlib.util.find_spec("vllm") is None:
        print("(vLLM not importable: no vllm column)")
    print_table(rows, names)
    if args.compile:
        compile_s = {f"{r['dtype']}/b{r['batch']}": round(r["warmup_s"]["ours+compile"], 1) for r in rows}
        equal = {f"{r['dtype']}/b{r['batch']}": r["compiled_rows_equal_to_eager"] for r in rows}
        print(f"first call incl. torch.compile, s: {compile_s}; compiled == eager rows: {equal}")
    if args.json:
        args.json.write_text(json.dumps({"target": desc, "args": {k: str(v) for k, v in vars(args).items()},
                                         "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
