"""Sweeps as users run them: `parity -m ...` with each launcher, the sweep summary and
its exit code, and the stage cache shared by the jobs of a sweep."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from conftest import run_cli


def sweep_dir(cwd: Path) -> Path:
    (folder,) = sorted((cwd / "multirun").glob("*/*"))[-1:]
    return folder


LAUNCHERS = {"basic": [], "joblib": ["hydra/launcher=joblib", "hydra.launcher.n_jobs=2"],
             "submitit_local": ["hydra/launcher=submitit_local"]}


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_sweep_summary_and_worst_exit_code_with_each_launcher(tmp_path, launcher):
    """ort_cpu passes; mnn_cpu at bf16 is a config error (exit 2) and mnn_opencl ran on the
    CPU (exit 4, the pip wheel has no OpenCL): the sweep exits 4 and lists every job."""
    result = run_cli(["-m", *LAUNCHERS[launcher], "target=ort_cpu,mnn_opencl", "precision=fp32,bf16"], tmp_path)
    assert result.returncode == 4, result.stdout + result.stderr
    folder = sweep_dir(tmp_path)
    summary = json.loads((folder / "sweep.json").read_text())
    jobs = {(job["target"], job["precision"]): job for job in summary["jobs"]}
    assert set(jobs) == {("ort_cpu", "fp32"), ("ort_cpu", "bf16"), ("mnn_opencl", "fp32"), ("mnn_opencl", "bf16")}
    assert jobs["ort_cpu", "fp32"]["verdict"] == "pass" and jobs["ort_cpu", "fp32"]["dir"] == "precision=fp32,target=ort_cpu"
    assert jobs["ort_cpu", "bf16"]["exit_code"] == 2 and "bf16" in jobs["ort_cpu", "bf16"]["reason"]
    assert jobs["mnn_opencl", "fp32"]["exit_code"] == 4
    assert summary["exit_code"] == 4
    assert summary["matrix"]["best"] == {"ort_cpu": summary["jobs"].index(jobs["ort_cpu", "fp32"])}
    assert ("contended" in summary["recommendation"]) == (launcher == "joblib")

    markdown = (folder / "sweep.md").read_text()
    assert "| ort_cpu | ★ pass (exit 0)" in markdown and "error (exit 2)" in markdown
    assert "<table>" in (folder / "sweep.html").read_text()
    junit = ET.parse(folder / "junit.xml").getroot()
    assert len(junit.findall("testsuite")) == 4
    assert int(junit.get("errors")) >= 1 and int(junit.get("failures")) >= 1
    assert "sweep: 4 jobs, exit code 4" in result.stdout


def test_sweep_of_passing_jobs_exits_0_and_shares_calibration(tmp_path):
    """2 targets x 2 quantized precisions: calibration runs once for the whole sweep (int8
    and mixed share it); the other jobs are served from the cache. The sensitivity search runs
    once per Q/DQ placement: ONNX Runtime's and OpenVINO's differ, and each target's
    search measures its own placement (on OpenVINO for openvino_cpu)."""
    result = run_cli(["-m", "target=ort_cpu,openvino_cpu", "precision=int8,mixed"], tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads((sweep_dir(tmp_path) / "sweep.json").read_text())
    assert summary["exit_code"] == 0 and len(summary["jobs"]) == 4
    shared = summary["shared_work"]
    assert shared["calibrate"] == {"computed": 1, "cached": 3}
    assert shared["sensitivity"]["computed"] == 3 and shared["sensitivity"]["cached"] == 1  # int8: a no-op, shared
    reports = [json.loads((sweep_dir(tmp_path) / job["dir"] / "report.json").read_text()) for job in summary["jobs"]]
    searched = {r["target"]["name"]: r["sensitivity"] for r in reports if r["precision"] == "mixed"}
    assert searched["openvino_cpu"]["measured_on"] == "openvino" and searched["ort_cpu"]["measured_on"] == "onnxruntime"
    assert searched["openvino_cpu"]["placement"]["quantized"] == "inputs"
    assert searched["ort_cpu"]["placement"]["quantized"] == "inputs and outputs"
    statistics = sorted(r["calibration"]["statistics"] for r in reports if r["stages"][1]["status"] == "computed")
    assert statistics == ["computed"]  # one statistics pass, one calibration for int8 and mixed together


def test_concurrent_jobs_sharing_the_cache_compute_once_and_agree(tmp_path):
    """Two parallel jobs that need the same calibration: one computes it under the
    cache lock, the other waits and is served; their int8 models come from one table."""
    result = run_cli(["-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", "target=ort_cpu,openvino_cpu",
                      "precision=int8"], tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    folder = sweep_dir(tmp_path)
    summary = json.loads((folder / "sweep.json").read_text())
    assert summary["shared_work"]["calibrate"] == {"computed": 1, "cached": 1}
    assert summary["shared_work"]["convert"]["computed"] == 2  # OpenVINO's convert adds an IR
    tables = {(folder / job["dir"] / "stages" / "calibrate" / "calibration.json").read_bytes()
              for job in summary["jobs"]}
    assert len(tables) == 1

    alone = tmp_path / "alone"
    alone.mkdir()
    single = run_cli(["target=ort_cpu", "precision=int8", "pipeline.cache=false"], alone)
    assert single.returncode == 0, single.stderr
    (run,) = (alone / "outputs").glob("*/*_ort_cpu_int8")
    ort_job = next(job for job in summary["jobs"] if job["target"] == "ort_cpu")
    built = sorted((folder / ort_job["dir"] / "stages" / "build").glob("*.onnx"))
    assert built and all(path.read_bytes() == (run / "stages" / "build" / path.name).read_bytes() for path in built)


def test_job_folders_are_named_after_the_swept_keys_only(tmp_path):
    """model.path=/x/y.onnx is the same for every job: it stays out of the folder names
    (a slash would nest them); a swept path is flattened into one folder name."""
    import importlib.resources

    model = importlib.resources.files("pipeline") / "assets" / "digits_cnn.onnx"
    result = run_cli(["-m", f"model.path={model}", "target=ort_cpu,openvino_cpu"], tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads((sweep_dir(tmp_path) / "sweep.json").read_text())
    assert sorted(job["dir"] for job in summary["jobs"]) == ["target=openvino_cpu", "target=ort_cpu"]
    assert all(job["verdict"] == "pass" for job in summary["jobs"])

    (tmp_path / "copy").mkdir()
    other = tmp_path / "copy" / "digits_cnn.onnx"
    other.write_bytes(model.read_bytes())
    swept = tmp_path / "swept"
    swept.mkdir()
    result = run_cli(["-m", f"model.path={model},{other}", "precision=fp32", "pipeline.stages=[convert]"], swept)
    assert result.returncode == 0, result.stdout + result.stderr
    folders = sorted(p.name for p in sweep_dir(swept).iterdir() if p.is_dir())
    assert folders == sorted(f"model.path={path}".replace("/", "_") for path in (model, other))


def test_parallel_jobs_get_plain_log_lines_not_live_bars(tmp_path):
    """A joblib job logs each stage as a line; live bars are off in parallel jobs."""
    import subprocess
    import sys

    code = ("from pipeline import console\nwith console.progress_bar() as bar:\n"
            "    assert not bar.disable or not console.stderr_console().is_terminal\n"
            "console.set_plain_progress()\nwith console.progress_bar() as bar:\n    assert bar.disable\nprint('plain')")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "plain"
    result = run_cli(["-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", "target=ort_cpu,openvino_cpu"],
                     tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("stage verify: computed") == 2
    import os

    cores = len(os.sched_getaffinity(0))
    for job in json.loads((sweep_dir(tmp_path) / "sweep.json").read_text())["jobs"]:
        report = json.loads((sweep_dir(tmp_path) / job["dir"] / "report.json").read_text())
        # two jobs side by side share the cores for parity's own work
        assert report["environment"]["cores"] == {"available": cores, "jobs_side_by_side": 2,
                                                  "own_threads": max(1, cores // 2)}
    found = json.loads((sweep_dir(tmp_path) / "sweep.json").read_text())["recommendation"]
    assert found["contended"] == 2 and "2 jobs side by side" in found["text"] and found["text"] in result.stdout


def test_a_crashed_job_outranks_a_failed_threshold_in_the_sweeps_exit_code(tmp_path):
    """A threshold failure (3) must not hide a job where parity itself crashed (1) or one
    killed before it wrote job.json; a refused write (5) still ranks above all."""
    from pipeline.errors import worst_exit_code
    from pipeline.release.sweep import summarize, write_job_record

    for name, code in (("a", 0), ("b", 3), ("c", 1)):
        (tmp_path / name).mkdir()
        write_job_record(tmp_path / name, code, ["target=ort_cpu", "precision=fp32"], {}, None if code == 0 else "x")
    assert summarize(tmp_path)["exit_code"] == 1
    (tmp_path / "c" / "job.json").unlink()
    (tmp_path / "c" / ".hydra").mkdir()  # a killed job: Hydra's folder, no job.json
    summary = summarize(tmp_path)
    assert summary["exit_code"] == 1 and "no job.json" in summary["jobs"][2]["reason"]
    assert [worst_exit_code(codes) for codes in ([], [3, 2], [4, 3], [1, 4], [5, 1], [3, 137])] == [0, 3, 4, 1, 5, 137]
