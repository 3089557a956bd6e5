"""The batched decoding engine: plain autoregressive generation (no drafter) and lossless speculative
decoding (draft -> choose depth -> one target forward -> verify -> commit), both with continuous batching.

Rows and requests
-----------------
`generate(requests)` runs a queue of requests over at most `max_batch_size` rows, each row a slot of one
static KV cache. Between steps, finished requests leave their rows and queued ones join them (a prefill
of just the joining rows, ragged prompts padded and masked). A row's committed sequence is
prompt + emitted tokens; the target cache holds every committed token but the newest ("last"), which is
the input of the next step:

    AR step           input [B, 1] = last            -> one logits row -> one token per row
    speculative step  input [B, n+1] = last, d_1..d_n -> verify -> num_accepted + 1 tokens per row,
                      then cache.truncate(old_len + num_accepted + 1) (rows keep exactly what they committed)

Stop tokens are INCLUDED in `Result.token_ids` (finish_reason "stop"); max_new_tokens truncates
(finish_reason "length"). A stop token or the length limit inside an accepted block truncates the block.

Randomness and batch independence
---------------------------------
Every random number comes from one counter-based hash (`sampling.uniform_noise` for accept coins,
`sampling.exponential_noise`, float32, for token draws), keyed by (request seed, absolute position of the
produced token, stream): a request draws the same tokens alone or in any batch at any row. An AR step and
a depth-0 speculative step draw the same token for the same request (see `sampling`'s docstring).

Verification protocol (docs/design.md trap 1), chosen per step on the host:
* every active row greedy             -> greedy acceptance on raw logits (exact by construction), inside the
  verify forward's call (`sampling.greedy_accept`, the rule `verify_greedy` checks its arguments for);
* drafts deterministic, or the depth policy reads this round's drafts -> `verify_deterministic`
  (exact for any depth choice);
* otherwise                           -> `verify_speculative` with the drafter's probabilities; a proposal
  that also carries per-row `lengths` is refused here (they could depend on the sampled drafts).

Cost notes
----------
Shapes are static within a step and the hot loop has ONE host sync per step: the step's tokens (and, for
speculative steps, num_accepted and depth) are copied to the host to learn which rows finished. A depth
policy whose depths depend on data, or per-row `Proposal.lengths` without their host copy (`host_lengths`), add a
second sync (the verify width, so pruned positions cost no compute). Host-side upper bounds of row lengths give the
target its `kv_len`, so attention only reads the slots in use. Idle rows (queue drained, others still running) are
still computed: they are masked, not removed.

Shape legend: B rows, T tokens per forward, K draft depth, n verify width (<= K), V vocab, D model dim.
"""

from __future__ import annotations

import numbers
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import torch
from torch import Tensor
from tqdm.auto import tqdm

from angelspec.decoding.batching import prefill_rows
from angelspec.decoding.compiled import static_attention, try_compile
from angelspec.decoding.drafters.base import Commit, Drafter, DraftState, Proposal
from angelspec.decoding.metrics import DecodeMetrics, PhaseClock
from angelspec.decoding.policies.base import FixedDepth, policy_static_depth, policy_uses_proposal
from angelspec.decoding.policies.gate import ServingGate, SpecGate
from angelspec.decoding.sampling import (
    BatchSampling,
    NoiseStream,
    SamplingParams,
    VerifyOutput,
    greedy_accept,
    greedy_argmax,
    process_logits,
    sample,
    verify_deterministic,
    verify_greedy,
    verify_speculative,
)
from angelspec.models.decoder import Decoder, DecoderOutput
from angelspec.models.kv_cache import StaticKVCache
from angelspec.models.linear import transpose_weights

FinishReason = Literal["stop", "length"]
VerifyProtocol = Literal["greedy", "deterministic", "speculative"]
DepthPolicyFn = Callable[[Proposal, DraftState], Tensor]


@dataclass(frozen=True)
class VerifyEvent:
    """What one speculative step verified, handed to `SpecEngine(on_verify=...)` observers (calibration data,
    step timing). Device tensors; reading them is a host sync the observer pays for."""

    proposal: Proposal  # the drafter's proposal as proposed (confidences before any depth policy)
    depth: Tensor  # [B] int64, drafts each row verified (0 for idle rows)
    num_accepted: Tensor  # [B] int64, drafts accepted per row (a prefix of the verified ones)
    active: Tensor  # [B] bool, rows that took part (a copy: the engine reuses its own buffer)


@dataclass(frozen=True)
class Request:
    """One generation request. stop_ids None = the target's eos ids; () = stop on length only."""

    prompt_ids: Sequence[int]
    max_new_tokens: int = 256
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_ids: tuple[int, ...] | None = None
    request_id: Any = None


@dataclass(frozen=True)
class Result:
    request_id: Any  # Request.request_id, or the request's index when that was None
    token_ids: list[int]  # emitted tokens; ends with the stop token when finish_reason == "stop"
    finish_reason: FinishReason
    num_steps: int  # target forwards that emitted this request's tokens (its prefill included)
    prompt_len: int
    queued_s: float = field(default=0.0, compare=False)  # generate() call to admission (wall seconds)
    latency_s: float = field(default=0.0, compare=False)  # admission to last token (per-user speed = tokens / this)
    first_token_s: float = field(default=0.0, compare=False)  # admission to the first token (its prefill)

    @property
    def time_per_output_token_s(self) -> float:
        """Seconds per token after the first (TPOT); 0.0 for a single token."""
        n = len(self.token_ids) - 1
        return (self.latency_s - self.first_token_s) / n if n > 0 else 0.0

    @property
    def tokens_per_step(self) -> float:
        return len(self.token_ids) / self.num_steps


@dataclass(frozen=True)
class EngineConfig:
    """max_batch_size: concurrency limit (KV-cache rows). max_seq_len: longest prompt + max_new_tokens a
    request may have (None = the target's max_position_embeddings). num_draft_tokens: K, drafts proposed
    per row per step (ignored without a drafter). dtype: the dtype the target must already have (None = any;
    the engine never casts the caller's model). seed: seeds requests whose SamplingParams.seed is None
    (None = fresh randomness per call). compile: torch.compile the AR decode step, or with a drafter the
    verify forward (padded and packed) and whatever the drafter compiles (`Drafter.compile`); the first calls pay the
    compilation, about 5-60 s on CPU; falls back to eager if compilation fails. With compile, an explicit
    max_seq_len also sizes every call's caches (one shape for all calls: a warm-up compiles what later calls use). The
    compiled step freezes the target's weights as constants: do not modify the target under a compiled
    engine. spec_gate: before each speculative step, skip drafting when plain steps have been committing tokens
    faster at this batch size (`policies.gate.SpecGate`; timing-based, so sampled outputs stay exact in
    distribution but are not bit-reproducible across runs). cuda_graphs: with compile, on a CUDA target whose
    attention resolves to flex (static shapes: every decode / verify step attends over the whole cache), also
    capture the compiled target forwards as CUDA graphs (`compiled.try_compile`); ignored elsewhere."""

    max_batch_size: int = 8
    max_seq_len: int | None = None
    num_draft_tokens: int = 4
    dtype: torch.dtype | None = None
    seed: int | None = None
    compile: bool = False
    dense_verify: bool = True
    spec_gate: bool = False
    cuda_graphs: bool = False

    def __post_init__(self) -> None:
        for name in ("max_batch_size", "num_draft_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < (1 if name == "max_batch_size" else 0):
                raise ValueError(f"EngineConfig.{name} must be an int >= {1 if name == 'max_batch_size' else 0}, "
                                 f"got {v!r}")
        if self.max_seq_len is not None and (not isinstance(self.max_seq_len, int) or self.max_seq_len <= 1):
            raise ValueError(f"EngineConfig.max_seq_len must be an int > 1 or None, got {self.max_seq_len!r}")


@dataclass
class _Slot:
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


class SpecEngine:
    """Batched AR (drafter=None) and speculative decoding over a frozen target `Decoder`.

    depth_policy: `(Proposal, DraftState) -> depth [B]` (see `drafter.DepthPolicy`); None = FixedDepth(K).
    on_verify: optional observer called once per speculative step, after verification and before the
    commit, with a `VerifyEvent` (billed to the "commit" phase; None costs nothing).
    After `generate`, `engine.metrics` holds that call's `DecodeMetrics`.
    """

    def __init__(self, target: Decoder, drafter: Drafter | None = None, config: EngineConfig | None = None,
                 depth_policy: DepthPolicyFn | None = None,
                 on_verify: Callable[[VerifyEvent], None] | None = None) -> None:
        config = config or EngineConfig()
        self.target, self.drafter, self.config = target, drafter, config
        self.on_verify = on_verify
        tcfg = target.config
        self.vocab_size = tcfg.vocab_size
        self.max_seq_len = config.max_seq_len or tcfg.max_position_embeddings
        if self.max_seq_len > tcfg.max_position_embeddings:
            raise ValueError(f"EngineConfig.max_seq_len {self.max_seq_len} exceeds the target context "
                             f"{tcfg.max_position_embeddings}")
        self.dtype = target.embed_tokens.weight.dtype
        if config.dtype is not None and config.dtype != self.dtype:
            raise ValueError(f"the target is {self.dtype} but EngineConfig.dtype is {config.dtype}; load it in that "
                             f"dtype (load_target(dir, dtype={config.dtype}))")
        self.device = target.embed_tokens.weight.device
        if self.device.type == "cpu":
            self._lay_out_weights()
        self.k = config.num_draft_tokens if drafter is not None else 0
        if drafter is None and depth_policy is not None:
            raise ValueError("a depth_policy needs a drafter")
        self.depth_policy: DepthPolicyFn = depth_policy or FixedDepth()
        static = policy_static_depth(self.depth_policy)
        if static is not None and not 0 <= static <= self.k:
            raise ValueError(f"depth policy verifies {static} drafts but num_draft_tokens is {self.k}")
        if static is None and isinstance(self.depth_policy, FixedDepth):  # FixedDepth() verifies all K: static too
            static = self.k
        self._static_depth = static  # every row's depth when the policy fixes one (no host read for the width)
        self._policy_uses_proposal = policy_uses_proposal(self.depth_policy)
        # The gate: the policy's own (`auto` builds a ServingGate) or, with spec_gate, the plain SpecGate.
        make_gate = getattr(self.depth_policy, "make_gate", None)
        self.gate: SpecGate | ServingGate | None = (
            None if drafter is None else make_gate(self.k) if callable(make_gate) else SpecGate() if config.spec_gate
            else None)
        self._taps: tuple[int, ...] = ()
        if drafter is not None:
            # Before any decoding: a drafter for another target/tokenizer fails here, not mid-generation.
            # (Drafted positions may run K past max_seq_len; RoPE extends there and such drafts are never kept.)
            drafter.check_compatible(tcfg, self.max_seq_len)
            self._taps = tuple(drafter.target_layer_ids)
        self.metrics = DecodeMetrics(num_draft_tokens=self.k)
        self._clock = PhaseClock(self.device)  # the phase split: host time on the CPU, CUDA events on a GPU
        self._cache: StaticKVCache | None = None
        self._decode_fn: Callable[..., Tensor] = self._decode_logits
        self._verify_fn: Callable[..., tuple[Tensor, tuple[Tensor, ...]]] = self._verify_forward
        self._greedy_verify_fn: Callable[..., tuple[Tensor, Tensor, tuple[Tensor, ...]]] = self._greedy_verify_forward
        self._packed_fn: Callable[..., tuple[Tensor, tuple[Tensor, ...]]] = self._packed_verify_forward
        self._greedy_packed_fn: Callable[..., tuple[Tensor, Tensor, tuple[Tensor, ...]]] = (
            self._greedy_packed_verify_forward)
        self._one_token_fn: Callable[..., tuple[Tensor, tuple[Tensor, ...]]] = self._one_token_forward
        # (batch kind: 1, or 2 for larger batches; "plain" / "greedy" / "sampled") step graphs already compiled
        self._graphs_compiled: set[tuple[int, str]] = set()
        self._graphs = config.compile and config.cuda_graphs and static_attention(target)
        if config.compile:
            graphs = self._graphs
            if drafter is None:
                self._decode_fn = try_compile(self._decode_logits, "decode step", cuda_graphs=graphs)
            else:
                self._verify_fn = try_compile(self._verify_forward, "verify forward", cuda_graphs=graphs)
                self._greedy_verify_fn = try_compile(self._greedy_verify_forward, "greedy verify step",
                                                     cuda_graphs=graphs)
                self._packed_fn = try_compile(self._packed_verify_forward, "packed verify forward", cuda_graphs=graphs)
                self._greedy_packed_fn = try_compile(self._greedy_packed_verify_forward, "packed greedy verify step",
                                                     cuda_graphs=graphs)
                self._one_token_fn = try_compile(self._one_token_forward, "one-token verify forward",
                                                 cuda_graphs=graphs)
                drafter.ensure_compiled()

    def _lay_out_weights(self) -> None:
        """CPU only: few-row fp32 GEMMs (a verify forward over K + 1 tokens, a block of drafts, a batch of rows) run
        much faster on weights stored as [in, out] (`models.linear`, `benchmarks/weight_layout.py`). Same values,
        in place, once per model; a tied LM head gets its own copy, so the target counts as frozen from here on
        (as `compile`'s frozen graphs already assume)."""
        transpose_weights(self.target)
        if self.drafter is not None:
            self.drafter.transpose_weights()

    # ------------------------------------------------------------------------------------------------
    # Public entry point
    # ------------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def generate(self, requests: Sequence[Request], progress: bool = False) -> list[Result]:
        """Run every request to completion; results in request order."""
        requests = list(requests)
        self._validate(requests)
        self.metrics = DecodeMetrics(num_draft_tokens=self.k, requests=len(requests),
                                     prompt_tokens=sum(len(r.prompt_ids) for r in requests))
        if not requests:
            return []
        t_start, cpu_start = time.perf_counter(), time.process_time()
        self._clock = PhaseClock(self.device)  # a fresh one per run: nothing pending from an interrupted one
        seeds = self._resolve_seeds(requests)
        n_rows = min(self.config.max_batch_size, len(requests))
        max_len = max(len(r.prompt_ids) + r.max_new_tokens for r in requests)
        if self.config.compile and self.config.max_seq_len is not None:
            # Compiled graphs guard on cache shapes: with an explicit bound, every call gets caches of that one size,
            # so a short call (a warm-up) and a longer one later share their graphs. Sized per call, the draft LM's
            # graphs recompiled inside a timed run of `angelspec eval --compile` (capacity 64 in the warm-up, its
            # head_dim too, which duck sizing tied to it; 80 in the run).
            max_len = self.config.max_seq_len
        temperatures = [r.sampling.temperature for r in requests]
        self._setup(n_rows, max_len, greedy=min(temperatures) == 0, sampled=max(temperatures) > 0)

        queue = deque(range(len(requests)))
        self._slots: list[_Slot | None] = [None] * n_rows
        results: list[Result | None] = [None] * len(requests)
        bar = tqdm(total=len(requests), disable=not progress, desc="generate", unit="req")
        while True:
            free = [r for r, s in enumerate(self._slots) if s is None]
            if queue and free:
                joined = [queue.popleft() for _ in range(min(len(free), len(queue)))]
                self._admit(free[: len(joined)], joined, requests, seeds)
            elif not self._active_rows:
                break
            if self._active_rows:
                if self.drafter is None:
                    self._ar_step()
                else:
                    self._spec_step()
            # Rows finish in a step or already at admission (first token a stop token, max_new_tokens == 1).
            done = [r for r, s in enumerate(self._slots) if s is not None and s.finish is not None]
            if done:
                for r in done:
                    s = self._slots[r]
                    assert s is not None and s.finish is not None
                    results[s.index] = Result(request_id=s.index if s.request.request_id is None
                                              else s.request.request_id, token_ids=s.tokens,
                                              finish_reason=s.finish, num_steps=s.steps,
                                              prompt_len=len(s.request.prompt_ids),
                                              queued_s=s.admitted_at - t_start,
                                              latency_s=time.perf_counter() - s.admitted_at,
                                              first_token_s=s.first_at - s.admitted_at)
                    self.metrics.output_tokens += len(s.tokens)
                    self._slots[r] = None
                self._release(done)
                bar.update(len(done))
        bar.close()
        self.metrics.wall_s = time.perf_counter() - t_start
        self._clock.flush(self.metrics)
        if self.device.type == "cpu":  # on a GPU the host's CPU time measures its waiting, not the decoding
            self.metrics.cpu_s = time.process_time() - cpu_start
        assert all(r is not None for r in results)
        return results  # type: ignore[return-value]

    # ------------------------------------------------------------------------------------------------
    # Set-up, validation, admission
    # ------------------------------------------------------------------------------------------------
    def _validate(self, requests: list[Request]) -> None:
        v, limit = self.vocab_size, self.max_seq_len
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

    def _resolve_seeds(self, requests: list[Request]) -> list[int]:
        # Host-side, once per call: a request's seed must stay fixed across all of its steps.
        gen = torch.Generator()
        if self.config.seed is None:
            gen.seed()
        else:
            gen.manual_seed(self.config.seed)
        draws = torch.randint(0, 2**62, (len(requests),), generator=gen).tolist()
        return [r.sampling.seed if r.sampling.seed is not None else d for r, d in zip(requests, draws, strict=True)]

    def _setup(self, n_rows: int, max_len: int, greedy: bool = True, sampled: bool = False) -> None:
        slack = self.k + 2  # a verify forward appends up to K+1 tokens past the last committed one
        c = self._cache
        if c is None or c.batch_size != n_rows or c.capacity < max_len + slack:
            self._cache = None  # free the old buffers before allocating new ones
            self._cache = StaticKVCache(self.target.config, n_rows, max_len, slack=slack, dtype=self.dtype,
                                        device=self.device)
            if self._graphs:  # graphs replay fixed addresses: the cache, mutated in place, must be one of them
                self._cache.mark_static_address()
        self._cache.reset()
        dev, b = self.device, n_rows
        self._last = torch.zeros(b, dtype=torch.int64, device=dev)  # [B] newest committed token
        self._seq_lens = torch.ones(b, dtype=torch.int64, device=dev)  # [B] committed tokens incl. last
        self._active = torch.zeros(b, dtype=torch.bool, device=dev)  # [B]
        self._active_long = torch.zeros(b, dtype=torch.int64, device=dev)  # [B] num_new of an AR step
        self._draft_round = torch.zeros(b, dtype=torch.int64, device=dev)  # [B]
        self._sampling = BatchSampling.from_params([SamplingParams(seed=0)] * b, device=dev)
        self._active_rows: tuple[int, ...] = ()
        self._all_greedy = True
        if self.config.compile and self.drafter is not None:
            self._compile_step_graphs(b, greedy, sampled)
        if self.drafter is not None:
            self.drafter.allocate(b, max_len, device=dev, slack=slack)

    def _compile_step_graphs(self, b: int, greedy: bool, sampled: bool) -> None:
        """Compile the speculative step's graphs for a batch of b rows before the run, on dummy inputs (the outputs
        are thrown away and the cache emptied again), rather than the first time a step needs one (mid-serving: ~10-20 s
        on a CPU). torch.compile specialises a batch of 1, so batch 1 and larger batches get graphs each; later depths
        and batch sizes reuse them (dynamic sizes).

        - the step without drafts (`_one_token_forward`). The target's RoPE table is built first, eagerly: a graph
          traced before it existed guards on its absence and was compiled again at the first real step without drafts
          (at batch 1 under the gate that step's seconds then included the compilation, and the gate took plain steps
          to be ~1000x slower than they are);
        - the verify graphs at depth K: dense (every row at the same depth) and, for more than one row, packed (ragged
          depths); greedy ones when the run has a request at T = 0, sampled ones when it has one at T > 0 (a step
          is greedy only when all its rows are, so a run at T > 0 never uses the greedy ones). At batch 4 with n-gram
          drafts the dense greedy graph was first needed after a 16-token warm-up, and compiled inside the timed run
          (12 s, 0.09x of AR)."""
        kind, dev, k, cache = min(b, 2), self.device, self.k, self._cache
        assert cache is not None
        wanted = {"plain": True, "greedy": greedy and k > 0, "sampled": sampled and k > 0}
        todo = [w for w in ("plain", "greedy", "sampled") if wanted[w] and (kind, w) not in self._graphs_compiled]
        if not todo:
            return
        self.target.rope_table(cache.capacity, dev)
        drafts = torch.zeros(b, k + 1, dtype=torch.int64, device=dev)
        full = torch.full((b,), k, dtype=torch.int64, device=dev)
        ragged = full.clone()
        ragged[1:] = 0
        active = torch.ones(b, dtype=torch.bool, device=dev)
        packed = b > 1 and self.config.dense_verify
        with torch.inference_mode():
            for what in todo:
                if what == "plain":
                    self._one_token_fn(torch.zeros(b, 1, dtype=torch.int64, device=dev), cache, 2,
                                       torch.ones(b, dtype=torch.int64, device=dev))
                elif what == "greedy":
                    self._greedy_verify_fn(drafts, cache, k + 1, full)
                    if packed:
                        cache.reset()
                        self._greedy_packed_fn(drafts, cache, k + 1, ragged, active, k + b)
                else:
                    self._verify_fn(drafts, cache, k + 1)
                    if packed:
                        cache.reset()
                        self._packed_fn(drafts, cache, k + 1, ragged, active, k + b)
                cache.reset()
                self._graphs_compiled.add((kind, what))

    def _admit(self, rows: list[int], indices: list[int], requests: list[Request], seeds: list[int]) -> None:
        """Prefill the joining requests into `rows` and emit their first token."""
        t0, m0 = time.perf_counter(), self._clock.mark()
        reqs = [requests[i] for i in indices]
        prompts = [list(r.prompt_ids) for r in reqs]
        params = [SamplingParams(r.sampling.temperature, r.sampling.top_k, r.sampling.top_p, seeds[i])
                  for r, i in zip(reqs, indices, strict=True)]
        joiners = BatchSampling.from_params(params, device=self.device)
        idx = torch.tensor(rows, dtype=torch.int64, device=self.device)
        s = self._sampling
        for mine, theirs in ((s.temperature, joiners.temperature), (s.top_k, joiners.top_k),
                             (s.top_p, joiners.top_p), (s.seeds, joiners.seeds)):
            mine[idx] = theirs

        out = prefill_rows(self.target, self._cache, rows, prompts, hidden_layers=self._taps)
        p_lens = torch.tensor([len(p) for p in prompts], dtype=torch.int64, device=self.device)  # [n]
        # The first emitted token sits at position P: that is its noise counter.
        first = self._choose(out.logits[:, 0], joiners, p_lens, all(p.is_greedy for p in params))  # [n]
        first_host = first.tolist()  # host sync: once per admission
        t_first = time.perf_counter()

        self._last[idx] = first
        self._seq_lens[idx] = p_lens + 1
        self._active[idx] = True
        self._active_long[idx] = 1
        self._draft_round[idx] = 0
        for r, i, req, tok in zip(rows, indices, reqs, first_host, strict=True):
            stop = req.stop_ids if req.stop_ids is not None else self.target.config.eos_token_ids
            slot = _Slot(index=i, request=req, stop=frozenset(stop), seq_len=len(req.prompt_ids) + 1,
                         admitted_at=t0, first_at=t_first)
            slot.emit([tok])
            self._slots[r] = slot
        self._refresh_rows()
        if self.drafter is not None:
            self.drafter.prefill(rows, prompts, first_host, out.hidden)
        self._clock.add(self.metrics, "prefill", m0, self._clock.mark())

    def _release(self, rows: list[int]) -> None:
        idx = torch.tensor(rows, dtype=torch.int64, device=self.device)
        self._active[idx] = False
        self._active_long[idx] = 0
        # Freed rows decode greedily as padding, so they never force the sampling path.
        self._sampling.temperature[idx] = 0.0
        self._refresh_rows()
        if self.drafter is not None:
            self.drafter.reset_rows(rows)

    def _refresh_rows(self) -> None:
        self._active_rows = tuple(r for r, s in enumerate(self._slots) if s is not None and s.finish is None)
        self._all_greedy = all(self._slots[r].request.sampling.is_greedy  # type: ignore[union-attr]
                               for r in self._active_rows)
        # `process_logits(filtering=False)` skips the sort when no row's sampling parameters filter. Freed rows decode
        # greedily; a row that finished at admission keeps its parameters until it is freed, so it counts.
        filtering = any(s.request.sampling.filters for s in self._slots if s is not None)
        if filtering != self._sampling.filtering:
            self._sampling = replace(self._sampling, filtering=filtering)

    # ------------------------------------------------------------------------------------------------
    # Token choice shared by prefill and AR steps
    # ------------------------------------------------------------------------------------------------
    def _choose(self, logits: Tensor, s: BatchSampling, counters: Tensor, greedy: bool) -> Tensor:
        """logits [B, V] -> token ids [B]; counters [B] = absolute positions of the produced tokens."""
        if greedy:
            return greedy_argmax(logits)  # same as process_logits' one-hot (ties -> lowest id), minus the sort
        probs = process_logits(logits, s.temperature, s.top_k, s.top_p, filtering=s.filtering)
        return sample(probs, s.seeds, counters, NoiseStream.TARGET)

    # ------------------------------------------------------------------------------------------------
    # Plain autoregressive step
    # ------------------------------------------------------------------------------------------------
    def _decode_logits(self, last: Tensor, cache: StaticKVCache, num_new: Tensor, kv_len: int) -> Tensor:
        """last [B] -> next-token logits [B, V]; the cache grows by num_new [B] (0 for idle rows)."""
        return self.target(last[:, None], cache=cache, num_new=num_new, kv_len=kv_len).logits[:, 0]

    def _verify_forward(self, tokens: Tensor, cache: StaticKVCache, kv_len: int) -> tuple[Tensor, tuple[Tensor, ...]]:
        """tokens [B, n+1] = [last, drafts] -> (logits [B, n+1, V], the drafter's taps); the cache grows by n+1."""
        out = self.target(tokens, cache=cache, kv_len=kv_len, hidden_layers=self._taps)
        return out.logits, out.hidden

    def _greedy_verify_forward(self, tokens: Tensor, cache: StaticKVCache, kv_len: int, depth: Tensor
                               ) -> tuple[Tensor, Tensor, tuple[Tensor, ...]]:
        """`_verify_forward` and greedy acceptance in one call (T=0, every row verifies n = tokens.shape[1] - 1
        positions but accepts at most depth [B] of them): -> (tokens [B, n+1] = accepted drafts, then the target's
        token, then placeholders; num_accepted [B]; the drafter's taps). Compiled, the sampler's ops join the
        forward's graph instead of running as eager ops after it (0.24 ms a step at batch 1 for DFly at K = 7)."""
        out = self.target(tokens, cache=cache, kv_len=kv_len, hidden_layers=self._taps)
        v = greedy_accept(tokens[:, 1:], out.logits, depth)
        return v.tokens, v.num_accepted, out.hidden

    def _one_token_forward(self, tokens: Tensor, cache: StaticKVCache, kv_len: int, num_new: Tensor
                           ) -> tuple[Tensor, tuple[Tensor, ...]]:
        """A step without drafts (tokens [B, 1] = the newest committed token per row): the AR step's forward plus the
        drafter's taps, so it costs what a plain decode step costs; the cache grows by num_new [B] (1 for active
        rows, 0 for idle ones). A function of its own, not the verify forward at width 0 nor the packed one with one
        kept column per row: under compile its graph sits in a guard cache of its own (dynamo keeps one list of
        graphs per function and checks their guards in turn on every call, and a verify call that first failed the
        one-token graph's guards cost ~70 us more: a profile of compiled n-gram decoding gave 161 us per cache lookup
        against 88 us for a drafter that always verifies K + 1 tokens), and at batch 16 on two cores the packed
        path's gather and scatter made a skipped step cost 1.15x a plain one (docs/design.md section 9)."""
        out = self.target(tokens, cache=cache, num_new=num_new, kv_len=kv_len, hidden_layers=self._taps)
        return out.logits, out.hidden

    def _packed_verify_forward(self, tokens: Tensor, cache: StaticKVCache, kv_len: int, depth: Tensor, active: Tensor,
                               num_keep: int) -> tuple[Tensor, tuple[Tensor, ...]]:
        """`_verify_forward` over only the positions a row verifies (its first depth + 1, none for idle rows),
        packed densely (`Decoder.forward(keep=...)`); num_keep = their host-side count. Logits and taps of the
        other positions come back as zeros; the cache grows by n+1 per row (roll back to the kept length)."""
        out = self._packed_target(tokens, cache, kv_len, depth, active, num_keep)
        return out.logits, out.hidden

    def _greedy_packed_verify_forward(self, tokens: Tensor, cache: StaticKVCache, kv_len: int, depth: Tensor,
                                      active: Tensor, num_keep: int) -> tuple[Tensor, Tensor, tuple[Tensor, ...]]:
        """`_packed_verify_forward` and greedy acceptance in one call, as `_greedy_verify_forward` is for the dense
        forward (positions past a row's depth are never compared, so their zero logits do not matter)."""
        out = self._packed_target(tokens, cache, kv_len, depth, active, num_keep)
        v = greedy_accept(tokens[:, 1:], out.logits, depth)
        return v.tokens, v.num_accepted, out.hidden

    def _packed_target(self, tokens: Tensor, cache: StaticKVCache, kv_len: int, depth: Tensor, active: Tensor,
                       num_keep: int) -> DecoderOutput:
        keep = (torch.arange(tokens.shape[1], device=tokens.device)[None, :] <= depth[:, None]) & active[:, None]
        return self.target(tokens, cache=cache, kv_len=kv_len, hidden_layers=self._taps, keep=keep, num_keep=num_keep)

    def _ar_step(self) -> None:
        clock = self._clock
        t0 = clock.mark()
        rows, slots, cache = self._active_rows, self._slots, self._cache
        assert cache is not None
        # kv_len: the longest active row's cache after appending one token = its seq_len.
        kv_len = max(slots[r].seq_len for r in rows)  # type: ignore[union-attr]
        logits = self._decode_fn(self._last, cache, self._active_long, kv_len)  # [B, V]
        # After the forward, cache.lengths = position of the token being produced (its noise counter).
        nxt = self._choose(logits, self._sampling, cache.lengths, self._all_greedy)  # [B]
        self._last = nxt
        t1 = clock.mark()
        host = nxt.tolist()  # host sync: once per step, to learn which rows finished
        for r in rows:
            s = slots[r]
            assert s is not None
            s.seq_len += 1
            s.steps += 1
            s.emit((host[r],))
        self.metrics.record_decode(len(rows))
        clock.step(self.metrics, verify=(t0, t1), commit=(t1, clock.mark()))

    # ------------------------------------------------------------------------------------------------
    # Speculative step
    # ------------------------------------------------------------------------------------------------
    def _spec_step(self) -> None:
        assert self.drafter is not None and self._cache is not None
        clock = self._clock
        t0, h0 = clock.mark(), time.perf_counter()  # h0: host time, what the gate weighs
        rows, slots, cache, k = self._active_rows, self._slots, self._cache, self.k
        b = cache.batch_size
        bound = max(slots[r].seq_len for r in rows)  # type: ignore[union-attr]
        state = DraftState(last_tokens=self._last, seq_lens=self._seq_lens, active=self._active, active_rows=rows,
                           sampling=self._sampling, draft_round=self._draft_round, num_draft_tokens=k,
                           deterministic=self._policy_uses_proposal, all_greedy=self._all_greedy,
                           seq_len_bound=bound)
        cap = k if self.gate is None else self.gate.choose_depth(len(rows), k)  # drafts to verify, 0: a plain step
        drafting = cap > 0
        # The gate skipped drafting (a plain step: a round of 0 drafts) or narrowed this step's depth. A compiled
        # drafter's step is specialised on its number of drafts (an unrolled loop): asked for each depth the gate
        # picks, it compiled a graph per depth in the middle of timed decoding, so under compile it drafts all K and
        # the verification keeps the first `cap` (a prefix of the drafts: exact at any temperature).
        if cap == 0 or (cap < k and not self.config.compile):
            state = replace(state, num_draft_tokens=cap)
        proposal = self.drafter.propose(state)
        proposal.check(b, state.num_draft_tokens, self.vocab_size)
        if not drafting:
            proposal = replace(proposal, deterministic=True, lengths=None, host_lengths=None)  # a plain sample
        protocol = self._protocol(proposal)  # refuses an unsafe proposal before any target work
        t1 = clock.mark()
        if drafting:
            depth, width, num_keep = self._select(proposal, state, cap)  # [B], host ints n and sum of (depth + 1)
        else:
            depth, width, num_keep = torch.zeros_like(self._seq_lens), 0, len(rows)
        t2 = clock.mark()

        drafts = proposal.tokens[:, :width]  # [B, n]
        tokens = torch.cat([self._last[:, None], drafts], dim=1) if width else self._last[:, None]  # [B, n+1]
        old_len = cache.lengths.clone() if width else None  # [B]; width 0 grows each active row by one: no rollback
        v, hidden = self._forward_and_verify(protocol, proposal, tokens, depth, width, num_keep, bound)
        t3 = clock.mark()

        acc = v.num_accepted
        if self.on_verify is not None and drafting:
            self.on_verify(VerifyEvent(proposal=proposal, depth=depth, num_accepted=acc, active=self._active.clone()))
        host_tokens: list[tuple[int, ...]] = [()] * b
        if old_len is None:  # width 0: one token per active row, nothing to roll back
            self._seq_lens = self._seq_lens + self._active_long
            self._last = v.tokens[:, 0]
            host_last = self._last.tolist()  # host sync: once per step
            accepted, depths = [0] * len(rows), [0] * len(rows)
            for r in rows:
                host_tokens[r] = (host_last[r],)
        else:
            cache.truncate(torch.where(self._active, old_len + acc + 1, old_len))  # rollback: trap 4
            self._seq_lens = torch.where(self._active, self._seq_lens + acc + 1, self._seq_lens)
            self._last = v.tokens.gather(1, acc[:, None])[:, 0]
            payload = torch.cat([v.tokens, acc[:, None], depth[:, None]], dim=1).tolist()  # host sync: once per step
            accepted, depths = [], []
            for r in rows:
                a = payload[r][width + 1]
                host_tokens[r] = tuple(payload[r][: a + 1])
                accepted.append(a)
                depths.append(payload[r][width + 2])
        self._draft_round += self._active_long
        for r, a in zip(rows, accepted, strict=True):
            s = slots[r]
            assert s is not None
            s.seq_len += a + 1
            s.steps += 1
            s.emit(host_tokens[r])
        t_on_commit = clock.mark()
        host_depths = [0] * b
        for r, d in zip(rows, depths, strict=True):
            host_depths[r] = d
        self.drafter.on_commit(Commit(tokens=v.tokens, num_accepted=acc, seq_lens=self._seq_lens,
                                      active=self._active, host_tokens=tuple(host_tokens),
                                      target_hidden=hidden, host_depths=tuple(host_depths)))
        on_commit = (t_on_commit, clock.mark())  # the drafter's share of the commit phase
        if drafting:
            self.metrics.record_verify(accepted, depths, protocol)
        else:
            self.metrics.record_decode(len(rows))
            self.metrics.skipped_steps += 1
        t4 = clock.mark()
        if self.gate is not None:
            self.gate.observe_step(len(rows), cap, time.perf_counter() - h0, accepted, depths)
        clock.step(self.metrics, draft=(t0, t1), select=(t1, t2), verify=(t2, t3), commit=(t3, t4),
                   on_commit=on_commit)

    def _forward_and_verify(self, protocol: VerifyProtocol, proposal: Proposal, tokens: Tensor, depth: Tensor,
                            width: int, num_keep: int, bound: int) -> tuple[VerifyOutput, tuple[Tensor, ...]]:
        """The target forward over tokens [B, n+1] = [last, drafts] and the verification of its drafts ->
        (VerifyOutput: tokens [B, n+1], num_accepted [B]; the drafter's taps). Greedy steps verify inside the
        forward's call (one compiled graph)."""
        cache = self._cache
        assert cache is not None
        b = cache.batch_size
        drafts = tokens[:, 1:]
        if width == 0:
            # No row verifies a draft (n-gram found no match, the gate skipped drafting, the policy chose depth 0):
            # the plain decode step's forward with the drafter's taps, compiled when compile is on (`_setup` compiled
            # that graph before the run). It grows each active row's cache by exactly one token; the token is chosen
            # as an AR step chooses it (the same noise key as verifying zero drafts: the target stream at the row's
            # position), without the verification sampler's checks and scans over zero drafts (0.17 against
            # 0.035 ms a step at batch 1, T=0, docs/design.md section 9).
            logits, hidden = self._one_token_fn(tokens, cache, bound, self._active_long)
            chosen = self._choose(logits[:, 0], self._sampling, self._seq_lens, protocol == "greedy")  # [B]
            return VerifyOutput(chosen[:, None], torch.zeros_like(self._seq_lens)), hidden
        greedy = protocol == "greedy"
        if self.config.dense_verify and num_keep < b * (width + 1):
            # Ragged or idle rows: pack the kept positions (at least two, since width >= 1).
            args = (tokens, cache, bound + width, depth, self._active, num_keep)
            if greedy:
                v_tokens, v_accepted, hidden = self._greedy_packed_fn(*args)
                return VerifyOutput(v_tokens, v_accepted), hidden
            logits, hidden = self._packed_fn(*args)
        elif greedy:
            v_tokens, v_accepted, hidden = self._greedy_verify_fn(tokens, cache, bound + width, depth)
            return VerifyOutput(v_tokens, v_accepted), hidden
        else:
            logits, hidden = self._verify_fn(tokens, cache, bound + width)
        return self._verify(protocol, drafts, proposal, logits, depth, width), hidden

    def _select(self, proposal: Proposal, state: DraftState, cap: int | None = None) -> tuple[Tensor, int, int]:
        """Per-row depth [B] (0 for idle rows), the verify width n = max depth and the number of verified
        positions sum over active rows of (depth + 1) (host ints). cap: the gate's most drafts per row this step."""
        k = self.k
        raw = self.depth_policy(proposal, state)
        if not isinstance(raw, Tensor) or raw.shape != self._active.shape or raw.is_floating_point():
            raise ValueError(f"depth policy must return an integer tensor [B] = [{self._active.shape[0]}], got "
                             f"{getattr(raw, 'dtype', type(raw).__name__)} {tuple(getattr(raw, 'shape', ()))}")
        raw = raw.long()
        capped = cap is not None and cap < k
        if capped:
            raw = raw.clamp(max=cap)
        depth = raw if proposal.lengths is None else torch.minimum(raw, proposal.lengths)
        depth = torch.where(self._active, depth, 0)
        static = self._static_depth
        if static is not None and capped:
            static = min(static, cap)
        if static is not None:
            if proposal.lengths is None:
                return depth, static, len(self._active_rows) * (static + 1)
            if proposal.host_lengths is not None:  # the drafter knows its lengths on the host (n-gram lookup)
                kept = [min(static, proposal.host_lengths[r]) for r in self._active_rows]
                return depth, max(kept), sum(kept) + len(kept)
        # host sync (the second of this step, only for data-dependent depths): the verify width, so that
        # positions no row verifies cost no compute; also lets us check the policy's values.
        masked = torch.where(self._active, raw, 0)
        kept = torch.where(self._active, depth + 1, 0).sum()
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
        if self._all_greedy:
            return "greedy"
        if proposal.deterministic or self._policy_uses_proposal:
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

    def _verify(self, protocol: VerifyProtocol, drafts: Tensor, proposal: Proposal, logits: Tensor, depth: Tensor,
                width: int) -> VerifyOutput:
        """drafts [B, n], logits [B, n+1, V] -> VerifyOutput(tokens [B, n+1], num_accepted [B]) by `protocol`."""
        if protocol == "greedy":
            return verify_greedy(drafts, logits, depth)
        s = self._sampling
        probs = process_logits(logits, s.temperature, s.top_k, s.top_p, filtering=s.filtering)  # [B, n+1, V]
        if protocol == "deterministic":
            return verify_deterministic(drafts, probs, depth, s.seeds, self._seq_lens)
        assert proposal.probs is not None  # _protocol checked it
        return verify_speculative(drafts, proposal.probs[:, :width], probs, depth, s.seeds, self._seq_lens)


def reference_generate(target: Decoder, requests: Sequence[Request],
                       seeds: Sequence[int] | None = None) -> list[Result]:
    """Slow reference: one request at a time, one token per forward, no batching, no admission logic.

    Samples with the same counter-based noise as the engine (TARGET stream, counter = position of the
    produced token), so for greedy requests and for seeded sampled requests the engine must match it
    token for token (up to floating-point ties between batched and single-row arithmetic).
    """
    results = []
    with torch.inference_mode():
        for i, r in enumerate(requests):
            seed = r.sampling.seed if r.sampling.seed is not None else (seeds[i] if seeds is not None else 0)
            s = BatchSampling.from_params([SamplingParams(r.sampling.temperature, r.sampling.top_k,
                                                          r.sampling.top_p, seed)])
            stop = set(r.stop_ids if r.stop_ids is not None else target.config.eos_token_ids)
            prompt = list(r.prompt_ids)
            cache = target.new_cache(1, len(prompt) + r.max_new_tokens + 1)
            logits = target(torch.tensor([prompt]), cache=cache).logits[:, -1]  # [1, V]
            out: list[int] = []
            finish: FinishReason = "length"
            while len(out) < r.max_new_tokens:
                pos = len(prompt) + len(out)
                if r.sampling.is_greedy:
                    tok = int(logits.argmax(dim=-1))
                else:
                    probs = process_logits(logits, s.temperature, s.top_k, s.top_p)
                    tok = int(sample(probs, s.seeds, torch.tensor([pos]), NoiseStream.TARGET))
                out.append(tok)
                if tok in stop:
                    finish = "stop"
                    break
                logits = target(torch.tensor([[tok]]), cache=cache).logits[:, -1]
            results.append(Result(request_id=i if r.request_id is None else r.request_id, token_ids=out,
                                  finish_reason=finish, num_steps=len(out), prompt_len=len(prompt)))
    return results
