"""Bias correction: restore each quantized op's per-output-channel mean.

Quantizing an op's weights and input shifts the mean of its output channels (rounding
errors do not cancel when a channel's weights round the same way more often than not).
For every quantized Conv/ConvTranspose/Gemm/MatMul of the built QDQ model, the op runs
twice on its fp32 input activations from the calibration samples: as in the fp32 model,
and with the built model's own Q/DQ nodes on its input and weight (the exact scales,
zero points, rounding and 7-bit weights the build applies). The per-channel mean of the
difference is added to the op's bias (an int32 bias with its DequantizeLinear is created
where a Conv/Gemm has none; a MatMul's bias is the constant of the Add that follows it).

NNCF's fast bias correction does the same from a blob filled with each input channel's
mean, and only for ops that already have a bias; here the real activations are used
(the quantizer's rounding is not linear, so the mean input does not give the mean error)
and ops without a bias get one.

Each op is corrected on fp32 inputs, not on the quantized network's own (errors that
earlier layers pass on are not compensated), and on some models the corrections add up
to a worse output: PP-OCRv4 det. So the corrected model is kept only when its outputs
are closer to fp32 (cosine, ONNX Runtime) on the same samples than the uncorrected
model's. docs/calibration.md gives the measured effect."""

from __future__ import annotations

from pathlib import Path

import hashlib
import time
from typing import Dict, Iterable, List, Optional

import numpy as np
import onnx
from onnx import helper, numpy_helper

from pipeline.precision.calibration.input_means import PatchMeans, dequantized_weight
from pipeline.precision.calibration.single_node import session
from pipeline import shapes
from pipeline.precision.calibration.statistics import ACTIVATION_BUDGET, BatchRunner, model_outputs
from pipeline.data import pack

CORRECTED_OPS = ("Conv", "ConvTranspose", "Gemm", "MatMul")
MAX_SAMPLES = 32  # calibration samples used (16 gave noisy shifts that hurt PP-OCRv4 rec)
BATCH = 4  # samples per run of the fp32 model (its activations for all ops are held at once)
# ... fewer on a large model: as many as hold REFINE_VALUES values of the ops' fp32 inputs, at
# least MIN_SAMPLES (the real-size segmenter's 119 convolutions read 60 M values a sample: 8 of
# its 16; weight rounding and bias correction 45 -> 27 s, the map IoU as before: docs/time.md)
REFINE_VALUES = 512 << 20
MIN_SAMPLES = 8


class _Op:
    """One quantized op: its node in the QDQ model, the Q/DQ nodes on its activation input
    and weight, the fp32 weight, and where its bias lives."""

    def __init__(self, node, source: str, quantizers: List[onnx.NodeProto], weight_dq, float_weight, index: int):
        self.node, self.source, self.quantizers = node, source, quantizers
        self.weight_dq, self.float_weight, self.activation_index = weight_dq, float_weight, index
        self.channel_axis = -1 if node.op_type == "MatMul" else 1
        self.sum: Optional[np.ndarray] = None
        self.count = 0
        self.session = None
        self.means: Optional[PatchMeans] = None  # where the mean error is read off the input's means

    def accumulate(self, activation: np.ndarray) -> None:
        if self.means is not None:
            self.means.add(activation)
            return
        difference = self.session.run(None, {"x": activation})[0].astype(np.float64)
        axis = self.channel_axis % difference.ndim
        reduce = tuple(a for a in range(difference.ndim) if a != axis)
        part = difference.sum(axis=reduce)
        self.sum = part if self.sum is None else self.sum + part
        self.count += difference.size // difference.shape[axis]

    @property
    def shift(self) -> np.ndarray:
        return self.sum / max(self.count, 1)


MAX_JUDGED = 256  # judged_on samples compared with and without the correction


def correct_file(quantized_path: Path, prepared_path: Path, samples: Iterable[Dict[str, np.ndarray]],
                 judged_on: Optional["Judged"] = None, fp32_pass: Optional["Fp32Pass"] = None) -> dict:
    """``correct`` on a QDQ model file, rewritten in place: how every int8 model parity
    builds from a table (the build, verify's INT8 baseline, tried advice) gets its biases."""
    model = onnx.load(str(quantized_path))
    summary = correct(model, onnx.load(str(prepared_path)), samples, judged_on=judged_on, fp32_pass=fp32_pass)
    onnx.save(model, str(quantized_path))
    return summary


class Fp32Pass:
    """The fp32 pass over the calibration samples that weight rounding makes, kept for the
    bias correction after it: every quantized op's input patch means (input_means.py), the
    fp32 outputs and the batches. Bias correction of the rounded model then runs no pass of
    its own (the real-size segmenter: 8 fp32 runs with 119 activations out, 2.9 s). Filled
    only where every op's mean error is read off its means, and only by a weight rounding
    that ran (not one served from the cache)."""

    def __init__(self):
        self.means: Optional[Dict[str, PatchMeans]] = None
        self.reference: List[Dict[str, np.ndarray]] = []
        self.batches: List[List[Dict[str, np.ndarray]]] = []

    def serves(self, ops: List[_Op]) -> bool:
        return self.means is not None and {op.node.name for op in ops} == set(self.means)


def correct(quantized: onnx.ModelProto, prepared: onnx.ModelProto, samples: Iterable[Dict[str, np.ndarray]],
            max_samples: int = MAX_SAMPLES, judged_on: Optional["Judged"] = None,
            fp32_pass: Optional[Fp32Pass] = None) -> dict:
    """Correct the biases of ``quantized`` (built from ``prepared``) in place, when that
    brings the model's outputs closer to fp32 on the samples, or on ``judged_on`` (validation
    samples with their fp32 outputs, shared by the build's refinements) when given
    (it does not on every model: docs/calibration.md). Returns the summary the build
    records: per corrected op the largest |shift|, the ops skipped, and the output cosine
    with and without. ``fp32_pass``: weight rounding's, read instead of a pass of its own."""
    started = time.perf_counter()
    ops, skipped = quantized_ops(quantized, prepared)
    served = fp32_pass is not None and fp32_pass.serves(ops)
    batches = fp32_pass.batches if served else \
        sample_batches(samples, max_samples, batch_size_for(prepared, [op.source for op in ops]))
    if not ops or not batches:
        return {"enabled": True, "applied": False, "samples": len(batches), "corrected": {}, "skipped": skipped,
                "reason": "no calibration samples" if ops else "no quantized op with a constant weight"}
    if served:
        for op in ops:
            op.means = fp32_pass.means[op.node.name]
        _read_off(ops, {t.name: t for t in quantized.graph.initializer})
        reference = fp32_pass.reference
    else:
        reference, batches = measure(ops, quantized, prepared, batches)
    candidate = onnx.ModelProto()
    candidate.CopyFrom(quantized)
    corrected = {}
    for op in ops:
        reason = "no finite measurement" if op.count == 0 or not np.isfinite(op.shift).all() \
            else apply_shift(candidate, op.node, op.shift)
        if reason:
            skipped[op.node.name] = reason
        else:
            corrected[op.node.name] = round(float(np.abs(op.shift).max()), 6)
    if judged_on is not None:
        without, with_, count = judged_on.cosine(quantized), judged_on.cosine(candidate), judged_on.count
    else:
        without, with_ = (output_cosine(model, batches, reference) for model in (quantized, candidate))
        count = sum(len(b) for b in batches)
    applied = bool(corrected) and with_ >= without
    if applied:
        quantized.CopyFrom(candidate)
    return {"enabled": True, "applied": applied, "samples": count,
            "output_cosine": {"without": round(without, 6), "with": round(with_, 6)},
            "corrected": corrected if applied else {}, "measured": corrected, "skipped": skipped,
            "seconds": round(time.perf_counter() - started, 3)}


class Judged:
    """Samples a refinement is judged on, with the fp32 outputs computed once and each
    model's output cosine remembered by its bytes: the build's refinements share it (the
    second's model without it is the first's result), so the samples run through the fp32
    model once and through each distinct model once."""

    def __init__(self, prepared: onnx.ModelProto, samples: Iterable[Dict[str, np.ndarray]], size: int):
        self.batches = sample_batches(samples, MAX_JUDGED, size)
        self.reference = reference_outputs(prepared, self.batches) if self.batches else []
        self._cosines: Dict[str, float] = {}

    @property
    def count(self) -> int:
        return sum(len(batch) for batch in self.batches)

    def cosine(self, model: onnx.ModelProto) -> float:
        key = hashlib.sha256(model.SerializeToString()).hexdigest()
        if key not in self._cosines:
            self._cosines[key] = output_cosine(model, self.batches, self.reference)
        return self._cosines[key]


def sample_batches(samples: Iterable[Dict[str, np.ndarray]], max_samples: int, size: int) -> List[List[Dict[str, np.ndarray]]]:
    """Up to ``max_samples`` samples in batches of at most ``size`` of one shape each."""
    return list(shapes.uniform_groups([feeds for _, feeds in zip(range(max_samples), samples)], size))


def batch_size_for(prepared: onnx.ModelProto, sources: List[str]) -> int:
    """Up to BATCH samples per run, fewer where the activations the ops read (inferred
    shapes, float32) would pass ACTIVATION_BUDGET: a large detector input."""
    dims = {v.name: v.type.tensor_type.shape.dim for v in
            list(prepared.graph.input) + list(prepared.graph.value_info) + list(prepared.graph.output)}
    per_sample = sum(4 * int(np.prod([max(d.dim_value, 1) for d in dims.get(name, [])])) for name in set(sources))
    return int(max(1, min(BATCH, ACTIVATION_BUDGET // max(per_sample, 1))))


def sized_runs(runner: BatchRunner, batches: List[List[Dict[str, np.ndarray]]], sources: List[str]):
    """(batch, the runner's fp32 values) for the batches in turn, stopping once the samples
    run hold REFINE_VALUES values of ``sources`` (MIN_SAMPLES at least): a refinement's
    work sized to the model, read off the first batch's activations."""
    taken, limit = 0, None
    for batch in batches:
        if limit is not None and taken >= limit:
            return
        values = runner.run(pack(batch), len(batch))
        if limit is None:
            per_sample = sum(values[name].size for name in set(sources) if name in values) / len(batch)
            limit = max(MIN_SAMPLES, int(REFINE_VALUES // max(per_sample, 1)))
        taken += len(batch)
        yield batch, values


def measure(ops: List[_Op], quantized: onnx.ModelProto, prepared: onnx.ModelProto,
            batches: List[List[Dict[str, np.ndarray]]]) -> tuple:
    """Accumulate every op's per-channel mean output error (fp32 - quantized) over the
    samples' fp32 activations (sized_runs); returns the fp32 model's outputs per batch and
    the batches measured."""
    outputs = [o.name for o in prepared.graph.output]
    runner = BatchRunner(prepared, list(dict.fromkeys([*(op.source for op in ops), *outputs])), len(batches[0]))
    constants = {t.name: t for t in quantized.graph.initializer}
    for op in ops:  # the op's mean error read off its input's means, else the op run twice
        op.means = PatchMeans.of(op, constants)
        op.session = None if op.means is not None else session(_difference_model(op, quantized, constants))
    reference, measured = [], []
    for batch, values in sized_runs(runner, batches, [op.source for op in ops]):
        for op in ops:
            op.accumulate(values[op.source])
        reference.append({name: values[name] for name in outputs})
        measured.append(batch)
    for op in ops:
        op.session = None
    _read_off(ops, constants)
    return reference, measured


def _read_off(ops: List[_Op], constants: Dict[str, onnx.TensorProto]) -> None:
    """The shifts of the ops measured by their input's patch means, from the weights in ``constants``."""
    for op in ops:
        if op.means is not None and op.means.positions:
            shift = op.means.shift(numpy_helper.to_array(op.float_weight), dequantized_weight(op.weight_dq, constants))
            op.sum, op.count = shift * op.means.positions, op.means.positions


def reference_outputs(prepared: onnx.ModelProto, batches) -> List[Dict[str, np.ndarray]]:
    """The fp32 model's outputs per batch."""
    return model_outputs(prepared, [o.name for o in prepared.graph.output], batches)


def output_cosine(model: onnx.ModelProto, batches, reference: List[Dict[str, np.ndarray]]) -> float:
    """Cosine of the model's float outputs to the fp32 outputs over all samples (ONNX
    Runtime), averaged over the outputs as verify does, times the share of integer output
    values that stayed exact (verify compares those exactly: a changed class id must cost
    more than any cosine gain, and ids passed through unchanged cost nothing; in one
    cosine with the float outputs, a sentence embedder's token ids made every candidate 1.0)."""
    key = _fingerprint([model.SerializeToString(), *(v.tobytes() for values in reference for v in values.values())])
    if key not in _COSINES:
        if len(_COSINES) >= 8:
            _COSINES.clear()
        _COSINES[key] = _output_cosine(model, batches, reference)
    return _COSINES[key]


# output_cosine's results by model and reference outputs: weight rounding's rounded model is
# the model bias correction starts from, judged on the same samples (3.3 s a judgement on the
# real-size segmenter)
_COSINES: Dict[str, float] = {}


def _fingerprint(parts) -> str:
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part)
    return digest.hexdigest()


def _output_cosine(model: onnx.ModelProto, batches, reference: List[Dict[str, np.ndarray]]) -> float:
    names = list(reference[0]) if reference else []
    built = model_outputs(model, names, batches)
    cosines, exact = [], 1.0
    for name in names:
        a = np.concatenate([values[name].ravel() for values in built])
        b = np.concatenate([values[name].ravel() for values in reference])
        if b.dtype.kind != "f":
            exact *= float(np.mean(a == b)) if b.size else 1.0
            continue
        a, b = a.astype(np.float64), b.astype(np.float64)
        norm = np.linalg.norm(a) * np.linalg.norm(b)
        cosines.append(float(a @ b / norm) if norm > 0 else 0.0)
    return (float(np.mean(cosines)) if cosines else 1.0) * exact


def quantized_ops(quantized: onnx.ModelProto, prepared: onnx.ModelProto):
    """The ops of CORRECTED_OPS whose weight is dequantized from an initializer, in
    topological order, and {op: why not} for the others of those types."""
    graph = quantized.graph
    producer = {out: node for node in graph.node for out in node.output}
    initializers = {t.name for t in graph.initializer}
    float_nodes = {node.name: node for node in prepared.graph.node}
    float_weights = {t.name: t for t in prepared.graph.initializer}
    ops, skipped = [], {}
    for node in graph.node:
        if node.op_type not in CORRECTED_OPS:
            continue
        weight_index = _weight_index(node, producer, initializers)
        original = float_nodes.get(node.name)
        if weight_index is None or original is None or original.input[weight_index] not in float_weights:
            skipped[node.name] = "no quantized constant weight (kept in float, or two activation inputs)"
            continue
        index = 1 - weight_index if node.op_type == "MatMul" else 0
        source, quantizers = _activation_path(node.input[index], producer)
        ops.append(_Op(node, source, quantizers, producer[node.input[weight_index]],
                       float_weights[original.input[weight_index]], index))
    return ops, skipped


def _weight_index(node, producer, initializers) -> Optional[int]:
    candidates = (0, 1) if node.op_type == "MatMul" else (1,)
    for index in candidates:
        dq = producer.get(node.input[index]) if index < len(node.input) else None
        if dq is not None and dq.op_type == "DequantizeLinear" and dq.input[0] in initializers:
            return index
    return None


def _activation_path(name: str, producer):
    """The fp32 tensor an op's activation input is quantized from, and the Q, DQ nodes."""
    dq = producer.get(name)
    q = producer.get(dq.input[0]) if dq is not None and dq.op_type == "DequantizeLinear" else None
    if q is None or q.op_type != "QuantizeLinear":
        return name, []
    return q.input[0], [q, dq]


def _difference_model(op: _Op, quantized: onnx.ModelProto, constants: Dict[str, onnx.TensorProto]) -> onnx.ModelProto:
    """x -> op(x, fp32 weight) - op(DQ(Q(x)), DQ(int8 weight)), both without bias, with
    copies of the built model's own Q/DQ nodes and constants."""
    nodes = []
    for original in op.quantizers + [op.weight_dq]:
        copy = onnx.NodeProto()
        copy.CopyFrom(original)
        copy.name = ""
        nodes.append(copy)
    activation = "x"
    if op.quantizers:
        nodes[0].input[0] = "x"
        activation = nodes[1].output[0]
    pair = [activation, op.weight_dq.output[0]] if op.activation_index == 0 else [op.weight_dq.output[0], activation]
    attributes = {a.name: helper.get_attribute_value(a) for a in op.node.attribute}
    nodes.append(helper.make_node(op.node.op_type, pair, ["y_quantized"], **attributes))
    fp32 = ["x", "w_float"] if op.activation_index == 0 else ["w_float", "x"]
    nodes.append(helper.make_node(op.node.op_type, fp32, ["y_float"], **attributes))
    nodes.append(helper.make_node("Sub", ["y_float", "y_quantized"], ["difference"]))
    weight = numpy_helper.from_array(numpy_helper.to_array(op.float_weight), "w_float")
    read = {name for node in nodes for name in node.input}
    inits = [weight] + [constants[name] for name in read if name in constants]
    graph = helper.make_graph(nodes, "bias_correction", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, None)],
                              [helper.make_tensor_value_info("difference", onnx.TensorProto.FLOAT, None)], inits)
    # per-channel DequantizeLinear (axis) needs opset 13
    opsets = [helper.make_opsetid(o.domain, max(o.version, 13) if o.domain in ("", "ai.onnx") else o.version)
              for o in quantized.opset_import]
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = quantized.ir_version
    return model


def apply_shift(model: onnx.ModelProto, node: onnx.NodeProto, shift: np.ndarray) -> Optional[str]:
    """Add ``shift`` (per output channel) to the bias of the op named as ``node`` in
    ``model``; the reason when it cannot."""
    node = next(n for n in model.graph.node if n.name == node.name)
    if node.op_type == "MatMul":
        return _shift_following_add(model, node, shift)
    beta = next((helper.get_attribute_value(a) for a in node.attribute if a.name == "beta"), 1.0)
    if node.op_type == "Gemm" and beta == 0:
        return "Gemm with beta=0 ignores its bias"
    shift = shift / beta
    if len(node.input) > 2 and node.input[2]:
        return _shift_quantized_bias(model, node, shift)
    return _add_bias(model, node, shift)


def _shift_quantized_bias(model, node, shift: np.ndarray) -> Optional[str]:
    """bias = DQ(int32, scale per channel): add round(shift / scale) to the int32 values."""
    producer = {out: n for n in model.graph.node for out in n.output}
    inits = {t.name: t for t in model.graph.initializer}
    dq = producer.get(node.input[2])
    if sum(name in (node.input[2], getattr(dq, "input", [""])[0]) for n in model.graph.node for name in n.input) > 2:
        return "the bias is shared with other ops"
    if dq is None or dq.op_type != "DequantizeLinear" or dq.input[0] not in inits:
        float_bias = inits.get(node.input[2])
        if float_bias is None or numpy_helper.to_array(float_bias).size != shift.size:
            return "bias is neither an int32 DequantizeLinear nor a float constant per channel"
        _replace(model, float_bias, numpy_helper.to_array(float_bias) + shift.reshape(float_bias.dims).astype(np.float32))
        return None
    values = numpy_helper.to_array(inits[dq.input[0]])
    scale = numpy_helper.to_array(inits[dq.input[1]]).astype(np.float64)
    if values.size != shift.size:
        return f"bias has {values.size} values for {shift.size} channels"
    steps = np.round(shift / np.where(scale > 0, scale, 1.0))
    updated = np.clip(values.astype(np.int64) + steps.astype(np.int64), -2**31, 2**31 - 1).astype(values.dtype)
    _replace(model, inits[dq.input[0]], updated)
    return None


def _add_bias(model, node, shift: np.ndarray) -> Optional[str]:
    """A Conv/Gemm without bias gets one, quantized as ONNX Runtime quantizes biases:
    int32 with scale = input scale x weight scale, DequantizeLinear axis 0."""
    producer = {out: n for n in model.graph.node for out in n.output}
    inits = {t.name: t for t in model.graph.initializer}
    activation_dq, weight_dq = producer.get(node.input[0]), producer.get(node.input[1])
    if activation_dq is None or activation_dq.op_type != "DequantizeLinear":
        return "no bias, and the input is not quantized (no scale for an int32 bias)"
    input_scale = float(numpy_helper.to_array(inits[activation_dq.input[1]]))
    weight_scale = numpy_helper.to_array(inits[weight_dq.input[1]]).astype(np.float64).ravel()
    scale = np.broadcast_to(input_scale * weight_scale, shift.shape).astype(np.float32)
    values = np.round(shift / np.where(scale > 0, scale, 1.0)).clip(-2**31, 2**31 - 1).astype(np.int32)
    base = f"{node.name}_bias_correction"
    model.graph.initializer.extend([numpy_helper.from_array(values, base + "_quantized"),
                                    numpy_helper.from_array(scale, base + "_scale"),
                                    numpy_helper.from_array(np.zeros_like(values), base + "_zero_point")])
    dq = helper.make_node("DequantizeLinear", [base + "_quantized", base + "_scale", base + "_zero_point"],
                          [base + "_dequantized"], name=base + "_DequantizeLinear", axis=0)
    model.graph.node.insert(list(model.graph.node).index(node), dq)
    while len(node.input) < 2:
        node.input.append("")
    if len(node.input) == 2:
        node.input.append(dq.output[0])
    else:
        node.input[2] = dq.output[0]
    return None


def _shift_following_add(model, node, shift: np.ndarray) -> Optional[str]:
    """A MatMul's bias: the float constant of the Add reading its output, directly or
    through the output's Q/DQ pair."""
    readers: Dict[str, List[onnx.NodeProto]] = {}
    for reader in model.graph.node:
        for name in reader.input:
            readers.setdefault(name, []).append(reader)
    inits = {t.name: t for t in model.graph.initializer}
    outputs = [node.output[0]]
    following = readers.get(node.output[0], [])
    if len(following) == 1 and following[0].op_type == "QuantizeLinear":
        dqs = readers.get(following[0].output[0], [])
        outputs = [dq.output[0] for dq in dqs]
        following = [r for dq in dqs for r in readers.get(dq.output[0], [])]
    if len(following) != 1 or following[0].op_type != "Add":
        return "MatMul without a following Add: no bias to correct"
    add = following[0]
    constant = next((inits[name] for name in add.input if name in inits and name not in outputs), None)
    if constant is None or numpy_helper.to_array(constant).size != shift.size \
            or constant.data_type != onnx.TensorProto.FLOAT:
        return "the Add after the MatMul has no float bias per channel"
    if len(readers.get(constant.name, [])) > 1:
        return "the Add's bias is shared with other ops"
    _replace(model, constant, numpy_helper.to_array(constant) + shift.reshape(constant.dims).astype(np.float32))
    return None


def _replace(model, tensor: onnx.TensorProto, values: np.ndarray) -> None:
    tensor.CopyFrom(numpy_helper.from_array(values.astype(numpy_helper.to_array(tensor).dtype), tensor.name))
