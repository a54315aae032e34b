"""Per-layer profiles: what every backend's ``Session.profile`` shares.

A backend measures its own layers (runtime name, layer type, kernel, time over runs) and
says, in its own terms, which ONNX nodes or tensors each layer stands for (its
"candidates": ONNX Runtime's executed node names, OpenVINO's ``originalLayersNames``, MNN's
op names, ncnn's layer map). ``Nodes`` resolves them against the converted ONNX model:
a candidate is an ONNX node name, or a tensor name whose producer is the node, optionally
with a runtime's decorations removed (``/WithoutBiases`` path parts, the
``_QuantizeLinear`` suffix of a quantizer's node named after the tensor it quantizes). A
layer that resolves to nothing (a reorder or layout conversion the runtime inserted, a
quantize op on a model input) keeps ``onnx_node`` null.

A layer can compute several ONNX nodes (Conv + BatchNormalization + Relu fused):
``onnx_nodes`` lists them in model order and ``onnx_node`` is the one doing the work. A
runtime that names a fused layer after the last op of the chain (ONNX Runtime's NCHWc
``relu1_out_nchwc`` is a Conv) is followed upstream through single-input elementwise ops
to the op of the layer's kind; ONNX Runtime's ``Fused*`` kernels also compute the
activation after their node.

The index is built where the model is loaded (``Nodes.load``, in the parent process) and
travels to the backend's worker as JSON (``to_json``/``from_json``), so that a worker
needs no onnx import. The result (``result``) is JSON: ``measured_by``, ``runs``,
``warmup``, ``device`` (what ran), ``run_ms`` (wall time of one whole run, as
``measured_by`` says), ``total_ms`` (sum of the layers), ``layers`` in execution order
(name, type, kernel, ms (mean per run), median_ms, share, onnx_node, onnx_nodes,
onnx_op_type) and ``note``. ``summarize`` makes the report's view: top layers, time by op type.
"""

from __future__ import annotations

import statistics
import time
from collections import OrderedDict
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional

from pipeline.backends.tensor_names import onnx_name

FORMAT = 1
# ops a runtime fuses into the op before them (one activation input, constants otherwise)
FUSABLE = {"Relu", "Clip", "Sigmoid", "HardSigmoid", "HardSwish", "LeakyRelu", "PRelu", "Tanh", "Elu", "Selu",
           "Gelu", "BatchNormalization", "Add", "Sub", "Mul", "Div", "Identity", "QuantizeLinear",
           "DequantizeLinear"}
# the activations ONNX Runtime's FusedConv / FusedGemm / FusedMatMul compute after their op
ACTIVATIONS = {"Relu", "Clip", "Sigmoid", "HardSigmoid", "LeakyRelu", "Tanh"}
_MAX_FUSED = 6
QDQ = ("QuantizeLinear", "DequantizeLinear")
# ORT's quantizer names a Q node after the tensor it quantizes (x_QuantizeLinear: x's producer ran
# before it, often in the same fused layer); a DQ node (x_DequantizeLinear) reads x, it does not make it
_NODE_SUFFIXES = ("_QuantizeLinear",)
UNMAPPED_NAMES = 20  # unmapped layers named in the summary (profile.json has them all)


def _family(runtime_type: str) -> Optional[set]:
    """The ONNX op types a runtime layer type computes (None: any, no upstream search)."""
    kind = runtime_type.lower()
    if "deconv" in kind or "convtranspose" in kind:
        return {"ConvTranspose"}
    if "conv" in kind:
        return {"Conv", "ConvInteger", "QLinearConv"}
    if any(word in kind for word in ("gemm", "fullyconnected", "innerproduct", "matmul")):
        return {"Gemm", "MatMul", "MatMulInteger", "QLinearMatMul"}
    if "pool" in kind:
        return {"MaxPool", "AveragePool", "GlobalAveragePool", "GlobalMaxPool"}
    return None


class Nodes:
    """The converted ONNX model's nodes, named as parity's reports name them (the node
    name, or ``OpType_position`` for an unnamed node), with their op types, order, the
    producer of every tensor, each node's activation inputs and each tensor's consumers.
    Empty (nothing resolves) when there is no model."""

    def __init__(self, index: Optional[dict] = None):
        index = index or {}
        self.types: Dict[str, str] = dict(index.get("types", {}))
        self.order: Dict[str, int] = {node: position for position, node in enumerate(self.types)}
        self.producers: Dict[str, str] = dict(index.get("producers", {}))
        self.inputs: Dict[str, List[str]] = dict(index.get("inputs", {}))
        self.consumers: Dict[str, List[str]] = dict(index.get("consumers", {}))
        self.unnamed: List[str] = list(index.get("unnamed", []))  # nodes the model left without a name

    @classmethod
    def load(cls, onnx_path: Path) -> "Nodes":
        import onnx

        graph = onnx.load(str(onnx_path), load_external_data=False).graph
        constants = {t.name for t in graph.initializer}
        index: dict = {"types": {}, "producers": {}, "inputs": {}, "consumers": {}, "unnamed": []}
        for position, node in enumerate(graph.node):
            key = node.name or f"{node.op_type}_{position}"
            index["types"][key] = node.op_type
            if not node.name:
                index["unnamed"].append(key)
            # outputs of constant-only nodes are constants too (nodes come in topological order)
            index["inputs"][key] = [name for name in node.input if name and name not in constants and (
                name not in index["producers"] or index["inputs"][index["producers"][name]])]
            for name in node.input:
                index["consumers"].setdefault(name, []).append(key)
            for name in node.output:
                if name:
                    index["producers"][name] = key
        return cls(index)

    def to_json(self) -> dict:
        return {"types": self.types, "producers": self.producers, "inputs": self.inputs, "consumers": self.consumers,
                "unnamed": self.unnamed}

    def only_unnamed(self, op_type: str) -> Optional[str]:
        """The model's one unnamed node of this op type (a runtime that kept the empty name)."""
        found = [node for node in self.unnamed if self.types[node] == op_type]
        return found[0] if len(found) == 1 else None

    def resolve(self, candidates: Iterable[str]) -> List[str]:
        """The ONNX nodes the candidate names stand for, in model order."""
        found = {node for node in map(self._node_for, candidates) if node is not None}
        return sorted(found, key=self.order.get)

    def _node_for(self, name: str) -> Optional[str]:
        while name:
            for form in (name, *[name[: -len(s)] for s in _NODE_SUFFIXES if name.endswith(s)]):
                if form in self.types:
                    return form
                tensor = onnx_name(form)
                if tensor in self.producers:
                    return self.producers[tensor]
            if "/" not in name.strip("/"):
                return None
            name = name.rstrip("/").rsplit("/", 1)[0]  # OpenVINO: conv1/WithoutBiases -> conv1
        return None

    def layer(self, name: str, runtime_type: str, kernel: Optional[str], ms: float,
              candidates: Iterable[str]) -> dict:
        nodes = self.resolve(candidates)
        if runtime_type in QDQ:  # a quantizer's Q/DQ op, named after the tensor it converts
            nodes = [node for node in nodes if self.types[node] in QDQ]
        primary = self._primary(nodes, runtime_type)
        if primary is not None and primary not in nodes:
            nodes = sorted({*nodes, *self._chain(nodes[0], primary)}, key=self.order.get)
        if primary is not None and runtime_type.startswith("Fused") and len(nodes) == 1:
            nodes += self._activation_after(primary)
        return {"name": name, "type": runtime_type, "kernel": kernel, "ms": ms, "onnx_node": primary,
                "onnx_nodes": nodes, "onnx_op_type": self.types.get(primary) if primary else None}

    def _primary(self, nodes: List[str], runtime_type: str) -> Optional[str]:
        if not nodes:
            return None
        family = _family(runtime_type)
        if family is None:
            return nodes[0]
        hit = next((node for node in nodes if self.types[node] in family), None)
        if hit is not None:
            return hit
        current = nodes[0]  # a fused chain named after its last op: look upstream for the layer's op
        for _ in range(_MAX_FUSED):
            parent = self._sole_parent(current)
            if parent is None:
                break
            if self.types[parent] in family:
                return parent
            current = parent
        return nodes[0]

    def _sole_parent(self, node: str) -> Optional[str]:
        """The producer of a fusable node's only activation input, when nothing else reads it."""
        inputs = self.inputs.get(node, [])
        if self.types.get(node) not in FUSABLE or len(inputs) != 1 or len(self.consumers.get(inputs[0], [])) != 1:
            return None
        return self.producers.get(inputs[0])

    def _chain(self, last: str, first: str) -> List[str]:
        chain, current = [], last
        while current is not None and current != first:
            chain.append(current)
            current = self._sole_parent(current)
        return chain + [first]

    def _activation_after(self, node: str) -> List[str]:
        outputs = [tensor for tensor, producer in self.producers.items() if producer == node]
        readers = self.consumers.get(outputs[0], []) if len(outputs) == 1 else []
        return readers if len(readers) == 1 and self.types.get(readers[0]) in ACTIVATIONS else []


class Runs:
    """``warmup`` runs, then up to ``runs`` counted ones, fewer when ``budget_s`` (warm-up
    included) is spent, never fewer than one: iterating says whether each run counts."""

    def __init__(self, runs: int, warmup: int, budget_s: Optional[float] = None):
        self.runs, self.warmup, self.budget_s = runs, warmup, budget_s
        self.counted = 0
        self.started = time.perf_counter()

    def __iter__(self):
        self.started = time.perf_counter()
        for _ in range(self.warmup):
            yield False
        for _ in range(self.runs):
            if self.counted and self.spent():
                return
            self.counted += 1
            yield True

    def spent(self) -> bool:
        return self.budget_s is not None and time.perf_counter() - self.started > self.budget_s

    def abandon(self) -> None:
        """The current counted run was given up (the budget ran out inside it)."""
        self.counted -= 1

    def note(self) -> Optional[str]:
        if self.counted >= self.runs:
            return None
        return (f"stopped after {self.counted} of {self.runs} runs: the time budget of {self.budget_s:g} s "
                "(profile.max_seconds) was spent")


class Timer:
    """Every time measured per layer, layers kept in first-seen order."""

    def __init__(self):
        self.samples: "OrderedDict[str, List[float]]" = OrderedDict()
        self.info: Dict[str, tuple] = {}

    def add(self, name: str, ms: float, runtime_type: str, kernel: Optional[str] = None) -> None:
        self.samples.setdefault(name, []).append(ms)
        self.info.setdefault(name, (runtime_type, kernel))

    def layers(self, nodes: Nodes, runs: int, candidates: Callable[[str], List[str]]) -> List[dict]:
        """Rows with the mean ms per run and the median (robust to a run the machine
        interrupted); ``candidates(name)`` names the layer's ONNX side."""
        rows = []
        for name, times in self.samples.items():
            row = nodes.layer(name, *self.info[name], sum(times) / runs, candidates(name))
            row["median_ms"] = round(statistics.median(times) * len(times) / runs, 6)
            rows.append(row)
        return rows


def result(measured_by: str, runs: int, warmup: int, layers: List[dict], run_ms: Optional[float],
           device: dict, *notes: Optional[str]) -> dict:
    total = sum(layer["ms"] for layer in layers)
    note = "; ".join(text for text in notes if text) or None
    for layer in layers:
        layer["share"] = _share(layer["ms"], total)
        layer["ms"] = round(layer["ms"], 6)
    return {"format": FORMAT, "measured_by": measured_by, "runs": runs, "warmup": warmup, **device,
            "run_ms": round(run_ms, 6) if run_ms is not None else None, "total_ms": round(total, 6),
            "layers": layers, "note": note}


def _share(ms: float, total: float) -> float:
    """ms / total in [0, 1]: summed from rounded times (a profile as read back), the one op
    type of a tiny model came out at 1.000015."""
    return min(1.0, round(ms / total, 6)) if total else 0.0


def summarize(profile: dict, top: int) -> dict:
    """The report's view of a profile: the ``top`` layers by time and the time by op type
    (the ONNX op type of a mapped layer, else the runtime's layer type)."""
    layers = profile["layers"]
    total = profile["total_ms"]
    by_type: "OrderedDict[str, dict]" = OrderedDict()
    for layer in layers:
        key = layer["onnx_op_type"] or layer["type"]
        entry = by_type.setdefault(key, {"op_type": key, "ms": 0.0, "layers": 0, "runtime_only": True})
        entry["ms"] += layer["ms"]
        entry["layers"] += 1
        entry["runtime_only"] = entry["runtime_only"] and layer["onnx_op_type"] is None
    op_types = sorted(by_type.values(), key=lambda e: -e["ms"])
    for entry in op_types:
        entry["ms"] = round(entry["ms"], 6)
        entry["share"] = _share(entry["ms"], total)
    unmapped = [layer["name"] for layer in layers if not layer["onnx_node"]]
    device = {key: profile[key] for key in ("device", "device_name", "device_type") if key in profile}
    return {"measured_by": profile["measured_by"], "runs": profile["runs"], "warmup": profile["warmup"], **device,
            "run_ms": profile["run_ms"], "total_ms": total, "layers": len(layers),
            "mapped": len(layers) - len(unmapped), "top": sorted(layers, key=lambda layer: -layer["ms"])[:top],
            "by_op_type": op_types, "unmapped": unmapped[:UNMAPPED_NAMES], "note": profile.get("note")}
