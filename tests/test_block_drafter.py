"""Block-parallel drafters (report §3.1–3.2, DSpark report §3): the index-masked training attention against its
per-anchor dense reference, no leakage across anchors and packed documents, the inference path (one backbone
pass + the head left to right) against the teacher-forced training path, each head's algebra, the DFlare distance
prior, folder IO, presets and bad input.

Models are tiny and run in float64, so fast paths and references agree far below any argmax gap."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from angelspec.decoding.drafters.block_propose import BlockProposer
from angelspec.models import CheckpointError, ConfigError, Decoder, DecoderConfig
from angelspec.models.block.config import (
    CONDITIONINGS,
    HEADS,
    BlockDrafterConfig,
    default_block_layer_ids,
    distance_prior,
    same_layer_taps,
)
from angelspec.models.block.drafter import BlockDrafter, reference_forward_backbone
from angelspec.models.block.heads import GatedMarkovHead, HiddenCorrectionHead, MarkovHead, RNNHead
from angelspec.models.block.io import load_block_drafter, read_block_config, save_block_drafter
from angelspec.models.block.presets import (
    dfly_embedded,
    embedded_target_shape,
    qwen3_8b_dfly,
    qwen3_8b_dspark,
    qwen3_8b_shape,
)
from angelspec.models.block.targets import block_targets, sample_anchors
from angelspec.models.decoder import TrainInputs
from angelspec.models.mtp import concat_taps

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB, MASK = 64, 5


def tiny_target(layers: int = 4, seed: int = 0) -> Decoder:
    cfg = DecoderConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256)
    torch.manual_seed(seed)
    model = Decoder(cfg)
    model.init_weights(std=0.3)
    return model.double().eval()


def tiny_drafter(target: Decoder, *, conditioning: str = "dfly", head: str = "hidden", block_size: int = 4,
                 seed: int = 1, confidence: bool = True, nonzero_heads: bool = True,
                 context_injection: str | None = None, fc_bias: bool | None = None,
                 anchor_fusion: bool = False) -> BlockDrafter:
    cfg = BlockDrafterConfig.for_target(target.config, mask_token_id=MASK, block_size=block_size, num_draft_layers=2,
                                        target_layer_ids=(0, 2, 3), conditioning=conditioning, head=head,
                                        markov_rank=8, confidence_head=confidence, context_injection=context_injection,
                                        fc_bias=fc_bias, anchor_fusion=anchor_fusion)
    model = BlockDrafter(cfg, target.embed_tokens, target.lm_head)
    model.init_weights(std=0.2, generator=torch.Generator().manual_seed(seed))
    if nonzero_heads:  # the zero-initialised projections would hide every head's effect
        with torch.no_grad():
            if isinstance(model.head, MarkovHead):
                model.head.out.weight.normal_(0.0, 0.3, generator=torch.Generator().manual_seed(seed + 1))
            elif isinstance(model.head, HiddenCorrectionHead):
                model.head.down_proj.weight.normal_(0.0, 0.3, generator=torch.Generator().manual_seed(seed + 1))
            if anchor_fusion:
                model.anchor_fuse.weight.normal_(0.0, 0.3, generator=torch.Generator().manual_seed(seed + 2))
    return model.double().eval()


def taps_of(target: Decoder, model: BlockDrafter, ids: torch.Tensor, positions: torch.Tensor | None = None,
            document_ids: torch.Tensor | None = None) -> torch.Tensor:
    with torch.no_grad():  # the target is frozen: its taps are inputs, as in the trainer
        out = target(ids, TrainInputs(positions=positions, document_ids=document_ids,
                                      hidden_layers=list(model.config.target_layer_ids), compute_logits=False))
    return concat_taps(out.hidden)


def packed_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two rows of T = 16: row 0 holds documents of 7 and 9 tokens, row 1 one document of 12 plus padding."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(6, VOCAB, (2, 16), generator=g)
    docs = torch.tensor([[0] * 7 + [1] * 9, [2] * 12 + [-1] * 4])
    pos = torch.tensor([list(range(7)) + list(range(9)), list(range(12)) + [0] * 4])
    return ids, pos, docs


# ----- training attention -----


@pytest.mark.parametrize("attention", ["linear", "dense"])
@pytest.mark.parametrize("conditioning", CONDITIONINGS)
def test_training_attention_matches_per_anchor_reference(conditioning: str, attention: str) -> None:
    """Both training attentions: mask-free tiles (the default) and SDPA under the index-built mask."""
    target = tiny_target()
    model = tiny_drafter(target, conditioning=conditioning)
    ids, pos, docs = packed_batch()
    taps = taps_of(target, model, ids, pos, docs)
    anchors = torch.tensor([[0, 3, 7, 12], [1, 4, 10, 11]])
    fast = model.forward_backbone(taps, ids, pos, anchors, docs, attention=attention)
    slow = reference_forward_backbone(model, taps, ids, pos, anchors, docs)
    torch.testing.assert_close(fast, slow, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("head", HEADS)
def test_no_leakage_after_anchor_block_or_across_documents(head: str) -> None:
    target = tiny_target()
    model = tiny_drafter(target, head=head)
    ids, pos, docs = packed_batch()
    taps = taps_of(target, model, ids, pos, docs)
    anchors = torch.tensor([[2, 9, 11], [3, 5, 8]])
    base = model.forward_train(taps, ids, pos, anchors, document_ids=docs)

    # Anchor (0, 0) = 2 in document 0 (positions 0..6): its block covers 2..5. Perturb the tokens after the block
    # and the taps from the anchor on (the context is strictly before the anchor), and all of document 1.
    ids2, taps2 = ids.clone(), taps.clone()
    ids2[0, 6:] = (ids2[0, 6:] + 7) % VOCAB
    taps2[0, 2:] += torch.randn_like(taps2[0, 2:])
    ids2[1, 9:] = (ids2[1, 9:] + 3) % VOCAB
    out = model.forward_train(taps2, ids2, pos, anchors, document_ids=docs)
    torch.testing.assert_close(out.logits[0, 0], base.logits[0, 0], rtol=0, atol=1e-12)
    torch.testing.assert_close(out.hidden[0, 0], base.hidden[0, 0], rtol=0, atol=1e-12)
    # Row 1's anchors 3 and 5 have blocks ending at 6 and 8: tokens from 9 on are invisible to both.
    torch.testing.assert_close(out.logits[1, :2], base.logits[1, :2], rtol=0, atol=1e-12)
    if base.confidence_logits is not None:
        torch.testing.assert_close(out.confidence_logits[0, 0], base.confidence_logits[0, 0], rtol=0, atol=1e-12)
    # Other anchors do see what changed (the perturbation is not a no-op).
    assert not torch.allclose(out.hidden[0, 1], base.hidden[0, 1])
    # The other way round: all of document 0 perturbed leaves document 1's anchors (9, 11) untouched.
    ids4, taps4 = ids.clone(), taps.clone()
    ids4[0, :7] = (ids4[0, :7] + 5) % VOCAB
    taps4[0, :7] += torch.randn_like(taps4[0, :7])
    out4 = model.forward_train(taps4, ids4, pos, anchors, document_ids=docs)
    torch.testing.assert_close(out4.logits[0, 1:], base.logits[0, 1:], rtol=0, atol=1e-12)

    # The backbone reads only the anchor token of the block: tokens inside the block do not move it either.
    ids3 = ids.clone()
    ids3[0, 3:6] = (ids3[0, 3:6] + 1) % VOCAB
    z3 = model.forward_backbone(taps, ids3, pos, anchors, docs)
    torch.testing.assert_close(z3[0, 0], model.forward_backbone(taps, ids, pos, anchors, docs)[0, 0], rtol=0, atol=0)


def test_packed_document_equals_document_alone() -> None:
    target = tiny_target()
    model = tiny_drafter(target, head="rnn")
    ids, pos, docs = packed_batch()
    taps = taps_of(target, model, ids, pos, docs)
    packed = model.forward_train(taps, ids, pos, torch.tensor([[8, 10, 13]]).expand(2, -1), document_ids=docs)
    alone_ids = ids[:1, 7:]  # document 1 of row 0, alone at positions 0..8
    alone_taps = taps_of(target, model, alone_ids)
    alone = model.forward_train(alone_taps, alone_ids, pos[:1, 7:], torch.tensor([[1, 3, 6]]))
    torch.testing.assert_close(packed.logits[0], alone.logits[0], rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(packed.targets.valid[0], alone.targets.valid[0])


def test_block_targets_stop_at_document_end_and_follow_loss_mask() -> None:
    ids, _, docs = packed_batch()
    loss_mask = torch.ones_like(ids, dtype=torch.bool)
    loss_mask[0, 9] = False
    t = block_targets(ids, torch.tensor([[4, 8], [10, 11]]), 4, document_ids=docs, loss_mask=loss_mask)
    assert t.valid[0, 0].tolist() == [True, True, False]  # 5, 6 in document 0; 7 is document 1
    assert t.valid[0, 1].tolist() == [False, True, True]  # 9 is masked out
    assert t.valid[1, 0].tolist() == [True, False, False]  # 11 ends the document, 12 is padding
    assert t.labels[0, 0].tolist() == ids[0, 5:8].tolist()
    assert t.prev_tokens[0, 0].tolist() == ids[0, 4:7].tolist()
    assert t.source_index[0, 0].tolist() == [4, 5, 6]


def test_sample_anchors_picks_trained_positions_inside_documents() -> None:
    _, _, docs = packed_batch()
    loss_mask = docs >= 0
    loss_mask[1, :6] = False
    anchors, valid = sample_anchors(loss_mask, 5, document_ids=docs, generator=torch.Generator().manual_seed(0))
    assert anchors.shape == valid.shape == (2, 5)
    for r in range(2):
        for a, ok in zip(anchors[r].tolist(), valid[r].tolist(), strict=True):
            if ok:
                assert loss_mask[r, a + 1] and docs[r, a + 1] == docs[r, a]
        got = [a for a, ok in zip(anchors[r].tolist(), valid[r].tolist(), strict=True) if ok]
        assert got == sorted(set(got))
    few, few_valid = sample_anchors(loss_mask, 16, document_ids=docs)
    assert int(few_valid[1].sum()) == 6  # row 1: anchors 5..10 predict trained tokens 6..11


# ----- inference path -----


@pytest.mark.parametrize(("conditioning", "head", "anchor_fusion"), [
    ("dflash", "none", False), ("dflash", "markov", False), ("dflash", "gated", False), ("dflash", "rnn", False),
    ("dfly", "hidden", False), ("dflare", "markov", False), ("dfly", "hidden", True), ("dflash", "markov", True)])
def test_propose_equals_teacher_forced_training_on_its_own_drafts(conditioning: str, head: str,
                                                                  anchor_fusion: bool) -> None:
    """The cached inference path equals the training path; with the fused anchor input, the cache's per-slot
    feature of the anchor's predecessor equals the training path's."""
    target = tiny_target()
    model = tiny_drafter(target, conditioning=conditioning, head=head, block_size=5, anchor_fusion=anchor_fusion)
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(6, VOCAB, (2, 14), generator=g)
    lengths = torch.tensor([6, 9])  # committed context; the anchor sits at position `lengths`
    anchors_tok = ids[torch.arange(2), lengths]
    taps = taps_of(target, model, ids)
    prop = BlockProposer(model).propose_from_taps(taps, lengths, anchors_tok)
    assert prop.tokens.shape == (2, 4) and prop.confidences.shape == (2, 4) and prop.probs is None
    assert torch.equal(prop.tokens, prop.logits.argmax(-1))
    assert ((prop.confidences > 0) & (prop.confidences < 1)).all()
    # Training path on the sequence whose block holds the drafts: same logits, same confidences.
    for r in range(2):
        a = int(lengths[r])
        seq = ids[r: r + 1].clone()
        seq[0, a + 1: a + 5] = prop.tokens[r]
        out = model.forward_train(taps[r: r + 1], seq, torch.arange(14)[None], torch.tensor([[a]]))
        torch.testing.assert_close(out.logits[0, 0], prop.logits[r], rtol=1e-9, atol=1e-9)
        # confidences come back in fp32, like the logits
        torch.testing.assert_close(torch.sigmoid(out.confidence_logits[0, 0]).float(), prop.confidences[r])


def test_propose_cache_appends_in_pieces_and_rolls_back() -> None:
    target = tiny_target()
    model = tiny_drafter(target, head="rnn")
    ids = torch.randint(6, VOCAB, (1, 12), generator=torch.Generator().manual_seed(2))
    taps = taps_of(target, model, ids)
    whole = BlockProposer(model).propose_from_taps(taps[:, :8], torch.tensor([8]), ids[:, 8])
    cache = model.new_cache(1, 12, slack=4, dtype=torch.float64, device="cpu")
    model.append_context(taps[:, :5], cache)
    model.append_context(taps[:, 5:11], cache, num_new=torch.tensor([6]))  # 5..10 written: 3 too many
    cache.truncate(torch.tensor([8]))  # roll back to 8 committed entries
    step = BlockProposer(model).propose(ids[:, 8], cache, kv_len=11)
    torch.testing.assert_close(step.logits, whole.logits, rtol=1e-10, atol=1e-10)
    # Prefill of a subset of rows (a request joining row 2 of 3) writes only that row.
    big = model.new_cache(3, 12, slack=4, dtype=torch.float64, device="cpu")
    big.lengths[:] = torch.tensor([4, 0, 6])
    model.append_context(taps[:, :8], big, num_new=torch.tensor([8]), rows=torch.tensor([1]))
    assert big.lengths.tolist() == [4, 8, 6] and torch.stack(big.k)[:, 0].abs().sum() == 0
    row = BlockProposer(model).propose(ids[:, 8].expand(3), big, kv_len=8)
    torch.testing.assert_close(row.logits[1], whole.logits[0], rtol=1e-10, atol=1e-10)


def test_propose_with_sampling_rule_returns_its_probabilities() -> None:
    target = tiny_target()
    model = tiny_drafter(target, head="gated")
    ids = torch.randint(6, VOCAB, (2, 10), generator=torch.Generator().manual_seed(4))
    taps = taps_of(target, model, ids)
    gen = torch.Generator().manual_seed(0)

    def select(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        probs = torch.softmax(logits, dim=-1)
        return torch.multinomial(probs, 1, generator=gen)[:, 0], probs

    prop = BlockProposer(model).propose_from_taps(taps, torch.tensor([4, 7]), ids[:, 8], select=select)
    assert prop.probs.shape == (2, 3, VOCAB)
    torch.testing.assert_close(prop.probs, torch.softmax(prop.logits, -1))


# ----- heads -----


def test_markov_head_is_low_rank_and_starts_at_zero() -> None:
    head = MarkovHead(VOCAB, 32, rank=3)
    torch.nn.init.normal_(head.out.weight)
    prev = torch.tensor([[1, 7, 7], [0, 63, 2]])
    bias = head.sequence(torch.zeros(2, 3, 32), prev)
    torch.testing.assert_close(bias, head.embed.weight[prev] @ head.out.weight.T)  # Eq. 14: W1[x] W2
    with torch.no_grad():
        transition = head.double().out(head.embed.weight)  # [V, V], row x = the bias after x
    assert torch.linalg.matrix_rank(transition) == 3
    target = tiny_target()
    model = tiny_drafter(target, head="markov", nonzero_heads=False)
    assert model.head.out.weight.abs().sum() == 0  # starts as the plain backbone
    assert model.head.sequence(torch.zeros(1, 2, 32, dtype=torch.float64), prev[:1, :2]).abs().sum() == 0


def test_gated_head_matches_formula() -> None:
    torch.manual_seed(0)
    head = GatedMarkovHead(VOCAB, 16, rank=4)
    torch.nn.init.normal_(head.out.weight)
    h, prev = torch.randn(3, 5, 16), torch.randint(0, VOCAB, (3, 5))
    e = head.embed.weight[prev]
    g = torch.sigmoid(torch.cat([h, e], -1) @ head.gate.weight.T + head.gate.bias)
    torch.testing.assert_close(head.sequence(h, prev), (g * e) @ head.out.weight.T)


def test_rnn_head_equals_hand_unrolled_recurrence() -> None:
    torch.manual_seed(0)
    head = RNNHead(VOCAB, 16, rank=4)
    torch.nn.init.normal_(head.out.weight)
    h, prev = torch.randn(3, 5, 16), torch.randint(0, VOCAB, (3, 5))

    def lin(layer: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        return x @ layer.weight.T + layer.bias

    s = torch.zeros(3, 4)
    expected = []
    for k in range(5):
        zeta = torch.cat([s, head.embed.weight[prev[:, k]], h[:, k]], dim=-1)
        u = torch.sigmoid(lin(head.gate, zeta))
        expected.append(torch.tanh(lin(head.proj, zeta)) @ head.out.weight.T)  # B_k uses ζ_k (s_{k-1})
        s = u * s + (1 - u) * torch.tanh(lin(head.cand, zeta))
    torch.testing.assert_close(head.sequence(h, prev), torch.stack(expected, dim=1))
    # The state carries history: changing the first predecessor changes the last bias.
    prev2 = prev.clone()
    prev2[:, 0] = (prev2[:, 0] + 1) % VOCAB
    assert not torch.allclose(head.sequence(h, prev2)[:, -1], head.sequence(h, prev)[:, -1])


def test_hidden_correction_is_identity_with_zero_output_projection() -> None:
    target = tiny_target()
    model = tiny_drafter(target, head="hidden", nonzero_heads=False)
    z, e = torch.randn(2, 3, 32, dtype=torch.float64), torch.randn(2, 3, 32, dtype=torch.float64)
    assert torch.equal(model.head(z, e), z)
    # So logits equal the plain backbone's.
    prev = torch.randint(0, VOCAB, (2, 3))
    logits, _ = model.head_logits(z, prev)
    torch.testing.assert_close(logits, model.lm_logits(model.norm(z)), rtol=0, atol=0)
    with torch.no_grad():
        model.head.down_proj.weight.normal_()
    assert not torch.allclose(model.head(z, e), z)


def test_confidence_head_shares_markov_embedding_else_owns_one() -> None:
    target = tiny_target()
    dspark = tiny_drafter(target, conditioning="dflash", head="markov")
    assert dspark.config.drafter == "dspark"
    assert not hasattr(dspark, "confidence_embed")
    prev = torch.tensor([3, 9])
    torch.testing.assert_close(dspark.markov_embed(prev), dspark.head.embed(prev))
    dfly = tiny_drafter(target, head="hidden")
    assert dfly.confidence_embed.weight.shape == (VOCAB, 8)
    none = tiny_drafter(target, head="none", confidence=False)
    ids = torch.randint(6, VOCAB, (1, 8))
    out = none.forward_train(taps_of(target, none, ids), ids, torch.arange(8)[None], torch.tensor([[2]]))
    assert out.confidence_logits is None


# ----- DFlare / DFly conditioning -----


def test_distance_prior_peaks_at_matching_depth() -> None:
    ids = default_block_layer_ids(36, 5)
    assert ids == (1, 9, 17, 25, 33)
    alpha = torch.softmax(distance_prior(5, ids, 0.1), dim=-1)
    assert alpha.argmax(-1).tolist() == [0, 1, 2, 3, 4]
    assert (alpha.max(-1).values > 0.5).all()
    assert torch.softmax(distance_prior(3, ids, 0.1), -1).argmax(-1).tolist() == [0, 2, 4]
    # Uneven taps: draft depth 0.5 sits nearest the tap at relative depth 0.4 (layer 5 of 1..11).
    assert torch.softmax(distance_prior(3, (1, 5, 11), 0.1), -1).argmax(-1).tolist() == [0, 1, 2]
    target = tiny_target()
    model = tiny_drafter(target, conditioning="dflare")
    w = model.fusion_weights()
    assert w.shape == (2, 3) and w.argmax(-1).tolist() == [0, 2]
    torch.testing.assert_close(w.sum(-1), torch.ones(2, dtype=w.dtype))


CONDITIONING_PARAMETERS = {  # the raw tensors each conditioning owns (Eq. 10-12), by state-dict name (L = 2)
    "dflash": {"fc.weight", "fc.bias", "hidden_norm.weight"},
    "dflare": {"fusion_logits", "context_norms.0.weight", "context_norms.1.weight"},
    "dfly": {"fc.weight", "fc.bias", "fusion_logits", "context_norms.0.weight", "context_norms.1.weight"},
}


def _rms_norm(x: torch.Tensor, gain: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm written out: gain * x / sqrt(mean(x^2) + eps) over the last dim."""
    return gain * x / torch.sqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)


@pytest.mark.parametrize("conditioning", CONDITIONINGS)
def test_conditioning_equations(conditioning: str) -> None:
    """Eq. 10-12 (report §3.1) rebuilt from the raw weight tensors with explicit arithmetic, never through the model's
    modules, so a wrong module, a swapped layer index or a mis-sliced W_fc is caught:
        Eq. 10  c_t = W_fc [h_t^(1); ...; h_t^(n)] + b_fc                (tap j meets columns j*C:(j+1)*C of W_fc)
        Eq. 11  alpha^(i) = softmax(W_fuse[i, :]),  f_t^(i) = sum_j alpha^(i)_j h_t^(j)
        Eq. 12  g_t^(i) = RMSNorm_i(c_t + f_t^(i))                        (dfly)
    dflash feeds RMSNorm(c_t) (its `hidden_norm`) to every draft layer; dflare RMSNorm_i(f_t^(i)). The taps h^(j) are
    read from the target directly (not through `concat_taps`), and every gain, bias and fusion logit is random, so no
    tensor can stand in for another."""
    target = tiny_target()
    model = tiny_drafter(target, conditioning=conditioning, fc_bias=True)  # Eq. 10's b_fc (new DFlash drafters omit it)
    params = dict(model.named_parameters())
    own = {k for k in params if not k.startswith(("layers.", "norm.", "head.", "confidence"))}
    assert own == CONDITIONING_PARAMETERS[conditioning]
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name in sorted(own):
            noise = torch.randn(params[name].shape, generator=g, dtype=params[name].dtype)
            if "norm" in name:  # RMSNorm gains around 1
                params[name].copy_(1.0 + 0.5 * noise)
            else:  # W_fc (scaled to the taps' size), b_fc, W_fuse
                params[name].copy_(noise * (0.2 if name == "fc.weight" else 1.0))
    ids = torch.randint(6, VOCAB, (1, 6), generator=g)
    with torch.no_grad():
        inputs = TrainInputs(hidden_layers=list(model.config.target_layer_ids), compute_logits=False)
        h = target(ids, inputs).hidden  # n x [1, T, C]
        feats = model.context_features(taps_of(target, model, ids))
    C, eps, n, L = model.config.hidden_size, model.config.rms_norm_eps, len(h), model.config.num_draft_layers
    assert len(feats) == L == 2 and n == 3
    if conditioning != "dflare":  # Eq. 10
        w_fc, b_fc = params["fc.weight"].detach(), params["fc.bias"].detach()  # [C, n*C], [C]
        c = sum(h[j] @ w_fc[:, j * C:(j + 1) * C].T for j in range(n)) + b_fc
    for i in range(L):
        if conditioning == "dflash":
            expected = _rms_norm(c, params["hidden_norm.weight"].detach(), eps)
        else:
            logits = params["fusion_logits"].detach()[i]  # [n], W_fuse[i, :]
            e = torch.exp(logits - logits.max())
            alpha = e / e.sum()  # Eq. 11
            f = sum(alpha[j] * h[j] for j in range(n))
            gain = params[f"context_norms.{i}.weight"].detach()
            expected = _rms_norm(f if conditioning == "dflare" else c + f, gain, eps)  # Eq. 12
        torch.testing.assert_close(feats[i], expected, rtol=1e-12, atol=1e-12)


# ----- DSpark's context injection (Uraion §3.3) -----


def test_same_layer_taps_match_layers_and_taps_by_relative_depth() -> None:
    assert same_layer_taps(5, 5) == (0, 1, 2, 3, 4)  # one to one
    assert same_layer_taps(2, 3) == (0, 2) and same_layer_taps(3, 5) == (0, 2, 4)  # fewer layers: own taps, ends kept
    assert same_layer_taps(1, 3) == (1,) and same_layer_taps(1, 2) == (1,)  # one layer: the middle (deeper) tap
    assert same_layer_taps(5, 2) == (0, 0, 1, 1, 1)  # more layers than taps: neighbours share, every tap read
    for layers in range(1, 8):
        for taps in range(1, 8):
            j = same_layer_taps(layers, taps)
            assert len(j) == layers and list(j) == sorted(j) and all(0 <= x < taps for x in j)
            assert len(set(j)) == min(layers, taps)  # distinct when layers <= taps, all taps when layers >= taps


def test_same_layer_injection_gives_each_draft_layer_its_own_tap() -> None:
    target = tiny_target()
    model = tiny_drafter(target, conditioning="dflash", head="markov")  # a new DSpark: same-layer by default
    cfg = model.config
    assert cfg.context_injection == "same_layer" and cfg.context_taps == (0, 2) and not cfg.has_fc
    assert not hasattr(model, "fc") and not hasattr(model, "hidden_norm") and not hasattr(model, "fusion_logits")
    ids = torch.randint(6, VOCAB, (1, 6))
    taps = taps_of(target, model, ids)
    per_tap = taps.view(1, 6, 3, 32)
    feats = model.context_features(taps)
    for i, j in enumerate((0, 2)):  # draft layer 0 reads tap id 0, layer 1 tap id 3 (taps (0, 2, 3))
        torch.testing.assert_close(feats[i], model.context_norms[i](per_tap[:, :, j]), rtol=0, atol=0)
    # The tap no layer reads changes nothing; the one layer 0 reads changes layer 0's context only.
    moved = per_tap.clone()
    moved[:, :, 1] += 5.0
    assert all(torch.equal(a, b) for a, b in zip(feats, model.context_features(moved.view(1, 6, 96)), strict=True))
    moved = per_tap.clone()
    moved[:, :, 0] += 5.0
    after = model.context_features(moved.view(1, 6, 96))
    assert not torch.allclose(after[0], feats[0]) and torch.equal(after[1], feats[1])
    # The index-masked training attention still equals the per-anchor reference.
    ids, pos, docs = packed_batch()
    taps = taps_of(target, model, ids, pos, docs)
    anchors = torch.tensor([[0, 3, 7, 12], [1, 4, 10, 11]])
    torch.testing.assert_close(model.forward_backbone(taps, ids, pos, anchors, docs),
                               reference_forward_backbone(model, taps, ids, pos, anchors, docs), rtol=1e-10, atol=1e-10)


def test_new_drafters_pick_the_injection_and_fc_bias_old_folders_keep_theirs(tmp_path) -> None:
    """New DSpark: same-layer injection; new DFlash / shared-context DSpark: fc without bias; DFly keeps Eq. 12's
    bias. A folder saved before the two fields existed (no context_injection / fc_bias in config.json) loads as it
    was built: the shared context with a biased fc."""
    target = tiny_target()
    shared = tiny_drafter(target, conditioning="dflash", head="markov", context_injection="shared")
    assert shared.config.context_injection == "shared" and shared.config.has_fc and shared.fc.bias is None
    assert tiny_drafter(target, conditioning="dflash", head="none").fc.bias is None
    assert tiny_drafter(target, conditioning="dfly").fc.bias is not None
    old = BlockDrafterConfig.for_target(target.config, mask_token_id=MASK, block_size=4, num_draft_layers=2,
                                        target_layer_ids=(0, 2, 3), conditioning="dflash", head="markov",
                                        markov_rank=8, context_injection="shared", fc_bias=True)
    model = BlockDrafter(old, target.embed_tokens, target.lm_head)
    model.init_weights(std=0.2, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        model.fc.bias.normal_(0.0, 0.3, generator=torch.Generator().manual_seed(4))
    model.double()  # after the fp32 init, like `tiny_drafter`: the loader builds in fp32, then casts
    out = save_block_drafter(model, tmp_path / "old")
    raw = json.loads((out / "config.json").read_text())
    assert raw["block_drafter_config"]["context_injection"] == "shared" and raw["block_drafter_config"]["fc_bias"]
    for key in ("context_injection", "fc_bias"):  # as written before these fields existed
        del raw["block_drafter_config"][key]
    (out / "config.json").write_text(json.dumps(raw))
    loaded = load_block_drafter(out, target, drafter="dspark")
    assert loaded.config == old and torch.equal(loaded.fc.bias, model.fc.bias)
    ids = torch.randint(6, VOCAB, (1, 10))
    taps = taps_of(target, model, ids)
    torch.testing.assert_close(BlockProposer(loaded).propose_from_taps(taps, torch.tensor([6]), ids[:, 6]).logits,
                               BlockProposer(model).propose_from_taps(taps, torch.tensor([6]), ids[:, 6]).logits,
                               rtol=0, atol=0)


def test_shipped_dspark_loads_and_proposes_exactly_as_before(tmp_path) -> None:
    """The shipped DSpark proposes exactly what it proposed when it was exported (values computed when its second
    stage, with the fused anchor input, was exported at 4,000 steps: retraining it means recomputing them), and its
    folder written without the later fields (as folders saved before context_injection / fc_bias /
    confidence_target existed) still loads with DFlash's shared context, the fc bias and the "tv" confidence head,
    and proposes the same."""
    import shutil

    from angelspec.assets import DEFAULT_DRAFTERS, DEFAULT_TARGET
    from angelspec.models import load_target

    folder = DEFAULT_DRAFTERS / "dspark"
    if not (folder / "config.json").is_file() or not (DEFAULT_TARGET / "config.json").is_file():
        pytest.skip("the shipped DSpark or the embedded target is not in this checkout")
    target = load_target(DEFAULT_TARGET, dtype=torch.float32)
    old = tmp_path / "dspark-old-format"
    shutil.copytree(folder, old)
    raw = json.loads((old / "config.json").read_text())
    later = ("context_injection", "fc_bias", "confidence_target", "confidence_temperatures")
    design = raw["block_drafter_config"]
    assert all(k in design for k in later)  # the exported folder writes them
    raw["block_drafter_config"] = {k: v for k, v in design.items() if k not in later}
    (old / "config.json").write_text(json.dumps(raw))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(6, 8192, (3, 24), generator=g)
    lengths = torch.tensor([24, 17, 9])
    props = []
    for path in (folder, old):
        model = load_block_drafter(path, target, dtype=torch.float32)
        assert model.config.context_injection == "shared" and model.config.fc_bias and model.fc.bias is not None
        assert model.config.confidence_target == "tv"
        with torch.no_grad():
            taps = concat_taps(target(ids, TrainInputs(hidden_layers=list(model.config.target_layer_ids),
                                                       compute_logits=False)).hidden)
            props.append(BlockProposer(model).propose_from_taps(taps, lengths - 1, ids[torch.arange(3), lengths - 1]))
    prop, prop_old = props
    assert torch.equal(prop.tokens, prop_old.tokens) and torch.equal(prop.logits, prop_old.logits)
    assert model.config.anchor_fusion
    assert prop.tokens.tolist() == [[306, 394, 789, 306, 3374, 19, 88],
                                    [19, 1253, 300, 552, 941, 941, 19],
                                    [310, 7770, 310, 7770, 310, 7770, 363]]
    want_conf = [[0.196484, 0.278533, 0.277707, 0.437043, 0.182754, 0.172879, 0.165816],
                 [0.566558, 0.620596, 0.420151, 0.665363, 0.381154, 0.400738, 0.452076],
                 [0.764586, 0.867506, 0.767827, 0.865094, 0.843538, 0.905118, 0.808426]]
    torch.testing.assert_close(prop.confidences, torch.tensor(want_conf), rtol=0, atol=2e-5)
    want_max = [4.491, 8.3971, 7.9858, 12.9458, 6.6959, 5.0181, 4.9567, 6.1664, 4.5568, 5.0289, 6.9583, 4.6247, 5.0955,
                5.1045, 6.2757, 5.2221, 6.5966, 5.6358, 6.3863, 5.6599, 5.6743]
    torch.testing.assert_close(prop.logits.max(-1).values.flatten(), torch.tensor(want_max), rtol=0, atol=2e-4)


# ----- the fused anchor input (anchor_fusion) -----


@pytest.mark.parametrize("conditioning", ["dfly", "dflash"])
def test_anchor_fusion_training_matches_reference_and_inference(conditioning: str) -> None:
    """The fused anchor input reads the context feature of the position before the anchor, in its own document:
    the batched training backbone equals the per-anchor reference (anchors 0 and 7 start a document: no
    predecessor). (The cached inference path: `test_propose_equals_teacher_forced_training_on_its_own_drafts`.)"""
    target = tiny_target()
    model = tiny_drafter(target, conditioning=conditioning, anchor_fusion=True)
    ids, pos, docs = packed_batch()
    taps = taps_of(target, model, ids, pos, docs)
    anchors = torch.tensor([[0, 3, 7, 12], [1, 4, 10, 11]])
    for attention in ("linear", "dense"):
        fast = model.forward_backbone(taps, ids, pos, anchors, docs, attention=attention)
        torch.testing.assert_close(fast, reference_forward_backbone(model, taps, ids, pos, anchors, docs),
                                   rtol=1e-10, atol=1e-10)
    # A document's first anchor gets nothing from the previous document: equal to the document alone.
    alone_ids = ids[:1, 7:]
    alone = model.forward_backbone(taps_of(target, model, alone_ids), alone_ids, pos[:1, 7:], torch.tensor([[0]]))
    torch.testing.assert_close(fast[0, 2], alone[0, 0], rtol=1e-9, atol=1e-9)


def test_anchor_fusion_cache_rolls_back_resets_rows_and_starts_as_the_plain_drafter() -> None:
    target = tiny_target()
    model = tiny_drafter(target, anchor_fusion=True)
    ids = torch.randint(6, VOCAB, (1, 12), generator=torch.Generator().manual_seed(2))
    taps = taps_of(target, model, ids)
    whole = BlockProposer(model).propose_from_taps(taps[:, :8], torch.tensor([8]), ids[:, 8])
    cache = model.new_cache(2, 12, slack=4, dtype=torch.float64, device="cpu")
    model.append_context(taps[:, :5].expand(2, -1, -1), cache)
    model.append_context(taps[:, 5:11].expand(2, -1, -1), cache, num_new=torch.tensor([6, 6]))
    cache.truncate(torch.tensor([8, 8]))  # the newest committed feature is slot 7's again, not slot 10's
    drafting = BlockProposer(model)
    torch.testing.assert_close(drafting.propose(ids[:, 8].expand(2), cache, kv_len=11).logits[0], whole.logits[0],
                               rtol=1e-10, atol=1e-10)
    cache.reset_rows([1])  # a new request with an empty context: no predecessor feature
    empty = BlockProposer(model).propose(ids[:, 8].expand(2), cache, kv_len=11)
    fresh = BlockProposer(model).propose(ids[:, 8], model.new_cache(1, 12, slack=4, dtype=torch.float64, device="cpu"),
                                         kv_len=11)
    torch.testing.assert_close(empty.logits[1], fresh.logits[0], rtol=1e-10, atol=1e-10)

    # W_a starts at zero: before training, the drafter proposes exactly what the same weights without it do, so a
    # trained drafter can be warm-started with the input added.
    plain = tiny_drafter(target)
    fused = BlockDrafter(replace(plain.config, anchor_fusion=True), target.embed_tokens, target.lm_head).double()
    fused.init_weights()
    missing, unexpected = fused.load_state_dict(plain.state_dict(), strict=False)
    assert sorted(missing) == ["anchor_fuse.weight", "anchor_norm.weight"] and not unexpected
    a = BlockProposer(plain).propose_from_taps(taps, torch.tensor([8]), ids[:, 8])
    b = BlockProposer(fused.eval()).propose_from_taps(taps, torch.tensor([8]), ids[:, 8])
    torch.testing.assert_close(b.logits, a.logits, rtol=0, atol=0)
    with pytest.raises(ConfigError, match="anchor_fusion must be true or false"):
        replace(plain.config, anchor_fusion="yes")


def test_sequence_parallel_training_refuses_the_fused_anchor_input() -> None:
    """A shard's first anchor lacks its predecessor's feature, so sequence parallelism refuses the design up front
    (the trainer checks it before anything is written, and the SP forward again)."""
    from types import SimpleNamespace

    from angelspec.train.block import check_sp_design

    fused = tiny_drafter(tiny_target(), anchor_fusion=True).config
    with pytest.raises(ConfigError, match=r"anchor_fusion.*--sp 1"):
        check_sp_design(fused, SimpleNamespace(enabled=True))
    check_sp_design(fused, SimpleNamespace(enabled=False))
    check_sp_design(replace(fused, anchor_fusion=False), SimpleNamespace(enabled=True))


# ----- folder IO -----


def test_save_load_round_trip_and_mismatches(tmp_path) -> None:
    target = tiny_target()
    model = tiny_drafter(target, conditioning="dflash", head="rnn")
    out = save_block_drafter(model, tmp_path / "dspark", extra={"step": 3})
    raw = json.loads((out / "config.json").read_text())
    meta = raw["angelspec"]
    assert meta["drafter"] == "dspark" and meta["head"] == "rnn" and meta["block_size"] == 4
    assert meta["target_layer_ids"] == [0, 2, 3] and meta["target_fingerprint"] == target.config.fingerprint()
    assert meta["step"] == 3
    assert not any("embed_tokens" in k or "lm_head" in k for k in model.state_dict())
    loaded = load_block_drafter(out, target, drafter="dspark", head="rnn")
    ids = torch.randint(6, VOCAB, (1, 10))
    taps = taps_of(target, model, ids)
    a = model.forward_train(taps, ids, torch.arange(10)[None], torch.tensor([[3, 6]]))
    b = loaded.forward_train(taps, ids, torch.arange(10)[None], torch.tensor([[3, 6]]))
    torch.testing.assert_close(a.logits, b.logits, rtol=0, atol=0)

    with pytest.raises(CheckpointError, match="trained with the 'rnn' head, not 'hidden'"):
        load_block_drafter(out, target, head="hidden")
    with pytest.raises(CheckpointError, match="holds a dspark drafter, not dfly"):
        read_block_config(out, drafter="dfly")
    other = tiny_target(layers=5)
    with pytest.raises(ConfigError, match="fingerprint"):
        load_block_drafter(out, other)
    shallow = tiny_target(layers=3)
    with pytest.raises(ConfigError, match=r"out of range"):
        load_block_drafter(out, shallow)
    # A config edited to another head no longer matches the weights.
    raw["block_drafter_config"]["head"] = "gated"
    (out / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="weights do not match"):
        load_block_drafter(out, target)
    with pytest.raises(CheckpointError, match="no config.json"):
        read_block_config(tmp_path / "nowhere")


# ----- presets -----


def test_dfly_embedded_preset_builds_and_runs() -> None:
    cfg = dfly_embedded()
    shape = embedded_target_shape()
    assert (cfg.vocab_size, cfg.hidden_size, cfg.target_num_layers, cfg.mask_token_id) == (8192, 256, 6, 5)
    assert cfg.drafter == "dfly" and cfg.head == "hidden" and cfg.num_drafts == 7
    assert cfg.target_fingerprint == shape.fingerprint()
    assert dfly_embedded(head="markov").head == "markov"
    embed, head = torch.nn.Embedding(8192, 256), torch.nn.Linear(256, 8192, bias=False)
    model = BlockDrafter(cfg, embed, head).eval()
    ids = torch.randint(6, 8192, (1, 12))
    taps = torch.randn(1, 12, 3 * 256)
    with torch.no_grad():
        out = model.forward_train(taps, ids, torch.arange(12)[None], torch.tensor([[3]]))
        prop = BlockProposer(model).propose_from_taps(taps, torch.tensor([5]), ids[:, 5])
    assert out.logits.shape == (1, 1, 7, 8192) and prop.tokens.shape == (1, 7)


@pytest.mark.parametrize("preset", [qwen3_8b_dfly, qwen3_8b_dspark])
def test_qwen3_8b_presets_have_paper_shapes_and_build_scaled_down(preset) -> None:
    cfg = preset()
    assert cfg.target_layer_ids == (1, 9, 17, 25, 33) and cfg.num_draft_layers == 5 and cfg.block_size == 8
    assert (cfg.hidden_size, cfg.vocab_size, cfg.mask_token_id) == (4096, 151936, 151669)
    assert cfg.target_fingerprint == qwen3_8b_shape().fingerprint()
    assert cfg.drafter == ("dfly" if preset is qwen3_8b_dfly else "dspark")
    # The same design on a tiny 10-layer target: build, one training forward + backward, one proposal.
    target = tiny_target(layers=10)
    small = preset(target.config, mask_token_id=MASK)
    assert small.num_draft_layers == 5 and small.num_taps == 5 and small.head == cfg.head
    model = BlockDrafter(small, target.embed_tokens, target.lm_head).double()
    ids = torch.randint(6, VOCAB, (1, 20))
    taps = taps_of(target, model, ids)
    out = model.forward_train(taps, ids, torch.arange(20)[None], torch.tensor([[2, 9]]))
    assert out.logits.shape == (1, 2, 7, VOCAB) and out.confidence_logits.shape == (1, 2, 7)
    out.logits.logsumexp(-1).sum().backward()
    assert target.embed_tokens.weight.grad is None and target.lm_head.weight.grad is None  # frozen by reference
    assert model.layers[0].attn.qkv_proj.weight.grad is not None
    assert BlockProposer(model).propose_from_taps(taps, torch.tensor([11]), ids[:, 11]).tokens.shape == (1, 7)


# ----- bad input -----


def test_bad_configs_raise_clear_errors() -> None:
    shape = tiny_target().config

    def make(**kw):
        args = dict(mask_token_id=MASK, block_size=4, num_draft_layers=2, target_layer_ids=(0, 2))
        args.update(kw)
        return BlockDrafterConfig.for_target(shape, **args)

    for b in (1, 0, -3):
        with pytest.raises(ConfigError, match="block_size must be an int >= 2"):
            make(block_size=b)
    with pytest.raises(ConfigError, match=r"do not fit a target with 4 layers.*\[4\] out of range"):
        make(target_layer_ids=(1, 4))
    with pytest.raises(ConfigError, match="out of range"):
        make(target_layer_ids=(-1, 2))
    with pytest.raises(ConfigError, match="mask_token_id is required"):
        make(mask_token_id=None)
    with pytest.raises(ConfigError, match="mask token id 64 is not in the vocabulary"):
        make(mask_token_id=VOCAB)
    with pytest.raises(ConfigError, match="unknown head 'tree'"):
        make(head="tree")
    with pytest.raises(ConfigError, match="unknown conditioning"):
        make(conditioning="eagle")
    with pytest.raises(ConfigError, match="strictly increasing"):
        make(target_layer_ids=(2, 2))
    with pytest.raises(ConfigError, match="not in the vocabulary"):
        make().check_mask_token(4)  # a tokenizer with only 4 ids lacks the mask token
    with pytest.raises(ConfigError, match="unknown block drafter config fields"):
        BlockDrafterConfig.from_dict({**make().to_dict(), "markov_head_type": "vanilla"})
    with pytest.raises(ConfigError, match="unknown context_injection 'per_layer'; choose one of shared, same_layer"):
        make(conditioning="dflash", head="markov", context_injection="per_layer")
    for design in (dict(conditioning="dflash", head="none"), dict(conditioning="dfly", head="markov"),
                   dict(conditioning="dflare", head="markov")):  # same-layer injection is DSpark's backbone only
        with pytest.raises(ConfigError, match="context_injection=same_layer is DSpark's backbone.*pass "
                                              "context_injection=shared"):
            make(context_injection="same_layer", **design)
    with pytest.raises(ConfigError, match="fc_bias must be true or false"):
        make(fc_bias="no")


def test_bad_forward_inputs() -> None:
    target = tiny_target()
    model = tiny_drafter(target)
    ids = torch.randint(6, VOCAB, (1, 8))
    taps = taps_of(target, model, ids)
    with pytest.raises(ValueError, match="taps must be"):
        model.forward_train(taps[..., :64], ids, torch.arange(8)[None], torch.tensor([[1]]))
    with pytest.raises(ValueError, match="anchors must index"):
        model.forward_train(taps, ids, torch.arange(8)[None], torch.tensor([[8]]))
    with pytest.raises(ValueError, match=r"anchors \[R, N\]"):
        model.forward_train(taps, ids, torch.arange(8)[None], torch.tensor([1]))
    with pytest.raises(ValueError, match=r"anchor_tokens must be \[B\]"):
        BlockProposer(model).propose_from_taps(taps, torch.tensor([4]), torch.tensor([[1]]))
    with pytest.raises(ConfigError, match="do not match"):
        BlockDrafter(model.config, torch.nn.Embedding(VOCAB + 1, 32), target.lm_head)


@pytest.mark.parametrize(("conditioning", "head"), [("dflash", "none"), ("dflash", "markov"), ("dflash", "gated"),
                                                    ("dflash", "rnn"), ("dfly", "hidden")])
@pytest.mark.parametrize("sampled", [False, True])
def test_propose_equals_the_one_position_at_a_time_head(conditioning: str, head: str, sampled: bool) -> None:
    """`propose` runs everything that does not depend on the predecessor for the whole block at once; it must give
    exactly the drafts, logits, sampling distributions and confidences of the head run one position (one LM-head
    call) at a time — with heads strong enough that the predecessor changes the argmax."""
    target = tiny_target()
    model = tiny_drafter(target, conditioning=conditioning, head=head, block_size=8)
    if model.head is not None:  # a strong head, so that its predecessor really changes the argmax
        with torch.no_grad():
            for p in model.head.parameters():
                p.mul_(6.0)
    B, T = 6, 12
    ids = torch.randint(6, VOCAB, (B, T + 1), generator=torch.Generator().manual_seed(11))
    taps = taps_of(target, model, ids)
    cache = model.new_cache(B, T, slack=8, dtype=torch.float64, device="cpu")
    model.append_context(taps[:, :T], cache, num_new=torch.tensor([12, 5, 9, 12, 3, 7]))
    anchors = ids[:, T]

    def select(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        # A pure function of (logits, k), as the engine's counter-based sampling is.
        probs = torch.softmax(logits / 0.7, dim=-1)
        u = torch.rand(B, VOCAB, generator=torch.Generator().manual_seed(100 + k), dtype=torch.float64)
        return (torch.log(u) / probs).argmax(-1), probs  # exponential-race sample of probs

    rule = select if sampled else None
    with torch.no_grad():
        fast = BlockProposer(model).propose(anchors, cache, kv_len=T, select=rule)
    ref = BlockProposer(model).reference_propose(anchors, cache, kv_len=T, select=rule)
    assert torch.equal(fast.tokens, ref.tokens)
    torch.testing.assert_close(fast.logits, ref.logits, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(fast.confidences, ref.confidences)  # fp32 outputs
    if sampled:
        torch.testing.assert_close(fast.probs, ref.probs, rtol=1e-10, atol=1e-10)
    else:
        assert fast.probs is None and ref.probs is None
    if model.head is not None:  # the head really depends on the predecessor: the backbone's argmax differs
        with torch.no_grad():
            backbone = model.draft_logits(model.norm(model.backbone_step(anchors, cache, T)[:, 1:])).argmax(-1)
        assert not torch.equal(backbone, fast.token_index)


@pytest.mark.parametrize(("conditioning", "head"), [("dflash", "none"), ("dflash", "rnn"), ("dfly", "hidden")])
def test_propose_fewer_drafts_runs_the_head_over_a_prefix_of_the_block(conditioning: str, head: str) -> None:
    """num_drafts = n < B−1 gives exactly the first n drafts of the whole block (the backbone still sees all B
    entries), greedy and sampled; n outside 1..B−1 is a clear error."""
    target = tiny_target()
    model = tiny_drafter(target, conditioning=conditioning, head=head, block_size=8)
    B, T = 3, 10
    ids = torch.randint(6, VOCAB, (B, T + 1), generator=torch.Generator().manual_seed(5))
    cache = model.new_cache(B, T, slack=8, dtype=torch.float64, device="cpu")
    model.append_context(taps_of(target, model, ids)[:, :T], cache)

    def select(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        probs = torch.softmax(logits, dim=-1)
        u = torch.rand(B, VOCAB, generator=torch.Generator().manual_seed(7 + k), dtype=torch.float64)
        return (torch.log(u) / probs).argmax(-1), probs

    with torch.no_grad():
        for rule in (None, select):
            full = BlockProposer(model).propose(ids[:, T], cache, kv_len=T, select=rule)
            part = BlockProposer(model).propose(ids[:, T], cache, kv_len=T, select=rule, num_drafts=3)
            assert part.tokens.shape == (B, 3) and part.confidences.shape == (B, 3)
            assert torch.equal(part.tokens, full.tokens[:, :3])
            torch.testing.assert_close(part.logits, full.logits[:, :3])
            torch.testing.assert_close(part.confidences, full.confidences[:, :3])
        for bad in (0, 8):
            with pytest.raises(ValueError, match=r"proposes 1\.\.7 drafts"):
                BlockProposer(model).propose(ids[:, T], cache, kv_len=T, num_drafts=bad)


@pytest.mark.parametrize("head", ["none", "markov", "hidden"])
def test_a_select_rule_without_probs_gives_a_proposal_without_probs(head: str) -> None:
    """`select` may return (tokens, None): the proposal then carries no sampling distribution (and no crash)."""
    target = tiny_target()
    model = tiny_drafter(target, conditioning="dfly" if head == "hidden" else "dflash", head=head, block_size=4)
    ids = torch.randint(6, VOCAB, (2, 7), generator=torch.Generator().manual_seed(9))
    cache = model.new_cache(2, 6, slack=4, dtype=torch.float64, device="cpu")
    model.append_context(taps_of(target, model, ids)[:, :6], cache)
    with torch.no_grad():
        got = BlockProposer(model).propose(ids[:, 6], cache, kv_len=6,
                                           select=lambda logits, k: (logits.argmax(-1), None))
        greedy = BlockProposer(model).propose(ids[:, 6], cache, kv_len=6)
    assert got.probs is None and torch.equal(got.tokens, greedy.tokens)


@pytest.mark.parametrize("S", [0, 1, 9])
def test_context_block_attention_equals_sdpa_over_the_concatenated_keys(S: int) -> None:
    """Inference attention scores the context and the block's own keys apart (no copy of the context K/V); it must
    equal scaled_dot_product_attention over [ctx; own] with the mask the training path builds, GQA included."""
    from angelspec.models.block.drafter import context_block_attention

    g = torch.Generator().manual_seed(S)
    B, H, Hkv, Tq, Dh = 3, 4, 2, 5, 8
    q = torch.randn(B, H, Tq, Dh, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, Hkv, Tq, Dh, generator=g, dtype=torch.float64) for _ in range(2))
    ck, cv = (torch.randn(B, Hkv, S, Dh, generator=g, dtype=torch.float64) for _ in range(2))
    valid = torch.rand(B, S, generator=g) < 0.6
    if S:
        valid[0] = False  # a row that sees no context at all
    mask = torch.cat([valid, torch.ones(B, Tq, dtype=torch.bool)], dim=1)[:, None, None, :].expand(-1, 1, Tq, -1)
    want = torch.nn.functional.scaled_dot_product_attention(q, torch.cat([ck, k], 2), torch.cat([cv, v], 2),
                                                            attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(context_block_attention(q, k, v, ck, cv, valid), want, rtol=1e-12, atol=1e-12)


def factored_and_plain(model: BlockDrafter, anchors: torch.Tensor, cache, kv_len: int) -> tuple:
    """Greedy proposals with the hidden-correction head factored and plain."""
    with torch.no_grad():
        fast = BlockProposer(model).propose(anchors, cache, kv_len=kv_len)
        plain = BlockProposer(model, factor_hidden_head=False).propose(anchors, cache, kv_len=kv_len)
    return fast, plain


def test_factored_hidden_head_equals_the_plain_head_and_follows_weight_changes() -> None:
    """Greedy DFly drafting on CPU runs the hidden-correction head factored (W' z_k + (W' W_down) a_k, T_e rows):
    same drafts and logits as the plain head, with and without a draft vocabulary, and its cached tables follow
    in-place weight edits and a new draft vocabulary."""
    target = tiny_target()
    for draft_vocab in (0, 24):
        cfg = BlockDrafterConfig.for_target(target.config, mask_token_id=MASK, block_size=8, num_draft_layers=1,
                                            target_layer_ids=(0, 2, 3), conditioning="dfly", head="hidden",
                                            markov_rank=8, draft_vocab_size=draft_vocab)
        model = BlockDrafter(cfg, target.embed_tokens, target.lm_head)
        model.init_weights(std=0.2, generator=torch.Generator().manual_seed(2))
        model = model.double().eval()
        with torch.no_grad():
            for p in model.head.parameters():
                p.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(3))
        assert BlockProposer(model).factored_head()
        B, T = 2, 10  # the factored head runs for at most FACTORED_HEAD_MAX_ROWS rows
        ids = torch.randint(6, VOCAB, (B, T + 1), generator=torch.Generator().manual_seed(4))
        cache = model.new_cache(B, T, slack=8, dtype=torch.float64, device="cpu")
        model.append_context(taps_of(target, model, ids)[:, :T], cache)
        for edit in range(3):
            fast, plain = factored_and_plain(model, ids[:, T], cache, T)
            assert torch.equal(fast.tokens, plain.tokens) and torch.equal(fast.token_index, plain.token_index)
            torch.testing.assert_close(fast.logits, plain.logits, rtol=1e-6, atol=1e-6)  # fp32 logits
            torch.testing.assert_close(fast.confidences, plain.confidences)
            with torch.no_grad():
                if edit == 0:
                    model.head.down_proj.weight.mul_(-2.0)  # in place: the tables must be rebuilt
                elif draft_vocab:
                    model.set_draft_vocab(torch.randperm(VOCAB, generator=torch.Generator().manual_seed(5))[:24])
                else:
                    model.norm.weight.add_(0.5)
        assert "factored head" in model._derived


def test_factored_head_is_off_without_a_hidden_head_or_with_too_large_tables(monkeypatch) -> None:
    from angelspec.decoding.drafters import block_propose

    target = tiny_target()
    assert not BlockProposer(tiny_drafter(target, conditioning="dflash", head="markov")).factored_head()
    assert not BlockProposer(tiny_drafter(target, conditioning="dfly", head="none")).factored_head()
    model = tiny_drafter(target)
    drafting = BlockProposer(model)
    assert drafting.factored_head() and drafting.factored_head(rows=2) and not drafting.factored_head(rows=3)
    monkeypatch.setattr(block_propose, "FACTORED_HEAD_MAX_BYTES", 1024)  # the tables take 64·(32+32+64)·8 bytes
    assert not BlockProposer(model).factored_head()
    ids = torch.randint(6, VOCAB, (1, 7), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        prop = BlockProposer(model).propose_from_taps(taps_of(target, model, ids)[:, :6], torch.tensor([6]), ids[:, 6])
    assert "factored head" not in model._derived and prop.tokens.shape == (1, 3)


@pytest.mark.parametrize("confidence", [True, False])
def test_greedy_propose_without_logits_gives_the_same_drafts_and_confidences(confidence: bool) -> None:
    """The engine asks for no logits: the factored head then skips forming them when a confidence head gives the
    confidences (and must still form them when the confidences are the drafts' own probabilities)."""
    target = tiny_target()
    model = tiny_drafter(target, confidence=confidence, block_size=6)
    ids = torch.randint(6, VOCAB, (1, 9), generator=torch.Generator().manual_seed(12))
    cache = model.new_cache(1, 8, slack=6, dtype=torch.float64, device="cpu")
    model.append_context(taps_of(target, model, ids)[:, :8], cache)
    with torch.no_grad():
        full = BlockProposer(model).propose(ids[:, 8], cache, kv_len=8)
        lean = BlockProposer(model).propose(ids[:, 8], cache, kv_len=8, with_logits=False)
    assert torch.equal(full.tokens, lean.tokens) and torch.equal(full.token_index, lean.token_index)
    torch.testing.assert_close(full.confidences, lean.confidences)
    assert (lean.logits is None) == confidence


def test_inference_gathers_rope_from_a_table_with_the_per_call_values() -> None:
    """Inference reads RoPE from a cached table (`DraftRope.rope_at`, block and MTP drafters): exactly the values
    `rope` computes per call; the table grows for larger sizes and is rebuilt for another dtype."""
    from angelspec.models.mtp import MTPConfig, MTPDraftModel

    target = tiny_target()
    mtp = MTPDraftModel(MTPConfig.for_target(target.config, num_depths=1), target.embed_tokens, target.lm_head)
    for model in (tiny_drafter(target), mtp):
        pos = torch.randint(0, 50, (2, 5), generator=torch.Generator().manual_seed(13))
        for size, dtype in ((50, torch.float64), (80, torch.float64), (60, torch.float32)):
            got, want = model.rope_at(pos + size - 50, size, dtype), model.rope(pos + size - 50, dtype)
            assert all(g.dtype == dtype and g.shape == w.shape and torch.equal(g, w)
                       for g, w in zip(got, want, strict=True))
        assert model.rope_table(10, torch.float32)[0].shape[0] == 60  # a longer table serves smaller sizes


def test_for_target_builds_the_shipped_dflys_qwen3_layers_and_proposes_the_same(tmp_path) -> None:
    """Every new block drafter gets Qwen3 draft layers (q/k norm) whatever the target, as vLLM's DFlash-based classes
    build them. On the embedded Qwen3 target that is the layer the shipped DFly has: `for_target` with its design
    gives its config field for field, and a drafter built from that config with the shipped weights proposes
    bit-identically to the shipped folder loaded as it is."""
    from safetensors.torch import load_file

    from angelspec.assets import DEFAULT_DRAFTERS, DEFAULT_TARGET
    from angelspec.models import load_target
    from angelspec.models.config import DraftShape

    folder = DEFAULT_DRAFTERS / "dfly"
    if not (folder / "config.json").is_file() or not (DEFAULT_TARGET / "config.json").is_file():
        pytest.skip("the shipped DFly or the embedded target is not in this checkout")
    target = load_target(DEFAULT_TARGET, dtype=torch.float32)
    shipped, _ = read_block_config(folder)
    assert (shipped.model_type, shipped.qk_norm) == ("qwen3", True)
    design = {k: getattr(shipped, k) for k in (
        "head_intermediate_size", "fusion_prior_temperature", "confidence_target", "confidence_temperatures",
        "anchor_fusion", "draft_vocab_size")}
    rebuilt = BlockDrafterConfig.for_target(
        target.config, mask_token_id=shipped.mask_token_id, block_size=shipped.block_size,
        num_draft_layers=shipped.num_draft_layers, target_layer_ids=shipped.target_layer_ids,
        conditioning=shipped.conditioning, head=shipped.head, markov_rank=shipped.markov_rank,
        confidence_head=shipped.confidence_head, shape=DraftShape(intermediate_size=shipped.intermediate_size),
        context_injection=shipped.context_injection, fc_bias=shipped.fc_bias, **design)
    assert rebuilt == shipped
    loaded = load_block_drafter(folder, target, dtype=torch.float32)
    model = BlockDrafter(rebuilt, target.embed_tokens, target.lm_head).eval()
    model.load_state_dict(load_file(str(folder / "model.safetensors")), strict=False)
    assert set(dict(model.state_dict())) == set(dict(loaded.state_dict()))
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), loaded.state_dict().values(),
                                                   strict=True))
    BlockProposer(model).refresh_inference_tables()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(6, target.config.vocab_size, (2, 20), generator=g)
    lengths = torch.tensor([20, 11])
    with torch.no_grad():
        inputs = TrainInputs(hidden_layers=list(shipped.target_layer_ids), compute_logits=False)
        taps = concat_taps(target(ids, inputs).hidden)
        props = [BlockProposer(m).propose_from_taps(taps, lengths - 1, ids[torch.arange(2), lengths - 1])
                 for m in (loaded, model)]
    assert torch.equal(props[0].tokens, props[1].tokens) and torch.equal(props[0].logits, props[1].logits)
