"""benchmarks/lookup_plan.py end to end on the embedded target, eager and tiny: both plans run beside AR with outputs
equal to AR's (the script exits otherwise), and the table carries each plan's ratios."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import lookup_plan  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("against", ["table", "unbounded"])
def test_both_plans_run_beside_ar_and_the_table_has_their_ratios(capsys, monkeypatch, against):
    monkeypatch.setattr(sys, "argv", ["lookup_plan.py", "--no-compile", "--concurrency", "1,2", "--max-new-tokens",
                                      "8", "--repeats", "2", "--against", against])
    lookup_plan.main()
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith(("| 1 |", "| 2 |"))]
    assert len(rows) == 2 and f"measured / {against}" in out
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert len(cells) == 8
        assert 0.2 < float(cells[2].split()[0]) < 5.0 and 0.2 < float(cells[3].split()[0]) < 5.0
        assert 0.2 < float(cells[4]) < 5.0
