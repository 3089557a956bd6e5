r"""Train and load the embedded target's byte-level BPE tokenizer.

The folder :func:`train_tokenizer` writes is a plain Hugging Face tokenizer folder
(``tokenizer.json`` + ``tokenizer_config.json`` with the chat template), so
``transformers.AutoTokenizer.from_pretrained(folder)`` and peer engines load it unchanged, while
:func:`load_tokenizer` gives a light wrapper over ``tokenizers.Tokenizer`` that needs no transformers.
Given any other model's Hugging Face folder (Qwen3, Llama, ...) it returns an
:class:`~angelspec.data.hf_tokenizer.HFChatTokenizer` instead, which has the same interface. Both build on
:mod:`angelspec.data.tokenizer_base` (the folder's files, :class:`TokenizerError`, the text <-> ids base class).

Special tokens have fixed ids 0..5 (see :data:`~angelspec.data.chat.SPECIAL_TOKENS`): ``<|endoftext|>``
(also padding), ``<|im_start|>``, ``<|im_end|>`` (end of turn = eos for chat), ``<think>``,
``</think>`` and ``<|mask|>`` (the placeholder block-parallel drafters fill in). As in Qwen3, the
think tags are added tokens that are *not* special, so ``skip_special_tokens=True`` keeps them.

Pre-tokenization uses the Qwen2 split pattern (then byte-level mapping without GPT-2's regex), for
two reasons: digits are split one per token, so a small model sees 1234 always as 1-2-3-4 rather than
arbitrary merges like 12-34; and a newline run is kept whole (``\s*[\r\n]+``), so ``"</think>\n\n"``
followed by an answer splits as ``"\n\n" | "Answer"`` whether the conversation is tokenized whole
(training) or the prompt alone (inference). GPT-2's pattern would split it ``"\n" | "\n" | "Answer"``
in the whole string but ``"\n\n"`` in the prompt alone, so every assistant turn would start from a
token sequence the model never meets at inference.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from angelspec.data.chat import (
    CHAT_TEMPLATE,
    ENDOFTEXT,
    IM_END,
    IM_START,
    MASK,
    SPECIAL_TOKENS,
    THINK_END,
    THINK_START,
    EncodedChat,
    encode_conversation,
    render_chat,
)
from angelspec.data.hf_tokenizer import HFChatTokenizer
from angelspec.data.tokenizer_base import (
    CONFIG_FILE,
    SPECIAL_MAP_FILE,
    TOKENIZER_FILE,
    BackendTokenizer,
    TokenizerError,
    read_tokenizer_folder,
)

# Qwen2's pre-tokenizer pattern: contractions, letter runs (with one leading non-letter), single digits,
# punctuation runs (with trailing newlines), newline runs, other whitespace.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Added tokens that stay visible when decoding with skip_special_tokens=True.
NON_SPECIAL_ADDED = frozenset({THINK_START, THINK_END})


def train_tokenizer(
    text_iter: Iterable[str],
    out_dir: str | os.PathLike[str],
    vocab_size: int = 8192,
    *,
    min_frequency: int = 2,
    model_max_length: int = 1024,
    show_progress: bool = False,
) -> Path:
    """Train a byte-level BPE on ``text_iter`` and write a transformers-loadable folder to ``out_dir``.

    ``vocab_size`` counts the special tokens and the 256 byte symbols, so it must exceed 262.
    Texts may be rendered chats: special-token strings in them are cut out before counting, because
    the BPE trainer does not split added tokens and would otherwise spend merges on ``<|im_`` pieces.
    Returns the folder path.
    """
    if vocab_size <= 256 + len(SPECIAL_TOKENS):
        floor = 256 + len(SPECIAL_TOKENS)
        raise ValueError(f"vocab_size must exceed {floor} (256 bytes + special tokens), got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[AddedToken(s, special=True, normalized=False) for s in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    tok.train_from_iterator(_without_specials(text_iter), trainer=trainer)
    # The trainer registers every special token as special; turn the think tags into ordinary added
    # tokens (still atomic, still never merged) by editing the serialized form.
    spec = json.loads(tok.to_str())
    for added in spec["added_tokens"]:
        if added["content"] in NON_SPECIAL_ADDED:
            added["special"] = False
    tok = Tokenizer.from_str(json.dumps(spec))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / TOKENIZER_FILE))
    _write_hf_config(out, tok, model_max_length)
    load_tokenizer(out)  # validate what was written
    return out


def _without_specials(texts: Iterable[str]) -> Iterator[str]:
    splitter = re.compile("|".join(re.escape(s) for s in SPECIAL_TOKENS))
    for text in texts:
        yield from (piece for piece in splitter.split(text) if piece)


def _write_hf_config(out: Path, tok: Tokenizer, model_max_length: int) -> None:
    added = {
        str(tok.token_to_id(s)): {
            "content": s,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": s not in NON_SPECIAL_ADDED,
        }
        for s in SPECIAL_TOKENS
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": model_max_length,
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        "mask_token": MASK,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "added_tokens_decoder": added,
        "chat_template": CHAT_TEMPLATE,
    }
    special_map = {"eos_token": IM_END, "pad_token": ENDOFTEXT, "mask_token": MASK}
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    (out / SPECIAL_MAP_FILE).write_text(json.dumps(special_map, indent=2) + "\n", encoding="utf-8")


class ChatTokenizer(BackendTokenizer):
    """Thin wrapper over ``tokenizers.Tokenizer`` with the chat format and special ids built in."""

    def __init__(self, backend: Tokenizer, path: Path | None = None, model_max_length: int | None = None) -> None:
        self.backend = backend
        self.path = path
        self.model_max_length = model_max_length
        ids = {}
        for expected, token in enumerate(SPECIAL_TOKENS):
            got = backend.token_to_id(token)
            if got != expected:
                where = f"{path / TOKENIZER_FILE}" if path is not None else "tokenizer"
                raise TokenizerError(f"{where}: special token {token!r} has id {got}, expected {expected}")
            ids[token] = got
        self.pad_token_id: int = ids[ENDOFTEXT]
        self.endoftext_id: int = ids[ENDOFTEXT]
        self.im_start_id: int = ids[IM_START]
        self.im_end_id: int = ids[IM_END]
        self.eos_token_id: int = ids[IM_END]  # a chat turn ends with <|im_end|>
        self.think_start_id: int = ids[THINK_START]
        self.think_end_id: int = ids[THINK_END]
        self.mask_token_id: int = ids[MASK]
        # Stop ids, as in the generation_config.json the embedded target ships: end of turn, end of text.
        self.eos_token_ids: tuple[int, ...] = (self.im_end_id, self.endoftext_id)

    @property
    def special_ids(self) -> frozenset[int]:
        return frozenset(range(len(SPECIAL_TOKENS)))

    def render_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, enable_thinking: bool = False
    ) -> str:
        """The conversation as text in the fixed chat format (:data:`~angelspec.data.chat.CHAT_TEMPLATE`), equal
        to transformers' ``apply_chat_template(..., tokenize=False)`` on this folder."""
        return render_chat(messages, add_generation_prompt, enable_thinking)

    def encode_conversation(
        self, messages: Sequence[Mapping[str, Any]], enable_thinking: bool = False, max_length: int | None = None
    ) -> EncodedChat:
        """Ids plus loss mask for training (see :func:`angelspec.data.chat.encode_conversation`)."""
        return encode_conversation(self, messages, enable_thinking=enable_thinking, max_length=max_length)

    def __repr__(self) -> str:
        return f"ChatTokenizer(path={str(self.path)!r}, vocab_size={self.vocab_size})"


def is_angelspec_layout(backend: Tokenizer) -> bool:
    """Whether :data:`SPECIAL_TOKENS` occupy ids 0..5, in any order.

    Any order, so a folder of ours with shuffled ids still reaches :class:`ChatTokenizer` and its precise
    error; a model that merely shares some names (Qwen3 has ``<|im_start|>`` at 151644) does not.
    """
    ids = [backend.token_to_id(token) for token in SPECIAL_TOKENS]
    return sorted(i for i in ids if i is not None) == list(range(len(SPECIAL_TOKENS)))


def load_tokenizer(path: str | os.PathLike[str]) -> ChatTokenizer | HFChatTokenizer:
    """Load a tokenizer folder without importing transformers.

    A folder written by :func:`train_tokenizer` (our special tokens at ids 0..5) gives a
    :class:`ChatTokenizer` with the chat format built in; any other Hugging Face fast-tokenizer folder (a
    Qwen3 or Llama checkpoint's) gives an :class:`~angelspec.data.hf_tokenizer.HFChatTokenizer` that renders
    the folder's own chat template. Both have the same interface.

    Raises:
        TokenizerError: the folder or one of its files is missing or unreadable; (our layout) the special
            tokens do not have the ids this project relies on; (other folders) the files disagree with each
            other or the chat template does not parse.
    """
    folder = Path(path)
    backend, config = read_tokenizer_folder(folder)
    if not is_angelspec_layout(backend):
        return HFChatTokenizer(backend, folder, config)
    max_len = config.get("model_max_length")
    return ChatTokenizer(backend, folder, max_len if isinstance(max_len, int) else None)
