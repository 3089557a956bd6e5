"""Pure-PyTorch decoder for the Qwen3 / Qwen2 / Llama families, with hidden-state taps and a static
KV cache.

Shape legend: B batch, T new tokens in this call, S cache slots, D model dim, H query heads,
Hkv key/value heads, Dh head dim, V vocab.

Hidden-state tap ids (DESIGN.md trap 2): id `i` (0-based) is the OUTPUT of decoder layer `i`, i.e.
HF `hidden_states[i + 1]`; the last id `L-1` is the final layer's output before the final norm.
vLLM/SGLang count "before layer i" and are converted in the exporters, never here.

For speed on small models (where per-op overhead dominates) q/k/v and gate/up are fused into one
matmul each; the HF adapter (`models/hf_io.py`) splits and joins the weights.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from angelspec.models.config import DecoderConfig, rope_inv_freq
from angelspec.models.kv_cache import StaticKVCache


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 then cast back before the weight, as the reference does for bf16.
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        qkv_out = (self.n_heads + 2 * self.n_kv) * self.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, qkv_out, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=cfg.o_bias)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,  # [B, T, D]
        cos: torch.Tensor,  # [B, 1, T, Dh]
        sin: torch.Tensor,  # [B, 1, T, Dh]
        mask: torch.Tensor | None,  # [B, 1, T, S] bool (True = attend) or None for plain causal
        cache: StaticKVCache | None,
        write_idx: tuple[torch.Tensor, torch.Tensor] | None,  # ([B, 1], [B, T]) row / slot indices
        kv_len: int | None,
    ) -> torch.Tensor:
        B, T, _ = x.shape
        qkv = self.qkv_proj(x).view(B, T, self.n_heads + 2 * self.n_kv, self.head_dim)
        q, k, v = qkv.split((self.n_heads, self.n_kv, self.n_kv), dim=2)  # [B, T, H|Hkv, Dh]
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H|Hkv, T, Dh]
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if cache is not None:
            assert write_idx is not None
            rows, slots = write_idx
            kc, vc = cache.k[self.layer_idx], cache.v[self.layer_idx]  # [B, Hkv, S, Dh]
            # Advanced indices around a slice put the indexed dims first: target view is [B, T, Hkv, Dh].
            kc[rows, :, slots] = k.transpose(1, 2).to(kc.dtype)
            vc[rows, :, slots] = v.transpose(1, 2).to(vc.dtype)
            k, v = kc[:, :, :kv_len], vc[:, :, :kv_len]
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.n_kv != self.n_heads)
        else:
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=self.n_kv != self.n_heads
            )
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.inter = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

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

    def forward(self, x, cos, sin, mask, cache, write_idx, kv_len):
        x = x + self.attn(self.input_layernorm(x), cos, sin, mask, cache, write_idx, kv_len)
        return x + self.mlp(self.post_attention_layernorm(x))


@dataclass
class DecoderOutput:
    logits: torch.Tensor | None  # [B, T or n_keep, V] fp32, None when no logits were requested
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
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        inv_freq, attn_factor = rope_inv_freq(cfg)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.attn_factor = attn_factor
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

    # ----- forward -----
    def forward(
        self,
        input_ids: torch.Tensor,  # [B, T]
        *,
        positions: torch.Tensor | None = None,  # [B, T]; default: cache lengths + arange(T), or arange(T)
        cache: StaticKVCache | None = None,
        num_new: torch.Tensor | None = None,  # [B] real tokens per row (<= T); rest is padding
        kv_len: int | None = None,  # host-side upper bound on lengths + T, to attend over fewer slots
        document_ids: torch.Tensor | None = None,  # [B, T] packed training: attend within a document only
        hidden_layers: Sequence[int] = (),
        logits_index: torch.Tensor | None = None,  # [B, n] positions whose logits are needed
        compute_logits: bool = True,
    ) -> DecoderOutput:
        """One forward pass.

        With a cache, the T tokens are appended at slots `lengths[b] .. lengths[b]+T-1`, attend to
        every committed slot of their row plus the earlier new tokens, and `lengths += num_new`
        afterwards. Roll back a partial accept with `cache.truncate(...)`.
        """
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, T], got shape {tuple(input_ids.shape)}")
        B, T = input_ids.shape
        L = self.config.num_hidden_layers
        for i in hidden_layers:
            if not 0 <= i < L:
                raise ValueError(f"hidden layer id {i} out of range: ids are 0..{L - 1} "
                                 "(id i = output of decoder layer i)")
        dev = input_ids.device
        explicit_positions = positions is not None
        mask: torch.Tensor | None = None
        write_idx = None
        if cache is not None:
            if B != cache.batch_size:
                raise ValueError(f"batch of {B} rows does not match the cache's {cache.batch_size} rows")
            start = cache.lengths  # [B]
            slots = start[:, None] + torch.arange(T, device=dev)  # [B, T]
            if positions is None:
                positions = slots
            write_idx = (torch.arange(B, device=dev)[:, None], slots.clamp(max=cache.capacity - 1))
            kv_len = cache.capacity if kv_len is None else min(kv_len, cache.capacity)
            key_pos = torch.arange(kv_len, device=dev)  # [S]
            mask = (key_pos[None, None, :] <= slots[:, :, None])[:, None]  # [B, 1, T, S]
        else:
            if positions is None:
                positions = torch.arange(T, device=dev).expand(B, T)
            if document_ids is not None:
                causal = torch.ones(T, T, dtype=torch.bool, device=dev).tril()
                same_doc = document_ids[:, :, None] == document_ids[:, None, :]  # [B, T, T]
                mask = (same_doc & causal)[:, None]
        if cache is not None:
            table_len = cache.capacity
        elif explicit_positions:
            table_len = int(positions.max()) + 1 if positions.numel() else 1  # host sync; training only
        else:
            table_len = T
        cos_t, sin_t = self.rope_table(table_len, dev)
        cos = cos_t[positions].unsqueeze(1).to(self.embed_tokens.weight.dtype)  # [B, 1, T, Dh]
        sin = sin_t[positions].unsqueeze(1).to(self.embed_tokens.weight.dtype)

        x = self.embed_tokens(input_ids)  # [B, T, D]
        taps: dict[int, torch.Tensor] = {}
        wanted = set(hidden_layers)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, mask, cache, write_idx, kv_len)
            if i in wanted:
                taps[i] = x
        if cache is not None:
            cache.lengths += T if num_new is None else num_new
        h = self.norm(x)
        logits = None
        if compute_logits:
            hl = h if logits_index is None else h.gather(1, logits_index[..., None].expand(-1, -1, h.shape[-1]))
            logits = self.lm_head(hl).float()
        return DecoderOutput(logits=logits, hidden=tuple(taps[i] for i in hidden_layers), last_hidden=h)
