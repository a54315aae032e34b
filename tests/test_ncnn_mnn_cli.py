"""ncnn and MNN targets as users run them: fp32 on every CPU target and on ncnn Vulkan,
the seed case (fp16 overflow on Vulkan fixed by per-layer feature masks), MNN's silent
GPU fallback caught, and a missing optional backend that does not stop a sweep."""

from __future__ import annotations

import os
import sys

import pytest

from conftest import read_report, run_cli, single_bundle
from ncnn_helpers import NO_VULKAN, has_vulkan, searched_masks
from overflow_model import build as build_overflow_model
from side_by_side import PACKAGED, VERIFIED, Jobs, new_run


# without a device: skipped locally, run (and failing) in CI, which installs lavapipe
VULKAN_RUNS = has_vulkan() or bool(os.environ.get("CI"))
needs_vulkan = pytest.mark.skipif(not VULKAN_RUNS, reason=NO_VULKAN)
FP32_TARGETS = [("ncnn_cpu", "CPU"), pytest.param("ncnn_vulkan", "VULKAN", marks=needs_vulkan), ("mnn_cpu", "CPU")]


def seed_args(root):
    model = build_overflow_model(root / "overflow.onnx")
    return [f"model.path={model}", "data=random", "data.high=4.0", "data.calibration_size=8",
            "data.validation_size=8", "target=ncnn_vulkan", "precision=fp16"]


def missing_backend_sweep(cwd):
    hide = cwd / "hide"
    hide.mkdir()
    (hide / "ncnn.py").write_text("raise ImportError('No module named ncnn (hidden by the test)')\n")
    env_path = os.pathsep.join([str(hide), os.environ.get("PYTHONPATH", "")])
    return run_cli(["-m", "target=ncnn_cpu,ort_cpu", "precision=fp32", VERIFIED], cwd,
                   env={"PYTHONPATH": env_path})


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """Every CLI job of this module, each in its own folder, started side by side
    (tests/side_by_side.py); no profile (and no bundle where a test reads none), a short speed
    measure: no test here looks at them."""
    pool = Jobs()

    def job(name, args, env=None):
        cwd = tmp_path_factory.mktemp(name)
        pool.submit(name, lambda: new_run([*args(cwd)], cwd, env=env and env(cwd)))

    if VULKAN_RUNS:  # the longest job first
        job("seed-auto-masks", lambda cwd: [*seed_args(cwd), PACKAGED])
    for target in ("ncnn_cpu", "ncnn_vulkan", "mnn_cpu"):
        if target != "ncnn_vulkan" or VULKAN_RUNS:
            job(f"fp32-{target}", lambda cwd, target=target: [f"target={target}", "precision=fp32", VERIFIED])
    job("mnn-opencl", lambda cwd: ["target=mnn_opencl", "precision=fp32", VERIFIED])
    job("vulkan-without-driver", lambda cwd: ["target=ncnn_vulkan", "precision=fp32", VERIFIED],
        env=lambda cwd: {"VK_ICD_FILENAMES": str(cwd / "no-driver.json"),  # the Vulkan loader finds no ICD
                         "VK_DRIVER_FILES": str(cwd / "no-driver.json")})
    sweep_cwd = tmp_path_factory.mktemp("missing-backend")
    pool.submit("missing-backend", lambda: (missing_backend_sweep(sweep_cwd), sweep_cwd))
    if VULKAN_RUNS:  # last, so not beside the other seed job unless a test asks for it: both keep lavapipe busy
        job("seed-plain", lambda cwd: [*seed_args(cwd), "target.ncnn.auto_masks=false", VERIFIED])
    yield pool
    pool.close()


@pytest.mark.parametrize("target, device", FP32_TARGETS)
def test_default_model_passes_at_fp32(jobs, target, device):
    result, run_dir = jobs[f"fp32-{target}"]
    assert result.returncode == 0, result.stdout + result.stderr
    report = read_report(run_dir)
    assert report["verify"]["effective"]["device"] == device
    assert report["verify"]["effective"]["precision"] == "fp32"
    assert report["verify"]["outputs"][0]["metrics"]["cosine"] > 0.9999
    assert report["verify"]["task"]["agreement"] >= 0.99


def test_mnn_gpu_request_that_runs_on_the_cpu_is_caught(jobs):
    result, run_dir = jobs["mnn-opencl"]
    assert result.returncode == 4, result.stdout + result.stderr
    report = read_report(run_dir)
    (reason,) = report["reasons"]
    assert reason.startswith("requested device OPENCL but CPU ran: this MNN build") and "no OPENCL backend" in reason
    assert report["verify"]["effective"]["device"] == "CPU"


def test_ncnn_vulkan_without_a_device_is_exit_4_naming_the_driver(jobs):
    result, run_dir = jobs["vulkan-without-driver"]
    assert result.returncode == 4, result.stdout + result.stderr
    report = read_report(run_dir)
    assert report["reasons"] == ["requested device VULKAN but CPU ran: no Vulkan device: install libvulkan1 and a "
                                 "driver such as mesa-vulkan-drivers"]


@needs_vulkan
def test_seed_case_plain_fp16_build_overflows_at_the_reduction(jobs):
    result, run_dir = jobs["seed-plain"]  # target.ncnn.auto_masks=false
    assert result.returncode == 3, result.stdout + result.stderr
    report = read_report(run_dir)
    output = report["verify"]["outputs"][0]
    assert output["metrics"]["inf"] > 0
    layers = report["verify"]["layerwise"]
    assert layers["ran"] and layers["nan_origin"]["op"] == "reduce"
    advice = [a for a in report["verify"]["recommendations"] if a["kind"] == "fp16_overflow"]
    assert advice and advice[0]["action"]["keep_float"] == ["reduce", "sqrt"]


@needs_vulkan
def test_seed_case_auto_masks_fix_exactly_the_reduction_and_its_consumer(jobs):
    masks, (_, run_dir) = searched_masks(jobs["seed-auto-masks"]), jobs["seed-auto-masks"]
    report = read_report(run_dir)
    assert sorted(m["onnx_op"] for m in masks["masks"]) == ["reduce", "sqrt"]
    assert all(m["mask"] == 16 and m["runs"].startswith("CPU") for m in masks["masks"])
    assert report["verify"]["outputs"][0]["metrics"]["inf"] == 0
    param = next(p for p in single_bundle(run_dir).iterdir() if p.suffix == ".param")
    assert param.read_text().count("31=16") == 2
    markdown = (run_dir / "report.md").read_text()
    assert "ncnn feature masks" in markdown and "2 layer(s) masked" in markdown
    assert "| sqrt" in markdown or "sqrt |" in markdown


def test_missing_optional_backend_is_exit_4_and_the_sweep_goes_on(jobs):
    result, tmp_path = jobs["missing-backend"]
    assert result.returncode == 4, result.stdout + result.stderr
    assert "pip install 'parity[ncnn]'" in result.stderr
    reports = [read_report(p.parent) for p in (tmp_path / "multirun").rglob("report.json")
               if "bundle" not in p.relative_to(tmp_path).parts]
    assert [r["target"]["name"] for r in reports if r["verdict"] == "pass"] == ["ort_cpu"]
