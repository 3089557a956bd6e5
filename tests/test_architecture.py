"""The package's layers point one way (docs/design.md, "Layers").

    fileio, errors, assets  ->  models | data  ->  decoding  ->  train | eval | export  ->  pipelines  ->  cli  ->  demo

(`angelspec_research`, the research tools, sits above all of them and is never imported by the library.)

A module may import its own layer and the layers below it, never a layer above or a sibling on the same
level (`models` and `data` do not import each other, nor do `train`, `eval` and `export`). Every import counts:
at module level, inside functions, and under `TYPE_CHECKING`. The module graph has no cycles.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "angelspec"

LEVEL = {"__init__": 0, "fileio": 0, "errors": 0, "assets": 0, "models": 1, "data": 1, "decoding": 2, "train": 3,
         "eval": 3, "export": 3, "pipelines": 4, "cli": 5, "demo": 6}
# Same-level layers that must not import each other.
SIBLINGS = {frozenset({"models", "data"}), frozenset({"train", "eval"}), frozenset({"train", "export"}),
            frozenset({"eval", "export"})}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _layer(module: str) -> str:
    parts = module.split(".")
    return "__init__" if len(parts) == 1 else parts[1]


def _imports(path: Path) -> set[str]:
    """Every `angelspec...` module `path` imports (for `from a.b import c`, a.b.c when that is a module)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "angelspec")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                and node.module.split(".")[0] == "angelspec":
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                found.add(sub if sub in MODULES else node.module)
    return found


FILES = sorted(p for p in PACKAGE.rglob("*.py") if "assets" not in p.relative_to(PACKAGE).parts[:-1])
MODULES = {_module_name(p): p for p in FILES}
GRAPH = {name: _imports(path) for name, path in MODULES.items()}


def test_every_layer_is_known():
    unknown = sorted({_layer(m) for m in MODULES} - set(LEVEL))
    assert not unknown, f"new top-level module(s) {unknown}: give them a level in LEVEL and in docs/design.md"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_point_down(module):
    layer = _layer(module)
    bad = []
    for dep in sorted(GRAPH[module]):
        dep_layer = _layer(dep)
        if dep_layer == layer:
            continue
        if LEVEL[dep_layer] > LEVEL[layer]:
            bad.append(f"{dep} (layer {dep_layer} is above {layer})")
        elif frozenset({layer, dep_layer}) in SIBLINGS:
            bad.append(f"{dep} ({layer} and {dep_layer} are siblings)")
    assert not bad, f"{module} imports upwards or sideways: {bad}"


def test_nothing_but_the_cli_imports_the_cli():
    users = sorted(m for m, deps in GRAPH.items() if _layer(m) != "cli" and any(_layer(d) == "cli" for d in deps))
    assert not users, f"library modules import the command line: {users}"


def test_no_import_cycles():
    # Tarjan's strongly connected components over the module graph (package __init__ edges included).
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH.get(v, ()):
            if w not in MODULES:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(MODULES):
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


RESEARCH = PACKAGE.parent / "angelspec_research"


def _top_level_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level == 0 and n.module}
    return {name.split(".")[0] for name in names}


def test_the_library_never_imports_the_research_tools():
    """`angelspec_research` (routing, commit prediction, oracle drafters) sits on top of the library: it may import
    `angelspec`, the library never imports it."""
    users = sorted(_module_name(p) for p in FILES if "angelspec_research" in _top_level_imports(p))
    assert not users, f"library modules import the research package: {users}"
    assert RESEARCH.is_dir() and any(
        "angelspec" in _top_level_imports(p) for p in RESEARCH.rglob("*.py")), "the research package moved"
