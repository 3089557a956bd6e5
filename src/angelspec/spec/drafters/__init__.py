"""Drafters; importing this package registers them (`get_drafter("ngram")`, `get_drafter("draft-lm")`,
`get_drafter("mtp")`)."""

from angelspec.spec.drafters.draft_lm import DraftLMDrafter
from angelspec.spec.drafters.mtp import MTPDrafter
from angelspec.spec.drafters.ngram import NGramDrafter

__all__ = ["DraftLMDrafter", "MTPDrafter", "NGramDrafter"]
