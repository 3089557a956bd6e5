"""The ``code`` domain: instruction -> function/method/class pairs mined from the CPython standard library
with ``ast`` (the instruction paraphrases the docstring, or names the function when it has none).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from angelspec.data.corpus.common import CodeFilter, Example, example_rng, has_special_token, mine_files
from angelspec.data.sources import iter_stdlib_files

_FUNC_WITH_DOC = (
    "Write a Python function `{sig}` that does the following: {desc}",
    "Implement `{sig}` in Python.\n\n{desc}",
    "Write a Python function named `{name}` with the signature `{sig}`. Its docstring says: \"{desc}\"",
    "In the `{module}` module, write the function `{sig}`. {desc}",
    "Here is a description of a function:\n\n{desc}\n\nWrite it in Python as `{sig}`.",
    "Write `{sig}`, a Python function for the `{module}` module. {desc}",
)
_METHOD_WITH_DOC = (
    "Write the method `{sig}` of the class `{cls}` in `{module}`. {desc}",
    "Implement the `{name}` method of `{cls}` (signature `{sig}`). It should do the following: {desc}",
    "Write a Python method `{sig}` for the class `{cls}`: {desc}",
    "Here is what `{cls}.{name}` should do:\n\n{desc}\n\nWrite the method `{sig}`.",
)
_CLASS_WITH_DOC = (
    "Write a Python class `{name}` that does the following: {desc}",
    "Implement the class `{name}` from the `{module}` module. {desc}",
    "Write a small Python class named `{name}`.\n\n{desc}",
)
_FUNC_NO_DOC = (
    "Write the Python function `{sig}` from the standard library module `{module}`.",
    "Implement `{sig}` as it is defined in Python's `{module}` module.",
    "Show the source of the function `{sig}` in the `{module}` module.",
)
_METHOD_NO_DOC = (
    "Write the `{name}` method of the `{cls}` class in Python's `{module}` module, with signature `{sig}`.",
    "Implement `{cls}.{name}` (signature `{sig}`) from the `{module}` module.",
    "Show the source of the method `{sig}` of `{cls}` in the `{module}` module.",
)

_SIGNATURE_DOC = re.compile(r"^[\w.]+\(.*\)(\s*->.*)?$", re.S)


def _module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts) or path.stem


def _describe(doc: str | None, limit: int) -> str | None:
    """The docstring's first real paragraph, whitespace-collapsed; None if absent or unusable.

    C-style docstrings open with a signature line (``S.find(sub) -> int``); that paragraph is skipped.
    Overlong paragraphs are cut at the last sentence end that fits, or rejected.
    """
    if not doc:
        return None
    paragraphs = [" ".join(p.split()) for p in doc.strip().split("\n\n")]
    paragraphs = [p for p in paragraphs if p]
    while paragraphs and _SIGNATURE_DOC.match(paragraphs[0]):
        paragraphs.pop(0)
    if not paragraphs:
        return None
    desc = paragraphs[0]
    if len(desc) > limit:
        cut = desc[:limit].rfind(". ")
        if cut < limit // 3:
            return None
        desc = desc[: cut + 1]
    if len(desc) < 12 or not any(c.isalpha() for c in desc):
        return None
    return desc


def _node_source(lines: list[str], node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> str:
    """The node's source including decorators, with exactly its own indentation removed.

    ``textwrap.dedent`` would fail on methods whose strings hold lines at column 0; stripping the
    node's ``col_offset`` only where present keeps those string contents intact.
    """
    start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
    indent = node.col_offset
    out = []
    for line in lines[start - 1 : node.end_lineno]:
        prefix = line[:indent]
        out.append(line[indent:] if prefix.strip() == "" else line)
    return "\n".join(out).rstrip() + "\n"


def _code_lines(node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> int:
    """Lines of statements besides the docstring; 0 for stubs (`pass`, `...`, raise NotImplementedError)."""
    body = list(node.body)
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant):
        if isinstance(body[0].value.value, str):
            body = body[1:]

    def is_stub(stmt: ast.stmt) -> bool:
        if isinstance(stmt, ast.Pass):
            return True
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) and stmt.value.value is ...:
            return True
        if isinstance(stmt, ast.Raise) and stmt.exc is not None:
            exc = stmt.exc.func if isinstance(stmt.exc, ast.Call) else stmt.exc
            return isinstance(exc, ast.Name) and exc.id == "NotImplementedError"
        return False

    if all(is_stub(s) for s in body):
        return 0
    return sum((s.end_lineno or s.lineno) - s.lineno + 1 for s in body)


def _signature(node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    prefix = "async " if isinstance(node, ast.AsyncFunctionDef) else ""
    ret = f" -> {ast.unparse(node.returns)}" if node.returns is not None else ""
    return f"{prefix}{node.name}({ast.unparse(node.args)}){ret}"


def code_pairs_from_source(
    source: str, module: str, *, seed: int = 0, limits: CodeFilter = CodeFilter()
) -> list[Example]:
    """Instruction -> code examples for one module's source (empty on a syntax error).

    Candidates: top-level functions, methods of top-level classes, and small documented classes.
    The split group is ``module:top-level name``, so a class and its methods share a split.
    """
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    lines = source.splitlines()
    func_types = (ast.FunctionDef, ast.AsyncFunctionDef)
    candidates: list[tuple[str, ast.AST, str | None]] = []  # (kind, node, class name)
    for node in tree.body:
        if isinstance(node, func_types):
            candidates.append(("function", node, None))
        elif isinstance(node, ast.ClassDef):
            candidates.extend(("method", m, node.name) for m in node.body if isinstance(m, func_types))
            if limits.include_classes:
                candidates.append(("class", node, None))
    examples: list[Example] = []
    for kind, node, cls in candidates:
        assert isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
        n_lines = (node.end_lineno or node.lineno) - min([node.lineno, *(d.lineno for d in node.decorator_list)]) + 1
        if n_lines > limits.max_lines or _code_lines(node) < limits.min_code_lines:
            continue
        code = _node_source(lines, node)
        if len(code) > limits.max_chars or has_special_token(code) or "\ufffd" in code:
            continue
        desc = _describe(ast.get_docstring(node), limits.max_description_chars)
        group = f"{module}:{cls or node.name}"
        rng = example_rng(seed, f"code:{group}:{kind}:{node.name}")
        fields = {"module": module, "name": node.name, "cls": cls or ""}
        if kind == "class":
            if desc is None:
                continue
            template = rng.choice(_CLASS_WITH_DOC)
        else:
            assert isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            fields["sig"] = _signature(node)
            if desc is None and not limits.include_undocumented:
                continue
            if kind == "function":
                template = rng.choice(_FUNC_WITH_DOC if desc else _FUNC_NO_DOC)
            else:
                template = rng.choice(_METHOD_WITH_DOC if desc else _METHOD_NO_DOC)
        prompt = template.format(desc=desc or "", **fields)
        examples.append(
            Example(group, ({"role": "user", "content": prompt}, {"role": "assistant", "content": code}))
        )
    return examples


def build_code_examples(
    root: Path, *, seed: int, limits: CodeFilter = CodeFilter(), progress: bool = True
) -> list[Example]:
    """Mine the stdlib folder ``root``; duplicates (same code up to whitespace) are kept once."""
    return mine_files(
        iter_stdlib_files(root),
        lambda path, source: code_pairs_from_source(source, _module_name(root, path), seed=seed, limits=limits),
        desc="code: parse stdlib",
        progress=progress,
    )
