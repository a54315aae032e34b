"""build: the deployable artifact for the target's backend and the runtime settings a
loader needs (runtime.yaml)."""

from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path
from typing import List, Optional

import onnx

from pipeline import backends, deadline, environment
from pipeline.backends import artifact
from pipeline.precision import dynamic, fp16, kinds
from pipeline.release import compile_cache
from pipeline.artifacts import hash_files, read_json, sha256_file, write_json
from pipeline.precision.calibration import bias_correction, latency, weight_rounding
from pipeline.errors import BackendCrashed, BackendUnavailable, ConfigError, first_line
from pipeline.precision.quantize import (MixedModels, QdqSettings, QuantizerFailed, backend_float_ops, build_qdq,
                                        gemm_bias_notes, int8_op_count, settings_float_ops)
from pipeline.worker import BackendWorker
from stages import (BASELINES, REFERENCE_MODULE, StageContext, StageResult, baseline_role, baselines, peek,
                    reference_settings)
from stages.convert import refuse_quantized
from stages.results import BuildSummary

log = logging.getLogger("parity")

NAME = "build"
CACHEABLE = True
ON_MACHINE = "device"  # compile caches, and builds searched on the device (ncnn's fp16 feature masks)
MASK_SAMPLES = 8  # validation samples each feature-mask candidate is verified on
UNFOLDED_QDQ = "quantized_unfolded.onnx"  # the refined Q/DQ model before rewrite_for_runtime: mixed models derive from it


def key_config(cfg):
    precision = cfg.precision
    quantized = kinds.quantized(precision.kind)
    backend = backends.spec(cfg.target.backend.value)
    return {"target": cfg.target, "precision": precision.name, "keep_float": sorted(precision.keep_float),
            # the backend's own float kinds can depend on the machine (ncnn: x86 or not)
            "float_op_kinds": backends.float_op_kinds(backend, cfg.target) if quantized else None,
            # precision.int8_where_faster times each op on this machine, on a validation sample
            "where_faster": (environment.fingerprint(), cfg.data)
            if quantized and precision.int8_where_faster else None,
            "int8": QdqSettings.resolve(precision, backend.NAME) if quantized and not precision.dynamic_ranges else None,
            **({"dynamic": _dynamic_key(cfg, backend)} if precision.dynamic_ranges else {}),
            # bias correction measures the quantized ops on the calibration samples
            "bias_correction": cfg.data if _refines(cfg, backend, "bias_correction") else False,
            "weight_rounding": cfg.data if _refines(cfg, backend, "weight_rounding") else False,
            # the mask search and the runtime's own int8 tooling use data (and the thresholds)
            "data": (cfg.data, _mask_search_reads(cfg) if _wants_masks(cfg, backend) else None, cfg.calibration)
            if _wants_masks(cfg, backend) or backends.own_quantizer(backend, precision.kind) else None,
            # a converter tracing at fixed shapes takes a range the data decides from the samples
            "traced_at": cfg.data if backend.CAPABILITIES.traces_at_shapes else None,
            # runtime.yaml's served shapes: a dynamic input the data feeds at one shape (served_inputs)
            "served_at": cfg.data,
            # a compile cache is made for this machine's CPU (pipeline/release/compile_cache.py)
            "machine": environment.fingerprint() if backend.CAPABILITIES.compile_cache else None,
            # verify's baselines, made here where verify runs (none: the key stays as it was)
            **({"baselines": baselines(cfg)} if baselines(cfg) else {})}


def _mask_search_reads(cfg) -> dict:
    """The validation settings the fp16 mask search reads (its thresholds and worker limits),
    and no others: auto's candidates run with verify's diagnosis off, and a key holding it
    rebuilt the winner in the final run."""
    reads = ("min_cosine", "task_min_cosine", "task_output", "max_abs_error", "max_mean_abs_error", "min_sqnr_db",
             "outputs", "worker_timeout_s", "worker_memory_mb", "layer_min_cosine")
    return {name: getattr(cfg.validation, name) for name in reads}


def _dynamic_key(cfg, backend) -> tuple:
    settings = dynamic.DynamicSettings.resolve(cfg.precision, backend.NAME)
    # a width the automatic rule chose is measured on the calibration samples
    return settings, (cfg.data if settings.width_measured else None)


def _wants_masks(cfg, backend) -> bool:
    return kinds.narrow(cfg.precision.kind) and cfg.target.auto_masks and backend.CAPABILITIES.feature_masks


def external_files(ctx: StageContext) -> List[Path]:
    backend = backends.spec(ctx.cfg.target.backend.value)
    if _wants_masks(ctx.cfg, backend) or backends.own_quantizer(backend, ctx.cfg.precision.kind) \
            or any(_refines(ctx.cfg, backend, step) for step, _, _ in REFINEMENTS) \
            or ctx.cfg.precision.int8_where_faster:
        return ctx.dataset().files
    return []


def _refines(cfg, backend, step: str) -> bool:
    """precision.<step> (bias_correction, weight_rounding) on a QDQ int8/mixed build, not
    the runtime's own int8 tooling."""
    name = cfg.precision.kind
    return kinds.quantized(name) and getattr(cfg.precision, step) and not backends.own_quantizer(backend, name) \
        and not cfg.precision.dynamic_ranges  # a static refinement: dynamic builds have no calibrated ranges


def _own_int8(ctx: StageContext, backend) -> dict:
    """int8 through the backend's own offline quantizer, fed parity's calibration samples;
    mixed: the qtable's ops (and precision.keep_float) named to it as ops to keep float."""
    float_ops = _qtable_float_ops(ctx) if kinds.searched(ctx.cfg.precision.kind) else []
    runtime, _ = ctx.build_into(ctx.out_dir, backend, ctx.cfg.precision.kind, ctx.results["convert"].path("model"),
                                own_float_ops=float_ops)
    return runtime


def _qtable_float_ops(ctx: StageContext) -> List[str]:
    """The sensitivity stage's float ops plus precision.keep_float (checked as for Q/DQ builds)."""
    found = ctx.results.get("sensitivity")
    if found is None or "qtable" not in found.files:
        raise ConfigError("precision=mixed needs the sensitivity stage: add it to pipeline.stages before build")
    prepared = onnx.load(str(ctx.results["calibrate"].path("prepared")), load_external_data=False)
    float_ops, _ = _requested_float(ctx, prepared, read_json(found.path("qtable"))["float_ops"])
    return float_ops


def _feature_masks(ctx: StageContext, backend, runtime: dict) -> dict:
    """fp16 on a backend with feature masks (ncnn): verify the plain build on the first
    validation samples; when it fails, find the layers to mask from the evidence and search the masks (pipeline/precision/feature_masks.py).
    The masks found are written into the artifact in place."""
    from pipeline.precision import feature_masks
    from pipeline.verification import layerwise

    cfg = ctx.cfg
    samples = [s.feeds for _, s in zip(range(MASK_SAMPLES), ctx.dataset().validation)]
    convert = ctx.results["convert"]
    limits = {"timeout_s": cfg.validation.worker_timeout_s, "memory_mb": cfg.validation.worker_memory_mb}
    with BackendWorker(REFERENCE_MODULE, convert.out_dir, reference_settings(convert),
                       label="reference (onnxruntime fp32)", **limits) as reference:
        expected = [reference.run(feeds) for feeds in samples]
        judge = feature_masks.Judge(backend.__name__, samples, expected, cfg.validation.thresholds_for,
                                    cfg.validation.worker_timeout_s)
        if judge(ctx.out_dir, runtime, {}):
            return {"searched": False, "reason": f"the plain fp16 build passes on {len(samples)} samples",
                    "masks": [], "trials": judge.trials}
        try:
            with BackendWorker(backend.__name__, ctx.out_dir, runtime, label=f"{backend.NAME} fp16 (plain)",
                               **limits) as target:
                graph = layerwise.Graph(onnx.load(str(convert.path("model"))))
                evidence = layerwise.compare(reference, target, graph, samples, cfg.validation.layer_min_cosine)
                evidence = evidence.summary("on_fail", "the plain fp16 build failed", "")
        except BackendCrashed as err:
            evidence = {"ran": False, "reason": str(err)}
    ops = feature_masks.candidate_ops(evidence, _preflight_block(ctx))
    layer_map = backend.layer_map(ctx.out_dir, runtime)
    layers = list(dict.fromkeys(layer_map[op] for op in ops if op in layer_map))
    outcome = feature_masks.search(ctx.out_dir, runtime, layers, cfg.target.device.upper(), judge, backend.apply_masks,
                                   backend.layer_consumers(ctx.out_dir, runtime))
    onnx_of = {layer: op for op, layer in layer_map.items()}
    if outcome.masks:
        with tempfile.TemporaryDirectory(prefix="parity-masked-") as scratch:
            files, masked = backend.apply_masks(ctx.out_dir, runtime, outcome.masks, Path(scratch))
            for name in files:
                shutil.copyfile(Path(scratch) / name, ctx.out_dir / name)
        runtime["options"] = masked["options"]
    return {"searched": True, "passed": outcome.passed, "candidates": [
                {"layer": layer, "onnx_op": onnx_of.get(layer)} for layer in outcome.candidates],
            "masks": [{"layer": layer, "onnx_op": onnx_of.get(layer), "mask": mask,
                       "runs": feature_masks.MASK_MEANING.get(mask, f"mask {mask}")}
                      for layer, mask in outcome.masks.items()],
            "evidence": {key: evidence.get(key) for key in ("nan_origin", "first_divergence", "reason")},
            "trials": judge.trials}


def _preflight_block(ctx: StageContext) -> List[str]:
    calibrate = ctx.results.get("calibrate")
    if calibrate is None or "fp16_findings" not in calibrate.files:
        return []
    prepared = onnx.load(str(calibrate.path("prepared")), load_external_data=False)
    return fp16.block_list(prepared, read_json(calibrate.path("fp16_findings")))


def _requested_float(ctx: StageContext, model: onnx.ModelProto, chosen: List[str]) -> tuple:
    """``chosen`` plus precision.keep_float, limited to ops the prepared graph still has
    (BatchNorm folded into Conv, for one, no longer exists), and the names left out."""
    names, asked = {node.name for node in model.graph.node}, list(ctx.cfg.precision.keep_float)
    converted = {node.name for node in onnx.load(str(ctx.results["convert"].path("model")),
                                                 load_external_data=False).graph.node}
    typos = [name for name in asked if name not in converted and name not in names]
    if typos:
        raise ConfigError(f"precision.keep_float: the model has no op {typos[0]!r} (names are ONNX node names, "
                          "as the report's layerwise section and recommendations give them)")
    if kinds.quantized(ctx.cfg.precision.kind):
        _only_quantized(ctx, model, asked)
    merged = list(dict.fromkeys([*chosen, *[name for name in asked if name in names]]))
    return merged, [name for name in asked if name not in names]


def _only_quantized(ctx: StageContext, model: onnx.ModelProto, asked: List[str]) -> None:
    """An int8 build keeps in float what it quantizes, or what the backend keeps float here anyway (a
    sweep may name ONNX Runtime's ConvTransposes); another op rebuilds the same model: exit 2."""
    from pipeline.verification.recommend import QuantizedGraph

    target, quantize_ops = ctx.cfg.target, ctx.cfg.precision.quantize_ops
    by_backend = backend_float_ops(backends.spec(target.backend.value), target, model, quantize_ops)
    graph = QuantizedGraph(model, quantize_ops, by_backend)
    for name in asked:
        if name in graph.op_types and name not in graph.quantized and name not in by_backend:
            raise ConfigError(f"precision.keep_float: {graph.not_quantized_line(name)}")


def run(ctx: StageContext) -> StageResult:
    target, precision = ctx.cfg.target, ctx.cfg.precision.kind
    backend = backends.spec(target.backend.value)
    ok, reason = backend.available()
    if not ok:
        raise BackendUnavailable(f"target {target.name}: {reason}")
    if precision != kinds.REFERENCE:
        refuse_quantized(ctx)
    convert = ctx.results["convert"]
    onnx_path, ir_dir = convert.path("model"), _ir_dir(convert)
    quantization = traced_ranges = None
    if backends.own_quantizer(backend, precision):  # the runtime's own int8 tooling
        runtime = _own_int8(ctx, backend)
        quantization = runtime["options"].get("quantization")
    else:
        if kinds.quantized(precision):
            (onnx_path, quantization), ir_dir = _dynamic(ctx, backend) if ctx.cfg.precision.dynamic_ranges \
                else _quantize(ctx), None
        elif kinds.narrow(precision) and precision not in backend.CAPABILITIES.runtime_precisions:
            (onnx_path, quantization), ir_dir = _half(ctx, backend.CAPABILITIES.fp16_converter), None
        runtime, traced_ranges = ctx.build_into(ctx.out_dir, backend, precision, onnx_path, ir_dir,
                                                dynamic=ctx.cfg.precision.dynamic_ranges)
    artifacts = runtime["files"]
    # the Q/DQ model as refined, Relus not folded: verify's advice screening (never packaged)
    qdq_file = UNFOLDED_QDQ if (ctx.out_dir / UNFOLDED_QDQ).exists() else None
    if onnx_path.parent == ctx.out_dir and onnx_path.name not in artifacts:
        if qdq_file is None and kinds.quantized(precision) and not ctx.cfg.precision.dynamic_ranges:
            qdq_file = onnx_path.name
        else:
            onnx_path.unlink()
    if _wants_masks(ctx.cfg, backend):
        quantization = {**(quantization or {}), "feature_masks": _feature_masks(ctx, backend, runtime)}
    cache = compile_cache.write(backend, ctx.out_dir, runtime)
    artifact.write(ctx.out_dir, runtime)
    files = {"runtime": artifact.RUNTIME, **{f"artifact:{name}": name for name in artifacts},
             **({"qdq": qdq_file} if qdq_file else {}), **_baselines(ctx, backend)}
    if cache:
        files["compile_cache"] = cache["folder"]
    summary = {"backend": backend.NAME, "files": artifacts, "options": runtime["options"],
               "versions": backend.versions(), "bytes": artifact.size(ctx.out_dir, runtime),
               "quantization": quantization, "compile_cache": cache}
    if traced_ranges:
        summary["traced_at_data_ranges"] = traced_ranges
    if kinds.quantized(precision):  # where the activation ranges come from: the calibration table, or each call
        summary["activation_ranges"] = ctx.cfg.precision.activation_ranges.value
    cut = [entry["cut"] for entry in (quantization or {}).values() if isinstance(entry, dict) and "cut" in entry]
    return StageResult(ctx.out_dir, files, BuildSummary.from_json(summary), cache=not cut)


def _ir_dir(convert: StageResult) -> Optional[Path]:
    """convert's folder where it wrote the backend's IR beside model.onnx (OpenVINO), else None."""
    return convert.out_dir if "ir_xml" in convert.files else None


def _baselines(ctx: StageContext, backend) -> dict:
    """role -> runtime.yaml of each baseline, made into baselines/<precision>/ by the build
    the artifact is made with (StageContext.build_into), without a compile cache; verify
    only loads them. fp32 from convert's model (its IR where convert wrote one); mixed's plain
    int8 by the runtime's own quantizer where it has one, else the Q/DQ model of _plain_int8."""
    convert, files = ctx.results["convert"], {}
    for name in baselines(ctx.cfg):
        folder = ctx.out_dir / BASELINES / name
        folder.mkdir(parents=True)
        with tempfile.TemporaryDirectory(prefix=f"parity-{name}-") as scratch:
            if name == kinds.REFERENCE:
                runtime, _ = ctx.build_into(folder, backend, name, convert.path("model"), _ir_dir(convert))
            elif backends.own_quantizer(backend, ctx.cfg.precision.kind):
                runtime, _ = ctx.build_into(folder, backend, name, convert.path("model"), own_float_ops=[])
            else:
                runtime, _ = ctx.build_into(folder, backend, name, _plain_int8(ctx, backend, Path(scratch)))
        artifact.write(folder, runtime)
        files[baseline_role(name)] = f"{BASELINES}/{name}/{artifact.RUNTIME}"
    return files


def _plain_int8(ctx: StageContext, backend, scratch: Path) -> Path:
    """mixed's plain int8 baseline: the Q/DQ model of calibrate's table with only
    precision.keep_float and the backend's own float kinds in float (as the target's int8
    build keeps them), refined as the int8 build refines it, as the sensitivity search
    measures plain int8 (int8_refiner: served from the search's memo)."""
    calibrate = ctx.results["calibrate"]
    prepared = onnx.load(str(calibrate.path("prepared")), load_external_data=False)
    by_backend = backend_float_ops(backend, ctx.cfg.target, prepared, ctx.cfg.precision.quantize_ops)
    int8 = scratch / "int8.onnx"
    settings = QdqSettings.resolve(ctx.cfg.precision, backend.NAME)
    try:
        build_qdq(calibrate.path("prepared"), read_json(calibrate.path("table"))["tensors"], int8, settings,
                  keep_float=list(dict.fromkeys([*ctx.cfg.precision.keep_float, *by_backend])))
    except QuantizerFailed as err:
        raise err.with_run(ctx)
    refine_as_int8(ctx, int8)
    # rewritten as the int8 build is (Relus unfolded: the segmenter's 1.48x against 1.75x fp32)
    model = onnx.load(str(int8)) if settings.rewrites_for_runtime else None
    if model is not None and any(settings.rewrite_for_runtime(model).values()):
        onnx.save(model, str(int8))
    return int8


def _half(ctx: StageContext, converter: Optional[str]):
    """fp16 from the prepared graph (BatchNorm folded): the pre-flight's findings name the
    nodes kept in fp32 (an overflowing tensor's producer and consumers). A backend without
    its own fp16 ``converter`` (Capabilities.fp16_converter) gets an fp16 ONNX model (ONNX
    Runtime); one with it the prepared fp32 graph, which its build converts (OpenVINO: an IR
    with fp16 weights; its execution precision is the precision hint's, when the CPU runs
    it natively)."""
    calibrate = ctx.results.get("calibrate")
    if calibrate is None or "fp16_findings" not in calibrate.files:
        raise ConfigError("precision=fp16 needs the calibrate stage (statistics for the fp16 pre-flight) before build")
    findings = read_json(calibrate.path("fp16_findings"))
    prepared = onnx.load(str(calibrate.path("prepared")))
    blocked, unknown = _requested_float(ctx, prepared, fp16.block_list(prepared, findings))
    half = ctx.out_dir / "half.onnx"
    if converter:
        # e.g. fp16 weights in the IR and the f16 hint; OpenVINO decides per layer what runs f16
        # (it keeps precision-sensitive subgraphs such as x*x -> ReduceSum in f32 itself).
        # The block list is recorded, not applied: verify reports what ran.
        onnx.save(prepared, str(half))
        return half, {"findings": findings, "blocked": blocked, "applied": False, "keep_float_not_found": unknown,
                      "converter": converter}
    summary = fp16.convert(calibrate.path("prepared"), half, blocked)
    return half, {"findings": findings, **summary, "keep_float_not_found": unknown}


def _dynamic(ctx: StageContext, backend):
    """int8 with activations quantized per call at run time (precision.activation_ranges=dynamic,
    backends declaring dynamic_int8): pipeline/precision/dynamic.py on convert's model, no calibration."""
    converted = ctx.results["convert"].path("model")
    _requested_float(ctx, onnx.load(str(converted), load_external_data=False), [])  # names checked as for Q/DQ
    quantized = ctx.out_dir / "quantized.onnx"
    try:
        settings = dynamic.DynamicSettings.resolve(ctx.cfg.precision, backend.NAME)
        samples = (sample.feeds for sample in ctx.dataset().calibration) if settings.width_measured else None
        summary = dynamic.build(converted, quantized, settings, ctx.cfg.precision.keep_float, samples)
    except QuantizerFailed as err:
        raise err.with_run(ctx)
    failure = dynamic.nothing_quantized(summary)
    if failure:
        raise QuantizerFailed(failure).with_run(ctx)
    log.info("build: dynamic int8, %d ops quantized, activation ranges computed per call; weights: %s",
             summary["int8_ops"], summary["reduce_range_rule"])
    return quantized, summary


def _quantize(ctx: StageContext):
    """The QDQ int8 model built from the calibrate stage's table."""
    calibrate = ctx.results.get("calibrate")
    if calibrate is None or "table" not in calibrate.files:
        raise ConfigError("precision=int8 needs the calibrate stage: add it to pipeline.stages before build")
    table = read_json(calibrate.path("table"))["tensors"]
    keep_float, quantized_inputs, precision = [], [], ctx.cfg.precision
    if kinds.searched(precision.kind):
        found = ctx.results.get("sensitivity")
        if found is None or "qtable" not in found.files:
            raise ConfigError("precision=mixed needs the sensitivity stage: add it to pipeline.stages before build")
        table = read_json(found.path("table"))["tensors"]
        qtable = read_json(found.path("qtable"))
        keep_float, quantized_inputs = qtable["float_ops"], qtable.get("quantized_inputs", [])
    prepared = onnx.load(str(calibrate.path("prepared")), load_external_data=False)
    keep_float, unknown = _requested_float(ctx, prepared, keep_float)
    searched = kinds.searched(precision.kind) and bool(keep_float)  # mixed with ops kept float
    backend = backends.spec(ctx.cfg.target.backend.value)
    by_backend = _backend_float_ops(ctx, backend, prepared, keep_float)
    keep_float = [*keep_float, *by_backend["ops"]]
    quantized = ctx.out_dir / "quantized.onnx"
    settings = QdqSettings.resolve(precision, backend.NAME)
    # MatMuls of two activations unless precision.quantize_activation_matmuls: float by intent (verify)
    keep_float = [*keep_float, *(op for op in settings_float_ops(prepared, settings) if op not in keep_float)]
    try:
        slower = _slower_in_int8(ctx, backend, calibrate.path("prepared"), table, settings, keep_float)
        keep_float = [*keep_float, *slower["ops"]]
        refined = _from_refined_int8(ctx, table, settings, keep_float, by_backend["ops"], quantized,
                                     quantized_inputs) if searched else None
        if refined is None:
            build_qdq(calibrate.path("prepared"), table, quantized, settings, keep_float=keep_float)
    except QuantizerFailed as err:
        raise err.with_run(ctx)
    reshaped = gemm_bias_notes(prepared, settings)
    for fix in reshaped:
        log.info("build: Gemm %s: bias %s given to the quantizer as %s (per-channel weights need a vector)",
                 fix["op"], fix["bias_from"], fix["bias_to"])
    if refined is None:
        refined = _refinements(ctx, quantized, keep_float, searched)
    model = onnx.load(str(quantized))
    rewritten = settings.rewrite_for_runtime(model)  # after what needs the graph as quantized
    if any(rewritten.values()):  # verify's advice derives models with ops back in float from the one before
        quantized.replace(ctx.out_dir / UNFOLDED_QDQ)
        onnx.save(model, str(quantized))
    beside = sorted(settings.float_neighbours(prepared, keep_float) - set(keep_float))
    settings = {**settings.describe(), "float_ops": keep_float, "passthrough_float": beside,
                **({"quantized_inputs": quantized_inputs} if quantized_inputs else {}),
                "keep_float_not_found": unknown, "backend_float_ops": by_backend, "slower_in_int8": slower,
                "gemm_bias_reshaped": reshaped, **refined, **rewritten,
                "int8_ops": int8_op_count(model)}
    return quantized, settings


def _from_refined_int8(ctx: StageContext, table: dict, settings: QdqSettings, keep_float: List[str],
                       by_backend: List[str], quantized: Path, quantized_inputs: List[str]) -> Optional[dict]:
    """A mixed build keeping ops float, written to ``quantized``: the int8 build's refined
    all-int8 model (refine_as_int8) with those ops back in float (``quantized_inputs``: those
    of them reading their inputs quantized, keep_in_float), the very model the search
    measured and chose them on (stages/sensitivity.py), so that its refinements are not
    measured again on the mixed model (the real-size segmenter on AVX2: 100 s). Its
    refinements' summaries; None where mixed models are built by the quantizer itself."""
    if not settings.derives_mixed:
        return None
    found: dict = {}

    def refine(model: onnx.ModelProto) -> onnx.ModelProto:
        model, found["summaries"] = int8_refiner(ctx)(model)
        return model

    prepared = onnx.load(str(ctx.results["calibrate"].path("prepared")))
    always = [*ctx.cfg.precision.keep_float, *by_backend]  # float in the search's all-int8 model too
    onnx.save(MixedModels(prepared, table, settings, always, refine).build(keep_float, quantized_inputs), str(quantized))
    return {step: {**summary, "inherited": "the refined all-int8 model's, with the float ops restored"}
            for step, summary in found.get("summaries", {}).items()}


def _backend_float_ops(ctx: StageContext, backend, prepared: onnx.ModelProto, chosen: List[str]) -> dict:
    """The quantized ops the backend keeps in float on this target (Capabilities.float_op_kinds:
    ncnn's depthwise convolutions on x86, ONNX Runtime's ConvTransposes), beyond those chosen."""
    kinds, target = backends.float_op_kinds(backend, ctx.cfg.target), ctx.cfg.target
    ops = [name for name in backend_float_ops(backend, target, prepared, ctx.cfg.precision.quantize_ops)
           if name not in chosen]
    if ops:
        log.info("build: %d %s op(s) kept in float: %s has no faster int8 kernel for them here (docs/targets.md)",
                 len(ops), "/".join(kinds), backend.NAME)
    return {"kinds": kinds, "ops": ops}


def _slower_in_int8(ctx: StageContext, backend, prepared_path: Path, table: dict, settings: QdqSettings,
                    chosen: List[str]) -> dict:
    """precision.int8_where_faster: the quantized ops that are slower in int8 than in fp32 on
    this machine, each timed in the target's own fp32 and int8 builds on one validation sample
    (pipeline/precision/calibration/latency.py); they join the float ops."""
    if not ctx.cfg.precision.int8_where_faster:
        return {"ops": []}
    if not backend.CAPABILITIES.profiler:
        return {"ops": [], "skipped": f"{backend.NAME} has no per-layer profiler: int8 kept everywhere"}
    prepared = onnx.load(str(prepared_path))  # with its weights: both builds are made from it
    quantized = [node.name for node in prepared.graph.node
                 if node.op_type in settings.quantize_ops and node.name not in chosen]
    int8_model = MixedModels(prepared, table, settings, always_float=chosen).build(chosen)
    rewritten = settings.rewrite_for_runtime(int8_model)  # timed as built (an unwidened head: 11 ms in int8, 6 fp32)
    feeds = next(iter(ctx.dataset().validation)).feeds
    measured = latency.op_costs(prepared, int8_model, backend, ctx.cfg.target, feeds, quantized)
    if "error" in measured:
        return {"ops": [], "skipped": f"not measured: {measured['error']}"}
    ops = [op for op, entry in measured["ops"].items() if entry["int8_ms"] > 0 and entry["cost_ms"] < 0]
    log.info("build: %d of %d quantized ops are slower in int8 than in fp32 on this machine: kept in float",
             len(ops), len(quantized))
    return {"ops": ops, "measured": {**measured, "int8_as_built": rewritten}}


def _judged_on(ctx: StageContext, float_ops: List[str]):
    """Where a refinement of a mixed build that keeps ops in float must not lower the cosine:
    the validation samples the search met its target on (PP-OCRv4 rec on ORT: bias correction
    raised the calibration cosine and took the validation cosine from 0.9959 to 0.9947). None
    otherwise (the calibration samples): a mixed build with an empty qtable is the int8 build."""
    return ((sample.feeds for sample in ctx.dataset().validation)
            if kinds.searched(ctx.cfg.precision.kind) and float_ops else None)


# the QDQ model's refinements, in order: precision.<step>, its function, its empty result
REFINEMENTS = (("weight_rounding", weight_rounding.round_file, {"ops": []}),
               ("bias_correction", bias_correction.correct_file, {"corrected": {}}))
# model runs a refinement costs a calibration sample (the real-size segmenter, 16 samples of
# which it measures 8, a 257 ms probe: weight rounding 14.5 s, bias correction 25.1 s with
# precision=auto's reference answers computed beside them; since bias correction reads its
# shifts off the patch means, 2.3-3.5 s after weight rounding's pass, about 7 s with a pass
# of its own; docs/time.md), and a validation sample where a mixed build's refinement is
# judged on them
REFINEMENT_RUNS = {"weight_rounding": 4.0, "bias_correction": 2.0}
JUDGED_RUNS = 2.0
REFINED = "quantized.onnx"  # the refined model in a refinement's memo, whatever the file was called


def _refinements(ctx: StageContext, quantized: Path, float_ops: List[str], searched: bool) -> dict:
    """Every refinement's summary; judged on the validation samples (a mixed build keeping ops
    float), they share the fp32 outputs and each model's cosine (bias_correction.Judged).
    ``searched``: a mixed build keeping ops float (``_refine``)."""
    samples = _judged_on(ctx, float_ops)
    judged_on = None
    refining = any(_refines(ctx.cfg, backends.spec(ctx.cfg.target.backend.value), step) for step, _, _ in REFINEMENTS)
    if samples is not None and refining:
        prepared = onnx.load(str(ctx.results["calibrate"].path("prepared")))
        size = bias_correction.batch_size_for(prepared, [o.name for o in prepared.graph.output])
        judged_on = bias_correction.Judged(prepared, samples, size)
    memo = refining and ctx.cache_root is not None and not _has_external_data(quantized)  # the memo keeps one file
    # what every refinement's memo depends on beyond its step, hashed once for both steps
    shared = {"prepared": sha256_file(ctx.results["calibrate"].path("prepared")),
              "data": (hash_files(ctx.dataset().files), str(ctx.cfg.data)), "cpu": environment.fingerprint()} \
        if memo else None
    fp32_pass = bias_correction.Fp32Pass()  # weight rounding's, read by bias correction
    return {step: _refine(ctx, quantized, (judged_on, fp32_pass), step, refine_file, nothing, shared, searched)
            for step, refine_file, nothing in REFINEMENTS}


def refine_as_int8(ctx: StageContext, quantized: Path) -> dict:
    """The int8 build's refinements (weight rounding, bias correction) on an all-int8 Q/DQ
    file made elsewhere, in place: the mixed search's base model and mixed's plain int8
    baseline, so that the search measures what verify measures (the real-size segmenter on
    AVX2: plain int8 0.031 off the float map unrefined, 0.0115 built). Served from the int8
    build's memo where it refined the same file. Not where mixed models are built by the
    quantizer itself (QdqSettings.derives_mixed)."""
    if not QdqSettings.resolve(ctx.cfg.precision, ctx.cfg.target.backend.value).derives_mixed:
        return {}
    return _refinements(ctx, quantized, [], searched=False)


def int8_refiner(ctx: StageContext):
    """all-int8 Q/DQ model -> (the same refined by refine_as_int8, the refinements' summaries)."""
    def refine(model: onnx.ModelProto):
        with tempfile.TemporaryDirectory(prefix="parity-refine-") as scratch:
            path = Path(scratch) / "quantized.onnx"
            onnx.save(model, str(path))
            summary = refine_as_int8(ctx, path)
            return onnx.load(str(path)), summary
    return refine


def _refine(ctx: StageContext, quantized: Path, judging: tuple, step: str, refine_file, nothing: dict,
            shared: Optional[dict], searched: bool = False) -> dict:
    """precision.<step> on the QDQ model, in place where it brings the outputs closer to fp32
    (pipeline/precision/calibration/weight_rounding.py, bias_correction.py); the build's summary.
    ``judging``: (the validation samples it is judged on or None, weight rounding's fp32 pass
    that bias correction reads: bias_correction.Fp32Pass).
    A mixed build (``searched``: ops kept float by the search) does not measure a refinement
    that the all-int8 build of the same calibration measured and did not keep (bias correction
    took 23 s and was not kept on the real-size segmenter, then 23 s again for mixed)."""
    if not _refines(ctx.cfg, backends.spec(ctx.cfg.target.backend.value), step):
        return {"enabled": False}
    (judged_on, fp32_pass), label = judging, step.replace("_", " ")
    # what an all-int8 build's outcome depends on, without its QDQ model: a mixed build of the
    # same calibration, data, placement and CPU looks it up
    outcome = None if shared is None else {
        **shared, "step": step,
        "settings": QdqSettings.resolve(ctx.cfg.precision, backends.spec(ctx.cfg.target.backend.value).NAME).describe()}
    if searched and outcome is not None:
        found = peek(ctx.cache_root, f"build-{step}-all-int8", outcome)
        if found is not None and not read_json(found / "summary.json")["applied"]:
            log.info("build: %s not measured: the all-int8 build of this calibration did not keep it", label)
            return {"enabled": True, "applied": False, **nothing, "samples": 0, "seconds": 0.0,
                    "not_measured": "the all-int8 build of the same calibration measured it and did not keep it"}
    dataset = ctx.dataset()
    prepared = ctx.results["calibrate"].path("prepared")
    material = None if shared is None else {**shared, "step": step, "quantized": sha256_file(quantized),
                                            "judged_on_validation": judged_on is not None}
    if material is None or peek(ctx.cache_root, f"build-{step}", material) is None:  # it would be measured now
        runs = REFINEMENT_RUNS[step] * len(dataset.calibration) + \
            (JUDGED_RUNS * len(dataset.validation) if judged_on is not None else 0.0)
        why = deadline.cut(f"build's {label}", runs)
        if why is not None:
            return {"enabled": True, "applied": False, **nothing, "samples": 0, "seconds": 0.0, "cut": why}

    def refine(path: Path) -> dict:
        try:
            return refine_file(path, prepared, (sample.feeds for sample in dataset.calibration), judged_on=judged_on,
                               fp32_pass=fp32_pass)
        except Exception as err:  # noqa: BLE001 - ONNX Runtime rejects a cut-out op or extra outputs: build without it
            log.warning("build: %s skipped: %s", label, first_line(err))
            return {"enabled": True, "applied": False, **nothing, "error": first_line(err)}

    def produce(folder: Path) -> None:
        shutil.copyfile(quantized, folder / REFINED)
        write_json(folder / "summary.json", refine(folder / REFINED))

    if shared is None:  # no stage cache, or weights in files of their own
        return _logged(refine(quantized), label, judged_on, reused=False)
    # the same QDQ model from the same data refines alike whatever the target (ort_cpu and
    # ncnn_cpu build one; so do int8 and a mixed build keeping nothing float)
    folder, reused = ctx.memo(f"build-{step}", material, produce)
    summary = read_json(folder / "summary.json")
    if summary.get("applied"):
        shutil.copyfile(folder / REFINED, quantized)
    if not searched and not ctx.cfg.precision.keep_float and "error" not in summary:  # what mixed looks up
        ctx.memo(f"build-{step}-all-int8", outcome, lambda to: write_json(to / "summary.json",
                                                                           {"applied": bool(summary.get("applied"))}))
    return _logged(summary, label, judged_on, reused)


def _logged(summary: dict, label: str, judged_on, reused: bool) -> dict:
    if "error" in summary:
        return summary
    summary["judged_on"] = "validation" if judged_on is not None else "calibration"
    log.info("build: %s %s (%d calibration samples, %.1f s%s)", label,
             "kept" if summary["applied"] else "measured, not kept", summary.get("samples", 0),
             summary.get("seconds", 0.0), ", reused from the cache" if reused else "")
    return summary


def _has_external_data(path: Path) -> bool:
    model = onnx.load(str(path), load_external_data=False)
    return any(t.data_location == onnx.TensorProto.EXTERNAL for t in model.graph.initializer)
