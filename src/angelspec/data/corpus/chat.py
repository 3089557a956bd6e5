"""The ``chat`` domain: ShareGPT conversations cleaned of HTML->markdown artefacts, English only, capped to fit
a 1024-token context.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from tqdm.auto import tqdm

from angelspec.data.corpus.common import MANY_NEWLINES, ChatFilter, Example, has_special_token

_ROLE_MAP = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant",
             "bard": "assistant", "assistant": "assistant"}
_FENCE = re.compile(r"```.*?(?:```|\Z)", re.S)
_MD_ESCAPE = re.compile(r"\\([_*#\[\]<>`|~])")
_IMAGE = re.compile(r"!\[[^\]\n]*\]\([^)\n]*\)")
_BR = re.compile(r"<br\s*/?>", re.I)
_UI_NOISE = re.compile(r"^(?:Copy code|Copy to clipboard|Regenerate response|\d+ / \d+)\s*$", re.M)
# Buttons of the browser extensions people used to share chats, glued to the end of a message.
_UI_SUFFIX = re.compile(r"(?:\s*(?:Share Prompt|Save & SubmitCancel|Translate now|지금 번역하기|Copy code))+\s*$")
_TRAILING_WS = re.compile(r"[ \t]+$", re.M)
# The ~100 most frequent English words: a conversation in another language shares almost none.
_COMMON_WORDS = frozenset(
    "the be to of and a in that have i it for not on with he as you do at this but his by from they we say "
    "her she or an will my one all would there their what so up out if about who get which go me when make "
    "can like time no just him know take people into year your good some could them see other than then now "
    "look only come its over think also back after use two how our work first well way even new want because "
    "any these give day most us is are was were has had been does did should may here".split()
)
_TYPOGRAPHIC = frozenset("\u2018\u2019\u201c\u201d\u2013\u2014\u2026\u2022\u00a0\u00b0\u00e9")


def clean_chat_text(text: str) -> str:
    """Undo ShareGPT's HTML->markdown artefacts: escaped ``\\_`` / ``\\*``, ``<br>`` in tables, images, UI text
    (lines such as "Copy code" and buttons like "Share Prompt" glued to the end of a message).

    Code fences are left alone except for ``\\_``, which the converter escaped inside code as well.
    """
    parts: list[str] = []
    pos = 0
    for m in _FENCE.finditer(text):
        parts.append(_clean_prose(text[pos : m.start()]))
        parts.append(m.group(0).replace("\\_", "_"))
        pos = m.end()
    parts.append(_clean_prose(text[pos:]))
    out = "".join(parts)
    out = _UI_SUFFIX.sub("", out)
    out = _TRAILING_WS.sub("", out)
    out = MANY_NEWLINES.sub("\n\n", out)
    return out.strip()


def _clean_prose(text: str) -> str:
    text = _MD_ESCAPE.sub(r"\1", text)
    text = _IMAGE.sub("", text)
    text = _BR.sub(" ", text)
    return _UI_NOISE.sub("", text)


def is_english(text: str, *, min_ascii_ratio: float = 0.97, min_common_word_ratio: float = 0.2) -> bool:
    """Cheap language check on the prose outside code fences: mostly ASCII and full of common English words.

    Typographic quotes/dashes count as ASCII so that English text pasted from word processors passes.
    Short texts (under 8 words) only need one common word.
    """
    prose = _FENCE.sub(" ", text)
    chars = [c for c in prose if not c.isspace()]
    if not chars:
        return False
    ascii_like = sum(1 for c in chars if c.isascii() or c in _TYPOGRAPHIC)
    if ascii_like / len(chars) < min_ascii_ratio:
        return False
    words = re.findall(r"[a-z]+(?:'[a-z]+)?", prose.lower())
    if not words:
        return False
    common = sum(1 for w in words if w in _COMMON_WORDS)
    if len(words) < 8:
        return common >= 1
    return common / len(words) >= min_common_word_ratio


def conversation_from_sharegpt(record: Mapping[str, Any], limits: ChatFilter = ChatFilter()) -> list[dict] | None:
    """One cleaned conversation (alternating user/assistant, starting with user) or None if unusable.

    Keeps at most ``limits.max_exchanges`` exchanges, stops before the first broken one (wrong role
    order, empty turn), then drops trailing exchanges until the total fits ``limits.max_chars``.
    """
    turns = record.get("conversations")
    if not isinstance(turns, list) or not turns:
        return None
    messages: list[dict[str, str]] = []
    for turn in turns:
        if not isinstance(turn, dict) or not isinstance(turn.get("value"), str):
            return None
        role = _ROLE_MAP.get(str(turn.get("from", "")).lower())
        if role is None:  # system prompts and unknown speakers: too rare to model, drop the conversation
            return None
        messages.append({"role": role, "content": clean_chat_text(turn["value"])})
    exchanges: list[tuple[dict, dict]] = []
    for i in range(0, len(messages) - 1, 2):
        user, assistant = messages[i], messages[i + 1]
        if user["role"] != "user" or assistant["role"] != "assistant":
            break
        if min(len(user["content"]), len(assistant["content"])) < limits.min_turn_chars:
            break
        exchanges.append((user, assistant))
        if len(exchanges) == limits.max_exchanges:
            break
    def too_long(pairs: list[tuple[dict, dict]]) -> bool:
        contents = [m["content"] for pair in pairs for m in pair]
        chars = sum(len(c) for c in contents)
        return chars > limits.max_chars or sum(map(estimate_tokens, contents)) > limits.max_est_tokens

    while exchanges and too_long(exchanges):
        exchanges.pop()
    if not exchanges:
        return None
    out = [m for pair in exchanges for m in pair]
    text = "\n".join(m["content"] for m in out)
    if has_special_token(text):
        return None
    if not is_english(
        text, min_ascii_ratio=limits.min_ascii_ratio, min_common_word_ratio=limits.min_common_word_ratio
    ):
        return None
    return out


def estimate_tokens(text: str) -> float:
    """Tokenizer-free token estimate for the target's 8k byte-level BPE (digits split one per token).

    Calibrated on the built corpus: about 4 characters per ASCII letter or space, one token per digit
    and per non-ASCII character, 1.5 characters per punctuation mark, plus ~5 template tokens per
    message. Its median ratio to the real count is ~0.9; a cap of 900 leaves ~0.1% of chats over 1024.
    """
    digits = letters = spaces = other_ascii = non_ascii = 0
    for c in text:
        if not c.isascii():
            non_ascii += 1
        elif c.isdigit():
            digits += 1
        elif c.isalpha():
            letters += 1
        elif c.isspace():
            spaces += 1
        else:
            other_ascii += 1
    return 5 + digits + non_ascii + (letters + spaces) / 4.0 + other_ascii / 1.5


def _norm_key(text: str) -> str:
    return " ".join(text.lower().split())


def build_chat_examples(
    records: Iterable[Mapping[str, Any]], *, limits: ChatFilter = ChatFilter(), progress: bool = True
) -> list[Example]:
    """Clean ShareGPT records into examples, deduplicated by (normalised) first user message."""
    seen: set[str] = set()
    out: list[Example] = []
    for record in tqdm(records, desc="chat: clean ShareGPT", unit="conv", disable=not progress):
        conv = conversation_from_sharegpt(record, limits)
        if conv is None:
            continue
        key = _norm_key(conv[0]["content"])
        if key in seen:
            continue
        seen.add(key)
        out.append(Example(key, tuple(conv)))
    return out
