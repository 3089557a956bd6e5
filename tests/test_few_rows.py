"""`models.few_rows`: the native kernel for products over a few rows equals `F.linear`, gives a row the same result
whatever rows share its call, and where it cannot be built says why and leaves the prepacked layers on oneDNN
through the Python op."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
import torch.nn.functional as F

from angelspec.models import few_rows
from angelspec.models import linear as linear_module
from angelspec.models.linear import Linear, prepack_weights, transpose_weights

needs_kernel = pytest.mark.skipif(not few_rows.available(), reason=f"the kernel is not built: {few_rows.status()}")


def test_it_builds_wherever_there_is_a_compiler_and_avx2():
    capable = torch.backends.cpu.get_cpu_capability().startswith(few_rows._CAPABLE)
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if capable and compiler and os.environ.get("ANGELSPEC_FEW_ROWS", "1") != "0":
        assert few_rows.available(), few_rows.status()
    assert few_rows.status()


@needs_kernel
@pytest.mark.parametrize("n, k", [(1, 8), (5, 16), (7, 13), (33, 40), (768, 256)])
@pytest.mark.parametrize("bias", [False, True])
def test_the_kernel_equals_f_linear_for_every_row_count_and_shape(n, k, bias):
    torch.manual_seed(n * k)
    w = torch.randn(n, k)
    b = torch.randn(n) if bias else None
    for rows in range(1, 10):
        x = torch.randn(rows, k)
        torch.testing.assert_close(few_rows.linear(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-4)
    x3 = torch.randn(2, 3, k)  # leading dimensions are kept
    torch.testing.assert_close(few_rows.linear(x3, w, b), F.linear(x3, w, b), rtol=1e-5, atol=1e-4)


@needs_kernel
def test_a_row_gets_the_same_bits_whatever_rows_and_threads_share_its_call():
    torch.manual_seed(0)
    w, b = torch.randn(100, 72), torch.randn(100)
    x = torch.randn(9, 72)
    alone = torch.cat([few_rows.linear(x[i:i + 1], w, b) for i in range(9)])
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            for rows in (2, 3, 4, 5, 7, 9):
                assert torch.equal(few_rows.linear(x[:rows], w, b), alone[:rows]), (t, rows)
    finally:
        torch.set_num_threads(threads)


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """The kernel module as before its first use, building into an empty cache (a library loaded earlier in this
    process stays loaded: its ops register once)."""
    monkeypatch.setattr(few_rows, "_ready", False)
    monkeypatch.setattr(few_rows, "_status", None)
    monkeypatch.setattr(few_rows, "_enabled", True)
    monkeypatch.setenv("ANGELSPEC_KERNEL_CACHE", str(tmp_path / "kernels"))
    yield tmp_path / "kernels"
    monkeypatch.undo()
    few_rows._configure()


def test_without_a_working_compiler_it_says_why_and_the_packed_layer_uses_onednn(fresh, monkeypatch, tmp_path):
    broken = tmp_path / "c++"
    broken.write_text("#!/bin/sh\nexit 1\n")
    broken.chmod(0o755)
    monkeypatch.setenv("CXX", str(broken))
    assert not few_rows.available() and few_rows.max_rows() == 0 and few_rows.native_op() is None
    if torch.backends.cpu.get_cpu_capability().startswith(few_rows._CAPABLE):
        assert few_rows.status().startswith("build failed"), few_rows.status()
    if linear_module._linear_pointwise is None:
        return
    lin = Linear(256, 1024)
    transpose_weights(lin)
    assert prepack_weights(lin) == 1
    x = torch.randn(3, 256)
    with torch.no_grad():
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
    assert linear_module.copies(lin) == {"onednn"}  # through the Python op
    one = torch.randn(1, 256)
    with torch.no_grad():
        torch.testing.assert_close(lin(one), F.linear(one, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)


def test_it_can_be_switched_off_by_the_environment(fresh, monkeypatch):
    monkeypatch.setenv("ANGELSPEC_FEW_ROWS", "0")
    assert not few_rows.available() and "ANGELSPEC_FEW_ROWS" in few_rows.status()


@needs_kernel
def test_a_fresh_build_lands_in_the_cache_and_is_reused(fresh):
    assert few_rows.available(), few_rows.status()
    built = list(fresh.glob("packed_op-*.so"))
    assert len(built) == 1 and not [p for p in fresh.iterdir() if p.is_dir()]  # no temporary folder left
    mtime = built[0].stat().st_mtime_ns
    few_rows._ready, few_rows._status = False, None
    assert few_rows.available() and built[0].stat().st_mtime_ns == mtime
