"""verify: run the built artifact on its real backend and the fp32 ONNX Runtime
reference on the validation set, compare every output against the thresholds, check
the task metric when labels exist, read back what the backend really ran, and, when
asked or when the verdict fails, compare every intermediate tensor (layerwise) to name
where the target diverges and why.

Every backend runs in a worker process (pipeline.worker): a crash, an abort or a hang
becomes the verdict "backend crashed/hung" with exit code 4, never the end of the run."""

from __future__ import annotations

import contextlib
import functools
import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import onnx
import yaml
from threadpoolctl import threadpool_limits

from pipeline import backends, environment, shapes
from pipeline.verification import diagnosis, float_noise, speed, verdict
from pipeline.artifacts import hash_files, read_json, write_json, write_npz
from pipeline.config.schemas import plain
from pipeline.model import ops_in_control_flow
from pipeline.precision import kinds
from pipeline.console import progress_bar
from pipeline.errors import BackendCrashed, BackendUnavailable, ConfigError, ExitCode
from pipeline.verification.metrics import OutputStats
from pipeline.verification.shape_checks import ShapeAccuracy
from pipeline.verification.reference_store import ReferenceStore, store_key
from pipeline.worker import answered, side_by_side
from pipeline.task_metrics import files as metric_files, load_metric
from pipeline.verification.scoring import TaskScorer
from stages import (StageContext, StageResult, baseline_role, baselines, code_version, deployable, machine,
                    reference_settings)
from stages.results import Quantization, VerifySummary
from stages.verify.advice import (advice_for, layerwise_skipped, layerwise_wanted, run_layerwise, truth_check,
                                  truth_wanted)
from stages.verify.shared import (MEMORY_TWIN, Live, Row, baseline_worker, judge_output, judged_with,
                                  measure_memory, memory_twin)


NAME = "verify"
CACHEABLE = True
ON_MACHINE = "device"  # the build run, timed and measured on this machine
REPRODUCE_SAMPLES = 8  # validation inputs and reference outputs recorded for parity-bundle check
log = logging.getLogger("parity")


def key_config(cfg):
    return {"validation": cfg.validation, "data": cfg.data, "target": cfg.target, "precision": cfg.precision,
            "metric": cfg.metric}


def external_files(ctx: StageContext) -> List[Path]:
    return ctx.dataset().files + metric_files(ctx.cfg.metric)  # a charset, a custom metric's module


def run(ctx: StageContext) -> StageResult:
    cfg = ctx.cfg
    dataset = ctx.dataset()
    deployed = _target(ctx)
    output_names = ctx.converted().output_names
    metric, task_output = _task_output(cfg, output_names)
    limits = {"timeout_s": cfg.validation.worker_timeout_s, "memory_mb": cfg.validation.worker_memory_mb}
    files = {"reproduce": "reproduce.npz"}
    flow = _control_flow(ctx)
    requested = {"device": str(deployed[2].get("device", cfg.target.device)).upper(),
                 "precision": cfg.precision.kind,
                 "accepted_precisions": _accepted_precisions(cfg.precision, _build_float_ops(ctx),
                                                             ctx.results["convert"].summary.quantized),
                 **_nothing_int8(ctx, flow), **({"control_flow": flow} if flow else {})}
    layers = None
    with contextlib.ExitStack() as stack, progress_bar() as progress:
        live = Live(ctx, deployed, (stack, limits))
        found = _measurement(ctx, live, dataset, (output_names, task_output, metric), requested, progress)
        if found["folder"] not in (None, ctx.out_dir):  # none when the target crashed before the last sample
            shutil.copyfile(found["folder"] / files["reproduce"], ctx.out_dir / files["reproduce"])
        measured = found["measured"]
        outputs, task, crash = measured["outputs"], measured["task"], measured["crash"]
        checks, reasons, exit_code = _verdict(ctx, outputs, measured["missing"], task, requested,
                                              measured["effective"], measured["samples"], crash, measured.get("memory"))
        if crash is None and (measured["timing"] or {}).get("failure"):  # min_speedup: after every accuracy reason
            reasons.append(measured["timing"]["failure"])
            exit_code = exit_code if exit_code != ExitCode.OK else ExitCode.THRESHOLD
        budget = diagnosis.Budget.of(cfg.validation, measured["seconds"])
        if crash is None and layerwise_wanted(cfg.validation.layerwise, exit_code):
            layers = run_layerwise(ctx, live, dataset, progress, budget)
            if layers.get("side_file"):
                files["layerwise"] = layers["side_file"]
        advice, tried = advice_for(ctx, deployed[0], live if crash is None else None, (requested, measured["effective"],
                                checks), layers, measured["truth"], outputs, task, budget)
    write_json(ctx.out_dir / "recommendations.json", advice)
    files["recommendations"] = "recommendations.json"
    summary = _summary(ctx, measured, {
        "requested": requested, "verdict": "pass" if exit_code == ExitCode.OK else "fail",
        "exit_code": int(exit_code), "reasons": reasons, "checks": checks, "layerwise": layers,
        "recommendations": advice, "advice_tried": tried, "reproduce_file": files["reproduce"],
        "diagnosis": budget.summary(exit_code != ExitCode.OK and crash is None, found["reused"])})
    files = {role: name for role, name in files.items() if (ctx.out_dir / name).exists()}
    # a crash, a hang or a device fallback depends on the machine (drivers, load), not on
    # the inputs the cache key covers: such a verdict is measured again next time
    return StageResult(ctx.out_dir, files, VerifySummary.from_json(summary), cache=exit_code != ExitCode.BACKEND,
                       reused=found["reused"] and not summary["diagnosis"]["ran"])


class _NotStored(Exception):
    """A measurement that depends on the machine's state, not on what the key covers (the
    target crashed or hung, the device fell back): the verdict's, never stored."""

    def __init__(self, measured: dict, folder: Optional[Path]):
        super().__init__("not stored")
        self.measured, self.folder = measured, folder


def _measurement(ctx: StageContext, live: Live, dataset, task_of, requested: dict, progress) -> dict:
    """The reference, the target and the baselines on the validation set, judged against the
    thresholds ({"measured", "folder" holding reproduce.npz, "reused"}). Stored by what it
    depends on (the artifact's files, the reference, data, thresholds, runtimes, machine), not
    by the run's diagnosis settings: the same build verified again (precision=auto's shipped
    candidate, a later run) is served from the cache, and only its diagnosis runs."""
    def produce(folder: Path) -> None:
        measured = _measure(ctx, live, dataset, task_of, requested, progress, folder / "reproduce.npz")
        _, _, exit_code = _verdict(ctx, measured["outputs"], measured["missing"], measured["task"], requested,
                                   measured["effective"], measured["samples"], measured["crash"])
        if measured["crash"] is not None or exit_code == ExitCode.BACKEND:
            kept = ctx.out_dir / "reproduce.npz"
            if (folder / "reproduce.npz").is_file():  # the folder is dropped with the exception
                shutil.copyfile(folder / "reproduce.npz", kept)
            raise _NotStored(measured, ctx.out_dir if kept.is_file() else None)
        write_json(folder / "measured.json", measured)

    try:
        folder, reused = ctx.memo("verify-measurement", _measurement_material(ctx), produce)
    except _NotStored as unstored:
        return {"measured": unstored.measured, "folder": unstored.folder, "reused": False}
    if reused:
        log.info("verify: the measurement of this build is served from the cache (same artifact, data, thresholds)")
    return {"measured": read_json(folder / "measured.json"), "folder": folder, "reused": reused}


def _measurement_material(ctx: StageContext) -> dict:
    """What the measurement depends on: the files that run (the artifact, build's or tune's;
    the baselines, build's; the reference, convert's; calibrate's, the builds' source),
    hashed once by the runner, the settings they run with, the validation data and thresholds."""
    validation = ctx.cfg.validation.judged()
    files = {name: ctx.output_hashes[name] for name in ("convert", "calibrate", "build", "tune")
             if name in ctx.output_hashes}
    return {"code": code_version(), "runtimes": environment.versions(), "machine": machine(ctx.cfg.target),
            "files": files,
            "config": plain({"validation": validation, "data": ctx.cfg.data, "target": ctx.cfg.target,
                             "precision": ctx.cfg.precision, "metric": ctx.cfg.metric}),
            "build": ctx.results["build"].summary.float_ops,
            "tuned": ctx.results["tune"].summary.chosen if "tune" in ctx.results else None,
            "external": list(hash_files(external_files(ctx)).values())}


def _measure(ctx: StageContext, live: Live, dataset, task_of, requested: dict, progress, reproduce: Path) -> dict:
    """One measurement (see _measurement) with its seconds: what the diagnosis budget scales."""
    started = time.perf_counter()
    cfg, (output_names, task_output, metric) = ctx.cfg, task_of
    check = _Check(output_names, TaskScorer(metric, task_output) if metric else None, cfg.precision.kind,
                   ctx.inputs())
    ran = _compare(ctx, live, check, dataset, progress, reproduce)
    task = check.task_result(cfg.validation.max_metric_drop, cfg.validation.require_confidence)
    outputs = [judge_output(name, check.stats[name], cfg.validation, task) for name in output_names
               if name not in check.missing and check.stats[name].elements]
    task = float_noise.judged(task, outputs, cfg.precision.kind)
    if metric and task is None and check.samples and ran.crash is None:
        scope = (f" ({metric.name} without labels judges class scores only: one dimension larger than 1 per sample, "
                 f"not named as an embedding; output {task_output} is not)"
                 if check.scorer.refused and metric.hook("without_labels") else "")
        dataset.warnings.append(f"metric {metric.name} needs labels and the validation split has none "
                                f"(labels.csv): no task metric{scope} (set metric=none, or a metric that compares "
                                "with the reference)")
    elif task and task.get("judged_as") and ran.crash is None:
        dataset.warnings.append(f"metric {metric.name}: the validation split has no labels (labels.csv): the task "
                                f"verdict is {task['judged_as']}, not accuracy")
    truth = None
    if ran.crash is None:
        checks, _, exit_code = _verdict(ctx, outputs, check.missing, task, requested, ran.effective, check.samples,
                                        None)
        _speed(ctx, live, ran, check, timed=exit_code == ExitCode.OK or cfg.validation.times_failing)
        if ran.crash is None and truth_wanted(cfg.precision.kind, checks):
            truth = truth_check(ctx, *live.workers(), dataset, outputs)
    check.add_task_values(ran.comparison)
    return {"samples": check.samples, "missing": check.missing, "outputs": outputs, "task": task,
            "effective": ran.effective, "comparison": ran.comparison, "timing": ran.timing, "crash": ran.crash,
            "memory": ran.memory, "reference": ran.reference, "shapes": check.by_shape.result(),
            "data": dataset.summary(), "truth": truth, "seconds": round(time.perf_counter() - started, 3)}


def _target(ctx: StageContext):
    """(backend module, the deployable artifact's result, its runtime.yaml settings)."""
    artifact = deployable(ctx.results)
    settings = yaml.safe_load(artifact.path("runtime").read_text())
    backend = backends.spec(settings["backend"])
    ok, reason = backend.available()
    if not ok:
        raise BackendUnavailable(f"target {ctx.cfg.target.name}: {reason}")
    return backend, artifact, settings


def _task_output(cfg, output_names: List[str]):
    """(the task metric or None, the output it scores: a pair metric's first, TaskScorer
    reads both), checked against the model's outputs."""
    _check_output_names(cfg.validation, output_names)
    metric = load_metric(cfg.metric)
    task_output = (metric and metric.output) or cfg.validation.task_output or output_names[0]
    for name in (metric.names if metric and len(metric.names) > 1 else (task_output,)):
        if name not in output_names:
            raise ConfigError(f"metric.output: the model has no output {name!r}; outputs: {', '.join(output_names)}")
    return metric, task_output


@dataclass
class _Ran:
    """What the side-by-side run of the reference, the target and the baselines gave."""

    effective: dict = field(default_factory=dict)
    comparison: dict = field(default_factory=dict)
    timing: dict = field(default_factory=dict)
    crash: Optional[dict] = None
    memory: Optional[dict] = None  # verify.memory (pipeline/verification/memory.py)
    reference: Optional[dict] = None  # the reference's samples read from its store, and run
    rows: dict = field(default_factory=dict)  # the side-by-side builds (Row), timed once judged (_speed)


def _compare(ctx: StageContext, live: Live, check: "_Check", dataset, progress, reproduce: Path) -> _Ran:
    """The reference and the target, and the fp32 and plain int8 baselines, on the
    validation set; a backend crash is recorded in ``crash``, not raised."""
    cfg, ran = ctx.cfg, _Ran()
    backend, build = live.deployed[0], ctx.results["build"]
    try:
        store = reference_store(ctx, dataset)
        stored = store is not None and store.holds(len(dataset.validation))
        live.launch(reference=not stored)
        if stored:
            log.info("verify: every reference answer is in its store: the reference starts only if something asks")
        twin = memory_twin(live)  # target.memory=low: the same build with memory=default, for its peak
        baselines = _baselines(ctx, backend, live.stack, live.limits)  # fp32 (and plain int8 for mixed) side by side
        reference, target = live.workers(lazy_reference=stored)
        for row in [*baselines.values(), *([twin] if twin else [])]:
            row.wait_loaded()
        timed_only = bool(baselines) and not cfg.validation.baselines_compared  # validation.baselines=timed
        fed = {**({} if timed_only else baselines), **({MEMORY_TWIN: twin} if twin else {})}
        check.run(reference, target, fed, dataset, progress, reproduce, f"verify {cfg.target.name}", store)
        if store is not None:
            ran.reference = {"from_store": store.served, "run": store.ran}
        once = check.by_shape.first_feeds(dataset.validation.read, check.last) if timed_only else None
        if once is not None:
            _run_once_per_shape(baselines, once)
        ran.memory = measure_memory(target, baselines, twin, cfg.target.memory.value, check.samples,
                                    None if once is None else len(once))  # before more runs
        ran.effective = target.effective()
        ran.rows = {**baselines, cfg.precision.kind: Row(target, build.summary.bytes, check.stats)}
    except BackendCrashed as err:
        ran.crash = _crashed(err)
    return ran


def _speed(ctx: StageContext, live: Live, ran: _Ran, check: "_Check", timed: bool) -> None:
    """The side-by-side table's rows, every build timed interleaved where ``timed``: a build
    whose accuracy checks fail is timed only with validation.time_failing (precision=auto's
    candidates are not: their table keeps the screening's speed; the segmenter's int8
    verify 21 -> 9 s)."""
    cfg, rows, split = ctx.cfg, ran.rows, ctx.dataset().validation
    backend_name = live.deployed[0].NAME
    try:
        curve = check.by_shape.curve_feeds(split.read) if timed else {}
        sample = curve.get("opt", check.last) if timed else None
        ran.comparison, ran.timing = _side_by_side(rows, sample, cfg.precision.kind, backend_name, cfg.validation)
        if not timed:
            ran.timing["not_timed"] = ("the build fails its accuracy checks and validation.time_failing is false "
                                       "(precision=auto's candidates: their table gives the screening's speed)")
            return
        if curve:
            ran.timing["by_shape"] = _latency_curve(rows, curve, ran, cfg.validation)
        if len(check.by_shape.first) > 1 and cfg.validation.timing_stream_samples > 0:
            _add_stream(ran, rows, split, cfg.validation, backend_name)
    except BackendCrashed as err:
        ran.crash = _crashed(err)


def _crashed(err: BackendCrashed) -> dict:
    log.warning("%s", err)
    return {"kind": err.kind, "backend": err.worker, "detail": err.detail, "stderr_tail": err.stderr_tail}


def _summary(ctx: StageContext, measured: dict, judged: dict) -> dict:
    """verify's summary (report.json's verify section), in its order."""
    crash = measured["crash"]
    return {
        "samples": measured["samples"],
        "requested": judged["requested"],
        "effective": measured["effective"],
        "outputs": measured["outputs"],
        "missing_outputs": measured["missing"],
        "task": measured["task"],
        "comparison": measured["comparison"],
        "speed": measured["timing"],
        "memory": measured.get("memory"),  # peak resident memory of the build, fp32's beside (docs/verify.md)
        "reference": measured.get("reference"),  # its samples read from the store (docs/verify.md "One reference pass")
        "shapes": measured.get("shapes"),  # a dynamic model: accuracy per input shape
        "data": measured["data"],
        "verdict": judged["verdict"],
        "exit_code": judged["exit_code"],
        "reasons": judged["reasons"],
        "checks": judged["checks"],  # every check that did not pass, warnings too (pipeline/verification/verdict.py)
        "judged_with": judged_with(ctx),  # what parity-bundle check needs to judge alike
        "truth": measured["truth"],
        "crash": crash,
        "layerwise": judged["layerwise"] if judged["layerwise"] is not None
        else layerwise_skipped(ctx.cfg.validation.layerwise, crash),
        "recommendations": judged["recommendations"],
        "advice_tried": judged["advice_tried"],
        "diagnosis": judged["diagnosis"],  # what the failing verdict's diagnosis ran and what its budget cut
        "measured_seconds": measured["seconds"],
        "reproduce": {"file": judged["reproduce_file"], "samples": min(measured["samples"], REPRODUCE_SAMPLES)},
    }


def _add_stream(ran: _Ran, rows: dict, split, validation, backend_name: str) -> None:
    """Speed as served (samples of several shapes): every build timed on the validation
    samples in their order, one call per sample (speed.stream_interleaved). The shipped
    build's speed warning and validation.min_speedup then judge this figure."""
    workers = {name: row.worker for name, row in rows.items() if not row.error}
    samples = speed.stream_samples(split, validation.timing_stream_samples)
    timings = speed.stream_interleaved(workers, samples, **speed.options(validation, stream=True))
    speedups, shipped = speed.speedups(timings, tight=validation.timing_tight_spread), ran.timing["shipped"]
    ran.timing["stream"] = {
        "method": f"the first {len(samples)} validation samples in order, one call each at its own shape, passes "
                  f"of every build filling a round of at least {validation.timing_round_ms:g} ms (one when a pass "
                  "is that long), order rotated; median of per-round ratios",
        "samples": len(samples), "shapes": len({shapes.shape_key(feeds) for feeds in samples}),
        "median_ms": {name: t.get("median_ms") for name, t in timings.items()},
        "rounds": max((t.get("rounds", 0) for t in timings.values()), default=0),
        "speedups": speedups}
    fp32_ms = (timings.get(kinds.REFERENCE) or {}).get("median_ms")
    ran.timing["warning"] = speed.slow_build_warning(shipped, speedups.get(shipped), backend_name,
                                                     environment.cpu()["flags"], fp32_ms)
    ran.timing["failure"] = speed.min_speedup_failure(shipped, speedups.get(shipped), validation.min_speedup)
    ran.timing["judged_on"] = "stream"


def _latency_curve(rows: dict, curve: Dict[str, dict], ran: _Ran, validation) -> Dict[str, dict]:
    """A dynamic model's latency at its min, opt and max shapes, every build interleaved as
    the main table is (opt's timing is that table's)."""
    workers = {name: row.worker for name, row in rows.items() if not row.error}
    found = {}
    for which, feeds in curve.items():
        if which == "opt":
            medians = {name: (row.get("latency") or {}).get("median_ms") for name, row in ran.comparison.items()}
            speedups = ran.timing.get("speedups", {})
        else:
            timings = speed.interleaved(workers, feeds, **speed.options(validation))
            medians = {name: t.get("median_ms") for name, t in timings.items()}
            speedups = speed.speedups(timings, tight=validation.timing_tight_spread)
        found[which] = {"shape": shapes.shape_key(feeds), "median_ms": medians, "speedups": speedups}
    return found


def _nothing_int8(ctx, control_flow: str = "") -> dict:
    """A build left with no int8 op runs fp32 as built: not a runtime's fallback but no int8
    build meeting the thresholds (mixed: the search kept every op float) or none faster than
    fp32 here (precision.int8_where_faster); pipeline.verification.verdict fails it with this line."""
    quantization = ctx.results["build"].summary.quantization or Quantization()
    if not kinds.quantized(ctx.cfg.precision.kind) or quantization.int8_ops != 0:
        return {}
    count, kind = len(quantization.float_ops or []), ctx.cfg.precision.kind
    if not count:
        why = "the model has no op parity quantizes (no Conv, MatMul, Gemm, ...): the build is the fp32 model"
        why += f"; {control_flow}" if control_flow else ""
    elif quantization.none_slower_in_int8:
        why = (f"no quantized op is faster in int8 than in fp32 on this machine (precision.int8_where_faster "
               f"kept all {count} in float) and the build runs fp32: ship fp32 (precision=auto chooses it)")
    elif kinds.searched(kind):
        why = (f"the sensitivity search kept all {count} quantized ops in float and the build runs fp32: no int8 "
               "build meets the thresholds (sensitivity.max_float_ops, validation.min_cosine)")
    else:
        why = f"precision.keep_float and the backend keep all {count} quantized ops in float: the build runs fp32"
    return {"accepted_precisions": [kinds.REFERENCE], "nothing_int8": f"precision {kind}: {why}"}


def _control_flow(ctx) -> str:
    """For an int8 or mixed build: the quantizable ops inside If, Loop or Scan bodies, which
    stay float, in the words a verdict gives them ("" where the model has none)."""
    convert = ctx.results["convert"]
    if not kinds.quantized(ctx.cfg.precision.kind) or not {"If", "Loop", "Scan"} & set(convert.summary.op_types):
        return ""
    inside = ops_in_control_flow(onnx.load(str(convert.path("model")), load_external_data=False),
                                 ctx.cfg.precision.quantize_ops)
    ops = ", ".join(sorted({op for found in inside.values() for op in found}))
    return (f"{ops} ops inside {', '.join(inside)} are not quantized (parity quantizes the main graph, not If, Loop "
            "or Scan bodies)") if inside else ""


def _build_float_ops(ctx) -> List[str]:
    """The quantized ops the build kept in float (precision.keep_float, the backend's own)."""
    build = ctx.results.get("build")
    return list((build.summary.float_ops if build else None) or [])


def _accepted_precisions(precision, float_ops: List[str], quantized: str = "") -> List[str]:
    """What the backend may report for this request: mixed with an empty qtable (plain
    int8 met the target) runs int8 everywhere; an int8 build that keeps ops in float
    (precision.keep_float, or the backend's own float kinds) is mixed; fp32 of a model
    quantized already (its Q/DQ as given) runs int8 or mixed."""
    name = precision.kind
    if quantized and name == kinds.REFERENCE:
        return [name, *kinds.with_partial("int8")]
    if kinds.searched(name) or (kinds.partial(name) and (precision.keep_float or float_ops)):
        return kinds.with_partial(name)
    return [name]


class _Check:
    """Reference vs target on every validation sample, with the side-by-side baselines."""

    def __init__(self, output_names: List[str], scorer: Optional[TaskScorer], shipped: str, inputs: Sequence = ()):
        self.stats = {name: OutputStats() for name in output_names}
        self.by_shape = ShapeAccuracy(inputs)  # a dynamic model: accuracy per input shape
        self.scorer, self.shipped = scorer, shipped  # the task metric, of the reference and every build
        self.missing: List[str] = []
        self.samples = 0
        self.last: Optional[dict] = None

    def run(self, reference, target, baselines, dataset, progress, reproduce: Path, title: str,
            store: Optional[ReferenceStore] = None) -> None:
        """Every validation sample on every worker, each worker at its own pace (side_by_side),
        while this process scores the samples all of them answered; the reference's answers
        read from ``store`` where it has them, and kept there where not."""
        self.missing = [name for name in self.stats if name not in target.outputs]
        recorded = {}
        task = progress.add_task(title, total=len(dataset.validation))
        asked = reference if store is None else functools.partial(store.answer, run=reference.run)
        workers = {REFERENCE: asked, TARGET: target,
                   **{name: row.worker for name, row in baselines.items() if not row.error}}
        # one BLAS thread here: OpenBLAS's second thread fights the workers' spinning runtime
        # threads (the segmenter's maps: 16.8 -> 7.4 ms a sample, benchmarks/scoring_threads.py)
        with contextlib.closing(side_by_side(workers, dataset.validation)) as given, \
                threadpool_limits(limits=1, user_api="blas"):  # no run left in flight
            for index, (sample, answers) in enumerate(given):
                expected, actual = _answer(answers[REFERENCE]), _answer(answers[TARGET])
                others = {name: baseline.receive(answers.get(name)) for name, baseline in baselines.items()}
                self._compare(index, sample, (expected, actual), baselines, others)
                if index < REPRODUCE_SAMPLES:
                    recorded.update({f"input/{index}/{k}": v for k, v in sample.feeds.items()})
                    recorded.update({f"reference/{index}/{k}": v for k, v in expected.items()})
                    recorded.update({f"target/{index}/{k}": v for k, v in actual.items()})  # check: reproduced?
                self.samples += 1
                self.last = sample.feeds
                progress.advance(task)
        write_npz(reproduce, recorded)  # fixed zip entry times: the same inputs give the same bytes

    def _compare(self, index: int, sample, outputs: tuple, baselines: dict, others: dict) -> None:
        expected, actual = outputs
        for name, stats in self.stats.items():
            if name in actual:
                stats.update(expected[name], actual[name])
        self.by_shape.update(index, sample.feeds, expected, actual)
        self._score("reference", expected, expected, sample.label)
        self._score(self.shipped, expected, actual, sample.label)
        for name, baseline in baselines.items():
            self._score(name, expected, baseline.compare(expected, others[name]), sample.label)

    def _score(self, build: str, expected: dict, actual: Optional[dict], label) -> None:
        """One build's outputs of a sample scored: what the metric reads of them (the task
        output, or a pair metric's two outputs: TaskScorer.task_values)."""
        if self.scorer is None or actual is None:
            return
        mine, theirs = self.scorer.task_values(actual), self.scorer.task_values(expected)
        if mine is not None and theirs is not None and self.scorer.active(label, theirs):
            self.scorer.add(build, mine, theirs, label)

    def task_result(self, max_drop: float, require_confidence: bool) -> Optional[dict]:
        if self.scorer is None:
            return None
        self.scorer.finish()
        return self.scorer.result(self.shipped, max_drop, require_confidence)

    def add_task_values(self, comparison: dict) -> None:
        """The task metric of every build in the side-by-side table (``top1`` too, for top-1)."""
        for name, row in comparison.items():
            if self.scorer is not None and "error" not in row:
                row["task_metric"] = self.scorer.value(name)
                if self.scorer.metric.name == "top1":
                    row["top1"] = row["task_metric"]


REFERENCE, TARGET = "\0reference", "\0target"  # side_by_side's names of the two, apart from any build's


def _answer(answer) -> dict:
    """The reference's or the target's outputs; the crash its run raised is verify's crash."""
    if isinstance(answer, BackendCrashed):
        raise answer
    return answer


def reference_store(ctx: StageContext, dataset) -> Optional[ReferenceStore]:
    """The store of this model's and data's reference outputs (None without a stage cache)."""
    convert = ctx.output_hashes.get("convert")
    if ctx.cache_root is None or convert is None:
        return None
    return ReferenceStore.of(ctx.cache_root, store_key(convert, ctx.cfg.data, dataset.files,
                                                       reference_settings(ctx.results["convert"])))


def _run_once_per_shape(rows: dict, samples: List[dict]) -> None:
    """validation.baselines=timed: each baseline runs one sample of each input shape twice
    (what its peak memory depends on), its outputs not compared; the row says so. Twice,
    because a runtime's memory settles on a shape's second run: ONNX Runtime allocates the
    memory pattern it recorded on the first (the real-size segmenter's fp32: 309 MB after
    one run, 513 MB from the second on), and a baseline read after one run was 40 % under
    the same build's own verify."""
    for row in rows.values():
        row.compared = False
        for feeds in samples:
            row.receive(answered(lambda: [row.worker.run(feeds) for _ in range(2)][-1]))


def _side_by_side(rows: dict, sample: Optional[dict], shipped: str, backend_name: str, validation):
    """Every build of the table timed interleaved in rounds (pipeline.verification.speed), its
    speed-up over fp32, and the warning or failing check a build not faster than fp32 gets."""
    workers = {name: row.worker for name, row in rows.items() if not row.error}
    timings = {} if sample is None else speed.interleaved(workers, sample,
                                                          **speed.options(validation, alone=len(workers) == 1))
    comparison = {name: row.result(timings.get(name)) for name, row in rows.items()}
    speedups = speed.speedups(timings, tight=validation.timing_tight_spread)
    for name, found in speedups.items():
        comparison[name]["speedup"] = found
    fp32_ms = (timings.get(kinds.REFERENCE) or {}).get("median_ms")
    summary = {"method": f"interleaved rounds of at least {validation.timing_round_ms:g} ms per build (runs sized "
                         f"from the warm-up, at least {validation.timing_runs}) in slices alternating between the "
                         "builds, order rotated; median of round medians; speed-up: median of per-round ratios; "
                         f"rounds lengthened while a spread is above {validation.timing_tight_spread:g}",
               "speedups": speedups, "shipped": shipped,
               "warning": speed.slow_build_warning(shipped, speedups.get(shipped), backend_name,
                                                   environment.cpu()["flags"], fp32_ms),
               "failure": speed.min_speedup_failure(shipped, speedups.get(shipped), validation.min_speedup)}
    return comparison, summary


def _baselines(ctx, backend, stack: contextlib.ExitStack, limits: dict) -> dict:
    """fp32 on the same backend for every other precision; plain int8 too for mixed
    (TPU-MLIR's FLOAT / INT8 / MIX table): the builds the build stage made beside the
    artifact (stages/build.py, baselines), loaded with tune's settings, side by side."""
    return {name: Row(*baseline_worker(ctx, backend, stack, limits, baseline_role(name), f"{backend.NAME} {name}"))
            for name in baselines(ctx.cfg)}


def _check_output_names(validation, outputs: List[str]) -> None:
    named = list(validation.outputs) + ([validation.task_output] if validation.task_output else [])
    for name in named:
        if name not in outputs:
            raise ConfigError(f"validation: the model has no output {name!r}; outputs: {', '.join(outputs)}")


def _verdict(ctx, outputs, missing, task, requested, effective, samples, crash, memory=None):
    """(checks, reasons, exit code) through pipeline.verification.verdict, which parity-bundle check shares."""
    judged = judged_with(ctx)
    return verdict.judge(outputs, missing, task, requested, effective, samples, crash,
                         judged["fail_on_float_fallback"], tuple(judged["intended_float"]), memory,
                         judged["max_memory_mb"])


