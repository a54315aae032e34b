"""Activation equalization across a layer pair, before static int8.

A convolutional network can carry one activation channel far above the rest of its
tensor: a folded batch norm whose channel saturates sits at a constant 228 where every
other channel stays under 72. One per-tensor int8 scale then spends its steps on that
channel and rounds the others to a few: ONNX Runtime's static quantizer and NNCF keep an
IoU of 0.57 and 0.47 of such a segmenter's map (docs/calibration.md, "Outlier channels").

For a Conv P whose output reaches only group-1 Convs C, directly or through ops that
commute with a positive per-channel scale (Relu, MaxPool, Resize, Concat on the channel
axis, ...), dividing P's output channel c (its weights and bias) by s_c and multiplying
every C's input channel c (at its offset in a Concat) by s_c leaves the network's outputs
unchanged in float. This is cross-layer equalization (Nagel et al. 2019, "Data-Free
Quantization Through Weight Equalization and Bias Correction") with the scales taken from
the calibration data's activation ranges, as SmoothQuant takes them for a transformer's
MatMuls (pipeline/precision/smoothing.py): only outlier channels move,

    s_c = m_c / typical   for m_c > OUTLIER_RATIO * median(m) and m_c >= MIN_SPREAD * typical,

m the channel maxima of P's output and typical the largest of its other channels. The
weights of C take the spread (quantized per output channel, they absorb it far better).
The equalized model is kept only where its int8 model, recalibrated, does at least MIN_GAIN
better at the network outputs on calibration samples (smoothing.Judge): equalization has
to pay."""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field
from itertools import islice
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import onnx
from onnx import numpy_helper

# ops y = f(x) with f(x / s) = f(x) / s for a positive per-channel s (input 0 only)
PASS_THROUGH = ("Relu", "LeakyRelu", "PRelu", "MaxPool", "AveragePool", "GlobalMaxPool", "GlobalAveragePool",
                "Resize", "Upsample", "Identity", "Dropout")
SHAPE_ONLY = ("Shape", "Size")  # readers that see the tensor's shape, not its values
OUTLIER_RATIO = 2.5  # a channel whose maximum is this far above the tensor's median channel maximum ...
MIN_SPREAD = 2.0  # ... and this far above the largest of the other channels (a tail of large channels is no outlier)
MIN_GAIN = 0.1  # the int8 loss must fall by this share at least (a judge on 16 samples moves by less on noise)
JUDGE_SAMPLES = 16  # calibration samples the int8 models with and without are judged on
ALPHAS = (0.5, 1.0)  # how much of an outlier's spread moves into the consumers' weights


@dataclass
class Pair:
    """A Conv whose output channels can be scaled, and the Convs that absorb the scales."""

    producer: str  # the Conv node making the equalized activation
    tensor: str  # its output
    consumers: List[Tuple[str, int]]  # (Conv node, the offset of the producer's channels in its input)
    rescaled: List[str] = field(default_factory=list)  # the tensors from it to the consumers: scaled too
    scale: Optional[np.ndarray] = field(default=None, repr=False)


def pairs(model: onnx.ModelProto) -> List[Pair]:
    """Every Conv with constant weights whose output reaches only group-1 Convs with their
    own constant weights, through PASS_THROUGH ops and channel Concats, in graph order."""
    graph = model.graph
    initializers = {t.name for t in graph.initializer}
    readers: Dict[str, List[onnx.NodeProto]] = defaultdict(list)
    uses: Dict[str, int] = defaultdict(int)
    for node in graph.node:
        for name in node.input:
            uses[name] += 1
        for name in dict.fromkeys(node.input):
            readers[name].append(node)
    channels = _channel_counts(model)
    found = []
    for node in graph.node:
        if node.op_type != "Conv" or not _own_weights(node, initializers, uses):
            continue
        rescaled: List[str] = []
        consumers = _consumers(node.output[0], 0, readers, channels, initializers, uses,
                               {o.name for o in graph.output}, rescaled)
        if consumers:
            found.append(Pair(node.name, node.output[0], consumers, list(dict.fromkeys(rescaled))))
    return found


def _own_weights(node: onnx.NodeProto, initializers: set, uses: Dict[str, int]) -> bool:
    """The Conv's weight (and bias) are initializers no other node reads."""
    constant = [name for name in node.input[1:] if name]
    return len(node.input) > 1 and all(name in initializers and uses[name] == 1 for name in constant)


def _consumers(tensor: str, offset: int, readers, channels: Dict[str, int], initializers: set,
               uses: Dict[str, int], outputs: set, rescaled: List[str]) -> Optional[List[Tuple[str, int]]]:
    """The Convs absorbing ``tensor``'s channels (at ``offset`` in their input), or None when
    any reader cannot take a per-channel scale (or the tensor is a graph output); the
    tensors on the way are added to ``rescaled``."""
    if tensor in outputs or not readers[tensor]:
        return None
    rescaled.append(tensor)
    found: List[Tuple[str, int]] = []
    for node in readers[tensor]:
        if node.op_type in SHAPE_ONLY:
            continue
        if node.op_type == "Conv" and _group(node) == 1 and list(node.input).count(tensor) == 1 \
                and node.input[0] == tensor and _own_weights(node, initializers, uses):
            found.append((node.name, offset))
            continue
        if node.op_type in PASS_THROUGH and node.input[0] == tensor and tensor not in node.input[1:]:
            deeper = _consumers(node.output[0], offset, readers, channels, initializers, uses, outputs, rescaled)
        elif node.op_type == "Concat" and _axis(node) in (1, -3) and all(i in channels for i in node.input):
            deeper = []
            for position, name in enumerate(node.input):
                if name == tensor:
                    before = sum(channels[i] for i in node.input[:position])
                    more = _consumers(node.output[0], offset + before, readers, channels, initializers, uses,
                                      outputs, rescaled)
                    deeper = None if more is None or deeper is None else deeper + more
        else:
            return None
        if deeper is None:
            return None
        found += deeper
    return found or None


def _group(node: onnx.NodeProto) -> int:
    return next((a.i for a in node.attribute if a.name == "group"), 1)


def _axis(node: onnx.NodeProto) -> int:
    return next((a.i for a in node.attribute if a.name == "axis"), 0)


def _channel_counts(model: onnx.ModelProto) -> Dict[str, int]:
    """Axis-1 sizes of 4-D tensors: shape inference's, and where it loses them (a Resize to
    sizes computed at run time) carried forward from each Conv's weight through the
    PASS_THROUGH ops and channel Concats."""
    found: Dict[str, int] = {}
    try:
        inferred = onnx.shape_inference.infer_shapes(model)
        values = list(inferred.graph.value_info) + list(inferred.graph.input) + list(inferred.graph.output)
    except Exception:  # noqa: BLE001 - a graph shape inference cannot follow
        values = list(model.graph.input)
    for value in values:
        dims = value.type.tensor_type.shape.dim
        if len(dims) == 4 and dims[1].HasField("dim_value"):
            found[value.name] = dims[1].dim_value
    weights = {t.name: list(t.dims) for t in model.graph.initializer}
    for node in model.graph.node:
        if node.output[0] in found or not node.input:
            continue
        if node.op_type == "Conv" and len(weights.get(node.input[1], [])) == 4:
            found[node.output[0]] = weights[node.input[1]][0]
        elif node.op_type in PASS_THROUGH and node.input[0] in found:
            found[node.output[0]] = found[node.input[0]]
        elif node.op_type == "Concat" and _axis(node) in (1, -3) and all(i in found for i in node.input):
            found[node.output[0]] = sum(found[i] for i in node.input)
    return found


def with_scales(found: Sequence[Pair], maxima: Dict[str, np.ndarray], alpha: float = 1.0) -> List[Pair]:
    """The pairs whose producer has outlier channels, each with its scale vector (1 for
    the channels that stay): (m_c / typical) ** alpha, 1 bringing the channel down to the
    typical one, 0.5 splitting the spread between the activation and the consumers' weights."""
    ready = []
    for pair in found:
        m = maxima.get(pair.tensor)
        if m is None or m.size < 2:
            continue
        median = float(np.median(m))
        outliers = m > OUTLIER_RATIO * max(median, 1e-12)
        if not outliers.any() or outliers.all():
            continue
        typical = float(m[~outliers].max())
        outliers &= m >= MIN_SPREAD * typical
        if typical <= 0.0 or not outliers.any():
            continue
        ready.append(Pair(pair.producer, pair.tensor, pair.consumers, pair.rescaled,
                          np.where(outliers, (m / typical) ** alpha, 1.0)))
    return ready


def equalized(model: onnx.ModelProto, ready: Sequence[Pair]) -> onnx.ModelProto:
    """A copy of ``model`` with each pair's producer channels divided by its scale and its
    consumers' input channels multiplied by it (the same outputs in float)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    initializers = {t.name: t for t in out.graph.initializer}
    nodes = {node.name: node for node in out.graph.node}
    for pair in ready:
        s = pair.scale.astype(np.float64)
        for position, name in enumerate(nodes[pair.producer].input[1:3], start=1):
            if name:
                values = numpy_helper.to_array(initializers[name]).astype(np.float64)
                shaped = s.reshape((-1,) + (1,) * (values.ndim - 1))  # weight [out, in, k, k] and bias [out]
                _replace(initializers[name], values / shaped)
        for consumer, offset in pair.consumers:
            name = nodes[consumer].input[1]
            values = numpy_helper.to_array(initializers[name]).astype(np.float64)
            values[:, offset:offset + s.size] *= s.reshape((1, -1) + (1,) * (values.ndim - 2))
            _replace(initializers[name], values)
    return out


def _replace(initializer: onnx.TensorProto, values: np.ndarray) -> None:
    initializer.CopyFrom(numpy_helper.from_array(values.astype(np.float32), initializer.name))


def describe(ready: Sequence[Pair]) -> List[dict]:
    """Per pair what the report records: the producer, its consumers, the channels scaled."""
    return [{"producer": p.producer, "activation": p.tensor, "consumers": [c for c, _ in p.consumers],
             "channels": [int(c) for c in np.flatnonzero(p.scale > 1.0)], "rescaled": list(p.rescaled),
             "scale_max": round(float(p.scale.max()), 4)} for p in ready]


def choose(prepared: onnx.ModelProto, samples: Sequence, enabled: bool, settings, make_table: Callable,
           base_statistics=None, judged_on: Optional[Sequence] = None,
           maxima: Optional[Dict[str, np.ndarray]] = None, shared: Optional[dict] = None
           ) -> Tuple[onnx.ModelProto, dict]:
    """The model calibration and the int8 build use, and the summary the report records.
    ``samples``: calibration samples (iterated twice): every one gives the channel maxima;
    ``judged_on`` (default: the first JUDGE_SAMPLES) judge the int8 models with and without
    equalization. ``base_statistics``: the prepared model's statistics on exactly those
    judge samples, if the caller has them. ``maxima``: the channel maxima of the pairs'
    tensors over every sample where the caller has them (calibrate's statistics pass: no
    pass of its own). An applied summary names the ``scaled_tensors``: the only
    activations whose values changed (their consumers take the scale back in float).
    ``shared``: see smoothing.Judge."""
    from pipeline.precision.calibration import statistics
    from pipeline.precision.smoothing import Judge

    if not enabled:
        return prepared, {"applied": False, "reason": "off (precision.equalization=false)"}
    started = time.perf_counter()
    found = pairs(prepared)
    if not found:
        return prepared, {"applied": False, "reason": "no Conv whose output only Convs read"}
    if maxima is None or any(p.tensor not in maxima for p in found):
        maxima = statistics.channel_maxima(prepared, (s.feeds for s in samples), [p.tensor for p in found], axis=1)
    if not with_scales(found, maxima):
        return prepared, {"applied": False, "reason": "no outlier channel", "pairs": len(found)}
    judged_on = list(islice(samples, JUDGE_SAMPLES)) if judged_on is None else list(judged_on)
    judge = Judge(prepared, judged_on, settings, (), make_table, base_statistics=base_statistics, shared=shared)
    scores = {"none": judge.loss(prepared)}
    scaled = {alpha: with_scales(found, maxima, alpha) for alpha in ALPHAS}
    # only the scaled activations change (the consumers take the scale back in float)
    changed = {alpha: sorted({name for pair in ready for name in [pair.tensor, *pair.rescaled]})
               for alpha, ready in scaled.items()}
    models = {alpha: equalized(prepared, ready) for alpha, ready in scaled.items()}
    for alpha in ALPHAS:
        scores[f"alpha {alpha:g}"] = judge.recollected_loss(models[alpha], changed[alpha])
    best = min(ALPHAS, key=lambda alpha: scores[f"alpha {alpha:g}"]["loss"])
    summary = {"pairs": len(found), "outlier_pairs": describe(scaled[best]),
               "judged_on": len(judge.samples), "candidates": scores,
               "seconds": round(time.perf_counter() - started, 3)}
    if scores[f"alpha {best:g}"]["loss"] < (1.0 - MIN_GAIN) * scores["none"]["loss"]:
        return models[best], {"applied": True, "alpha": best, **summary, "scaled_tensors": changed[best]}
    return prepared, {"applied": False, "reason": f"the int8 model did not do {MIN_GAIN:.0%} better with it",
                      **summary}
