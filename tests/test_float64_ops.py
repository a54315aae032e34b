"""The float64 truth check's own Conv, ConvTranspose, MaxPool and BatchNormalization
(pipeline/verification/float64_ops.py) compute what ONNX Runtime computes in float32 and
what onnx.reference computes, on every attribute combination a CNN uses; a Paddle-style
BatchNormalization with ``momentum`` is normalized with its stored statistics."""

from __future__ import annotations

import importlib.resources
import itertools

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference.ops.op_conv import _conv_implementation

from pipeline.verification import float64_ops, truth


def _single_op(op: str, x: np.ndarray, initializers: dict, **attributes) -> onnx.ModelProto:
    node = helper.make_node(op, ["x", *initializers], ["y"], **attributes)
    graph = helper.make_graph([node], op, [helper.make_tensor_value_info("x", TensorProto.FLOAT, x.shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(v.astype(np.float32), k) for k, v in initializers.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)


def _ort(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x.astype(np.float32)})[0]


def _float64(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    """The op through the evaluator with parity's ops (ONNX Runtime has float64 MaxPool and
    BatchNormalization kernels, so run_float64 would not reach them)."""
    from onnx.reference import ReferenceEvaluator

    return ReferenceEvaluator(truth.float64_copy(model), new_ops=float64_ops.NEW_OPS).run(None, {"x": x})[0]


CONV_CASES = list(itertools.product([1, 2, 4], [(1, 1), (2, 2), (2, 1)], [(1, 1), (2, 2)],
                                    [(0, 0, 0, 0), (1, 1, 1, 1), (1, 0, 2, 1)], [(3, 3), (1, 1), (2, 3)]))


def test_conv_matches_onnx_reference_on_groups_strides_dilations_and_uneven_pads():
    rng = np.random.default_rng(0)
    for group, strides, dilations, pads, kernel in CONV_CASES:
        x, w, b = rng.standard_normal((2, 4, 9, 8)), rng.standard_normal((8, 4 // group, *kernel)), rng.standard_normal(8)
        expected = _conv_implementation(x, w, b, "NOTSET", list(dilations), group, list(kernel), list(pads),
                                        list(strides))
        found = float64_ops.conv2d(x, w, b, dilations, group, pads, strides)
        assert found.shape == expected.shape
        np.testing.assert_allclose(found, expected, rtol=0, atol=1e-12)


def test_conv_in_blocks_of_rows_equals_one_block(monkeypatch):
    rng = np.random.default_rng(1)
    x, w = rng.standard_normal((1, 8, 40, 30)), rng.standard_normal((16, 8, 3, 3))
    whole = float64_ops.conv2d(x, w, None, (1, 1), 1, (1, 1, 1, 1), (1, 1))
    monkeypatch.setattr(float64_ops, "COLUMN_BYTES", 8 * 8 * 9 * 30 * 3)  # three rows a block
    np.testing.assert_allclose(float64_ops.conv2d(x, w, None, (1, 1), 1, (1, 1, 1, 1), (1, 1)), whole, rtol=0, atol=1e-12)


@pytest.mark.parametrize("group", [1, 2])
def test_conv_transpose_matches_onnx_runtime(group):
    rng = np.random.default_rng(2)
    for strides, dilations, pads, kernel, output_padding in itertools.product(
            [(1, 1), (2, 2), (2, 1)], [(1, 1), (2, 1)], [(0, 0, 0, 0), (1, 1, 1, 1), (1, 0, 0, 1)],
            [(2, 2), (3, 3), (1, 2)], [(0, 0), (1, 0)]):
        if output_padding[0] >= strides[0]:
            continue
        x = rng.standard_normal((1, 4, 5, 4))
        initializers = {"w": rng.standard_normal((4, 3, *kernel)), "b": rng.standard_normal(3 * group)}
        model = _single_op("ConvTranspose", x, initializers, group=group, strides=list(strides),
                           dilations=list(dilations), pads=list(pads), output_padding=list(output_padding))
        expected, found = _ort(model, x), _float64(model, x)
        assert found.shape == expected.shape
        np.testing.assert_allclose(found, expected, rtol=0, atol=1e-4)


def test_max_pool_matches_onnx_runtime_with_ceil_mode_and_padding():
    """ceil_mode's last window that would start in the end padding is dropped, as ONNX Runtime does."""
    rng = np.random.default_rng(3)
    checked = 0
    for kernel, strides, dilations, pads, ceil_mode, size in itertools.product(
            [(2, 2), (3, 3), (2, 3)], [(1, 1), (2, 2), (3, 2)], [(1, 1), (2, 2)],
            [(0, 0, 0, 0), (1, 1, 1, 1), (1, 0, 0, 1)], [0, 1], [(7, 8), (9, 9), (10, 5)]):
        if any(pad >= k for pad, k in zip(pads, kernel + kernel)):
            continue
        x = rng.standard_normal((1, 2, *size))
        model = _single_op("MaxPool", x, {}, kernel_shape=list(kernel), strides=list(strides),
                           dilations=list(dilations), pads=list(pads), ceil_mode=ceil_mode)
        expected, found = _ort(model, x), _float64(model, x)
        assert found.shape == expected.shape, (kernel, strides, dilations, pads, ceil_mode, size)
        np.testing.assert_allclose(found, expected, rtol=0, atol=1e-6)
        checked += 1
    assert checked > 300


def test_batch_normalization_with_momentum_uses_its_stored_statistics():
    """onnx.reference's own BatchNormalization takes the batch's statistics when ``momentum``
    is set (opset 9-13, as Paddle exports it); ONNX Runtime takes the stored ones."""
    rng = np.random.default_rng(4)
    x = rng.uniform(0, 5, (2, 3, 6, 6))
    initializers = {"scale": rng.uniform(0.5, 2, 3), "bias": rng.standard_normal(3),
                    "mean": rng.standard_normal(3), "var": rng.uniform(0.1, 4, 3)}
    model = _single_op("BatchNormalization", x, initializers, epsilon=1e-5, momentum=0.9)
    expected, found = _ort(model, x), _float64(model, x)
    np.testing.assert_allclose(found, expected, rtol=1e-5, atol=1e-5)
    from onnx.reference import ReferenceEvaluator

    plain = ReferenceEvaluator(truth.float64_copy(model)).run(None, {"x": x})[0]
    assert np.abs(plain - expected).max() > 0.1  # the evaluator's own is the batch's statistics


def test_paddle_detector_float64_truth_agrees_with_its_float32_run():
    """PP-OCRv4 det (a Paddle export: BatchNormalization with momentum, ConvTranspose): its float64
    run agrees with ONNX Runtime's float32 one everywhere but float32 rounding."""
    path = importlib.resources.files("rapidocr_onnxruntime") / "models" / "ch_PP-OCRv4_det_infer.onnx"
    model = onnx.load(str(path))
    rng = np.random.default_rng(5)
    page = np.full((1, 3, 160, 160), 0.9, np.float32)  # dark lines on a light page
    for top in range(12, 150, 24):
        page[:, :, top:top + 10, 10:150] = rng.uniform(0, 0.4, (1, 3, 10, 140))
    x = (page - 0.5) / 0.5
    (exact,), engine = truth.run_float64(model, [{"x": x}])
    single = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0].ravel()

    def cosine(found):
        return found @ single / np.linalg.norm(found) / np.linalg.norm(single)

    assert engine == "onnx.reference float64" and cosine(exact[model.graph.output[0].name].ravel()) > 0.99999
    from onnx.reference import ReferenceEvaluator

    plain = ReferenceEvaluator(truth.float64_copy(model)).run(None, {"x": x.astype(np.float64)})[0].ravel()
    assert cosine(plain) < 0.99  # what the check compared with before
