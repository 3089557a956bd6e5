"""AngelSpec's MTP drafter in vLLM 0.32 (report §2.1, Eq. 1-2), served by vLLM's EAGLE-3 proposer.

Per depth k, over the depth input (h, x) (h: the target tap at depth 0, the model's own pre-norm output after):

    u = W_proj [RMSNorm_h(h) ; RMSNorm_e(E(x))]          (Eq. 1; E the target's embedding, shared by vLLM)
    h' = F(u)                                             (one decoder layer of the target's family, causal, KV cache)
    q = softmax(W_lm RMSNorm(h'))                         (Eq. 2; W_lm the target's rows of the draft vocabulary)

The EAGLE-3 proposer gives the first pass the target's auxiliary hidden states, here the one tap MTP reads
(`eagle_aux_hidden_state_layer_ids`: our tap + 1, vLLM counting the residual stream before a layer), through
`combine_hidden_states` (the identity: no fc), then feeds back the second value `forward` returns (h', pre-norm)
at the next depth, at the next position: the recurrence and the RoPE offsets MTP was trained with (TTT).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from vllm.config import VllmConfig, get_current_vllm_config
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import ReplicatedLinear
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.models.qwen3_eagle3 import Eagle3Qwen3ForCausalLM
from vllm.model_executor.models.utils import AutoWeightsLoader, WeightsMapper, maybe_prefix

STACKED = {".q_proj": (".qkv_proj", "q"), ".k_proj": (".qkv_proj", "k"), ".v_proj": (".qkv_proj", "v"),
           ".gate_proj": (".gate_up_proj", 0), ".up_proj": (".gate_up_proj", 1)}


def decoder_layer(config, vllm_config: VllmConfig, prefix: str) -> nn.Module:
    """One vLLM decoder layer of the drafter's family (config.model_type: qwen3 with q/k norm, or llama)."""
    if config.model_type == "llama":
        from vllm.model_executor.models.llama import LlamaDecoderLayer

        return LlamaDecoderLayer(vllm_config=vllm_config, prefix=prefix, config=config)
    from vllm.model_executor.models.qwen3 import Qwen3DecoderLayer

    return Qwen3DecoderLayer(config=config, cache_config=vllm_config.cache_config, prefix=prefix)


class AngelSpecMTPModel(nn.Module):
    hf_to_vllm_mapper = WeightsMapper(orig_to_new_stacked=STACKED)

    def __init__(self, *, vllm_config: VllmConfig, start_layer_id: int, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.speculative_config.draft_model_config.hf_config
        self.config = config
        self.use_aux_hidden_state = True
        self.norm_before_fc = False
        self.fc_norm = None
        c, eps = config.hidden_size, config.rms_norm_eps
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, c, prefix=maybe_prefix(prefix, "embed_tokens"))
        self.hidden_norm = RMSNorm(c, eps=eps)
        self.embed_norm = RMSNorm(c, eps=eps)
        self.proj = ReplicatedLinear(2 * c, c, bias=False, params_dtype=vllm_config.model_config.dtype,
                                     prefix=maybe_prefix(prefix, "proj"), return_bias=False)
        # One layer, named after the target's last so that its KV cache gets a name of its own.
        self.layers = nn.ModuleList([decoder_layer(config, get_current_vllm_config(),
                                                   maybe_prefix(prefix, f"layers.{start_layer_id}"))])
        self.norm = RMSNorm(c, eps=eps)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden_states: torch.Tensor,
                input_embeds: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        e = self.embed_input_ids(input_ids) if input_embeds is None else input_embeds
        u = self.proj(torch.cat([self.hidden_norm(hidden_states), self.embed_norm(e.to(hidden_states.dtype))], -1))
        x, residual = self.layers[0](positions, u, None)
        out, prenorm = self.norm(x, residual)  # RMSNorm(x + residual), and x + residual itself
        return out, prenorm

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return AutoWeightsLoader(self).load_weights(weights, mapper=self.hf_to_vllm_mapper)


class AngelSpecMTPEagle3(Eagle3Qwen3ForCausalLM):
    """An `angelspec export --format vllm` MTP folder (`method: "eagle3"`): Eagle3Qwen3ForCausalLM's head, draft
    vocabulary and loading, with `AngelSpecMTPModel` as its model and no fc."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        # Eagle3Qwen3ForCausalLM.__init__ with our model in place of its own (building both would register the
        # draft layer's attention twice under one name).
        nn.Module.__init__(self)
        spec = vllm_config.speculative_config
        if spec.parallel_drafting:
            raise ValueError("an AngelSpec MTP drafter drafts one depth at a time: drop parallel_drafting")
        self.use_parallel_drafting = False
        self.config = config = spec.draft_model_config.hf_config
        if getattr(config, "draft_vocab_size", None) is None:
            config.draft_vocab_size = config.vocab_size
        target_layers = vllm_config.model_config.get_total_num_hidden_layers()
        config.target_layer_count = target_layers
        self.model = AngelSpecMTPModel(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"),
                                       start_layer_id=target_layers)
        self.lm_head = ParallelLMHead(config.draft_vocab_size, config.hidden_size,
                                      prefix=maybe_prefix(prefix, "lm_head"))
        self.logits_processor = LogitsProcessor(config.draft_vocab_size, scale=getattr(config, "logit_scale", 1.0))
        self.draft_id_to_target_id = None
        if config.draft_vocab_size != vllm_config.model_config.get_vocab_size():
            self.draft_id_to_target_id = nn.Parameter(torch.zeros(config.draft_vocab_size, dtype=torch.long),
                                                      requires_grad=False)

    def combine_hidden_states(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The one target tap MTP reads, as it is (MTP has no fc)."""
        if hidden_states.shape[-1] != self.config.hidden_size:
            raise ValueError(f"the AngelSpec MTP drafter reads one target tap of width {self.config.hidden_size}, "
                             f"got {hidden_states.shape[-1]} features: eagle_aux_hidden_state_layer_ids must name "
                             "one layer")
        return hidden_states
