"""Target decoder configuration and its mapping to/from a Hugging Face `config.json`, and the base of every
drafter's config.

One frozen dataclass describes every supported family (Qwen3, Qwen2, Llama, Mistral without sliding
window); the differences are flags (`qk_norm`, `qkv_bias`, `o_bias`, `mlp_bias`), not subclasses.

`LayerShape` holds the decoder-layer shape fields once: `DecoderConfig` (the target) and `DraftModelConfig` (the
base of the MTP-family and block-drafter configs, whose draft layers take the target's shape by default) both
extend it, and a drafter's `layer_config()` is the `DecoderConfig` of its draft layers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any, ClassVar, Self

import torch

# HF `architectures` entry -> (model_type, qk_norm, qkv_bias default, o_bias follows attention_bias)
_FAMILIES: dict[str, str] = {
    "Qwen3ForCausalLM": "qwen3",
    "Qwen2ForCausalLM": "qwen2",
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
}
_MODEL_TYPE_TO_ARCH = {v: k for k, v in _FAMILIES.items()}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


class ConfigError(ValueError):
    """A checkpoint config that AngelSpec cannot run, with a message that names the fix."""


def check_tap_ids(layer_ids: Sequence[int], num_layers: int, owner: str) -> None:
    """Raise ConfigError unless every hidden-state tap id of `owner` names a layer of a `num_layers`-layer target."""
    bad = [i for i in layer_ids if not 0 <= i < num_layers]
    if bad:
        raise ConfigError(f"{owner} target layer ids {list(layer_ids)} do not fit a target with {num_layers} layers: "
                          f"ids are 0..{num_layers - 1} (id i = output of decoder layer i); {bad} out of range")


@dataclass(frozen=True, kw_only=True)
class LayerShape:
    """The shape of a stack of decoder layers (plain RoPE): what `DecoderConfig` and every drafter config share."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    model_type: str = "qwen3"
    qk_norm: bool = True

    def layer_shape(self) -> dict[str, Any]:
        """The `LayerShape` fields of this config, by name."""
        return {f.name: getattr(self, f.name) for f in fields(LayerShape)}


@dataclass(frozen=True)
class DraftShape:
    """The draft layers' attention and MLP shape where a drafter's differs from its target's (None: the target's),
    as a trainer's config names it (`DrafterRunConfig.layer_shape`) and the models' `for_target` take it."""

    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    intermediate_size: int | None = None


@dataclass(frozen=True, kw_only=True)
class DecoderConfig(LayerShape):
    """Shape and family flags of a decoder-only target.

    `rope_scaling` is the HF rope dict minus `rope_theta` (None for plain RoPE).
    """

    num_hidden_layers: int
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = True
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        positive = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"config field {name!r} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads}) for grouped-query attention"
            )
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.model_type not in _MODEL_TYPE_TO_ARCH:
            raise ConfigError(f"unknown model_type {self.model_type!r}; supported: {sorted(_MODEL_TYPE_TO_ARCH)}")
        rope_type = self.rope_type
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ConfigError(
                f"rope type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)}); "
                "convert the checkpoint's rope_scaling or open an issue"
            )
        if rope_type != "default" and "factor" not in (self.rope_scaling or {}):
            raise ConfigError(f"rope_scaling of type {rope_type!r} needs a 'factor' entry")

    # ----- derived values -----
    @property
    def rope_type(self) -> str:
        if not self.rope_scaling:
            return "default"
        return str(self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default")))

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        if self.eos_token_id is None:
            return ()
        if isinstance(self.eos_token_id, int):
            return (self.eos_token_id,)
        return tuple(int(t) for t in self.eos_token_id)

    @property
    def architecture(self) -> str:
        return _MODEL_TYPE_TO_ARCH[self.model_type]

    def num_parameters(self) -> int:
        d, f, hq, hkv, dh = (self.hidden_size, self.intermediate_size, self.num_attention_heads,
                             self.num_key_value_heads, self.head_dim)
        attn = d * dh * (hq + 2 * hkv) + hq * dh * d
        per_layer = attn + 3 * d * f + 2 * d + (2 * dh if self.qk_norm else 0)
        emb = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
        return self.num_hidden_layers * per_layer + emb + d

    # ----- HF interop -----
    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> DecoderConfig:
        """Build from a HF `config.json` dict (transformers 4.x `rope_theta`/`rope_scaling` or 5.x
        `rope_parameters` spelling)."""
        archs = cfg.get("architectures") or []
        model_type = cfg.get("model_type")
        if archs and archs[0] in _FAMILIES:
            model_type = _FAMILIES[archs[0]]
        if model_type not in _MODEL_TYPE_TO_ARCH:
            raise ConfigError(
                f"unknown architecture {archs or model_type!r}: AngelSpec targets support "
                f"{', '.join(_FAMILIES)}; check the checkpoint's config.json"
            )
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
            if key not in cfg:
                raise ConfigError(f"config.json is missing {key!r}; is this a causal-LM checkpoint?")
        if cfg.get("use_sliding_window") or (model_type == "mistral" and cfg.get("sliding_window")):
            raise ConfigError("sliding-window attention is not supported yet; set use_sliding_window=false "
                              "only if the model was trained without it")
        rope_params = dict(cfg.get("rope_parameters") or {})
        rope_theta = float(cfg.get("rope_theta", rope_params.pop("rope_theta", 10000.0)))
        rope_params.pop("rope_theta", None)
        rope_scaling = cfg.get("rope_scaling") or rope_params or None
        if rope_scaling is not None:
            rope_scaling = dict(rope_scaling)
            rope_scaling.pop("rope_theta", None)
            if rope_scaling.get("rope_type", rope_scaling.get("type", "default")) == "default":
                rope_scaling = None
        heads = int(cfg["num_attention_heads"])
        attention_bias = bool(cfg.get("attention_bias", False))
        return cls(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            model_type=model_type,
            qk_norm=model_type == "qwen3",
            # Qwen2 always has q/k/v bias and no o bias; Llama/Qwen3 use attention_bias for all four.
            qkv_bias=True if model_type == "qwen2" else attention_bias,
            o_bias=False if model_type == "qwen2" else attention_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", model_type != "llama")),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=cfg.get("eos_token_id"),
            pad_token_id=cfg.get("pad_token_id"),
        )

    def to_hf_dict(self, torch_dtype: str = "float32") -> dict[str, Any]:
        """A `config.json` that both transformers 4.x and 5.x read."""
        rope_parameters = {"rope_type": "default", **(self.rope_scaling or {}), "rope_theta": self.rope_theta}
        out: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "rope_parameters": rope_parameters,
            "hidden_act": "silu",
            "attention_bias": self.qkv_bias if self.model_type != "qwen2" else False,
            "attention_dropout": 0.0,
            "mlp_bias": self.mlp_bias,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "torch_dtype": torch_dtype,
            "dtype": torch_dtype,
            "use_cache": True,
        }
        if self.model_type in ("qwen3", "qwen2"):
            out["use_sliding_window"] = False
            out["sliding_window"] = None
            out["max_window_layers"] = self.num_hidden_layers
        if self.model_type == "mistral":
            out["sliding_window"] = None
        return out

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def fingerprint(self) -> str:
        """A short stable hash of the shape-defining fields, used to tie drafters to their target."""
        import hashlib
        import json

        keys = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "model_type")
        blob = json.dumps({k: getattr(self, k) for k in keys}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


@dataclass(frozen=True, kw_only=True)
class DraftModelConfig(LayerShape):
    """The base of every drafter's config (MTP family, block drafters): the draft layers' shape (`LayerShape`;
    `hidden_size` and `vocab_size` equal the target's, the attention and MLP shape default to it) and the target
    it was built for. A subclass says which target taps feed it (`target_layer_ids`, id i = output of target
    decoder layer i), which drafter kind it is (`drafter`) and how many draft layers it has (`num_draft_layers`)."""

    noun: ClassVar[str]  # what messages call this kind of config ("mtp drafter", "block drafter", ...)
    drafter: ClassVar[str]  # the registry name written to config.json's "angelspec" entry (a subclass may compute it)
    # Each subclass provides `target_layer_ids: tuple[int, ...]` (a field or a property) and `num_draft_layers`
    # (a field or a class constant); they are not declared here so that a subclass may make them dataclass fields.
    target_layer_ids: ClassVar[tuple[int, ...]]
    num_draft_layers: ClassVar[int]

    target_fingerprint: str
    target_num_layers: int
    draft_vocab_size: int = 0  # inference drafts only from the N most frequent target tokens (0: the whole vocab)

    @staticmethod
    def target_shape(target: DecoderConfig, shape: DraftShape | None = None) -> dict[str, Any]:
        """The shape and target fields of a drafter for `target`: attention / MLP shape default to the target's
        (`shape`: the overrides)."""
        shape = DraftShape() if shape is None else shape
        return {**target.layer_shape(), "target_fingerprint": target.fingerprint(),
                "target_num_layers": target.num_hidden_layers,
                "num_attention_heads": shape.num_attention_heads or target.num_attention_heads,
                "num_key_value_heads": shape.num_key_value_heads or target.num_key_value_heads,
                "head_dim": shape.head_dim or target.head_dim,
                "intermediate_size": shape.intermediate_size or target.intermediate_size}

    def layer_config(self) -> DecoderConfig:
        """The `DecoderConfig` the draft layers and their KV cache are built from: this shape with
        `num_draft_layers` layers (plain RoPE)."""
        return DecoderConfig(**self.layer_shape(), num_hidden_layers=self.num_draft_layers)

    def check_layer_ids(self, num_layers: int) -> None:
        """Raise ConfigError unless every tap id names a layer of a target with `num_layers` layers."""
        check_tap_ids(self.target_layer_ids, num_layers, self.noun)

    def check_target(self, target: DecoderConfig) -> None:
        """Raise ConfigError when `target` is not the model this drafter was built for. The tap ids are checked
        first: a target too shallow for them gets that error, not a fingerprint one."""
        self.check_layer_ids(target.num_hidden_layers)
        if target.fingerprint() != self.target_fingerprint:
            raise ConfigError(f"{self.drafter} drafter was built for a target with fingerprint "
                              f"{self.target_fingerprint}, but this target's is {target.fingerprint()}: train or pick "
                              f"a {self.drafter} drafter for it")
        if (target.vocab_size, target.hidden_size) != (self.vocab_size, self.hidden_size):
            raise ConfigError(f"{self.drafter} drafter expects vocab {self.vocab_size} / hidden {self.hidden_size}, "
                              f"the target has {target.vocab_size} / {target.hidden_size}")

    def to_dict(self) -> dict[str, Any]:
        """The config.json entry (tuples as lists)."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Self:
        unknown = sorted(set(raw) - {f.name for f in fields(cls)})
        if unknown:
            raise ConfigError(f"unknown {cls.noun} config fields {unknown}; is this a {cls.noun} folder?")
        return cls(**raw)


def rope_inv_freq(cfg: DecoderConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim/2] (fp32) for RoPE and the cos/sin attention factor.

    Follows the published definitions: linear position interpolation, Llama-3.1 wavelength-banded
    scaling, and YaRN (NTK-by-parts ramp plus 0.1·ln(s)+1 attention temperature). Computed in fp32
    the same way the reference implementation does, so long positions round identically.
    """
    dim = cfg.head_dim
    base = cfg.rope_theta
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    rope_type = cfg.rope_type
    rs = cfg.rope_scaling or {}
    if rope_type == "default":
        return inv, 1.0
    factor = float(rs["factor"])
    if rope_type == "linear":
        return inv / factor, 1.0
    if rope_type == "llama3":
        low_ff = float(rs.get("low_freq_factor", 1.0))
        high_ff = float(rs.get("high_freq_factor", 4.0))
        old_ctx = float(rs.get("original_max_position_embeddings", 8192))
        low_wl, high_wl = old_ctx / low_ff, old_ctx / high_ff
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wl, inv / factor, inv)
        smooth = (old_ctx / wavelen - low_ff) / (high_ff - low_ff)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_wl) & ~(wavelen > low_wl)
        return torch.where(is_medium, smoothed, scaled), 1.0
    # yarn
    orig = float(rs.get("original_max_position_embeddings") or cfg.max_position_embeddings / factor)
    attn_factor = rs.get("attention_factor")
    mscale, mscale_all = rs.get("mscale"), rs.get("mscale_all_dim")

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if attn_factor is None:
        attn_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all) if (mscale and mscale_all) \
            else get_mscale(factor)
    beta_fast = float(rs.get("beta_fast") or 32)
    beta_slow = float(rs.get("beta_slow") or 1)

    def corr_dim(rot: float) -> float:
        return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

    low, high = corr_dim(beta_fast), corr_dim(beta_slow)
    if rs.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrap_w = 1 - ramp
    return (inv / factor) * (1 - extrap_w) + inv * extrap_w, float(attn_factor)
