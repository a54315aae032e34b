"""Stages hand each other typed summaries (stages/results.py, issue 47): no module reads
another stage's result by string key, and every summary goes through its JSON (result.json,
the stage cache) unchanged, keys in their order."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from pipeline.app.runner import _from_cache
from pipeline.artifacts import write_json
from stages import StageResult
from stages.results import SHAPES, BuildSummary, Quantization, TuneSummary, VerifySummary, summary_of

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted([*(ROOT / "pipeline").rglob("*.py"), *(ROOT / "stages").rglob("*.py")])
RESULT_ATTRIBUTES = {"summary", "verify"}  # StageResult.summary, RunOutcome.verify


def _string_key_reads(path: Path, root: Path = ROOT):
    """``x.summary["key"]`` and ``x.summary.get("key")`` (and the same on ``.verify``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        target = key = None
        if isinstance(node, ast.Subscript):
            target, key = node.value, node.slice
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" \
                and node.args:
            target, key = node.func.value, node.args[0]
        if isinstance(target, ast.Attribute) and target.attr in RESULT_ATTRIBUTES \
                and isinstance(key, ast.Constant) and isinstance(key.value, str):
            found.append(f"{path.relative_to(root)}:{node.lineno} .{target.attr}[{key.value!r}]")
    return found


def test_no_module_reads_a_stage_result_by_string_key():
    reads = [read for path in SOURCES for read in _string_key_reads(path)]
    assert not reads, reads


def test_the_scan_finds_a_string_key_read(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text('a = ctx.results["build"].summary["bytes"]\nb = outcome.verify.get("verdict")\n'
                      'c = ctx.results["build"].summary.bytes\nd = report["verify"]["verdict"]\n')
    assert _string_key_reads(sample, tmp_path) == ["sample.py:1 .summary['bytes']", "sample.py:2 .verify['verdict']"]


SAMPLES = {
    "convert": {"source": "/m.onnx", "source_sha256": "ab", "opset": {"from": 13, "to": 17},
                "inputs": [{"name": "x", "shape": [1, 3], "dtype": "float32"}],
                "outputs": [{"name": "y", "shape": [1, 2], "dtype": "float32"}], "fixed_shapes": {},
                "preflight": [{"check": "nan_inf", "severity": "info", "tensor": "w", "detail": "-"}],
                "output_shapes": {"mismatches": [{"output": "y", "declared": [1, 2], "returned": [1, 3]}]}},
    "calibrate": {"method": "max", "samples": 8, "warnings": ["few samples"], "auto": {"x": 1.0},
                  "equalization": {"applied": True, "outlier_pairs": [{"rescaled": ["a", "b"]}]}},
    "sensitivity": {"samples": 4, "select": "target", "warning": "not reached", "skipped": None},
    "build": {"backend": "onnxruntime", "files": ["model.onnx"], "options": {}, "bytes": 1234,
              "quantization": {"builder": "qdq", "float_ops": ["Conv_0"], "int8_ops": 3,
                               "weight_rounding": {"enabled": True, "seconds": 1.5},
                               "bias_correction": {"enabled": True, "error": "no", "seconds": 0.5},
                               "keep_float_not_found": ["Gone"]},
              "compile_cache": None, "activation_ranges": "static"},
    "tune": {"ran": True, "level": "normal", "chosen": {"changes": {"threads": 2}, "measurement": {}, "error": None,
                                                        "order": 1, "score_ms": 1.0}, "speedup": 1.2},
    "verify": {"samples": 4, "requested": {}, "outputs": [{"name": "y", "metrics": {"cosine": 0.99}}],
               "task": None, "comparison": {}, "speed": {"warning": "noisy"}, "memory": None,
               "data": {"warnings": ["no labels"]}, "truth": {"warnings": ["far"]}, "verdict": "fail",
               "exit_code": 3, "reasons": ["cosine"],
               "checks": [{"check": "memory", "severity": "fail", "text": "over"},
                          {"check": "precision", "severity": "warning", "text": "partly float"}]},
    "profile": {"backend": "onnxruntime", "ran": False, "reason": "no profiler"},
    "package": {"bundle": "/run/bundle/m", "archive": None, "files": ["manifest.json"], "manifest_sha256": "cd"},
}


@pytest.mark.parametrize("stage", sorted(SHAPES))
def test_each_summary_goes_through_its_json_unchanged(stage):
    data = json.loads(json.dumps(SAMPLES[stage]))
    typed = summary_of(stage, data)
    assert isinstance(typed, SHAPES[stage])
    assert json.dumps(typed.to_json()) == json.dumps(SAMPLES[stage])  # keys in their order, values the same
    assert summary_of(stage, typed.to_json()) == typed


@pytest.mark.parametrize("stage", sorted(SHAPES))
def test_a_summary_served_from_the_stage_cache_is_typed_again(tmp_path, stage):
    entry, out_dir = tmp_path / "entry", tmp_path / "out"
    entry.mkdir()
    result = StageResult(entry, {}, summary_of(stage, SAMPLES[stage]))
    write_json(entry / "result.json", {**result.to_json(), "computed_seconds": 1.0})
    served, seconds = _from_cache(entry, out_dir, stage)
    assert seconds == 1.0 and isinstance(served.summary, SHAPES[stage])
    assert served.summary == result.summary and served.to_json() == result.to_json()


def test_fields_read_across_modules_are_attributes():
    build = summary_of("build", SAMPLES["build"])
    assert isinstance(build.quantization, Quantization) and build.float_ops == ["Conv_0"] and build.bytes == 1234
    assert build.quantization.refined("weight_rounding") and not build.quantization.refined("bias_correction")
    assert build.quantization.refinement_seconds() == 2.0
    assert BuildSummary.from_json({"files": []}).float_ops is None
    assert summary_of("tune", SAMPLES["tune"]).changes == {"threads": 2} and TuneSummary().changes == {}
    verify = summary_of("verify", SAMPLES["verify"])
    assert verify.data_warnings == ["no labels"] and verify.check_warnings == ["partly float", "far"]
    assert verify.speed_warning == "noisy" and verify.failed_check("memory") and not verify.failed_check("accuracy")
    assert VerifySummary().verdict == "unverified"
    convert = summary_of("convert", SAMPLES["convert"])
    assert convert.output_names == ["y"] and convert.shape_mismatches[0]["output"] == "y"
    calibrate = summary_of("calibrate", SAMPLES["calibrate"])
    assert calibrate.rescaled == ["a", "b"] and "auto" not in calibrate.report()
    assert summary_of("package", SAMPLES["package"]).manifest_sha256 == "cd"


def test_a_field_set_after_the_json_is_written_after_its_keys():
    typed = summary_of("profile", {"ran": True})
    typed.reason = "set later"
    assert list(typed.to_json()) == ["ran", "reason"]
