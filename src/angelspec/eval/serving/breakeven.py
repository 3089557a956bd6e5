"""Break-even committed length (AngelSpec report §5, Eq. 25 and Table 8 in miniature) from a serving sweep's rows.

    C_BE_m(b) = 3 (T_exec,m(b) + T_sample,m(b)) / (T_exec,ref(b) + T_sample,ref(b))

T_exec is the target's verification per step (`verify`, the report's execute_model), T_sample drafting + depth
selection (`draft` + `select` + the drafter's `on_commit`, which the engine bills to its commit phase: the report's
sample_tokens covers all the proposer's work), both at concurrency b and both medians over the point's steps (the
report's T-tilde: one slow step does not move them; sweep.py's `EXEC_PHASES` / `SAMPLE_PHASES`). The reference is an MTP
configuration when one is present (the report's Hy3-MTP3, assumed to commit 3 tokens per step), else the
first speculative configuration; we also give the variant that uses the reference's measured MAL instead of
3. A method is predicted to beat the reference at concurrency b when its measured MAL exceeds C_BE_m(b).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from angelspec.eval.serving.base import ServingError, ServingRow, concurrency_levels, find_row, first_rows

REFERENCE_COMMIT = 3.0  # tokens per step the report assumes for its MTP3 reference (Eq. 25)


@dataclass(frozen=True)
class BreakEven:
    """Eq. 25 per concurrency: values[config][C] = C_BE with the report's 3-token reference,
    measured_ref[config][C] = the same with the reference's measured MAL instead of 3."""

    reference: str
    why: str
    values: dict[str, dict[int, float]]
    measured_ref: dict[str, dict[int, float]]
    mal: dict[str, dict[int, float]]


def compute_breakeven(rows: Sequence[ServingRow], reference: str | None = None) -> BreakEven | None:
    """Eq. 25 for every speculative configuration against `reference` (None = the first MTP
    configuration at full depth, else the first MTP one, else the first speculative one)."""
    first = first_rows(rows)
    spec = [c for c, r in first.items() if r.kind != "ar"]
    if not spec:
        return None
    if reference is not None:
        if reference not in spec:
            raise ServingError(f"break-even reference {reference!r} is not a speculative configuration of this "
                               f"sweep ({', '.join(spec) or 'none'})")
        why = "chosen"
    else:
        mtp = [c for c in spec if first[c].kind == "mtp"]
        full_mtp = [c for c in mtp if first[c].policy == "full"]
        reference = (full_mtp or mtp or spec)[0]
        why = "the MTP configuration" if mtp else "no MTP configuration in the sweep: the first speculative one"
    values: dict[str, dict[int, float]] = {}
    measured: dict[str, dict[int, float]] = {}
    mal: dict[str, dict[int, float]] = {}
    for name in spec:
        values[name], measured[name], mal[name] = {}, {}, {}
        for c in concurrency_levels(rows):
            m, ref = find_row(rows, name, c), find_row(rows, reference, c)
            if m is None or ref is None or ref.step_s <= 0:
                continue
            ratio = m.step_s / ref.step_s
            values[name][c] = REFERENCE_COMMIT * ratio
            measured[name][c] = ref.mal * ratio
            mal[name][c] = m.mal
    return BreakEven(reference=reference, why=why, values=values, measured_ref=measured, mal=mal)


def format_breakeven(rows: Sequence[ServingRow], reference: str | None = None) -> str:
    """The Eq. 25 table: one line per concurrency and an average, each cell C_BE / measured MAL."""
    be = compute_breakeven(rows, reference)
    if be is None:
        return "break-even committed length (Eq. 25): no speculative configuration"
    names = list(be.values)
    w = max(15, *(len(n) + 3 for n in names))
    lines = [f"break-even committed length C_BE (Eq. 25): reference {be.reference!r} ({be.why}), assumed to "
             f"commit {REFERENCE_COMMIT:g} tokens per step as in the report; per cell: C_BE / measured MAL "
             "(the method is predicted to beat the reference where MAL > C_BE). Medians per step: T_exec = verify, "
             "T_sample = draft (propose + on_commit) + select.",
             f"{'C':>5}" + "".join(f"{n:>{w}}" for n in names)]
    for c in concurrency_levels(rows):
        cells = "".join(f"{_be_cell(be.values[n].get(c), be.mal[n].get(c)):>{w}}" for n in names)
        lines.append(f"{c:>5}{cells}")
    avg = "".join(f"{_be_cell(_mean(be.values[n].values()), _mean(be.mal[n].values())):>{w}}" for n in names)
    lines.append(f"{'Avg.':>5}{avg}")
    lines.append("with the reference's measured MAL instead of 3: "
                 + "; ".join(f"{n} {_mean(be.measured_ref[n].values()):.2f}" for n in names if n != be.reference))
    return "\n".join(lines)


def breakeven_json(rows: Sequence[ServingRow], reference: str | None = None) -> dict[str, object] | None:
    """The `breakeven` entry of results.json (concurrency keys as strings), None without speculation."""
    be = compute_breakeven(rows, reference)
    if be is None:
        return None
    return {"reference": be.reference, "why": be.why, "reference_commit": REFERENCE_COMMIT,
            "values": {n: {str(c): v for c, v in d.items()} for n, d in be.values.items()},
            "with_measured_reference_mal": {n: {str(c): v for c, v in d.items()} for n, d in be.measured_ref.items()}}


def _mean(values: Iterable[float]) -> float | None:
    values = list(values)
    return statistics.fmean(values) if values else None


def _be_cell(value: float | None, mal: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.2f}" + ("" if mal is None else f" / {mal:.2f}")
