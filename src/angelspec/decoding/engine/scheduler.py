"""Scheduling: which request runs in which row of the target's static KV cache. Requests are checked and
seeded once per call, join free rows between steps (a prefill of just the joining rows, ragged prompts packed)
and leave them when finished; the rows' device state (newest token, lengths, sampling parameters) is what a
step reads and commits to.

Shape legend: B rows, n joining rows, V vocab.
"""

from __future__ import annotations

import numbers
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from angelspec.decoding.batching import prefill_rows
from angelspec.decoding.drafters.base import Drafter
from angelspec.decoding.engine.types import FinishReason, Request, Result
from angelspec.decoding.metrics import DecodeMetrics, PhaseClock
from angelspec.decoding.sampling import (
    BatchSampling,
    NoiseStream,
    SamplingParams,
    greedy_argmax,
    process_logits,
    sample,
)
from angelspec.models.decoder import Decoder
from angelspec.models.kv_cache import StaticKVCache


def choose(logits: Tensor, s: BatchSampling, counters: Tensor, greedy: bool) -> Tensor:
    """One token per row, as an AR step chooses it: logits [B, V] -> token ids [B]; counters [B] = absolute
    positions of the produced tokens (their noise keys)."""
    if greedy:
        return greedy_argmax(logits)  # same as process_logits' one-hot (ties -> lowest id), minus the sort
    probs = process_logits(logits, s.temperature, s.top_k, s.top_p, filtering=s.filtering)
    return sample(probs, s.seeds, counters, NoiseStream.TARGET)


@dataclass
class Slot:
    """Host-side record of the request running in one row."""

    index: int  # position of the request in the generate() call
    request: Request
    stop: frozenset[int]
    seq_len: int  # committed tokens including the newest one (= cache length + 1)
    tokens: list[int] = field(default_factory=list)
    steps: int = 1  # the prefill emitted the first token
    finish: FinishReason | None = None
    admitted_at: float = 0.0  # perf_counter() at admission
    first_at: float = 0.0  # perf_counter() once the first token is on the host
    # the first position whose taps the drafter has not been given (steps without upkeep, `Step._bare`); None: none
    stale_from: int | None = None
    stale_step: int = 0  # `steps` when stale_from was set: the drafter rounds the row has missed since

    def emit(self, new: Sequence[int]) -> None:
        """Append tokens until a stop token (kept) or max_new_tokens."""
        for t in new:
            self.tokens.append(t)
            if t in self.stop:
                self.finish = "stop"
                return
            if len(self.tokens) >= self.request.max_new_tokens:
                self.finish = "length"
                return


class Scheduler:
    """The rows of one static KV cache and the requests in them.

    Device state per row, read and advanced by the step: `last` [B] newest committed token (the next step's input),
    `seq_lens` [B] committed tokens including `last`, `active` [B] bool and `active_long` [B] (1 / 0: an AR step's
    num_new), `draft_round` [B], `sampling`. Host state: `slots` (one `Slot` or None per row), `active_rows` (rows
    with an unfinished request) and `all_greedy` (every active row at T = 0)."""

    def __init__(self, target: Decoder, drafter: Drafter | None, max_seq_len: int, slack: int,
                 taps: tuple[int, ...], static_cache: bool) -> None:
        self.target, self.drafter, self.max_seq_len, self.slack = target, drafter, max_seq_len, slack
        self.taps, self.static_cache = taps, static_cache  # static_cache: graphs replay the cache's addresses
        self.device = target.embed_tokens.weight.device
        self.cache: StaticKVCache | None = None
        self.slots: list[Slot | None] = []

    def validate(self, requests: list[Request]) -> None:
        v, limit = self.target.config.vocab_size, self.max_seq_len
        for i, r in enumerate(requests):
            if not isinstance(r, Request):
                raise TypeError(f"request {i}: expected a Request, got {type(r).__name__}")
            if not isinstance(r.sampling, SamplingParams):
                raise TypeError(f"request {i}: sampling must be a SamplingParams, got {type(r.sampling).__name__}")
            n = len(r.prompt_ids)
            if n == 0:
                raise ValueError(f"request {i}: empty prompt (at least one token is needed)")
            m = r.max_new_tokens
            if isinstance(m, bool) or not isinstance(m, int) or m <= 0:
                raise ValueError(f"request {i}: max_new_tokens must be an int > 0, got {m!r}")
            if n + m > limit:
                raise ValueError(f"request {i}: prompt of {n} tokens + max_new_tokens {m} = {n + m} tokens exceeds "
                                 f"the limit of {limit} tokens (target context / EngineConfig.max_seq_len)")
            for name, ids in (("prompt", r.prompt_ids), ("stop", r.stop_ids or ())):
                for j, t in enumerate(ids):
                    if isinstance(t, bool) or not isinstance(t, numbers.Integral):
                        raise TypeError(f"request {i}: {name} token at index {j} is a {type(t).__name__}, not an int")
                    if not 0 <= t < v:
                        raise ValueError(f"request {i}: {name} token {t!r} at index {j} is outside the "
                                         f"target vocab [0, {v})")

    @staticmethod
    def resolve_seeds(requests: list[Request], seed: int | None) -> list[int]:
        """Each request's seed: its own, else a draw from `seed` (None: fresh randomness). Host-side, once per call:
        a request's seed must stay fixed across all of its steps."""
        gen = torch.Generator()
        if seed is None:
            gen.seed()
        else:
            gen.manual_seed(seed)
        draws = torch.randint(0, 2**62, (len(requests),), generator=gen).tolist()
        return [r.sampling.seed if r.sampling.seed is not None else d for r, d in zip(requests, draws, strict=True)]

    def setup(self, n_rows: int, max_len: int) -> StaticKVCache:
        """A cache of n_rows rows for sequences up to max_len (kept from the last call when it fits), emptied, and
        every row free."""
        c = self.cache
        if c is None or c.batch_size != n_rows or c.capacity < max_len + self.slack:
            self.cache = None  # free the old buffers before allocating new ones
            self.cache = StaticKVCache(self.target.config, n_rows, max_len, slack=self.slack,
                                       dtype=self.target.embed_tokens.weight.dtype, device=self.device)
            if self.static_cache:
                self.cache.mark_static_address()
        self.cache.reset()
        dev, b = self.device, n_rows
        self.last = torch.zeros(b, dtype=torch.int64, device=dev)
        self.seq_lens = torch.ones(b, dtype=torch.int64, device=dev)
        self.active = torch.zeros(b, dtype=torch.bool, device=dev)
        self.active_long = torch.zeros(b, dtype=torch.int64, device=dev)
        self.draft_round = torch.zeros(b, dtype=torch.int64, device=dev)
        self.sampling = BatchSampling.from_params([SamplingParams(seed=0)] * b, device=dev)
        self.slots = [None] * b
        self.active_rows: tuple[int, ...] = ()
        self.all_greedy = True
        return self.cache

    def free_rows(self) -> list[int]:
        return [r for r, s in enumerate(self.slots) if s is None]

    def seq_len_bound(self) -> int:
        """The longest active row's committed length (a host-side bound for the target's kv_len)."""
        return max(self.slots[r].seq_len for r in self.active_rows)  # type: ignore[union-attr]

    def admit(self, rows: list[int], indices: list[int], requests: list[Request], seeds: list[int],
              metrics: DecodeMetrics, clock: PhaseClock) -> None:
        """Prefill the joining requests into `rows` and emit their first token (billed to the "prefill" phase)."""
        t0, m0 = time.perf_counter(), clock.mark()
        reqs = [requests[i] for i in indices]
        prompts = [list(r.prompt_ids) for r in reqs]
        params = [SamplingParams(r.sampling.temperature, r.sampling.top_k, r.sampling.top_p, seeds[i])
                  for r, i in zip(reqs, indices, strict=True)]
        joiners = BatchSampling.from_params(params, device=self.device)
        idx = torch.tensor(rows, dtype=torch.int64, device=self.device)
        s = self.sampling
        for mine, theirs in ((s.temperature, joiners.temperature), (s.top_k, joiners.top_k),
                             (s.top_p, joiners.top_p), (s.seeds, joiners.seeds)):
            mine[idx] = theirs

        out = prefill_rows(self.target, self.cache, rows, prompts, hidden_layers=self.taps)
        p_lens = torch.tensor([len(p) for p in prompts], dtype=torch.int64, device=self.device)  # [n]
        # The first emitted token sits at position P: that is its noise counter.
        first = choose(out.logits[:, 0], joiners, p_lens, all(p.is_greedy for p in params))  # [n]
        first_host = first.tolist()  # host sync: once per admission
        t_first = time.perf_counter()

        self.last[idx] = first
        self.seq_lens[idx] = p_lens + 1
        self.active[idx] = True
        self.active_long[idx] = 1
        self.draft_round[idx] = 0
        for r, i, req, tok in zip(rows, indices, reqs, first_host, strict=True):
            stop = req.stop_ids if req.stop_ids is not None else self.target.config.eos_token_ids
            slot = Slot(index=i, request=req, stop=frozenset(stop), seq_len=len(req.prompt_ids) + 1,
                        admitted_at=t0, first_at=t_first)
            slot.emit([tok])
            self.slots[r] = slot
        self._refresh_rows()
        if self.drafter is not None:
            self.drafter.prefill(rows, prompts, first_host, out.hidden)
        clock.add(metrics, "prefill", m0, clock.mark())

    def one_each(self, host: Sequence[int]) -> list[tuple[int, ...]]:
        """A step's commit of one token a row as `emit` and the drafter take it: (host[r],) for each active row r, ()
        for idle rows."""
        out: list[tuple[int, ...]] = [()] * len(host)
        for r in self.active_rows:
            out[r] = (host[r],)
        return out

    def emit(self, host_tokens: Sequence[Sequence[int]]) -> None:
        """A step's commit on the host: each active row r appends host_tokens[r] (then its slot stops at a stop
        token or its length limit)."""
        for r in self.active_rows:
            s = self.slots[r]
            assert s is not None
            s.seq_len += len(host_tokens[r])
            s.steps += 1
            s.emit(host_tokens[r])

    def retire(self, t_start: float, metrics: DecodeMetrics) -> list[tuple[int, Result]]:
        """Free the rows whose request finished (in a step or already at admission: a stop token first,
        max_new_tokens == 1) -> (request index in the call, result) each; t_start: perf_counter() at the call."""
        done = [r for r, s in enumerate(self.slots) if s is not None and s.finish is not None]
        results = []
        for r in done:
            s = self.slots[r]
            assert s is not None and s.finish is not None
            request_id = s.index if s.request.request_id is None else s.request.request_id
            results.append((s.index, Result(request_id=request_id, token_ids=s.tokens, finish_reason=s.finish,
                                            num_steps=s.steps, prompt_len=len(s.request.prompt_ids),
                                            queued_s=s.admitted_at - t_start,
                                            latency_s=time.perf_counter() - s.admitted_at,
                                            first_token_s=s.first_at - s.admitted_at)))
            metrics.output_tokens += len(s.tokens)
            self.slots[r] = None
        if done:
            self._release(done)
        return results

    def _release(self, rows: list[int]) -> None:
        idx = torch.tensor(rows, dtype=torch.int64, device=self.device)
        self.active[idx] = False
        self.active_long[idx] = 0
        # Freed rows decode greedily as padding, so they never force the sampling path.
        self.sampling.temperature[idx] = 0.0
        self._refresh_rows()
        if self.drafter is not None:
            self.drafter.reset_rows(rows)

    def _refresh_rows(self) -> None:
        self.active_rows = tuple(r for r, s in enumerate(self.slots) if s is not None and s.finish is None)
        self.all_greedy = all(self.slots[r].request.sampling.is_greedy  # type: ignore[union-attr]
                              for r in self.active_rows)
        # `process_logits(filtering=False)` skips the sort when no row's sampling parameters filter. Freed rows decode
        # greedily; a row that finished at admission keeps its parameters until it is freed, so it counts.
        filtering = any(s.request.sampling.filters for s in self.slots if s is not None)
        if filtering != self.sampling.filtering:
            self.sampling = replace(self.sampling, filtering=filtering)
