"""A small model whose intermediate activation overflows fp16 while its input, weights and
output all fit: Conv -> Relu -> x*x -> ReduceSum(H, W) -> Sqrt. The sum of squares over a
64x64 map exceeds 65504 for the channels with a large mean response (shared/findings.md:
the same graph overflows to inf on ncnn's Vulkan fp16 path)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

INPUT_SHAPE = (1, 3, 64, 64)
CHANNELS = 32
WEIGHT_SEED = 0
WEIGHT_STD = 0.5
INPUT_HIGH = 4.0


def build(path) -> Path:
    """Write the model to `path` (IR 8, opset 17) and return the path."""
    rng = np.random.default_rng(WEIGHT_SEED)
    weight = rng.normal(0.0, WEIGHT_STD, (CHANNELS, INPUT_SHAPE[1], 3, 3)).astype(np.float32)
    bias = rng.normal(0.0, WEIGHT_STD, CHANNELS).astype(np.float32)
    nodes = [
        helper.make_node("Conv", ["x", "conv.weight", "conv.bias"], ["conv_out"], name="conv",
                         kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["conv_out"], ["relu_out"], name="relu"),
        helper.make_node("Mul", ["relu_out", "relu_out"], ["square_out"], name="square"),
        helper.make_node("ReduceSum", ["square_out", "axes"], ["reduce_out"], name="reduce", keepdims=1),
        helper.make_node("Sqrt", ["reduce_out"], ["y"], name="sqrt"),
    ]
    graph = helper.make_graph(
        nodes, "fp16_overflow",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(INPUT_SHAPE))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, CHANNELS, 1, 1])],
        initializer=[numpy_helper.from_array(weight, "conv.weight"),
                     numpy_helper.from_array(bias, "conv.bias"),
                     numpy_helper.from_array(np.array([2, 3], dtype=np.int64), "axes")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8  # onnx's default IR is newer than ONNX Runtime loads
    onnx.checker.check_model(model, full_check=True)
    path = Path(path)
    onnx.save(model, str(path))
    return path


def sample(seed: int) -> np.ndarray:
    """One input, uniform in [0, INPUT_HIGH)."""
    return np.random.default_rng(seed).uniform(0.0, INPUT_HIGH, INPUT_SHAPE).astype(np.float32)
