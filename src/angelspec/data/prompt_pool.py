"""A large, decontaminated prompt pool for target rollouts (issue 13: training data at scale).

The drafter is trained on the target's own responses (:mod:`angelspec.train.rollout`), so what limits the
training data is the number of *prompts*. This module takes the prompt side of the offline corpus the
embedded target was built from (:mod:`angelspec.data.corpus`):

- ``code``: the instructions of the stdlib instruction -> function pairs,
- ``chat``: the first user turn of each cleaned ShareGPT conversation (all of them, not only the
  ones the corpus' cap kept),
- ``math``: the generated word problems (the corpus' own problems first; more are generated with
  the same seed only if the pool needs them),
- ``docs``: the "Explain <section> ..." questions about the Python manual,

and turns them into one prompts file (the :mod:`angelspec.data.prompts` format) through these steps,
counted per domain in the summary:

1. groups the corpus holds out (its ``heldout.jsonl`` splits, where the shipped evaluation prompts come
   from) are excluded, so a pool prompt never comes from a held-out group;
2. prompts longer than ``max_chars`` characters or ``max_prompt_tokens`` target tokens, or holding a
   special token, are dropped (a prompt must leave room for the response in the target's context);
3. duplicates (case and whitespace folded) are kept once, across all domains;
4. prompts equal to a held-out prompt, or sharing any ``ngram``-token window with one
   (:func:`angelspec.data.decontam.decontaminate`, the target's tokenizer), are dropped;
5. each domain takes a seeded random sample of its quota; a domain that runs short passes its shortfall
   on to the ``fill_domains`` (code and maths by default), until ``min_total`` prompts are chosen.

Output: ``out`` (``{"prompt", "domain", "id"}`` per line, domains interleaved by a seeded shuffle so any
prefix of a rollout is balanced; ``id`` is a stable hash of domain and prompt), ``<out>.summary.json``
(settings and per-domain counts) and ``<out>.decontam.json`` (the decontamination report: every dropped
prompt with the shared window). Everything is deterministic given the seed and the sources.

Run: ``python -m angelspec.data.prompt_pool --out .cache/pool/prompts.jsonl``.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from angelspec.data.corpus.chat import build_chat_examples
from angelspec.data.corpus.code import build_code_examples
from angelspec.data.corpus.common import CorpusConfig, Example, cap_and_order, split_examples
from angelspec.data.corpus.docs import build_docs_examples
from angelspec.data.corpus.maths import build_math_examples
from angelspec.data.decontam import DEFAULT_NGRAM, decontaminate, prompt_texts, report_path
from angelspec.data.prompts import load_prompts
from angelspec.data.sources import Sources, fetch_docs, iter_sharegpt_records, locate_sharegpt, stdlib_dir
from angelspec.errors import require_range
from angelspec.fileio import check_output_path, refuse_same_file, write_json_atomic, write_jsonl_atomic

POOL_VERSION = 1
DOMAINS: tuple[str, ...] = ("code", "chat", "math", "docs")
DEFAULT_PER_DOMAIN: dict[str, int] = {"code": 5000, "chat": 5000, "math": 5000, "docs": 5000}
DEFAULT_MIN_TOTAL = 20_000
MAX_POOL = 1_000_000  # prompts a domain quota or the whole pool may ask for (maths is generated to fill it)
DEFAULT_FILL_DOMAINS: tuple[str, ...] = ("code", "math")
DEFAULT_MAX_CHARS = 1024
# The target's context is 1024 tokens; 512 prompt tokens leave room for a 256-token response plus the
# chat template. Only digit- or symbol-heavy prompts under max_chars come near it.
DEFAULT_MAX_PROMPT_TOKENS = 512

_ASSETS = Path(__file__).resolve().parents[1] / "assets"  # no import of angelspec.assets: data-only module
DEFAULT_TARGET_DIR = _ASSETS / "target"
DEFAULT_HELDOUT_PATHS: tuple[Path, ...] = (_ASSETS / "prompts" / "eval.jsonl",)


class PromptPoolError(ValueError):
    """Bad pool settings or inputs; the message names the setting."""


@dataclass(frozen=True)
class Candidate:
    """One prompt before selection; ``group`` is the corpus split group it came from."""

    domain: str
    group: str
    prompt: str


def summary_path(out: str | os.PathLike[str]) -> Path:
    out = Path(out)
    return out.with_name(out.name + ".summary.json")


def norm_key(text: str) -> str:
    """The duplicate key: case-folded, whitespace-collapsed text."""
    return " ".join(text.lower().split())


def prompt_id(domain: str, prompt: str) -> str:
    """A stable id for joining rollouts back to the pool: ``<domain>-<12 hex digits>``."""
    digest = hashlib.blake2b(f"{domain}\x00{prompt}".encode(), digest_size=6).hexdigest()
    return f"{domain}-{digest}"


# ---------------------------------------------------------------------------------- mining


def corpus_heldout_groups(examples: list[Example], domain: str, *, seed: int, cap: int | None,
                          fraction: float = 0.02, min_heldout: int = 50) -> set[str]:
    """Groups the corpus build holds out for ``domain``, plus those it would hold out over all ``examples``.

    The corpus splits its *capped* list (:func:`angelspec.data.corpus.build_corpus`); the second split
    covers the candidates beyond the cap with the same hash rule, so the result never depends on the cap.
    """
    capped = cap_and_order(examples, cap, seed, domain)
    held: set[str] = set()
    for subset in (capped, examples):
        _, heldout = split_examples(subset, domain, fraction=fraction, min_heldout=min_heldout)
        held.update(ex.group for ex in heldout)
    return held


def candidates_from_examples(examples: Iterable[Example], domain: str, exclude_groups: set[str]) -> list[Candidate]:
    """The first user turn of every example outside ``exclude_groups``."""
    out = []
    for ex in examples:
        if ex.group in exclude_groups:
            continue
        user = next((m["content"] for m in ex.messages if m["role"] == "user"), None)
        if user is not None:
            out.append(Candidate(domain, ex.group, user))
    return out


def mine_domain(domain: str, sources: Sources, *, seed: int = 0, math_problems: int | None = None,
                progress: bool = False) -> tuple[list[Candidate], dict[str, int]]:
    """All prompt candidates of one domain from the corpus miners, minus the corpus' held-out groups.

    Returns (candidates, {"mined": examples, "corpus_heldout": excluded}). ``math_problems`` defaults to
    the corpus' own count; a larger number keeps those problems first (the generator is sequential).
    """
    config = CorpusConfig(seed=seed)
    cap = config.max_examples.get(domain)
    if domain == "code":
        examples = build_code_examples(sources.stdlib, seed=seed, limits=config.code, progress=progress)
    elif domain == "chat":
        examples = build_chat_examples(iter_sharegpt_records(sources.sharegpt), limits=config.chat, progress=progress)
    elif domain == "math":
        corpus_n = config.max_examples["math"]
        n = max(math_problems or corpus_n, corpus_n)
        examples = build_math_examples(n, seed=seed, progress=progress)
        # The corpus split only its first corpus_n problems; the extra ones are split on their own.
        held = corpus_heldout_groups(examples[:corpus_n], domain, seed=seed, cap=cap,
                                     fraction=config.heldout_fraction, min_heldout=config.min_heldout)
        held |= corpus_heldout_groups(examples, domain, seed=seed, cap=None,
                                      fraction=config.heldout_fraction, min_heldout=config.min_heldout)
        out = candidates_from_examples(examples, domain, held)
        return out, {"mined": len(examples), "corpus_heldout": len(examples) - len(out)}
    elif domain == "docs":
        if sources.docs is None or not sources.docs.is_dir():
            raise PromptPoolError("docs domain requested but the Python documentation sources are not available")
        examples = build_docs_examples(sources.docs, seed=seed, limits=config.docs, progress=progress)
    else:
        raise PromptPoolError(f"unknown domain {domain!r}; choose from {DOMAINS}")
    held = corpus_heldout_groups(examples, domain, seed=seed, cap=cap, fraction=config.heldout_fraction,
                                 min_heldout=config.min_heldout)
    out = candidates_from_examples(examples, domain, held)
    return out, {"mined": len(examples), "corpus_heldout": len(examples) - len(out)}


# ---------------------------------------------------------------------------------- selection


def _special_ids(tokenizer: Any) -> frozenset[int]:
    ids = getattr(tokenizer, "special_ids", None)
    return frozenset(ids) if ids is not None else frozenset()


def _encode_all(tokenizer: Any, texts: Sequence[str]) -> list[list[int]]:
    batch = getattr(tokenizer, "encode_batch", None)
    return batch(list(texts)) if batch is not None else [tokenizer.encode(t) for t in texts]


def allocate(available: Mapping[str, int], per_domain: Mapping[str, int], *, min_total: int,
             fill_domains: Sequence[str]) -> dict[str, int]:
    """How many prompts each domain gives: its quota where available, the shortfall up to
    ``max(min_total, sum(per_domain))`` spread evenly over the ``fill_domains`` that have spare prompts."""
    take = {d: min(q, available.get(d, 0)) for d, q in per_domain.items()}
    short = max(min_total, sum(per_domain.values())) - sum(take.values())
    while short > 0:
        spare = [d for d in fill_domains if d in take and available.get(d, 0) > take[d]]
        if not spare:
            break
        share = math.ceil(short / len(spare))
        for d in spare:
            add = min(share, available[d] - take[d], short)
            take[d] += add
            short -= add
    return take


def select_pool(
    candidates: Mapping[str, Sequence[Candidate]],
    heldout_prompts: Sequence[Mapping[str, Any] | str],
    tokenizer: Any,
    *,
    per_domain: Mapping[str, int],
    min_total: int = 0,
    fill_domains: Sequence[str] = DEFAULT_FILL_DOMAINS,
    seed: int = 0,
    max_chars: int = DEFAULT_MAX_CHARS,
    max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS,
    ngram: int = DEFAULT_NGRAM,
) -> tuple[list[dict[str, Any]], dict[str, Any], Any]:
    """Filter, deduplicate, decontaminate and sample ``candidates`` (steps 2-5 of the module docstring).

    heldout_prompts: prompts-format records (or plain strings) nothing in the pool may overlap.
    tokenizer: the target's (``encode``/``decode``), for the token-length cap and the n-gram rule.
    Returns (records in output order, per-domain counts, the :class:`~angelspec.data.decontam.DecontamReport`).
    """
    unknown = set(per_domain) - set(candidates)
    if unknown:
        raise PromptPoolError(f"per_domain names domains without candidates: {sorted(unknown)}")
    bad = {d: q for d, q in per_domain.items() if isinstance(q, bool) or not isinstance(q, int) or q < 0}
    if bad:
        raise PromptPoolError(f"per_domain quotas must be ints >= 0, got {bad}")
    heldout_keys = {norm_key(t) for p in heldout_prompts for t in ([p] if isinstance(p, str) else prompt_texts(p))}
    special = _special_ids(tokenizer)
    counts: dict[str, dict[str, int]] = {}
    seen: set[str] = set()
    clean: list[dict[str, Any]] = []
    for domain in per_domain:  # domain order decides which copy of a cross-domain duplicate survives
        c = counts[domain] = dict.fromkeys(
            ("candidates", "empty", "too_long_chars", "too_long_tokens", "special_tokens", "duplicates",
             "heldout_exact", "decontam_dropped", "available", "quota", "selected"), 0)
        c["candidates"] = len(candidates[domain])
        short = []
        for cand in candidates[domain]:
            text = cand.prompt.strip()
            if not text:
                c["empty"] += 1
            elif len(text) > max_chars:
                c["too_long_chars"] += 1
            else:
                short.append((cand, text))
        best: dict[str, tuple[str, str]] = {}  # key -> (text, group); the smallest text wins, in any input order
        for (cand, text), ids in zip(short, _encode_all(tokenizer, [t for _, t in short]), strict=True):
            key = norm_key(text)
            if len(ids) > max_prompt_tokens:
                c["too_long_tokens"] += 1
            elif special and any(i in special for i in ids):
                c["special_tokens"] += 1
            elif key in best:
                c["duplicates"] += 1
                best[key] = min(best[key], (text, cand.group))
            else:
                best[key] = (text, cand.group)
        for key in sorted(best):
            text, group = best[key]
            if key in seen:  # kept by an earlier domain
                c["duplicates"] += 1
            elif key in heldout_keys:
                c["heldout_exact"] += 1
            else:
                seen.add(key)
                clean.append({"prompt": text, "domain": domain, "group": group})
    if heldout_prompts:
        kept, report = decontaminate(clean, heldout_prompts, tokenizer, n=ngram)
    else:
        kept, report = list(clean), None
    for domain, c in counts.items():
        c["decontam_dropped"] = report.dropped_by_domain.get(domain, 0) if report is not None else 0
    by_domain: dict[str, list[Mapping[str, Any]]] = {d: [] for d in per_domain}
    for rec in kept:
        by_domain[rec["domain"]].append(rec)
    take = allocate({d: len(v) for d, v in by_domain.items()}, per_domain, min_total=min_total,
                    fill_domains=fill_domains)
    chosen: list[dict[str, Any]] = []
    for domain, recs in by_domain.items():
        order = sorted(recs, key=lambda r: norm_key(r["prompt"]))  # input-order independent start
        random.Random(f"{seed}:pool:{domain}").shuffle(order)
        counts[domain].update(available=len(recs), quota=per_domain[domain], selected=take[domain])
        chosen.extend({"prompt": r["prompt"], "domain": domain, "id": prompt_id(domain, r["prompt"])}
                      for r in order[: take[domain]])
    chosen.sort(key=lambda r: r["id"])
    random.Random(f"{seed}:pool:interleave").shuffle(chosen)
    return chosen, counts, report


# ---------------------------------------------------------------------------------- build


@dataclass(frozen=True)
class PoolSettings:
    """What `build_prompt_pool` selects: `per_domain` quotas (default :data:`DEFAULT_PER_DOMAIN`; its keys are the
    domains mined); `min_total`, the pool's minimum size, whose shortfalls go to `fill_domains` (maths is regenerated
    with more problems when it is the one that runs out); `seed`; the length caps `max_chars` and
    `max_prompt_tokens` (target tokens); `ngram`, the decontamination n-gram length."""

    per_domain: Mapping[str, int] | None = None
    min_total: int = DEFAULT_MIN_TOTAL
    fill_domains: Sequence[str] = DEFAULT_FILL_DOMAINS
    seed: int = 0
    max_chars: int = DEFAULT_MAX_CHARS
    max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS
    ngram: int = DEFAULT_NGRAM


def build_prompt_pool(
    out_path: str | os.PathLike[str],
    settings: PoolSettings | None = None,
    *,
    heldout_paths: Sequence[str | os.PathLike[str]] = DEFAULT_HELDOUT_PATHS,
    cache_dir: str | os.PathLike[str] | None = None,
    sources: Sources | None = None,
    target_dir: str | os.PathLike[str] = DEFAULT_TARGET_DIR,
    tokenizer: Any = None,
    progress: bool = True,
    force: bool = False,
) -> dict[str, Any]:
    """Build the prompt pool that `settings` describe (`PoolSettings`; None: the defaults) into ``out_path`` (plus
    its summary and decontamination report); return the summary. An existing ``out_path`` is refused unless
    ``force``, and one of the held-out files always.

    Args:
        heldout_paths: prompts files (default: the shipped ``eval.jsonl``) nothing in the pool may overlap.
        cache_dir / sources: where the raw sources live (:mod:`angelspec.data.sources`); tests pass fakes.
        target_dir / tokenizer: the target whose tokens the length cap and the n-gram rule count.
    """
    t0 = time.perf_counter()
    s = PoolSettings() if settings is None else settings
    per_domain, min_total, fill_domains, seed = s.per_domain, s.min_total, s.fill_domains, s.seed
    max_chars, max_prompt_tokens, ngram = s.max_chars, s.max_prompt_tokens, s.ngram
    say: Callable[[str], None] = (lambda msg: print(f"prompt-pool: {msg}", file=sys.stderr)) if progress else (
        lambda msg: None)
    if per_domain is not None and not isinstance(per_domain, Mapping):
        raise PromptPoolError(f"--per-domain must be a JSON object of quotas such as {json.dumps(DEFAULT_PER_DOMAIN)}, "
                              f"got {per_domain!r}")
    quotas = dict(per_domain if per_domain is not None else DEFAULT_PER_DOMAIN)
    unknown = set(quotas) - set(DOMAINS)
    if unknown:
        raise PromptPoolError(f"unknown domain(s) {sorted(unknown)}; choose from {DOMAINS}")
    for domain, quota in quotas.items():
        if isinstance(quota, bool) or not isinstance(quota, int):
            raise PromptPoolError(f"--per-domain {domain}: the quota must be a whole number, got {quota!r}")
        require_range(f"--per-domain {domain}", quota, 0, MAX_POOL)
    require_range("--min-total", min_total, 0, MAX_POOL)
    out = Path(out_path)
    if out.is_dir():
        raise PromptPoolError(f"out_path {out} is a directory; give a file name")
    for written in (out, summary_path(out), report_path(out)):
        refuse_same_file(written, *(("--heldout", path) for path in heldout_paths))
    check_output_path(out, force)
    if tokenizer is None:
        from angelspec.data.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(target_dir)
    heldout = [p["record"] for path in heldout_paths for p in load_prompts(path)]
    if sources is None:
        sources = Sources(
            stdlib=stdlib_dir() if "code" in quotas else Path(),
            sharegpt=locate_sharegpt(cache_dir) if "chat" in quotas else Path(),
            docs=fetch_docs(cache_dir) if "docs" in quotas else None,
        )
    candidates: dict[str, list[Candidate]] = {}
    mined: dict[str, dict[str, int]] = {}
    for domain in quotas:
        say(f"mining {domain}")
        candidates[domain], mined[domain] = mine_domain(domain, sources, seed=seed, progress=progress)
    math_problems = mined["math"]["mined"] if "math" in quotas else 0
    while True:
        say("filtering, deduplicating and decontaminating")
        records, counts, report = select_pool(
            candidates, heldout, tokenizer, per_domain=quotas, min_total=min_total, fill_domains=fill_domains,
            seed=seed, max_chars=max_chars, max_prompt_tokens=max_prompt_tokens, ngram=ngram)
        short = max(min_total, sum(quotas.values())) - len(records)
        maths_ran_out = "math" in counts and counts["math"]["selected"] == counts["math"]["available"]
        if short <= 0 or not maths_ran_out or "math" not in fill_domains or math_problems > 50 * max(min_total, 1):
            break
        math_problems *= 2
        say(f"{short} prompts short: generating {math_problems} maths problems")
        candidates["math"], mined["math"] = mine_domain("math", sources, seed=seed, math_problems=math_problems,
                                                        progress=progress)
    for domain, c in counts.items():
        counts[domain] = {"mined": mined[domain]["mined"], "corpus_heldout": mined[domain]["corpus_heldout"], **c}
    summary: dict[str, Any] = {
        "version": POOL_VERSION,
        "out": str(out),
        "total": len(records),
        "short_of_min_total": max(0, min_total - len(records)),
        "selected": {d: c["selected"] for d, c in counts.items()},
        "decontam_dropped": {d: c["decontam_dropped"] + c["heldout_exact"] for d, c in counts.items()},
        "settings": {"seed": seed, "per_domain": quotas, "min_total": min_total, "fill_domains": list(fill_domains),
                     "max_chars": max_chars, "max_prompt_tokens": max_prompt_tokens, "ngram": ngram,
                     "heldout_paths": [str(p) for p in heldout_paths], "heldout_prompts": len(heldout),
                     "target_dir": str(target_dir), "math_problems": math_problems,
                     "sources": {"stdlib": str(sources.stdlib), "sharegpt": str(sources.sharegpt),
                                 "docs": str(sources.docs) if sources.docs is not None else None}},
        "domains": counts,
        "decontam": None if report is None else {k: v for k, v in report.to_json().items() if k != "dropped"},
        "elapsed_s": round(time.perf_counter() - t0, 1),
    }
    write_jsonl_atomic(out, records)
    if report is not None:
        write_json_atomic(report_path(out), report.to_json())
    write_json_atomic(summary_path(out), summary)
    if summary["short_of_min_total"]:
        say(f"warning: only {len(records)} prompts, {summary['short_of_min_total']} short of {min_total}")
    say(f"wrote {len(records)} prompts to {out} ({summary['selected']}) in {summary['elapsed_s']} s")
    return summary
