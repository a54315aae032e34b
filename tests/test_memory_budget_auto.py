"""precision=auto under validation.max_memory_mb (issue 39): a build over the budget fails its
verdict, auto tries it with target.memory=low before giving up on it, and what ships fits.

The model carries a 16 MB fp32 weight (4 MB in int8), so the fp32 and int8 builds' peaks
lie far enough apart for a budget between them (ONNX Runtime: about 35 MB); the peaks are
read from a first run, as a user would read them from the report. The runs go side by side
(tests/side_by_side.py): memory figures do not depend on the machine's load."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from conftest import read_report, run_cli, run_dirs
from side_by_side import Jobs

AUTO = ["precision=auto", "precision.candidates=[fp32,int8]", "target=ort_cpu", "target.threads=1",
        "data=random", "data.calibration_size=8", "data.validation_size=8", "metric=none",
        "validation.timing_max_seconds=1", "precision.weight_rounding=false", "precision.bias_correction=false",
        "pipeline.stages=[convert,calibrate,sensitivity,build,verify]"]
BELOW_ANY_RUNTIME_MB = 20  # the interpreter and ONNX Runtime alone take more


def wide_model(path):
    """y = relu(x @ W), W [512, 8192] fp32 (16 MB)."""
    weight = np.random.default_rng(0).normal(scale=0.05, size=(512, 8192)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["h"], name="wide"), helper.make_node("Relu", ["h"], ["y"])],
        "wide", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 512])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8192])], [numpy_helper.from_array(weight, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(model, str(path))
    return path


def auto_run(tmp_path, name, *extra):
    cwd = tmp_path / name
    cwd.mkdir()
    result = run_cli([f"model.path={tmp_path / 'wide.onnx'}", *AUTO, *extra], cwd, default_precision=None)
    return result, read_report(run_dirs(cwd)[-1]), run_dirs(cwd)[-1]


@pytest.fixture(scope="module")
def budget_jobs(tmp_path_factory):
    """The run without a budget and the one below every build side by side, then the one
    with a budget between the first run's int8 and fp32 peaks."""
    tmp_path = tmp_path_factory.mktemp("budget")
    wide_model(tmp_path / "wide.onnx")
    jobs = Jobs()
    jobs.submit("free", lambda: auto_run(tmp_path, "free"))
    jobs.submit("below", lambda: auto_run(tmp_path, "below", f"validation.max_memory_mb={BELOW_ANY_RUNTIME_MB}"))

    def between():
        memory = jobs["free"][1]["verify"]["memory"]
        budget = round((memory["peak_mb"] + memory["fp32"]["peak_mb"]) / 2)
        return budget, auto_run(tmp_path, "between", f"validation.max_memory_mb={budget}")

    jobs.submit("between", between, after="free")
    return jobs


def test_a_budget_between_the_peaks_ships_the_build_that_fits(budget_jobs):
    result, report, _ = budget_jobs["free"]
    assert result.returncode == 0, result.stdout + result.stderr
    memory = report["verify"]["memory"]
    assert report["auto"]["chosen"] == "int8" and memory["fp32"]["peak_mb"] - memory["peak_mb"] > 10, memory
    budget, (result, report, _) = budget_jobs["between"]
    assert result.returncode == 0, result.stdout + result.stderr
    assert report["auto"]["chosen"] == "int8" and report["verify"]["memory"]["peak_mb"] <= budget < \
        memory["fp32"]["peak_mb"]


def test_over_every_budget_auto_tries_memory_low_then_fails_naming_peak_and_budget(budget_jobs):
    result, report, run_dir = budget_jobs["below"]
    assert result.returncode == 3, result.stdout + result.stderr
    rows = {row["precision"]: row for row in report["auto"]["candidates"]}
    assert rows["int8"]["verdict"] == "fail" and rows["int8"]["target_memory"] == "low"
    assert (run_dir / "candidates" / "int8-memory-low" / "stages" / "verify").is_dir()
    assert (run_dir / "candidates" / "int8" / "stages" / "verify").is_dir()  # default first
    memory_reasons = [r for r in report["verify"]["reasons"] if "max_memory_mb" in r]
    assert memory_reasons and f"{BELOW_ANY_RUNTIME_MB} MB" in memory_reasons[0], report["verify"]["reasons"]
