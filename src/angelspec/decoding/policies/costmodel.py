"""The measured step-cost table the verification budgets read: latencies C(B, N) of whole speculative steps of B
requests that verify N positions in total (anchors included, the convention of `budget.py`), and its loader. The
profiler that measures it runs the engine and lives above this layer (`eval/cost_profile.py`); a policy receives the
table, or a `CostSource` that hands one over.

`CostTable` implements the `CostModel` protocol from those measurements:
* in N, for a measured B: piecewise-linear between the measured N, linear extrapolation from the end
  segments beyond them, never below the cheapest measurement of that B;
* in B: linear between the two nearest measured batch sizes at the same tokens per request u = N / B
  (so each row is read inside the range it was measured on), the nearest measured B outside them.
SPS(B, N) = 1 / C(B, N) is Algorithm 1's steps-per-second curve (`CostTable.sps`).

Tables are cached as JSON, keyed by `CostKey`: the target's `DecoderConfig.fingerprint()`, the drafter
(registry kind plus its own model fingerprint when it has one), K, dtype, torch version and a machine id
(CUDA device name, or hostname + CPU model + cores + intra-op threads). `load_cost_table` reads the table of a
setup and raises `StaleCostTableError` naming what differs (or what is missing) when there is no usable one;
`eval.cost_profile.load_or_profile`, a `CostSource` of the same shape, measures it instead.

Shape legend: B requests (batch rows), K draft depth, N verified positions per step (B <= N <= B(K+1)).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import socket
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from angelspec.decoding.drafters.base import Drafter, unwrap
from angelspec.decoding.drafters.draft_lm import DraftLMDrafter
from angelspec.decoding.drafters.families import family_of
from angelspec.fileio import write_json_atomic
from angelspec.models import few_rows
from angelspec.models.attention import resolve_attention_backend
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
    # the CPU kernels a step runs (`cpu_kernels`): the few-rows product's build (`models.few_rows.identity`, so a
    # changed kernel is measured again) and the attention when it is not SDPA's; "" where none is used (a GPU)
    kernels: str = ""

    def differences(self, other: CostKey) -> list[str]:
        """'field: mine != theirs' for every field that differs."""
        return [f"{k}: {v!r} != {getattr(other, k)!r}" for k, v in asdict(self).items() if getattr(other, k) != v]

    def to_json(self) -> dict[str, Any]:
        """The key's fields; `compiled` and `kernels` only when set, so a table without them keeps the file name and
        digest it had before the fields existed."""
        d = asdict(self)
        for name in ("compiled", "kernels"):
            if not d[name]:
                del d[name]
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
    inner = unwrap(drafter)  # calibration wrappers cost what the wrapped drafter costs
    family = family_of(inner)
    kind = type(inner).__name__ if family is None else family.name
    return f"{kind}:{inner.model.config.fingerprint()}" if isinstance(inner, DraftLMDrafter) else kind


def cost_key(target: Decoder, drafter: Drafter, num_draft_tokens: int, machine: str | None = None, *,
             compiled: bool = False) -> CostKey:
    weight = target.embed_tokens.weight
    return CostKey(model=target.config.fingerprint(), drafter=drafter_id(drafter), num_draft_tokens=num_draft_tokens,
                   dtype=str(weight.dtype).removeprefix("torch."), torch_version=torch.__version__,
                   machine=machine if machine is not None else machine_id(weight.device), compiled=compiled,
                   kernels=cpu_kernels(target) if weight.device.type == "cpu" else "")


def cpu_kernels(target: Decoder) -> str:
    """`CostKey.kernels` of a CPU target: "few-rows:<build>" while the product kernel is in use, joined by "|" with
    "attention:<backend>" where the target's cached attention is not SDPA's (`models.attention`)."""
    attention = resolve_attention_backend(target.attn_backend, target.embed_tokens.weight.device)
    parts = [few_rows.identity(), "" if attention == "sdpa" else f"attention:{attention}"]
    return "|".join(p for p in parts if p)


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
# What a table is measured for, and where it comes from
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CostSettings:
    """How a cost table is measured: the batch sizes B it must cover, the draft depth K, the N measured per B
    (`token_counts`, None: B(d+1) for every uniform depth d = 0..K), the timed steps per cell (`repeats`, after
    `warmup` untimed ones), the random prompts (`prompt_len` tokens, `seed`), the machine id of the key (None:
    `machine_id` of the target's device) and whether the engine runs compiled (a key of its own)."""

    batch_sizes: Sequence[int] = (1, 2, 4, 8)
    num_draft_tokens: int = 4
    token_counts: Sequence[int] | None = None
    repeats: int = 5
    warmup: int = 2
    prompt_len: int = 16
    seed: int = 0
    machine: str | None = None
    compile: bool = False

    def key(self, target: Decoder, drafter: Drafter) -> CostKey:
        """The key a table measured with these settings carries."""
        return cost_key(target, drafter, self.num_draft_tokens, self.machine, compiled=self.compile)


class CostSource(Protocol):
    """Hands a policy the cost table of a setup: (table, what happened). `load_cost_table` only reads;
    `eval.cost_profile.load_or_profile` measures a missing or stale one."""

    def __call__(self, target: Decoder, drafter: Drafter, settings: CostSettings, path: str | Path | None = None, *,
                 log: Callable[[str], None] | None = None) -> tuple[CostTable, str]: ...


def usable_table(path: Path, expected: CostKey, batch_sizes: Sequence[int]) -> tuple[CostTable | None, str]:
    """(the table at `path`, "loaded PATH") when it was measured under `expected` and covers `batch_sizes`; else
    (None, why not). A malformed file raises `CostTableError`."""
    if not path.exists():
        return None, "no table yet"
    try:
        table = CostTable.load(path, expected)
    except StaleCostTableError as e:
        return None, f"stale: {e}"
    missing = sorted(set(batch_sizes) - set(table.rows))
    if missing:
        return None, f"batch sizes {missing} not measured"
    return table, f"loaded {path}"


def load_cost_table(target: Decoder, drafter: Drafter, settings: CostSettings, path: str | Path | None = None, *,
                    log: Callable[[str], None] | None = None) -> tuple[CostTable, str]:
    """The cost table of this setup from `path` (default: `default_table_path` of its key), never measured:
    a missing, stale or too small table raises `StaleCostTableError` (measure one with `angelspec profile`).
    A `CostSource`; `log` is unused (nothing is profiled)."""
    expected = settings.key(target, drafter)
    path = Path(path) if path is not None else default_table_path(expected)
    table, what = usable_table(path, expected, settings.batch_sizes)
    if table is None:
        raise StaleCostTableError(f"no usable cost table at {path} ({what}); measure one with `angelspec profile`")
    return table, what
