"""Peak memory and time of one MTP training step at an 8B-like head: the teacher as whole [B, T, V] logits (the old
path) against the target's final-norm states and LM head applied per loss chunk (`train.losses.TeacherHead`, what
the trainers run now), side by side in one run; then the same computed for 4 x 4k tokens.

Setup: a 2-layer target of Qwen3-8B's layer shape (hidden 4096, 32 query / 8 kv heads x 128, MLP 12288) with a
152k vocabulary (151,936) and a tied head (one [V, C] matrix: 2.3 GiB of fp32 instead of two), random weights; its
MTP-3 drafter (the trainer's default: TTT over D = 3 depths, checkpointed depths, e2e TV); one packed row of T
tokens holding 4 documents. The measured step is the trainer's forward and backward without the optimizer: the
target's forward under no_grad (`TargetFeatures`, online), the rollout, the chunked LM head + loss, the backward.

  old   `TargetFeatures` returned `lm_head(norm(h)).float()`, [B, T, V] fp32, and the loss chunks held 2^23 logits
        (32 MiB: 18 rows at D = 3, V = 152k; the same budget on every device)
  new   the teacher is a `TeacherHead` (states [B, T, C]); each chunk runs the LM head on its rows' window; the chunk
        budget comes from the device (`loss_chunk_logits`: 1/8 of a GPU's memory, 2^23 logits on the host)

Memory: on CPU the live tensor storage of the step as `torch.profiler` records it (every allocation and free of
the CPU allocator; `benchmarks/ttt_memory.py`'s `peak_bytes`): the peak over the step's start, weights excluded.
Deterministic (contention changes seconds, not bytes). On CUDA `torch.cuda.max_memory_allocated` over the start.
Seconds are one step each (CPU: shared cores, so compare within a run).

Measured (2 shared CPU cores, B x T = 1 x 128, the full 8B-like shape): peak 1,732 MiB old vs 1,660 MiB new (0.96x;
the 72 MiB saved is the old path's [1, 128, V] teacher, 74 MiB), the same loss to the last digit printed; one step
370 s old vs 595 s new on cores shared with other jobs (the new path also runs the teacher head in each chunk's
recompute: about +10% of the step's LM-head rows at D = 3, so most of that gap is contention). At 4 x 4k on a
141 GB GPU the shapes give 9.3 GiB of teacher old vs 0.25 GiB of states new, and 911 loss chunks vs 21.

Run:  .venv/bin/python benchmarks/teacher_memory.py                       (CPU: B = 1, T = 128, ~20 minutes here)
      .venv/bin/python benchmarks/teacher_memory.py --device cuda --batch 4 --seq-len 4096
      --quick: a tiny shape (hidden 64, V = 4096) for a smoke run; --mlp 1024: smaller layers (the head unchanged)
      for a host with ~4 GiB free (the weights are excluded from the peak either way)
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable

import torch
from ttt_memory import limit_heap_fragmentation, peak_bytes

from angelspec.data.packing import Doc, PackedBatch, pack_documents
from angelspec.models import Decoder, DecoderConfig
from angelspec.models.mtp import MTPConfig, MTPDraftModel, concat_taps
from angelspec.train.features import TargetFeatures
from angelspec.train.losses import (
    CHUNK_BUFFERS,
    LOSSES,
    ChunkedLossBatch,
    LossConfig,
    loss_chunk_logits,
    teacher_logits,
)
from angelspec.train.ttt import RolloutMemory, mtp_chunked_loss_batch, ttt_rollout

GiB, MiB = 2**30, 2**20
OLD_MAX_LOGITS = 1 << 23  # the chunk budget every device had before it came from the device's memory


def target_config(quick: bool, T: int, mlp: int = 12288) -> DecoderConfig:
    if quick:
        return DecoderConfig(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=T,
                             model_type="qwen3", qk_norm=True, tie_word_embeddings=True)
    return DecoderConfig(vocab_size=151936, hidden_size=4096, intermediate_size=mlp, num_hidden_layers=2,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=T,
                         model_type="qwen3", qk_norm=True, tie_word_embeddings=True)


def make_problem(cfg: DecoderConfig, B: int, T: int, D: int, device: torch.device
                 ) -> tuple[Decoder, MTPDraftModel, PackedBatch]:
    torch.manual_seed(0)
    with torch.device(device):
        target = Decoder(cfg)
    target.init_weights(std=0.02, generator=torch.Generator(device=device).manual_seed(0))
    target.requires_grad_(False).eval()
    with torch.device(device):
        model = MTPDraftModel(MTPConfig.for_target(cfg, num_depths=D), target.embed_tokens, target.lm_head)
    model.init_weights(std=0.02, generator=torch.Generator(device=device).manual_seed(1))
    g = torch.Generator().manual_seed(2)
    sizes = [int(T * f) for f in (0.4, 0.3, 0.2)]
    docs = [Doc(torch.randint(0, cfg.vocab_size, (n,), generator=g), torch.ones(n, dtype=torch.long))
            for n in (*sizes, T - sum(sizes))] * B
    return target, model, pack_documents(docs, T, pad_id=0).to(device)


def step_fn(variant: str, target: Decoder, model: MTPDraftModel, packed: PackedBatch, D: int
            ) -> Callable[[], float]:
    features = TargetFeatures(target, list(model.config.target_layer_ids))
    objective, config = LOSSES["e2e_tv"], LossConfig()

    def step() -> float:
        taps, teacher = features(packed, list(range(packed.num_rows)))
        max_logits = None
        if variant == "old":
            teacher, max_logits = teacher_logits(teacher), OLD_MAX_LOGITS  # [B, T, V] fp32, as before
        out = ttt_rollout(model, concat_taps(taps), packed.input_ids, packed.positions, packed.document_ids, D,
                          memory=RolloutMemory(keep_logits=False, checkpoint_depths=True))
        loss = objective(mtp_chunked_loss_batch(model, out, packed, teacher, max_logits=max_logits), config).loss
        loss.backward()
        model.zero_grad(set_to_none=True)
        return float(loss.detach())

    return step


def measure(fn: Callable[[], float], device: torch.device) -> tuple[float, float, float]:
    """-> (peak bytes over the start, seconds, loss)."""
    if device.type != "cuda":
        return peak_bytes(fn)
    fn()  # warm-up (kernels, allocator)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    start = torch.cuda.memory_allocated(device)
    t0 = time.perf_counter()
    value = fn()
    torch.cuda.synchronize(device)
    return float(torch.cuda.max_memory_allocated(device) - start), time.perf_counter() - t0, value


def chunk_rows(max_logits: int, D: int, V: int) -> int:
    return ChunkedLossBatch.rows_for(max_logits, D, V)


def computed(B: int, T: int, D: int, cfg: DecoderConfig, device_memory: int) -> list[str]:
    """What the two paths hold at B x T tokens, from the shapes (no run)."""
    V, C, N = cfg.vocab_size, cfg.hidden_size, B * T
    old_rows, new_budget = chunk_rows(OLD_MAX_LOGITS, D, V), max(1 << 20, device_memory // 8 // (4 * CHUNK_BUFFERS))
    new_rows = chunk_rows(new_budget, D, V)
    return [
        f"computed for B x T = {B} x {T} ({N} tokens), D = {D}, C = {C}, V = {V}, a GPU of "
        f"{device_memory / GiB:.0f} GiB:",
        f"  teacher held by the step   old [B, T, V] fp32 {N * V * 4 / GiB:.1f} GiB   new [B, T, C] states "
        f"{N * C * 4 / GiB:.2f} GiB fp32 ({N * C * 2 / GiB:.2f} GiB bf16)",
        f"  loss chunks per step       old {math.ceil(N / old_rows)} of {old_rows} rows   new "
        f"{math.ceil(N / new_rows)} of {new_rows} rows (budget {new_budget * 4 * CHUNK_BUFFERS / GiB:.1f} GiB "
        f"for a chunk's ~{CHUNK_BUFFERS} fp32 buffers)",
        "  host syncs from x[mask]    old several per chunk and loss   new none (static shapes)",
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--depths", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="a tiny shape (hidden 64, V = 4096): a smoke run")
    ap.add_argument("--mlp", type=int, default=12288,
                    help="MLP width of the target's and the drafter's layers (the head stays 4096 x 152k): a smaller "
                         "one fits a host with little free memory and changes neither path's teacher")
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is visible here; run with --device cpu")
    limit_heap_fragmentation()
    B, T, D = args.batch, args.seq_len, args.depths
    cfg = target_config(args.quick, T, args.mlp)
    t0 = time.perf_counter()
    target, model, packed = make_problem(cfg, B, T, D, device)
    print(f"target: 2 layers of hidden {cfg.hidden_size} / MLP {cfg.intermediate_size}, V = {cfg.vocab_size}, tied "
          f"head; MTP-{D}; B x T = {B} x {T}; {device} fp32 (built in {time.perf_counter() - t0:.0f} s)")
    rows = {}
    for variant in ("old", "new"):
        peak, dt, loss = measure(step_fn(variant, target, model, packed, D), device)
        budget = OLD_MAX_LOGITS if variant == "old" else loss_chunk_logits(device)
        rows[variant] = (peak, dt, loss, chunk_rows(budget, D, cfg.vocab_size))
    V, N = cfg.vocab_size, B * T
    print(f"\n{'variant':<44} {'rows/chunk':>10} {'chunks':>7} {'peak MiB':>10} {'step s':>8} {'loss':>10}")
    names = {"old": "old: teacher [B, T, V] fp32, 2^23 logits/chunk", "new": "new: TeacherHead per chunk"}
    for variant, (peak, dt, loss, r) in rows.items():
        print(f"{names[variant]:<44} {r:>10} {math.ceil(N / r):>7} {peak / MiB:>10.1f} {dt:>8.2f} {loss:>10.6f}")
    (po, to, lo, _), (pn, tn, ln, _) = rows["old"], rows["new"]
    print(f"{'new / old':<44} {'':>10} {'':>7} {pn / po:>9.2f}x {tn / to:>7.2f}x   loss diff {abs(ln - lo):.1e}")
    print(f"(the old path's teacher alone: {N * V * 4 / MiB:.1f} MiB)\n")
    memory = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else 141 * 10**9
    print("\n".join(computed(4, 4096, D, target_config(False, 4096), memory)))


if __name__ == "__main__":
    main()
