"""The step: one target forward over every row of the scheduler. An AR step decodes one token per row; a
speculative step drafts, selects each row's depth, verifies the drafts in one forward, and commits the accepted
prefix plus the target's own token (rolling the cache back past the rejected drafts).

Verification protocol (docs/design.md trap 1), chosen per step on the host:
* every active row greedy             -> greedy acceptance on raw logits (exact by construction), inside the
  verify forward's call (`sampling.greedy_accept`, the rule `verify_greedy` checks its arguments for);
* drafts deterministic, or the depth policy reads this round's drafts -> `verify_deterministic`
  (exact for any depth choice);
* otherwise                           -> `verify_speculative` with the drafter's probabilities; a proposal
  that also carries per-row `lengths` is refused here (they could depend on the sampled drafts).

Host syncs: one per step (the step's tokens, and for speculative steps num_accepted and depth, to learn which rows
finished). A depth policy whose depths depend on data, or per-row `Proposal.lengths` without their host copy
(`host_lengths`), add a second one: the verify width, so that positions no row verifies cost no compute.

Shape legend: B rows, K draft depth, n verify width (<= K), V vocab.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import Tensor

from angelspec.decoding.drafters.base import Commit, Drafter, DraftState, Proposal
from angelspec.decoding.engine.forwards import Taps, TargetForwards
from angelspec.decoding.engine.scheduler import Scheduler, choose
from angelspec.decoding.engine.types import DepthPolicyFn, VerifyEvent, VerifyProtocol
from angelspec.decoding.metrics import DecodeMetrics, PhaseClock
from angelspec.decoding.policies.base import FixedDepth, policy_static_depth, policy_uses_proposal
from angelspec.decoding.policies.gate import ServingGate, SpecGate
from angelspec.decoding.sampling import (
    PLACEHOLDER_TOKEN_ID,
    VerifyOutput,
    process_logits,
    verify_deterministic,
    verify_greedy,
    verify_speculative,
)


class Step:
    """The steps over `rows` (a `Scheduler`), through the target's `forwards`.

    depth_policy: `(Proposal, DraftState) -> depth [B]`; None = FixedDepth(K). `static_depth`: every row's depth
    when the policy fixes one (no host read for the verify width). `gate`: the policy's own (`make_gate`) or, with
    spec_gate, the plain `SpecGate`; before each speculative step it chooses how many drafts to verify (0: a plain
    step). on_verify: called after verification and before the commit of each step that drafted."""

    def __init__(self, rows: Scheduler, forwards: TargetForwards, drafter: Drafter | None, k: int, *,
                 depth_policy: DepthPolicyFn | None, spec_gate: bool, dense_verify: bool,
                 on_verify: Callable[[VerifyEvent], None] | None) -> None:
        self.rows, self.forwards, self.drafter, self.k = rows, forwards, drafter, k
        self.dense_verify, self.on_verify = dense_verify, on_verify
        self.vocab_size = rows.target.config.vocab_size
        if drafter is None and depth_policy is not None:
            raise ValueError("a depth_policy needs a drafter")
        self.depth_policy: DepthPolicyFn = depth_policy or FixedDepth()
        static = policy_static_depth(self.depth_policy)
        if static is not None and not 0 <= static <= k:
            raise ValueError(f"depth policy verifies {static} drafts but num_draft_tokens is {k}")
        if static is None and isinstance(self.depth_policy, FixedDepth):  # FixedDepth() verifies all K: static too
            static = k
        self.static_depth = static
        self.uses_proposal = policy_uses_proposal(self.depth_policy)
        self._none_accepted: Tensor | None = None  # zeros [B]: a plain step's accepted drafts (never written)
        make_gate = getattr(self.depth_policy, "make_gate", None)
        self.gate: SpecGate | ServingGate | None = (
            None if drafter is None else make_gate(k, lookup=drafter.lookup_drafts) if callable(make_gate)
            else SpecGate() if spec_gate else None)
        # Steps the gate skipped may leave the drafter's context behind (`_bare`) when the drafter builds it from
        # commits alone; a draft LM feeds its own cache on every round.
        self.may_lapse = drafter is not None and drafter.context_from_commits
        self._lapsed = False  # some row's drafter context stops before its committed tokens (`Slot.stale_from`)
        # per step without upkeep since the last catch-up: its taps and, for a lookup step, the tokens each row
        # committed (None: a plain step, one per row)
        self._held: list[tuple[Taps, tuple[int, ...] | None]] = []
        self._lens_stale = False  # plain steps without upkeep left `rows.seq_lens` behind the cache

    @property
    def resume_window(self) -> int | None:
        """The newest missed positions the drafter needs after steps without upkeep (`Drafter.resume_window`); None
        where it needs them all or never misses any."""
        return self.drafter.resume_window if self.may_lapse and self.drafter is not None else None

    @property
    def bare_decode(self) -> bool:
        """Steps may run AR's decode forward: the serving gate's plain steps while drafting is off that make no taps,
        for a drafter that resumes from its newest positions (`ServingGate.keep_taps`)."""
        return isinstance(self.gate, ServingGate) and self.resume_window is not None

    def start(self, rows: int) -> None:
        """A run over a cache of `rows` rows begins (the serving gate keeps its measurements per cache size)."""
        if isinstance(self.gate, ServingGate):
            self.gate.begin(rows, window=self.resume_window)
        self._lapsed, self._held, self._lens_stale = False, [], False

    def ar(self, metrics: DecodeMetrics, clock: PhaseClock) -> None:
        """One token per active row from the plain decode forward."""
        rows = self.rows
        cache = rows.cache
        assert cache is not None
        t0 = clock.mark()
        # kv_len: the longest active row's cache after appending one token = its seq_len.
        logits = self.forwards.decode(rows.last, cache, rows.active_long, rows.seq_len_bound())  # [B, V]
        # After the forward, cache.lengths = position of the token being produced (its noise counter).
        rows.last = choose(logits, rows.sampling, cache.lengths, rows.all_greedy)  # [B]
        t1 = clock.mark()
        host = rows.last.tolist()  # host sync: once per step, to learn which rows finished
        rows.emit([(t,) for t in host])
        metrics.record_decode(len(rows.active_rows))
        clock.step(metrics, verify=(t0, t1), commit=(t1, clock.mark()))

    def spec(self, metrics: DecodeMetrics, clock: PhaseClock) -> None:
        """draft -> select each row's depth -> verify (one target forward) -> commit."""
        rows, k, gate = self.rows, self.k, self.gate
        assert rows.cache is not None
        t0, h0 = clock.mark(), time.perf_counter()  # h0: host time, what the gate weighs
        if isinstance(gate, ServingGate):
            gate.greedy = rows.all_greedy  # (lookup steps only for greedy rows)
        cap = k if gate is None else gate.choose_depth(len(rows.active_rows), k)  # drafts to verify, 0: a plain step
        lookup = gate is not None and gate.lookup_only
        lapse = self.may_lapse and not getattr(gate, "upkeep", True)  # a step without the drafter's upkeep
        if lapse and not cap:
            self._bare(metrics, clock, t0, h0)
            return
        if lapse and not lookup:
            raise RuntimeError("internal: a step the model drafts in must keep its context (the gate's upkeep)")
        if lapse and not any(self.drafter.lookup_depths(rows.active_rows, rows.cache.batch_size, cap,
                                                        gate.lookup_costs, getattr(gate, "latency_slack", None))):
            # A lookup step where no row would verify a match: AR's step, without building a round to verify nothing
            # (the host work between two forwards is what such a step pays over AR's: `_bare`)
            self._bare(metrics, clock, t0, h0, lookup=True)
            return
        if self._lapsed and not lapse:  # drafting (or upkeep) resumes after steps without it: the drafter catches up
            held = len(self._held)
            caught = self._resync()
            h0 += caught  # (what the gate times is the step; the catch-up depends on how long drafting was off)
            if isinstance(gate, ServingGate):  # (a cost of probing, which sizes the gap between probes)
                gate.observe_catch_up(len(rows.active_rows), caught, held)
        if not cap:
            self._plain(metrics, clock, t0, h0)
            return
        if lapse and self._lens_stale:  # a lookup step after plain steps without upkeep: the rows' lengths first
            rows.seq_lens = torch.where(rows.active, rows.cache.lengths + 1, rows.seq_lens)
            self._lens_stale = False
        proposal, state = self._draft(cap, lookup, lapse)
        protocol = self._protocol(proposal)  # refuses an unsafe proposal before any target work
        t1 = clock.mark()
        depth, width, num_keep = self._select(proposal, state, cap)  # [B], host ints n and sum of (depth + 1)
        t2 = clock.mark()
        old_len = rows.cache.lengths.clone() if width else None  # [B]; width 0 grows each active row by one
        # (a lookup step without upkeep where no row verifies a draft makes no taps unless the gate keeps them)
        make_taps = not lapse or getattr(gate, "keep_taps", True)
        v, taps = self._verify(protocol, proposal, depth, width, num_keep, state.seq_len_bound, make_taps)
        t3 = clock.mark()
        if self.on_verify is not None:
            self.on_verify(VerifyEvent(proposal=proposal, depth=depth, num_accepted=v.num_accepted,
                                       active=rows.active.clone()))
        measured: tuple[list[int], list[int]] | None = None
        if gate is not None and gate.measure_only and width:
            # A probe while drafting is off: what the rows accepted goes to the gate, and one token a row is committed
            # (the first verified one, the target's own token at that position: exact at any temperature), so the rows
            # stay in step as plain steps keep them; the drafter learns nothing of drafts it was not credited with.
            # (One more host sync, on probes only.)
            acc, verified = torch.stack([v.num_accepted, depth]).tolist()
            measured = [acc[r] for r in rows.active_rows], [verified[r] for r in rows.active_rows]
            v, depth = VerifyOutput(v.tokens, torch.zeros_like(v.num_accepted)), torch.zeros_like(depth)
        accepted, depths, on_commit = self._commit(v, taps, depth, old_len, clock, lapse)
        metrics.record_verify(accepted, depths, protocol)
        t4 = clock.mark()
        if gate is not None:
            if measured is not None:
                accepted, depths = measured
            gate.observe_step(len(rows.active_rows), cap, time.perf_counter() - h0, accepted, depths)
        clock.step(metrics, draft=(t0, t1), select=(t1, t2), verify=(t2, t3), commit=(t3, t4), on_commit=on_commit)

    def _plain(self, metrics: DecodeMetrics, clock: PhaseClock, t0: object, h0: float) -> None:
        """A step the gate skipped (or K = 0): what an AR step does (one forward, one token per row, one host sync),
        through the decode forward that also returns the drafter's taps. The drafter's round is one of zero drafts
        (`propose` with K = 0, which costs a drafter whose context comes from commits nothing; a draft LM feeds its own
        cache there) and the commit (kept for its next drafted round: `PendingCommits`). The token is chosen as an AR
        step chooses it, with the same noise key as a step verifying zero drafts, so outputs do not depend on which
        steps drafted."""
        rows, gate = self.rows, self.gate
        cache = rows.cache
        assert cache is not None and self.drafter is not None
        state = self._state(0, deterministic=True)
        self.drafter.propose(state)
        logits, taps = self.forwards.one_token(rows.last, cache, state.seq_len_bound, rows.active_long)
        rows.last = choose(logits, rows.sampling, rows.seq_lens, rows.all_greedy)  # [B]
        t1 = clock.mark()
        host = rows.last.tolist()  # host sync: once per step
        rows.seq_lens = rows.seq_lens + rows.active_long
        rows.draft_round += rows.active_long
        host_tokens = rows.one_each(host)
        rows.emit(host_tokens)
        t2 = clock.mark()
        if self._none_accepted is None or self._none_accepted.shape != rows.seq_lens.shape:
            self._none_accepted = torch.zeros_like(rows.seq_lens)
        self.drafter.on_commit(Commit(tokens=rows.last[:, None], num_accepted=self._none_accepted,
                                      seq_lens=rows.seq_lens, active=rows.active, host_tokens=tuple(host_tokens),
                                      target_hidden=taps, host_depths=(0,) * cache.batch_size))
        t3 = clock.mark()
        metrics.record_decode(len(rows.active_rows))
        metrics.skipped_steps += 1
        if gate is not None:
            gate.observe_step(len(rows.active_rows), 0, time.perf_counter() - h0, (), ())
        clock.step(metrics, verify=(t0, t1), commit=(t1, clock.mark()), on_commit=(t2, t3))

    def _bare(self, metrics: DecodeMetrics, clock: PhaseClock, t0: object, h0: float, *, lookup: bool = False
              ) -> None:
        """A step the gate skipped while drafting is off (`gate.upkeep` False): what an AR step does, and of the
        drafter's upkeep only this: the forward's taps are held as they came (`_hold`, one tuple a step), or where
        the gate does not need them (`gate.keep_taps` False: the drafter resumes from its newest positions, and the
        next drafted step is further away than those) none are made, the step runs AR's own decode forward and the
        taps held so far are dropped (`_resync` hands the drafter only positions after them). The drafter
        is neither asked for a round nor told the commit (a drafter with lookup drafts, in an engine that may run lookup
        steps: only its lookup, through `on_lookup_commit`), the rows' device `seq_lens` and `draft_round` are not
        advanced; each row records where its drafter context stops (`Slot.stale_from`), and the next step that drafts
        (or keeps the context) first hands the drafter every missed position in one commit (`_resync`). A lookup step
        while drafting is off lapses the same way (`_commit` with `lapse`). The token is chosen as `_plain` chooses it
        (the cache length after the forward is the row's committed length before it: the same noise key). `lookup`: a
        lookup step where no row verifies a match (`Drafter.lookup_depths`), counted as a step that verified no
        drafts, not as one the gate skipped."""
        rows, gate = self.rows, self.gate
        cache = rows.cache
        assert cache is not None and gate is not None and self.drafter is not None
        logits, taps = self._one_token(rows.seq_len_bound(), getattr(gate, "keep_taps", True))
        rows.last = choose(logits, rows.sampling, cache.lengths, rows.all_greedy)  # [B]
        t1 = clock.mark()
        host = rows.last.tolist()  # host sync: once per step
        self._hold(taps, None)
        self._lens_stale = True
        if self.drafter.lookup_drafts and gate.lookup_engine:  # the lookup's history stays current (its steps read it)
            host_tokens = rows.one_each(host)
            rows.emit(host_tokens)
            self.drafter.on_lookup_commit(host_tokens)
        else:
            rows.emit([(t,) for t in host])
        if lookup:  # (the gate reads it as the lookup step it asked for: `lookup_only`, one token a row)
            none = [0] * len(rows.active_rows)  # (a lookup proposal is deterministic: `_protocol`)
            metrics.record_verify(none, none, "greedy" if rows.all_greedy else "deterministic")
        else:
            metrics.record_decode(len(rows.active_rows))
            metrics.skipped_steps += 1
        gate.observe_step(len(rows.active_rows), 0, time.perf_counter() - h0, (), ())
        clock.step(metrics, verify=(t0, t1), commit=(t1, clock.mark()))

    def _one_token(self, bound: int, make_taps: bool) -> tuple[Tensor, Taps]:
        """One token per active row from the target: next-token logits [B, V] and the drafter's taps, or where nobody
        needs them (`make_taps` False) AR's own decode forward and no taps. bound: the longest active row's length."""
        rows = self.rows
        assert rows.cache is not None
        if make_taps:
            return self.forwards.one_token(rows.last, rows.cache, bound, rows.active_long)
        return self.forwards.decode(rows.last, rows.cache, rows.active_long, bound), ()

    def _hold(self, taps: Taps, counts: tuple[int, ...] | None) -> None:
        """A step without upkeep, before its `emit`: hold its taps (`counts`: each row's committed tokens, None for a
        plain step's one a row), or drop those held so far where it made none (they no longer end at the rows' newest
        positions, which `_resync` hands over), and mark where each active row's drafter context stops
        (`Slot.stale_from`)."""
        if taps:  # a CUDA graph's outputs are its own memory, overwritten by its next replay: keep a copy
            self._held.append((tuple(t.clone() for t in taps) if self.forwards.cuda_graphs else taps, counts))
        else:  # (a drafter without taps never holds any)
            self._held.clear()
        self._lapse_rows()

    def _lapse_rows(self) -> None:
        """Mark where each active row's drafter context stops (`Slot.stale_from`), before a step without upkeep
        commits."""
        rows = self.rows
        for r in rows.active_rows:
            slot = rows.slots[r]
            assert slot is not None
            if slot.stale_from is None:  # the input token's position: its taps are the first missed
                slot.stale_from, slot.stale_step = slot.seq_len - 1, slot.steps
        self._lapsed = True

    def _resync(self) -> float:
        """Hand the drafter the committed positions it missed during steps without upkeep, as one commit after a round
        of zero drafts (the contract of a drafter whose context comes from commits, `Drafter.on_catch_up`): per row,
        the missed positions whose taps were held (its last committed positions across the held steps: a row is
        active in every step since it lapsed), all of them unless the drafter resumes from its newest ones
        (`Drafter.resume_window`; the gate then held the steps before a drafted one, `ServingGate.keep_taps`), and
        their next tokens; a lookup whose history lapsed too takes the tokens left out first (`on_lookup_commit`).
        The rows' device state is caught up -> the seconds it took."""
        start = time.perf_counter()
        rows, drafter = self.rows, self.drafter
        cache = rows.cache
        assert cache is not None and drafter is not None
        held, self._held, self._lapsed, self._lens_stale = self._held, [], False, False
        b = cache.batch_size
        gaps, missed, tokens = [0] * b, [0] * b, [()] * b
        for r in rows.active_rows:
            slot = rows.slots[r]
            assert slot is not None
            if slot.stale_from is not None:
                gaps[r] = slot.seq_len - 1 - slot.stale_from
                missed[r] = slot.steps - slot.stale_step
                tokens[r] = tuple(slot.tokens[len(slot.tokens) - gaps[r]:])  # positions stale_from + 1 ..
                slot.stale_from = None
        if not max(gaps):  # the rows that lapsed have all left
            return time.perf_counter() - start
        dev = cache.device
        rows.seq_lens = torch.where(rows.active, cache.lengths + 1, rows.seq_lens)
        rows.draft_round += torch.tensor(missed, dtype=torch.int64, device=dev)  # one round per step missed
        plain = all(counts is None for _, counts in held)
        flat = None if plain else self._held_positions(held, b)
        avail = [len(held)] * b if plain else [len(f) for f in flat]  # positions held per row
        takes = gaps if not drafter.target_layer_ids else [min(g, n) for g, n in zip(gaps, avail, strict=True)]
        if takes != gaps:
            if drafter.resume_window is None:
                raise RuntimeError(f"internal: {gaps} positions to catch up but {avail} held")
            if drafter.lookup_drafts and not getattr(self.gate, "lookup_engine", False):
                drafter.on_lookup_commit([t[:g - k] for t, g, k in zip(tokens, gaps, takes, strict=True)])
        width = max(takes)
        if not width:
            return time.perf_counter() - start
        host_tokens = tuple(t[len(t) - k:] if k else () for t, k in zip(tokens, takes, strict=True))
        take = torch.tensor(takes, dtype=torch.int64, device=dev)  # [B] positions handed over per row
        drafter.propose(self._state(0, deterministic=True))
        taps: Taps = ()
        if held:  # [B, G]: where each row's last takes[r] held positions lie in the held taps joined on dim 1
            if flat is None:  # one position a row per step: on the device
                n = len(held)
                index = ((n - take)[:, None] + torch.arange(width, device=dev)).clamp(0, n - 1)
            else:  # left-aligned, padding repeats a valid index
                index = torch.tensor([f[len(f) - k:] + [f[-1]] * (width - k) if k else [0] * width
                                      for f, k in zip(flat, takes, strict=True)], dtype=torch.int64, device=dev)
            taps = tuple(torch.cat([h[i] for h, _ in held], dim=1).gather(  # [B, sum T, D] -> [B, G, D]
                1, index[:, :, None].expand(-1, -1, held[0][0][i].shape[-1])) for i in range(len(held[0][0])))
        committed = torch.tensor([list(t) + [PLACEHOLDER_TOKEN_ID] * (width - len(t)) for t in host_tokens],
                                 dtype=torch.int64, device=dev)  # [B, G]
        drafter.on_catch_up(Commit(tokens=committed, num_accepted=(take - 1).clamp(min=0), seq_lens=rows.seq_lens,
                                   active=take > 0, host_tokens=host_tokens, target_hidden=taps,
                                   host_depths=(0,) * b))
        return time.perf_counter() - start

    @staticmethod
    def _held_positions(held: list[tuple[Taps, tuple[int, ...] | None]], b: int) -> list[list[int]]:
        """Per row, where the positions of the held steps lie in their taps joined on dim 1, oldest first (a plain
        step holds one position a row, a lookup step `counts[r]`)."""
        flat: list[list[int]] = [[] for _ in range(b)]
        offset = 0
        for taps, counts in held:
            for r in range(b):
                flat[r].extend(range(offset, offset + (1 if counts is None else counts[r])))
            offset += taps[0].shape[1]
        return flat

    def _draft(self, cap: int, lookup: bool = False, lapse: bool = False) -> tuple[Proposal, DraftState]:
        """The drafter's proposal of `cap` > 0 drafts per row (`lookup`: the serving gate's lookup step, only the
        drafts that cost no model forward, `DraftState.lookup_only`).

        Compiled, a drafter's step is specialised on its number of drafts (an unrolled loop): asked for each depth
        the gate picks, it would compile a graph per depth in the middle of timed decoding. So under compile it
        drafts all K and `_select` verifies the first `cap` (a prefix of the drafts: exact at any temperature).
        `lapse`: a lookup step without the model's upkeep (`DraftState.lapsed`)."""
        assert self.drafter is not None and self.rows.cache is not None
        asked = self.k if self.forwards.compiled and not lookup else cap  # (a lookup step runs no graph)
        state = self._state(asked, deterministic=self.uses_proposal, lookup=lookup, lapse=lapse)
        proposal = self.drafter.propose(state)
        proposal.check(self.rows.cache.batch_size, asked, self.vocab_size)
        return proposal, state

    def _state(self, num_draft_tokens: int, *, deterministic: bool, lookup: bool = False, lapse: bool = False
               ) -> DraftState:
        """What the drafter reads this round: the rows' state, asking for `num_draft_tokens` drafts each (`lookup`:
        the gate's lookup step, with its costs; `lapse`: without the model's upkeep)."""
        rows = self.rows
        return DraftState(last_tokens=rows.last, seq_lens=rows.seq_lens, active=rows.active,
                          active_rows=rows.active_rows, sampling=rows.sampling, draft_round=rows.draft_round,
                          num_draft_tokens=num_draft_tokens, deterministic=deterministic, all_greedy=rows.all_greedy,
                          seq_len_bound=rows.seq_len_bound(), lookup_only=lookup,
                          lookup_costs=self.gate.lookup_costs if lookup and self.gate is not None else (),
                          lookup_slack=getattr(self.gate, "latency_slack", None) if lookup else None, lapsed=lapse)

    def _select(self, proposal: Proposal, state: DraftState, cap: int) -> tuple[Tensor, int, int]:
        """Per-row depth [B] (0 for idle rows), the verify width n = max depth and the number of verified
        positions sum over active rows of (depth + 1) (host ints). cap: the gate's most drafts per row this step."""
        k, active, active_rows = self.k, self.rows.active, self.rows.active_rows
        raw = self.depth_policy(proposal, state)
        if not isinstance(raw, Tensor) or raw.shape != active.shape or raw.is_floating_point():
            raise ValueError(f"depth policy must return an integer tensor [B] = [{active.shape[0]}], got "
                             f"{getattr(raw, 'dtype', type(raw).__name__)} {tuple(getattr(raw, 'shape', ()))}")
        raw = raw.long()
        capped = cap < k
        if capped:
            raw = raw.clamp(max=cap)
        depth = raw if proposal.lengths is None else torch.minimum(raw, proposal.lengths)
        depth = torch.where(active, depth, 0)
        static = self.static_depth
        if static is not None and capped:
            static = min(static, cap)
        if static is not None:
            if proposal.lengths is None:
                return depth, static, len(active_rows) * (static + 1)
            if proposal.host_lengths is not None:  # the drafter knows its lengths on the host (n-gram lookup)
                kept = [min(static, proposal.host_lengths[r]) for r in active_rows]
                return depth, max(kept), sum(kept) + len(kept)
        # host sync (the second of this step, only for data-dependent depths): the verify width, so that
        # positions no row verifies cost no compute; also lets us check the policy's values.
        masked = torch.where(active, raw, 0)
        kept = torch.where(active, depth + 1, 0).sum()
        lo, hi, width, num_keep = torch.stack([masked.min(), masked.max(), depth.max(), kept]).tolist()
        if lo < 0 or hi > k:
            raise ValueError(f"depth policy returned depths in [{lo}, {hi}]; they must lie in [0, K={k}]")
        return depth, width, num_keep

    def _protocol(self, proposal: Proposal) -> VerifyProtocol:
        """The step's verification protocol (docs/design.md trap 1); refuses a proposal it cannot verify exactly.

        "greedy" when every active row is greedy; "deterministic" when the drafts are deterministic or the depth
        policy reads this round's proposal (exact for any depth, even one computed from this round's drafts);
        else "speculative", which is exact only if nothing that bounds the depth depends on the sampled drafts.
        The engine cannot tell when a drafter fixed `Proposal.lengths`, so under standard sampling it refuses
        lengths altogether: a per-row cap known before sampling belongs in the depth policy (`uses_proposal =
        False`, depths from `DraftState` and earlier steps only)."""
        if self.rows.all_greedy:
            return "greedy"
        if proposal.deterministic or self.uses_proposal:
            return "deterministic"
        name = type(self.drafter).__name__
        if proposal.probs is None:
            raise ValueError(f"{name} proposed sampled drafts (deterministic=False) without probs [B, K, V]; "
                             "standard speculative sampling needs the draft distributions")
        if proposal.lengths is not None:
            raise ValueError(f"{name} proposed sampled drafts with per-row lengths, but standard speculative sampling "
                             "is exact only if no depth depends on the sampled drafts (docs/design.md trap 1): "
                             "return lengths=None for sampled drafts (end proposals early only when "
                             "DraftState.deterministic or all_greedy asks for argmax drafts), or cap depths in a "
                             "depth policy that reads only DraftState")
        return "speculative"

    def _verify(self, protocol: VerifyProtocol, proposal: Proposal, depth: Tensor, width: int, num_keep: int,
                bound: int, make_taps: bool = True) -> tuple[VerifyOutput, Taps]:
        """The target forward over [last, drafts] [B, n+1] and the verification of the drafts -> (VerifyOutput:
        tokens [B, n+1], num_accepted [B]; the drafter's taps). bound: the longest active row's committed length;
        `make_taps` False: where no row verifies a draft, AR's decode forward, and no taps."""
        rows, fwd = self.rows, self.forwards
        cache = rows.cache
        assert cache is not None
        if width == 0:
            # No row verifies a draft (no n-gram match, the gate skipped drafting, the policy chose depth 0): the
            # decode forward with the taps, its token chosen as an AR step chooses it (the same noise key as verifying
            # zero drafts), without the verification sampler's checks and scans over zero drafts.
            logits, taps = self._one_token(bound, make_taps)
            chosen = choose(logits, rows.sampling, rows.seq_lens, protocol == "greedy")  # [B]
            return VerifyOutput(chosen[:, None], torch.zeros_like(rows.seq_lens)), taps
        tokens = torch.cat([rows.last[:, None], proposal.tokens[:, :width]], dim=1)  # [B, n+1]
        greedy, kv_len = protocol == "greedy", bound + width
        if self.dense_verify and num_keep < cache.batch_size * (width + 1):
            # Ragged or idle rows: pack the kept positions (at least two, since width >= 1).
            args = (tokens, cache, kv_len, depth, rows.active, num_keep)
            if greedy:
                v_tokens, v_accepted, taps = fwd.greedy_packed_verify(*args)
                return VerifyOutput(v_tokens, v_accepted), taps
            logits, taps = fwd.packed_verify(*args)
        elif greedy:
            v_tokens, v_accepted, taps = fwd.greedy_verify(tokens, cache, kv_len, depth)
            return VerifyOutput(v_tokens, v_accepted), taps
        else:
            logits, taps = fwd.verify(tokens, cache, kv_len)
        return self._accept(protocol, proposal, tokens[:, 1:], logits, depth, width), taps

    def _accept(self, protocol: VerifyProtocol, proposal: Proposal, drafts: Tensor, logits: Tensor, depth: Tensor,
                width: int) -> VerifyOutput:
        """drafts [B, n], logits [B, n+1, V] -> VerifyOutput(tokens [B, n+1], num_accepted [B]) by `protocol`."""
        if protocol == "greedy":
            return verify_greedy(drafts, logits, depth)
        s, seq_lens = self.rows.sampling, self.rows.seq_lens
        probs = process_logits(logits, s.temperature, s.top_k, s.top_p, filtering=s.filtering)  # [B, n+1, V]
        if protocol == "deterministic":
            return verify_deterministic(drafts, probs, depth, s.seeds, seq_lens)
        assert proposal.probs is not None  # _protocol checked it
        return verify_speculative(drafts, proposal.probs[:, :width], probs, depth, s.seeds, seq_lens)

    def _commit(self, v: VerifyOutput, taps: Taps, depth: Tensor, old_len: Tensor | None, clock: PhaseClock,
                lapse: bool = False) -> tuple[list[int], list[int], tuple[object, object]]:
        """Keep each active row's accepted drafts and the target's token: roll the cache back to them (trap 4), move
        the rows' state on, emit on the host, tell the drafter. old_len [B]: cache lengths before the forward, None
        when it verified no drafts; `lapse`: a lookup step without the model's upkeep (its taps are held, the
        rows' `draft_round` waits for the catch-up, only the lookup is told) -> (accepted, depths) per active row, and
        the span of the drafter's on_commit."""
        rows = self.rows
        cache, acc, width = rows.cache, v.num_accepted, v.tokens.shape[1] - 1
        assert cache is not None and self.drafter is not None
        host_tokens: list[tuple[int, ...]]
        host_depths = [0] * cache.batch_size
        if old_len is None:  # one token per active row, nothing to roll back
            rows.seq_lens = rows.seq_lens + rows.active_long
            rows.last = v.tokens[:, 0]
            host_tokens = rows.one_each(rows.last.tolist())  # host sync: once per step
        else:
            host_tokens = [()] * cache.batch_size
            cache.truncate(torch.where(rows.active, old_len + acc + 1, old_len))
            rows.seq_lens = torch.where(rows.active, rows.seq_lens + acc + 1, rows.seq_lens)
            rows.last = v.tokens.gather(1, acc[:, None])[:, 0]
            payload = torch.cat([v.tokens, acc[:, None], depth[:, None]], dim=1).tolist()  # host sync: once per step
            for r in rows.active_rows:
                host_tokens[r] = tuple(payload[r][: payload[r][width + 1] + 1])
                host_depths[r] = payload[r][width + 2]
        if lapse:  # (before `emit`: where each row's context stops)
            self._hold(taps, tuple(len(t) for t in host_tokens))
        else:
            rows.draft_round += rows.active_long
        rows.emit(host_tokens)
        t = clock.mark()
        if lapse:
            self.drafter.on_lookup_commit(host_tokens, host_depths)
        else:
            self.drafter.on_commit(Commit(tokens=v.tokens, num_accepted=acc, seq_lens=rows.seq_lens,
                                          active=rows.active, host_tokens=tuple(host_tokens), target_hidden=taps,
                                          host_depths=tuple(host_depths)))
        accepted = [len(host_tokens[r]) - 1 for r in rows.active_rows]
        return accepted, [host_depths[r] for r in rows.active_rows], (t, clock.mark())
