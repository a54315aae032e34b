"""Out of memory (issue 28, item 6): data that cannot fit is refused before it is loaded
(exit 2 with the estimate and what fits), a MemoryError anywhere is exit 5 with what is
available, never an internal error."""

from __future__ import annotations

import onnx
import pytest
from omegaconf import OmegaConf
from onnx import TensorProto, helper

from conftest import run_cli

from pipeline.data import memory
from pipeline.data import TensorSpec
from pipeline.errors import ConfigError, ExitCode, environment_fault


def big_input_model(path):
    """x [1024, 262144] float32 (1 GiB a sample) -> ReduceMean -> y."""
    graph = helper.make_graph([helper.make_node("ReduceMean", ["x"], ["y"], name="mean", keepdims=0)], "big",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1024, 262144])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def _data(calibration, validation):
    return OmegaConf.create({"calibration_size": calibration, "validation_size": validation,
                             "calibration_cap": 500, "validation_cap": 2000})


def test_the_estimate_refuses_explicit_counts_and_warns_on_caps(caplog):
    spec = [TensorSpec("x", [65536, 1024], "float32")]
    gib = 2**30
    with pytest.raises(ConfigError, match=r"66.00 GiB in memory \(264 samples x 0.25 GiB .*about 32 samples fit in all"):
        memory.check(_data(64, 200), spec, available=16 * gib)
    memory.check(_data(8, 16), spec, available=16 * gib)  # 6 GiB of 8: fits
    memory.check(_data(None, None), spec, available=16 * gib)  # the caps might not fit: a warning only
    assert "data.validation_cap" in caplog.text
    with pytest.raises(ConfigError):  # one sample does not fit: refused whatever the counts
        memory.check(_data(None, None), spec, available=gib // 4)


def test_a_memory_error_is_an_environment_fault():
    fault = environment_fault(RuntimeError("while stacking"), None) or environment_fault(
        MemoryError("Unable to allocate 64.0 GiB"))
    assert fault.exit_code == ExitCode.ENVIRONMENT and "out of memory" in str(fault) and "64.0 GiB" in str(fault)
    wrapped = RuntimeError("stage verify failed")
    wrapped.__cause__ = MemoryError()
    assert environment_fault(wrapped).exit_code == ExitCode.ENVIRONMENT


def test_a_run_whose_data_cannot_fit_is_refused_before_loading(tmp_path):
    """264 samples of 1 GiB: more than half the memory of any machine this runs on."""
    model = big_input_model(tmp_path / "big.onnx")
    assert memory.available_memory_bytes() is not None, "the estimate reads /proc/meminfo (Linux)"
    result = run_cli([f"model.path={model}", "data=random", "data.calibration_size=64", "data.validation_size=200",
                      "metric=none", "precision=fp32"], tmp_path, timeout=120)
    assert result.returncode == ExitCode.USAGE, result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("parity:")]
    assert len(lines) == 1 and "264.00 GiB in memory" in lines[0] and "samples fit in all" in lines[0]
