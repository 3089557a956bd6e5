"""Peak memory and time of the attention at an 8B-like layer shape, old path against new, as T grows.

Shape: 2 layers of 32 query / 8 kv heads × head_dim 128 (Qwen3-8B / Llama-3-8B attention), batch 1, q/k/v random
(the projections and MLPs are the same in both paths and left out: this measures what the kernels add).

  prefill T       old: SDPA under the boolean [1, 1, T, S] cache mask with enable_gqa (what every cached forward
                  passed); new: SDPA is_causal (a fresh prefill) — and on CUDA FlexAttention under the cache's
                  block mask
  decode @ S      one query per row over a cache of S slots: old mask path vs the new backend ("auto": the mask
                  path on a CPU, FlexAttention over the capacity on CUDA)
  train mtp-ttt   forward + backward of the TTT prefix attention over a row of 4 packed documents: old the dense
                  reference (a [T, T] mask and scores), new the tiled O(T) kernel (CPU) / FlexAttention (CUDA)
  train dfly      the same for the block drafters' anchors (T/16 anchors of block 8): dense `training_mask` SDPA
                  vs `anchored_block_attention`

Memory: on CUDA `torch.cuda.max_memory_allocated` over the call; on a CPU the allocator's own record
(`torch.profiler` allocations and frees: live tensor bytes, not RSS). Where a case would not fit in --max-seconds
on a CPU, the row prints the computed bytes instead: the dense path holds fp32 scores [H, T, S] per layer at the
math fallback (what CUDA runs for a mask with GQA), the new paths q, k, v, out and the [T/128]² block mask.
Goal: memory grows linearly, (M(16k) - M(4k)) <= ~5 × (M(4k) - M(1k)); a [T, T] tensor gives 16×.

Run:  .venv/bin/python benchmarks/attention_scale.py --quick                # CPU: small T measured, rest computed
      .venv/bin/python benchmarks/attention_scale.py --device cuda           # every size measured on a GPU
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.nn.functional as F
from ttt_memory import peak_bytes  # a sibling script: the CPU profiler's allocation peak, CUDA's own counter

from angelspec.models.attention import (
    AttentionPlan,
    document_first_index,
    document_prefix_attention,
    document_prefix_attention_reference,
    resolve_attention_backend,
)
from angelspec.models.block.drafter import AnchorIndex, anchored_block_attention

H, HKV, DH, LAYERS = 32, 8, 128, 2
GiB = float(1 << 30)


def measure(fn: Callable[[], object], device: torch.device) -> tuple[float, float]:
    """-> (peak bytes allocated inside fn over its start, seconds): `ttt_memory.peak_bytes`."""
    peak, dt, _ = peak_bytes(fn, device)
    return peak, dt


def computed(kind: str, T: int, S: int, dtype_bytes: int, train: bool) -> float:
    """T queries over S keys (a DFly row of T tokens: T/2 block queries over T keys + their own)."""
    # Bytes a path adds per call (2 layers, the largest transient of one layer + outputs of both).
    qkv = (H + 2 * HKV) * T * DH * dtype_bytes if T == S else (H * T + 2 * HKV * S) * DH * dtype_bytes
    out = H * T * DH * dtype_bytes
    if kind == "dense":
        scores = H * T * S * 4 * (2 if train else 1)  # fp32 scores (and their softmax kept for the backward)
        return LAYERS * out + scores + T * S + 2 * H * S * DH * dtype_bytes  # + mask, K/V repeated per head
    blocks = -(-T // 128) * -(-S // 128) * 4 * 4
    return LAYERS * out * (3 if train else 1) + blocks + (qkv if train else 0)


def cases(device: torch.device, dtype: torch.dtype, backend: str):
    """(name, T, S, train, old fn-builder, new fn-builder)."""

    def rand(*shape):
        return torch.randn(*shape, device=device, dtype=dtype)

    def prefill(T: int, new: bool):
        q, k, v = rand(1, H, T, DH), rand(1, HKV, T, DH), rand(1, HKV, T, DH)
        start = torch.zeros(1, dtype=torch.long, device=device)
        plan = AttentionPlan.cached(start, T, T, T, backend if new else "sdpa", fresh=new)
        return lambda: [plan(q, k, v) for _ in range(LAYERS)]

    def decode(S: int, new: bool):
        q, k, v = rand(1, H, 1, DH), rand(1, HKV, S, DH), rand(1, HKV, S, DH)
        start = torch.full((1,), S - 1, dtype=torch.long, device=device)
        plan = AttentionPlan.cached(start, 1, S, S, backend if new else "sdpa", fresh=False)
        return lambda: [plan(q, k, v) for _ in range(LAYERS)]

    def docs(T: int) -> torch.Tensor:
        t = torch.arange(T, device=device)
        return ((t >= T * 4 // 10).long() + (t >= T * 7 // 10).long() + (t >= T * 9 // 10).long())[None]

    def ttt(T: int, new: bool):
        doc, q_last = docs(T), torch.arange(T, device=device)[None]
        first = document_first_index(doc)
        xs = [rand(1, H, T, DH).requires_grad_(), rand(1, HKV, T, DH).requires_grad_(),
              rand(1, HKV, T, DH).requires_grad_()]

        def step():
            for _ in range(LAYERS):
                if new:
                    out, lse = document_prefix_attention(*xs, q_last, doc, doc, first, backend=backend)
                else:
                    out, lse = document_prefix_attention_reference(*xs, q_last, doc, doc)
                (out.float().sum() + lse.float().sum()).backward()
        return step

    def dfly(T: int, new: bool):
        doc, Bk = docs(T), 8
        anchors = torch.arange(1, T - 1, 16, device=device)[None]
        index = AnchorIndex.build(anchors, Bk, doc)
        Q = anchors.shape[1] * Bk
        xs = [rand(1, H, Q, DH).requires_grad_(), rand(1, HKV, Q, DH).requires_grad_(),
              rand(1, HKV, Q, DH).requires_grad_(), rand(1, HKV, T, DH).requires_grad_(),
              rand(1, HKV, T, DH).requires_grad_()]

        def dense_mask() -> torch.Tensor:  # `BlockDrafter.training_mask`'s pattern, built the same way
            ctx = ((torch.arange(T, device=device) <= index.last[..., None])
                   & (doc[:, None, :] == index.doc[..., None]))  # [1, Q, T]
            blk = torch.arange(Q, device=device) // Bk
            return torch.cat([ctx, (blk[:, None] == blk[None, :])[None]], dim=-1)[:, None]

        def step():
            for _ in range(LAYERS):
                q, k, v, ck, cv = xs
                if new:
                    out = anchored_block_attention(q, k, v, ck, cv, index, backend=backend)
                else:
                    out = F.scaled_dot_product_attention(q, torch.cat([ck, k], 2), torch.cat([cv, v], 2),
                                                         attn_mask=dense_mask(), enable_gqa=True)
                out.float().sum().backward()
        return step

    for T in (1024, 4096, 16384, 32768):
        yield f"prefill T={T}", T, T, False, prefill
    yield "decode S=32768", 1, 32768, False, decode
    for T in (1024, 4096, 16384):
        yield f"train mtp-ttt T={T}", T, T, True, ttt
    for T in (1024, 4096, 16384):
        yield f"train dfly T={T}", T, T, True, dfly


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, choices=("float32", "bfloat16"), help="default: bf16 on CUDA, fp32")
    ap.add_argument("--backend", default="auto", help="the new path's attention backend (default auto)")
    ap.add_argument("--quick", action="store_true", help="measure only T <= --max-measured (and decode); compute "
                    "the rest")
    ap.add_argument("--max-measured", type=int, default=1024)
    args = ap.parse_args()
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    backend = resolve_attention_backend(args.backend, device)
    nbytes = torch.empty((), dtype=dtype).element_size()
    print(f"attention at {LAYERS} layers x {H}/{HKV} heads x {DH}, {dtype}, {device}, new backend {backend}")
    print(f"{'case':<22} {'old GiB':>9} {'new GiB':>9} {'old/new':>8} {'old s':>8} {'new s':>8}   (c = computed)")
    mem: dict[tuple[str, str], dict[int, float]] = {}
    for name, T, S, train, build in cases(device, dtype, backend):
        row = []
        for new in (False, True):
            kind = "new" if new else "dense"
            q_len = T // 2 if name.startswith("train dfly") else T
            c = computed(kind, q_len, S, nbytes, train)
            mem.setdefault((name.split(" T=")[0], kind, "computed"), {})[T] = c
            if args.quick and T > args.max_measured:  # decode (T = 1) is always measured
                b, dt, tag = c, float("nan"), "c"
            else:
                fn = build(S if T == 1 else T, new)
                fn()  # warm-up (compiles the flex kernel on its first shape)
                b, dt = measure(fn, device)
                tag = ""
            row.append((b, dt, tag))
            if not tag:
                mem.setdefault((name.split(" T=")[0], kind, "measured"), {})[T] = b
        (bo, to, co), (bn, tn, cn) = row
        print(f"{name:<22} {bo / GiB:>8.3f}{co or ' '} {bn / GiB:>8.3f}{cn or ' '} {bo / max(bn, 1):>8.1f} "
              f"{to:>8.3f} {tn:>8.3f}")
    print("\nlinear-growth goal: (M(16k) - M(4k)) / (M(4k) - M(1k)) <= ~5 (a [T, T] tensor: 16)")
    for (case, kind, how), by_t in sorted(mem.items()):
        if {1024, 4096, 16384} <= by_t.keys():
            inc = (by_t[16384] - by_t[4096]) / max(by_t[4096] - by_t[1024], 1.0)
            print(f"  {case:<16} {'old' if kind == 'dense' else 'new':<4} {how:<9} {inc:6.1f}x")


if __name__ == "__main__":
    main()
