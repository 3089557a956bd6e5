"""Document-aware packing (docs/design.md trap 3): zero leakage between packed documents through attention,
labels (every depth, both label conventions) and positions; first-fit packing and its efficiency.

Shape legend: R rows, T row length, V vocab."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

import angelspec.models.decoder as decoder_module
from angelspec.data.chat import EncodedChat
from angelspec.data.packing import (
    IGNORE_INDEX,
    PAD_DOCUMENT_ID,
    Doc,
    PackedBatch,
    attention_gate,
    document_mask_mod,
    document_spans,
    first_fit,
    label_offset,
    mtp_labels,
    pack_documents,
    packing_report,
    shifted_labels,
    varlen_attention_reference,
)
from angelspec.models import Decoder, DecoderConfig
from angelspec.models.decoder import TrainInputs

V = 64
PAD = 0


def _random_docs(lengths: list[int], seed: int, p_loss: float = 0.7) -> list[Doc]:
    g = torch.Generator().manual_seed(seed)
    return [Doc(torch.randint(1, V, (n,), generator=g).tolist(), (torch.rand(n, generator=g) < p_loss).long().tolist(),
                doc_id=f"doc{i}") for i, n in enumerate(lengths)]


def _slots(packed: PackedBatch, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, cols) of document d's tokens, in order."""
    rows, cols = (packed.document_ids == d).nonzero(as_tuple=True)
    return rows, cols


@pytest.fixture(scope="module")
def model() -> Decoder:
    cfg = DecoderConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                        num_key_value_heads=2, head_dim=16, max_position_embeddings=64)
    torch.manual_seed(0)
    m = Decoder(cfg)
    m.init_weights()
    return m.eval()


def _forward(model: Decoder, packed: PackedBatch, *, gate: bool = True, local_positions: bool = True) -> torch.Tensor:
    positions = packed.positions if local_positions else torch.arange(packed.seq_len).expand_as(packed.input_ids)
    with torch.no_grad():
        inputs = TrainInputs(positions=positions, document_ids=packed.document_ids if gate else None)
        return model(packed.input_ids, inputs).logits  # [R, T, V]


def _token_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:  # [R, T]
    R, T, _ = logits.shape
    return F.cross_entropy(logits.reshape(R * T, -1), labels.reshape(-1), reduction="none",
                           ignore_index=IGNORE_INDEX).view(R, T)


def _perturbed(packed: PackedBatch, d: int, seed: int = 1) -> PackedBatch:
    """Every token of document d replaced by a different token; everything else untouched."""
    ids = packed.input_ids.clone()
    mask = packed.document_ids == d
    bump = torch.randint(1, V - 1, (int(mask.sum()),), generator=torch.Generator().manual_seed(seed))
    ids[mask] = (ids[mask] - 1 + bump) % (V - 1) + 1  # stays in 1..V-1 and never equals the old token
    assert (ids[mask] != packed.input_ids[mask]).all()
    labels, _ = shifted_labels(replace(packed, input_ids=ids), 0)
    return replace(packed, input_ids=ids, labels=labels)


# Longest first into rows of 24: row 0 = [10, 8, 6] (full), row 1 = [5, 4, 3, 3, 2] + 7 padding slots.
LEAK_LENGTHS = [3, 8, 5, 10, 2, 6, 4, 3]
LEAK_T = 24


@pytest.fixture(scope="module")
def leak_setup(model: Decoder):
    docs = _random_docs(LEAK_LENGTHS, seed=0)
    packed = pack_documents(docs, LEAK_T, pad_id=PAD)
    assert [len(r) for r in packed.row_docs] == [3, 5]
    victim = packed.row_docs[0][1]  # middle of row 0: one document before it, one after it
    return docs, packed, victim


# ----- (1) zero leakage -----


def test_perturbing_one_document_leaves_every_other_bit_for_bit_unchanged(model, leak_setup):
    docs, packed, victim = leak_setup
    base = _forward(model, packed)
    pert = _perturbed(packed, victim)
    out = _forward(model, pert)
    base_loss, pert_loss = _token_losses(base, packed.labels), _token_losses(out, pert.labels)
    others = [d for row in packed.row_docs for d in row if d != victim]
    assert len(others) == len(docs) - 1
    for d in others:
        m = packed.document_ids == d
        assert torch.equal(base[m], out[m]), f"document {d} logits changed"
        assert torch.equal(base_loss[m].sum(), pert_loss[m].sum()), f"document {d} loss changed"
        assert torch.equal(packed.labels[m], pert.labels[m])
    pad = packed.document_ids == PAD_DOCUMENT_ID
    assert pad.any() and torch.equal(base[pad], out[pad])

    m = packed.document_ids == victim
    assert not torch.allclose(base[m], out[m]), "the perturbation must change the victim (else the test is vacuous)"
    alone_ids = pert.input_ids[m][None]  # [1, L]
    with torch.no_grad():
        alone = model(alone_ids).logits[0]  # [L, V], default positions 0..L-1, no gate
    torch.testing.assert_close(out[m], alone, rtol=0, atol=1e-5)
    alone_labels = pack_documents([Doc(alone_ids[0], docs[victim].loss_mask)], len(alone_ids[0]), pad_id=PAD).labels
    assert torch.equal(pert.labels[m], alone_labels[0])
    torch.testing.assert_close(pert_loss[m], _token_losses(alone[None], alone_labels)[0], rtol=0, atol=1e-5)


def test_leak_checks_fail_when_a_gate_is_removed(model, leak_setup):
    """The checks above can fail: without the attention gate or the label gate they catch the leak.

    (Positions have no such control here: RoPE scores depend only on q - k offsets, so a document shifted
    as a whole by row-global positions matches running it alone to rounding. Test (4) checks them directly.)
    """
    _, packed, victim = leak_setup
    before, after = packed.row_docs[0][0], packed.row_docs[0][2]
    pert = _perturbed(packed, victim)
    m_before, m_after = packed.document_ids == before, packed.document_ids == after

    # No attention gate: the document after the victim sees it through plain causal attention.
    assert not torch.equal(_forward(model, packed, gate=False)[m_after], _forward(model, pert, gate=False)[m_after])

    # No label gate: the last token of the document before the victim is trained on the victim's first token.
    def naive(p: PackedBatch) -> torch.Tensor:  # [R, T] plain shift-by-one labels
        return torch.cat([p.input_ids[:, 1:], torch.full_like(p.input_ids[:, :1], IGNORE_INDEX)], 1)

    base = _forward(model, packed)
    assert not torch.equal(_token_losses(base, naive(packed))[m_before].sum(),
                           _token_losses(base, naive(pert))[m_before].sum())


# ----- (2) depth-shifted labels never cross a document end -----


def _reference_labels(doc: Doc, offset: int, n: int) -> tuple[list[int], list[bool]]:
    """Labels of one document run alone (first n tokens): x[p + offset] where it exists and is trained on."""
    ids, mask = list(doc.input_ids)[:n], list(doc.loss_mask)[:n]
    valid = [p + offset < n and bool(mask[p + offset]) for p in range(n)]
    return [ids[p + offset] if ok else IGNORE_INDEX for p, ok in enumerate(valid)], valid


@pytest.mark.parametrize("convention", ["next_token", "mtp"])
def test_shifted_labels_match_each_document_alone_at_every_depth(convention):
    rng = random.Random(1234)
    T = 32
    lengths = [rng.choice([1, 2, 3, 4, 5, rng.randint(1, 40)]) for _ in range(120)]  # many docs shorter than k+2
    docs = _random_docs(lengths, seed=5)
    packed = pack_documents(docs, T, pad_id=PAD)
    assert packed.num_truncated == sum(n > T for n in lengths) > 0
    for k in range(4):
        s = label_offset(k, convention)
        assert s == k + (1 if convention == "next_token" else 2)
        labels, valid = shifted_labels(packed, k, convention=convention)
        expected_labels = torch.full_like(labels, IGNORE_INDEX)
        expected_valid = torch.zeros_like(valid)
        for d, doc in enumerate(docs):
            rows, cols = _slots(packed, d)
            ref_labels, ref_valid = _reference_labels(doc, s, len(cols))
            expected_labels[rows, cols] = torch.tensor(ref_labels)
            expected_valid[rows, cols] = torch.tensor(ref_valid)
        assert torch.equal(labels, expected_labels), f"depth {k}"
        assert torch.equal(valid, expected_valid), f"depth {k}"
        assert torch.equal(labels != IGNORE_INDEX, valid)
        # Directly: every valid label's token is s slots ahead in the same row and the same document.
        r, i = valid.nonzero(as_tuple=True)
        assert (i + s < T).all()
        assert torch.equal(packed.document_ids[r, i], packed.document_ids[r, i + s])
        assert torch.equal(labels[r, i], packed.input_ids[r, i + s])
        assert packed.loss_mask[r, i + s].all()
    assert torch.equal(shifted_labels(packed, 0)[0], packed.labels)
    assert torch.equal(mtp_labels(packed, 1)[0], shifted_labels(packed, 2)[0])  # x_{i+3} both ways


def test_label_gate_on_a_hand_built_batch():
    """Built by hand, not by pack_documents: an id reused by a non-adjacent document, a loss mask left on in
    padding. Neither may produce a label."""
    ids = torch.arange(1, 9)[None]
    doc = torch.tensor([[7, 7, 3, 3, 7, 7, -1, -1]])
    p = PackedBatch(ids, ids, torch.ones(1, 8, dtype=torch.bool), doc, torch.zeros(1, 8, dtype=torch.long),
                    ((7, 3, 7),), 6, 0, 0)
    _, valid = shifted_labels(p, 3)  # offset 4: slot 0 -> 4 and 1 -> 5 share id 7 but not a document
    assert not valid.any()
    _, valid = shifted_labels(p, 0)
    assert valid[0].tolist() == [True, False, True, False, True, False, False, False]


def test_label_offset_rejects_bad_arguments():
    with pytest.raises(ValueError, match="depth"):
        label_offset(-1)
    with pytest.raises(ValueError, match="convention"):
        label_offset(0, "eagle")  # type: ignore[arg-type]


# ----- (3) first-fit packing: deterministic, lossless, efficiency -----


def test_first_fit_decreasing_on_a_worked_example():
    docs = _random_docs([1, 3, 5, 2, 4, 3], seed=2)
    packed = pack_documents(docs, 6, pad_id=PAD)
    # Longest first: 5 -> r0, 4 -> r1, 3 -> r2, 3 -> r2, 2 -> r1, 1 -> r0 (first row with room each time).
    assert packed.row_docs == ((2, 0), (4, 3), (1, 5))
    assert packed.efficiency == 1.0 and packed.num_truncated == 0

    packed = pack_documents(_random_docs([10, 3], seed=2), 6, pad_id=PAD)
    assert packed.row_docs == ((0,), (1,))
    assert (packed.num_truncated, packed.truncated_tokens, packed.num_tokens) == (1, 4, 9)
    assert packed.efficiency == 9 / 12
    report = packing_report(packed)
    assert (report.rows, report.documents, report.slots, report.mean_docs_per_row) == (2, 2, 12, 1.0)
    assert report.supervised_tokens == int((packed.labels != IGNORE_INDEX).sum())
    assert report.truncated_fraction == 4 / 13
    assert "75.0%" in report.format() and "truncated 1 docs (4 tokens, 30.8% of input)" in report.format()


def _naive_first_fit(lengths: list[int], capacity: int) -> list[tuple[int, int]]:
    used: list[int] = []
    out = []
    for n in lengths:
        row = next((r for r, u in enumerate(used) if u + n <= capacity), len(used))
        if row == len(used):
            used.append(0)
        out.append((row, used[row]))
        used[row] += n
    return out


def test_first_fit_tree_matches_naive_scan():
    rng = random.Random(7)
    for _ in range(20):
        cap = rng.randint(1, 50)
        lengths = [rng.randint(1, cap) for _ in range(rng.randint(1, 80))]
        assert first_fit(lengths, cap) == _naive_first_fit(lengths, cap)


def test_packing_is_deterministic_keeps_every_token_once_and_counts_efficiency():
    rng = random.Random(3)
    T = 48
    lengths = [max(1, int(rng.lognormvariate(math.log(12), 0.8))) for _ in range(150)]
    docs = _random_docs(lengths, seed=3)
    a, b = pack_documents(docs, T, pad_id=PAD), pack_documents(docs, T, pad_id=PAD)
    for name in ("input_ids", "labels", "loss_mask", "document_ids", "positions"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert a.row_docs == b.row_docs
    assert sorted(d for row in a.row_docs for d in row) == list(range(len(docs)))
    for d, doc in enumerate(docs):
        rows, cols = _slots(a, d)
        n = min(len(doc), T)
        assert len(cols) == n and (rows == rows[0]).all() and torch.equal(cols, cols[0] + torch.arange(n))
        assert a.input_ids[rows, cols].tolist() == list(doc.input_ids)[:n]
        assert a.loss_mask[rows, cols].long().tolist() == list(doc.loss_mask)[:n]
    real = int((a.document_ids != PAD_DOCUMENT_ID).sum())
    assert real == a.num_tokens == sum(min(n, T) for n in lengths)
    assert a.efficiency == real / (a.num_rows * T)
    assert a.num_truncated == sum(n > T for n in lengths)
    assert a.truncated_tokens == sum(max(n - T, 0) for n in lengths)
    assert (a.input_ids[a.document_ids == PAD_DOCUMENT_ID] == PAD).all()


def test_doc_from_encoded_chat_and_bad_input():
    doc = Doc.from_encoded(EncodedChat([5, 6, 7], [0, 1, 1], 0), doc_id="x")
    packed = pack_documents([doc, Doc([9, 9])], 4, pad_id=PAD)
    assert packed.labels[0].tolist() == [6, 7, IGNORE_INDEX, IGNORE_INDEX]
    assert packed.labels[1].tolist() == [9, IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX]  # loss_mask=None trains all
    with pytest.raises(ValueError, match="document 1 is empty"):
        pack_documents([doc, Doc([])], 4, pad_id=PAD)
    with pytest.raises(ValueError, match="loss mask of 2"):
        pack_documents([Doc([1, 2, 3], [1, 1])], 4, pad_id=PAD)
    with pytest.raises(ValueError, match="seq_len"):
        pack_documents([doc], 0, pad_id=PAD)
    with pytest.raises(ValueError, match="no documents"):
        pack_documents([], 4, pad_id=PAD)


# ----- (4) positions restart per document -----


def test_positions_restart_at_zero_for_every_document(leak_setup):
    docs, packed, _ = leak_setup
    for d in range(len(docs)):
        rows, cols = _slots(packed, d)
        assert torch.equal(packed.positions[rows, cols], torch.arange(len(docs[d])))
    assert (packed.positions[packed.document_ids == PAD_DOCUMENT_ID] == 0).all()


# ----- (5) padding: no loss, no attention -----


def test_padding_gets_no_loss_and_no_attention(model, leak_setup):
    _, packed, _ = leak_setup
    pad = packed.document_ids == PAD_DOCUMENT_ID  # [R, T]
    assert pad.any()
    assert not packed.loss_mask[pad].any()
    for k in range(4):
        for convention in ("next_token", "mtp"):
            labels, valid = shifted_labels(packed, k, convention=convention)
            assert not valid[pad].any() and (labels[pad] == IGNORE_INDEX).all()
            r, i = valid.nonzero(as_tuple=True)
            assert not pad[r, i + label_offset(k, convention)].any(), "a real token is supervised with padding"

    gate = attention_gate(packed.document_ids)[:, 0]  # [R, T, T]
    real = ~pad
    assert not (gate & pad[:, :, None] & real[:, None, :]).any(), "padding attends to a real token"
    assert not (gate & real[:, :, None] & pad[:, None, :]).any(), "a real token attends to padding"
    assert gate.any(dim=-1).all(), "every row of the gate keeps at least one key (no NaN rows)"

    noisy = packed.input_ids.clone()
    noisy[pad] = torch.randint(1, V, (int(pad.sum()),), generator=torch.Generator().manual_seed(9))
    out = _forward(model, replace(packed, input_ids=noisy))
    assert torch.equal(_forward(model, packed)[real], out[real])


# ----- the gate in its three forms -----


def test_attention_gate_is_what_the_decoder_builds(model, leak_setup, monkeypatch):
    _, packed, _ = leak_setup
    seen: list[torch.Tensor] = []
    sdpa = decoder_module.F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append(kwargs["attn_mask"])
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(decoder_module.F, "scaled_dot_product_attention", spy)
    _forward(model, packed)
    assert len(seen) == model.config.num_hidden_layers
    for mask in seen:
        assert torch.equal(mask, attention_gate(packed.document_ids))


def test_varlen_spans_and_flex_mask_mod_agree_with_the_dense_gate(leak_setup):
    _, packed, _ = leak_setup
    R, T = packed.input_ids.shape
    spans = document_spans(packed.document_ids)
    lengths = spans.lengths
    assert int(spans.cu_seqlens[-1]) == R * T and spans.max_seqlen == int(lengths.max()) == 10
    # Row 0: three documents; row 1: five documents then one padding run.
    assert spans.document_ids.tolist() == [*packed.row_docs[0], *packed.row_docs[1], PAD_DOCUMENT_ID]
    assert lengths.tolist() == [10, 8, 6, 5, 4, 3, 3, 2, 7]

    g = torch.Generator().manual_seed(4)
    H, Dh = 2, 8
    q, k, v = (torch.randn(R, H, T, Dh, generator=g) for _ in range(3))
    dense = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_gate(packed.document_ids))  # [R, H, T, Dh]
    flat = [x.transpose(1, 2).reshape(R * T, H, Dh) for x in (q, k, v)]
    varlen = varlen_attention_reference(*flat, spans).view(R, T, H, Dh).transpose(1, 2)
    torch.testing.assert_close(varlen, dense, rtol=0, atol=1e-6)

    from torch.nn.attention.flex_attention import create_mask

    flex = create_mask(document_mask_mod(packed.document_ids), R, 1, T, T, device="cpu")
    assert torch.equal(flex, attention_gate(packed.document_ids))
