"""Models that ended in an internal error (issue 28, item 1): a float16 ONNX model (float16
input, weights and output) builds int8 on ONNX Runtime and OpenVINO and fp32 on ncnn,
each with a verdict (exit 0 or 3, never 1)."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from conftest import read_report, run_cli, run_dirs

from pipeline import float32


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
