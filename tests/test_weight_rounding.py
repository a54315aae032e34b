"""Weight rounding (pipeline/precision/calibration/weight_rounding.py): int8 weights rounded against
the calibration inputs, on by default in int8 builds, switched off by
precision.weight_rounding=false, and each op's output error on its calibration inputs
smaller than round-to-nearest's on a real model."""

from __future__ import annotations

import json
import re

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper

from conftest import model_copy, run_cli, run_dirs, run_with_outputs
from pipeline.precision.calibration import bias_correction, weight_rounding

STAGES = "pipeline.stages=[convert,calibrate,build]"


def _conv(x: np.ndarray, w: np.ndarray, **attributes) -> np.ndarray:
    node = helper.make_node("Conv", ["x", "w"], ["y"], **attributes)
    graph = helper.make_graph([node], "conv", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, x.shape)],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


@pytest.mark.parametrize("attributes, channels, groups", [
    ({"pads": [1, 2, 1, 0], "strides": [2, 1], "dilations": [1, 2], "group": 2}, 4, 2),
    ({"pads": [1, 1, 1, 1], "group": 6}, 6, 6),  # depthwise
])
def test_columns_reproduce_the_convolution(attributes, channels, groups):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(1, channels, 9, 11)).astype(np.float32)
    w = rng.normal(size=(6, channels // groups, 3, 3)).astype(np.float32)
    expected = _conv(x, w, **attributes)
    columns = weight_rounding._conv_columns(x, attributes, w.shape, groups, 10**9)  # every position, in order
    per_group = w.reshape(groups, 6 // groups, -1)
    computed = np.concatenate([per_group[g] @ columns[g] for g in range(groups)], axis=0)
    assert np.allclose(computed.reshape(expected.shape), expected, atol=1e-4)


def test_columns_stride_the_positions_evenly():
    """At most about ``rows`` output positions per sample, picked on both axes: each picked
    column is the convolution's input patch at that position."""
    rng = np.random.default_rng(2)
    x = rng.normal(size=(1, 3, 10, 12)).astype(np.float32)
    w = rng.normal(size=(4, 3, 3, 3)).astype(np.float32)
    attributes = {"pads": [1, 1, 1, 1]}
    expected = _conv(x, w, **attributes)[0]  # [4, 10, 12]
    columns = weight_rounding._conv_columns(x, attributes, w.shape, 1, 14)  # 120 positions: every 3rd
    assert columns.shape == (1, 27, 4 * 4)  # every 3rd row and column of the 10x12 grid
    computed = (w.reshape(4, -1) @ columns[0]).reshape(4, 4, 4)
    assert np.allclose(computed, expected[:, ::3, ::3], atol=1e-4)


def test_compensated_rounding_lowers_the_output_error_on_correlated_inputs():
    rng = np.random.default_rng(1)
    inputs = rng.normal(size=(4096, 64)) @ rng.normal(size=(64, 64))  # correlated input channels
    weights = rng.normal(size=(1, 8, 64))
    scales = np.abs(weights).max(axis=2) / 127
    limits = np.full((1, 8), 127)
    hessian = (inputs.T @ inputs)[None]
    nearest = np.round(weights / scales[..., None])
    compensated = weight_rounding.compensated_rounding(weights, scales, limits, hessian)
    assert np.abs(compensated).max() <= 127 and not np.array_equal(compensated, nearest)

    def error(integers):
        return np.linalg.norm(inputs @ (weights[0] - integers[0] * scales[0][:, None]).T)

    assert error(compensated) < 0.85 * error(nearest)  # 0.76 measured


@pytest.fixture(scope="module")
def digits_builds(tmp_path_factory):
    """The embedded digits job built int8 with and without weight rounding (bias correction
    off in both, so the weights alone differ)."""
    cwd = tmp_path_factory.mktemp("rounding")
    runs = {}
    for switch in ("true", "false"):
        result = run_cli(["precision=int8", STAGES, "precision.bias_correction=false", "target=ort_cpu",
                          f"precision.weight_rounding={switch}"], cwd)
        assert result.returncode == 0, result.stdout + result.stderr
        runs[switch] = run_dirs(cwd)[-1]
    return runs


def _int8_weights(run) -> dict:
    """op -> (int8 weight, its scales on the DequantizeLinear's axis, the fp32 weight) of the
    built QDQ model."""
    built = onnx.load(str(run / "stages" / "build" / "model.onnx"))
    prepared = onnx.load(str(run / "stages" / "calibrate" / "prepared.onnx"))
    ops, _ = bias_correction.quantized_ops(built, prepared)
    constants = {t.name: numpy_helper.to_array(t) for t in built.graph.initializer}
    found = {}
    for op in ops:
        weight = numpy_helper.to_array(op.float_weight)
        axis = next((a.i for a in op.weight_dq.attribute if a.name == "axis"), 1)
        shape = [1] * weight.ndim
        shape[axis] = -1
        found[op.node.name] = (constants[op.weight_dq.input[0]], constants[op.weight_dq.input[1]].reshape(shape), weight)
    return found


def test_int8_build_rounds_weights_by_default_and_records_them(digits_builds):
    summary = json.loads((digits_builds["true"] / "stages" / "build" / "result.json").read_text())
    rounding = summary["summary"]["quantization"]["weight_rounding"]
    assert rounding["enabled"] and rounding["applied"] and rounding["samples"] >= 8, rounding
    assert rounding["output_cosine"]["with"] > rounding["output_cosine"]["without"]
    assert set(rounding["ops"]) == {"conv1", "conv2", "conv3", "fc2"}
    # fc1 reads 2048 columns, one row a sample: 32 rows, under a thirty-second of its columns
    assert rounding["skipped"]["fc1"] == "weight rounding: 32 input rows for 2048 columns (round to nearest kept)"
    rounded, nearest = _int8_weights(digits_builds["true"]), _int8_weights(digits_builds["false"])
    for op, (values, scales, _) in rounded.items():
        assert np.array_equal(values, nearest[op][0]) == (op == "fc1"), op
        assert np.array_equal(scales, nearest[op][1]), op  # the grid stays the build's own


def test_switched_off_rounds_to_nearest(digits_builds):
    summary = json.loads((digits_builds["false"] / "stages" / "build" / "result.json").read_text())
    assert summary["summary"]["quantization"]["weight_rounding"] == {"enabled": False}
    for op, (values, scales, weight) in _int8_weights(digits_builds["false"]).items():
        assert np.array_equal(values, np.round(weight / scales)), op


@pytest.fixture(scope="module")
def classifier(classifier_qdq):
    return classifier_qdq


def _weight_only_errors(prepared, quantized, samples) -> dict:
    """Per Conv: squared error of its output with the built int8 weight against the fp32
    weight, both fed the fp32 model's own input activations (ONNX Runtime, no Q/DQ on x)."""
    ops, _ = bias_correction.quantized_ops(quantized, prepared)
    convs = [op for op in ops if op.node.op_type == "Conv"]
    activations = run_with_outputs(prepared, list(dict.fromkeys(op.source for op in convs)), samples)
    constants = {t.name: numpy_helper.to_array(t) for t in quantized.graph.initializer}
    errors = {}
    for op in convs:
        attributes = {a.name: helper.get_attribute_value(a) for a in op.node.attribute}
        weight = numpy_helper.to_array(op.float_weight)
        scales = constants[op.weight_dq.input[1]].reshape(-1, 1, 1, 1)
        difference = weight - constants[op.weight_dq.input[0]].astype(np.float32) * scales
        errors[op.node.name] = sum(float(np.square(_conv(values[op.source], difference, **attributes)).sum())
                                   for values in activations)
    return errors


def test_each_convolution_errs_less_than_round_to_nearest_on_the_classifier(classifier):
    prepared, quantized, samples = classifier
    rounded = model_copy(quantized)
    summary = weight_rounding.round_weights(rounded, prepared, samples, only_if_closer=False)
    assert summary["applied"] and len(summary["ops"]) >= 50, summary
    before = _weight_only_errors(prepared, quantized, samples)
    after = _weight_only_errors(prepared, rounded, samples)
    better = [op for op in before if after[op] < before[op]]
    assert len(better) >= 0.9 * len(before), {op: (before[op], after[op]) for op in before if op not in better}
    assert sum(after.values()) < 0.7 * sum(before.values())


def test_kept_only_when_the_output_gets_closer_to_fp32(classifier):
    prepared, quantized, samples = classifier
    model = model_copy(quantized)
    summary = weight_rounding.round_weights(model, prepared, samples)
    cosine = summary["output_cosine"]
    assert summary["applied"] == (cosine["with"] > cosine["without"])
    assert (model.SerializeToString() != quantized.SerializeToString()) == summary["applied"]


def test_the_same_qdq_model_is_rounded_once_and_reused_on_another_target(tmp_path):
    """ort_cpu and ncnn_cpu build the same QDQ model from the same data (ncnn given ONNX
    Runtime's pass-through ops): the second job takes the first one's rounding from the stage
    cache (its own folder's), byte for byte, and says so."""
    jobs = {}
    for target, placement in (("ort_cpu", []), ("ncnn_cpu", ["precision.passthrough_ops=[Relu,MaxPool,Resize,Concat]"])):
        result = run_cli(["precision=int8", STAGES, f"target={target}", *placement], tmp_path, shared_cache=False)
        assert result.returncode == 0, result.stdout + result.stderr
        jobs[target] = (run_dirs(tmp_path)[-1], (run_dirs(tmp_path)[-1] / "parity.log").read_text())
    (first, first_log), (second, second_log) = jobs["ort_cpu"], jobs["ncnn_cpu"]
    assert "weight rounding kept" in first_log and "reused from the cache" not in first_log
    assert re.search(r"weight rounding kept \(.*, reused from the cache\)", second_log), second_log
    results = [json.loads((run / "stages" / "build" / "result.json").read_text()) for run in (first, second)]
    # the refined Q/DQ model each build keeps for verify's advice (before its Relus are folded)
    quantized = [(run / "stages" / "build" / result["files"]["qdq"]).read_bytes()
                 for run, result in zip((first, second), results)]
    assert quantized[0] == quantized[1]
    summaries = [result["summary"]["quantization"] for result in results]
    assert summaries[0]["weight_rounding"] == summaries[1]["weight_rounding"]
    assert summaries[1]["weight_rounding"]["applied"]


def test_without_a_cache_the_rounding_leaves_no_memo_folder_in_the_run(tmp_path):
    result = run_cli(["precision=int8", STAGES, "target=ort_cpu", "pipeline.cache=false"], tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    build = run_dirs(tmp_path)[-1] / "stages" / "build"
    assert "weight rounding kept" in (build.parent.parent / "parity.log").read_text()
    assert not [p.name for p in build.iterdir() if p.name.startswith("build-")], sorted(p.name for p in build.iterdir())
