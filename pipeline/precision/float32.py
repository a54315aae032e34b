"""A float16 ONNX model computed in float32 inside, its inputs and outputs still float16.

ONNX Runtime's quantizer, pnnx (ncnn) and MNN's converter expect float32 graphs: on a model
exported in float16 (weights, inputs and outputs) the quantizer inserts casts its own
calibration cannot type, and pnnx reports "cannot convert op Conv" for a float16 Conv.
parity hands them this widened graph (what float16 computes, without float16's rounding)
and keeps the model's interface: a Cast to float32 after each float16 input and a Cast
back to float16 before each float16 output, so a bundle still takes and gives float16.
Subgraphs (If, Loop bodies) are widened the same way."""

from __future__ import annotations

from typing import Set

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from pipeline.precision.fp16 import unique_name

HALF, FLOAT = TensorProto.FLOAT16, TensorProto.FLOAT


def has_float16(model: onnx.ModelProto) -> bool:
    """Any float16 initializer, input, output or declared tensor in the main graph."""
    graph = model.graph
    values = [*graph.input, *graph.output, *graph.value_info]
    return any(t.data_type == HALF for t in graph.initializer) or \
        any(v.type.tensor_type.elem_type == HALF for v in values)


def widened(model: onnx.ModelProto, keep_io: bool = True) -> onnx.ModelProto:
    """A copy of ``model`` computing in float32 (see the module), shapes re-inferred;
    ``keep_io=False``: its float16 inputs and outputs become float32 too (for runtimes
    whose sessions feed and return float32 anyway: ncnn, MNN)."""
    wide = onnx.ModelProto()
    wide.CopyFrom(model)
    graph = wide.graph
    _widen_graph(graph)
    if keep_io:
        taken = {name for node in graph.node for name in [*node.input, *node.output]} | \
            {v.name for v in [*graph.input, *graph.output]}
        _cast_inputs(graph, taken)
        _cast_outputs(graph, taken)
    else:
        _retype(graph, [*graph.input, *graph.output])
    del graph.value_info[:]
    return onnx.shape_inference.infer_shapes(wide)


def _widen_graph(graph: onnx.GraphProto) -> None:
    for index, tensor in enumerate(graph.initializer):
        if tensor.data_type == HALF:
            graph.initializer[index].CopyFrom(_wide_tensor(tensor))
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.TENSOR and attribute.t.data_type == HALF:
                attribute.t.CopyFrom(_wide_tensor(attribute.t))
            if node.op_type == "Cast" and attribute.name == "to" and attribute.i == HALF:
                attribute.i = FLOAT
            if attribute.type == onnx.AttributeProto.GRAPH:
                _widen_graph(attribute.g)
                _retype(attribute.g, [*attribute.g.input, *attribute.g.output])
            if node.op_type in ("RandomNormal", "RandomUniform", "EyeLike") and attribute.name == "dtype" \
                    and attribute.i == HALF:
                attribute.i = FLOAT
    _retype(graph, graph.value_info)


def _retype(graph: onnx.GraphProto, values) -> None:
    for value in values:
        if value.type.tensor_type.elem_type == HALF:
            value.type.tensor_type.elem_type = FLOAT


def _wide_tensor(tensor: TensorProto) -> TensorProto:
    return numpy_helper.from_array(numpy_helper.to_array(tensor).astype(np.float32), tensor.name)


def _cast_inputs(graph: onnx.GraphProto, taken: Set[str]) -> None:
    """Each float16 graph input feeds a Cast to float32, which its readers read instead."""
    casts = []
    for value in graph.input:
        if value.type.tensor_type.elem_type == HALF:
            wide = _renamed(graph, value.name, taken)
            casts.append(helper.make_node("Cast", [value.name], [wide], to=FLOAT,
                                          name=unique_name(f"{value.name}_to_float32", taken)))
    for cast in reversed(casts):
        graph.node.insert(0, cast)


def _cast_outputs(graph: onnx.GraphProto, taken: Set[str]) -> None:
    """Each float16 graph output is a Cast back to float16 of what its producer now makes."""
    for value in graph.output:
        if value.type.tensor_type.elem_type == HALF:
            wide = _renamed(graph, value.name, taken)
            graph.node.append(helper.make_node("Cast", [wide], [value.name], to=HALF,
                                               name=unique_name(f"{value.name}_to_float16", taken)))


def _renamed(graph: onnx.GraphProto, name: str, taken: Set[str]) -> str:
    """Every node's use of tensor ``name`` (read or made) renamed to a new float32 name."""
    wide = unique_name(f"{name}_float32", taken)
    for node in graph.node:
        node.input[:] = [wide if tensor == name else tensor for tensor in node.input]
        node.output[:] = [wide if tensor == name else tensor for tensor in node.output]
    return wide
