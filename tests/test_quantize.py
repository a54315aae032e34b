"""Mixed QDQ models derived from the all-int8 model (pipeline.precision.quantize.keep_in_float) are
the models ONNX Runtime's quantizer builds with the same ops excluded: same Q/DQ pairs in
the same places, bit-identical outputs."""

from __future__ import annotations

import itertools

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from pipeline.precision.quantize import MixedModels, QdqSettings, keep_in_float, quantize_static_qdq

WEIGHTED = ("A", "B", "C", "D", "E")


def _branchy_model() -> onnx.ModelProto:
    """Conv A -> Relu feeds two branches: Conv B -> Conv C (int8 op straight into int8 op)
    and Conv D; Add -> pool -> Gemm E, whose result is the graph output."""
    rng = np.random.default_rng(0)

    def weight(name, *shape):
        return numpy_helper.from_array(rng.normal(0, 0.3, shape).astype(np.float32), name)

    inits = [weight("wa", 8, 3, 3, 3), weight("ba", 8), weight("wb", 8, 8, 1, 1), weight("bb", 8),
             weight("wc", 8, 8, 3, 3), weight("bc", 8), weight("wd", 8, 8, 1, 1), weight("bd", 8),
             weight("we", 8, 4), weight("be", 4)]
    nodes = [
        helper.make_node("Conv", ["x", "wa", "ba"], ["a"], name="A", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["a"], ["r"], name="relu"),
        helper.make_node("Conv", ["r", "wb", "bb"], ["b"], name="B"),
        helper.make_node("Conv", ["b", "wc", "bc"], ["c"], name="C", pads=[1, 1, 1, 1]),
        helper.make_node("Conv", ["r", "wd", "bd"], ["d"], name="D"),
        helper.make_node("Add", ["c", "d"], ["s"], name="add"),
        helper.make_node("GlobalAveragePool", ["s"], ["p"], name="pool"),
        helper.make_node("Flatten", ["p"], ["f"], name="flatten"),
        helper.make_node("Gemm", ["f", "we", "be"], ["logits"], name="E"),
    ]
    graph = helper.make_graph(nodes, "branchy", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 16, 16])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 4])], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def _table(model: onnx.ModelProto, feeds) -> dict:
    """Observed ranges of every activation, as the calibrate stage writes them."""
    names = ["x"] + [out for node in model.graph.node for out in node.output]
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    del probe.graph.output[:]
    probe.graph.output.extend(helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in names)
    values = ort.InferenceSession(probe.SerializeToString(), providers=["CPUExecutionProvider"]).run(names, feeds)
    return {n: {"threshold": float(np.abs(v).max()), "min": float(v.min()), "max": float(v.max())}
            for n, v in zip(names, values)}


def _placement(model: onnx.ModelProto):
    """Which inputs of each compute op come through a DequantizeLinear, and the Q/DQ counts."""
    producer = {out: node for node in model.graph.node for out in node.output}
    inputs = sorted((node.name, tuple(producer[i].op_type == "DequantizeLinear" if i in producer else False
                                      for i in node.input))
                    for node in model.graph.node if node.op_type not in ("QuantizeLinear", "DequantizeLinear"))
    counts = [sum(node.op_type == kind for node in model.graph.node) for kind in ("QuantizeLinear", "DequantizeLinear")]
    return inputs, counts


def _run(model: onnx.ModelProto, feeds) -> np.ndarray:
    onnx.checker.check_model(model)
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]


SETTINGS = [QdqSettings(), QdqSettings(quantize_outputs=False), QdqSettings(activations="int8", per_channel=False)]


@pytest.mark.parametrize("settings", SETTINGS, ids=["uint8-outputs", "inputs-only", "int8-per-tensor"])
def test_derived_mixed_models_are_the_quantizers_own(settings):
    model = _branchy_model()
    feeds = {"x": np.random.default_rng(1).normal(0, 1, (1, 3, 16, 16)).astype(np.float32)}
    table = _table(model, feeds)
    all_int8 = quantize_static_qdq(model, table, settings)
    for size in range(1, len(WEIGHTED) + 1):
        for float_ops in itertools.combinations(WEIGHTED, size):
            derived = keep_in_float(all_int8, model, float_ops, settings)
            built = quantize_static_qdq(model, table, settings, keep_float=float_ops)
            assert _placement(derived) == _placement(built), float_ops
            np.testing.assert_array_equal(_run(derived, feeds), _run(built, feeds))
    everything_float = keep_in_float(all_int8, model, WEIGHTED, settings)
    assert _placement(everything_float)[1] == [0, 0]
    np.testing.assert_allclose(_run(everything_float, feeds), _run(model, feeds), rtol=1e-6)
    assert len(all_int8.graph.node) > len(model.graph.node)  # the derivation copied, never edited it


def test_quantizer_builds_mixed_models_itself_when_it_fuses_ops():
    """With Relu quantized the quantizer folds it into a QuantizeLinear: no derivation."""
    model = _branchy_model()
    feeds = {"x": np.random.default_rng(2).normal(0, 1, (1, 3, 16, 16)).astype(np.float32)}
    table = _table(model, feeds)
    settings = QdqSettings(quantize_ops=("Conv", "Gemm", "Relu"))
    mixed = MixedModels(model, table, settings).build(["B", "relu"])
    built = quantize_static_qdq(model, table, settings, keep_float=["B", "relu"])
    assert _placement(mixed) == _placement(built)
    assert "relu" in {node.name for node in mixed.graph.node}


def test_an_unknown_float_op_is_named():
    model = _branchy_model()
    feeds = {"x": np.zeros((1, 3, 16, 16), np.float32)}
    all_int8 = quantize_static_qdq(model, _table(model, feeds), QdqSettings())
    with pytest.raises(KeyError, match="Z"):
        keep_in_float(all_int8, model, ["Z"], QdqSettings())


def test_ops_of_kinds_finds_the_depthwise_convolutions_only():
    """depthwise: a Conv with more than one group of one input channel each; a plain and a
    grouped convolution are not, and an op type that is not quantized is left out."""
    from pipeline.precision.quantize import ops_of_kinds

    def conv(name, source, weight_shape, group):
        weight = numpy_helper.from_array(np.ones(weight_shape, np.float32), f"{name}_w")
        node = helper.make_node("Conv", [source, weight.name], [f"{name}_out"], name=name, group=group, pads=[1] * 4)
        return node, weight

    nodes, weights = zip(conv("plain", "x", [4, 4, 3, 3], 1), conv("grouped", "plain_out", [4, 2, 3, 3], 2),
                         conv("depthwise", "grouped_out", [4, 1, 3, 3], 4))
    graph = helper.make_graph(list(nodes), "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 8, 8])],
                              [helper.make_tensor_value_info("depthwise_out", TensorProto.FLOAT, None)],
                              initializer=list(weights))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    assert ops_of_kinds(model, ["depthwise"], ["Conv", "MatMul"]) == ["depthwise"]
    assert ops_of_kinds(model, ["depthwise"], ["MatMul"]) == [] and ops_of_kinds(model, [], ["Conv"]) == []
