"""What keeping an op in float costs on the target, for the latency-aware mixed selection.

The fp32 model and the all-int8 QDQ model (the target's Q/DQ placement) are built and
profiled by the target's own backend (``build`` + ``load`` + ``Session.profile``, the
protocol every backend has), on one validation sample. Each runtime layer is mapped to the
ONNX node doing its work (pipeline/profiling.py), so every quantizable op gets its time
in fp32 and in int8; its **cost** is the difference: what the mixed build gives back of
int8's gain when that op stays float (negative where the op is slower in int8 here: the
selection then takes it first, as it buys accuracy and speed). Conversions and reorders the runtime inserts around
a float island are not anyone's op: the selection accounts for them by preferring float
sets that do not split int8 chains (``island_edges``), and verify times the result.
Where the runtime's conversions are priced (``Boundary``: ONNX Runtime), a float op's
tensors that cross to an int8 neighbour cost their elements at the int8 run's own
quantize/dequantize price times the passes one conversion takes (a float head reading a
64 x 320 x 320 tensor: dequantize, layout transpose, NCHWc reorder: 9.3 ms where the kernel
difference the profiles show is 2.9 ms; the first convolution float, -2.2 ms by the
kernels, made the segmenter's int8 graph 17 ms slower: docs/sensitivity.md).
"""

from __future__ import annotations

import logging
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Tuple

import numpy as np

from pipeline import profiling
from pipeline.errors import first_line
from pipeline.verification.layerwise import element_counts

log = logging.getLogger("parity")
RUNS, WARMUP, BUDGET_S = 10, 2, 5.0  # per model; the profile stops early once the budget is spent
SMALL_CONSTANT = 64  # elements: a constant shape inference may need the values of (a Reshape's shape)


def op_costs(fp32_model, int8_model, backend, target, feeds: Dict[str, np.ndarray], ops: Iterable[str]) -> dict:
    """{"ops": {op: {"fp32_ms", "int8_ms", "cost_ms"}}, "fp32_ms", "int8_ms" (whole runs),
    "measured_by"}; {"error": ...} when the backend cannot profile these models (the
    selection then falls back to accuracy alone)."""
    try:
        with tempfile.TemporaryDirectory(prefix="parity-costs-") as scratch:
            fp32 = _profile(fp32_model, "fp32", Path(scratch), backend, target, feeds)
            int8 = _profile(int8_model, "int8", Path(scratch), backend, target, feeds)
    except Exception as err:  # noqa: BLE001 - a backend that cannot build or profile these models
        log.warning("sensitivity: no per-op latency on %s (%s): selecting by accuracy alone", backend.NAME,
                    first_line(err))
        return {"error": first_line(err), "ops": {}}
    by_fp32, by_int8 = _by_node(fp32["layers"]), _by_node(int8["layers"])
    sizes = tensor_sizes(fp32_model, feeds)
    nodes = {node.name: node for node in fp32_model.graph.node}
    costs = {op: {"fp32_ms": round(by_fp32[op], 4), "int8_ms": round(by_int8[op], 4),
                  "cost_ms": round(by_fp32[op] - by_int8[op], 4),
                  "elements": [sizes.get(nodes[op].input[0]), sizes.get(nodes[op].output[0])] if op in nodes else None}
             for op in ops}
    return {"ops": costs, "fp32_ms": fp32["run_ms"], "int8_ms": int8["run_ms"], "measured_by": fp32["measured_by"],
            "device": fp32.get("device"), "runs": fp32["runs"],
            "quantize_ms_per_melement": quantize_price(int8["layers"], sizes)}


def tensor_sizes(model, feeds: Dict[str, np.ndarray]) -> Dict[str, int]:
    """layerwise.element_counts with the graph inputs at the sample's shapes ({} where
    inference fails: the selection then counts edges)."""
    import onnx

    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    # weights become typed inputs (their shapes are what inference needs, and a large model
    # stays cheap to copy); small constants (shapes, scales) keep their values
    large = [t for t in copy.graph.initializer if int(np.prod(t.dims)) > SMALL_CONSTANT]
    for tensor in large:
        copy.graph.initializer.remove(tensor)
    declared = {v.name for v in copy.graph.input}
    copy.graph.input.extend(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
                            for t in large if t.name not in declared)
    for value in copy.graph.input:
        if value.name in feeds:
            dims = value.type.tensor_type.shape.dim
            del dims[:]
            for size in np.shape(feeds[value.name]):
                dims.add().dim_value = int(size)
    return element_counts(copy)


def quantize_price(layers: List[dict], sizes: Dict[str, int]) -> Optional[float]:
    """ms per million elements of the int8 run's own QuantizeLinear and DequantizeLinear layers
    (ONNX Runtime names each after its tensor: x_QuantizeLinear), where their tensors' sizes
    are known; None without any."""
    ms, elements = 0.0, 0
    for layer in layers:
        if layer.get("type") not in profiling.QDQ:
            continue
        tensor = layer["name"].removesuffix("/duplicated")
        for op_type in profiling.QDQ:
            tensor = tensor.removesuffix(f"_{op_type}")
        if tensor in sizes:
            ms, elements = ms + layer["ms"], elements + sizes[tensor]
    return round(1e6 * ms / elements, 6) if elements else None



def _profile(model, precision: str, scratch: Path, backend, target, feeds) -> dict:
    import onnx

    folder = scratch / precision
    folder.mkdir()
    path = folder / "source.onnx"
    onnx.save(model, str(path))
    out = folder / "built"
    out.mkdir()
    _, settings = backend.build(path, None, out, target, precision)
    settings = {"device": target.device.upper(), "precision": precision, **settings}
    session = backend.load(out, settings)
    return session.profile(feeds, RUNS, WARMUP, nodes=profiling.Nodes.load(path).to_json(), budget_s=BUDGET_S)


def _by_node(layers: List[dict]) -> Counter:
    times: Counter = Counter()
    for layer in layers:
        if layer.get("onnx_node"):
            times[layer["onnx_node"]] += layer["ms"]
    return times


def island_edges(float_ops: Iterable[str], neighbours: Dict[str, List[str]]) -> int:
    """Edges between a float op and a quantizable op left int8: each is a place where the
    runtime converts between an int8 chain and a float island."""
    chosen = set(float_ops)
    return sum(1 for op in chosen for other in neighbours.get(op, ()) if other not in chosen)


def either_way(up: Dict[str, List[str]], down: Dict[str, List[str]]) -> Dict[str, List[str]]:
    """Each op's neighbours_each_way, up- and downstream together."""
    return {op: sorted(set(up[op]) | set(down[op])) for op in up}


def neighbours_each_way(model, ops: Iterable[str]) -> Tuple[Dict[str, List[str]], Dict[str, List[str]]]:
    """(upstream, downstream): for each quantizable op, the nearest quantizable ops up- and
    downstream, through the ops between them that do not compute much (activations, adds,
    reshapes, pools)."""
    ops = set(ops)
    producers = {out: node for node in model.graph.node for out in node.output}
    consumers: Dict[str, list] = {}
    for node in model.graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)

    def walk(start, step) -> set:
        found, seen, frontier = set(), set(), list(step(start))
        while frontier:
            node = frontier.pop()
            if node.name in seen:
                continue
            seen.add(node.name)
            if node.name in ops:
                found.add(node.name)
            else:
                frontier.extend(step(node))
        return found

    def up(node):
        return [producers[name] for name in node.input if name in producers]

    def down(node):
        return [c for name in node.output for c in consumers.get(name, [])]

    nodes = {node.name: node for node in model.graph.node}
    present = [op for op in ops if op in nodes]
    return ({op: sorted(walk(nodes[op], up)) for op in present}, {op: sorted(walk(nodes[op], down)) for op in present})


@dataclass
class Boundary:
    """What the runtime's conversions between int8 and float cost a float set: each float op's
    input (output) that an int8 op upstream (downstream) makes (reads) is converted once, its
    elements at ``ms_per_element``: the int8 run's quantize price times the conversion's
    passes (Capabilities.conversion_passes). ``elements``: op -> (input, output) elements."""
    up: Dict[str, List[str]]
    down: Dict[str, List[str]]
    elements: Dict[str, Tuple[int, int]]
    ms_per_element: float
    memo: Dict[frozenset, float] = field(default_factory=dict, repr=False)

    def ms(self, float_ops: Iterable[str]) -> float:
        chosen = frozenset(float_ops)
        if chosen not in self.memo:
            self.memo[chosen] = self.ms_per_element * sum(
                inputs * any(n not in chosen for n in self.up.get(op, ())) +
                outputs * any(n not in chosen for n in self.down.get(op, ()))
                for op in chosen for inputs, outputs in [self.elements.get(op, (0, 0))])
        return self.memo[chosen]

    def added_ms(self, float_ops: Iterable[str], op: str) -> float:
        """The conversions' ms that ``op`` joining ``float_ops`` adds (negative: it closes more)."""
        return self.ms([*float_ops, op]) - self.ms(float_ops)


def boundary(up: Dict[str, List[str]], down: Dict[str, List[str]], measured: dict, passes: int) -> Optional[Boundary]:
    """The Boundary of op_costs's measure (``up``, ``down``: neighbours_each_way's), or None
    where the runtime's conversions are not priced (``passes`` 0), the int8 run had no quantize
    layer to price them by, or no op's tensor sizes are known."""
    price = measured.get("quantize_ms_per_melement")
    elements = {op: tuple(entry["elements"]) for op, entry in measured.get("ops", {}).items()
                if entry.get("elements") and None not in entry["elements"]}
    if not passes or not price or not elements:
        return None
    return Boundary(up, down, elements, passes * price / 1e6)


def estimate_ms(float_ops: Iterable[str], costs: Dict[str, float], priced: Optional[Boundary] = None) -> Optional[float]:
    """The latency the float ops add to plain int8, by their measured costs and, where priced,
    their conversions (None without costs)."""
    if not costs:
        return None
    float_ops = list(float_ops)
    return round(sum(costs.get(op, 0.0) for op in float_ops) + (priced.ms(float_ops) if priced else 0.0), 4)


def value_per_ms(row: dict, float_ops: List[str], costs: Dict[str, float], neighbours: Dict[str, List[str]],
                 edge_ms: float, floor_ms: float, priced: Optional[Boundary] = None) -> float:
    """Loss per millisecond given back when the op joins the float set: its measured cost,
    plus the conversions it adds where they are priced, else ``edge_ms`` (a typical op's cost)
    for every new edge between the float set and an int8 neighbour (minus one for every such
    edge it closes), never below ``floor_ms``."""
    if priced is not None:
        spent = costs.get(row["op"], 0.0) + priced.added_ms(float_ops, row["op"])
    else:
        edges = island_edges([*float_ops, row["op"]], neighbours) - island_edges(float_ops, neighbours)
        spent = costs.get(row["op"], 0.0) + edge_ms * edges
    return row.get("badness", row["loss"]) / max(spent, floor_ms, 1e-9)
