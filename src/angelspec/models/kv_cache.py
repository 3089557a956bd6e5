"""Static, preallocated KV cache for a batch of rows of different lengths.

Layout: `k[l]`, `v[l]` are one `[B, Hkv, S, Dh]` buffer per layer l, written by index; `lengths [B]` holds how
many slots of each row are committed. Slot index == token position within the row, so RoPE positions
come straight from `lengths`. Nothing past `lengths[b]` is ever attended to (the attention mask is
built from `lengths`), which makes rollback after a partial accept a single tensor write:
`truncate(new_lengths)` — stale keys beyond the new length are invisible and get overwritten by the
next append. Rows are reused for new requests with `reset_rows`.

Why one tensor per layer rather than views of one [L, B, Hkv, S, Dh] buffer: under torch.compile, an in-place
write into a *view* of a graph input is functionalised into a copy of the whole input every step, while a write
into a whole input stays in place (measured: docs/design.md §12). Eager speed is the same either way.
"""

from __future__ import annotations

import torch

from angelspec.models.config import DecoderConfig


class StaticKVCache:
    """Per-layer key/value buffers plus per-row committed lengths; every model (target, draft LM, MTP family, block
    drafters) caches into one.

    `max_len` is the largest committed length a row may reach; `slack` extra slots let one forward
    append up to `slack` speculative tokens to a row that is already full (they are rolled back).
    """

    def __init__(
        self,
        config: DecoderConfig,
        batch_size: int,
        max_len: int,
        *,
        slack: int = 16,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        if batch_size <= 0 or max_len <= 0:
            raise ValueError(f"KV cache needs batch_size > 0 and max_len > 0, got {batch_size}, {max_len}")
        self.config = config
        self.batch_size = batch_size
        self.max_len = max_len
        self.capacity = max_len + slack
        shape = (batch_size, config.num_key_value_heads, self.capacity, config.head_dim)
        # zeros, not empty: masked slots still enter the attention matmul, and NaN garbage would poison it.
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)]
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)  # [B]

    @property
    def device(self) -> torch.device:
        return self.lengths.device

    @property
    def dtype(self) -> torch.dtype:
        return self.k[0].dtype

    def truncate(self, lengths: torch.Tensor) -> None:
        """Roll every row back (or forward over already-written slots) to `lengths [B]`."""
        if lengths.shape != self.lengths.shape:
            raise ValueError(
                f"truncate expects lengths of shape {tuple(self.lengths.shape)}, got {tuple(lengths.shape)}"
            )
        self.lengths.copy_(lengths)

    def reset_rows(self, rows: torch.Tensor | list[int]) -> None:
        """Free rows for new requests (their stale entries are masked by length 0)."""
        self.lengths[torch.as_tensor(rows, dtype=torch.long, device=self.device)] = 0

    def mark_static_address(self) -> None:
        """Tell torch.compile that these buffers keep their addresses for the cache's life (they are only ever
        written in place), so a compiled forward captured as a CUDA graph may mutate them."""
        for t in (*self.k, *self.v, self.lengths):
            torch._dynamo.mark_static_address(t)

    def reset(self) -> None:
        self.lengths.zero_()
