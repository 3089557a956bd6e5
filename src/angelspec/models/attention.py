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

import torch
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
                              q_chunk: int | None = None, k_chunk: int | None = None) -> tuple[Tensor, Tensor]:
    """Attention of q over the keys each query may see (module docstring), with its log-sum-exp.

    q [B, H, Q, Dh]; k, v [B, Hkv, T, Dh]; q_last [B|1, Q] the last key index each query may see; q_doc [B|1, Q]
    and k_doc [B|1, T] document ids (None: one document); q_first [B|1, Q] a lower bound on the first visible key
    (only used to skip tiles; None = 0); tiles of q_chunk × k_chunk (None: `DEFAULT_Q_CHUNK`, `DEFAULT_K_CHUNK`,
    read at call time). -> (out [B, H, Q, Dh], lse [B, H, Q] in fp32 or wider; out = 0 and lse = -inf where a
    query sees no key). Scale 1/sqrt(Dh)."""
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
