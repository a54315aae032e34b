"""What verify does after its verdict: layerwise probes, the float64 check of the
reference, and advice (keep-in-float candidates screened on the reference and confirmed
on the target within the diagnosis budget)."""

from __future__ import annotations

import itertools
import shutil
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

import onnx

from pipeline import backends
from pipeline.verification import diagnosis, layerwise, trials, truth as float64, verdict
from pipeline.artifacts import read_json
from pipeline.config.schemas import Layerwise
from pipeline.precision import kinds
from pipeline.errors import BackendCrashed, ExitCode, first_line
from pipeline.task_metrics import load_metric
from pipeline.verification.scoring import TaskScorer
from pipeline.precision.calibration import bias_correction, weight_rounding
from pipeline.precision.passthrough import CLAMPS, clamp_bounds, constants
from pipeline.precision.quantize import QdqSettings, build_qdq, keep_in_float
from pipeline.verification.recommend import QuantizedGraph, recommend
from pipeline.worker import BackendWorker
from stages import REFERENCE_MODULE, reference_settings
from stages.verify.shared import Live, built_worker, judge_output, judged_with, launch_worker, loaded


def layerwise_wanted(mode: Layerwise, exit_code: ExitCode) -> bool:
    return mode == Layerwise.always or (mode == Layerwise.on_fail and exit_code != ExitCode.OK)


def layerwise_skipped(mode: Layerwise, crash) -> dict:
    reason = ("the target crashed" if crash else "validation.layerwise=off" if mode == Layerwise.off
              else "the verdict passed (validation.layerwise=on_fail)")
    return {"mode": mode.value, "ran": False, "reason": reason}


def run_layerwise(ctx, live: Live, dataset, progress, budget: "diagnosis.Budget") -> dict:
    """Every intermediate tensor on the first layerwise_samples samples, within the
    diagnosis budget; a crash of the probing session is reported here and leaves the
    verdict as it was."""
    validation = ctx.cfg.validation
    mode = validation.layerwise.value
    reason = "always (validation.layerwise=always)" if mode == "always" else "the verdict failed"
    model = onnx.load(str(ctx.results["convert"].path("model")))
    graph = layerwise.Graph(model)
    samples = [sample.feeds for _, sample in zip(range(validation.layerwise_samples), dataset.validation)]
    always = mode == "always"  # every tensor, whatever the budget (the user asked for the whole table)
    try:
        reference, target = live.workers()
        result = layerwise.compare(reference, target, graph, samples, validation.layer_min_cosine,
                                   progress=progress, stop_at_divergence=not always,
                                   deadline=None if always else budget.deadline, rescaled=_rescaled(ctx),
                                   clamped=_clamped(ctx, graph, model))
    except BackendCrashed as err:
        return {"mode": mode, "ran": False, "reason": f"layerwise probing failed: {err}"}
    budget.spent("layerwise", result.seconds, cut=result.cut)
    side_file = "layerwise.json.gz"
    result.write_side_file(ctx.out_dir / side_file)
    return result.summary(mode, reason, side_file)


def _rescaled(ctx) -> List[str]:
    """The activations calibrate's equalization scaled per channel (the build's model
    differs from the reference there by design; the consumers' outputs agree again)."""
    calibrate = ctx.results.get("calibrate")
    return calibrate.summary.rescaled if calibrate else []


def _clamped(ctx, graph: layerwise.Graph, model) -> Dict[str, tuple]:
    """The tensors an int8 build holds clamped, and the bounds: an int8 op's output whose only
    reader is a pass-through Relu or Clip, folded into that output's Q (docs/calibration.md,
    "Pass-through ops"); compared with the reference's through the same clamp, not as a
    divergence."""
    build = ctx.results.get("build")
    quantization = build.summary.quantization if build else None
    folding = set(CLAMPS) & set((quantization.passthrough_ops or []) if quantization else [])
    if not folding:
        return {}
    int8_types, float_ops = set(quantization.quantized_ops or []), set(quantization.float_ops or [])
    found, known = {}, constants(model)
    for tensor in graph.tensors:
        readers = [graph.nodes[op] for op in graph.consumers(tensor.name)]
        if tensor.op_type not in int8_types or tensor.op in float_ops or len(readers) != 1 \
                or readers[0].op_type not in folding:
            continue
        bounds = clamp_bounds(readers[0], known)
        if bounds is not None:
            found[tensor.name] = bounds
    return found


ACCURACY_CHECKS = ("accuracy", "task", "nan_inf")


def advice_for(ctx, backend, live: Optional[Live], judged, layers, truth, outputs, task,
            budget: "diagnosis.Budget") -> tuple:
    """(recommendations, trials): named from the evidence (pipeline/verification/recommend.py), and for
    an int8/mixed build failing on accuracy, keep-in-float candidates tried within the
    diagnosis budget first (``live``: None when the target crashed)."""
    (requested, effective, checks), precision = judged, ctx.cfg.precision.kind
    graph = _quantized_graph(ctx)
    calibrate = ctx.results.get("calibrate")
    table = read_json(calibrate.path("table")) if calibrate and "table" in calibrate.files else None
    advice = recommend(precision, backend.NAME, requested, effective, layers, table, graph, truth)
    if live is None or not _accuracy_failed(checks) or graph is None or ctx.cfg.validation.advice_trials <= 0:
        return advice, []
    if budget.exhausted():
        budget.skipped("advice trials")
        return advice, []
    return _tried_advice(ctx, backend, live, advice, layers, graph, outputs, task, budget)


def _accuracy_failed(checks: List[dict]) -> bool:
    return any(c["severity"] == "fail" and c["check"] in ACCURACY_CHECKS for c in checks)


def truth_wanted(precision: str, checks: List[dict]) -> bool:
    """The float64 check of the reference (a few samples): on fp32 targets, where a
    reference far from the truth hides behind a pass, and on float targets whose accuracy
    fails, before a kernel is blamed. int8/mixed: quantization error dwarfs float32
    rounding, and their advice is about quantized ops, which this check cannot change."""
    return precision == kinds.REFERENCE or (kinds.half(precision) and _accuracy_failed(checks))


def truth_check(ctx, reference, target, dataset, outputs: List[dict]) -> dict:
    """Reference and target against a float64 run of the reference model on a few samples
    (pipeline/verification/truth.py); each compared output gets a ``truth`` entry."""
    samples = [sample.feeds for _, sample in zip(range(float64.SAMPLES), dataset.validation)]
    try:
        float32_s = _seconds(lambda: reference.run(samples[0])) if samples else None
        exact, engine = float64.run_float64(onnx.load(str(ctx.results["convert"].path("model"))), samples, float32_s)
        expected = [reference.run(feeds) for feeds in samples[:len(exact)]]
        actual = [target.run(feeds) for feeds in samples[:len(exact)]]
    except float64.TooSlow as err:
        return {"ran": False, "reason": f"not run: {err}"}
    except Exception as err:  # noqa: BLE001 - a check of the reference: information, never the verdict
        return {"ran": False, "reason": f"the float64 run failed: {first_line(err)}"}
    found = float64.compare(exact, expected, actual, [o["name"] for o in outputs], engine)
    for output in outputs:
        if output["name"] in found:
            output["truth"] = found[output["name"]]
    warnings = [float64.reference_warning(o["name"], found[o["name"]], o["thresholds"]["min_cosine"])
                for o in outputs if o["passed"] and o["name"] in found]
    return {"ran": True, "engine": engine, "samples": len(exact), "outputs": found,
            "warnings": [w for w in warnings if w]}


def _seconds(call) -> float:
    """The faster of two calls' seconds (the first may pay a warm-up)."""
    found = []
    for _ in range(2):
        started = time.perf_counter()
        call()
        found.append(time.perf_counter() - started)
    return min(found)


def _quantized_graph(ctx) -> Optional[QuantizedGraph]:
    """The converted model with the ops this build quantizes (int8/mixed through parity's
    QDQ builds; None for the runtime's own int8 tooling, which takes no keep_float)."""
    precision = ctx.cfg.precision
    float_ops = ctx.results["build"].summary.float_ops
    calibrate = ctx.results.get("calibrate")
    if not kinds.quantized(precision.kind) or float_ops is None or calibrate is None:
        return None
    prepared = onnx.load(str(calibrate.path("prepared")), load_external_data=False)
    model = onnx.load(str(ctx.results["convert"].path("model")), load_external_data=False)
    return QuantizedGraph(model, precision.quantize_ops, float_ops,
                          present={node.name for node in prepared.graph.node})


def _tried_advice(ctx, backend, live: Live, advice: List[dict], layers, graph: QuantizedGraph,
                  outputs: List[dict], task, budget: "diagnosis.Budget") -> tuple:
    """Keep-in-float candidates ranked by their gain on the reference runtime (a few samples,
    pipeline/verification/trials.py), then confirmed on the target best first, built, measured and judged
    like the build, while the budget lasts: (the advice to print, every trial)."""
    cfg, (reference, target) = ctx.cfg, live.workers()
    dataset = ctx.dataset()
    metric = load_metric(cfg.metric)
    task_output = (metric and metric.output) or cfg.validation.task_output or outputs[0]["name"]
    found = trials.candidates(advice, layers, graph, [graph.op_of(o["name"]) for o in outputs],
                              cfg.validation.advice_trials)
    if not found:  # nothing this build could keep in float (no quantized op upstream of the evidence)
        return advice, []
    already = judged_with(ctx)["intended_float"]
    requested = {"device": cfg.target.device.upper(), "precision": cfg.precision.kind,  # int8 or mixed
                 "accepted_precisions": kinds.with_partial(cfg.precision.kind)}  # as with precision.keep_float

    def judge(stats, build, effective):
        measured_task = (scorer.result(build, cfg.validation.max_metric_drop, cfg.validation.require_confidence)
                         if scorer else None)
        judged = [judge_output(name, found_stats, cfg.validation, measured_task) for name, found_stats in stats.items()]
        _, reasons, _ = verdict.judge(judged, [], measured_task, requested, effective, len(dataset.validation),
                                      None, cfg.validation.fail_on_float_fallback, (*already, *build.split(",")))
        return reasons, min(o["metrics"]["cosine"] for o in judged), measured_task

    qdq = None if backends.own_quantizer(backend, cfg.precision.kind) else _qdq_maker(ctx, backend, live.stack)
    ranked = _screened(ctx, backend, live, qdq, found, (outputs, dataset), budget)
    launch, tried = _trial_launcher(ctx, backend, qdq, live), list(ranked["failed"])
    expected = budget.check_seconds + _refinement_seconds(ctx)
    for keep in ranked["order"]:
        if not budget.fits(expected):
            budget.skipped(f"confirming keep_float=[{','.join(keep)}] on the target", expected)
            continue
        started = time.perf_counter()
        scorer = TaskScorer(metric, task_output) if metric else None
        confirmed = trials.run([keep], launch, reference, target, dataset, judge, scorer)
        for trial in confirmed:
            trial["screen_cosine"] = ranked["cosine"].get(",".join(keep))
            trial["predicted_cosine"] = ranked["predicted"].get(",".join(keep))
            _checked_prediction(trial, outputs, budget)
        tried += confirmed
        budget.spent(f"trial keep_float=[{','.join(keep)}]", time.perf_counter() - started)
        if any(t["passed"] for t in confirmed):
            break  # the best-ranked candidate that passes is the advice; the rest cannot beat it on speed
    untouched = [a for a in advice if not a["action"].get("keep_float")]
    if not any("cosine" in t for t in tried):  # the budget ran out before any confirmation
        return untouched + [_unconfirmed(ranked, budget)], tried
    base = {"cosine": min(o["metrics"]["cosine"] for o in outputs), "task": task}
    found_advice = trials.advice(tried, base, list(cfg.precision.keep_float))
    further = kinds.partial(cfg.precision.kind)  # int8: mixed
    if found_advice[0]["kind"] == "tried_none_passed" and further:
        found_advice[0]["text"] += f"; precision={further} searches further (docs/sensitivity.md)"
    return untouched + found_advice, tried


def _refinement_seconds(ctx) -> float:
    """What the build's weight rounding and bias correction took: a trial built like the
    build repeats them."""
    quantization = ctx.results["build"].summary.quantization
    return quantization.refinement_seconds() if quantization else 0.0


def _unconfirmed(ranked: dict, budget: "diagnosis.Budget") -> dict:
    """The advice when the budget ran out before a candidate was confirmed on the target:
    which one would be next, with nothing to apply (it is not measured on the target)."""
    text = (f"the diagnosis budget ({budget.seconds:.1f} s, validation.diagnosis_budget) left no time to "
            "confirm a keep-in-float candidate on the target")
    if ranked["order"]:
        first = ",".join(ranked["order"][0])
        where = "the target's runtime" if budget.screening.get("on") == "target" else "the reference runtime"
        predicted = ranked["predicted"].get(first)  # none where a single candidate was not screened
        text += (f"; the best ranked on {where}, keep_float=[{first}]"
                 + (f" (predicted cosine {predicted:.6f})" if predicted is not None else "")
                 + ", is confirmed with a larger budget")
    return {"kind": "diagnosis_cut", "text": text, "tried": False, "action": {"validation.diagnosis_budget":
                                                                            "a larger multiple"}}


def _screened(ctx, backend, live: Live, qdq, found: List[List[str]], judged: tuple,
              budget: "diagnosis.Budget") -> dict:
    """The candidates ranked by the cosine predicted on the target over trials.SCREEN_SAMPLES
    validation samples ({"order", "cosine", "base", "predicted", "failed"}). Their plain Q/DQ
    models run on the target's runtime where it runs parity's Q/DQ model as it is (ONNX
    Runtime's and OpenVINO's int8 kernels, not a simulation of them), else on the reference
    runtime; the build is screened the same way and each prediction is the build's measured
    cosine plus the gain over it. A runtime with its own quantizer (MNN) builds no Q/DQ model:
    the order stays as found."""
    if qdq is None or len(found) < 2:
        return {"order": found, "cosine": {}, "base": None, "predicted": {}, "failed": []}
    started = time.perf_counter()
    outputs, dataset = judged  # the build's judged outputs (their thresholds), the run's data
    feeds = [sample.feeds for _, sample in zip(range(trials.SCREEN_SAMPLES), dataset.validation)]
    on_target = backend.CAPABILITIES.qdq_latency
    screened_model = _screen_maker(ctx, backend, qdq, live.stack)

    def worker(keep: List[str]) -> BackendWorker:
        path, label = screened_model(keep), f"screen keep_float=[{','.join(keep)}]"
        if on_target:
            return loaded(built_worker(ctx, backend, live.stack, live.limits, path, ctx.cfg.precision.kind, label))
        settings = {**reference_settings(ctx.results["convert"]), "model": path.name}
        return loaded(launch_worker(live.stack, REFERENCE_MODULE, path.parent, settings, label, live.limits))

    needed = _needed_cosine(outputs)
    build_cosine = min(o["metrics"]["cosine"] for o in outputs)
    ranked = trials.screen(found, worker, live.workers()[0], feeds, needed, build_cosine)
    where = f"the target's runtime ({backend.NAME})" if on_target else "the reference runtime"
    budget.spent(f"screening {len(found)} candidates and the build on {where} ({len(feeds)} samples)",
                 time.perf_counter() - started)
    budget.screening = {"on": "target" if on_target else "reference", "build_screened_cosine": ranked["base"],
                        "build_cosine": build_cosine, "needed_cosine": needed, "predicts_target": None}
    budget.screened = [{"keep_float": keep, "cosine": ranked["cosine"][",".join(keep)],
                        "predicted_cosine": ranked["predicted"][",".join(keep)]} for keep in ranked["order"]]
    return ranked


def _screen_maker(ctx, backend, qdq, stack):
    """keep_float -> the model a candidate is screened with: the build's own Q/DQ model as
    refined (weight rounding and bias correction as the build kept them) with those ops back
    in float (quantize.keep_in_float), so that the screening differs from the trial only by
    the samples; the plain Q/DQ model where the build kept none or its quantizer rewrites more
    than Q/DQ pairs. Without the refinements the screening missed them: PP-OCR's classifier
    on ONNX Runtime, 16 lines, the build 0.99881 on the target and 0.99621 screened plain."""
    build = ctx.results["build"]
    settings = QdqSettings.resolve(ctx.cfg.precision, backend.NAME)
    if "qdq" not in build.files or not settings.derives_mixed:
        return qdq
    refined = onnx.load(str(build.path("qdq")))
    prepared = onnx.load(str(ctx.results["calibrate"].path("prepared")))
    reads_quantized = (build.summary.quantization and build.summary.quantization.quantized_inputs) or []
    scratch = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="parity-screen-")))
    numbers = itertools.count()

    def make(keep: List[str]) -> Path:
        path = scratch / f"screen{next(numbers)}.onnx"
        onnx.save(keep_in_float(refined, prepared, keep, settings, reads_quantized), str(path))
        return path

    return make


def _needed_cosine(outputs: List[dict]) -> Optional[float]:
    needed = [o["thresholds"]["min_cosine"] for o in outputs if o["thresholds"].get("min_cosine") is not None]
    return max(needed) if needed else None


def _checked_prediction(trial: dict, outputs: List[dict], budget: "diagnosis.Budget") -> None:
    """The confirmed trial's measured cosine next to its prediction (verify.diagnosis.screened);
    a miss larger than the gap to pass says the screening does not predict this target."""
    for entry in budget.screened:
        if entry["keep_float"] == trial["keep_float"] and "cosine" in trial:
            entry["measured_cosine"] = trial["cosine"]
    if not budget.screening or "cosine" not in trial:
        return
    missed = trials.misprediction(trial, budget.screening["build_cosine"], _needed_cosine(outputs))
    if missed:
        budget.screening["predicts_target"] = False
        budget.screening.setdefault("misses", []).append(missed)
    elif budget.screening["predicts_target"] is None:
        budget.screening["predicts_target"] = True


def _trial_launcher(ctx, backend, qdq, live: Live):
    """keep_float -> a loaded worker running the build with those ops (and the build's own
    float ops) in float, made as the build stage makes it: the same quantizer, table,
    settings and bias correction (a rerun with precision.keep_float gets this model)."""
    precision, stack, limits = ctx.cfg.precision, live.stack, live.limits
    float_ops = ctx.results["build"].summary.float_ops

    def launch(keep: List[str]):
        label = f"advice keep_float=[{','.join(keep)}]"
        if qdq is None:  # as the build: the runtime's quantizer
            return loaded(built_worker(ctx, backend, stack, limits, None, precision.kind, label, [*float_ops, *keep]))
        path = qdq(keep)
        path = shutil.copyfile(path, path.with_name(f"refined-{path.name}"))  # the screened model stays as it was
        _correct_like_the_build(ctx, backend, path)
        return loaded(built_worker(ctx, backend, stack, limits, path, precision.kind, label))

    return launch


def _qdq_maker(ctx, backend, stack):
    """keep_float -> the path of the build's plain Q/DQ model (its table, settings and own
    float ops) with those ops float too, made once per keep_float (screening ranks it,
    confirming refines a copy of it), in a scratch folder the stack removes."""
    calibrate = ctx.results["calibrate"]
    source = ctx.results["sensitivity"] if kinds.searched(ctx.cfg.precision.kind) else calibrate
    table = read_json(source.path("table"))["tensors"]
    settings = QdqSettings.resolve(ctx.cfg.precision, backend.NAME)
    float_ops = ctx.results["build"].summary.float_ops
    scratch = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="parity-advice-")))
    made: Dict[tuple, Path] = {}

    def make(keep: List[str]) -> Path:
        if tuple(keep) not in made:
            made[tuple(keep)] = scratch / f"model{len(made)}.onnx"
            build_qdq(calibrate.path("prepared"), table, made[tuple(keep)], settings, keep_float=[*float_ops, *keep])
        return made[tuple(keep)]

    return make


def _correct_like_the_build(ctx, backend, quantized: Path) -> None:
    """Weight rounding and bias correction on a QDQ model made here, where the build stage
    applied them to the shipped one, then rewritten for the runtime as the build rewrites it
    (pass-through Relus folded, narrow Convs widened: the trial is timed against the build)."""
    quantization = ctx.results["build"].summary.quantization
    prepared = ctx.results["calibrate"].path("prepared")
    for step, refine in (("weight_rounding", weight_rounding.round_file),
                         ("bias_correction", bias_correction.correct_file)):
        if quantization and quantization.refined(step):
            refine(quantized, prepared, (sample.feeds for sample in ctx.dataset().calibration))
    if quantization and (quantization.relus_folded or quantization.convs_widened):
        model = onnx.load(str(quantized))
        QdqSettings.resolve(ctx.cfg.precision, backend.NAME).rewrite_for_runtime(model)
        onnx.save(model, str(quantized))

