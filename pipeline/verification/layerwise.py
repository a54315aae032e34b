"""Layerwise comparison: every intermediate tensor of the fp32 reference against the
same tensor on the target backend, the first divergence and the origin of NaN/Inf.

Backends expose tensors under their own names; their sessions map them back to ONNX
names: ``probe(names)`` says which of them they can expose (``exposed``) and which ONNX
names all their own tensors map to (``tensors``: those not in the reference are listed
as unmappable); ``run_probe(feeds)`` returns the exposed ones as float32, dequantized
where the backend holds them quantized. The reference and the
target run in worker processes (pipeline.worker); this module only talks to them
through ``call(method, *args)``.

Memory stays bounded: tensors are fetched in chunks whose float32 size per sample fits
a budget, and only running sums per tensor are kept (pipeline.verification.metrics.OutputStats)."""

from __future__ import annotations

import gzip
import json
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np
import onnx
from onnx import helper, numpy_helper, shape_inference

from pipeline.verification.metrics import OutputStats
from pipeline.backends.tensor_names import onnx_name  # noqa: F401 - its former home: keeps layerwise.onnx_name working

CHUNK_BYTES = 256 * 1024 * 1024  # float32 bytes of probed tensors per sample and side
# Stopping at the first divergence on a model whose tensors exceed STOP_BYTES per sample:
# every CHECKPOINT_STEP-th tensor first, then the tensors between the last checkpoint that
# agrees and the first that does not (docs/verify.md, "Layerwise").
STOP_BYTES = 16 * 1024 * 1024
CHECKPOINT_STEP = 8
# Elements per tensor and sample the agreement is computed on (evenly strided): a cosine on
# 2^18 values is as decisive as on millions, at a fraction of the time (docs/verify.md).
SUBSAMPLE_ELEMENTS = 1 << 18
DEPTH_POINTS = 2000  # chart points kept in the report; the side file has every tensor
LOCAL_LOSSES = 10  # tensors adding the most error, kept in the summary


def dynamic_outputs(nodes: Iterable, inputs: Iterable[str]) -> List[str]:
    """Outputs of the nodes that depend on a graph input (not constant subgraphs), in order."""
    dynamic, found = set(inputs), []
    for node in nodes:
        if any(name in dynamic for name in node.input):
            for name in node.output:
                if name:
                    dynamic.add(name)
                    found.append(name)
    return found


@dataclass
class Tensor:
    name: str
    op: str
    op_type: str
    index: int
    inputs: List[str]  # activation inputs of the producing op
    elements: Optional[int] = None


class Graph:
    """The reference model's activations in topological order, with their producers."""

    def __init__(self, model: onnx.ModelProto):
        graph = model.graph
        initializers = {t.name for t in graph.initializer}
        self.inputs = [i.name for i in graph.input if i.name not in initializers]
        self.outputs = [o.name for o in graph.output]
        self.nodes = {}
        elements = element_counts(model)
        dynamic = set(self.inputs)
        self.tensors: List[Tensor] = []
        for position, node in enumerate(graph.node):
            if not any(name in dynamic for name in node.input):
                continue
            op = node.name or f"{node.op_type}_{position}"
            self.nodes[op] = node
            activation_inputs = [name for name in node.input if name in dynamic]
            for name in node.output:
                if name:
                    dynamic.add(name)
                    self.tensors.append(Tensor(name, op, node.op_type, len(self.tensors), activation_inputs,
                                               elements.get(name)))
        self.by_name: Dict[str, Tensor] = {t.name: t for t in self.tensors}

    def attributes(self, op: str) -> dict:
        node = self.nodes.get(op)
        if node is None:
            return {}
        found = {}
        for attribute in node.attribute:
            value = helper.get_attribute_value(attribute)
            if isinstance(value, bytes):
                value = value.decode(errors="replace")
            elif isinstance(value, onnx.TensorProto):
                array = numpy_helper.to_array(value)
                value = array.tolist() if array.size <= 16 else f"tensor {list(array.shape)}"
            elif isinstance(value, (list, tuple)):
                value = [v.decode(errors="replace") if isinstance(v, bytes) else v for v in value]
                if value and not isinstance(value[0], (int, float, str)):
                    value = f"{len(value)} values"
            elif not isinstance(value, (int, float, str)):
                value = type(value).__name__
            found[attribute.name] = value
        return found

    def consumers(self, tensor: str) -> List[str]:
        return [op for op, node in self.nodes.items() if tensor in node.input]

    def nbytes(self, names: Sequence[str]) -> int:
        """float32 bytes per sample of these tensors (unknown sizes: 4 MiB)."""
        return sum(4 * (self.by_name[n].elements or 1024 * 1024) if n in self.by_name else 4 * 1024 * 1024
                   for n in names)

    def chunks(self, names: Sequence[str], budget: int = CHUNK_BYTES) -> List[List[str]]:
        """Groups of tensors whose float32 size per sample fits the budget (unknown: 4 MiB)."""
        groups, current, size = [], [], 0
        for name in names:
            elements = self.by_name[name].elements if name in self.by_name else None
            nbytes = 4 * elements if elements else 4 * 1024 * 1024
            if current and size + nbytes > budget:
                groups.append(current)
                current, size = [], 0
            current.append(name)
            size += nbytes
        return groups + ([current] if current else [])


def element_counts(model: onnx.ModelProto) -> Dict[str, int]:
    """Element counts of the tensors (graph inputs included) whose shapes ONNX shape
    inference knows."""
    try:
        inferred = shape_inference.infer_shapes(model)
    except Exception:  # noqa: BLE001 - sizes only steer chunking and pricing
        return {}
    counts = {}
    for info in [*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output]:
        dims = info.type.tensor_type.shape.dim
        if dims and all(d.HasField("dim_value") for d in dims):
            counts[info.name] = int(np.prod([d.dim_value for d in dims]))
    return counts


@dataclass
class Comparison:
    """Per-tensor agreement of one layerwise run."""

    graph: Graph
    threshold: float
    stats: Dict[str, OutputStats] = field(default_factory=dict)
    not_exposed: List[str] = field(default_factory=list)
    unmappable: List[str] = field(default_factory=list)
    errors: Dict[str, str] = field(default_factory=dict)  # tensor -> why it could not be compared
    samples: int = 0
    seconds: float = 0.0
    stopped: Optional[dict] = None  # where compare stopped at the first divergence (stop_at_divergence)
    cut: Optional[str] = None  # what the diagnosis budget's deadline left out
    rescaled: List[str] = field(default_factory=list)  # scaled on purpose by the build (equalization): not compared
    # held clamped by the build (a folded Relu or Clip): tensor -> (low, high), vs the reference clamped alike
    clamped: Dict[str, Tuple[float, float]] = field(default_factory=dict)

    def metrics(self, name: str) -> dict:
        result = self.stats[name].result()
        result["passed"] = self.passes(name)
        result["reference_max_abs"] = self.stats[name].reference_max_abs
        return result

    def passes(self, name: str) -> bool:
        stats = self.stats[name]
        new_nonfinite = (stats.nan + stats.inf) > (stats.reference_nan + stats.reference_inf)
        return not new_nonfinite and stats.result()["cosine"] >= self.threshold

    def rows(self) -> List[dict]:
        rows = []
        for tensor in self.graph.tensors:
            if tensor.name in self.stats:
                metrics = self.metrics(tensor.name)
                rows.append({"tensor": tensor.name, "op": tensor.op, "op_type": tensor.op_type,
                             "index": tensor.index, **metrics,
                             "per_sample_cosine": self.stats[tensor.name].sample_cosine})
        return rows

    def compared_ancestors(self, name: str) -> List[str]:
        """The nearest compared tensors feeding ``name`` (walking through unexposed ones)."""
        found, seen, stack = [], set(), list(self.graph.by_name[name].inputs)
        while stack:
            current = stack.pop()
            if current in seen:
                continue
            seen.add(current)
            if current in self.stats:
                found.append(current)
            elif current in self.graph.by_name:
                stack.extend(self.graph.by_name[current].inputs)
        return sorted(found, key=lambda n: self.graph.by_name[n].index)

    def region(self, name: str) -> List[str]:
        """The ops between the nearest compared ancestors and ``name``: where the fault is."""
        ops, stack, seen = [], [name], set()
        while stack:
            current = stack.pop()
            if current in seen or current not in self.graph.by_name:
                continue
            seen.add(current)
            tensor = self.graph.by_name[current]
            if current != name and current in self.stats:
                continue
            ops.append(tensor)
            stack.extend(tensor.inputs)
        return [t.op for t in sorted(ops, key=lambda t: t.index)]

    def first_divergence(self) -> Optional[dict]:
        for tensor in self.graph.tensors:
            if tensor.name not in self.stats or self.passes(tensor.name):
                continue
            ancestors = self.compared_ancestors(tensor.name)
            if all(self.passes(a) for a in ancestors):
                metrics = self.metrics(tensor.name)
                return {"tensor": tensor.name, "op": tensor.op, "op_type": tensor.op_type,
                        "attributes": self.graph.attributes(tensor.op), "cosine": metrics["cosine"],
                        "max_abs": metrics["max_abs"], "nan": metrics["nan"], "inf": metrics["inf"],
                        "reference_max_abs": metrics["reference_max_abs"], "threshold": self.threshold,
                        "inputs": [{"tensor": a, "cosine": self.stats[a].result()["cosine"],
                                    "reference_max_abs": self.stats[a].reference_max_abs} for a in ancestors],
                        "region": self.region(tensor.name), "consumers": self.graph.consumers(tensor.name)}
        return None

    def local_losses(self, count: int = LOCAL_LOSSES) -> List[dict]:
        """The tensors that lose the most cosine against their nearest compared inputs:
        where error is added, not just carried (the candidates advice tries first)."""
        found = []
        for tensor in self.graph.tensors:
            if tensor.name not in self.stats:
                continue
            cosine = self.stats[tensor.name].result()["cosine"]
            inputs = [self.stats[a].result()["cosine"] for a in self.compared_ancestors(tensor.name)]
            if isinstance(cosine, float) and not math.isnan(cosine):
                loss = min([c for c in inputs if not math.isnan(c)], default=1.0) - cosine
                found.append({"tensor": tensor.name, "op": tensor.op, "op_type": tensor.op_type,
                              "cosine": cosine, "loss": loss})
        return sorted(found, key=lambda row: -row["loss"])[:count]

    def nan_origin(self) -> Optional[dict]:
        for tensor in self.graph.tensors:
            stats = self.stats.get(tensor.name)
            if stats and (stats.nan + stats.inf) > (stats.reference_nan + stats.reference_inf):
                return {"tensor": tensor.name, "op": tensor.op, "op_type": tensor.op_type,
                        "nan": stats.nan, "inf": stats.inf, "reference_max_abs": stats.reference_max_abs,
                        "consumers": self.graph.consumers(tensor.name)}
        return None

    def summary(self, mode: str, reason: str, side_file: str) -> dict:
        rows = [{k: v for k, v in row.items() if k != "per_sample_cosine"} for row in self.rows()]
        step = max(1, math.ceil(len(rows) / DEPTH_POINTS))
        depth = [{"index": r["index"], "tensor": r["tensor"], "op": r["op"], "cosine": r["cosine"],
                  "passed": r["passed"]} for r in rows[::step]]
        worst = sorted(rows, key=lambda r: (r["passed"], _sort_cosine(r["cosine"])))[:10]
        return {"mode": mode, "ran": True, "reason": reason, "samples": self.samples,
                "seconds": round(self.seconds, 3), "threshold": self.threshold, "compared": len(rows),
                "not_exposed": self.not_exposed, "unmappable": self.unmappable, "errors": self.errors,
                "depth": depth, "worst": [_row_brief(r) for r in worst],
                "first_divergence": self.first_divergence(), "nan_origin": self.nan_origin(),
                "local_losses": self.local_losses(), "stopped": self.stopped, "cut": self.cut,
                "rescaled": self.rescaled, "side_file": side_file}

    def write_side_file(self, path: Path) -> None:
        """Every compared tensor, gzip-compressed JSON (mtime 0: same content, same bytes)."""
        document = {"schema_version": 1, "threshold": self.threshold, "samples": self.samples,
                    "tensors": self.rows(), "not_exposed": self.not_exposed, "unmappable": self.unmappable,
                    "errors": self.errors}
        data = json.dumps(document, separators=(",", ":"), default=_json_default).encode()
        with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as handle:
            handle.write(data)


def _sort_cosine(value) -> float:
    return value if isinstance(value, float) and not math.isnan(value) else -math.inf


def _row_brief(row: dict) -> dict:
    keys = ("tensor", "op", "op_type", "index", "cosine", "max_abs", "sqnr_db", "nan", "inf", "passed")
    return {k: row.get(k) for k in keys}


def _json_default(value):
    if isinstance(value, (np.floating, np.integer)):
        return value.item()
    raise TypeError(type(value).__name__)


def compare(reference, target, graph: Graph, samples: Sequence[dict], threshold: float,
            budget: int = CHUNK_BYTES, progress=None, stop_at_divergence: bool = False,
            deadline: Optional[float] = None, rescaled: Sequence[str] = (),
            clamped: Optional[Dict[str, Tuple[float, float]]] = None) -> Comparison:
    """Run every sample through both sides chunk by chunk (network order) and accumulate
    per-tensor stats. ``reference`` and ``target`` answer ``call("probe", names)`` and
    ``call("run_probe", feeds)``; they run side by side, the next sample while this one's
    stats are summed. ``stop_at_divergence`` (only the culprit is needed): checkpoints
    first (every CHECKPOINT_STEP-th tensor), then every tensor between the last
    checkpoint that agrees and the first that does not; the whole table otherwise.
    ``deadline`` (time.perf_counter()): no chunk is started after it, and the chunk in
    flight stops at the sample it reached; ``cut`` says what was left out. ``rescaled``:
    tensors the build scaled per channel on purpose (equalization: the consumers undo it),
    which would read as diverging; not compared. ``clamped``: tensors the build holds
    clamped (a Relu or Clip folded into their Q) and the bounds, compared with the reference's
    clamped too."""
    started = time.perf_counter()
    comparison = Comparison(graph, threshold, samples=len(samples), rescaled=list(rescaled), clamped=dict(clamped or {}))
    probing = _Probing(reference, target, graph, comparison, samples)
    probing.deadline = deadline
    wanted = [t.name for t in graph.tensors if t.name not in set(rescaled)]
    with ThreadPoolExecutor(max_workers=2) as probing.pool:
        if stop_at_divergence and graph.nbytes(wanted) > STOP_BYTES:
            probing.bracket(wanted, budget, progress)
        else:
            probing.run(wanted, budget, progress)
    comparison = probing.comparison
    comparison.not_exposed = probing.not_exposed + [n for n in comparison.errors if n not in probing.not_exposed]
    comparison.unmappable = sorted(probing.unmappable)
    comparison.seconds = time.perf_counter() - started
    return comparison


class _Probing:
    """One layerwise run: which tensors were probed, and their stats."""

    def __init__(self, reference, target, graph: Graph, comparison: Comparison, samples: Sequence[dict]):
        self.reference, self.target, self.graph, self.comparison = reference, target, graph, comparison
        self.samples = samples
        self.not_exposed: List[str] = []
        self.unmappable: set = set()
        self.pool = None
        self.deadline: Optional[float] = None
        self.probe_seconds = 0.0  # the last probe (both workers re-exposing tensors): a chunk costs at least it

    def late(self, margin: float = 0.0) -> bool:
        return self.deadline is not None and time.perf_counter() + margin > self.deadline

    def bracket(self, wanted: List[str], budget: int, progress) -> None:
        """Checkpoints, then the tensors from the last agreeing checkpoint to the first
        disagreeing one (a NaN/Inf or a cosine below the threshold)."""
        checkpoints = list(dict.fromkeys(wanted[CHECKPOINT_STEP - 1::CHECKPOINT_STEP] + wanted[-1:]))
        self.run(checkpoints, budget, progress)
        failing = [name for name in checkpoints if name in self.comparison.stats
                   and not self.comparison.passes(name)]
        if not failing:  # nothing to bracket: the whole table
            self.run([name for name in wanted if name not in checkpoints], budget, progress)
            return
        end = wanted.index(failing[0])
        agreeing = [wanted.index(n) for n in checkpoints[:checkpoints.index(failing[0])] if n in self.comparison.stats]
        begin = agreeing[-1] + 1 if agreeing else 0
        self.run([name for name in wanted[begin:end] if name not in checkpoints], budget, progress)
        self.comparison.stopped = {"checkpoints": len(checkpoints), "bracket": [wanted[begin], wanted[end]],
                                   "tensors_left": len(wanted) - len(self.comparison.stats)}

    def run(self, names: List[str], budget: int, progress) -> None:
        chunks = self.graph.chunks(names, budget)
        task = progress.add_task("layerwise", total=len(chunks) * len(self.samples)) if progress else None
        for done, chunk in enumerate(chunks):
            if self.late(self.probe_seconds):  # a chunk that could not compare one sample in time is not started
                left = sum(len(c) for c in chunks[done:])
                self.comparison.cut = f"the diagnosis budget ran out with {left} tensors not compared"
                return
            started = time.perf_counter()
            ours, theirs = _both(self.pool, self.reference, self.target, "probe", chunk)
            self.probe_seconds = time.perf_counter() - started
            self.unmappable.update(n for n in theirs["tensors"]
                                   if n not in self.graph.by_name and n not in self.graph.inputs)
            both = [name for name in chunk if name in ours["exposed"] and name in theirs["exposed"]]
            self.not_exposed += [name for name in chunk if name not in both]
            if both:
                _compare_chunk(self.pool, self.reference, self.target, self.samples, both, self.comparison,
                               progress, task, self.late)
            elif progress:
                progress.advance(task, len(self.samples))


def _both(pool, reference, target, method: str, *args):
    """The same request to both workers at once (each has its own pipe)."""
    ours, theirs = pool.submit(reference.call, method, *args), pool.submit(target.call, method, *args)
    return ours.result(), theirs.result()


def _compare_chunk(pool, reference, target, samples, names, comparison, progress, task, late=lambda: False) -> None:
    pending = _submit(pool, reference, target, samples[0]) if samples else None
    for index in range(len(samples)):
        expected, actual = pending[0].result(), pending[1].result()
        stop = index > 0 and late()  # at least one sample of every started chunk
        pending = _submit(pool, reference, target, samples[index + 1]) \
            if index + 1 < len(samples) and not stop else None
        for name in names:
            if name in comparison.errors:
                continue
            try:
                wanted = np.clip(expected[name], *comparison.clamped[name]) if name in comparison.clamped \
                    else expected[name]
                accumulate(comparison.stats.setdefault(name, OutputStats()), wanted, actual[name])
            except ValueError as err:  # e.g. a backend that keeps a different layout
                comparison.errors[name] = str(err)
                comparison.stats.pop(name, None)
        if progress:
            progress.advance(task)
        if pending is None and index + 1 < len(samples):  # the deadline passed: this chunk stops here
            comparison.cut = comparison.cut or (f"the diagnosis budget ran out: some tensors compared on "
                                                f"{index + 1} of {len(samples)} samples")
            if progress:
                progress.advance(task, len(samples) - index - 1)
            return


def _submit(pool, reference, target, feeds):
    return pool.submit(reference.call, "run_probe", feeds), pool.submit(target.call, "run_probe", feeds)


def accumulate(stats: OutputStats, reference: np.ndarray, output: np.ndarray) -> None:
    """OutputStats.update for layerwise, which compares hundreds of tensors per sample:
    agreement (cosine, error, SQNR) over an evenly strided subset of at most
    SUBSAMPLE_ELEMENTS elements of the tensor (every channel is still sampled), peaks and
    NaN/Inf over all of it. A tensor holding NaN/Inf takes OutputStats.update's full path."""
    ref = np.asarray(reference, dtype=np.float32).ravel()
    out = np.asarray(output, dtype=np.float32).ravel()
    if ref.shape != out.shape:
        raise ValueError(f"shape {np.shape(output)} differs from the reference's {np.shape(reference)}")
    peaks = [float(ref.max()), float(ref.min()), float(out.max()), float(out.min())] if ref.size else []
    if not ref.size or not all(math.isfinite(p) for p in peaks):  # max/min propagate NaN and show Inf
        stats.update(reference, output)
        return
    step = max(1, ref.size // SUBSAMPLE_ELEMENTS)
    ref64, out64 = ref[::step].astype(np.float64), out[::step].astype(np.float64)
    # einsum, not BLAS: OpenBLAS threads on a busy machine took 20 ms for one 2^18 dot product
    dot, ref_sq, out_sq = (float(np.einsum("i,i->", a, b)) for a, b in ((ref64, out64), (ref64, ref64),
                                                                           (out64, out64)))
    diff = np.subtract(out64, ref64, out=out64)
    stats.dot, stats.ref_sq, stats.out_sq = stats.dot + dot, stats.ref_sq + ref_sq, stats.out_sq + out_sq
    stats.err_sq += float(np.einsum("i,i->", diff, diff))
    sample_max = max(float(diff.max()), -float(diff.min()))
    stats.err_abs += float(np.abs(diff, out=diff).sum())
    stats.elements += int(diff.size)
    stats.max_abs = max(stats.max_abs, sample_max)
    stats.reference_max_abs = max(stats.reference_max_abs, peaks[0], -peaks[1])
    norm = math.sqrt(ref_sq * out_sq)
    stats.sample_cosine.append(dot / norm if norm else (1.0 if ref_sq == out_sq == 0 else 0.0))
    stats.sample_max_abs.append(sample_max)
