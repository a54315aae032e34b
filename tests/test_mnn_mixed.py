"""precision=mixed on MNN: MNN's own quantizer with the qtable's ops named in its
skip_quant_op_names, and what ran read back from the built model (MNN tags the ops it
runs in int8): the qtable's ops in float, every other compute op in int8."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from conftest import read_report, run_cli, run_dirs, single_bundle
from pipeline.config.schemas import Backend, MnnTarget
from pipeline.errors import ConfigError

mnn = pytest.importorskip("pipeline.backends.mnn")
# skipped without the extra locally; in CI (which installs it) the tests run and fail
pytestmark = pytest.mark.skipif(not mnn.available()[0] and not os.environ.get("CI"),
                                reason="MNN is not installed: pip install 'parity[mnn]'")

ASSETS = Path(__file__).resolve().parents[1] / "pipeline" / "assets"
DIGITS = ASSETS / "digits_cnn.onnx"
DIGITS_COMPUTE = {"conv1", "conv2", "conv3", "fc1", "fc2"}  # the digits model's Conv and Gemm nodes


def calibration(count: int = 16):
    return [{"input": x[None]} for x in np.load(ASSETS / "digits.npz")["calibration/input"][:count]]


def ran(folder: Path, feeds) -> dict:
    """{ONNX node: ran in int8} for the compute ops of the built model.mnn, read back from
    MNN's per-op tags and named through the build's op map (tensors.json)."""
    onnx_of = json.loads((folder / "tensors.json").read_text())["ops"]
    return {onnx_of[name]: int8 for name, _, int8 in mnn.op_census(folder / "model.mnn", feeds) if name in onnx_of}


def test_build_int8_keeps_the_named_onnx_op_float(tmp_path):
    samples = calibration()
    target = MnnTarget(name="mnn_cpu", backend=Backend.mnn, device="CPU")
    files, settings = mnn.build_int8(DIGITS, tmp_path, target, samples, "kl", float_ops=["conv1"])
    quantization = settings["options"]["quantization"]
    assert quantization["float_ops"] == ["conv1"] and quantization["skip_quant_op_names"] == ["conv1_out"]
    assert ran(tmp_path, samples[0]) == {"conv1": False, "conv2": True, "conv3": True, "fc1": True, "fc2": True}
    session = mnn.load(tmp_path, {**settings, "device": "CPU"})
    session.run(samples[1])
    effective = session.effective()
    assert effective["precision"] == "mixed" and effective["layers"] == "fp32: 1, int8: 4"
    assert effective["float_ops"] == {"conv1": "Convolution"}
    assert sorted(effective["int8_ops"]) == ["conv2", "conv3", "fc1", "fc2"]


def test_ema_cannot_keep_ops_float_and_is_left_out():
    """Measured: MNN's EMA quantizer quantizes the ops skip_quant_op_names names."""
    assert mnn._candidates("auto", has_batchnorm=False, skipping=True)[0] == ["KL", "ADMM"]
    assert mnn._candidates("auto", has_batchnorm=False, skipping=False)[0] == ["KL", "ADMM", "EMA"]
    with pytest.raises(ConfigError, match="calibration.method=kl"):
        mnn._candidates("max", has_batchnorm=False, skipping=True)
    with pytest.raises(ConfigError, match="BatchNorm"):
        mnn._candidates("auto", has_batchnorm=True, skipping=True)


def test_cli_mixed_runs_the_qtable_op_float_and_the_rest_int8(tmp_path):
    result = run_cli(["target=mnn_cpu", "precision=mixed", "sensitivity=top_n", "sensitivity.top_n=1"], tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    (run_dir,) = run_dirs(tmp_path)
    float_ops = json.loads((run_dir / "stages" / "sensitivity" / "qtable.json").read_text())["float_ops"]
    assert len(float_ops) == 1 and set(float_ops) < DIGITS_COMPUTE
    report = read_report(run_dir)
    assert report["build"]["quantization"]["float_ops"] == float_ops
    effective = report["verify"]["effective"]
    assert effective["precision"] == "mixed" and set(effective["float_ops"]) == set(float_ops)
    assert sorted(effective["int8_ops"]) == sorted(DIGITS_COMPUTE - set(float_ops))
    assert not [c for c in report["verify"]["checks"] if c["check"] == "float_fallback"]
    assert {"fp32", "int8", "mixed"} <= set(report["verify"]["comparison"])  # FLOAT / INT8 / MIX
    # made by the build stage (plain int8 by MNN's own quantizer), loaded by verify: it builds none
    assert all((run_dir / "stages" / "build" / "baselines" / p / "model.mnn").is_file() for p in ("fp32", "int8"))
    assert not list((run_dir / "stages" / "verify").rglob("*.mnn"))
    # the shipped bundle, read back here from its own model.mnn
    bundle = single_bundle(run_dir)
    found = ran(bundle, calibration(1)[0])
    assert found == {op: op not in float_ops for op in DIGITS_COMPUTE}
