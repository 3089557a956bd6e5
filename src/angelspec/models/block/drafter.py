"""The block-parallel drafter: the DFlash / DFlare / DFly backbones with the sequential heads of `heads`.

Report §3.1–3.2 (Eq. 10–15, §6.2) and the DSpark implementation report §3 (UraionSpec: Markov, gated Markov and
RNN heads, confidence head, DFlash backbone with KV injection).

One backbone pass drafts a whole block. The block is `[x_t, m, m, …, m]` (B = `block_size` entries): the anchor
x_t is the newest committed token, whose target hidden state does not exist yet, and the B−1 mask-token
embeddings E(m) are the positions to predict, x_{t+1} … x_{t+B−1}. Block entry k sits at RoPE position p_t + k,
continuing the context. Every draft layer i attends, bidirectionally inside the block, to

    keys/values = [ W_K g^(i)_{<t} ; W_K u_block ]        (KV injection: the target context as extra keys)

where g^(i)_s is draft layer i's view of the target taps at committed position s < t (one per tap id in
`target_layer_ids`; id j = output of target decoder layer j, docs/design.md trap 2):

    dflash  Eq. 10   g^(i)_s = RMSNorm(c_s),  c_s = W_fc [h_s^(1); …; h_s^(n)] + b_fc     (shared by all layers)
    dspark  Uraion §3.3  the same shared context (context_injection "shared"), or, the default for new DSpark
                     drafters ("same_layer"), g^(i)_s = RMSNorm_i(h_s^(j(i))): draft layer i reads its own tap,
                     j(i) = `config.same_layer_taps` (layers and taps matched by relative depth)
    dflare  Eq. 11   g^(i)_s = RMSNorm_i(f^(i)_s),  f^(i)_s = Σ_j softmax(W_fuse[i])_j h_s^(j)
    dfly    Eq. 12   g^(i)_s = RMSNorm_i(c_s + f^(i)_s)

(DFlash's `hidden_norm` after fc is kept; DFlare and same-layer DSpark get a per-layer RMSNorm too, because the
raw taps of different target layers differ in scale by orders of magnitude and W_K was sized for normalised input:
the report injects W_K h unnormalised. b_fc exists only with `config.fc_bias`.)
W_fuse starts from a distance prior (§6.2, `config.distance_prior`): draft layer i first looks at the taps of
matching relative depth and learns to deviate. After the backbone, a head (`heads`, Eq. 13–15) runs left to right
over the B−1 draft positions.

E and W_lm are the TARGET's, held by reference (not submodules), read detached, never saved. Model code only:
no file I/O, no target inside, no sampling policy (the caller passes `select`).

Training (`forward_train`): N anchors per packed row, all blocks of a row in one pass per layer. Queries are the
R·N·B block entries; keys are the row's T context entries (their K/V computed once per layer and shared by every
anchor) and the entries of the query's own block: context key s is visible to anchor a iff s < a and
doc(s) = doc(a); block keys iff same anchor (bidirectional). By default (`anchored_block_attention`) no mask
exists: the context part is the tiled `models.attention.document_prefix_attention` (visibility rebuilt per tile
from the anchor's last key and document; tiles below the anchors' documents skipped), the block part a
[.., B, B] softmax per block, joined by log-sum-exp: memory O(N·B + T) per layer, O(N·B·L_doc·D) flops. The
`attention="dense"` reference builds the boolean mask [R, 1, N·B, T + N·B] from the same indices
(`training_mask`) for one SDPA call. `reference_forward_backbone` is the slow per-anchor reference the tests hold
both to.

Inference: the committed context's injected K/V in a `StaticKVCache` (`new_cache`, `append_context`), one backbone
pass per step (`backbone_step`) and the head one position at a time (`head_step`). The drafting loop that drives
them, the selection of each draft and the factored CPU form of the hidden-correction head are the engine's:
`decoding/drafters/block_propose.py` (`BlockProposer`).

Shape legend: R packed rows (batch), T time, N anchors per row, B block size, K = B−1 draft positions,
C model dim (= the target's), n taps, L draft layers, H heads, Hkv kv heads, Dh head dim, V vocab, r rank.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from angelspec.models.attention import (
    cache_span,
    document_first_index,
    document_prefix_attention,
    flex_prefix_attention,
    merge_attention,
    prefix_block_mask,
    resolve_attention_backend,
)
from angelspec.models.block.config import MARKOV_HEADS, BlockDrafterConfig, distance_prior
from angelspec.models.block.heads import HEAD_CLASSES, ConfidenceHead, HiddenCorrectionHead, MarkovHead
from angelspec.models.block.targets import BlockTargets, block_targets
from angelspec.models.config import ConfigError
from angelspec.models.decoder import DecoderLayer, DraftRope, RMSNorm, rotate_half
from angelspec.models.kv_cache import StaticKVCache
from angelspec.models.linear import Linear, linear
from angelspec.models.vocab import DraftVocabulary

# A training attention over block entries and context (`BlockDrafter.forward_backbone(block_attention=...)`):
# (q [R, H, Q, Dh], own k, v [R, Hkv, Q, Dh], ctx_k, ctx_v [R, Hkv, T, Dh]) -> [R, H, Q, Dh].
ContextAttention = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]


def context_block_attention(q: Tensor, k: Tensor, v: Tensor, ctx_k: Tensor, ctx_v: Tensor, ctx_valid: Tensor | None,
                            block_mask: object | None = None) -> Tensor:
    """One block per row attends to its valid context slots and to all of its own entries (bidirectional):
    q [B, H, Tq, Dh], own k/v [B, Hkv, Tq, Dh], ctx_k/ctx_v [B, Hkv, S, Dh], ctx_valid [B, S] -> [B, H, Tq, Dh].

    The same softmax attention as `scaled_dot_product_attention` over the concatenated keys [ctx; own] under the
    matching mask (query head h reads kv head h // (H / Hkv)), but the two key segments are scored separately
    and joined only in the small [.., Tq, S + Tq] score matrix: concatenating the keys would copy the whole context
    K/V every step (what that cost: docs/design.md §12).

    With `block_mask` (a FlexAttention BlockMask of the valid slots, `context_block_mask`; ctx_valid unused) the
    context part is FlexAttention with its log-sum-exp (no [.., Tq, S] scores, slots past every row's length
    skipped) and the own block's [.., Tq, Tq] softmax joins it exactly (`merge_attention`)."""
    B, H, Tq, Dh = q.shape
    Hkv, S = ctx_k.shape[1], ctx_k.shape[2]
    if block_mask is not None:
        G = H // Hkv
        out_c, lse_c = flex_prefix_attention(q, ctx_k, ctx_v, block_mask, lse=True)
        wide = torch.promote_types(q.dtype, torch.float32)
        s = (q.reshape(B, Hkv, G, Tq, Dh) @ k[:, :, None].transpose(-1, -2)).to(wide) * Dh ** -0.5  # [.., Tq, Tq]
        lse_b = s.logsumexp(dim=-1)
        out_b = torch.exp(s - lse_b[..., None]).to(v.dtype) @ v[:, :, None]
        out = merge_attention(out_c.reshape(B, Hkv, G, Tq, Dh), lse_c.reshape(B, Hkv, G, Tq), out_b, lse_b)
        return out.reshape(B, H, Tq, Dh)
    assert ctx_valid is not None
    qg = q.reshape(B, Hkv, (H // Hkv) * Tq, Dh) * Dh ** -0.5  # the query heads that share a kv head, stacked
    scores = torch.cat([(qg @ ctx_k.transpose(-1, -2)).masked_fill(~ctx_valid[:, None, None, :], float("-inf")),
                        qg @ k.transpose(-1, -2)], dim=-1)  # [B, Hkv, g·Tq, S + Tq]
    p = torch.softmax(scores if scores.dtype.itemsize >= 4 else scores.float(), dim=-1).to(q.dtype)  # fp32+
    return (p[..., :S] @ ctx_v + p[..., S:] @ v).view(B, H, Tq, Dh)


def context_block_mask(lengths: Tensor, block_size: int, num_slots: int) -> object:
    """The BlockMask of `context_block_attention`: each row's block_size entries see slots < lengths[b] [B] of
    num_slots."""
    last = (lengths - 1)[:, None].expand(-1, block_size)
    return prefix_block_mask(last, num_slots, batch=lengths.shape[0])


@dataclass(frozen=True)
class AnchorIndex:
    """What a training block entry may see, as indices (no mask): entry (n, k) of a row attends to context keys
    s <= last[n·B + k] = anchors[n] − 1 with doc(s) = doc(anchors[n]), and to the B entries of its own block."""

    block_size: int
    last: Tensor  # [R, N·B] the last visible context key (−1: none)
    doc: Tensor | None  # [R, N·B] the anchor's document id (None: one document per row)
    first: Tensor | None  # [R, N·B] the first position of that document (a lower bound that skips tiles)
    k_doc: Tensor | None  # [R, T] document ids of the context keys

    @classmethod
    def build(cls, anchors: Tensor, block_size: int, document_ids: Tensor | None) -> AnchorIndex:
        """anchors [R, N], document_ids [R, T] -> the index of the R·N·B block entries."""
        q_anchor = anchors.repeat_interleave(block_size, dim=1)  # [R, N·B]
        if document_ids is None:
            return cls(block_size, q_anchor - 1, None, None, None)
        first = document_first_index(document_ids).gather(1, q_anchor)
        return cls(block_size, q_anchor - 1, document_ids.gather(1, q_anchor), first, document_ids)


def anchored_block_attention(q: Tensor, k: Tensor, v: Tensor, ctx_k: Tensor, ctx_v: Tensor, index: AnchorIndex,
                             backend: str = "auto") -> Tensor:
    """Training attention of N blocks per row without a mask: q [R, H, N·B, Dh], own k/v [R, Hkv, N·B, Dh], context
    ctx_k/ctx_v [R, Hkv, T, Dh] -> [R, H, N·B, Dh]; the softmax over the visible context keys
    (`document_prefix_attention`, tiled) and over the own block (bidirectional, [.., B, B] scores per block) are
    joined exactly by their log-sum-exps (`merge_attention`). Equals SDPA under `BlockDrafter.training_mask`.
    backend: the context kernel (`document_prefix_attention`'s: tiled, or FlexAttention)."""
    R, H, Q, Dh = q.shape
    Hkv, Bk = k.shape[1], index.block_size
    G, N = H // Hkv, Q // Bk
    out_c, lse_c = document_prefix_attention(q, ctx_k, ctx_v, index.last, index.doc, index.k_doc, index.first,
                                             backend=backend)
    qg = q.reshape(R, Hkv, G, N, Bk, Dh)
    wide = torch.promote_types(q.dtype, torch.float32)
    s = (qg @ k.reshape(R, Hkv, 1, N, Bk, Dh).transpose(-1, -2)).to(wide) * Dh ** -0.5  # [R, Hkv, G, N, B, B]
    lse_b = s.logsumexp(dim=-1)
    out_b = torch.exp(s - lse_b[..., None]).to(v.dtype) @ v.reshape(R, Hkv, 1, N, Bk, Dh)  # [R, Hkv, G, N, B, Dh]
    out = merge_attention(out_c.reshape(R, Hkv, G, Q, Dh), lse_c.reshape(R, Hkv, G, Q),
                          out_b.reshape(R, Hkv, G, Q, Dh), lse_b.reshape(R, Hkv, G, Q))
    return out.reshape(R, H, Q, Dh)


@dataclass(frozen=True)
class BackboneOptions:
    """How `forward_train` runs the parallel backbone (`forward_backbone`'s keywords): `attention` "linear"
    (`anchored_block_attention`, memory O(N·B + T) per layer) or "dense" (the masked reference), `checkpoint_layers`
    (recompute each draft layer in the backward), `block_attention` (a caller's attention for every layer, e.g.
    sequence parallelism's)."""

    attention: Literal["linear", "dense"] = "linear"
    checkpoint_layers: bool = False
    block_attention: ContextAttention | None = None


@dataclass(frozen=True)
class BlockTrainOutput:
    """`forward_train`'s result; flatten (R, N) with `.flatten(0, 1)` for the losses' [N, K, V] layout."""

    logits: Tensor | None  # [R, N, K, V] fp32 (None with compute_logits=False: use `head_logits` in chunks)
    confidence_logits: Tensor | None  # [R, N, K] pre-sigmoid ([R, N, K, n] for a "protocol" head: one per grid
    #                                   temperature), None without a confidence head
    hidden: Tensor  # [R, N, K, C] backbone output at the draft positions (pre-norm)
    targets: BlockTargets


class BlockDrafter(DraftRope, DraftVocabulary, nn.Module):
    """A DFlash / DFlare / DFly / DSpark drafter around the target's frozen embedding and LM head."""

    def __init__(self, cfg: BlockDrafterConfig, embed_tokens: nn.Embedding, lm_head: nn.Linear) -> None:
        super().__init__()
        shape = (cfg.vocab_size, cfg.hidden_size)
        if tuple(embed_tokens.weight.shape) != shape or tuple(lm_head.weight.shape) != shape:
            raise ConfigError(f"target embedding {tuple(embed_tokens.weight.shape)} / LM head "
                              f"{tuple(lm_head.weight.shape)} do not match the {cfg.drafter} config's [vocab, hidden]"
                              f" = {list(shape)}")
        self.config = cfg
        self.attn_backend = "auto"  # `models.attention.set_attention_backend`
        # A tuple is not registered by nn.Module: the target's tensors stay out of parameters()/state_dict().
        self._shared: tuple[nn.Embedding, nn.Linear] = (embed_tokens, lm_head)
        C, L, n, eps = cfg.hidden_size, cfg.num_draft_layers, cfg.num_taps, cfg.rms_norm_eps
        if cfg.has_fc:
            self.fc = Linear(n * C, C, bias=cfg.fc_bias)  # W_fc, b_fc of Eq. 10
        if cfg.conditioning == "dflash" and cfg.has_fc:
            self.hidden_norm = RMSNorm(C, eps)
        else:
            if cfg.conditioning != "dflash":
                self.fusion_logits = nn.Parameter(torch.zeros(L, n))  # W_fuse of Eq. 11, distance-prior init
            # RMSNorm of Eq. 12 (and of the same-layer taps), per layer
            self.context_norms = nn.ModuleList(RMSNorm(C, eps) for _ in range(L))
        layer_cfg = cfg.layer_config()
        self.layers = nn.ModuleList(DecoderLayer(layer_cfg, i) for i in range(L))
        self.norm = RMSNorm(C, eps)  # before W_lm
        self.head: nn.Module | None = None
        if cfg.head in MARKOV_HEADS:
            self.head = HEAD_CLASSES[cfg.head](cfg.vocab_size, C, cfg.markov_rank)
        elif cfg.head == "hidden":
            self.head = HiddenCorrectionHead(C, cfg.head_intermediate_size or C, eps)
        if cfg.anchor_fusion:  # `anchor_input`
            self.anchor_norm = RMSNorm(C, eps)
            self.anchor_fuse = Linear(2 * C, C, bias=False)  # W_a, zero at init
        if cfg.confidence_head:
            self.confidence = ConfidenceHead(C, cfg.markov_rank, cfg.confidence_temperatures)
            if cfg.head not in MARKOV_HEADS:
                self.confidence_embed = nn.Embedding(cfg.vocab_size, cfg.markov_rank)  # its own W1
        dh = cfg.head_dim
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dh, 2, dtype=torch.float32) / dh))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._init_draft_vocab()
        self._special_init()

    def _special_init(self) -> None:
        """Distance prior for W_fuse; zero W2 / SwiGLU down projection so every head starts as the backbone; zero
        W_a, so a drafter with the fused anchor input starts as the same drafter without it."""
        cfg = self.config
        with torch.no_grad():
            if cfg.anchor_fusion:
                self.anchor_fuse.weight.zero_()
            if cfg.conditioning != "dflash":
                self.fusion_logits.copy_(distance_prior(cfg.num_draft_layers, cfg.target_layer_ids,
                                                        cfg.fusion_prior_temperature))
            if isinstance(self.head, MarkovHead):
                self.head.out.weight.zero_()
            elif isinstance(self.head, HiddenCorrectionHead):
                self.head.down_proj.weight.zero_()

    def init_weights(self, std: float = 0.02, generator: torch.Generator | None = None) -> None:
        """RMSNorm weights 1, biases 0, other Linear / Embedding weights N(0, std²); then `_special_init`."""
        with torch.no_grad():
            for module in self.modules():
                if isinstance(module, RMSNorm):
                    module.weight.fill_(1.0)
                elif isinstance(module, nn.Linear | nn.Embedding):
                    module.weight.normal_(0.0, std, generator=generator)
                    if getattr(module, "bias", None) is not None:
                        module.bias.zero_()
        self._special_init()

    # ----- shared pieces -----
    def embed(self, token_ids: Tensor) -> Tensor:
        """E(x) [..., C], the target's, frozen."""
        return F.embedding(token_ids, self._shared[0].weight.detach())

    def target_weights(self) -> tuple[Tensor, Tensor]:
        """The target's E and W_lm weights, [V, C] each (held by reference, never saved)."""
        return self._shared[0].weight, self._shared[1].weight

    def lm_logits(self, h: Tensor) -> Tensor:
        """W_lm h -> fp32 logits [..., V] (h already normalised; W_lm frozen)."""
        return linear(h, self._shared[1].weight.detach()).float()

    # ----- the draft vocabulary (`DraftVocabulary`): a Markov-family head's W2 rows are cut with the LM head's -----
    def _vocab_sources(self) -> tuple[Tensor, ...]:
        w = self._shared[1].weight
        return (w, self.head.out.weight) if isinstance(self.head, MarkovHead) else (w,)

    def draft_bias(self, u: Tensor) -> Tensor:
        """A Markov-family head's bias over the draft vocabulary: u [..., r] (`features`) -> [..., V']."""
        assert isinstance(self.head, MarkovHead)
        if not self.config.draft_vocab_size:
            return self.head.out(u)
        return linear(u, self._vocab_weights()[1])

    def fusion_weights(self) -> Tensor:
        """α of Eq. 11: softmax(W_fuse) [L, n] (dflare / dfly)."""
        return torch.softmax(self.fusion_logits, dim=-1)

    def context_features(self, taps: Tensor) -> list[Tensor]:
        """Eq. 10–12 and same-layer injection (Uraion §3.3): taps [B, T, n·C] (`concat_taps` of `target_layer_ids`)
        -> g^(i) [B, T, C] for each layer i."""
        cfg = self.config
        if taps.dim() != 3 or taps.shape[-1] != cfg.num_taps * cfg.hidden_size:
            raise ValueError(f"taps must be [B, T, n·C] = [B, T, {cfg.num_taps * cfg.hidden_size}] (the "
                             f"{cfg.num_taps} taps {list(cfg.target_layer_ids)} joined), got {tuple(taps.shape)}")
        if cfg.conditioning == "dflash" and cfg.has_fc:
            g = self.hidden_norm(self.fc(taps))  # Eq. 10, shared
            return [g] * cfg.num_draft_layers
        B, T, _ = taps.shape
        per_tap = taps.view(B, T, cfg.num_taps, cfg.hidden_size)  # [B, T, n, C]
        if cfg.conditioning == "dflash":  # same-layer injection (Uraion §3.3): layer i reads tap j(i)
            return [norm(per_tap[:, :, j]) for norm, j in zip(self.context_norms, cfg.context_taps, strict=True)]
        alpha = self.fusion_weights().to(taps.dtype)  # [L, n]
        c = self.fc(taps) if cfg.conditioning == "dfly" else None
        out = []
        for i, norm in enumerate(self.context_norms):
            f = torch.einsum("btnc,n->btc", per_tap, alpha[i])  # Eq. 11
            out.append(norm(f if c is None else c + f))  # Eq. 12 (dfly) / normalised Eq. 11 (dflare)
        return out

    def context_kv(self, i: int, g: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """Draft layer i's injected keys/values: g [B, T, C] -> k, v [B, Hkv, T, Dh] (W_K, W_V of the layer, its k
        norm and RoPE at the context positions). Only the k/v rows of the fused qkv projection are used."""
        attn = self.layers[i].attn
        B, T, _ = g.shape
        lo = attn.n_heads * attn.head_dim
        bias = attn.qkv_proj.bias
        kv = linear(g, attn.qkv_proj.weight[lo:], None if bias is None else bias[lo:])
        k, v = kv.view(B, T, 2 * attn.n_kv, attn.head_dim).split(attn.n_kv, dim=2)  # [B, T, Hkv, Dh]
        if attn.qk_norm:
            k = attn.k_norm(k)
        k, v = k.transpose(1, 2), v.transpose(1, 2)
        return k * cos + rotate_half(k) * sin, v

    def layer_forward(self, i: int, x: Tensor, cos: Tensor, sin: Tensor, ctx_k: Tensor, ctx_v: Tensor,
                      mask: Tensor | None, *, ctx_valid: Tensor | None = None, ctx_mask: object | None = None,
                      attend: ContextAttention | None = None) -> Tensor:
        """Draft layer i over block entries x [B, Tq, C] (cos/sin [B, 1, Tq, Dh] of their positions), attending to
        [ctx_k; own keys] ([B, Hkv, S + Tq, Dh]) under mask [B, 1, Tq, S + Tq] (True = attend) -> [B, Tq, C].

        Inference passes `ctx_valid` [B, S] instead of `mask` (one block per row: it sees the valid context
        slots and all of its own entries): `context_block_attention`, which never copies the context K/V; or
        `ctx_mask`, the FlexAttention block mask of the same slots (`context_block_mask`).
        Training passes `attend` instead (`anchored_block_attention` over the anchors' index: no mask, memory
        linear in T; or a caller's `ContextAttention`, e.g. sequence parallelism's)."""
        layer = self.layers[i]
        attn = layer.attn
        q, k, v = attn.project(layer.input_layernorm(x), cos, sin)  # [B, H|Hkv, Tq, Dh]
        if attend is not None:
            out = attend(q, k, v, ctx_k.to(k.dtype), ctx_v.to(v.dtype))
        elif ctx_valid is not None or ctx_mask is not None:
            out = context_block_attention(q, k, v, ctx_k.to(k.dtype), ctx_v.to(v.dtype), ctx_valid, ctx_mask)
        else:
            k = torch.cat([ctx_k.to(k.dtype), k], dim=2)
            v = torch.cat([ctx_v.to(v.dtype), v], dim=2)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=attn.n_kv != attn.n_heads)
        B, H, Tq, Dh = out.shape
        x = x + attn.o_proj(out.transpose(1, 2).reshape(B, Tq, H * Dh))
        return x + layer.mlp(layer.post_attention_layernorm(x))

    def block_inputs(self, anchor_tokens: Tensor) -> Tensor:
        """[..., ] anchor ids -> block ids [..., B] = [anchor, mask, …, mask]."""
        cfg = self.config
        mask = anchor_tokens.new_full((*anchor_tokens.shape, cfg.block_size - 1), cfg.mask_token_id)
        return torch.cat([anchor_tokens[..., None], mask], dim=-1)

    def anchor_input(self, g_last: Tensor, anchor_tokens: Tensor, has_context: Tensor) -> Tensor:
        """The fused anchor input (`config.anchor_fusion`), added to every entry of a block:

            u = W_a [g^(0)_{t−1} ; RMSNorm_a(E(x_t))]     (0 where the anchor has no context: t = 0 in its document)

        g_last [..., C] draft layer 0's context feature of the newest context position t−1 (`context_features`,
        normalised), anchor_tokens [...] x_t, has_context [...] bool -> u [..., C]. Without it, the mask entries'
        queries are the same for every context, so one draft layer can only average the context keys; with it, the
        first draft position sees what MTP's first depth does (the last target state and the anchor, fused)."""
        e = self.anchor_norm(self.embed(anchor_tokens).to(g_last.dtype))
        u = self.anchor_fuse(torch.cat([g_last, e], dim=-1))
        return u * has_context[..., None].to(u.dtype)

    # ----- the heads, teacher-forced (training) and one position at a time (inference) -----
    def markov_embed(self, prev: Tensor) -> Tensor:
        """W1[x_prev] [..., r] as the confidence head sees it (the Markov-family head's, else its own)."""
        table = self.head.embed if isinstance(self.head, MarkovHead) else self.confidence_embed
        return table(prev)

    def head_logits(self, z: Tensor, prev: Tensor, *, confidence: bool = True, draft_vocab: bool = False
                    ) -> tuple[Tensor, Tensor | None]:
        """Teacher-forced heads over the draft positions: z [..., K, C] backbone output (pre-norm), prev [..., K]
        predecessors -> (logits [..., K, V] fp32, confidence logits [..., K] ([..., K, n], one per grid temperature,
        for a "protocol" head) or None; None too with confidence=False). Position-wise except the RNN (which runs
        along K only), so a trainer may call it on chunks of anchors to bound the [.., V] memory.
        `draft_vocab`: logits [..., K, V'] over the draft vocabulary only (its order; the whole vocabulary without
        one), a Markov-family head's W2 rows cut with the LM head's but still trained (train_vocab "draft")."""
        h = self.norm(z)
        lm = self.draft_logits if draft_vocab else self.lm_logits
        if isinstance(self.head, HiddenCorrectionHead):
            logits = lm(self.norm(self.head(z, self.embed(prev))))  # Eq. 15
        else:
            logits = lm(h)
            if isinstance(self.head, MarkovHead):
                if draft_vocab and self.config.draft_vocab_size:  # W2's V' rows, with their gradient
                    w2 = self.head.out.weight.index_select(0, self.draft_vocab)
                    bias = linear(self.head.sequence_features(h, prev), w2)
                else:
                    bias = self.head.sequence(h, prev)
                logits = logits + bias.float()  # Eq. 14 / DSpark §3.1
        conf = (self.confidence.training_logits(h, self.markov_embed(prev))
                if confidence and self.config.confidence_head else None)
        return logits, conf

    def head_step(self, z: Tensor, prev: Tensor, state: Tensor | None, temperature: Tensor | None = None
                  ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """One draft position at inference: z [B, C], prev [B], temperature [B] the rows' sampling temperatures
        (None = 0) -> (logits [B, V'] over the draft vocabulary, confidence logit [B] or None, next head state)."""
        h = self.norm(z)
        if isinstance(self.head, HiddenCorrectionHead):
            logits = self.draft_logits(self.norm(self.head(z, self.embed(prev))))
        else:
            logits = self.draft_logits(h)
            if isinstance(self.head, MarkovHead):
                u, state = self.head.features(h, prev, state)
                logits = logits + self.draft_bias(u).float()
        conf = self.confidence(h, self.markov_embed(prev), temperature) if self.config.confidence_head else None
        return logits, conf, state

    # ----- training: many anchors per packed row -----
    def training_mask(self, anchors: Tensor, T: int, document_ids: Tensor | None) -> Tensor:
        """Index-built mask [R, 1, N·B, T + N·B] (True = attend): block entry (n, k) sees context key s iff
        s < anchors[n] and doc(s) = doc(anchors[n]), and block keys of its own anchor n (bidirectional)."""
        R, N = anchors.shape
        Bk = self.config.block_size
        q_anchor = anchors.repeat_interleave(Bk, dim=1)  # [R, N·B]
        key = torch.arange(T, device=anchors.device)
        ctx = key[None, None, :] < q_anchor[:, :, None]  # [R, N·B, T]
        if document_ids is not None:
            q_doc = document_ids.gather(1, q_anchor)  # [R, N·B]
            ctx = ctx & (document_ids[:, None, :] == q_doc[:, :, None])
        blk = torch.arange(N, device=anchors.device).repeat_interleave(Bk)  # [N·B]
        own = (blk[:, None] == blk[None, :]).expand(R, -1, -1)  # [R, N·B, N·B]
        return torch.cat([ctx, own], dim=2)[:, None]

    def forward_backbone(self, taps: Tensor, input_ids: Tensor, positions: Tensor, anchors: Tensor,
                         document_ids: Tensor | None = None, *, attention: Literal["linear", "dense"] = "linear",
                         checkpoint_layers: bool = False, block_attention: ContextAttention | None = None) -> Tensor:
        """The parallel backbone for N anchors per row: -> z [R, N, B, C] (block entry 0 is the anchor).

        taps [R, T, n·C] target taps at every position; input_ids [R, T]; positions [R, T] document-local;
        anchors [R, N] indices into T; document_ids [R, T] (None: one document per row).
        attention "linear": `anchored_block_attention`, memory O(N·B + T) per layer; "dense": one SDPA call under
        the index-built `training_mask` [R, 1, N·B, T + N·B] (the reference). checkpoint_layers: recompute each
        draft layer in the backward (activation checkpointing). `block_attention` replaces the attention of
        every layer (the caller then owns which keys each entry sees; `attention` and document_ids are unused):
        the hook sequence parallelism uses (`train.sequence_parallel.block_attention`)."""
        if input_ids.dim() != 2 or anchors.dim() != 2 or positions.shape != input_ids.shape:
            raise ValueError(f"input_ids/positions must be [R, T] and anchors [R, N], got {tuple(input_ids.shape)}, "
                             f"{tuple(positions.shape)}, {tuple(anchors.shape)}")
        if taps.shape[:2] != input_ids.shape:
            raise ValueError(f"taps {tuple(taps.shape)} do not cover input_ids {tuple(input_ids.shape)}")
        R, T = input_ids.shape
        N, Bk, C = anchors.shape[1], self.config.block_size, self.config.hidden_size
        if anchors.numel() and (int(anchors.min()) < 0 or int(anchors.max()) >= T):  # host sync; training only
            raise ValueError(f"anchors must index positions 0..{T - 1}")
        dtype = taps.dtype
        ctx_cos, ctx_sin = self.rope(positions, dtype)  # [R, 1, T, Dh]
        blk_pos = (positions.gather(1, anchors)[..., None] + torch.arange(Bk, device=anchors.device)).flatten(1)
        cos, sin = self.rope(blk_pos, dtype)  # [R, 1, N·B, Dh]
        if attention not in ("linear", "dense"):
            raise ValueError(f"attention must be 'linear' or 'dense', got {attention!r}")
        mask, attend = None, block_attention
        if attend is None and attention == "dense":
            mask = self.training_mask(anchors, T, document_ids)
        elif attend is None:
            attend = partial(anchored_block_attention, index=AnchorIndex.build(anchors, Bk, document_ids),
                             backend=self.attn_backend)
        anchor_ids = input_ids.gather(1, anchors)  # [R, N]
        x = self.embed(self.block_inputs(anchor_ids)).to(dtype)  # [R, N, B, C]
        feats = self.context_features(taps)
        if self.config.anchor_fusion:
            # t−1 is in the anchor's document iff the anchor is not its document's first token (positions are
            # document-local; a packed document's tokens are contiguous)
            last = feats[0].gather(1, (anchors - 1).clamp(min=0)[..., None].expand(-1, -1, C))  # [R, N, C]
            x = x + self.anchor_input(last, anchor_ids, positions.gather(1, anchors) > 0)[:, :, None]
        x = x.view(R, N * Bk, C)

        def layer(i: int, x: Tensor, g: Tensor) -> Tensor:
            ctx_k, ctx_v = self.context_kv(i, g, ctx_cos, ctx_sin)
            return self.layer_forward(i, x, cos, sin, ctx_k, ctx_v, mask, attend=attend)

        for i, g in enumerate(feats):
            if checkpoint_layers and torch.is_grad_enabled():
                x = checkpoint(layer, i, x, g, use_reentrant=False)
            else:
                x = layer(i, x, g)
        return x.view(R, N, Bk, C)

    def forward_train(self, taps: Tensor, input_ids: Tensor, positions: Tensor, anchors: Tensor, *,
                      document_ids: Tensor | None = None, loss_mask: Tensor | None = None,
                      anchor_valid: Tensor | None = None, compute_logits: bool = True,
                      targets: BlockTargets | None = None, backbone: BackboneOptions | None = None
                      ) -> BlockTrainOutput:
        """Backbone + teacher-forced head for N anchors per packed row (arguments as `forward_backbone`, whose
        keywords `backbone` carries; None: `BackboneOptions()`; loss_mask [R, T] and anchor_valid [R, N] only shape
        `targets.valid`). compute_logits=False leaves the head to the caller (`head_logits` on chunks of anchors: no
        [R, N, K, V] logits). `targets`: the anchors' labels and predecessors when the caller builds them from other
        columns than `input_ids` (a sequence-parallel shard's, from its shard plus halo); None: `block_targets` of
        these inputs."""
        opts = backbone or BackboneOptions()
        z = self.forward_backbone(taps, input_ids, positions, anchors, document_ids, attention=opts.attention,
                                  checkpoint_layers=opts.checkpoint_layers,
                                  block_attention=opts.block_attention)[:, :, 1:]  # [R, N, K, C]
        if targets is None:
            targets = block_targets(input_ids, anchors, self.config.block_size, document_ids=document_ids,
                                    loss_mask=loss_mask, anchor_valid=anchor_valid)
        logits = conf = None
        if compute_logits:
            logits, conf = self.head_logits(z, targets.prev_tokens)
        elif self.config.confidence_head:
            conf = self.confidence.training_logits(self.norm(z), self.markov_embed(targets.prev_tokens))
        return BlockTrainOutput(logits=logits, confidence_logits=conf, hidden=z, targets=targets)

    # ----- inference: context K/V in a static cache, one backbone pass per step (`BlockProposer` drafts) -----
    def new_cache(self, batch_size: int, max_len: int, *, slack: int, dtype: torch.dtype,
                  device: torch.device | str) -> StaticKVCache:
        """Per-layer context K/V of committed positions (slot == position). Block entries are never cached. With the
        fused anchor input, the cache also holds draft layer 0's context feature per slot (`anchor_features`
        [B, S, C]: the anchor reads its predecessor's; slot-indexed like the K/V, so rollback and row resets need
        nothing more)."""
        cache = StaticKVCache(self.config.layer_config(), batch_size, max_len, slack=slack, dtype=dtype,
                              device=device)
        if self.config.anchor_fusion:
            cache.anchor_features = torch.zeros(batch_size, cache.capacity, self.config.hidden_size, dtype=dtype,
                                                device=device)
        return cache

    def append_context(self, taps: Tensor, cache: StaticKVCache, num_new: Tensor | None = None,
                       rows: Tensor | None = None) -> None:
        """Write the injected K/V of T new committed positions per row at slots `cache.lengths + arange(T)`;
        `cache.lengths += num_new` (default T). taps [n_rows, T, n·C] (`concat_taps`) for the cache rows `rows`
        [n_rows] (default: all rows, in order). Entries past num_new land beyond the new length: invisible, and
        overwritten by the next append. Only committed positions are ever cached (block entries never are), so a
        step needs no rollback; `cache.truncate` still rolls back anything."""
        n, T, _ = taps.shape
        dev = taps.device
        lengths = cache.lengths if rows is None else cache.lengths[rows]
        at = (torch.arange(n, device=dev) if rows is None else rows)[:, None]  # [n, 1]
        # Slots past the end hold only entries beyond num_new (invisible), whatever their position.
        write = (lengths[:, None] + torch.arange(T, device=dev)).clamp(max=cache.capacity - 1)  # [n, T]
        cos, sin = self.rope_at(write, self.rope_size(cache), cache.dtype)
        feats = self.context_features(taps.to(cache.dtype))
        for i, g in enumerate(feats):
            k, v = self.context_kv(i, g, cos, sin)  # [n, Hkv, T, Dh]
            cache.k[i][at, :, write] = k.transpose(1, 2)
            cache.v[i][at, :, write] = v.transpose(1, 2)
        if self.config.anchor_fusion:
            cache.anchor_features[at, write] = feats[0]
        if rows is None:
            cache.lengths += T if num_new is None else num_new
        else:
            cache.lengths[rows] += T if num_new is None else num_new

    def rope_size(self, cache: StaticKVCache) -> int:
        """Positions inference may rope with `cache`: its slots and a block past the last one."""
        return cache.capacity + self.config.block_size

    def backbone_step(self, anchor_tokens: Tensor, cache: StaticKVCache, kv_len: int | None = None) -> Tensor:
        """ONE backbone pass: anchor_tokens [B] (the newest committed token of each row, at position
        `cache.lengths`) -> z [B, B_blk, C]. `kv_len` (host int) bounds the context slots attended to."""
        cfg = self.config
        if anchor_tokens.shape != (cache.batch_size,):
            raise ValueError(f"anchor_tokens must be [B] = [{cache.batch_size}] (one per cache row), got "
                             f"{tuple(anchor_tokens.shape)}")
        dev = anchor_tokens.device
        Bk = cfg.block_size
        kv_len = cache_span(kv_len, cache.capacity, self.attn_backend, dev)
        pos = cache.lengths[:, None] + torch.arange(Bk, device=dev)  # [B, B_blk]
        cos, sin = self.rope_at(pos, self.rope_size(cache), cache.dtype)
        flex = resolve_attention_backend(self.attn_backend, dev) == "flex"
        if flex:  # the whole capacity (one shape every step); the block mask skips slots past every row's length
            ctx, ctx_mask = None, context_block_mask(cache.lengths, Bk, cache.capacity)
        else:
            ctx, ctx_mask = torch.arange(kv_len, device=dev)[None, :] < cache.lengths[:, None], None  # [B, S]
        x = self.embed(self.block_inputs(anchor_tokens)).to(cache.dtype)  # [B, B_blk, C]
        if cfg.anchor_fusion:
            rows = torch.arange(anchor_tokens.shape[0], device=dev)
            last = cache.anchor_features[rows, (cache.lengths - 1).clamp(min=0)]  # [B, C]
            x = x + self.anchor_input(last, anchor_tokens, cache.lengths > 0)[:, None]
        for i in range(cfg.num_draft_layers):
            x = self.layer_forward(i, x, cos, sin, cache.k[i][:, :, :kv_len], cache.v[i][:, :, :kv_len], None,
                                   ctx_valid=ctx, ctx_mask=ctx_mask)
        return x


@torch.no_grad()
def reference_forward_backbone(model: BlockDrafter, taps: Tensor, input_ids: Tensor, positions: Tensor,
                               anchors: Tensor, document_ids: Tensor | None = None) -> Tensor:
    """Slow reference for `forward_backbone`: one anchor at a time, keys = [all T context entries; its own block],
    with a dense mask built by explicit loops over the positions. -> z [R, N, B, C]."""
    R, T = input_ids.shape
    N, Bk = anchors.shape[1], model.config.block_size
    feats = model.context_features(taps)
    out = torch.empty(R, N, Bk, model.config.hidden_size, dtype=taps.dtype, device=taps.device)
    with_context = [[a > 0 and (document_ids is None or int(document_ids[r, a - 1]) == int(document_ids[r, a]))
                     for a in anchors[r].tolist()] for r in range(R)]
    for r in range(R):
        ctx_cos, ctx_sin = model.rope(positions[r: r + 1], taps.dtype)
        for n in range(N):
            a = int(anchors[r, n])
            visible = [s < a and (document_ids is None or int(document_ids[r, s]) == int(document_ids[r, a]))
                       for s in range(T)]
            mask = torch.tensor(visible + [True] * Bk, device=taps.device)[None, None, None, :].expand(1, 1, Bk, -1)
            pos = int(positions[r, a]) + torch.arange(Bk, device=taps.device)[None]
            cos, sin = model.rope(pos, taps.dtype)
            x = model.embed(model.block_inputs(input_ids[r: r + 1, a])).to(taps.dtype)  # [1, B, C]
            if model.config.anchor_fusion:
                has = torch.tensor([with_context[r][n]], device=taps.device)
                x = x + model.anchor_input(feats[0][r: r + 1, max(a - 1, 0)], input_ids[r: r + 1, a], has)[:, None]
            for i, g in enumerate(feats):
                k, v = model.context_kv(i, g[r: r + 1], ctx_cos, ctx_sin)
                x = model.layer_forward(i, x, cos, sin, k, v, mask)
            out[r, n] = x[0]
    return out
