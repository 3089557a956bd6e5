"""Assemble the embedded target's training corpus from offline sources.

Four domains, each turned into chat examples ``{"messages": [...], "domain": ...}``, one miner per module:

- ``code`` (:mod:`.code`): instruction -> function pairs mined from the CPython standard library with ``ast``.
- ``chat`` (:mod:`.chat`): cleaned, English-only ShareGPT conversations, capped to fit a 1024-token context.
- ``math`` (:mod:`.maths`): seeded arithmetic word problems with worked solutions ending in "The answer is N.".
- ``docs`` (:mod:`.docs`, optional): sections of the Python manual, "Explain <title> ..." -> cleaned section text.

:mod:`.common` holds what they share (:class:`Example`, the filter and config dataclasses, the split and the
cap); :mod:`.build` writes and reads the corpus folder.

Everything is deterministic given the seed: inputs are read in sorted order, each example draws its
phrasing from an RNG keyed by (seed, example key), and the held-out split is decided by hashing a
stable group key (a module's top-level name, a first user message, a problem text, a doc section),
so the split neither depends on the seed nor on iteration order, and an example never moves between
splits when only the caps change. Output layout::

    out_dir/manifest.json                  settings + counts/chars/bytes per domain and split
    out_dir/<domain>/{train,heldout}.jsonl one example per line
    out_dir/<domain>/stats.json            per-domain record, lets an interrupted build resume
"""

from angelspec.data.corpus.build import FORMAT_VERSION, build_corpus, iter_examples, iter_texts
from angelspec.data.corpus.chat import (
    build_chat_examples,
    clean_chat_text,
    conversation_from_sharegpt,
    estimate_tokens,
    is_english,
)
from angelspec.data.corpus.code import build_code_examples, code_pairs_from_source
from angelspec.data.corpus.common import (
    DEFAULT_MAX_EXAMPLES,
    DOMAINS,
    REQUIRED_DOMAINS,
    SPLITS,
    ChatFilter,
    CodeFilter,
    CorpusConfig,
    DocsFilter,
    Example,
    split_examples,
)
from angelspec.data.corpus.docs import build_docs_examples, clean_rst, docs_examples_from_rst, rst_sections
from angelspec.data.corpus.maths import MATH_TEMPLATES, MathProblem, build_math_examples, generate_math_problems

__all__ = [
    "DEFAULT_MAX_EXAMPLES",
    "DOMAINS",
    "FORMAT_VERSION",
    "MATH_TEMPLATES",
    "REQUIRED_DOMAINS",
    "SPLITS",
    "ChatFilter",
    "CodeFilter",
    "CorpusConfig",
    "DocsFilter",
    "Example",
    "MathProblem",
    "build_chat_examples",
    "build_code_examples",
    "build_corpus",
    "build_docs_examples",
    "build_math_examples",
    "clean_chat_text",
    "clean_rst",
    "code_pairs_from_source",
    "conversation_from_sharegpt",
    "docs_examples_from_rst",
    "estimate_tokens",
    "generate_math_problems",
    "is_english",
    "iter_examples",
    "iter_texts",
    "rst_sections",
    "split_examples",
]
