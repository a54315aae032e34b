"""Every precision's facts live in pipeline/precision/kinds.py (issue 47): the table covers
every config precision, its orders and relations are consistent, and no other module of
pipeline/ or stages/ compares a precision's name as text."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from pipeline import backends
from pipeline.config.schemas import Precision, PrecisionConfig, QuantType
from pipeline.precision import kinds

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted([*(ROOT / "pipeline").rglob("*.py"), *(ROOT / "stages").rglob("*.py")])
KINDS_MODULE = ROOT / "pipeline" / "precision" / "kinds.py"


def test_every_config_precision_has_its_facts():
    files = {path.stem for path in (ROOT / "conf" / "precision").glob("*.yaml")}
    # int8_dynamic's file is int8 with per-call ranges: the candidate's name typed back
    variants = {name for name, kind in kinds.KINDS.items() if kind.config is not None}
    assert files == {*kinds.CONFIG_NAMES, kinds.AUTO, *variants}
    assert [p.value for p in Precision] == [*kinds.CONFIG_NAMES, kinds.AUTO]  # the enum is the table's
    assert kinds.REFERENCE in kinds.CONFIG_NAMES and kinds.AUTO not in kinds.KINDS


def test_every_declared_precision_and_candidate_is_in_the_table():
    for name in backends.MODULES:
        can = backends.spec(name).CAPABILITIES
        for precision in (*can.precisions, *can.auto_candidates, *can.runtime_precisions, *can.own_int8):
            assert precision in kinds.CONFIG_NAMES, (name, precision)


def test_orders_are_consistent():
    assert set(kinds.FIDELITY) == set(kinds.KINDS) and kinds.FIDELITY[0] == kinds.REFERENCE
    assert len({kind.fidelity for kind in kinds.KINDS.values()}) == len(kinds.KINDS)  # no tie left to chance
    # auto's tie-break as it was: the higher float first, dynamic int8 closer than static int8
    assert kinds.FIDELITY == ("fp32", "bf16", "fp16", "mixed", "int8_dynamic", "int8")
    # the sweep's columns: the config precisions in the table's order, any other name after them
    assert sorted(["mixed", "auto", "fp16", "int8", "fp32", "bf16"], key=kinds.listed_order) == \
        ["fp32", "fp16", "bf16", "int8", "mixed", "auto"]
    assert kinds.HALF == ("fp16", "bf16")


def test_facts_hang_together():
    for name, kind in kinds.KINDS.items():
        assert kind.name == name and kind.float_bits in (16, 32)
        assert not kind.narrow or kind.float_bits == 16
        if kind.partial_of is not None:  # a part of a quantized precision, calibrated as it is
            whole = kinds.of(kind.partial_of)
            assert kind.quantized and whole.quantized and whole.partial_of is None
            assert kind.calibrated == whole.calibrated
        if kind.config is not None:  # an auto candidate built as a config precision with per-call ranges
            assert kind.config in kinds.CONFIG_NAMES and kind.quantized and not kind.calibrated
        assert bool(kind.native_flags) == bool(kind.not_native)
        assert not kind.emulated or kind.native_flags
    assert kinds.partial("int8") == "mixed" and kinds.partial_of("mixed") == "int8"
    assert kinds.dynamic_variant("int8") == "int8_dynamic" and kinds.config_name("int8_dynamic") == "int8"
    assert kinds.build_name("int8", True) == "int8_dynamic" and kinds.build_name("mixed", False) == "mixed"
    assert [p for p in kinds.CONFIG_NAMES if kinds.calibrated(p)] == ["fp16", "int8", "mixed"]
    assert [p for p in kinds.CONFIG_NAMES if kinds.quantized(p)] == ["int8", "mixed"]
    assert kinds.ran_partly("int8", "mixed") and not kinds.ran_partly("fp32", "mixed")
    assert kinds.with_partial("mixed") == kinds.with_partial("int8") == ["int8", "mixed"]
    assert kinds.with_partial("fp16") == ["fp16"]


def test_a_name_outside_the_table_has_no_facts():
    for name in (kinds.AUTO, "", "fp64"):
        assert not (kinds.quantized(name) or kinds.calibrated(name) or kinds.half(name) or kinds.reduced(name))
        assert kinds.partial(name) is None and kinds.native(name, [])


@pytest.mark.parametrize("counts, ran", [
    ({"int8": 4}, "int8"), ({"int8": 3, "fp32": 1}, "mixed"), ({"fp16": 2, "fp32": 1}, None),
    ({"int8": 0, "fp32": 2}, None), ({}, None)])
def test_what_ran_from_op_counts(counts, ran):
    assert kinds.from_op_counts(counts) == ran


def test_dynamic_ranges_only_where_a_dynamic_variant_exists():
    from pipeline.config.schemas import ActivationRanges

    dynamic = {name: PrecisionConfig(name=Precision(name), activation_ranges=ActivationRanges.dynamic).dynamic_ranges
               for name in kinds.CONFIG_NAMES}
    assert dynamic == {name: name == "int8" for name in kinds.CONFIG_NAMES}


def test_a_new_precision_needs_one_entry(monkeypatch):
    """An entry is all the facts stages ask: a new quantized precision is quantized,
    calibrated, listed and ordered without touching any other module."""
    added = kinds.Kind("int4", fidelity=6, quantized=True, calibrated=True, keeps_float=True)
    monkeypatch.setitem(kinds.KINDS, "int4", added)
    assert kinds.quantized("int4") and kinds.calibrated("int4") and kinds.reduced("int4")
    assert kinds.from_op_counts({"int4": 2, "fp32": 1}) == "int4"  # no partial declared: itself
    assert not kinds.half("int4") and kinds.partial("int4") is None and kinds.with_partial("int4") == ["int4"]


def _precision_strings(node: ast.AST) -> set:
    return {n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and n.value in kinds.KINDS}


def _elements_named(node: ast.AST) -> set:
    return {e.value for e in node.elts if isinstance(e, ast.Constant) and e.value in kinds.KINDS}


def _is_quant_type(node: ast.AST) -> bool:
    """``activations`` is precision.activations, a QuantType (int8 | uint8): comparing it
    with "int8" asks for signed activations, not for a precision (pipeline/precision/quantize.py)."""
    name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else None
    return name == "activations"


def _names_precision_kind(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Attribute) and n.attr == "kind" and isinstance(n.value, ast.Attribute)
               and n.value.attr == "precision" for n in ast.walk(node))


def _text_comparisons(source: str) -> list:
    """Comparisons and membership tests with a precision name as text, and precision.kind
    compared with any text (precision.kind == "auto")."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        named = _precision_strings(node) and not any(_is_quant_type(side) for side in sides)
        kind_as_text = _names_precision_kind(node) and any(
            isinstance(n, ast.Constant) and isinstance(n.value, str) for side in sides for n in ast.walk(side))
        if named or kind_as_text:
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def _precision_lists(source: str) -> list:
    return [f"{node.lineno}: {ast.unparse(node)}" for node in ast.walk(ast.parse(source))
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and len(_elements_named(node)) > 1]


def test_the_scans_find_what_they_look_for():
    assert len(_text_comparisons('a = p in ("int8", "mixed")\nb = cfg.precision.kind == "auto"\n'
                                 'c = q == "fp32"\nd = settings.activations == "int8"\ne = x["int8"]')) == 3
    assert len(_precision_lists('ORDER = ("fp32", "fp16")\nKEYS = (get("int8"), get("mixed"))')) == 1


def test_no_module_compares_a_precision_name_as_text():
    """Comparisons, membership tests and orderings of precision names are kinds' (its
    predicates, REFERENCE, AUTO); names may stay as dictionary keys, report fields,
    declarations (a backend's CAPABILITIES) and message text."""
    found = {str(path.relative_to(ROOT)): _text_comparisons(path.read_text())
             for path in SOURCES if path != KINDS_MODULE}
    assert not {path: lines for path, lines in found.items() if lines}


def test_no_module_lists_precisions_of_its_own():
    """A tuple, list or set of precision names is an order or a fact kinds holds (the
    sweep's order, auto's fidelity, "builds that exist to be faster"); only a backend
    declares the ones it builds (pipeline/backends/, its CAPABILITIES)."""
    found = {str(path.relative_to(ROOT)): _precision_lists(path.read_text())
             for path in SOURCES if path != KINDS_MODULE and "backends" not in path.relative_to(ROOT).parts}
    assert not {path: lines for path, lines in found.items() if lines}


def test_the_quant_type_exception_is_only_the_quant_type():
    assert {t.value for t in QuantType} & set(kinds.KINDS) == {"int8"}
