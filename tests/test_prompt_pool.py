"""Prompt pool (data/prompt_pool.py) on tiny synthetic inputs: dedup, decontamination, quotas, the files."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from angelspec.data import prompt_pool as P
from angelspec.data.decontam import report_path
from angelspec.data.prompts import load_prompts
from angelspec.data.sources import Sources


class WordTokenizer:
    """One token per whitespace-separated word: n-gram overlaps are easy to construct by hand."""

    def __init__(self) -> None:
        self.vocab: dict[str, int] = {}
        self.words: list[str] = []

    def encode(self, text: str) -> list[int]:
        ids = []
        for w in text.split():
            if w not in self.vocab:
                self.vocab[w] = len(self.words)
                self.words.append(w)
            ids.append(self.vocab[w])
        return ids

    def decode(self, ids: list[int]) -> str:
        return " ".join(self.words[i] for i in ids)


EVAL_LONG = " ".join(f"evalword{i}" for i in range(20))  # 20 tokens: any 16 of them in a row contaminate
EVAL_SHORT = "Hi there"  # shorter than the n-gram: only an exact match can catch it


def _cands(domain: str, prompts: list[str]) -> list[P.Candidate]:
    return [P.Candidate(domain, f"{domain}:{i}", p) for i, p in enumerate(prompts)]


def _synthetic() -> dict[str, list[P.Candidate]]:
    code = [f"Write function number {i} please." for i in range(30)]
    code += ["write  FUNCTION number 3 please.", "Write function number 4 please.  "]  # 2 duplicates
    chat = [f"Tell me about topic {i}." for i in range(20)]
    chat += ["prefix " + " ".join(EVAL_LONG.split()[2:18]) + " suffix",  # shares a 16-gram: dropped
             "prefix " + " ".join(EVAL_LONG.split()[2:17]) + " suffix",  # only 15 shared tokens: kept
             "hi   THERE",  # the short eval prompt, up to case and spaces: dropped
             "x" * 301]  # over max_chars=300: dropped
    math = [f"What is {i} plus {i + 1}?" for i in range(40)]
    docs = [f"Explain section {i}." for i in range(3)]  # fewer than its quota
    return {"code": _cands("code", code), "chat": _cands("chat", chat), "math": _cands("math", math),
            "docs": _cands("docs", docs)}


def _select(cands, **kw):
    kw.setdefault("per_domain", {"code": 10, "chat": 10, "math": 10, "docs": 10})
    kw.setdefault("min_total", 40)
    return P.select_pool(cands, [{"prompt": EVAL_LONG}, EVAL_SHORT], WordTokenizer(), max_chars=300, **kw)


def test_dedup_decontamination_and_domain_counts() -> None:
    records, counts, report = _select(_synthetic())
    assert counts["code"]["duplicates"] == 2 and counts["code"]["available"] == 30
    assert counts["chat"]["decontam_dropped"] == 1 and counts["chat"]["heldout_exact"] == 1
    assert counts["chat"]["too_long_chars"] == 1 and counts["chat"]["available"] == 21
    assert report.dropped_by_domain == {"chat": 1} and report.eval_prompts == 2
    prompts = {r["prompt"] for r in records}
    assert not any("evalword2 evalword3" in p and "evalword17" in p for p in prompts)
    assert "hi   THERE" not in prompts
    # docs has 3 of 10: its 7 missing prompts are split between the fill domains (code, maths)
    assert counts["docs"]["selected"] == 3
    assert counts["code"]["selected"] + counts["math"]["selected"] == 27
    assert abs(counts["code"]["selected"] - counts["math"]["selected"]) <= 1
    assert counts["chat"]["selected"] == 10
    assert len(records) == 40
    by_domain = {d: sum(r["domain"] == d for r in records) for d in P.DOMAINS}
    assert by_domain == {d: c["selected"] for d, c in counts.items()}
    assert len({P.norm_key(r["prompt"]) for r in records}) == 40  # no duplicates survive
    assert len({r["id"] for r in records}) == 40 and all(set(r) == {"prompt", "domain", "id"} for r in records)


def test_selection_is_deterministic_and_order_independent() -> None:
    cands = _synthetic()
    first, _, _ = _select(cands)
    again, _, _ = _select({d: list(reversed(v)) for d, v in cands.items()})
    assert first == again
    other_seed, _, _ = _select(cands, seed=1)
    assert other_seed != first and sorted(map(str, other_seed)) != sorted(map(str, first))


def test_allocate_fills_shortfall_and_stops_when_sources_run_out() -> None:
    avail = {"code": 100, "chat": 4, "math": 100, "docs": 0}
    quota = {"code": 10, "chat": 10, "math": 10, "docs": 10}
    assert P.allocate(avail, quota, min_total=40, fill_domains=("code", "math")) == {
        "code": 18, "chat": 4, "math": 18, "docs": 0}
    assert P.allocate(avail, quota, min_total=50, fill_domains=("code", "math")) == {
        "code": 23, "chat": 4, "math": 23, "docs": 0}
    small = {"code": 12, "chat": 4, "math": 100, "docs": 0}
    assert P.allocate(small, quota, min_total=40, fill_domains=("code", "math")) == {
        "code": 12, "chat": 4, "math": 24, "docs": 0}
    assert sum(P.allocate({"code": 3}, {"code": 10}, min_total=40, fill_domains=("code",)).values()) == 3


def test_bad_quotas_are_rejected() -> None:
    with pytest.raises(P.PromptPoolError, match="without candidates"):
        _select(_synthetic(), per_domain={"poetry": 3})
    with pytest.raises(P.PromptPoolError, match="ints >= 0"):
        _select(_synthetic(), per_domain={"code": -1})


# ------------------------------------------------------------------ end to end on fake sources

FAKE_MODULE = textwrap.dedent(
    '''
    def add_numbers(a, b=1):
        """Add two numbers and return the sum."""
        total = a + b
        return total


    def scale_numbers(a, factor=2):
        """Multiply a number by a factor and return it."""
        result = a * factor
        return result
    '''
)

FAKE_RST = textwrap.dedent(
    """
    Fake page NAME
    ==============================

    This section explains a fake feature called NAME in enough words to pass the docs length filter, which
    needs at least three hundred characters of cleaned prose. So here is some more text about NAME, how it
    works, and why a small model might want to learn about it before answering questions on the topic.
    """
)


def _chat_prompt(i: int) -> str:
    return f"Can you tell me what the number {i} is used for in this small example that I wrote for my class today?"


def _fake_sources(root: Path) -> Sources:
    stdlib = root / "stdlib"
    stdlib.mkdir()
    for i in range(6):
        (stdlib / f"mod{i}.py").write_text(FAKE_MODULE.replace("_numbers", f"_numbers{i}"), encoding="utf-8")
    records = [{"id": str(i), "conversations": [
        {"from": "human", "value": _chat_prompt(i)},
        {"from": "gpt", "value": f"The number {i} is a label that tells the records apart."}]} for i in range(30)]
    sharegpt = root / "sharegpt.json"
    sharegpt.write_text(json.dumps(records), encoding="utf-8")
    docs = root / "docs" / "library"
    docs.mkdir(parents=True)
    for i in range(8):
        (docs / f"page{i}.rst.txt").write_text(FAKE_RST.replace("NAME", f"widget{i}"), encoding="utf-8")
    return Sources(stdlib=stdlib, sharegpt=sharegpt, docs=root / "docs")


def test_build_prompt_pool_files(tmp_path: Path) -> None:
    from angelspec.data.corpus import DEFAULT_MAX_EXAMPLES
    from angelspec.data.corpus.chat import build_chat_examples
    from angelspec.data.corpus.maths import build_math_examples
    from angelspec.data.sources import iter_sharegpt_records

    sources = _fake_sources(tmp_path)
    chat_exs = build_chat_examples(iter_sharegpt_records(sources.sharegpt), progress=False)
    chat_held = P.corpus_heldout_groups(chat_exs, "chat", seed=0, cap=DEFAULT_MAX_EXAMPLES["chat"])
    chat_prompt = next(p for p in map(_chat_prompt, range(30)) if P.norm_key(p) not in chat_held)
    heldout = tmp_path / "eval.jsonl"
    heldout.write_text(json.dumps({"prompt": f"Please answer: {chat_prompt} Thanks!", "domain": "chat"}) + "\n")
    out = tmp_path / "pool" / "prompts.jsonl"
    quotas = {"code": 20, "chat": 5, "math": 5, "docs": 10}
    summary = P.build_prompt_pool(out, P.PoolSettings(per_domain=quotas, min_total=40), heldout_paths=[heldout],
                                  sources=sources, tokenizer=WordTokenizer(), progress=False)
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(load_prompts(out)) == len(lines) == summary["total"] == 40
    assert all(set(r) == {"prompt", "domain", "id"} for r in lines)
    assert chat_prompt not in {r["prompt"] for r in lines}
    assert json.loads(P.summary_path(out).read_text()) == summary
    assert json.loads(report_path(out).read_text())["dropped_by_domain"] == summary["decontam"]["dropped_by_domain"]
    doms = summary["domains"]
    assert doms["chat"]["mined"] == 30 and doms["chat"]["decontam_dropped"] == 1
    assert summary["decontam_dropped"]["chat"] == 1
    for d, c in doms.items():
        assert c["candidates"] == c["mined"] - c["corpus_heldout"]
        assert c["selected"] == sum(r["domain"] == d for r in lines) == summary["selected"][d]
        assert c["selected"] <= c["available"]
    # docs (8 pages) and code (12 functions, minus the corpus' held-out groups) run short: maths fills the rest
    assert doms["docs"]["selected"] == doms["docs"]["available"] < 8
    assert doms["code"]["selected"] == doms["code"]["available"] <= 12
    assert doms["math"]["selected"] == 40 - sum(c["selected"] for d, c in doms.items() if d != "math")
    # the corpus' held-out groups never reach the pool: rebuild the maths split and check
    exs = build_math_examples(summary["settings"]["math_problems"], seed=0, progress=False)
    held = P.corpus_heldout_groups(exs, "math", seed=0, cap=DEFAULT_MAX_EXAMPLES["math"])
    assert held and not held & {r["prompt"] for r in lines if r["domain"] == "math"}
