"""Drafters, one module per family; importing this package registers them: `get_drafter("ngram")`,
`get_drafter("draft-lm")`, `get_drafter("mtp")`, `get_drafter("eagle3")`, and the block-parallel
`get_drafter("dflash" | "dflare" | "dfly" | "dspark")`. A new family is one module here that decorates its class
with `@register_drafter(name)`, plus one import line below."""

from angelspec.decoding.drafters.base import _REGISTRY, Drafter, register_drafter
from angelspec.decoding.drafters.block import (
    BlockDrafterAdapter,
    DFlareDrafter,
    DFlashDrafter,
    DFlyDrafter,
    DSparkDrafter,
)
from angelspec.decoding.drafters.draft_lm import DraftLMDrafter
from angelspec.decoding.drafters.eagle3 import Eagle3Drafter
from angelspec.decoding.drafters.mtp import MTPDrafter
from angelspec.decoding.drafters.ngram import NGramDrafter


def get_drafter(name: str) -> type[Drafter]:
    """The drafter class registered as `name`."""
    if name not in _REGISTRY:
        raise KeyError(f"unknown drafter {name!r}; registered: {', '.join(sorted(_REGISTRY)) or 'none'}")
    return _REGISTRY[name]


def registered_drafters() -> tuple[str, ...]:
    return tuple(sorted(_REGISTRY))


__all__ = ["BlockDrafterAdapter", "DFlareDrafter", "DFlashDrafter", "DFlyDrafter", "DSparkDrafter", "DraftLMDrafter",
           "Drafter", "Eagle3Drafter", "MTPDrafter", "NGramDrafter", "get_drafter", "register_drafter",
           "registered_drafters"]
