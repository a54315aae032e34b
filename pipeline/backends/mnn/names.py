"""MNN tensor and op names -> ONNX names: which ONNX tensors an MNN model holds faithfully
(``tensor_map``, tensors.json) and which ONNX node each compute op computes (``onnx_ops``)."""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np

from pipeline.backends.mnn.common import _COMPUTE_OPS, _mnn_graph, _mnn_root, PRECISION_MODES
from pipeline.backends.mnn.session import _mnn_candidates, Session

_ONNX_PASSTHROUGH = {"Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity", "Dropout"}
_FLOAT_ELEM_TYPES = {1, 10, 11, 16}  # ONNX float, float16, double, bfloat16
_ONNX_COMPUTE = {"Conv", "ConvTranspose", "Gemm", "MatMul"}  # what MNN's compute ops stand for
MAX_FUSED = 6  # single-input ops between a fused MNN op's name and the ONNX op it computes


def tensor_map(onnx_path: Path, mnn_path: Path, converted: Optional[Path] = None) -> dict:
    """Which ONNX tensors the MNN model holds, and which it does not faithfully.

    MNN's converter keeps ONNX tensor names, but a fused op writes its result under the
    names along its chain: with Gemm -> Relu fused, MNN's tensor "fc1_out" holds
    relu(fc1_out). Tensors of the MNN model that lead (through layout-only ops) to the
    same computing op form a group; within a group only the ONNX tensors of the latest
    ONNX op hold their own values. ``converted``: for a quantized model, the converter's
    fp32 model it was made from; the map is made on it and a quantized tensor is kept
    only where it is produced like its fp32 namesake (MNN's EMA quantizer rebuilds the
    graph and names tensors after ops: its "conv1_out" holds relu1_out's values)."""
    if converted is not None:
        return _restricted(tensor_map(onnx_path, converted), _mnn_graph(converted), _mnn_graph(mnn_path))
    import onnx

    model = onnx.load(str(onnx_path), load_external_data=False)
    producers, order = _onnx_producers(model.graph)
    shapes, types = _onnx_shapes(model)
    graph_mnn = _mnn_graph(mnn_path)
    groups: Dict[str, List[str]] = {}
    for name in producers:
        if name in graph_mnn and graph_mnn[name]["float"] and (types.get(name) or 1) in _FLOAT_ELEM_TYPES:
            groups.setdefault(_mnn_root(graph_mnn, name), []).append(name)
    faithful, fused = {}, {}
    for root, members in groups.items():
        roots = {name: _onnx_root(producers, name) for name in members}
        latest = max(roots.values(), key=lambda r: order.get(r, -1))
        for name in members:
            problem = _unfaithful(name, roots[name], latest, graph_mnn, root, shapes)
            if problem:
                fused[name] = problem
            else:
                faithful[name] = {"shape": shapes.get(name)}
    return {"format": 1, "faithful": faithful, "fused": fused,
            "mnn_tensors": sorted(name for name, info in graph_mnn.items() if info["activation"])}


def _onnx_producers(graph) -> Tuple[dict, Dict[str, int]]:
    """({tensor computed from the inputs: its producing node}, {tensor: the node's index})."""
    initializers = {t.name for t in graph.initializer}
    dynamic = {i.name for i in graph.input if i.name not in initializers}
    producers, order = {}, {}
    for index, node in enumerate(graph.node):
        if any(name in dynamic for name in node.input):
            for name in node.output:
                if name:
                    dynamic.add(name)
                    producers[name], order[name] = node, index
    return producers, order


def _onnx_shapes(model) -> Tuple[Dict[str, List[int]], Dict[str, int]]:
    """({tensor: static shape}, {tensor: ONNX element type}), shapes inferred where ONNX can."""
    from onnx import shape_inference

    graph = model.graph
    shapes, types = {}, {}
    try:
        inferred = shape_inference.infer_shapes(model)
        infos = list(inferred.graph.value_info) + list(inferred.graph.output) + list(inferred.graph.input)
    except Exception:  # noqa: BLE001 - shapes only refine the map
        infos = list(graph.value_info) + list(graph.output) + list(graph.input)
    for info in infos:
        tensor_type = info.type.tensor_type
        types[info.name] = tensor_type.elem_type
        dims = tensor_type.shape.dim
        if dims and all(d.HasField("dim_value") and d.dim_value > 0 for d in dims):
            shapes[info.name] = [int(d.dim_value) for d in dims]
    return shapes, types


def _onnx_root(producers: dict, name: str) -> str:
    """The tensor a chain of value-preserving ONNX ops (Reshape, Identity, ...) starts from."""
    seen = set()
    while name in producers and producers[name].op_type in _ONNX_PASSTHROUGH and name not in seen:
        seen.add(name)
        name = producers[name].input[0]
    return name


def _unfaithful(name: str, onnx_root: str, latest: str, graph_mnn: Dict[str, dict], root: str,
                shapes: Dict[str, List[int]]) -> Optional[str]:
    """Why MNN's tensor ``name`` does not hold the ONNX tensor's values, or None when it does."""
    if onnx_root != latest:
        return (f"MNN computes it in one op ({graph_mnn[root]['op']}) with {latest}: "
                f"the tensor holds {latest}'s values")
    mnn_size = graph_mnn[name]["size"]
    if name in shapes and mnn_size and int(np.prod(shapes[name])) != mnn_size:
        return f"MNN's tensor has {mnn_size} elements, ONNX's {int(np.prod(shapes[name]))}"
    return None


def _restricted(found: dict, before: Dict[str, dict], after: Dict[str, dict]) -> dict:
    faithful, fused = {}, dict(found["fused"])
    for name, info in found["faithful"].items():
        same = (name in after and after[name]["float"] and after[name]["size"] == before[name]["size"]
                and before[_mnn_root(before, name)]["op"] == after[_mnn_root(after, name)]["op"])
        if same:
            faithful[name] = info
        elif name in after:
            fused[name] = "the quantized model's tensor of this name is produced by a different op than the fp32 one"
    return {"format": 1, "faithful": faithful, "fused": fused,
            "mnn_tensors": sorted(name for name, info in after.items() if info["activation"])}


def onnx_ops(mnn_path: Path, onnx_path: Path, feeds: Dict[str, np.ndarray]) -> Dict[str, str]:
    """{MNN op name: ONNX node} for the compute ops of an MNN model, run once on ``feeds``
    (op names exist only in a session), mapped as the per-op profile maps them."""
    from pipeline import profiling

    nodes = profiling.Nodes.load(onnx_path)
    found = {}
    for name, op_type, _ in op_census(mnn_path, feeds):
        if op_type in _COMPUTE_OPS:
            node = nodes.layer(name, op_type, None, 0.0, _mnn_candidates(name, op_type))["onnx_node"]
            if node is not None:
                found[name] = _computing(nodes, node)
    return found


def _computing(nodes, node: str) -> str:
    """The Conv/Gemm/MatMul upstream of a node through single-input ops: MNN runs a MatMul
    and the bias Add after it as one Convolution named after the Add (PP-OCR's classifier)."""
    current = node
    for _ in range(MAX_FUSED):
        if nodes.types.get(current) in _ONNX_COMPUTE:
            return current
        inputs = nodes.inputs.get(current, [])
        current = nodes.producers.get(inputs[0]) if len(inputs) == 1 else None
        if current is None:
            break
    return node


def op_census(mnn_path: Path, feeds: Dict[str, np.ndarray]) -> List[Tuple[str, str, bool]]:
    """(op name, type, ran in int8) of every op a CPU session of the model runs."""
    session = Session(mnn_path, {"backend": "CPU", "forward_type": 0, "precision_mode": PRECISION_MODES["high"]})
    return session._op_census(feeds)
