"""A CPU kernel for linear products over a few rows, and the prepacked layers' product as a native torch op, built
from C++ at first use.

Why the kernel: on the CPUs this project is measured on, MKL and oneDNN run a product over a few rows well below
memory speed: multiplying the embedded target's weights by 2-8 rows cost 1.5-2.9 times one row through MKL and
1.6-2.3 times through oneDNN's prepacked weights (`benchmarks/gemm_rows.py`), although every one of those products
reads the same weights. A verify forward over K + 1 positions and a decode step of a few requests are such products,
so this is what a speculative step pays over a plain one on a CPU. `kernels/few_rows.c` reads each block of weight
rows from memory once and multiplies it by every row of x while it sits in L1.

Why a native op: the prepacked layers call one op per product (`models.linear`), 19 a forward on the embedded
target, and an op implemented in Python costs 15-30 us a call in dispatch and interpreter time, as much as a small
product itself. `kernels/packed_op.cpp` is that op in C++ (`angelspec_native::packed_linear`: the module's copies of
its weight, checked at every call, the kernel up to `max_rows()` rows, oneDNN's prepacked product past that), so
that one row, too, goes faster through the kernel than through MKL. Where it cannot be built, `models.linear` keeps
its Python op (oneDNN only).

Build: the machine's C++ compiler (`$CXX`, else `c++` or `g++`) compiles `packed_op.cpp` (which includes
`few_rows.c`) with AVX2 + FMA and OpenMP (without OpenMP if that fails: one thread), against the headers of the torch
that runs it (they ship with every torch wheel), into a shared library cached under `$ANGELSPEC_KERNEL_CACHE`
(default `~/.cache/angelspec/kernels`), named by a hash of the sources, the flags, the compiler and the torch build:
about 15 s once per machine and torch. `torch.ops.load_library` loads it. Nothing here is required: without a
compiler, on a CPU without AVX2 (or not x86), with `ANGELSPEC_FEW_ROWS=0`, or if the build fails, `available()` is
False, `status()` says why, and the prepacked layers use oneDNN as before. OpenMP threads come from the runtime torch
itself loaded (the same `libgomp.so.1`), as many as `torch.get_num_threads()`.

Every output element is computed the same way whatever the number of rows, so a row's result does not depend on
the other rows of the call (tested).

The same library holds the attention of decode and verify steps over a KV cache (`kernels/cached_attention.c`,
`attention_op()`, the "native" attention backend of `models.attention`): where the library is not built, attention
takes SDPA's masked path instead.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from torch import Tensor

KERNELS = Path(__file__).with_name("kernels")
SOURCES = (KERNELS / "packed_op.cpp", KERNELS / "few_rows.c", KERNELS / "cached_attention.c")
FLAGS = ("-O3", "-mavx2", "-mfma", "-shared", "-fPIC", "-std=c++17", "-w")
ROWS_PER_THREAD = 6  # the kernel beats oneDNN's prepacked product up to about this many rows per thread
_CAPABLE = ("AVX2", "AVX512")  # torch's CPU capability names of x86 CPUs with AVX2 and FMA

_loaded: Path | None = None  # the library loaded into this process (its ops cannot be loaded twice)
_op: torch._ops.OpOverload | None = None  # its packed product, once loaded
_ready = False  # the last `_load` found the library (built, or loaded earlier in this process)
_threaded = False
_status: str | None = None  # None: not tried yet
_enabled = True
_native_on = True  # `set_enabled(native=...)`


def _cache_dir() -> Path:
    root = os.environ.get("ANGELSPEC_KERNEL_CACHE")
    if root:
        return Path(root)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "angelspec" / "kernels"


def _torch_flags() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(compile flags, link flags) for the running torch: its headers and C++ ABI, its libraries (after the source:
    linkers that drop libraries nothing before them needs)."""
    root = Path(torch.__file__).parent
    lib = root / "lib"
    return ((f"-I{root / 'include'}", f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"),
            (f"-L{lib}", f"-Wl,-rpath,{lib}", "-lc10", "-ltorch_cpu"))


def _build(compiler: str, openmp: bool) -> Path:
    """The cached library for these sources, flags, compiler and torch, compiled if missing (atomically: concurrent
    processes may build the same one)."""
    include, link = _torch_flags()
    flags = (*FLAGS, *(("-fopenmp",) if openmp else ()), *include)
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
    text = "\0".join([*(s.read_text() for s in SOURCES), *flags, *link, compiler, version, torch.__version__])
    out = _cache_dir() / f"packed_op-{hashlib.sha256(text.encode()).hexdigest()[:16]}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    print(f"angelspec: building the native CPU op for this torch (once, about 15 s) into {out.parent}",
          file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        part = Path(tmp) / out.name
        run = subprocess.run([compiler, *flags, "-o", str(part), str(SOURCES[0]), *link], capture_output=True,
                             text=True, timeout=600)
        if run.returncode != 0:
            errors = [line for line in run.stderr.splitlines() if "error" in line] or run.stderr.strip().splitlines()
            raise RuntimeError(errors[0].strip() if errors else "the compiler failed")
        os.replace(part, out)
    return out


def _load() -> None:
    global _threaded, _loaded, _status, _op, _ready
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
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not compiler:
        _status = "no C++ compiler (set CXX or install g++)"
        return
    errors = []
    for openmp in (True, False):
        try:
            path = _build(compiler, openmp)
            if _loaded is None:  # (a library's ops register once per process: a later build reuses them)
                torch.ops.load_library(str(path))
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            errors.append(f"{'with' if openmp else 'without'} OpenMP: {e}")
            continue
        if _loaded is None:
            torch.library.register_fake("angelspec_native::packed_linear")(_product_shape)
            torch.library.register_fake("angelspec_native::few_rows_linear")(_product_shape)
            torch.library.register_fake("angelspec_native::cached_attention")(_attention_shape)
            _loaded, _threaded = path, bool(torch.ops.angelspec_native.threaded())
            _op = torch.ops.angelspec_native.packed_linear.default
        _ready = True
        _status = f"built with {compiler}{'' if _threaded else ', one thread (no OpenMP)'}"
        _configure()
        return
    _status = "build failed: " + "; ".join(errors)


def _product_shape(x: Tensor, weight: Tensor, bias: Tensor | None = None, key: Tensor | None = None) -> Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _attention_shape(q: Tensor, k: Tensor, v: Tensor, start: Tensor, scale: float) -> Tensor:
    B, H, T, D = q.shape
    return q.new_empty((B, T, H, D)).transpose(1, 2)


def _configure() -> None:
    if _loaded is not None:
        torch.ops.angelspec_native.configure(ROWS_PER_THREAD if _enabled and _ready else 0)


def available() -> bool:
    """Whether the kernel is built and switched on (builds it at the first call)."""
    if _status is None:
        _load()
    return _enabled and _ready and _native_on


def native_op() -> torch._ops.OpOverload | None:
    """The native prepacked product (`angelspec_native::packed_linear`) where the library is loaded, else None. It
    never builds: `available()` does, which every prepacking calls first (`models.linear.prepack_available`)."""
    return _op if _ready and _native_on else None


def attention_op() -> torch._ops.OpOverload | None:
    """The native cached attention (`angelspec_native::cached_attention`, `kernels/cached_attention.c`: q [B, H, T, D],
    k / v [B, Hkv, S, D] fp32, start [B] int64, scale -> [B, H, T, D]) where the library is built (building it at the
    first call), else None. `set_enabled` does not switch it: the attention backend does (`models.attention`)."""
    if _status is None:
        _load()
    return torch.ops.angelspec_native.cached_attention.default if _ready else None


def status() -> str:
    """How the kernel was built, or why it is not used."""
    available()
    return _status if _enabled or not _ready else f"switched off ({_status})"


def identity() -> str:
    """"few-rows:<digest of the build>" while the kernel is in use, else "": what a measured step cost depends on
    (`decoding.policies.costmodel.CostKey.kernels`)."""
    return f"few-rows:{_loaded.stem.rsplit('-', 1)[-1]}" if available() and _loaded is not None else ""


def set_enabled(enabled: bool, native: bool = True) -> None:
    """Switch the kernel on or off in this process (benchmarks compare both sides in one run): off, the native op
    sends every product of two rows or more to oneDNN and one row to the BLAS. `native` False: the prepacked layers
    do not use the native op at all (what they do where it is not built: `models.linear`'s Python op)."""
    global _enabled, _native_on
    _enabled, _native_on = enabled, native
    _configure()


def _threads() -> int:
    """The threads the kernel runs on now: torch's intra-op count, one without OpenMP."""
    return torch.get_num_threads() if _threaded else 1


def max_rows() -> int:
    """The most rows a product sends to the kernel now (0 where it is not available): `ROWS_PER_THREAD` per
    thread it runs on (`_threads`). Past that, oneDNN's prepacked product is faster."""
    return ROWS_PER_THREAD * _threads() if available() else 0


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """`F.linear(x, weight, bias)` through the kernel alone: x [..., K] fp32 on the CPU, weight [N, K] fp32 row-major
    contiguous, bias [N] or None. The caller checks `available()`."""
    return torch.ops.angelspec_native.few_rows_linear(x, weight, bias)


def drop(key: int) -> None:
    """Forget the native op's copies for a module's key (made again at its next product)."""
    if _loaded is not None:
        torch.ops.angelspec_native.drop_pack(key)


def copies(key: int) -> set[str] | None:
    """The native op's copies for a key ({"rows", "onednn"} or a part), None without an entry (or without the
    library)."""
    if _loaded is None:
        return None
    got = torch.ops.angelspec_native.pack_copies(key)
    return None if got < 0 else {n for n, bit in (("rows", 1), ("onednn", 2)) if got & bit}
