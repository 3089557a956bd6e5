"""Exporters: an AngelSpec drafter folder -> the layout another serving engine loads (one module per format).

`export_drafter(drafter_dir, out_dir, format=...)` (one of FORMATS) is the one entry point (`angelspec export`). A
drafter a format cannot represent is refused with `ExportRefused` naming what does not fit; every written folder is
read back and checked against the target's config (`checks`) before the call returns. Tap ids are converted to the
engine's counting here and nowhere else (docs/design.md trap 2).
"""

from __future__ import annotations

from pathlib import Path

import torch

from angelspec.export.checks import ExportCheckError, ExportRefused, ExportResult
from angelspec.export.sglang import export_sglang
from angelspec.export.vllm import export_vllm
from angelspec.models.device import resolve_dtype

FORMATS = ("vllm", "sglang")

__all__ = ["FORMATS", "ExportCheckError", "ExportRefused", "ExportResult", "export_drafter", "export_sglang",
           "export_vllm"]


def export_drafter(drafter_dir: str | Path, out_dir: str | Path, *, format: str = "vllm",
                   target: str | Path | None = None, force: bool = False,
                   dtype: torch.dtype | str | None = None) -> ExportResult:
    """Export the drafter folder `drafter_dir` into `out_dir` in `format` (one of FORMATS) for the target `target`
    (default: the embedded target), its weights in `dtype` (a torch dtype or a name such as "bfloat16"; None: the
    drafter's own, e.g. the fp32 master weights a run wrote; `angelspec export` defaults to bfloat16)."""
    if format not in FORMATS:
        raise ExportRefused(f"unknown export format {format!r}; choose one of {', '.join(FORMATS)}")
    exporter = export_sglang if format == "sglang" else export_vllm
    chosen = None if dtype is None else resolve_dtype(dtype, "cpu")
    return exporter(drafter_dir, out_dir, target=target, force=force, dtype=chosen)
