"""Every `angelspec` name a benchmark script imports exists, including the imports inside functions.

The benchmarks are scripts, not part of the package, so nothing else imports them; when modules move (the
architecture change moved `models/model/` to `models/block/`) a benchmark can break without any test noticing.
This reads each script's import statements and resolves them, so a stale path fails here in milliseconds.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

BENCHMARKS = sorted((Path(__file__).resolve().parents[1] / "benchmarks").glob("*.py"))


def angelspec_imports(path: Path) -> list[tuple[int, str, str | None]]:
    """(line, module, name) for every `from angelspec... import name` and `import angelspec...` in the file."""
    found: list[tuple[int, str, str | None]] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "angelspec":
            found.extend((node.lineno, node.module, alias.name) for alias in node.names)
        elif isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name, None) for alias in node.names
                         if alias.name.split(".")[0] == "angelspec")
    return found


def test_there_are_benchmarks_to_check():
    assert len(BENCHMARKS) >= 5


@pytest.mark.parametrize("path", BENCHMARKS, ids=lambda p: p.name)
def test_benchmark_imports_resolve(path: Path):
    broken = []
    for line, module, name in angelspec_imports(path):
        try:
            mod = importlib.import_module(module)
        except ImportError as e:
            broken.append(f"{path.name}:{line}: {module}: {e}")
            continue
        if name is not None and name != "*" and not hasattr(mod, name):
            try:  # `from package import submodule`
                importlib.import_module(f"{module}.{name}")
            except ImportError:
                broken.append(f"{path.name}:{line}: {module} has no {name}")
    assert not broken, "\n".join(broken)
