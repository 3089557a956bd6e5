"""Prompt files: one JSON object per line, either `{"prompt": str}` or `{"messages": [...]}`.

Shared by every command that takes `--prompts FILE.jsonl` (`generate` now; `eval` and `rollout` later), so
they all accept the same format and report bad lines the same way: one `PromptFileError` naming the file
and the 1-based line number, raised before any model is loaded or any token is decoded.

A "prompt" is wrapped as a single user message, so downstream code only ever sees chat messages and
renders them with the target's chat template. Extra keys on a line (an id, a domain, ...) are kept in
`record` so outputs can echo them for joining.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from angelspec.data.chat import ROLES


class PromptFileError(ValueError):
    """A prompts file that cannot be used; the message names the file, the line and the problem."""


def load_prompts(path: str | Path) -> list[dict[str, Any]]:
    """Read and validate a prompts JSONL file.

    Returns one dict per non-blank line: `{"line": int, "messages": [{"role", "content"}, ...],
    "record": <the line's original object>}`. Blank lines are skipped (a trailing newline is common);
    everything else must be valid. Raises `FileNotFoundError` for a missing file and `PromptFileError`
    for anything wrong inside it, including a file with no prompts at all.
    """
    path = Path(path)
    if path.is_dir():
        raise PromptFileError(f"prompts file {path} is a directory, expected a .jsonl file")
    if not path.is_file():
        raise FileNotFoundError(f"prompts file {path} does not exist")
    prompts: list[dict[str, Any]] = []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                text = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")  # tolerate a BOM from editors
            except UnicodeDecodeError as e:
                raise PromptFileError(f"{path}:{lineno}: not valid UTF-8 ({e.reason} at byte {e.start})") from None
            if not text.strip():
                continue
            try:
                record = json.loads(text)
            except json.JSONDecodeError as e:
                raise PromptFileError(f"{path}:{lineno}: malformed JSON: {e.msg} (column {e.colno})") from None
            messages = _record_messages(record, f"{path}:{lineno}")
            prompts.append({"line": lineno, "messages": messages, "record": record})
    if not prompts:
        raise PromptFileError(f"prompts file {path} is empty: expected one JSON object per line, "
                              'e.g. {"prompt": "Write a haiku about caches."}')
    return prompts


def _record_messages(record: object, where: str) -> list[dict[str, str]]:
    """Validate one line's object and return its chat messages (a "prompt" becomes one user turn)."""
    if not isinstance(record, dict):
        raise PromptFileError(f'{where}: expected a JSON object with "prompt" or "messages", '
                              f"got a JSON {_json_type(record)}")
    has_prompt, has_messages = "prompt" in record, "messages" in record
    if has_prompt and has_messages:
        raise PromptFileError(f'{where}: has both "prompt" and "messages"; give exactly one')
    if has_prompt:
        prompt = record["prompt"]
        if not isinstance(prompt, str):
            raise PromptFileError(f'{where}: "prompt" must be a string, got a JSON {_json_type(prompt)}')
        if not prompt.strip():
            raise PromptFileError(f'{where}: "prompt" is empty')
        return [{"role": "user", "content": prompt}]
    if has_messages:
        return _check_messages(record["messages"], where)
    keys = ", ".join(repr(k) for k in record) or "none"
    raise PromptFileError(f'{where}: needs a "prompt" (string) or "messages" (list of chat messages); '
                          f"keys found: {keys}")


def _check_messages(messages: object, where: str) -> list[dict[str, str]]:
    """Each message: a known role, string content, and optionally an assistant's `reasoning_content`
    (rendered in thinking mode); other keys are dropped here but kept in the echoed record."""
    if not isinstance(messages, list):
        raise PromptFileError(f'{where}: "messages" must be a list of {{"role", "content"}} objects, '
                              f"got a JSON {_json_type(messages)}")
    if not messages:
        raise PromptFileError(f'{where}: "messages" is an empty list')
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise PromptFileError(f"{where}: messages[{i}] must be an object, got a JSON {_json_type(m)}")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise PromptFileError(f"{where}: messages[{i}] has role {role!r}; expected one of {', '.join(ROLES)}")
        if not isinstance(content, str):
            raise PromptFileError(f'{where}: messages[{i}] "content" must be a string, '
                                  f"got a JSON {_json_type(content)}")
        message = {"role": role, "content": content}
        if m.get("reasoning_content") is not None:
            if role != "assistant" or not isinstance(m["reasoning_content"], str):
                raise PromptFileError(f'{where}: messages[{i}] "reasoning_content" must be a string on an '
                                      "assistant message")
            message["reasoning_content"] = m["reasoning_content"]
        out.append(message)
    return out


def _json_type(value: object) -> str:
    """The JSON name of a decoded value, so messages speak the file's language, not Python's."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"
