"""Training-Time Test rollout of the shared MTP block over a whole packed sequence (report §2.2, §6.1).

It serves every member of the MTP family (`models.mtp.MTPDraftModel` and subclasses such as EAGLE-3's
`Eagle3DraftModel`): the block maps the target taps to h^(-1) (`block.condition`) and the depth input (h, x̃) to its
decoder layer's residual stream and attention input (`block.layer_inputs`); the rollout owns the rest.

What each depth sees and predicts (report §2.3; `data.packing.label_offset(k, "mtp") = k + 2`)
-------------------------------------------------------------------------------------------------
At sequence position i and zero-based depth k the block predicts token x_{i+k+2}:

* depth 0 fuses the target tap h_i (EAGLE-3: fc over three taps) with E(x_{i+1}) (Eq. 1) — the same input
  as at inference;
* depth k >= 1 fuses the block's own h^(k-1)_i with E(x̂), where x̂ = argmax q_{k-1}(·|i) is depth k-1's
  prediction of x_{i+k+1} (the TTT self-conditioned input; teacher forcing would feed x_{i+k+1});
* the teacher of depth k at i is the frozen target's distribution at position i+k+1 (which predicts
  x_{i+k+2}), and the label/validity come from `mtp_labels(packed, k)`: valid only if x_{i+k+2} is in the
  same document as i and trained on (the depth-shift document gate, docs/design.md trap 3).

The depth-0 input x_{i+1} at a document's last token would belong to the next document; it is replaced by
`pad_id` (that position has no valid label at any depth, but its key would still carry the other
document's token into the own row's attention — the gate keeps even unsupervised state document-local).

Attention pattern (the "causal prefix plus diagonal draft keys")
---------------------------------------------------------------
Depth k's query at position i attends to
  (a) the depth-0 keys at positions j <= i of the same document — the committed draft KV of inference;
  (b) the keys of depths 1..k at the SAME position i — the draft chain grown during this drafting round.
RoPE position of depth k at i is p_i + k (document-local p), as for the k-th entry of an inference round.

Fast path (`ttt_attention`): (a) is one batched matmul per depth against the shared depth-0 keys with the
[B, 1, T, T] document gate (broadcast over heads and GQA groups), a masked logsumexp and a second matmul
(`_PrefixAttention`, which returns the prefix LSE; SDPA is not used here because it does not return the
log-sum-exp, let alone differentiably, and the merge needs both); (b) is k per-position dot products ([B, H, T] each);
the two are merged exactly with logsumexp:
    out = e^{lse_a - lse} out_a + Σ_j e^{s_j - lse} v_j,    lse = logsumexp(lse_a, s_1, ..., s_k).
Cost per depth: O(B·H·T²·Dh/2) flops for (a) (query chunks skip the causally masked key blocks),
O(B·H·T·Dh·k) for (b). Memory: scores exist only transiently, [B, H, query_chunk, T] at a time, in the
forward and again in the backward, which recomputes them flash-style; autograd keeps O(B·H·T·Dh) per
depth. No D×T×T (let alone (D·T)²) mask exists: the only mask is the [B, 1, T, T] document gate, shared
by all depths (a fused kernel with a differentiable LSE, e.g. compiled FlexAttention, would drop the
transient scores and the gate too). `benchmarks/ttt_memory.py` measures all of this.

Slow reference (`ttt_attention_reference`): builds the full (D·T)×(D·T) boolean mask of the pattern
(`ttt_reference_mask`) and runs plain SDPA over the concatenated keys; tests check both agree.

Shape legend: B batch rows, T time, D depths, C model dim, V vocab, H heads, Hkv kv heads, G = H/Hkv,
Dh head dim, N = B·T flattened positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from angelspec.data.packing import PAD_DOCUMENT_ID, PackedBatch, attention_gate, mtp_labels
from angelspec.models.mtp import MTPDraftModel
from angelspec.train.losses import LossBatch

AttentionImpl = Literal["fast", "reference"]


@dataclass
class TTTOutput:
    logits: Tensor | None  # [B, T, D, V] fp32 student logits (depth k at i predicts x_{i+k+2}); None if not kept
    inputs: Tensor  # [B, T, D] int64, the token x̃_k fused at each depth (x_{i+1}, then argmaxes)
    hidden: Tensor  # [B, T, D, C] h^(k), the block's output per depth


def depth0_inputs(input_ids: Tensor, document_ids: Tensor | None, pad_id: int) -> Tensor:
    """x_{i+1} when it is in the same document as i, else `pad_id`: [B, T] -> [B, T]."""
    nxt = torch.full_like(input_ids, pad_id)
    nxt[:, :-1] = input_ids[:, 1:]
    if document_ids is not None:
        same = torch.zeros_like(input_ids, dtype=torch.bool)
        same[:, :-1] = (document_ids[:, 1:] == document_ids[:, :-1]) & (document_ids[:, :-1] != PAD_DOCUMENT_ID)
        nxt = torch.where(same, nxt, pad_id)
    return nxt


class _PrefixAttention(torch.autograd.Function):
    """Causal-prefix attention that also returns its log-sum-exp, in query chunks, with a flash-style backward.

    Forward, per chunk of `chunk` queries [s0, s1): scores against keys 0..s1-1 (later keys are causally
    masked anyway) -> masked LSE -> p = exp(scores - lse) -> out = p @ v. Only q, k, v, the gate, lse and out
    are saved (O(T·Dh) each); the backward recomputes p chunk by chunk, so the largest transient is
    [B, H, chunk, T] and no [T, T] tensor outlives its chunk:
        dv = pᵀ g_out,   ds = p ⊙ (g_out vᵀ − rowsum(g_out ⊙ out) + g_lse),   dq = ds k·s,   dk = dsᵀ q·s
    (the + g_lse term is ∂lse/∂scores = p). `prefix_attention_reference` is the plain-autograd twin."""

    @staticmethod
    def forward(ctx, qg: Tensor, k: Tensor, v: Tensor, gate: Tensor, scale: float, chunk: int
                ) -> tuple[Tensor, Tensor]:
        # qg [B, Hkv, G, T, Dh]; k, v [B, Hkv, 1, T, Dh]; gate [B|1, 1, 1, T, T] bool
        T = qg.shape[-2]
        outs, lses = [], []
        for s0 in range(0, T, chunk):
            s1 = min(s0 + chunk, T)
            p = (qg[..., s0:s1, :] @ k[..., :s1, :].transpose(-1, -2)).mul_(scale)  # [B, Hkv, G, c, s1]
            p.masked_fill_(~gate[..., s0:s1, :s1], float("-inf"))
            lse = p.logsumexp(dim=-1)  # [B, Hkv, G, c]; every row sees its own key, so finite
            outs.append(p.sub_(lse[..., None]).exp_() @ v[..., :s1, :])
            lses.append(lse)
        out, lse = torch.cat(outs, dim=-2), torch.cat(lses, dim=-1)
        ctx.save_for_backward(qg, k, v, gate, lse, out)
        ctx.scale, ctx.chunk = scale, chunk
        return out, lse

    @staticmethod
    def backward(ctx, g_out: Tensor, g_lse: Tensor) -> tuple[Tensor, Tensor, Tensor, None, None, None]:
        qg, k, v, gate, lse, out = ctx.saved_tensors
        sc, T = ctx.scale, qg.shape[-2]
        dq, dk, dv = torch.empty_like(qg), torch.zeros_like(k), torch.zeros_like(v)
        for s0 in range(0, T, ctx.chunk):
            s1 = min(s0 + ctx.chunk, T)
            q_c, k_c, v_c, g_c = qg[..., s0:s1, :], k[..., :s1, :], v[..., :s1, :], g_out[..., s0:s1, :]
            p = (q_c @ k_c.transpose(-1, -2)).mul_(sc).masked_fill_(~gate[..., s0:s1, :s1], float("-inf"))
            p = p.sub_(lse[..., s0:s1, None]).exp_()  # [B, Hkv, G, c, s1]
            dv[..., :s1, :] += (p.transpose(-1, -2) @ g_c).sum(dim=2, keepdim=True)
            delta = (g_c * out[..., s0:s1, :]).sum(dim=-1, keepdim=True)  # [B, Hkv, G, c, 1]
            ds = (g_c @ v_c.transpose(-1, -2)).sub_(delta).add_(g_lse[..., s0:s1, None]).mul_(p)
            del p
            dq[..., s0:s1, :] = (ds @ k_c).mul_(sc)
            dk[..., :s1, :] += (ds.transpose(-1, -2) @ q_c).sum(dim=2, keepdim=True).mul_(sc)
        return dq, dk, dv, None, None, None


def prefix_attention_reference(qg: Tensor, k: Tensor, v: Tensor, gate: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """Plain-autograd twin of `_PrefixAttention` (keeps the [T, T] scores and probabilities for backward)."""
    scores = (qg @ k.transpose(-1, -2) * scale).masked_fill(~gate, float("-inf"))
    lse = scores.logsumexp(dim=-1)
    return torch.exp(scores - lse[..., None]) @ v, lse


def ttt_attention(q: Tensor, k0: Tensor, v0: Tensor, diag_k: list[Tensor], diag_v: list[Tensor],
                  gate: Tensor | None, query_chunk: int = 256) -> Tensor:
    """Fast TTT attention of one depth (module docstring).

    q [B, H, T, Dh]; k0, v0 [B, Hkv, T, Dh] depth-0 keys/values; diag_k/diag_v: depths 1..k, each
    [B, Hkv, T, Dh]; gate [B, 1, T, T] bool (True = attend; None = plain causal) -> [B, H, T, Dh].
    `query_chunk` bounds the transient scores to [B, H, query_chunk, T]."""
    B, H, T, Dh = q.shape
    Hkv = k0.shape[1]
    G = H // Hkv
    scale = Dh ** -0.5
    qg = q.reshape(B, Hkv, G, T, Dh)  # query heads grouped under their kv head (GQA)
    if gate is None:
        gate = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()[None, None]
    out, lse_a = _PrefixAttention.apply(qg, k0[:, :, None], v0[:, :, None], gate[:, :, None], scale, query_chunk)
    if diag_k:
        s = torch.stack([(qg * kj[:, :, None]).sum(-1) * scale for kj in diag_k], dim=-1)  # [B, Hkv, G, T, k]
        lse = torch.cat([lse_a[..., None], s], dim=-1).logsumexp(dim=-1)  # [B, Hkv, G, T]
        out = torch.exp(lse_a - lse)[..., None] * out
        for j, vj in enumerate(diag_v):
            out = out + torch.exp(s[..., j] - lse)[..., None] * vj[:, :, None]
    return out.reshape(B, H, T, Dh)


def ttt_reference_mask(document_ids: Tensor | None, batch: int, T: int, num_depths: int,
                       device: torch.device | None = None) -> Tensor:
    """The full TTT pattern as a (D·T)×(D·T) mask, [B, 1, D·T, D·T] bool; index k·T + i = depth k, position i.

    Query (k, i) sees key (0, j) iff j <= i in the same document, and key (j', i) for 1 <= j' <= k."""
    if document_ids is None:
        gate = torch.ones(T, T, dtype=torch.bool, device=device).tril().expand(batch, 1, T, T)
    else:
        gate = attention_gate(document_ids)  # [B, 1, T, T]
    eye = torch.eye(T, dtype=torch.bool, device=gate.device)
    D = num_depths
    full = torch.zeros(gate.shape[0], 1, D * T, D * T, dtype=torch.bool, device=gate.device)
    for k in range(D):
        full[:, :, k * T:(k + 1) * T, :T] = gate
        for j in range(1, k + 1):
            full[:, :, k * T:(k + 1) * T, j * T:(j + 1) * T] = eye
    return full


def ttt_attention_reference(q: Tensor, keys: list[Tensor], values: list[Tensor], full_mask: Tensor,
                            depth: int) -> Tensor:
    """Slow reference: plain SDPA of depth `depth`'s queries over all keys of depths 0..depth, masked by
    rows depth·T..(depth+1)·T of the explicit (D·T)×(D·T) mask. q [B, H, T, Dh]; keys/values one
    [B, Hkv, T, Dh] per depth 0..depth -> [B, H, T, Dh]."""
    T = q.shape[2]
    k_all, v_all = torch.cat(keys, dim=2), torch.cat(values, dim=2)  # [B, Hkv, (depth+1)·T, Dh]
    mask = full_mask[:, :, depth * T:(depth + 1) * T, :(depth + 1) * T]
    return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, enable_gqa=q.shape[1] != k_all.shape[1])


def ttt_rollout(block: MTPDraftModel, hidden: Tensor, input_ids: Tensor, positions: Tensor,
                document_ids: Tensor | None, num_depths: int, *, pad_id: int = 0,
                attention: AttentionImpl = "fast", keep_logits: bool = True,
                checkpoint_depths: bool = False, query_chunk: int = 256) -> TTTOutput:
    """Unroll the shared block for `num_depths` depths over packed rows (module docstring).

    hidden [B, T, n·Ct] target taps joined by `concat_taps` (detached here: the target is frozen; the block's
    `condition` maps them to h^(-1) [B, T, C], with gradient into its own weights); input_ids, positions,
    document_ids [B, T] (document-local positions; ids None = one document per row).
    keep_logits=False computes each depth's logits only for the argmax (no grad, freed at once) and
    returns logits=None: a caller that applies the head itself, e.g. chunk-wise from `hidden`, then never
    holds D×T×V logits.
    checkpoint_depths=True recomputes each depth's block activations in the backward (activation
    checkpointing per depth): autograd then keeps only each depth's inputs, output and k/v, so training
    memory of the block stays near one depth's instead of growing D-fold; costs one more block forward
    per depth. `query_chunk` bounds the transient attention scores and argmax logits to that many positions."""
    if hidden.dim() != 3 or input_ids.shape != hidden.shape[:2] or positions.shape != input_ids.shape:
        raise ValueError(f"hidden must be [B, T, C] with input_ids/positions [B, T], got {tuple(hidden.shape)}, "
                         f"{tuple(input_ids.shape)}, {tuple(positions.shape)}")
    if num_depths < 1:
        raise ValueError(f"num_depths must be >= 1, got {num_depths}")
    B, T, _ = hidden.shape
    gate = None if document_ids is None else attention_gate(document_ids)  # [B, 1, T, T]
    full_mask = ttt_reference_mask(document_ids, B, T, num_depths, hidden.device) if attention == "reference" \
        else None
    attn = block.layer.attn

    def depth_step(h_prev: Tensor, tok: Tensor, k: int, prev_k: list[Tensor], prev_v: list[Tensor]
                   ) -> tuple[Tensor, Tensor, Tensor]:
        """Depth k: the block's fusion, attention over depth-0 prefix + diagonal keys, rest of Eq. 2 -> (h, k, v)."""
        x, attn_in = block.layer_inputs(h_prev, tok)  # residual [B, T, C], attention input [B, T, C_in]
        cos, sin = block.rope(positions + k, x.dtype)
        q, kk, vv = attn.project(attn_in, cos, sin)
        ks, vs = [*prev_k, kk], [*prev_v, vv]
        if full_mask is None:
            a = ttt_attention(q, ks[0], vs[0], ks[1:], vs[1:], gate, query_chunk)
        else:
            a = ttt_attention_reference(q, ks, vs, full_mask, k)
        return block.attend_out(x, a), kk, vv

    h_prev, tok = block.condition(hidden.detach()), depth0_inputs(input_ids, document_ids, pad_id)
    keys: list[Tensor] = []
    values: list[Tensor] = []
    inputs, states = [], []
    # Written depth by depth into one buffer: stacking a list would hold two copies of D×T×V at the end.
    logits = hidden.new_empty(B, T, num_depths, block.config.vocab_size, dtype=torch.float32) if keep_logits \
        else None
    for k in range(num_depths):
        if checkpoint_depths and torch.is_grad_enabled():
            h, kk, vv = checkpoint(depth_step, h_prev, tok, k, list(keys), list(values), use_reentrant=False)
        else:
            h, kk, vv = depth_step(h_prev, tok, k, keys, values)
        keys.append(kk)
        values.append(vv)
        nxt = tok
        if logits is not None:
            lg = block.logits(h)  # [B, T, V]
            logits[:, :, k] = lg
            nxt = lg.detach().argmax(dim=-1)
        elif k < num_depths - 1:
            with torch.no_grad():  # chunked: never a whole [B, T, V] just for an argmax
                nxt = torch.cat([block.logits(hc).argmax(dim=-1) for hc in h.split(query_chunk, dim=1)], dim=1)
        inputs.append(tok)
        states.append(h)
        h_prev, tok = h, nxt  # depth k+1 consumes depth k's argmax (TTT)
    return TTTOutput(logits=logits, inputs=torch.stack(inputs, dim=2), hidden=torch.stack(states, dim=2))


def teacher_for_depths(target_logits: Tensor, num_depths: int) -> Tensor:
    """Teacher of depth k at i = target logits at i+k+1 (they predict x_{i+k+2}): [B, T, V] -> [B, T, D, V].

    Positions past the row end are zero-filled; their labels are invalid in `mtp_loss_batch`."""
    B, T, V = target_logits.shape
    out = target_logits.new_zeros(B, T, num_depths, V)
    for k in range(num_depths):
        s = k + 1
        if s < T:
            out[:, :T - s, k] = target_logits[:, s:]
    return out


def mtp_loss_batch(out: TTTOutput, packed: PackedBatch, target_logits: Tensor | None) -> LossBatch:
    """Flatten a rollout into the `[N, D, V]` layout of `train.losses` with the depth-shift gate."""
    if out.logits is None:
        raise ValueError("mtp_loss_batch needs a rollout run with keep_logits=True")
    B, T, D, V = out.logits.shape
    labels, valid = zip(*(mtp_labels(packed, k) for k in range(D)), strict=True)
    lab = torch.stack(labels, dim=-1).to(out.logits.device)  # [B, T, D]
    mask = torch.stack(valid, dim=-1).to(out.logits.device)  # [B, T, D]
    teacher = None if target_logits is None else teacher_for_depths(target_logits, D).reshape(B * T, D, V)
    return LossBatch(student_logits=out.logits.reshape(B * T, D, V), mask=mask.reshape(B * T, D),
                     teacher_logits=teacher, labels=lab.clamp_min(0).reshape(B * T, D))
