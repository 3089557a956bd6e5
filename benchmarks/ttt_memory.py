"""Peak memory of one MTP training step with Training-Time Test (D=3), LM head and loss included, against one
causal pass with its loss, at several sequence lengths (report §2.2 / §6.1: "close to a single causal pass";
our goal ≤ 1.3× at T = 4k and 16k).

Setup: the embedded target's shape (hidden 256, 4 heads / 2 kv heads × 64, MLP 768, vocab 8192), random
weights, one packed row of T tokens holding 4 documents (40/30/20/10 % of T), random target taps and random
teacher logits (the target's features; made before the measured region, like the weights), fp32 on CPU. Each
variant runs one training step's autograd work: forward, LM head, the objective (`--loss`, default e2e TV, the
trainer's main objective), backward.

  causal D=1 (linear)    THE BASELINE: one causal pass of the block with its loss, done the linear way —
                         `ttt_rollout(num_depths=1)` (depth 0 = the teacher-forced causal pass; tiled
                         document-masked attention, no [T, T] mask) and the chunked LM head + loss, activations kept
                         as any causal pass keeps them. Why this and not `MTPDraftModel.forward`: that pass builds a
                         [B, 1, T, T] document gate for SDPA and, with a plain head, [T, V] logits; both grow faster
                         than a pass needs to, so a ratio against it would flatter the TTT step. The goal compares
                         like with like: the same attention and head machinery, one depth vs D depths.
  causal D=1 (ckpt)      the baseline with its one depth checkpointed (does checkpointing pay for one depth?)
  ttt D=3 (linear)       the TTT step as above with D depths, every depth's activations kept
  ttt D=3 (linear+ckpt)  the same with per-depth activation checkpointing: what the trainer runs by default
  causal-sdpa (legacy)   `MTPDraftModel.forward` ([B, 1, T, T] gate) + whole [T, V] logits and loss   } only for
  ttt D=3 (whole logits) the rollout with `keep_logits=True` + `mtp_loss_batch` (the reference loss    } T <=
                         path: [N, D, V] student logits and a [N, D, V] teacher copy)                   } --legacy-max

How memory is measured: `torch.profiler` with `profile_memory=True` records every allocation and free of the CPU
allocator; ordered in time, their running sum is the bytes of live tensor storage, and the peak is its maximum
over the step minus its value at the start (weights, taps and teacher logits made before are excluded; the
taps' [T, C] and the teacher's [T, V] are listed for scale). This is the allocator's view, not RSS (no allocator
slack, no scratch outside tensors). It is deterministic: contention on a shared machine changes the seconds,
never the bytes. `export_memory_timeline`, which an earlier version of this script used, gives the same peaks,
minutes slower. RSS is kept close to it by `limit_heap_fragmentation`.

On a GPU (`--device cuda`) the peak is the CUDA caching allocator's (`torch.cuda.max_memory_allocated` over the
step, minus what was allocated at its start), and no thread count is printed.

Run:  .venv/bin/python benchmarks/ttt_memory.py --seq-len 4096 16384 32768 [--depths 3] [--loss e2e_tv] [--device cuda]
"""

from __future__ import annotations

import argparse
import ctypes
import time
from collections.abc import Callable

import torch
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

from angelspec.data.packing import Doc, PackedBatch, pack_documents
from angelspec.models import DecoderConfig
from angelspec.models.mtp import MTPConfig, MTPDraftModel
from angelspec.train.losses import LOSSES, LossBatch, LossConfig
from angelspec.train.ttt import (
    RolloutMemory,
    depth0_inputs,
    depth_labels,
    mtp_chunked_loss_batch,
    mtp_loss_batch,
    teacher_for_depths,
    ttt_rollout,
)

MiB = 2**20
BASELINE = "causal D=1 (linear)"


def limit_heap_fragmentation() -> None:
    """glibc: serve every allocation of 128 KiB or more by mmap, returned to the OS when freed. By default glibc
    raises that threshold to the size of the largest block freed so far (up to 32 MiB), after which the many
    4-32 MiB attention tiles and loss chunks of a long step come from the heap and fragment it: at T = 8192 the
    process's RSS grew to 4x the tensor peak (and a 32k run was OOM-killed at 18 GiB RSS for ~4 GiB of tensors).
    Changes RSS only, not the bytes measured here. No-op where glibc is absent."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


def peak_bytes(fn: Callable[[], float], device: torch.device | str = "cpu") -> tuple[float, float, float]:
    """-> (peak bytes of tensor storage allocated inside fn over its start, seconds, fn's return value). On the CPU
    from the profiler's allocator events (below); on a CUDA device from the caching allocator's own peak counter
    (`torch.cuda.max_memory_allocated`, reset before fn, minus what was allocated at its start), the seconds after a
    synchronize."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        t0 = time.perf_counter()
        value = fn()
        torch.cuda.synchronize(device)
        dt = time.perf_counter() - t0
        return float(torch.cuda.max_memory_allocated(device) - base), dt, value
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        t0 = time.perf_counter()
        value = fn()
        dt = time.perf_counter() - t0
    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:  # every allocation (+) and free (-) of the CPU allocator, wherever it sits in the op tree
        node = stack.pop()
        if node.tag == _EventType.Allocation:
            events.append((node.start_time_ns, node.extra_fields.alloc_size))
        stack.extend(node.children)
    live = peak = 0
    for _, delta in sorted(events):
        live += delta
        peak = max(peak, live)
    return float(peak), dt, value


def make_problem(T: int, D: int, seed: int = 1, device: torch.device | str = "cpu"
                 ) -> tuple[MTPDraftModel, PackedBatch, torch.Tensor, torch.Tensor]:
    """The model at the embedded shape, one packed row of T tokens (4 documents), random taps and teacher logits,
    drawn on the host (the same problem on every device) and moved to `device`."""
    tcfg = DecoderConfig(vocab_size=8192, hidden_size=256, intermediate_size=768, num_hidden_layers=6,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=T)
    # Only the target's (tied) embedding and head enter the model; taps are random, so no target is built.
    embed = torch.nn.Embedding(tcfg.vocab_size, tcfg.hidden_size)
    torch.nn.init.normal_(embed.weight, generator=torch.Generator().manual_seed(seed + 1))
    head = torch.nn.Linear(tcfg.hidden_size, tcfg.vocab_size, bias=False)
    head.weight = embed.weight
    model = MTPDraftModel(MTPConfig.for_target(tcfg, num_depths=D), embed, head)
    model.init_weights(generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(seed)
    sizes = [int(T * f) for f in (0.4, 0.3, 0.2)]
    docs = [Doc(torch.randint(0, tcfg.vocab_size, (n,), generator=g)) for n in (*sizes, T - sum(sizes))]
    packed = pack_documents(docs, T, pad_id=0)
    hidden = torch.randn(1, T, tcfg.hidden_size, generator=g)
    teacher = torch.randn(1, T, tcfg.vocab_size, generator=g) * 3
    return model.to(device), packed.to(device), hidden.to(device), teacher.to(device)


def variants(model: MTPDraftModel, packed: PackedBatch, hidden: torch.Tensor, teacher: torch.Tensor, D: int,
             loss: str, legacy: bool) -> dict[str, Callable[[], float]]:
    """name -> one training step (returns the loss value)."""
    ids, pos, doc = packed.input_ids, packed.positions, packed.document_ids
    objective, config = LOSSES[loss], LossConfig()

    def linear(depths: int, ckpt: bool) -> Callable[[], float]:
        def run() -> float:
            out = ttt_rollout(model, hidden, ids, pos, doc, depths,
                              memory=RolloutMemory(keep_logits=False, checkpoint_depths=ckpt))
            value = objective(mtp_chunked_loss_batch(model, out, packed, teacher), config).loss
            value.backward()
            return value.item()
        return run

    def whole_logits() -> float:
        out = ttt_rollout(model, hidden, ids, pos, doc, D)
        value = objective(mtp_loss_batch(out, packed, teacher), config).loss
        value.backward()
        return value.item()

    def causal_sdpa() -> float:
        h = model(hidden, depth0_inputs(ids, doc, 0), pos, doc)  # [B, 1, T, T] gate inside
        lab, mask = depth_labels(packed, 1)
        lb = LossBatch(student_logits=model.logits(h).flatten(0, 1)[:, None], mask=mask,
                       teacher_logits=teacher_for_depths(teacher, 1).flatten(0, 1), labels=lab)
        value = objective(lb, config).loss
        value.backward()
        return value.item()

    out = {BASELINE: linear(1, False), "causal D=1 (ckpt)": linear(1, True), f"ttt D={D} (linear)": linear(D, False),
           f"ttt D={D} (linear+ckpt)": linear(D, True)}
    if legacy:
        out |= {"causal-sdpa (legacy)": causal_sdpa, f"ttt D={D} (whole logits)": whole_logits}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq-len", type=int, nargs="+", default=[1024])
    ap.add_argument("--depths", type=int, default=3)
    ap.add_argument("--loss", default="e2e_tv", choices=sorted(LOSSES))
    ap.add_argument("--legacy-max", type=int, default=4096, help="run the legacy variants up to this T")
    ap.add_argument("--threads", type=int, default=2, help="torch threads of a CPU run")
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:N]: on a GPU the peak is the CUDA allocator's")
    args = ap.parse_args()
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    limit_heap_fragmentation()
    D = args.depths
    # Warm-up at a small T (oneDNN primitives and other one-off allocations stay out of the measured steps).
    for step in variants(*make_problem(256, D, device=device), D, args.loss, True).values():
        step()
    where = f"{args.threads} threads" if device.type == "cpu" else str(device)
    print(f"MTP draft model at the embedded shape (C=256, V=8192), D={D}, loss={args.loss}, fp32, "
          f"{where}; one packed row of 4 documents")
    rows = []
    for T in args.seq_len:
        model, packed, hidden, teacher = make_problem(T, D, device=device)
        print(f"\nT={T}: inputs, not counted: taps [T, C] {hidden.numel() * 4 / MiB:.0f} MiB, teacher logits "
              f"[T, V] {teacher.numel() * 4 / MiB:.0f} MiB; one depth's fp32 logits [T, V] would be "
              f"{T * 8192 * 4 / MiB:.0f} MiB, a [T, T] fp32 score matrix per head {T * T * 4 / MiB:.0f} MiB")
        print(f"{'variant':<26} {'peak MiB':>10} {'x causal':>9} {'loss':>10} {'s':>7}")
        peaks: dict[str, float] = {}
        for name, step in variants(model, packed, hidden, teacher, D, args.loss, T <= args.legacy_max).items():
            model.zero_grad(set_to_none=True)
            peaks[name], dt, value = peak_bytes(step, device)
            ratio = peaks[name] / peaks[BASELINE]
            print(f"{name:<26} {peaks[name] / MiB:>10.1f} {ratio:>8.2f}x {value:>10.6f} {dt:>7.1f}", flush=True)
            rows.append((T, name, peaks[name] / MiB, ratio))
        model.zero_grad(set_to_none=True)
    ckpt = f"ttt D={D} (linear+ckpt)"
    print(f"\nsummary: {ckpt} / {BASELINE} (goal <= 1.3x at T = 4k and 16k)")
    for T, name, mib, ratio in rows:
        if name == ckpt:
            print(f"  T={T:>6}: {mib:8.1f} MiB, {ratio:.2f}x")


if __name__ == "__main__":
    main()
