"""build: the deployable artifact for the target's backend and the runtime settings a
loader needs (runtime.yaml)."""

from __future__ import annotations

from pathlib import Path
from typing import List

import yaml

import onnx

from pipeline import backends, fp16
from pipeline.artifacts import read_json
from pipeline.errors import BackendUnavailable, ConfigError, first_line
from pipeline.quantize import build_qdq, needs_reduce_range
from stages import StageContext, StageResult

NAME = "build"
VERSION = 11
CACHEABLE = True


def key_config(cfg):
    precision = cfg.precision
    quantized = precision.name.value in ("int8", "mixed")
    return {"target": cfg.target, "precision": precision.name, "keep_float": sorted(precision.keep_float),
            "int8": (precision.activations, precision.per_channel, precision.reduce_range,
                     needs_reduce_range()) if quantized else None}


def _requested_float(ctx: StageContext, model: onnx.ModelProto, chosen: List[str]) -> tuple:
    """``chosen`` plus precision.keep_float, limited to ops the prepared graph still has
    (BatchNorm folded into Conv, for one, no longer exists), and the names left out."""
    names = {node.name for node in model.graph.node}
    asked = list(ctx.cfg.precision.keep_float)
    converted = {node.name for node in onnx.load(str(ctx.results["convert"].path("model")),
                                                 load_external_data=False).graph.node}
    typos = [name for name in asked if name not in converted and name not in names]
    if typos:
        raise ConfigError(f"precision.keep_float: the model has no op {typos[0]!r} (names are ONNX node names, "
                          "as the report's layerwise section and recommendations give them)")
    merged = list(dict.fromkeys([*chosen, *[name for name in asked if name in names]]))
    return merged, [name for name in asked if name not in names]


def external_files(ctx: StageContext) -> List[Path]:
    return []


def run(ctx: StageContext) -> StageResult:
    target, precision = ctx.cfg.target, ctx.cfg.precision.name.value
    backend = backends.spec(target.backend.value)
    ok, reason = backend.available()
    if not ok:
        raise BackendUnavailable(f"target {target.name}: {reason}")
    convert = ctx.results["convert"]
    onnx_path, ir_dir = convert.path("model"), convert.out_dir if "ir_xml" in convert.files else None
    quantization = None
    if precision in ("int8", "mixed"):
        (onnx_path, quantization), ir_dir = _quantize(ctx), None
    elif precision == "fp16":
        (onnx_path, quantization), ir_dir = _half(ctx, backend.NAME), None
    artifacts, settings = backend.build(onnx_path, ir_dir, ctx.out_dir, target, precision)
    if onnx_path.parent == ctx.out_dir and onnx_path.name not in artifacts:
        onnx_path.unlink()
    runtime = {
        "format": 1,
        "backend": backend.NAME,
        "target": target.name,
        "device": target.device.upper(),
        "precision": precision,
        "memory_mode": target.memory_mode.value,
        "model": settings["model"],
        "files": artifacts,
        "options": settings.get("options", {}),
        "inputs": convert.summary["inputs"],
        "outputs": convert.summary["outputs"],
    }
    (ctx.out_dir / "runtime.yaml").write_text(yaml.safe_dump(runtime, sort_keys=False))
    files = {"runtime": "runtime.yaml", **{f"artifact:{name}": name for name in artifacts}}
    summary = {"backend": backend.NAME, "files": artifacts, "options": runtime["options"],
               "versions": backend.versions(),
               "bytes": sum((ctx.out_dir / name).stat().st_size for name in artifacts),
               "quantization": quantization}
    return StageResult(ctx.out_dir, files, summary)


def _half(ctx: StageContext, backend: str):
    """fp16 from the prepared graph (BatchNorm folded): the pre-flight's findings name the
    nodes kept in fp32 (an overflowing tensor's producer and consumers). ONNX Runtime gets
    an fp16 ONNX model; OpenVINO an IR with fp16 weights (its execution precision is the
    precision hint's, when the CPU runs it natively)."""
    calibrate = ctx.results.get("calibrate")
    if calibrate is None or "fp16_findings" not in calibrate.files:
        raise ConfigError("precision=fp16 needs the calibrate stage (statistics for the fp16 pre-flight) before build")
    findings = read_json(calibrate.path("fp16_findings"))
    prepared = onnx.load(str(calibrate.path("prepared")))
    blocked, unknown = _requested_float(ctx, prepared, fp16.block_list(prepared, findings))
    half = ctx.out_dir / "half.onnx"
    if backend == "openvino":
        # fp16 weights in the IR and the f16 hint; OpenVINO decides per layer what runs f16
        # (it keeps precision-sensitive subgraphs such as x*x -> ReduceSum in f32 itself).
        # The block list is recorded, not applied: verify reports what ran.
        onnx.save(prepared, str(half))
        return half, {"findings": findings, "blocked": blocked, "applied": False, "keep_float_not_found": unknown,
                      "converter": "openvino save_model(compress_to_fp16=True)"}
    summary = fp16.convert(calibrate.path("prepared"), half, blocked)
    return half, {"findings": findings, **summary, "keep_float_not_found": unknown}


def _quantize(ctx: StageContext):
    """The QDQ int8 model built from the calibrate stage's table."""
    calibrate = ctx.results.get("calibrate")
    if calibrate is None or "table" not in calibrate.files:
        raise ConfigError("precision=int8 needs the calibrate stage: add it to pipeline.stages before build")
    table = read_json(calibrate.path("table"))["tensors"]
    keep_float: list = []
    precision = ctx.cfg.precision
    if precision.name.value == "mixed":
        found = ctx.results.get("sensitivity")
        if found is None or "qtable" not in found.files:
            raise ConfigError("precision=mixed needs the sensitivity stage: add it to pipeline.stages before build")
        table = read_json(found.path("table"))["tensors"]
        keep_float = read_json(found.path("qtable"))["float_ops"]
    keep_float, unknown = _requested_float(ctx, onnx.load(str(calibrate.path("prepared")), load_external_data=False),
                                           keep_float)
    quantized = ctx.out_dir / "quantized.onnx"
    reduce_range = precision.reduce_range
    if reduce_range is None:
        reduce_range = needs_reduce_range()
    try:
        build_qdq(calibrate.path("prepared"), table, quantized, precision.activations.value, precision.per_channel,
                  keep_float=keep_float, reduce_range=reduce_range)
    except Exception as err:  # noqa: BLE001 - ORT's quantizer rejects some graphs
        raise BackendUnavailable(f"int8: ONNX Runtime's quantizer cannot quantize the model: {first_line(err)}") from err
    settings = {"weights": "int8 symmetric, " + ("per channel" if precision.per_channel else "per tensor"),
                "activations": precision.activations.value + (" symmetric" if precision.activations.value == "int8"
                                                              else " asymmetric") + ", per tensor",
                "bias": "int32", "reduce_range": reduce_range, "float_ops": keep_float,
                "keep_float_not_found": unknown}
    return quantized, settings
