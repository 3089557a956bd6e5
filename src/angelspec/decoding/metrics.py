"""Decoding metrics: mean accepted length, acceptance per position, acceptance histogram, time split, speed.

The engine already copies each step's verification result to the host once (to learn which rows
finished), so everything here is accumulated from those host ints: no extra syncs, no device tensors.

Definitions (per verify step per active row, a "row-step"):
* MAL (mean accepted length) = mean of num_accepted + 1, i.e. drafts accepted plus the recovered/bonus
  token, counted as the verifier saw them (before truncation at a stop token or max_new_tokens).
* acceptance[j-1] = P(the first j drafts were all accepted | the row verified >= j drafts), j = 1..K;
  with a fixed depth this is the usual cumulative acceptance p_j.
* accept_hist[a] = row-steps that accepted exactly a drafts; depth_hist[n] = row-steps that verified n.
* Time split per step: draft (drafter proposes), select (depth policy), verify (target forward and
  verification), commit (cache rollback, host copy, bookkeeping, drafter rollback), plus prefill.
  In AR steps the forward and sampling are billed to verify, the host bookkeeping to commit.
  Measured by `PhaseClock`: host wall-clock on the CPU; CUDA events on a GPU, so the device's queued work is billed
  to the phase that launched it, not to the phase that happens to sync (the events are read once, at the run's end).
* step_seconds keeps the same split per decode step, plus "on_commit": the part of a step's commit the
  drafter's `on_commit` took (its share of the drafting cost; AngelSpec §5 counts it in sample_tokens). Medians
  over steps (`median_step_seconds`) are the report's typical-step latencies, which one slow step cannot move.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

PHASES = ("prefill", "draft", "select", "verify", "commit")
STEP_PHASES = ("draft", "select", "verify", "commit", "on_commit")  # per decode step; on_commit is within commit
STALL_S = 1.0  # a decode step this long compiled a graph mid-run (steps take milliseconds here): reports flag it


class PhaseClock:
    """The engine's phase timer on `device`: `mark()` a point, `step(metrics, verify=(a, b), ...)` one decode step's
    phases from marks, `add(metrics, "prefill", a, b)` to a run total, `flush(metrics)` at the run's end.

    On the CPU a mark is `time.perf_counter()` and the seconds land at once. On CUDA a mark is an event recorded on
    the current stream: the seconds between two marks are the GPU's, so kernels are billed to the phase that
    launched them even when a later phase waits for them; the spans are read (one synchronize) in `flush`, never
    inside a step."""

    def __init__(self, device: Any) -> None:
        self.cuda = getattr(device, "type", str(device)) == "cuda"
        self._pending: list[tuple[str | None, dict[str, tuple[Any, Any]]]] = []

    def mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        import torch

        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def step(self, metrics: DecodeMetrics, **spans: tuple[Any, Any]) -> None:
        """One decode step's `STEP_PHASES` as (start mark, end mark) pairs (`DecodeMetrics.record_step_seconds`)."""
        if self.cuda:
            self._pending.append((None, spans))
        else:
            metrics.record_step_seconds(**{k: b - a for k, (a, b) in spans.items()})

    def add(self, metrics: DecodeMetrics, phase: str, start: Any, end: Any) -> None:
        """Add the seconds from `start` to `end` to the run's `phase` (prefill)."""
        if self.cuda:
            self._pending.append((phase, {phase: (start, end)}))
        else:
            metrics.seconds[phase] += end - start

    def flush(self, metrics: DecodeMetrics) -> None:
        """Read the CUDA spans into `metrics`, in step order (nothing to do on the CPU)."""
        if not self._pending:
            return
        import torch

        torch.cuda.synchronize()
        for phase, spans in self._pending:
            seconds = {k: a.elapsed_time(b) / 1e3 for k, (a, b) in spans.items()}
            if phase is None:
                metrics.record_step_seconds(**seconds)
            else:
                metrics.seconds[phase] += seconds[phase]
        self._pending.clear()


@dataclass
class DecodeMetrics:
    num_draft_tokens: int = 0  # K
    steps: int = 0  # decode / verify forwards of the whole batch (prefills not counted)
    row_steps: int = 0  # sum over steps of active rows
    accepted_plus_one: int = 0  # sum over row-steps of num_accepted + 1
    output_tokens: int = 0  # tokens returned to callers (after stop / length truncation)
    prompt_tokens: int = 0
    requests: int = 0
    wall_s: float = 0.0
    # This process's CPU time over the run, every thread (a measure a busy machine distorts less); 0 for a GPU run,
    # where it measures the host's waiting, not the decoding.
    cpu_s: float = 0.0
    accept_hist: list[int] = field(default_factory=list)  # [K+1]
    depth_hist: list[int] = field(default_factory=list)  # [K+1]
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    protocols: dict[str, int] = field(default_factory=dict)  # verify steps per protocol (greedy / ...)
    skipped_steps: int = 0  # steps of a speculative engine whose drafting the gate skipped (counted in steps)
    step_seconds: dict[str, list[float]] = field(default_factory=lambda: {p: [] for p in STEP_PHASES})

    def __post_init__(self) -> None:
        if not self.accept_hist:
            self.accept_hist = [0] * (self.num_draft_tokens + 1)
        if not self.depth_hist:
            self.depth_hist = [0] * (self.num_draft_tokens + 1)

    def record_verify(self, num_accepted: list[int], depths: list[int], protocol: str) -> None:
        """One speculative step: num_accepted and depths of the active rows (host ints)."""
        self.steps += 1
        self.protocols[protocol] = self.protocols.get(protocol, 0) + 1
        self.row_steps += len(num_accepted)
        for a, n in zip(num_accepted, depths, strict=True):
            self.accepted_plus_one += a + 1
            self.accept_hist[a] += 1
            self.depth_hist[n] += 1

    def record_decode(self, active_rows: int) -> None:
        """One plain AR step: every active row emitted one token."""
        self.steps += 1
        self.row_steps += active_rows
        self.accepted_plus_one += active_rows
        self.accept_hist[0] += active_rows
        self.depth_hist[0] += active_rows

    def record_step_seconds(self, **seconds: float) -> None:
        """One decode step's seconds per phase of `STEP_PHASES` (a phase not given took 0): kept per step and added
        to the run's `seconds` ("on_commit" only per step: its time is already part of "commit")."""
        for phase in STEP_PHASES:
            sec = seconds.pop(phase, 0.0)
            self.step_seconds[phase].append(sec)
            if phase in self.seconds:
                self.seconds[phase] += sec
        if seconds:
            raise ValueError(f"unknown step phases {sorted(seconds)}; expected some of {STEP_PHASES}")

    def _per_step(self, phases: Sequence[str]) -> list[float]:
        """Each decode step's seconds in `phases`, summed within the step."""
        return [sum(t) for t in zip(*(self.step_seconds[p] for p in phases), strict=True)]

    def median_step_seconds(self, phases: Sequence[str]) -> float:
        """The median over decode steps of the seconds a step spent in `phases` (summed within the step); 0.0
        before the first step."""
        per_step = self._per_step(phases)
        return statistics.median(per_step) if per_step else 0.0

    def slowest_step_seconds(self) -> float:
        """The longest decode step's seconds (0.0 before the first): a step of seconds where the median takes
        milliseconds compiled a graph mid-run, and the run's throughput then says little."""
        return max(self._per_step([p for p in STEP_PHASES if p != "on_commit"]), default=0.0)

    @property
    def mean_accepted_length(self) -> float:
        return self.accepted_plus_one / self.row_steps if self.row_steps else 0.0

    @property
    def acceptance(self) -> list[float]:
        """p_1..p_K as defined in the module docstring."""
        out = []
        for j in range(1, self.num_draft_tokens + 1):
            verified = sum(self.depth_hist[j:])
            all_ok = sum(self.accept_hist[j:])
            out.append(all_ok / verified if verified else 0.0)
        return out

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def tokens_per_cpu_s(self) -> float:
        return self.output_tokens / self.cpu_s if self.cpu_s > 0 else 0.0

    def summary(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "output_tokens": self.output_tokens,
            "prompt_tokens": self.prompt_tokens,
            "steps": self.steps,
            "num_draft_tokens": self.num_draft_tokens,
            "mean_accepted_length": self.mean_accepted_length,
            "acceptance": self.acceptance,
            "accept_hist": list(self.accept_hist),
            "depth_hist": list(self.depth_hist),
            "seconds": dict(self.seconds),
            "protocols": dict(self.protocols),
            "skipped_steps": self.skipped_steps,
            "wall_s": self.wall_s,
            "cpu_s": self.cpu_s,
            "tokens_per_s": self.tokens_per_s,
        }

    def format(self) -> str:
        acc = " ".join(f"{p:.2f}" for p in self.acceptance)
        t = " ".join(f"{k}={v * 1e3:.0f}ms" for k, v in self.seconds.items())
        gated = f" ({self.skipped_steps} without drafting)" if self.skipped_steps else ""
        return (f"{self.output_tokens} tokens in {self.wall_s:.2f}s ({self.tokens_per_s:.1f} tok/s), "
                f"{self.steps} steps{gated}, MAL {self.mean_accepted_length:.2f}, p_1..p_K [{acc}], {t}")
