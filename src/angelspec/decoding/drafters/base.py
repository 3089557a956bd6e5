"""The drafter interface and the registry entry point.

A drafter proposes K tokens per row for a batch of rows and is told what the target committed; it never
owns the target. What flows between the engine and a drafter, once per speculative step:

    engine                                   drafter
    DraftState (last token, lengths, ...) -> propose()  -> Proposal(tokens [B, K], probs, confidences, ...)
    depth policy (Proposal, DraftState)   -> depth [B]  (how many drafts each row verifies; decoding/policies/)
    target verify forward, verification
    Commit (tokens, num_accepted, ...)    -> on_commit()   (roll the drafter's own cache back: docs/design.md trap 4)

A model drafter's context upkeep (the newly committed positions' taps into its own cache) is needed only by the
next round that drafts, so `on_commit` may just keep the commit (`PendingCommits`) and `propose` catch up first:
a round the speculation gate skips (K = 0) then costs the drafter nothing, and a run of skipped rounds is caught up
in one batched pass.

Rows are KV-cache slots. A request joins a free row (`prefill`) and leaves it (`reset_rows`) between steps.
A drafter that wants target hidden states lists tap ids in `target_layer_ids` (id i = output of target
decoder layer i, docs/design.md trap 2); the engine hands the taps of the prefill and verify forwards over.

A drafter family is one record in `angelspec.decoding.drafters.families` (`get_family(name)`).

Shape legend: B batch rows, K draft depth, T tokens in one forward, P prompt length, V vocab, D model dim.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from angelspec.decoding.sampling import BatchSampling
from angelspec.models.config import DecoderConfig
from angelspec.models.linear import lay_out_weights as lay_out_linear_weights


class DrafterMismatchError(ValueError):
    """The drafter was built for another target or tokenizer; raised before any decoding."""


@dataclass(frozen=True)
class DraftState:
    """What a drafter may read when proposing. Device tensors cover every row; inactive rows hold garbage
    and their drafts are never verified."""

    last_tokens: Tensor  # [B] int64, newest committed token per row; the target has not cached it yet
    seq_lens: Tensor  # [B] int64, committed tokens per row including last_tokens (at position seq_lens - 1)
    active: Tensor  # [B] bool, rows that hold a running request
    active_rows: tuple[int, ...]  # the same on the host, ascending
    sampling: BatchSampling  # per-row temperature / top-k / top-p / seed
    draft_round: Tensor  # [B] int64, speculative steps this row's request has run (keys NoiseStream.DRAFT)
    num_draft_tokens: int  # K, the number of drafts to propose per row
    deterministic: bool  # True: the engine verifies with the deterministic-draft protocol; propose argmaxes
    all_greedy: bool  # host flag: every active row decodes at temperature 0
    seq_len_bound: int  # host upper bound of seq_lens over active rows (for `kv_len`)
    # True: propose only drafts that cost no model forward (n-gram lookup), none where there are none; asked only of
    # a drafter with `lookup_drafts` (the serving gate's lookup steps)
    lookup_only: bool = False
    # With lookup_only: the model's context is left behind this round (a step without upkeep): the model is not
    # asked for a round, the commit goes to `on_lookup_commit`, and the model catches up in `on_catch_up`
    lapsed: bool = False
    # With lookup_only: what the step costs verifying m = 0, 1, ... drafts in all (every row's together) against one
    # verifying none (the serving gate's, from the lookup steps it timed). The rows verify the drafts that make the
    # step's expected committed tokens per unit of cost highest, none where no number of drafts is expected to beat a
    # plain step; () verifies every match to K.
    lookup_costs: tuple[float, ...] = ()
    # With lookup_costs: how much a request may be slowed by waiting on the other rows' drafts, as a share of its time
    # per output token counted in those costs (the serving gate's `latency_slack`); None: no bound
    lookup_slack: float | None = None


@dataclass(frozen=True)
class Proposal:
    """K drafts per row and what the drafter knows about them.

    tokens: [B, K] int64, valid token ids everywhere (pad unused positions with any id, e.g. 0): they are
        fed to the target embedding even where they are not verified.
    probs: [B, K, V] float or None, the distributions the drafts were *sampled* from; needed by standard
        speculative sampling, None for deterministic drafts.
    confidences: [B, K] float in [0, 1] or None, the drafter's belief that each draft is right (for depth
        policies such as D-cut); per position, not cumulative.
    lengths: [B] int64 or None, drafts per row worth verifying (the rest is padding); a row verifies at most
        its length. None = K. A length chosen after sampling (e.g. an early stop on a sampled draft's
        confidence) is correlated with the sampled tokens and would bias standard speculative sampling
        (docs/design.md trap 1), and the engine cannot see when a length was fixed. So lengths are allowed only
        where verification is exact for any depth: deterministic drafts, a depth policy with `uses_proposal`,
        or all-greedy steps. With sampled drafts under standard speculative sampling the engine refuses them
        (ValueError); propose argmax drafts when `DraftState.deterministic` / `all_greedy` ask for them, and
        put caps known before sampling in the depth policy instead.
    deterministic: True when the drafts are a deterministic function of the committed prefix (an argmax or
        a lookup), which makes the deterministic-draft protocol exact under any depth policy.
    host_lengths: the same values as `lengths`, on the host, when the drafter has them there (the n-gram lookup
        computes them in Python): with a fixed depth policy the engine then sizes the verify forward without reading
        `lengths` back from the device. They must equal `lengths` (a wrapper that changes `lengths` drops them).
    """

    tokens: Tensor
    probs: Tensor | None = None
    confidences: Tensor | None = None
    lengths: Tensor | None = None
    deterministic: bool = False
    host_lengths: tuple[int, ...] | None = None

    def check(self, batch_size: int, k: int, vocab_size: int) -> None:
        """Shape checks only (reading values would be a host sync)."""
        if self.tokens.shape != (batch_size, k) or self.tokens.dtype != torch.int64:
            raise ValueError(f"Proposal.tokens must be int64 [B, K] = [{batch_size}, {k}], "
                             f"got {self.tokens.dtype} {tuple(self.tokens.shape)}")
        if self.probs is not None and self.probs.shape != (batch_size, k, vocab_size):
            raise ValueError(f"Proposal.probs must be [B, K, V] = [{batch_size}, {k}, {vocab_size}], "
                             f"got {tuple(self.probs.shape)}")
        if self.confidences is not None and self.confidences.shape != (batch_size, k):
            raise ValueError(f"Proposal.confidences must be [B, K] = [{batch_size}, {k}], "
                             f"got {tuple(self.confidences.shape)}")
        if self.lengths is not None and self.lengths.shape != (batch_size,):
            raise ValueError(f"Proposal.lengths must be [B] = [{batch_size}], got {tuple(self.lengths.shape)}")
        if self.host_lengths is not None and (self.lengths is None or len(self.host_lengths) != batch_size):
            raise ValueError(f"Proposal.host_lengths must come with lengths and hold B = {batch_size} values, got "
                             f"{len(self.host_lengths)} with lengths {'absent' if self.lengths is None else 'given'}")


@dataclass(frozen=True)
class Commit:
    """What the target committed in one speculative step."""

    tokens: Tensor  # [B, T] int64, accepted drafts then the recovered/bonus token, then PLACEHOLDER_TOKEN_ID
    num_accepted: Tensor  # [B] int64; each active row committed num_accepted + 1 tokens
    seq_lens: Tensor  # [B] int64, committed lengths after this step (inactive rows unchanged)
    active: Tensor  # [B] bool, rows that took part
    host_tokens: tuple[tuple[int, ...], ...]  # per row, the committed tokens on the host (() if inactive)
    target_hidden: tuple[Tensor, ...]  # one [B, T, D] per id in target_layer_ids, from the verify forward
    host_depths: tuple[int, ...] = ()  # per row, the drafts verified this step (0: inactive, or nothing verified)
    # tokens, num_accepted and target_hidden are this step's own tensors, never written again: a drafter may keep
    # them past `on_commit` (`PendingCommits`). seq_lens and active are the engine's buffers, which it updates in
    # place when rows join or leave: copy what you keep of them.

    def new_counts(self) -> tuple[Tensor, list[int] | None]:
        """Per row, the positions this step committed (num_accepted + 1 where active, else 0): [B] int64 on the
        device, and the same on the host from `host_tokens` (None when they do not cover every row)."""
        count = torch.where(self.active, self.num_accepted + 1, 0)
        host = [len(t) for t in self.host_tokens] if len(self.host_tokens) == self.active.shape[0] else None
        return count, host


class Drafter(ABC):
    """Base class of all drafters. Subclasses set the class attributes they need and implement `propose`.

    Life cycle inside `SpecEngine.generate`: `allocate(B, max_len, ...)` once, then per request
    `prefill(rows, ...)` when it joins a row, `propose` / `on_commit` every step, `reset_rows` when it leaves.
    """

    # Tap ids of the target whose hidden states the drafter wants (id i = output of target layer i).
    target_layer_ids: tuple[int, ...] = ()
    # True when the drafter's context is built from what the target committed (tokens, taps), never from its own
    # drafts, so a round of 0 drafts may be followed by a commit of any width and drafts of another drafter may be
    # verified in its place (`HybridDrafter`). A draft LM caches its own drafts: False.
    context_from_commits: bool = False
    # True when `DraftState.lookup_only` can be honoured: the drafter also drafts without a model forward (a model
    # drafter with n-gram lookup in front, `HybridDrafter`)
    lookup_drafts: bool = False
    # (Drafters with `context_from_commits`.) How many of the newest committed positions the drafter needs to draft
    # well again after steps that left its context behind (`on_catch_up`); the positions before them may be left
    # out, and its context then runs on across the gap (its cache slots, which are its positions, follow on). None:
    # it needs every missed position.
    resume_window: int | None = None

    @property
    def vocab_size(self) -> int | None:
        """Token-id space the drafter proposes in; None = any (e.g. copied from the prompt)."""
        return None

    @property
    def eos_token_ids(self) -> tuple[int, ...] | None:
        """Special tokens the drafter was trained with; None = no claim."""
        return None

    @property
    def target_fingerprint(self) -> str | None:
        """`DecoderConfig.fingerprint()` of the target the drafter was trained for; None = no claim."""
        return None

    @property
    def max_positions(self) -> int | None:
        """Longest sequence the drafter can handle; None = unlimited."""
        return None

    @property
    def trained_depth(self) -> int | None:
        """The number of drafts per step the drafter was trained to propose (a block drafter's block size - 1, an
        MTP / EAGLE-3 model's depth count): the K every command drafts unless told otherwise. None = no trained
        depth (n-gram lookup, the draft LM: `DEFAULT_NUM_DRAFT_TOKENS`)."""
        return None

    @property
    def max_draft_tokens(self) -> int | None:
        """The most drafts one proposal can hold (a block drafter's block size - 1); None = no bound of its own."""
        return None

    def check_depth(self, k: int) -> None:
        """Raise DrafterMismatchError when this drafter cannot propose `k` drafts per step (above
        `max_draft_tokens`); K's own range is `limits.check_num_draft_tokens`."""
        bound = self.max_draft_tokens
        if bound is not None and not 0 <= k <= bound:
            raise DrafterMismatchError(f"{type(self).__name__} proposes at most {bound} drafts per step, but {k} "
                                       f"were asked for: set num_draft_tokens <= {bound}")

    def check_compatible(self, target: DecoderConfig, max_seq_len: int | None = None) -> None:
        """Raise DrafterMismatchError if this drafter cannot serve `target`; called before any decoding."""
        name = type(self).__name__
        if self.vocab_size is not None and self.vocab_size != target.vocab_size:
            raise DrafterMismatchError(
                f"{name} has vocab size {self.vocab_size} but the target has {target.vocab_size}: the drafter "
                "was built for another tokenizer")
        eos = self.eos_token_ids
        if eos is not None and target.eos_token_ids and set(eos) != set(target.eos_token_ids):
            raise DrafterMismatchError(
                f"{name} was trained with eos/special token ids {sorted(eos)} but the target uses "
                f"{sorted(target.eos_token_ids)}: the drafter was built for another tokenizer")
        fp = self.target_fingerprint
        if fp is not None and fp != target.fingerprint():
            raise DrafterMismatchError(
                f"{name} was trained for a target with config fingerprint {fp}, but this target's is "
                f"{target.fingerprint()}: train or pick a drafter for this target")
        for i in self.target_layer_ids:
            if not 0 <= i < target.num_hidden_layers:
                raise DrafterMismatchError(
                    f"{name} wants target layer {i}, but the target has layers 0..{target.num_hidden_layers - 1}")
        if max_seq_len is not None and self.max_positions is not None and self.max_positions < max_seq_len:
            raise DrafterMismatchError(
                f"{name} handles at most {self.max_positions} positions but the engine may need {max_seq_len}; "
                "lower EngineConfig.max_seq_len")

    def allocate(self, batch_size: int, max_len: int, *, device: torch.device, slack: int) -> None:  # noqa: B027
        """Allocate per-row state for `batch_size` rows of up to `max_len` committed tokens (+ `slack`)."""

    @abstractmethod
    def prefill(self, rows: Sequence[int], prompts: Sequence[Sequence[int]], first_tokens: Sequence[int],
                target_hidden: tuple[Tensor, ...]) -> None:
        """Requests joined `rows`: their prompts were prefilled by the target, which then emitted
        `first_tokens` (so each row's committed sequence is prompt + [first_token]).
        target_hidden: one [n, P_max, D] per tap id, prompts right-padded, rows in the order of `rows`."""

    @abstractmethod
    def propose(self, state: DraftState) -> Proposal:
        """Propose `state.num_draft_tokens` drafts for every row (see `Proposal`). A round of 0 drafts (the
        speculation gate skipped drafting) may come between ordinary rounds: propose nothing and keep whatever
        state the following `on_commit` (one committed token per active row) needs."""

    @abstractmethod
    def on_commit(self, commit: Commit) -> None:
        """The target committed `commit`; roll back any draft state past the committed tokens. Work on the new
        positions may wait for the next `propose` that drafts (`PendingCommits`): until then the drafter holds the
        commits, and it must catch up before rows change (`prefill`, `reset_rows`) and drop them in `allocate`."""

    def on_lookup_commit(self, host_tokens: Sequence[Sequence[int]], host_depths: Sequence[int] = ()) -> None:
        """(Drafters with `lookup_drafts`.) A step that left the model's context behind (the engine's steps without
        upkeep: plain steps and lookup steps while the serving gate has the model off) committed `host_tokens` per
        row (() for idle rows), after verifying `host_depths` lookup drafts (() or zeros: none): keep the lookup's
        history current; the model gets these positions later, in `on_catch_up`. Called in engines that may run
        lookup steps (`ServingGate.lookup_engine`); elsewhere the lookup's history lapses with the model's context and
        `on_catch_up` brings both up to date, after this call with the tokens of the positions it leaves out
        (`resume_window`)."""
        raise NotImplementedError(f"{type(self).__name__} drafts no lookup drafts (lookup_drafts is False)")

    def lookup_depths(self, active_rows: Sequence[int], batch_size: int, k: int, costs: Sequence[float] = (),
                      slack: float | None = None) -> tuple[int, ...]:
        """(Drafters with `lookup_drafts`.) Per row of the batch, the drafts a lookup step (`DraftState.lookup_only`
        with k drafts, these `lookup_costs` and this `lookup_slack`) would verify now, 0 for rows that would verify
        none: asked before the round, so that a step where no row would verify anything runs as a plain one."""
        raise NotImplementedError(f"{type(self).__name__} drafts no lookup drafts (lookup_drafts is False)")

    def on_catch_up(self, commit: Commit) -> None:
        """The positions the steps without upkeep committed since the drafter's context stopped, in one commit after a
        round of zero drafts (the engine's `Step._resync`; only for drafters with `context_from_commits`): every one of
        them, or with `resume_window` set at least the newest `resume_window` of them (a drafter with lookup drafts was
        given the tokens before those through `on_lookup_commit` first). Default: `on_commit`. A drafter with lookup
        drafts hands them to its model, and to its lookup where the lookup's history lapsed too (only steps of engines
        that may run lookup steps call `on_lookup_commit`)."""
        self.on_commit(commit)

    def reset_rows(self, rows: Sequence[int]) -> None:  # noqa: B027
        """Requests left `rows`; their state may be dropped."""

    def compile(self) -> None:  # noqa: B027
        """`EngineConfig(compile=True)`: compile the drafter's hot calls (`spec.compiled.try_compile`); its
        weights are frozen from then on. Default: nothing to compile."""

    def lay_out_weights(self, prepack: bool = True) -> None:  # noqa: B027
        """Lay the draft model's linear weights out for few-row GEMMs on a CPU (`models.linear.lay_out_weights`;
        the engine calls it on CPU, before any compile). Default: no model weights."""

    @contextmanager
    def full_depth(self) -> Iterator[None]:
        """Inside, every proposal has all K drafts: what calibration and cost profiling must observe. A drafter that
        ends a proposal early (the draft LM's `stop_below`) or drafts only some rows (the n-gram lookup) switches
        that off here and back on after. Default: proposals are always full."""
        yield

    def ensure_compiled(self) -> None:
        """`compile()` once per drafter: engines may share one."""
        if not self.__dict__.get("_compiled", False):
            self.compile()
            self._compiled = True


class ModelConfigDrafter(Drafter):
    """A drafter around a trained draft model (`self.model`) whose config records the vocabulary, the target it
    was trained for and its position limit; those properties are read from it."""

    model: Any

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    def lay_out_weights(self, prepack: bool = True) -> None:
        lay_out_linear_weights(self.model, prepack)

    @property
    def target_fingerprint(self) -> str | None:
        return self.model.config.target_fingerprint

    @property
    def max_positions(self) -> int:
        return self.model.config.max_position_embeddings


class WrappedDrafter(Drafter):
    """A drafter around another one (`inner`) that changes what `propose` returns and delegates the rest: the
    inner drafter's identity (vocabulary, target, position limit, taps), its life cycle and its compiled calls."""

    def __init__(self, inner: Drafter) -> None:
        self.inner = inner
        self.target_layer_ids = inner.target_layer_ids
        self.context_from_commits = inner.context_from_commits
        self.lookup_drafts = inner.lookup_drafts
        self.resume_window = inner.resume_window

    @property
    def vocab_size(self) -> int | None:
        return self.inner.vocab_size

    @property
    def eos_token_ids(self) -> tuple[int, ...] | None:
        return self.inner.eos_token_ids

    @property
    def target_fingerprint(self) -> str | None:
        return self.inner.target_fingerprint

    @property
    def max_positions(self) -> int | None:
        return self.inner.max_positions

    @property
    def trained_depth(self) -> int | None:
        return self.inner.trained_depth

    @property
    def max_draft_tokens(self) -> int | None:
        return self.inner.max_draft_tokens

    def check_depth(self, k: int) -> None:
        self.inner.check_depth(k)

    def check_compatible(self, target: DecoderConfig, max_seq_len: int | None = None) -> None:
        self.inner.check_compatible(target, max_seq_len)

    def allocate(self, batch_size: int, max_len: int, *, device: torch.device, slack: int) -> None:
        self.inner.allocate(batch_size, max_len, device=device, slack=slack)

    def prefill(self, rows: Sequence[int], prompts: Sequence[Sequence[int]], first_tokens: Sequence[int],
                target_hidden: tuple[Tensor, ...]) -> None:
        self.inner.prefill(rows, prompts, first_tokens, target_hidden)

    def on_commit(self, commit: Commit) -> None:
        self.inner.on_commit(commit)

    def on_lookup_commit(self, host_tokens: Sequence[Sequence[int]], host_depths: Sequence[int] = ()) -> None:
        self.inner.on_lookup_commit(host_tokens, host_depths)

    def lookup_depths(self, active_rows: Sequence[int], batch_size: int, k: int, costs: Sequence[float] = (),
                      slack: float | None = None) -> tuple[int, ...]:
        return self.inner.lookup_depths(active_rows, batch_size, k, costs, slack)

    def on_catch_up(self, commit: Commit) -> None:
        self.inner.on_catch_up(commit)

    def reset_rows(self, rows: Sequence[int]) -> None:
        self.inner.reset_rows(rows)

    def lay_out_weights(self, prepack: bool = True) -> None:
        self.inner.lay_out_weights(prepack)

    @contextmanager
    def full_depth(self) -> Iterator[None]:
        with self.inner.full_depth():
            yield

    def compile(self) -> None:
        self.inner.ensure_compiled()  # engines may share the inner drafter: compile its hot calls once


def unwrap(drafter: Drafter) -> Drafter:
    """The drafter a `WrappedDrafter` (a calibration wrapper) wraps, else `drafter` itself."""
    return drafter.inner if isinstance(drafter, WrappedDrafter) else drafter


class PendingCommits:
    """Committed positions a drafter was told about (`on_commit`) but has not yet added to its context.

    Why: appending a commit's taps to a drafter's cache is only needed by the next round that drafts. Kept here
    instead, `on_commit` returns at once, a round the speculation gate skipped (K = 0) costs the drafter nothing,
    and the next drafted round catches up on every waiting commit in ONE batched append (per-call overhead, not
    arithmetic, bounds these small appends on a CPU).

    Each commit adds per-row tensors [B, T_j, ...] (time on dim 1) whose first `count_j[b]` entries are new (the
    rest: rejected drafts or idle rows). `take` returns them joined: [B, W, ...] with each row's new entries first,
    in commit order, then padding (whatever the buffer held: read only a row's first `count[b]`), and the total
    counts [B]; one commit comes back as it was added (padded to two columns when it has one: `take`).

    Storage: the first commit after a `take` is kept as it came (the usual case while drafting: one commit a round,
    no copy). From the second on, entries are written into one buffer per tensor, [B, capacity, ...], at each row's
    fill position (one scatter per commit, device ops only), so a long stretch of skipped rounds costs one small
    write per step, whatever its length. W, the joined width, is the longest row's waiting count: exact when the
    callers pass each row's count on the host (`host_count`, which a `Commit` has as its `host_tokens`), else a bound
    that grows by each commit's width. The buffer grows by doubling and is kept between takes (it holds at most
    what a row committed since its last drafted round)."""

    def __init__(self) -> None:
        self._first: tuple[tuple[Tensor, ...], Tensor] | None = None  # the only waiting commit, as it came
        self._bufs: tuple[Tensor, ...] = ()  # per tensor [B, capacity, ...], from the second waiting commit on
        self._row_start = torch.zeros(0, dtype=torch.int64)  # [B] where each row starts in a buffer seen flat
        self._fill: Tensor | None = None  # [B] int64, each row's entries in the buffers
        self._host: list[int] = []  # per row, a host bound of its waiting entries (exact with host counts)
        self._waiting = 0  # commits added since the last take

    def __len__(self) -> int:
        return self._waiting

    def add(self, tensors: Sequence[Tensor], count: Tensor, host_count: Sequence[int] | None = None) -> None:
        """One commit: tensors [B, T, ...] (the same T), count [B] int64 new entries per row (0: none); host_count:
        the same counts on the host, if the caller has them (a tighter joined width, no host sync either way)."""
        tensors = tuple(tensors)
        b, width = tensors[0].shape[:2]
        new = list(host_count) if host_count is not None else [width] * b
        if len(new) != b or (new and (min(new) < 0 or max(new) > width)):
            raise ValueError(f"PendingCommits.add: host_count must give 0..{width} for each of {b} rows, got {new}")
        if not self._waiting:
            self._first, self._host, self._waiting = (tensors, count), new, 1
            return
        if self._first is not None:  # a second commit: the first moves into the buffers
            first, first_count = self._first
            self._first = None
            self._reserve(first, first[0].shape[1], keep=False)
            self._fill = torch.zeros(b, dtype=torch.int64, device=count.device)
            self._write(first, first_count)
        self._reserve(tensors, max(h + width for h in self._host))
        self._write(tensors, count)
        self._host = [h + c for h, c in zip(self._host, new, strict=True)]
        self._waiting += 1

    def _reserve(self, like: tuple[Tensor, ...], width: int, keep: bool = True) -> None:
        """Buffers shaped like `like` ([B, T, ...] each) with room for `width` entries per row (doubling); `keep`:
        what the buffers hold waits and moves into the new ones."""
        def shapes(ts: Sequence[Tensor]) -> list[tuple[Any, ...]]:
            return [(t.shape[0], *t.shape[2:], t.dtype, t.device) for t in ts]

        if keep and self._bufs[0].shape[1] >= width:  # the common case: room left (a mismatch fails in `_write`)
            return
        same = bool(self._bufs) and shapes(like) == shapes(self._bufs)
        if same and self._bufs[0].shape[1] >= width:
            return
        if keep and not same:
            raise ValueError("PendingCommits.add: a commit's tensors differ in batch, feature shape, dtype or device "
                             "from the ones waiting (clear() between engines)")
        cap = max(width, 2 * self._bufs[0].shape[1] if same else 16)
        bufs = []
        for i, t in enumerate(like):
            buf = t.new_zeros(t.shape[0], cap, *t.shape[2:])
            if keep:
                old = self._bufs[i]
                buf[:, :old.shape[1]] = old
            bufs.append(buf)
        self._bufs = tuple(bufs)
        self._row_start = torch.arange(like[0].shape[0], device=like[0].device) * cap  # [B] each row's first entry

    def _write(self, tensors: tuple[Tensor, ...], count: Tensor) -> None:
        """Each row's entries of one commit at its fill position (all T columns: the ones past `count` are
        overwritten by the next commit or read as padding), then move the fill on by `count`. One index_copy per
        tensor into the buffer seen as [B * capacity, ...] rows (a gather-free write: the commit's entries are
        contiguous per row)."""
        assert self._fill is not None
        b, width = tensors[0].shape[:2]
        cap = self._bufs[0].shape[1]
        pos = self._fill + self._row_start if width == 1 else \
            ((self._fill + self._row_start)[:, None] + torch.arange(width, device=self._fill.device)).view(-1)  # [B T]
        for buf, t in zip(self._bufs, tensors, strict=True):
            buf.view(b * cap, *buf.shape[2:]).index_copy_(0, pos, t.reshape(b * width, *t.shape[2:]))
        self._fill = self._fill + count

    def clear(self) -> None:
        """Forget everything waiting (and the buffers)."""
        self._first, self._bufs, self._fill, self._host, self._waiting = None, (), None, [], 0

    def drop_rows(self, rows: Sequence[int]) -> None:
        """Forget the waiting entries of `rows` (their requests left: what they committed is no one's context any
        more). Device writes only."""
        rows = list(rows)
        if not self._waiting or not rows:
            return
        idx = torch.as_tensor(rows, dtype=torch.int64, device=self._count_device())
        if self._first is not None:
            tensors, count = self._first
            count = count.clone()
            count[idx] = 0
            self._first = (tensors, count)
        else:
            assert self._fill is not None
            self._fill[idx] = 0  # our own tensor (`_write` makes a new one each commit; `take` hands it over)
        for r in rows:
            self._host[r] = 0

    def _count_device(self) -> torch.device:
        if self._first is not None:
            return self._first[1].device
        assert self._fill is not None
        return self._fill.device

    def take(self) -> tuple[tuple[Tensor, ...], Tensor] | None:
        """Every waiting commit, joined (class docstring), and forget them; None when nothing waits. A width of one
        comes back padded to two (a placeholder column, counts unchanged): torch.compile specialises a size of 1, so
        a catch-up of one position (one gate-skipped step, or a step that verified no draft) would otherwise compile
        a graph of its own the first time it happens, in the middle of a run (seconds, at batch 1)."""
        if not self._waiting:
            return None
        if self._first is not None:
            tensors, count = self._first
            if tensors[0].shape[1] == 1:
                tensors = tuple(torch.cat([t, torch.zeros_like(t)], dim=1) for t in tensors)
            out = (tensors, count)
        else:
            assert self._fill is not None
            width = max(2, max(self._host))
            out = (tuple(buf[:, :width].clone() for buf in self._bufs), self._fill)
        self._first, self._fill, self._host, self._waiting = None, None, [], 0
        return out


@contextmanager
def switched(obj: object, name: str, value: Any) -> Iterator[None]:
    """Set attribute `name` of `obj` to `value` inside the block and restore it after (the `full_depth` switches)."""
    saved = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, saved)


@contextmanager
def full_depth_drafting(drafter: Drafter) -> Iterator[Drafter]:
    """`drafter.full_depth()` as a function: every proposal inside has all K drafts (see `Drafter.full_depth`)."""
    with drafter.full_depth():
        yield drafter
