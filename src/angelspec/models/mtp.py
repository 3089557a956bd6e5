"""The shared-parameter multi-depth MTP draft model (report §2.1, Eq. 1–2).

One physical module, invoked recurrently for D logical depths k = 0..D-1:

    Eq. 1   u^(k) = W_proj [RMSNorm(h^(k-1)) ; RMSNorm(E(x̃_k))]
    Eq. 2   h^(k) = F_θ(u^(k), K^(<k)),        q_k = softmax(W_lm · RMSNorm_out(h^(k)))

h^(-1) is the target's tap hidden state (by default the output of the target's last decoder layer, tap
id L-1; docs/design.md trap 2), E and W_lm are the target's embedding and LM head, and F_θ is one decoder
layer (`DecoderLayer`: RMSNorm, GQA attention with RoPE and the target family's q/k norm, SwiGLU MLP)
attending over the draft KV K^(<k). Like DeepSeek-V3's MTP module (and unlike the bare Eq. 2) the
layer output passes through the model's own final RMSNorm before W_lm, because the target's head was
trained on normalised states; h^(k) itself (pre-norm) is what the next depth consumes.

Alignment (report §2.3): at sequence position i, depth 0 fuses the target state h_i with E(x_{i+1})
and predicts x_{i+2}; depth k predicts x_{i+k+2}. The model's RoPE position for depth k at i is
p_i + k, so a draft chain at inference (positions t, t+1, ...) sees the same relative offsets as
training.

E and W_lm are TAKEN FROM THE TARGET AND FROZEN: the model keeps plain references (not submodules),
reads their weights detached, and its `state_dict()` holds only its own weights. Model code only: no
file I/O, no target loading.

The MTP family: `MTPDraftModel` is also the base of EAGLE-3's `Eagle3DraftModel` (`models.eagle3`). A member
differs only in how the target taps become h^(-1) (`condition`: MTP takes its one tap as is, EAGLE-3 applies fc
to three) and how the depth input (h, x̃) enters the decoder layer (`build_fusion`, `layer_inputs`: MTP's W_proj
of Eq. 1 vs EAGLE-3's 2C-wide attention input); configs share `MTPFamilyConfig`. The TTT rollout, the cached
inference step, the trainer, the engine drafter and the folder IO are written once against this interface.

Shape legend: B batch, T time, C model dim (= the target's), H heads, Hkv kv heads, Dh head dim, V vocab
(D is reserved for the number of depths).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from angelspec.models.attention import AttentionPlan, cache_span
from angelspec.models.config import ConfigError, DecoderConfig, DraftModelConfig, DraftShape
from angelspec.models.decoder import DecoderLayer, DraftRope, RMSNorm
from angelspec.models.kv_cache import StaticKVCache
from angelspec.models.linear import Linear, linear
from angelspec.models.vocab import DraftVocabulary, check_draft_vocab_size


@dataclass(frozen=True, kw_only=True)
class MTPFamilyConfig(DraftModelConfig):
    """Shape of one MTP-family draft model (MTP, EAGLE-3) and the target it belongs to (`DraftModelConfig`).

    `hidden_size` and `vocab_size` must equal the target's (E and W_lm are shared); the attention
    shape and MLP width are the model's own. `num_depths` is D, the TTT unroll length used in training; at
    inference the model may be invoked for more depths recurrently. Subclasses say which target taps feed the
    model (`target_layer_ids`: a property of MTP's one tap, a field of EAGLE-3's three) and which drafter kind
    they are.
    """

    num_draft_layers: ClassVar[int] = 1  # one physical decoder layer F_θ, invoked once per depth

    num_depths: int

    def __post_init__(self) -> None:
        if self.num_depths < 1:
            raise ConfigError(f"num_depths must be >= 1, got {self.num_depths}")
        check_draft_vocab_size(self.draft_vocab_size, self.vocab_size)
        self.check_layer_ids(self.target_num_layers)
        self.layer_config()  # validates head shapes


@dataclass(frozen=True, kw_only=True)
class MTPConfig(MTPFamilyConfig):
    """An MTP draft model: `target_layer_id` is the one tap fed as h^(-1) (default: the target's last layer)."""

    drafter: ClassVar[str] = "mtp"
    noun: ClassVar[str] = "mtp drafter"

    target_layer_id: int

    @property
    def target_layer_ids(self) -> tuple[int, ...]:
        return (self.target_layer_id,)

    @classmethod
    def for_target(cls, target: DecoderConfig, *, num_depths: int = 3, target_layer_id: int | None = None,
                   shape: DraftShape | None = None) -> MTPConfig:
        """A model for `target`: attention/MLP shape default to the target's (`shape`: the overrides); tap defaults
        to its last layer."""
        layers = cls.target_shape(target, shape)
        tap = target.num_hidden_layers - 1 if target_layer_id is None else target_layer_id
        return cls(num_depths=num_depths, target_layer_id=tap, **layers)


def concat_taps(taps: Sequence[torch.Tensor]) -> torch.Tensor:
    """The target taps a drafter conditions on, joined on the feature axis: n × [B, T, Ct] -> [B, T, n·Ct]."""
    return taps[0] if len(taps) == 1 else torch.cat(list(taps), dim=-1)


class MTPDraftModel(DraftRope, DraftVocabulary, nn.Module):
    """Eq. 1–2 with the target's embedding and LM head passed in by reference (frozen, never saved).

    The base of the MTP family: a subclass (`models.eagle3.Eagle3DraftModel`) changes only how the depth input
    (h, x̃) enters the decoder layer (`build_fusion`, `condition`, `layer_inputs`); the TTT rollout, the
    cached inference step, the trainer, the drafter and the folder IO serve every member unchanged."""

    def __init__(self, cfg: MTPFamilyConfig, embed_tokens: nn.Embedding, lm_head: nn.Linear) -> None:
        super().__init__()
        if embed_tokens.weight.shape != (cfg.vocab_size, cfg.hidden_size):
            raise ConfigError(f"embedding {tuple(embed_tokens.weight.shape)} does not match the {cfg.drafter} "
                              f"config's [vocab, hidden] = [{cfg.vocab_size}, {cfg.hidden_size}]")
        if lm_head.weight.shape != (cfg.vocab_size, cfg.hidden_size):
            raise ConfigError(f"LM head {tuple(lm_head.weight.shape)} does not match [{cfg.vocab_size}, "
                              f"{cfg.hidden_size}]")
        self.config = cfg
        # A tuple is not registered by nn.Module: the target's tensors stay out of parameters()/state_dict().
        self._shared: tuple[nn.Embedding, nn.Linear] = (embed_tokens, lm_head)
        self.build_fusion()
        self.layer = DecoderLayer(cfg.layer_config(), 0)  # F_θ of Eq. 2
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # before W_lm
        dh = cfg.head_dim
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dh, 2, dtype=torch.float32) / dh))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.attn_backend = "auto"  # `models.attention.set_attention_backend`
        self._init_draft_vocab()  # `angelspec draft-vocab` / the trainer's draft_vocab_size (`draft_head`)

    def build_fusion(self) -> None:
        """The modules that join the depth input (h, x̃) before F_θ; MTP: Eq. 1's norms and W_proj."""
        d, eps = self.config.hidden_size, self.config.rms_norm_eps
        self.hidden_norm = RMSNorm(d, eps)  # RMSNorm(h^(k-1)) of Eq. 1
        self.embed_norm = RMSNorm(d, eps)  # RMSNorm(E(x̃_k)) of Eq. 1
        self.proj = Linear(2 * d, d, bias=False)  # W_proj of Eq. 1

    def init_weights(self, std: float = 0.02, generator: torch.Generator | None = None) -> None:
        for name, p in self.named_parameters():
            with torch.no_grad():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                elif name.endswith(".bias"):
                    p.zero_()
                else:
                    p.normal_(0.0, std, generator=generator)

    # ----- pieces shared by training and inference -----
    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """E(x) [B, T, C], frozen."""
        return F.embedding(token_ids, self._shared[0].weight.detach())

    def fuse(self, hidden: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """Eq. 1: h [B, T, C], x̃ [B, T] -> u [B, T, C]."""
        e = self.embed(token_ids).to(hidden.dtype)
        return self.proj(torch.cat([self.hidden_norm(hidden), self.embed_norm(e)], dim=-1))

    def condition(self, taps: torch.Tensor) -> torch.Tensor:
        """h^(-1) from the target taps (`concat_taps` of `target_layer_ids`): [B, T, n·Ct] -> [B, T, C].
        MTP: the one tap as it is."""
        return taps

    def layer_inputs(self, hidden: torch.Tensor, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """F_θ's residual stream x [B, T, C] and attention input [B, T, C_in] for the depth input (h, x̃).

        MTP: x = u of Eq. 1 and the attention reads RMSNorm(u), exactly `DecoderLayer.forward`."""
        u = self.fuse(hidden, token_ids)
        return u, self.layer.input_layernorm(u)

    def layer_forward(self, hidden: torch.Tensor, token_ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      mask: AttentionPlan | None, cache: StaticKVCache | None,
                      write_idx: tuple[torch.Tensor, torch.Tensor] | None, kv_len: int | None) -> torch.Tensor:
        """One depth of F_θ over (h [B, T, C], x̃ [B, T]) -> h' [B, T, C] (arguments as `Attention.forward`)."""
        x, attn_in = self.layer_inputs(hidden, token_ids)
        x = x + self.layer.attn(attn_in, cos, sin, mask, cache, write_idx, kv_len)
        return x + self.layer.mlp(self.layer.post_attention_layernorm(x))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Eq. 2's head: h^(k) [..., C] -> fp32 logits [..., V] (W_lm frozen)."""
        return linear(self.norm(hidden), self._shared[1].weight.detach()).float()

    def draft_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Eq. 2's head at inference, over the draft vocabulary: h^(k) [..., C] -> fp32 logits [..., V'] (V' = V
        without one; index along it with `to_target_ids`)."""
        return self.draft_logits(self.norm(hidden))

    def attention_residual(self, x: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """`DecoderLayer.forward`'s attention residual: x [B, T, C], attn_out [B, H, T, Dh] -> [B, T, C]."""
        B, H, T, Dh = attn_out.shape
        return x + self.layer.attn.o_proj(attn_out.transpose(1, 2).reshape(B, T, H * Dh))

    def mlp_residual(self, x: torch.Tensor) -> torch.Tensor:
        """`DecoderLayer.forward`'s MLP residual, the layer's last step: x [B, T, C] -> h [B, T, C]."""
        return x + self.layer.mlp(self.layer.post_attention_layernorm(x))

    # ----- depth 0, teacher-forced (base MTP and the "one causal pass" of benchmarks/ttt_memory.py) -----
    def forward(self, hidden: torch.Tensor, token_ids: torch.Tensor, positions: torch.Tensor,
                document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """One causal pass of Eq. 1–2 over a (packed) sequence: -> h^(0) [B, T, C].

        hidden [B, T, n·Ct] target taps h_i (`concat_taps`); token_ids [B, T] the aligned inputs x_{i+1};
        positions [B, T] document-local; document_ids [B, T] gate attention to the own document (None = plain
        causal)."""
        if hidden.dim() != 3 or token_ids.shape != hidden.shape[:2]:
            raise ValueError(f"hidden must be [B, T, C] and token_ids [B, T], got {tuple(hidden.shape)}, "
                             f"{tuple(token_ids.shape)}")
        h = self.condition(hidden)  # [B, T, C]
        cos, sin = self.rope(positions, h.dtype)
        mask = None if document_ids is None else AttentionPlan.documents(document_ids, self.attn_backend)
        return self.layer_forward(h, token_ids, cos, sin, mask, None, None, None)

    # ----- inference: one decoder layer over a static draft KV cache -----
    def new_cache(self, batch_size: int, max_len: int, *, slack: int, dtype: torch.dtype,
                  device: torch.device) -> StaticKVCache:
        return StaticKVCache(self.config.layer_config(), batch_size, max_len, slack=slack, dtype=dtype,
                             device=device)

    def forward_cached(self, hidden: torch.Tensor, token_ids: torch.Tensor, cache: StaticKVCache, *,
                       num_new: torch.Tensor | None = None, kv_len: int | None = None) -> torch.Tensor:
        """Append T entries per row at slots `cache.lengths + arange(T)` (slot == RoPE position) and attend
        over each row's cached entries: -> h [B, T, C]; `cache.lengths += num_new` (default T).

        hidden [B, T, C] is the depth input h, already conditioned: `condition(taps)` for committed entries,
        the model's own previous output for draft-chain entries."""
        B, T = token_ids.shape
        dev = token_ids.device
        slots = cache.lengths[:, None] + torch.arange(T, device=dev)  # [B, T]
        kv_len = cache_span(kv_len, cache.capacity, self.attn_backend, dev)
        mask = AttentionPlan.cached(cache.lengths, T, kv_len, cache.capacity, self.attn_backend, False,
                                    cache.dtype)
        write = slots.clamp(max=cache.capacity - 1)  # slots past the end hold only entries beyond num_new
        write_idx = (torch.arange(B, device=dev)[:, None], write)
        cos, sin = self.rope_at(write, cache.capacity, hidden.dtype)
        out = self.layer_forward(hidden, token_ids, cos, sin, mask, cache, write_idx, kv_len)
        cache.lengths += T if num_new is None else num_new
        return out
