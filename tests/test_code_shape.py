"""The shape the code keeps (docs/architecture.md): short functions and modules in
pipeline/ and stages/, no import cycle, no stage naming a backend, no capability found by
probing a module."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from pipeline import backends

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted([*(ROOT / "pipeline").rglob("*.py"), *(ROOT / "stages").rglob("*.py")])
MAX_FUNCTION_LINES = 60
MAX_MODULE_LINES = 600
STAGE_SOURCES = sorted((ROOT / "stages").rglob("*.py"))


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


@pytest.mark.parametrize("path", [p for p in SOURCES if p in STAGE_SOURCES or "backends" in p.parts],
                         ids=lambda p: p.name)
def test_no_capability_is_probed_with_hasattr(path):
    """Stages and backends ask CAPABILITIES; hasattr on a backend or session is the old probe."""
    assert not _calls_named(path, "hasattr") or path.name == "openvino.py", path
    if path.name == "openvino.py":  # only OpenVINO's own values (get_type_name), never a backend
        assert all(call.args[1].value == "get_type_name" for call in _calls_named(path, "hasattr"))


@pytest.mark.parametrize("path", STAGE_SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_stage_names_a_backend_other_than_the_reference(path):
    names = set(backends.MODULES) - {backends.REFERENCE}
    strings = {node.value for node in ast.walk(ast.parse(path.read_text()))
               if isinstance(node, ast.Constant) and isinstance(node.value, str)}
    assert not names & strings, (path.name, names & strings)


def test_no_module_is_longer_than_600_lines():
    everything = sorted([*SOURCES, *(ROOT / "tests").glob("*.py"), *(ROOT / "benchmarks").glob("*.py"),
                         *(ROOT / "scripts").glob("*.py")])
    long = [f"{path.relative_to(ROOT)} ({lines} lines)" for path in everything
            if (lines := len(path.read_text().splitlines())) > MAX_MODULE_LINES]
    assert not long, long


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, known: set) -> set:
    """The project modules ``path`` imports, at the top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
                break
    return found


def test_no_import_cycle_anywhere():
    """Not at the top and not inside a function: a module never imports one that imports it
    back (a package's own __init__ excepted, which Python imports first anyway)."""
    modules = {_module(path): path for path in SOURCES}
    graph = {name: {d for d in _imports(path, set(modules)) if d != name and not name.startswith(d + ".")}
             for name, path in modules.items()}
    cycles = []

    def reaches(start, goal, seen):
        for step in graph[start]:
            if step == goal:
                return True
            if step not in seen:
                seen.add(step)
                if reaches(step, goal, seen):
                    return True
        return False

    for name in sorted(graph):
        back = sorted(d for d in graph[name] if reaches(d, name, {d}))
        if back:
            cycles.append(f"{name} <-> {back}")
    assert not cycles, cycles
