"""The embedded target's chat format (Qwen3-style ChatML with think blocks) and its loss masks.

One message renders as ``<|im_start|>{role}\\n{content}<|im_end|>\\n``. An assistant turn depends
on the mode:

- ``enable_thinking=False`` (the default; our target is trained without reasoning traces): every
  assistant turn carries an empty think block, ``<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n
  {content}<|im_end|>\\n``, and the generation prompt ends with that same empty block, so at inference
  the model continues exactly where training put the answer.
- ``enable_thinking=True``: the template inserts no think block; a message's ``reasoning_content``,
  when present, renders as ``<think>\\n{reasoning}\\n</think>\\n\\n`` before the content, and the
  generation prompt is just ``<|im_start|>assistant\\n`` (the model opens ``<think>`` itself).

Unlike Qwen3 (which defaults to thinking), an absent ``enable_thinking`` means no-think here, in
both :func:`render_chat` and the Jinja :data:`CHAT_TEMPLATE`, to match how the target is trained.

:func:`render_chat`, :func:`encode_conversation` and :data:`CHAT_TEMPLATE` all derive from the same
segment list (:func:`chat_segments`), and a test checks the Jinja template against it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, Protocol

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
THINK_START = "<think>"
THINK_END = "</think>"
MASK = "<|mask|>"
# Order fixes the ids 0..5 of every tokenizer this project trains.
SPECIAL_TOKENS: tuple[str, ...] = (ENDOFTEXT, IM_START, IM_END, THINK_START, THINK_END, MASK)
ROLES: tuple[str, ...] = ("system", "user", "assistant")

# HF renders this with trim_blocks/lstrip_blocks; every tag also trims itself (`{%- -%}`) so the
# output is independent of those settings. `raise_exception` is provided by transformers.
CHAT_TEMPLATE = (
    "{%- set think = enable_thinking is defined and enable_thinking -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if not think -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- elif message['reasoning_content'] is defined and message['reasoning_content'] -%}"
    "{{- '<think>\\n' + message['reasoning_content'] + '\\n</think>\\n\\n' -}}"
    "{%- endif -%}"
    "{{- message['content'] + '<|im_end|>\\n' -}}"
    "{%- elif message['role'] == 'user' or message['role'] == 'system' -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- raise_exception('Unknown chat role: ' + message['role']) -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if not think -%}{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}"
    "{%- endif -%}"
)


class Segment(NamedTuple):
    """A piece of a rendered chat: a special token or a run of text, and whether it is trained on."""

    text: str
    special: bool
    loss: bool


class EncodedChat(NamedTuple):
    """Token ids, a 0/1 loss mask of the same length, and how many tokens truncation cut off."""

    ids: list[int]
    loss_mask: list[int]
    num_truncated: int

    @property
    def truncated(self) -> bool:
        return self.num_truncated > 0


class _Backend(Protocol):  # the subset of `tokenizers.Tokenizer` used here
    def token_to_id(self, token: str) -> int | None: ...
    def encode(self, sequence: str, add_special_tokens: bool = ...) -> Any: ...


def check_message_list(messages: Any) -> Sequence[Mapping[str, Any]]:
    """The outer shape every conversation must have: a non-empty list of dicts (errors name the index)."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ValueError(f"messages must be a list of dicts, got {type(messages).__name__}")
    if not messages:
        raise ValueError("messages is empty")
    for i, msg in enumerate(messages):
        if not isinstance(msg, Mapping):
            raise ValueError(f"message {i} must be a dict with 'role' and 'content', got {type(msg).__name__}")
    return messages


def validate_messages(messages: Any) -> list[dict[str, Any]]:
    """Check a conversation's shape; errors name the offending message index.

    Each message must be a mapping with ``role`` in :data:`ROLES` and a ``str`` ``content``; an
    assistant message may add a ``reasoning_content`` string (or None).
    """
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(check_message_list(messages)):
        role, content = msg.get("role"), msg.get("content")
        if role not in ROLES:
            raise ValueError(f"message {i} has unknown role {role!r}; expected one of {ROLES}")
        if not isinstance(content, str):
            raise ValueError(f"message {i} ({role}) content must be a str, got {type(content).__name__}")
        reasoning = msg.get("reasoning_content")
        if reasoning is not None and not isinstance(reasoning, str):
            raise ValueError(f"message {i} reasoning_content must be a str or None, got {type(reasoning).__name__}")
        out.append(dict(msg))
    return out


def chat_segments(
    messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = False, enable_thinking: bool = False
) -> list[Segment]:
    """The conversation as an ordered list of segments; the single source of truth for the format.

    Loss covers what the assistant produces: its content and closing ``<|im_end|>`` and, in thinking
    mode, the think block it writes. Headers, the trailing ``\\n``, the empty think block of no-think
    mode (part of the prompt at inference) and all system/user tokens are not trained on.
    """
    segs: list[Segment] = []
    for msg in validate_messages(messages):
        role, content = msg["role"], msg["content"]
        segs.append(Segment(IM_START, True, False))
        if role != "assistant":
            segs += [
                Segment(f"{role}\n{content}", False, False),
                Segment(IM_END, True, False),
                Segment("\n", False, False),
            ]
            continue
        segs.append(Segment("assistant\n", False, False))
        if not enable_thinking:
            segs += _empty_think(loss=False)
        elif msg.get("reasoning_content"):
            segs += [
                Segment(THINK_START, True, True),
                Segment(f"\n{msg['reasoning_content']}\n", False, True),
                Segment(THINK_END, True, True),
                Segment("\n\n", False, True),
            ]
        segs += [Segment(content, False, True), Segment(IM_END, True, True), Segment("\n", False, False)]
    if add_generation_prompt:
        segs += [Segment(IM_START, True, False), Segment("assistant\n", False, False)]
        if not enable_thinking:
            segs += _empty_think(loss=False)
    return [s for s in segs if s.text]


def _empty_think(*, loss: bool) -> list[Segment]:
    return [Segment(THINK_START, True, loss), Segment("\n\n", False, loss), Segment(THINK_END, True, loss),
            Segment("\n\n", False, loss)]


def render_chat(
    messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = False, enable_thinking: bool = False
) -> str:
    """The conversation as text, identical to ``CHAT_TEMPLATE`` rendered by transformers."""
    segs = chat_segments(messages, add_generation_prompt=add_generation_prompt, enable_thinking=enable_thinking)
    return "".join(s.text for s in segs)


def _backend_of(tokenizer: Any) -> _Backend:
    """Accept our wrapper (``.backend``), a HF fast tokenizer (``.backend_tokenizer``) or a raw Tokenizer."""
    for attr in ("backend", "backend_tokenizer"):
        inner = getattr(tokenizer, attr, None)
        if inner is not None and hasattr(inner, "token_to_id"):
            return inner
    if hasattr(tokenizer, "token_to_id") and hasattr(tokenizer, "encode"):
        return tokenizer
    raise TypeError(f"unsupported tokenizer type {type(tokenizer).__name__}: need a `tokenizers.Tokenizer` backend")


def encode_conversation(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    enable_thinking: bool = False,
    max_length: int | None = None,
) -> EncodedChat:
    """Tokenize a training conversation and build its loss mask.

    Special tokens are inserted as their single ids. The text between two special tokens is encoded
    as one run, exactly as whole-string tokenization of :func:`render_chat`'s output sees it, and
    each token of a run is trained on if its character span overlaps trained text. So the ids always
    equal ``tokenizer.encode(render_chat(messages))`` (what transformers' ``apply_chat_template``
    gives), and the mask boundaries are exact whenever a piece boundary is also a token boundary.

    With this project's tokenizer (Qwen2 split pattern, see :mod:`angelspec.data.tokenizer`) that holds
    for typical text, so the ids also equal encoding the pieces separately and concatenating -- in
    particular, a turn's prompt part encodes exactly as the inference-time generation prompt does.
    It can differ at a piece boundary where trained text starts with a newline: ``"</think>\\n\\n"`` +
    ``"\\nfoo"`` becomes one ``"\\n\\n\\n"`` token, which straddles the boundary and is trained on. The
    corpus strips message contents, so this does not arise in our data.

    Args:
        tokenizer: our :class:`~angelspec.data.tokenizer.ChatTokenizer`, a HF fast tokenizer or a
            ``tokenizers.Tokenizer`` with the :data:`SPECIAL_TOKENS`.
        max_length: keep the first ``max_length`` tokens; ``num_truncated`` says how many were cut.

    Raises:
        ValueError: malformed messages (naming the index), no assistant message, or content that
            contains a literal special-token string (it would forge a turn boundary).
    """
    msgs = validate_messages(messages)
    if not any(m["role"] == "assistant" for m in msgs):
        raise ValueError("conversation has no assistant message: nothing to train on")
    for i, m in enumerate(msgs):
        for key in ("content", "reasoning_content"):
            text = m.get(key) or ""
            bad = next((s for s in SPECIAL_TOKENS if s in text), None)
            if bad is not None:
                raise ValueError(f"message {i} {key} contains the control token {bad!r}")
    if max_length is not None and max_length < 1:
        raise ValueError(f"max_length must be positive, got {max_length}")
    backend = _backend_of(tokenizer)
    ids: list[int] = []
    mask: list[int] = []
    run: list[Segment] = []

    def flush() -> None:
        if not run:
            return
        text = "".join(s.text for s in run)
        spans: list[tuple[int, int]] = []  # character spans of trained text within `text`
        pos = 0
        for s in run:
            if s.loss:
                spans.append((pos, pos + len(s.text)))
            pos += len(s.text)
        enc = backend.encode(text, add_special_tokens=False)
        for tok_id, (start, end) in zip(enc.ids, enc.offsets, strict=True):
            ids.append(tok_id)
            mask.append(int(any(start < e and end > b for b, e in spans)))
        run.clear()

    for seg in chat_segments(msgs, add_generation_prompt=False, enable_thinking=enable_thinking):
        if not seg.special:
            run.append(seg)
            continue
        flush()
        tok_id = backend.token_to_id(seg.text)
        if tok_id is None:
            raise ValueError(f"tokenizer has no special token {seg.text!r}; train it with angelspec's train_tokenizer")
        ids.append(tok_id)
        mask.append(int(seg.loss))
    flush()
    cut = 0
    if max_length is not None and len(ids) > max_length:
        cut = len(ids) - max_length
        ids, mask = ids[:max_length], mask[:max_length]
    return EncodedChat(ids, mask, cut)
