"""verify: run the built artifact on its real backend and the fp32 ONNX Runtime
reference on the validation set, compare every output against the thresholds, check
the task metric when labels exist, and read back what the backend really ran."""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import List

import yaml
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from pipeline import backends
from pipeline.backends import onnxruntime as ort_backend
from pipeline.console import stderr_console
from pipeline.data import Dataset, TensorSpec, open_dataset
from pipeline.errors import BackendUnavailable, ConfigError, ExitCode, first_line
from pipeline.metrics import OutputStats, Top1, failures, latency
from stages import StageContext, StageResult

NAME = "verify"
# mixed with an empty qtable (plain int8 met the target) runs int8 everywhere
ACCEPTED_PRECISIONS = {"mixed": {"mixed", "int8"}}
VERSION = 1
CACHEABLE = True
log = logging.getLogger("parity")


def key_config(cfg):
    return {"validation": cfg.validation, "data": cfg.data, "target": cfg.target, "precision": cfg.precision}


def external_files(ctx: StageContext) -> List[Path]:
    return _dataset(ctx).files


def _dataset(ctx: StageContext) -> Dataset:
    inputs = [TensorSpec(**spec) for spec in ctx.results["convert"].summary["inputs"]]
    return open_dataset(ctx.cfg.data, inputs)


def run(ctx: StageContext) -> StageResult:
    cfg = ctx.cfg
    dataset = _dataset(ctx)
    build = ctx.results["build"]
    settings = yaml.safe_load(build.path("runtime").read_text())
    backend = backends.spec(settings["backend"])
    ok, reason = backend.available()
    if not ok:
        raise BackendUnavailable(f"target {cfg.target.name}: {reason}")
    try:
        reference = ort_backend.reference(ctx.results["convert"].path("model"))
    except Exception as err:  # noqa: BLE001 - e.g. an op ONNX Runtime does not implement
        raise BackendUnavailable(f"the reference (ONNX Runtime fp32) cannot load the converted model: "
                                 f"{first_line(err)}") from err
    try:
        session = backend.load(build.out_dir, settings)
    except Exception as err:  # the runtime refused the artifact: not the user's input
        raise BackendUnavailable(f"target {cfg.target.name}: {backend.NAME} failed to load the artifact: "
                                 f"{first_line(err)}") from err

    _check_output_names(cfg.validation, reference.outputs)
    task_output = cfg.validation.task_output or reference.outputs[0]
    stats = {name: OutputStats() for name in reference.outputs}
    top1 = Top1()
    missing = [name for name in reference.outputs if name not in session.outputs]
    with _progress() as progress:
        task = progress.add_task(f"verify {cfg.target.name}", total=len(dataset.validation))
        for sample in dataset.validation:
            expected = reference.run(sample.feeds)
            actual = session.run(sample.feeds)
            for name in stats:
                if name in actual:
                    stats[name].update(expected[name], actual[name])
            if sample.label is not None and task_output in actual:
                top1.update(expected[task_output], actual[task_output], sample.label)
            progress.advance(task)

    requested = {"device": cfg.target.device.upper(), "precision": cfg.precision.name.value}
    effective = session.effective()
    comparison = _compare_with_fp32(ctx, backend, session, sample.feeds, build, top1) if len(dataset.validation) else None
    outputs = [_judge(name, stats[name], cfg.validation) for name in reference.outputs if name not in missing]
    task = top1.result(cfg.validation.max_metric_drop, task_output)
    reasons, exit_code = _verdict(outputs, missing, task, requested, effective, len(dataset.validation))
    summary = {
        "samples": len(dataset.validation),
        "requested": requested,
        "effective": effective,
        "outputs": outputs,
        "missing_outputs": missing,
        "task": task,
        "comparison": comparison,
        "data": dataset.summary(),
        "verdict": "pass" if exit_code == ExitCode.OK else "fail",
        "exit_code": int(exit_code),
        "reasons": reasons,
    }
    return StageResult(ctx.out_dir, {}, summary)



def _compare_with_fp32(ctx, backend, session, feeds, build, top1) -> dict:
    """The build side by side with an fp32 build on the same backend: latency, size, top-1."""
    precision = ctx.cfg.precision.name.value
    row = {"latency": latency(session.run, feeds), "bytes": build.summary.get("bytes"),
           "top1": top1.target_correct / top1.count if top1.count else None}
    if precision == "fp32":
        return {"fp32": row}
    convert = ctx.results["convert"]
    ir_dir = convert.out_dir if "ir_xml" in convert.files else None
    with tempfile.TemporaryDirectory(prefix="parity-fp32-") as scratch:
        files, settings = backend.build(convert.path("model"), ir_dir, Path(scratch), ctx.cfg.target, "fp32")
        settings = {**settings, "device": ctx.cfg.target.device.upper(), "precision": "fp32",
                    "outputs": convert.summary["outputs"]}
        baseline = backend.load(Path(scratch), settings)
        fp32 = {"latency": latency(baseline.run, feeds),
                "bytes": sum((Path(scratch) / f).stat().st_size for f in files),
                "top1": top1.reference_correct / top1.count if top1.count else None}
    return {"fp32": fp32, precision: row}


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
            "per_sample": {"cosine": stats.sample_cosine[:1000], "max_abs": stats.sample_max_abs[:1000]}}


def _verdict(outputs, missing, task, requested, effective, samples):
    """Reasons the run fails, and the exit code: 4 when the backend did not run what was
    asked, 3 when a threshold fails. A verdict never passes on nothing."""
    accepted = {"device": {requested["device"]}, "precision": ACCEPTED_PRECISIONS.get(requested["precision"],
                                                                                      {requested["precision"]})}
    mismatched = [f"requested {key} {requested[key]} but {effective.get(key)} ran"
                  for key in ("device", "precision") if str(effective.get(key, "")).lower() not in
                  {value.lower() for value in accepted[key]}]
    if mismatched:
        return mismatched, ExitCode.BACKEND
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


def _progress() -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                    console=stderr_console(), transient=True, disable=not stderr_console().is_terminal)
