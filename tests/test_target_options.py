"""Backend options as structured configs: each target config carries only its backend's
group (target.ncnn.*, target.mnn.*, target.openvino.*), the schema of that group checks
it, and the options reach the runtime."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from conftest import composed, run_cli
from pipeline import backends
from pipeline.config import schemas, validation
from pipeline.app.cli import CONFIG_DIR

GROUPS = {"onnxruntime": None, "openvino": "openvino", "ncnn": "ncnn", "mnn": "mnn"}
TARGETS = sorted(path.stem for path in (Path(CONFIG_DIR) / "target").glob("*.yaml"))


@pytest.mark.parametrize("name", TARGETS)
def test_each_target_validates_to_its_backends_schema_with_only_its_group(name):
    run = validation.validate(composed(f"target={name}", "precision=fp32"))
    backend = run.target.backend
    assert type(run.target) is schemas.TARGET_SCHEMAS[backend]
    groups = {key for key in vars(run.target) if key in {"ncnn", "mnn", "openvino"}}
    assert groups == ({GROUPS[backend.value]} if GROUPS[backend.value] else set())


def test_cfg_job_shows_only_the_options_that_apply(tmp_path):
    shown = {}
    for name in ("ort_cpu", "ncnn_vulkan", "mnn_opencl", "openvino_cpu"):
        result = run_cli([f"target={name}", "--cfg", "job"], tmp_path, default_precision=None)
        assert result.returncode == 0, result.stderr
        shown[name] = yaml.safe_load(result.stdout)["target"]
    assert set(shown["ort_cpu"]) == {"name", "backend", "device", "threads", "memory"}
    assert set(shown["ncnn_vulkan"]) == {"name", "backend", "device", "threads", "memory", "ncnn"}
    assert shown["ncnn_vulkan"]["ncnn"]["device_index"] == 0 and shown["ncnn_vulkan"]["ncnn"]["auto_masks"] is True
    assert shown["mnn_opencl"]["mnn"] == {"memory_mode": "auto", "tuning": "none", "precision": None}
    assert shown["openvino_cpu"]["openvino"] == {"performance_hint": None, "num_streams": None}


def test_the_memory_mode_is_the_mnn_groups_and_auto_elsewhere():
    mnn = validation.validate(composed("target=mnn_opencl", "precision=fp32", "target.mnn.memory_mode=image"))
    ort = validation.validate(composed("target=ort_cpu", "precision=fp32"))
    assert (mnn.target.memory_mode, ort.target.memory_mode) == ("image", "auto")
    assert backends.spec("mnn").session_options(mnn.target, "fp32")["memory_mode"] == "image"


def test_ncnn_switches_reach_the_runtime_options():
    run = validation.validate(composed("target=ncnn_vulkan", "precision=fp16", "target.ncnn.fp16_arithmetic=false",
                                   "target.ncnn.device_index=1", "target.ncnn.auto_masks=false"))
    options = backends.spec("ncnn").runtime_options(run.target, "fp16")
    assert options["use_fp16_storage"] and not options["use_fp16_arithmetic"] and options["device_index"] == 1
    assert run.target.auto_masks is False
    assert validation.validate(composed("target=ncnn_cpu", "precision=fp16")).target.auto_masks is True
    assert validation.validate(composed("target=ort_cpu", "precision=fp32")).target.auto_masks is False


def test_openvino_hints_are_compiled_into_the_model(tmp_path):
    """The options group reaches OpenVINO itself: the compiled model reports them back."""
    result = run_cli(["target=openvino_cpu", "precision=fp32", "target.openvino.performance_hint=throughput",
                      "target.openvino.num_streams=2", "pipeline.stages=[convert,build]"], tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    runtime = next(tmp_path.glob("outputs/*/*/stages/build/runtime.yaml"))
    settings = yaml.safe_load(runtime.read_text())
    assert settings["options"]["PERFORMANCE_HINT"] == "THROUGHPUT" and settings["options"]["NUM_STREAMS"] == 2
    read_back = backends.spec("openvino").load(runtime.parent, settings).effective()["runtime_options"]
    assert (read_back["PERFORMANCE_HINT"], read_back["NUM_STREAMS"]) == ("THROUGHPUT", "2")


def test_openvino_default_leaves_the_hints_to_openvino():
    run = validation.validate(composed("target=openvino_cpu", "precision=fp32"))
    assert run.target.openvino.performance_hint is None and run.target.openvino.num_streams is None
    assert OmegaConf.to_container(OmegaConf.structured(run.target))["openvino"] == {
        "performance_hint": None, "num_streams": None}


def test_a_target_config_of_your_own_extends_its_backends_schema(tmp_path):
    """A user's target yaml under --config-dir takes the backend's options through the
    schema it names in its defaults; without that line the one-line error says how."""
    (tmp_path / "target").mkdir()
    body = "name: my_ncnn\nbackend: ncnn\ndevice: CPU\nncnn:\n  auto_masks: false\n"
    (tmp_path / "target" / "my_ncnn.yaml").write_text(
        "defaults:\n  - /schema/target/ncnn@_here_\n  - _self_\n" + body)
    (tmp_path / "target" / "bare_ncnn.yaml").write_text(body)
    good = run_cli(["--config-dir", tmp_path, "target=my_ncnn", "--cfg", "job"], tmp_path, default_precision=None)
    assert good.returncode == 0, good.stderr
    options = yaml.safe_load(good.stdout)["target"]["ncnn"]
    assert options["auto_masks"] is False and options["fp16_storage"] is True  # the rest from the schema
    (tmp_path / "target" / "ncnn_nomasks.yaml").write_text(  # docs/sweeps.md: a shipped target, one option changed
        "defaults:\n  - ncnn_cpu\n  - _self_\nname: ncnn_nomasks\nncnn:\n  auto_masks: false\n")
    derived = run_cli(["--config-dir", tmp_path, "target=ncnn_nomasks", "--cfg", "job"], tmp_path,
                      default_precision=None)
    assert derived.returncode == 0, derived.stderr
    shown = yaml.safe_load(derived.stdout)["target"]
    assert (shown["name"], shown["backend"], shown["ncnn"]["auto_masks"]) == ("ncnn_nomasks", "ncnn", False)
    bare = run_cli(["--config-dir", tmp_path, "target=bare_ncnn", "--cfg", "job"], tmp_path, default_precision=None)
    assert bare.returncode == 2
    assert "defaults: [/schema/target/ncnn@_here_, _self_]" in bare.stderr
