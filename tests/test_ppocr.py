"""A real model: the PP-OCR text-direction classifier from the rapidocr-onnxruntime wheel,
fed rendered text lines rotated 0 or 180 degrees, configured from a user config directory
(--config-dir) as a user would."""

from __future__ import annotations

import functools
import json

import pytest

from conftest import read_report
from side_by_side import (NO_DIAGNOSIS, SIDE_BY_SIDE_ENV, Jobs, job_output, new_run, run_sweep,
                          selected, stages)
from textlines import NEEDS_FONTS_SKIPPED, write_ppocr_configs

VALIDATION = 24
CPU_TARGETS = ["ort_cpu", "openvino_cpu", "ncnn_cpu", "ncnn_vulkan", "mnn_cpu"]
INT8_TARGETS = ["ort_cpu", "openvino_cpu"]

pytestmark = pytest.mark.skipif(NEEDS_FONTS_SKIPPED, reason="needs Debian's fonts-dejavu-core (installed by .ci/run)")


@pytest.fixture(scope="module")
def user_configs(tmp_path_factory):
    """A config directory with the user's own model and data options, and the data."""
    root = tmp_path_factory.mktemp("ppocr")
    write_ppocr_configs(root, calibration=32, validation=VALIDATION, calibration_size=4)
    return root


def ppocr_args(user_configs, *overrides, sweep=False) -> list:
    return ["--config-dir", user_configs / "conf", *(["-m"] if sweep else []), "model=ppocr_cls", "data=textlines",
            *overrides]


@pytest.fixture(scope="module")
def ppocr_jobs(request, user_configs):
    """The module's jobs, each in its own folder, submitted up front and run side by side."""
    jobs = Jobs()

    def folder(name):
        (user_configs / "jobs" / name).mkdir(parents=True)
        return user_configs / "jobs" / name

    if selected(request, "test_fp32_passes_with_top1_reported",
                "test_fp32_sweep_over_every_cpu_runtime_agrees_with_the_reference"):
        args = ppocr_args(user_configs, "precision=fp32", f"target={','.join(CPU_TARGETS)}",
                          sweep=True)
        jobs.submit("fp32", functools.partial(run_sweep, args, folder("fp32"), timeout=600, env=SIDE_BY_SIDE_ENV))
    if selected(request, "test_int8_auto_calibration_keeps_accuracy"):
        args = ppocr_args(user_configs, "precision=int8", "calibration=auto", "data.calibration_size=32",
                          f"target={','.join(INT8_TARGETS)}", stages("convert", "calibrate", "build", "verify"),
                          sweep=True)
        jobs.submit("int8", functools.partial(run_sweep, args, folder("int8"), timeout=600, env=SIDE_BY_SIDE_ENV))
    if selected(request, "test_openvino_bf16_reports_what_ran"):
        # 24 images: one changed prediction is 4.17 points, so the top-1 gate is loosened here
        # and the precision check (exit 4 on a fallback) is what this test is about
        args = ppocr_args(user_configs, "target=openvino_cpu", "precision=bf16", "validation.max_metric_drop=0.1",
                          stages("convert", "calibrate", "build", "verify"), *NO_DIAGNOSIS)
        jobs.submit("bf16", functools.partial(new_run, args, folder("bf16"), env=SIDE_BY_SIDE_ENV))
    yield jobs
    jobs.close()


@pytest.fixture(scope="module")
def fp32_sweep(ppocr_jobs):
    """One sweep over the five CPU runtimes at fp32 on every validation line: the fp32 job
    of each target, read by the tests below: (completed process, {target: job folder})."""
    result, sweep = ppocr_jobs["fp32"]
    return result, {target: next(sweep.glob(f"*target={target}")) for target in CPU_TARGETS}


@pytest.mark.parametrize("target", ["ort_cpu", "openvino_cpu"])
def test_fp32_passes_with_top1_reported(fp32_sweep, target):
    result, jobs = fp32_sweep
    assert result.returncode == 0, result.stdout + result.stderr
    run_dir = jobs[target]
    report = read_report(run_dir)
    assert report["verdict"] == "pass"
    convert = report["convert"]
    assert convert["opset"] == {"from": 11, "to": 13}
    assert convert["fixed_shapes"]["x"]["to"] == [1, 3, 48, 192]
    assert convert["inputs"][0]["shape"] == [1, 3, 48, 192]
    verify = report["verify"]
    assert verify["samples"] == VALIDATION
    assert verify["effective"]["precision"] == "fp32"
    (output,) = verify["outputs"]
    assert output["metrics"]["cosine"] > 0.9999
    task = verify["task"]
    assert task["samples"] == VALIDATION
    assert task["target"] >= 0.75, task  # rendered text lines are easy for the real classifier
    assert task["agreement"] == 1.0
    assert "top-1: reference" in job_output(result.stdout, f"target={target}")
    bundle = run_dir / "bundle" / f"ppocr_cls-{target}-fp32"
    runtime = (bundle / "runtime.yaml").read_text()
    assert "keep_aspect: true" in runtime  # a loader learns the preprocessing from the bundle
    assert_profile_names_every_conv(run_dir)
    assert report["profile"]["ran"] and report["profile"]["top"][0]["ms"] > 0


def assert_profile_names_every_conv(run_dir):
    """The profile lists the model's layers by ONNX name: each of the classifier's 53 Conv
    nodes (names such as Conv@12, of the converted model) is the node of exactly one layer."""
    import json

    import onnx

    model = onnx.load(str(run_dir / "stages" / "convert" / "model.onnx"))
    names = {node.name or f"{node.op_type}_{position}" for position, node in enumerate(model.graph.node)}
    convs = sorted(node.name for node in model.graph.node if node.op_type == "Conv")
    profile = json.loads((run_dir / "stages" / "profile" / "profile.json").read_text())
    primaries = [layer["onnx_node"] for layer in profile["layers"] if layer["onnx_node"]]
    assert len(convs) == 53 and sorted(node for node in primaries if node in convs) == convs, profile["measured_by"]
    assert set(primaries) <= names, sorted(set(primaries) - names)


def test_openvino_bf16_reports_what_ran(ppocr_jobs):
    """With a bf16 hint the report states the precision that really ran: bf16 on CPUs that
    have it natively, otherwise a failed verdict (exit 4) naming the fallback."""
    import openvino as ov

    native_bf16 = "BF16" in ov.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")
    result, run_dir = ppocr_jobs["bf16"]
    verify = read_report(run_dir)["verify"]
    assert verify["requested"]["precision"] == "bf16"
    if native_bf16:
        assert verify["effective"]["precision"] == "bf16"
        assert verify["outputs"][0]["metrics"]["cosine"] >= 0.999
        assert result.returncode == 0, result.stdout + result.stderr
    else:
        assert verify["effective"]["precision"] == "fp32"
        assert result.returncode == 4
        assert "requested precision bf16 but fp32 ran" in result.stdout


@pytest.fixture(scope="module")
def int8_sweep(ppocr_jobs):
    """int8 with calibration=auto on 32 lines, ONNX Runtime and OpenVINO in one sweep (one
    calibration): (sweep.json's jobs by target, {target: job folder}, completed process)."""
    result, sweep = ppocr_jobs["int8"]
    summary = json.loads((sweep / "sweep.json").read_text())
    assert len(summary["jobs"]) == len(INT8_TARGETS), result.stdout + result.stderr
    return ({job["target"]: job for job in summary["jobs"]},
            {target: next(sweep.glob(f"*target={target}")) for target in INT8_TARGETS}, result)


@pytest.mark.parametrize("target", ["ort_cpu", "openvino_cpu"])
def test_int8_auto_calibration_keeps_accuracy(int8_sweep, target):
    jobs, folders, result = int8_sweep
    run_dir = folders[target]
    report = read_report(run_dir)
    calibration = report["calibration"]
    assert calibration["tensors"] > 100 and calibration["batch_size"] > 1  # the batch-1 Reshape was freed
    verify = report["verify"]
    assert verify["effective"]["precision"] == "int8", verify["effective"]
    assert verify["outputs"][0]["metrics"]["cosine"] > 0.95  # 400-image figures: benchmarks/calibration.py
    assert verify["task"]["agreement"] >= 0.8
    assert jobs[target]["exit_code"] in (0, 3), result.stdout + result.stderr  # 24 images: one flip is 4 points


def test_fp32_sweep_over_every_cpu_runtime_agrees_with_the_reference(fp32_sweep):
    """One sweep over the five runtimes at fp32: every backend agrees with the reference
    within the default thresholds (ncnn's CPU kernels differ by ~1e-6..1e-3 max abs), and
    every job's report says what ran."""
    targets = CPU_TARGETS
    result, jobs = fp32_sweep
    assert result.returncode == 0, result.stdout + result.stderr
    reports = {target: read_report(jobs[target]) for target in targets}
    for target, report in reports.items():
        verify = report["verify"]
        assert report["verdict"] == "pass", (target, verify.get("reasons"))
        assert verify["effective"]["precision"] == "fp32", target
        (output,) = verify["outputs"]
        assert output["metrics"]["cosine"] > 0.9999 and output["metrics"]["max_abs"] < 1e-2, (target, output)
        assert verify["task"]["agreement"] == 1.0, target
    assert reports["ncnn_vulkan"]["verify"]["effective"]["device"].startswith("VULKAN"), reports["ncnn_vulkan"]["verify"]["effective"]
    for target in targets:
        assert_profile_names_every_conv(jobs[target])
