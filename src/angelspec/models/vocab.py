"""Draft vocabularies at inference: a drafter scores only some target ids (`angelspec draft-vocab`), and a
sampling rule over the target's whole vocabulary must see the rest as impossible."""

from __future__ import annotations

from torch import Tensor


def expand_logits(logits: Tensor, token_ids: Tensor, vocab_size: int) -> Tensor:
    """logits [..., V'] over `token_ids` [V'] -> [..., vocab_size] with −inf at every other id."""
    full = logits.new_full((*logits.shape[:-1], vocab_size), float("-inf"))
    return full.index_copy_(-1, token_ids, logits)
