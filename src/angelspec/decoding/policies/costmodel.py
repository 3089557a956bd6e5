"""The start-up cost profiler: measured step latencies C(B, N) for the verification budgets (issue 6, "Cost model").

`profile_costs` runs the real engine on synthetic prompts and times whole speculative steps: draft +
select + pack + verify + commit, the interval between two consecutive verifications of a batch of B
requests that verify N positions in total (anchors included, the convention of `spec/budget.py`). The N
positions are spread over the rows the way a budget policy keeps them (every anchor, then drafts as evenly
as possible), and the policy declares itself data-dependent like D-cut, so the second host sync of the
verify width is paid too. Each cell keeps the median of `repeats` steps after `warmup` untimed ones.

`CostTable` implements the `CostModel` protocol from those measurements:
* in N, for a measured B: piecewise-linear between the measured N, linear extrapolation from the end
  segments beyond them, never below the cheapest measurement of that B;
* in B: linear between the two nearest measured batch sizes at the same tokens per request u = N / B
  (so each row is read inside the range it was measured on), the nearest measured B outside them.
SPS(B, N) = 1 / C(B, N) is Algorithm 1's steps-per-second curve (`CostTable.sps`).

Tables are cached as JSON, keyed by `CostKey`: the target's `DecoderConfig.fingerprint()`, the drafter
(registry kind plus its own model fingerprint when it has one), K, dtype, torch version and a machine id
(CUDA device name, or hostname + CPU model + cores + intra-op threads). `load_or_profile` re-profiles a
stale or foreign table, or raises `StaleCostTableError` naming what differs when re-profiling is off.

Shape legend: B requests (batch rows), K draft depth, N verified positions per step (B <= N <= B(K+1)).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import socket
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from angelspec.decoding.drafters.base import Drafter, DraftState, Proposal, full_depth_drafting
from angelspec.decoding.drafters.families import family_of
from angelspec.decoding.engine import EngineConfig, Request, SpecEngine, VerifyEvent
from angelspec.fileio import write_json_atomic
from angelspec.models.decoder import Decoder

DEFAULT_COST_DIR = Path(".cache/angelspec-costs")
FORMAT = "angelspec-cost-table"
VERSION = 1


class CostTableError(ValueError):
    """A cost table that cannot be used: unreadable, malformed, or asked for settings it cannot give."""


class StaleCostTableError(CostTableError):
    """The table on disk was profiled for another model, drafter, dtype, torch version or machine."""


# ---------------------------------------------------------------------------------------------------------
# Keys
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CostKey:
    """What a measured latency depends on; a table is valid only for an equal key."""

    model: str  # the target's DecoderConfig.fingerprint()
    drafter: str  # registry kind, plus ":<fingerprint>" of the drafter's own model when it has one
    num_draft_tokens: int  # K
    dtype: str  # the target's parameter dtype
    torch_version: str
    machine: str  # see machine_id
    compiled: bool = False  # measured with the engine's torch.compile on (a compiled step costs far less)

    def differences(self, other: CostKey) -> list[str]:
        """'field: mine != theirs' for every field that differs."""
        return [f"{k}: {v!r} != {getattr(other, k)!r}" for k, v in asdict(self).items() if getattr(other, k) != v]

    def to_json(self) -> dict[str, Any]:
        """The key's fields; `compiled` only when set, so an eager table keeps the file name and digest it had
        before the field existed."""
        d = asdict(self)
        if not self.compiled:
            del d["compiled"]
        return d

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.to_json(), sort_keys=True).encode()).hexdigest()[:12]


def machine_id(device: torch.device | str = "cpu") -> str:
    """CUDA device name for a CUDA device; else hostname, CPU model, core count and intra-op threads (a
    table measured with 1 thread does not describe 2)."""
    device = torch.device(device)
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return f"{socket.gethostname()}|{_cpu_model()}|{os.cpu_count()} cores|{torch.get_num_threads()} threads"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def drafter_id(drafter: Drafter) -> str:
    """Registry kind of the drafter (class name when unregistered), plus its own model's config fingerprint
    when it wraps a `Decoder` (two draft LMs of one kind but other sizes cost differently)."""
    inner = getattr(drafter, "inner", drafter)  # calibration wrappers cost what the wrapped drafter costs
    family = family_of(inner)
    kind = type(inner).__name__ if family is None else family.name
    model = getattr(inner, "model", None)
    return f"{kind}:{model.config.fingerprint()}" if isinstance(model, Decoder) else kind


def cost_key(target: Decoder, drafter: Drafter, num_draft_tokens: int, machine: str | None = None, *,
             compiled: bool = False) -> CostKey:
    weight = target.embed_tokens.weight
    return CostKey(model=target.config.fingerprint(), drafter=drafter_id(drafter), num_draft_tokens=num_draft_tokens,
                   dtype=str(weight.dtype).removeprefix("torch."), torch_version=torch.__version__,
                   machine=machine if machine is not None else machine_id(weight.device), compiled=compiled)


def default_table_path(key: CostKey, cache_dir: Path = DEFAULT_COST_DIR) -> Path:
    """`<cache_dir>/<model fingerprint>-<key digest>.json`: one file per key, so tables never overwrite
    each other across machines or drafters sharing a cache folder."""
    return cache_dir / f"{key.model}-{key.digest()}.json"


# ---------------------------------------------------------------------------------------------------------
# The table
# ---------------------------------------------------------------------------------------------------------


def _lerp(x: float, x0: float, y0: float, x1: float, y1: float) -> float:
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclass(frozen=True)
class CostTable:
    """Measured step latencies: rows[B] = ((N, seconds), ...) sorted by N. A `CostModel` (see module doc)."""

    key: CostKey
    rows: dict[int, tuple[tuple[int, float], ...]]
    settings: dict[str, Any] = field(default_factory=dict)  # how it was measured (repeats, warmup, ...)

    def __post_init__(self) -> None:
        if not self.rows:
            raise CostTableError("a cost table needs at least one measured batch size")
        for b, row in self.rows.items():
            ns = [n for n, _ in row]
            if not row or ns != sorted(set(ns)) or any(not (math.isfinite(c) and c > 0) for _, c in row):
                raise CostTableError(f"cost table row B={b} must hold distinct increasing N with finite positive "
                                     f"seconds, got {list(row)}")

    @property
    def batch_sizes(self) -> tuple[int, ...]:
        return tuple(sorted(self.rows))

    def row_cost(self, batch_size: int, num_tokens: float) -> float:
        """Piecewise-linear in N within a measured row; linear extrapolation from the end segments, floored
        at the row's cheapest measurement."""
        row = self.rows[batch_size]
        if len(row) == 1:
            return row[0][1]
        i = 1
        while i < len(row) - 1 and num_tokens > row[i][0]:
            i += 1
        (n0, c0), (n1, c1) = row[i - 1], row[i]
        return max(_lerp(num_tokens, n0, c0, n1, c1), min(c for _, c in row))

    def __call__(self, num_requests: int, num_tokens: int) -> float:
        if num_requests < 1:
            raise CostTableError(f"cost of a step needs num_requests >= 1, got {num_requests}")
        bs = self.batch_sizes
        if num_requests in self.rows:
            return self.row_cost(num_requests, num_tokens)
        per_request = num_tokens / num_requests  # u = N / B, read off each row at its own B
        if num_requests < bs[0] or num_requests > bs[-1]:
            b = bs[0] if num_requests < bs[0] else bs[-1]
            return self.row_cost(b, per_request * b)
        hi = next(b for b in bs if b > num_requests)
        lo = max(b for b in bs if b < num_requests)
        return _lerp(num_requests, lo, self.row_cost(lo, per_request * lo), hi, self.row_cost(hi, per_request * hi))

    def sps(self, num_requests: int, num_tokens: int) -> float:
        """Steps per second SPS = 1 / C(B, N) (Algorithm 1's hardware curve)."""
        return 1.0 / self(num_requests, num_tokens)

    def format(self) -> str:
        """One line per measured B: N -> milliseconds per step and steps/s."""
        compiled = ", compiled" if self.key.compiled else ""
        lines = [f"cost table for {self.key.model} + {self.key.drafter}, K={self.key.num_draft_tokens}, "
                 f"{self.key.dtype}, torch {self.key.torch_version}, {self.key.machine}{compiled}"]
        for b in self.batch_sizes:
            cells = "  ".join(f"N={n}: {c * 1e3:.2f} ms ({1 / c:.0f}/s)" for n, c in self.rows[b])
            lines.append(f"  B={b:<3} {cells}")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "version": VERSION, "key": self.key.to_json(), "settings": self.settings,
                "rows": {str(b): [[n, c] for n, c in self.rows[b]] for b in self.batch_sizes}}

    @classmethod
    def from_json(cls, obj: Any, source: str = "cost table") -> CostTable:
        if not isinstance(obj, dict) or obj.get("format") != FORMAT:
            raise CostTableError(f"{source} is not an AngelSpec cost table (no \"format\": {FORMAT!r})")
        if obj.get("version") != VERSION:
            raise StaleCostTableError(f"{source} has format version {obj.get('version')!r}, this AngelSpec writes "
                                      f"{VERSION}")
        try:
            key = CostKey(**obj["key"])
            rows = {int(b): tuple((int(n), float(c)) for n, c in row) for b, row in obj["rows"].items()}
        except (KeyError, TypeError, ValueError) as e:
            raise CostTableError(f"{source} is malformed ({type(e).__name__}: {e})") from None
        return cls(key=key, rows=rows, settings=dict(obj.get("settings", {})))

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, self.to_json())
        return path

    @classmethod
    def load(cls, path: str | Path, expected: CostKey | None = None) -> CostTable:
        """Read a table; with `expected`, refuse one measured under another key (StaleCostTableError)."""
        path = Path(path)
        try:
            obj = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CostTableError(f"cost table {path} is not valid JSON ({e})") from None
        table = cls.from_json(obj, source=f"cost table {path}")
        if expected is not None and table.key != expected:
            raise StaleCostTableError(f"cost table {path} was profiled under another setup ("
                                      + "; ".join(table.key.differences(expected)) + "): re-profile it")
        return table


# ---------------------------------------------------------------------------------------------------------
# Profiling
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SpreadDepth:
    """Depth policy verifying `num_tokens` positions in total: every active row's anchor, then the drafts
    spread as evenly as possible (the first rows get one more). Declares itself data-dependent and
    proposal-reading, like D-cut, so the profiled step pays what a budget policy's step pays."""

    num_tokens: int
    uses_proposal: bool = True
    static_depth: int | None = None

    def __call__(self, proposal: Proposal, state: DraftState) -> Tensor:
        rows = state.active_rows
        q, r = divmod(max(self.num_tokens - len(rows), 0), len(rows))
        depth = [0] * state.seq_lens.shape[0]
        for j, row in enumerate(rows):
            depth[row] = min(q + (j < r), state.num_draft_tokens)
        return torch.tensor(depth, dtype=torch.int64, device=state.seq_lens.device)


class _Enough(Exception):
    """Raised by the step timer to end a profiling run once it has its samples."""


def token_grid(batch_size: int, k: int, token_counts: Sequence[int] | None = None) -> list[int]:
    """The N measured for one B: B(d+1) for every uniform depth d = 0..K by default; else `token_counts`
    clipped to [B, B(K+1)], always with both ends so interpolation covers the whole range."""
    lo, hi = batch_size, batch_size * (k + 1)
    ns = {batch_size * (d + 1) for d in range(k + 1)} if token_counts is None else \
        {min(max(int(n), lo), hi) for n in token_counts} | {lo, hi}
    return sorted(ns)


def profile_costs(target: Decoder, drafter: Drafter, *, batch_sizes: Sequence[int] = (1, 2, 4, 8),
                  token_counts: Sequence[int] | None = None, num_draft_tokens: int = 4, repeats: int = 5,
                  warmup: int = 2, prompt_len: int = 16, seed: int = 0,
                  clock: Callable[[], float] = time.perf_counter, machine: str | None = None,
                  compile: bool = False, log: Callable[[str], None] | None = None) -> CostTable:
    """Measure C(B, N) for every B in `batch_sizes` and N in `token_grid(B, K, token_counts)`; with `compile`, on
    a compiled engine (`EngineConfig.compile`: the table of a compiled engine, whose steps cost far less).

    Per cell: B greedy requests on random prompts of `prompt_len` tokens (seeded), decoded by a `SpecEngine`
    whose `SpreadDepth(N)` policy verifies N positions per step; `clock` is read once per verification
    (the engine's `on_verify` hook), so consecutive readings are one whole step apart. The first `warmup`
    intervals are dropped, the median of the next `repeats` is kept. Every row drafts all K for the profile
    (`full_depth_drafting`: a draft LM's early stop is off, the n-gram lookup pads rows that matched nothing), so
    each step verifies N positions."""
    if repeats < 1 or warmup < 0 or prompt_len < 1 or num_draft_tokens < 1:
        raise CostTableError(f"profile needs repeats >= 1, warmup >= 0, prompt_len >= 1 and K >= 1; got {repeats}, "
                             f"{warmup}, {prompt_len}, {num_draft_tokens}")
    if not batch_sizes or any(b < 1 for b in batch_sizes):
        raise CostTableError(f"batch sizes must be positive integers, got {list(batch_sizes)}")
    k = num_draft_tokens
    intervals = warmup + repeats
    # A step commits at most K+1 tokens per row: with this budget no row finishes before the last reading.
    new_tokens = (intervals + 2) * (k + 1)
    context = min(target.config.max_position_embeddings, drafter.max_positions or target.config.max_position_embeddings)
    if prompt_len + new_tokens > context:
        raise CostTableError(f"profiling {intervals} steps at K={k} needs {prompt_len + new_tokens} positions, more "
                             f"than the context of {context}; lower repeats, warmup or prompt_len")
    gen = torch.Generator().manual_seed(seed)
    vocab = target.config.vocab_size
    rows: dict[int, tuple[tuple[int, float], ...]] = {}
    for b in sorted(set(batch_sizes)):
        requests = [Request(prompt_ids=torch.randint(0, vocab, (prompt_len,), generator=gen).tolist(),
                            max_new_tokens=new_tokens, stop_ids=()) for _ in range(b)]
        cells = []
        for n in token_grid(b, k, token_counts):
            times: list[float] = []

            def tick(_: VerifyEvent, times: list[float] = times) -> None:
                times.append(clock())
                if len(times) > intervals:
                    raise _Enough

            engine = SpecEngine(target, drafter, EngineConfig(max_batch_size=b, num_draft_tokens=k,
                                                              max_seq_len=prompt_len + new_tokens, compile=compile),
                                depth_policy=SpreadDepth(n), on_verify=tick)
            try:
                with full_depth_drafting(drafter):  # an early-stopping drafter would verify fewer than N
                    engine.generate(requests)
            except _Enough:
                pass
            steps = [t1 - t0 for t0, t1 in zip(times, times[1:], strict=False)][warmup:]
            if len(steps) < repeats:
                raise CostTableError(f"B={b}, N={n}: the run ended after {len(steps)} timed steps, {repeats} needed")
            cells.append((n, statistics.median(steps)))
            if log is not None:
                log(f"B={b} N={n}: {cells[-1][1] * 1e3:.2f} ms/step (median of {repeats})")
        rows[b] = tuple(cells)
    key = cost_key(target, drafter, k, machine, compiled=compile)
    return CostTable(key=key, rows=rows, settings={"repeats": repeats, "warmup": warmup, "prompt_len": prompt_len,
                                                   "seed": seed, "token_counts": None if token_counts is None
                                                   else [int(n) for n in token_counts]})


def load_or_profile(target: Decoder, drafter: Drafter, path: str | Path | None = None, *,
                    batch_sizes: Sequence[int] = (1, 2, 4, 8), num_draft_tokens: int = 4,
                    token_counts: Sequence[int] | None = None, repeats: int = 5, warmup: int = 2,
                    reprofile: bool = True, force: bool = False, machine: str | None = None,
                    clock: Callable[[], float] = time.perf_counter, compile: bool = False,
                    log: Callable[[str], None] | None = None) -> tuple[CostTable, str]:
    """The cost table for this setup from `path` (default: `default_table_path` of its key), profiled and
    saved when missing, stale/foreign (other key), lacking a batch size, or when `force`. With
    `reprofile=False` a stale or missing table is an error instead. compile: the table of a compiled engine
    (a key of its own). Returns (table, what happened)."""
    expected = cost_key(target, drafter, num_draft_tokens, machine, compiled=compile)
    path = Path(path) if path is not None else default_table_path(expected)
    reason = "forced" if force else None
    if reason is None and not path.exists():
        reason = "no table yet"
    if reason is None:
        try:
            table = CostTable.load(path, expected)
        except StaleCostTableError as e:
            if not reprofile:
                raise
            reason = f"stale: {e}"
        else:
            missing = sorted(set(batch_sizes) - set(table.rows))
            if not missing:
                return table, f"loaded {path}"
            reason = f"batch sizes {missing} not measured"
    if not reprofile:
        raise StaleCostTableError(f"no usable cost table at {path} ({reason}) and re-profiling is disabled")
    table = profile_costs(target, drafter, batch_sizes=batch_sizes, token_counts=token_counts,
                          num_draft_tokens=num_draft_tokens, repeats=repeats, warmup=warmup, clock=clock,
                          machine=machine, compile=compile, log=log)
    table.save(path)
    return table, f"profiled ({reason}), wrote {path}"
