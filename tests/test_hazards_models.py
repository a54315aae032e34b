"""Models that ended in an internal error (issue 28, items 1-3): a float16 ONNX model
(float16 input, weights and output) builds int8 on ONNX Runtime and OpenVINO and fp32 on
ncnn, each with a verdict (exit 0 or 3, never 1); a converter that rejects an op (pnnx on
Loop, OpenVINO's frontend on Det) is the target's limitation: exit 4, one line naming the
op, and the target that runs it."""

from __future__ import annotations

import re

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from conftest import read_report, run_cli, run_dirs

from pipeline.precision import float32


def half_model(path):
    """x float16 [1, 3, 16, 16] -> Conv -> Relu -> Flatten -> MatMul -> y float16 [1, 4]."""
    rng = np.random.default_rng(0)
    weights = {"w": rng.normal(0, 0.3, (8, 3, 3, 3)), "b": rng.normal(0, 0.1, 8), "w2": rng.normal(0, 0.3, (2048, 4))}
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["r"], name="relu"),
             helper.make_node("Flatten", ["r"], ["f"], name="flat"),
             helper.make_node("MatMul", ["f", "w2"], ["y"], name="head")]
    graph = helper.make_graph(nodes, "half", [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [1, 3, 16, 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [1, 4])],
                              [numpy_helper.from_array(v.astype(np.float16), k) for k, v in weights.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, str(path))
    return path


def test_widening_keeps_the_interface_and_what_it_computes(tmp_path):
    model = onnx.load(str(half_model(tmp_path / "half.onnx")))
    assert float32.has_float16(model)
    wide = float32.widened(model)
    assert [i.type.tensor_type.elem_type for i in wide.graph.input] == [TensorProto.FLOAT16]
    assert [o.type.tensor_type.elem_type for o in wide.graph.output] == [TensorProto.FLOAT16]
    assert all(t.data_type == TensorProto.FLOAT for t in wide.graph.initializer)
    x = np.random.default_rng(1).normal(size=(1, 3, 16, 16)).astype(np.float16)
    run = lambda m: ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    half, widened = run(model), run(wide)
    assert widened.dtype == np.float16 and np.allclose(widened, half, rtol=0.02, atol=0.05)
    bare = float32.widened(model, keep_io=False)
    assert [i.type.tensor_type.elem_type for i in bare.graph.input] == [TensorProto.FLOAT]


@pytest.mark.parametrize("target, precision", [("ort_cpu", "int8"), ("openvino_cpu", "int8"), ("ncnn_cpu", "fp32")])
def test_a_float16_model_gets_a_verdict(tmp_path, target, precision):
    model = half_model(tmp_path / "half.onnx")
    result = run_cli([f"model.path={model}", "data=random", "data.calibration_size=8", "data.validation_size=16",
                      "metric=none", f"target={target}", f"precision={precision}",
                      "pipeline.stages=[convert,calibrate,build,verify]"], tmp_path)
    assert result.returncode in (0, 3), result.stdout + result.stderr
    verify = read_report(run_dirs(tmp_path)[-1])["verify"]
    assert verify["outputs"][0]["metrics"]["cosine"] > 0.99


def loop_model(path):
    """x [1, 8] -> MatMul -> Loop (3 times: + 1) -> y: pnnx has no ncnn layer for Loop."""
    body = helper.make_graph(
        [helper.make_node("Add", ["v_in", "one"], ["v_out"], name="inc"),
         helper.make_node("Identity", ["cond_in"], ["cond_out"], name="keep")], "body",
        [helper.make_tensor_value_info("i", TensorProto.INT64, []),
         helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
         helper.make_tensor_value_info("v_in", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("v_out", TensorProto.FLOAT, [1, 4])],
        [numpy_helper.from_array(np.ones((1, 4), np.float32), "one")])
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="dense"),
             helper.make_node("Loop", ["trips", "cond", "h"], ["y"], name="repeat", body=body)]
    return _save(nodes, path, {"w": np.random.default_rng(0).normal(size=(8, 4)).astype(np.float32),
                               "trips": np.array(3, np.int64), "cond": np.array(True)}, [1, 4])


def det_model(path):
    """x [1, 8] -> MatMul -> Reshape [1, 3, 3] -> Det -> y: OpenVINO has no Det."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="dense"),
             helper.make_node("Reshape", ["h", "shape"], ["m"], name="square"),
             helper.make_node("Det", ["m"], ["y"], name="det")]
    return _save(nodes, path, {"w": np.random.default_rng(0).normal(size=(8, 9)).astype(np.float32),
                               "shape": np.array([1, 3, 3], np.int64)}, [1])


def _save(nodes, path, constants, out_shape):
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, out_shape)],
                              [numpy_helper.from_array(v, k) for k, v in constants.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, str(path))
    return path


def batch4_model(path):
    """A classifier exported with a fixed batch of 4: x [4, 3, 8, 8] -> Conv -> y [4, 2, 8, 8]."""
    weights = numpy_helper.from_array(np.random.default_rng(0).normal(size=(2, 3, 3, 3)).astype(np.float32), "w")
    graph = helper.make_graph([helper.make_node("Conv", ["x", "w"], ["y"], name="conv", pads=[1, 1, 1, 1])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 3, 8, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 2, 8, 8])], [weights])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


@pytest.mark.parametrize("make, target, said", [
    (loop_model, "ncnn_cpu", "target ncnn_cpu cannot build this model: pnnx cannot convert ops"),
    (batch4_model, "ncnn_cpu", "ncnn runs one sample at a time (a Mat has no batch axis; pnnx drops the first dim "
                               "of a 4-d input): input 'x' [4, 3, 8, 8] has a fixed batch of 4"),
    (det_model, "openvino_cpu", "target openvino_cpu cannot read this model: No conversion rule found for "
                                "operations: Det"),
])
def test_a_converter_that_rejects_an_op_is_exit_4_in_one_line(tmp_path, make, target, said):
    model = make(tmp_path / "model.onnx")
    source = model.read_bytes()
    result = run_cli([f"model.path={model}", "data=random", "data.calibration_size=8", "data.validation_size=8",
                      "metric=none", f"target={target}", "precision=fp32"], tmp_path)
    assert result.returncode == 4, result.stdout + result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx", "outputs"] and model.read_bytes() == source
    lines = [line for line in result.stderr.splitlines() if line.startswith("parity:")]
    assert len(lines) == 1 and said in lines[0] and ("ort_cpu runs it" in lines[0] or "run it on ort_cpu" in lines[0]), \
        result.stderr
    assert "Loop (node repeat)" in lines[0] or make is not loop_model
    assert "Exception from" not in result.stderr and "internal error" not in result.stderr


def test_the_meaningful_line_of_a_runtime_message():
    from pipeline.errors import meaningful_line

    openvino = RuntimeError("Exception from src/inference/src/cpp/core.cpp:105:\nCheck 'false' failed at "
                            "src/frontends/common_translators/src/unconverted_ops_report.cpp:151:\nFrontEnd API "
                            "failed with OpConversionFailure:\nModel wasn't fully converted.\nSummary:\n-- No "
                            "conversion rule found for operations: If-13, LSTM-14\n")
    assert meaningful_line(openvino) == "No conversion rule found for operations: If-13, LSTM-14"
    assert meaningful_line(RuntimeError("Exception from src/a.cpp:3:\nout of range")) == "out of range"
    assert meaningful_line(RuntimeError("")) == "RuntimeError"


def test_a_runtime_that_cannot_load_the_model_says_so_in_one_line(tmp_path):
    """ONNX Runtime has no float64 Det kernel: exit 4, one line naming the node."""
    nodes = [helper.make_node("Reshape", ["x", "shape"], ["m"], name="square"),
             helper.make_node("Det", ["m"], ["y"], name="det")]
    graph = helper.make_graph(nodes, "det64", [helper.make_tensor_value_info("x", TensorProto.DOUBLE, [1, 9])],
                              [helper.make_tensor_value_info("y", TensorProto.DOUBLE, [1])],
                              [numpy_helper.from_array(np.array([1, 3, 3], np.int64), "shape")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(tmp_path / "det64.onnx"))
    (tmp_path / "keep.txt").write_text("mine")
    before = sorted(p.name for p in tmp_path.iterdir())
    result = run_cli([f"model.path={tmp_path / 'det64.onnx'}", "data=random", "data.calibration_size=4",
                      "data.validation_size=4", "metric=none", "target=ort_cpu", "precision=fp32"], tmp_path)
    assert result.returncode == 4, result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("parity:")]
    assert len(lines) == 1 and "Could not find an implementation for Det(11) node with name 'det'" in lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted({*before, "outputs"})
    assert (tmp_path / "keep.txt").read_text() == "mine"


@pytest.mark.parametrize("domain, opset, said", [
    ("com.acme", 17, r"does not know the op com\.acme:Fancy: export the model with standard ONNX ops"),
    ("", 30, r"reads opset (\d+) of domain ai\.onnx at most and the model is stamped 30: export it with opset \1 or lower"),
])
def test_a_model_the_reference_cannot_load_is_one_line_from_convert_under_auto(tmp_path, domain, opset, said):
    """A custom op, an opset newer than ONNX Runtime knows: under precision=auto this was an
    internal error (exit 1) from the int8 quantizer's own session; now convert loads the
    reference first and says it once, exit 4, for every candidate it stops."""
    node = helper.make_node("Fancy" if domain else "Relu", ["x"], ["y"], domain=domain, name="op")
    graph = helper.make_graph([node], "unloadable", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset),
                                                    *([helper.make_opsetid(domain, 1)] if domain else [])])
    model.ir_version = 8
    onnx.save(model, str(tmp_path / "unloadable.onnx"))
    result = run_cli([f"model.path={tmp_path / 'unloadable.onnx'}", "data=random", "metric=none"], tmp_path,
                     default_precision=None)
    assert result.returncode == 4, result.stdout + result.stderr
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("parity:")]
    assert line.startswith("parity: reference unavailable: ONNX Runtime ") and re.search(said, line), line
    assert "no candidate could be built" not in line and "Traceback" not in result.stderr


def conv_if_model(path):
    """An If choosing between two Conv branches that read a stem Conv's output from the main
    graph (a scripted export's branch), [1, 3, 16, 16] in, [1, 4, 16, 16] out."""
    rng = np.random.default_rng(0)

    def weight(name: str, out: int) -> onnx.TensorProto:
        return numpy_helper.from_array(rng.normal(0, 0.3, (out, 3, 3, 3)).astype(np.float32), name)

    def branch(name: str) -> onnx.GraphProto:  # each reads the stem's output, as an If body reads the graph's
        return helper.make_graph([helper.make_node("Conv", ["feat", f"{name}_w"], [f"{name}_y"], pads=[1, 1, 1, 1])],
                                 name, [], [helper.make_tensor_value_info(f"{name}_y", TensorProto.FLOAT, None)],
                                 initializer=[weight(f"{name}_w", 4)])

    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "stem_w"], ["feat"], pads=[1, 1, 1, 1], name="stem"),
         helper.make_node("ReduceMean", ["x"], ["m"], keepdims=0, name="mean"),
         helper.make_node("Greater", ["m", "zero"], ["c"], name="gt"),
         helper.make_node("If", ["c"], ["y"], then_branch=branch("then"), else_branch=branch("else"), name="branch")],
        "conv_if", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 16, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 16, 16])],
        initializer=[weight("stem_w", 3), numpy_helper.from_array(np.array(0, np.float32), "zero")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), str(path))
    return path


def test_int8_of_a_model_with_convs_in_an_if_says_they_stay_float(tmp_path):
    """The branches' Convs are not quantized and the stem's Conv, whose output they read, does
    not fuse: fp32 runs, exit 4, and the verdict says why (it said only "int8 but fp32 ran")."""
    model = conv_if_model(tmp_path / "conv_if.onnx")
    result = run_cli([f"model.path={model}", "data=random", "metric=none", "precision=int8"], tmp_path)
    assert result.returncode == 4, result.stdout + result.stderr
    (verdict,) = [line for line in result.stdout.splitlines() if line.startswith("verdict:")]
    assert "requested precision int8 but fp32 ran; Conv ops inside If 'branch' are not quantized" in verdict, verdict


def _looped_conv(path):
    """A Conv + Relu applied three times by a Loop whose body reads the weights from the main
    graph (a scripted export's loop), nothing quantizable outside it."""
    weight = numpy_helper.from_array(np.random.default_rng(0).normal(0, 0.2, (3, 3, 3, 3)).astype(np.float32), "w")
    state = [1, 3, 16, 16]
    body = helper.make_graph(
        [helper.make_node("Identity", ["cond_in"], ["cond_out"]),
         helper.make_node("Conv", ["state_in", "w"], ["c"], pads=[1, 1, 1, 1], name="body_conv"),
         helper.make_node("Relu", ["c"], ["state_out"], name="body_relu")], "body",
        [helper.make_tensor_value_info("i", TensorProto.INT64, []),
         helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
         helper.make_tensor_value_info("state_in", TensorProto.FLOAT, state)],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("state_out", TensorProto.FLOAT, state)])
    graph = helper.make_graph([helper.make_node("Loop", ["trip", "cond", "x"], ["y"], body=body, name="loop")], "loopy",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, state)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, state)],
                              [weight, numpy_helper.from_array(np.array(3, np.int64), "trip"),
                               numpy_helper.from_array(np.array(True), "cond")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), str(path))
    return path


def test_int8_of_a_model_whose_convs_are_all_inside_a_loop_says_where_they_are(tmp_path):
    """Nothing to quantize in the main graph: the int8 build is the fp32 model and the verdict
    fails it (exit 3), naming the Loop whose body holds the Conv (it said only "no Conv")."""
    from pipeline.model import ops_in_control_flow

    model = onnx.load(str(_looped_conv(tmp_path / "loopy.onnx")))
    assert ops_in_control_flow(model, ["Conv", "MatMul"]) == {"Loop 'loop'": ["Conv"]}
    result = run_cli([f"model.path={tmp_path / 'loopy.onnx'}", "data=random", "metric=none", "precision=int8"], tmp_path)
    assert result.returncode == 3, result.stdout + result.stderr
    (verdict,) = [line for line in result.stdout.splitlines() if line.startswith("verdict:")]
    assert "the model has no op parity quantizes" in verdict and \
        "Conv ops inside Loop 'loop' are not quantized (parity quantizes the main graph, not If, Loop or Scan " \
        "bodies)" in verdict, verdict


def quantized_digits(path):
    """The default digits CNN through ONNX Runtime's own quantize_static (QDQ, per channel),
    fed 16 of its calibration samples: a model quantized before parity sees it."""
    from importlib import resources

    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, quantize_static

    assets = resources.files("pipeline") / "assets"
    calibration = np.load(str(assets / "digits.npz"))["calibration/input"][:16]

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.samples = iter({"input": sample[None]} for sample in calibration)

        def get_next(self):
            return next(self.samples, None)

    quantize_static(str(assets / "digits_cnn.onnx"), str(path), Reader(), quant_format=QuantFormat.QDQ,
                    per_channel=True)
    return path


def test_a_model_quantized_already_is_verified_as_given_and_never_quantized_again(tmp_path):
    """int8 of a QDQ model was an internal error (ONNX Runtime: two nodes with the same name):
    precision=int8 is exit 2 saying why; auto builds fp32, the model as given, which OpenVINO
    runs in int8 (accepted: that is the model), and ships it; the other candidates are not built."""
    model = quantized_digits(tmp_path / "digits_qdq.onnx")
    refused = run_cli([f"model.path={model}", "precision=int8"], tmp_path)
    assert refused.returncode == 2, refused.stdout[-2000:] + refused.stderr[-2000:]
    (line,) = [line for line in refused.stderr.splitlines() if line.startswith("parity:")]
    assert "the model is quantized already (" in line and "DequantizeLinear" in line and "precision=fp32" in line
    done = run_cli([f"model.path={model}", "target=openvino_cpu"], tmp_path, default_precision=None)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    report = read_report(run_dirs(tmp_path)[-1])
    rows = {row["precision"]: row for row in report["auto"]["candidates"]}
    assert report["auto"]["chosen"] == "fp32" and report["verify"]["effective"]["precision"] in ("int8", "mixed")
    assert {p for p, row in rows.items() if row["verdict"] == "not built"} == {"bf16", "int8", "mixed"} - (
        {"bf16"} if "bf16" not in rows else set())
    assert all("quantized already" in rows[p]["reasons"][0] for p in ("int8", "mixed"))
    assert "; not built (the model is quantized already (" in report["auto"]["why"]  # the one line says why


def opset9_model(path):
    """As an old exporter (IR 3, opset 9) writes it: the weights listed as graph inputs too,
    an Upsample (the version converter makes it a Resize with an roi it never reads)."""
    rng = np.random.default_rng(0)
    weights = {"w": rng.normal(0, 0.3, (4, 3, 3, 3)).astype(np.float32), "scales": np.array([1, 1, 2, 2], np.float32)}
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["r"]),
             helper.make_node("Upsample", ["r", "scales"], ["y"], mode="nearest")]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])] + [
        helper.make_tensor_value_info(name, TensorProto.FLOAT, list(value.shape)) for name, value in weights.items()]
    graph = helper.make_graph(nodes, "old", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 16, 16])],
                              [numpy_helper.from_array(value, name) for name, value in weights.items()])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 9)], ir_version=3), str(path))
    return path


def test_an_opset_9_model_with_its_weights_as_inputs_converts_for_ncnn(tmp_path):
    """pnnx took the Upsample's scales, a graph input, for a run-time value and could not
    convert the Resize (nor one with the roi the version converter writes): the weights are
    constants only now, the unread roi left empty, and ncnn's fp32 build passes."""
    model = opset9_model(tmp_path / "old.onnx")
    done = run_cli([f"model.path={model}", "data=random", "data.calibration_size=4", "data.validation_size=8",
                    "metric=none", "target=ncnn_cpu", "precision=fp32"], tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    run_dir = run_dirs(tmp_path)[-1]
    converted = onnx.load(str(run_dir / "stages" / "convert" / "model.onnx"))
    assert [value.name for value in converted.graph.input] == ["x"]
    assert [list(node.input) for node in converted.graph.node if node.op_type == "Resize"] == [["r", "", "scales"]]
    assert read_report(run_dir)["verify"]["effective"]["precision"] == "fp32"


def contrib_model(path):
    """As ONNX Runtime's transformer optimizer writes a layer: MatMul -> com.microsoft
    SkipLayerNormalization -> com.microsoft Gelu -> MatMul."""
    rng = np.random.default_rng(0)
    weights = {"w1": rng.normal(0, 0.2, (32, 64)), "bias": np.zeros(64), "w2": rng.normal(0, 0.2, (64, 10)),
               "gamma": np.ones(64), "beta": np.zeros(64)}
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["a"], name="up"),
             helper.make_node("SkipLayerNormalization", ["a", "a", "gamma", "beta", "bias"], ["n"], name="norm",
                              domain="com.microsoft", epsilon=1e-5),
             helper.make_node("Gelu", ["n"], ["g"], name="gelu", domain="com.microsoft"),
             helper.make_node("MatMul", ["g", "w2"], ["y"], name="down")]
    graph = helper.make_graph(nodes, "contrib", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 32])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 10])],
                              [numpy_helper.from_array(v.astype(np.float32), k) for k, v in weights.items()])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)],
                                ir_version=8), str(path))
    return path


def test_the_matmul_after_onnx_runtimes_own_ops_is_quantized_too(tmp_path):
    """ONNX's shape inference leaves com.microsoft outputs untyped: the MatMul reading Gelu's
    output got no range and stayed float (on a ViT the optimizer had fused, int8 was not built
    at all). ONNX Runtime's symbolic shape inference types them: both MatMuls run int8."""
    model = contrib_model(tmp_path / "contrib.onnx")
    done = run_cli([f"model.path={model}", "data=random", "data.calibration_size=8", "data.validation_size=8",
                    "metric=none", "precision=int8"], tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    effective = read_report(run_dirs(tmp_path)[-1])["verify"]["effective"]
    assert effective["precision"] == "int8" and effective["layers"] == "int8: 2", effective
