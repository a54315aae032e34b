"""Pass-through ops of an int8 build (precision.passthrough_ops): ops that only move or clamp
values (Relu, Clip, MaxPool, Resize, Concat) given Q/DQ around them so that int8 flows from one
quantized op to the next (docs/calibration.md, "Pass-through ops"). Their ranges follow from
the measured neighbours' (calibration measures only around precision.quantize_ops), and a
mixed model derived from the all-int8 one keeps the pairs the quantizer would keep. An op kept
float takes the pass-through ops next to it along (float_neighbours)."""

from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Tuple

import numpy as np


def passthrough_for(precision, capabilities, outputs_quantized: bool) -> Tuple[str, ...]:
    """precision.passthrough_ops, null resolved: the backend's (Capabilities.qdq_passthrough)
    where outputs are quantized and activations are uint8 (a Relu folds into the Q before it
    only where that Q's zero point is 0)."""
    if precision.passthrough_ops is not None:
        return tuple(precision.passthrough_ops)
    unsigned = precision.activations.value == "uint8"
    return tuple(capabilities.qdq_passthrough) if outputs_quantized and unsigned else ()


def remove_nodes(graph, nodes) -> None:
    """The nodes, and the initializers only they read (their Q/DQ scales and zero points)."""
    names = {name for node in nodes for name in node.input}
    for node in nodes:
        graph.node.remove(node)
    still_read = {name for node in graph.node for name in node.input}
    for tensor in [t for t in graph.initializer if t.name in names and t.name not in still_read]:
        graph.initializer.remove(tensor)


def producers_and_readers(graph) -> Tuple[Dict[str, object], Dict[str, list]]:
    """({tensor: the node writing it}, {tensor: the nodes reading it}) of an ONNX graph."""
    producer = {out: node for node in graph.node for out in node.output}
    readers: Dict[str, list] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    return producer, readers


GATES = ("Sigmoid", "HardSigmoid")  # x * gate(x): SiLU, and HardSwish as ONNX Runtime's optimizer splits it
SWISH_OPS = (*GATES, "Mul")


def swish_ops(model, made_by: Iterable[str], table: Optional[Dict[str, dict]] = None) -> List[str]:
    """The gate and the Mul of each x * Sigmoid(x) or x * HardSigmoid(x) whose x an op of the
    types ``made_by`` makes (YOLO's SiLU, MobileNetV3's HardSwish after a Conv;
    QdqSettings.swish_after), where ``table`` has ranges for x, the gate's output and the
    product (all of them without a table). ONNX Runtime runs a Sigmoid and the Mul as
    QLinearSigmoid and QLinearMul, a HardSigmoid in float between its Q/DQ and the Mul as
    QLinearMul; left float, each costs a dequantize and a quantize between two convolutions
    (the YOLOv8n-architecture detector: int8 1.43x fp32 with them float, 1.54x quantized)."""
    made_by = set(made_by)
    if not made_by:
        return []
    producer = {out: node for node in model.graph.node for out in node.output}
    gated = list(_gated_muls(model, producer))
    found: List[str] = []
    for mul, x, gate in gated:
        made = producer.get(x)
        if mul.name not in found and gate.input[0] == x and made is not None and made.op_type in made_by \
                and (table is None or all(name in table for name in (x, gate.output[0], mul.output[0]))):
            found += [gate.name, mul.name]
    return found + _excite_gates(gated, producer, made_by, set(found), table)


def _gated_muls(model, producer):
    """(Mul, x, gate node) for each reading of a two-input Mul as x times what a gate (GATES)
    makes: both ways round where both inputs are gated."""
    for mul in model.graph.node:
        if mul.op_type == "Mul" and len(mul.input) == 2:
            for x, gate in (tuple(mul.input), tuple(mul.input)[::-1]):
                made = producer.get(gate)
                if made is not None and made.op_type in GATES:
                    yield mul, x, made


def _excite_gates(gated, producer, made_by: set, swish: set, table: Optional[Dict[str, dict]]) -> List[str]:
    """The Sigmoid and the Mul of each squeeze-excite gate x * Sigmoid(g) of ``gated``
    (_gated_muls): g made by an op of the types ``made_by`` (the excite convolution), x by one
    of them or by a SiLU of ``swish`` (EfficientNet's blocks), with ranges for g, the gate and
    the product where ``table`` is given. ONNX Runtime runs them as QLinearSigmoid and
    QLinearMul; left float, the gate costs a dequantize and a quantize of the block's whole
    tensor (an EfficientNet-B0-like classifier: int8 0.99x fp32, ONNX Runtime's own quantizer
    1.15x). HardSigmoid gates (PP-LCNet, MobileNetV3) stay float: ONNX Runtime has no int8
    HardSigmoid."""
    found: List[str] = []
    for mul, x, gate in gated:
        excite, made = producer.get(gate.input[0]), producer.get(x)
        if mul.name not in swish and mul.name not in found and gate.op_type == "Sigmoid" \
                and excite is not None and excite.op_type in made_by and made is not None and (made.op_type in made_by or made.name in swish) \
                and (table is None or all(name in table for name in (gate.input[0], gate.output[0], mul.output[0]))):
            found += [gate.name, mul.name]
    return found


def quantizer_inputs(model, table: Dict[str, dict], quantize_ops, passthrough_ops, keep_float: List[str],
                     options: dict, swish_after: Iterable[str] = ()) -> Tuple[Dict[str, dict], List[str], List[str]]:
    """(the table, the op types to quantize, the ops to exclude) ONNX Runtime's quantizer gets;
    ``options`` (its extra_options) updated in place. ``swish_after``: the SiLU ops after
    these op types whose tensors the table has are quantized too, every other Sigmoid and Mul
    excluded."""
    op_types = list(quantize_ops)
    quantized = [name for name in swish_ops(model, swish_after, table) if name not in keep_float]
    if quantized:
        op_types += [t for t in SWISH_OPS if t not in op_types]
        keep_float = [*keep_float, *(node.name for node in model.graph.node if node.op_type in SWISH_OPS
                                     and node.name not in quantized and node.name not in keep_float)]
    if not passthrough_ops:
        return table, op_types, list(keep_float)
    table, unresolved = passthrough_ranges(model, table, passthrough_ops)
    # a quantized Relu stays in the graph (ONNX Runtime drops it at load, its Q clamping at
    # zero), so that keep_in_float's derivation holds for pass-through graphs too
    options["QDQKeepRemovableActivations"] = True
    return (_float_relus_ranges(model, table, keep_float), op_types + [t for t in passthrough_ops if t not in op_types],
            [*keep_float, *unresolved])


def _float_relus_ranges(model, table: Dict[str, dict], keep_float: Iterable[str]) -> Dict[str, dict]:
    """Where a float Relu (or Clip) is its input's only reader, the input's Q takes its range, as
    the all-int8 model's shared Q has it (nothing outside that range survives it anyway)."""
    float_relus = [node for node in model.graph.node if node.op_type in CLAMPS and node.name in set(keep_float)]
    readers: Dict[str, int] = {}
    for node in model.graph.node:
        for name in node.input:
            readers[name] = readers.get(name, 0) + 1
    outputs = {o.name for o in model.graph.output}
    table = dict(table)
    for relu in float_relus:
        source, out = relu.input[0], relu.output[0]
        if readers.get(source) == 1 and source not in outputs and source in table and out in table:
            table[source] = {**table[out], "derived_from": out}
    return table


def float_neighbours(model, float_ops: Iterable[str], passthrough_ops: Iterable[str], swish: Iterable[str] = ()) -> set:
    """``float_ops`` with the pass-through ops next to them, and next to those, in float too
    (and the quantized SiLU ops named in ``swish``). A quantized Relu, MaxPool or Concat
    beside a float op keeps its Q/DQ at the int8 scale, so keeping the op float removed little
    error: on the real-size segmenter the fused logits' Conv and the search's top 4 ops float
    gave map IoU 0.975 of fp32's with their neighbours int8 and 0.986 with them float (docs/time.md)."""
    chosen, passing, swish = set(float_ops), set(passthrough_ops), set(swish)
    if not chosen or not (passing or swish):
        return chosen
    producer, readers = producers_and_readers(model.graph)
    by_name = {node.name: node for node in model.graph.node}
    todo = [by_name[name] for name in chosen if name in by_name]
    while todo:
        node = todo.pop()
        near = [producer[name] for name in node.input if name in producer] + \
               [reader for out in node.output for reader in readers.get(out, [])]
        for other in near:
            if (other.op_type in passing or other.name in swish) and other.name not in chosen:
                chosen.add(other.name)
                todo.append(other)
    return chosen


def int8_after(graph, producer: dict, quantize_ops, passthrough_ops, float_ops: set, swish: Iterable[str] = ()) -> set:
    """The ops still int8 once ``float_ops`` are float, as the quantizer decides it: an op of
    ``quantize_ops`` unless named; a SiLU op of ``swish`` or a pass-through op it quantized in
    the all-int8 model (reads a DequantizeLinear) unless named, a Relu, MaxPool or Resize only
    while the op making its input is still int8 (ONNX Runtime quantizes those only behind a
    quantized tensor), in graph order."""
    swish = set(swish)
    in_int8 = set()

    def source(name: str):  # the op making ``name``, through a Q -> DQ pair
        node = producer.get(name)
        if node is not None and node.op_type == "DequantizeLinear":
            made = producer.get(node.input[0])
            node = producer.get(made.input[0]) if made is not None and made.op_type == "QuantizeLinear" else made
        return node

    for node in graph.node:
        if node.name in float_ops:
            continue
        dequantized = any(getattr(producer.get(name), "op_type", None) == "DequantizeLinear" for name in node.input)
        if node.op_type in quantize_ops or (node.name in swish and dequantized):
            in_int8.add(node.name)
        elif node.op_type in passthrough_ops and dequantized:
            made_by = source(node.input[0])
            if node.op_type == "Concat" or (made_by is not None and made_by.name in in_int8):
                in_int8.add(node.name)
    return in_int8


PASSTHROUGH_FORWARD = {"Relu", "MaxPool", "Resize"}  # ops whose output range follows from input 0's
CLAMPS = ("Relu", "Clip")  # pass-through ops that clamp: folded into the Q before them (fold_relus)


def passthrough_ranges(model, table: Dict[str, dict], op_types: Iterable[str]) -> Tuple[Dict[str, dict], List[str]]:
    """(the table with an entry for every tensor a pass-through op reads or writes, the
    pass-through ops left float because one of their tensors has none). Measured entries are
    kept: where a Relu is its input's only reader, ONNX Runtime's quantizer gives the input
    the Relu's range (the Relu's entry, a clipping the user set, rules the Q they share). Calibration
    measures only around the quantized op types; these ranges follow from their neighbours':
    a Relu's output is its input's range from 0 (ONNX Runtime then folds the Relu into the
    Q before it), MaxPool's and Resize's outputs their input's range (a max or an
    interpolation stays inside it), a Concat's output the union of its inputs', and
    backwards, an input of a Concat or a MaxPool the output's range (every value of a Concat's
    input is in its output; a value under a MaxPool's output minimum is never a window's
    maximum). Derived entries name their source (``derived_from``)."""
    table = dict(table)
    op_types = set(op_types)
    nodes = [node for node in model.graph.node if node.op_type in op_types]
    known = constants(model) if any(node.op_type == "Clip" for node in nodes) else {}
    bounds = {node.name: clamp_bounds(node, known) for node in nodes if node.op_type == "Clip"}
    for _ in range(len(nodes) + 1):  # forward and backward until nothing changes
        if not any([_derive(node, table, bounds.get(node.name)) for node in nodes] +
                   [_derive_back(node, table) for node in nodes]):
            break
    unresolved = [node.name for node in nodes if (node.op_type == "Clip" and bounds[node.name] is None)
                  or not all(name in table for name in [*_data_inputs(node), node.output[0]])]
    return table, unresolved


def _data_inputs(node) -> List[str]:
    return [name for name in (node.input if node.op_type == "Concat" else node.input[:1]) if name]


def constants(model) -> Dict[str, object]:
    """Every constant tensor by name: the initializers and the Constant nodes' values."""
    from onnx import helper

    found: Dict[str, object] = {t.name: t for t in model.graph.initializer}
    found.update({n.output[0]: helper.get_attribute_value(n.attribute[0]) for n in model.graph.node
                  if n.op_type == "Constant" and not n.input and n.attribute and n.attribute[0].name == "value"})
    return found


def clamp_bounds(node, known: Dict[str, object]) -> Optional[Tuple[float, float]]:
    """A clamp's (min, max) (CLAMPS): a Relu's (0, inf); a Clip's where they are constants
    (inputs since opset 11, in ``known``: constants(model); attributes before; absent:
    unbounded), else None."""
    from onnx import helper, numpy_helper

    if node.op_type == "Relu":
        return 0.0, np.inf
    attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    found = []
    for index, (key, unbounded) in enumerate((("min", -np.inf), ("max", np.inf)), start=1):
        name = node.input[index] if len(node.input) > index else ""
        if name and name not in known:
            return None
        found.append(float(numpy_helper.to_array(known[name])) if name else float(attributes.get(key, unbounded)))
    return found[0], found[1]


def _derive(node, table: Dict[str, dict], bounds: Optional[Tuple[float, float]] = None) -> bool:
    """The output's entry from the inputs' (``bounds``: a Clip's); whether one was added."""
    out, inputs = node.output[0], _data_inputs(node)
    if out in table or not all(name in table for name in inputs):
        return False
    if node.op_type == "Relu":
        source = table[inputs[0]]
        table[out] = {**source, "min": max(float(source["min"]), 0.0), "derived_from": inputs[0]}
    elif node.op_type == "Clip" and bounds is not None:
        source, (low, high) = table[inputs[0]], bounds
        least, most = max(float(source["min"]), low), min(float(source["max"]), high)
        table[out] = {**source, "min": least, "max": most, "derived_from": inputs[0],
                      "threshold": min(float(source["threshold"]), max(abs(least), abs(most)))}
    elif node.op_type in PASSTHROUGH_FORWARD:
        table[out] = {**table[inputs[0]], "derived_from": inputs[0]}
    elif node.op_type == "Concat":
        entries = [table[name] for name in inputs]
        table[out] = {**max(entries, key=lambda e: float(e["threshold"])),
                      "min": min(float(e["min"]) for e in entries), "max": max(float(e["max"]) for e in entries),
                      "derived_from": "+".join(inputs)}
    else:
        return False
    return True


def _derive_back(node, table: Dict[str, dict]) -> bool:
    """A Concat's or MaxPool's missing inputs from its output's entry; whether one was added."""
    out = node.output[0]
    if node.op_type not in ("Concat", "MaxPool") or out not in table:
        return False
    missing = [name for name in _data_inputs(node) if name not in table]
    for name in missing:
        table[name] = {**table[out], "derived_from": out}
    return bool(missing)


def _inside(clamp, known: Dict[str, object], scale, zero) -> bool:
    """The clamp's bounds hold every value the Q before it can give (zero point 0 already
    checked, so a clamp unbounded above, a Relu, always does): it changes none of them."""
    bounds = clamp_bounds(clamp, known)
    if bounds is None:
        return False
    low, high = bounds
    if high == np.inf:
        return low <= 0.0
    if np.size(scale) != 1:
        return False
    top = float(scale) * (np.iinfo(np.asarray(zero).dtype).max - float(zero))
    return low <= 0.0 and top <= high * (1 + 1e-6) + 1e-12


def fold_relus(model) -> int:
    """Remove each pass-through Relu (or Clip whose bounds hold the whole quantized range)
    between a Q -> DQ and a Q of the same scale and zero point 0, in place: the first Q
    already clamps at zero, so DQ -> Relu -> Q returns its input. ONNX Runtime removes such a Relu itself, but not the DQ -> Q pair left where the
    Relu's output has several readers (a U-Net skip: 56 requantizations of 112 Relus on
    U^2-Net-p, 1.87x fp32 against 2.25x for its own quantizer's graph). Done after the
    mixed derivations and the refinements, which need the Relu in the graph. Returns how
    many were folded."""
    from onnx import numpy_helper

    graph = model.graph
    initializers = {t.name: t for t in graph.initializer}
    known = constants(model)

    def constant(name: str):  # a Q/DQ parameter as an array (not every weight converted)
        return numpy_helper.to_array(initializers[name]) if name in initializers else None

    producer, readers = producers_and_readers(graph)
    outputs = {o.name for o in graph.output}
    folded = []
    for relu in [node for node in graph.node if node.op_type in CLAMPS]:
        dq = producer.get(relu.input[0])
        after = readers.get(relu.output[0], [])
        if dq is None or dq.op_type != "DequantizeLinear" or len(readers.get(dq.output[0], [])) != 1 \
                or len(after) != 1 or after[0].op_type != "QuantizeLinear" or relu.output[0] in outputs:
            continue
        params = [constant(name) for name in (*dq.input[1:3], *after[0].input[1:3])]
        if len(params) != 4 or any(p is None for p in params) or np.any(params[1] != 0) \
                or not all(np.array_equal(a, b) for a, b in zip(params[:2], params[2:])) \
                or not _inside(relu, known, params[0], params[1]):
            continue
        for reader in readers.get(after[0].output[0], []):
            reader.input[:] = [dq.input[0] if name == after[0].output[0] else name for name in reader.input]
        folded += [dq, relu, after[0]]
    remove_nodes(graph, folded)
    return len(folded) // 3
