"""pipeline/precision/calibration/input_means.py: a quantized op's per-channel mean error
read off its input's patch means equals what running the op twice (fp32 and with its
Q/DQ nodes, ONNX Runtime) measures, for the convolution geometries and matrix ops it
covers; the ops it does not cover still run."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from pipeline.data import Sample
from pipeline.precision.calibration import bias_correction, input_means, statistics, tables
from pipeline.precision.quantize import QdqSettings, quantize_static_qdq


def _weight(rng, name, shape):
    return numpy_helper.from_array(rng.normal(0, 0.3, shape).astype(np.float32), name)


def _geometries_model(rng) -> onnx.ModelProto:
    """Convolutions with stride 2 and uneven pads, dilation 2, depthwise and without bias, a
    ConvTranspose, then Gemm (transB) and MatMul: every shape of the patch means."""
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="strided", strides=[2, 2], pads=[0, 1, 2, 0]),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("Conv", ["r1", "w2"], ["c2"], name="dilated", dilations=[2, 2], pads=[2, 2, 2, 2]),
        helper.make_node("Conv", ["c2", "w3", "b3"], ["c3"], name="depthwise", group=8, pads=[1, 1, 1, 1]),
        helper.make_node("ConvTranspose", ["c3", "w4"], ["c4"], name="transposed", strides=[2, 2]),
        helper.make_node("GlobalAveragePool", ["c4"], ["pooled"]),
        helper.make_node("Flatten", ["pooled"], ["flat"]),
        helper.make_node("Gemm", ["flat", "w5", "b5"], ["g"], name="gemm", transB=1, alpha=0.5),
        helper.make_node("MatMul", ["g", "w6"], ["y"], name="matmul"),
    ]
    weights = [_weight(rng, "w1", (8, 3, 3, 3)), _weight(rng, "b1", (8,)), _weight(rng, "w2", (8, 8, 3, 3)),
               _weight(rng, "w3", (8, 1, 3, 3)), _weight(rng, "b3", (8,)), _weight(rng, "w4", (8, 4, 2, 2)),
               _weight(rng, "w5", (6, 4)), _weight(rng, "b5", (6,)), _weight(rng, "w6", (6, 5))]
    graph = helper.make_graph(nodes, "geometries", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                                   [1, 3, 17, 15])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 5])], weights)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return onnx.shape_inference.infer_shapes(model)


@pytest.fixture(scope="module")
def geometries(tmp_path_factory):
    rng = np.random.default_rng(5)
    prepared = _geometries_model(rng)
    path = tmp_path_factory.mktemp("means") / "prepared.onnx"
    onnx.save(prepared, str(path))
    samples = [{"x": rng.normal(0.2, 1.0, (1, 3, 17, 15)).astype(np.float32)} for _ in range(6)]
    stats = statistics.collect(path, [Sample(str(i), s) for i, s in enumerate(samples)], len(samples), 512, 8, 0)
    quantized = quantize_static_qdq(prepared, tables.build_table(stats.histograms, "max"), QdqSettings())
    return prepared, quantized, samples


def _shifts(prepared, quantized, samples, read_off: bool) -> dict:
    ops, _ = bias_correction.quantized_ops(quantized, prepared)
    if not read_off:
        original = input_means.PatchMeans.of
        input_means.PatchMeans.of = classmethod(lambda cls, op, constants: None)
    try:
        bias_correction.measure(ops, quantized, prepared, [samples[:3], samples[3:]])
    finally:
        if not read_off:
            input_means.PatchMeans.of = original
    return {op.node.name: (op.shift, op.means is not None) for op in ops}


def test_read_off_shifts_equal_the_ops_run_twice(geometries):
    prepared, quantized, samples = geometries
    read_off, ran = _shifts(*geometries, read_off=True), _shifts(*geometries, read_off=False)
    assert set(read_off) == {"strided", "dilated", "depthwise", "transposed", "gemm", "matmul"}
    covered = {name for name, (_, means) in read_off.items() if means}
    assert covered == {"strided", "dilated", "depthwise", "gemm", "matmul"}  # ConvTranspose still runs
    for name, (shift, _) in read_off.items():
        expected = ran[name][0]
        assert shift.shape == expected.shape, name
        assert np.allclose(shift, expected, rtol=1e-3, atol=1e-5 * np.abs(expected).max()), \
            (name, shift, expected)
        assert np.abs(expected).max() > 0, name  # a real error to read off


@pytest.mark.parametrize("start, stride, count, size, expected", [
    (-1, 1, 5, 5, [0, 1, 2, 3]), (-3, 2, 4, 5, [1, 3]), (2, 2, 3, 5, [2, 4]), (6, 1, 2, 5, []), (-4, 1, 2, 5, [])])
def test_visited_indices_are_those_inside_the_input(start, stride, count, size, expected):
    assert list(range(size))[input_means._visited(start, stride, count, size)] == expected
