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
"""

from __future__ import annotations

import logging
import tempfile
from collections import Counter
from pathlib import Path
from typing import Dict, Iterable, List, Optional

import numpy as np

from pipeline import profiling
from pipeline.errors import first_line

log = logging.getLogger("parity")
RUNS, WARMUP, BUDGET_S = 10, 2, 5.0  # per model; the profile stops early once the budget is spent


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
    costs = {op: {"fp32_ms": round(by_fp32[op], 4), "int8_ms": round(by_int8[op], 4),
                  "cost_ms": round(by_fp32[op] - by_int8[op], 4)} for op in ops}
    return {"ops": costs, "fp32_ms": fp32["run_ms"], "int8_ms": int8["run_ms"], "measured_by": fp32["measured_by"],
            "device": fp32.get("device"), "runs": fp32["runs"]}


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


def quantizable_neighbours(model, ops: Iterable[str]) -> Dict[str, List[str]]:
    """For each quantizable op, the nearest quantizable ops up- and downstream, through the
    ops between them that do not compute much (activations, adds, reshapes, pools)."""
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
    return {op: sorted(walk(nodes[op], up) | walk(nodes[op], down)) for op in ops if op in nodes}


def estimate_ms(float_ops: Iterable[str], costs: Dict[str, float]) -> Optional[float]:
    """The latency the float ops add to plain int8, by their measured costs (None without costs)."""
    if not costs:
        return None
    return round(sum(costs.get(op, 0.0) for op in float_ops), 4)


def value_per_ms(row: dict, float_ops: List[str], costs: Dict[str, float], neighbours: Dict[str, List[str]],
                 edge_ms: float, floor_ms: float) -> float:
    """Loss per millisecond given back when the op joins the float set: its measured cost,
    plus ``edge_ms`` (a typical op's cost) for every new edge between the float set and an
    int8 neighbour (minus one for every such edge it closes), never below ``floor_ms``."""
    edges = island_edges([*float_ops, row["op"]], neighbours) - island_edges(float_ops, neighbours)
    spent = costs.get(row["op"], 0.0) + edge_ms * edges
    return row.get("badness", row["loss"]) / max(spent, floor_ms, 1e-9)
