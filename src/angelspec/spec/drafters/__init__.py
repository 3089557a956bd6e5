"""Baseline drafters; importing this package registers them (`get_drafter("ngram")`, `get_drafter("draft-lm")`)."""

from angelspec.spec.drafters.draft_lm import DraftLMDrafter
from angelspec.spec.drafters.ngram import NGramDrafter

__all__ = ["DraftLMDrafter", "NGramDrafter"]
