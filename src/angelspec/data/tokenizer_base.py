"""What both tokenizer classes build on: the folder's file names, :class:`TokenizerError`, the shared
text <-> ids base class and the reading of a tokenizer folder.

:mod:`angelspec.data.tokenizer` (AngelSpec's own layout) and :mod:`angelspec.data.hf_tokenizer` (any Hugging
Face folder) both import this module; ``tokenizer`` picks between the two when loading a folder.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
SPECIAL_MAP_FILE = "special_tokens_map.json"


class TokenizerError(ValueError):
    """A tokenizer folder is missing, incomplete or inconsistent; the message names folder and file."""


class BackendTokenizer:
    """What every tokenizer we load shares: a ``tokenizers.Tokenizer`` backend, plain text <-> ids, and chat
    ids as the rendered conversation encoded. Subclasses add the special ids and render the chat template of
    their layout."""

    backend: Tokenizer

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included (the embedding table size a model needs at least)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def encode(self, text: str) -> list[int]:
        """Ids of ``text`` without BOS/EOS; special-token strings in it become their single ids (as in
        transformers)."""
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Like :meth:`encode` for many texts, parallelised inside the Rust library."""
        return [e.ids for e in self.backend.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def render_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, enable_thinking: bool = False
    ) -> str:
        """The conversation as text, as transformers' ``apply_chat_template(..., tokenize=False)`` renders it."""
        raise NotImplementedError

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, enable_thinking: bool = False
    ) -> list[int]:
        """Ids of the rendered conversation; equal to transformers' ``apply_chat_template(..., tokenize=True)``."""
        return self.encode(self.render_chat_template(messages, add_generation_prompt, enable_thinking))


def read_json_config(path: Path) -> dict[str, Any]:
    """The JSON object in one of the folder's files.

    Raises:
        TokenizerError: naming ``path``, when it is unreadable, not JSON or not an object.
    """
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TokenizerError(f"cannot read {path}: {exc}") from None
    if not isinstance(data, dict):
        raise TokenizerError(f"{path} must hold a JSON object")
    return data


def read_tokenizer_folder(path: str | os.PathLike[str]) -> tuple[Tokenizer, dict[str, Any]]:
    """Check a tokenizer folder and parse its ``tokenizer.json`` and ``tokenizer_config.json``.

    Shared by both tokenizer classes so a missing or corrupt file gets the same message whichever
    layout the folder turns out to have.

    Raises:
        TokenizerError: the folder or one of the two files is missing or unreadable.
    """
    folder = Path(path)
    if not folder.is_dir():
        raise TokenizerError(
            f"tokenizer folder {folder} does not exist; train one with train_tokenizer(texts, {str(folder)!r})"
        )
    for name in (TOKENIZER_FILE, CONFIG_FILE):
        if not (folder / name).is_file():
            raise TokenizerError(f"tokenizer folder {folder} is incomplete: {name} is missing")
    config = read_json_config(folder / CONFIG_FILE)
    try:
        backend = Tokenizer.from_file(str(folder / TOKENIZER_FILE))
    except Exception as exc:  # the Rust binding raises a bare `Exception` for every parse error
        raise TokenizerError(f"cannot parse {folder / TOKENIZER_FILE}: {exc}") from None
    return backend, config
