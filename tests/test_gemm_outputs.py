"""ONNX Runtime's placement around Gemms (pipeline/precision/gemm_outputs.py): a Gemm's output
stays float where int8 does not flow on from it (a transformer's FFN), and keeps its Q/DQ pair
where it does (a classifier's MLP head); checked on ONNX Runtime's own optimized graph."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from conftest import ort_qdq_settings, read_report, run_cli, run_dirs
from pipeline.precision.quantize import MixedModels
from test_quantize import _table


def _erf_gelu(x: str, out: str) -> list:
    """GELU in the erf form torch exports, x * (1 + erf(x / sqrt 2)) * 0.5 (constants `sqrt2`,
    `one`, `half`): the pattern ONNX Runtime fuses into one Gelu."""
    return [helper.make_node("Div", [x, "sqrt2"], ["gelu_d"], name="gelu_div"),
            helper.make_node("Erf", ["gelu_d"], ["gelu_e"], name="gelu_erf"),
            helper.make_node("Add", ["gelu_e", "one"], ["gelu_a"], name="gelu_add"),
            helper.make_node("Mul", [x, "gelu_a"], ["gelu_m"], name="gelu_mul"),
            helper.make_node("Mul", ["gelu_m", "half"], [out], name="gelu_half")]


def _ffn_model() -> onnx.ModelProto:
    """A transformer FFN at a fixed token count as the prepare step leaves it (MatMul + Add
    fused into Reshape -> Gemm -> Reshape), the GELU between its two Gemms in the erf form
    torch exports."""
    rng = np.random.default_rng(3)
    inits = [numpy_helper.from_array(rng.normal(0, 0.2, shape).astype(np.float32), name)
             for name, shape in (("w1", (16, 32)), ("b1", (32,)), ("w2", (32, 16)), ("b2", (16,)))]
    inits += [numpy_helper.from_array(np.array(v, np.int64), n) for n, v in
              (("flat16", [8, 16]), ("tokens32", [1, 8, 32]), ("flat32", [8, 32]), ("tokens16", [1, 8, 16]))]
    inits += [numpy_helper.from_array(np.array(v, np.float32), n) for n, v in (("sqrt2", 2 ** 0.5), ("one", 1.0), ("half", 0.5))]
    nodes = [helper.make_node("Reshape", ["x", "flat16"], ["x2"], name="r1"),
             helper.make_node("Gemm", ["x2", "w1", "b1"], ["h2"], name="fc1"),
             helper.make_node("Reshape", ["h2", "tokens32"], ["h"], name="r2"),
             *_erf_gelu("h", "g"),
             helper.make_node("Reshape", ["g", "flat32"], ["g2"], name="r3"),
             helper.make_node("Gemm", ["g2", "w2", "b2"], ["y2"], name="fc2"),
             helper.make_node("Reshape", ["y2", "tokens16"], ["y"], name="r4")]
    graph = helper.make_graph(nodes, "ffn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 16])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _optimized(model: onnx.ModelProto, folder) -> tuple:
    """(ONNX Runtime's session of the model, the op types of its optimized graph)."""
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(folder / "optimized.onnx")
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session, [n.op_type for n in onnx.load(options.optimized_model_filepath).graph.node]


def test_a_gemm_output_stays_float_where_int8_does_not_flow_on_and_the_gelu_after_it_fuses(tmp_path):
    """The FFN's Gemms feed a reshape (then a GELU) and the output: their outputs stay float,
    DQ -> Gemm runs as QGemm with a float output, and the GELU stays one pattern ONNX Runtime
    fuses (with a Q/DQ pair there it copied the DequantizeLinear for each GELU reader and left
    Div, Erf, Add, Mul, Mul unfused: a ViT-tiny at 224 ran 1.08x fp32 instead of 1.28x)."""
    model = _ffn_model()
    feeds = {"x": np.random.default_rng(4).normal(0, 1, (1, 8, 16)).astype(np.float32)}
    built = MixedModels(model, _table(model, feeds), ort_qdq_settings("Gemm")).build()
    quantized = {n.input[0] for n in built.graph.node if n.op_type == "QuantizeLinear"}
    assert quantized == {"x2", "g2"}  # the Gemms' inputs; their outputs h2 and y2 float
    session, kinds = _optimized(built, tmp_path)
    assert kinds.count("QGemm") == 2 and "Gelu" in kinds and "Erf" not in kinds, kinds
    expected = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    actual = session.run(None, feeds)[0]
    assert float(np.dot(actual.ravel(), expected.ravel()) /
                 (np.linalg.norm(actual) * np.linalg.norm(expected))) > 0.99


def test_a_gemm_feeding_a_relu_before_the_next_gemm_keeps_its_quantized_output(tmp_path):
    """A classifier's MLP head (Gemm -> Relu -> Gemm): int8 flows on through the Relu, so the
    first Gemm's output keeps its Q/DQ pair and ONNX Runtime folds the Relu away."""
    rng = np.random.default_rng(7)
    inits = [numpy_helper.from_array(rng.normal(0, 0.3, shape).astype(np.float32), name)
             for name, shape in (("w1", (16, 32)), ("b1", (32,)), ("w2", (32, 10)), ("b2", (10,)))]
    nodes = [helper.make_node("Gemm", ["x", "w1", "b1"], ["h"], name="fc1"),
             helper.make_node("Relu", ["h"], ["r"], name="relu"),
             helper.make_node("Gemm", ["r", "w2", "b2"], ["y"], name="fc2")]
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 10])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    feeds = {"x": rng.normal(0, 1, (1, 16)).astype(np.float32)}
    built = MixedModels(model, _table(model, feeds), ort_qdq_settings("Gemm")).build()
    assert {n.input[0] for n in built.graph.node if n.op_type == "QuantizeLinear"} >= {"x", "h"}
    kinds = _optimized(built, tmp_path)[1]
    assert kinds.count("QGemm") == 2 and "Relu" not in kinds, kinds


def test_the_build_simulations_follow_the_same_rule():
    """Fake quantization (calibration, smoothing and the mixed search judge with it) rounds a
    Gemm's output only where the build keeps its pair: not the FFN's, the MLP head's fc1 yes."""
    from pipeline.precision.calibration.fake_quant import _quantized_tensors
    from pipeline.precision.gemm_outputs import float_output_gemms

    ffn = _ffn_model()
    everything = {value.name for value in ffn.graph.input} | {o for node in ffn.graph.node for o in node.output}
    assert float_output_gemms(ffn, ort_qdq_settings("Gemm")) == {"fc1", "fc2"}
    assert set(_quantized_tensors(ffn, everything, ort_qdq_settings("Gemm"), set())) == {"x2", "g2"}
    nodes = [helper.make_node("Gemm", ["x", "w1", "b1"], ["h"], name="fc1"),
             helper.make_node("Relu", ["h"], ["r"], name="relu"),
             helper.make_node("Gemm", ["r", "w2", "b2"], ["y"], name="fc2")]
    mlp = helper.make_model(helper.make_graph(nodes, "mlp", [], []))
    assert float_output_gemms(mlp, ort_qdq_settings("Gemm")) == {"fc2"}
    assert set(_quantized_tensors(mlp, {"x", "h", "r", "y"}, ort_qdq_settings("Gemm"), set())) == {"x", "h", "r"}


def _tokens_model(path) -> None:
    """A ViT-like classifier at a fixed token count, as torch exports one: 8 x 8 patches of a
    32 x 32 image -> 16 tokens of 32 channels -> LayerNorm -> MatMul + Add -> GELU (erf) ->
    MatMul + Add -> residual Add -> LayerNorm -> mean over tokens -> MatMul + Add -> 10 logits."""
    rng = np.random.default_rng(11)

    def weight(name, *shape, spread=0.2):
        return numpy_helper.from_array(rng.normal(0, spread, shape).astype(np.float32), name)

    inits = [weight("patch_w", 32, 3, 8, 8, spread=0.05), weight("patch_b", 32), weight("w1", 32, 64), weight("b1", 64),
             weight("w2", 64, 32), weight("b2", 32), weight("wh", 32, 10), weight("bh", 10),
             numpy_helper.from_array(np.linspace(0.5, 4.0, 32).astype(np.float32), "gamma"),
             weight("beta", 32, spread=0.1), numpy_helper.from_array(np.ones(32, np.float32), "gamma2"),
             numpy_helper.from_array(np.zeros(32, np.float32), "beta2"),
             numpy_helper.from_array(np.array([1, 32, 16], np.int64), "tokens_shape")]
    inits += [numpy_helper.from_array(np.array(v, np.float32), n) for n, v in (("sqrt2", 2 ** 0.5), ("one", 1.0), ("half", 0.5))]
    nodes = [helper.make_node("Conv", ["image", "patch_w", "patch_b"], ["p"], name="patch", strides=[8, 8]),
             helper.make_node("Reshape", ["p", "tokens_shape"], ["pt"], name="to_tokens"),
             helper.make_node("Transpose", ["pt"], ["t"], name="tokens_last", perm=[0, 2, 1]),
             helper.make_node("LayerNormalization", ["t", "gamma", "beta"], ["n"], name="norm1", axis=-1),
             helper.make_node("MatMul", ["n", "w1"], ["m1"], name="fc1"),
             helper.make_node("Add", ["m1", "b1"], ["h"], name="fc1_bias"),
             *_erf_gelu("h", "g"),
             helper.make_node("MatMul", ["g", "w2"], ["m2"], name="fc2"),
             helper.make_node("Add", ["m2", "b2"], ["f"], name="fc2_bias"),
             helper.make_node("Add", ["t", "f"], ["r"], name="residual"),
             helper.make_node("LayerNormalization", ["r", "gamma2", "beta2"], ["n2"], name="norm2", axis=-1),
             helper.make_node("ReduceMean", ["n2"], ["pooled"], name="pool", axes=[1], keepdims=0),
             helper.make_node("MatMul", ["pooled", "wh"], ["mh"], name="head"),
             helper.make_node("Add", ["mh", "bh"], ["logits"], name="head_bias")]
    graph = helper.make_graph(nodes, "tokens", [helper.make_tensor_value_info("image", TensorProto.FLOAT, [1, 3, 32, 32])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 10])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.save(onnx.shape_inference.infer_shapes(model), str(path))


def test_the_cli_builds_a_fixed_token_transformer_with_its_gelu_fused_and_smoothing_folded(tmp_path):
    """The user's path: `parity ... precision=int8` on a ViT-like model. The prepare step makes
    its FFN a Reshape -> Gemm -> Reshape; the built model runs both FFN Gemms as QGemm with the
    GELU between them fused, and smoothing's scale for the first lives in the LayerNorm
    (through the Gemm's reshape), not in a Mul."""
    _tokens_model(tmp_path / "tokens.onnx")
    result = run_cli([f"model.path={tmp_path / 'tokens.onnx'}", "data=random", "metric=none", "target=ort_cpu",
                      "precision=int8", "precision.smoothing=0.5", "pipeline.stages=[convert,calibrate,build,verify]"],
                     tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    run_dir = run_dirs(tmp_path)[-1]
    groups = read_report(run_dir)["calibration"]["smoothing"]["groups"]
    assert {g["folded_into"] for g in groups if "fc1" in " ".join(g["ops"])} == {"norm1"}, groups
    kinds = _optimized(onnx.load(str(run_dir / "stages" / "build" / "model.onnx")), tmp_path)[1]
    assert kinds.count("QGemm") >= 2 and "Gelu" in kinds and "Erf" not in kinds, kinds
