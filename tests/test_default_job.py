"""The embedded default job end to end through the CLI, and the stage cache."""

from __future__ import annotations

import json
import tarfile

import yaml

from conftest import composed, read_report, run_cli, run_dirs, single_bundle
from pipeline.artifacts import sha256_file


def manifest_of(bundle):
    return json.loads((bundle / "manifest.json").read_text())


def test_default_job_packages_a_passing_bundle(default_run):
    cwd, run_dir, result = default_run
    assert "verdict: PASS (exit 0)" in result.stdout
    bundle = single_bundle(run_dir)
    assert bundle.name == "digits_cnn-ort_cpu-mixed"
    manifest = manifest_of(bundle)
    assert manifest["verdict"] == "pass"
    caches = {"compile_cache/key.json", "compile_cache/model.optimized.onnx"}  # ONNX Runtime's optimized graph
    assert set(manifest["files"]) == {"model.onnx", "runtime.yaml", "report.json", "report.md", "report.html",
                                      "reproduce.npz"} | caches
    assert set(manifest["caches"]) == caches
    for name, entry in manifest["files"].items():
        assert sha256_file(bundle / name) == entry["sha256"], name
    assert {"onnx", "onnxruntime", "openvino", "numpy", "python"} <= set(manifest["versions"])
    assert "flags" in manifest["cpu"]
    assert manifest["config"]["target"]["name"] == "ort_cpu"
    report = json.loads((bundle / "report.json").read_text())
    assert report["verdict"] == "pass"
    assert report["verify"]["task"]["target"] > 0.95  # the shipped digits CNN
    assert report["verify"]["samples"] == 200
    assert "PASS" in (bundle / "report.md").read_text()
    assert "<svg" in (bundle / "report.html").read_text()
    with tarfile.open(bundle.parent / f"{bundle.name}.tar.gz") as archive:
        names = sorted(archive.getnames())
    assert names == sorted(f"{bundle.name}/{n}" for n in list(manifest["files"]) + ["manifest.json"])
    assert (run_dir / "parity.log").read_text().count("stage verify") >= 1


MODEL_FILES = {".onnx", ".xml", ".bin", ".param", ".mnn"}  # every backend's model files


def test_verify_builds_nothing_the_build_stage_makes_its_baselines(default_run):
    """One way to build (issue 47): the fp32 and plain int8 builds verify runs beside the
    mixed one are the build stage's, listed in its result with their runtime.yaml and made
    as the artifact is; verify's folder holds no model, and the bundle none of them."""
    _, run_dir, _ = default_run
    build = run_dir / "stages" / "build"
    files = json.loads((build / "result.json").read_text())["files"]
    assert {role: name for role, name in files.items() if role.startswith("baseline_")} == {
        "baseline_fp32": "baselines/fp32/runtime.yaml", "baseline_int8": "baselines/int8/runtime.yaml"}
    shipped = yaml.safe_load((build / "runtime.yaml").read_text())
    for precision in ("fp32", "int8"):
        folder = build / "baselines" / precision
        runtime = yaml.safe_load((folder / "runtime.yaml").read_text())
        assert runtime["precision"] == precision and runtime["backend"] == shipped["backend"]
        assert set(runtime) == set(shipped) - {"compile_cache"}  # the artifact's settings, no compile cache
        assert runtime["files"] == ["model.onnx"] and (folder / "model.onnx").is_file()
    assert "QuantizeLinear" in op_types(build / "baselines" / "int8" / "model.onnx")
    # the int8 build's graph: its Relus folded into the Q/DQ before them, as the int8 build folds them
    assert "Relu" in op_types(run_dir / "stages" / "convert" / "model.onnx")
    assert "Relu" not in op_types(build / "baselines" / "int8" / "model.onnx")
    assert "QuantizeLinear" not in op_types(build / "baselines" / "fp32" / "model.onnx")
    assert not [p for p in (run_dir / "stages" / "verify").rglob("*") if p.suffix in MODEL_FILES]
    assert not [p for p in single_bundle(run_dir).rglob("*") if "baselines" in p.parts]
    comparison = read_report(run_dir)["verify"]["comparison"]
    sizes = {p: (build / "baselines" / p / "model.onnx").stat().st_size for p in ("fp32", "int8")}
    assert {p: comparison[p]["bytes"] for p in sizes} == sizes


def test_baselines_are_made_only_where_verify_runs():
    """The build stage makes a baseline only for a verify that runs: a build without verify
    costs no more, and only a build with baselines has them in its cache key."""
    from pipeline.config.validation import validate
    from stages import baselines, build

    def made(*overrides):
        run = validate(composed(*overrides))
        assert ("baselines" in build.key_config(run)) == bool(baselines(run))
        return baselines(run)

    assert made("precision=mixed") == ["fp32", "int8"]
    assert made("precision=int8") == ["fp32"]
    assert made("precision=fp32") == []
    assert made("precision=mixed", "pipeline.stages=[convert,calibrate,sensitivity,build,package]") == []


def op_types(path) -> set:
    import onnx

    return {node.op_type for node in onnx.load(str(path), load_external_data=False).graph.node}


def test_default_job_runs_the_whole_pipeline_and_shows_float_int8_mix(default_run):
    """The default is precision=mixed: calibration and the sensitivity stage really run, the
    build is int8 with the qtable's ops in float, and verify puts FLOAT / INT8 / MIX side by side."""
    _, run_dir, _ = default_run
    report = read_report(run_dir)
    statuses = {s["stage"]: s["status"] for s in report["stages"]}
    assert set(statuses.values()) == {"computed"}
    assert report["calibration"]["tensors"] > 0 and report["calibration"]["method"] == "auto"
    sensitivity = report["sensitivity"]
    assert sensitivity["int8"]["cosine"] >= sensitivity["expected_cos"] and sensitivity["skipped"]
    assert report["verify"]["effective"]["precision"] in ("int8", "mixed")  # an empty qtable runs plain int8
    assert report["build"]["quantization"]["quantized_ops"] == ["Conv", "ConvTranspose", "Gemm", "MatMul"]
    comparison = report["verify"]["comparison"]
    assert set(comparison) == {"fp32", "int8", "mixed"}
    assert all(row["cosine"] >= 0.995 and row["latency"]["median_ms"] > 0 for row in comparison.values())
    assert "| FLOAT |" in (run_dir / "report.md").read_text()


def test_default_job_at_fp32_leaves_nothing_in_the_temp_folder(tmp_path):
    # a TMPDIR longer than an AF_UNIX socket path allows: the fork server's socket goes to a
    # short folder of its own (pipeline/worker.py), the job runs, and nothing is left here
    temp = tmp_path / ("temp-" + "x" * 100)
    temp.mkdir()
    result = run_cli(["precision=fp32"], tmp_path, shared_cache=False, env={"TMPDIR": str(temp)})
    assert result.returncode == 0, result.stdout + result.stderr
    report = read_report(run_dirs(tmp_path)[-1])
    assert report["verify"]["effective"]["precision"] == "fp32"
    assert {s["stage"]: s.get("status") for s in report["stages"]}["verify"] == "computed"
    assert report["verify"]["task"]["target"] > 0.95
    # the backend workers end without the interpreter's teardown: their sessions' scratch goes first
    assert sorted(path.name for path in temp.iterdir()) == []


def test_second_run_reuses_stages_and_artifacts(default_run):
    cwd, first_dir, _ = default_run
    result = run_cli([], cwd, shared_cache=False, quick=False)
    assert result.returncode == 0, result.stderr
    second_dir = run_dirs(cwd)[-1]
    assert second_dir != first_dir
    statuses = {s["stage"]: s["status"] for s in read_report(second_dir)["stages"]}
    assert statuses == {"convert": "cached", "calibrate": "cached", "sensitivity": "cached", "build": "cached",
                        "tune": "cached", "verify": "cached", "profile": "cached", "package": "computed"}
    first, second = manifest_of(single_bundle(first_dir)), manifest_of(single_bundle(second_dir))
    for name in ("model.onnx", "runtime.yaml"):
        assert first["files"][name]["sha256"] == second["files"][name]["sha256"]


def test_changing_one_option_reruns_only_what_depends_on_it(default_run):
    cwd, _, _ = default_run
    # a verify threshold the search does not aim at; timed in full, as the default job was
    result = run_cli(["validation.min_sqnr_db=10"], cwd, shared_cache=False, quick=False)
    assert result.returncode == 0, result.stderr
    report = read_report(run_dirs(cwd)[-1])
    statuses = {s["stage"]: s["status"] for s in report["stages"]}
    assert statuses == {"convert": "cached", "calibrate": "cached", "sensitivity": "cached", "build": "cached",
                        "tune": "cached", "verify": "computed", "profile": "cached", "package": "computed"}
    # the first run stored every reference answer: this verify reads them and starts no reference worker
    assert report["verify"]["reference"] == {"from_store": report["verify"]["samples"], "run": 0}
    assert "the reference starts only if something asks" in (run_dirs(cwd)[-1] / "parity.log").read_text()
    result = run_cli(["target.threads=1"], cwd, shared_cache=False, quick=False)
    statuses = {s["stage"]: s["status"] for s in read_report(run_dirs(cwd)[-1])["stages"]}
    # the latency-aware search weighs ops by their cost with the target's own threads: recomputed too
    assert statuses == {"convert": "cached", "calibrate": "cached", "sensitivity": "computed", "build": "computed",
                        "tune": "computed", "verify": "computed", "profile": "computed", "package": "computed"}


def test_default_model_on_openvino(tmp_path):
    result = run_cli(["target=openvino_cpu"], tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    (run_dir,) = run_dirs(tmp_path)
    bundle = single_bundle(run_dir)
    assert {"model.xml", "model.bin"} <= set(manifest_of(bundle)["files"])
    report = read_report(run_dir)
    assert report["build"]["options"]["INFERENCE_PRECISION_HINT"] == "f32"  # never left to the CPU's default
    assert report["verify"]["effective"]["device"] == "CPU"
    assert report["verify"]["effective"]["precision"] in ("int8", "mixed")  # real int8 convolutions
    assert report["verify"]["verdict"] == "pass"


def test_threshold_failure_is_exit_3_and_still_packaged(default_run):
    cwd, _, _ = default_run
    result = run_cli(["validation.max_abs_error=1e-12"], cwd)
    assert result.returncode == 3, result.stdout + result.stderr
    assert "max abs error" in result.stdout
    run_dir = run_dirs(cwd)[-1]
    assert manifest_of(single_bundle(run_dir))["verdict"] == "fail"


def test_random_data_warns_in_report(tmp_path):
    result = run_cli(["data=random"], tmp_path)
    assert result.returncode == 0, result.stderr
    report = read_report(run_dirs(tmp_path)[-1])
    # no labels: the digits classifier's class scores are judged by their agreement with the reference
    task = report["verify"]["task"]
    assert task["metric"] == "top1" and task["labeled"] is False and task["reference"] == 1.0
    assert task["judged_as"] == "top-1 agreement with the reference (no labels)" and len(task["interval"]) == 2
    assert any("top-1 agreement with the reference (no labels), not accuracy" in w for w in report["warnings"])
    assert any("not representative" in w for w in report["warnings"])
    assert "not representative" in result.stdout


def test_python_dash_m_entry_point(tmp_path):
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "pipeline", "--cfg", "job"], cwd=tmp_path,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "backend: onnxruntime" in result.stdout


def test_per_output_threshold_override(default_run):
    cwd, _, _ = default_run
    result = run_cli(["+validation.outputs={logits:{max_abs_error:1e-12}}"], cwd)
    assert result.returncode == 3
    assert "output logits: max abs error" in result.stdout
    result = run_cli(["+validation.outputs={scores:{max_abs_error:1e-3}}"], cwd)
    assert result.returncode == 2
    assert "the model has no output 'scores'; outputs: logits" in result.stderr


def test_broken_cache_entry_is_recomputed_not_fatal(tmp_path):
    stages = "pipeline.stages=[convert,calibrate,sensitivity,build]"  # a broken entry and what follows it
    run_cli([stages], tmp_path, shared_cache=False)
    for result_json in (tmp_path / "outputs" / ".cache" / "convert").glob("*/result.json"):
        result_json.write_text("{ truncated")
    result = run_cli([stages], tmp_path, shared_cache=False)
    assert result.returncode == 0, result.stderr
    statuses = {s["stage"]: s["status"] for s in read_report(run_dirs(tmp_path)[-1])["stages"]}
    assert statuses["convert"] == "computed" and statuses["build"] == "cached"
    assert "ignoring broken stage cache entry" in result.stderr
    run_cli([stages], tmp_path, shared_cache=False)
    statuses = {s["stage"]: s["status"] for s in read_report(run_dirs(tmp_path)[-1])["stages"]}
    assert statuses["convert"] == "cached"  # the entry was replaced by the recomputed output
