"""Assemble the embedded target's training corpus from offline sources.

Four domains, each turned into chat examples ``{"messages": [...], "domain": ...}``, one miner per module:

- ``code`` (:mod:`.code`): instruction -> function pairs mined from the CPython standard library with ``ast``.
- ``chat`` (:mod:`.chat`): cleaned, English-only ShareGPT conversations, capped to fit a 1024-token context.
- ``math`` (:mod:`.maths`): seeded arithmetic word problems with worked solutions ending in "The answer is N.".
- ``docs`` (:mod:`.docs`, optional): sections of the Python manual, "Explain <title> ..." -> cleaned section text.

:mod:`.common` holds what they share (``Example``, the filter and config dataclasses, the split and the
cap); :mod:`.build` writes and reads the corpus folder. This package re-exports what building and reading
a corpus takes; each miner's own functions are imported from its module.

Everything is deterministic given the seed: inputs are read in sorted order, each example draws its
phrasing from an RNG keyed by (seed, example key), and the held-out split is decided by hashing a
stable group key (a module's top-level name, a first user message, a problem text, a doc section),
so the split neither depends on the seed nor on iteration order, and an example never moves between
splits when only the caps change. Output layout::

    out_dir/manifest.json                  settings + counts/chars/bytes per domain and split
    out_dir/<domain>/{train,heldout}.jsonl one example per line
    out_dir/<domain>/stats.json            per-domain record, lets an interrupted build resume
"""

from angelspec.data.corpus.build import build_corpus, iter_examples, iter_texts
from angelspec.data.corpus.common import (
    DEFAULT_MAX_EXAMPLES,
    DOMAINS,
    SPLITS,
    ChatFilter,
    CodeFilter,
    CorpusConfig,
    DocsFilter,
)

__all__ = [
    "DEFAULT_MAX_EXAMPLES",
    "DOMAINS",
    "SPLITS",
    "ChatFilter",
    "CodeFilter",
    "CorpusConfig",
    "DocsFilter",
    "build_corpus",
    "iter_examples",
    "iter_texts",
]
