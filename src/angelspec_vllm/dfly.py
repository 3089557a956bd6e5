"""AngelSpec's DFly / DFlare block drafter in vLLM 0.32 (report §3.1-3.2, Eq. 11-15), served by vLLM's DFlash
proposer (`method: "dflash"`): one pass over the block [x_t, m, ..., m] per step, the target context injected as
extra keys/values of every draft layer.

What differs from vLLM's DFlash (`DFlashQwen3ForCausalLM`, whose proposer, KV layout and loading this class keeps):

  context   draft layer i reads its own view of the n target taps h^(1..n) (Eq. 11-12):
                g^(i) = RMSNorm_i(c + sum_j softmax(W_fuse[i])_j h^(j)),   c = W_fc [h^(1); ...; h^(n)] + b_fc (DFly)
            instead of DFlash's one RMSNorm(W_fc [...]) for all layers. `combine_hidden_states` (which the proposer
            calls on the taps, and whose C-wide result it hands to `precompute_and_store_context_kv`) returns layer 0's
            pre-norm feature and keeps the taps for the other layers' features.
  anchor    with the fused anchor input, every block entry also gets W_a [g^(0)_{t-1}; RMSNorm_a(E(x_t))]: the
            newest context position's layer-0 feature, found through the KV-cache slot of position t-1 (the block
            table of the drafter's attention metadata), beside the anchor's embedding.
  head      the hidden-correction head (Eq. 15) runs in `compute_logits`, left to right over the K draft positions of
            each request: z_k + SwiGLU(W [RMSNorm z_k; RMSNorm E(x_{k-1})]), x_{k-1} the anchor, then the previous
            position's argmax. vLLM drafts greedily (argmax of these logits), so the drafts are the ones our engine
            proposes at T = 0; the forward pass therefore returns the backbone's pre-norm output.

A confidence head is not served (vLLM's DFlash has no use for one). Eager mode only (the per-layer context and the
head run outside vLLM's compiled graph; serve with enforce_eager).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from vllm.config import VllmConfig
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import ReplicatedLinear
from vllm.model_executor.models.qwen3_dflash import DFlashQwen3ForCausalLM


class HiddenCorrectionHead(nn.Module):
    """Eq. 15: z_hat = z + W_down (SiLU(g) * u), [g; u] = W [RMSNorm_z(z); RMSNorm_e(e_prev)]."""

    def __init__(self, hidden: int, inter: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.hidden, self.inter = hidden, inter
        self.z_norm = RMSNorm(hidden, eps=eps)
        self.e_norm = RMSNorm(hidden, eps=eps)
        self.gate_up_proj = ReplicatedLinear(2 * hidden, 2 * inter, bias=False, params_dtype=dtype, return_bias=False)
        self.down_proj = ReplicatedLinear(inter, hidden, bias=False, params_dtype=dtype, return_bias=False)

    def forward(self, z: torch.Tensor, e_prev: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(torch.cat([self.z_norm(z), self.e_norm(e_prev.to(z.dtype))], -1)).split(
            self.inter, dim=-1)
        return z + self.down_proj(F.silu(gate) * up)


class AngelSpecDFlyDFlash(DFlashQwen3ForCausalLM):
    """An `angelspec export --format vllm` DFly / DFlare folder (config `angelspec_block`: conditioning, head,
    fc_bias, anchor_fusion, head_intermediate_size)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        cfg = self.config
        block = dict(getattr(cfg, "angelspec_block", None) or {})
        self.conditioning = block.get("conditioning", "dfly")
        self.head_kind = block.get("head", "none")
        self.anchor_fusion = bool(block.get("anchor_fusion", False))
        self.block_size = int(cfg.block_size)
        taps = len(cfg.dflash_config["target_layer_ids"])
        c, eps, dtype = cfg.hidden_size, cfg.rms_norm_eps, vllm_config.model_config.dtype
        layers = cfg.num_hidden_layers
        m = self.model
        m.num_taps = taps
        if self.conditioning == "dfly":
            m.fc_bias = nn.Parameter(torch.zeros(c, dtype=dtype), requires_grad=False) if block.get("fc_bias") \
                else None
        m.fusion_logits = nn.Parameter(torch.zeros(layers, taps, dtype=torch.float32), requires_grad=False)
        m.context_norms = nn.ModuleList(RMSNorm(c, eps=eps) for _ in range(layers))
        if self.anchor_fusion:
            m.anchor_norm = RMSNorm(c, eps=eps)
            m.anchor_fuse = ReplicatedLinear(2 * c, c, bias=False, params_dtype=dtype, return_bias=False)
        if self.head_kind == "hidden":
            m.head = HiddenCorrectionHead(c, int(block.get("head_intermediate_size") or c), eps, dtype)
        elif self.head_kind != "none":
            raise ValueError(f"the AngelSpec block drafter class serves the heads none and hidden, not "
                             f"{self.head_kind!r}")
        self._kv_block_size = int(vllm_config.cache_config.block_size)  # slot = block * size + offset
        self._taps: torch.Tensor | None = None
        self._anchors: torch.Tensor | None = None
        self._context: tuple[torch.Tensor, torch.Tensor] | None = None  # (g^(0) rows, their KV-cache slots)

    # ----- the context: per-layer features, injected as keys/values -----
    def _pre_norm_feature(self, taps: torch.Tensor, layer: int) -> torch.Tensor:
        """c + f^(i) (DFly) or f^(i) (DFlare) for taps [N, n*C] -> [N, C]."""
        m = self.model
        alpha = torch.softmax(m.fusion_logits[layer].float(), dim=-1).to(taps.dtype)  # [n]
        f = torch.einsum("tnc,n->tc", taps.view(taps.shape[0], m.num_taps, -1), alpha)
        if self.conditioning != "dfly":
            return f
        c = m.fc(taps)
        return f + c if m.fc_bias is None else f + c + m.fc_bias

    def load_weights(self, weights):
        """Our names, except the fc bias, which lives beside vLLM's bias-free fc."""
        return super().load_weights(("fc_bias" if name == "fc.bias" else name, t) for name, t in weights)

    def combine_hidden_states(self, hidden_states: torch.Tensor) -> torch.Tensor:
        self._taps = hidden_states
        return self._pre_norm_feature(hidden_states, 0)

    def precompute_and_store_context_kv(self, context_states: torch.Tensor, context_positions: torch.Tensor,
                                        context_slot_mapping=None) -> None:
        taps = self._taps if self._taps is not None and self._taps.shape[0] == context_states.shape[0] else None
        self._taps = None
        for i, layer in enumerate(self.model.layers):
            pre = context_states if i == 0 or taps is None else self._pre_norm_feature(taps, i)
            g = self.model.context_norms[i](pre)
            slots = context_slot_mapping[i] if isinstance(context_slot_mapping, list | tuple) else context_slot_mapping
            if i == 0:
                self._context = None if slots is None else (g, slots)
            attn = layer.self_attn
            qkv, _ = attn.qkv_proj(g)
            k = qkv[:, attn.q_size: attn.q_size + attn.kv_size]
            v = qkv[:, attn.q_size + attn.kv_size:]
            k = attn.k_norm(k.reshape(-1, attn.num_kv_heads, attn.head_dim)).reshape(k.shape)
            _, k = attn.rotary_emb.forward_native(context_positions, k.clone(), k)
            if slots is None:
                continue
            if attn.v_scale is not None:
                v = v * attn.v_scale
            inner = attn.attn
            inner.impl.do_kv_cache_update(inner, k.reshape(-1, attn.num_kv_heads, attn.head_dim).contiguous(),
                                          v.reshape(-1, attn.num_kv_heads, attn.head_dim).contiguous(),
                                          inner.kv_cache, slots)

    # ----- the block pass -----
    def _block_starts(self, num_tokens: int) -> tuple[torch.Tensor | None, torch.Tensor]:
        """This step's attention metadata for the draft layers (None in a profiling run) and the index of each
        request's block start (its anchor) among the query tokens."""
        meta = get_forward_context().attn_metadata
        if isinstance(meta, dict):
            meta = meta.get(self.model.layers[0].self_attn.attn.layer_name)
        if meta is None:
            rows = num_tokens // self.block_size
            return None, torch.arange(rows, device=self.model.norm.weight.device) * self.block_size
        return meta, meta.query_start_loc[:-1].long()

    def _anchor_input(self, meta, anchors: torch.Tensor, anchor_positions: torch.Tensor) -> torch.Tensor:
        """W_a [g^(0)_{t-1}; RMSNorm_a(E(x_t))] per request: anchors, anchor_positions [R] -> [R, C]; g^(0)_{t-1}
        is the context row written to the KV-cache slot of position t-1 (block table * block size + offset)."""
        m = self.model
        if meta is None or self._context is None:  # a profiling run: no cache, no context
            g_last = torch.zeros(anchors.shape[0], self.config.hidden_size, dtype=m.norm.weight.dtype,
                                 device=anchors.device)
        else:
            g, slots = self._context
            block = self._kv_block_size
            prev = anchor_positions.long() - 1
            table = meta.block_table[: anchors.shape[0]].long()
            want = table.gather(1, (prev // block)[:, None])[:, 0] * block + prev % block  # [R] slot of t-1
            hit = slots.long()[None, :] == want[:, None]  # [R, N]
            if not bool(hit.any(dim=1).all()):
                raise RuntimeError("AngelSpec DFly: the newest context position of a request is not among this "
                                   "step's context states; the fused anchor input cannot be formed")
            g_last = g[hit.float().argmax(dim=1)]
        e = m.anchor_norm(m.embed_input_ids(anchors).to(g_last.dtype))
        return m.anchor_fuse(torch.cat([g_last, e], dim=-1))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, inputs_embeds: torch.Tensor | None = None
                ) -> torch.Tensor:
        m = self.model
        x = m.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds
        meta, starts = self._block_starts(x.shape[0])
        anchors = input_ids[starts]
        self._anchors = anchors
        if self.anchor_fusion and starts.numel():
            u = self._anchor_input(meta, anchors, positions[starts])  # [R, C]
            rows = starts.numel()
            x = x.clone()
            x[: rows * self.block_size] += u.repeat_interleave(self.block_size, dim=0).to(x.dtype)
        residual = None
        for layer in m.layers:
            x, residual = layer(positions=positions, hidden_states=x, residual=residual)
        return x + residual  # pre-norm: `compute_logits` runs the head and the final norm

    # ----- the head, left to right over greedy predecessors -----
    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        m = self.model
        if self.head_kind != "hidden":
            return super().compute_logits(m.norm(hidden_states))
        k = self.block_size - 1
        rows = hidden_states.shape[0] // k
        z = hidden_states[: rows * k].view(rows, k, -1)
        anchors = self._anchors
        prev = anchors[:rows].long() if anchors is not None and anchors.shape[0] >= rows else \
            torch.zeros(rows, dtype=torch.long, device=z.device)
        out = []
        for j in range(k):
            logits = super().compute_logits(m.norm(m.head(z[:, j], m.embed_input_ids(prev))))  # [R, V] target ids
            out.append(logits)
            prev = logits.argmax(dim=-1)
        return torch.stack(out, dim=1).view(rows * k, -1)

