"""Dynamic int8 (``precision.activation_ranges=dynamic``, backends declaring ``dynamic_int8``):
int8 weights in the model, activations quantized at run time over each call's own range.

Built with ONNX Runtime's own dynamic quantizer (``onnxruntime.quantization.quantize_dynamic``)
on the prepared graph (prepare.prepare: BatchNorm folded, float16 widened): each quantized
MatMul (a Gemm is rewritten as MatMul + Add first) and Conv becomes DynamicQuantizeLinear
(uint8 activations, asymmetric, per tensor, range of this call) -> MatMulInteger / ConvInteger
(int8 symmetric weights) -> Cast -> Mul by the two scales, which ONNX Runtime's optimizer
fuses into DynamicQuantizeMatMul / MatMulIntegerToFloat. Only MatMuls with a constant B are
quantized (MatMulConstBOnly): attention's two activation-by-activation MatMuls stay float.

One thing is parity's own: ``quantize_dynamic`` gives ConvInteger per-tensor weights whatever
``per_channel`` says; with ``precision.per_channel`` each Conv weight is re-quantized per
output channel here (zero point 0, so ConvInteger's scalar zero point still holds; the scale
Mul after it becomes a per-channel vector). No calibration, no table: bias correction and
weight rounding measure static ranges and do not apply (docs/targets.md, "ONNX Runtime").

Where ``precision.reduce_range`` null chose 7-bit weights (an x86 CPU without VNNI), that is a
guess from static builds: the model is built with 7-bit and with 8-bit weights, both run on
the calibration samples, and the one whose outputs are closer to fp32 is kept (7-bit on a tie).
The intent classifier of docs/benchmarks.md kept every top-1 decision with 8 bits and flipped
two of 300 with 7. Under precision.budget_s (precision=auto's candidates) the widths are not
measured where the 7-bit build runs slower than fp32 on a calibration sample: auto screens such
a build out whatever its width, and on the real-size segmenter (AVX2, 0.23x fp32) the two
widths' runs took 80 of the candidate's 108 s (docs/time.md).
"""

from __future__ import annotations

import itertools
import logging
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Tuple

import numpy as np

from pipeline import deadline
from pipeline.errors import first_line
from pipeline.precision.calibration import bias_correction
from pipeline.precision.prepare import prepare
from pipeline.precision.quantize import WEIGHTED_OPS, QuantizerFailed, needs_reduce_range

# parity's quantize_ops -> the op type ONNX Runtime's dynamic quantizer quantizes them as;
# ConvTranspose has no integer kernel there
DYNAMIC_OPS = {"MatMul": "MatMul", "Gemm": "MatMul", "Conv": "Conv"}
INTEGER_OPS = ("MatMulInteger", "ConvInteger")
BUILDER = "onnxruntime.quantization.quantize_dynamic (MatMulConstBOnly)"
NOT_APPLICABLE = "not applicable: a static refinement (calibration ranges); dynamic activation ranges have none"


@dataclass(frozen=True)
class DynamicSettings:
    """How the dynamic model is quantized: weight granularity, 7-bit weights (and whether that
    was decided for this machine), which op types."""

    per_channel: bool = True
    reduce_range: bool = False
    reduce_range_automatic: bool = True
    quantize_ops: Tuple[str, ...] = WEIGHTED_OPS

    @classmethod
    def resolve(cls, precision, backend: str) -> "DynamicSettings":
        """From a PrecisionConfig; reduce_range null is decided as for static builds
        (quantize.needs_reduce_range: x86 without VNNI, where u8 x s8 kernels saturate)."""
        automatic = precision.reduce_range is None
        reduce_range = needs_reduce_range(backend) if automatic else bool(precision.reduce_range)
        return cls(precision.per_channel, reduce_range, automatic, tuple(precision.quantize_ops))

    @property
    def width_measured(self) -> bool:
        """The automatic rule chose 7-bit weights: both widths are built and measured."""
        return self.reduce_range and self.reduce_range_automatic

    def describe(self) -> dict:
        why = ("automatic: " + ("an x86 CPU without VNNI, whose u8 x s8 kernels saturate" if self.reduce_range
                                else "no u8 x s8 saturation here") if self.reduce_range_automatic
               else "precision.reduce_range")
        return {"activation_ranges": "dynamic", "builder": BUILDER,
                "weights": "int8 symmetric, " + ("per channel" if self.per_channel else "per tensor"),
                "activations": "uint8 asymmetric, per tensor, range computed per call (DynamicQuantizeLinear)",
                "reduce_range": self.reduce_range, "reduce_range_rule": why,
                "quantized_ops": [op for op in self.quantize_ops if op in DYNAMIC_OPS],
                "bias_correction": {"enabled": False, "reason": NOT_APPLICABLE},
                "weight_rounding": {"enabled": False, "reason": NOT_APPLICABLE}}


def build(model_path: Path, out_path: Path, settings: DynamicSettings, keep_float: Iterable[str] = (),
          samples: Optional[Iterable[Dict[str, np.ndarray]]] = None) -> dict:
    """The dynamic int8 model of ``model_path`` (convert's) at ``out_path``; ops named in
    ``keep_float`` stay float. With ``samples`` (the calibration feeds) and a width the
    automatic rule chose, both widths are measured and the closer one kept. Returns the build
    summary's quantization entry: what it did, the ops quantized and those left float with the
    reason. ONNX Runtime's tools raising on the model is a QuantizerFailed (one line, exit 2)."""
    import onnx

    keep_float = list(keep_float)
    widths = None
    with tempfile.TemporaryDirectory(prefix="parity-dynamic-") as scratch:
        prepared_path = Path(scratch) / "prepared.onnx"
        try:
            prepare(model_path, prepared_path)
            prepared = onnx.load(str(prepared_path))
            asked = _asked(prepared, settings, keep_float)
            if not asked["op_types"]:  # nothing of quantize_ops has an integer kernel: [] would mean "every type"
                onnx.save(prepared, str(out_path))
                per_channel = []
            elif settings.width_measured and samples is not None:
                settings, per_channel, widths = _measured_width(prepared, prepared_path, out_path, settings, asked,
                                                                samples)
            else:
                per_channel = _one_width(prepared, prepared_path, out_path, settings, asked)
        except Exception as err:  # noqa: BLE001 - ORT's pre-processing and quantizer raise bare errors
            raise QuantizerFailed(f"precision.activation_ranges=dynamic: ONNX Runtime's dynamic quantizer failed: "
                                  f"{first_line(err)}; build it with activation_ranges=static") from err
    model = onnx.load(str(out_path))
    quantized, left = _outcome(model, prepared, settings, keep_float)
    present = {node.name for node in prepared.graph.node}
    measured = {"weight_widths": widths, "reduce_range_rule": _width_rule(widths)} if widths else {}
    return {**settings.describe(), **measured, "conv_per_channel": per_channel,
            "int8_ops": sum(node.op_type in INTEGER_OPS for node in model.graph.node),
            "quantized": quantized, "not_quantized": left,
            "dynamic_quantizers": sum(node.op_type == "DynamicQuantizeLinear" for node in model.graph.node),
            "keep_float_not_found": [name for name in keep_float if name not in present]}


def _one_width(prepared, prepared_path: Path, out_path: Path, settings: DynamicSettings, asked: dict) -> List[str]:
    """quantize_dynamic at the settings' width, Conv weights then made per channel; the Conv
    ops changed so."""
    import onnx

    _quantize(prepared_path, out_path, settings, asked)
    if not settings.per_channel:
        return []
    model = onnx.load(str(out_path))
    per_channel = _per_channel_conv(model, prepared, settings.reduce_range)
    if per_channel:
        onnx.save(model, str(out_path))
    return per_channel


def _measured_width(prepared, prepared_path: Path, out_path: Path, settings: DynamicSettings, asked: dict,
                    samples) -> Tuple[DynamicSettings, List[str], Optional[dict]]:
    """Both weight widths built and run on the samples; the one whose outputs are closer to
    fp32 (bias_correction's output cosine) is left at ``out_path``, 7-bit on a tie."""
    import onnx

    eight = replace(settings, reduce_range=False)
    wide = out_path.with_name(out_path.stem + "-8bit.onnx")
    seven = _one_width(prepared, prepared_path, out_path, settings, asked)
    samples = iter(samples)
    first = next(samples, None)
    if first is None:
        return settings, seven, None
    samples = itertools.chain([first], samples)
    speed = _speed_vs_float(prepared_path, out_path, first) if deadline.current() is not None else None
    if speed is not None and speed < 1.0:  # screened out by auto whatever its width: not paid for
        return settings, seven, {"measured_on": "one calibration sample's speed", "kept": 7, "speed_vs_fp32": speed}
    per_channel = {True: seven, False: _one_width(prepared, prepared_path, wide, eight, asked)}
    judged = bias_correction.Judged(prepared, samples,
                                    bias_correction.batch_size_for(prepared, [o.name for o in prepared.graph.output]))
    if not judged.count:
        wide.unlink()
        return settings, per_channel[True], None
    cosines = {bits: judged.cosine(onnx.load(str(path))) for bits, path in ((7, out_path), (8, wide))}
    chosen = eight if cosines[8] > cosines[7] else settings
    wide.replace(out_path) if chosen is eight else wide.unlink()
    return chosen, per_channel[chosen.reduce_range], {
        "measured_on": f"{judged.count} calibration samples", "kept": 7 if chosen.reduce_range else 8,
        "output_cosine": {"7-bit": round(cosines[7], 6), "8-bit": round(cosines[8], 6)}}


def _speed_vs_float(prepared_path: Path, built_path: Path, feeds: Dict[str, np.ndarray]) -> float:
    """The built model's speed-up over the prepared fp32 model on one sample (the faster of
    two runs each, after a warm-up): a rough screen, not a timing."""
    import onnxruntime as ort

    from pipeline.backends.onnxruntime import fastest_run, untimed_options

    def best(path: Path) -> float:
        return fastest_run(ort.InferenceSession(str(path), untimed_options(), providers=["CPUExecutionProvider"]),
                           feeds, 2)

    return round(best(prepared_path) / max(best(built_path), 1e-9), 3)


def _width_rule(widths: dict) -> str:
    if "speed_vs_fp32" in widths:
        return (f"7-bit weights (the automatic rule: an x86 CPU without VNNI), not measured against 8-bit: the "
                f"build ran {widths['speed_vs_fp32']:.2f}x fp32 on one calibration sample, slower than fp32 "
                "whatever its width, and precision.budget_s is set")
    kept, other = (f"{widths['kept']}-bit", "8-bit" if widths["kept"] == 7 else "7-bit")
    cosines = widths["output_cosine"]
    return (f"measured on {widths['measured_on']}: {kept} weights kept, output cosine {cosines[kept]} against "
            f"{cosines[other]} with {other} (the automatic rule's 7 bits: an x86 CPU without VNNI)")


def _asked(prepared, settings: DynamicSettings, keep_float: List[str]) -> dict:
    """quantize_dynamic's op types and the node names it must leave float: precision.keep_float
    and the ops of types outside precision.quantize_ops (a Gemm is a MatMul to it, named
    <gemm>_MatMul)."""
    op_types = sorted({DYNAMIC_OPS[op] for op in settings.quantize_ops if op in DYNAMIC_OPS})
    excluded = [node.name for node in prepared.graph.node
                if node.name in keep_float or (node.op_type in DYNAMIC_OPS and node.op_type not in settings.quantize_ops)]
    return {"op_types": op_types, "excluded": excluded + [f"{name}_MatMul" for name in excluded]}


def _quantize(prepared_path: Path, out_path: Path, settings: DynamicSettings, asked: dict) -> None:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)  # ORT logs advice and every op it skips on the root logger
    try:
        quantize_dynamic(str(prepared_path), str(out_path), op_types_to_quantize=asked["op_types"],
                         per_channel=settings.per_channel, reduce_range=settings.reduce_range,
                         weight_type=QuantType.QInt8, nodes_to_exclude=asked["excluded"],
                         extra_options={"MatMulConstBOnly": True, "WeightSymmetric": True})
    finally:
        root.setLevel(level)


def _per_channel_conv(model, prepared, reduce_range: bool) -> List[str]:
    """Each ConvInteger's weight re-quantized per output channel with ONNX Runtime's own
    quantize_data (symmetric int8, zero point 0), its scale initializer made a [C_out, 1, ...]
    vector; in place. Returns the Conv ops changed."""
    from onnx import TensorProto, numpy_helper
    from onnxruntime.quantization.quant_utils import quantize_data

    weights = {init.name: init for init in model.graph.initializer}
    floats = {init.name: init for init in prepared.graph.initializer}
    originals = {node.name: node for node in prepared.graph.node if node.op_type == "Conv"}
    scale_of = {node.name: node.input[1] for node in model.graph.node if node.op_type == "Mul"}
    changed = []
    for node in model.graph.node:
        conv = originals.get(node.name[: -len("_quant")]) if node.op_type == "ConvInteger" else None
        scale = scale_of.get(f"{node.name}_scales_mul")
        if conv is None or scale not in weights or conv.input[1] not in floats or node.input[1] not in weights \
                or (len(node.input) > 3 and np.any(numpy_helper.to_array(weights[node.input[3]]))):
            continue
        weight = numpy_helper.to_array(floats[conv.input[1]])
        channels = [quantize_data(weight[c].ravel(), TensorProto.INT8, True, reduce_range) for c in range(len(weight))]
        quantized = np.stack([q.reshape(weight.shape[1:]) for _, _, q in channels]).astype(np.int8)
        scales = np.array([s for _, s, _ in channels], dtype=np.float32).reshape((-1,) + (1,) * (weight.ndim - 2))
        weights[node.input[1]].CopyFrom(numpy_helper.from_array(quantized, node.input[1]))
        weights[scale].CopyFrom(numpy_helper.from_array(scales, scale))
        changed.append(conv.name)
    return changed


def _outcome(model, prepared, settings: DynamicSettings, keep_float: List[str]) -> Tuple[List[str], Dict[str, str]]:
    """(the prepared graph's ops now integer, {op left float: why}) among the weighted op types."""
    integer = {node.name for node in model.graph.node if node.op_type in INTEGER_OPS}
    constants = {init.name for init in prepared.graph.initializer}
    quantized, left = [], {}
    for node in prepared.graph.node:
        if node.op_type not in WEIGHTED_OPS:
            continue
        if {f"{node.name}_quant", f"{node.name}_MatMul_quant"} & integer:
            quantized.append(node.name)
        else:
            left[node.name] = _why_float(node, settings, keep_float, constants)
    return quantized, left


def _why_float(node, settings: DynamicSettings, keep_float: List[str], constants) -> str:
    if node.name in keep_float:
        return "precision.keep_float"
    if node.op_type not in settings.quantize_ops:
        return "not in precision.quantize_ops"
    if node.op_type not in DYNAMIC_OPS:
        return f"{node.op_type}: no dynamic integer kernel in ONNX Runtime"
    if node.op_type == "MatMul" and node.input[1] not in constants:
        return "MatMul of two activations: the dynamic quantizer quantizes a constant B only"
    return f"{node.op_type} left float by ONNX Runtime's dynamic quantizer"


def nothing_quantized(summary: dict) -> Optional[str]:
    """The one line a dynamic build that quantized no op fails with, else None."""
    if summary["int8_ops"]:
        return None
    return ("precision.activation_ranges=dynamic: ONNX Runtime's dynamic quantizer quantized none of the model's "
            f"{len(summary['not_quantized'])} {'/'.join(WEIGHTED_OPS)} ops (it quantizes Conv, Gemm and MatMul with "
            "constant weights, those of precision.quantize_ops); build it with activation_ranges=static")
