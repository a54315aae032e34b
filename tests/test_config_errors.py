"""Config validation through the real CLI: each kind of mistake is exit code 2 with one
line naming the key and what is allowed, before any work starts.

The table of mistakes goes through `parity`'s entry point in one interpreter
(tests/cli_in_one_process.py: a process each took 40 s of CPU for the table); the first
mistake also runs as its own process of the console script, and must say the same."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import cli_env, parity_args, run_cli

CASES = [
    # (overrides, phrases the one-line message must contain)
    (["target.threadz=2"], ["target.threadz", "allowed keys: name, backend, device, threads, memory"]),
    (["+target.extra=1"], ["target.extra", "allowed keys"]),
    # backend options: each backend's own group, checked by its schema
    (["target=ncnn_cpu", "target.threadz=2"],
     ["target.threadz", "allowed keys: name, backend, device, threads, memory, ncnn"]),
    (["target.memory=tiny"], ["target.memory", "expected one of [default, low]"]),
    (["validation.max_memory_mb=0"], ["validation.max_memory_mb=0.0", ">= 1.0"]),
    (["target=openvino_cpu", "target.openvino.num_streams=2", "target.memory=low"],
     ["target.openvino.num_streams=2 and target.memory=low", "one stream"]),
    (["target=mnn_opencl", "target.mnn.memory_mode=texture"],
     ["target.mnn.memory_mode", "expected one of [auto, buffer, image]"]),
    (["target=ncnn_cpu", "target.ncnn.fp16_storag=false"],
     ["target.ncnn.fp16_storag", "allowed keys: device_index, fp16_storage, fp16_packed"]),
    (["target=ncnn_cpu", "target.ncnn.auto_masks=maybe"], ["target.ncnn.auto_masks", "not a valid bool"]),
    (["target=openvino_cpu", "target.openvino.performance_hint=fast"],
     ["target.openvino.performance_hint", "expected one of [latency, throughput]"]),
    (["target=openvino_cpu", "target.openvino.num_streams=0"], ["target.openvino.num_streams=0", ">= 1"]),
    (["target.mnn.memory_mode=image"], ["target.mnn", "applies to targets of backend mnn only"]),
    (["target=openvino_cpu", "target.ncnn.auto_masks=false"], ["target.ncnn", "backend ncnn only"]),
    (["target=ncnn_cpu", "target.backend=mnn"], ["target.ncnn", "backend ncnn only"]),
    (["target=mnn_cpu", "precision=int8", "precision.int8_where_faster=true"],
     ["precision.int8_where_faster", "mnn builds int8 with its own quantizer"]),
    # the flat keys of earlier versions: where each one lives now
    (["target.memory_mode=image"], ["target.memory_mode", "moved to target.mnn.memory_mode"]),
    (["target=ncnn_cpu", "target.fp16_storage=false"], ["target.fp16_storage", "moved to target.ncnn.fp16_storage"]),
    (["target=mnn_opencl", "target.mnn.memory_mode=image", "target.device=CPU"],
     ["target.mnn.memory_mode=image", "needs an MNN GPU device"]),
    (["precision=bf16"], ["precision=bf16", "ort_cpu", "allowed: fp32"]),
    (["precision=fp64"], ["precision=fp64", "no such config", "allowed: auto, bf16, fp16, fp32, int8, int8_dynamic, mixed"]),
    (["target=tpu"], ["target=tpu", "allowed: mnn_cpu, mnn_opencl, mnn_vulkan, ncnn_cpu, ncnn_vulkan, openvino_cpu, ort_cpu"]),
    (["model.path=???"], ["model.path", "a value is required"]),
    (["data.kind=video"], ["data.kind", "expected one of [tensors, images, random, custom, text]"]),
    (["data.path=null"], ["data.path", "required"]),
    (["target.threads=many"], ["target.threads", "many"]),
    (["pipeline.stages=[convert,deploy]"], ["pipeline.stages", "deploy", "allowed: convert, calibrate, sensitivity, build, tune, verify, profile, package"]),
    (["validation.min_cosine=high"], ["validation.min_cosine"]),
    # thresholds out of their range: the key, the value and the range
    (["validation.min_cosine=2"], ["validation.min_cosine=2.0", "out of range", "[-1.0, 1.0]"]),
    (["validation.max_abs_error=-0.5"], ["validation.max_abs_error=-0.5", ">= 0.0"]),
    (["validation.max_metric_drop=5"], ["validation.max_metric_drop=5.0", "[-1.0, 1.0]"]),
    (["validation.min_sqnr_db=nan"], ["validation.min_sqnr_db=nan", "not NaN"]),
    (["sensitivity.samples=0"], ["sensitivity.samples=0", ">= 1"]),
    (["validation.timing_processes=0"], ["validation.timing_processes=0", "out of range", ">= 1"]),
    (["+validation.outputs={logits:{min_cosine:1.5}}"], ["validation.outputs.logits.min_cosine=1.5", "[-1.0, 1.0]"]),
]


@pytest.fixture(scope="module")
def mistakes(tmp_path_factory):
    """Every case of the table run once, in one folder: (folder, [{code, stdout, stderr}])."""
    cwd = tmp_path_factory.mktemp("mistakes")
    runner = Path(__file__).with_name("cli_in_one_process.py")
    command = [sys.executable, str(runner), json.dumps([parity_args(overrides) for overrides, _ in CASES])]
    done = subprocess.run(command, cwd=cwd, env=cli_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    return cwd, json.loads(done.stdout)


@pytest.mark.parametrize("case", range(len(CASES)), ids=[" ".join(c[0]) for c in CASES])
def test_config_error_is_exit_2_with_one_line(mistakes, case):
    cwd, results = mistakes
    overrides, phrases = CASES[case]
    result = results[case]
    assert result["code"] == 2, result["stdout"] + result["stderr"]
    lines = [line for line in result["stderr"].splitlines() if line.strip()]
    assert len(lines) == 1, result["stderr"]
    assert lines[0].startswith("parity: config error:")
    for phrase in phrases:
        assert phrase in lines[0]
    assert "Traceback" not in result["stderr"] + result["stdout"]
    assert not list(cwd.glob("outputs/*/*/bundle")), "no work may start on a config error"


def test_a_mistake_in_its_own_process_says_the_same(mistakes, tmp_path):
    _, results = mistakes
    result = run_cli(CASES[0][0], tmp_path)
    assert (result.returncode, result.stdout, result.stderr) == \
        (results[0]["code"], results[0]["stdout"], results[0]["stderr"])


def test_help_lists_groups_and_options(tmp_path):
    result = run_cli(["--help"], tmp_path)
    assert result.returncode == 0
    for phrase in ("target: mnn_cpu, mnn_opencl, mnn_vulkan, ncnn_cpu, ncnn_vulkan, openvino_cpu, ort_cpu", "precision: auto, bf16, fp16, fp32, int8, int8_dynamic, mixed", "sensitivity: target, top_n", "model: digits", "data: digits, random"):
        assert phrase in result.stdout
    assert "parity_schema" not in result.stdout.split("== Config ==")[0]


def test_hydra_mode_probe_is_skipped_only_where_nothing_can_set_the_mode():
    from pipeline.app.cli import mode_is_known

    assert mode_is_known(["precision=int8", "-m", "target=ort_cpu,openvino_cpu", "hydra/launcher=joblib",
                          "hydra.launcher.n_jobs=2", "hydra.run.dir=out", "hydra.sweep.dir=sweep"])
    for argv in (["hydra.mode=MULTIRUN"], ["+hydra.mode=RUN"], ["--config-dir", "my_conf"], ["-cd", "my_conf"],
                 ["--config-dir=my_conf"], ["-cn", "mine"], ["hydra/sweeper=basic"]):
        assert not mode_is_known(argv), argv


def test_hydra_mode_set_by_an_override_still_makes_a_sweep(tmp_path):
    """hydra.mode=MULTIRUN without -m: Hydra's mode probe runs and the job is a sweep."""
    result = run_cli(["hydra.mode=MULTIRUN", "precision=fp32,mixed", "pipeline.stages=[convert]"], tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert len(list((tmp_path / "multirun").glob("*/*/precision=*"))) == 2, result.stdout
    modes = {p.read_text().count("mode: MULTIRUN") for p in (tmp_path / "multirun").glob("*/*/*/.hydra/hydra.yaml")}
    assert modes == {1}, modes
