"""ReLU6 (Clip(0, 6), MobileNetV2's activation) as a pass-through op on ONNX Runtime's placement:
int8 flows from one convolution to the next through it, and the Clip folds into the Q before
it where its bounds hold the whole quantized range (pipeline/precision/passthrough.py). Before,
every ReLU6 ran in float between a DequantizeLinear and a QuantizeLinear: a MobileNetV2 at 224 ran
int8 at 0.77x fp32 on an AVX2 CPU, ONNX Runtime's own quantizer's graph 1.30x; now 1.28x."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from conftest import ort_qdq_settings, read_report, run_cli, run_dirs
from pipeline.precision.passthrough import _derive, clamp_bounds, constants, fold_relus
from pipeline.precision.quantize import MixedModels
from test_quantize import _table


def _relu6_net() -> onnx.ModelProto:
    """x [1, 3, 32, 32] -> Conv -> ReLU6 (bounds as initializers) -> Conv 1x1 -> ReLU6 (bounds as
    Constant nodes, as torch exports them) -> Conv -> y."""
    rng = np.random.default_rng(21)
    inits = [numpy_helper.from_array(rng.normal(0, 0.4, shape).astype(np.float32), name) for name, shape in
             (("w1", (16, 3, 3, 3)), ("b1", (16,)), ("w2", (16, 16, 1, 1)), ("b2", (16,)), ("w3", (8, 16, 3, 3)), ("b3", (8,)))]
    inits += [numpy_helper.from_array(np.array(v, np.float32), n) for n, v in (("zero", 0.0), ("six", 6.0))]
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
             helper.make_node("Clip", ["c1", "zero", "six"], ["r1"], name="relu6_1"),
             helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], name="conv2"),
             helper.make_node("Constant", [], ["low"], name="low", value=numpy_helper.from_array(np.array(0.0, np.float32))),
             helper.make_node("Constant", [], ["high"], name="high", value=numpy_helper.from_array(np.array(6.0, np.float32))),
             helper.make_node("Clip", ["c2", "low", "high"], ["r2"], name="relu6_2"),
             helper.make_node("Conv", ["r2", "w3", "b3"], ["y"], name="conv3", pads=[1, 1, 1, 1])]
    graph = helper.make_graph(nodes, "relu6", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 32, 32])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 32, 32])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_clamp_bounds_come_from_initializers_constant_nodes_or_attributes():
    model = _relu6_net()
    clips, known = {n.name: n for n in model.graph.node if n.op_type == "Clip"}, constants(model)
    assert clamp_bounds(clips["relu6_1"], known) == clamp_bounds(clips["relu6_2"], known) == (0.0, 6.0)
    old = helper.make_node("Clip", ["c"], ["r"], min=-1.0, max=1.0)  # opset 6: attributes
    assert clamp_bounds(old, known) == (-1.0, 1.0)
    assert clamp_bounds(helper.make_node("Clip", ["c", "zero"], ["r"]), known) == (0.0, np.inf)
    assert clamp_bounds(helper.make_node("Clip", ["c", "computed", "six"], ["r"]), known) is None
    table = {"c": {"threshold": 9.0, "min": -3.0, "max": 9.0}}
    assert _derive(clips["relu6_1"], {"c1": table["c"]}, (0.0, 6.0))
    clips["relu6_1"].output[0] = "out"
    derived = {"c1": table["c"]}
    _derive(clips["relu6_1"], derived, (0.0, 6.0))
    assert (derived["out"]["min"], derived["out"]["max"], derived["out"]["threshold"]) == (0.0, 6.0, 6.0)


def test_relu6_is_a_pass_through_op_and_folds_into_the_q_before_it(tmp_path):
    """Both ReLU6s get Q/DQ around them and fold away: ONNX Runtime runs the first two
    convolutions as QLinearConv with no DequantizeLinear or QuantizeLinear between them (the
    last writes the user's float output: the build strips its output pair)."""
    model = _relu6_net()
    feeds = {"x": np.random.default_rng(22).normal(0, 1, (1, 3, 32, 32)).astype(np.float32)}
    settings = ort_qdq_settings("Conv")
    assert "Clip" in settings.passthrough_ops and settings.folds_relus
    built = MixedModels(model, _table(model, feeds), settings).build()
    assert settings.rewrite_for_runtime(built)["relus_folded"] == 2
    assert not [n for n in built.graph.node if n.op_type == "Clip"]
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    session = ort.InferenceSession(built.SerializeToString(), options, providers=["CPUExecutionProvider"])
    kinds = [n.op_type for n in onnx.load(options.optimized_model_filepath).graph.node]
    assert kinds.count("QLinearConv") == 2 and "Clip" not in kinds, kinds
    assert kinds.count("QuantizeLinear") == 1, kinds  # the input's: no requantization between the convolutions
    first = kinds.index("QLinearConv")
    assert kinds[first + 1] == "QLinearConv", kinds
    expected = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    actual = session.run(None, feeds)[0]
    assert float(np.dot(actual.ravel(), expected.ravel()) /
                 (np.linalg.norm(actual) * np.linalg.norm(expected))) > 0.99


def test_a_clip_narrower_than_the_quantized_range_is_not_folded():
    """A Clip(0, 1) behind a Q that can give up to 6 changes values: it stays."""
    scale, zero = numpy_helper.from_array(np.array(6.0 / 255, np.float32), "s"), \
        numpy_helper.from_array(np.array(0, np.uint8), "z")
    one = numpy_helper.from_array(np.array(1.0, np.float32), "one")
    zero_f = numpy_helper.from_array(np.array(0.0, np.float32), "zero_f")
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"]),
             helper.make_node("DequantizeLinear", ["q", "s", "z"], ["d"]),
             helper.make_node("Clip", ["d", "zero_f", "one"], ["c"], name="clip"),
             helper.make_node("QuantizeLinear", ["c", "s", "z"], ["q2"]),
             helper.make_node("DequantizeLinear", ["q2", "s", "z"], ["y"])]
    graph = helper.make_graph(nodes, "narrow", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])], [scale, zero, one, zero_f])
    model = helper.make_model(graph)
    assert fold_relus(model) == 0 and [n.op_type for n in model.graph.node].count("Clip") == 1
    model.graph.initializer[2].CopyFrom(numpy_helper.from_array(np.array(6.0, np.float32), "one"))
    assert fold_relus(model) == 1 and "Clip" not in [n.op_type for n in model.graph.node]


def test_the_cli_int8_build_of_a_relu6_net_folds_its_clips(tmp_path):
    onnx.save(_relu6_net(), str(tmp_path / "relu6.onnx"))
    result = run_cli([f"model.path={tmp_path / 'relu6.onnx'}", "data=random", "metric=none", "target=ort_cpu",
                      "precision=int8", "pipeline.stages=[convert,calibrate,build,verify]"], tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    quantization = read_report(run_dirs(tmp_path)[-1])["build"]["quantization"]
    assert "Clip" in quantization["passthrough_ops"] and quantization["relus_folded"] == 2, quantization


def test_layerwise_compares_a_folded_clips_input_with_the_reference_clamped_alike():
    """Verify's layerwise probe: a convolution's output whose only reader is a folded pass-through
    Relu or Clip is held clamped by the build, so it is compared with the reference clamped to
    the same bounds (the Clip's from its Constant nodes in the converted model), not as a divergence."""
    from pipeline.verification import layerwise
    from stages.verify.advice import _clamped

    model = _relu6_net()
    quantization = SimpleNamespace(passthrough_ops=["Relu", "Clip", "MaxPool"], quantized_ops=["Conv"], float_ops=[])
    ctx = SimpleNamespace(results={"build": SimpleNamespace(summary=SimpleNamespace(quantization=quantization))})
    assert _clamped(ctx, layerwise.Graph(model), model) == {"c1": (0.0, 6.0), "c2": (0.0, 6.0)}
    quantization.float_ops = ["conv2"]  # a float op's output is not held by any Q
    assert _clamped(ctx, layerwise.Graph(model), model) == {"c1": (0.0, 6.0)}
    quantization.passthrough_ops = ["MaxPool"]
    assert _clamped(ctx, layerwise.Graph(model), model) == {}
