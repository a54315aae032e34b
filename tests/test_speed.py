"""Honest speed in verify: builds timed interleaved in rounds, speed-up over fp32, a
warning for a build that is not faster, and validation.min_speedup as a failing check."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import read_report, run_cli, run_dirs
from pipeline.verification import confidence, speed
from pipeline.worker import BackendWorker

ASSETS = Path(__file__).resolve().parents[1] / "pipeline" / "assets"


def test_a_build_not_faster_than_fp32_is_never_a_silent_pass(default_run):
    """The default job ships a mixed build: whatever this machine makes of it, the report
    carries the interleaved speed-ups, and a build that is not faster says so."""
    _, run_dir, result = default_run
    report = read_report(run_dir)
    found = report["verify"]["speed"]["speedups"]
    assert set(found) == {"int8", "mixed"}
    shipped = found["mixed"]
    assert shipped["speedup_p25"] <= shipped["speedup"] <= shipped["speedup_p75"]
    assert report["verify"]["comparison"]["mixed"]["speedup"] == shipped
    latency = report["verify"]["comparison"]["fp32"]["latency"]
    assert latency["rounds"] == len(latency["round_medians_ms"]) >= 3
    warned = [w for w in report["warnings"] if w.startswith("speed: the mixed build")]
    assert bool(warned) == (not shipped["faster"])
    assert ("speed vs fp32" in result.stdout) and (("warning: speed:" in result.stdout) == bool(warned))
    assert "speed-up vs fp32" in (run_dir / "report.md").read_text()
    if warned:  # the warning sits in the verdict section of every report
        assert warned[0] in (run_dir / "report.md").read_text()


def test_a_short_build_is_timed_in_two_processes_each_and_printed_with_its_round_interval(tmp_path):
    """The digits model runs in well under 10 ms: with the default timing, int8's verify times
    fp32 and int8 in two processes each, rounds in turn (as many in each), and the printed
    interval is where the next round falls (speed.round_interval of the report's rounds), as
    the speed line names it."""
    result = run_cli(["precision=int8", "pipeline.stages=[convert,calibrate,build,verify]"], tmp_path, quick=False)
    assert result.returncode == 0, result.stdout + result.stderr
    report = read_report(run_dirs(tmp_path)[-1])
    comparison, found = report["verify"]["comparison"], report["verify"]["speed"]["speedups"]["int8"]
    for build in ("fp32", "int8"):
        latency = comparison[build]["latency"]
        assert latency["processes"] == 2 and latency["rounds"] % 2 == 0 and latency["rounds"] >= 8
    ratios = [f / t for f, t in zip(comparison["fp32"]["latency"]["round_medians_ms"],
                                    comparison["int8"]["latency"]["round_medians_ms"])]
    assert (found["speedup_low"], found["speedup_high"]) == pytest.approx(speed.round_interval(ratios))
    assert found["level"] == 0.9 and found["speedup_low"] <= found["speedup"] <= found["speedup_high"]
    printed = f"int8 {found['speedup']:.2f}x ({found['speedup_low']:.2f}-{found['speedup_high']:.2f})"
    assert f"2 processes a build; the next round's 90 % range): {printed}" in result.stdout
    assert "in brackets where one more round's ratio falls, 90 % sure" in (run_dirs(tmp_path)[-1] / "report.md").read_text()


def test_min_speedup_fails_the_verdict_after_the_accuracy_checks(tmp_path):
    result = run_cli(["precision=int8", "validation.min_speedup=1000", "validation.timing_max_seconds=0"], tmp_path)
    assert result.returncode == 3, result.stderr
    report = read_report(run_dirs(tmp_path)[0])
    assert report["verdict"] == "fail"
    assert report["reasons"][-1].startswith("speed: the int8 build is ")
    assert "below validation.min_speedup 1000" in report["reasons"][-1]
    assert (run_dirs(tmp_path)[0] / "bundle").is_dir()  # the report and bundle are still written


@pytest.mark.parametrize("setting, timed", [("validation.time_failing=null", True),
                                             ("validation.time_failing=false", False)])
def test_a_failing_build_is_timed_unless_time_failing_is_false(tmp_path, setting, timed):
    """A build that fails its accuracy checks is timed as a passing one is (what a looser
    threshold would buy), unless validation.time_failing=false (auto's candidates)."""
    result = run_cli(["precision=int8", "metric=none", "validation.min_cosine=0.999999", "validation.layerwise=off",
                      "validation.advice_trials=0", setting], tmp_path)
    assert result.returncode == 3, result.stdout + result.stderr
    verify = read_report(run_dirs(tmp_path)[0])["verify"]
    assert (verify["comparison"]["int8"]["latency"] is not None) == timed, verify["comparison"]["int8"]
    assert bool(verify["speed"]["speedups"]) == timed and ("not_timed" in verify["speed"]) == (not timed)
    assert ("speed vs fp32: not timed: the build fails its accuracy checks" in result.stdout) == (not timed)


def test_interleaved_rounds_and_time_budget():
    """Real ONNX Runtime workers: every build gets one median per round; a spent time
    budget stops after three rounds."""
    settings = {"model": "digits_cnn.onnx", "options": {}, "device": "CPU", "precision": "fp32"}
    feeds = {"input": np.zeros((1, 1, 8, 8), np.float32)}
    with BackendWorker("pipeline.backends.onnxruntime", ASSETS, settings, label="a") as first, \
            BackendWorker("pipeline.backends.onnxruntime", ASSETS, settings, label="b") as second:
        found = speed.interleaved({"fp32": first, "int8": second}, feeds, rounds=5, runs=4, max_seconds=60)
        assert [found[n]["rounds"] for n in ("fp32", "int8")] == [5, 5]
        assert found["fp32"]["runs"] == 20 and len(found["int8"]["round_medians_ms"]) == 5
        budget = speed.interleaved({"fp32": first}, feeds, rounds=50, runs=2, max_seconds=0)
        assert budget["fp32"]["rounds"] == 3


def test_short_builds_are_timed_in_as_many_processes_each_in_turn():
    """processes=2: every build of a short run gets a second worker of the same build; the
    rounds alternate between them (rounded up to as many in each) and the second workers are
    gone when the timing ends, the first ones still serving."""
    settings = {"model": "digits_cnn.onnx", "options": {}, "device": "CPU", "precision": "fp32"}
    feeds = {"input": np.zeros((1, 1, 8, 8), np.float32)}
    before = _worker_pids()
    with BackendWorker("pipeline.backends.onnxruntime", ASSETS, settings, label="a") as first, \
            BackendWorker("pipeline.backends.onnxruntime", ASSETS, settings, label="b") as second:
        found = speed.interleaved({"fp32": first, "int8": second}, feeds, rounds=5, runs=4, max_seconds=60,
                                  processes=2)
        assert [found[n]["processes"] for n in ("fp32", "int8")] == [2, 2]
        assert [found[n]["rounds"] for n in ("fp32", "int8")] == [6, 6]
        assert len(_worker_pids() - before) == 2  # the two it was given
        assert first.run(feeds)["logits"].shape == (1, 10)
        slow = speed.interleaved({"fp32": first}, feeds, rounds=3, runs=2, max_seconds=60, processes=1)
        assert slow["fp32"]["processes"] == 1 and slow["fp32"]["rounds"] == 3


def test_a_second_process_that_fails_to_load_leaves_the_build_timed_in_one(tmp_path):
    """A build whose second timing process cannot load (a memory limit, say) is timed in its
    first alone, as a long build is; the build beside it still takes its rounds in two."""
    once = {"behaviour": "load_once", "marker": str(tmp_path / "loaded")}
    with BackendWorker("worker_backends", ".", once, label="a") as first, \
            BackendWorker("worker_backends", ".", {"behaviour": "double"}, label="b") as second:
        found = speed.interleaved({"fp32": first, "int8": second}, {"x": np.ones(4, np.float32)}, rounds=4, runs=2,
                                  max_seconds=60, processes=2)
    assert "error" not in found["fp32"] and "error" not in found["int8"], found
    assert found["fp32"]["rounds"] == found["int8"]["rounds"] == 4
    assert speed.speedups(found)["int8"]["speedup"] > 0


def _worker_pids() -> set:
    import multiprocessing

    return {child.pid for child in multiprocessing.active_children() if child.name.startswith("parity-worker")}


def test_the_printed_interval_is_where_the_next_round_falls():
    """A prediction interval of one more round's ratio in log space, around the median: median
    times or over exp(t(n-1) s sqrt(1 + 1/n)), t Student's (checked against scipy), s the
    robust standard deviation of the log ratios; one odd round does not widen it, more rounds
    do not shrink it to nothing, one round is the ratio alone."""
    from scipy import stats

    ratios = [1.5, 1.6, 1.55, 1.2, 1.58, 1.57, 2.4, 1.56]
    logs = np.log(ratios)
    scale = 1.4826 * np.median(np.abs(logs - np.log(np.median(ratios))))
    half = stats.t.ppf(0.95, 7) * scale * np.sqrt(1 + 1 / 8)
    low, high = speed.round_interval(ratios)
    assert (low, high) == pytest.approx((np.median(ratios) / np.exp(half), np.median(ratios) * np.exp(half)))
    assert low < 1.5 and 1.6 < high < 1.7  # 1.2 and 2.4 leave it where the other six put it
    many = speed.round_interval(ratios * 8)
    assert many[0] > low and many[1] < high and many[1] / many[0] > 1.06  # narrower with 64 rounds, not a point
    assert speed.round_interval([1.3]) == pytest.approx((1.3, 1.3))
    timings = {"fp32": {"round_medians_ms": [2.0] * 8}, "int8": {"round_medians_ms": [1.0] * 7 + [0.5]}}
    found = speed.speedups(timings)["int8"]
    assert (found["speedup_low"], found["speedup"], found["speedup_high"]) == (2.0, 2.0, 2.0)
    assert speed.speedup_text(found) == "2.00x (2.00-2.00)" and speed.how_sure(found) == "the next round's 90 % range"
    assert speed.interval({"speedup_p25": 1.1, "speedup_p75": 1.3}) == (1.1, 1.3)  # a report from before
    assert speed.how_sure({"speedup_low": 1.1, "speedup_high": 1.3, "confidence": 0.93}) == "the median's 93 % interval"


def test_t_quantile_is_students():
    from scipy import stats

    for level, df in [(0.9, 1), (0.9, 2), (0.9, 7), (0.95, 30), (0.5, 4)]:
        assert confidence.t_quantile(level, df) == pytest.approx(stats.t.ppf((1 + level) / 2, df), rel=1e-9)


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads a process's CPU time from /proc")
def test_the_builds_not_being_timed_are_paused_and_all_run_again_after():
    """A build's worker whose threads spin while idle (ONNX Runtime's pool after each run)
    takes no CPU while another build is timed: the others are paused for each turn, and
    every worker runs again when the timing ends, whatever it ends with."""
    settings = {"behaviour": "spin"}
    with BackendWorker("worker_backends", ".", settings, label="a") as first, \
            BackendWorker("worker_backends", ".", settings, label="b") as second:
        pids = [worker.effective()["pid"] for worker in (first, second)]
        before, started = [_cpu_seconds(pid) for pid in pids], time.perf_counter()
        speed.interleaved({"fp32": first, "int8": second}, {"x": np.ones(4, np.float32)}, rounds=6, runs=1,
                          max_seconds=60, round_ms=100)
        wall = time.perf_counter() - started
        spent = sum(_cpu_seconds(pid) - cpu for pid, cpu in zip(pids, before))
        assert spent < 1.4 * wall, (spent, wall)  # unpaused, both spin all along: about 2x on 2 cores
        for pid in pids:  # running again ('R'/'S'), not stopped ('T')
            assert Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "T"
        assert first.run({"x": np.ones(2, np.float32)})["y"].tolist() == [2, 2]
        assert second.run({"x": np.ones(2, np.float32)})["y"].tolist() == [2, 2]


def test_only_backends_whose_idle_threads_spin_are_paused():
    """ONNX Runtime's pool spins after a run, so its idle workers are paused; ncnn's threads
    wait passively and OpenVINO's and MNN's are left running, as before the pause existed."""
    paused = {name: speed._idle_threads_spin(BackendWorker(f"pipeline.backends.{name}", ".", {}, label=name))
              for name in ("onnxruntime", "openvino", "ncnn", "mnn")}
    assert paused == {"onnxruntime": True, "openvino": False, "ncnn": False, "mnn": False}


def _timing(medians):
    return {"round_medians_ms": medians, "median_ms": float(np.median(medians))}


def test_speedup_is_the_median_of_paired_round_ratios():
    timings = {"fp32": _timing([2.0, 4.0, 2.0, 2.0]), "int8": _timing([1.0, 2.0, 1.0, 4.0])}
    found = speed.speedups(timings)["int8"]
    assert found["speedup"] == 2.0  # ratios 2, 2, 2, 0.5: one slow round does not decide
    assert found["faster"] is True
    noisy = speed.speedups({"fp32": _timing([1.0, 1.0, 1.0, 1.0]), "int8": _timing([0.9, 1.1, 0.95, 1.05])})
    assert noisy["int8"]["faster"] is False


def test_warning_names_the_known_cause():
    slower = {"speedup": 0.6, "speedup_p25": 0.55, "speedup_p75": 0.65, "faster": False}
    text = speed.slow_build_warning("int8", slower, "onnxruntime", ["avx2", "fma"], 3.0)
    assert "slower than fp32" in text and "x86 without VNNI" in text and "u8s8" in text
    vnni = speed.slow_build_warning("int8", slower, "openvino", ["avx2", "avx512_vnni"], 3.0)
    assert "VNNI" not in vnni
    assert speed.slow_build_warning("fp32", slower, "onnxruntime", [], 3.0) is None
    faster = {**slower, "speedup": 1.5, "speedup_p25": 1.4, "speedup_p75": 1.6, "faster": True}
    assert speed.slow_build_warning("int8", faster, "onnxruntime", ["avx2"], 3.0) is None
    assert speed.min_speedup_failure("int8", faster, 1.2) is None
    assert "below validation.min_speedup 2" in speed.min_speedup_failure("int8", faster, 2)
