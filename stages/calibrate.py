"""calibrate: activation statistics from one streaming pass over the calibration set
(shared by every threshold method through the cache), thresholds per tensor with the
configured method, and the calibration table with its TPU-MLIR and ONNX Runtime exports.
Runs only for precisions that quantize (int8)."""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np
import onnx

from pipeline.artifacts import hash_files, sha256_file, write_json
from pipeline import backends, deadline, shapes
from pipeline.precision import equalization, fp16, kinds, smoothing
from pipeline.precision.calibration import auto, statistics, tables, thresholds
from pipeline.console import progress_bar
from pipeline.errors import BackendUnavailable, ConfigError, InputError, first_line
from pipeline.precision.calibration.fake_quant import FakeQuantModel
from pipeline.precision.calibration.measure import OutputJudge
from pipeline.precision.prepare import prepare
from pipeline.precision.quantize import QdqSettings, write_ort_cache
from stages import StageContext, StageResult
from stages.convert import refuse_quantized
from stages.results import CalibrateSummary

NAME = "calibrate"
CACHEABLE = True
READS = {"convert": ["model"]}  # not the OpenVINO IR: targets share calibration
# mean_min_max is left out: judged at the outputs it lost on PP-OCRv4 det and rec (docs/calibration.md)
AUTO_CANDIDATES = ("kl", "percentile", "mse", "max")
ORT_QUANTIZE_CACHE = "ort_quantize_cache.json"  # quantize_static(calibration_cache_path=...)
CANDIDATES = "candidates.json"  # every method's entry per tensor, for the sensitivity search
FP16_FINDINGS = "fp16_findings.json"  # what fp16 cannot hold, for fp16 builds
# model runs equalization costs a calibration sample (the real-size segmenter: 13 s of 16
# samples at a 257 ms probe since it judges on a subsample and reads the statistics' channel
# maxima; 40.7 s at 244 ms before; docs/time.md)
EQUALIZATION_RUNS = 4.0


def needed(cfg) -> bool:
    return kinds.calibrated(cfg.precision.kind) and not cfg.precision.dynamic_ranges  # fp16: its pre-flight


def _not_needed(cfg) -> str:
    if cfg.precision.dynamic_ranges:
        return (f"precision {cfg.precision.kind} with precision.activation_ranges=dynamic: activations are quantized "
                "over each call's own range at run time, no calibration")
    return f"precision {cfg.precision.kind} needs no calibration"


def key_config(cfg):
    if not needed(cfg):  # a dynamic build's skip says why in its own words: its own key
        return {"needed": False, **({"activation_ranges": "dynamic"} if cfg.precision.dynamic_ranges else {})}
    return {"needed": True, "calibration": cfg.calibration, "data": cfg.data,
            "activations": cfg.precision.activations, "precision": _calibrated_as(cfg), "around": _measured_around(cfg),
            # auto's choice measures int8 models built with these (_auto_at_outputs); never with
            # precision.keep_float: a rerun applying advice gets the table its trial was built with
            "auto": QdqSettings.resolve(cfg.precision, backends.REFERENCE) if _judged_at_outputs(cfg) else None,
            "smoothing": _smoothing_key(cfg), "equalization": _equalization_key(cfg)}


def _calibrated_as(cfg) -> str:
    """int8 and mixed share one calibration (the same table, and every method's entries for
    the search): a later run or precision=auto's other candidate is served from the cache."""
    return kinds.partial_of(cfg.precision.kind) or cfg.precision.kind


def _measured_around(cfg):
    """The op types whose tensors calibration measures: for int8 and mixed the ones they can
    quantize (the inputs and outputs of precision.quantize_ops: 55 of PP-OCRv4 rec's 405
    activations); fp16's pre-flight looks at every activation (None)."""
    return sorted(cfg.precision.quantize_ops) if kinds.quantized(cfg.precision.kind) else None


def _judged_at_outputs(cfg) -> bool:
    """calibration=auto for an int8 build: the final choice is measured at the outputs."""
    return cfg.calibration.method.value == "auto" and kinds.quantized(cfg.precision.kind)


def external_files(ctx: StageContext) -> List[Path]:
    if not needed(ctx.cfg):
        return []
    table = [Path(ctx.cfg.calibration.table).expanduser()] if ctx.cfg.calibration.table else []
    return ctx.dataset().files + [t for t in table if t.is_file()]



def run(ctx: StageContext) -> StageResult:
    cfg = ctx.cfg
    if not needed(cfg):
        return StageResult(ctx.out_dir, {}, CalibrateSummary.from_json({"skipped": _not_needed(cfg)}))
    refuse_quantized(ctx)
    model_path = ctx.out_dir / "prepared.onnx"
    try:
        prepare(ctx.results["convert"].path("model"), model_path)
    except Exception as err:  # noqa: BLE001 - ORT's optimizer rejects the graph
        raise BackendUnavailable(f"int8: ONNX Runtime cannot prepare the model for quantization: "
                                 f"{first_line(err)}") from err
    # the prepared model's statistics serve equalization's judge and, beyond the tensors it
    # scales, the table: one pass over the calibration set instead of two
    base = None if cfg.calibration.table else _statistics(ctx, model_path, channels=_channel_tensors(cfg, model_path))
    judged: dict = {}  # the judges' fp32 outputs and statistics of the prepared model
    equalized = _equalize(ctx, model_path, base, judged)  # the statistics, the table and the build use the model
    smoothed = _smooth(ctx, model_path, base, judged if not (equalized or {}).get("applied") else None)
    if cfg.calibration.table:
        table, summary = _imported_table(Path(cfg.calibration.table).expanduser(), model_path)
    else:
        table, summary = _computed_table(ctx, model_path, _final_statistics(ctx, model_path, base, equalized,
                                                                             smoothed))
    if smoothed is not None:
        summary["smoothing"] = smoothed
    if equalized is not None:
        summary["equalization"] = equalized
    activations = cfg.precision.activations.value
    write_json(ctx.out_dir / "calibration.json", {"method": summary["method"], "tensors": table})
    exports = tables.write_exports(table, ctx.out_dir)  # TPU-MLIR; ORT's write_calibration_table files
    write_ort_cache(table, activations, ctx.out_dir / ORT_QUANTIZE_CACHE)  # exactly the ranges the build uses
    files = {"prepared": "prepared.onnx", "table": "calibration.json", "ort_quantize_cache": ORT_QUANTIZE_CACHE,
             **{role: name for role, name in (("candidates", CANDIDATES), ("fp16_findings", FP16_FINDINGS))
                if (ctx.out_dir / name).exists()},
             **{kind: path.name for kind, path in exports.items()}}
    return StageResult(ctx.out_dir, files, CalibrateSummary.from_json(summary),
                       cache=not (equalized or {}).get("cut"))


def _smoothing_key(cfg):
    """What the smoothing decision depends on: the setting, and for auto how its candidates
    are judged (the reference's Q/DQ placement, the judge's method; not precision.keep_float,
    like auto's table)."""
    if not kinds.quantized(cfg.precision.kind) or cfg.calibration.table:
        return None
    setting = smoothing.parse(cfg.precision.smoothing)
    return {"setting": setting,
            "judged": QdqSettings.resolve(cfg.precision, backends.REFERENCE) if setting == "auto" else None}


def _equalization_key(cfg):
    """What equalization depends on: on or off, and how it is judged (the reference's Q/DQ
    placement, the judge's method)."""
    if not kinds.quantized(cfg.precision.kind) or cfg.calibration.table:
        return None
    return {"enabled": cfg.precision.equalization,
            "judged": QdqSettings.resolve(cfg.precision, backends.REFERENCE) if cfg.precision.equalization else None}


def _equalize(ctx: StageContext, model_path: Path, base, judged: dict):
    """precision.equalization for int8 and mixed (pipeline/precision/equalization.py):
    prepared.onnx rewritten with outlier channels scaled across Conv pairs, where the int8
    model does better with it; the summary, or None where it does not apply. ``base``: the
    prepared model's statistics, the judge's own where it judges on the whole calibration set."""
    cfg = ctx.cfg
    if _equalization_key(cfg) is None:
        return None
    split = ctx.dataset().calibration
    why = deadline.cut("calibrate's equalization", EQUALIZATION_RUNS * len(split))
    if why is not None:
        return {"enabled": True, "applied": False, "cut": why}
    prepared = onnx.load(str(model_path))
    judged_on = statistics.judge_samples(split, base[0] if base is not None else None)
    whole = base[0] if base is not None and len(judged_on) == len(split) else None
    if base is not None and whole is None:
        _judge_table_from_bounds(cfg, base[0], judged_on, judged)
    model, summary = equalization.choose(prepared, split, cfg.precision.equalization,
                                         QdqSettings.resolve(cfg.precision, backends.REFERENCE),
                                         _judge_tables(cfg, prepared), base_statistics=whole, judged_on=judged_on,
                                         maxima=base[0].channel_maxima if base is not None else None, shared=judged)
    if summary["applied"]:
        onnx.save(model, str(model_path))
    return summary


def _judge_table_from_bounds(cfg, stats, judged_on, judged: dict) -> None:
    """The judges' table on the samples ``judged_on`` into ``judged`` (what they share), where
    it is a max table: read off the statistics pass's per-sample bounds instead of a pass of
    the judges' own over those samples (the real-size segmenter: 4 samples, 3 s)."""
    names = [sample.name for sample in judged_on]
    bounds = stats.bounds_over(names) if set(_judge_methods(cfg)) == {"max"} else None
    if bounds is not None:
        judged.update(samples=names, base_table={name: smoothing.range_entry(*found) for name, found in bounds.items()})


def _judge_methods(cfg) -> tuple:
    """(the int8 judges' method: the calibration method, or smoothing.JUDGE_METHOD for auto;
    the model inputs' own, calibration.inputs where it is one method)."""
    method = cfg.calibration.method.value if cfg.calibration.method.value in thresholds.METHODS \
        else smoothing.JUDGE_METHOD
    inputs = cfg.calibration.inputs.value if cfg.calibration.inputs and \
        cfg.calibration.inputs.value in thresholds.METHODS else method
    return method, inputs


def _judge_tables(cfg, prepared):
    """make_table(statistics) of the int8 judges (equalization, smoothing): every tensor at
    _judge_methods' method, the model inputs at theirs."""
    options, inputs = _method_options(cfg.calibration), {i.name for i in prepared.graph.input}
    method, input_method = _judge_methods(cfg)

    def make_table(stats) -> Dict[str, dict]:
        return {name: _entry(stats, name, input_method if name in inputs else method, options)
                for name in stats.histograms}

    return make_table


def _smooth(ctx: StageContext, model_path: Path, base, judged: Optional[dict]):
    """precision.smoothing for int8 and mixed (pipeline/precision/smoothing.py): prepared.onnx
    rewritten with the activations' outlier channels moved into the weights, when a fixed
    alpha is set or auto measures it better; the summary, or None where it does not apply
    (fp16, an imported table whose tensors are the unsmoothed model's). ``judged``: what
    equalization's judge learnt of the prepared model, None where equalization rewrote it
    (then neither that nor the statistics' channel maxima are the model's)."""
    cfg = ctx.cfg
    if _smoothing_key(cfg) is None:
        return None
    setting = smoothing.parse(cfg.precision.smoothing)
    prepared = onnx.load(str(model_path))
    split = ctx.dataset().calibration
    judged_on = statistics.judge_samples(split, base[0] if base is not None else None)
    model, summary = smoothing.choose(prepared, split, setting, QdqSettings.resolve(cfg.precision, backends.REFERENCE),
                                      (), _judge_tables(cfg, prepared), judged_on=judged_on, shared=judged,
                                      maxima=base[0].channel_maxima if base is not None and judged is not None else None)
    if summary["applied"]:
        onnx.save(model, str(model_path))
    return summary


def _channel_tensors(cfg, model_path: Path) -> Dict[str, int]:
    """The tensors whose channel maxima the statistics pass keeps, with their channel axis:
    what equalization would scale (its pairs' producers' outputs, axis 1) and what smoothing
    would divide (its groups' activations, the last axis): neither needs a pass of its own."""
    prepared = onnx.load(str(model_path), load_external_data=False)
    found: Dict[str, int] = {}
    if _smoothing_key(cfg) is not None and smoothing.parse(cfg.precision.smoothing) is not None:
        found.update({group.source: -1 for group in smoothing.groups(prepared, QdqSettings.resolve(
            cfg.precision, backends.REFERENCE).quantize_ops)})
    if _equalization_key(cfg) is not None and cfg.precision.equalization:
        found.update({pair.tensor: 1 for pair in equalization.pairs(prepared)})
    return found


def _statistics(ctx: StageContext, model_path: Path, only=None, channels: Dict[str, int] = None):
    """(statistics of the model's measured tensors over the calibration set, seconds, reused
    from the cache); ``only``: just these tensors (a pass that outputs only them); ``channels``:
    tensors whose channel maxima are kept too."""
    cfg = ctx.cfg.calibration
    dataset = ctx.dataset()
    split = dataset.calibration
    if len(split) == 0:
        raise InputError("calibration: no calibration samples (set data.calibration_size >= 1)")
    material = {"model": sha256_file(model_path), "data": hash_files(dataset.files), "split": split.names,
                "data_config": str(ctx.cfg.data), "bins": cfg.bins, "batch_size": cfg.batch_size,
                "keep": cfg.auto_samples, "sample_ranges": True, "around": _measured_around(ctx.cfg),
                **({"channels": sorted(channels.items())} if channels else {}),
                **({"only": sorted(only)} if only is not None else {})}
    started = time.perf_counter()

    def collect(out: Path) -> None:
        with progress_bar() as progress:
            task = progress.add_task("calibration statistics", total=len(split))
            statistics.collect(model_path, split, len(split), cfg.bins, cfg.batch_size, cfg.auto_samples,
                               progress=lambda n: progress.advance(task, n), around=_measured_around(ctx.cfg),
                               only=set(only) if only is not None else None, channels=channels or {}).save(out)

    folder, reused = ctx.memo("calibration-statistics", material, collect)
    return statistics.Statistics.load(folder), time.perf_counter() - started, reused


def _final_statistics(ctx: StageContext, model_path: Path, base, equalized, smoothed):
    """The statistics of the model the build quantizes: the prepared model's, with the tensors
    equalization scaled and smoothing divided measured again on the rewritten model (every
    other tensor computes the same values; a full pass again took 8 of rec's 36 s calibrate)."""
    changed = [*((equalized or {}).get("scaled_tensors") or []), *((smoothed or {}).get("smoothed_tensors") or [])]
    if not changed:
        return base
    scaled, seconds, reused = _statistics(ctx, model_path, only=sorted(set(changed)))
    stats, base_seconds, base_reused = base
    measured = statistics.activation_names(onnx.load(str(model_path), load_external_data=False),
                                           _measured_around(ctx.cfg))
    return stats.merged(scaled, measured), base_seconds + seconds, base_reused and reused


def _computed_table(ctx: StageContext, model_path: Path, measured):
    cfg = ctx.cfg.calibration
    dataset = ctx.dataset()
    split = dataset.calibration
    warnings = list(dataset.warnings)
    if len(split) < cfg.min_samples:
        warnings.append(f"only {len(split)} calibration samples (calibration.min_samples={cfg.min_samples}): "
                        "thresholds may not represent real inputs")
    stats, collected, reused = measured
    started = time.perf_counter() - collected
    precision = ctx.cfg.precision.kind
    every_method = _candidates(stats, cfg) if kinds.quantized(precision) else None
    table, choices, decision = _thresholds(stats, ctx, model_path, every_method)
    if every_method is not None:
        write_json(ctx.out_dir / CANDIDATES, every_method)
    if kinds.narrow(precision):  # what fp16 cannot hold
        write_json(ctx.out_dir / FP16_FINDINGS, fp16.activation_findings(stats.histograms)
                   + fp16.constant_findings(onnx.load(str(model_path))))
    zero = sorted(name for name, h in stats.histograms.items() if h.abs_max == 0)
    if zero:
        warnings.append(f"{len(zero)} tensors are always zero (threshold floor {thresholds.MIN_THRESHOLD:g}): "
                        + ", ".join(zero[:5]) + (" ..." if len(zero) > 5 else ""))
    summary = {
        "method": cfg.method.value,
        "tensors": len(table),
        "samples": stats.samples,
        "batch_size": stats.batch_size,
        # how samples were batched: stacked on each input's batch axis, or why one at a time
        "batching": stats.batch_note or "samples stacked on each input's batch axis",
        "statistics": "reused" if reused else "computed",
        "statistics_seconds": round(collected, 4),
        "thresholds_seconds": round(time.perf_counter() - started - collected, 4),
        "methods_chosen": dict(Counter(entry["method"] for entry in table.values())),
        "zero_tensors": zero,
        "warnings": warnings,
        "auto": choices,
        "auto_choice": decision,
    }
    return table, summary


def _thresholds(stats, ctx: StageContext, model_path: Path, every_method=None):
    """The table for the configured method; every_method: entries already computed for
    all base methods (mixed), reused instead of computed again."""
    cfg = ctx.cfg.calibration
    options = _method_options(cfg)
    model = onnx.load(str(model_path), load_external_data=False)
    inputs = {i.name for i in model.graph.input}
    candidates: Dict[str, Dict[str, dict]] = {}
    for name, histogram in stats.histograms.items():
        method = cfg.inputs.value if name in inputs and cfg.inputs else cfg.method.value
        methods = AUTO_CANDIDATES if method == "auto" else (method,)
        candidates[name] = {m: every_method[name][m] if every_method else
                            _entry(stats, name, m, options) for m in methods}
    undecided = {name: entries for name, entries in candidates.items() if len(entries) > 1}
    choices = auto.choose(model, stats.kept, undecided, ctx.cfg.precision.activations.value) if undecided else {}
    table = {name: entries[choices[name]["method"]] if name in choices else next(iter(entries.values()))
             for name, entries in candidates.items()}
    decision = None
    if undecided and _judged_at_outputs(ctx.cfg):
        split = ctx.dataset().calibration
        judged_on = statistics.judge_indices([sample.name for sample in split], stats)
        table, decision = _auto_at_outputs(ctx, model_path, table, candidates, judged_on)
    return table, {name: c["errors"] for name, c in list(choices.items())[:200]} or None, decision


def _auto_at_outputs(ctx: StageContext, model_path: Path, per_tensor: Dict[str, dict], candidates,
                     judged_on: List[int]):
    """auto's final choice between the per-tensor table and each single method's table: the
    one whose int8 model (ONNX Runtime's placement, every quantizable op quantized) does best
    at the network outputs on the whole calibration set (auto.choose_table), every table
    screened first on the samples at ``judged_on`` where that is a subsample of it (their
    fp32 outputs taken from the whole set's). precision.keep_float
    is left out: the table a build is made with does not move when advice keeps an op float,
    so the advice trial built with it is what the rerun applying it gets."""
    tables_by_name = {"per-tensor": per_tensor}
    for method in AUTO_CANDIDATES:  # model inputs keep their own method (calibration.inputs)
        tables_by_name[method] = {name: entries[method] if method in entries else next(iter(entries.values()))
                                  for name, entries in candidates.items()}
    prepared = onnx.load(str(model_path))
    model = FakeQuantModel(prepared, per_tensor, QdqSettings.resolve(ctx.cfg.precision, backends.REFERENCE))
    split = list(ctx.dataset().calibration)
    kept = shapes.one_shape(list(range(len(split))), lambda i: split[i].feeds)  # compared as equal slices
    whole = OutputJudge(prepared, [split[i].feeds for i in kept])
    position = {index: at for at, index in enumerate(kept)}
    subsample = [position[i] for i in judged_on if i in position]
    measure, screen = _table_measures(model, whole, subsample if len(subsample) < len(kept) else None)
    chosen, scores = auto.choose_table(measure, tables_by_name, screen)
    return tables_by_name[chosen], {"chosen": chosen, "samples": whole.count, "criterion": auto.CRITERION,
                                    "measured_on": "the fake-quantized model (calibration/fake_quant.py)",
                                    **({"screened_on": len(subsample)} if screen else {}), "candidates": scores}


def _table_measures(model: FakeQuantModel, whole: OutputJudge, subsample: Optional[List[int]]):
    """(measure, screen): a table's judgement on every sample of ``whole``, and on the
    samples at ``subsample`` (None: no screening). A table measured after its screening
    runs only the samples the screening did not (the segmenter's two finalists: 32 runs of
    the fake-quantized model -> 24)."""
    def outputs(table, samples) -> List[List[np.ndarray]]:
        return model.run_each(table, samples, whole.outputs)

    def scored(judge: OutputJudge, rows) -> dict:
        return judge.score([[np.concatenate([np.atleast_1d(row[i]) for row in rows]) for i in range(len(whole.outputs))]])

    if subsample is None:
        return (lambda table: scored(whole, outputs(table, whole.samples))), None
    part, screened = whole.subset(subsample), {}  # id(table) -> its screening's rows, in subsample's order

    def screen(table) -> dict:
        screened[id(table)] = outputs(table, part.samples)
        return scored(part, screened[id(table)])

    def measure(table) -> dict:
        known = dict(zip(subsample, screened.get(id(table), [])))
        rest = [i for i in range(whole.count) if i not in known]
        known.update(zip(rest, outputs(table, [whole.samples[i] for i in rest])))
        return scored(whole, [known[i] for i in range(whole.count)])

    return measure, screen


def _method_options(cfg) -> Dict[str, dict]:
    return {"percentile": {"percentile": cfg.percentile},
            "kl": {"quantized_levels": cfg.quantized_levels, "max_clipped": cfg.kl_max_clipped}}


def _candidates(stats, cfg) -> Dict[str, Dict[str, dict]]:
    """Every tensor's entry under each base method: what the sensitivity search tries."""
    options = _method_options(cfg)
    return {name: {m: _entry(stats, name, m, options) for m in thresholds.METHODS} for name in stats.histograms}


def _entry(stats, name: str, method: str, options: Dict[str, dict]) -> dict:
    """One tensor's table entry; mean_min_max reads the per-sample ranges of the statistics."""
    extra = {"sample_range": stats.sample_ranges.get(name)} if method == "mean_min_max" else {}
    return tables.table_entry(stats.histograms[name], method, **options.get(method, {}), **extra)


def _imported_table(path: Path, model_path: Path):
    if not path.is_file():
        raise ConfigError(f"calibration.table: {path} does not exist")
    try:
        table = tables.from_tpu_mlir(path.read_text())
    except ValueError as err:
        raise InputError(f"calibration.table: {path}: {err}") from err
    known = set(statistics.activation_names(onnx.load(str(model_path), load_external_data=False)))
    unknown = sorted(set(table) - known)
    if unknown:
        raise InputError(f"calibration.table: {path} names tensors the model does not have: {', '.join(unknown[:5])}")
    missing = sorted(known - set(table))
    warnings = [f"the imported table has no threshold for {len(missing)} tensors; they stay in float"] if missing else []
    return table, {"method": "imported", "source": str(path), "tensors": len(table), "warnings": warnings,
                   "methods_chosen": {"imported": len(table)}}
