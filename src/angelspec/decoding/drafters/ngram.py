"""N-gram prompt lookup: propose the tokens that followed the most recent earlier occurrence of the row's
trailing n-gram in its own committed history (prompt + output). No model, no training, deterministic.

Matching is host-side and incremental: each row keeps, per n, a dict from n-gram to the position right
after its most recent occurrence, updated as tokens are committed. A step costs O(new tokens x n) dict
writes plus one lookup per n, independent of history length. Longer n-grams are tried first.

When the continuation runs into the end of the history (a repeating pattern), the proposal continues the
pattern with itself: future[L + m] := future[j + m], which predicts loops of any period.

Confidences are learned while decoding (`MatchAcceptance`): the draft at depth m after an n-token match gets the
share of such drafts the target accepted so far, given that the drafts before it were accepted, over every row of
the drafter. A depth policy (D-cut, Algorithm 1) can then verify the drafts that are likely to pay and skip the
rest: a 1-token match is right far less often than a 3-token one, and at a large batch on a CPU every verified
position costs the target a share of a step.

Shape legend: B rows, K draft depth.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager

import torch
from torch import Tensor

from angelspec.decoding.drafters.base import Commit, Drafter, DraftState, Proposal, switched


class MatchAcceptance:
    """Acceptance of the lookup's drafts by match length n and depth m, counted over every row: `trials[n][m]` drafts
    at depth m after an n-token match were verified with every draft before them accepted, `hits[n][m]` of them were
    accepted. The estimate is (hits + prior) / (trials + prior): it starts at 1.0 (optimistic), so a depth policy
    verifies a kind of draft until it has been seen to fail; the counts of a cell are halved when its trials pass
    `cap`, so the estimate follows the text as it changes (code, then chat)."""

    def __init__(self, max_ngram: int, *, prior: float = 1.0, cap: float = 512.0) -> None:
        self.prior, self.cap = prior, cap
        self.hits: list[list[float]] = [[] for _ in range(max_ngram + 1)]
        self.trials: list[list[float]] = [[] for _ in range(max_ngram + 1)]

    def estimate(self, n: int, k: int) -> list[float]:
        """The acceptance of depths 0..k-1 after an n-token match, each given the depths before it accepted."""
        hits, trials, prior = self.hits[n], self.trials[n], self.prior
        return [(hits[m] + prior) / (trials[m] + prior) if m < len(trials) else 1.0 for m in range(k)]

    def plan(self, matches: Mapping[int, int], num_rows: int, k: int, costs: Sequence[float],
             room: Mapping[int, float] | None = None) -> dict[int, int]:
        """How many drafts each row with a match verifies in one step of `num_rows` rows: `matches` row -> its match
        length n, costs[m] what the step costs verifying m drafts in all (every row's together) against one verifying
        none. The step commits num_rows + sum over rows of the expected accepted drafts, P(the first d accepted) for
        each verified depth d; the plan keeps the drafts with the highest such chances, as many as make the step's
        expected tokens per unit of cost highest, and none where no number of drafts beats a plain step
        (num_rows / costs[0]). A row's drafts are verified in order (its chances fall with depth), at most k and at
        most len(costs) - 1 in all. Since the step is shared, a draft that pays for its row alone may not pay for the
        batch: the fixed part of a verify step slows every row in it.

        `room`: every active row -> how much more its request may be slowed, in plain steps (`LatencyBudget`). A
        step of m drafts costs a row costs[m] / costs[0] - 1 - (its expected accepted drafts) plain steps more than a
        plain step; only plans whose cost to every row stays within its room (or, for a row out of room, that are
        expected to pay for the row itself) are kept, so a row that matches nothing does not wait for the others'
        drafts without end. -> row -> drafts to verify (rows left out: none)."""
        ranked = []  # (-P(first d accepted), d, row)
        for r, n in matches.items():
            alive = 1.0
            for d, p in enumerate(self.estimate(n, k), 1):
                alive *= p
                ranked.append((-alive, d, r))
        ranked.sort()
        tokens, best, best_rate = float(num_rows), 0, num_rows / costs[0]
        # with room: per row, the most the step may cost it (1 + its room + its expected accepted drafts so far)
        limit = {r: 1.0 + max(x, 0.0) for r, x in room.items()} if room is not None else {}
        lowest = min(limit.values(), default=math.inf)
        for m, (neg, _, r) in enumerate(ranked[: len(costs) - 1], 1):
            tokens -= neg
            if r in limit:
                was = limit[r]
                limit[r] = was - neg
                if was == lowest:
                    lowest = min(limit.values())
            if tokens / costs[m] > best_rate and costs[m] / costs[0] <= lowest:
                best, best_rate = m, tokens / costs[m]
        depths: dict[int, int] = {}
        for _, _, r in ranked[:best]:
            depths[r] = depths.get(r, 0) + 1
        return depths

    def observe(self, n: int, verified: int, accepted: int) -> None:
        """A row verified `verified` drafts of an n-token match and the target accepted the first `accepted`."""
        hits, trials = self.hits[n], self.trials[n]
        if len(trials) < verified:
            hits.extend([0.0] * (verified - len(hits)))
            trials.extend([0.0] * (verified - len(trials)))
        for m in range(min(accepted + 1, verified)):  # depth m was tried iff every depth before it was accepted
            trials[m] += 1.0
            if m < accepted:
                hits[m] += 1.0
            if trials[m] > self.cap:
                trials[m] *= 0.5
                hits[m] *= 0.5


class NGramDrafter(Drafter):
    """Prompt-lookup drafter. `Proposal.lengths` = matched length (0 when no n-gram matches), so unmatched rows
    verify nothing; confidences are each matched draft's learned acceptance (`MatchAcceptance`), 0.0 for padding."""

    context_from_commits = True

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got min_ngram={min_ngram}, max_ngram={max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.acceptance = MatchAcceptance(max_ngram)  # kept across runs: it describes the drafter on this target
        self._device = torch.device("cpu")
        self._hist: list[list[int]] = []
        self._index: list[dict[tuple[int, ...], int]] = []  # per row; keys of every n share one dict
        # per row, the history positions the index holds (`_indexed`): commits only append to the history, and a
        # row's index catches up when it is looked up, so steps that look nothing up (a gate that keeps lookup steps
        # off at a large batch) pay one list append a row
        self._upto: list[int] = []
        self._matched: list[int] = []  # per row, the match length behind its last proposal (0: none)
        # Cost profiling (`full_depth`): rows that matched nothing propose K copies of their last token
        # (confidence 0), so every step verifies as many positions as the profile asks for.
        self.draft_every_row = False

    def allocate(self, batch_size: int, max_len: int, *, device: torch.device, slack: int) -> None:
        self._device = device
        self._hist = [[] for _ in range(batch_size)]
        self._index = [{} for _ in range(batch_size)]
        self._upto = [0] * batch_size
        self._matched = [0] * batch_size

    def prefill(self, rows: Sequence[int], prompts: Sequence[Sequence[int]], first_tokens: Sequence[int],
                target_hidden: tuple[Tensor, ...]) -> None:
        for r, prompt, first in zip(rows, prompts, first_tokens, strict=True):
            self._hist[r], self._index[r], self._upto[r] = [], {}, 0
            self._extend(r, [*prompt, first])

    def _extend(self, r: int, tokens: Sequence[int]) -> None:
        self._hist[r].extend(tokens)

    def _indexed(self, r: int) -> tuple[list[int], dict[tuple[int, ...], int]]:
        """Row r's history and its index, brought up to the history's end (positions in order, so a later occurrence
        of an n-gram replaces an earlier one: the index says where each n-gram last occurred)."""
        h, index = self._hist[r], self._index[r]
        lo, hi = self.min_ngram, self.max_ngram
        for i in range(self._upto[r], len(h)):  # position i: every n-gram ending at i-1 is followed by position i
            for n in range(lo, min(hi, i) + 1):
                index[tuple(h[i - n: i])] = i
        self._upto[r] = len(h)
        return h, index

    def history_len(self, r: int) -> int:
        """Tokens in row r's history."""
        return len(self._hist[r])

    def full_depth(self) -> AbstractContextManager[None]:
        """Rows without a match draft K padding tokens inside (`Drafter.full_depth`)."""
        return switched(self, "draft_every_row", True)

    def lookup(self, r: int, k: int) -> list[int]:
        """Up to k drafts for row r ([] when nothing matches)."""
        return self.match(r, k)[1]

    def match(self, r: int, k: int) -> tuple[int, list[int]]:
        """(n, drafts): the longest n-gram of row r's history tail that occurred before (0 when none) and the k
        tokens that followed its most recent occurrence ([] when none). A longer match is usually a surer draft."""
        h, index = self._indexed(r)
        length = len(h)
        for n in range(min(self.max_ngram, length), self.min_ngram - 1, -1):
            j = index.get(tuple(h[length - n:]))
            if j is not None:
                out: list[int] = []
                for m in range(k):
                    out.append(h[j + m] if j + m < length else out[j + m - length])
                return n, out
        return 0, []

    def note_match(self, r: int, n: int) -> None:
        """Row r's next commit verifies drafts that followed an n-token match (another drafter proposed them, from
        `match`): what the target accepts teaches `acceptance`."""
        self._matched[r] = n

    def propose(self, state: DraftState) -> Proposal:
        k, b = state.num_draft_tokens, state.seq_lens.shape[0]
        tokens = [[0] * k for _ in range(b)]
        conf = [[0.0] * k for _ in range(b)]
        lengths = [0] * b
        for r in state.active_rows:
            n, found = self.match(r, k)
            self._matched[r] = n
            if found:
                tokens[r] = found
                conf[r] = self.acceptance.estimate(n, k)
                lengths[r] = k
            elif self.draft_every_row and k:
                tokens[r] = [self._hist[r][-1]] * k
                lengths[r] = k
        tok = torch.tensor(tokens, dtype=torch.int64, device=self._device).view(b, k)  # [B, K]
        lens = torch.tensor(lengths, dtype=torch.int64, device=self._device)  # [B]
        confidences = torch.tensor(conf, dtype=torch.float32, device=self._device).view(b, k)  # [B, K]
        return Proposal(tokens=tok, confidences=confidences, lengths=lens, deterministic=True,
                        host_lengths=tuple(lengths))

    def on_commit(self, commit: Commit) -> None:
        self.extend(commit.host_tokens, commit.host_depths)

    def extend(self, host_tokens: Sequence[Sequence[int]], host_depths: Sequence[int] = ()) -> None:
        """Each row's committed tokens into its history; a row that verified `host_depths[r]` drafts of a match
        (`note_match`, or this drafter's own proposal) teaches `acceptance` what the target kept of them."""
        depths = host_depths  # () from a caller that does not say (nothing is learned then)
        for r, toks in enumerate(host_tokens):
            if toks:
                self._extend(r, toks)
                if self._matched[r] and depths and depths[r]:
                    self.acceptance.observe(self._matched[r], depths[r], len(toks) - 1)
            self._matched[r] = 0

    def catch_up(self, host_tokens: Sequence[Sequence[int]], seq_lens: Sequence[int]) -> None:
        """Rows whose history stops short of their committed length `seq_lens[r]` take the missing tail of
        `host_tokens[r]` (their last committed tokens); rows that are current are left as they are."""
        for r, toks in enumerate(host_tokens):
            missing = seq_lens[r] - len(self._hist[r]) if toks else 0
            if missing > len(toks):
                raise RuntimeError(f"internal: row {r}'s lookup history misses {missing} tokens, {len(toks)} given")
            if missing > 0:
                self._extend(r, toks[len(toks) - missing:])

    def reset_rows(self, rows: Sequence[int]) -> None:
        for r in rows:
            self._hist[r], self._index[r], self._upto[r] = [], {}, 0
            self._matched[r] = 0


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
