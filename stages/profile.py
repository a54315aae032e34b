"""profile: per-layer times of the built artifact on its backend, mapped to the converted
model's ONNX node names (pipeline.profiling; docs/tuning.md#profiles).

The artifact verify judged (build's, or tune's runtime settings: stages.deployable) runs
in a worker process on the first validation sample: ``warmup`` runs,
then ``runs`` profiled runs, through its Session's ``profile`` method (a separate profiling
session or compiled model: the one verify ran is not changed). ``profile.json`` holds every
layer; the summary (the report's Profile section) the top layers and the time by op type.

With a compile cache, the same worker also times start-up (load + first inference) with
the cache and without it, alternating, so the report shows cold vs warm start-up.

Profiling is information, never a gate: a backend without a profiler, or one that crashes,
hangs or refuses while profiling, gives a summary that says so; the verdict and the exit
code stay verify's. Timings belong to the machine: the cache key includes its fingerprint."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import List

import yaml

from pipeline import backends, environment, profiling
from pipeline.release import compile_cache
from pipeline.artifacts import write_json
from pipeline.errors import BackendCrashed
from pipeline.worker import BackendWorker
from stages import StageContext, StageResult, deployable
from stages.results import ProfileSummary

NAME = "profile"
CACHEABLE = True
ON_MACHINE = "device"
READS = {"convert": ["model"], "build": None, "tune": None}
PROFILE_FILE = "profile.json"
log = logging.getLogger("parity")


def key_config(cfg):
    return {"profile": cfg.profile, "data": cfg.data, "machine": environment.fingerprint()}


def external_files(ctx: StageContext) -> List[Path]:
    return ctx.dataset().files if "convert" in ctx.results else []



def run(ctx: StageContext) -> StageResult:
    cfg = ctx.cfg
    about = {"target": cfg.target.name, "precision": cfg.precision.kind}
    if "build" not in ctx.results or "convert" not in ctx.results:
        return _skipped(ctx, about, "nothing to profile: pipeline.stages has no convert and build before profile")
    artifact, convert = deployable(ctx.results), ctx.results["convert"]  # tune's settings when it changed them
    settings = yaml.safe_load(artifact.path("runtime").read_text())
    backend = backends.spec(settings["backend"])
    about["backend"] = backend.NAME
    ok, reason = backend.available()
    if not ok:
        return _skipped(ctx, about, reason, cache=False)
    if not backend.CAPABILITIES.profiler:
        return _skipped(ctx, about, f"backend {backend.NAME} has no per-layer profiler")
    sample = next(iter(ctx.dataset().validation), None)
    if sample is None:
        return _skipped(ctx, about, "no validation sample to profile")
    limits, nodes = cfg.profile, profiling.Nodes.load(convert.path("model")).to_json()
    label = f"{cfg.target.name} ({backend.NAME} {cfg.precision.kind}) profile"
    try:
        with BackendWorker(backend.__name__, artifact.out_dir, settings, label=label,
                           timeout_s=limits.worker_timeout_s, memory_mb=limits.worker_memory_mb) as worker:
            found = worker.call("profile", sample.feeds, limits.runs, limits.warmup, nodes, limits.max_seconds)
            startup = _startup(worker, settings, sample.feeds, limits.startup_rounds)
    except BackendCrashed as err:
        log.warning("profile: %s", err)
        crash = {"kind": err.kind, "backend": err.worker, "detail": err.detail, "stderr_tail": err.stderr_tail}
        what = {"hung": "hung", "error": "failed", "memory": "ran out of memory"}.get(err.kind, "crashed")
        return _skipped(ctx, about, f"profiling {what}: {err.detail}", cache=False, crash=crash)
    write_json(ctx.out_dir / PROFILE_FILE, {**found, **about, "sample": sample.name,
                                            "machine": environment.fingerprint(), "cpu": environment.cpu()})
    summary = {**about, "ran": True, "sample": sample.name, "file": PROFILE_FILE,
               **profiling.summarize(found, limits.top), "startup": startup}
    return StageResult(ctx.out_dir, {"profile": PROFILE_FILE}, ProfileSummary.from_json(summary))


def _startup(worker: BackendWorker, settings: dict, feeds: dict, rounds: int):
    """Load + first inference with the bundle's compile cache and without it, alternating,
    in the worker (its runtime already initialised, so the two differ by the compilation)."""
    if not rounds or not settings.get(compile_cache.CACHE_FIELD):
        return None
    found = worker.startup({"warm": settings, "cold": compile_cache.without_cache(settings)}, feeds, rounds)
    cold, warm = found["seconds"]["cold"], found["seconds"]["warm"]
    return {"cold_s": cold, "warm_s": warm, "speedup": cold / warm if warm > 0 else None,
            "compile_cache": found["compile_cache"]["warm"], "rounds": rounds}


def _skipped(ctx: StageContext, about: dict, reason: str, cache: bool = True, crash=None) -> StageResult:
    """A summary that says why there is no profile (a crash is measured again next run)."""
    summary = {**about, "ran": False, "reason": reason}
    if crash is not None:
        summary["crash"] = crash
    return StageResult(ctx.out_dir, {}, ProfileSummary.from_json(summary), cache=cache)
