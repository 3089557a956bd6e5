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

Every match of `min_match` tokens or more (default 1: the model drafts where the lookup finds nothing) drafts from
the lookup. With `adaptive=True` a match drafts only where it has paid so far (`LookupChooser`: accepted drafts
per round of the lookup after an n-token match and of the model, per request, against the measured seconds of a
round of each kind). How often a short match pays depends on the drafter and the text, and the adaptive choice is
not the default (why: docs/design.md §12, `benchmarks/hybrid.py --measured`). It reads host timings, so which
drafter drafted a round can differ between runs: outputs stay exact (identical to AR at T = 0), but sampled outputs
at T > 0 are not bit-reproducible across runs, as with the speculation gate.

`model_depth` D < K caps the model's drafts: the lookup still verifies up to the engine's K after a match (a copied
stretch is often right for many tokens), while the model proposes D argmax drafts (`Proposal.lengths`), so its rounds
verify D + 1 positions and run D head steps instead of K. A model's acceptance falls with depth and a verified
position costs the target the same whoever drafted it, so the best D for the model is usually below the lookup's
best K (measured in `benchmarks/hybrid.py --model-depths`). With D set the model always drafts argmax drafts, also
at T > 0 where no row matched, verified with the deterministic-draft protocol (exact; per-row lengths are refused
under standard speculative sampling).

The serving gate's lookup steps (`DraftState.lookup_only`, with the costs of verifying m drafts in all) are planned
over the step's rows together (`MatchAcceptance.plan`), within each request's `LatencyBudget`: waiting on other rows'
drafts slows a request by at most the gate's `latency_slack` (5% by default, `--policy auto:slack=S`) of its time per
output token, as the plan's costs count it.

`--drafter DIR+ngram` (or `KIND:DIR+ngram`; `...+ngram:N:M:D` for the longest n-gram N, the shortest match M and
the model's depth D) builds one.

Shape legend: B rows, K draft depth.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace

import torch
from torch import Tensor

from angelspec.decoding.drafters.base import Commit, Drafter, DraftState, Proposal, WrappedDrafter
from angelspec.decoding.drafters.ngram import NGramDrafter
from angelspec.decoding.metrics import STALL_S

MODEL_FIRST_ROUNDS = 2


class RoundStats:
    """What each kind of round cost, for reports: per kind, [rounds, seconds from proposing to the commit, tokens
    committed]. A round over `metrics.STALL_S` (it compiled a graph) is left out."""

    def __init__(self, kinds: Sequence[str]) -> None:
        self.by_kind: dict[str, list[float]] = {kind: [0, 0.0, 0] for kind in kinds}

    def add(self, kind: str, seconds: float, tokens: int) -> None:
        if seconds < STALL_S:
            stats = self.by_kind[kind]
            stats[0] += 1
            stats[1] += seconds
            stats[2] += tokens

    def snapshot(self) -> dict[str, list[float]]:
        return {kind: list(v) for kind, v in self.by_kind.items()}


def _ema(old: float | None, x: float, alpha: float) -> float:
    return x if old is None else old + alpha * (x - old)


class LookupChooser:
    """Which drafter pays better for a row whose lookup matched n tokens, from what the run has measured: accepted
    drafts per round of each source (per row, started from the drafter-wide means when a request joins; the lookup
    per match length n) and the seconds of a whole round of each kind, from proposing to the commit (drafter-wide:
    rounds the lookup drafted alone, rounds the model drafted in). The lookup wins when
    (a_lookup(n) + 1) / t_lookup_round >= (a_model + 1) / t_model_round: tokens per second of a round at batch 1. (A
    model round costs more than its drafting call: timing only the call and pooling the verification of both kinds
    chose the model too often, and ran slower than drafting every match.) While anything is unknown the lookup, which
    costs nothing, is tried. A row that keeps declining the lookup takes it every `probe_every`-th time so its
    estimate stays current; a time above `outlier` times its running mean (a compile, a preempted core) is left
    out."""

    def __init__(self, max_ngram: int, *, row_alpha: float = 0.3, global_alpha: float = 0.05, probe_every: int = 8,
                 outlier: float = 4.0) -> None:
        self.row_alpha, self.global_alpha = row_alpha, global_alpha
        self.probe_every, self.outlier = probe_every, outlier
        self.lookup_acc: list[float | None] = [None] * (max_ngram + 1)  # drafter-wide, per match length
        self.model_acc: float | None = None
        self.lookup_round_s: float | None = None
        self.model_round_s: float | None = None
        self._rows: list[dict] = []

    def reset(self, batch_size: int) -> None:
        self._rows = [self._fresh() for _ in range(batch_size)]

    def _fresh(self) -> dict:
        return {"lookup": list(self.lookup_acc), "model": self.model_acc, "declined": 0}

    def start_row(self, r: int) -> None:
        self._rows[r] = self._fresh()

    def prefers_lookup(self, r: int, n: int) -> bool:
        row = self._rows[r]
        a_lookup, a_model = row["lookup"][n], row["model"]
        if a_lookup is None or a_model is None or self.lookup_round_s is None or self.model_round_s is None:
            return True
        if (a_lookup + 1.0) * self.model_round_s >= (a_model + 1.0) * self.lookup_round_s:
            row["declined"] = 0
            return True
        row["declined"] += 1
        if row["declined"] >= self.probe_every:
            row["declined"] = 0
            return True
        return False

    def observe_accepted(self, r: int, n: int, accepted: int) -> None:
        """Row r's round drafted by the lookup after a match of n tokens (n = 0: by the model) accepted `accepted`."""
        row = self._rows[r]
        if n:
            row["lookup"][n] = _ema(row["lookup"][n], accepted, self.row_alpha)
            self.lookup_acc[n] = _ema(self.lookup_acc[n], accepted, self.global_alpha)
        else:
            row["model"] = _ema(row["model"], accepted, self.row_alpha)
            self.model_acc = _ema(self.model_acc, accepted, self.global_alpha)

    def observe_round(self, seconds: float, model_drafted: bool) -> None:
        """One round's seconds, from proposing to the commit; `model_drafted`: the model drafted in it."""
        old = self.model_round_s if model_drafted else self.lookup_round_s
        if old is not None and seconds > self.outlier * old:
            return
        if model_drafted:
            self.model_round_s = _ema(old, seconds, self.global_alpha)
        else:
            self.lookup_round_s = _ema(old, seconds, self.global_alpha)


class LatencyBudget:
    """How much each request's lookup steps may slow it against plain decoding: a `slack` (the serving gate's
    `latency_slack`, 0.05: 5%) of its time per output token. A lookup step of m drafts in all costs every row of the
    batch costs[m] (its planned cost against a plain step, `DraftState.lookup_costs`) and commits 1 + its accepted
    drafts to each; per row, `debt` sums what its lookup steps cost it beyond the tokens they gave it, in plain steps
    (a plain step costs 1 and gives 1: nothing), and `room(slack)` = slack * max(tokens since its prefill,
    `allowance`) - debt is what the plan may still spend of it (`MatchAcceptance.plan`; the allowance lets a
    request's first tokens wait on others' drafts that its later ones will make up for, as a time per output token
    over the whole request does). So a request that matches nothing beside one that matches much is slowed by at
    most the slack, as planned (the step costs as the gate measured them; what rows out of step cost is not in
    them), and one whose drafts keep failing verifies only what is expected to pay for itself."""

    def __init__(self, allowance: int = 128) -> None:
        if allowance < 0:
            raise ValueError(f"LatencyBudget needs allowance >= 0, got {allowance}")
        self.allowance = allowance
        self.debt: list[float] = []
        self.base: list[int] = []  # per row, its history's length after the prefill (the prompt and first token)

    def reset(self, batch_size: int) -> None:
        self.debt, self.base = [0.0] * batch_size, [0] * batch_size

    def start_row(self, r: int, history_len: int) -> None:
        self.debt[r], self.base[r] = 0.0, history_len

    def room(self, r: int, history_len: int, slack: float) -> float:
        """Plain steps' worth of time row r may still lose (negative: it lost more than the slack allows)."""
        if not slack >= 0.0:
            raise ValueError(f"the latency slack must be >= 0, got {slack}")
        return slack * max(history_len - self.base[r], self.allowance) - self.debt[r]

    def charge(self, cost: float, host_tokens: Sequence[Sequence[int]]) -> None:
        """A lookup step that cost `cost` plain steps committed host_tokens[r] to each active row (empty: idle)."""
        for r, toks in enumerate(host_tokens):
            if toks:
                self.debt[r] += cost - len(toks)


class HybridDrafter(WrappedDrafter):
    """`inner` (a model drafter) with `ngram` in front; rows whose n-gram match is at least `min_match` tokens long
    draft from the lookup (always, or with `adaptive` where it has paid so far). Not registered: it is built around
    another drafter (`loading.resolve_drafter`)."""

    def __init__(self, inner: Drafter, ngram: NGramDrafter | None = None, min_match: int | None = None, *,
                 adaptive: bool = False, model_depth: int | None = None) -> None:
        if not inner.context_from_commits:
            raise ValueError(f"HybridDrafter: {type(inner).__name__} keeps its own drafts as context, so lookup drafts "
                             "cannot be verified in its place; use a drafter that builds its context from the target's "
                             "commits (MTP, EAGLE-3, DFlash / DFlare / DFly / DSpark)")
        super().__init__(inner)
        self.lookup_drafts = True
        self.ngram = ngram if ngram is not None else NGramDrafter()
        self.min_match = self.ngram.min_ngram if min_match is None else min_match
        if not self.ngram.min_ngram <= self.min_match <= self.ngram.max_ngram:
            raise ValueError(f"HybridDrafter: min_match must lie in [{self.ngram.min_ngram}, {self.ngram.max_ngram}] "
                             f"(the n-gram lengths the lookup matches), got {self.min_match}")
        if model_depth is not None and model_depth < 1:
            raise ValueError(f"HybridDrafter: model_depth must be a positive number of drafts, got {model_depth}")
        # at most this many model drafts per round (None: the engine's K, as the lookup); argmax drafts then
        self.model_depth = model_depth
        self.lookup_rounds = 0  # row-rounds drafted by the lookup since the drafter was built (for reports)
        self.model_rounds = 0  # row-rounds drafted by the model
        self._model_first: list[int] = []  # per row: rounds the model drafts before the lookup may
        # adaptive: a match of min_match or more drafts when the measured rates say it pays (`LookupChooser`);
        # else always (the default)
        self.chooser = LookupChooser(self.ngram.max_ngram) if adaptive else None
        self._sources: dict[int, int] = {}  # this round: row -> match length its lookup drafts came from, 0 = model
        # this round's lookup plan (`lookup_depths`): (what it was made for, row -> (match length, drafts, depth))
        self._plan: tuple[tuple, dict[int, tuple[int, list[int], int]]] | None = None
        self._timing: tuple[float, bool] | None = None  # this round: (start of propose, the model drafted)
        # for reports: "lookup" (every active row drafted from the lookup) and "model" (the model drafted in it)
        # rounds; a request's first rounds are left out
        self.round_stats = RoundStats(("lookup", "model"))
        # what lookup steps cost each request beyond the tokens they gave it, against the slack a lookup step is
        # planned with (`DraftState.lookup_slack`)
        self.budget = LatencyBudget()
        self._charge = 0.0  # this round: what its lookup step cost every row, in plain steps (0.0: not a lookup step)

    def allocate(self, batch_size: int, max_len: int, *, device: torch.device, slack: int) -> None:
        self.inner.allocate(batch_size, max_len, device=device, slack=slack)
        self.ngram.allocate(batch_size, max_len, device=device, slack=slack)
        self._model_first = [MODEL_FIRST_ROUNDS] * batch_size
        if self.chooser is not None:
            self.chooser.reset(batch_size)
        self.budget.reset(batch_size)
        self._sources, self._timing, self._plan, self._charge = {}, None, None, 0.0

    def prefill(self, rows: Sequence[int], prompts: Sequence[Sequence[int]], first_tokens: Sequence[int],
                target_hidden: tuple[Tensor, ...]) -> None:
        self.inner.prefill(rows, prompts, first_tokens, target_hidden)
        self.ngram.prefill(rows, prompts, first_tokens, ())
        for r in rows:
            self._model_first[r] = MODEL_FIRST_ROUNDS
            if self.chooser is not None:
                self.chooser.start_row(r)
            self.budget.start_row(r, self.ngram.history_len(r))

    def propose(self, state: DraftState) -> Proposal:
        k = state.num_draft_tokens
        self._sources, self._timing = {}, None
        start = time.perf_counter()
        if k == 0:  # the speculation gate skipped the round
            return self.inner.propose(state)
        if state.lookup_only:  # the serving gate's lookup step: the model sits the round out
            return self._lookup_round(state, start)
        matched: dict[int, list[int]] = {}
        first_rounds = False
        for r in state.active_rows:
            self._sources[r] = 0
            if self._model_first[r]:
                self._model_first[r] -= 1
                first_rounds = True
                continue
            n, drafts = self.ngram.match(r, k)
            if n >= self.min_match and (self.chooser is None or self.chooser.prefers_lookup(r, n)):
                matched[r] = drafts
                self._sources[r] = n
                self.ngram.note_match(r, n)
        self.lookup_rounds += len(matched)
        self.model_rounds += len(state.active_rows) - len(matched)
        shallow = self.model_depth is not None and self.model_depth < k
        if not matched and not shallow:
            self._timing = None if first_rounds else (start, True)
            return self.inner.propose(state)
        b, dev = state.seq_lens.shape[0], state.seq_lens.device
        if matched:
            rows = torch.tensor(list(matched), dtype=torch.int64, device=dev)  # [m]
            drafts = torch.tensor(list(matched.values()), dtype=torch.int64, device=dev)  # [m, K]
            if len(matched) == len(state.active_rows):
                self.inner.propose(replace(state, num_draft_tokens=0))  # the model sits this round out
                tokens = torch.zeros(b, k, dtype=torch.int64, device=dev)
                tokens[rows] = drafts
                self._timing = (start, False)
                return Proposal(tokens=tokens, confidences=torch.ones(b, k, device=dev), deterministic=True)
        self._timing = None if first_rounds else (start, True)
        d = min(self.model_depth, k) if shallow else k  # type: ignore[type-var]
        p = self.inner.propose(replace(state, num_draft_tokens=d, deterministic=True))
        if not p.deterministic:
            raise ValueError(f"HybridDrafter: {type(self.inner).__name__} proposed sampled drafts when asked for "
                             "deterministic ones (DraftState.deterministic); it cannot share a round with n-gram "
                             "lookup")
        tokens = torch.zeros(b, k, dtype=torch.int64, device=dev)
        tokens[:, :d] = p.tokens
        conf = torch.zeros(b, k, device=dev)
        conf[:, :d] = 1.0 if p.confidences is None else p.confidences
        lengths = torch.full((b,), d, dtype=torch.int64, device=dev) if p.lengths is None else p.lengths.clone()
        if matched:
            tokens[rows] = drafts
            conf[rows] = 1.0
            lengths.index_fill_(0, rows, k)
        return Proposal(tokens=tokens, confidences=conf, lengths=None if d == k and p.lengths is None else lengths,
                        deterministic=True)

    def lookup_depths(self, active_rows: Sequence[int], batch_size: int, k: int, costs: Sequence[float] = (),
                      slack: float | None = None) -> tuple[int, ...]:
        """Per row, the drafts a lookup step of k drafts with these `costs` and latency `slack` would verify
        (`_lookup_round`'s choice, from the rows' histories alone), without proposing. The plan is kept for this
        round's `propose` (it reads the same histories), so asking first costs no second lookup."""
        self._plan = self._make_plan(active_rows, k, tuple(costs), slack)
        depths = [0] * batch_size
        for r, (_, _, depth) in self._plan[1].items():
            depths[r] = depth
        return tuple(depths)

    def _make_plan(self, active_rows: Sequence[int], k: int, costs: tuple[float, ...], slack: float | None
                   ) -> tuple[tuple, dict[int, tuple[int, list[int], int]]]:
        """(what the plan is for, row -> (match length, drafts, depth)) for the rows whose match of at least
        `min_match` tokens is worth verifying to some depth in a step of these rows at these relative `costs` of
        verifying m drafts in all, each row kept within its latency budget at this `slack` (None: unbounded)
        (`MatchAcceptance.plan`; every match to k without costs)."""
        matches: dict[int, tuple[int, list[int]]] = {}
        for r in active_rows:
            n, drafts = self.ngram.match(r, k)
            if n >= self.min_match:  # (rows without a match drafted nothing: no source to learn about)
                matches[r] = (n, drafts)
        budget = self.budget
        room = None if slack is None else {r: budget.room(r, self.ngram.history_len(r), slack) for r in active_rows}
        depths = (self.ngram.acceptance.plan({r: n for r, (n, _) in matches.items()}, len(active_rows), k, costs,
                                             room)
                  if len(costs) > 1 else dict.fromkeys(matches, k))
        plan = {r: (matches[r][0], matches[r][1], d) for r, d in depths.items()}
        return self._plan_key(active_rows, k, costs, slack), plan

    def _plan_key(self, active_rows: Sequence[int], k: int, costs: tuple[float, ...], slack: float | None) -> tuple:
        """What a lookup plan was made for: its rows, their histories' lengths, the depth, the costs and the slack."""
        return tuple(active_rows), tuple(self.ngram.history_len(r) for r in active_rows), k, costs, slack

    def _lookup_round(self, state: DraftState, start: float) -> Proposal:
        """Only the lookup's drafts (`DraftState.lookup_only`): the rows with a match of at least `min_match` tokens
        verify as many of its drafts as the step's expected tokens per unit of `DraftState.lookup_costs` pays for
        (`MatchAcceptance.plan`, over the step's rows together; all K without costs), the others none
        (`Proposal.host_lengths`, so a round where nothing is verified costs a plain step); the model's round is one of
        zero drafts (it catches up on its next drafted round)."""
        k, b, dev = state.num_draft_tokens, state.seq_lens.shape[0], state.seq_lens.device
        if not state.lapsed:
            self.inner.propose(replace(state, num_draft_tokens=0, lookup_only=False, lookup_costs=(),
                                       lookup_slack=None))
        costs, slack = tuple(state.lookup_costs), state.lookup_slack
        planned, self._plan = self._plan, None
        if planned is None or planned[0] != self._plan_key(state.active_rows, k, costs, slack):
            planned = self._make_plan(state.active_rows, k, costs, slack)
        tokens = [[0] * k for _ in range(b)]
        lengths = [0] * b
        for r, (n, drafts, depth) in planned[1].items():
            tokens[r], lengths[r], self._sources[r] = drafts, depth, n
            self.ngram.note_match(r, n)
        verified = sum(lengths)
        self._charge = costs[verified] / costs[0] if verified and len(costs) > verified else 0.0
        self.lookup_rounds += len(planned[1])
        self._timing = (start, False)
        length = torch.tensor(lengths, dtype=torch.int64, device=dev)  # [B]
        return Proposal(tokens=torch.tensor(tokens, dtype=torch.int64, device=dev).view(b, k),
                        confidences=(torch.arange(k, device=dev) < length[:, None]).float(), lengths=length,
                        deterministic=True, host_lengths=tuple(lengths))

    def on_commit(self, commit: Commit) -> None:
        if self._timing is not None and self._sources:
            start, model_drafted = self._timing
            seconds = time.perf_counter() - start
            self.round_stats.add("model" if model_drafted else "lookup", seconds,
                                 sum(len(commit.host_tokens[r]) for r in self._sources))
            if self.chooser is not None:
                self.chooser.observe_round(seconds, model_drafted)
        if self.chooser is not None:
            for r, n in self._sources.items():
                self.chooser.observe_accepted(r, n, len(commit.host_tokens[r]) - 1)
        self._settle(commit.host_tokens)
        self._sources, self._timing, self._plan = {}, None, None
        self.inner.on_commit(commit)
        self.ngram.on_commit(commit)

    def on_lookup_commit(self, host_tokens: Sequence[Sequence[int]], host_depths: Sequence[int] = ()) -> None:
        """A step that left the model behind: the lookup's history (and what it learns of the rows it drafted) takes
        the tokens, the model waits for `on_catch_up`."""
        self._settle(host_tokens)
        self._sources, self._timing, self._plan = {}, None, None
        self.ngram.extend(host_tokens, host_depths)

    def _settle(self, host_tokens: Sequence[Sequence[int]]) -> None:
        """A lookup step's cost goes to every active row's latency budget (`LatencyBudget.charge`)."""
        if self._charge:
            self.budget.charge(self._charge, host_tokens)
        self._charge = 0.0

    def on_catch_up(self, commit: Commit) -> None:
        """The positions the model missed; the lookup takes those it has not seen (an engine that runs no lookup steps
        leaves its history behind too; one that does kept it current, `on_lookup_commit`)."""
        self.ngram.catch_up(commit.host_tokens, commit.seq_lens.tolist())
        self.inner.on_catch_up(commit)

    def reset_rows(self, rows: Sequence[int]) -> None:
        self.inner.reset_rows(rows)
        self.ngram.reset_rows(rows)
