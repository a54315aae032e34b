"""Small ONNX Runtime models cut out of a graph: one node alone (every input, weights
included, a graph input), shared by the auto method and the sensitivity search."""

from __future__ import annotations

import onnx


def session(model: onnx.ModelProto, tiny: bool = False):
    """An ONNX Runtime CPU session; ``tiny``: single-threaded (a thread pool per one-node
    session costs more than the node)."""
    import onnxruntime as ort

    from pipeline.backends.onnxruntime import untimed_options

    options = untimed_options()
    options.log_severity_level = 4
    options.inter_op_num_threads = 1
    if tiny:
        options.intra_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def node_session(model: onnx.ModelProto, node: onnx.NodeProto):
    """``node`` alone; feed every input by name, weights included."""
    inputs = [onnx.helper.make_tensor_value_info(name, elem_type(model, name), None) for name in node.input if name]
    output = onnx.helper.make_tensor_value_info(node.output[0], onnx.TensorProto.FLOAT, None)
    single = onnx.helper.make_model(onnx.helper.make_graph([node], "op", inputs, [output]),
                                    opset_imports=list(model.opset_import))
    single.ir_version = model.ir_version
    return session(single, tiny=True)


def elem_type(model: onnx.ModelProto, name: str) -> int:
    for value in list(model.graph.input) + list(model.graph.value_info) + list(model.graph.output):
        if value.name == name:
            return value.type.tensor_type.elem_type
    for tensor in model.graph.initializer:
        if tensor.name == name:
            return tensor.data_type
    return onnx.TensorProto.FLOAT
