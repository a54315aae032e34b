"""Squeeze-excite gates (EfficientNet's x * Sigmoid(excite conv)) quantized with the SiLUs on
ONNX Runtime's placement (pipeline/precision/passthrough.py swish_ops): ONNX Runtime runs them as
QLinearSigmoid and QLinearMul instead of dequantizing the block's tensor for a float Mul; a float
excite convolution takes its gate along. An EfficientNet-B0-like classifier at 224 as an AVX2
CPU: int8 0.99x -> 1.06-1.08x fp32 (ONNX Runtime's own quantizer 1.11-1.16x in the same timings)."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from conftest import ort_qdq_settings
from pipeline.precision.passthrough import float_neighbours, swish_ops
from pipeline.precision.quantize import MixedModels
from test_quantize import _table


def _se_block(gate: str = "Sigmoid") -> onnx.ModelProto:
    """x [1, 8, 16, 16] -> Conv -> SiLU -> squeeze (GlobalAveragePool -> Conv -> SiLU -> Conv ->
    ``gate``) -> excite Mul -> Conv -> y."""
    rng = np.random.default_rng(31)
    inits = [numpy_helper.from_array(rng.normal(0, 0.3, shape).astype(np.float32), name) for name, shape in
             (("w1", (16, 8, 3, 3)), ("wa", (4, 16, 1, 1)), ("ba", (4,)), ("wb", (16, 4, 1, 1)), ("bb", (16,)),
              ("w2", (8, 16, 1, 1)))]
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("Sigmoid", ["c"], ["cs"], name="silu_sigmoid"),
             helper.make_node("Mul", ["c", "cs"], ["h"], name="silu_mul"),
             helper.make_node("GlobalAveragePool", ["h"], ["p"], name="squeeze"),
             helper.make_node("Conv", ["p", "wa", "ba"], ["a"], name="reduce"),
             helper.make_node("Sigmoid", ["a"], ["as"], name="reduce_sigmoid"),
             helper.make_node("Mul", ["a", "as"], ["r"], name="reduce_mul"),
             helper.make_node("Conv", ["r", "wb", "bb"], ["g"], name="excite"),
             helper.make_node(gate, ["g"], ["gs"], name="gate"),
             helper.make_node("Mul", ["h", "gs"], ["e"], name="gate_mul"),
             helper.make_node("Conv", ["e", "w2"], ["y"], name="project")]
    graph = helper.make_graph(nodes, "se", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 16, 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 16, 16])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_the_gate_is_found_with_the_silus_and_a_float_excite_conv_takes_it_along():
    model = _se_block()
    found = swish_ops(model, ["Conv"])
    assert found == ["silu_sigmoid", "silu_mul", "reduce_sigmoid", "reduce_mul", "gate", "gate_mul"]
    assert swish_ops(_se_block("HardSigmoid"), ["Conv"])[-2:] == ["reduce_sigmoid", "reduce_mul"]  # no int8 HardSigmoid
    taken = float_neighbours(model, ["excite"], [], found)
    assert {"gate", "gate_mul"} <= taken and "project" not in taken


def test_onnx_runtime_runs_the_gate_in_int8(tmp_path):
    model = _se_block()
    feeds = {"x": np.random.default_rng(32).normal(0, 1, (1, 8, 16, 16)).astype(np.float32)}
    settings = ort_qdq_settings("Conv")
    built = MixedModels(model, _table(model, feeds), settings).build()
    settings.rewrite_for_runtime(built)
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    session = ort.InferenceSession(built.SerializeToString(), options, providers=["CPUExecutionProvider"])
    kinds = [n.op_type for n in onnx.load(options.optimized_model_filepath).graph.node]
    assert kinds.count("QLinearMul") == 3 and kinds.count("QLinearSigmoid") == 3 and "Mul" not in kinds, kinds
    expected = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    actual = session.run(None, feeds)[0]
    assert float(np.dot(actual.ravel(), expected.ravel()) /
                 (np.linalg.norm(actual) * np.linalg.norm(expected))) > 0.99
