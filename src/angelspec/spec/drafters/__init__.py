"""Drafters; importing this package registers them (`get_drafter("ngram")`, `get_drafter("draft-lm")`,
`get_drafter("mtp")`, `get_drafter("eagle3")`, and the block-parallel `get_drafter("dflash" | "dflare" | "dfly" |
"dspark")`)."""

from angelspec.spec.drafters.block import (
    BlockDrafterAdapter,
    DFlareDrafter,
    DFlashDrafter,
    DFlyDrafter,
    DSparkDrafter,
)
from angelspec.spec.drafters.draft_lm import DraftLMDrafter
from angelspec.spec.drafters.eagle3 import Eagle3Drafter
from angelspec.spec.drafters.mtp import MTPDrafter
from angelspec.spec.drafters.ngram import NGramDrafter

__all__ = ["BlockDrafterAdapter", "DFlareDrafter", "DFlashDrafter", "DFlyDrafter", "DSparkDrafter", "DraftLMDrafter",
           "Eagle3Drafter", "MTPDrafter", "NGramDrafter"]
