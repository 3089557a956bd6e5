"""`torch.compile` for the engine's hot calls (the AR decode step, the verify forward, a draft LM's steps), with
a fallback to eager so a machine without a working compiler still decodes."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch._dynamo.config as dynamo_config
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
    """inductor options of `try_compile`: with cuda_graphs, CUDA graph capture of the compiled graph; none otherwise.
    Never `freezing`: a frozen graph holds the weights it was traced with as constants, while dynamo keeps one list
    of graphs per function and checks only tensor shapes, so a second model of the same shapes (two targets, or a
    target beside a drafter of its architecture) would run the first one's weights and a model whose weights change
    (a drafter evaluated during training) its old ones, silently (trap 5, `tests/test_compiled.py`). The weights
    are graph inputs instead; they cost a guard check per call (docs/design.md section 9)."""
    return {"triton.cudagraphs": True} if cuda_graphs else {}


def try_compile(fn: Callable[..., R], what: str, *, cuda_graphs: bool = False) -> Callable[..., R]:
    """torch.compile `fn`, falling back to eager (with one warning naming `what`) at the first call that fails
    to compile. dynamic: kv_len changes every step and must not trigger recompiles.

    Duck sizing is off while `fn` runs (so while dynamo traces it): with it on, two input sizes that happen to be
    equal when a graph is traced share one symbol, and when one of them is fixed by the weights the other is
    fixed with it: a KV cache of capacity 64 traced beside a head_dim of 64 gives a graph for capacity 64 only,
    and the next engine with another capacity compiles again mid-run (`angelspec bench`'s warm-up has a shorter
    capacity than its timed run). The switch is cheap (numbers: docs/design.md §12). Dynamo's preparation for
    freezing is off too, whatever the environment says (`TORCHDYNAMO_PREPARE_FREEZING=1`): with it on, a graph
    traced for one model runs for another of the same shapes with the first one's weights, without any freezing
    asked for (`compile_options`). cuda_graphs: `compile_options`; for callers whose every call has the same shapes
    (`static_attention`)."""
    compiled = torch.compile(fn, dynamic=True, options=compile_options(cuda_graphs))
    state: dict[str, Callable[..., R]] = {"fn": compiled}

    def call(*args: Any, **kwargs: Any) -> R:
        duck, prepare = shape_config.use_duck_shape, dynamo_config.prepare_freezing
        shape_config.use_duck_shape = dynamo_config.prepare_freezing = False
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
            shape_config.use_duck_shape, dynamo_config.prepare_freezing = duck, prepare

    return call
