"""Decontamination: drop training prompts that share >= n contiguous tokens with an evaluation prompt.

Report §3.5: "Before response generation, we remove any prompt that shares a contiguous sequence of at
least 16 tokens with an evaluation example." Acceptance measured on prompts the drafter was trained on
overstates it, and rollout makes the leak worse (the drafter then sees the target's exact answer), so
this runs before :mod:`angelspec.train.rollout`. `angelspec decontam` (angelspec.cli.data) is the command
line of :func:`decontaminate_file`.

What is compared: the *prompt* side only, i.e. the content of each user turn, tokenized as plain text
with the target's tokenizer (no chat template: its fixed header tokens would be shared by every pair).
Turns are scanned separately, so an n-gram never spans two turns.

Cost: every n-gram of the evaluation prompts goes into one hash set; each training token is then looked
up once, so the whole pass is O(total tokens). Window hashes are computed for a whole token array at
once with a polynomial rolling hash mod 2^64 (:func:`ngram_hashes`), and every hit is confirmed by
comparing the actual tokens, so a hash collision can never drop a clean prompt.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from angelspec.data.prompts import load_prompts
from angelspec.fileio import check_writable_path, refuse_same_file, write_json_atomic, write_jsonl_atomic

DEFAULT_NGRAM = 16
MAX_NGRAM = 1024  # the longest shared window that can count as contamination
_BASE = np.uint64(0x9E3779B97F4A7C15)  # odd, so it is invertible mod 2^64
_BASE_INV = np.uint64(pow(int(_BASE), -1, 1 << 64))


class DecontamError(ValueError):
    """Bad decontamination input (n, empty evaluation set, unreadable files)."""


def _powers(base: np.uint64, n: int) -> np.ndarray:
    """base^0 .. base^(n-1) mod 2^64 ([n] uint64); cumprod wraps, which is the modular product we want."""
    out = np.full(n, base, dtype=np.uint64)
    out[0] = 1
    with np.errstate(over="ignore"):
        return np.cumprod(out, dtype=np.uint64)


def ngram_hashes(ids: Sequence[int] | np.ndarray, n: int) -> np.ndarray:
    """Hash of every length-n window: h[i] = sum_j ids[i+j] * B^(n-1-j) mod 2^64, as [len - n + 1] uint64.

    Vectorised in O(len) with no per-window loop: scale x_j by B^-j, prefix-sum (S), then each window is
    (S[i+n-1] - S[i-1]) * B^(i+n-1). All arithmetic wraps mod 2^64, where B^-1 exists because B is odd.
    """
    x = np.asarray(ids, dtype=np.uint64) + np.uint64(1)  # +1: token 0 still moves the hash
    m = x.shape[0]
    if m < n:
        return np.empty(0, dtype=np.uint64)
    with np.errstate(over="ignore"):
        prefix = np.concatenate([np.zeros(1, np.uint64), np.cumsum(x * _powers(_BASE_INV, m), dtype=np.uint64)])
        window = prefix[n:] - prefix[:-n]  # [m - n + 1] = sum_{j in window} x_j B^-j
        return window * _powers(_BASE, m)[n - 1:]


def prompt_texts(record: Mapping[str, Any]) -> list[str]:
    """The user turns of a prompts-format record ({"prompt": str} or {"messages": [...]})."""
    if isinstance(record.get("prompt"), str):
        return [record["prompt"]]
    return [m["content"] for m in record.get("messages", ()) if isinstance(m, Mapping) and m.get("role") == "user"
            and isinstance(m.get("content"), str)]


@dataclass
class DecontamReport:
    """What was dropped and why, plus per-domain counts (domain = the record's "domain" key or "unknown")."""

    ngram: int
    eval_prompts: int
    eval_ngrams: int
    kept: int = 0
    dropped: list[dict[str, Any]] = field(default_factory=list)  # {index, domain, eval_index, overlap}
    total_by_domain: Counter[str] = field(default_factory=Counter)
    dropped_by_domain: Counter[str] = field(default_factory=Counter)

    def format(self) -> str:
        total = self.kept + len(self.dropped)
        lines = [f"decontam: dropped {len(self.dropped)}/{total} training prompts sharing >= {self.ngram} contiguous "
                 f"tokens with {self.eval_prompts} evaluation prompts ({self.eval_ngrams} distinct {self.ngram}-grams)"]
        for domain in sorted(self.total_by_domain):
            d, t = self.dropped_by_domain[domain], self.total_by_domain[domain]
            lines.append(f"  {domain:<16} dropped {d:>7} of {t:>7} ({d / t:.2%})")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {"ngram": self.ngram, "eval_prompts": self.eval_prompts, "eval_ngrams": self.eval_ngrams,
                "kept": self.kept, "dropped_count": len(self.dropped),
                "total_by_domain": dict(self.total_by_domain), "dropped_by_domain": dict(self.dropped_by_domain),
                "dropped": self.dropped}


def decontaminate(
    train_records: Iterable[Mapping[str, Any]],
    eval_prompts: Iterable[Mapping[str, Any] | str],
    tokenizer: Any,
    n: int = DEFAULT_NGRAM,
) -> tuple[list[Mapping[str, Any]], DecontamReport]:
    """Split training records into those kept and a report of those dropped.

    train_records / eval_prompts: prompts-format records (an evaluation prompt may also be a plain str).
    tokenizer: anything with ``encode(text) -> list[int]`` (the target's tokenizer: the rule counts
    *its* tokens). A record is dropped when any user turn contains a length-``n`` token window that
    also occurs in an evaluation prompt.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise DecontamError(f"n-gram length must be an int >= 1, got {n!r}")
    if n > MAX_NGRAM:  # a window longer than every prompt matches nothing: every line would be kept, unchecked
        raise DecontamError(f"n-gram length (--ngram) must be at most {MAX_NGRAM} tokens, got {n}")
    table: dict[int, tuple[int, int]] = {}  # window hash -> (eval text row, window start) of its first occurrence
    eval_ids: list[np.ndarray] = []  # one row per evaluation user turn
    owner: list[int] = []  # eval text row -> index of its evaluation prompt
    num_eval = 0
    for ei, prompt in enumerate(eval_prompts):
        num_eval += 1
        for text in [prompt] if isinstance(prompt, str) else prompt_texts(prompt):
            ids = np.asarray(tokenizer.encode(text), dtype=np.int64)
            eval_ids.append(ids)
            owner.append(ei)
            for start, h in enumerate(ngram_hashes(ids, n).tolist()):
                table.setdefault(h, (len(eval_ids) - 1, start))
    if not eval_ids:
        raise DecontamError("no evaluation prompts given: nothing to decontaminate against")
    report = DecontamReport(ngram=n, eval_prompts=num_eval, eval_ngrams=len(table))
    kept: list[Mapping[str, Any]] = []
    for index, record in enumerate(train_records):
        domain = str(record.get("domain", "unknown"))
        report.total_by_domain[domain] += 1
        hit = _first_overlap(record, tokenizer, n, table, eval_ids)
        if hit is None:
            kept.append(record)
            continue
        row, overlap = hit
        report.dropped_by_domain[domain] += 1
        report.dropped.append({"index": index, "domain": domain,
                               "eval_index": owner[row],
                               "overlap": tokenizer.decode(overlap.tolist())})
    report.kept = len(kept)
    return kept, report


def _first_overlap(record: Mapping[str, Any], tokenizer: Any, n: int, table: Mapping[int, tuple[int, int]],
                   eval_ids: Sequence[np.ndarray]) -> tuple[int, np.ndarray] | None:
    """(eval row, the shared n tokens) of the first confirmed shared window, or None."""
    for text in prompt_texts(record):
        ids = np.asarray(tokenizer.encode(text), dtype=np.int64)
        for start, h in enumerate(ngram_hashes(ids, n).tolist()):
            found = table.get(h)
            if found is None:
                continue
            row, at = found
            window = ids[start:start + n]
            if np.array_equal(window, eval_ids[row][at:at + n]):  # confirm: a collision never drops a prompt
                return row, window
    return None


def report_path(out: Path) -> Path:
    """Where `decontaminate_file` writes its JSON report: beside the output, OUT.decontam.json."""
    return out.with_name(out.name + ".decontam.json")


def decontaminate_file(train_path: str | Path, eval_paths: Sequence[str | Path], out_path: str | Path,
                       tokenizer: Any, *, n: int = DEFAULT_NGRAM,
                       force: bool = False) -> tuple[int, DecontamReport]:
    """Filter the prompts file `train_path` against every file of `eval_paths` (:func:`decontaminate`), write
    the kept lines unchanged to `out_path` and the report to :func:`report_path`; returns (lines kept, report).

    tokenizer: the target's tokenizer (``encode`` / ``decode``). Refuses to overwrite the output or its report
    without `force`, an output that is an input (`refuse_same_file`) and one that cannot be written.
    """
    out = Path(out_path)
    inputs = [("--train", train_path), *(("--eval", path) for path in eval_paths)]
    refuse_same_file(out, *inputs)
    refuse_same_file(report_path(out), *inputs, flag="the report of --out,")
    if out.is_dir():
        raise DecontamError(f"--out {out} is a directory; give a file name")
    for path in (out, report_path(out)):
        if path.exists() and not force:
            raise FileExistsError(f"{path} already exists; pass --force to overwrite it")
    check_writable_path(out)
    train = load_prompts(train_path)
    evals = [p["record"] for path in eval_paths for p in load_prompts(path)]
    kept, report = decontaminate([p["record"] for p in train], evals, tokenizer, n=n)
    write_jsonl_atomic(out, list(kept))
    write_json_atomic(report_path(out), report.to_json())
    return len(kept), report
