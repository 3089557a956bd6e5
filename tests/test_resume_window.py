"""benchmarks/resume_window.py end to end on the embedded target, tiny: a row per drafter with each window's mean
accepted drafts per probe, the whole context's, and each window's share of it; with the window as long as the gap
between probes, the drafter sees what it sees with every step's taps held."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import resume_window  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def test_each_window_gets_its_acceptance_and_the_gaps_own_window_equals_the_whole_context(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["resume_window.py", "--drafters", "dfly", "--requests", "2",
                                      "--max-new-tokens", "24", "--gap", "6", "--windows", "0,6"])
    resume_window.main()
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| dfly |")]
    assert len(rows) == 1
    cells = [c.strip() for c in rows[0].strip("|").split("|")]
    assert cells[1] == "7" and cells[2] == "32"  # K, resume_window
    none, gap, full = (float(c) for c in cells[3:6])
    assert gap == full and 0.0 <= none <= 7.0 and float(cells[-1]) == 1.0
