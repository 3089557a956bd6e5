"""benchmarks/plain_step.py end to end on the embedded target, eager and tiny: every engine runs (AR, the plain steps
with the drafter's upkeep, holding every step's taps, making none but the window's, and lookup steps that verify
nothing), the speculative ones draft exactly where the script says (the script checks it and exits otherwise), and the
table carries a ratio per engine."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import plain_step  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def test_every_engine_runs_and_the_table_has_a_ratio_each(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["plain_step.py", "--no-compile", "--concurrency", "1,2", "--max-new-tokens",
                                      "6", "--repeats", "1"])
    plain_step.main()
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("| C |"))
    for name in ("AR", "upkeep", "held", "no taps", "lookup"):
        assert f"| {name} ms/step" in header
    rows = [line for line in out.splitlines() if line.startswith("| 1 |") or line.startswith("| 2 |")]
    assert len(rows) == 2
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert len(cells) == 2 + 5 + 4
        assert all(0.2 < float(r) < 5.0 for r in cells[-4:])  # each engine's throughput / AR's
