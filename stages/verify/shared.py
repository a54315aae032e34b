"""What verify's measurement and its diagnosis share: the backend workers verify runs (the
reference and the target, launched once, when first needed; the baselines the build stage
made; the advice trials' builds, made by the build stage's own way of building) and an
output's judgement."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import List, Optional

import numpy as np

from pipeline import tuning
from pipeline.backends import artifact
from pipeline.errors import BackendCrashed, BackendUnavailable, ConfigError
from pipeline.verification.metrics import OutputStats, failures
from pipeline.verification.scoring import task_outputs
from pipeline.worker import BackendWorker
from stages import REFERENCE_MODULE, StageContext, reference_settings


class Live:
    """The reference and target workers of this verify, launched when first needed: by the
    measurement, or by the diagnosis of a measurement served from the cache. A measurement
    whose reference answers are all in their store starts the reference only if something
    then asks it (``workers(lazy_reference=True)``; a process and 0.15 s of CPU a verify)."""

    def __init__(self, ctx: StageContext, deployed, launching):
        self.ctx, self.deployed, (self.stack, self.limits) = ctx, deployed, launching
        self.reference: Optional[BackendWorker] = None
        self.target: Optional[BackendWorker] = None
        self._loaded: set = set()

    def launch(self, reference: bool = True) -> None:
        cfg, (backend, artifact, settings) = self.ctx.cfg, self.deployed
        if reference and self.reference is None:
            convert = self.ctx.results["convert"]
            self.reference = launch_worker(self.stack, REFERENCE_MODULE, convert.out_dir,
                                           reference_settings(convert), "reference (onnxruntime fp32)", self.limits)
        if self.target is None:
            self.target = launch_worker(self.stack, backend.__name__, artifact.out_dir, settings,
                                        f"{cfg.target.name} ({backend.NAME} {cfg.precision.kind})", self.limits)

    def workers(self, lazy_reference: bool = False) -> tuple:
        """(reference, target), both loaded (waited for once); with ``lazy_reference`` and
        the reference not started yet, a stand-in that starts it on its first run."""
        self.launch(reference=not lazy_reference)
        for worker in (self.reference, self.target):
            if worker is not None and id(worker) not in self._loaded:
                loaded(worker)
                self._loaded.add(id(worker))
        return self.reference or _ReferenceOnFirstRun(self), self.target


class _ReferenceOnFirstRun:
    def __init__(self, live: Live):
        self.live = live

    def run(self, feeds: dict) -> dict:
        return self.live.workers()[0].run(feeds)


def launch_worker(stack, module: str, folder: Path, settings: dict, label: str, limits: dict) -> BackendWorker:
    """A worker process started (closed with the stack); its load is awaited by loaded,
    so that the workers of one verify start side by side."""
    worker = BackendWorker(module, folder, settings, label=label, timeout_s=limits["timeout_s"],
                           memory_mb=limits["memory_mb"])
    stack.callback(worker.close)
    worker.launch()
    return worker


def loaded(worker: BackendWorker) -> BackendWorker:
    try:
        worker.wait_loaded()
    except BackendCrashed as err:
        if err.kind == "error":  # the runtime refused the artifact: a clear error, not a crash
            raise BackendUnavailable(f"{worker.label} failed to load the artifact: {err.detail}") from err
        raise
    return worker


def tuned(ctx, backend, settings: dict) -> dict:
    """runtime.yaml's ``settings`` of a build on the target's backend with the runtime changes
    tune chose for the artifact (none when tune kept the build's): every build verify runs
    beside the artifact runs as it does."""
    tune = ctx.results.get("tune")
    changes = tune.summary.changes if tune is not None and "runtime" in tune.files else {}
    return tuning.apply(backend, settings, changes)


def baseline_worker(ctx, backend, stack, limits: dict, role: str, label: str):
    """(worker, bytes) of a baseline the build stage made (its result's ``role``: the
    runtime.yaml in baselines/<precision>/), launched with tune's settings."""
    build = ctx.results["build"]
    if role not in build.files:
        raise ConfigError(f"verify: the build stage made no {role}: it makes the baselines when pipeline.stages "
                          "has verify")
    folder = build.path(role).parent
    settings = artifact.read(folder)
    return launch_worker(stack, backend.__name__, folder, tuned(ctx, backend, settings), label, limits), \
        artifact.size(folder, settings)


def built_worker(ctx, backend, stack, limits: dict, onnx_path: Optional[Path], precision: str, label: str,
                 own_float_ops: Optional[List[str]] = None) -> BackendWorker:
    """A diagnosis experiment (an advice trial or screening): ``onnx_path`` built in a scratch
    folder by the build the build stage makes its artifacts with (StageContext.build_into;
    ``own_float_ops``: by the runtime's own quantizer, these ops float), launched with tune's
    settings."""
    folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix=f"parity-{precision}-")))
    runtime, _ = ctx.build_into(folder, backend, precision, onnx_path, own_float_ops=own_float_ops)
    return launch_worker(stack, backend.__name__, folder, tuned(ctx, backend, runtime), label, limits)


def judge_output(name: str, stats: OutputStats, validation, task: Optional[dict]) -> dict:
    """One output's checks; with a task metric scored (``task``), its output's cosine is
    gated at validation.task_min_cosine (docs/verify.md, "Task-first verdicts")."""
    metrics = stats.result()
    scored = name in task_outputs(task)  # the task output, or either of a pair metric's two
    limits = validation.thresholds_for(name, name if scored else None)
    failed = failures(metrics, limits)
    task_gated = scored and validation.cosine_gate(True) != validation.min_cosine
    return {"name": name, "passed": not failed, "failures": failed, "thresholds": vars(limits),
            "cosine_gate": "task_min_cosine" if task_gated else "min_cosine",
            "metrics": metrics,
            # Polygraphy-style: either tolerance alone would pass every element (rel: null, none would)
            "min_tolerances": {"abs": stats.max_abs, "rel": stats.max_rel if np.isfinite(stats.max_rel) else None},
            "per_sample": {"cosine": stats.sample_cosine[:1000], "max_abs": stats.sample_max_abs[:1000]}}


def judged_with(ctx) -> dict:
    return {"fail_on_float_fallback": ctx.cfg.validation.fail_on_float_fallback,
            "intended_float": ctx.results["build"].summary.kept_float,
            "max_memory_mb": ctx.cfg.validation.max_memory_mb}


MEMORY_TWIN = "memory=default"  # target.memory=low: the same build loaded with the runtime's defaults


class Row:
    """One build in the side-by-side table: output agreement, top-1, latency, size."""

    def __init__(self, worker, size, stats=None):
        self.worker, self.size = worker, size
        self.stats = stats if stats is not None else {}
        self.error: Optional[str] = None
        self.compared = True  # False: timed and run for its memory only (validation.baselines=timed)

    def wait_loaded(self) -> None:
        try:
            loaded(self.worker)
        except (BackendCrashed, BackendUnavailable) as err:  # a side-by-side build is information only
            self.error = str(err)

    def receive(self, answer) -> Optional[dict]:
        """This build's outputs for the sample (side_by_side's answer); None once it failed."""
        if self.error:
            return None
        if isinstance(answer, BackendCrashed):  # a side-by-side build is information, not the verdict
            self.error = str(answer)
            return None
        return answer

    def compare(self, expected: dict, actual: Optional[dict]) -> Optional[dict]:
        """``actual`` (receive()'s) compared with the reference's outputs."""
        if actual is not None:
            for name in expected:
                self.stats.setdefault(name, OutputStats()).update(expected[name], actual[name])
        return actual

    def result(self, timing: Optional[dict]) -> dict:
        if self.error or (timing or {}).get("error"):
            return {"error": self.error or timing["error"], "bytes": self.size}
        first = next(iter(self.stats.values()), None)
        return {"latency": timing, "bytes": self.size, "top1": None,
                "cosine": first.result()["cosine"] if first and first.elements else None,
                **({} if self.compared else {"compared": False})}


class MemoryTwin(Row):
    """target.memory=low: the target's artifact in a worker of its own with options.memory
    default, fed every validation sample beside the target (as a baseline row; its outputs
    never compared nor scored) so that its peak memory compares with the target's."""

    def __init__(self, worker: BackendWorker):
        super().__init__(worker, None)

    def compare(self, expected: dict, actual) -> None:
        return None


def memory_twin(live: Live) -> Optional[MemoryTwin]:
    """The memory=default twin of a target.memory=low build (None otherwise), launched."""
    backend, artifact, settings = live.deployed
    options = settings.get("options") or {}
    if options.get("memory") != "low":
        return None
    twin = {**settings, "options": {**options, "memory": "default"}}
    return MemoryTwin(launch_worker(live.stack, backend.__name__, artifact.out_dir, twin,
                                    f"{live.ctx.cfg.target.name} ({backend.NAME} {live.ctx.cfg.precision.kind}, "
                                    f"{MEMORY_TWIN})", live.limits))


def measure_memory(target: BackendWorker, rows: dict, twin: Optional[MemoryTwin], mode: str, samples: int,
                   baseline_samples: Optional[int] = None) -> dict:
    """verify.memory (pipeline/verification/memory.py): read right after the validation
    samples, before anything else runs in the workers; the twin is closed then.
    ``baseline_samples``: the baselines ran only this many (validation.baselines=timed)."""
    from pipeline.verification import memory

    baselines = {name: memory.reading(row.worker) for name, row in rows.items() if not row.error}
    twin_reading = memory.reading(twin.worker) if twin is not None and twin.error is None else None
    if twin is not None:
        twin.worker.close()
    return memory.summary(memory.reading(target), baselines, twin_reading, mode, samples, baseline_samples)
