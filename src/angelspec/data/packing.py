"""Document-aware sequence packing (report §6.3; docs/design.md trap 3).

Drafter training samples are short, so one conversation per row wastes most of a fixed-length batch
on padding. :func:`pack_documents` puts several documents into each row with greedy first-fit
decreasing, and keeps them strictly isolated by three gates, each of which has a test that perturbs
one document and checks every other document's logits and losses stay bit-for-bit unchanged:

1. **Attention gate** (:func:`attention_gate`): a query sees only keys of its own document, causally.
   The :class:`~angelspec.models.Decoder` builds the same dense mask from ``document_ids``; the
   index-based forms (:func:`document_spans` for varlen kernels, :func:`document_mask_mod` for
   FlexAttention) express the same gate without a dense ``T x T`` mask.
2. **Depth-shift gate** (:func:`shifted_labels`): a label ``s`` tokens ahead is kept only when that
   token lies in the same document and is trained on, so no depth is ever supervised across a
   document end.
3. **Document-local positions**: ``positions`` restart at 0 for every document, so a packed document
   sees exactly the rotary layout it would see alone.

Shape legend: R packed rows, T row length (``seq_len``), N documents or spans, H heads, Dh head dim.

Padding has ``document_ids == PAD_DOCUMENT_ID`` (-1, never a real document's id). It attends to the
padding before it in its row and to nothing else, and nothing real attends to it. Padding must not get
an empty attention row: SDPA turns a fully masked row into NaN, and in the next layer that NaN sits in
a value vector that real queries multiply by an exact 0 probability, and ``0 * NaN`` is NaN.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Literal

import torch
import torch.nn.functional as F

from angelspec.data.chat import EncodedChat

IGNORE_INDEX = -100  # label value that torch.nn.functional.cross_entropy skips
PAD_DOCUMENT_ID = -1  # document id of padding slots

LabelConvention = Literal["next_token", "mtp"]


@dataclass(frozen=True)
class Doc:
    """One training document: token ids and a 0/1 mask of the tokens trained on.

    ``loss_mask=None`` trains on every token (plain LM data); chat data passes the assistant-only mask
    from :func:`~angelspec.data.chat.encode_conversation` (see :meth:`from_encoded`). ``doc_id`` is a
    caller's handle (a dataset row, a hash); packing never reads it.
    """

    input_ids: Sequence[int] | torch.Tensor
    loss_mask: Sequence[int] | torch.Tensor | None = None
    doc_id: str | int | None = None

    @classmethod
    def from_encoded(cls, enc: EncodedChat, doc_id: str | int | None = None) -> Doc:
        return cls(enc.ids, enc.loss_mask, doc_id)

    def __len__(self) -> int:
        return len(self.input_ids)


@dataclass
class PackedBatch:
    """Fixed-length packed rows, ready for ``Decoder(input_ids, positions=..., document_ids=...)``.

    ``labels`` are next-token labels (convention ``"next_token"``, depth 0 of :func:`shifted_labels`):
    ``labels[r, t]`` is ``input_ids[r, t + 1]`` when that token is in the same document and trained on,
    else :data:`IGNORE_INDEX`. So the last token of every document, padding, and positions whose next
    token is a prompt token get no loss, exactly as if each document were alone in its row.
    """

    input_ids: torch.Tensor  # [R, T] int64, pad_id in padding slots
    labels: torch.Tensor  # [R, T] int64, next token or IGNORE_INDEX
    loss_mask: torch.Tensor  # [R, T] bool, token t itself is trained on (assistant); False in padding
    document_ids: torch.Tensor  # [R, T] int64, index of the document in the packed list; -1 in padding
    positions: torch.Tensor  # [R, T] int64, document-local (0 at every document's first token); 0 in padding
    row_docs: tuple[tuple[int, ...], ...]  # per row, the indices of its documents in left-to-right order
    num_tokens: int  # real (non-padding) tokens after truncation
    num_truncated: int  # documents longer than T, cut to their first T tokens
    truncated_tokens: int  # tokens those cuts dropped

    @property
    def num_rows(self) -> int:
        return self.input_ids.shape[0]

    @property
    def seq_len(self) -> int:
        return self.input_ids.shape[1]

    @property
    def efficiency(self) -> float:
        """Real tokens / total slots: the fraction of the batch's compute spent on data."""
        slots = self.input_ids.numel()
        return self.num_tokens / slots if slots else 0.0

    def to(self, device: torch.device | str) -> PackedBatch:
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        return PackedBatch(**{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in moved.items()})


# ----- packing -----


def _as_doc_tensors(doc: Doc, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.as_tensor(doc.input_ids, dtype=torch.long).reshape(-1)
    if ids.numel() == 0:
        raise ValueError(f"document {index} is empty: nothing to pack")
    if doc.loss_mask is None:
        mask = torch.ones_like(ids, dtype=torch.bool)
    else:
        mask = torch.as_tensor(doc.loss_mask).reshape(-1).bool()
        if mask.numel() != ids.numel():
            raise ValueError(f"document {index} has {ids.numel()} tokens but a loss mask of {mask.numel()}")
    return ids, mask


def first_fit(lengths: Sequence[int], capacity: int) -> list[tuple[int, int]]:
    """Greedy first-fit of items (each ``1 <= length <= capacity``), in the given order.

    Returns ``(row, offset)`` per item. A max segment tree over the rows' free space finds the leftmost
    row with room in O(log N), so packing a large buffer costs O(N log N) rather than the O(N * R) of
    scanning every open row. Rows that are not open yet sit at full capacity to the right of the open
    ones, so "leftmost row with room" opens a new row exactly when no open row fits.
    """
    n = len(lengths)
    size = 1
    while size < max(n, 1):
        size *= 2
    free = [0] * (2 * size)  # free[size + r] = room left in row r; inner nodes hold their subtree's max
    for r in range(n):
        free[size + r] = capacity
    for node in range(size - 1, 0, -1):
        free[node] = max(free[2 * node], free[2 * node + 1])
    out: list[tuple[int, int]] = []
    for length in lengths:
        if not 1 <= length <= capacity:
            raise ValueError(f"item length {length} is outside 1..{capacity}")
        node = 1
        while node < size:
            node = 2 * node if free[2 * node] >= length else 2 * node + 1
        out.append((node - size, capacity - free[node]))
        free[node] -= length
        node //= 2
        while node:
            free[node] = max(free[2 * node], free[2 * node + 1])
            node //= 2
    return out


def pack_documents(docs: Sequence[Doc], seq_len: int, *, pad_id: int) -> PackedBatch:
    """Pack documents into rows of ``seq_len`` tokens with greedy first-fit decreasing.

    Documents are placed longest first (ties keep input order, so the result is deterministic), each
    into the first row with room. A document longer than ``seq_len`` keeps its first ``seq_len`` tokens
    and is counted in ``num_truncated``. ``document_ids`` hold each document's index in ``docs``, so
    they are distinct within a row and map back to the input.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len must be positive, got {seq_len}")
    if not docs:
        raise ValueError("no documents to pack")
    tensors = [_as_doc_tensors(d, i) for i, d in enumerate(docs)]
    lengths = [min(ids.numel(), seq_len) for ids, _ in tensors]
    num_truncated = sum(ids.numel() > seq_len for ids, _ in tensors)
    truncated_tokens = sum(max(ids.numel() - seq_len, 0) for ids, _ in tensors)
    order = sorted(range(len(docs)), key=lambda i: (-lengths[i], i))
    placed = first_fit([lengths[i] for i in order], seq_len)
    R = 1 + max(row for row, _ in placed)

    input_ids = torch.full((R, seq_len), pad_id, dtype=torch.long)
    loss_mask = torch.zeros(R, seq_len, dtype=torch.bool)
    document_ids = torch.full((R, seq_len), PAD_DOCUMENT_ID, dtype=torch.long)
    positions = torch.zeros(R, seq_len, dtype=torch.long)
    rows: list[list[int]] = [[] for _ in range(R)]
    for i, (row, off) in zip(order, placed, strict=True):
        ids, mask = tensors[i]
        n = lengths[i]
        input_ids[row, off:off + n] = ids[:n]
        loss_mask[row, off:off + n] = mask[:n]
        document_ids[row, off:off + n] = i
        positions[row, off:off + n] = torch.arange(n)
        rows[row].append(i)  # first-fit fills a row left to right, so append order is offset order
    labels, _ = _gate(input_ids, loss_mask, document_ids, 1)
    return PackedBatch(input_ids=input_ids, labels=labels, loss_mask=loss_mask, document_ids=document_ids,
                       positions=positions, row_docs=tuple(tuple(r) for r in rows), num_tokens=sum(lengths),
                       num_truncated=num_truncated, truncated_tokens=truncated_tokens)


# ----- the depth-shift gate -----


def label_offset(depth: int, convention: LabelConvention = "next_token") -> int:
    """How many tokens ahead of position ``i`` the label at zero-based ``depth`` lies.

    - ``"next_token"``: ``depth + 1``. Depth 0 is the ordinary next-token label ``x_{i+1}`` (what
      :attr:`PackedBatch.labels` holds); depth k is the (k+1)-th token after the prefix ``x_{<=i}``,
      the indexing of a draft chain that starts right after the prefix (EAGLE-style).
    - ``"mtp"``: ``depth + 2``. Report §2.3: "at sequence position i and zero-based depth k, the MTP
      prediction is aligned with token x_{i+k+2}". The target's own head at ``i`` already predicts
      ``x_{i+1}``; MTP depth 0 takes ``[h_i ; E(x_{i+1})]`` and predicts ``x_{i+2}``, and each depth
      shifts the teacher by one more token. Its teacher-forced input ``x_{i+k+1}`` always lies between
      ``i`` and the label, so a valid label implies a same-document input.
    """
    if depth < 0:
        raise ValueError(f"depth must be >= 0, got {depth}")
    if convention == "next_token":
        return depth + 1
    if convention == "mtp":
        return depth + 2
    raise ValueError(f"unknown label convention {convention!r}; expected 'next_token' or 'mtp'")


def _gate(
    input_ids: torch.Tensor,  # [R, T]
    loss_mask: torch.Tensor,  # [R, T] bool
    document_ids: torch.Tensor,  # [R, T]
    offset: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    R, T = input_ids.shape
    labels = torch.full((R, T), IGNORE_INDEX, dtype=torch.long, device=input_ids.device)
    valid = torch.zeros(R, T, dtype=torch.bool, device=input_ids.device)
    if offset >= T:
        return labels, valid
    # Compare run indices, not ids: "no document boundary in (i, i + offset]" holds even if a caller
    # reuses an id for a later, non-adjacent document in the same row.
    boundary = torch.ones(R, T, dtype=torch.long, device=input_ids.device)
    boundary[:, 1:] = (document_ids[:, 1:] != document_ids[:, :-1]).long()
    run = boundary.cumsum(dim=1)  # [R, T] index of the contiguous run each slot belongs to
    same_run = run[:, :-offset] == run[:, offset:]  # [R, T - offset]
    ok = same_run & (document_ids[:, :-offset] != PAD_DOCUMENT_ID) & loss_mask[:, offset:].bool()
    valid[:, :-offset] = ok
    labels[:, :-offset] = torch.where(ok, input_ids[:, offset:], IGNORE_INDEX)
    return labels, valid


def shifted_labels(
    packed: PackedBatch, depth: int, *, convention: LabelConvention = "next_token"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depth-shifted labels and their validity: the MTP depth-shift document gate (report §6.3).

    With ``s = label_offset(depth, convention)``, ``labels[r, i] = input_ids[r, i + s]`` and
    ``valid[r, i]`` is True only when slot ``i`` is a real token, ``i + s`` is inside the row and in the
    SAME document (no boundary in between), and token ``i + s`` is trained on. Elsewhere the label is
    :data:`IGNORE_INDEX`. The last ``s`` tokens of every document are therefore unsupervised at that
    depth, which is what running the document alone gives: packing loses no supervision.

    Returns ``(labels [R, T] int64, valid [R, T] bool)``.
    """
    return _gate(packed.input_ids, packed.loss_mask, packed.document_ids, label_offset(depth, convention))


def mtp_labels(packed: PackedBatch, depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`shifted_labels` with the report's MTP alignment: depth k at position i targets ``x_{i+k+2}``."""
    return shifted_labels(packed, depth, convention="mtp")


# ----- the attention gate: dense mask, varlen spans, FlexAttention mask_mod -----


def attention_gate(document_ids: torch.Tensor) -> torch.Tensor:
    """Dense ``same document & causal`` mask, [R, 1, T, T] bool (True = attend); what the Decoder builds.

    Cost: R * T^2 bytes (1 MiB per row at T=1024, 1 GiB at T=32k), and a boolean ``attn_mask`` keeps
    SDPA off the flash kernel, so every row still pays the full T^2 of cross-document blocks that the
    mask then throws away. It is the reference and the CPU path; see :func:`document_spans` and
    :func:`document_mask_mod` for forms that skip the masked work.
    """
    if document_ids.dim() != 2:
        raise ValueError(f"document_ids must be [R, T], got shape {tuple(document_ids.shape)}")
    T = document_ids.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=document_ids.device).tril()  # [T, T]
    same_doc = document_ids[:, :, None] == document_ids[:, None, :]  # [R, T, T]
    return (same_doc & causal)[:, None]


@dataclass(frozen=True)
class DocumentSpans:
    """Packed rows as contiguous spans of the flattened ``[R * T]`` token stream, for varlen kernels.

    ``cu_seqlens`` is the ``cu_seq_q``/``cu_seq_k`` argument of ``torch.nn.attention.varlen.varlen_attn``
    and flash-attn's ``flash_attn_varlen_func``; call them with q/k/v reshaped ``[R * T, H, Dh]`` and
    causal attention. Padding runs are spans of their own (``document_ids == -1``), so the stream needs
    no gather/scatter to drop padding; a padding span attends only to itself, as in the dense gate.
    """

    cu_seqlens: torch.Tensor  # [N + 1] int32 span offsets into the flattened stream, 0 .. R * T
    max_seqlen: int  # longest span (host int; varlen kernels size their grid with it)
    document_ids: torch.Tensor  # [N] int64 document id of each span, -1 for padding runs

    @property
    def lengths(self) -> torch.Tensor:  # [N]
        return self.cu_seqlens.diff()


def document_spans(document_ids: torch.Tensor) -> DocumentSpans:
    """Index form of the attention gate: O(N) integers instead of an O(R * T^2) mask.

    A span is a maximal run of one document id within one row (a row start always starts a span, so
    spans never straddle rows). Varlen kernels then do sum(L_d^2) work instead of R * T^2 and never
    touch cross-document blocks. The price: the layout is ``[tokens, H, Dh]`` rather than
    ``[R, H, T, Dh]``, the fused kernels are CUDA-only (CPU uses the dense gate or
    :func:`varlen_attention_reference`), and ``max_seqlen`` is a device-to-host sync, so build the spans
    in the data loader while the ids are still on the CPU.
    """
    if document_ids.dim() != 2:
        raise ValueError(f"document_ids must be [R, T], got shape {tuple(document_ids.shape)}")
    R, T = document_ids.shape
    starts = torch.ones(R, T, dtype=torch.bool, device=document_ids.device)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    flat_starts = starts.reshape(-1).nonzero().squeeze(1)  # [N]
    end = torch.tensor([R * T], device=document_ids.device)
    cu = torch.cat([flat_starts, end]).to(torch.int32)  # [N + 1]
    max_seqlen = int(cu.diff().max()) if cu.numel() > 1 else 0
    return DocumentSpans(cu_seqlens=cu, max_seqlen=max_seqlen, document_ids=document_ids.reshape(-1)[flat_starts])


def varlen_attention_reference(
    q: torch.Tensor,  # [R * T, H, Dh]
    k: torch.Tensor,  # [R * T, Hkv, Dh]
    v: torch.Tensor,  # [R * T, Hkv, Dh]
    spans: DocumentSpans,
) -> torch.Tensor:  # [R * T, H, Dh]
    """Slow reference for a causal varlen kernel: one SDPA call per span, in the varlen layout.

    Loops on the host over N spans, so it is for tests and tiny CPU runs, not training.
    """
    out = torch.empty_like(q)
    bounds = spans.cu_seqlens.tolist()
    gqa = q.shape[1] != k.shape[1]
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        qs, ks, vs = (x[start:end].transpose(0, 1) for x in (q, k, v))  # [H|Hkv, L, Dh]
        out[start:end] = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=gqa).transpose(0, 1)
    return out


def document_mask_mod(document_ids: torch.Tensor) -> Callable[..., torch.Tensor]:
    """The attention gate as a FlexAttention ``mask_mod`` for ``create_block_mask(mod, R, None, T, T)``.

    The resulting BlockMask stores which 128x128 tiles are empty, full or partial (O(R * (T/128)^2)
    ints) and the compiled kernel skips empty tiles, so cost tracks sum(L_d^2) like varlen while the
    layout stays ``[R, H, T, Dh]``. FlexAttention also returns the log-sum-exp, which the TTT rollout
    needs to merge the causal-prefix attention with its diagonal draft keys. It needs
    ``torch.compile`` to be fast; eager FlexAttention materialises the scores.
    """

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        return (document_ids[b, q_idx] == document_ids[b, kv_idx]) & (q_idx >= kv_idx)

    return mask_mod


# ----- efficiency report -----


@dataclass(frozen=True)
class PackingReport:
    """How well a batch is packed; log it once per interval, not per step."""

    rows: int
    seq_len: int
    documents: int
    tokens: int  # real tokens after truncation
    slots: int  # rows * seq_len
    efficiency: float  # tokens / slots
    num_truncated: int
    truncated_tokens: int
    mean_docs_per_row: float
    supervised_tokens: int  # positions with a valid next-token label

    @property
    def truncated_fraction(self) -> float:
        """Share of the input's tokens that truncation dropped (efficiency does not see these)."""
        total = self.tokens + self.truncated_tokens
        return self.truncated_tokens / total if total else 0.0

    def format(self) -> str:
        return (f"packing: {self.documents} docs -> {self.rows} rows x {self.seq_len} | "
                f"efficiency {self.efficiency:.1%} ({self.tokens}/{self.slots}) | "
                f"{self.mean_docs_per_row:.2f} docs/row | supervised {self.supervised_tokens} | "
                f"truncated {self.num_truncated} docs ({self.truncated_tokens} tokens, "
                f"{self.truncated_fraction:.1%} of input)")


def packing_report(packed: PackedBatch) -> PackingReport:
    documents = sum(len(r) for r in packed.row_docs)
    return PackingReport(
        rows=packed.num_rows,
        seq_len=packed.seq_len,
        documents=documents,
        tokens=packed.num_tokens,
        slots=packed.input_ids.numel(),
        efficiency=packed.efficiency,
        num_truncated=packed.num_truncated,
        truncated_tokens=packed.truncated_tokens,
        mean_docs_per_row=documents / packed.num_rows if packed.num_rows else 0.0,
        supervised_tokens=int((packed.labels != IGNORE_INDEX).sum()),
    )
