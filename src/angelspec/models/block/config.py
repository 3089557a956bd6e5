"""Block-drafter configuration (report §3.1–3.2, §6.2; DSpark report §3): `BlockDrafterConfig`, the design
choices of a DFlash / DFlare / DFly / DSpark drafter and the target it belongs to, the names of those choices
(CONDITIONINGS, HEADS, MARKOV_HEADS, DRAFTER_KINDS, CONTEXT_INJECTIONS, CONFIDENCE_TARGETS), DFlash's tap choice
(`default_block_layer_ids`), the distance prior W_fuse starts from (`distance_prior`, §6.2) and the tap each draft
layer reads under DSpark's same-layer injection (`same_layer_taps`, Uraion §3.3).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from angelspec.models.config import ConfigError, DecoderConfig, DraftModelConfig, DraftShape
from angelspec.models.vocab import check_draft_vocab_size

CONDITIONINGS = ("dflash", "dflare", "dfly")
HEADS = ("none", "markov", "gated", "rnn", "hidden")
MARKOV_HEADS = ("markov", "gated", "rnn")  # the heads with a token embedding W1 and a bias W2 (DSpark §3.1)
DRAFTER_KINDS = ("dflash", "dflare", "dfly", "dspark")
# How the DFlash backbone (conditioning "dflash") injects the target context (Uraion §3.3): "shared" = DFlash's one
# fused context RMSNorm(W_fc [h^(1); …; h^(n)] + b) for every draft layer (Eq. 10); "same_layer" = draft layer i
# reads its own target tap (`same_layer_taps`), as the DSpark report's backbone does.
CONTEXT_INJECTIONS = ("shared", "same_layer")
# What the confidence head predicts (`heads.ConfidenceHead`): "tv" = α = 1 − TV(p, q), the acceptance of standard
# speculative sampling at T = 1 (DSpark §3.2; one output); "protocol" = the acceptance of the ARGMAX draft that every
# confidence-driven depth policy verifies (deterministic-draft protocol): 1[argmax q = argmax p] at T = 0, p_T(argmax q)
# at T > 0, one output per temperature of `confidence_temperatures`, interpolated in between.
CONFIDENCE_TARGETS = ("tv", "protocol")
DEFAULT_CONFIDENCE_TEMPERATURES = (0.0, 0.5, 1.0)


def default_block_layer_ids(num_target_layers: int, num_taps: int) -> tuple[int, ...]:
    """DFlash's tap choice: `num_taps` ids evenly spaced from 1 to L−3 (Qwen3-8B, L = 36, 5 taps: 1, 9, 17, 25,
    33); small targets fall back to 1..L−1, then to the last layer."""
    if num_taps < 1:
        raise ConfigError(f"need at least one target tap, got {num_taps}")
    start, end = 1, num_target_layers - 3
    if end - start + 1 < num_taps:
        start, end = max(0, num_target_layers - num_taps), num_target_layers - 1
    if num_taps == 1:
        return (end,)
    return tuple(int(round(start + i * (end - start) / (num_taps - 1))) for i in range(num_taps))


def same_layer_taps(num_draft_layers: int, num_taps: int) -> tuple[int, ...]:
    """Same-layer injection (Uraion §3.3: draft layer i's keys/values come from "the target model's hidden states at
    the same layer"): the index j(i) into `target_layer_ids` of the tap draft layer i reads, for L draft layers and n
    taps. Layers and taps are matched by relative depth, the layer at fraction d_i = i / (L−1) of the drafter (1/2
    for L = 1) reading the tap at the same fraction of the tap list:

        j(i) = ⌊d_i · (n − 1) + 1/2⌋     (ties go to the deeper tap)

    L = n pairs them one to one (j(i) = i). L < n gives every layer its own tap, the first and the last tap
    included; the taps in between that no layer reads are skipped. L > n lets neighbouring layers share a tap,
    every tap being read. Examples: L = 2, taps (1, 3, 5) -> (0, 2): taps 1 and 5; L = 1 -> (1,): the middle tap."""
    if num_draft_layers < 1 or num_taps < 1:
        raise ConfigError(f"same-layer injection needs at least one draft layer and one tap, got "
                          f"{num_draft_layers} and {num_taps}")
    if num_draft_layers == 1:
        return (int((num_taps - 1) / 2 + 0.5),)
    return tuple(int(i * (num_taps - 1) / (num_draft_layers - 1) + 0.5) for i in range(num_draft_layers))


def distance_prior(num_draft_layers: int, target_layer_ids: Sequence[int], temperature: float) -> Tensor:
    """W_fuse's initial logits [L, n] (§6.2): −|d_i − t_j| / temperature, where d_i = i / (L−1) is draft layer i's
    relative depth and t_j = (id_j − id_first) / (id_last − id_first) is tap j's relative depth within the tapped
    span (0.5 for a single layer or tap). softmax over j therefore peaks at the tap of matching depth."""
    # Computed on the host whatever the default device (a model built under `torch.device("meta")` reads it).
    ids = torch.tensor(list(target_layer_ids), dtype=torch.float64, device="cpu")
    d = torch.arange(num_draft_layers, dtype=torch.float64, device="cpu") / max(num_draft_layers - 1, 1)
    if num_draft_layers == 1:
        d = d + 0.5
    span = float(ids[-1] - ids[0]) if len(ids) > 1 else 0.0
    t = (ids - ids[0]) / span if span > 0 else torch.full_like(ids, 0.5, device="cpu")
    return (-(d[:, None] - t[None, :]).abs() / temperature).float()


def check_confidence_target(target: str, temperatures: Sequence[float]) -> None:
    """Raise ConfigError unless `target` is one of CONFIDENCE_TARGETS with fitting `temperatures`: none for "tv"
    (its one output predicts α), a strictly increasing list of finite values >= 0 for "protocol"."""
    if target not in CONFIDENCE_TARGETS:
        raise ConfigError(f"unknown confidence_target {target!r}; choose one of {', '.join(CONFIDENCE_TARGETS)}")
    temps = list(temperatures)
    if target == "tv" and temps:
        raise ConfigError(f"confidence_target 'tv' predicts α = 1 − TV at T = 1 and takes no temperatures, got {temps}"
                          "; use confidence_target=protocol for per-temperature confidences")
    if target == "protocol" and (not temps or any(not (math.isfinite(t) and t >= 0) for t in temps)
                                 or any(b <= a for a, b in zip(temps, temps[1:], strict=False))):
        raise ConfigError(f"confidence_temperatures must be a strictly increasing list of temperatures >= 0 (e.g. "
                          f"0,0.5,1), got {temps}")


@dataclass(frozen=True, kw_only=True)
class BlockDrafterConfig(DraftModelConfig):
    """Shape and design of a block-parallel drafter and the target it belongs to (`DraftModelConfig`).

    `hidden_size` / `vocab_size` equal the target's (E and W_lm are shared); attention and MLP shapes are the
    draft layers' own (default: the target's). `block_size` B counts the anchor, so a step proposes B−1 drafts
    (vLLM's `num_speculative_tokens = block_size − 1`). `mask_token_id` must be a real id of the target's
    vocabulary (DFlash reserves an unused special token; Qwen3: 151669).

    `context_injection` and `fc_bias` default to what a folder saved before they existed was built with (the
    shared fused context, W_fc with a bias), so such folders load unchanged; `for_target`, which builds new
    drafters, picks a DSpark's same-layer injection and no fc bias for the DFlash backbone instead."""

    noun: ClassVar[str] = "block drafter"

    target_layer_ids: tuple[int, ...]  # type: ignore[misc]  # a field here, a ClassVar on the base
    mask_token_id: int | None
    block_size: int = 8
    num_draft_layers: int = 5  # type: ignore[misc]  # a field here, a ClassVar on the base
    conditioning: str = "dfly"
    head: str = "hidden"
    markov_rank: int = 256
    confidence_head: bool = True
    head_intermediate_size: int | None = None  # hidden-correction SwiGLU width (None: hidden_size)
    fusion_prior_temperature: float = 0.1  # sharpness of the distance prior (dflare/dfly)
    context_injection: str = "shared"  # the DFlash backbone's context (CONTEXT_INJECTIONS); "same_layer": DSpark only
    fc_bias: bool = True  # b_fc of Eq. 10 / 12 (vLLM's DFlash fc has none); unused without an fc
    # The confidence head's target (CONFIDENCE_TARGETS). Folders written before these fields existed are "tv".
    confidence_target: str = "tv"
    confidence_temperatures: tuple[float, ...] = ()  # "protocol": the sampling temperatures it has outputs for
    # Fused anchor input (`BlockDrafter.anchor_input`): every block entry also gets W_a [g_{t−1}; RMSNorm(E(x_t))],
    # the newest context feature beside the anchor's embedding, as MTP's first depth sees them. False for folders
    # written before the field existed.
    anchor_fusion: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "target_layer_ids", tuple(int(i) for i in self.target_layer_ids))  # JSON list
        object.__setattr__(self, "confidence_temperatures", tuple(float(t) for t in self.confidence_temperatures))
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size < 2:
            raise ConfigError(f"block_size must be an int >= 2 (the anchor plus at least one draft), got "
                              f"{self.block_size!r}")
        if self.num_draft_layers < 1:
            raise ConfigError(f"num_draft_layers must be >= 1, got {self.num_draft_layers}")
        if self.conditioning not in CONDITIONINGS:
            raise ConfigError(f"unknown conditioning {self.conditioning!r}; choose one of {', '.join(CONDITIONINGS)}")
        if self.head not in HEADS:
            raise ConfigError(f"unknown head {self.head!r}; choose one of {', '.join(HEADS)}")
        if self.markov_rank < 1:
            raise ConfigError(f"markov_rank must be >= 1, got {self.markov_rank}")
        check_draft_vocab_size(self.draft_vocab_size, self.vocab_size)
        self._check_context_injection()
        if self.fusion_prior_temperature <= 0:
            raise ConfigError(f"fusion_prior_temperature must be > 0, got {self.fusion_prior_temperature}")
        if not self.target_layer_ids:
            raise ConfigError("target_layer_ids is empty: a block drafter conditions on at least one target tap")
        if len(set(self.target_layer_ids)) != len(self.target_layer_ids) or list(self.target_layer_ids) != sorted(
                self.target_layer_ids):
            raise ConfigError(f"target_layer_ids must be strictly increasing, got {list(self.target_layer_ids)}")
        self.check_layer_ids(self.target_num_layers)
        check_confidence_target(self.confidence_target, self.confidence_temperatures)
        if not isinstance(self.anchor_fusion, bool):
            raise ConfigError(f"anchor_fusion must be true or false, got {self.anchor_fusion!r}")
        if self.mask_token_id is None:
            raise ConfigError("mask_token_id is required: block drafters fill the draft positions with the "
                              "embedding of a reserved token (pass mask_token_id=<an unused special token id>)")
        self.check_mask_token(self.vocab_size)
        self.layer_config()  # validates head shapes

    # ----- derived values -----
    @property
    def num_drafts(self) -> int:
        """K = B − 1 drafts per step."""
        return self.block_size - 1

    @property
    def num_taps(self) -> int:
        return len(self.target_layer_ids)

    @property
    def drafter(self) -> str:
        """The drafter kind written to config.json: "dspark" for the DFlash backbone with a Markov-family head
        (DSpark report), otherwise the conditioning ("dflash", "dflare", "dfly"; DFly's heads are markov|hidden)."""
        return "dspark" if self.conditioning == "dflash" and self.head in MARKOV_HEADS else self.conditioning

    @property
    def has_fc(self) -> bool:
        """Whether the drafter has the context projection W_fc (DFlash's shared context, Eq. 10; DFly, Eq. 12)."""
        return self.conditioning == "dfly" or (self.conditioning == "dflash" and self.context_injection == "shared")

    @property
    def context_taps(self) -> tuple[int, ...]:
        """Same-layer injection: the index into `target_layer_ids` of the tap each draft layer reads
        (`same_layer_taps`); empty for the other conditionings (every layer sees every tap)."""
        if self.context_injection != "same_layer":
            return ()
        return same_layer_taps(self.num_draft_layers, self.num_taps)

    # ----- checks -----
    def _check_context_injection(self) -> None:
        """Raise ConfigError for an unknown `context_injection`, or same-layer injection outside DSpark."""
        if self.context_injection not in CONTEXT_INJECTIONS:
            raise ConfigError(f"unknown context_injection {self.context_injection!r}; choose one of "
                              f"{', '.join(CONTEXT_INJECTIONS)}")
        if not isinstance(self.fc_bias, bool):
            raise ConfigError(f"fc_bias must be true or false, got {self.fc_bias!r}")
        if self.context_injection == "same_layer" and (self.conditioning != "dflash" or self.head not in MARKOV_HEADS):
            raise ConfigError(f"context_injection=same_layer is DSpark's backbone (the dflash conditioning with a "
                              f"Markov-family head: {', '.join(MARKOV_HEADS)}); this drafter has the "
                              f"{self.conditioning} conditioning and the {self.head!r} head. DFlash shares one "
                              f"fused context (Eq. 10) and DFlare / DFly fuse the taps per layer (Eq. 11-12): pass "
                              f"context_injection=shared, or head=markov with the dflash conditioning")

    def check_mask_token(self, num_tokens: int) -> None:
        """Raise ConfigError unless `mask_token_id` is an id of a vocabulary (or tokenizer) of `num_tokens`."""
        if self.mask_token_id is None or not 0 <= self.mask_token_id < num_tokens:
            raise ConfigError(f"mask token id {self.mask_token_id} is not in the vocabulary (ids 0..{num_tokens - 1})"
                              ": pick a reserved special token of the target's tokenizer")

    # ----- construction / serialisation -----
    @classmethod
    def for_target(cls, target: DecoderConfig, *, mask_token_id: int | None, num_draft_layers: int = 5,
                   target_layer_ids: Sequence[int] | None = None, num_taps: int | None = None,
                   conditioning: str = "dfly", head: str = "hidden", shape: DraftShape | None = None,
                   context_injection: str | None = None, fc_bias: bool | None = None,
                   **design: Any) -> BlockDrafterConfig:
        """A new drafter for `target`: draft-layer shapes default to the target's (`shape`: the overrides), taps to
        `default_block_layer_ids` with `num_taps` (default: one per draft layer, at most the target's layer count).
        `context_injection` None
        = "same_layer" for a DSpark (the dflash conditioning with a Markov-family head, Uraion §3.3), else "shared";
        `fc_bias` None = a bias only for DFly (Eq. 12): the DFlash backbone's fc is built without one, as vLLM's
        DFlash / DSpark fc has none (`export.vllm`). The draft layers are Qwen3 layers (q/k norm) whatever the target
        (a Llama target's layers have none): vLLM's DFlash-based classes, which serve every block drafter (DFlash,
        DSpark, and DFlare / DFly through the angelspec[vllm] plugin), build Qwen3 draft layers. A Qwen3 target's
        layer is that layer already. `design` takes the
        remaining fields (head_intermediate_size, fusion_prior_temperature, confidence_target,
        confidence_temperatures, anchor_fusion), and block_size, markov_rank and confidence_head, whose defaults are
        the class's."""
        if target_layer_ids is None:
            taps = num_taps or min(num_draft_layers, target.num_hidden_layers)
            target_layer_ids = default_block_layer_ids(target.num_hidden_layers, taps)
        layers = cls.target_shape(target, shape)
        layers.update(model_type="qwen3", qk_norm=True)  # a Qwen3 draft layer for every target (docstring)
        if context_injection is None:
            context_injection = "same_layer" if conditioning == "dflash" and head in MARKOV_HEADS else "shared"
        return cls(
            target_layer_ids=tuple(target_layer_ids), mask_token_id=mask_token_id, num_draft_layers=num_draft_layers,
            conditioning=conditioning, head=head, context_injection=context_injection,
            fc_bias=conditioning == "dfly" if fc_bias is None else fc_bias, **layers, **design,
        )
