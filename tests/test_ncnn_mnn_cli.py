"""ncnn and MNN targets as users run them: fp32 on every CPU target and on ncnn Vulkan,
the seed case (fp16 overflow on Vulkan fixed by per-layer feature masks), MNN's silent
GPU fallback caught, and a missing optional backend that does not stop a sweep."""

from __future__ import annotations

import os
import sys

import pytest

from conftest import read_report, run_cli, run_dirs, single_bundle
from ncnn_helpers import NO_VULKAN, has_vulkan
from overflow_model import build as build_overflow_model


# without a device: skipped locally, run (and failing) in CI, which installs lavapipe
needs_vulkan = pytest.mark.skipif(not has_vulkan() and not os.environ.get("CI"), reason=NO_VULKAN)


def last_run(cwd):
    return run_dirs(cwd)[-1]


@pytest.mark.parametrize("target, device", [("ncnn_cpu", "CPU"), pytest.param("ncnn_vulkan", "VULKAN",
                                                                               marks=needs_vulkan),
                                            ("mnn_cpu", "CPU")])
def test_default_model_passes_at_fp32(tmp_path, target, device):
    result = run_cli([f"target={target}", "precision=fp32"], tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    report = read_report(last_run(tmp_path))
    assert report["verify"]["effective"]["device"] == device
    assert report["verify"]["effective"]["precision"] == "fp32"
    assert report["verify"]["outputs"][0]["metrics"]["cosine"] > 0.9999
    assert report["verify"]["task"]["agreement"] >= 0.99


def test_mnn_gpu_request_that_runs_on_the_cpu_is_caught(tmp_path):
    result = run_cli(["target=mnn_opencl", "precision=fp32"], tmp_path)
    assert result.returncode == 4, result.stdout + result.stderr
    report = read_report(last_run(tmp_path))
    (reason,) = report["reasons"]
    assert reason.startswith("requested device OPENCL but CPU ran: this MNN build") and "no OPENCL backend" in reason
    assert report["verify"]["effective"]["device"] == "CPU"


def test_ncnn_vulkan_without_a_device_is_exit_4_naming_the_driver(tmp_path):
    missing = str(tmp_path / "no-driver.json")  # the Vulkan loader finds no ICD
    result = run_cli(["target=ncnn_vulkan", "precision=fp32"], tmp_path, env={"VK_ICD_FILENAMES": missing, "VK_DRIVER_FILES": missing})
    assert result.returncode == 4, result.stdout + result.stderr
    report = read_report(last_run(tmp_path))
    assert report["reasons"] == ["requested device VULKAN but CPU ran: no Vulkan device: install libvulkan1 and a "
                                 "driver such as mesa-vulkan-drivers"]


@pytest.fixture(scope="module")
def overflow_args(tmp_path_factory):
    root = tmp_path_factory.mktemp("seed")
    model = build_overflow_model(root / "overflow.onnx")
    return root, [f"model.path={model}", "data=random", "data.high=4.0", "data.calibration_size=8",
                  "data.validation_size=8", "target=ncnn_vulkan", "precision=fp16"]


@needs_vulkan
def test_seed_case_plain_fp16_build_overflows_at_the_reduction(overflow_args):
    root, args = overflow_args
    result = run_cli([*args, "target.ncnn.auto_masks=false"], root)
    assert result.returncode == 3, result.stdout + result.stderr
    report = read_report(last_run(root))
    output = report["verify"]["outputs"][0]
    assert output["metrics"]["inf"] > 0
    layers = report["verify"]["layerwise"]
    assert layers["ran"] and layers["nan_origin"]["op"] == "reduce"
    advice = [a for a in report["verify"]["recommendations"] if a["kind"] == "fp16_overflow"]
    assert advice and advice[0]["action"]["keep_float"] == ["reduce", "sqrt"]


@needs_vulkan
def test_seed_case_auto_masks_fix_exactly_the_reduction_and_its_consumer(overflow_args):
    root, args = overflow_args
    result = run_cli(args, root)
    assert result.returncode == 0, result.stdout + result.stderr
    run_dir = last_run(root)
    report = read_report(run_dir)
    masks = report["build"]["quantization"]["feature_masks"]
    assert masks["searched"] and masks["passed"]
    assert sorted(m["onnx_op"] for m in masks["masks"]) == ["reduce", "sqrt"]
    assert all(m["mask"] == 16 and m["runs"].startswith("CPU") for m in masks["masks"])
    assert report["verify"]["outputs"][0]["metrics"]["inf"] == 0
    param = next(p for p in single_bundle(run_dir).iterdir() if p.suffix == ".param")
    assert param.read_text().count("31=16") == 2
    markdown = (run_dir / "report.md").read_text()
    assert "ncnn feature masks" in markdown and "2 layer(s) masked" in markdown
    assert "| sqrt" in markdown or "sqrt |" in markdown


def test_missing_optional_backend_is_exit_4_and_the_sweep_goes_on(tmp_path):
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "ncnn.py").write_text("raise ImportError('No module named ncnn (hidden by the test)')\n")
    env_path = os.pathsep.join([str(hide), os.environ.get("PYTHONPATH", "")])
    result = run_cli(["-m", "target=ncnn_cpu,ort_cpu", "precision=fp32"], tmp_path, env={"PYTHONPATH": env_path})
    assert result.returncode == 4, result.stdout + result.stderr
    assert "pip install 'parity[ncnn]'" in result.stderr
    reports = [read_report(p.parent) for p in (tmp_path / "multirun").rglob("report.json")
               if "bundle" not in p.relative_to(tmp_path).parts]
    assert [r["target"]["name"] for r in reports if r["verdict"] == "pass"] == ["ort_cpu"]
