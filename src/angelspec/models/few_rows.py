"""A CPU kernel for linear products over a few rows (2 to about 6 per thread), built from C at first use.

Why: on the CPUs this project is measured on, MKL and oneDNN run a product over a few rows well below memory speed:
multiplying the embedded target's weights by 2-8 rows cost 1.5-2.9 times one row through MKL and 1.6-2.3 times
through oneDNN's prepacked weights (`benchmarks/gemm_rows.py`), although every one of those products reads the same
weights. A verify forward over K + 1 positions and a decode step of a few requests are such products, so this is
what a speculative step pays over a plain one on a CPU. `kernels/few_rows.c` reads each block of weight rows from
memory once and multiplies it by every row of x while it sits in L1; where it wins, `models.linear` uses it for the
prepacked layers (`max_rows`).

Build: the machine's C compiler (`$CC`, else `cc`) compiles the source with AVX2 + FMA and OpenMP (without OpenMP
if that fails: one thread) into a shared library cached under `$ANGELSPEC_KERNEL_CACHE` (default
`~/.cache/angelspec/kernels`), named by a hash of the source, the flags and the compiler, and loads it with ctypes
(no torch headers: it builds in about a second). Nothing here is required: without a compiler, on a CPU without
AVX2 (or not x86), with `ANGELSPEC_FEW_ROWS=0`, or if the build fails, `available()` is False, `status()` says why,
and the prepacked layers use oneDNN as before. OpenMP threads come from the runtime torch itself loaded (the same
`libgomp.so.1`), as many as `torch.get_num_threads()`.

Every output element is computed the same way whatever the number of rows, so a row's result does not depend on
the other rows of the call (tested).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
from torch import Tensor

SOURCE = Path(__file__).with_name("kernels") / "few_rows.c"
FLAGS = ("-O3", "-mavx2", "-mfma", "-shared", "-fPIC")
ROWS_PER_THREAD = 6  # the kernel beats oneDNN's prepacked product up to about this many rows per thread
_CAPABLE = ("AVX2", "AVX512")  # torch's CPU capability names of x86 CPUs with AVX2 and FMA

_fn = None  # the loaded C function, once `_load` succeeded
_built: Path | None = None  # the library it came from
_threaded = False
_status: str | None = None  # None: not tried yet
_enabled = True


def _cache_dir() -> Path:
    root = os.environ.get("ANGELSPEC_KERNEL_CACHE")
    if root:
        return Path(root)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "angelspec" / "kernels"


def _build(compiler: str, openmp: bool) -> Path:
    """The cached library for this source, flags and compiler, compiled if missing (atomically: concurrent
    processes may build the same one)."""
    flags = (*FLAGS, "-fopenmp") if openmp else FLAGS
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
    digest = hashlib.sha256("\0".join([SOURCE.read_text(), *flags, compiler, version]).encode()).hexdigest()[:16]
    out = _cache_dir() / f"few_rows-{digest}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        part = Path(tmp) / out.name
        run = subprocess.run([compiler, *flags, "-o", str(part), str(SOURCE)], capture_output=True, text=True,
                             timeout=300)
        if run.returncode != 0:
            raise RuntimeError(run.stderr.strip().splitlines()[-1] if run.stderr.strip() else "compiler failed")
        os.replace(part, out)
    return out


def _load() -> None:
    global _fn, _threaded, _built, _status
    if os.environ.get("ANGELSPEC_FEW_ROWS", "1") == "0":
        _status = "off (ANGELSPEC_FEW_ROWS=0)"
        return
    if platform.machine().lower() not in ("x86_64", "amd64"):
        _status = f"not an x86-64 CPU ({platform.machine()})"
        return
    capability = torch.backends.cpu.get_cpu_capability()
    if not capability.startswith(_CAPABLE):
        _status = f"the CPU lacks AVX2 (torch reports {capability})"
        return
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        _status = "no C compiler (set CC or install gcc)"
        return
    errors = []
    for openmp in (True, False):
        try:
            lib = ctypes.CDLL(str(path := _build(compiler, openmp)))
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            errors.append(f"{'with' if openmp else 'without'} OpenMP: {e}")
            continue
        fn = lib.few_rows_linear
        fn.restype = None
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                       ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
        _fn, _threaded, _built = fn, openmp, path
        _status = f"built with {compiler}{'' if openmp else ', one thread (no OpenMP)'}"
        return
    _status = "build failed: " + "; ".join(errors)


def available() -> bool:
    """Whether the kernel is built and switched on (builds it at the first call)."""
    if _status is None:
        _load()
    return _enabled and _fn is not None


def status() -> str:
    """How the kernel was built, or why it is not used."""
    available()
    return _status if _enabled or _fn is None else f"switched off ({_status})"


def identity() -> str:
    """"few-rows:<digest of the build>" while the kernel is in use, else "": what a measured step cost depends on
    (`decoding.policies.costmodel.CostKey.kernels`)."""
    return f"few-rows:{_built.stem.rsplit('-', 1)[-1]}" if available() and _built is not None else ""


def set_enabled(enabled: bool) -> None:
    """Switch the kernel on or off in this process (benchmarks compare both sides in one run)."""
    global _enabled
    _enabled = enabled


def _threads() -> int:
    """The threads the kernel runs on now: torch's intra-op count, one without OpenMP."""
    return torch.get_num_threads() if _threaded else 1


def max_rows() -> int:
    """The most rows a product sends to the kernel now (0 where it is not available): `ROWS_PER_THREAD` per
    thread it runs on (`_threads`). Past that, oneDNN's prepacked product is faster."""
    return ROWS_PER_THREAD * _threads() if available() else 0


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """`F.linear(x, weight, bias)` through the kernel: x [..., K] fp32 on the CPU, weight [N, K] fp32 row-major
    contiguous, bias [N] or None. The caller checks `available()`."""
    k, n = x.shape[-1], weight.shape[0]
    flat = x.dim() == 2 and x.is_contiguous()  # (the common case, without the reshapes: this runs per layer)
    x2 = x if flat else x.reshape(-1, k).contiguous()
    rows = x2.shape[0]
    out = torch.empty((rows, n), dtype=torch.float32)
    b = None if bias is None else bias.contiguous().data_ptr()
    _fn(x2.data_ptr(), rows, k, weight.data_ptr(), n, b, out.data_ptr(), _threads())
    return out if flat else out.view(*x.shape[:-1], n)
