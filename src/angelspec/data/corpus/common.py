"""What the corpus miners and the build share: the domain and split names, the filter and config
dataclasses, :class:`Example`, the seed-independent held-out split and the seeded cap.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import re
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

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
