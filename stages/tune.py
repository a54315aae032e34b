"""tune: measure the built artifact's runtime settings on this machine and keep the
fastest one for the objective that still passes the validation thresholds.

The search (pipeline/tuning.py) runs every candidate in a fresh worker process. Its
measurements are cached per (artifact, runtime versions, machine fingerprint, tuning
config), like MNN's tuning cache file: a second run on the same machine skips them. The
chosen setting is re-verified against the fp32 reference on the first validation
samples before it is written; a setting that fails is refused and the next best tried.
When the build's own settings win, nothing is written and later stages use build's."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Dict, List, Optional

import yaml

from pipeline import backends, environment, tuning
from pipeline.release import compile_cache
from pipeline.artifacts import hash_files, read_json, write_json
from pipeline.console import progress_bar
from pipeline.errors import BackendCrashed, BackendUnavailable
from pipeline.verification.metrics import output_failures
from pipeline.worker import BackendWorker
from stages import REFERENCE_MODULE, StageContext, StageResult, machine, reference_settings
from stages.results import TuneSummary

NAME = "tune"
CACHEABLE = True
ON_MACHINE = "device"  # runtime settings timed on this machine
log = logging.getLogger("parity")


def key_config(cfg):
    if cfg.tuning.level.value == "none":
        return {"level": "none"}
    # the thresholds, not how a failing verify is diagnosed; the machine is in every key of
    # an ON_MACHINE stage (stages.machine)
    return {"tuning": cfg.tuning, "data": cfg.data, "validation": cfg.validation.judged()}


def external_files(ctx: StageContext) -> List[Path]:
    return [] if ctx.cfg.tuning.level.value == "none" else ctx.dataset().files



def _skipped(ctx: StageContext, reason: str, **extra) -> StageResult:
    log.info("tune: %s", reason)
    summary = {**extra, "ran": False, "level": ctx.cfg.tuning.level.value, "reason": reason}
    return StageResult(ctx.out_dir, {}, TuneSummary.from_json(summary))


def run(ctx: StageContext) -> StageResult:
    cfg = ctx.cfg.tuning
    if cfg.level.value == "none":
        return _skipped(ctx, "tuning=none: the build's runtime settings are kept")
    build = ctx.results["build"]
    settings = yaml.safe_load(build.path("runtime").read_text())
    backend = backends.spec(settings["backend"])
    ok, reason = backend.available()
    if not ok:
        raise BackendUnavailable(f"target {ctx.cfg.target.name}: {reason}")
    if not backend.CAPABILITIES.tuning:
        return _skipped(ctx, f"backend {backend.NAME} has no runtime settings to tune")
    space = backend.tuning_space(settings, cfg.level.value, cfg.objective.value, list(cfg.devices))
    samples = [s.feeds for _, s in zip(range(cfg.verify_samples), ctx.dataset().validation)]
    folder, reused = ctx.memo("tuning", _material(ctx, build, settings, space, samples[0]),
                              lambda out: write_json(out / "trials.json", _search(ctx, backend, build, settings,
                                                                                  space, samples[0])))
    trials = [tuning.Trial.from_json(t) for t in read_json(folder / "trials.json")["trials"]]
    baseline = trials[0]
    summary = {"ran": True, "level": cfg.level.value, "objective": cfg.objective.value, "backend": backend.NAME,
               "reused": reused, "space": [{"option": name, "values": values} for name, values in space],
               "baseline": baseline.to_json(), "noise": cfg.noise}
    if not baseline.ok:
        return _skipped(ctx, f"the build's own settings did not run: {baseline.error}", **summary)
    requested, ran = str(settings.get("device", "CPU")).upper(), str(baseline.measurement.get("device", "")).upper()
    if ran and ran != requested:
        return _skipped(ctx, f"{requested} did not run ({ran} did): nothing to tune; verify reports the fallback",
                        **summary)
    chosen, verdicts = _verified_choice(ctx, backend, build, settings, baseline, tuning.ranked(trials, cfg.noise),
                                        samples)
    summary.update(_outcome(trials, baseline, chosen, verdicts, len(samples)))
    files: Dict[str, str] = {}
    if chosen is not None and chosen is not baseline:
        files, summary["compile_cache"] = _write_tuned(ctx, backend, build,
                                                       tuning.apply(backend, settings, chosen.changes))
    return StageResult(ctx.out_dir, files, TuneSummary.from_json(summary))


def _material(ctx: StageContext, build, settings: dict, space, feeds) -> dict:
    """What the measurements depend on: the artifact, the runtime, this machine, the
    settings tried and how they are measured."""
    import hashlib

    artifacts = [build.out_dir / name for name in settings["files"]]
    cfg = ctx.cfg.tuning
    return {"artifact": sorted(hash_files(artifacts).values()), "settings": compile_cache.without_cache(settings),
            "versions": environment.versions(), "machine": machine(ctx.cfg.target), "space": space,
            "level": cfg.level.value, "objective": cfg.objective.value, "warmup": cfg.warmup, "repeats": cfg.repeats,
            "noise": cfg.noise,
            "feeds": hashlib.sha256(b"".join(feeds[name].tobytes() for name in sorted(feeds))).hexdigest()}


def _search(ctx: StageContext, backend, build, settings: dict, space, feeds) -> dict:
    cfg = ctx.cfg.tuning
    level = tuning.LEVELS[cfg.level.value]
    warmup = level.warmup if cfg.warmup is None else cfg.warmup
    repeats = level.repeats if cfg.repeats is None else cfg.repeats
    timeout = ctx.cfg.validation.worker_timeout_s

    def measure(changes: dict) -> dict:
        candidate = tuning.apply(backend, settings, changes)
        label = f"{backend.NAME} tuning candidate {changes or 'build settings'}"
        with BackendWorker(backend.__name__, build.out_dir, candidate, label=label, timeout_s=timeout,
                           memory_mb=ctx.cfg.validation.worker_memory_mb) as worker:
            if cfg.objective.value == "throughput":
                measurement = worker.throughput(feeds, warmup, repeats)
            else:
                measurement = worker.latency(feeds, warmup, repeats)
            measurement["device"] = worker.effective().get("device")
        return measurement

    with progress_bar() as progress:
        search = tuning.Search(space, measure, cfg.noise, level.passes)
        task = progress.add_task(f"tune {ctx.cfg.target.name} ({cfg.level.value})", total=search.planned())
        search.on_trial = lambda: progress.advance(task)
        trials = search.run()
    return {"warmup": warmup, "repeats": repeats, "trials": [trial.to_json() for trial in trials]}


def _verified_choice(ctx: StageContext, backend, build, settings: dict, baseline: tuning.Trial,
                     ranked: List[tuning.Trial], samples: List[dict]):
    """The best-ranked trial whose outputs pass the validation thresholds against the
    reference on ``samples`` (None if none does); the build's settings are always judged
    too (first), so the report says whether they pass. Returns (chosen, {order: failures})."""
    convert = ctx.results["convert"]
    limits = {"timeout_s": ctx.cfg.validation.worker_timeout_s, "memory_mb": ctx.cfg.validation.worker_memory_mb}
    with BackendWorker(REFERENCE_MODULE, convert.out_dir, reference_settings(convert),
                       label="reference (onnxruntime fp32)", **limits) as reference:
        expected = [reference.run(feeds) for feeds in samples]
    verdicts: Dict[int, List[str]] = {}

    def judge(trial: tuning.Trial) -> List[str]:
        if trial.order not in verdicts:
            verdicts[trial.order] = _failures(ctx, backend, build, tuning.apply(backend, settings, trial.changes),
                                              samples, expected, limits)
        return verdicts[trial.order]

    judge(baseline)
    for trial in ranked:
        if not judge(trial):
            return trial, verdicts
    return None, verdicts


def _failures(ctx: StageContext, backend, build, candidate: dict, samples, expected, limits) -> List[str]:
    try:
        with BackendWorker(backend.__name__, build.out_dir, candidate, label=f"{backend.NAME} tuned (re-verify)",
                           **limits) as worker:
            return output_failures(worker.run, samples, expected, ctx.cfg.validation.thresholds_for)
    except BackendCrashed as err:
        return [f"crashed while re-verifying: {err.detail}"]


def _outcome(trials: List[tuning.Trial], baseline: tuning.Trial, chosen: Optional[tuning.Trial],
             verdicts: Dict[int, List[str]], samples: int) -> dict:
    rows = []
    for trial in trials:
        row = trial.to_json()
        if trial.order in verdicts:
            row["verified"] = not verdicts[trial.order]
            row["failures"] = verdicts[trial.order]
        rows.append(row)
    kept = chosen or baseline
    speedup = (tuning.score(baseline.measurement) / tuning.score(kept.measurement)) if kept.ok else None
    refused = [row for row in rows if row.get("verified") is False]
    note = None
    if chosen is None:
        note = "no setting passed the thresholds on the re-verification samples: the build's settings are kept"
    elif chosen is baseline:
        note = "the build's settings are the fastest (or tie with the fastest)"
    return {"trials": rows, "chosen": kept.to_json(), "changed": bool(kept.changes), "speedup": speedup,
            "refused": len(refused), "verify_samples": samples, "note": note,
            "baseline_passes": not verdicts.get(baseline.order, ["not judged"])}


def _write_tuned(ctx: StageContext, backend, build, settings: dict):
    """The artifact folder with the tuned runtime.yaml and a compile cache for it (the
    artifact files are hard links to build's where the file system allows): (files, the
    compile cache's summary or None)."""
    files = {}
    for name in settings["files"]:
        target = ctx.out_dir / name
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(build.out_dir / name, target)
        except OSError:
            shutil.copyfile(build.out_dir / name, target)
        files[f"artifact:{name}"] = name
    cache = compile_cache.write(backend, ctx.out_dir, settings)
    if cache:
        files["compile_cache"] = cache["folder"]
    (ctx.out_dir / "runtime.yaml").write_text(yaml.safe_dump(settings, sort_keys=False))
    files["runtime"] = "runtime.yaml"
    return files, cache
