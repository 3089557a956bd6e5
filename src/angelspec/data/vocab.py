"""Draft vocabularies: the target tokens a drafter may propose, chosen by how often the drafter's training data
uses them (EAGLE-3's reduced draft vocabulary, applied to the block drafters' LM-head calls)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from angelspec.data.packing import Doc


def count_tokens(input_ids: torch.Tensor, loss_mask: torch.Tensor | None, vocab_size: int) -> torch.Tensor:
    """How often each target id is a trained-on token of input_ids [...] (loss_mask [...] True; every token
    without a mask) -> [V] int64."""
    ids = torch.as_tensor(input_ids, dtype=torch.int64)
    if loss_mask is not None:
        ids = ids[torch.as_tensor(loss_mask, dtype=torch.bool)]
    ids = ids.flatten()
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise ValueError(f"token ids outside the target vocabulary [0, {vocab_size}): is this data tokenized for "
                         "another model?")
    return torch.bincount(ids, minlength=vocab_size)


def token_counts(docs: Iterable[Doc], vocab_size: int) -> torch.Tensor:
    """`count_tokens` summed over documents -> [V] int64."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for doc in docs:
        counts += count_tokens(torch.as_tensor(doc.input_ids), None if doc.loss_mask is None
                               else torch.as_tensor(doc.loss_mask), vocab_size)
    return counts


def frequent_tokens(counts: torch.Tensor, size: int, always: Sequence[int] = ()) -> torch.Tensor:
    """The `size` most frequent ids of counts [V] (ties: the lower id), with every id of `always` (e.g. the end-of-
    turn tokens, so a draft can end an answer) taking the place of the least frequent ones -> [size] int64,
    most frequent first."""
    vocab_size = counts.shape[0]
    if not 0 < size <= vocab_size:
        raise ValueError(f"a draft vocabulary size must be in [1, {vocab_size}], got {size}")
    forced = list(dict.fromkeys(int(t) for t in always if 0 <= int(t) < vocab_size))
    if len(forced) > size:
        raise ValueError(f"{len(forced)} tokens must always be draftable, more than the draft vocabulary of {size}")
    # Stable sort on -count keeps ids ascending among equal counts.
    order = torch.sort(-counts.to(torch.int64), stable=True).indices
    forced_set = set(forced)
    rest = [int(t) for t in order[: size + len(forced)] if int(t) not in forced_set][: size - len(forced)]
    chosen = torch.tensor(rest + forced, dtype=torch.int64)
    return chosen[torch.sort(-counts[chosen], stable=True).indices]


def coverage(counts: torch.Tensor, token_ids: torch.Tensor) -> float:
    """Share of the counted tokens that `token_ids` covers (the upper bound on how often the target's choice
    can be drafted at all)."""
    total = int(counts.sum())
    return float(counts[token_ids].sum()) / total if total else 0.0
