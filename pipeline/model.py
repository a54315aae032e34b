"""Reading ONNX files safely: precise errors for the ways a model file goes wrong,
external data kept inside the model's directory, and the model's signature."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np
import onnx
from google.protobuf.message import DecodeError

from pipeline import shapes
from pipeline.data import TensorSpec
from pipeline.errors import InputError, first_line


def load_onnx(path: Path, key: str = "model.path") -> onnx.ModelProto:
    path = Path(path).expanduser()
    if not path.exists():
        raise InputError(f"{key}: {path} does not exist (set {key}=... to an ONNX file)")
    if path.is_dir():
        raise InputError(f"{key}: {path} is a directory, not an ONNX file")
    if not path.is_file():  # reading a FIFO would wait forever, a device never ends
        raise InputError(f"{key}: {path} is not a regular file (a device, pipe or socket): give the ONNX file itself")
    head = path.read_bytes()[:512] if path.stat().st_size else b""
    if not head:
        raise InputError(f"{key}: {path} is empty (0 bytes): re-export or re-download the model")
    if _looks_like_text(head):
        raise InputError(f"{key}: {path} is a text file, not an ONNX model (binary protobuf)")
    try:
        model = onnx.load(str(path), load_external_data=False)
    except (DecodeError, ValueError, RuntimeError) as err:
        raise InputError(f"{key}: {path} cannot be parsed as ONNX, the file is truncated or not a model "
                         f"({first_line(err)})") from err
    if not model.graph.node or not model.graph.output or not model.opset_import:
        raise InputError(f"{key}: {path} is not a complete ONNX model (no graph nodes, outputs or opset): "
                         "the file is truncated or not a model")
    _load_external_data(model, path, key)
    return model


def _looks_like_text(head: bytes) -> bool:
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return all(ch.isprintable() or ch in "\r\n\t" for ch in text)


def _load_external_data(model: onnx.ModelProto, path: Path, key: str) -> None:
    base = path.parent.resolve()
    external = [t for t in _all_tensors(model) if t.data_location == onnx.TensorProto.EXTERNAL]
    for tensor in external:
        info = {entry.key: entry.value for entry in tensor.external_data}
        location = info.get("location", "")
        target = (base / location).resolve()
        if Path(location).is_absolute() or not target.is_relative_to(base):
            raise InputError(f"{key}: external data '{location}' of tensor '{tensor.name}' points outside "
                             f"the model's directory {base}; refusing to read it")
        if not target.is_file():
            raise InputError(f"{key}: external data file '{location}' of tensor '{tensor.name}' is missing "
                             f"(expected at {target})")
        needed = int(info.get("offset", 0)) + int(info.get("length", 0))
        if target.stat().st_size < needed:
            raise InputError(f"{key}: external data file '{location}' is truncated "
                             f"({target.stat().st_size} bytes, tensor '{tensor.name}' needs {needed})")
    if external:
        onnx.load_external_data_for_model(model, str(base))


def external_data_files(path: Path) -> List[Path]:
    """The external data files a model file refers to, inside its directory (cache keys)."""
    base = Path(path).parent.resolve()
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception:  # noqa: BLE001 - a corrupt model is reported by load_onnx
        return []
    found = set()
    for tensor in _all_tensors(model):
        for entry in tensor.external_data:
            target = (base / entry.value).resolve()
            if entry.key == "location" and target.is_relative_to(base) and target.is_file():
                found.add(target)
    return sorted(found)


def _all_tensors(model: onnx.ModelProto):
    yield from model.graph.initializer
    for node in model.graph.node:
        for attribute in node.attribute:
            if attribute.HasField("t"):
                yield attribute.t



def check(model: onnx.ModelProto, key: str = "model.path") -> None:
    try:
        onnx.checker.check_model(model, full_check=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as err:
        raise InputError(f"{key}: the ONNX checker rejects the model: {first_line(err)}") from err


# ops that make a model quantized already (a quantizer's QDQ or QOperator output): parity builds it as given
QUANTIZED_OP_TYPES = ("QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear", "QLinearConv", "QLinearMatMul",
                      "ConvInteger", "MatMulInteger", "QLinearAdd", "QLinearMul", "QGemm")
BATCH_AXES_KEY = "parity.batch_axes"  # metadata_props: {input: batch axis or null}, written by convert


def signature(model: onnx.ModelProto, outputs: bool = False) -> List[TensorSpec]:
    """The graph's real inputs (initializers excluded) or outputs, with dims as ints
    (0 for an unknown dim), numpy dtype names and, for inputs, the batch axis (as convert
    recorded it, else found from the dims' names: ``batch_axes``)."""
    initializers = {t.name for t in model.graph.initializer}
    values = model.graph.output if outputs else [v for v in model.graph.input if v.name not in initializers]
    recorded = {p.key: p.value for p in model.metadata_props}.get(BATCH_AXES_KEY)
    axes = json.loads(recorded) if recorded else batch_axes(model)
    ranges = {} if outputs else shapes.recorded(model)
    specs = []
    for value in values:
        tensor_type = value.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else 0 for d in tensor_type.shape.dim]
        dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tensor_type.elem_type)).name
        axis = axes.get(value.name, 0 if dims else None) if not outputs else (0 if dims else None)
        found = ranges.get(value.name)
        specs.append(TensorSpec(value.name, dims, dtype, axis, found.to_json() if found else None))
    return specs


def batch_axes(model: onnx.ModelProto) -> Dict[str, Optional[int]]:
    """Each graph input's batch axis. The batch is the symbolic dim named like "batch" (or,
    failing that, the name most inputs' first dims share); an input carrying that name has
    its batch there (silero-vad's state [2, batch, 128]: axis 1). Otherwise axis 0 when the
    first dim is symbolic or 1; none for a scalar or a fixed first dim > 1."""
    initializers = {t.name for t in model.graph.initializer}
    dims = {v.name: [d.dim_param if d.dim_param and not d.HasField("dim_value") else d.dim_value
                     for d in v.type.tensor_type.shape.dim]
            for v in model.graph.input if v.name not in initializers}
    names = [d for shape in dims.values() for d in shape if isinstance(d, str)]
    batch = next((d for d in names if "batch" in d.lower()), None)
    if batch is None:
        firsts = Counter(shape[0] for shape in dims.values() if shape and isinstance(shape[0], str))
        batch = firsts.most_common(1)[0][0] if firsts else None
    axes: Dict[str, Optional[int]] = {}
    for name, shape in dims.items():
        if batch is not None and batch in shape:
            axes[name] = shape.index(batch)
        elif shape and (isinstance(shape[0], str) or shape[0] in (0, 1)):
            axes[name] = 0
        else:
            axes[name] = None
    return axes


def record_batch_axes(model: onnx.ModelProto, axes: Dict[str, Optional[int]]) -> None:
    """Keep the batch axes in the model (convert fixes the symbolic dims they come from)."""
    props = {p.key: p.value for p in model.metadata_props}
    onnx.helper.set_model_props(model, {**props, BATCH_AXES_KEY: json.dumps(axes)})  # replaces them all


def ops_in_control_flow(model: onnx.ModelProto, op_types) -> Dict[str, List[str]]:
    """Per control-flow node of the main graph (If, Loop, Scan: "Loop 'loop'"), the ``op_types``
    its bodies hold, nested bodies included; only nodes that hold some."""
    wanted, found = set(op_types), {}
    for node in model.graph.node:
        inside = sorted({inner.op_type for body in bodies(node) for inner in _walk(body)} & wanted)
        if inside:
            found[f"{node.op_type} '{node.name}'"] = inside
    return found


def bodies(node: onnx.NodeProto) -> List[onnx.GraphProto]:
    """The graphs a node holds as attributes: an If's branches, a Loop's or Scan's body."""
    return [body for attribute in node.attribute
            for body in ([attribute.g] if attribute.type == onnx.AttributeProto.GRAPH else list(attribute.graphs))]


def _walk(graph: onnx.GraphProto):
    for node in graph.node:
        yield node
        for body in bodies(node):
            yield from _walk(body)
