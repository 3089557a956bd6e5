"""The angelspec[vllm] plugin (`src/angelspec_vllm`): declared where vLLM looks for it, naming the architectures
the exporter writes, and kept apart from the package (it imports vLLM; AngelSpec never imports it). Serving through
it is proved by `make vllm-check` (vLLM lives in its own venv)."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

import angelspec_vllm
from angelspec.export import vllm as export_vllm

ROOT = Path(__file__).resolve().parents[1]
PLUGIN = ROOT / "src" / "angelspec_vllm"


def _imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            roots.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


def test_the_plugin_is_a_vllm_general_plugin_for_the_architectures_export_writes():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    assert project["entry-points"]["vllm.general_plugins"] == {"angelspec": "angelspec_vllm:register"}
    assert "vllm" in project["optional-dependencies"]
    assert set(angelspec_vllm.ARCHITECTURES) == {export_vllm.MTP_ARCH, export_vllm.BLOCK_ARCH}
    for target in angelspec_vllm.ARCHITECTURES.values():  # "module:Class" inside the plugin
        module, _, cls = target.partition(":")
        file = PLUGIN / f"{module.removeprefix('angelspec_vllm.')}.py"
        assert f"class {cls}(" in file.read_text(encoding="utf-8"), target


def test_the_plugin_and_the_package_do_not_import_each_other():
    """vLLM pins its own torch, so only the plugin may import it at module level, and the plugin reads exports, not
    AngelSpec: neither side imports the other."""
    for path in sorted(PLUGIN.glob("*.py")):
        assert "angelspec" not in _imported_roots(path), path
    for path in sorted((ROOT / "src" / "angelspec").rglob("*.py")):
        assert "angelspec_vllm" not in _imported_roots(path), path


def test_register_adds_the_classes_to_vllms_registry_once():
    pytest.importorskip("vllm", reason="vLLM lives in its own venv (make vllm-venv)")
    from vllm import ModelRegistry

    angelspec_vllm.register()
    angelspec_vllm.register()  # vLLM may load plugins more than once
    assert set(angelspec_vllm.ARCHITECTURES) <= set(ModelRegistry.get_supported_archs())
