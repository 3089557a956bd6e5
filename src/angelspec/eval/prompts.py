"""Held-out evaluation prompts: a prompts file's lines grouped by their "domain" key and rendered with the
target's chat template, for `evaluate`, the serving sweep and the demo."""

from __future__ import annotations

from typing import Any

from angelspec.decoding.loading import encode_prompts
from angelspec.errors import UsageError
from angelspec.eval.speculative import ALL, EvalPrompt


def eval_prompts(tokenizer: Any, records: list[dict[str, Any]], *, context: int, source: str,
                 limit: int | None = None, think: bool = False) -> list[EvalPrompt]:
    """Prompts for `evaluate`: grouped by each line's "domain" key, at most `limit` per domain.

    Lines without a domain are grouped as "other" when some lines have one, and everything is one group
    ("all") when none has; a domain that is not a string is refused with its line number.
    """
    has_domains = any("domain" in p["record"] for p in records)
    kept, counts = [], {}
    for p in records:
        domain = p["record"].get("domain", "other") if has_domains else ALL
        if has_domains and (not isinstance(domain, str) or not domain.strip() or domain == ALL):
            raise UsageError(f'{source}:{p["line"]}: "domain" must be a non-empty string other than {ALL!r}, '
                             f"got {domain!r}")
        if limit is not None and counts.get(domain, 0) >= limit:
            continue
        counts[domain] = counts.get(domain, 0) + 1
        kept.append((p, domain))
    ids = encode_prompts(tokenizer, [p for p, _ in kept], context=context, think=think, source=source)
    return [EvalPrompt(ids=i, domain=d, line=p["line"]) for i, (p, d) in zip(ids, kept, strict=True)]
