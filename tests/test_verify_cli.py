"""verify as users run it: layerwise evidence, a deliberately broken layer named as the
culprit, crashes and hangs as verdicts, JUnit XML, report.json against its JSON Schema,
and a verdict reproduced from the bundle."""

from __future__ import annotations

import gzip
import json
import shutil
import xml.etree.ElementTree as ET
from pathlib import Path

import jsonschema
import pytest

from conftest import REPO, read_report, run_cli, run_dirs, single_bundle

SCHEMA = json.loads((REPO / "docs" / "report.schema.json").read_text())


def assert_valid_report(report: dict) -> None:
    jsonschema.Draft202012Validator.check_schema(SCHEMA)
    jsonschema.validate(report, SCHEMA, cls=jsonschema.Draft202012Validator)


def last_run(cwd: Path) -> Path:
    return run_dirs(cwd)[-1]


def run_with_valid_report(args, cwd: Path, returncode: int):
    """`parity ARGS` that must exit with ``returncode`` and write a report.json valid against
    the schema: (completed process, run folder, report)."""
    result = run_cli(args, cwd)
    assert result.returncode == returncode, result.stdout + result.stderr
    run_dir = last_run(cwd)
    report = read_report(run_dir)
    assert_valid_report(report)
    return result, run_dir, report


def test_default_report_validates_against_the_schema(default_run):
    _, run_dir, _ = default_run
    report = read_report(run_dir)
    assert report["schema_version"] == 1
    assert_valid_report(report)
    assert report["verify"]["layerwise"] == {"mode": "on_fail", "ran": False,
                                             "reason": "the verdict passed (validation.layerwise=on_fail)"}
    broken = json.loads(json.dumps(report))
    broken["verify"]["crash"] = {"kind": "exploded"}
    with pytest.raises(jsonschema.ValidationError):
        assert_valid_report(broken)


def test_layerwise_always_compares_every_tensor_and_writes_the_side_file(tmp_path):
    result, run_dir, report = run_with_valid_report(["validation.layerwise=always"], tmp_path, returncode=0)
    layers = report["verify"]["layerwise"]
    assert layers["ran"] and layers["samples"] == 30
    assert layers["compared"] >= 5 and layers["first_divergence"] is None and layers["nan_origin"] is None
    # relu4 is folded into fc1's int8 output on ONNX Runtime (a pass-through op): fc1_out or relu4_out
    assert {row["tensor"] for row in layers["depth"]} >= {"logits"}
    assert {row["tensor"] for row in layers["depth"]} & {"relu4_out", "fc1_out"}
    side = run_dir / "stages" / "verify" / layers["side_file"]
    document = json.loads(gzip.decompress(side.read_bytes()))
    assert len(document["tensors"]) == layers["compared"]
    assert "layerwise: " in result.stdout and "tensors compared" in result.stdout


def test_junit_xml_has_a_case_per_output_threshold(default_run):
    _, run_dir, _ = default_run
    suite = ET.parse(run_dir / "junit.xml").getroot().find("testsuite")
    names = [case.get("name") for case in suite.iter("testcase")]
    assert any(name.startswith("logits: min_cosine") for name in names)
    assert suite.get("failures") == "0" and suite.get("errors") == "0" and int(suite.get("tests")) >= 4


@pytest.fixture(scope="module")
def broken_table(tmp_path_factory):
    """The digits int8 calibration table with relu1_out's threshold (conv2's input) at 1 % of its value."""
    root = tmp_path_factory.mktemp("broken")
    result = run_cli(["precision=int8"], root)
    assert result.returncode == 0, result.stdout + result.stderr
    table = last_run(root) / "stages" / "calibrate" / "calibration_table.txt"
    lines = []
    for line in table.read_text().splitlines():
        fields = line.split()
        if fields and fields[0] == "relu1_out":
            fields[1] = repr(float(fields[1]) * 0.01)
        lines.append(" ".join(fields))
    broken = root / "broken_table.txt"
    broken.write_text("\n".join(lines) + "\n")
    assert broken.read_text() != table.read_text()
    return root, broken


@pytest.mark.parametrize("target", ["ort_cpu", "openvino_cpu"])
def test_a_clipped_int8_threshold_is_named_as_the_first_divergence(broken_table, target):
    root, table = broken_table
    result, _, report = run_with_valid_report(["precision=int8", f"target={target}", f"calibration.table={table}",
                                               "validation.diagnosis_min_seconds=60"],
                                              root, returncode=3)
    layers = report["verify"]["layerwise"]
    assert layers["ran"] and layers["reason"] == "the verdict failed"
    culprit = layers["first_divergence"]
    # on ONNX Runtime relu1 is a pass-through op: its clipped range is the Q right after conv1,
    # which the Relu is folded into (docs/calibration.md, "Pass-through ops")
    tensor, op = ("conv1_out", "conv1") if target == "ort_cpu" else ("relu1_out", "relu1")
    assert culprit["tensor"] == tensor and culprit["op"] == op, culprit
    assert all(i["cosine"] >= layers["threshold"] for i in culprit["inputs"])
    # relu1 is not quantized: the advice ranked its quantized producer and conv2, which quantizes
    # relu1_out where it reads it, on the reference runtime (with the ops after them where those
    # diverge too), and confirmed the best on the target; every printed recommendation was
    # built and measured
    screened = [s["keep_float"] for s in report["verify"]["diagnosis"]["screened"]]
    assert any({"conv1", "conv2"} <= set(ops) for ops in screened), screened
    tried = report["verify"]["advice_tried"]
    assert tried[0]["keep_float"] == screened[0] and tried[0]["passed"]
    advice = report["verify"]["recommendations"]
    assert advice and all(a["tried"] and a["measured"]["passed"] for a in advice)
    assert "conv2" in advice[0]["action"]["keep_float"] and "relu1" not in advice[0]["action"]["keep_float"]
    assert f"-> cosine {advice[0]['measured']['cosine']:.6f} (pass" in advice[0]["text"]
    assert advice[0]["text"] in result.stdout
    assert f"first divergence: op {op}" in result.stdout


def test_a_backend_that_runs_out_of_memory_is_a_crash_verdict_and_the_run_goes_on(tmp_path):
    result, run_dir, report = run_with_valid_report(["validation.worker_memory_mb=64"], tmp_path, returncode=4)
    crash = report["verify"]["crash"]
    assert crash["kind"] in ("crashed", "memory", "error")
    assert report["verdict"] == "fail" and report["reasons"][0].startswith("backend crashed")
    assert (run_dir / "report.html").is_file() and single_bundle(run_dir).is_dir()  # the rest of the run went on
    suite = ET.parse(run_dir / "junit.xml").getroot().find("testsuite")
    assert suite.get("errors") == "1"
    assert "Traceback" not in result.stderr


def test_a_backend_that_does_not_answer_is_a_hang_verdict(tmp_path):
    # 1 ms: no worker forks, loads its runtime and a model in that (a fast machine answered within 50 ms)
    result = run_cli(["validation.worker_timeout_s=0.001"], tmp_path, shared_cache=False)
    assert result.returncode == 4, result.stdout + result.stderr
    report = read_report(last_run(tmp_path))
    assert report["verify"]["crash"]["kind"] == "hung"
    assert report["reasons"][0].startswith("backend hung")
    # a crashed or hung verify is never cached: the next run tries again and passes
    again = run_cli([], tmp_path, shared_cache=False)
    assert again.returncode == 0, again.stdout + again.stderr
    statuses = {s["stage"]: s["status"] for s in read_report(last_run(tmp_path))["stages"]}
    assert statuses["verify"] == "computed"


def test_bundle_check_reproduces_the_verdict_from_recorded_inputs(default_run, tmp_path):
    _, run_dir, _ = default_run
    bundle = shutil.copytree(single_bundle(run_dir), tmp_path / "bundle")
    result = run_cli(["check", bundle], tmp_path, program="parity-bundle")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "verdict: PASS (exit 0; packaged verdict: pass, exit 0)" in result.stdout
    (bundle / "reproduce.npz").write_bytes((bundle / "reproduce.npz").read_bytes()[:-10])
    tampered = run_cli(["check", bundle], tmp_path, program="parity-bundle")
    assert tampered.returncode == 2 and "reproduce.npz" in tampered.stderr


def test_applying_the_recommendation_fixes_the_broken_layer(broken_table):
    root, table = broken_table
    # the clipped relu1_out is conv2's input and, on ONNX Runtime, conv1's output (relu1 is
    # folded into conv1's Q as a pass-through op): both in float, as the advice screens them
    result = run_cli(["precision=int8", f"calibration.table={table}", "precision.keep_float=[conv1,conv2]"], root)
    assert result.returncode == 0, result.stdout + result.stderr
    report = read_report(last_run(root))
    assert {"conv1", "conv2"} <= set(report["build"]["quantization"]["float_ops"])
    # the pass-through ops beside them are float too (float_neighbours; pool1 reads conv3's int8
    # output), and no fallback to warn of
    assert report["build"]["quantization"]["passthrough_float"] == ["relu1", "relu2"]
    assert "int8 ran partly" not in result.stdout, result.stdout
    assert report["verify"]["effective"]["precision"] == "mixed"  # int8 with ops kept float is accepted
    not_quantized = run_cli(["precision=int8", f"calibration.table={table}", "precision.keep_float=[relu1]"], root)
    assert not_quantized.returncode == 2
    assert not_quantized.stderr.strip().endswith(
        "precision.keep_float: relu1 is not quantized in this build: quantize_ops=[Conv, ConvTranspose, Gemm, "
        "MatMul]; its quantized producers are conv1 (keep those in float instead)"), not_quantized.stderr
    typo = run_cli(["precision=int8", "precision.keep_float=[relu9]"], root)
    assert typo.returncode == 2 and "precision.keep_float: the model has no op 'relu9'" in typo.stderr


def test_openvino_without_a_precision_hint_is_caught_when_it_falls_back(tmp_path):
    """OpenVINO's CPU plugin runs bf16 by default on CPUs with native bf16 (shared/findings.md);
    requested fp32 without the hint must then fail the verdict. Elsewhere fp32 runs and passes."""
    import openvino as ov

    from pipeline.backends import openvino as ov_backend
    from pipeline.worker import BackendWorker
    from pipeline.verification.verdict import judge

    model = REPO / "pipeline" / "assets" / "digits_cnn.onnx"
    ov_backend.convert(model, tmp_path)
    with BackendWorker("pipeline.backends.openvino", tmp_path, {"model": "model.xml", "options": {}},
                       label="openvino without a hint", timeout_s=120) as worker:
        effective = worker.effective()
    requested = {"device": "CPU", "precision": "fp32", "accepted_precisions": ["fp32"]}
    _, reasons, code = judge([{"name": "logits", "failures": []}], [], None, requested, effective, 1, None)
    native_bf16 = "BF16" in ov.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")
    if native_bf16:
        assert effective["precision"] == "bf16" and code == 4
        assert reasons == ["requested precision fp32 but bf16 ran"]
    else:
        assert effective["precision"] == "fp32" and code == 0 and reasons == []


@pytest.mark.parametrize("outputs, missing, samples, expected", [
    ([], ["logits"], 10, ["output logits was not produced by the target", "no outputs were compared"]),
    ([], [], 0, ["no validation samples were compared", "no outputs were compared"]),
])
def test_a_verdict_never_passes_on_nothing(outputs, missing, samples, expected):
    from pipeline.verification.verdict import judge

    requested = {"device": "CPU", "precision": "fp32", "accepted_precisions": ["fp32"]}
    _, reasons, code = judge(outputs, missing, None, requested, {"device": "CPU", "precision": "fp32"}, samples, None)
    assert reasons == expected and code == 3


def test_a_mixed_build_left_with_no_int8_op_fails_on_that_not_as_a_fallback(tmp_path):
    """An unreachable target makes the search keep every quantized op float: fp32 runs as
    built, so the verdict is the thresholds' (exit 3), not a runtime's precision fallback."""
    result = run_cli(["precision=mixed", "validation.min_cosine=0.9999999", "validation.task_min_cosine=null",
                      "pipeline.stages=[convert,calibrate,sensitivity,build,verify]"], tmp_path)
    assert result.returncode == 3, result.stdout + result.stderr
    report = read_report(run_dirs(tmp_path)[-1])
    assert report["build"]["quantization"]["int8_ops"] == 0
    checks = {c["check"]: c for c in report["verify"]["checks"]}
    assert "precision" not in checks and checks["nothing_int8"]["severity"] == "fail"
    assert "kept all 5 quantized ops in float" in checks["nothing_int8"]["text"]


def test_an_int8_build_with_every_op_kept_float_says_why_it_runs_fp32(tmp_path):
    result = run_cli(["precision=int8", "precision.keep_float=[conv1,conv2,conv3,fc1,fc2]",
                      "pipeline.stages=[convert,calibrate,build,verify]"], tmp_path)
    assert result.returncode == 3, result.stdout + result.stderr
    checks = {c["check"]: c for c in read_report(run_dirs(tmp_path)[-1])["verify"]["checks"]}
    assert "precision" not in checks
    assert "precision int8: precision.keep_float and the backend keep all 5" in checks["nothing_int8"]["text"]


def test_nothing_int8_names_the_cause_for_each_way_a_build_ends_fp32():
    """Which line a build left with no int8 op gets: the search's, int8_where_faster's or
    keep_float's (stages.verify._nothing_int8 reads the build summary)."""
    from types import SimpleNamespace

    from stages.results import BuildSummary
    from stages.verify import _nothing_int8

    def line(kind, quantization):
        summary = BuildSummary.from_json({"quantization": quantization})
        ctx = SimpleNamespace(results={"build": SimpleNamespace(summary=summary)},
                              cfg=SimpleNamespace(precision=SimpleNamespace(kind=kind)))
        return _nothing_int8(ctx).get("nothing_int8")

    ended = {"int8_ops": 0, "float_ops": ["a", "b"]}
    assert "ship fp32" in line("int8", {**ended, "slower_in_int8": {"ops": ["a", "b"]}})
    assert "sensitivity search kept all 2" in line("mixed", {**ended, "slower_in_int8": {"ops": []}})
    assert "keep_float and the backend keep all 2" in line("int8", ended)
    assert line("int8", {"int8_ops": 1, "float_ops": ["a"]}) is None and line("fp32", ended) is None
