"""Bounds on the numbers the decoding commands take (generate, eval, bench, profile, calibrate, eval-server, rollout),
checked before any weights are read, so a typo such as 10^9 is one line instead of a process that grows until the
kernel kills it.

`check_counts` holds the fixed bounds; `check_fits_target` those that come from the target's config.json (its
context) and from the machine: the KV cache of the rows decoded at once against the memory free where it lives (a
CUDA device's, or the host's).
Each message names the setting (its field name in the library's settings, which the command line words as its flag)
and its range.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from angelspec.errors import SettingError, require_range
from angelspec.fileio import require_memory

if TYPE_CHECKING:
    from angelspec.models import DecoderConfig

MAX_NEW_TOKENS = 1 << 24  # tokens a request may generate (each is also capped to fit the target's context)
MAX_DRAFT_TOKENS = 64  # K: drafts proposed and verified per step (published drafters use at most 16)
MAX_BATCH_SIZE = 4096  # rows decoded at once (concurrent requests)
MAX_NGRAM = 64  # the longest n-gram the lookup drafter matches
MAX_REQUESTS = 1_000_000  # requests one run makes (bench --min-requests)
MAX_REPEATS = 10_000  # timed or untimed steps per profiled cell


def check_num_draft_tokens(k: int, context: int | None = None) -> None:
    """The one check of a requested K (`--num-draft-tokens`, `num_draft_tokens` of the library calls): an integer
    from 1 to MAX_DRAFT_TOKENS, and with the target's `context` known, at most context - 2 (the verify forward
    takes K + 1 positions after at least one token). A drafter's own bound (a block drafter's block size - 1) is
    its `Drafter.check_depth`."""
    if isinstance(k, bool) or not isinstance(k, int | float):
        raise SettingError(f"{{num_draft_tokens}} must be a positive integer, got {k!r}")
    if context is None:
        require_range("num_draft_tokens", k, 1, MAX_DRAFT_TOKENS)
    else:
        require_range("num_draft_tokens", k, 1, min(MAX_DRAFT_TOKENS, context - 2),
                      f" (the target's context is {context} tokens)")
    if k != int(k):
        raise SettingError(f"{{num_draft_tokens}} must be a positive integer, got {k!r}")


def check_counts(*, max_new_tokens: int | None = None, batch_size: int | None = None,
                 num_draft_tokens: int | None = None, limit: int | None = None) -> None:
    """The fixed bounds of the counts every decoding command shares (None: not taken by the command); the ones the
    target's config sets, `check_fits_target` checks once it is read."""
    if max_new_tokens is not None:
        require_range("max_new_tokens", max_new_tokens, 1, MAX_NEW_TOKENS)
    if batch_size is not None:
        require_range("batch_size", batch_size, 1, MAX_BATCH_SIZE)
    if num_draft_tokens is not None:
        check_num_draft_tokens(num_draft_tokens)
    if limit is not None:
        require_range("limit", limit, 1, 1 << 31)


def kv_cache_bytes(config: DecoderConfig, rows: int, tokens: int, dtype_bytes: int = 4) -> int:
    """Bytes of the target's KV cache for `rows` rows of `tokens` tokens (keys and values of every layer)."""
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * dtype_bytes
    return rows * tokens * per_token


def free_memory(device: Any = None) -> tuple[int | None, str] | None:
    """(bytes free, where) for a KV cache on `device`: a CUDA device's free memory (`torch.cuda.mem_get_info`), the
    host's for the CPU or None (None bytes: `fileio.require_memory` reads /proc/meminfo's); None for another kind of
    accelerator, whose free memory torch does not report."""
    kind = getattr(device, "type", None if device is None else str(device).partition(":")[0])
    if kind is None or kind == "cpu":
        return None, "this machine"
    if kind != "cuda":
        return None
    import torch

    try:
        free, _ = torch.cuda.mem_get_info(torch.device(device))
    except (RuntimeError, AssertionError, ValueError):  # no usable CUDA runtime: nothing to compare with
        return None
    return int(free), f"the GPU {device}"


def check_fits_target(config: DecoderConfig, *, rows: int, num_draft_tokens: int | None = 0,
                      batch_flag: str = "--batch-size", dtype_bytes: int = 4, device: Any = None,
                      available: int | None = None, with_weights: bool = False) -> None:
    """Refuse, from the target's config alone, more drafts per step than its context can verify (`num_draft_tokens`
    None: the drafter's own depth, checked where it is known) and a number of rows decoded at once (`rows`, set by
    `batch_flag`) whose KV cache could not fit in the memory free where it lives (`available`; default: a CUDA
    `device`'s free memory, the host's for `device` None or a CPU, see `free_memory`; not checked on other
    accelerators). `with_weights`: the target is not loaded yet, and its weights (in `dtype_bytes` a parameter) will
    take that memory too. A `--max-new-tokens` beyond the context needs no refusal: every request is capped to fit it
    and ends with finish_reason "length"."""
    context = config.max_position_embeddings
    k = num_draft_tokens or 0
    if k:
        check_num_draft_tokens(k, context)
    where = "this machine"
    if available is None:
        found = free_memory(device)
        if found is None:
            return
        available, where = found
    need = kv_cache_bytes(config, rows, context + k + 2, dtype_bytes)
    what = f"the KV cache of {rows} row(s) of {context} tokens"
    if with_weights:
        need += config.num_parameters() * dtype_bytes
        what += " and the target's weights"
    require_memory(batch_flag, need, what, available, where=where)
