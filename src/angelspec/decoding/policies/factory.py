"""Depth-policy specs: one string names how many drafts each request verifies per step (`--policy SPEC`).

Forms (K = drafts proposed per step, B = concurrent requests):

* `full`         verify all K drafts of every request (`FixedDepth()`, the default).
* `fixed:N`      verify the first N drafts of every request, 0 <= N <= K (`FixedDepth(N)`).
* `threshold:C`  per request, the longest prefix whose cumulative confidence prod_{t<=k} c_t >= C, C in [0, 1]
                 (`ConfidenceThreshold(C)`; no batch-level budget).
* `dcut`         D-cut (AngelSpec report §4.2, Eq. 19-24): top-K_rho(B) positions of the batch, with the ratio
                 rho* = argmax_rho U(B, rho) / C(B, rho) chosen every step from the measured cost table.
* `dcut:RHO`     D-cut at one fixed ratio RHO in {0.25, 0.5, 0.75, 1} (no cost model needed: Eq. 24 has a
                 single candidate).
* `dcut:max-loss=E`  D-cut whose ratio maximises U / C among the ratios that keep the expected committed tokens
                 within (1 - E) of full verification's, E in [0, 1) (`budget.dcut_select`'s max_loss): speed
                 bought with at most that share of acceptance.
* `alg1`, `alg1:TAU`  DSpark's hardware-aware prefix scheduler (Algorithm 1, greedy admission with early stop on
                 Theta = tau * SPS(B)); TAU is the candidate threshold of Algorithm 1's line
                 "C <- {(r, j) | a_{r,j} > eps}", a prefix survival in [0, 1) (default 1e-6).
* `production`   DSpark's production scheduler (budget sized from confidences two steps old, global search).
* `auto`         the serving setting: one depth for every row per step, chosen from the cost table and the measured
                 acceptance to commit the most tokens per second at the current batch size, narrowing with load,
                 and plain steps where no depth beats them (`gate.AutoDepth` / `gate.ServingGate`). `auto:slack=S`:
                 its lookup steps slow no request by more than a share S of its time per output token waiting on
                 the other rows' drafts (default 0.05; `auto:slack=none`: no bound, a little more throughput where
                 lookup steps pay, a longer tail).

Policies with a cost model (`dcut`, `alg1`, `production`, `auto`) receive the measured table from a
`costmodel.CostSource`: a table cached on disk per (target, drafter, K, dtype, torch, machine). The default source
only reads it (`costmodel.load_cost_table`); the commands pass `eval.cost_profile.load_or_profile`, which profiles a
missing table and re-profiles a stale one or one that lacks a batch size asked for.

`parse_policy` checks a spec without any model (so the command line can refuse a typo before loading
weights); `make_policy` builds the policy object for `SpecEngine(depth_policy=...)`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from angelspec.decoding.policies.dcut import DCUT_RATIOS

if TYPE_CHECKING:
    from angelspec.decoding.drafters.base import Drafter
    from angelspec.decoding.policies.base import DepthPolicy
    from angelspec.decoding.policies.costmodel import CostSource
    from angelspec.models.decoder import Decoder

POLICY_FORMS = ("full | fixed:N (0 <= N <= K) | threshold:C (C in [0, 1]) | dcut | dcut:RHO (RHO in 0.25, 0.5, "
                "0.75, 1) | dcut:max-loss=E (E in [0, 1)) | alg1 | alg1:TAU (TAU in [0, 1)) | production | auto | "
                "auto:slack=S (S >= 0, or none)")
POLICY_KINDS = ("full", "fixed", "threshold", "dcut", "alg1", "production", "auto")
COST_POLICIES = ("dcut", "alg1", "production", "auto")  # kinds that may need a measured cost table
DEFAULT_ALG1_EPS = 1e-6


class PolicyError(ValueError):
    """A depth-policy spec that cannot be used; the message lists the valid forms."""


@dataclass(frozen=True)
class PolicySpec:
    """A parsed `--policy` spec: `kind` in POLICY_KINDS and its numeric argument (None = the default)."""

    text: str
    kind: str
    arg: float | None = None
    max_loss: float | None = None  # dcut:max-loss=E

    @property
    def needs_cost_model(self) -> bool:
        """True when building the policy reads (or profiles) the cost table."""
        return self.kind in ("alg1", "production", "auto") or (self.kind == "dcut" and self.arg is None)

    @property
    def uses_drafts(self) -> bool:
        """False only for `full` (the one policy an AR run, with no drafter, can take)."""
        return self.kind != "full"


def _bad(spec: str, why: str) -> PolicyError:
    return PolicyError(f"bad depth policy {spec!r}: {why}; valid forms: {POLICY_FORMS}")


def _number(spec: str, arg: str, what: str) -> float:
    try:
        value = float(arg)
    except ValueError:
        raise _bad(spec, f"{what} must be a number, got {arg!r}") from None
    if not math.isfinite(value):
        raise _bad(spec, f"{what} must be finite, got {arg!r}")
    return value


def parse_policy(spec: str) -> PolicySpec:
    """Check a policy spec's form and values (no model needed). K-dependent limits (fixed:N <= K) are
    checked by `make_policy`."""
    if not isinstance(spec, str) or not spec.strip():
        raise _bad(str(spec), "empty spec")
    text = spec.strip()
    kind, sep, arg = text.partition(":")
    kind = kind.strip().lower()
    arg = arg.strip()
    if kind not in POLICY_KINDS:
        raise _bad(spec, f"unknown policy {kind!r}")
    if sep and not arg:
        raise _bad(spec, f"{kind}: is missing its value after the colon")
    if kind == "auto" and sep:
        name, eq, value = arg.partition("=")
        if name.strip().lower() != "slack" or not eq:
            raise _bad(spec, f"auto takes slack=S (the share of a request's time per output token its lookup steps "
                             f"may spend waiting on other rows' drafts, S >= 0, or none), got {arg!r}")
        if value.strip().lower() == "none":
            return PolicySpec(text, kind, math.inf)
        slack = _number(spec, value.strip(), "the latency slack S")  # (finite)
        if slack < 0.0:
            raise _bad(spec, f"auto:slack=S needs S >= 0 (or none), got {slack}")
        return PolicySpec(text, kind, slack)
    if kind in ("full", "production", "auto"):
        if sep:
            raise _bad(spec, f"{kind} takes no value")
        return PolicySpec(text, kind)
    if kind == "fixed":
        if not sep:
            raise _bad(spec, "fixed needs a depth: fixed:N")
        try:
            n = int(arg)
        except ValueError:
            raise _bad(spec, f"fixed:N needs an integer N >= 0, got {arg!r}") from None
        if n < 0:
            raise _bad(spec, f"fixed:N needs N >= 0, got {n}")
        return PolicySpec(text, kind, float(n))
    if kind == "threshold":
        if not sep:
            raise _bad(spec, "threshold needs a confidence: threshold:C")
        c = _number(spec, arg, "the threshold C")
        if not 0.0 <= c <= 1.0:
            raise _bad(spec, f"the threshold C must lie in [0, 1], got {c}")
        return PolicySpec(text, kind, c)
    if kind == "dcut":
        if not sep:
            return PolicySpec(text, kind)
        if arg.lower().startswith("max-loss="):
            e = _number(spec, arg.partition("=")[2], "the acceptance loss bound E")
            if not 0.0 <= e < 1.0:
                raise _bad(spec, f"dcut:max-loss=E needs E in [0, 1), got {e}")
            return PolicySpec(text, kind, None, e)
        rho = _number(spec, arg, "the ratio RHO")
        if not any(math.isclose(rho, r) for r in DCUT_RATIOS):
            raise _bad(spec, f"dcut:RHO takes one of the report's ratios {', '.join(map(str, DCUT_RATIOS))}, "
                             f"got {arg}")
        return PolicySpec(text, kind, next(r for r in DCUT_RATIOS if math.isclose(rho, r)))
    # alg1
    if not sep:
        return PolicySpec(text, kind)
    tau = _number(spec, arg, "the candidate threshold TAU")
    if not 0.0 <= tau < 1.0:
        raise _bad(spec, f"alg1:TAU needs a candidate threshold in [0, 1), got {tau}")
    return PolicySpec(text, kind, tau)


def cost_batch_sizes(max_batch: int) -> tuple[int, ...]:
    """Batch sizes to profile for runs of up to `max_batch` concurrent requests: powers of two below it,
    and `max_batch` itself (the table interpolates in between)."""
    if max_batch < 1:
        raise PolicyError(f"the cost table needs a batch size >= 1, got {max_batch}")
    sizes = {1 << i for i in range(max_batch.bit_length()) if 1 << i <= max_batch}
    return tuple(sorted(sizes | {max_batch}))


def make_policy(spec: str | PolicySpec, *, target: Decoder, drafter: Drafter | None, num_draft_tokens: int,
                cost_table_path: str | Path | None = None, batch_sizes: Sequence[int] = (1, 2, 4, 8),
                compile: bool = False, cost_drafter: Drafter | None = None,
                cost_source: CostSource | None = None,
                log: Callable[[str], None] | None = print) -> DepthPolicy | None:
    """The depth policy for `SpecEngine(target, drafter, depth_policy=...)`, or None (= the engine's
    default, full depth) for `full`.

    target: the frozen target `Decoder`; drafter: None for AR (only `full` is valid then);
    num_draft_tokens: K, drafts proposed per step; cost_table_path: the cost-table JSON for policies with a
    cost model (None = the per-setup file under `.cache/angelspec-costs/`); batch_sizes: the concurrent
    request counts the table must cover (see `cost_batch_sizes`); compile: the engine runs compiled, so the
    table is a compiled engine's (a compiled step costs far less, and in other proportions); cost_drafter: the
    drafter the table is profiled with when it is not `drafter` itself (a stand-in whose steps cost the same, for a
    drafter that cannot draft on the profiler's random prompts, such as `benchmarks/step_cost.py`'s oracle);
    cost_source: where the table comes from (None: `costmodel.load_cost_table`, which reads it and never profiles;
    `eval.cost_profile.load_or_profile` measures it); log: progress of a (re-)profile.
    """
    from angelspec.decoding.policies.base import ConfidenceThreshold, FixedDepth
    from angelspec.decoding.policies.budget import LinearCost
    from angelspec.decoding.policies.dcut import DCut
    from angelspec.decoding.policies.gate import DEFAULT_LATENCY_SLACK, AutoDepth
    from angelspec.decoding.policies.scheduler import PrefixScheduler, ProductionScheduler

    parsed = spec if isinstance(spec, PolicySpec) else parse_policy(spec)
    if drafter is None:
        if parsed.uses_drafts:
            raise PolicyError(f"depth policy {parsed.text!r} chooses how many drafts to verify, but there is no "
                              "drafter (autoregressive decoding); pick a drafter or use the policy full")
        return None
    if num_draft_tokens < 1:
        raise PolicyError(f"depth policy {parsed.text!r} needs num_draft_tokens >= 1, got {num_draft_tokens}")
    kind, arg = parsed.kind, parsed.arg
    if kind == "full":
        return FixedDepth()
    if kind == "fixed":
        assert arg is not None
        if int(arg) > num_draft_tokens:
            raise _bad(parsed.text, f"fixed:N verifies at most the K={num_draft_tokens} drafts proposed, got "
                                    f"N={int(arg)}; lower N or raise the number of draft tokens")
        return FixedDepth(int(arg))
    if kind == "threshold":
        assert arg is not None
        return ConfidenceThreshold(arg)
    if kind == "dcut" and arg is not None:
        return DCut(cost=LinearCost(), ratios=(arg,))  # one ratio: the cost never decides
    from angelspec.decoding.policies.costmodel import CostSettings, load_cost_table

    source = load_cost_table if cost_source is None else cost_source
    settings = CostSettings(batch_sizes=tuple(batch_sizes), num_draft_tokens=num_draft_tokens, compile=compile)
    table, what = source(target, cost_drafter or drafter, settings, cost_table_path, log=log)
    if log is not None:
        log(f"policy {parsed.text}: cost table {what}")
    if kind == "dcut":
        return DCut(cost=table, max_loss=parsed.max_loss)
    if kind == "auto":  # (arg: the slack; inf for auto:slack=none, no bound)
        slack = DEFAULT_LATENCY_SLACK if arg is None else None if math.isinf(arg) else arg
        return AutoDepth(cost=table, latency_slack=slack)
    if kind == "alg1":
        return PrefixScheduler(cost=table, eps=DEFAULT_ALG1_EPS if arg is None else arg)
    return ProductionScheduler(table)
