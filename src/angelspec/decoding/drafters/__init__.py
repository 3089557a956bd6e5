"""Drafters, one module per family, and the table of families (`families.py`): `get_drafter("ngram")`,
`get_drafter("draft-lm")`, `get_drafter("mtp")`, `get_drafter("eagle3")`, and the block-parallel
`get_drafter("dflash" | "dflare" | "dfly" | "dspark")` are the engine adapters of those records. A new family is one
module here and one `DrafterFamily` record in `families.py`."""

from angelspec.decoding.drafters.base import Drafter
from angelspec.decoding.drafters.block import (
    BlockDrafterAdapter,
    DFlareDrafter,
    DFlashDrafter,
    DFlyDrafter,
    DSparkDrafter,
)
from angelspec.decoding.drafters.draft_lm import DraftLMDrafter
from angelspec.decoding.drafters.eagle3 import Eagle3Drafter
from angelspec.decoding.drafters.families import DrafterFamily, families, family_of, get_family, register_family
from angelspec.decoding.drafters.mtp import MTPDrafter
from angelspec.decoding.drafters.ngram import NGramDrafter


def get_drafter(name: str) -> type[Drafter]:
    """The engine adapter of the family registered as `name`."""
    return get_family(name).drafter


def registered_drafters() -> tuple[str, ...]:
    return tuple(f.name for f in families())


__all__ = ["BlockDrafterAdapter", "DFlareDrafter", "DFlashDrafter", "DFlyDrafter", "DSparkDrafter", "DraftLMDrafter",
           "Drafter", "DrafterFamily", "Eagle3Drafter", "MTPDrafter", "NGramDrafter", "families", "family_of",
           "get_drafter", "get_family", "register_family", "registered_drafters"]
