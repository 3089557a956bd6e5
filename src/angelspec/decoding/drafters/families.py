"""The drafter families, one typed record each: the one table the engine, the loaders, the cost profiler and the
commands look a family up in (`get_family("dfly")`).

A record holds what the decoding layer knows of a family: its engine adapter (a `Drafter` subclass), the pure
PyTorch model class in `models/` behind it, whether it is a block-parallel drafter, the export formats that can write
it, and the depth it drafts when its folder records none. Its trainer and presets extend the record one layer up
(`angelspec.train.registry`), since a trainer sits above decoding.

A new family is one module in this package and one record below (or `register_family` for a family defined
outside the package).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from angelspec.decoding.drafters.base import Drafter
from angelspec.decoding.drafters.block import DFlareDrafter, DFlashDrafter, DFlyDrafter, DSparkDrafter
from angelspec.decoding.drafters.draft_lm import DraftLMDrafter
from angelspec.decoding.drafters.eagle3 import Eagle3Drafter
from angelspec.decoding.drafters.mtp import MTPDrafter
from angelspec.decoding.drafters.ngram import NGramDrafter
from angelspec.models.block.drafter import BlockDrafter
from angelspec.models.decoder import Decoder
from angelspec.models.eagle3 import Eagle3DraftModel
from angelspec.models.mtp import MTPDraftModel

DEFAULT_NUM_DRAFT_TOKENS = 4  # K for drafters without a trained depth (n-gram lookup, the draft LM)

# A saved family's loader: (folder, target, dtype) -> the drafter, on the target's device.
Loader = Callable[[Path, Decoder, torch.dtype], Drafter]


def on_target(cls: type) -> Loader:
    """The loader of a family that shares the target's embedding and LM head (`from_pretrained(DIR, target=...)`):
    its weights take the target's device and dtype."""
    return lambda path, target, dtype: cls.from_pretrained(path, target=target)


def own_weights(cls: type) -> Loader:
    """The loader of a family with weights of its own (a draft LM): read in `dtype` onto the target's device."""
    return lambda path, target, dtype: cls.from_pretrained(path, dtype=dtype, device=target.embed_tokens.weight.device)


@dataclass(frozen=True)
class DrafterFamily:
    """One drafter family.

    name: the kind `--drafter KIND:DIR` names and a saved folder records (`"angelspec": {"drafter": KIND}`).
    drafter: the engine adapter (`Drafter` subclass).
    model: the pure PyTorch model in `models/` the adapter drives (None: a lookup with no weights).
    load: how a saved folder becomes a drafter (`on_target`, `own_weights`); None: the family has no saved form
        and is built from settings (`ngram[:N]`).
    block: a block-parallel drafter (one forward drafts the whole block; the kinds that take a `--head`).
    exports: the `angelspec export --format` values that can write this family.
    default_depth: K when neither the command nor the drafter names one; a drafter with a trained depth
        (`Drafter.trained_depth`: a block drafter's block size - 1, an MTP / EAGLE-3 model's depth count) drafts
        that instead.
    """

    name: str
    drafter: type[Drafter]
    model: type[nn.Module] | None
    load: Loader | None = None
    block: bool = False
    exports: tuple[str, ...] = ()
    default_depth: int = DEFAULT_NUM_DRAFT_TOKENS

    def __post_init__(self) -> None:
        if not (isinstance(self.drafter, type) and issubclass(self.drafter, Drafter)):
            raise TypeError(f"drafter family {self.name!r} needs a Drafter subclass, got {self.drafter!r}")

    @property
    def saved(self) -> bool:
        """The family's drafters are folders (`KIND:DIR`)."""
        return self.load is not None


def _block(name: str, drafter: type[Drafter], exports: tuple[str, ...] = ("vllm",)) -> DrafterFamily:
    return DrafterFamily(name, drafter, BlockDrafter, on_target(drafter), block=True, exports=exports)


_FAMILIES: dict[str, DrafterFamily] = {f.name: f for f in (
    DrafterFamily("ngram", NGramDrafter, None),
    DrafterFamily("draft-lm", DraftLMDrafter, Decoder, own_weights(DraftLMDrafter), exports=("vllm", "sglang")),
    DrafterFamily("mtp", MTPDrafter, MTPDraftModel, on_target(MTPDrafter), exports=("vllm",)),
    DrafterFamily("eagle3", Eagle3Drafter, Eagle3DraftModel, on_target(Eagle3Drafter), exports=("vllm",)),
    _block("dflash", DFlashDrafter, exports=("vllm", "sglang")),
    _block("dflare", DFlareDrafter),
    _block("dfly", DFlyDrafter),
    _block("dspark", DSparkDrafter),
)}


def register_family(family: DrafterFamily) -> DrafterFamily:
    """Add a family defined outside this package; a name is one family."""
    if not isinstance(family, DrafterFamily):
        raise TypeError(f"register_family expects a DrafterFamily, got {family!r}")
    known = _FAMILIES.get(family.name)
    if known is not None and known != family:
        raise ValueError(f"drafter name {family.name!r} is already registered to {known.drafter.__name__}")
    _FAMILIES[family.name] = family
    return family


def get_family(name: str) -> DrafterFamily:
    """The family registered as `name`."""
    if name not in _FAMILIES:
        raise KeyError(f"unknown drafter {name!r}; registered: {', '.join(sorted(_FAMILIES)) or 'none'}")
    return _FAMILIES[name]


def families() -> tuple[DrafterFamily, ...]:
    """Every registered family, by name."""
    return tuple(_FAMILIES[n] for n in sorted(_FAMILIES))


def family_of(drafter: Drafter) -> DrafterFamily | None:
    """The family whose adapter `drafter` is (exactly that class, not a subclass), None for any other drafter."""
    return next((f for f in _FAMILIES.values() if f.drafter is type(drafter)), None)
