"""`torch.compile` for the engine's hot calls (the AR decode step, the verify forward, a draft LM's steps), with
a fallback to eager so a machine without a working compiler still decodes."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.fx.experimental._config as shape_config

if TYPE_CHECKING:
    from angelspec.models import Decoder

R = TypeVar("R")


def static_attention(model: Decoder) -> bool:
    """Whether `model`'s cached forwards have one shape every step, so that CUDA graphs can replay them: a CUDA
    model whose attention resolves to flex (`models.attention.cache_span`: the whole cache, never `kv_len`)."""
    from angelspec.models.attention import resolve_attention_backend

    device = next(model.parameters()).device
    return device.type == "cuda" and resolve_attention_backend(model.attn_backend, device) == "flex"


def compile_options(cuda_graphs: bool) -> dict[str, Any]:
    """inductor options of `try_compile`: frozen weights (oneDNN prepacking on a CPU); with cuda_graphs, CUDA graph
    capture of the compiled graph instead (freezing would fold the in-place mutated cache into constants there)."""
    return {"triton.cudagraphs": True} if cuda_graphs else {"freezing": True}


def try_compile(fn: Callable[..., R], what: str, *, cuda_graphs: bool = False) -> Callable[..., R]:
    """torch.compile `fn`, falling back to eager (with one warning naming `what`) at the first call that fails
    to compile. freezing: weights become constants, so inductor can prepack them for oneDNN (frozen models
    only: never modify the weights under a compiled call); dynamic: kv_len changes every step and must not
    trigger recompiles.

    Duck sizing is off while `fn` runs (so while dynamo traces it): with it on, two input sizes that happen to be
    equal when a graph is traced share one symbol, and when one of them is fixed by the weights the other is
    fixed with it: a KV cache of capacity 64 traced beside a head_dim of 64 gives a graph for capacity 64 only,
    and the next engine with another capacity compiles again mid-run (`angelspec bench`'s warm-up has a shorter
    capacity than its timed run). The switch is cheap (numbers: docs/design.md §12). cuda_graphs:
    `compile_options`; for callers whose every call has the same shapes (`static_attention`)."""
    compiled = torch.compile(fn, dynamic=True, options=compile_options(cuda_graphs))
    state: dict[str, Callable[..., R]] = {"fn": compiled}

    def call(*args: Any, **kwargs: Any) -> R:
        duck = shape_config.use_duck_shape
        shape_config.use_duck_shape = False
        try:
            return state["fn"](*args, **kwargs)
        except Exception as e:  # any compiler failure (dynamo, inductor, C++ build) means "run eager"
            if state["fn"] is fn:
                raise
            warnings.warn(f"torch.compile of the {what} failed ({type(e).__name__}: {e}); running eager",
                          stacklevel=2)
            state["fn"] = fn
            return fn(*args, **kwargs)
        finally:
            shape_config.use_duck_shape = duck

    return call
