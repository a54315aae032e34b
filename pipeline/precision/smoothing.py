"""SmoothQuant (Xiao et al. 2023) before static int8: activation outlier channels moved
into the weights of the MatMul/Gemm ops that read them.

A transformer's activations have a few channels far larger than the rest (BERT's
LayerNorm outputs: a handful of the 384 channels reach 10-20 where the others stay near 1),
and one per-tensor int8 range for all of them rounds the small channels to a few steps.
For an op Y = X W with a constant weight, dividing input channel j of X by s_j and
multiplying row j of W by s_j leaves Y unchanged in float, and with

    s_j = max|X_j| ** alpha / max|W_j| ** (1 - alpha)

the activation's channels come closer together while the weights (quantized per output
channel) take on part of the spread. ``alpha`` says how much moves: 0 nothing on the
activation side, 1 everything.

Every reader of one activation that is such an op forms a group and shares one s (the
weights' maxima taken over all of them). X / s is folded into the LayerNormalization that
makes X when the group's ops are its only readers (its scale and bias divided by s: free),
also through the reshapes and transposes that keep the channel axis last (a fixed-shape
transformer's Gemm reads its 2-D view: the prepare step fuses MatMul + Add into Reshape ->
Gemm -> Reshape); otherwise a Mul by 1/s is inserted in front of the group (a post-norm
BERT's LayerNorm output also feeds the residual Add). ``choose`` measures each alpha of a grid, and no
smoothing, at the network outputs on calibration samples, each with its own
recalibrated table, as calibration=auto measures tables (docs/calibration.md,
"Transformers")."""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field, replace
from itertools import islice
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import numpy as np
import onnx
from onnx import helper, numpy_helper

SMOOTHED_OPS = ("MatMul", "Gemm")
NORMS = ("LayerNormalization", "RMSNormalization", "SimplifiedLayerNormalization")
ELEMENTWISE = ("Add", "Sub", "Mul", "Div", "Sqrt", "Pow", "Reciprocal")  # a decomposed norm's ops
RESHAPES = ("Reshape", "Flatten", "Squeeze", "Unsqueeze")  # looked through back to the norm
ALPHAS = (0.4, 0.6, 0.8)  # precision.smoothing=auto's first grid (and no smoothing) ...
REFINE = 0.1  # ... then steps this long from the best one either way while the loss falls
JUDGE_SAMPLES = 16  # calibration samples each candidate is recalibrated and judged on (32 ranked alike)
JUDGE_METHOD = "max"  # the judge's thresholds when calibration.method is auto (docs/calibration.md)
EPSILON = 1e-5  # smallest channel maximum used (NNCF clips its statistics there too)

Setting = Union[None, float, str]


def parse(value) -> Setting:
    """precision.smoothing as the code uses it: None (off), "auto" or an alpha in [0, 1].
    Raises ValueError with the accepted values otherwise."""
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "null", "none", "off", "false")):
        return None
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    try:
        alpha = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"precision.smoothing must be null, auto or an alpha in [0, 1], not {value!r}") from None
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"precision.smoothing: alpha {alpha} is outside [0, 1]")
    return alpha


@dataclass
class Group:
    """The smoothable readers of one activation: they share one scale vector."""

    source: str  # the activation X
    ops: List[str]  # MatMul/Gemm nodes reading X as their first input with a constant weight
    weights: List[Tuple[str, int]]  # (weight initializer, its input-channel axis) per op
    fold: Optional[str] = None  # the normalization node X is scaled in, when it can be
    views: List[str] = field(default_factory=list)  # with fold: the tensors between its output and X (scaled too)
    after_norm: bool = False  # X is made by a normalization (LayerNorm, RMSNorm)
    scale: Optional[np.ndarray] = field(default=None, repr=False)


def _weight_axis(node, initializers) -> Optional[int]:
    """The input-channel axis of the op's constant 2-D float weight, when the op reads an
    activation as its first input (Y = X W): MatMul [C, N] -> 0; Gemm [C, N] -> 0, with
    transB [N, C] -> 1. None for anything else (transA, two activations, batched weights)."""
    if node.op_type not in SMOOTHED_OPS or len(node.input) < 2 or node.input[0] in initializers:
        return None
    weight = initializers.get(node.input[1])
    if weight is None or weight.data_type != onnx.TensorProto.FLOAT or len(weight.dims) != 2:
        return None
    attributes = {a.name: a.i for a in node.attribute if a.type == onnx.AttributeProto.INT}
    if node.op_type == "Gemm":
        if attributes.get("transA", 0):
            return None
        return 1 if attributes.get("transB", 0) else 0
    return 0


def groups(model: onnx.ModelProto, op_types: Iterable[str] = SMOOTHED_OPS, keep_float: Iterable[str] = ()) -> List[Group]:
    """Every activation read by smoothable ops (of ``op_types``, not kept float), in graph
    order. A weight that another node also reads is left alone (scaling it for one reader
    would change the other)."""
    graph = model.graph
    initializers = {t.name: t for t in graph.initializer}
    readers: Dict[str, List] = defaultdict(list)
    for node in graph.node:
        for name in dict.fromkeys(node.input):
            readers[name].append(node)
    producer = {out: node for node in graph.node for out in node.output}
    wanted, keep_float = set(op_types) & set(SMOOTHED_OPS), set(keep_float)
    by_source: Dict[str, Group] = {}
    for node in graph.node:
        axis = _weight_axis(node, initializers) if node.op_type in wanted and node.name not in keep_float else None
        if axis is None or len(readers[node.input[1]]) > 1:
            continue
        group = by_source.setdefault(node.input[0], Group(node.input[0], [], [],
                                                           after_norm=_made_by_norm(node.input[0], producer)))
        group.ops.append(node.name)
        group.weights.append((node.input[1], axis))
    outputs = {o.name for o in graph.output}
    for group in by_source.values():
        group.fold, group.views = _foldable_norm(group, producer, readers, initializers, outputs)
    return list(by_source.values())


def _foldable_norm(group: Group, producer, readers, initializers, outputs) -> Tuple[Optional[str], List[str]]:
    """(the normalization X / s can be folded into, the tensors between its output and X) or
    (None, []): X made by a normalization over its last axis, directly or through reshapes and
    transposes that keep the channel axis last, each tensor on the way read by the next node
    alone and no graph output."""
    weight, axis = group.weights[0]
    channels = initializers[weight].dims[axis]
    name, expected, views = group.source, set(group.ops), []
    while name not in outputs and {n.name for n in readers[name]} == expected and name in producer:
        node = producer[name]
        if node.op_type in NORMS:
            return (node.name, views[::-1]) if _folds_into(node, initializers, channels) else (None, [])
        if not _keeps_channels_last(node, initializers, channels):
            break
        name, expected = node.input[0], {node.name}
        views.append(name)
    return None, []


def _folds_into(norm, initializers, channels: int) -> bool:
    """The normalization is over the last axis and its scale and bias are constants of one
    value a channel."""
    attributes = {a.name: a.i for a in norm.attribute if a.type == onnx.AttributeProto.INT}
    return attributes.get("axis", -1) == -1 and \
        all(name in initializers and list(initializers[name].dims) == [channels] for name in norm.input[1:] if name)


def _keeps_channels_last(node, initializers, channels: int) -> bool:
    """A transpose that leaves the last axis last, or a reshape whose target ends in the
    channels (its input ends in them too: the walk starts at a normalization over them)."""
    if node.op_type == "Transpose":
        perm = next((list(a.ints) for a in node.attribute if a.name == "perm"), None)
        return perm is not None and perm[-1] == len(perm) - 1
    if node.op_type == "Reshape" and node.input[1] in initializers:
        shape = numpy_helper.to_array(initializers[node.input[1]])
        return shape.size > 0 and int(shape[-1]) == channels
    return False


def _made_by_norm(name: str, producer: Dict[str, onnx.NodeProto], depth: int = 6) -> bool:
    """The tensor is a normalization's output (through reshapes): a LayerNormalization or
    RMSNormalization op, or the elementwise ops an older export spells one with
    (x - mean) / sqrt(var + eps) * gamma + beta: a ReduceMean within ``depth`` elementwise
    steps up."""
    node = producer.get(name)
    while node is not None and node.op_type in RESHAPES:  # a Gemm's 2-D view of a [batch, tokens, C] input
        node = producer.get(node.input[0])
    if node is None or node.op_type in NORMS:
        return node is not None
    frontier, seen = [node], {node.name}
    for _ in range(depth):
        above = []
        for current in frontier:
            if current.op_type not in ELEMENTWISE:
                continue
            for up in (producer.get(i) for i in current.input):
                if up is not None and up.op_type == "ReduceMean":
                    return True
                if up is not None and up.name not in seen:
                    seen.add(up.name)
                    above.append(up)
        frontier = above
    return False


def weight_maxima(model: onnx.ModelProto, group: Group) -> np.ndarray:
    """max |W| per input channel over every weight of the group."""
    initializers = {t.name: t for t in model.graph.initializer}
    found = None
    for name, axis in group.weights:
        weight = np.abs(numpy_helper.to_array(initializers[name]))
        per_channel = weight.max(axis=1 - axis)
        found = per_channel if found is None else np.maximum(found, per_channel)
    return found.astype(np.float64)


def scales(activation_max: np.ndarray, weight_max: np.ndarray, alpha: float) -> np.ndarray:
    """s_j = max|X_j|^alpha / max|W_j|^(1-alpha); 1 where a channel is all zero on either side."""
    a, w = np.asarray(activation_max, np.float64), np.asarray(weight_max, np.float64)
    s = np.maximum(a, EPSILON) ** alpha / np.maximum(w, EPSILON) ** (1.0 - alpha)
    return np.where((a > 0) & (w > 0) & np.isfinite(s) & (s > 0), s, 1.0)


def with_scales(model: onnx.ModelProto, found: Sequence[Group], maxima: Dict[str, np.ndarray],
                alpha: float) -> List[Group]:
    """The groups whose channels match their weights, each with its scale for ``alpha``."""
    ready = []
    for group in found:
        activation = maxima.get(group.source)
        weight = weight_maxima(model, group)
        if activation is None or activation.shape != weight.shape:
            continue
        ready.append(replace(group, scale=scales(activation, weight, alpha)))
    return ready


def smoothed(model: onnx.ModelProto, ready: Sequence[Group]) -> onnx.ModelProto:
    """A copy of ``model`` with each group's weights times s and its activation divided by s
    (folded into the normalization, or a Mul in front of the group). The float model
    computes the same outputs (up to float32 rounding)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    initializers = {t.name: t for t in graph.initializer}
    nodes = {node.name: node for node in graph.node}
    types = {v.name: v for v in list(graph.input) + list(graph.value_info) + list(graph.output)}
    taken = {t.name for t in graph.initializer} | {o for n in graph.node for o in n.output} | \
        {i.name for i in graph.input} | set(nodes)
    inserted: Dict[str, onnx.NodeProto] = {}  # first reader's name -> the Mul to place before it
    uses = Counter(name for node in graph.node for name in node.input)
    for group in ready:
        s = group.scale
        for name, axis in group.weights:
            weight = numpy_helper.to_array(initializers[name]).astype(np.float64)
            shaped = s.reshape((-1, 1) if axis == 0 else (1, -1))
            initializers[name].CopyFrom(numpy_helper.from_array((weight * shaped).astype(np.float32), name))
        if group.fold is not None:
            norm = nodes[group.fold]
            for index, name in enumerate(norm.input[1:], start=1):
                if not name:
                    continue
                values = (numpy_helper.to_array(initializers[name]).astype(np.float64) / s).astype(np.float32)
                if uses[name] > 1:  # another node reads it too (an exporter shares equal constants): a copy of its own
                    uses[name] -= 1
                    norm.input[index] = _fresh(f"{name}_smoothed", taken)
                    graph.initializer.append(numpy_helper.from_array(values, norm.input[index]))
                else:
                    initializers[name].CopyFrom(numpy_helper.from_array(values, name))
            continue
        inverse = _fresh(f"{group.source}_smooth_scale", taken)
        result = _fresh(f"{group.source}_smoothed", taken)
        graph.initializer.append(numpy_helper.from_array((1.0 / s).astype(np.float32), inverse))
        if group.source in types:
            info = onnx.ValueInfoProto()
            info.CopyFrom(types[group.source])
            info.name = result
            graph.value_info.append(info)
        first = next(node for node in graph.node if node.name in group.ops)
        inserted[first.name] = helper.make_node("Mul", [group.source, inverse], [result],
                                                name=_fresh(f"{group.source}/smoothing", taken))
        for op in group.ops:
            nodes[op].input[0] = result
    if inserted:
        ordered = []
        for node in graph.node:
            if node.name in inserted:
                ordered.append(inserted[node.name])
            ordered.append(node)
        del graph.node[:]
        graph.node.extend(ordered)
    return out


def _fresh(base: str, taken: set) -> str:
    name, number = base, 1
    while name in taken:
        number += 1
        name = f"{base}_{number}"
    taken.add(name)
    return name


def describe(ready: Sequence[Group]) -> List[dict]:
    """Per group what the report records: the activation, its ops, folded or a Mul, the
    spread of s."""
    return [{"activation": g.source, "ops": list(g.ops), "folded_into": g.fold,
             "scale_min": round(float(g.scale.min()), 6), "scale_max": round(float(g.scale.max()), 6)}
            for g in ready]


class Judge:
    """Candidate float models (the prepared one, or smoothed ones) scored at the network
    outputs as their int8 models: each recalibrated on the judge samples (``make_table``
    from their statistics), fake-quantized with ``settings`` (calibration/fake_quant.py)
    and run sample by sample (samples may differ in shape) against the prepared model's
    fp32 outputs. The loss is calibration=auto's: (1 - cosine) + (1 - worst sample's
    cosine), averaged over the float outputs.

    One statistics pass serves every candidate where the smoothed tensors' entries are max
    ranges (the judge's method): smoothing changes only the activations it divides (every
    other tensor computes the same values), and the range of X / s is the per-channel range
    of X divided by s. A histogram method (calibration.method=kl, ...) recollects per
    candidate."""

    def __init__(self, prepared: onnx.ModelProto, samples: Sequence, settings, keep_float: Iterable[str],
                 make_table: Callable, sources: Sequence[str] = (), base_statistics=None,
                 shared: Optional[dict] = None):
        """``base_statistics``: the prepared model's statistics on these very samples, where
        the caller has them (calibration's own pass): not collected again. ``shared``: what
        the judges of one calibration share while they judge the same prepared model
        (equalization's, then smoothing's where equalization left the model as it was): its
        fp32 outputs and table on the judge samples, computed once (about 2 s of PP-OCRv4
        rec's calibrate); a max table the caller read off its statistics' per-sample bounds
        may be there already (``base_table``, stages/calibrate.py)."""
        from pipeline.precision.calibration import statistics
        from pipeline.precision.calibration.measure import float_outputs

        self.samples, self.settings, self.keep_float = list(samples), settings, list(keep_float)
        self.make_table, self.outputs = make_table, float_outputs(prepared)
        names = [getattr(sample, "name", None) for sample in self.samples]
        known = shared if shared is not None and None not in names and shared.get("samples") == names else {}
        self.reference = known["reference"] if "reference" in known else self._run_float(prepared)
        self.base = make_table(base_statistics) if base_statistics is not None else known.get("base_table")
        if self.base is None:
            self.base = make_table(self._statistics(prepared))
        if shared is not None and None not in names:
            shared.update(samples=names, reference=self.reference, base_table=self.base)
        self.ranges = statistics.channel_ranges(prepared, (s.feeds for s in self.samples), list(sources)) \
            if all(self.base.get(name, {}).get("method") == "max" for name in sources) else None

    def _statistics(self, model: onnx.ModelProto, only: Optional[Iterable[str]] = None):
        from pipeline.precision.calibration import statistics

        return statistics.collect(model, self.samples, len(self.samples), keep=0, around=self.settings.quantize_ops,
                                  only=only)

    def _run_float(self, model: onnx.ModelProto) -> List[List[np.ndarray]]:
        from pipeline.backends.onnxruntime import untimed_options
        import onnxruntime as ort

        options = untimed_options()
        options.log_severity_level = 4
        session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        return [session.run(self.outputs, sample.feeds) for sample in self.samples]

    def table(self, model: onnx.ModelProto, ready: Sequence[Group]) -> Dict[str, dict]:
        """``model``'s table on the judge samples: the prepared model's with each smoothed
        activation's range divided by its s, or recollected (see the class)."""
        if not ready:
            return self.base
        if self.ranges is None:
            return self.make_table(self._statistics(model))
        table = dict(self.base)
        for group, smoothed_name in zip(ready, smoothed_tensors(model, ready)):  # the source when folded, else the Mul's
            low, high = self.ranges[group.source]
            entry = range_entry(float((low / group.scale).min()), float((high / group.scale).max()))
            table.update({name: entry for name in (smoothed_name, *group.views)})  # a view holds the same values
        return table

    def loss(self, model: onnx.ModelProto, ready: Sequence[Group] = ()) -> dict:
        return self._loss(model, self.table(model, ready))

    def recollected_loss(self, model: onnx.ModelProto, changed: Optional[Iterable[str]] = None) -> dict:
        """``model``'s loss with a table recollected on it: a model whose activations changed
        beyond smoothed ones (pipeline/precision/equalization.py). ``changed``: the only
        tensors whose values differ from the prepared model's; the others keep the base
        table's entries (a full pass over a 320x320 segmenter's 329 tensors took 35-45 s)."""
        if changed is None:
            return self._loss(model, self.make_table(self._statistics(model)))
        return self._loss(model, {**self.base, **self.make_table(self._statistics(model, only=set(changed)))})

    def _loss(self, model: onnx.ModelProto, table: Dict[str, dict]) -> dict:
        from pipeline.precision.calibration.fake_quant import FakeQuantModel

        fake = FakeQuantModel(model, table, self.settings, self.keep_float)
        actual = fake.run_each(table, [sample.feeds for sample in self.samples], self.outputs)
        return agreement(self.reference, actual)


def range_entry(low: float, high: float) -> dict:
    """A max-method table entry from a signed range (what tables.table_entry gives a
    histogram with these extremes, without the histogram)."""
    from pipeline.precision.calibration.thresholds import MIN_THRESHOLD

    return {"threshold": max(abs(low), abs(high), MIN_THRESHOLD), "min": low, "max": high, "method": "max"}


def agreement(reference: List[List[np.ndarray]], actual: List[List[np.ndarray]]) -> dict:
    """Per float output the cosine over all samples together (verify's) and the worst
    sample's, averaged over the outputs; samples may differ in shape."""
    cosines, worst = [], []
    for index in range(len(reference[0]) if reference else 0):
        dots = ref_sq = out_sq = 0.0
        lowest = 1.0
        for ref, out in zip(reference, actual):
            a, b = ref[index].astype(np.float64).ravel(), np.nan_to_num(out[index].astype(np.float64).ravel())
            dot, aa, bb = float(a @ b), float(a @ a), float(b @ b)
            dots, ref_sq, out_sq = dots + dot, ref_sq + aa, out_sq + bb
            lowest = min(lowest, dot / np.sqrt(aa * bb) if aa > 0 and bb > 0 else float(aa == bb))
        cosines.append(dots / np.sqrt(ref_sq * out_sq) if ref_sq > 0 and out_sq > 0 else float(ref_sq == out_sq))
        worst.append(lowest)
    cosine, low = float(np.mean(cosines)), float(np.mean(worst))
    return {"cosine": round(cosine, 6), "worst_sample_cosine": round(low, 6),
            "loss": round((1.0 - cosine) + (1.0 - low), 6)}


def applies(found: Sequence[Group], setting: Setting) -> bool:
    """Whether a setting smooths these groups: a fixed alpha any group; auto only a model
    with an activation made by a normalization (a transformer), so a CNN's classifier head
    alone costs no search."""
    if setting is None or not found:
        return False
    return setting != "auto" or any(g.after_norm for g in found)


def choose(prepared: onnx.ModelProto, samples: Sequence, setting: Setting, settings, keep_float: Iterable[str],
           make_table: Callable, alphas: Sequence[float] = ALPHAS, judged_on: Optional[Sequence] = None,
           shared: Optional[dict] = None, maxima: Optional[Dict[str, np.ndarray]] = None
           ) -> Tuple[onnx.ModelProto, dict]:
    """The model calibration and the int8 build use, and the summary the report records.
    ``samples``: calibration samples (pipeline.data.Sample, iterated twice); every one gives
    the channel maxima, ``judged_on`` (default: the first JUDGE_SAMPLES) judge auto's candidates: no smoothing, each
    alpha of ``alphas``, then REFINE steps from the best alpha either way (in (0, 1]) while
    the loss falls. No smoothing is kept on ties: smoothing has to pay. ``shared``: see Judge.
    ``maxima``: the groups' activations' channel maxima (last axis) over every sample, where
    the caller has them (calibrate's statistics pass): no pass of its own."""
    from pipeline.precision.calibration import statistics

    started = time.perf_counter()
    found = groups(prepared, settings.quantize_ops, keep_float)
    if not applies(found, setting):
        why = "off" if setting is None else ("no MatMul/Gemm with a constant weight" if not found
                                            else "auto: no MatMul/Gemm reads a normalization's output")
        return prepared, {"setting": setting, "applied": False, "reason": why}
    if maxima is None or any(g.source not in maxima or maxima[g.source].shape != weight_maxima(prepared, g).shape
                             for g in found):  # maxima on another axis than the one its weights scale
        maxima = statistics.channel_maxima(prepared, (s.feeds for s in samples), [g.source for g in found])
    else:
        maxima = {g.source: maxima[g.source] for g in found}
    if not maxima:
        return prepared, {"setting": setting, "applied": False, "reason": "no calibration samples"}
    if not with_scales(prepared, found, maxima, 0.5):
        return prepared, {"setting": setting, "applied": False, "reason": "no group's channels match its weights"}

    def seconds() -> float:
        return round(time.perf_counter() - started, 3)

    if setting != "auto":
        ready = with_scales(prepared, found, maxima, float(setting))
        model = smoothed(prepared, ready)
        return model, {"setting": setting, "applied": True, "alpha": float(setting), "groups": describe(ready),
                       "smoothed_tensors": changed_tensors(model, ready), "seconds": seconds()}
    judged_on = list(islice(samples, JUDGE_SAMPLES)) if judged_on is None else list(judged_on)
    judge = Judge(prepared, judged_on, settings, keep_float, make_table,
                  [g.source for g in with_scales(prepared, found, maxima, 0.5)], shared=shared)

    def loss(alpha: Optional[float]) -> dict:
        ready = [] if alpha is None else with_scales(prepared, found, maxima, alpha)
        return judge.loss(smoothed(prepared, ready) if ready else prepared, ready)

    best, scores = search(loss, alphas)
    summary = {"setting": setting, "applied": best is not None, "alpha": best,
               "judged_on": len(judge.samples), "candidates": scores}
    if best is None:
        return prepared, {**summary, "seconds": seconds()}
    ready = with_scales(prepared, found, maxima, best)
    model = smoothed(prepared, ready)
    return model, {**summary, "groups": describe(ready), "smoothed_tensors": changed_tensors(model, ready),
                   "seconds": seconds()}


def smoothed_tensors(model: onnx.ModelProto, ready: Sequence[Group]) -> List[str]:
    """The only tensors of the smoothed ``model`` whose values differ from the prepared
    model's: what each group's ops read (the normalization's output it was folded into, or
    the inserted Mul's). Every other tensor computes the same values."""
    nodes = {node.name: node for node in model.graph.node}
    return [nodes[group.ops[0]].input[0] for group in ready]  # one a group: each group has its own source


def changed_tensors(model: onnx.ModelProto, ready: Sequence[Group]) -> List[str]:
    """smoothed_tensors and, where a group is folded through reshapes or transposes, the
    tensors on the way (its normalization's output first): every tensor whose values differ."""
    return [*smoothed_tensors(model, ready), *(view for group in ready for view in group.views)]


def search(loss: Callable[[Optional[float]], dict], alphas: Sequence[float] = ALPHAS) -> Tuple[Optional[float], dict]:
    """(the alpha with the lowest loss, or None for no smoothing; every measurement by name).
    ``loss(alpha)`` measures one candidate (None: no smoothing), measured first; then each of
    ``alphas``; then REFINE steps from the best of them either way, within (0, 1], while the
    loss falls. Ties go to the first measured: no smoothing, then the grid's order."""
    scores = {"none": loss(None)}

    def measure(alpha: float) -> float:
        if str(alpha) not in scores:
            scores[str(alpha)] = loss(alpha)
        return scores[str(alpha)]["loss"]

    for alpha in alphas:
        measure(alpha)
    start = min(alphas, key=measure)
    for step in (-REFINE, REFINE):
        last, alpha = start, round(start + step, 3)
        while 0.0 < alpha <= 1.0 and str(alpha) not in scores and measure(alpha) < measure(last):
            last, alpha = alpha, round(alpha + step, 3)
    best = min(scores, key=lambda name: scores[name]["loss"])
    return (None if best == "none" else float(best)), scores
