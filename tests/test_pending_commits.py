"""`PendingCommits` folds a long run of waiting commits into one entry (a stretch the speculation gate kept drafting
off): what `take` returns is the same as without folding, rows dropped on the way included."""

from __future__ import annotations

import torch

from angelspec.decoding.drafters.base import PendingCommits


def _fill(pending: PendingCommits, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    b = 3
    for step in range(100):
        width = 1 if step % 7 else 3  # mostly skipped steps (one position), now and then a verify of 2 drafts
        taps = torch.randn(b, width, 4, generator=gen)
        count = torch.randint(0, width + 1, (b,), generator=gen)
        if step == 50:  # every row takes a new request: what its old one left waiting is dropped, then its prompt
            pending.drop_rows(torch.arange(b))
        pending.add((taps, taps[..., :2] * 2), count, starts=step == 50)
        if step == 60:
            pending.drop_rows(torch.tensor([1]))


def _rows(taken: tuple[tuple[torch.Tensor, ...], torch.Tensor]) -> list[list[torch.Tensor]]:
    """Each row's new entries (the rest is padding), per tensor."""
    tensors, counts = taken
    return [[t[r, : int(counts[r])] for t in tensors] for r in range(counts.shape[0])]


def test_folded_waiting_commits_take_the_same_entries():
    folded, plain = PendingCommits(), PendingCommits()
    plain.fold_at = 10**9
    _fill(folded, 0)
    _fill(plain, 0)
    assert len(folded) < folded.fold_at and len(plain) == 100
    a, b = folded.take(), plain.take()
    assert a is not None and b is not None
    assert torch.equal(a[1], b[1])
    for row_a, row_b in zip(_rows(a), _rows(b), strict=True):
        for x, y in zip(row_a, row_b, strict=True):
            assert torch.equal(x, y)
    assert folded.take() is None
