"""verify: run the built artifact on its real backend and the fp32 ONNX Runtime
reference on the validation set, compare every output against the thresholds, check
the task metric when labels exist, and read back what the backend really ran."""

from __future__ import annotations

import contextlib
import logging
import tempfile
from pathlib import Path
from typing import List

import yaml

from pipeline import backends
from pipeline.backends import onnxruntime as ort_backend
from pipeline.console import progress_bar
from pipeline.data import Dataset, TensorSpec, open_dataset
from pipeline.errors import BackendUnavailable, ConfigError, ExitCode, first_line
from pipeline.artifacts import read_json
from pipeline.metrics import OutputStats, Top1, failures, latency
from pipeline.quantize import build_qdq
from stages import StageContext, StageResult

NAME = "verify"
# mixed with an empty qtable (plain int8 met the target) runs int8 everywhere
ACCEPTED_PRECISIONS = {"mixed": {"mixed", "int8"}}
VERSION = 2
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
    with contextlib.ExitStack() as scratch, progress_bar() as progress:
        baselines = _baselines(ctx, backend, scratch)  # fp32 (and plain int8 for mixed) side by side
        task = progress.add_task(f"verify {cfg.target.name}", total=len(dataset.validation))
        for sample in dataset.validation:
            expected = reference.run(sample.feeds)
            actual = session.run(sample.feeds)
            for name in stats:
                if name in actual:
                    stats[name].update(expected[name], actual[name])
            if sample.label is not None and task_output in actual:
                top1.update(expected[task_output], actual[task_output], sample.label)
            for baseline in baselines.values():
                baseline.update(expected, sample, task_output)
            progress.advance(task)
        last = sample.feeds if len(dataset.validation) else None
        comparison = {name: b.row(last) for name, b in baselines.items()}
        comparison[cfg.precision.name.value] = _Row(session, build.summary.get("bytes"), stats, top1).row(last)

    requested = {"device": cfg.target.device.upper(), "precision": cfg.precision.name.value}
    effective = session.effective()
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



class _Row:
    """One build in the side-by-side table: output agreement, top-1, latency, size."""

    def __init__(self, session, size, stats=None, top1=None):
        self.session, self.size = session, size
        self.stats, self.top1 = stats if stats is not None else {}, top1 if top1 is not None else Top1()

    def update(self, expected, sample, task_output) -> None:
        actual = self.session.run(sample.feeds)
        for name in expected:
            self.stats.setdefault(name, OutputStats()).update(expected[name], actual[name])
        if sample.label is not None:
            self.top1.update(expected[task_output], actual[task_output], sample.label)

    def row(self, feeds) -> dict:
        first = next(iter(self.stats.values()), None)
        return {"latency": latency(self.session.run, feeds) if feeds is not None else None, "bytes": self.size,
                "top1": self.top1.target_correct / self.top1.count if self.top1.count else None,
                "cosine": first.result()["cosine"] if first and first.elements else None}


def _baselines(ctx, backend, scratch: contextlib.ExitStack) -> dict:
    """fp32 on the same backend for every other precision; plain int8 too for mixed
    (TPU-MLIR's FLOAT / INT8 / MIX table)."""
    precision = ctx.cfg.precision.name.value
    convert = ctx.results["convert"]
    builds = {}
    if precision != "fp32":
        builds["fp32"] = (convert.path("model"), convert.out_dir if "ir_xml" in convert.files else None)
    if precision == "mixed":
        int8 = Path(scratch.enter_context(tempfile.TemporaryDirectory(prefix="parity-int8-"))) / "int8.onnx"
        calibrate = ctx.results["calibrate"]
        build_qdq(calibrate.path("prepared"), read_json(calibrate.path("table"))["tensors"], int8,
                  ctx.cfg.precision.activations.value, ctx.cfg.precision.per_channel,
                  reduce_range=ctx.results["build"].summary["quantization"]["reduce_range"])
        builds["int8"] = (int8, None)
    rows = {}
    for name, (onnx_path, ir_dir) in builds.items():
        folder = Path(scratch.enter_context(tempfile.TemporaryDirectory(prefix=f"parity-{name}-")))
        files, settings = backend.build(onnx_path, ir_dir, folder, ctx.cfg.target, name)
        settings = {**settings, "device": ctx.cfg.target.device.upper(), "precision": name,
                    "outputs": convert.summary["outputs"]}
        rows[name] = _Row(backend.load(folder, settings), sum((folder / f).stat().st_size for f in files))
    return rows


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
