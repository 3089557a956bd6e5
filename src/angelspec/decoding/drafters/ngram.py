"""N-gram prompt lookup: propose the tokens that followed the most recent earlier occurrence of the row's
trailing n-gram in its own committed history (prompt + output). No model, no training, deterministic.

Matching is host-side and incremental: each row keeps, per n, a dict from n-gram to the position right
after its most recent occurrence, updated as tokens are committed. A step costs O(new tokens x n) dict
writes plus one lookup per n, independent of history length. Longer n-grams are tried first.

When the continuation runs into the end of the history (a repeating pattern), the proposal continues the
pattern with itself: future[L + m] := future[j + m], which predicts loops of any period.

Shape legend: B rows, K draft depth.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from angelspec.decoding.drafters.base import Commit, Drafter, DraftState, Proposal, register_drafter


@register_drafter("ngram")
class NGramDrafter(Drafter):
    """Prompt-lookup drafter. Confidences are 1.0 for matched positions and 0.0 for padding;
    `Proposal.lengths` = matched length (0 when no n-gram matches), so unmatched rows verify nothing."""

    context_from_commits = True

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got min_ngram={min_ngram}, max_ngram={max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self._device = torch.device("cpu")
        self._hist: list[list[int]] = []
        self._index: list[dict[tuple[int, ...], int]] = []  # per row; keys of every n share one dict

    def allocate(self, batch_size: int, max_len: int, *, device: torch.device, slack: int) -> None:
        self._device = device
        self._hist = [[] for _ in range(batch_size)]
        self._index = [{} for _ in range(batch_size)]

    def prefill(self, rows: Sequence[int], prompts: Sequence[Sequence[int]], first_tokens: Sequence[int],
                target_hidden: tuple[Tensor, ...]) -> None:
        for r, prompt, first in zip(rows, prompts, first_tokens, strict=True):
            self._hist[r], self._index[r] = [], {}
            self._extend(r, [*prompt, first])

    def _extend(self, r: int, tokens: Sequence[int]) -> None:
        h, index = self._hist[r], self._index[r]
        lo, hi = self.min_ngram, self.max_ngram
        for t in tokens:
            i = len(h)  # position of t: every n-gram ending at i-1 is now followed by position i
            h.append(t)
            for n in range(lo, min(hi, i) + 1):
                index[tuple(h[i - n: i])] = i

    def lookup(self, r: int, k: int) -> list[int]:
        """Up to k drafts for row r ([] when nothing matches)."""
        return self.match(r, k)[1]

    def match(self, r: int, k: int) -> tuple[int, list[int]]:
        """(n, drafts): the longest n-gram of row r's history tail that occurred before (0 when none) and the k
        tokens that followed its most recent occurrence ([] when none). A longer match is usually a surer draft."""
        h, index = self._hist[r], self._index[r]
        length = len(h)
        for n in range(min(self.max_ngram, length), self.min_ngram - 1, -1):
            j = index.get(tuple(h[length - n:]))
            if j is not None:
                out: list[int] = []
                for m in range(k):
                    out.append(h[j + m] if j + m < length else out[j + m - length])
                return n, out
        return 0, []

    def propose(self, state: DraftState) -> Proposal:
        k, b = state.num_draft_tokens, state.seq_lens.shape[0]
        tokens = [[0] * k for _ in range(b)]
        lengths = [0] * b
        for r in state.active_rows:
            found = self.lookup(r, k)
            tokens[r][: len(found)] = found
            lengths[r] = len(found)
        tok = torch.tensor(tokens, dtype=torch.int64, device=self._device).view(b, k)  # [B, K]
        lens = torch.tensor(lengths, dtype=torch.int64, device=self._device)  # [B]
        conf = (torch.arange(k, device=self._device) < lens[:, None]).float()  # [B, K]
        return Proposal(tokens=tok, confidences=conf, lengths=lens, deterministic=True)

    def on_commit(self, commit: Commit) -> None:
        for r, toks in enumerate(commit.host_tokens):
            if toks:
                self._extend(r, toks)

    def reset_rows(self, rows: Sequence[int]) -> None:
        for r in rows:
            self._hist[r], self._index[r] = [], {}


def reference_lookup(history: Sequence[int], k: int, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
    """Slow twin of `NGramDrafter.lookup`: scan the history backwards for the latest earlier occurrence."""
    h = list(history)
    length = len(h)
    for n in range(min(max_ngram, length), min_ngram - 1, -1):
        suffix = h[length - n:]
        for start in range(length - n - 1, -1, -1):  # occurrences that have a following token
            if h[start: start + n] == suffix:
                future = h[:]
                j = start + n
                while len(future) < length + k:
                    future.append(future[j + len(future) - length])
                return future[length: length + k]
    return []
