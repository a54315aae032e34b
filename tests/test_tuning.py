"""The tune stage and compile caches: tuned settings reach runtime.yaml and the loader,
measurements are reused on the same machine, a failing setting is refused, a stale cache
falls back, and the search logic picks the fastest setting, ties toward the simpler one."""

from __future__ import annotations

import functools
import importlib.util
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml

from conftest import read_report, run_cli, single_bundle
from side_by_side import NO_DIAGNOSIS, SIDE_BY_SIDE_ENV, Jobs, new_run, selected
from side_by_side import stages as only_stages
from pipeline import tuning
from pipeline.release import compile_cache
from pipeline.config.resolvers import asset_path

TUNE_SAMPLES = 16  # conf/tuning/*.yaml verify_samples


def digits_inputs(count: int):
    with np.load(asset_path("digits.npz")) as data:
        return [data["validation/input"][i:i + 1] for i in range(count)]


def ort_error(level: str, inputs) -> float:
    """Max abs difference between ONNX Runtime at this optimization level and the reference
    (optimizations off) on the digits model."""
    import onnxruntime as ort

    def outputs(name):
        options = ort.SessionOptions()
        options.graph_optimization_level = getattr(ort.GraphOptimizationLevel, name)
        session = ort.InferenceSession(asset_path("digits_cnn.onnx"), options, providers=["CPUExecutionProvider"])
        return np.stack([session.run(None, {"input": x})[0] for x in inputs])

    return float(np.abs(outputs(level) - outputs("ORT_DISABLE_ALL")).max())


@pytest.fixture(scope="module")
def tuning_jobs(request, tmp_path_factory):
    """The module's `parity` jobs, each in its own folder, submitted up front and run side
    by side; the tests read their results."""
    jobs = Jobs()

    def submit(name, job, *args):
        jobs.submit(name, functools.partial(job, tmp_path_factory.mktemp(name), *args))

    if selected(request, "test_tuning_refuses_a_setting_that_fails_verification_and_the_bundle_runs_the_tuned_one"):
        inputs = digits_inputs(TUNE_SAMPLES)
        fused, basic = ort_error("ORT_ENABLE_ALL", inputs), ort_error("ORT_ENABLE_BASIC", inputs)
        if basic < fused:  # else the test skips
            submit("refuses", new_run_in, "precision=fp32", "tuning=normal",
                   f"validation.max_abs_error={(basic + fused) / 2}",
                   only_stages("convert", "build", "tune", "verify", "package"))
    if selected(request, "test_measurements_are_reused_on_the_same_machine"):
        submit("reused", reuse_runs)
    if selected(request, "test_a_gpu_target_that_falls_back_is_not_tuned") and importlib.util.find_spec("MNN"):
        submit("gpu", new_run_in, "target=mnn_opencl", "precision=fp32", "tuning=fast",
               only_stages("convert", "build", "tune", "verify"), *NO_DIAGNOSIS)
    if selected(request, "test_throughput_objective_uses_concurrent_requests"):
        submit("throughput", new_run_in, "target=openvino_cpu", "precision=int8", "tuning=fast",
               "tuning.objective=throughput", only_stages("convert", "calibrate", "build", "tune"))
    if selected(request, "test_stale_compile_cache_falls_back_to_compiling",
                "test_startup_measures_cold_and_warm_loads", "test_report_shows_cold_and_warm_startup"):
        submit("openvino", new_run_in, "target=openvino_cpu", "precision=fp32")
    yield jobs
    jobs.close()


def new_run_in(cwd, *args):
    """``parity ARGS`` in cwd: (completed process, run folder)."""
    return new_run(list(args), cwd, env=SIDE_BY_SIDE_ENV)


def test_tuning_refuses_a_setting_that_fails_verification_and_the_bundle_runs_the_tuned_one(tuning_jobs, tmp_path):
    """With max_abs_error between the error of ONNX Runtime's fused kernels (level "all",
    the build's setting) and that of level basic, every "all" candidate fails the
    re-verification: tuning must refuse them and ship a basic/extended setting, which
    runtime.yaml holds and parity-bundle run really uses (read back from the session)."""
    inputs = digits_inputs(TUNE_SAMPLES)
    fused, basic = ort_error("ORT_ENABLE_ALL", inputs), ort_error("ORT_ENABLE_BASIC", inputs)
    if not basic < fused:  # NCHWc kernels of level "all" reorder the sums on every x86 CPU seen so far
        pytest.skip(f"this CPU computes level all as exactly as level basic ({fused} vs {basic}): nothing to refuse")
    result, run_dir = tuning_jobs["refuses"]
    assert result.returncode == 0, result.stdout + result.stderr
    tuned = read_report(run_dir)["tuning"]
    assert tuned["ran"] and tuned["baseline_passes"] is False
    refused = [t for t in tuned["trials"] if t.get("verified") is False]
    assert refused and all(t["changes"].get("graph_optimization_level", "all") == "all" for t in refused)
    assert all("max abs error" in t["failures"][0] for t in refused)
    chosen = tuned["chosen"]["changes"]
    assert chosen["graph_optimization_level"] in ("basic", "extended")
    bundle = single_bundle(run_dir)
    runtime = yaml.safe_load((bundle / "runtime.yaml").read_text())
    assert {k: runtime["options"][k] for k in chosen} == chosen
    np.save(tmp_path / "x.npy", inputs[0])
    ran = run_cli(["run", bundle, "--input", tmp_path / "x.npy"], tmp_path, program="parity-bundle")
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "compile cache: hit" in ran.stdout
    assert f"graph_optimization_level={chosen['graph_optimization_level']} (cached graph)" in ran.stdout
    if "intra_op_num_threads" in chosen:
        assert f"intra_op_num_threads={chosen['intra_op_num_threads']}" in ran.stdout


def reuse_runs(cwd):
    """One tuned job, the same job again, then with other thresholds, in one folder:
    (completed process, run folder) of each."""
    job = ["target=openvino_cpu", "precision=fp32", "tuning=fast",
           only_stages("convert", "build", "tune", "verify", "package")]
    return [new_run(args, cwd, env=SIDE_BY_SIDE_ENV, shared_cache=False)  # their statuses are read
            for args in (job, job, [*job, "validation.min_cosine=0.999"])]


def test_measurements_are_reused_on_the_same_machine(tuning_jobs):
    (first, first_dir), (again, again_dir), (other, other_dir) = tuning_jobs["reused"]
    assert first.returncode == 0, first.stdout + first.stderr
    report = read_report(first_dir)
    assert report["tuning"]["ran"] and not report["tuning"]["reused"]
    assert {"INFERENCE_NUM_THREADS"} == {row["option"] for row in report["tuning"]["space"]}
    # the same job: the whole stage comes from the stage cache
    stages = {s["stage"]: s["status"] for s in read_report(again_dir)["stages"]}
    assert again.returncode == 0 and stages["tune"] == "cached"
    # other thresholds re-verify, but the measurements of this artifact on this machine are reused
    report = read_report(other_dir)
    assert other.returncode == 0 and report["tuning"]["reused"]
    assert {s["stage"]: s["status"] for s in report["stages"]}["tune"] == "computed"
    effective = report["verify"]["effective"]
    options = yaml.safe_load((single_bundle(other_dir) / "runtime.yaml").read_text())["options"]
    assert effective["compile_cache"] == "hit"
    if "INFERENCE_NUM_THREADS" in options:  # verify ran what runtime.yaml says
        assert effective["runtime_options"]["INFERENCE_NUM_THREADS"] == str(options["INFERENCE_NUM_THREADS"])


def test_tuning_none_keeps_the_build_settings(default_run):
    _, run_dir, _ = default_run
    report = read_report(run_dir)
    assert report["tuning"] == {"ran": False, "level": "none",
                                "reason": "tuning=none: the build's runtime settings are kept"}
    assert not (run_dir / "stages" / "tune" / "runtime.yaml").exists()


def test_a_gpu_target_that_falls_back_is_not_tuned(tuning_jobs):
    pytest.importorskip("MNN")
    result, run_dir = tuning_jobs["gpu"]
    assert result.returncode == 4, result.stdout + result.stderr  # verify reports the fallback
    tuned = read_report(run_dir)["tuning"]
    assert not tuned["ran"] and tuned["reason"].startswith("OPENCL did not run (CPU did)")


def test_throughput_objective_uses_concurrent_requests(tuning_jobs):
    result, run_dir = tuning_jobs["throughput"]
    assert result.returncode == 0, result.stdout + result.stderr
    tuned = read_report(run_dir)["tuning"]
    assert tuned["space"][0]["option"] == "PERFORMANCE_HINT"
    measured = [t["measurement"] for t in tuned["trials"] if t["measurement"]]
    assert all(m["throughput"] > 0 and m["requests"] >= 1 for m in measured)
    hinted = next(t for t in tuned["trials"] if t["changes"].get("PERFORMANCE_HINT") == "THROUGHPUT")
    assert hinted["measurement"]["requests"] > 1  # OpenVINO's optimal number of requests on 2+ cores


@pytest.fixture(scope="module")
def openvino_bundle(tuning_jobs):
    result, run_dir = tuning_jobs["openvino"]
    assert result.returncode == 0, result.stdout + result.stderr
    return single_bundle(run_dir)


def loaded(module: str, bundle: Path, feeds):
    import importlib

    backend = importlib.import_module(module)
    session = backend.load(bundle, yaml.safe_load((bundle / "runtime.yaml").read_text()))
    return session.effective()["compile_cache"], session.run(feeds)


@pytest.mark.parametrize("field,value,reason", [
    ("versions", {"openvino": "2020.1"}, "stale: built with openvino 2020.1 -> "),
    ("fingerprint", "0000000000000000", "stale: built on another machine"),
    ("options_sha256", "0", "stale: built for other runtime options"),
    ("artifact_sha256", "0" * 64, "stale: built for another model")])
def test_stale_compile_cache_falls_back_to_compiling(openvino_bundle, tmp_path, field, value, reason):
    feeds = {"input": digits_inputs(1)[0]}
    status, expected = loaded("pipeline.backends.openvino", openvino_bundle, feeds)
    assert status == "hit"
    copy = tmp_path / "bundle"
    shutil.copytree(openvino_bundle, copy)
    key_file = copy / compile_cache.FOLDER / compile_cache.KEY_FILE
    key = json.loads(key_file.read_text())
    key[field] = value
    key_file.write_text(json.dumps(key))
    status, outputs = loaded("pipeline.backends.openvino", copy, feeds)
    assert status.startswith(reason), status
    np.testing.assert_array_equal(outputs["logits"], expected["logits"])
    assert sorted(p.name for p in (copy / compile_cache.FOLDER).iterdir()) == \
        sorted(p.name for p in (openvino_bundle / compile_cache.FOLDER).iterdir())  # the bundle is never written


def test_startup_measures_cold_and_warm_loads(openvino_bundle):
    from pipeline.worker import BackendWorker

    settings = yaml.safe_load((openvino_bundle / "runtime.yaml").read_text())
    with BackendWorker("pipeline.backends.openvino", openvino_bundle, settings, label="ov") as worker:
        result = worker.startup({"warm": settings, "cold": compile_cache.without_cache(settings)},
                                {"input": digits_inputs(1)[0]}, 2)
    assert result["compile_cache"] == {"warm": "hit", "cold": "none"}
    assert set(result["seconds"]) == {"warm", "cold"} and all(v > 0 for v in result["seconds"].values())


def test_report_shows_cold_and_warm_startup(openvino_bundle):
    report = json.loads((openvino_bundle / "report.json").read_text())
    startup = report["profile"]["startup"]
    assert startup["compile_cache"] == "hit" and startup["rounds"] == 1  # profile.startup_rounds' default
    assert startup["cold_s"] > 0 and startup["warm_s"] > 0 and startup["speedup"] > 0
    assert "ms with the compile cache (hit)" in (openvino_bundle / "report.md").read_text()


# -- the search itself, on measurements given as data


def fixed(times: dict, spread: float = 0.0):
    """A measure function from {changes as sorted tuple: ms}."""
    def measure(changes):
        ms = times[tuple(sorted(changes.items()))]
        if ms is None:
            raise RuntimeError("the runtime refused this setting")
        return {"median_ms": ms, "p25_ms": ms - spread / 2, "p75_ms": ms + spread / 2}
    return measure


def test_search_descends_one_option_at_a_time():
    space = [("threads", [0, 1, 2]), ("level", ["all", "basic"])]
    times = {(): 10.0, (("threads", 1),): 8.0, (("threads", 2),): 6.0,
             (("level", "basic"), ("threads", 2)): 5.0}
    search = tuning.Search(space, fixed(times), noise=0.0, passes=1)
    trials = search.run()
    assert [t.changes for t in trials] == [{}, {"threads": 1}, {"threads": 2}, {"threads": 2, "level": "basic"}]
    assert tuning.ranked(trials, 0.0)[0].changes == {"threads": 2, "level": "basic"}
    assert search.planned() == 4


def test_search_ties_go_to_the_simpler_setting():
    space = [("threads", [0, 1])]
    trials = tuning.Search(space, fixed({(): 10.0, (("threads", 1),): 9.8}), noise=0.03, passes=1).run()
    assert tuning.best(trials, 0.03).changes == {}  # 2 % faster is noise at 3 %
    assert tuning.best(trials, 0.01).changes == {"threads": 1}
    wide = tuning.Search(space, fixed({(): 10.0, (("threads", 1),): 9.0}, spread=2.0), noise=0.0, passes=1).run()
    assert tuning.best(wide, 0.0).changes == {}  # within the best's interquartile range


def test_search_records_a_setting_that_cannot_run():
    space = [("threads", [0, 1, 2])]
    trials = tuning.Search(space, fixed({(): 10.0, (("threads", 1),): None, (("threads", 2),): 7.0}), 0.0, 1).run()
    broken = next(t for t in trials if t.changes == {"threads": 1})
    assert not broken.ok and "refused" in broken.error
    assert [t.changes for t in tuning.ranked(trials, 0.0)] == [{"threads": 2}, {}]


def test_throughput_scores_invert():
    assert tuning.score({"throughput": 500.0}) == pytest.approx(2.0)
    assert tuning.score({"median_ms": 3.0}) == 3.0


def test_untimed_sessions_never_spin_and_shipped_ones_follow_runtime_yaml(tmp_path):
    """Sessions parity runs only for their values (the reference among them) do not
    spin-wait; a target's session spins unless its runtime options say otherwise, and
    effective() reads back what ONNX Runtime holds."""
    from pipeline.backends import onnxruntime as ort_backend
    from stages import REFERENCE_MODULE, StageResult, reference_settings

    assert ort_backend.untimed_options().get_session_config_entry(ort_backend.SPINNING) == "0"
    model = Path(asset_path("digits_cnn.onnx"))
    shipped = ort_backend.Session(model)
    assert shipped.effective()["runtime_options"]["allow_spinning"] is True
    quiet = ort_backend.Session(model, options={"allow_spinning": False})
    assert quiet.effective()["runtime_options"]["allow_spinning"] is False
    assert REFERENCE_MODULE == ort_backend.__name__
    convert = StageResult(model.parent, {"model": model.name}, {})
    assert reference_settings(convert)["options"]["allow_spinning"] is False
    assert ("allow_spinning", [True, False]) in ort_backend.tuning_space({}, "normal", "latency", ["CPU"])


def test_jobs_side_by_side_share_the_cores_for_parity_own_work():
    from pipeline import environment
    from pipeline.backends.onnxruntime import untimed_options

    try:
        environment.share_cores(2)
        assert environment.own_threads() == max(1, environment.cores() // 2)
        assert untimed_options().intra_op_num_threads == environment.own_threads()
        environment.share_cores(10 ** 6)
        assert environment.own_threads() == 1
    finally:
        environment.share_cores(1)
    assert environment.own_threads() == environment.cores()
    assert untimed_options().intra_op_num_threads == 0  # alone: ONNX Runtime's default
