"""Where a model runs and in which precision: the one place `--device` / `--dtype` strings become torch objects.

`resolve_device(None)` is $ANGELSPEC_DEVICE when set, else the first CUDA GPU when torch sees one, else the CPU;
`resolve_dtype(None, device)` is bfloat16 on a GPU, float32 elsewhere. A device that is not there (`cuda` on a
machine without a GPU, `cuda:3` with one GPU, `mps` off Apple silicon, a misspelling) is a `UsageError` naming the
fix, never a silent CPU run. `Placement` carries the pair through the library; `autocast` and `enable_tf32` are the
precision switches the trainers use (fp32 master weights, 16-bit matmuls under autocast, TF32 for the matmuls left
in fp32).
"""

from __future__ import annotations

import os
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch

from angelspec.errors import UsageError

DEVICE_FORMS = "cpu, cuda, cuda:N or mps"
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}
DTYPE_FORMS = "float32 (fp32), bfloat16 (bf16) or float16 (fp16)"


DEVICE_ENV = "ANGELSPEC_DEVICE"  # the default device where a command gets no --device (e.g. cpu for a test suite)


def resolve_device(name: str | torch.device | None = None) -> torch.device:
    """`name` -> a device that exists here; None = $ANGELSPEC_DEVICE when set, else `cuda:0` when torch sees a GPU,
    else `cpu`."""
    if isinstance(name, torch.device):
        return name
    if name is None or name == "auto":
        name = os.environ.get(DEVICE_ENV) or None
    if name is None or name == "auto":
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    text = name.strip().lower()
    try:
        device = torch.device(text)
    except RuntimeError:
        raise UsageError(f"--device {name!r} is not a device; pass {DEVICE_FORMS}") from None
    if device.type == "cpu":
        return torch.device("cpu")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(f"--device {name}: torch sees no CUDA GPU here (a CPU-only torch build, no driver, or "
                             "CUDA_VISIBLE_DEVICES hides them); install a CUDA build of torch or pass --device cpu")
        count = torch.cuda.device_count()
        index = 0 if device.index is None else device.index
        if index >= count:
            raise UsageError(f"--device {name}: this machine has {count} CUDA GPU(s) (cuda:0..cuda:{count - 1}); "
                             "pass one of those")
        return torch.device("cuda", index)
    if device.type == "mps":
        mps = getattr(torch.backends, "mps", None)
        if mps is None or not mps.is_available():
            raise UsageError(f"--device {name}: Apple's MPS backend is not available here; pass --device cpu"
                             f"{' or cuda' if torch.cuda.is_available() else ''}")
        return torch.device("mps")
    raise UsageError(f"--device {name!r}: AngelSpec runs on {DEVICE_FORMS}, not {device.type}")


def resolve_dtype(name: str | torch.dtype | None, device: torch.device | str) -> torch.dtype:
    """`name` -> a torch dtype; None = bfloat16 on a CUDA GPU, float32 elsewhere."""
    if isinstance(name, torch.dtype):
        return name
    if name is None or name == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    dtype = DTYPES.get(name.strip().lower())
    if dtype is None:
        raise UsageError(f"--dtype {name!r} is not a dtype AngelSpec runs in; pass {DTYPE_FORMS}")
    return dtype


def dtype_label(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bfloat16"."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class Placement:
    """The device and dtype a command loads the target in (`resolve_placement`); drafters follow the target."""

    device: torch.device
    dtype: torch.dtype
    attention: str = "auto"  # the attention kernels (`models.attention.ATTENTION_BACKENDS`)

    def use_attention(self) -> None:
        """Make `attention` the kernels of every model this process runs (`set_default_attention_backend`)."""
        from angelspec.models.attention import set_default_attention_backend

        set_default_attention_backend(self.attention)

    def describe(self) -> str:
        return f"{self.device} {dtype_label(self.dtype)}"


def resolve_placement(device: str | torch.device | None = None, dtype: str | torch.dtype | None = None,
                      attention: str | None = None) -> Placement:
    """`--device`, `--dtype` and `--attention` (None = the defaults of `resolve_device` / `resolve_dtype`, and
    "auto": FlexAttention on a GPU, the native kernel or SDPA elsewhere) -> a `Placement`. An unknown attention name
    is a UsageError."""
    from angelspec.models.attention import ATTENTION_BACKENDS

    dev = resolve_device(device)
    if attention is None:
        attention = "auto"
    if attention not in ATTENTION_BACKENDS:
        raise UsageError(f"attention {attention!r} is not a backend; use one of {', '.join(ATTENTION_BACKENDS)} "
                         "(auto: FlexAttention on a GPU, the native kernel or SDPA elsewhere)")
    return Placement(dev, resolve_dtype(dtype, dev), attention)


def placement_of(placement: Placement | None) -> Placement:
    """`placement`, or the default one when None."""
    return placement if placement is not None else resolve_placement()


def autocast(device: torch.device, dtype: torch.dtype) -> AbstractContextManager:
    """torch.autocast to `dtype` on `device` when `dtype` is a 16-bit float (the trainer keeps fp32 master weights
    and runs the matmuls in `dtype`); a no-op context for float32."""
    if dtype not in (torch.bfloat16, torch.float16) or device.type == "meta":
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def enable_tf32(device: torch.device) -> None:
    """Let the fp32 matmuls and convolutions left on a CUDA device use TF32 tensor cores."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
