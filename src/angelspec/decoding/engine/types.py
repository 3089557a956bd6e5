"""The engine's public records: a `Request`, its `Result`, the `EngineConfig`, and the `VerifyEvent` that
speculative steps hand to observers."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor

from angelspec.decoding.drafters.base import DraftState, Proposal
from angelspec.decoding.sampling import SamplingParams

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
    compilation; falls back to eager if compilation fails. With compile, an explicit
    max_seq_len also sizes every call's caches (one shape for all calls: a warm-up compiles what later calls use). The
    compiled graphs take the weights as inputs (never frozen into them: `compiled.compile_options`), so every model
    runs its own current weights. spec_gate: before each speculative step, skip drafting when plain steps have been
    committing tokens faster at this batch size (`policies.gate.SpecGate`; timing-based, so sampled outputs stay
    exact in distribution but are not bit-reproducible across runs). cuda_graphs: with compile, on a CUDA target whose
    attention resolves to flex (static shapes: every decode / verify step attends over the whole cache), also
    capture the compiled target forwards as CUDA graphs (`compiled.try_compile`); ignored elsewhere. prepack: on a
    CPU with oneDNN, multiply the large fp32 linear weights of the target and the drafter through copies prepacked
    for few rows wherever a product has two rows or more (`models.linear.prepack_weights`: one more copy of those
    weights in memory; False takes copies an earlier engine made away again); ignored elsewhere."""

    max_batch_size: int = 8
    max_seq_len: int | None = None
    num_draft_tokens: int = 4
    dtype: torch.dtype | None = None
    seed: int | None = None
    compile: bool = False
    dense_verify: bool = True
    spec_gate: bool = False
    cuda_graphs: bool = False
    prepack: bool = True

    def __post_init__(self) -> None:
        for name in ("max_batch_size", "num_draft_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < (1 if name == "max_batch_size" else 0):
                raise ValueError(f"EngineConfig.{name} must be an int >= {1 if name == 'max_batch_size' else 0}, "
                                 f"got {v!r}")
        if self.max_seq_len is not None and (not isinstance(self.max_seq_len, int) or self.max_seq_len <= 1):
            raise ValueError(f"EngineConfig.max_seq_len must be an int > 1 or None, got {self.max_seq_len!r}")
