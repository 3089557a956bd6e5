"""Draft vocabularies at inference: a drafter scores only some target ids (`angelspec draft-vocab`), and a
sampling rule over the target's whole vocabulary must see the rest as impossible."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
from torch import Tensor

from angelspec.models.config import ConfigError
from angelspec.models.linear import linear, transposed_copy

T = TypeVar("T")


def expand_logits(logits: Tensor, token_ids: Tensor, vocab_size: int) -> Tensor:
    """logits [..., V'] over `token_ids` [V'] -> [..., vocab_size] with −inf at every other id."""
    full = logits.new_full((*logits.shape[:-1], vocab_size), float("-inf"))
    return full.index_copy_(-1, token_ids, logits)


def check_draft_vocab_size(size: Any, vocab_size: int) -> None:
    """Raise ConfigError unless `size` is an int in [0, vocab_size] (0: the whole vocabulary)."""
    if isinstance(size, bool) or not isinstance(size, int) or not 0 <= size <= vocab_size:
        raise ConfigError(f"draft_vocab_size must be an int in [0, vocab_size = {vocab_size}] (0: draft from the "
                          f"whole vocabulary), got {size!r}")


def weights_key(*tensors: Tensor) -> tuple[int, ...]:
    """What a cache of tensors derived from `tensors` is valid for: their storage, in-place version and dtype
    (a weight loaded, edited in place or cast gives another key)."""
    return tuple(x for t in tensors for x in (t.data_ptr(), t._version, t.dtype.itemsize))


class DraftVocabulary:
    """A draft vocabulary for an `nn.Module` drafter that shares the target's LM head (`self._shared[1]`) and
    whose `config` has `vocab_size` and `draft_vocab_size` (0: the whole vocabulary).

    With one, the module holds a `draft_vocab` buffer of target ids (saved with its weights), and inference
    multiplies only those LM-head rows: the head's cost falls by V / V'. Training scores the whole vocabulary, or
    under train_vocab "draft" the same rows (`draft_logits`, whose gradient reaches h). Call `_init_draft_vocab()`
    in `__init__` after `config` is set."""

    config: Any
    _shared: tuple[Any, ...]
    draft_vocab: Tensor

    def _init_draft_vocab(self) -> None:
        if self.config.draft_vocab_size:  # target ids inference drafts from (`set_draft_vocab`)
            self.register_buffer("draft_vocab",  # type: ignore[attr-defined]
                                 torch.arange(self.config.draft_vocab_size, dtype=torch.int64))
        self._derived: dict[str, tuple[tuple[int, ...], Any]] = {}  # `derived`'s cache

    def derived(self, name: str, sources: Sequence[Tensor], build: Callable[[], T]) -> T:
        """`build()`, a value computed from `sources` (weights, the vocabulary), cached under `name` until one of
        them changes (`weights_key`). Inside a compiled graph the cache is taken as it is (the key's pointer reads
        would break the graph): refresh it eagerly before every compiled step (`refresh_draft_vocab`)."""
        cached = self._derived.get(name)
        if cached is not None and torch.compiler.is_compiling():
            return cached[1]
        key = weights_key(*sources)
        if cached is None or cached[0] != key:
            with torch.no_grad():
                cached = self._derived[name] = (key, build())
        return cached[1]

    def set_draft_vocab(self, token_ids: Sequence[int] | Tensor) -> None:
        """Draft only from `token_ids` (e.g. `frequent_tokens` of the training data): [draft_vocab_size] distinct
        target ids. A draft the target would pick outside the set is simply never proposed."""
        n, v = self.config.draft_vocab_size, self.config.vocab_size
        ids = torch.as_tensor(token_ids, dtype=torch.int64).flatten()
        if not n:
            raise ConfigError("this drafter drafts from the whole vocabulary (draft_vocab_size = 0); build it with "
                              "draft_vocab_size=N to give it a draft vocabulary")
        if ids.numel() != n or ids.unique().numel() != n or not bool(((ids >= 0) & (ids < v)).all()):
            raise ConfigError(f"a draft vocabulary must be {n} distinct target ids in [0, {v}), got {ids.numel()} "
                              f"ids ({ids.unique().numel()} distinct)")
        with torch.no_grad():
            self.draft_vocab.copy_(ids.to(self.draft_vocab.device))

    def _vocab_sources(self) -> tuple[Tensor, ...]:
        """The [V, ·] weights whose draft-vocabulary rows inference multiplies: the LM head (a subclass may add
        more, e.g. a Markov head's W2)."""
        return (self._shared[1].weight,)

    def _vocab_weights(self) -> tuple[Tensor, ...]:
        """The draft-vocabulary rows of `_vocab_sources()`, cached until a weight or the vocabulary changes."""
        sources, v = self._vocab_sources(), self.draft_vocab
        # Stored transposed (`models.linear`): inference multiplies them by a few rows at a time.
        return self.derived("vocab rows", (*sources, v), lambda: tuple(transposed_copy(w.detach()[v]) for w in sources))

    def refresh_draft_vocab(self) -> None:
        """Bring the draft vocabulary's weight rows up to date, outside any compiled graph."""
        if self.config.draft_vocab_size:
            self._vocab_weights()

    def draft_logits(self, h: Tensor) -> Tensor:
        """Inference logits over the draft vocabulary: h [..., C] (normalised) -> [..., V'] fp32."""
        if not self.config.draft_vocab_size:
            return linear(h, self._shared[1].weight.detach()).float()
        return linear(h, self._vocab_weights()[0]).float()

    def to_target_ids(self, index: Tensor) -> Tensor:
        """Indices along the draft vocabulary -> target token ids (identity without one)."""
        return self.draft_vocab[index] if self.config.draft_vocab_size else index

    def to_draft_index(self, tokens: Tensor) -> Tensor:
        """Target ids inside the draft vocabulary -> their indices along it (identity without one)."""
        if not self.config.draft_vocab_size:
            return tokens
        v = self.draft_vocab

        def inverse() -> Tensor:  # [V]: the index along the vocabulary, −1 outside it
            table = torch.full((self.config.vocab_size,), -1, dtype=torch.int64, device=v.device)
            return table.index_copy_(0, v, torch.arange(self.config.draft_vocab_size, device=v.device))

        return self.derived("draft index", (v,), inverse)[tokens]

    def full_logits(self, logits: Tensor) -> Tensor:
        """[..., V'] -> [..., V] with −inf outside the draft vocabulary (what a sampling rule over the target's
        vocabulary sees: it can only pick draft-vocabulary tokens)."""
        if not self.config.draft_vocab_size:
            return logits
        return expand_logits(logits, self.draft_vocab, self.config.vocab_size)
