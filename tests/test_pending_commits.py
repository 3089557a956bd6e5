"""`PendingCommits` keeps what skipped rounds committed until the next drafted round: whatever the mix of commits,
dropped rows and takes, `take` returns each row's new entries in commit order, with the exact joined width when the
callers give the counts on the host, and one write per commit however long drafting stays off."""

from __future__ import annotations

import pytest
import torch

from angelspec.decoding.drafters.base import PendingCommits


def _rows(taken: tuple[tuple[torch.Tensor, ...], torch.Tensor]) -> list[list[torch.Tensor]]:
    """Each row's new entries (the rest is padding), per tensor."""
    tensors, counts = taken
    return [[t[r, : int(counts[r])] for t in tensors] for r in range(counts.shape[0])]


@pytest.mark.parametrize("host_counts", [True, False], ids=["host-counts", "bound"])
def test_take_returns_each_rows_entries_in_commit_order_through_drops_and_takes(host_counts):
    gen = torch.Generator().manual_seed(0)
    b = 3
    pending = PendingCommits()
    expected: list[list[torch.Tensor]] = [[] for _ in range(b)]  # per row, the waiting entries of the first tensor
    for step in range(300):
        width = 1 if step % 7 else 3  # mostly skipped steps (one position), now and then a verify of 2 drafts
        if step % 53 == 20:  # a prompt joins row 1 (its request's waiting entries are dropped first)
            width = 9
        taps = torch.randn(b, width, 4, generator=gen)
        count = torch.randint(0, width + 1, (b,), generator=gen)
        if width == 9:
            pending.drop_rows([1])
            expected[1] = []
            count = torch.tensor([0, 6, 0])
        pending.add((taps, taps[..., :2] * 2), count, count.tolist() if host_counts else None)
        for r in range(b):
            expected[r].extend(taps[r, : int(count[r])])
        if step % 41 == 40:
            pending.drop_rows([0, 2])
            expected[0], expected[2] = [], []
        if step % 97 == 96 or step == 299:  # a drafted round catches up
            taken = pending.take()
            assert taken is not None and not pending and pending.take() is None
            (feats, halves), counts = taken
            assert counts.tolist() == [len(e) for e in expected]
            if host_counts:
                assert feats.shape[1] == max(2, *counts.tolist())  # the longest row's entries, no more
            for r, (got, half) in enumerate(_rows(taken)):
                want = torch.stack(expected[r]) if expected[r] else torch.zeros(0, 4)
                assert torch.equal(got, want) and torch.equal(half, want[..., :2] * 2)
            expected = [[] for _ in range(b)]


def test_a_long_stretch_of_skipped_rounds_writes_each_commit_once():
    """Drafting off for many steps: each commit is one scatter into a buffer that grows by doubling, never a re-join
    of everything that waits (which made every 32nd skipped step cost a copy of the whole backlog)."""
    pending, b = PendingCommits(), 4
    one = torch.ones(b, dtype=torch.int64)
    calls = {"cat": 0}
    real_cat = torch.cat

    def counting_cat(*args, **kwargs):
        calls["cat"] += 1
        return real_cat(*args, **kwargs)

    torch.cat = counting_cat
    try:
        for step in range(500):
            pending.add((torch.full((b, 1, 8), float(step)),), one, [1] * b)
    finally:
        torch.cat = real_cat
    assert calls["cat"] == 0
    (feats,), counts = pending.take()
    assert counts.tolist() == [500] * b and feats.shape == (b, 500, 8)
    assert torch.equal(feats[:, :, 0], torch.arange(500.0).expand(b, -1))


def test_wrong_host_counts_are_refused():
    pending = PendingCommits()
    with pytest.raises(ValueError, match="host_count"):
        pending.add((torch.zeros(2, 1, 3),), torch.ones(2, dtype=torch.int64), [1, 2])
