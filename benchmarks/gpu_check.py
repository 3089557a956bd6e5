"""The GPU check: on one GPU in a few minutes, everything a user with a GPU runs first, in one table.

  decode    the embedded target AR and with every shipped drafter (`assets/drafters`), fp32 and bf16, eager and
            compiled (`EvalSettings.compile`), on the shipped held-out prompts at T = 0: tokens/s, speed-up over AR
            and the lossless count (outputs identical to AR); and the AR step compiled with CUDA graphs
            (`EngineConfig.cuda_graphs`, static shapes under FlexAttention) against the eager engine
  train     one training step (forward, backward, AdamW) of each drafter family (MTP, EAGLE-3, DFlash, DFly,
            DSpark) on a 3-layer target of Qwen3-8B's layer shape (hidden 4096, 32 / 8 heads x 128, MLP 12288,
            V = 152k), the trainers' own pieces: `TargetFeatures` (teacher as states + head), the TTT rollout or the
            block backbone, the chunked head + loss, their default objective; the target in bf16 with the drafter
            under bf16 autocast on a GPU: seconds, peak memory, loss finite
  prefill   a long prompt (32k tokens) through that target with a KV cache: seconds and peak memory
  pytest    the `gpu`-marked tests (gradient equality of the attention paths where they exist), `pytest -m gpu`

On a CPU: `--device cpu --quick` runs every row at tiny shapes (two prompts, 4 new tokens, a 4k-vocabulary 64-wide
target, a 256-token prefill, no compile, no pytest), so the script itself is tested here (tests/test_gpu_check.py).

Device and dtype go through the library calls that exist: the target is loaded and moved with `Module.to`, the
drafters' own modules after it. Peak memory is `torch.cuda.max_memory_allocated` on CUDA, "-" elsewhere (the host
allocator has no peak counter; benchmarks/teacher_memory.py measures the host path).

Run:  .venv/bin/python benchmarks/gpu_check.py                      (CUDA when visible)
      .venv/bin/python benchmarks/gpu_check.py --device cpu --quick
"""

from __future__ import annotations

import argparse
import math
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from angelspec.assets import DEFAULT_DRAFTERS, DEFAULT_TARGET, EVAL_PROMPTS
from angelspec.data.packing import Doc, pack_documents
from angelspec.data.prompts import load_prompts
from angelspec.decoding.loading import load_target_and_tokenizer, resolve_drafter
from angelspec.decoding.sampling import SamplingParams
from angelspec.eval.prompts import eval_prompts
from angelspec.eval.speculative import EvalSettings, evaluate, run_decoding
from angelspec.models import Decoder, DecoderConfig
from angelspec.models.block.drafter import BlockDrafter
from angelspec.models.decoder import CacheInputs
from angelspec.models.eagle3 import Eagle3Config, Eagle3DraftModel
from angelspec.models.mtp import MTPConfig, MTPDraftModel, concat_taps
from angelspec.train.block import (
    block_chunked_loss_batch,
    block_forward_train,
    dflash_embedded,
    dfly_embedded,
    dspark_embedded,
    row_anchors,
)
from angelspec.train.confidence import confidence_targets
from angelspec.train.features import TargetFeatures
from angelspec.train.losses import LOSSES, LossBatch, LossConfig, with_confidence_term
from angelspec.train.ttt import RolloutMemory, mtp_chunked_loss_batch, ttt_rollout

MiB = 2**20
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass
class Row:
    check: str
    setting: str
    result: str
    seconds: float
    peak_mib: float | None = None
    ok: bool = True


class Meter:
    """Seconds and peak device memory of a block of work (peak only on CUDA)."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.seconds, self.peak = device, 0.0, None

    def __enter__(self) -> Meter:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device) / MiB
        self.seconds = time.perf_counter() - self.t0


def shipped_drafters(names: list[str] | None = None) -> list[Path]:
    found = sorted(p for p in DEFAULT_DRAFTERS.iterdir() if (p / "config.json").is_file())
    return found if names is None else [p for p in found if p.name in names]


def place_drafter(drafter: Any, device: torch.device) -> None:
    """The drafter's own modules on `device` (the target's embedding and head, which it shares, are there already)."""
    for value in vars(drafter).values():
        if isinstance(value, torch.nn.Module):
            value.to(device)


def decode_rows(device: torch.device, dtypes: list[str], compiled: list[bool], per_domain: int, max_new: int,
                batch: int, max_prompts: int | None = None, drafters: list[str] | None = None) -> list[Row]:
    rows: list[Row] = []
    for dname in dtypes:
        target, tok = load_target_and_tokenizer(Path(DEFAULT_TARGET))
        target = target.to(device=device, dtype=DTYPES[dname]).eval()
        prompts = eval_prompts(tok, load_prompts(EVAL_PROMPTS), context=target.config.max_position_embeddings,
                               source=str(EVAL_PROMPTS), limit=per_domain)[:max_prompts]
        for comp in compiled:
            settings = EvalSettings(max_new_tokens=max_new, batch_size=batch, sampling=SamplingParams(temperature=0.0),
                                    warmup_tokens=0 if max_prompts else 8, compile=comp)
            setting = f"{dname} {'compiled' if comp else 'eager'}"
            with Meter(device) as m:
                ar = run_decoding(target, prompts, settings, progress=False)
            tps = ar.overall.tokens_per_s
            rows.append(Row("decode AR", setting, f"{tps:.0f} tok/s, {len(prompts)} prompts", m.seconds, m.peak))
            for path in shipped_drafters(drafters):
                try:
                    with Meter(device) as m:
                        drafter = resolve_drafter(str(path), target, Path(DEFAULT_TARGET), DTYPES[dname])
                        place_drafter(drafter, device)
                        rep = evaluate(target, drafter, prompts, settings, name=path.name, baseline=ar,
                                       progress=False)
                    n, same = rep.overall.prompts, rep.overall.identical or 0
                    rows.append(Row(f"decode {path.name}", setting,
                                    f"{rep.overall.speedup:.2f}x AR, lossless {same}/{n}", m.seconds, m.peak,
                                    ok=bool(rep.lossless)))
                except Exception as e:  # one row per failure, the table still comes out
                    rows.append(Row(f"decode {path.name}", setting, f"FAILED: {type(e).__name__}: {e}"[:90], 0.0,
                                    ok=False))
    return rows


def train_target(quick: bool, T: int, layers: int, device: torch.device, dtype: torch.dtype) -> Decoder:
    if quick:
        cfg = DecoderConfig(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=T,
                            model_type="qwen3", qk_norm=True, tie_word_embeddings=False)
    else:
        cfg = DecoderConfig(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=layers,
                            num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=T,
                            model_type="qwen3", qk_norm=True, tie_word_embeddings=False)
    with torch.device(device):
        target = Decoder(cfg)
    target.init_weights(std=0.02, generator=torch.Generator(device=device).manual_seed(0))
    return target.to(dtype).requires_grad_(False).eval()


def _packed(vocab: int, B: int, T: int, device: torch.device):
    g = torch.Generator().manual_seed(3)
    sizes = [T // 2, T // 4, T - T // 2 - T // 4]
    docs = [Doc(torch.randint(6, vocab, (n,), generator=g), torch.ones(n, dtype=torch.long)) for n in sizes] * B
    return pack_documents(docs, T, pad_id=0).to(device)


def train_rows(device: torch.device, quick: bool, B: int, T: int, dtype: torch.dtype) -> list[Row]:
    """One step of each family on the 3-layer target (taps 0, 1, 2; MTP reads the last)."""
    target = train_target(quick, T, 3, device, dtype)
    tcfg = target.config
    packed = _packed(tcfg.vocab_size, B, T, device)
    rows = list(range(packed.num_rows))
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if dtype == torch.bfloat16 else nullcontext()
    out: list[Row] = []

    def run(name: str, model: torch.nn.Module, loss_fn: Callable[[], torch.Tensor]) -> None:
        model.to(device)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
        try:
            with Meter(device) as m:
                with autocast:
                    loss = loss_fn()
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                value = float(loss.detach())
            out.append(Row(f"train {name}", f"{B}x{T} V={tcfg.vocab_size} {str(dtype).removeprefix('torch.')}",
                           f"loss {value:.4f}", m.seconds, m.peak, ok=math.isfinite(value)))
        except Exception as e:
            out.append(Row(f"train {name}", f"{B}x{T}", f"FAILED: {type(e).__name__}: {e}"[:90], 0.0, ok=False))

    D = 3
    for kind in ("mtp", "eagle3"):
        if kind == "mtp":
            mtp: MTPDraftModel = MTPDraftModel(MTPConfig.for_target(tcfg, num_depths=D), target.embed_tokens,
                                               target.lm_head)
        else:
            mtp = Eagle3DraftModel(Eagle3Config.for_target(tcfg, num_depths=D, target_layer_ids=(0, 1, 2)),
                                   target.embed_tokens, target.lm_head)
        mtp.init_weights(std=0.02, generator=torch.Generator().manual_seed(1))
        features = TargetFeatures(target, list(mtp.config.target_layer_ids))

        def mtp_loss(mtp: MTPDraftModel = mtp, features: TargetFeatures = features) -> torch.Tensor:
            taps, teacher = features(packed, rows)
            o = ttt_rollout(mtp, concat_taps(taps), packed.input_ids, packed.positions, packed.document_ids, D,
                            memory=RolloutMemory(keep_logits=False, checkpoint_depths=True))
            return LOSSES["e2e_tv"](mtp_chunked_loss_batch(mtp, o, packed, teacher), LossConfig()).loss

        run(kind, mtp, mtp_loss)
        del mtp, features
    for preset, objective in ((dflash_embedded, "dpace_lk"), (dfly_embedded, "dpace_lk"), (dspark_embedded, "dspark")):
        cfg = replace(preset(), target_layer_ids=(0, 1, 2), num_anchors=min(16, T // 8))
        mcfg = cfg.model_config(tcfg, 5)
        block = BlockDrafter(mcfg, target.embed_tokens, target.lm_head)
        block.init_weights(std=0.02, generator=torch.Generator().manual_seed(1))
        features = TargetFeatures(target, list(mcfg.target_layer_ids))
        obj = LOSSES[objective]
        if mcfg.confidence_head and objective != "dspark":
            obj = with_confidence_term(obj, 1.0)

        def block_loss(block: BlockDrafter = block, features: TargetFeatures = features, obj=obj,
                       n: int = cfg.num_anchors) -> torch.Tensor:
            taps, teacher = features(packed, rows)
            anchors, valid = row_anchors(packed, n, 0, 0, rows)
            o = block_forward_train(block, concat_taps(taps), packed, anchors.to(device), valid.to(device),
                                    checkpoint_layers=True)
            def targets(lb: LossBatch, block: BlockDrafter = block) -> torch.Tensor:  # as the trainer's chunk_targets
                return confidence_targets(block.config, lb.student_logits.detach(), lb.teacher_logits, lb.mask, None,
                                          block.draft_vocab if block.config.draft_vocab_size else None,
                                          draft_columns=lb.draft_vocab is not None)

            return obj(block_chunked_loss_batch(block, o, teacher, confidence_targets=targets), LossConfig()).loss

        run(mcfg.drafter, block, block_loss)
        del block, features
    return out


def prefill_row(device: torch.device, quick: bool, T: int, dtype: torch.dtype) -> Row:
    target = train_target(quick, T, 2, device, dtype)
    ids = torch.randint(6, target.config.vocab_size, (1, T), generator=torch.Generator().manual_seed(4)).to(device)
    try:
        with torch.no_grad(), Meter(device) as m:
            cache = target.new_cache(1, T + 1)
            last = torch.tensor([[T - 1]], device=device)
            logits = target.forward_cached(ids, CacheInputs(cache, logits_index=last)).logits
            ok = bool(torch.isfinite(logits).all())
        return Row("prefill", f"1x{T} V={target.config.vocab_size} {str(dtype).removeprefix('torch.')}",
                   f"{T / m.seconds:.0f} tok/s", m.seconds, m.peak, ok=ok)
    except Exception as e:
        return Row("prefill", f"1x{T}", f"FAILED: {type(e).__name__}: {e}"[:90], 0.0, ok=False)


def graphs_row(device: torch.device, compile: bool, max_new: int, dtype: torch.dtype) -> Row:
    """The AR decode step compiled with CUDA graphs (`EngineConfig.cuda_graphs`: static shapes under flex
    attention) against the eager engine: greedy outputs equal, tokens/s side by side. Without compile (quick) it
    runs the switch's eager path, which must be the eager engine."""
    from angelspec.decoding.engine import EngineConfig, Request, SpecEngine

    target, tok = load_target_and_tokenizer(Path(DEFAULT_TARGET))
    target = target.to(device=device, dtype=dtype).eval()
    prompts = eval_prompts(tok, load_prompts(EVAL_PROMPTS), context=target.config.max_position_embeddings,
                           source=str(EVAL_PROMPTS), limit=1)[:4]
    greedy = SamplingParams(temperature=0.0)

    def run(config: EngineConfig) -> tuple[list[list[int]], float]:
        engine = SpecEngine(target, config=config)
        reqs = [Request(prompt_ids=p.ids, max_new_tokens=max_new, sampling=greedy, request_id=i)
                for i, p in enumerate(prompts)]
        engine.generate(reqs)  # warm-up: compiles and captures
        t0 = time.perf_counter()
        out = engine.generate(reqs)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return [r.token_ids for r in out], sum(len(r.token_ids) for r in out) / (time.perf_counter() - t0)

    try:
        with Meter(device) as m:
            eager, eager_tps = run(EngineConfig(max_batch_size=4, max_seq_len=512))
            graphs, graph_tps = run(EngineConfig(max_batch_size=4, max_seq_len=512, compile=compile,
                                                 cuda_graphs=True))
        same = eager == graphs
        return Row("decode AR cuda graphs", f"{str(dtype).removeprefix('torch.')} {'compiled' if compile else 'eager'}",
                   f"{graph_tps / eager_tps:.2f}x eager, outputs {'equal' if same else 'DIFFER'}", m.seconds, m.peak,
                   ok=same)
    except Exception as e:
        return Row("decode AR cuda graphs", "", f"FAILED: {type(e).__name__}: {e}"[:90], 0.0, ok=False)


def pytest_row() -> Row:
    """`pytest -m gpu` (the repository's gpu-marked tests), summarised."""
    root = Path(__file__).resolve().parents[1]
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "tests"],
                          cwd=root, capture_output=True, text=True, timeout=300)
    tail = (proc.stdout.strip().splitlines() or ["(no output)"])[-1]
    ok = proc.returncode in (0, 5)  # 5: no test carries the marker in this checkout
    return Row("pytest -m gpu", "tests/", tail[:90] if proc.returncode != 5 else "no gpu-marked tests here",
               time.perf_counter() - t0, ok=ok)


def format_table(rows: list[Row]) -> str:
    lines = [f"{'check':<18} {'setting':<28} {'result':<44} {'s':>7} {'peak MiB':>9}  ok"]
    for r in rows:
        peak = "-" if r.peak_mib is None else f"{r.peak_mib:.0f}"
        lines.append(f"{r.check:<18} {r.setting:<28} {r.result:<44} {r.seconds:>7.1f} {peak:>9}  "
                     f"{'yes' if r.ok else 'NO'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="tiny shapes, no compile, no pytest: a CPU smoke run")
    ap.add_argument("--per-domain", type=int, default=None, help="held-out prompts per domain (default 8; quick 1)")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="default 128; quick 4")
    ap.add_argument("--seq-len", type=int, default=None, help="training row length (default 2048; quick 64)")
    ap.add_argument("--prefill", type=int, default=None, help="long-prompt length (default 32768; quick 256)")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--dtypes", default="fp32,bf16", help="decode dtypes (default fp32,bf16)")
    ap.add_argument("--train-dtype", choices=sorted(DTYPES), default=None,
                    help="the training rows' target dtype (bf16 = drafter under bf16 autocast; default bf16 on a GPU, "
                         "fp32 elsewhere)")
    ap.add_argument("--drafters", default=None, help="comma-separated shipped drafters to decode (default: all)")
    ap.add_argument("--skip", default="", help="comma-separated sections to skip: decode,train,prefill,pytest")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device is visible on this machine; run with --device cpu --quick",
              file=sys.stderr)
        return 2
    quick, skip = args.quick, set(filter(None, args.skip.split(",")))
    gpu = device.type == "cuda"
    per_domain = args.per_domain or (1 if quick else 8)
    max_new = args.max_new_tokens or (4 if quick else 128)
    T = args.seq_len or (64 if quick else 2048)
    prefill = args.prefill or (256 if quick else 32768)
    train_dtype = DTYPES[args.train_dtype or ("bf16" if gpu else "fp32")]
    if gpu:
        torch.backends.cuda.matmul.allow_tf32 = True
    t0 = time.perf_counter()
    rows: list[Row] = []
    if "decode" not in skip:
        compiled = [False] if quick or args.no_compile else [False, True]
        rows += decode_rows(device, args.dtypes.split(","), compiled, per_domain, max_new, batch=4 if quick else 8,
                            max_prompts=2 if quick else None,
                            drafters=None if args.drafters is None else args.drafters.split(","))
        rows.append(graphs_row(device, not (quick or args.no_compile), max_new, train_dtype))
    if "train" not in skip:
        rows += train_rows(device, quick, 1, T, train_dtype)
    if "prefill" not in skip:
        rows.append(prefill_row(device, quick, prefill, train_dtype))
    if "pytest" not in skip and not quick:
        rows.append(pytest_row())
    name = torch.cuda.get_device_name(device) if gpu else "CPU"
    print(f"gpu_check on {name} ({device}), torch {torch.__version__}, {time.perf_counter() - t0:.0f} s"
          f"{' (quick: tiny shapes)' if quick else ''}")
    print(format_table(rows))
    return 0 if all(r.ok for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
