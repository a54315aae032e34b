"""``validate``: the composed config turned into typed objects (pipeline/config/schemas.py)
and checked for what a schema cannot say (missing values, a precision the target's backend
cannot run, ranges, stage names), and one-line descriptions of Hydra/OmegaConf errors."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import fields
from pathlib import Path
from typing import List, Optional, get_type_hints

from hydra.core.config_store import ConfigStore
from hydra.errors import OverrideParseException
from hydra.plugins.config_source import ConfigLoadError
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, MissingMandatoryValue, OmegaConfBaseException

from pipeline import shapes
from pipeline.config.schemas import (MOVED_TARGET_KEYS, STAGE_NAMES, TARGET_SCHEMAS, Backend, DataConfig, DataKind,
                                     PreprocessConfig, RunConfig, TargetConfig, TuningConfig)
from pipeline.config.schemas import ActivationRanges, QuantType
from pipeline.errors import ConfigError
from pipeline.precision import kinds


def validate(cfg: DictConfig) -> RunConfig:
    """Typed config, or a ConfigError naming the key and what is allowed."""
    try:
        # Re-merging onto the schema also rejects keys added with Hydra's '+key=value'.
        checked = OmegaConf.merge(_schema(_named_backend(cfg)), OmegaConf.to_container(cfg, resolve=False))
        run: RunConfig = OmegaConf.to_object(checked)
    except MissingMandatoryValue as err:
        raise ConfigError(f"{err.full_key}: a value is required (set {err.full_key}=...)") from err
    except OmegaConfBaseException as err:
        raise ConfigError(describe_config_error(err)) from err
    _check_combinations(run)
    return run


@functools.lru_cache(maxsize=None)
def _schema(backend: Optional[Backend]) -> DictConfig:
    """RunConfig's schema with ``backend``'s target schema (the base one for None), once per
    process (auto validates every candidate; merge copies it): a copy of the nodes Hydra's
    ConfigStore holds where resolvers.register stored them (OmegaConf.structured took
    0.04-0.08 s, a copy 0.01)."""
    schema = _stored("parity_schema.yaml", RunConfig)
    schema.target = (_stored(f"schema/target/{backend.value}.yaml", TARGET_SCHEMAS[backend]) if backend
                     else OmegaConf.structured(TargetConfig))
    return schema


def _stored(name: str, schema_type: type) -> DictConfig:
    try:
        return ConfigStore.instance().load(name).node  # a copy
    except ConfigLoadError:  # not registered: validate called outside the CLI
        return OmegaConf.structured(schema_type)


def _named_backend(cfg: DictConfig) -> Optional[Backend]:
    """The backend the config names, or None for one parity does not know (whose value the
    merge onto the base target schema then rejects)."""
    named = OmegaConf.select(cfg, "target.backend", default=None)
    named = named.value if isinstance(named, Backend) else named
    return next((backend for backend in TARGET_SCHEMAS if backend.value == named), None)


def _check_combinations(run: RunConfig) -> None:
    from pipeline import backends

    backend = backends.spec(run.target.backend.value)
    can = backend.CAPABILITIES
    if run.precision.kind not in (*can.precisions, kinds.AUTO):
        raise ConfigError(
            f"precision={run.precision.kind} is not supported by target {run.target.name} "
            f"(backend {backend.NAME}); allowed: {', '.join(can.precisions)}")
    if run.target.memory_mode not in can.memory_modes:
        raise ConfigError(
            f"target.memory_mode={run.target.memory_mode}: backend {backend.NAME} has no "
            f"such memory mode; allowed: {', '.join(can.memory_modes)}")
    if run.target.device.upper() not in can.devices:
        raise ConfigError(f"target.device={run.target.device}: backend {backend.NAME} supports "
                          f"{', '.join(can.devices)}")
    problem = (backend.check_config(run.target, run.precision.kind)
               if run.precision.kind != kinds.AUTO else None)
    if problem:
        raise ConfigError(problem)
    unknown = [s for s in run.pipeline.stages if s not in STAGE_NAMES]
    if unknown:
        raise ConfigError(f"pipeline.stages: unknown stage {unknown[0]!r}; allowed: {', '.join(STAGE_NAMES)}")
    if run.data.kind is not DataKind.random and not run.data.path:
        raise ConfigError(f"data.path: a value is required for data.kind={run.data.kind.value} "
                          "(or use data.kind=random)")
    if run.validation.layerwise_samples < 1 or run.validation.worker_timeout_s <= 0:
        raise ConfigError("validation.layerwise_samples must be >= 1 and validation.worker_timeout_s > 0")
    _check_data(run.data)
    cal = run.calibration
    if not 0 < cal.percentile <= 100:
        raise ConfigError(f"calibration.percentile={cal.percentile}: must be in (0, 100]")
    if cal.bins < cal.quantized_levels or cal.quantized_levels < 2 or cal.batch_size < 1:
        raise ConfigError("calibration: need bins >= quantized_levels >= 2 and batch_size >= 1")
    _check_sensitivity_methods(run.sensitivity.methods)
    profile = run.profile
    if profile.runs < 1 or profile.warmup < 0 or profile.top < 1 or profile.worker_timeout_s <= 0 \
            or profile.max_seconds <= 0 or profile.startup_rounds < 0:
        raise ConfigError("profile: need runs >= 1, warmup >= 0, top >= 1, max_seconds > 0, startup_rounds >= 0 "
                          "and worker_timeout_s > 0")
    if run.precision.int8_where_faster and run.precision.kind in can.own_int8:
        raise ConfigError(f"precision.int8_where_faster: {backend.NAME} builds {run.precision.kind} with its own "
                          "quantizer, not from parity's Q/DQ model whose ops it times; set it to false")
    _check_activation_ranges(run, backend)
    _check_smoothing(run.precision.smoothing)
    if kinds.quantized(run.precision.kind) and not run.precision.quantize_ops:
        raise ConfigError("precision.quantize_ops: name at least one op type (default: Conv, ConvTranspose, Gemm, MatMul)")
    if run.target.threads < 0:
        raise ConfigError("target.threads must be >= 0 (0 = the runtime's default)")
    _check_tuning(run.tuning, backend)
    check_ranges(run)
    _check_metric(run)


def _check_sensitivity_methods(methods: List[str]) -> None:
    """sensitivity.methods: the threshold methods of pipeline/precision/calibration/thresholds.py."""
    from pipeline.precision.calibration.thresholds import METHODS

    unknown_methods = sorted(set(methods) - set(METHODS))
    if unknown_methods or not methods:
        raise ConfigError(f"sensitivity.methods: {unknown_methods or 'empty'}; allowed: {', '.join(METHODS)}")


def _check_smoothing(value) -> None:
    """precision.smoothing: null, auto or an alpha in [0, 1] (pipeline/precision/smoothing.py)."""
    from pipeline.precision.smoothing import parse

    try:
        parse(value)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def _check_activation_ranges(run: RunConfig, backend) -> None:
    """precision.activation_ranges=dynamic: int8 on a backend declaring dynamic_int8, with no
    setting that only a static (calibrated) build has. Float precisions ignore it, as the
    other int8 keys."""
    precision, can = run.precision, backend.CAPABILITIES
    if precision.activation_ranges is not ActivationRanges.dynamic or not kinds.quantized(precision.kind):
        return
    if not can.dynamic_int8:
        raise ConfigError(f"precision.activation_ranges=dynamic is not supported by target {run.target.name} "
                          f"(backend {backend.NAME}); allowed: static")
    if kinds.dynamic_variant(precision.kind) is None:  # mixed
        raise ConfigError(f"precision.activation_ranges=dynamic: precision={precision.kind} searches on static ranges; "
                          f"use precision={kinds.partial_of(precision.kind)} (precision.keep_float keeps ops float) or "
                          "activation_ranges=static")
    if precision.activations is QuantType.int8:
        raise ConfigError("precision.activations=int8: dynamic activation ranges quantize to uint8 (ONNX Runtime's "
                          "DynamicQuantizeLinear); set precision.activations=uint8 or activation_ranges=static")
    if precision.int8_where_faster:
        raise ConfigError("precision.int8_where_faster times the ops of parity's static Q/DQ model, not a dynamic "
                          "build's; set it to false")
    if run.calibration.table:
        raise ConfigError("calibration.table: a build with precision.activation_ranges=dynamic computes activation "
                          "ranges per call and reads no table; drop calibration.table or set activation_ranges=static")


COSINE = (-1.0, 1.0)
DROP = (-1.0, 1.0)  # a task metric's drop, as a fraction; negative: the target must beat the reference
# Thresholds and counts with a range (lowest, highest; None: unbounded). SQNR thresholds
# take any real number (dB); a value that is None in the config is not checked.
RANGES = {
    "precision.min_cosine": COSINE, "precision.layer_min_cosine": COSINE, "precision.max_metric_drop": DROP,
    "precision.budget_s": (0.0, None),
    "validation.min_cosine": COSINE, "validation.layer_min_cosine": COSINE,
    "precision.task_min_cosine": COSINE, "validation.task_min_cosine": COSINE,
    "validation.max_abs_error": (0.0, None), "validation.max_mean_abs_error": (0.0, None),
    "validation.max_metric_drop": DROP, "validation.layerwise_samples": (1, None),
    "validation.diagnosis_budget": (0.0, None), "validation.diagnosis_min_seconds": (0.0, None),
    "validation.timing_stream_samples": (0, None), "validation.max_memory_mb": (1.0, None),
    "validation.timing_round_ms": (0.0, None), "validation.timing_tight_spread": (1.0, None),
    "validation.timing_processes": (1, None),
    "calibration.min_samples": (1, None), "calibration.auto_samples": (1, None),
    "calibration.kl_max_clipped": (0.0, 1.0),
    "sensitivity.expected_cos": COSINE, "sensitivity.max_drop": DROP, "sensitivity.samples": (1, None), "sensitivity.max_ranked": (1, None),
    "sensitivity.top_n": (0, None), "sensitivity.screen": (0, None), "sensitivity.max_float_ops": (0, None),
    "tuning.verify_samples": (1, None),
}
OUTPUT_RANGES = {"min_cosine": COSINE, "max_abs_error": (0.0, None), "max_mean_abs_error": (0.0, None),
                 "min_agreement": (0.0, 1.0)}


def check_ranges(run: RunConfig) -> None:
    """Every threshold and count of RANGES (and each validation.outputs override) in its
    range, else a ConfigError naming the key, the value and the range; no NaN anywhere."""
    values = [(key, functools.reduce(getattr, key.split("."), run), allowed) for key, allowed in RANGES.items()]
    for output, override in run.validation.outputs.items():
        values += [(f"validation.outputs.{output}.{name}", getattr(override, name), allowed)
                   for name, allowed in OUTPUT_RANGES.items()]
    values += [(f"validation.outputs.{output}.min_sqnr_db", o.min_sqnr_db, (None, None))
               for output, o in run.validation.outputs.items()]
    values.append(("validation.min_sqnr_db", run.validation.min_sqnr_db, (None, None)))
    shapes.parse_all(run.model.input_shapes)  # dims >= 1, min <= opt <= max
    for key, value, (low, high) in values:
        if value is None:
            continue
        if value != value or (low is not None and value < low) or (high is not None and value > high):
            raise ConfigError(f"{key}={value} is out of range: {_describe_range(low, high)}")


def _describe_range(low, high) -> str:
    if low is None and high is None:
        return "a number (not NaN)"
    if high is None:
        return f"must be >= {low}"
    return f"must be in [{low}, {high}]"


RESIZE_POLICIES = ("fixed", "limit_side", "height")


def _check_resize(pre: PreprocessConfig) -> None:
    resize = pre.resize
    fixed = isinstance(resize, list) and len(resize) == 2 and all(isinstance(d, int) and d >= 1 for d in resize)
    if not (resize is None or fixed or resize in RESIZE_POLICIES):
        raise ConfigError(f"data.preprocess.resize={resize!r}: give [height, width] or one of "
                          f"{', '.join(RESIZE_POLICIES)} (null: the model input's size)")
    if pre.multiple_of < 1 or (pre.side is not None and pre.side < 1):
        raise ConfigError("data.preprocess.multiple_of and data.preprocess.side must be >= 1")


def _check_data(data: DataConfig) -> None:
    _check_resize(data.preprocess)
    if (data.calibration_size is not None and data.calibration_size < 0) or \
            (data.validation_size is not None and data.validation_size < 1):
        raise ConfigError("data.validation_size must be >= 1 and data.calibration_size >= 0 (null: every sample found)")
    if data.calibration_cap < 0 or data.validation_cap < 1:
        raise ConfigError("data.validation_cap must be >= 1 and data.calibration_cap >= 0")
    if (data.kind is DataKind.custom) != bool(data.preprocess._target_):
        raise ConfigError("data.kind=custom reads files with data.preprocess._target_ (module.callable taking a "
                          "file path): set both, or neither")
    if (data.kind is DataKind.text) != bool(data.tokenizer):
        raise ConfigError("data.kind=text tokenizes texts with data.tokenizer (a Hugging Face tokenizer.json): "
                          "set both, or neither")
    if data.max_length is not None and data.max_length < 1:
        raise ConfigError(f"data.max_length={data.max_length}: must be >= 1 (null: no truncation)")


def _check_metric(run: RunConfig) -> None:
    """Instantiating the metric at start: a wrong _target_, path or argument is a one-line
    error before any work (a metric's import loads no model). An output name is a string
    however it looks (Hydra reads ``metric.output=461`` as an int; torch.onnx.export names
    outputs by number), and every output the config names must be the model's."""
    from pipeline.metrics import load_metric, output_names

    names = output_names((run.metric or {}).get("output"))
    if names:
        run.metric["output"] = names[0] if len(names) == 1 else list(names)
    if len(names) > 2:
        raise ConfigError(f"metric.output names {len(names)} outputs; a metric reads one, or two (a detector's boxes "
                          "and scores, metric.format=pair)")
    _check_pair(load_metric(run.metric), names)
    outputs = model_outputs(run.model.path)
    if outputs is None:  # convert says what is wrong with the file
        return
    named = [*(("metric.output", name) for name in names), ("validation", run.validation.task_output),
             *(("validation", name) for name in run.validation.outputs)]
    for key, name in named:
        if name is not None and name not in outputs:
            raise ConfigError(f"{key}: the model has no output {name!r}; outputs: {', '.join(outputs)}")


def _check_pair(metric, names) -> None:
    """Two outputs go to a metric that reads a pair (detection's pair format, a custom
    metric), and detection's pair format gets two: one line where they disagree."""
    from pipeline.metrics import BUILTIN_NAMES, Detection

    score = metric.score if metric is not None else None
    if isinstance(score, Detection) and score.format == "pair" and len(names) != 2:
        given = f"names one, {names[0]!r}" if names else "names none"
        raise ConfigError(f"metric.format=pair reads two outputs, boxes [1, N, 4] then scores [1, N, C], and "
                          f"metric.output {given}: name both in that order, e.g. metric.output=[boxes,scores]")
    one = isinstance(score, tuple(builtin for builtin, _ in BUILTIN_NAMES)) or (
        isinstance(score, Detection) and score.format not in ("auto", "pair"))
    if len(names) == 2 and one:
        raise ConfigError(f"metric.output={list(names)}: metric {metric.name} reads one output; two (boxes, then "
                          "scores) are for metric=detection metric.format=pair")


def model_outputs(path: str) -> Optional[List[str]]:
    """The ONNX file's graph output names, or None when it cannot be read here."""
    file = Path(str(path)).expanduser()
    try:
        if not file.is_file():  # a FIFO or a device would block or never end: convert names it
            return None
        return _outputs_of(str(file.resolve()), file.stat().st_mtime_ns, file.stat().st_size)
    except OSError:
        return None


@functools.lru_cache(maxsize=8)
def _outputs_of(path: str, mtime_ns: int, size: int) -> Optional[List[str]]:
    """(cached by the file's path, time and size: auto validates each candidate's config)"""
    import onnx

    try:
        return [o.name for o in onnx.load(path, load_external_data=False).graph.output]
    except Exception:  # noqa: BLE001 - not an ONNX file: convert's error names it
        return None


def _check_tuning(tuning: TuningConfig, backend) -> None:
    if (tuning.warmup is not None and tuning.warmup < 0) or (tuning.repeats is not None and tuning.repeats < 3):
        raise ConfigError("tuning: warmup must be >= 0 and repeats >= 3")
    if not 0 <= tuning.noise < 1 or tuning.verify_samples < 1:
        raise ConfigError("tuning: noise must be in [0, 1) and verify_samples >= 1")
    other = [d for d in tuning.devices if d.upper() not in backend.CAPABILITIES.devices]
    if other:
        raise ConfigError(f"tuning.devices: backend {backend.NAME} has no device {other[0]!r}; "
                          f"allowed: {', '.join(backend.CAPABILITIES.devices)}")


def describe_config_error(err: BaseException) -> str:
    """One line from a Hydra/OmegaConf error chain: the key and the complaint."""
    chain = []
    while err is not None:
        chain.append(err)
        err = err.__cause__ or err.__context__
    for item in chain:
        if isinstance(item, OverrideParseException):
            return _unparsable_override(item)
        if isinstance(item, OmegaConfBaseException) and getattr(item, "full_key", None):
            msg = str(getattr(item, "msg", "") or item).splitlines()[0]
            allowed = _allowed_keys(item) if isinstance(item, (ConfigKeyError, ConfigAttributeError)) else None
            return f"{item.full_key}: {msg}" + (f"; allowed keys: {', '.join(allowed)}" if allowed else "") \
                + _key_hint(item.full_key, msg)
    first = str(chain[-1]).strip().splitlines() or [type(chain[-1]).__name__]
    return first[0]


def _unparsable_override(err) -> str:
    """Hydra's grammar takes unquoted values of ASCII letters, digits and a few symbols: a
    path with a space or a non-ASCII letter must be quoted."""
    override = str(err.override)
    key, _, value = override.partition("=")
    odd = sorted({c for c in value if not c.isascii() or c.isspace()})
    why = f"{', '.join(repr(c) for c in odd)} cannot stand unquoted" if odd else "Hydra cannot parse it"
    return (f"override {override!r}: {why}; quote the value: \"{key}='{value}'\" "
            "(https://hydra.cc/docs/advanced/override_grammar/basic)")


def _key_hint(full_key: str, msg: str) -> str:
    parent, _, key = full_key.rpartition(".")
    if parent == "target" and key in MOVED_TARGET_KEYS:
        moved = MOVED_TARGET_KEYS[key]
        return f"; it moved to {moved} ({moved.split('.')[1]} targets only)"
    if parent == "target" and key in {backend.value for backend in TARGET_SCHEMAS}:
        return (f"; target.{key}.* applies to targets of backend {key} only (a target config of your own "
                f"starts with defaults: [/schema/target/{key}@_here_, _self_])")
    return f"; to add a key use +{full_key}=..." if "not in struct" in msg else ""


def _allowed_keys(err: OmegaConfBaseException) -> Optional[List[str]]:
    """The schema's field names where the unknown key was set (None if not a schema node)."""
    if dataclasses.is_dataclass(getattr(err, "object_type", None)):
        return [f.name for f in dataclasses.fields(err.object_type)]
    node = RunConfig
    for part in err.full_key.split(".")[:-1]:
        hints = get_type_hints(node) if dataclasses.is_dataclass(node) else {}
        node = hints.get(part)
        if node is None:
            return None
    return [f.name for f in dataclasses.fields(node)] if dataclasses.is_dataclass(node) else None
