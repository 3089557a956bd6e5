"""Cheap identity checks for the inputs of long, resumable data jobs (rollouts, feature caches).

A resumed job must refuse to mix outputs of two different targets or two different input files: the
result would look fine and silently train a drafter on a blend of teachers. Hashing every weight of an
8B target costs tens of seconds, so :func:`model_fingerprint` hashes the config, every parameter's
name, shape and dtype, and a strided sample of its values: any retrained or re-quantised model changes
the sample, while the check stays O(#parameters tensors), not O(#weights).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn

SAMPLES_PER_TENSOR = 1024
_CHUNK = 1 << 20


def model_fingerprint(model: nn.Module, *, precision: torch.dtype | None = None) -> str:
    """A short hex id of a model's config, parameter layout and sampled weight values.

    Two loads of the same checkpoint in the same dtype give the same id; a different checkpoint, a
    different dtype or a different architecture gives another one. Not a cryptographic hash of all
    weights (see the module docstring for the trade-off). `precision` (a floating dtype): the sampled
    floating-point values are hashed as that dtype, and the layout names it instead of the tensors' own, so
    every load of the same weights in that dtype or a wider one gets the same id (`target_weights_fingerprint`).
    """
    return tensors_fingerprint(getattr(model, "config", None), sorted(model.state_dict().items()),
                               precision=precision)


def tensors_fingerprint(config: Any, tensors: Iterable[tuple[str, torch.Tensor]], *,
                        precision: torch.dtype | None = None) -> str:
    """`model_fingerprint` from the model's config and its state dict's (name, tensor) pairs in sorted name order,
    which may be produced one at a time (e.g. read from a checkpoint for a model whose layers were never loaded)."""
    import torch  # here, not at module level: the CLI parser imports this module and must stay light

    h = hashlib.sha256()
    if config is not None and hasattr(config, "to_hf_dict"):
        h.update(json.dumps(config.to_hf_dict("any"), sort_keys=True, default=str).encode())
    for name, t in tensors:
        cast = precision is not None and t.is_floating_point()
        h.update(f"{name}:{tuple(t.shape)}:{precision if cast else t.dtype}".encode())
        flat = t.detach().reshape(-1)
        step = max(1, flat.numel() // SAMPLES_PER_TENSOR)
        sample = flat[::step][:SAMPLES_PER_TENSOR].contiguous().cpu()
        if cast:
            sample = sample.to(precision)
        h.update(sample.view(torch.uint8).numpy().tobytes())  # raw bytes: works for bf16 too
    return h.hexdigest()[:16]


def target_weights_fingerprint(target: nn.Module,
                               tensors: Iterable[tuple[str, torch.Tensor]] | None = None) -> str:
    """The id of a target's weights that a drafter records (`"angelspec": {"target_weights": ...}` in its
    config.json) and that a resumed training run compares: `model_fingerprint` at bfloat16 precision, so that it
    is the same whether the target is loaded in float32 or bfloat16, and changes with any retrained weight.
    `tensors`: the state dict's (name, tensor) pairs in sorted name order when the model does not hold them all
    (a `parts="head"` load, whose layers are read from the checkpoint one at a time)."""
    import torch

    if tensors is None:
        return model_fingerprint(target, precision=torch.bfloat16)
    return tensors_fingerprint(getattr(target, "config", None), tensors, precision=torch.bfloat16)


def checkpoint_fingerprint(folder: str | Path) -> str:
    """A short hex id of a HF checkpoint folder read from its files, without loading the model (for a target
    that another engine serves, e.g. vLLM): config.json, then per safetensors file its header (names, shapes,
    dtypes, offsets), its size and SAMPLES_PER_TENSOR strided 8-byte samples of its data. Retraining or
    re-quantising changes it; it is not comparable with `model_fingerprint` of the same weights."""
    folder = Path(folder)
    h = hashlib.sha256((folder / "config.json").read_bytes())
    for file in sorted(folder.glob("*.safetensors")):
        size = file.stat().st_size
        with open(file, "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            h.update(file.name.encode() + f.read(header_len) + str(size).encode())
            start = 8 + header_len
            step = max(8, (size - start) // SAMPLES_PER_TENSOR)
            for pos in range(start, size, step):
                f.seek(pos)
                h.update(f.read(8))
    return h.hexdigest()[:16]


def file_sha256(path: str | Path) -> str:
    """Full SHA-256 of a file, streamed (input files and cache shards are hashed whole)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            h.update(block)
    return h.hexdigest()
