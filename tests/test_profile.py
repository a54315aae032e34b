"""Per-layer profiles on the real runtimes, from the CLI: every layer named by the ONNX node
it computes, OpenVINO's int8 kernels, a profiling crash that leaves the verdict alone, and
the sweep's recommendation of what to ship."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from conftest import QUICK_TIMING, read_report, run_cli, single_bundle
from ncnn_helpers import require_vulkan
from side_by_side import PROFILED, Jobs, new_run, stages
from pipeline import environment
from pipeline.release.sweep import recommend

# the embedded digits CNN: node -> op type (the ReLUs are fused into the layer before them)
DIGITS = {"conv1": "Conv", "relu1": "Relu", "conv2": "Conv", "relu2": "Relu", "conv3": "Conv", "relu3": "Relu",
          "pool1": "MaxPool", "flatten": "Flatten", "fc1": "Gemm", "relu4": "Relu", "fc2": "Gemm"}
COMPUTE = ("conv1", "conv2", "conv3", "fc1", "fc2")
SWEEP_TARGETS = ("ort_cpu", "openvino_cpu", "ncnn_cpu", "ncnn_vulkan", "mnn_cpu", "mnn_opencl")
# the stages a profile needs, for the jobs whose tests look at nothing else
PROFILE_ONLY = stages("convert", "calibrate", "sensitivity", "build", "tune", "profile")
CRASHES = [("profile.worker_memory_mb=64", ("memory", "crashed", "error")),
           ("profile.worker_timeout_s=0.001", ("hung",))]


def profile_of(run_dir: Path) -> dict:
    return json.loads((run_dir / "stages" / "profile" / "profile.json").read_text())


def assert_named_by_onnx(profile: dict, runs: int = 20) -> None:
    """Every Conv and Gemm of the model is the node of exactly one layer; every name is
    the model's; the times add up."""
    layers = profile["layers"]
    primaries = [layer["onnx_node"] for layer in layers if layer["onnx_node"]]
    assert sorted(node for node in primaries if node in COMPUTE) == sorted(COMPUTE), layers
    for layer in layers:
        assert set(layer["onnx_nodes"]) <= set(DIGITS), layer
        if layer["onnx_node"]:
            assert layer["onnx_node"] in layer["onnx_nodes"] and layer["onnx_op_type"] == DIGITS[layer["onnx_node"]]
        else:
            assert layer["onnx_nodes"] == [] and layer["onnx_op_type"] is None
        assert layer["ms"] >= 0 and layer["median_ms"] >= 0 and 0 <= layer["share"] <= 1
    # a machine busy enough to spend profile.max_seconds gives fewer runs, and says so
    assert profile["runs"] == runs or (1 <= profile["runs"] < runs and "profile.max_seconds" in profile["note"])
    assert profile["warmup"] == 3
    assert sum(layer["ms"] for layer in layers) == pytest.approx(profile["total_ms"], abs=1e-4)
    assert profile["measured_by"] and profile["device"]


def profiling_crash_job(cwd, override):
    """The job with ``override`` (a crashing profile), then the same job again without it."""
    first = new_run([override], cwd, shared_cache=False)  # the second reads its statuses
    return (*first, *new_run([], cwd, shared_cache=False))


def sweep_job(cwd):
    """The digits model at fp32 on every CPU runtime and both GPU targets (the pip MNN
    wheel has no OpenCL: mnn_opencl runs on the CPU and fails with exit 4)."""
    result = run_cli(["-m", f"target={','.join(SWEEP_TARGETS)}", "precision=fp32", PROFILED, *QUICK_TIMING], cwd,
                     timeout=600, quick=False)  # the profile's own defaults: runs=20, warmup=3
    (folder,) = sorted((cwd / "multirun").glob("*/*"))[-1:]
    return result, folder, json.loads((folder / "sweep.json").read_text())


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """Every CLI job of this module, each in its own folder, started side by side
    (tests/side_by_side.py), the longest first; no bundle where a test reads none, a short speed
    measure (the sweep's recommendation reads the medians, whatever their spread)."""
    pool = Jobs()

    def job(name, run):
        cwd = tmp_path_factory.mktemp(name)
        pool.submit(name, lambda: run(cwd))

    job("sweep", sweep_job)
    for override, _ in CRASHES:
        job(override, lambda cwd, override=override: profiling_crash_job(cwd, override))
    job("openvino", lambda cwd: (new_run(["target=openvino_cpu", "precision=int8", PROFILE_ONLY], cwd, quick=False),
                                 new_run(["target=openvino_cpu", "precision=fp32", PROFILE_ONLY], cwd, quick=False)))
    job("time-budget", lambda cwd: new_run(["profile.runs=1000000", "profile.max_seconds=0.5", PROFILE_ONLY], cwd))
    yield pool
    pool.close()


def test_default_run_profiles_ort_by_onnx_node(default_run):
    _, run_dir, result = default_run
    profile = profile_of(run_dir)
    assert_named_by_onnx(profile)
    assert "ONNX Runtime profiler" in profile["measured_by"] and profile["device"] == "CPU"
    kernels = {layer["onnx_node"]: layer["kernel"] for layer in profile["layers"] if layer["onnx_node"]}
    # the default job is precision=mixed: ONNX Runtime's int8 kernels, named by the ONNX node they compute
    assert kernels["conv1"] == "QLinearConv" and kernels["fc1"] == "QGemm"
    assert profile["machine"] == environment.fingerprint()
    summary = read_report(run_dir)["profile"]
    assert summary["ran"] and summary["layers"] == len(profile["layers"]) and summary["file"] == "profile.json"
    assert summary["top"] == sorted(profile["layers"], key=lambda layer: -layer["ms"])[:10]
    assert sum(entry["layers"] for entry in summary["by_op_type"]) == summary["layers"]
    assert {"Conv", "Gemm"} <= {entry["op_type"] for entry in summary["by_op_type"]}
    bundle = single_bundle(run_dir)
    assert "## Profile (time per layer)" in (bundle / "report.md").read_text()
    assert "time per layer (mean per run)" in (bundle / "report.html").read_text()
    assert re.search(r"profile: \d+ layers \(\d+ with an ONNX node\)", result.stdout)


def test_openvino_int8_convolutions_run_int8_kernels(jobs):
    (result, run_dir), (fp32, fp32_dir) = jobs["openvino"]
    assert result.returncode == 0, result.stdout + result.stderr
    profile = profile_of(run_dir)
    assert_named_by_onnx(profile)
    assert "PERF_COUNT" in profile["measured_by"]
    kernels = {layer["onnx_node"]: layer["kernel"] for layer in profile["layers"] if layer["onnx_node"]}
    for conv in ("conv1", "conv2"):
        assert re.search(r"_[IU]8$", kernels[conv]), kernels  # OpenVINO's exec type, e.g. brgconv_avx512_amx_I8
    assert fp32.returncode == 0, fp32.stdout + fp32.stderr
    kernels = {layer["onnx_node"]: layer["kernel"] for layer in profile_of(fp32_dir)["layers"]}
    assert kernels["conv1"].endswith("_f32"), kernels


@pytest.mark.parametrize("override, kinds", CRASHES)
def test_a_profiling_crash_leaves_the_verdict_alone(jobs, override, kinds):
    result, run_dir, again, again_dir = jobs[override]
    assert result.returncode == 0, result.stdout + result.stderr
    report = read_report(run_dir)
    assert report["verdict"] == "pass" and report["exit_code"] == 0 and report["reasons"] == []
    profile = report["profile"]
    assert profile["ran"] is False and profile["crash"]["kind"] in kinds
    assert profile["reason"].startswith("profiling ")
    assert "not profiled" in result.stdout and "Traceback" not in result.stderr
    assert "not profiled: profiling" in (single_bundle(run_dir) / "report.md").read_text()
    # again: the same job without the override; a crashed profile is not cached: measured again
    statuses = {s["stage"]: s["status"] for s in read_report(again_dir)["stages"]}
    assert again.returncode == 0 and statuses["profile"] == "computed" and statuses["verify"] == "cached"
    assert read_report(again_dir)["profile"]["ran"] is True


def test_profiling_stops_at_its_time_budget(jobs):
    result, run_dir = jobs["time-budget"]  # profile.runs=1000000 profile.max_seconds=0.5
    assert result.returncode == 0, result.stdout + result.stderr
    profile = profile_of(run_dir)
    assert 1 <= profile["runs"] < 1000000
    assert profile["note"].startswith(f"stopped after {profile['runs']} of 1000000 runs")
    assert read_report(run_dir)["profile"]["note"] == profile["note"]


@pytest.fixture(scope="module")
def sweep(jobs):
    return jobs["sweep"]


@pytest.mark.parametrize("target", SWEEP_TARGETS)
def test_every_runtime_profiles_by_onnx_node(sweep, target):
    _, folder, _ = sweep
    if target == "ncnn_vulkan":
        require_vulkan()  # skips locally without a Vulkan driver; fails in CI, which installs lavapipe
    profile = profile_of(folder / f"target={target}")  # precision=fp32 is not swept
    assert_named_by_onnx(profile)
    expected = {"ort_cpu": "ONNX Runtime profiler", "openvino_cpu": "PERF_COUNT", "ncnn_cpu": "incremental extraction",
                "ncnn_vulkan": "incremental extraction", "mnn_cpu": "per-op callbacks", "mnn_opencl": "per-op callbacks"}
    assert expected[target] in profile["measured_by"]
    if target.startswith("ncnn"):  # ncnn's layer map covers every node, fused ReLUs included
        assert set().union(*(layer["onnx_nodes"] for layer in profile["layers"])) == set(DIGITS)
    if target == "ncnn_vulkan":
        assert profile["device"] == "VULKAN" and profile["device_name"]
    if target == "mnn_opencl":
        assert profile["device"] == "CPU"  # what really ran


def test_sweep_recommends_the_fastest_passing_job_and_says_what_ran(sweep):
    result, folder, summary = sweep
    jobs = summary["jobs"]
    passing = [job for job in jobs if job["verdict"] == "pass" and job["latency_ms"]]
    fastest = min(passing, key=lambda job: job["latency_ms"])
    found = summary["recommendation"]
    assert found["ship"]["job"] == fastest["dir"] and found["ship"]["latency_ms"] == fastest["latency_ms"]
    assert all(tie["latency_ms"] <= fastest["latency_ms"] * 1.05 for tie in found["ties"])
    assert found["text"].startswith(f"ship {fastest['target']} fp32") and found["text"] in result.stdout
    notes = {note["job"].split(",")[-1]: note for note in found["gpu_vs_cpu"]}  # target=...
    assert notes["target=mnn_opencl"]["kind"] == "fallback" and "ran on CPU" in notes["target=mnn_opencl"]["text"]
    vulkan = next(job for job in jobs if job["target"] == "ncnn_vulkan")
    if vulkan["effective"].get("device_type") == "CPU":  # Mesa's lavapipe: slower than the CPU runtimes
        note = notes["target=ncnn_vulkan"]
        assert note["kind"] == "slower" and note["gpu_ms"] > note["cpu_ms"]
        assert "not a GPU" in note["text"] and "MNN's lesson" in note["text"]
    markdown = (folder / "sweep.md").read_text()
    assert "## Recommendation" in markdown and "## Profiles" in markdown
    assert all(job["profile"]["total_ms"] > 0 for job in jobs if job["exit_code"] in (0, 4))


def test_recommendation_notes_ties_and_never_ships_a_failing_job():
    def job(target, verdict, ms, device="CPU", effective=None):
        return {"dir": f"target={target}", "target": target, "precision": "fp32", "verdict": verdict,
                "latency_ms": ms, "bytes": 1, "device": device, "effective": effective or {"device": device}}

    jobs = [job("a", "fail", 0.5), job("b", "pass", 1.0), job("c", "pass", 1.04), job("d", "pass", 2.0),
            job("g", "pass", 3.0, "OPENCL", {"device": "OPENCL", "device_name": "Mali", "device_type": "integrated GPU"})]
    found = recommend(jobs)
    assert found["ship"]["target"] == "b" and [tie["target"] for tie in found["ties"]] == ["c"]
    assert "a tie" in found["text"]
    (note,) = found["gpu_vs_cpu"]
    assert note["kind"] == "slower" and note["cpu_job"] == "target=a" and "3.000 ms, 6.0x the 0.500 ms" in note["text"]
    assert "OPENCL on Mali (integrated GPU)" in note["text"] and "dispatch and copy overhead" in note["text"]
    assert recommend([job("a", "fail", 0.5)])["ship"] is None


def test_shares_stay_within_one_when_times_round():
    """Times summed after rounding can exceed the rounded total (a tiny model on ncnn gave
    one op type a share of 1.000015, which the report schema refuses)."""
    from pipeline import profiling

    layers = [{"name": f"conv{i}", "type": "Convolution", "kernel": None, "ms": 0.0000026, "onnx_node": f"conv{i}",
               "onnx_nodes": [f"conv{i}"], "onnx_op_type": "Conv"} for i in range(2)]
    profile = profiling.result("test", 1, 0, layers, None, {})
    assert all(0 <= layer["share"] <= 1 for layer in profile["layers"])
    summary = profiling.summarize(profile, top=5)
    assert summary["by_op_type"][0]["op_type"] == "Conv"
    assert 0 < summary["by_op_type"][0]["share"] <= 1
