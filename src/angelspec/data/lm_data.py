"""Tokenised documents and the deterministic packed row stream used to train causal LMs (the embedded
target and the draft-LM baseline). Row `r` of the stream is a pure function of (seed, r), which is what
makes training resumable to the exact same batches.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from angelspec.data.tokenizer import ChatTokenizer


@dataclass
class TokenizedDomain:
    tokens: np.ndarray  # [N] int32, documents concatenated
    offsets: np.ndarray  # [n_docs + 1] int64 document boundaries


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def tokenize_split(tokenizer: Any, path: Path, sep_id: int, context: int) -> tuple[TokenizedDomain, int]:
    """Tokenise one JSONL file of conversations with the tokenizer's chat template; each document ends with
    `sep_id`. Documents longer than the context are truncated (and counted)."""
    from angelspec.data.chat import render_chat

    records = read_jsonl(path)
    if isinstance(tokenizer, ChatTokenizer):  # our own format: render in Python, encode in parallel in Rust
        encoded = tokenizer.encode_batch([render_chat(r["messages"], add_generation_prompt=False) for r in records])
    else:
        encoded = [tokenizer.apply_chat_template(r["messages"], add_generation_prompt=False) for r in records]
    docs, truncated = [], 0
    for ids in encoded:
        ids = list(ids)[: context - 1] + [sep_id]
        truncated += len(ids) >= context
        docs.append(np.asarray(ids, dtype=np.int32))
    offsets = np.zeros(len(docs) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(d) for d in docs])
    tokens = np.concatenate(docs) if docs else np.zeros(0, dtype=np.int32)
    return TokenizedDomain(tokens, offsets), truncated


class PackedStream:
    """Rows of `seq_len + 1` tokens from documents repeated per domain weight and shuffled per epoch.

    Row `r` is a pure function of (seed, r): resuming at step s reproduces the same batches.
    Documents are concatenated (separated by the end-of-text token) as in ordinary pre-training.
    """

    def __init__(self, domains: dict[str, TokenizedDomain], weights: dict[str, float], seq_len: int, seed: int):
        self.domains, self.weights, self.seq_len, self.seed = domains, weights, seq_len, seed
        self._epoch_cache: tuple[int, np.ndarray] | None = None
        self.rows_per_epoch = len(self._epoch_tokens(0)) // (seq_len + 1)
        if self.rows_per_epoch == 0:
            raise ValueError("training corpus is smaller than one row; build a larger corpus")

    def _epoch_tokens(self, epoch: int) -> np.ndarray:
        if self._epoch_cache is not None and self._epoch_cache[0] == epoch:
            return self._epoch_cache[1]
        rng = np.random.default_rng([self.seed, epoch])
        pieces: list[np.ndarray] = []
        for name in sorted(self.domains):
            dom, w = self.domains[name], self.weights.get(name, 1.0)
            n = len(dom.offsets) - 1
            reps = int(w) + (rng.random(n) < (w - int(w)))  # fractional weights by Bernoulli
            idx = np.repeat(np.arange(n), reps if np.ndim(reps) else np.full(n, reps))
            pieces.extend((name, int(i)) for i in idx)  # type: ignore[arg-type]
        order = rng.permutation(len(pieces))
        chunks = []
        for j in order:
            name, i = pieces[j]  # type: ignore[misc]
            dom = self.domains[name]
            chunks.append(dom.tokens[dom.offsets[i]: dom.offsets[i + 1]])
        toks = np.concatenate(chunks)
        self._epoch_cache = (epoch, toks)
        return toks

    def batch(self, step: int, batch_size: int) -> torch.Tensor:
        rows = []
        for r in range(step * batch_size, (step + 1) * batch_size):
            epoch, k = divmod(r, self.rows_per_epoch)
            toks = self._epoch_tokens(epoch)
            rows.append(toks[k * (self.seq_len + 1): (k + 1) * (self.seq_len + 1)])
        return torch.from_numpy(np.stack(rows).astype(np.int64))  # [B, seq_len + 1]


