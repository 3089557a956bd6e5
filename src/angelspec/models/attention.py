"""Document-masked prefix attention in O(T) memory: no [T, T] mask or score matrix ever exists.

Training drafters over packed rows needs an attention whose mask is "same document, at most up to a position":
the TTT rollout's causal prefix (`train.ttt`; query i sees keys j <= i of its own document) and the block
drafters' context (`models.block.drafter`; block entries of anchor a see context keys s < a of a's document).
A dense boolean mask for that is [T, T] per row (1 GiB at 32k tokens), and so are the scores SDPA keeps for
its backward. Here the mask is never stored: it is rebuilt per tile from three small index tensors,

    visible(q, j) = k_doc[j] == q_doc[q]  and  j <= q_last[q]          (q_doc, q_last [B, Q]; k_doc [B, T])

and the softmax runs flash-style over tiles of `q_chunk` queries × `k_chunk` keys with an online (running
max / running sum) merge. The forward keeps only q, k, v, the output and the per-query log-sum-exp (LSE); the
backward recomputes each tile's probabilities from the LSE. Largest transient: a few [B, H, q_chunk, k_chunk]
tiles, independent of T. Tiles wholly outside a query block's key range [min q_first, max q_last] are skipped
(`q_first` is a lower bound on the first visible key, e.g. the query's document start), so packed rows cost
Σ_d L_d² work instead of T².

The LSE is an output with a gradient (∂lse/∂score = p), because callers merge this attention with keys scored
elsewhere (TTT's diagonal draft keys, a block's own entries) by logsumexp:
    out = e^{lse_a - lse} out_a + Σ_j e^{s_j - lse} v_j,   lse = logsumexp(lse_a, s_1, ...)   (`merge_extra_keys`).
A query that sees no key at all gets out = 0 and lse = -inf, which such a merge treats as "no prefix".

Shape legend: B batch rows, T keys, Q queries, H query heads, Hkv kv heads, G = H / Hkv, Dh head dim.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

DEFAULT_Q_CHUNK = 256
DEFAULT_K_CHUNK = 1024


def document_first_index(document_ids: Tensor) -> Tensor:
    """For every position, the first position of the same row holding the same document id: [B, T] -> [B, T].

    With packing's contiguous documents this is each document's start. O(B·T log(B·T)), no [T, T] tensor."""
    B, T = document_ids.shape
    _, inv = torch.unique(document_ids, return_inverse=True)  # [B, T] dense ids
    key = (inv + torch.arange(B, device=inv.device)[:, None] * (int(inv.max()) + 1 if inv.numel() else 1)).reshape(-1)
    pos = torch.arange(T, device=inv.device).repeat(B)
    first = torch.full((int(key.max()) + 1 if key.numel() else 0,), T, dtype=torch.long, device=inv.device)
    first = first.scatter_reduce(0, key, pos, reduce="amin")
    return first[key].view(B, T)


def _block_bounds(q_first: Tensor, q_last: Tensor, q_chunk: int) -> list[tuple[int, int, int, int]]:
    """Per query block [s0, s1): the key range [lo, hi] any of its queries may see, over all rows (one host sync)."""
    Q = q_last.shape[-1]
    n = -(-Q // q_chunk)
    blk = torch.arange(Q, device=q_last.device) // q_chunk
    lo = q_first.new_zeros(n).scatter_reduce(0, blk, q_first.amin(0), "amin", include_self=False)
    hi = q_last.new_zeros(n).scatter_reduce(0, blk, q_last.amax(0), "amax", include_self=False)
    bounds = torch.stack([lo, hi], dim=1).tolist()
    return [(b * q_chunk, min((b + 1) * q_chunk, Q), lo_b, hi_b) for b, (lo_b, hi_b) in enumerate(bounds)]


def _visible(q_doc: Tensor, q_last: Tensor, k_doc: Tensor, s0: int, s1: int, t0: int, t1: int) -> Tensor:
    """The mask of one tile, [B|1, 1, 1, s1-s0, t1-t0] bool (True = attend)."""
    kidx = torch.arange(t0, t1, device=k_doc.device)
    vis = (k_doc[:, None, t0:t1] == q_doc[:, s0:s1, None]) & (kidx <= q_last[:, s0:s1, None])
    return vis[:, None, None]


class _DocumentPrefixAttention(torch.autograd.Function):
    """Flash-style forward (online softmax over key tiles) and backward (probabilities recomputed from the LSE):
        dv = pᵀ g_out,   ds = p ⊙ (g_out vᵀ − rowsum(g_out ⊙ out) + g_lse),   dq = ds k·s,   dk = dsᵀ q·s
    (the + g_lse term is ∂lse/∂scores = p). `document_prefix_attention_reference` is the dense autograd twin."""

    @staticmethod
    def forward(ctx, qg: Tensor, k: Tensor, v: Tensor, q_doc: Tensor, q_last: Tensor, k_doc: Tensor,
                q_first: Tensor, scale: float, q_chunk: int, k_chunk: int) -> tuple[Tensor, Tensor]:
        # qg [B, Hkv, G, Q, Dh]; k, v [B, Hkv, 1, T, Dh]; q_doc, q_last, q_first [B|1, Q]; k_doc [B|1, T]
        wide = torch.promote_types(qg.dtype, torch.float32)
        out = torch.zeros(qg.shape, dtype=qg.dtype, device=qg.device)
        lse = torch.full(qg.shape[:-1], float("-inf"), dtype=wide, device=qg.device)
        bounds = _block_bounds(q_first, q_last, q_chunk)
        for s0, s1, lo, hi in bounds:
            qb = qg[..., s0:s1, :]
            m = torch.full(qb.shape[:-1], float("-inf"), dtype=wide, device=qg.device)  # running max
            l = torch.zeros_like(m)  # running sum of exp(score - m)  # noqa: E741
            acc = torch.zeros(qb.shape, dtype=wide, device=qg.device)
            for t1 in range(hi + 1, lo, -k_chunk):  # key tiles from the diagonal down
                t0 = max(lo, t1 - k_chunk)
                s = (qb @ k[..., t0:t1, :].transpose(-1, -2)).to(wide).mul_(scale)  # [B, Hkv, G, c, kc]
                s.masked_fill_(~_visible(q_doc, q_last, k_doc, s0, s1, t0, t1), float("-inf"))
                m_new = torch.maximum(m, s.amax(dim=-1))
                shift = m_new.masked_fill(m_new == float("-inf"), 0.0)  # rows that saw nothing yet stay at 0
                p = s.sub_(shift[..., None]).exp_()
                corr = (m - shift).exp()
                l = l.mul_(corr).add_(p.sum(dim=-1))  # noqa: E741
                acc = acc.mul_(corr[..., None]).add_(p.to(v.dtype) @ v[..., t0:t1, :])
                m = m_new
            seen = l > 0
            out[..., s0:s1, :] = (acc / torch.where(seen, l, 1.0)[..., None]).to(qg.dtype)
            lse[..., s0:s1] = torch.where(seen, m + l.log(), float("-inf"))
        ctx.save_for_backward(qg, k, v, q_doc, q_last, k_doc, lse, out)
        ctx.scale, ctx.bounds, ctx.k_chunk = scale, bounds, k_chunk
        return out, lse

    @staticmethod
    def backward(ctx, g_out: Tensor, g_lse: Tensor) -> tuple[Tensor | None, ...]:
        qg, k, v, q_doc, q_last, k_doc, lse, out = ctx.saved_tensors
        sc, wide = ctx.scale, lse.dtype
        dq = torch.zeros(qg.shape, dtype=wide, device=qg.device)
        dk = torch.zeros(k.shape, dtype=wide, device=k.device)
        dv = torch.zeros(v.shape, dtype=wide, device=v.device)
        for s0, s1, lo, hi in ctx.bounds:
            qb, gb = qg[..., s0:s1, :], g_out[..., s0:s1, :].to(wide)
            lse_b = lse[..., s0:s1].masked_fill(lse[..., s0:s1] == float("-inf"), float("inf"))  # p = 0 there
            delta = (gb * out[..., s0:s1, :].to(wide)).sum(dim=-1, keepdim=True)  # [B, Hkv, G, c, 1]
            g_l = g_lse[..., s0:s1, None].to(wide)
            for t1 in range(hi + 1, lo, -ctx.k_chunk):
                t0 = max(lo, t1 - ctx.k_chunk)
                k_t, v_t = k[..., t0:t1, :].to(wide), v[..., t0:t1, :].to(wide)
                p = (qb.to(wide) @ k_t.transpose(-1, -2)).mul_(sc)
                p.masked_fill_(~_visible(q_doc, q_last, k_doc, s0, s1, t0, t1), float("-inf"))
                p = p.sub_(lse_b[..., None]).exp_()  # [B, Hkv, G, c, kc]
                dv[..., t0:t1, :] += (p.transpose(-1, -2) @ gb).sum(dim=2, keepdim=True)
                ds = (gb @ v_t.transpose(-1, -2)).sub_(delta).add_(g_l).mul_(p)
                del p
                dq[..., s0:s1, :] += (ds @ k_t).mul_(sc)
                dk[..., t0:t1, :] += (ds.transpose(-1, -2) @ qb.to(wide)).sum(dim=2, keepdim=True).mul_(sc)
        return dq.to(qg.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None, None, None


def _grouped(q: Tensor, k: Tensor) -> Tensor:
    """q [B, H, Q, Dh] -> [B, Hkv, G, Q, Dh]: the query heads that share a kv head (GQA), grouped."""
    B, H, Q, Dh = q.shape
    Hkv = k.shape[1]
    if H % Hkv:
        raise ValueError(f"{H} query heads do not group over {Hkv} kv heads")
    return q.reshape(B, Hkv, H // Hkv, Q, Dh)


def _index_inputs(q: Tensor, k: Tensor, q_doc: Tensor | None, q_last: Tensor, k_doc: Tensor | None,
                  q_first: Tensor | None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Defaults: no document ids = one document per row; no q_first = 0 (nothing skipped below the range)."""
    if (q_doc is None) != (k_doc is None):
        raise ValueError("pass both q_doc and k_doc, or neither")
    if q_doc is None or k_doc is None:
        q_doc = torch.zeros(1, q.shape[2], dtype=torch.long, device=q.device)
        k_doc = torch.zeros(1, k.shape[2], dtype=torch.long, device=q.device)
    if q_first is None:
        q_first = torch.zeros_like(q_last)
    return q_doc, q_last, k_doc, q_first


def document_prefix_attention(q: Tensor, k: Tensor, v: Tensor, q_last: Tensor, q_doc: Tensor | None = None,
                              k_doc: Tensor | None = None, q_first: Tensor | None = None, *,
                              q_chunk: int | None = None, k_chunk: int | None = None, backend: str = "auto"
                              ) -> tuple[Tensor, Tensor]:
    """Attention of q over the keys each query may see (module docstring), with its log-sum-exp.

    q [B, H, Q, Dh]; k, v [B, Hkv, T, Dh]; q_last [B|1, Q] the last key index each query may see; q_doc [B|1, Q]
    and k_doc [B|1, T] document ids (None: one document); q_first [B|1, Q] a lower bound on the first visible key
    (only used to skip tiles; None = 0); tiles of q_chunk × k_chunk (None: `DEFAULT_Q_CHUNK`, `DEFAULT_K_CHUNK`,
    read at call time). -> (out [B, H, Q, Dh], lse [B, H, Q] in fp32 or wider; out = 0 and lse = -inf where a
    query sees no key). Scale 1/sqrt(Dh). backend (`ATTENTION_BACKENDS`): "flex" runs FlexAttention under
    `prefix_block_mask` (no Python tile loop, no host sync; its backward needs a GPU), every other resolved name
    the tiled kernel here (the CPU training path)."""
    if resolve_attention_backend(backend, q.device) == "flex":
        block_mask = prefix_block_mask(q_last, k.shape[2], q_doc, k_doc, q_first, batch=q.shape[0])
        return flex_prefix_attention(q, k, v, block_mask, lse=True)  # type: ignore[return-value]
    q_chunk = DEFAULT_Q_CHUNK if q_chunk is None else q_chunk
    k_chunk = DEFAULT_K_CHUNK if k_chunk is None else k_chunk
    if q_chunk < 1 or k_chunk < 1:
        raise ValueError(f"q_chunk and k_chunk must be >= 1, got {q_chunk}, {k_chunk}")
    qg = _grouped(q, k)
    q_doc, q_last, k_doc, q_first = _index_inputs(q, k, q_doc, q_last, k_doc, q_first)
    out, lse = _DocumentPrefixAttention.apply(qg, k[:, :, None], v[:, :, None], q_doc, q_last, k_doc, q_first,
                                              q.shape[-1] ** -0.5, q_chunk, k_chunk)
    B, H, Q, Dh = q.shape
    return out.reshape(B, H, Q, Dh), lse.reshape(B, H, Q)


def document_prefix_attention_reference(q: Tensor, k: Tensor, v: Tensor, q_last: Tensor, q_doc: Tensor | None = None,
                                        k_doc: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Dense plain-autograd twin of `document_prefix_attention` (builds the [B, 1, Q, T] mask and scores)."""
    q_doc, q_last, k_doc, _ = _index_inputs(q, k, q_doc, q_last, k_doc, None)
    qg = _grouped(q, k)
    wide = torch.promote_types(q.dtype, torch.float32)
    mask = _visible(q_doc, q_last, k_doc, 0, q.shape[2], 0, k.shape[2])  # [B|1, 1, 1, Q, T]
    scores = (qg @ k[:, :, None].transpose(-1, -2)).to(wide) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~mask, float("-inf"))
    lse = scores.logsumexp(dim=-1)
    p = torch.exp(scores - lse.masked_fill(lse == float("-inf"), float("inf"))[..., None])
    out = (p.to(v.dtype) @ v[:, :, None]).reshape(q.shape)
    return out, lse.reshape(q.shape[:-1])


def merge_extra_keys(out_a: Tensor, lse_a: Tensor, scores: Tensor, values: list[Tensor]) -> Tensor:
    """Join an attention (out_a [..., Q, Dh] with its lse_a [..., Q]) and E more keys scored elsewhere (scores
    [..., Q, E], already scaled; values: E tensors broadcastable to out_a, one value per query) into one softmax
    over all keys, exactly: out = e^{lse_a - lse} out_a + Σ_e e^{s_e - lse} v_e, lse = logsumexp(lse_a, s_1..s_E).
    E small (a loop, no stacked copy of the values)."""
    lse = torch.cat([lse_a[..., None], scores.to(lse_a.dtype)], dim=-1).logsumexp(dim=-1)  # [..., Q]
    out = torch.exp(lse_a - lse).to(out_a.dtype)[..., None] * out_a
    for e, ve in enumerate(values):
        out = out + torch.exp(scores[..., e].to(lse.dtype) - lse).to(ve.dtype)[..., None] * ve
    return out


def merge_attention(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> Tensor:
    """One softmax over two disjoint key sets from the two partial attentions (out [..., Q, Dh], lse [..., Q]):
    out = e^{lse_a - lse} out_a + e^{lse_b - lse} out_b, lse = logaddexp(lse_a, lse_b). A side that saw no key
    (lse = -inf) drops out; the other must have seen one."""
    lse = torch.logaddexp(lse_a, lse_b.to(lse_a.dtype))
    return (torch.exp(lse_a - lse).to(out_a.dtype)[..., None] * out_a
            + torch.exp(lse_b.to(lse.dtype) - lse).to(out_b.dtype)[..., None] * out_b)


# ----- kernel choice: one switch for every attention call of a model (`set_attention_backend`) -----
#
#   sdpa    today's kernels: SDPA under a boolean [B, 1, T, S] mask for cached calls and document-masked
#           forwards, the tiled kernel above for the prefix patterns of training
#   native  cached calls (a decode or verify step: at most `NATIVE_MAX_NEW` new positions a row, fp32, on a CPU
#           where the native library is built: `models.few_rows`) through our kernel (`kernels/cached_attention.c`):
#           each row read only up to its own last slot, each kv head once for its query group, no mask; every
#           other call as sdpa
#   flex    FlexAttention (compiled) under a block mask built from per-row lengths / document ids: no dense
#           mask, no [T, S] scores, GQA native, empty tiles skipped; cached calls attend over the whole
#           capacity (static shapes), the block mask skips what no row reaches. Its backward needs a GPU.
#   expand  cached calls repeat the kv heads (K/V [B, H, S, Dh]) and pass the mask to SDPA: without
#           enable_gqa a fused memory-efficient kernel takes an arbitrary mask on CUDA
#   auto    flex on CUDA; native on a CPU where the native library is built, else sdpa (on a CPU the fastest
#           measured: `benchmarks/cached_attention.py`)
# A fresh prefill (every row empty, known on the host from kv_len <= T) runs SDPA with is_causal under
# every backend but flex: flash kernels take that without a mask.

ATTENTION_BACKENDS = ("auto", "sdpa", "native", "flex", "expand")
NATIVE_MAX_NEW = 64  # the most new positions a row of a cached call the native kernel takes (past that: sdpa)
FLEX_BLOCK = 128  # FlexAttention's tile (queries and keys)


def check_attention_backend(backend: str) -> str:
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend must be one of {', '.join(ATTENTION_BACKENDS)}, got {backend!r}")
    return backend


_default_backend = "auto"  # what a module's "auto" means (`set_default_attention_backend`)


def set_default_attention_backend(backend: str) -> None:
    """Make "auto" (every model's setting unless `set_attention_backend` chose another) mean `backend` in this
    process: a command's `--attention` (`models.device.Placement.use_attention`). "auto" restores the choice by
    device. A process-wide switch, like torch's own SDPA kernel switches: every model a command loads (the
    target, its drafter, a draft LM) then attends the same way."""
    global _default_backend
    _default_backend = check_attention_backend(backend)


def resolve_attention_backend(backend: str, device: torch.device) -> str:
    """"auto" -> the process default when one is set, else the backend for tensors on `device` (table above);
    any other name is returned checked."""
    check_attention_backend(backend)
    if backend == "auto":
        backend = _default_backend
    if backend == "auto":
        if device.type == "cuda":
            return "flex"
        return "native" if device.type == "cpu" and _native_attention() is not None else "sdpa"
    return backend


def _native_attention():
    """The native cached-attention op where its library is built (`models.few_rows`), else None."""
    from angelspec.models import few_rows

    return few_rows.attention_op()


def set_attention_backend(model: torch.nn.Module, backend: str) -> None:
    """Make every attention of `model` (and its submodules that choose one: the target, MTP / EAGLE-3 and
    block drafters) use `backend` (one of `ATTENTION_BACKENDS`)."""
    check_attention_backend(backend)
    for m in model.modules():
        if hasattr(m, "attn_backend"):
            m.attn_backend = backend


def cache_span(kv_len: int | None, capacity: int, backend: str, device: torch.device) -> int:
    """The slots a cached forward attends over: `kv_len` (the longest row's length after this call; None: all)
    clamped to the capacity, or the whole capacity under flex. There the block mask skips the slots no row has
    reached, so every decode and verify step has one shape and never reads `kv_len` (a compiled step then has
    one graph, which CUDA graphs can replay)."""
    if resolve_attention_backend(backend, device) == "flex" or kv_len is None:  # flex first: kv_len never read
        return capacity
    return min(kv_len, capacity)


_FLEX = None


def compiled_flex_attention():
    """torch.compile(flex_attention), built once: eager FlexAttention materialises the scores it exists to avoid."""
    global _FLEX
    if _FLEX is None:
        from torch.nn.attention.flex_attention import flex_attention
        _FLEX = torch.compile(flex_attention, dynamic=False)
    return _FLEX


def _blocks(x: Tensor, n: int, fill: int, reduce: str) -> Tensor:
    """x [B, L] -> [B, n] min or max over consecutive tiles of FLEX_BLOCK (padded with `fill`)."""
    pad = n * FLEX_BLOCK - x.shape[1]
    if pad:
        x = torch.cat([x, x.new_full((x.shape[0], pad), fill)], dim=1)
    x = x.view(x.shape[0], n, FLEX_BLOCK)
    return x.amin(-1) if reduce == "min" else x.amax(-1)


def prefix_block_mask(q_last: Tensor, num_keys: int, q_doc: Tensor | None = None, k_doc: Tensor | None = None,
                      q_first: Tensor | None = None, batch: int = 1):
    """A FlexAttention BlockMask of `visible(q, j) = k_doc[j] == q_doc[q] and j <= q_last[q]` (module docstring)
    built from the index tensors alone: per (query tile, key tile) whether some, all or no pair is visible, from
    the tiles' min / max of positions and document ids ([B, Q/128, S/128] ints; no [Q, S] tensor, no host
    sync). q_last [B|1, Q]; q_doc [B|1, Q], k_doc [B|1, S] (None: one document); q_first [B|1, Q] a lower bound
    on the first visible key (None: 0); batch: the attention's rows, when every index tensor broadcasts one row
    (the mask is evaluated per row of the attention)."""
    from torch.nn.attention.flex_attention import BlockMask

    q_doc, q_last, k_doc, q_first = _index_inputs_shapes(q_last, num_keys, q_doc, k_doc, q_first, batch)
    B, Q = q_last.shape
    big = torch.iinfo(torch.long).max // 2
    nq, nk = -(-Q // FLEX_BLOCK), -(-num_keys // FLEX_BLOCK)
    q_lo, q_hi = _blocks(q_first, nq, big, "min"), _blocks(q_last, nq, -big, "max")
    q_last_min = _blocks(q_last, nq, big, "min")
    qd_min, qd_max = _blocks(q_doc, nq, big, "min"), _blocks(q_doc, nq, -big, "max")
    kd_min, kd_max = _blocks(k_doc, nk, big, "min"), _blocks(k_doc, nk, -big, "max")
    j = torch.arange(nk, device=q_last.device)
    k_start, k_end = j * FLEX_BLOCK, torch.clamp((j + 1) * FLEX_BLOCK, max=num_keys) - 1  # [nk]
    any_ = ((k_start <= q_hi[..., None]) & (k_end >= q_lo[..., None])
            & (kd_min[:, None] <= qd_max[..., None]) & (kd_max[:, None] >= qd_min[..., None]))  # [B, nq, nk]
    one_doc = (qd_min == qd_max)[..., None] & (kd_min == kd_max)[:, None] & (qd_min[..., None] == kd_min[:, None])
    full = any_ & one_doc & (k_end <= q_last_min[..., None]) & ((j + 1) * FLEX_BLOCK <= num_keys)
    part = any_ & ~full

    def packed(sel: Tensor) -> tuple[Tensor, Tensor]:
        num = sel.sum(-1, dtype=torch.int32)[:, None]  # [B, 1, nq]
        idx = torch.argsort((~sel).to(torch.int8), dim=-1, stable=True).to(torch.int32)[:, None]  # selected first
        return num.contiguous(), idx.contiguous()

    (kv_num, kv_idx), (full_num, full_idx) = packed(part), packed(full)
    last_max, doc = Q - 1, q_doc is not None

    def mask_mod(b, h, q_idx, kv_idx):
        qi, ki = q_idx.clamp(max=last_max), kv_idx.clamp(max=num_keys - 1)
        return (ki <= q_last[b, qi]) & (k_doc[b, ki] == q_doc[b, qi]) if doc else ki <= q_last[b, qi]

    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=FLEX_BLOCK, mask_mod=mask_mod,
                                    seq_lengths=(Q, num_keys))


def _index_inputs_shapes(q_last: Tensor, num_keys: int, q_doc: Tensor | None, k_doc: Tensor | None,
                         q_first: Tensor | None, batch: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """`_index_inputs` for the block mask: every index tensor at the same batch size B (broadcast rows expanded)."""
    if (q_doc is None) != (k_doc is None):
        raise ValueError("pass both q_doc and k_doc, or neither")
    dev, Q = q_last.device, q_last.shape[-1]
    if q_doc is None or k_doc is None:
        q_doc = torch.zeros(1, Q, dtype=torch.long, device=dev)
        k_doc = torch.zeros(1, num_keys, dtype=torch.long, device=dev)
    q_first = torch.zeros_like(q_last) if q_first is None else q_first
    B = max(batch, *(x.shape[0] for x in (q_last, q_doc, k_doc, q_first)))
    return tuple(x.long().expand(B, x.shape[-1]) for x in (q_doc, q_last, k_doc, q_first))  # type: ignore[return-value]


def grouped_query(q: Tensor, k: Tensor) -> bool:
    """Whether q [B, H, ...] has more heads than k [B, Hkv, ...] (SDPA's / FlexAttention's enable_gqa), as a plain
    bool: compiled with dynamic shapes the head counts are symbolic, and a symbolic bool is refused by SDPA (a graph
    break in every layer of a compiled forward). Branching on it makes the compiler guard on the comparison and hand
    back a constant; `bool(...)` would keep it symbolic."""
    if q.shape[1] != k.shape[1]:
        return True
    return False


def flex_prefix_attention(q: Tensor, k: Tensor, v: Tensor, block_mask, *, lse: bool = False
                          ) -> Tensor | tuple[Tensor, Tensor]:
    """Compiled FlexAttention of q [B, H, Q, Dh] over k, v [B, Hkv, S, Dh] under `block_mask` (GQA native) ->
    out [B, H, Q, Dh] (and lse [B, H, Q] fp32 with lse=True; out = 0, lse = -inf where a query sees no key)."""
    from torch.nn.attention.flex_attention import AuxRequest, flex_attention

    gqa = grouped_query(q, k)
    if not lse:
        return compiled_flex_attention()(q, k, v, block_mask=block_mask, enable_gqa=gqa)
    # The CPU lowering of the compiled kernel takes neither the LSE nor a backward: there the eager FlexAttention
    # evaluates the same block mask (dense scores, for checking the pattern; use the tiled kernel to train on a CPU).
    aux_lse = AuxRequest(lse=True)
    if q.device.type == "cpu":
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            out, aux = flex_attention(q, k, v, block_mask=block_mask, enable_gqa=gqa, return_aux=aux_lse)
        return out, aux.lse
    out, aux = compiled_flex_attention()(q, k, v, block_mask=block_mask, enable_gqa=gqa, return_aux=aux_lse)
    return out, aux.lse


@dataclass(frozen=True)
class AttentionPlan:
    """How one forward's queries see their keys, built once per forward and handed to every layer (in place of
    the boolean mask): `kind` is "causal" (SDPA is_causal), "mask" (SDPA under `mask`), "expand" (the same with
    the kv heads repeated), "flex" (FlexAttention under `block_mask`) or "rows" (the native kernel: query t of row b
    sees slots <= `start[b]` + t; SDPA under that mask where the kernel cannot take the call); `kv_len` slices a
    cache's slots (None: the keys as given)."""

    kind: str
    kv_len: int | None = None
    mask: Tensor | None = None  # [B, 1, T, S] bool (True = attend)
    block_mask: object | None = None  # a FlexAttention BlockMask
    start: Tensor | None = None  # "rows": each row's first new slot [B]

    @classmethod
    def cached(cls, start: Tensor, T: int, kv_len: int, capacity: int, backend: str, fresh: bool,
               dtype: torch.dtype = torch.float32) -> AttentionPlan:
        """T new queries per row at slots start[b] + t [B] over a static cache of `dtype`: each sees slots <= its own.
        `fresh` (host-side: every row starts empty) takes SDPA's is_causal; flex attends over the whole
        capacity (one shape for every step, the block mask skips the slots no row has reached); native takes the
        kernel where it can (decided here, once a forward, not per layer)."""
        kind = resolve_attention_backend(backend, start.device)
        if fresh:
            return cls("causal", kv_len)
        if kind == "flex":
            slots = start[:, None] + torch.arange(T, device=start.device)  # [B, T]
            return cls("flex", capacity, block_mask=prefix_block_mask(slots, capacity, batch=start.shape[0]))
        if (kind == "native" and T <= NATIVE_MAX_NEW and start.device.type == "cpu" and dtype == torch.float32
                and _native_attention() is not None):
            return cls("rows", kv_len, start=start)
        return cls("mask" if kind in ("sdpa", "native") else kind, kv_len, mask=_cached_mask(start, T, kv_len))

    @classmethod
    def documents(cls, document_ids: Tensor | None, backend: str) -> AttentionPlan:
        """A cache-free forward over packed rows: causal within each document (document_ids [B, T]; None: causal)."""
        if document_ids is None:
            return cls("causal")
        kind = resolve_attention_backend(backend, document_ids.device)
        T = document_ids.shape[1]
        if kind == "native":
            kind = "sdpa"
        if kind == "flex":
            q_last = torch.arange(T, device=document_ids.device)[None]
            first = document_first_index(document_ids)
            return cls("flex", block_mask=prefix_block_mask(q_last, T, document_ids, document_ids, first,
                                                            document_ids.shape[0]))
        causal = torch.ones(T, T, dtype=torch.bool, device=document_ids.device).tril()
        same_doc = document_ids[:, :, None] == document_ids[:, None, :]  # [B, T, T]
        return cls("mask" if kind == "sdpa" else kind, mask=(same_doc & causal)[:, None])

    def __call__(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """q [B, H, T, Dh], k, v [B, Hkv, S, Dh] (a cache's whole buffers, or this call's keys) -> [B, H, T, Dh]."""
        if self.kv_len is not None:
            k, v = k[:, :, :self.kv_len], v[:, :, :self.kv_len]
        gqa = grouped_query(q, k)
        if self.kind == "flex":
            return flex_prefix_attention(q, k, v, self.block_mask)  # type: ignore[return-value]
        mask = self.mask
        if self.kind == "rows":
            assert self.start is not None
            op = _native_attention()
            # (the kernel has no backward: a call that needs gradients takes SDPA, as does one whose tensors are not
            # the fp32 the plan was built for)
            grads = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
            if op is not None and not grads and q.dtype == k.dtype == v.dtype == torch.float32:
                return op(q, k, v, self.start, q.shape[-1] ** -0.5)
            mask = _cached_mask(self.start, q.shape[2], k.shape[2])
        if self.kind == "expand" and gqa:
            g = q.shape[1] // k.shape[1]
            k, v, gqa = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1), False
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=self.kind == "causal",
                                              enable_gqa=gqa)


def _cached_mask(start: Tensor, T: int, kv_len: int) -> Tensor:
    """[B, 1, T, kv_len] bool: query t of row b sees slots <= start[b] + t."""
    slots = start[:, None] + torch.arange(T, device=start.device)  # [B, T]
    key_pos = torch.arange(kv_len, device=start.device)
    return (key_pos[None, None, :] <= slots[:, :, None])[:, None]
