"""benchmarks/gpu_check.py's CPU mode (`--device cpu --quick`): every section runs at tiny shapes and the table
says each row passed (decode here with one shipped drafter in fp32, to keep the test short); asking for CUDA where
there is none is one line and exit 2."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"


def _script():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("gpu_check", module)  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.usefixtures("one_thread")
def test_quick_mode_runs_every_section_on_the_cpu(capsys):
    rc = _script().main(["--device", "cpu", "--quick", "--drafters", "mtp", "--dtypes", "fp32"])
    out = capsys.readouterr().out
    assert rc == 0, out
    for check in ("decode AR", "decode mtp", "train mtp", "train eagle3", "train dflash", "train dfly",
                  "train dspark", "prefill"):
        assert check in out, out
    assert "lossless 2/2" in out and " NO" not in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is visible")
def test_cuda_without_a_gpu_is_one_line_and_exit_2(capsys):
    assert _script().main(["--device", "cuda", "--quick"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no CUDA device" in err[0]
