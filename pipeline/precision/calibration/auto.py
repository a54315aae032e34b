"""calibration.method=auto, in two steps.

1. ``choose``: per tensor, the threshold method whose quantization gives the lowest error
   at the output of the op that consumes the tensor, on a few kept calibration samples.
   Weighted consumers (Conv, Gemm, MatMul) are run as single-node ONNX Runtime models on
   the fake-quantized tensor; for any other consumer the tensor's own quantization error
   is what propagates, so that is measured instead.
2. ``choose_table``: that per-tensor table and every single method's table are each
   measured at the network outputs of the int8 model (one fake-quantized model whose
   ranges are inputs, pipeline/precision/calibration/fake_quant.py); the lowest loss wins.
   On a model too large to run every table on every sample, the tables are screened on a
   subsample that keeps the outlier samples and the two best measured in full. The
   single methods are candidates, so auto is never worse than the best of them on this
   measurement (a local criterion alone can clip what a few samples need)."""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

import numpy as np
import onnx
from onnx import numpy_helper

from pipeline.precision.calibration.single_node import node_session

from pipeline.precision.quantize import scale_and_zero_point

WEIGHTED_OPS = {"Conv", "ConvTranspose", "Gemm", "MatMul"}
CRITERION = "lowest (1 - cosine) + (1 - worst sample's cosine) at the outputs, calibration set"


FINALISTS = 2  # tables measured on every calibration sample after a screening on a subsample


def choose_table(measure: Callable[[Dict[str, dict]], dict], tables: Dict[str, Dict[str, dict]],
                 screen: Optional[Callable[[Dict[str, dict]], dict]] = None) -> Tuple[str, Dict[str, dict]]:
    """(name of the best table, every table's measurement). ``measure(table)`` gives
    measure.OutputJudge's figures for the int8 model of that table; the loss adds the worst
    sample's 1 - cosine to the whole set's, so one sample wrecked by clipping counts as much
    as the average. ``screen``: the same measurement on a subsample that keeps the outlier
    samples: every table is screened and only the FINALISTS best are measured in full (the
    others keep their screening figures, marked ``screened_only``). Ties go to the earlier table."""
    names = list(tables)
    screened: Dict[str, dict] = {}
    if screen is not None and len(tables) > FINALISTS:
        screened = {name: {**_scored(screen(table)), "screened_only": True} for name, table in tables.items()}
        best = sorted(names, key=lambda name: (screened[name]["loss"], names.index(name)))[:FINALISTS]
        names = [name for name in names if name in best]
    scores = {name: _scored(measure(tables[name])) for name in names}
    chosen = min(scores, key=lambda name: scores[name]["loss"])
    return chosen, {name: scores.get(name, screened.get(name)) for name in tables}


def _scored(result: dict) -> dict:
    return {**result, "loss": (1.0 - result["cosine"]) + (1.0 - result["worst_sample_cosine"])}


BLOCK_VALUES = 1 << 16  # values fake-quantized at a time: the steps' temporaries stay in the CPU's cache


def fake_quantize(values: np.ndarray, entry: dict, activations: str) -> np.ndarray:
    """Quantize-dequantize over the range the int8 build will use for this tensor, in
    float32 as ONNX Runtime's QuantizeLinear and DequantizeLinear compute. A block at a
    time, in place: five whole-tensor temporaries made the mixed search's op screen of the
    real-size segmenter (64 x 320 x 320 tensors, 8 samples) spend 96 s of its threads here."""
    qmin, qmax = (-128, 127) if activations == "int8" else (0, 255)
    scale, zero = scale_and_zero_point(entry, activations)  # exactly the build's
    if values.dtype != np.float32:
        quantized = np.clip(np.round(values / scale) + zero, qmin, qmax)
        return ((quantized - zero) * scale).astype(values.dtype)
    flat = np.ascontiguousarray(values).reshape(-1)
    out = np.empty_like(flat)
    for start in range(0, flat.size, BLOCK_VALUES):
        block = out[start:start + BLOCK_VALUES]
        np.divide(flat[start:start + BLOCK_VALUES], scale, out=block)
        np.round(block, out=block)
        block += zero
        np.clip(block, qmin, qmax, out=block)
        block -= zero
        block *= scale
    return out.reshape(values.shape)


def choose(model: onnx.ModelProto, kept: Dict[str, np.ndarray], candidates: Dict[str, Dict[str, dict]],
           activations: str) -> Dict[str, dict]:
    """{tensor: {"method": best, "errors": {method: mse}}} for every tensor with kept samples."""
    consumers = _weighted_consumers(model)
    sessions: Dict[str, tuple] = {}
    chosen = {}
    for name, entries in candidates.items():
        values = kept.get(name)
        if values is None:
            continue
        errors = {method: 0.0 for method in entries}
        measured = False
        for node in consumers.get(name, []):
            if node.name not in sessions:
                feeds = _node_feeds(model, node, kept)
                sessions[node.name] = (node_session(model, node) if feeds is not None else None, feeds)
            session, feeds = sessions[node.name]
            if session is None:
                continue
            measured = True
            reference = session.run(None, feeds)[0]
            for method, entry in entries.items():
                output = session.run(None, {**feeds, name: fake_quantize(feeds[name], entry, activations)})[0]
                errors[method] += float(np.mean((output - reference) ** 2))
        if not measured:
            errors = {m: float(np.mean((fake_quantize(values, e, activations) - values) ** 2))
                      for m, e in entries.items()}
        chosen[name] = {"method": min(errors, key=errors.get), "errors": errors}
    return chosen


def _weighted_consumers(model: onnx.ModelProto) -> Dict[str, List[onnx.NodeProto]]:
    found: Dict[str, List[onnx.NodeProto]] = {}
    for index, node in enumerate(model.graph.node):
        if node.op_type in WEIGHTED_OPS:
            if not node.name:
                node.name = f"{node.op_type}_{index}"
            for name in node.input[:1] if node.op_type != "MatMul" else node.input[:2]:
                found.setdefault(name, []).append(node)
    return found


def _node_feeds(model: onnx.ModelProto, node: onnx.NodeProto, kept: Dict[str, np.ndarray]) -> Optional[dict]:
    """Float inputs of ``node`` (weights from the initializers), or None when one was not kept.
    Activations on as many kept samples as all of them have (a large tensor keeps fewer:
    statistics.KEPT_VALUES)."""
    initializers = {t.name: t for t in model.graph.initializer}
    activations = [n for n in node.input if n and n not in initializers]
    if any(name not in kept for name in activations):
        return None
    rows = min((len(kept[name]) for name in activations), default=0)
    return {name: numpy_helper.to_array(initializers[name]) if name in initializers else kept[name][:rows]
            for name in node.input if name}
