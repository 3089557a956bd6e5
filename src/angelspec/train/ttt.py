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
  prediction of x_{i+k+1} (the TTT self-conditioned input; teacher forcing would feed x_{i+k+1}); under
  train_vocab "draft" q covers the block's draft vocabulary only, so x̂ is a token inference could propose;
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

Fast path (`ttt_attention`): (a) is `models.attention.document_prefix_attention` against the shared depth-0
keys: tiles of query_chunk × key_chunk scores, the document mask rebuilt per tile from the document ids (no
[T, T] mask), an online softmax, and the prefix LSE as a differentiable output (SDPA is not used here because it
does not return the log-sum-exp, let alone differentiably, and the merge needs both); (b) is k per-position dot
products ([B, H, T] each); the two are merged exactly with logsumexp (`merge_extra_keys`):
    out = e^{lse_a - lse} out_a + Σ_j e^{s_j - lse} v_j,    lse = logsumexp(lse_a, s_1, ..., s_k).
Cost per depth: O(B·H·Σ_d L_d²·Dh) flops for (a) (tiles outside a query block's document-and-causal key range
are skipped), O(B·H·T·Dh·k) for (b). Memory: scores exist only transiently, one [B, H, query_chunk, key_chunk]
tile at a time, in the forward and again in the backward, which recomputes them flash-style; autograd keeps
O(B·H·T·Dh) per depth. No tensor is [T, T], let alone D×T×T or (D·T)².

Training step in memory linear in T (docs/design.md "Memory linear in T"): `ttt_rollout` with
`RolloutMemory(keep_logits=False, checkpoint_depths=True)` (each depth recomputed in the backward) +
`mtp_chunked_loss_batch` (the LM head and the loss a chunk of positions at a time, recomputed in the backward).
`benchmarks/ttt_memory.py` measures it.

Slow reference (`ttt_attention_reference`): builds the full (D·T)×(D·T) boolean mask of the pattern
(`ttt_reference_mask`) and runs plain SDPA over the concatenated keys; tests check both agree.

Shape legend: B batch rows, T time, D depths, C model dim, V vocab, H heads, Hkv kv heads, G = H/Hkv,
Dh head dim, N = B·T flattened positions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from angelspec.data.packing import PAD_DOCUMENT_ID, PackedBatch, attention_gate, mtp_labels
from angelspec.models.attention import (
    document_first_index,
    document_prefix_attention,
    grouped_query,
    merge_extra_keys,
)
from angelspec.models.mtp import MTPDraftModel
from angelspec.train.losses import (
    ChunkedLossBatch,
    LossBatch,
    Teacher,
    TeacherHead,
    draft_space_teacher,
    loss_chunk_logits,
    teacher_logits,
)
from angelspec.train.sequence_parallel import SequenceParallel

AttentionImpl = Literal["fast", "reference"]


@dataclass
class TTTOutput:
    logits: Tensor | None  # [B, T, D, V] fp32 student logits (depth k at i predicts x_{i+k+2}); None if not kept
    inputs: Tensor  # [B, T, D] int64, the token x̃_k fused at each depth (x_{i+1}, then argmaxes)
    states: tuple[Tensor, ...]  # D × [B, T, C] h^(k), the block's output per depth (not stacked: no copy)

    @property
    def hidden(self) -> Tensor:
        """[B, T, D, C] h^(k) stacked (a copy)."""
        return torch.stack(self.states, dim=2)


def depth0_inputs(input_ids: Tensor, document_ids: Tensor | None, pad_id: int) -> Tensor:
    """x_{i+1} when it is in the same document as i, else `pad_id`: [B, T] -> [B, T]."""
    nxt = torch.full_like(input_ids, pad_id)
    nxt[:, :-1] = input_ids[:, 1:]
    if document_ids is not None:
        same = torch.zeros_like(input_ids, dtype=torch.bool)
        same[:, :-1] = (document_ids[:, 1:] == document_ids[:, :-1]) & (document_ids[:, :-1] != PAD_DOCUMENT_ID)
        nxt = torch.where(same, nxt, pad_id)
    return nxt


def ttt_attention(q: Tensor, k0: Tensor, v0: Tensor, diag_k: list[Tensor], diag_v: list[Tensor],
                  document_ids: Tensor | None, document_first: Tensor | None = None, query_chunk: int = 256,
                  key_chunk: int = 1024, backend: str = "auto") -> Tensor:
    """Fast TTT attention of one depth (module docstring).

    q [B, H, T, Dh]; k0, v0 [B, Hkv, T, Dh] depth-0 keys/values; diag_k/diag_v: depths 1..k, each
    [B, Hkv, T, Dh]; document_ids [B, T] (None = plain causal) and their `document_first_index` (computed here
    when None) -> [B, H, T, Dh]. The prefix part is `models.attention.document_prefix_attention` (tiles of
    `query_chunk` × `key_chunk`, no [T, T] tensor; or FlexAttention under a block mask with backend "flex", the
    GPU's default); the diagonal keys join it by `merge_extra_keys`."""
    B, H, T, Dh = q.shape
    Hkv = k0.shape[1]
    if document_ids is not None and document_first is None:
        document_first = document_first_index(document_ids)
    q_last = torch.arange(T, device=q.device)[None]
    out, lse_a = document_prefix_attention(q, k0, v0, q_last, document_ids, document_ids, document_first,
                                           q_chunk=query_chunk, k_chunk=max(key_chunk, query_chunk), backend=backend)
    if not diag_k:
        return out
    qg = q.reshape(B, Hkv, H // Hkv, T, Dh)  # query heads grouped under their kv head (GQA)
    s = torch.stack([(qg * kj[:, :, None]).sum(-1) * Dh ** -0.5 for kj in diag_k], dim=-1)  # [B, Hkv, G, T, k]
    merged = merge_extra_keys(out.reshape(B, Hkv, H // Hkv, T, Dh), lse_a.reshape(B, Hkv, H // Hkv, T), s,
                              [vj[:, :, None] for vj in diag_v])
    return merged.reshape(B, H, T, Dh)


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
    return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, enable_gqa=grouped_query(q, k_all))


@dataclass(frozen=True)
class RolloutMemory:
    """How `ttt_rollout` trades compute for memory: `keep_logits`, `checkpoint_depths`, and the attention and argmax
    tiles `query_chunk` × `key_chunk` (`ttt_rollout`'s docstring)."""

    keep_logits: bool = True
    checkpoint_depths: bool = False
    query_chunk: int = 256
    key_chunk: int = 1024


def ttt_rollout(block: MTPDraftModel, hidden: Tensor, input_ids: Tensor, positions: Tensor,
                document_ids: Tensor | None, num_depths: int, *, pad_id: int = 0,
                attention: AttentionImpl = "fast", memory: RolloutMemory = RolloutMemory(),
                sp: SequenceParallel | None = None, train_vocab: str = "full") -> TTTOutput:
    """Unroll the shared block for `num_depths` depths over packed rows (module docstring).

    hidden [B, T, n·Ct] target taps joined by `concat_taps` (detached here: the target is frozen; the block's
    `condition` maps them to h^(-1) [B, T, C], with gradient into its own weights); input_ids, positions,
    document_ids [B, T] (document-local positions; ids None = one document per row).
    `memory` (`RolloutMemory`): keep_logits=False computes each depth's logits only for the argmax (no grad, freed at
    once) and returns logits=None: a caller that applies the head itself, e.g. chunk-wise from `hidden`, then never
    holds D×T×V logits.
    checkpoint_depths=True recomputes each depth's block activations in the backward (activation
    checkpointing per depth, in two pieces: fusion + attention, then the MLP): autograd then keeps only each
    depth's inputs, its attention residual, output and k/v, so training memory of the block stays near half a
    depth's activations instead of growing D-fold; costs one more block forward per depth. `query_chunk` ×
    `key_chunk` bounds the transient attention scores, `query_chunk` positions the argmax logits.
    `sp` (sequence parallelism, `train.sequence_parallel`): `hidden` holds only this rank's shard of the rows
    ([B, T/N, C]; input_ids, positions, document_ids stay whole rows), every per-position step runs on the shard,
    and each depth's attention runs head-sharded over the whole rows between two all-to-alls; the output covers
    the shard.
    `train_vocab` "draft": the head scores the block's draft vocabulary only (`block.draft_head`): kept logits are
    [B, T, D, V'] and each depth's argmax is taken over V' and mapped back to target ids (`block.to_target_ids`)."""
    keep_logits, checkpoint_depths = memory.keep_logits, memory.checkpoint_depths
    query_chunk, key_chunk = memory.query_chunk, memory.key_chunk
    sp = sp if sp is not None and sp.enabled else None
    draft = train_vocab == "draft"
    head = block.draft_head if draft else block.logits

    def to_ids(index: Tensor) -> Tensor:
        """An argmax along the head's logits -> target token ids."""
        return block.to_target_ids(index) if draft else index

    B, T = input_ids.shape
    cols = slice(0, T) if sp is None else sp.columns(T)
    if hidden.dim() != 3 or hidden.shape[:2] != (B, cols.stop - cols.start) or positions.shape != input_ids.shape:
        raise ValueError(f"hidden must be [B, T, C] (the shard's [B, T/N, C] under sequence parallelism) with "
                         f"input_ids/positions [B, T], got {tuple(hidden.shape)}, {tuple(input_ids.shape)}, "
                         f"{tuple(positions.shape)}")
    if num_depths < 1:
        raise ValueError(f"num_depths must be >= 1, got {num_depths}")
    first = None if document_ids is None else document_first_index(document_ids)  # [B, T] document starts
    full_mask = ttt_reference_mask(document_ids, B, T, num_depths, hidden.device) if attention == "reference" \
        else None
    attn = block.layer.attn
    own_positions = positions[:, cols]

    def attention_step(h_prev: Tensor, tok: Tensor, k: int, prev_k: list[Tensor], prev_v: list[Tensor]
                       ) -> tuple[Tensor, Tensor, Tensor]:
        """Depth k up to its attention residual: the block's fusion, attention over depth-0 prefix + diagonal
        keys -> (x [B, T, C], k, v); `block.mlp_residual(x)` completes Eq. 2."""
        x, attn_in = block.layer_inputs(h_prev, tok)  # residual [B, T, C], attention input [B, T, C_in]
        cos, sin = block.rope(own_positions + k, x.dtype)
        q, kk, vv = attn.project(attn_in, cos, sin)
        if sp is not None:  # Ulysses: every token of the rows, this rank's heads (the keys are kept that way)
            H = q.shape[1]
            q, kk, vv = sp.to_heads(q), sp.to_heads(kk, H), sp.to_heads(vv, H)
        ks, vs = [*prev_k, kk], [*prev_v, vv]
        if full_mask is None:
            a = ttt_attention(q, ks[0], vs[0], ks[1:], vs[1:], document_ids, first, query_chunk, key_chunk,
                              block.attn_backend)
        else:
            a = ttt_attention_reference(q, ks, vs, full_mask, k)
        return block.attention_residual(x, a if sp is None else sp.to_sequence(a)), kk, vv

    h_prev, tok = block.condition(hidden.detach()), depth0_inputs(input_ids, document_ids, pad_id)[:, cols]
    keys: list[Tensor] = []
    values: list[Tensor] = []
    inputs, states = [], []
    # Written depth by depth into one buffer: stacking a list would hold two copies of D×T×V at the end.
    width = (block.config.draft_vocab_size or block.config.vocab_size) if draft else block.config.vocab_size
    logits = hidden.new_empty(*hidden.shape[:2], num_depths, width, dtype=torch.float32) if keep_logits else None
    for k in range(num_depths):
        if checkpoint_depths and torch.is_grad_enabled():  # two pieces: the backward rebuilds one at a time
            x, kk, vv = checkpoint(attention_step, h_prev, tok, k, list(keys), list(values), use_reentrant=False)
            h = checkpoint(block.mlp_residual, x, use_reentrant=False)
        else:
            x, kk, vv = attention_step(h_prev, tok, k, keys, values)
            h = block.mlp_residual(x)
        keys.append(kk)
        values.append(vv)
        nxt = tok
        if logits is not None:
            lg = head(h)  # [B, T, V] (V')
            logits[:, :, k] = lg
            nxt = to_ids(lg.detach().argmax(dim=-1))
        elif k < num_depths - 1:
            with torch.no_grad():  # chunked: never a whole [B, T, V] just for an argmax
                nxt = to_ids(torch.cat([head(hc).argmax(dim=-1) for hc in h.split(query_chunk, dim=1)], dim=1))
        inputs.append(tok)
        states.append(h)
        h_prev, tok = h, nxt  # depth k+1 consumes depth k's argmax (TTT)
    return TTTOutput(logits=logits, inputs=torch.stack(inputs, dim=2), states=tuple(states))


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


def depth_labels(packed: PackedBatch, num_depths: int, device: torch.device | None = None,
                 length: int | None = None) -> tuple[Tensor, Tensor]:
    """Labels and the depth-shift gate of every depth, flattened: (labels [B·T, D] (0 where invalid), valid
    [B·T, D] bool). `length`: keep only the first `length` positions of each row (a sequence-parallel shard, when
    `packed` is its window: shard + halo, `SequenceParallel.window`)."""
    labels, valid = zip(*(mtp_labels(packed, k) for k in range(num_depths)), strict=True)
    lab = torch.stack(labels, dim=-1).to(device).clamp_min(0)[:, :length]  # [B, T, D]
    mask = torch.stack(valid, dim=-1).to(device)[:, :length]  # [B, T, D]
    return lab.flatten(0, 1), mask.flatten(0, 1)


def mtp_loss_batch(out: TTTOutput, packed: PackedBatch, target_logits: Teacher | None,
                   draft_vocab: Tensor | None = None) -> LossBatch:
    """Flatten a rollout into the `[N, D, V]` layout of `train.losses` with the depth-shift gate (the reference
    for `mtp_chunked_loss_batch`: it holds the whole [N, D, V] student and teacher logits). `draft_vocab` [V']:
    the rollout ran with train_vocab "draft" (its logits are over these target ids)."""
    if out.logits is None:
        raise ValueError("mtp_loss_batch needs a rollout run with keep_logits=True")
    B, T, D, V = out.logits.shape
    lab, mask = depth_labels(packed, D, out.logits.device)
    target_logits = None if target_logits is None else teacher_logits(target_logits)
    teacher = None if target_logits is None else \
        teacher_for_depths(target_logits, D).reshape(B * T, D, target_logits.shape[-1])
    return LossBatch(student_logits=out.logits.reshape(B * T, D, V), mask=mask, teacher_logits=teacher, labels=lab,
                     draft_vocab=draft_vocab)


def depth_teacher_rows(target_logits: Teacher, num_depths: int, length: int | None = None
                       ) -> Callable[[slice], Tensor]:
    """`teacher_for_depths` for a slice of the flattened rows only: rows -> [n, D, V] (zeros past a row end).
    `length`: the loss covers the first `length` positions of each of target_logits' rows [B, T, V] (a
    sequence-parallel shard, whose halo follows it in `target_logits`); default T.

    The depths of a slice of rows read one window of the target's positions, the slice shifted by 1..D: a
    `TeacherHead` runs its LM head on that window only (n + D positions, not n·D, and no [B, T, V] tensor), logits
    `target_logits` are sliced there. The window's bounds are host integers and the rows are picked by index, so
    no host sync."""
    B, T, V = target_logits.shape
    L = T if length is None else length
    head = target_logits if isinstance(target_logits, TeacherHead) else None
    flat = target_logits.reshape(B * T, V) if head is None else head.states.reshape(B * T, -1)

    def source(n: int) -> int:  # flat position of the loss's row n
        return (n // L) * T + n % L

    def rows(r: slice) -> Tensor:
        lo, hi = source(r.start) + 1, min(source(r.stop - 1) + num_depths + 1, B * T)
        n = torch.arange(r.start, r.stop, device=flat.device)
        shift = torch.arange(1, num_depths + 1, device=flat.device)
        ok = (n % L)[:, None] + shift < T  # [n, D]: the depth's position lies in the row
        if hi <= lo:  # the last position of the last row: nothing in reach
            return flat.new_zeros(len(n), num_depths, V, dtype=torch.float32 if head else flat.dtype)
        window = flat[lo:hi] if head is None else head.logits(flat[lo:hi])  # [W, V]
        at = (((n // L) * T + n % L)[:, None] + shift - lo).clamp(0, hi - lo - 1)  # [n, D] into the window
        out = window.index_select(0, at.flatten()).view(len(n), num_depths, V)
        return out.masked_fill_(~ok[..., None], 0)

    return rows


def mtp_chunked_loss_batch(block: MTPDraftModel, out: TTTOutput, packed: PackedBatch, target_logits: Teacher | None,
                           *, max_logits: int | None = None, track_alpha: bool = False,
                           sp: SequenceParallel | None = None, train_vocab: str = "full") -> ChunkedLossBatch:
    """`mtp_loss_batch` without the [N, D, V] logits: the rollout's states (run it with keep_logits=False) go
    through `block.logits` a chunk of rows at a time, at most `max_logits` logits per chunk (default: from the
    device's memory, `train.losses.loss_chunk_logits`; `train.losses.ChunkedLossBatch`). Same losses and gradients
    (tested). The teacher is the target's logits [B, T, V] or, as the trainers pass it, a `TeacherHead` whose LM
    head runs inside each chunk on the positions that chunk needs (`depth_teacher_rows`).

    `sp`: the rollout ran on this rank's shard (`ttt_rollout(sp=...)`); `packed` holds whole rows and
    `target_logits` the teacher of the shard plus its halo of D + 1 positions (`SequenceParallel.columns(T, D + 1)`):
    labels and teacher come from that window, so depth shifts past the shard's end stay rank-local.

    `train_vocab` "draft": the head scores the draft vocabulary only (`block.draft_head`) and the losses run in the
    draft space (`train.losses.to_draft_space`), the teacher moved there once per position (`draft_space_teacher`
    of `target_logits`) instead of once per chunk, depth and recompute; a chunk then holds V' + 1 wide rows only, and
    takes that many more rows."""
    D = len(out.states)
    B, S = out.states[0].shape[:2]
    dev = out.states[0].device
    if sp is not None and sp.enabled:
        packed = sp.window(packed, D + 1)
        if target_logits is not None and target_logits.shape[1] != packed.seq_len:
            raise ValueError(f"under sequence parallelism the teacher covers the shard and its halo, "
                             f"{packed.seq_len} positions (SequenceParallel.columns(T, {D + 1})), got "
                             f"{target_logits.shape[1]}")
    lab, mask = depth_labels(packed, D, dev, length=S)
    max_logits = loss_chunk_logits(dev) if max_logits is None else max_logits
    draft = train_vocab == "draft" and bool(block.config.draft_vocab_size)
    head = block.draft_head if draft else block.logits
    if draft and isinstance(target_logits, TeacherHead):  # [B, T, V' + 1] log-probs, a chunk of positions at a time
        target_logits = target_logits.map_positions(lambda t: draft_space_teacher(t, block.draft_vocab), max_logits)
    elif draft and target_logits is not None:
        target_logits = draft_space_teacher(target_logits, block.draft_vocab)  # [B, T, V' + 1] log-probs
    return ChunkedLossBatch(
        hidden=tuple(h.reshape(B * S, -1) for h in out.states), head=lambda h, rows: head(h), mask=mask,
        chunk_rows=ChunkedLossBatch.rows_for(max_logits, D, block.config.draft_vocab_size + 1 if draft
                                             else block.config.vocab_size),
        teacher=None if target_logits is None else depth_teacher_rows(target_logits, D, S), labels=lab,
        track_alpha=track_alpha, draft_vocab=block.draft_vocab if draft else None, draft_teacher=draft)
