"""A model drafter with n-gram lookup in front: where a row's recent tokens repeat an earlier stretch of its own
history (a long n-gram match), the lookup's drafts are used, for free; elsewhere the model drafts.

Why: prompt lookup costs no model call and is very often right after a long match (copied code, a repeated
phrase, a loop), while a trained drafter is right more often on fresh text but pays a forward per round. The
choice is made per row and per step from the committed prefix alone (the n-gram match length), before anything is
sampled:

* every active row has a match of at least `min_match` tokens: the model sits the round out (a round of 0
  drafts, as when the speculation gate skips it; it keeps the commit and catches up on its next drafted round),
  and the lookup's drafts are verified;
* no row has one: the model's proposal, unchanged (sampled drafts at T > 0 keep standard speculative sampling);
* some rows have one: the model drafts argmax drafts for the batch (`DraftState.deterministic`) and the matched
  rows take the lookup's drafts instead; the proposal is deterministic, verified with the deterministic-draft
  protocol, which is exact for any mix of deterministic drafts.

Both drafters see every prefill, commit and reset, so either can take any round. The model drafts each request's
first `MODEL_FIRST_ROUNDS` rounds whatever the lookup finds: its first round has no waiting commits and its second
has some, which a compiled model runs as two different graphs; drafted on the first request (a warm-up), both are
built before any timed decoding (a lookup-drafted first round put the first compile of one of them in the middle of
a timed run). Outputs stay identical to AR at
T = 0 and exact in distribution at T > 0: which drafter drafts depends only on the committed prefix.

Which match is long enough (`min_match`, default 1: the model drafts only where the lookup finds nothing) was
measured, not derived: with the shipped drafters of the embedded target, compiled at batch 1, a 1-gram match's
drafts paid better than a model round (`benchmarks/hybrid.py --min-match 1,2,3`). A drafter much stronger than the
lookup on the text at hand wants a higher bar.

`--drafter DIR+ngram` (or `KIND:DIR+ngram`; `...+ngram:N:M` for the longest n-gram N and the shortest match M)
builds one.

Shape legend: B rows, K draft depth.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch
from torch import Tensor

from angelspec.decoding.drafters.base import Commit, Drafter, DraftState, Proposal, WrappedDrafter
from angelspec.decoding.drafters.ngram import NGramDrafter

MODEL_FIRST_ROUNDS = 2


class HybridDrafter(WrappedDrafter):
    """`inner` (a model drafter) with `ngram` in front; rows whose n-gram match is at least `min_match` tokens long
    draft from the lookup. Not registered: it is built around another drafter (`loading.resolve_drafter`)."""

    def __init__(self, inner: Drafter, ngram: NGramDrafter | None = None, min_match: int | None = None) -> None:
        if not inner.context_from_commits:
            raise ValueError(f"HybridDrafter: {type(inner).__name__} keeps its own drafts as context, so lookup drafts "
                             "cannot be verified in its place; use a drafter that builds its context from the target's "
                             "commits (MTP, EAGLE-3, DFlash / DFlare / DFly / DSpark)")
        super().__init__(inner)
        self.ngram = ngram if ngram is not None else NGramDrafter()
        self.min_match = self.ngram.min_ngram if min_match is None else min_match
        if not self.ngram.min_ngram <= self.min_match <= self.ngram.max_ngram:
            raise ValueError(f"HybridDrafter: min_match must lie in [{self.ngram.min_ngram}, {self.ngram.max_ngram}] "
                             f"(the n-gram lengths the lookup matches), got {self.min_match}")
        self.lookup_rounds = 0  # row-rounds drafted by the lookup since the drafter was built (for reports)
        self.model_rounds = 0  # row-rounds drafted by the model
        self._model_first: list[int] = []  # per row: rounds the model drafts before the lookup may

    @property
    def name(self) -> str:
        return f"{type(self.inner).__name__}+ngram"

    def allocate(self, batch_size: int, max_len: int, *, device: torch.device, slack: int) -> None:
        self.inner.allocate(batch_size, max_len, device=device, slack=slack)
        self.ngram.allocate(batch_size, max_len, device=device, slack=slack)
        self._model_first = [MODEL_FIRST_ROUNDS] * batch_size

    def prefill(self, rows: Sequence[int], prompts: Sequence[Sequence[int]], first_tokens: Sequence[int],
                target_hidden: tuple[Tensor, ...]) -> None:
        self.inner.prefill(rows, prompts, first_tokens, target_hidden)
        self.ngram.prefill(rows, prompts, first_tokens, ())
        for r in rows:
            self._model_first[r] = MODEL_FIRST_ROUNDS

    def propose(self, state: DraftState) -> Proposal:
        k = state.num_draft_tokens
        if k == 0:  # the speculation gate skipped the round
            return self.inner.propose(state)
        matched: dict[int, list[int]] = {}
        for r in state.active_rows:
            if self._model_first[r]:
                self._model_first[r] -= 1
                continue
            n, drafts = self.ngram.match(r, k)
            if n >= self.min_match:
                matched[r] = drafts
        self.lookup_rounds += len(matched)
        self.model_rounds += len(state.active_rows) - len(matched)
        if not matched:
            return self.inner.propose(state)
        b, dev = state.seq_lens.shape[0], state.seq_lens.device
        rows = torch.tensor(list(matched), dtype=torch.int64, device=dev)  # [m]
        drafts = torch.tensor(list(matched.values()), dtype=torch.int64, device=dev)  # [m, K]
        if len(matched) == len(state.active_rows):
            self.inner.propose(replace(state, num_draft_tokens=0))  # the model sits this round out
            tokens = torch.zeros(b, k, dtype=torch.int64, device=dev)
            tokens[rows] = drafts
            return Proposal(tokens=tokens, confidences=torch.ones(b, k, device=dev), deterministic=True)
        p = self.inner.propose(replace(state, deterministic=True))
        if not p.deterministic:
            raise ValueError(f"HybridDrafter: {type(self.inner).__name__} proposed sampled drafts when asked for "
                             "deterministic ones (DraftState.deterministic); it cannot share a round with n-gram "
                             "lookup")
        tokens = p.tokens.clone()
        tokens[rows] = drafts
        conf = torch.ones(b, k, device=dev) if p.confidences is None else p.confidences.clone()
        conf[rows] = 1.0
        lengths = None if p.lengths is None else p.lengths.clone().index_fill_(0, rows, k)
        return Proposal(tokens=tokens, confidences=conf, lengths=lengths, deterministic=True)

    def on_commit(self, commit: Commit) -> None:
        self.inner.on_commit(commit)
        self.ngram.on_commit(commit)

    def reset_rows(self, rows: Sequence[int]) -> None:
        self.inner.reset_rows(rows)
        self.ngram.reset_rows(rows)
