"""Mixed QDQ models derived from the all-int8 model (pipeline.precision.quantize.keep_in_float) are
the models ONNX Runtime's quantizer builds with the same ops excluded: same Q/DQ pairs in
the same places, bit-identical outputs."""

from __future__ import annotations

import itertools
import math

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from pipeline.precision.passthrough import float_neighbours, passthrough_ranges
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


def _silu_model(gate: str = "Sigmoid") -> onnx.ModelProto:
    """YOLO's pattern: Conv -> SiLU (x * Sigmoid(x)) -> Conv -> SiLU -> MaxPool -> Conv, then a
    decode-like tail: a Sigmoid that is no SiLU and a Mul by a constant (float in every build).
    ``gate="HardSigmoid"``: MobileNetV3's HardSwish (x * HardSigmoid(x)) as ONNX Runtime's
    optimizer splits it, instead of the SiLUs."""
    rng = np.random.default_rng(3)
    gated = {"alpha": 1 / 6, "beta": 0.5} if gate == "HardSigmoid" else {}

    def weight(name, *shape):
        return numpy_helper.from_array(rng.normal(0, 0.3, shape).astype(np.float32), name)

    inits = [weight("w1", 8, 3, 3, 3), weight("w2", 8, 8, 3, 3), weight("w3", 4, 8, 1, 1),
             numpy_helper.from_array(np.float32(8.0), "stride")]
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
             helper.make_node(gate, ["c1"], ["g1"], name="sig1", **gated),
             helper.make_node("Mul", ["c1", "g1"], ["s1"], name="silu1"),
             helper.make_node("Conv", ["s1", "w2"], ["c2"], name="conv2", pads=[1, 1, 1, 1]),
             helper.make_node(gate, ["c2"], ["g2"], name="sig2", **gated),
             helper.make_node("Mul", ["g2", "c2"], ["s2"], name="silu2"),
             helper.make_node("MaxPool", ["s2"], ["p"], name="pool", kernel_shape=[2, 2], strides=[2, 2]),
             helper.make_node("Conv", ["p", "w3"], ["c3"], name="conv3"),
             helper.make_node("Sigmoid", ["c3"], ["scores"], name="scores_sigmoid"),
             helper.make_node("Mul", ["scores", "stride"], ["y"], name="scale")]
    graph = helper.make_graph(nodes, "silu", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 16, 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


PASSTHROUGH = ("Relu", "MaxPool", "Resize", "Concat")
SETTINGS = [QdqSettings(), QdqSettings(quantize_outputs=False), QdqSettings(activations="int8", per_channel=False),
            QdqSettings(passthrough_ops=PASSTHROUGH), QdqSettings(passthrough_ops=PASSTHROUGH, swish=True)]


@pytest.mark.parametrize("settings", SETTINGS,
                         ids=["uint8-outputs", "inputs-only", "int8-per-tensor", "passthrough", "passthrough-swish"])
def test_derived_mixed_models_are_the_quantizers_own(settings):
    for model, weighted, shape in [(_branchy_model(), WEIGHTED, (1, 3, 16, 16)),
                                   (_unet_like_model(), ("conv1", "conv2", "conv3"), (1, 3, 32, 32)),
                                   (_silu_model(), ("conv1", "conv2", "conv3"), (1, 3, 16, 16))]:
        feeds = {"x": np.random.default_rng(1).normal(0, 1, shape).astype(np.float32)}
        table = _table(model, feeds)
        all_int8 = quantize_static_qdq(model, table, settings)
        for size in range(1, len(weighted) + 1):
            for float_ops in itertools.combinations(weighted, size):
                derived = keep_in_float(all_int8, model, float_ops, settings)
                with_neighbours = sorted(settings.float_neighbours(model, float_ops))
                built = quantize_static_qdq(model, table, settings, keep_float=with_neighbours)
                assert _placement(derived) == _placement(built), float_ops
                if settings.swish and model.graph.name == "silu" and "pool" in with_neighbours \
                        and "conv3" not in float_ops:
                    # a pass-through op gone float before an int8 op: the derivation keeps the Q
                    # after it at the scale it shared in the all-int8 model, the quantizer gives it
                    # the op's own measured range (SiLU's negative tail, pooled away)
                    assert np.corrcoef(_run(derived, feeds).ravel(), _run(built, feeds).ravel())[0, 1] > 0.999
                    continue
                np.testing.assert_array_equal(_run(derived, feeds), _run(built, feeds))
        everything_float = keep_in_float(all_int8, model, weighted, settings)
        assert _placement(everything_float)[1] == [0, 0]
        np.testing.assert_allclose(_run(everything_float, feeds), _run(model, feeds), rtol=1e-5)
        assert len(all_int8.graph.node) > len(model.graph.node)  # the derivation copied, never edited it


def test_a_float_op_takes_its_passthrough_neighbours_along():
    """conv2 float: the MaxPool feeding it, its Relu, the Resize after that, the Concat they
    reach and the Relu feeding the Concat go float; conv1 and conv3 stay int8 and nothing
    between them and the float ops is requantized at the float op's boundary."""
    model = _unet_like_model()
    assert float_neighbours(model, ["conv2"], PASSTHROUGH) == {"conv2", "pool", "relu2", "up", "cat", "relu1"}
    assert float_neighbours(model, ["conv2"], ()) == {"conv2"}
    feeds = {"x": np.random.default_rng(6).normal(0, 1, (1, 3, 32, 32)).astype(np.float32)}
    table = _around_convs(_table(model, feeds), model)
    settings = QdqSettings(passthrough_ops=PASSTHROUGH)
    mixed = MixedModels(model, table, settings).build(["conv2"])
    producer = {out: node for node in mixed.graph.node for out in node.output}
    by_name = {node.name: node for node in mixed.graph.node}
    for name in ("pool", "relu2", "up", "cat"):  # they read float tensors
        assert producer[by_name[name].input[0]].op_type != "DequantizeLinear", name
    assert producer[by_name["conv3"].input[0]].op_type == "DequantizeLinear"  # conv3 still int8
    assert producer[by_name["conv1"].input[1]].op_type == "DequantizeLinear"
    assert np.corrcoef(_run(mixed, feeds).ravel(), _run(model, feeds).ravel())[0, 1] > 0.99


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


def _unet_like_model() -> onnx.ModelProto:
    """Conv -> Relu -> MaxPool -> Conv -> Relu -> Resize (sizes from a constant), concatenated
    with the first Relu's output (a U-Net skip) -> Conv: the chain ONNX Runtime keeps int8
    from Conv to Conv when the ops between are quantized too."""
    rng = np.random.default_rng(3)

    def weight(name, *shape):
        return numpy_helper.from_array(rng.normal(0, 0.3, shape).astype(np.float32), name)

    inits = [weight("w1", 8, 3, 3, 3), weight("b1", 8), weight("w2", 8, 8, 3, 3), weight("b2", 8),
             weight("w3", 4, 16, 3, 3), weight("b3", 4),
             numpy_helper.from_array(np.array([1, 8, 32, 32], np.int64), "sizes")]
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("MaxPool", ["r1"], ["p1"], name="pool", kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Conv", ["p1", "w2", "b2"], ["c2"], name="conv2", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c2"], ["r2"], name="relu2"),
        helper.make_node("Resize", ["r2", "", "", "sizes"], ["u2"], name="up", mode="linear"),
        helper.make_node("Concat", ["u2", "r1"], ["cat"], name="cat", axis=1),
        helper.make_node("Conv", ["cat", "w3", "b3"], ["y"], name="conv3", pads=[1, 1, 1, 1]),
    ]
    graph = helper.make_graph(nodes, "unet", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 32, 32])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 32, 32])], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def _around_convs(table: dict, model: onnx.ModelProto) -> dict:
    """Only the entries calibration measures: the inputs and outputs of the Convs."""
    around = {name for node in model.graph.node if node.op_type == "Conv" for name in [node.input[0], node.output[0]]}
    return {name: entry for name, entry in table.items() if name in around}


def test_passthrough_ranges_follow_from_the_convs_neighbours():
    model = _unet_like_model()
    feeds = {"x": np.random.default_rng(4).normal(0, 1, (1, 3, 32, 32)).astype(np.float32)}
    measured = _around_convs(_table(model, feeds), model)
    assert "r1" not in measured and "u2" not in measured
    table, unresolved = passthrough_ranges(model, measured, PASSTHROUGH)
    assert unresolved == []
    assert table["r1"]["min"] == 0.0 and table["r1"]["max"] == measured["c1"]["max"]  # a Relu from 0
    assert table["r2"]["derived_from"] == "c2" and table["u2"]["derived_from"] == "r2"
    assert measured == {name: table[name] for name in measured}  # measured entries are kept as they are
    everything = _table(model, feeds)  # r1 and r2 measured too: their own entries stay
    assert passthrough_ranges(model, everything, PASSTHROUGH)[0] == everything
    nothing, left = passthrough_ranges(model, {}, PASSTHROUGH)
    assert sorted(left) == ["cat", "pool", "relu1", "relu2", "up"] and nothing == {}


def test_passthrough_keeps_the_chain_int8_in_onnx_runtime(tmp_path):
    """With the pass-through ops quantized, ONNX Runtime's optimized graph concatenates int8
    (QLinearConcat), runs MaxPool on uint8 and no Relu (folded into the Q before it);
    without, all three run in float between dequantize and quantize. The outputs stay close
    to fp32 either way."""
    model = _unet_like_model()
    feeds = {"x": np.random.default_rng(5).normal(0, 1, (1, 3, 32, 32)).astype(np.float32)}
    table = _around_convs(_table(model, feeds), model)
    reference = _run(model, feeds)

    def optimized_ops(settings) -> list:
        quantized = quantize_static_qdq(model, table, settings)
        out = _run(quantized, feeds)
        assert np.corrcoef(out.ravel(), reference.ravel())[0, 1] > 0.99
        options = ort.SessionOptions()
        options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
        ort.InferenceSession(quantized.SerializeToString(), options, providers=["CPUExecutionProvider"])
        return [node.op_type for node in onnx.load(options.optimized_model_filepath).graph.node]

    weighted = optimized_ops(QdqSettings())
    passing = optimized_ops(QdqSettings(passthrough_ops=PASSTHROUGH))
    assert {"Relu", "MaxPool", "Concat"} <= set(weighted) and "QLinearConcat" not in weighted
    assert not {"Relu", "MaxPool", "Concat"} & set(passing) and "QLinearConcat" in passing  # MaxPool runs on uint8


def test_folding_the_relus_changes_no_output_and_leaves_no_requantization(tmp_path):
    """fold_relus: DQ -> Relu -> Q of the same scale after a Q clamping at zero is the identity;
    removed, the outputs are bit-identical and ONNX Runtime's optimized graph no longer
    dequantizes and requantizes conv1's output for its two readers (MaxPool and the Concat)."""
    from pipeline.precision.passthrough import fold_relus

    model = _unet_like_model()
    feeds = {"x": np.random.default_rng(6).normal(0, 1, (1, 3, 32, 32)).astype(np.float32)}
    quantized = quantize_static_qdq(model, _around_convs(_table(model, feeds), model),
                                    QdqSettings(passthrough_ops=PASSTHROUGH))
    folded = onnx.ModelProto()
    folded.CopyFrom(quantized)
    assert fold_relus(folded) == 2 and "Relu" not in {node.op_type for node in folded.graph.node}
    np.testing.assert_array_equal(_run(folded, feeds), _run(quantized, feeds))

    def dequantized_then_quantized(graph_model) -> int:
        options = ort.SessionOptions()
        options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
        ort.InferenceSession(graph_model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        graph = onnx.load(options.optimized_model_filepath).graph
        producer = {out: node for node in graph.node for out in node.output}
        return sum(node.op_type == "QuantizeLinear" and getattr(producer.get(node.input[0]), "op_type", "")
                   == "DequantizeLinear" for node in graph.node)

    assert dequantized_then_quantized(quantized) >= 1 and dequantized_then_quantized(folded) == 0


@pytest.mark.parametrize("gate", ["Sigmoid", "HardSigmoid"])
def test_silu_after_a_quantized_conv_runs_int8_and_the_decode_stays_float(gate):
    """With swish on, each x * Sigmoid(x) (or HardSwish's x * HardSigmoid(x)) after a quantized
    Conv has its gate and Mul read dequantized tensors (ONNX Runtime's QLinearSigmoid /
    QLinearMul; a HardSigmoid runs float between its pairs); the Sigmoid that is no SiLU and the
    Mul by a constant stay float; a float Conv takes the SiLUs on either side along."""
    from pipeline.precision.passthrough import swish_ops

    model = _silu_model(gate)
    assert swish_ops(model, ("Conv",)) == ["sig1", "silu1", "sig2", "silu2"]
    assert QdqSettings(swish=True).swish_ops(model) == ["sig1", "silu1", "sig2", "silu2"]
    mine = QdqSettings(quantize_ops=("Conv", "Sigmoid", "Mul"), swish=True)
    assert mine.swish_ops(model) == []  # the user's own placement rules
    # a SiLU after an op whose output stays float (a SwiGLU's gate MatMul) stays float too
    assert QdqSettings(quantize_ops=("MatMul",), float_output_ops=("MatMul",), swish=True).swish_after == ()
    feeds = {"x": np.random.default_rng(4).normal(0, 1, (1, 3, 16, 16)).astype(np.float32)}
    table = _table(model, feeds)
    settings = QdqSettings(passthrough_ops=PASSTHROUGH, swish=True)
    built = quantize_static_qdq(model, table, settings)
    producer = {out: node for node in built.graph.node for out in node.output}
    by_name = {node.name: node for node in built.graph.node}

    readers = {}
    for node in built.graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node.op_type)

    def dequantized(name: str) -> bool:  # what ONNX Runtime fuses into an int8 kernel: DQ -> op -> Q
        node = by_name[name]
        return all(producer[i].op_type == "DequantizeLinear" for i in node.input if i in producer) \
            and "QuantizeLinear" in readers.get(node.output[0], [])

    assert all(dequantized(name) for name in ("sig1", "silu1", "sig2", "silu2"))
    assert not dequantized("scale") and not dequantized("scores_sigmoid")
    assert settings.float_neighbours(model, ["conv2"]) == {"sig1", "silu1", "conv2", "sig2", "silu2", "pool"}
    plain = quantize_static_qdq(model, table, QdqSettings(passthrough_ops=PASSTHROUGH))
    assert sum(n.op_type == "QuantizeLinear" for n in plain.graph.node) < \
        sum(n.op_type == "QuantizeLinear" for n in built.graph.node)  # without swish the SiLU runs float
    assert np.corrcoef(_run(built, feeds).ravel(), _run(model, feeds).ravel())[0, 1] > 0.99


def test_an_op_bias_correction_gave_a_bias_goes_back_to_float_without_it():
    """keep_in_float on the refined all-int8 model (the mixed search's base): an op that had
    no bias and got one from bias correction is the prepared op again, with no bias."""
    from pipeline.precision.calibration import bias_correction

    rng = np.random.default_rng(1)
    weights = [numpy_helper.from_array(rng.normal(0, 0.5, shape).astype(np.float32), name)
               for name, shape in (("w1", (4, 1, 3, 3)), ("w2", (2, 4, 3, 3)))]
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w1"], ["a"], name="conv1", pads=[1, 1, 1, 1]),
         helper.make_node("Conv", ["a", "w2"], ["y"], name="conv2", pads=[1, 1, 1, 1])],
        "unbiased", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, 8, 8])], initializer=weights)
    prepared = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    prepared.ir_version = 8
    samples = [{"x": rng.uniform(0, 1, (1, 1, 8, 8)).astype(np.float32)} for _ in range(4)]

    def corrected(model):
        bias_correction.correct(model, prepared, samples)
        assert len({n.name: n for n in model.graph.node}["conv2"].input) == 3  # a bias was added
        return model

    mixed = MixedModels(prepared, _table(prepared, samples[0]), QdqSettings(), refine=corrected)
    model = mixed.build(["conv1", "conv2"])
    assert [list(n.input) for n in model.graph.node] == [list(n.input) for n in prepared.graph.node]
    assert np.array_equal(_run(model, samples[0]), _run(prepared, samples[0]))


def _narrow_convs_model(path):
    """Q/DQ model: input 16 ch -> conv_one (16 -> 1, 3x3, per-channel weights, int32 bias),
    conv_grouped (depthwise 16 -> 16), conv_three (16 -> 3, per-tensor weights, float bias),
    conv_twenty (16 -> 20) and conv_wide (16 -> 32), each through Q/DQ; outputs the maps."""
    rng = np.random.default_rng(0)
    consts = {"s": np.array(0.05, np.float32), "z": np.array(128, np.uint8), "zo": np.array(0, np.uint8)}
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["xd"])]
    outputs = []
    for name, cout, group, per_channel in (("conv_one", 1, 1, True), ("conv_grouped", 16, 16, True),
                                          ("conv_three", 3, 1, False), ("conv_twenty", 20, 1, True),
                                          ("conv_wide", 32, 1, True)):
        weights = rng.integers(-127, 128, (cout, 16 // group, 3, 3)).astype(np.int8)
        consts[f"{name}_w"] = weights
        consts[f"{name}_ws"] = np.full(cout, 0.004, np.float32) if per_channel else np.array(0.004, np.float32)
        consts[f"{name}_wz"] = np.zeros(cout, np.int8) if per_channel else np.array(0, np.int8)
        nodes.append(helper.make_node("DequantizeLinear", [f"{name}_w", f"{name}_ws", f"{name}_wz"], [f"{name}_wd"],
                                      axis=0))
        if per_channel:
            consts[f"{name}_b"] = rng.integers(-500, 500, cout).astype(np.int32)
            consts[f"{name}_bs"] = np.full(cout, 0.05 * 0.004, np.float32)
            nodes.append(helper.make_node("DequantizeLinear", [f"{name}_b", f"{name}_bs"], [f"{name}_bd"], axis=0))
        else:
            consts[f"{name}_bd"] = rng.normal(0, 0.5, cout).astype(np.float32)
        nodes += [helper.make_node("Conv", ["xd", f"{name}_wd", f"{name}_bd"], [f"{name}_out"], name=name,
                                   pads=[1, 1, 1, 1], group=group),
                  helper.make_node("QuantizeLinear", [f"{name}_out", "s", "zo"], [f"{name}_q"]),
                  helper.make_node("DequantizeLinear", [f"{name}_q", "s", "zo"], [f"{name}_y"])]
        outputs.append(helper.make_tensor_value_info(f"{name}_y", TensorProto.FLOAT, [1, cout, 24, 24]))
    graph = helper.make_graph(nodes, "narrow", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16, 24, 24])],
                              outputs, [numpy_helper.from_array(v, k) for k, v in consts.items()])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8), str(path))
    return path


def test_narrow_int8_convs_are_widened_to_the_kernel_block_and_compute_the_same(tmp_path):
    """ONNX Runtime's int8 Conv of fewer than 16 output channels, or of a count off a multiple
    of 8, runs a slower kernel: the build gives it zero filters up to 16 (24 for 20) and slices
    the quantized output back. The outputs, their names and shapes stay bit for bit; a grouped
    Conv and one of 32 are left as they are."""
    from pipeline.precision.narrow_convs import widen_narrow_convs

    path = _narrow_convs_model(tmp_path / "narrow.onnx")
    model = onnx.load(str(path))
    assert widen_narrow_convs(model, 16) == ["conv_one", "conv_three", "conv_twenty"]
    onnx.checker.check_model(model)
    onnx.save(model, str(tmp_path / "widened.onnx"))
    x = np.random.default_rng(1).normal(0, 2, (1, 16, 24, 24)).astype(np.float32)
    before = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    after = ort.InferenceSession(str(tmp_path / "widened.onnx"), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    assert [a.shape[1] for a in after] == [1, 16, 3, 20, 32]
    assert all(np.array_equal(a, b) for a, b in zip(before, after)) and np.ptp(after[0]) > 0
    weights = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    assert weights["conv_one_w"].shape[0] == weights["conv_one_ws"].shape[0] == weights["conv_one_b"].shape[0] == 16
    assert weights["conv_three_w"].shape[0] == weights["conv_three_bd"].shape[0] == 16
    assert weights["conv_three_ws"].shape == () and not weights["conv_one_w"][1:].any()
    assert weights["conv_grouped_w"].shape[0] == 16 and weights["conv_wide_w"].shape[0] == 32
    assert weights["conv_twenty_w"].shape[0] == 24
    assert [n.op_type for n in model.graph.node].count("Slice") == 3
    assert QdqSettings(conv_block=16).rewrite_for_runtime(onnx.load(str(path))) == {
        "relus_folded": 0, "convs_widened": ["conv_one", "conv_three", "conv_twenty"]}
    assert QdqSettings().rewrite_for_runtime(onnx.load(str(path))) == {"relus_folded": 0}


def test_a_narrow_conv_sharing_its_weights_is_left_as_it_is(tmp_path):
    """One set of weights read by two Convs (a network applied twice): widening them for one
    would widen the other, whose output is not sliced; neither is widened."""
    from pipeline.precision.narrow_convs import widen_narrow_convs

    model = onnx.load(str(_narrow_convs_model(tmp_path / "narrow.onnx")))
    model.graph.node.extend([
        helper.make_node("Conv", ["xd", "conv_one_wd"], ["twin_out"], name="conv_twin", pads=[1, 1, 1, 1]),
        helper.make_node("QuantizeLinear", ["twin_out", "s", "zo"], ["twin_q"]),
        helper.make_node("DequantizeLinear", ["twin_q", "s", "zo"], ["twin_y"])])
    model.graph.output.append(helper.make_tensor_value_info("twin_y", TensorProto.FLOAT, [1, 1, 24, 24]))
    assert widen_narrow_convs(model, 16) == ["conv_three", "conv_twenty"]
    assert numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == "conv_one_w")).shape[0] == 1


def test_a_narrow_conv1d_with_a_negative_weight_axis_is_widened_alike(tmp_path):
    """A 1-D Conv's weights have three axes: axis -3 is its output channels."""
    from pipeline.precision.narrow_convs import widen_narrow_convs

    rng = np.random.default_rng(2)
    consts = {"s": np.array(0.05, np.float32), "z": np.array(128, np.uint8), "w": rng.integers(-127, 128, (2, 8, 5)).astype(np.int8),
              "ws": np.array([0.004, 0.002], np.float32), "wz": np.zeros(2, np.int8)}
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["xd"]),
             helper.make_node("DequantizeLinear", ["w", "ws", "wz"], ["wd"], axis=-3),
             helper.make_node("Conv", ["xd", "wd"], ["c"], name="conv1d", pads=[2, 2]),
             helper.make_node("QuantizeLinear", ["c", "s", "z"], ["cq"]),
             helper.make_node("DequantizeLinear", ["cq", "s", "z"], ["y"])]
    graph = helper.make_graph(nodes, "c1d", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 50])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, 50])],
                              [numpy_helper.from_array(v, k) for k, v in consts.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    onnx.save(model, str(tmp_path / "c1d.onnx"))
    assert widen_narrow_convs(model, 16) == ["conv1d"]
    onnx.save(model, str(tmp_path / "wide.onnx"))
    scales = numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == "ws"))
    assert scales.shape == (16,) and np.all(scales[2:] == 0.004)
    x = np.random.default_rng(3).normal(0, 2, (1, 8, 50)).astype(np.float32)
    before, after = (ort.InferenceSession(str(tmp_path / n), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
                     for n in ("c1d.onnx", "wide.onnx"))
    assert after.shape == (1, 2, 50) and np.array_equal(before, after)


def _residual_head_model() -> onnx.ModelProto:
    """Conv A -> Relu feeds Conv B and Conv C; their sum (a residual Add) feeds the 1-channel
    3x3 head H, the graph output: the segmenter's side heads in small."""
    rng = np.random.default_rng(3)

    def weight(name, *shape):
        return numpy_helper.from_array(rng.normal(0, 0.3, shape).astype(np.float32), name)

    inits = [weight("wa", 8, 3, 3, 3), weight("ba", 8), weight("wb", 8, 8, 3, 3), weight("bb", 8),
             weight("wc", 8, 8, 1, 1), weight("bc", 8), weight("wh", 1, 8, 3, 3), weight("bh", 1)]
    nodes = [helper.make_node("Conv", ["x", "wa", "ba"], ["a"], name="A", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["a"], ["r"], name="relu"),
             helper.make_node("Conv", ["r", "wb", "bb"], ["b"], name="B", pads=[1, 1, 1, 1]),
             helper.make_node("Conv", ["r", "wc", "bc"], ["c"], name="C"),
             helper.make_node("Add", ["b", "c"], ["s"], name="add"),
             helper.make_node("Conv", ["s", "wh", "bh"], ["y"], name="H", pads=[1, 1, 1, 1])]
    graph = helper.make_graph(nodes, "residual_head", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                                     [1, 3, 16, 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1, 16, 16])], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return onnx.shape_inference.infer_shapes(model)


def test_a_float_head_can_read_its_input_as_its_int8_self_did(tmp_path):
    """keep_in_float's quantized_inputs: the float head H reads the residual Add's output
    through the Q/DQ pair its int8 self read, so ONNX Runtime runs the Add int8 (QLinearAdd);
    without, the Add runs in float on two dequantized inputs. H's weights are float either way."""
    model = _residual_head_model()
    feeds = {"x": np.random.default_rng(4).normal(0, 1, (1, 3, 16, 16)).astype(np.float32)}
    settings = QdqSettings()
    all_int8 = quantize_static_qdq(model, _table(model, feeds), settings)
    reference = _run(model, feeds)

    def optimized(derived) -> list:
        options = ort.SessionOptions()
        options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
        ort.InferenceSession(derived.SerializeToString(), options, providers=["CPUExecutionProvider"])
        return [node.op_type for node in onnx.load(options.optimized_model_filepath).graph.node]

    plain = keep_in_float(all_int8, model, ["H"], settings)
    reading = keep_in_float(all_int8, model, ["H"], settings, quantized_inputs=["H"])
    producer = {out: node for node in reading.graph.node for out in node.output}
    head = next(node for node in reading.graph.node if node.name == "H")
    assert producer[head.input[0]].op_type == "DequantizeLinear" and head.input[1] == "wh"
    assert next(n for n in plain.graph.node if n.name == "H").input[0] == "s"
    assert "QLinearAdd" in optimized(reading) and "QLinearAdd" not in optimized(plain)
    for derived in (plain, reading):
        assert np.corrcoef(_run(derived, feeds).ravel(), reference.ravel())[0, 1] > 0.99
    assert len(keep_in_float(all_int8, model, ["H"], settings, quantized_inputs=["B"]).graph.node) == \
        len(plain.graph.node)  # an int8 op among them changes nothing


class _ScriptedMeasure:
    """The mixed search's measure with its drops given per set of quantized inputs: the
    search's decisions, on the real derived models (MixedModels), without running them."""

    def __init__(self, model, table, drops: dict):
        self.prepared, self.drops, self.calls, self._models = model, drops, [], MixedModels(model, table, QdqSettings())

    def models(self, table):
        return self._models

    def __call__(self, table, float_ops, quantized_inputs=(), model=None):
        self.calls.append(list(quantized_inputs))
        return {"cosine": 0.999, "metric_drop": self.drops[tuple(quantized_inputs)]}

    def meets(self, result) -> bool:
        return result["metric_drop"] <= 0.01

    def no_time(self, step):
        return None


@pytest.mark.parametrize("drop, kept", [(0.009, ["H"]), (0.011, [])])
def test_the_search_gives_a_float_head_its_quantized_input_only_where_the_target_holds(drop, kept):
    from pipeline.precision.calibration.sensitivity import quantized_inputs_back

    model = _residual_head_model()
    feeds = {"x": np.random.default_rng(4).normal(0, 1, (1, 3, 16, 16)).astype(np.float32)}
    measure = _ScriptedMeasure(model, _table(model, feeds), {("H",): drop})
    summary = {"mixed": {"cosine": 0.9995, "metric_drop": 0.008}}
    # C reads the Relu's output, which B reads int8 anyway: giving it back changes nothing, so it is not measured
    assert quantized_inputs_back(measure, None, ["H", "C"], summary, "next") == kept
    assert measure.calls == [["H"]]
    assert summary["inputs_given_back"] == [{"op": "H", "kept": bool(kept), "cosine": 0.999, "metric_drop": drop}]
    assert summary["mixed"]["metric_drop"] == (drop if kept else 0.008)


def test_inputs_are_given_back_largest_first_and_small_ones_not_at_all():
    from pipeline.precision.calibration.sensitivity import SMALL_INPUT, _largest_inputs_first

    def head(name, size):
        return helper.make_tensor_value_info(f"{name}_in", TensorProto.FLOAT, [1, 64, size, size])

    nodes = [helper.make_node("Conv", [f"{n}_in", "w"], [f"{n}_out"], name=n) for n in ("small", "big", "mid", "unknown")]
    graph = helper.make_graph(nodes, "heads", [head("small", 10), head("big", 320), head("mid", 160)], [])
    side = math.ceil((320 * 320 / SMALL_INPUT) ** 0.5)
    assert _largest_inputs_first(helper.make_model(graph), ["small", "mid", "unknown", "big"]) == ["big", "mid", "unknown"]
    graph.input[0].CopyFrom(head("small", side))
    assert _largest_inputs_first(helper.make_model(graph), ["small", "big"]) == ["big", "small"]
