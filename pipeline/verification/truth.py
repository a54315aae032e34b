"""Float64 truth: the reference model computed in float64 on a few samples, so that a
disagreement between target and reference is blamed on the side that is farther from
the exact result (docs/verify.md, "Which side is wrong").

The float64 copy runs in ONNX Runtime where it has float64 kernels for every op (MatMul,
Sqrt, ReduceSum...), else in ONNX's reference evaluator (NumPy: any op, slower) with
parity's matrix-product Conv, ConvTranspose and MaxPool and a BatchNormalization that keeps
its stored statistics (float64_ops.py). Only a
few samples, within a time budget: this is a check of the reference, not a second verify."""

from __future__ import annotations

import logging
import time
from typing import Dict, List, Optional, Sequence

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from pipeline.verification.metrics import OutputStats

SAMPLES = 4  # validation samples the float64 run sees
BUDGET_S = 6.0  # no further sample once this much time went into the float64 run
# onnx.reference's float64 run (with float64_ops' Conv, ConvTranspose, MaxPool) against the
# reference's float32 one, 2 cores: PP-OCRv4 det 736x736 1.05 s against 68 ms (15x),
# U^2-Net-p 320x320 2.9 s against 227 ms (13x), PP-OCRv4 rec 13x, YOLOv8n 320 7x (onnx.reference's
# own ops: 14.8 and 24.4 s a sample). A sample expected to take longer than BUDGET_S is not started.
EVALUATOR_SLOWDOWN = 30.0
AS_CLOSE = 2.0  # the target is "as close" when its distance to the truth is within 2x the reference's
log = logging.getLogger("parity")


def float64_copy(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model with every float32 tensor, input, output and cast in float64."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    graph = copy.graph
    for index, tensor in enumerate(graph.initializer):
        if tensor.data_type == TensorProto.FLOAT:
            graph.initializer[index].CopyFrom(_as_double(tensor))
    for info in [*graph.input, *graph.output]:
        if info.type.tensor_type.elem_type == TensorProto.FLOAT:
            info.type.tensor_type.elem_type = TensorProto.DOUBLE
    del graph.value_info[:]  # re-inferred by the runtimes
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.name == "to" and attribute.i == TensorProto.FLOAT:
                attribute.i = TensorProto.DOUBLE
            elif attribute.type == onnx.AttributeProto.TENSOR and attribute.t.data_type == TensorProto.FLOAT:
                attribute.t.CopyFrom(_as_double(attribute.t))
    return copy


def _as_double(tensor: TensorProto) -> TensorProto:
    return numpy_helper.from_array(numpy_helper.to_array(tensor).astype(np.float64), tensor.name)


class TooSlow(Exception):
    """The float64 run would take far longer than the check is worth."""


def run_float64(model: onnx.ModelProto, samples: Sequence[dict], float32_s: Optional[float] = None) -> tuple:
    """(outputs per sample as {name: float64 array}, what ran them). Stops early once the
    time budget is spent (one sample at least). ``float32_s``: one sample's float32 run by
    the reference; where only ONNX's NumPy evaluator can run the float64 copy and that
    would take more than the budget for one sample, raises TooSlow instead of starting."""
    double = float64_copy(model)
    run, engine = _runner(double)
    expected = None if float32_s is None else float32_s * EVALUATOR_SLOWDOWN
    if engine.startswith("onnx.reference") and expected is not None and expected > BUDGET_S:
        raise TooSlow(f"ONNX Runtime has no float64 kernel for every op of this model, and ONNX's NumPy evaluator "
                      f"would take about {expected:.0f} s a sample ({EVALUATOR_SLOWDOWN:g}x the reference's "
                      f"{1000 * float32_s:.0f} ms), over the check's {BUDGET_S:g} s")
    found, started = [], time.perf_counter()
    for feeds in samples[:SAMPLES]:
        if found and time.perf_counter() - started > BUDGET_S:
            break
        cast = {name: value.astype(np.float64) if value.dtype == np.float32 else value for name, value in feeds.items()}
        found.append(run(cast))
    return found, engine


def _runner(model: onnx.ModelProto):
    names = [o.name for o in model.graph.output]
    try:
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.log_severity_level = 3
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        return (lambda feeds: dict(zip(names, session.run(names, feeds)))), "onnxruntime float64"
    except Exception as err:  # noqa: BLE001 - ORT lacks float64 kernels for many ops (Conv...)
        log.debug("float64 copy in ONNX Runtime: %s; using onnx.reference", err)
    from onnx.reference import ReferenceEvaluator

    from pipeline.verification.float64_ops import NEW_OPS

    evaluator = ReferenceEvaluator(model, new_ops=NEW_OPS)
    return (lambda feeds: dict(zip(names, evaluator.run(names, feeds)))), "onnx.reference float64"


def compare(truth: List[dict], reference: List[dict], target: List[dict], names: Sequence[str],
            engine: str) -> Dict[str, dict]:
    """Per output: cosine of reference and of target to the float64 truth, and which is closer."""
    found = {}
    for name in names:
        ours, theirs = OutputStats(), OutputStats()
        for exact, expected, actual in zip(truth, reference, target):
            if name in exact and name in expected and name in actual:
                ours.update(exact[name], expected[name])
                theirs.update(exact[name], actual[name])
        if ours.elements:
            found[name] = judge(ours.result()["cosine"], theirs.result()["cosine"], len(truth), engine)
    return found


def judge(reference_cosine: float, target_cosine: float, samples: int, engine: str) -> dict:
    reference_error, target_error = 1.0 - reference_cosine, 1.0 - target_cosine
    as_close = bool(reference_error > 1e-6 and target_error <= AS_CLOSE * reference_error)
    if reference_error <= 1e-6:
        verdict = (f"the fp32 reference matches a float64 run ({reference_cosine:.6f} on {samples} samples): "
                   "the difference is the target's")
    elif as_close and target_error < reference_error:
        verdict = (f"the target is closer to the float64 truth ({target_cosine:.4f}) than the fp32 reference "
                   f"({reference_cosine:.4f}): the reference is the imprecise side")
    elif as_close:
        verdict = (f"the target is as close to the float64 truth ({target_cosine:.4f}) as the fp32 reference "
                   f"({reference_cosine:.4f}): both are float32 rounding away from it")
    else:
        verdict = (f"the target is farther from the float64 truth ({target_cosine:.6f}) than the fp32 reference "
                   f"({reference_cosine:.6f})")
    return {"reference_cosine": reference_cosine, "target_cosine": target_cosine, "target_as_close": as_close,
            "samples": samples, "engine": engine, "verdict": verdict}


def reference_warning(name: str, result: dict, min_cosine: Optional[float]) -> Optional[str]:
    """A PASS whose reference is itself far from the truth: the gate compared two imprecise results."""
    if min_cosine is None or result["reference_cosine"] >= min_cosine:
        return None
    return (f"output {name}: the fp32 reference itself is only {result['reference_cosine']:.4f} cosine from a "
            f"float64 run ({result['samples']} samples, {result['engine']}), below min_cosine {min_cosine}: "
            "a pass here compares two imprecise results")
