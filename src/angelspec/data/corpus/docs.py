"""The optional ``docs`` domain: sections of the Python manual's .rst sources, "Explain <title> ..." ->
the section rendered as plain text.
"""

from __future__ import annotations

import re
from pathlib import Path

from angelspec.data.corpus.common import MANY_NEWLINES, DocsFilter, Example, example_rng, has_special_token, mine_files
from angelspec.data.sources import iter_docs_files

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
