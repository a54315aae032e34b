"""INT8 QDQ models from parity's calibration table, through ONNX Runtime's quantizer
(fed parity's ranges via its calibration-cache file, so ORT computes no ranges itself)."""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import Dict, Iterable, Tuple

import numpy as np

RANGE_FLOOR = 1e-6
_DATA_MOVEMENT = {"Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten", "Gather", "Resize", "Split",
                  "Slice", "Expand", "Identity"}  # the narrowest activation range written (an all-zero tensor still gets a scale)


def activation_range(entry: dict, activations: str) -> Tuple[float, float]:
    """The [low, high] an activation is quantized over: symmetric +-threshold for int8;
    for uint8 the observed [min, max] clipped to +-threshold, always containing 0."""
    threshold = max(float(entry["threshold"]), RANGE_FLOOR)
    if activations == "int8":
        return -threshold, threshold
    low = min(max(float(entry["min"]), -threshold), 0.0)
    high = max(min(float(entry["max"]), threshold), 0.0)
    if high - low < RANGE_FLOOR:
        high = low + RANGE_FLOOR
    return low, high


def ort_tensors_data(table: Dict[str, dict], activations: str):
    from onnxruntime.quantization.calibrate import CalibrationMethod, TensorData, TensorsData

    ranges = {}
    for name, entry in table.items():
        low, high = activation_range(entry, activations)
        ranges[name] = TensorData(lowest=np.float32(low), highest=np.float32(high))
    return TensorsData(CalibrationMethod.MinMax, ranges)


def write_ort_cache(table: Dict[str, dict], activations: str, path: Path) -> None:
    """ONNX Runtime's own calibration-cache JSON (quantize_static(calibration_cache_path=...))."""
    from onnxruntime.quantization.calibrate import save_tensors_data

    save_tensors_data(ort_tensors_data(table, activations), path)


def needs_reduce_range() -> bool:
    """u8 x s8 int8 kernels use VPMADDUBSW on x86 CPUs without VNNI, whose 16-bit
    intermediate sums saturate (ONNX Runtime's quantization docs); 7-bit weights avoid it.
    Measured here for ONNX Runtime and OpenVINO alike (docs/calibration.md)."""
    from pipeline.environment import cpu

    info = cpu()
    vnni = {"avx512_vnni", "avx_vnni", "amx_int8"} & set(info["flags"])
    return info["machine"] in ("x86_64", "AMD64") and not vnni


def build_qdq(model_path: Path, table: Dict[str, dict], out_path: Path, activations: str = "uint8",
              per_channel: bool = True, keep_float: Iterable[str] = (), reduce_range: bool = False) -> None:
    """Weights symmetric int8 (per channel by default), activations per tensor, bias int32;
    nodes named in keep_float stay in float. The model's outputs stay float: a Q/DQ pair on
    an output saves no compute and only rounds what the user reads (on the PP-OCR
    classifier it flipped 1 % of top-1 predictions)."""
    import onnx
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    graph = onnx.load(str(model_path), load_external_data=False).graph
    outputs = {o.name for o in graph.output}
    producers = [n for n in graph.node if outputs & set(n.output)]
    # Data-movement ops (Reshape...) stay float when their output has no range. Other ops
    # demand a range at their output: there output quantization is switched off by op type
    # (inside the graph a consumer still quantizes such a tensor at its own input).
    moved = {o for n in producers if n.op_type in _DATA_MOVEMENT for o in n.output}
    table = {name: entry for name, entry in table.items() if name not in moved}
    float_outputs = sorted({n.op_type for n in producers if n.op_type not in _DATA_MOVEMENT})
    with tempfile.TemporaryDirectory(prefix="parity-qdq-") as scratch:
        cache = Path(scratch) / "ranges.json"
        write_ort_cache(table, activations, cache)
        quiet = logging.getLogger().level
        logging.getLogger().setLevel(logging.ERROR)  # ORT logs advice on the root logger
        try:
            quantize_static(
                str(model_path), str(out_path), None,
                calibration_cache_path=str(cache),
                calibrate_method=CalibrationMethod.MinMax,
                quant_format=QuantFormat.QDQ,
                per_channel=per_channel,
                reduce_range=reduce_range,
                activation_type=QuantType.QInt8 if activations == "int8" else QuantType.QUInt8,
                weight_type=QuantType.QInt8,
                nodes_to_exclude=list(keep_float),
                extra_options={"WeightSymmetric": True, "ActivationSymmetric": activations == "int8",
                               "OpTypesToExcludeOutputQuantization": float_outputs},
            )
        finally:
            logging.getLogger().setLevel(quiet)


def prepare(model_path: Path, out_path: Path) -> None:
    """The graph that gets calibrated and quantized: ONNX Runtime's quantization
    pre-processing at its basic level (constant folding, BatchNorm folded into Conv),
    which keeps standard ONNX ops only. Symbolic shape inference is skipped: it fails on
    some exported models (shared/findings.md) and convert already inferred shapes."""
    import onnx
    from onnxruntime.quantization.shape_inference import quant_pre_process

    quant_pre_process(str(model_path), str(out_path), skip_symbolic_shape=True)
    model = onnx.load(str(out_path))
    used = {node.domain or "" for node in model.graph.node}
    kept = [o for o in model.opset_import if (o.domain or "") in used | {""}]
    del model.opset_import[:]
    model.opset_import.extend(kept)
    onnx.save(model, str(out_path))
