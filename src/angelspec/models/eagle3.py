"""The EAGLE-3 draft model: a member of the MTP family (`models.mtp`) with another input fusion.

EAGLE-3 (Li et al., 2025) differs from the MTP model of Eq. 1–2 in two places only:

* conditioning: depth 0's hidden input is `g = fc([h_low; h_mid; h_high])`, a bias-free linear map of three
  target taps joined on the feature axis ([B, T, 3·Ct] -> [B, T, C]) instead of one tap as it is;
* the decoder layer: its attention reads `[RMSNorm_in(E(x̃)); RMSNorm_h(h)]` (q/k/v take 2·C) while the
  residual stream is h itself; there is no W_proj. Then `h' = h + Attn(...)`, `h' += MLP(RMSNorm(h'))`.

Everything else is shared with MTP: at depth k >= 1 the hidden input is the model's own previous-depth output
(pre-norm), the head is `W_lm · RMSNorm_out(h)` with the target's frozen LM head (the draft vocabulary is the
target's: no d2t/t2d reduction yet), the alignment (position i fuses E(x_{i+1}) and predicts x_{i+2}), the
TTT rollout (`train.ttt`), the draft KV cache and the engine drafter.

Tap ids follow the project convention (id i = output of target decoder layer i, docs/design.md trap 2). The
default (1, L//2, L-2) is, in vLLM/SGLang's "input of layer i" counting, (2, L//2+1, L-1); EAGLE-3's own
default there is (2, L//2, L-3), i.e. ours (1, L//2-1, L-4): the same low tap, a mid tap one layer later and a
high tap two layers later (the input of the last layer rather than of the third-to-last). Pass
`target_layer_ids` to reproduce EAGLE-3's exact choice.

Weight names, kept near the export layout (`LlamaForCausalLMEagle3`) where it costs nothing:
  fc.weight [C, 3·Ct]                          -> fc.weight
  hidden_norm.weight                           -> midlayer.hidden_norm.weight
  layer.input_layernorm.weight (on E(x̃))      -> midlayer.input_layernorm.weight
  layer.attn.qkv_proj.weight [(H+2Hkv)·Dh, 2C] -> midlayer.self_attn.{q,k,v}_proj.weight (split rows)
  layer.attn.o_proj / layer.post_attention_layernorm / layer.mlp.{gate_up,down}_proj
                                               -> midlayer.self_attn.o_proj / .post_attention_layernorm / .mlp.*
  norm.weight                                  -> norm.weight
(`lm_head`, `d2t`, `t2d` are written by the exporter from the target's head.)

Shape legend: B batch, T time, C model dim (= the target's), Ct target hidden (= C), H heads, Hkv kv heads,
Dh head dim.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from angelspec.models.config import ConfigError, DecoderConfig, DraftShape
from angelspec.models.decoder import RMSNorm
from angelspec.models.linear import Linear
from angelspec.models.mtp import MTPDraftModel, MTPFamilyConfig

NUM_TAPS = 3


def default_eagle3_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """Low / mid / high taps (1, L//2, L-2) of an L-layer target (module docstring). Targets of 3 or 4 layers, where
    those are not three distinct layers, get the first, middle and last layer (0, L//2, L-1); fewer than 3 layers
    have no three taps."""
    ids = (1, num_layers // 2, num_layers - 2)
    if not ids[0] < ids[1] < ids[2]:
        ids = (0, num_layers // 2, num_layers - 1)
    if not ids[0] < ids[1] < ids[2]:
        raise ConfigError(f"EAGLE-3 reads three distinct target layers, and a target with {num_layers} layers has "
                          f"fewer (needs at least 3); pass target_layer_ids or pick another drafter")
    return ids


@dataclass(frozen=True, kw_only=True)
class Eagle3Config(MTPFamilyConfig):
    """An EAGLE-3 draft model: `target_layer_ids` = (low, mid, high) taps, strictly increasing."""

    drafter: ClassVar[str] = "eagle3"
    noun: ClassVar[str] = "eagle3 drafter"

    target_layer_ids: tuple[int, int, int]  # type: ignore[misc]  # a field here, a ClassVar on the base

    def __post_init__(self) -> None:
        object.__setattr__(self, "target_layer_ids", tuple(int(i) for i in self.target_layer_ids))  # JSON list
        ids = self.target_layer_ids
        if len(ids) != NUM_TAPS or not ids[0] < ids[1] < ids[2]:
            raise ConfigError(f"EAGLE-3 needs three strictly increasing target layer ids (low, mid, high), got "
                              f"{list(ids)}")
        super().__post_init__()

    @classmethod
    def for_target(cls, target: DecoderConfig, *, num_depths: int = 3,
                   target_layer_ids: tuple[int, int, int] | None = None,
                   shape: DraftShape | None = None) -> Eagle3Config:
        """A model for `target`: attention/MLP shape default to the target's (`shape`: the overrides), taps to
        (1, L//2, L-2)."""
        layers = cls.target_shape(target, shape)
        ids = default_eagle3_layer_ids(target.num_hidden_layers) if target_layer_ids is None else target_layer_ids
        return cls(num_depths=num_depths, target_layer_ids=tuple(ids), **layers)


class Eagle3DraftModel(MTPDraftModel):
    """`MTPDraftModel` with EAGLE-3's fusion (module docstring); E and W_lm are the target's, by reference."""

    config: Eagle3Config

    def __init__(self, cfg: Eagle3Config, embed_tokens: nn.Embedding, lm_head: nn.Linear) -> None:
        super().__init__(cfg, embed_tokens, lm_head)
        attn = self.layer.attn
        # q/k/v read [RMSNorm(E(x̃)); RMSNorm(h)]: twice the model dim (replaces the C-wide projection).
        attn.qkv_proj = Linear(2 * cfg.hidden_size, attn.qkv_proj.out_features, bias=attn.qkv_proj.bias is not None)

    def build_fusion(self) -> None:
        d, eps = self.config.hidden_size, self.config.rms_norm_eps
        self.fc = Linear(NUM_TAPS * d, d, bias=False)  # [h_low; h_mid; h_high] -> g
        self.hidden_norm = RMSNorm(d, eps)  # RMSNorm_h(h); the embedding's norm is layer.input_layernorm

    def condition(self, taps: torch.Tensor) -> torch.Tensor:
        """g = fc([h_low; h_mid; h_high]): [B, T, 3·Ct] -> [B, T, C]."""
        if taps.shape[-1] != self.fc.in_features:
            raise ValueError(f"EAGLE-3 expects the {NUM_TAPS} target taps joined on the last dim "
                             f"({self.fc.in_features} features), got {tuple(taps.shape)}")
        return self.fc(taps)

    def layer_inputs(self, hidden: torch.Tensor, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Residual stream h [B, T, C]; attention input [RMSNorm_in(E(x̃)); RMSNorm_h(h)] [B, T, 2C]."""
        e = self.embed(token_ids).to(hidden.dtype)
        return hidden, torch.cat([self.layer.input_layernorm(e), self.hidden_norm(hidden)], dim=-1)
