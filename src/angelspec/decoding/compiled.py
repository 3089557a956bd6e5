"""`torch.compile` for the engine's hot calls (the AR decode step, the verify forward, a draft LM's steps), with
a fallback to eager so a machine without a working compiler still decodes."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.fx.experimental._config as shape_config

R = TypeVar("R")


def try_compile(fn: Callable[..., R], what: str) -> Callable[..., R]:
    """torch.compile `fn`, falling back to eager (with one warning naming `what`) at the first call that fails
    to compile. freezing: weights become constants, so inductor can prepack them for oneDNN (frozen models
    only: never modify the weights under a compiled call); dynamic: kv_len changes every step and must not
    trigger recompiles.

    Duck sizing is off while `fn` runs (so while dynamo traces it): with it on, two input sizes that happen to be
    equal when a graph is traced share one symbol, and when one of them is fixed by the weights the other is
    fixed with it. A KV cache of capacity 64 traced beside a head_dim of 64 gave a graph for capacity 64 only,
    and the next engine with another capacity compiled again mid-run (~20 s on this CPU; `angelspec bench`'s
    warm-up has a shorter capacity than its timed run). The switch costs ~3 us a call."""
    compiled = torch.compile(fn, dynamic=True, options={"freezing": True})
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
