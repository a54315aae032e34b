"""Sweeps as users run them: `parity -m ...` with each launcher, the sweep summary and
its exit code, and the stage cache shared by the jobs of a sweep."""

from __future__ import annotations

import functools
import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from conftest import run_cli
from side_by_side import SIDE_BY_SIDE_ENV, Jobs, selected, stages


def sweep_dir(cwd: Path) -> Path:
    (folder,) = sorted((cwd / "multirun").glob("*/*"))[-1:]
    return folder


LAUNCHERS = {"basic": [], "joblib": ["hydra/launcher=joblib", "hydra.launcher.n_jobs=2"],
             "submitit_local": ["hydra/launcher=submitit_local"]}
# int8 builds need calibration; verify makes each job log a verify stage and a latency
PARALLEL_STAGES = stages("convert", "calibrate", "build", "verify")


def run_in(cwd: Path, *args, shared_cache: bool = False):
    """``parity ARGS`` in cwd: (cwd, completed process); with the folder's own stage cache
    unless ``shared_cache`` (the tests that count a sweep's shared work need their own)."""
    return cwd, run_cli(list(args), cwd, env=SIDE_BY_SIDE_ENV, shared_cache=shared_cache)


@pytest.fixture(scope="module")
def sweeps(request, tmp_path_factory):
    """The module's sweeps, each in its own folder, submitted up front and run side by side."""
    jobs = Jobs()

    def submit(name, *args, shared_cache=False):
        jobs.submit(name, functools.partial(run_in, tmp_path_factory.mktemp(name), *args, shared_cache=shared_cache))

    for launcher, options in LAUNCHERS.items():
        if selected(request, f"test_sweep_summary_and_worst_exit_code_with_each_launcher[{launcher}]"):
            # the same jobs under each launcher: the first to compute a stage serves the others
            submit(launcher, "-m", *options, "target=ort_cpu,mnn_opencl", "precision=fp32,bf16",
                   stages("convert", "build", "verify"), shared_cache=True)
    if selected(request, "test_sweep_of_passing_jobs_exits_0_and_shares_calibration"):
        submit("passing", "-m", "target=ort_cpu,openvino_cpu", "precision=int8,mixed",
               stages("convert", "calibrate", "sensitivity", "build", "verify"))
    if selected(request, "test_concurrent_jobs_sharing_the_cache_compute_once_and_agree",
                "test_parallel_jobs_get_plain_log_lines_not_live_bars"):
        submit("parallel", "-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2",
               "target=ort_cpu,openvino_cpu", "precision=int8", PARALLEL_STAGES)
    if selected(request, "test_concurrent_jobs_sharing_the_cache_compute_once_and_agree"):
        submit("alone", "target=ort_cpu", "precision=int8", "pipeline.cache=false", PARALLEL_STAGES)
    if selected(request, "test_job_folders_are_named_after_the_swept_keys_only"):
        jobs.submit("folders", functools.partial(folder_sweeps, tmp_path_factory.mktemp("folders")))
    yield jobs
    jobs.close()


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_sweep_summary_and_worst_exit_code_with_each_launcher(sweeps, launcher):
    """ort_cpu passes; mnn_cpu at bf16 is a config error (exit 2) and mnn_opencl ran on the
    CPU (exit 4, the pip wheel has no OpenCL): the sweep exits 4 and lists every job."""
    cwd, result = sweeps[launcher]
    assert result.returncode == 4, result.stdout + result.stderr
    folder = sweep_dir(cwd)
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


def test_sweep_of_passing_jobs_exits_0_and_shares_calibration(sweeps):
    """2 targets x 2 quantized precisions: calibration runs once for the whole sweep (int8
    and mixed share it); the other jobs are served from the cache. The sensitivity search runs
    once per Q/DQ placement: ONNX Runtime's and OpenVINO's differ, and each target's
    search measures its own placement (on OpenVINO for openvino_cpu)."""
    cwd, result = sweeps["passing"]
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads((sweep_dir(cwd) / "sweep.json").read_text())
    assert summary["exit_code"] == 0 and len(summary["jobs"]) == 4
    shared = summary["shared_work"]
    assert shared["calibrate"] == {"computed": 1, "cached": 3}
    assert shared["sensitivity"]["computed"] == 3 and shared["sensitivity"]["cached"] == 1  # int8: a no-op, shared
    reports = [json.loads((sweep_dir(cwd) / job["dir"] / "report.json").read_text()) for job in summary["jobs"]]
    searched = {r["target"]["name"]: r["sensitivity"] for r in reports if r["precision"] == "mixed"}
    assert searched["openvino_cpu"]["measured_on"] == "openvino" and searched["ort_cpu"]["measured_on"] == "onnxruntime"
    assert searched["openvino_cpu"]["placement"]["quantized"] == "inputs"
    assert searched["ort_cpu"]["placement"]["quantized"] == "inputs and outputs"
    statistics = sorted(r["calibration"]["statistics"] for r in reports if r["stages"][1]["status"] == "computed")
    assert statistics == ["computed"]  # one statistics pass, one calibration for int8 and mixed together


@pytest.fixture(scope="module")
def parallel_sweep(sweeps):
    """Two int8 jobs side by side (joblib, 2 workers) in a fresh folder: (folder, completed process)."""
    cwd, result = sweeps["parallel"]
    assert result.returncode == 0, result.stdout + result.stderr
    return cwd, result


def test_concurrent_jobs_sharing_the_cache_compute_once_and_agree(parallel_sweep, sweeps):
    """Two parallel jobs that need the same calibration: one computes it under the
    cache lock, the other waits and is served; their int8 models come from one table."""
    cwd, result = parallel_sweep
    folder = sweep_dir(cwd)
    summary = json.loads((folder / "sweep.json").read_text())
    assert summary["shared_work"]["calibrate"] == {"computed": 1, "cached": 1}
    assert summary["shared_work"]["convert"]["computed"] == 2  # OpenVINO's convert adds an IR
    tables = {(folder / job["dir"] / "stages" / "calibrate" / "calibration.json").read_bytes()
              for job in summary["jobs"]}
    assert len(tables) == 1

    alone, single = sweeps["alone"]  # the same int8 job alone, without the cache
    assert single.returncode == 0, single.stderr
    (run,) = (alone / "outputs").glob("*/*_ort_cpu_int8")
    ort_job = next(job for job in summary["jobs"] if job["target"] == "ort_cpu")
    built = sorted((folder / ort_job["dir"] / "stages" / "build").glob("*.onnx"))
    assert built and all(path.read_bytes() == (run / "stages" / "build" / path.name).read_bytes() for path in built)


def folder_sweeps(tmp_path):
    """A sweep with model.path set for every job, then one sweeping two model paths:
    (the model, its copy, (cwd, completed process) of each)."""
    import importlib.resources

    model = importlib.resources.files("pipeline") / "assets" / "digits_cnn.onnx"
    (tmp_path / "fixed").mkdir()
    fixed = run_in(tmp_path / "fixed", "-m", f"model.path={model}", "target=ort_cpu,openvino_cpu", "precision=fp32",
                   stages("convert", "build", "verify"))
    (tmp_path / "copy").mkdir()
    other = tmp_path / "copy" / "digits_cnn.onnx"
    other.write_bytes(model.read_bytes())
    (tmp_path / "swept").mkdir()
    swept = run_in(tmp_path / "swept", "-m", f"model.path={model},{other}", "precision=fp32",
                   "pipeline.stages=[convert]")
    return model, other, fixed, swept


def test_job_folders_are_named_after_the_swept_keys_only(sweeps):
    """model.path=/x/y.onnx is the same for every job: it stays out of the folder names
    (a slash would nest them); a swept path is flattened into one folder name."""
    model, other, (cwd, result), (swept, second) = sweeps["folders"]
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads((sweep_dir(cwd) / "sweep.json").read_text())
    assert sorted(job["dir"] for job in summary["jobs"]) == ["target=openvino_cpu", "target=ort_cpu"]
    assert all(job["verdict"] == "pass" for job in summary["jobs"])

    result = second
    assert result.returncode == 0, result.stdout + result.stderr
    folders = sorted(p.name for p in sweep_dir(swept).iterdir() if p.is_dir())
    assert folders == sorted(f"model.path={path}".replace("/", "_") for path in (model, other))


def test_parallel_jobs_get_plain_log_lines_not_live_bars(parallel_sweep):
    """A joblib job logs each stage as a line; live bars are off in parallel jobs."""
    import subprocess
    import sys

    code = ("from pipeline import console\nwith console.progress_bar() as bar:\n"
            "    assert not bar.disable or not console.stderr_console().is_terminal\n"
            "console.set_plain_progress()\nwith console.progress_bar() as bar:\n    assert bar.disable\nprint('plain')")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "plain"
    cwd, result = parallel_sweep
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("stage verify: computed") == 2
    import os

    cores = len(os.sched_getaffinity(0))
    for job in json.loads((sweep_dir(cwd) / "sweep.json").read_text())["jobs"]:
        report = json.loads((sweep_dir(cwd) / job["dir"] / "report.json").read_text())
        # two jobs side by side share the cores for parity's own work
        assert report["environment"]["cores"] == {"available": cores, "jobs_side_by_side": 2,
                                                  "own_threads": max(1, cores // 2)}
    found = json.loads((sweep_dir(cwd) / "sweep.json").read_text())["recommendation"]
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
