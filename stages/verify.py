"""verify: run the built artifact on its real backend and the fp32 ONNX Runtime
reference on the validation set, compare every output against the thresholds, check
the task metric when labels exist, read back what the backend really ran, and, when
asked or when the verdict fails, compare every intermediate tensor (layerwise) to name
where the target diverges and why.

Every backend runs in a worker process (pipeline.worker): a crash, an abort or a hang
becomes the verdict "backend crashed/hung" with exit code 4, never the end of the run."""

from __future__ import annotations

import contextlib
import logging
import tempfile
from pathlib import Path
from typing import List, Optional

import numpy as np
import onnx
import yaml

from pipeline import backends, environment, layerwise, speed, tuning
from pipeline.artifacts import read_json, write_json, write_npz
from pipeline.config import Layerwise
from pipeline.console import progress_bar
from pipeline.errors import BackendCrashed, BackendUnavailable, ConfigError, ExitCode
from pipeline.metrics import OutputStats, Top1, failures
from pipeline.quantize import QdqSettings, build_qdq
from pipeline.recommend import recommend
from pipeline.worker import BackendWorker
from stages import REFERENCE_MODULE, StageContext, StageResult, deployable, reference_settings

NAME = "verify"
VERSION = 7
CACHEABLE = True
REPRODUCE_SAMPLES = 8  # validation inputs and reference outputs recorded for parity-bundle check
log = logging.getLogger("parity")


def key_config(cfg):
    return {"validation": cfg.validation, "data": cfg.data, "target": cfg.target, "precision": cfg.precision}


def external_files(ctx: StageContext) -> List[Path]:
    return ctx.dataset().files



def run(ctx: StageContext) -> StageResult:
    cfg = ctx.cfg
    dataset = ctx.dataset()
    convert, build, artifact = ctx.results["convert"], ctx.results["build"], deployable(ctx.results)
    settings = yaml.safe_load(artifact.path("runtime").read_text())
    backend = backends.spec(settings["backend"])
    ok, reason = backend.available()
    if not ok:
        raise BackendUnavailable(f"target {cfg.target.name}: {reason}")
    output_names = [o["name"] for o in convert.summary["outputs"]]
    _check_output_names(cfg.validation, output_names)
    task_output = cfg.validation.task_output or output_names[0]
    limits = {"timeout_s": cfg.validation.worker_timeout_s, "memory_mb": cfg.validation.worker_memory_mb}
    files = {"reproduce": "reproduce.npz"}
    check = _Check(output_names, task_output)
    requested = {"device": str(settings.get("device", cfg.target.device)).upper(), "precision": cfg.precision.name.value,
                 "accepted_precisions": _accepted_precisions(cfg.precision)}
    effective, crash, layers, comparison, timing = {}, None, None, {}, {}
    with contextlib.ExitStack() as stack, progress_bar() as progress:
        try:
            reference = _launch(stack, REFERENCE_MODULE, convert.out_dir, reference_settings(convert),
                                "reference (onnxruntime fp32)", limits)
            target = _launch(stack, backend.__name__, artifact.out_dir, settings,
                             f"{cfg.target.name} ({backend.NAME} {cfg.precision.name.value})", limits)
            baselines = _baselines(ctx, backend, stack, limits)  # fp32 (and plain int8 for mixed) side by side
            _loaded(reference)
            _loaded(target)
            for row in baselines.values():
                row.wait_loaded()
            check.run(reference, target, baselines, dataset, progress, ctx.out_dir / files["reproduce"],
                      f"verify {cfg.target.name}")
            effective = target.effective()
            rows = {**baselines, cfg.precision.name.value: _Row(target, build.summary.get("bytes"), check.stats,
                                                                check.top1)}
            comparison, timing = _side_by_side(rows, check.last, cfg.precision.name.value, backend.NAME, cfg.validation)
        except BackendCrashed as err:
            crash = {"kind": err.kind, "backend": err.worker, "detail": err.detail,
                     "stderr_tail": err.stderr_tail}
            log.warning("%s", err)
        outputs = [_judge(name, check.stats[name], cfg.validation) for name in output_names
                   if name not in check.missing and check.stats[name].elements]
        task = check.top1.result(cfg.validation.max_metric_drop, task_output)
        reasons, exit_code = _verdict(outputs, check.missing, task, requested, effective, check.samples, crash)
        if crash is None and timing.get("failure"):  # validation.min_speedup: after every accuracy reason
            reasons.append(timing["failure"])
            exit_code = exit_code if exit_code != ExitCode.OK else ExitCode.THRESHOLD
        if crash is None and _layerwise_wanted(cfg.validation.layerwise, exit_code):
            layers = _layerwise(ctx, reference, target, dataset, exit_code, progress)
            if layers.get("side_file"):
                files["layerwise"] = layers["side_file"]
    calibrate = ctx.results.get("calibrate")
    table = read_json(calibrate.path("table")) if calibrate and "table" in calibrate.files else None
    advice = recommend(cfg.precision.name.value, backend.NAME, requested, effective, layers, table)
    write_json(ctx.out_dir / "recommendations.json", advice)
    files["recommendations"] = "recommendations.json"
    summary = {
        "samples": check.samples,
        "requested": requested,
        "effective": effective,
        "outputs": outputs,
        "missing_outputs": check.missing,
        "task": task,
        "comparison": comparison,
        "speed": timing,
        "data": dataset.summary(),
        "verdict": "pass" if exit_code == ExitCode.OK else "fail",
        "exit_code": int(exit_code),
        "reasons": reasons,
        "crash": crash,
        "layerwise": layers if layers is not None else _layerwise_skipped(cfg.validation.layerwise, crash),
        "recommendations": advice,
        "reproduce": {"file": files["reproduce"], "samples": min(check.samples, REPRODUCE_SAMPLES)},
    }
    files = {role: name for role, name in files.items() if (ctx.out_dir / name).exists()}
    # a crash, a hang or a device fallback depends on the machine (drivers, load), not on
    # the inputs the cache key covers: such a verdict is measured again next time
    return StageResult(ctx.out_dir, files, summary, cache=exit_code != ExitCode.BACKEND)


def _accepted_precisions(precision) -> List[str]:
    """What the backend may report for this request: mixed with an empty qtable (plain
    int8 met the target) runs int8 everywhere; int8 with precision.keep_float is mixed."""
    name = precision.name.value
    if name == "mixed" or (name == "int8" and precision.keep_float):
        return ["int8", "mixed"]
    return [name]


def _launch(stack, module: str, folder: Path, settings: dict, label: str, limits: dict) -> BackendWorker:
    """A worker process started (closed with the stack); its load is awaited by _loaded,
    so that the workers of one verify start side by side."""
    worker = BackendWorker(module, folder, settings, label=label, timeout_s=limits["timeout_s"],
                           memory_mb=limits["memory_mb"])
    stack.callback(worker.close)
    worker.launch()
    return worker


def _loaded(worker: BackendWorker) -> BackendWorker:
    try:
        worker.wait_loaded()
    except BackendCrashed as err:
        if err.kind == "error":  # the runtime refused the artifact: a clear error, not a crash
            raise BackendUnavailable(f"{worker.label} failed to load the artifact: {err.detail}") from err
        raise
    return worker


class _Check:
    """Reference vs target on every validation sample, with the side-by-side baselines."""

    def __init__(self, output_names: List[str], task_output: str):
        self.stats = {name: OutputStats() for name in output_names}
        self.task_output = task_output
        self.top1 = Top1()
        self.missing: List[str] = []
        self.samples = 0
        self.last: Optional[dict] = None

    def run(self, reference, target, baselines, dataset, progress, reproduce: Path, title: str) -> None:
        self.missing = [name for name in self.stats if name not in target.outputs]
        recorded = {}
        task = progress.add_task(title, total=len(dataset.validation))
        for index, sample in enumerate(dataset.validation):
            expected = reference.run(sample.feeds)
            actual = target.run(sample.feeds)
            for name, stats in self.stats.items():
                if name in actual:
                    stats.update(expected[name], actual[name])
            if sample.label is not None and self.task_output in actual:
                self.top1.update(expected[self.task_output], actual[self.task_output], sample.label)
            for baseline in baselines.values():
                baseline.update(expected, sample, self.task_output)
            if index < REPRODUCE_SAMPLES:
                recorded.update({f"input/{index}/{k}": v for k, v in sample.feeds.items()})
                recorded.update({f"reference/{index}/{k}": v for k, v in expected.items()})
            self.samples += 1
            self.last = sample.feeds
            progress.advance(task)
        write_npz(reproduce, recorded)  # fixed zip entry times: the same inputs give the same bytes


class _Row:
    """One build in the side-by-side table: output agreement, top-1, latency, size."""

    def __init__(self, worker, size, stats=None, top1=None):
        self.worker, self.size = worker, size
        self.stats, self.top1 = stats if stats is not None else {}, top1 if top1 is not None else Top1()
        self.error: Optional[str] = None

    def wait_loaded(self) -> None:
        try:
            _loaded(self.worker)
        except (BackendCrashed, BackendUnavailable) as err:  # a side-by-side build is information only
            self.error = str(err)

    def update(self, expected, sample, task_output) -> None:
        if self.error:
            return
        try:
            actual = self.worker.run(sample.feeds)
        except BackendCrashed as err:  # a side-by-side build is information, not the verdict
            self.error = str(err)
            return
        for name in expected:
            self.stats.setdefault(name, OutputStats()).update(expected[name], actual[name])
        if sample.label is not None:
            self.top1.update(expected[task_output], actual[task_output], sample.label)

    def result(self, timing: Optional[dict]) -> dict:
        if self.error or (timing or {}).get("error"):
            return {"error": self.error or timing["error"], "bytes": self.size}
        first = next(iter(self.stats.values()), None)
        return {"latency": timing, "bytes": self.size,
                "top1": self.top1.target_correct / self.top1.count if self.top1.count else None,
                "cosine": first.result()["cosine"] if first and first.elements else None}


def _side_by_side(rows: dict, sample: Optional[dict], shipped: str, backend_name: str, validation):
    """Every build of the table timed interleaved in rounds (pipeline.speed), its
    speed-up over fp32, and the warning or failing check a build not faster than fp32 gets."""
    workers = {name: row.worker for name, row in rows.items() if not row.error}
    timings = {} if sample is None else speed.interleaved(
        workers, sample, validation.timing_rounds, validation.timing_runs, validation.timing_max_seconds)
    comparison = {name: row.result(timings.get(name)) for name, row in rows.items()}
    speedups = speed.speedups(timings)
    for name, found in speedups.items():
        comparison[name]["speedup"] = found
    fp32_ms = (timings.get("fp32") or {}).get("median_ms")
    summary = {"method": f"interleaved rounds, order rotated, {validation.timing_runs} runs of one sample a round; "
                         "median of round medians; speed-up: median of per-round ratios",
               "speedups": speedups, "shipped": shipped,
               "warning": speed.slow_build_warning(shipped, speedups.get(shipped), backend_name,
                                                   environment.cpu()["flags"], fp32_ms),
               "failure": speed.min_speedup_failure(shipped, speedups.get(shipped), validation.min_speedup)}
    return comparison, summary


def _baselines(ctx, backend, stack: contextlib.ExitStack, limits: dict) -> dict:
    """fp32 on the same backend for every other precision; plain int8 too for mixed
    (TPU-MLIR's FLOAT / INT8 / MIX table)."""
    precision = ctx.cfg.precision.name.value
    convert = ctx.results["convert"]
    tune = ctx.results.get("tune")
    tuned = tune.summary["chosen"]["changes"] if tune is not None and "runtime" in tune.files else {}  # same settings
    builds = {}
    if precision != "fp32":
        builds["fp32"] = (convert.path("model"), convert.out_dir if "ir_xml" in convert.files else None)
    if precision == "mixed":
        int8 = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="parity-int8-"))) / "int8.onnx"
        calibrate = ctx.results["calibrate"]
        build_qdq(calibrate.path("prepared"), read_json(calibrate.path("table"))["tensors"], int8,
                  QdqSettings.resolve(ctx.cfg.precision, backend.NAME))
        builds["int8"] = (int8, None)
    rows = {}
    for name, (onnx_path, ir_dir) in builds.items():
        folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix=f"parity-{name}-")))
        files, settings = backend.build(onnx_path, ir_dir, folder, ctx.cfg.target, name)
        settings = tuning.apply(backend, {**settings, "device": ctx.cfg.target.device.upper(), "precision": name,
                                          "outputs": convert.summary["outputs"]}, tuned)
        size = sum((folder / f).stat().st_size for f in files)
        rows[name] = _Row(_launch(stack, backend.__name__, folder, settings, f"{backend.NAME} {name}", limits), size)
    return rows


def _layerwise_wanted(mode: Layerwise, exit_code: ExitCode) -> bool:
    return mode == Layerwise.always or (mode == Layerwise.on_fail and exit_code != ExitCode.OK)


def _layerwise_skipped(mode: Layerwise, crash) -> dict:
    reason = ("the target crashed" if crash else "validation.layerwise=off" if mode == Layerwise.off
              else "the verdict passed (validation.layerwise=on_fail)")
    return {"mode": mode.value, "ran": False, "reason": reason}


def _layerwise(ctx, reference, target, dataset, exit_code: ExitCode, progress) -> dict:
    """Every intermediate tensor on the first layerwise_samples samples; a crash of the
    probing session is reported here and leaves the verdict as it was."""
    validation = ctx.cfg.validation
    mode = validation.layerwise.value
    reason = "always (validation.layerwise=always)" if mode == "always" else "the verdict failed"
    graph = layerwise.Graph(onnx.load(str(ctx.results["convert"].path("model"))))
    samples = [sample.feeds for _, sample in zip(range(validation.layerwise_samples), dataset.validation)]
    try:
        result = layerwise.compare(reference, target, graph, samples, validation.layer_min_cosine,
                                   progress=progress)
    except BackendCrashed as err:
        return {"mode": mode, "ran": False, "reason": f"layerwise probing failed: {err}"}
    side_file = "layerwise.json.gz"
    result.write_side_file(ctx.out_dir / side_file)
    return result.summary(mode, reason, side_file)


def _check_output_names(validation, outputs: List[str]) -> None:
    named = list(validation.outputs) + ([validation.task_output] if validation.task_output else [])
    for name in named:
        if name not in outputs:
            raise ConfigError(f"validation: the model has no output {name!r}; outputs: {', '.join(outputs)}")


def _judge(name: str, stats: OutputStats, validation) -> dict:
    metrics = stats.result()
    limits = validation.thresholds_for(name)
    failed = failures(metrics, limits)
    return {"name": name, "passed": not failed, "failures": failed, "thresholds": vars(limits),
            "metrics": metrics,
            # Polygraphy-style: either tolerance alone would pass every element (rel: null, none would)
            "min_tolerances": {"abs": stats.max_abs, "rel": stats.max_rel if np.isfinite(stats.max_rel) else None},
            "per_sample": {"cosine": stats.sample_cosine[:1000], "max_abs": stats.sample_max_abs[:1000]}}


def _verdict(outputs, missing, task, requested, effective, samples, crash):
    """Reasons the run fails, and the exit code: 4 when the backend crashed, hung or did
    not run what was asked, 3 when a threshold fails. A verdict never passes on nothing."""
    if crash:
        what = "hung" if crash["kind"] == "hung" else "crashed"
        tail = "; ".join(crash["stderr_tail"][-3:])
        return [f"backend {what}: {crash['detail']}" + (f" (stderr: {tail})" if tail else "")], ExitCode.BACKEND
    accepted = {"device": {requested["device"]}, "precision": set(requested["accepted_precisions"])}
    mismatched = [f"requested {key} {requested[key]} but {effective.get(key)} ran"
                  for key in ("device", "precision") if str(effective.get(key, "")).lower() not in
                  {value.lower() for value in accepted[key]}]
    if mismatched:
        why = effective.get("note")  # the backend's own account of the fallback
        return [f"{reason}: {why}" if why else reason for reason in mismatched], ExitCode.BACKEND
    reasons = [f"output {name} was not produced by the target" for name in missing]
    if samples == 0:
        reasons.append("no validation samples were compared")
    if not outputs:
        reasons.append("no outputs were compared")
    reasons += [f"output {o['name']}: {failure}" for o in outputs for failure in o["failures"]]
    if task and not task["passed"]:
        reasons.append(f"top-1 accuracy dropped {task['drop'] * 100:.2f} points "
                       f"({task['reference']:.4f} -> {task['target']:.4f}), allowed {task['max_drop'] * 100:.2f}")
    return reasons, (ExitCode.THRESHOLD if reasons else ExitCode.OK)
