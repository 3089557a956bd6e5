"""`SpecEngine`: the scheduler, the target's forwards and the step, composed, and the generate loop."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence

import torch
from tqdm.auto import tqdm

from angelspec.decoding.compiled import static_attention
from angelspec.decoding.drafters.base import Drafter
from angelspec.decoding.engine.forwards import TargetForwards
from angelspec.decoding.engine.scheduler import Scheduler
from angelspec.decoding.engine.step import Step
from angelspec.decoding.engine.types import DepthPolicyFn, EngineConfig, Request, Result, VerifyEvent
from angelspec.decoding.metrics import DecodeMetrics, PhaseClock
from angelspec.decoding.policies.gate import ServingGate, SpecGate
from angelspec.models.decoder import Decoder
from angelspec.models.linear import lay_out_weights


class SpecEngine:
    """Batched AR (drafter=None) and speculative decoding over a frozen target `Decoder`.

    depth_policy: `(Proposal, DraftState) -> depth [B]` (see `drafter.DepthPolicy`); None = FixedDepth(K).
    on_verify: optional observer called once per speculative step, after verification and before the
    commit, with a `VerifyEvent` (billed to the "commit" phase; None costs nothing).
    After `generate`, `engine.metrics` holds that call's `DecodeMetrics`.

    The pieces: `rows` (a `Scheduler`: admission, slots, release), `forwards` (`TargetForwards`: the target's
    forward variants, eager or compiled) and `step` (a `Step`: the AR and the speculative step).
    """

    def __init__(self, target: Decoder, drafter: Drafter | None = None, config: EngineConfig | None = None,
                 depth_policy: DepthPolicyFn | None = None,
                 on_verify: Callable[[VerifyEvent], None] | None = None) -> None:
        config = config or EngineConfig()
        self.target, self.drafter, self.config = target, drafter, config
        tcfg = target.config
        self.max_seq_len = config.max_seq_len or tcfg.max_position_embeddings
        if self.max_seq_len > tcfg.max_position_embeddings:
            raise ValueError(f"EngineConfig.max_seq_len {self.max_seq_len} exceeds the target context "
                             f"{tcfg.max_position_embeddings}")
        dtype = target.embed_tokens.weight.dtype
        if config.dtype is not None and config.dtype != dtype:
            raise ValueError(f"the target is {dtype} but EngineConfig.dtype is {config.dtype}; load it in that "
                             f"dtype (load_target(dir, dtype={config.dtype}))")
        self.device = target.embed_tokens.weight.device
        if self.device.type == "cpu":
            self._lay_out_weights()
        self.k = config.num_draft_tokens if drafter is not None else 0
        taps: tuple[int, ...] = ()
        if drafter is not None:
            # Before any decoding: a drafter for another target/tokenizer fails here, not mid-generation.
            # (Drafted positions may run K past max_seq_len; RoPE extends there and such drafts are never kept.)
            drafter.check_compatible(tcfg, self.max_seq_len)
            taps = tuple(drafter.target_layer_ids)
        graphs = config.compile and config.cuda_graphs and static_attention(target)
        # slack: a verify forward appends up to K+1 tokens past the last committed one
        self.rows = Scheduler(target, drafter, self.max_seq_len, slack=self.k + 2, taps=taps, static_cache=graphs)
        self.forwards = TargetForwards(target, taps, speculative=drafter is not None, compile=config.compile,
                                       cuda_graphs=graphs)
        self.step = Step(self.rows, self.forwards, drafter, self.k, depth_policy=depth_policy,
                         spec_gate=config.spec_gate, dense_verify=config.dense_verify, on_verify=on_verify)
        if config.compile and drafter is not None:
            drafter.ensure_compiled()
        self.metrics = DecodeMetrics(num_draft_tokens=self.k)
        self._clock = PhaseClock(self.device)  # the phase split: host time on the CPU, CUDA events on a GPU

    @property
    def gate(self) -> SpecGate | ServingGate | None:
        """The step's gate (`Step.gate`); assignable."""
        return self.step.gate

    @gate.setter
    def gate(self, gate: SpecGate | ServingGate | None) -> None:
        self.step.gate = gate

    def _lay_out_weights(self) -> None:
        """CPU only: few-row fp32 GEMMs (a verify forward over K + 1 tokens, a block of drafts, a batch of rows) run
        much faster on weights stored as [in, out] (`models.linear`, `benchmarks/weight_layout.py`), and faster still
        for the large weights through oneDNN copies prepacked for few rows (`EngineConfig.prepack`,
        `benchmarks/gemm_rows.py`). Same values, in place, once per model; a tied LM head gets its own copy, so the
        target counts as frozen from here on (its weights' values may still change; a tie split here no longer ties
        them)."""
        lay_out_weights(self.target, self.config.prepack)
        if self.drafter is not None:
            self.drafter.lay_out_weights(self.config.prepack)

    @torch.inference_mode()
    def generate(self, requests: Sequence[Request], progress: bool = False) -> list[Result]:
        """Run every request to completion; results in request order."""
        requests = list(requests)
        self.rows.validate(requests)
        self.metrics = metrics = DecodeMetrics(num_draft_tokens=self.k, requests=len(requests),
                                               prompt_tokens=sum(len(r.prompt_ids) for r in requests))
        if not requests:
            return []
        t_start, cpu_start = time.perf_counter(), time.process_time()
        self._clock = clock = PhaseClock(self.device)  # a fresh one per run: nothing pending from an interrupted one
        seeds = Scheduler.resolve_seeds(requests, self.config.seed)
        self._setup(requests)
        step = self.step.ar if self.drafter is None else self.step.spec

        queue = deque(range(len(requests)))
        results: list[Result | None] = [None] * len(requests)
        bar = tqdm(total=len(requests), disable=not progress, desc="generate", unit="req")
        while True:
            free = self.rows.free_rows()
            if queue and free:
                joined = [queue.popleft() for _ in range(min(len(free), len(queue)))]
                self.rows.admit(free[: len(joined)], joined, requests, seeds, metrics, clock)
            elif not self.rows.active_rows:
                break
            if self.rows.active_rows:
                step(metrics, clock)
            done = self.rows.retire(t_start, metrics)
            for index, result in done:
                results[index] = result
            bar.update(len(done))
        bar.close()
        metrics.wall_s = time.perf_counter() - t_start
        clock.flush(metrics)
        if self.device.type == "cpu":  # on a GPU the host's CPU time measures its waiting, not the decoding
            metrics.cpu_s = time.process_time() - cpu_start
        assert all(r is not None for r in results)
        return results  # type: ignore[return-value]

    def _setup(self, requests: list[Request]) -> None:
        """The rows and cache for this call, the step graphs it needs compiled, the drafter's buffers."""
        n_rows = min(self.config.max_batch_size, len(requests))
        max_len = max(len(r.prompt_ids) + r.max_new_tokens for r in requests)
        if self.config.compile and self.config.max_seq_len is not None:
            # Compiled graphs guard on cache shapes: with an explicit bound, every call gets caches of that one size,
            # so a short call (a warm-up) and a longer one later share their graphs (docs/design.md section 9).
            max_len = self.config.max_seq_len
        cache = self.rows.setup(n_rows, max_len)
        self.step.start(n_rows)
        if self.drafter is not None:
            temperatures = [r.sampling.temperature for r in requests]
            self.forwards.warm_up(cache, self.k, greedy=min(temperatures) == 0, sampled=max(temperatures) > 0,
                                  packed=self.config.dense_verify, decode=self.step.bare_decode)
            self.drafter.allocate(n_rows, max_len, device=self.device, slack=self.k + 2)
