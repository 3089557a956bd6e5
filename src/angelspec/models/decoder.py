"""Pure-PyTorch decoder for the Qwen3 / Qwen2 / Llama families, with hidden-state taps and a static
KV cache.

Shape legend: B batch, T new tokens in this call, S cache slots, D model dim, H query heads,
Hkv key/value heads, Dh head dim, V vocab.

Hidden-state tap ids (docs/design.md trap 2): id `i` (0-based) is the OUTPUT of decoder layer `i`, i.e.
HF `hidden_states[i + 1]`; the last id `L-1` is the final layer's output before the final norm.
vLLM/SGLang count "before layer i" and are converted in the exporters, never here.

Two forwards, each with its own argument object: `Decoder.forward(ids, TrainInputs(...))` over whole sequences
(training, features, scoring) and `Decoder.forward_cached(ids, CacheInputs(cache, ...))` for serving (prefill,
decode, verify). `TrainInputs.attend` swaps the attention itself (q [B, H, T, Dh], k, v [B, Hkv, T, Dh] ->
[B, H, T, Dh]) for a caller's pattern, e.g. sequence-parallel training's Ulysses attention over the whole row while
the call holds a shard of it (`train.sequence_parallel.target_attention`); the model stays free of distributed code.

For speed on small models (where per-op overhead dominates) q/k/v and gate/up are fused into one
matmul each; the HF adapter (`models/hf_io.py`) splits and joins the weights.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from angelspec.models.attention import AttentionPlan, cache_span
from angelspec.models.config import DecoderConfig, rope_inv_freq
from angelspec.models.kv_cache import StaticKVCache
from angelspec.models.linear import Linear


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 (or wider) then cast back before the weight, as the reference does for bf16.
        wide = torch.promote_types(x.dtype, torch.float32)
        if wide == x.dtype == self.weight.dtype:  # fp32: one fused kernel with the weight (same values, fewer ops)
            return F.rms_norm(x, (x.shape[-1],), self.weight, eps=self.eps)
        return self.weight * F.rms_norm(x.to(wide), (x.shape[-1],), eps=self.eps).to(x.dtype)


class DraftRope:
    """RoPE of the draft models (an `nn.Module` mixin whose `inv_freq` buffer holds the inverse frequencies; fp32
    angles, no scaling): computed per call for training (`rope`), gathered from a cached table at inference
    (`rope_at`): at batch 1 the table saves a handful of kernel calls per draft step, with the same values."""

    inv_freq: torch.Tensor
    _rope_cache: tuple[torch.Tensor, torch.Tensor] | None = None  # `rope_table`'s (a plain attribute, never saved)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, T] -> cos, sin [B, 1, T, Dh] (fp32 angles, like `rope_inv_freq`)."""
        freqs = positions.float()[..., None] * self.inv_freq  # [B, T, Dh/2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def rope_table(self, size: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [n, Dh] (n >= size) of positions 0..n-1, exactly `rope`'s values (it is elementwise), cached
        until a larger size, another dtype or device is asked for. Build it eagerly before a compiled call uses it
        (`rope_at` with the same size)."""
        table = self._rope_cache
        dev = self.inv_freq.device
        if table is None or table[0].shape[0] < size or table[0].dtype != dtype or table[0].device != dev:
            cos, sin = self.rope(torch.arange(size, device=dev)[None], dtype)
            table = self._rope_cache = (cos[0, 0], sin[0, 0])
        return table

    def rope_at(self, positions: torch.Tensor, size: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """`rope(positions, dtype)` for positions [B, T] below `size`, gathered from `rope_table(size, dtype)`."""
        cos, sin = self.rope_table(size, dtype)
        return F.embedding(positions, cos)[:, None], F.embedding(positions, sin)[:, None]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        qkv_out = (self.n_heads + 2 * self.n_kv) * self.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, qkv_out, bias=cfg.qkv_bias)
        self.o_proj = Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=cfg.o_bias)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads_first: bool = True
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Projection, q/k norm and RoPE (also for custom attention patterns: block drafters, the TTT rollout).

        x [B, T, C_in], cos/sin [B, 1, T, Dh] -> q [B, H, T, Dh], k, v [B, Hkv, T, Dh]; with heads_first=False,
        x [..., C_in], cos/sin [..., 1, Dh] -> q [..., H, Dh], k, v [..., Hkv, Dh] (the packed tokens of
        `Decoder.forward_cached(ids, CacheInputs(keep=...))`)."""
        qkv = self.qkv_proj(x).unflatten(-1, (self.n_heads + 2 * self.n_kv, self.head_dim))
        q, k, v = qkv.split((self.n_heads, self.n_kv, self.n_kv), dim=-2)  # [..., H|Hkv, Dh]
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if heads_first:
            q, k, v = q.transpose(-3, -2), k.transpose(-3, -2), v.transpose(-3, -2)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin, v

    def forward(
        self,
        x: torch.Tensor,  # [B, T, D]
        cos: torch.Tensor,  # [B, 1, T, Dh]
        sin: torch.Tensor,  # [B, 1, T, Dh]
        mask: AttentionPlan | None,  # how the queries see the keys (built once per forward); None: plain causal
        cache: StaticKVCache | None,
        write_idx: tuple[torch.Tensor, torch.Tensor] | None,  # ([B, 1], [B, T]) row / slot indices
        kv_len: int | None,
        packed: Packing | None = None,
        attend: Attend | None = None,
    ) -> torch.Tensor:
        if packed is not None:
            return self._forward_packed(x, cos, sin, mask, cache, write_idx, kv_len, packed)
        B, T, _ = x.shape
        q, k, v = self.project(x, cos, sin)  # [B, H|Hkv, T, Dh]
        if cache is not None:
            assert write_idx is not None
            rows, slots = write_idx
            kc, vc = cache.k[self.layer_idx], cache.v[self.layer_idx]  # [B, Hkv, S, Dh]
            # Advanced indices around a slice put the indexed dims first: target view is [B, T, Hkv, Dh].
            kc[rows, :, slots] = k.transpose(1, 2).to(kc.dtype)
            vc[rows, :, slots] = v.transpose(1, 2).to(vc.dtype)
            assert mask is not None
            out = mask(q, kc, vc)  # the plan slices the slots it attends over
        elif attend is not None:
            out = attend(q, k, v)
        elif mask is not None:
            out = mask(q, k, v)
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_kv != self.n_heads)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))

    def _forward_packed(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: AttentionPlan | None,
                        cache: StaticKVCache | None, write_idx: tuple[torch.Tensor, torch.Tensor] | None,
                        kv_len: int | None, packed: Packing) -> torch.Tensor:
        """Dense rows: x [N, D] (the kept tokens only), cos/sin [N, 1, Dh], write_idx ([N], [N]) row / slot.
        Projections run on the N kept tokens; attention scatters their queries into the padded [B, H, T, Dh]
        layout (dropped queries are zeros and their outputs are discarded) against the row's cache."""
        assert cache is not None and write_idx is not None and mask is not None
        q, k, v = self.project(x, cos, sin, heads_first=False)  # [N, H|Hkv, Dh]
        rows, slots = write_idx
        kc, vc = cache.k[self.layer_idx], cache.v[self.layer_idx]  # [B, Hkv, S, Dh]
        kc[rows, :, slots] = k.to(kc.dtype)  # only kept tokens are written: dropped ones cost no cache traffic
        vc[rows, :, slots] = v.to(vc.dtype)
        B, T = packed.shape
        qp = q.new_zeros(B * T, self.n_heads, self.head_dim).index_copy_(0, packed.index, q)
        qp = qp.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # [B, H, T, Dh]
        out = mask(qp, kc, vc)
        out = out.transpose(1, 2).reshape(B * T, self.n_heads * self.head_dim).index_select(0, packed.index)
        return self.o_proj(out)


# A custom attention (`TrainInputs.attend`): q [B, H, T, Dh], k, v [B, Hkv, T, Dh] -> out [B, H, T, Dh].
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Packing:
    """Which of a [B, T] call's tokens run: index [N] flat positions (b·T + t) of the kept tokens."""

    index: torch.Tensor
    shape: tuple[int, int]

    def scatter(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, F] -> [B, T, F], zeros at dropped positions."""
        B, T = self.shape
        return x.new_zeros(B * T, x.shape[-1]).index_copy_(0, self.index, x).view(B, T, -1)


class MLP(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.inter = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.inter, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, mask, cache, write_idx, kv_len, packed=None, attend=None):
        x = x + self.attn(self.input_layernorm(x), cos, sin, mask, cache, write_idx, kv_len, packed, attend)
        return x + self.mlp(self.post_attention_layernorm(x))


@dataclass(frozen=True)
class TrainInputs:
    """What a cache-free `Decoder.forward` takes besides input_ids [B, T] (training, features, scoring)."""

    positions: torch.Tensor | None = None  # [B, T]; default arange(T)
    document_ids: torch.Tensor | None = None  # [B, T] packed training: attend within a document only
    attend: Attend | None = None  # this attention instead of the causal / document-masked one (brings its own mask)
    hidden_layers: Sequence[int] = ()  # tap ids whose outputs come back in `DecoderOutput.hidden`
    logits_index: torch.Tensor | None = None  # [B, n] positions whose logits are needed
    compute_logits: bool = True


@dataclass(frozen=True)
class CacheInputs:
    """What a serving `Decoder.forward_cached` takes besides input_ids [B, T]: the cache and how to use it."""

    cache: StaticKVCache
    positions: torch.Tensor | None = None  # [B, T]; default cache lengths + arange(T)
    num_new: torch.Tensor | None = None  # [B] real tokens per row (<= T); rest is padding
    kv_len: int | None = None  # host-side upper bound on lengths + T, to attend over fewer slots
    hidden_layers: Sequence[int] = ()  # tap ids whose outputs come back in `DecoderOutput.hidden`
    logits_index: torch.Tensor | None = None  # [B, n] positions whose logits are needed
    compute_logits: bool = True
    keep: torch.Tensor | None = None  # [B, T] bool, a prefix per row: only these tokens run
    num_keep: int | None = None  # host-side keep.sum(), if the caller knows it (saves a host sync)


@dataclass
class DecoderOutput:
    logits: torch.Tensor | None  # [B, T or n_keep, V] fp32, None when no logits were requested (zeros where
    #                              `keep` dropped a token)
    hidden: tuple[torch.Tensor, ...]  # one [B, T, D] per requested tap id, in request order
    last_hidden: torch.Tensor  # [B, T, D] final-norm output (what the LM head sees)


class Decoder(nn.Module):
    """Causal LM. Model code only: no file I/O, no sampling, no distributed wrapping."""

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        inv_freq, attn_factor = rope_inv_freq(cfg)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.attn_factor = attn_factor
        self.attn_backend = "auto"  # `models.attention.set_attention_backend`
        self._rope_table: tuple[torch.Tensor, torch.Tensor] | None = None

    # ----- helpers -----
    def init_weights(self, std: float = 0.02, generator: torch.Generator | None = None) -> None:
        """GPT-style init for training from scratch (residual projections scaled by depth)."""
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                nn.init.ones_(p)
            elif name.endswith(".bias"):
                nn.init.zeros_(p)
            else:
                scale = std / (2 * self.config.num_hidden_layers) ** 0.5 if name.endswith(
                    ("o_proj.weight", "down_proj.weight")) else std
                with torch.no_grad():
                    p.normal_(0.0, scale, generator=generator)

    def rope_table(self, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [n, Dh], built once per length (grown on demand) on the model's device."""
        if self._rope_table is None or self._rope_table[0].shape[0] < n or self._rope_table[0].device != device:
            n_alloc = max(n, self.config.max_position_embeddings)
            pos = torch.arange(n_alloc, device=device, dtype=torch.float32)
            freqs = torch.outer(pos, self.inv_freq.to(device))  # [n, Dh/2]
            emb = torch.cat((freqs, freqs), dim=-1)
            self._rope_table = (emb.cos() * self.attn_factor, emb.sin() * self.attn_factor)
        return self._rope_table

    def new_cache(self, batch_size: int, max_len: int, *, slack: int = 16,
                  dtype: torch.dtype | None = None) -> StaticKVCache:
        dev = self.embed_tokens.weight.device
        return StaticKVCache(self.config, batch_size, max_len, slack=slack,
                             dtype=dtype or self.embed_tokens.weight.dtype, device=dev)

    def head_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final-norm states [..., D] -> fp32 logits [..., V]: the LM head exactly as `forward` applies it."""
        return self.lm_head(h).float()

    # ----- forward -----
    def forward(self, input_ids: torch.Tensor, inputs: TrainInputs | None = None) -> DecoderOutput:
        """A cache-free forward over whole sequences (training, features, scoring): input_ids [B, T], causal
        attention within each row (within each document with `document_ids`, or the `attend` callable's own
        pattern, module docstring)."""
        inputs = TrainInputs() if inputs is None else inputs
        B, T = self._check(input_ids, inputs.hidden_layers)
        if inputs.attend is not None and inputs.document_ids is not None:
            raise ValueError("attend= replaces the attention of a cache-free forward and brings its own mask; do not "
                             "pass document_ids= with it")
        dev = input_ids.device
        positions = inputs.positions
        if positions is None:
            positions, table_len = torch.arange(T, device=dev).expand(B, T), T
        else:
            table_len = int(positions.max()) + 1 if positions.numel() else 1  # host sync; training only
        mask = None if inputs.document_ids is None else AttentionPlan.documents(inputs.document_ids, self.attn_backend)
        cos, sin = self._rope_at(positions, table_len)
        x = self.embed_tokens(input_ids)  # [B, T, D]
        taps: dict[int, torch.Tensor] = {}
        wanted = set(inputs.hidden_layers)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, mask, None, None, None, attend=inputs.attend)
            if i in wanted:
                taps[i] = x
        return self._output(self.norm(x), taps, inputs.hidden_layers, inputs.logits_index, inputs.compute_logits)

    def forward_cached(self, input_ids: torch.Tensor, inputs: CacheInputs) -> DecoderOutput:
        """A serving forward: the T tokens are appended at slots `lengths[b] .. lengths[b]+T-1` of `inputs.cache`,
        attend to every committed slot of their row plus the earlier new tokens, and `lengths += num_new`
        afterwards. Roll back a partial accept with `cache.truncate(...)`.

        `keep` packs ragged rows densely (speculative verification with per-row depths): the projections, MLPs
        and LM head run on the kept tokens only, dropped tokens write no cache slot, and their logits / taps
        come back as zeros. Each row's kept tokens must be a prefix of it (a dropped token is never attended to
        by a kept one only because it comes after them); roll the cache back to at most the kept length."""
        B, T = self._check(input_ids, inputs.hidden_layers)
        cache = inputs.cache
        if B != cache.batch_size:
            raise ValueError(f"batch of {B} rows does not match the cache's {cache.batch_size} rows")
        dev = input_ids.device
        start = cache.lengths  # [B]
        slots = start[:, None] + torch.arange(T, device=dev)  # [B, T]
        positions = slots if inputs.positions is None else inputs.positions
        # kv_len bounds lengths + T, so kv_len <= T says every row starts empty (a prefill). Not inside a compiled
        # step: there the test would guard the graph on kv_len and recompile it when a warm-up's bound differs.
        fresh = not torch.compiler.is_compiling() and inputs.kv_len is not None and inputs.kv_len <= T
        kv_len = cache_span(inputs.kv_len, cache.capacity, self.attn_backend, dev)
        mask = AttentionPlan.cached(start, T, kv_len, cache.capacity, self.attn_backend, fresh, cache.dtype)
        if inputs.keep is not None:
            return self._forward_packed(input_ids, positions, mask, kv_len, inputs)
        write_idx = (torch.arange(B, device=dev)[:, None], slots.clamp(max=cache.capacity - 1))
        cos, sin = self._rope_at(positions, cache.capacity)
        x = self.embed_tokens(input_ids)  # [B, T, D]
        taps: dict[int, torch.Tensor] = {}
        wanted = set(inputs.hidden_layers)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, mask, cache, write_idx, kv_len)
            if i in wanted:
                taps[i] = x
        cache.lengths += T if inputs.num_new is None else inputs.num_new
        return self._output(self.norm(x), taps, inputs.hidden_layers, inputs.logits_index, inputs.compute_logits)

    def _check(self, input_ids: torch.Tensor, hidden_layers: Sequence[int]) -> tuple[int, int]:
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, T], got shape {tuple(input_ids.shape)}")
        L = self.config.num_hidden_layers
        for i in hidden_layers:
            if not 0 <= i < L:
                raise ValueError(f"hidden layer id {i} out of range: ids are 0..{L - 1} "
                                 "(id i = output of decoder layer i)")
        return input_ids.shape

    def _rope_at(self, positions: torch.Tensor, table_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [...] -> cos, sin [..., 1, Dh] in the model's dtype, from `rope_table(table_len)`."""
        cos_t, sin_t = self.rope_table(table_len, positions.device)
        dtype = self.embed_tokens.weight.dtype
        return cos_t[positions].unsqueeze(1).to(dtype), sin_t[positions].unsqueeze(1).to(dtype)

    def _output(self, h: torch.Tensor, taps: dict[int, torch.Tensor], hidden_layers: Sequence[int],
                logits_index: torch.Tensor | None, compute_logits: bool) -> DecoderOutput:
        logits = None
        if compute_logits:
            hl = h if logits_index is None else h.gather(1, logits_index[..., None].expand(-1, -1, h.shape[-1]))
            logits = self.head_logits(hl)
        return DecoderOutput(logits=logits, hidden=tuple(taps[i] for i in hidden_layers), last_hidden=h)

    def _forward_packed(self, input_ids: torch.Tensor, positions: torch.Tensor, mask: AttentionPlan, kv_len: int,
                        inputs: CacheInputs) -> DecoderOutput:
        """`forward_cached` with `keep`: the kept tokens as one dense [N, D] batch (see `forward_cached`)."""
        cache, keep, num_keep = inputs.cache, inputs.keep, inputs.num_keep
        assert keep is not None
        if inputs.logits_index is not None:
            raise ValueError("keep= and logits_index= cannot be combined: keep already selects the positions")
        B, T = input_ids.shape
        if keep.shape != (B, T) or keep.dtype != torch.bool:
            raise ValueError(f"keep must be a bool tensor [B, T] = [{B}, {T}], got {keep.dtype} {tuple(keep.shape)}")
        flat = keep.reshape(-1)
        index = flat.nonzero()[:, 0] if num_keep is None else torch.nonzero_static(flat, size=num_keep)[:, 0]
        packed = Packing(index=index, shape=(B, T))
        slots = cache.lengths[:, None] + torch.arange(T, device=input_ids.device)  # [B, T]
        write_idx = (index // T, slots.reshape(-1).index_select(0, index).clamp(max=cache.capacity - 1))
        cos, sin = self._rope_at(positions.reshape(-1).index_select(0, index), cache.capacity)  # [N, 1, Dh]
        x = self.embed_tokens(input_ids.reshape(-1).index_select(0, index))  # [N, D]
        taps: dict[int, torch.Tensor] = {}
        wanted = set(inputs.hidden_layers)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, mask, cache, write_idx, kv_len, packed)
            if i in wanted:
                taps[i] = packed.scatter(x)
        cache.lengths += T if inputs.num_new is None else inputs.num_new
        h = self.norm(x)  # [N, D]
        logits = packed.scatter(self.head_logits(h)) if inputs.compute_logits else None
        return DecoderOutput(logits=logits, hidden=tuple(taps[i] for i in inputs.hidden_layers),
                             last_hidden=packed.scatter(h))
