"""fp16 builds: find what fp16 cannot hold (activations from calibration statistics,
constants from the model), name the nodes that must stay fp32, and convert the rest with
onnxconverter-common, repairing the graphs it gets wrong around a block list."""

from __future__ import annotations

import math
import warnings
from typing import TYPE_CHECKING, Dict, Iterator, List, Mapping, Sequence, Set, Tuple

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

if TYPE_CHECKING:
    from pipeline.precision.calibration.histogram import AbsHistogram

FP16_MAX = 65504.0
FP16_MIN_NORMAL = 2.0**-14
FP16_SMALLEST = 2.0**-24  # the smallest fp16 subnormal
# An activation is reported as denormal when more than this share of its non-zero values
# lies below FP16_MIN_NORMAL: there fp16 keeps fewer than 10 significant bits, and values
# below FP16_SMALLEST become 0.
DENORMAL_SHARE = 0.5
# onnxconverter-common's defaults, which clamp every constant beyond them.
LIBRARY_MAX_FINITE = 1e4
LIBRARY_MIN_POSITIVE = 1e-7


def activation_findings(histograms: Mapping[str, AbsHistogram]) -> List[dict]:
    """Activations fp16 cannot hold, from calibration histograms of |x|: "fp16_overflow"
    (error) when max |x| > FP16_MAX, "fp16_denormal" (warning) when more than
    DENORMAL_SHARE of the non-zero values lie below FP16_MIN_NORMAL. Counts interpolate
    linearly inside a bin, so they are as fine as the histogram (bins of abs_max / bins):
    with 2048 bins, 2**-14 is resolved only when abs_max < 0.125; above that the values
    below it share bin 0 and are estimated as spread evenly over it, which undercounts
    values clustered at 0."""
    findings = []
    for tensor, histogram in histograms.items():
        if histogram.abs_max > FP16_MAX:
            over = max(1, round(histogram.count - _count_below(histogram, FP16_MAX)))
            findings.append(_finding(
                tensor, "fp16_overflow", over,
                f"max |x| {histogram.abs_max:.6g} > {FP16_MAX:.0f}: about {over} value(s) become inf in fp16",
                "error"))
        nonzero = histogram.count - histogram.zero_count
        if nonzero > 0:
            tiny = _count_below(histogram, FP16_MIN_NORMAL) - histogram.zero_count
            if tiny > DENORMAL_SHARE * nonzero:
                findings.append(_finding(
                    tensor, "fp16_denormal", round(tiny),
                    f"{tiny / nonzero:.0%} of the non-zero values have |x| < 2**-14 ({FP16_MIN_NORMAL:.3g}): "
                    f"fp16 keeps fewer than 10 significant bits there and flushes |x| < 2**-24 to 0",
                    "warning"))
    return findings


def constant_findings(model: onnx.ModelProto) -> List[dict]:
    """Float32 initializers and Constant values of the main graph with |x| > FP16_MAX
    ("fp16_overflow", error; the converter would clamp them) or NaN/Inf ("nan_inf",
    error; fp16 stores them as they are, so blocking would not change them). Each
    finding names the nodes that consume the tensor under "node"."""
    consumers = _consumers(model.graph)
    findings = []
    for name, tensor in _graph_constants(model.graph):
        if tensor.data_type != TensorProto.FLOAT:
            continue
        values = numpy_helper.to_array(tensor).ravel()
        nonfinite = ~np.isfinite(values)
        over = np.abs(np.where(nonfinite, 0.0, values)) > FP16_MAX
        nodes = [n.name for n in consumers.get(name, [])]
        if over.any():
            top = float(np.abs(values[over]).max())
            findings.append({**_finding(name, "fp16_overflow", int(over.sum()),
                                        f"max |x| {top:.6g} > {FP16_MAX:.0f}: fp16 cannot hold it", "error"),
                             "node": nodes})
        if nonfinite.any():
            findings.append({**_finding(name, "nan_inf", int(nonfinite.sum()),
                                        f"{int(np.isnan(values).sum())} NaN, {int(np.isinf(values).sum())} Inf "
                                        "(fp16 keeps them as they are)", "error"),
                             "node": nodes})
    return findings


def name_nodes(model: onnx.ModelProto) -> None:
    """Give every node of the main graph a unique name, in place: an unnamed node (or a
    later node repeating a name) becomes f"{op_type}_{index}" (index in graph.node), with
    a suffix if that is taken. Named, unique nodes are left alone, so it is idempotent."""
    taken = {node.name for node in model.graph.node if node.name}
    seen: Set[str] = set()
    for index, node in enumerate(model.graph.node):
        if not node.name or node.name in seen:
            node.name = unique_name(f"{node.op_type}_{index}", taken)
        seen.add(node.name)


def block_list(model: onnx.ModelProto, findings: Sequence[dict]) -> List[str]:
    """Names of the nodes to keep in fp32 (names nodes first, see name_nodes). For every
    "fp16_overflow" finding: the tensor's producer (a Constant node for a constant; none
    for an initializer) and every consumer. The producer alone is not enough: the
    converter casts a blocked node's output back to fp16 for its consumers, which is
    where the value overflows. NaN/Inf and denormal findings block nothing (blocking
    would not change them). A finding naming a tensor the graph lacks is an error: the
    statistics must come from the graph that gets converted."""
    name_nodes(model)
    producers = {out: node for node in model.graph.node for out in node.output if out}
    consumers = _consumers(model.graph)
    known = set(producers) | set(consumers) | {i.name for i in model.graph.input} | \
        {t.name for t in model.graph.initializer}
    overflowing = [f["tensor"] for f in findings if f["check"] == "fp16_overflow"]
    missing = sorted(set(overflowing) - known)
    if missing:
        raise ValueError(f"fp16 block list: the model has no tensor {', '.join(map(repr, missing))}")
    blocked: Set[str] = set()
    for tensor in overflowing:
        if tensor in producers:
            blocked.add(producers[tensor].name)
        blocked.update(node.name for node in consumers.get(tensor, []))
    return [node.name for node in model.graph.node if node.name in blocked]


def convert(model_path, out_path, block: Sequence[str], keep_io_types: bool = True) -> dict:
    """Write the fp16 model: every float32 tensor becomes fp16 except inside the nodes in
    `block` (and onnxconverter-common's default op block list), which run in fp32 between
    Cast nodes; model inputs and outputs stay float32 when keep_io_types. Constants are
    clamped only where fp16 cannot hold them, and the summary names every one that was.
    The result passes onnx.checker.check_model(full_check=True)."""
    from onnxconverter_common import __version__ as library_version
    from onnxconverter_common import float16

    model = onnx.load(str(model_path))
    name_nodes(model)
    unknown = sorted(set(block) - {node.name for node in model.graph.node})
    if unknown:
        raise ValueError(f"fp16 block list: the model has no node {', '.join(map(repr, unknown))}")
    by_op_type = [n.name for n in model.graph.node
                  if n.op_type in float16.DEFAULT_OP_BLOCK_LIST and n.name not in block]
    blocked = set(block) | set(by_op_type)
    float_outputs = {o.name for o in model.graph.output if o.type.tensor_type.elem_type == TensorProto.FLOAT}
    float_initializers = {t.name for t in model.graph.initializer if t.data_type == TensorProto.FLOAT}
    if _has_fp16(model.graph):
        raise ValueError(f"{model_path}: the model already has float16 inputs, outputs or initializers")

    _split_shared_initializers(model.graph, blocked)
    blocked |= _separate_consumed_outputs(model.graph, blocked)
    _retype_float_producers(model.graph, blocked)
    clamped, avoided = _clamping(model.graph, blocked)
    original_nodes = {node.name for node in model.graph.node}

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # its clamping warnings are reported in the summary instead
        converted = float16.convert_float_to_float16(
            model, keep_io_types=keep_io_types, node_block_list=sorted(blocked),
            min_positive_val=FP16_SMALLEST, max_finite_val=FP16_MAX,
            check_fp16_ready=False)  # its check fails on the fp16 Casts _retype_float_producers writes

    added = {node.name for node in converted.graph.node} - original_nodes
    bypassed = _bypass_round_trips(converted.graph, added)
    if keep_io_types:
        _restore_float_outputs(converted.graph, float_outputs, added)
    del converted.graph.value_info[:]  # stale after the repairs; inferred again below
    converted = onnx.shape_inference.infer_shapes(converted, check_type=True, strict_mode=True)
    onnx.checker.check_model(converted, full_check=True)
    onnx.save(converted, str(out_path))

    fp32_initializers = [t.name for t in converted.graph.initializer if t.data_type == TensorProto.FLOAT]
    return {
        "converter": f"onnxconverter-common {library_version}",
        "blocked": list(block),
        "blocked_by_op_type": by_op_type,
        "converted_initializers": sum(t.data_type == TensorProto.FLOAT16 and t.name in float_initializers
                                      for t in converted.graph.initializer),
        "fp32_initializers": fp32_initializers,
        "casts": sum(node.op_type == "Cast" and node.name in added for node in converted.graph.node),
        "round_trips_removed": bypassed,
        "clamped": clamped,
        "library_defaults_would_clamp": avoided,
        "keep_io_types": keep_io_types,
    }


def _finding(tensor: str, check: str, count: int, detail: str, severity: str) -> dict:
    return {"tensor": tensor, "check": check, "count": int(count), "detail": detail, "severity": severity}


def _count_below(histogram: AbsHistogram, threshold: float) -> float:
    """Approximate number of values with |x| < threshold: whole bins below it, plus the
    straddling bin's non-zero values in proportion to overlap (exact zeros always count)."""
    if histogram.width == 0.0 or threshold > histogram.abs_max:
        return float(histogram.count)
    position = threshold / histogram.width
    whole = min(int(math.floor(position)), histogram.bins)
    below = float(histogram.counts[:whole].sum())
    if whole < histogram.bins:
        in_bin = float(histogram.counts[whole])
        zeros = histogram.zero_count if whole == 0 else 0
        below += zeros + (in_bin - zeros) * (position - whole)
    return below


def _consumers(graph: onnx.GraphProto) -> Dict[str, List[onnx.NodeProto]]:
    consumers: Dict[str, List[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in dict.fromkeys(node.input):  # a node reading a tensor twice counts once
            if name:
                consumers.setdefault(name, []).append(node)
    return consumers


def _graph_constants(graph: onnx.GraphProto) -> Iterator[Tuple[str, TensorProto]]:
    """(name, tensor) for every initializer and every Constant node's value."""
    for tensor in graph.initializer:
        yield tensor.name, tensor
    for node in graph.node:
        if node.op_type != "Constant" or node.domain not in ("", "ai.onnx"):
            continue
        for attribute in node.attribute:
            if attribute.name == "value":
                yield node.output[0], attribute.t
            elif attribute.name in ("value_float", "value_floats"):
                values = [attribute.f] if attribute.name == "value_float" else list(attribute.floats)
                yield node.output[0], numpy_helper.from_array(np.array(values, dtype=np.float32))


def _split_shared_initializers(graph: onnx.GraphProto, blocked: Set[str]) -> None:
    """A float initializer read by blocked and unblocked nodes gets an fp32 copy for the
    blocked ones: the converter would otherwise leave it fp32 for all of them, and the
    unblocked (fp16) nodes would get a float32 input."""
    initializers = {t.name: t for t in graph.initializer if t.data_type == TensorProto.FLOAT}
    names = {t.name for t in graph.initializer} | {o for n in graph.node for o in n.output}
    for name, readers in _consumers(graph).items():
        if name not in initializers or len({r.name in blocked for r in readers}) < 2:
            continue
        copy_name = unique_name(f"{name}_fp32", names)
        copy = graph.initializer.add()
        copy.CopyFrom(initializers[name])
        copy.name = copy_name
        for node in readers:
            if node.name in blocked:
                node.input[:] = [copy_name if i == name else i for i in node.input]


def _separate_consumed_outputs(graph: onnx.GraphProto, blocked: Set[str]) -> Set[str]:
    """A graph output that nodes also read gets its own Identity, and the readers read the
    producer's output under a new name. The converter mishandles such a tensor: with
    keep_io_types it renames the producer's output for the output Cast but leaves the
    readers on the old name (wrong type); without, it inserts no fp32 Cast before a
    blocked reader (it looks the tensor up in value_info, which lists no graph outputs).
    The Identity is blocked when its producer is. Returns the blocked Identity nodes."""
    readers = _consumers(graph)
    names = {o for n in graph.node for o in n.output} | {n.name for n in graph.node}
    added_blocked = set()
    for output in graph.output:
        producer_index = next((i for i, n in enumerate(graph.node) if output.name in n.output), None)
        if output.name not in readers or producer_index is None:
            continue
        producer = graph.node[producer_index]
        inner = unique_name(f"{output.name}_inner", names)
        producer.output[:] = [inner if o == output.name else o for o in producer.output]
        for node in readers[output.name]:
            node.input[:] = [inner if i == output.name else i for i in node.input]
        identity = helper.make_node("Identity", [inner], [output.name], name=unique_name(f"{output.name}_output", names))
        graph.node.insert(producer_index + 1, identity)
        if producer.name in blocked:
            added_blocked.add(identity.name)
    return added_blocked


def _retype_float_producers(graph: onnx.GraphProto, blocked: Set[str]) -> None:
    """Ops whose attribute fixes a float32 output, which the converter leaves alone: an
    unblocked Cast(to=FLOAT) casts to fp16 instead, and an unblocked ConstantOfShape
    without a value gets an explicit fp16 zero (its default value is float32)."""
    for node in graph.node:
        if node.name in blocked or node.domain not in ("", "ai.onnx"):
            continue
        if node.op_type == "Cast":
            for attribute in node.attribute:
                if attribute.name == "to" and attribute.i == TensorProto.FLOAT:
                    attribute.i = TensorProto.FLOAT16
        elif node.op_type == "ConstantOfShape" and not any(a.name == "value" for a in node.attribute):
            zero = helper.make_tensor("value", TensorProto.FLOAT16, [1], [0.0])
            node.attribute.append(helper.make_attribute("value", zero))


def _clamping(graph: onnx.GraphProto, blocked: Set[str]) -> Tuple[List[dict], List[str]]:
    """What the conversion will clamp (values fp16 cannot hold, in the constants it
    converts), and the constants the library's default bounds would have clamped too."""
    clamped, avoided = [], []
    for name, values in _converted_constants(graph, blocked):
        magnitude = np.abs(values[np.isfinite(values)])
        nonzero = magnitude[magnitude > 0]
        over, under = int((nonzero > FP16_MAX).sum()), int((nonzero < FP16_SMALLEST).sum())
        if over or under:
            parts = [f"{over} value(s) beyond +-{FP16_MAX:.0f} set to +-{FP16_MAX:.0f}"] if over else []
            parts += [f"{under} non-zero value(s) below 2**-24 set to +-2**-24"] if under else []
            clamped.append({"tensor": name, "count": over + under, "detail": "; ".join(parts)})
        if ((nonzero > LIBRARY_MAX_FINITE) | (nonzero < LIBRARY_MIN_POSITIVE)).any():
            avoided.append(name)
    return clamped, avoided


def _converted_constants(graph: onnx.GraphProto, blocked: Set[str]) -> Iterator[Tuple[str, np.ndarray]]:
    """The float32 tensors the converter turns into fp16: initializers no blocked node
    reads, and tensor attributes (named by the Constant's output, or node.attribute) and
    subgraphs of unblocked nodes."""
    read_by_blocked = {i for n in graph.node if n.name in blocked for i in n.input}
    for tensor in graph.initializer:
        if tensor.data_type == TensorProto.FLOAT and tensor.name not in read_by_blocked:
            yield tensor.name, numpy_helper.to_array(tensor).ravel()
    for node in graph.node:
        if node.name in blocked:
            continue
        for attribute in node.attribute:
            label = node.output[0] if node.op_type == "Constant" else f"{node.name}.{attribute.name}"
            for tensor in [attribute.t, *attribute.tensors]:
                if tensor.data_type == TensorProto.FLOAT:
                    yield label, numpy_helper.to_array(tensor).ravel()
            for subgraph in [attribute.g, *attribute.graphs]:
                if subgraph.node:
                    yield from _converted_constants(subgraph, blocked)


def _bypass_round_trips(graph: onnx.GraphProto, added: Set[str]) -> int:
    """Converter Casts float32 -> fp16 -> float32 between two blocked nodes (or a blocked
    node and a float32 input) round through fp16 for nothing, and overflow where the
    value does not fit, which is why both ends were blocked. The library removes such a
    pair only when the fp16 tensor has a single reader. Returns how many were bypassed."""
    types = _elem_types(graph)
    producers = {out: node for node in graph.node for out in node.output}
    outputs = {o.name for o in graph.output}
    bypassed = []
    for node in graph.node:
        first = producers.get(node.input[0]) if node.op_type == "Cast" and node.name in added else None
        if (first is None or first.op_type != "Cast" or first.name not in added
                or _cast_to(node) != TensorProto.FLOAT or _cast_to(first) != TensorProto.FLOAT16
                or types.get(first.input[0]) != TensorProto.FLOAT):
            continue
        if node.output[0] in outputs:  # the output name must stay: the Cast becomes a copy
            _make_identity(node, first.input[0])
            continue
        for reader in graph.node:
            reader.input[:] = [first.input[0] if i == node.output[0] else i for i in reader.input]
        bypassed.append(node)
    for node in bypassed:
        graph.node.remove(node)
    read = {i for n in graph.node for i in n.input} | outputs
    for node in [n for n in graph.node if n.name in added and n.op_type == "Cast" and n.output[0] not in read]:
        graph.node.remove(node)
    return len(bypassed)


def _restore_float_outputs(graph: onnx.GraphProto, float_outputs: Set[str], added: Set[str]) -> None:
    """keep_io_types: the library turns a float32 output of a blocked node into fp16 (it
    appends its fp16 Cast and retypes the output). Drop that Cast (or make it a copy when
    the float32 value has other readers); cast back if the fp16 value comes from elsewhere."""
    types = _elem_types(graph)
    for output in graph.output:
        if output.name not in float_outputs or output.type.tensor_type.elem_type == TensorProto.FLOAT:
            continue
        index, producer = next((i, n) for i, n in enumerate(graph.node) if output.name in n.output)
        source = producer.input[0] if producer.op_type == "Cast" else None
        readers = [n for n in graph.node if source in n.input] if source else []
        from_float = (producer.name in added and _cast_to(producer) == TensorProto.FLOAT16
                      and types.get(source) == TensorProto.FLOAT)
        source_producer = next((n for n in graph.node if source in n.output), None) if from_float else None
        if source_producer is not None and readers == [producer] and source not in float_outputs:
            source_producer.output[:] = [output.name if o == source else o for o in source_producer.output]
            graph.node.remove(producer)
        elif from_float:
            _make_identity(producer, source)
        else:
            names = {o for n in graph.node for o in n.output} | {n.name for n in graph.node}
            inner = unique_name(f"{output.name}_fp16", names)
            producer.output[:] = [inner if o == output.name else o for o in producer.output]
            cast = helper.make_node("Cast", [inner], [output.name], to=TensorProto.FLOAT,
                                    name=unique_name(f"{output.name}_to_float", names))
            graph.node.insert(index + 1, cast)
        output.type.tensor_type.elem_type = TensorProto.FLOAT


def _make_identity(node: onnx.NodeProto, source: str) -> None:
    node.op_type = "Identity"
    node.input[:] = [source]
    del node.attribute[:]


def _has_fp16(graph: onnx.GraphProto) -> bool:
    values = [*graph.input, *graph.output]
    return any(v.type.tensor_type.elem_type == TensorProto.FLOAT16 for v in values) or \
        any(t.data_type == TensorProto.FLOAT16 for t in graph.initializer)


def _elem_types(graph: onnx.GraphProto) -> Dict[str, int]:
    types = {t.name: t.data_type for t in graph.initializer}
    for value in [*graph.input, *graph.value_info, *graph.output]:
        if value.type.HasField("tensor_type"):
            types[value.name] = value.type.tensor_type.elem_type
    return types


def _cast_to(node: onnx.NodeProto) -> int:
    return next((a.i for a in node.attribute if a.name == "to"), 0)


def unique_name(base: str, taken: Set[str]) -> str:
    """``base``, or ``base_1``, ``base_2``...: the first not in ``taken`` (added to it)."""
    name, suffix = base, 1
    while name in taken:
        name, suffix = f"{base}_{suffix}", suffix + 1
    taken.add(name)
    return name
