"""convert: the user's ONNX file -> a normalized, checked ONNX model (input shapes fixed
where the config or the batch says so, dynamic within their recorded range elsewhere, opset >= model.min_opset, an IR version every runtime here loads, shapes
inferred), a numeric pre-flight of its weights, and OpenVINO IR for OpenVINO targets."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np
import onnx
from onnx import numpy_helper, version_converter

from pipeline import backends, shapes
from pipeline.artifacts import sha256_file
from pipeline.errors import (ConfigError, InputError, ReferenceUnavailable, first_line, meaningful_line,
                             target_cannot)
from pipeline.model import batch_axes, check, external_data_files, load_onnx, record_batch_axes, signature
from stages import StageContext, StageResult
from stages.results import ConvertSummary

NAME = "convert"
CACHEABLE = True

# ONNX Runtime 1.31 loads IR <= 13 and OpenVINO reads IR 10 files; IR 10 covers opsets up to 21.
MAX_IR_VERSION = 10
FP16_MAX = float(np.finfo(np.float16).max)
FP16_SMALLEST = float(2.0 ** -24)  # smaller nonzero magnitudes become 0 in fp16
FP32_TINY = float(np.finfo(np.float32).tiny)  # smaller nonzero magnitudes are fp32 denormals


def key_config(cfg):
    return {"model": {k: v for k, v in vars(cfg.model).items() if k != "name"},
            "ir": backends.capabilities(cfg.target.backend.value).ir}


def external_files(ctx: StageContext) -> List[Path]:
    path = Path(ctx.cfg.model.path).expanduser()
    return [path, *external_data_files(path)] if path.is_file() else []


def run(ctx: StageContext) -> StageResult:
    cfg = ctx.cfg.model
    source = Path(cfg.path).expanduser()
    model = load_onnx(source)
    before = {"opset": _default_opset(model), "ir_version": model.ir_version}
    axes = batch_axes(model)
    fixed = _fix_input_shapes(model, cfg.input_shapes, axes)
    model = _upgrade_opset(model, cfg.min_opset)
    model.ir_version = _ir_version(model)
    constants = _initializers_out_of_inputs(model)  # IR 3 needs them listed, the version converter too
    _drop_unused_resize_rois(model)
    model = _infer_shapes(model)
    record_batch_axes(model, axes)
    check(model)
    onnx.save(model, str(ctx.out_dir / "model.onnx"))
    output_shapes = output_shape_check(reference_session(ctx.out_dir / "model.onnx"), model)  # the session freed
    files = {"model": "model.onnx"}
    backend = backends.spec(ctx.cfg.target.backend.value)
    if backend.CAPABILITIES.ir:  # the runtime's own IR of the float model, for build
        try:
            ir_files = backend.convert_ir(ctx.out_dir / "model.onnx", ctx.out_dir)
        except RuntimeError as err:  # OpenVINO's frontend: pages of "Exception from src/...": one line
            raise target_cannot(ctx.cfg.target.name, "read", err) from err
        files.update({"ir_xml": ir_files[0], "ir_bin": ir_files[1]})
    summary = {
        "source": str(source.resolve()),
        "source_sha256": sha256_file(source),
        "opset": {"from": before["opset"], "to": _default_opset(model)},
        "ir_version": {"from": before["ir_version"], "to": model.ir_version},
        "nodes": len(model.graph.node),
        "op_types": dict(Counter(n.op_type for n in model.graph.node).most_common()),
        "inputs": [vars(s) for s in signature(model)],
        "outputs": [vars(s) for s in signature(model, outputs=True)],
        "fixed_shapes": fixed,
        "initializers_in_inputs": constants,
        "dynamic_shapes": {name: r.to_json() if r else "data" for name, r in shapes.recorded(model).items()},
        "preflight": preflight(model),
        "output_shapes": output_shapes,
    }
    return StageResult(ctx.out_dir, files, ConvertSummary.from_json(summary))


def _initializers_out_of_inputs(model: onnx.ModelProto) -> int:
    """Weights an old exporter (IR 3) also listed as graph inputs become constants only:
    as inputs they are overridable, so runtimes fold nothing through them and pnnx takes an
    old Upsample's scales for a run-time input ("cannot convert op Resize"). How many moved."""
    weights = {tensor.name for tensor in model.graph.initializer}
    kept = [value for value in model.graph.input if value.name not in weights]
    moved = len(model.graph.input) - len(kept)
    if moved:
        del model.graph.input[:]
        model.graph.input.extend(kept)
    return moved


def _drop_unused_resize_rois(model: onnx.ModelProto) -> None:
    """A Resize reads its roi input only in tf_crop_and_resize mode; the version converter
    writes one for an opset-9 Upsample anyway ([0,0,0,0,1,1,1,1]), and pnnx then cannot
    convert the Resize. An roi the op ignores is left empty."""
    for node in model.graph.node:
        mode = next((a.s.decode() for a in node.attribute if a.name == "coordinate_transformation_mode"), "half_pixel")
        if node.op_type == "Resize" and len(node.input) > 1 and node.input[1] and mode != "tf_crop_and_resize":
            node.input[1] = ""


def refuse_quantized(ctx: StageContext) -> None:
    """A model quantized already is built and verified as given (precision=fp32, whose
    reference runs the same quantized graph); quantizing it again or narrowing its float
    parts is a config error, before its ops meet a quantizer that assumes a float model."""
    convert = ctx.results.get("convert")
    found = convert.summary.quantized if convert is not None else ""
    if found:
        raise ConfigError(f"precision={ctx.cfg.precision.kind}: the model is quantized already ({found}): parity "
                          "builds and verifies it as given with precision=fp32 (the reference runs the same "
                          "quantized graph); give parity the float model to let it choose the precision")


def _default_opset(model: onnx.ModelProto) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)


def _fix_input_shapes(model: onnx.ModelProto, requested: Dict[str, object], axes: Dict[str, Optional[int]]) -> dict:
    """Fix what should be fixed: config first (a fixed shape, or a range's dims whose min
    equals max), then batch 1 on each input's batch axis (``axes``) where no range names
    it. Other dynamic dims stay dynamic: within the range given, or as the data decides.
    The ranges are recorded in the model (pipeline.shapes.record). A scalar stays a scalar."""
    inputs = {s.name: s for s in signature(model)}
    ranges = shapes.parse_all(requested)
    unknown = sorted(set(ranges) - set(inputs))
    if unknown:
        raise InputError(f"model.input_shapes: the model has no input {unknown[0]!r}; inputs: {', '.join(inputs)}")
    fixed, dynamic = {}, {}
    initializers = {t.name for t in model.graph.initializer}
    for value in model.graph.input:
        if value.name in initializers:
            continue
        dims = value.type.tensor_type.shape.dim
        before = [d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else (d.dim_param or "?") for d in dims]
        after = _wanted_dims(value.name, before, ranges.get(value.name), axes.get(value.name))
        if after != before:
            for axis, (dim, size) in enumerate(zip(dims, after)):
                dim.Clear()
                if isinstance(size, int):
                    dim.dim_value = size
                else:
                    dim.dim_param = size if size != "?" else f"{value.name}_{axis}"
            fixed[value.name] = {"from": before, "to": after}
        if any(isinstance(d, str) for d in after):
            given = ranges.get(value.name)
            dynamic[value.name] = given if given and given.dynamic_axes else None
    if fixed:  # stale intermediate and output shapes would contradict the new input shapes
        del model.graph.value_info[:]
        for output in model.graph.output:
            for dim in output.type.tensor_type.shape.dim:
                if not (dim.HasField("dim_value") and dim.dim_value > 0):
                    dim.Clear()
    shapes.record(model, dynamic)
    return fixed


def _wanted_dims(name: str, before: List, wanted: Optional[shapes.ShapeRange], batch_axis: Optional[int]) -> List:
    """One input's dims after convert: ints where fixed, the model's dim names (or "?")
    where dynamic. A range that contradicts a fixed dim of the model is an InputError."""
    if wanted is None:
        return [1 if index == batch_axis and isinstance(dim, str) else dim for index, dim in enumerate(before)]
    if len(wanted.min) != len(before):
        raise InputError(f"model.input_shapes.{name}: {len(wanted.min)} dims given, the input has {len(before)} "
                         f"({before})")
    after = []
    for index, (dim, low, high) in enumerate(zip(before, wanted.min, wanted.max)):
        if isinstance(dim, int) and not low == high == dim:
            raise InputError(f"model.input_shapes.{name}: dim {index} is fixed at {dim} in the model but the config "
                             f"gives {low if low == high else f'{low}..{high}'} ({before})")
        after.append(low if low == high else dim)
    return after


def _upgrade_opset(model: onnx.ModelProto, min_opset: int) -> onnx.ModelProto:
    current = _default_opset(model)
    if current >= min_opset:
        return model
    try:
        return version_converter.convert_version(model, min_opset)
    except Exception as err:  # the converter raises bare RuntimeErrors/IndexErrors
        raise InputError(f"model: cannot upgrade opset {current} to {min_opset} "
                         f"({first_line(err)}); "
                         "export the model at opset >= 13 or set model.min_opset") from err


def _ir_version(model: onnx.ModelProto) -> int:
    required = onnx.helper.find_min_ir_version_for(list(model.opset_import), ignore_unknown=True)
    return max(required, min(model.ir_version, MAX_IR_VERSION))


def _infer_shapes(model: onnx.ModelProto) -> onnx.ModelProto:
    try:
        return onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True, data_prop=True)
    except (onnx.shape_inference.InferenceError, onnx.checker.ValidationError, RuntimeError) as err:
        raise InputError(f"model: shape inference fails on the model: {first_line(err)}") from err


def preflight(model: onnx.ModelProto) -> List[dict]:
    """Weights that will not survive as they are: NaN/Inf, beyond fp16, denormals."""
    findings = []
    tensors = list(model.graph.initializer) + [a.t for n in model.graph.node if n.op_type == "Constant"
                                                for a in n.attribute if a.HasField("t")]
    for tensor in tensors:
        if tensor.data_type not in (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16):
            continue
        values = numpy_helper.to_array(tensor).astype(np.float64, copy=False).ravel()
        name = tensor.name or "<Constant>"
        nonfinite = ~np.isfinite(values)
        if nonfinite.any():
            findings.append(_finding(name, "nan_inf", int(nonfinite.sum()),
                                     f"{int(np.isnan(values).sum())} NaN, {int(np.isinf(values).sum())} Inf", "error"))
        magnitude = np.abs(values[~nonfinite])
        over = magnitude > FP16_MAX
        if over.any():
            findings.append(_finding(name, "fp16_overflow", int(over.sum()),
                                     f"max |x| {magnitude.max():.3g} > {FP16_MAX:.0f}", "warning"))
        nonzero = magnitude[magnitude > 0]
        denormal = nonzero < FP32_TINY
        if denormal.any():
            findings.append(_finding(name, "fp32_denormal", int(denormal.sum()),
                                     f"smallest |x| {nonzero.min():.3g} < {FP32_TINY:.3g}", "warning"))
        underflow = (nonzero < FP16_SMALLEST) & ~denormal
        if underflow.any():
            findings.append(_finding(name, "fp16_underflow", int(underflow.sum()),
                                     f"{int(underflow.sum())} values below {FP16_SMALLEST:.3g} become 0 in fp16", "info"))
    return findings


def _finding(tensor: str, check_name: str, count: int, detail: str, severity: str) -> dict:
    return {"tensor": tensor, "check": check_name, "count": count, "detail": detail, "severity": severity}


def reference_session(path: Path):
    """ONNX Runtime's session of the converted model, unoptimized: the fp32 reference every
    build is compared against. A model it cannot load (an op of a custom domain, an opset newer
    than it knows, a kernel it lacks) stops every job: said here in one line (exit 4), not as an
    internal error in the first later step that loads it (the int8 quantizer's, under auto)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 3  # ONNX Runtime's own "Error merging shape info" line: reported by output_shape_check
    try:
        return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    except Exception as err:  # noqa: BLE001 - ONNX Runtime raises its own Fail, InvalidGraph, NotImplemented...
        raise ReferenceUnavailable(_cannot_load(err, f"ONNX Runtime {ort.__version__}")) from err


def _cannot_load(err: Exception, runtime: str) -> str:
    """What the reference runtime's refusal to load a model means, and what to do."""
    message, reference = str(err), f"{runtime}, the fp32 reference every build is compared against,"
    unknown = re.search(r"([\w.]+:\w+|\w+)\(-?\d+\) is not a registered function/op", message)
    if unknown:
        return (f"{reference} does not know the op {unknown.group(1)}: export the model with standard ONNX ops "
                "(a custom op has no reference to verify against)")
    newer = re.search(r"Opset (\d+) is under development.*?support for domain (\S*) is till opset (\d+)", message, re.S)
    if newer:
        return (f"{reference} reads opset {newer.group(3)} of domain {newer.group(2)} at most and the model is stamped "
                f"{newer.group(1)}: export it with opset {newer.group(3)} or lower (or install a newer onnxruntime)")
    return f"{reference} cannot load this model: {meaningful_line(err).split('failed:', 1)[-1].strip()}"


def output_shape_check(session, model: onnx.ModelProto) -> dict:
    """Each output's declared static dims against the shape ONNX Runtime returns for
    all-zero inputs (``session``: reference_session's). Runtimes accept a wrong declaration
    silently (ONNX Runtime only logs it), and a loader that trusts runtime.yaml's shapes
    would misread the output."""
    declared = {o.name: [d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else "?"
                         for d in o.type.tensor_type.shape.dim]
                for o in model.graph.output if o.type.tensor_type.HasField("shape")}
    specs = signature(model)
    if any(spec.dynamic and not spec.range for spec in specs):
        return {"checked": False, "reason": "dynamic inputs without a range: verify checks the outputs at each "
                                            "sample's own shape", "mismatches": []}
    feeds = {spec.name: np.zeros(spec.range["opt"] if spec.dynamic else spec.shape, spec.dtype) for spec in specs}
    try:
        returned = dict(zip((o.name for o in session.get_outputs()), session.run(None, feeds)))
    except Exception as err:  # noqa: BLE001 - zeros are not every model's valid input
        return {"checked": False, "reason": f"ONNX Runtime could not run the model on all-zero inputs: "
                                            f"{first_line(err)}", "mismatches": []}
    mismatches = []
    for name, dims in declared.items():
        shape = list(np.shape(returned[name]))
        if len(dims) != len(shape) or any(d != "?" and d != r for d, r in zip(dims, shape)):
            mismatches.append({"output": name, "declared": dims, "returned": shape})
    return {"checked": True, "inputs": "zeros", "mismatches": mismatches}
