"""Helpers for the ncnn backend tests: targets, models, the ONNX Runtime reference."""

from __future__ import annotations

import importlib.resources
import os
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, shape_inference

from pipeline.config.schemas import Backend, NcnnOptions, NcnnTarget

ASSETS = Path(__file__).resolve().parents[1] / "pipeline" / "assets"
DIGITS_MODEL = ASSETS / "digits_cnn.onnx"
DIGITS_DATA = ASSETS / "digits.npz"
CLS_SHAPE = [1, 3, 48, 192]
NO_VULKAN = "no Vulkan device: apt-get install libvulkan1 mesa-vulkan-drivers"


def target(device: str = "CPU", **overrides) -> NcnnTarget:
    name = "ncnn_vulkan" if device == "VULKAN" else "ncnn_cpu"
    return NcnnTarget(name=name, backend=Backend.ncnn, device=device, ncnn=NcnnOptions(**overrides))


def has_vulkan() -> bool:
    try:
        import ncnn
    except ImportError:
        return False
    return ncnn.get_gpu_count() > 0


def require_vulkan() -> None:
    """Skip without a Vulkan device; with CI set, fail (CI installs lavapipe)."""
    if has_vulkan():
        return
    if os.environ.get("CI"):
        pytest.fail(NO_VULKAN)
    pytest.skip(NO_VULKAN)


def digits_inputs(count: int) -> List[np.ndarray]:
    data = np.load(DIGITS_DATA)["validation/input"]
    return [data[i:i + 1].astype(np.float32) for i in range(count)]


def reference(model_path: Path, feeds: Dict[str, np.ndarray], extra: Optional[List[str]] = None) -> dict:
    """ONNX Runtime fp32, optimizations off; ``extra`` intermediate tensors added as outputs."""
    import onnxruntime as ort

    model = onnx.load(str(model_path))
    names = [o.name for o in model.graph.output]
    for name in extra or []:
        if name not in names:
            model.graph.output.append(onnx.ValueInfoProto(name=name))
            names.append(name)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return dict(zip(names, session.run(names, feeds)))


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def cls_model(path: Path) -> Path:
    """The PP-OCR text-direction classifier of the rapidocr wheel, input x fixed to 1x3x48x192."""
    source = importlib.resources.files("rapidocr_onnxruntime") / "models" / "ch_ppocr_mobile_v2.0_cls_infer.onnx"
    model = onnx.load(str(source))
    dims = model.graph.input[0].type.tensor_type.shape.dim
    for dim, value in zip(dims, CLS_SHAPE):
        dim.Clear()
        dim.dim_value = value
    onnx.save(shape_inference.infer_shapes(model), str(path))
    return path


def unsupported_model(path: Path) -> Path:
    """Relu -> Det: pnnx passes Det through as an ncnn layer type that does not exist."""
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu"),
             helper.make_node("Det", ["r"], ["y"], name="/head/Det_3")]
    graph = helper.make_graph(nodes, "unsupported", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 4, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


MODULATED_SHAPE = [1, 3, 32, 32]


def modulated_conv_model(path: Path) -> Path:
    """A StyleGAN2-style demodulation: y = conv(x); y / sqrt(sum_hw(y*y) + 1e-8). For inputs in
    [0, 4) the sum of squares reaches ~1e5 (> 65504, fp16's largest) while every other tensor
    fits fp16; the ``+1e-8`` Add leaves the sum unchanged in fp32, so its output equals the
    reduction's (the name mapping must tell the two layers apart by graph structure)."""
    rng = np.random.default_rng(1)
    weight = rng.normal(0.5, 0.5, (8, MODULATED_SHAPE[1], 3, 3)).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w"], ["conv_out"], name="conv", kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
             helper.make_node("Mul", ["conv_out", "conv_out"], ["square_out"], name="square"),
             helper.make_node("ReduceSum", ["square_out", "axes"], ["sum_out"], name="sum", keepdims=1),
             helper.make_node("Add", ["sum_out", "eps"], ["add_out"], name="add_eps"),
             helper.make_node("Sqrt", ["add_out"], ["norm_out"], name="sqrt"),
             helper.make_node("Div", ["conv_out", "norm_out"], ["y"], name="demodulate")]
    graph = helper.make_graph(
        nodes, "modulated_conv", [helper.make_tensor_value_info("x", TensorProto.FLOAT, MODULATED_SHAPE)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, *MODULATED_SHAPE[2:]])],
        initializer=[onnx.numpy_helper.from_array(weight, "w"),
                     onnx.numpy_helper.from_array(np.array([2, 3], dtype=np.int64), "axes"),
                     onnx.numpy_helper.from_array(np.array(1e-8, dtype=np.float32), "eps")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, str(path))
    return path


def modulated_sample(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).uniform(0.0, 4.0, MODULATED_SHAPE).astype(np.float32)


def searched_masks(job) -> dict:
    """A CLI job's (completed process, run folder) feature-mask search: it passed (exit 0), it
    searched and its masks passed; build's summary of it."""
    from conftest import read_report

    result, run_dir = job
    assert result.returncode == 0, result.stdout + result.stderr
    found = read_report(run_dir)["build"]["quantization"]["feature_masks"]
    assert found["searched"] and found["passed"], found
    return found
