"""The shape the code keeps (docs/architecture.md): short functions in pipeline/ and
stages/, no stage naming a backend, no capability found by probing a module."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from pipeline import backends

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted([*(ROOT / "pipeline").rglob("*.py"), *(ROOT / "stages").rglob("*.py")])
MAX_FUNCTION_LINES = 60


def _functions(path: Path):
    tree = ast.parse(path.read_text(), filename=str(path))
    return [node for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]


def test_no_function_in_pipeline_or_stages_is_longer_than_60_lines():
    long = [f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for path in SOURCES for node in _functions(path)
            if node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]
    assert not long, long


def _calls_named(path: Path, name: str):
    tree = ast.parse(path.read_text(), filename=str(path))
    return [node for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == name]


@pytest.mark.parametrize("path", [p for p in SOURCES if p.parent.name in ("stages", "backends") or
                                  p.parent.parent.name == "backends"], ids=lambda p: p.name)
def test_no_capability_is_probed_with_hasattr(path):
    """Stages and backends ask CAPABILITIES; hasattr on a backend or session is the old probe."""
    assert not _calls_named(path, "hasattr") or path.name == "openvino.py", path
    if path.name == "openvino.py":  # only OpenVINO's own values (get_type_name), never a backend
        assert all(call.args[1].value == "get_type_name" for call in _calls_named(path, "hasattr"))


@pytest.mark.parametrize("path", sorted((ROOT / "stages").glob("*.py")), ids=lambda p: p.name)
def test_no_stage_names_a_backend_other_than_the_reference(path):
    names = set(backends.MODULES) - {backends.REFERENCE}
    strings = {node.value for node in ast.walk(ast.parse(path.read_text()))
               if isinstance(node, ast.Constant) and isinstance(node.value, str)}
    assert not names & strings, (path.name, names & strings)
