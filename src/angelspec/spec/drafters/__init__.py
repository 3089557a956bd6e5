"""Drafters; importing this package registers them (`get_drafter("ngram")`, `get_drafter("draft-lm")`,
`get_drafter("mtp")`, `get_drafter("eagle3")`)."""

from angelspec.spec.drafters.draft_lm import DraftLMDrafter
from angelspec.spec.drafters.eagle3 import Eagle3Drafter
from angelspec.spec.drafters.mtp import MTPDrafter
from angelspec.spec.drafters.ngram import NGramDrafter

__all__ = ["DraftLMDrafter", "Eagle3Drafter", "MTPDrafter", "NGramDrafter"]
