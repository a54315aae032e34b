"""precision=auto's timings: the screening of a candidate against fp32 on one validation
sample before it is verified (a first look of single runs, then short interleaved rounds),
and the interleaved timing of builds in their own workers (pipeline/verification/speed.py).
docs/config.md, "precision=auto"."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Callable, Dict, Optional, Tuple

import yaml

from pipeline import backends, shapes
from pipeline.app.runner import RunOutcome
from pipeline.console import job_step
from pipeline.errors import BackendCrashed, first_line
from pipeline.precision import kinds
from pipeline.verification import speed

log = logging.getLogger("parity")
REFERENCE = kinds.REFERENCE
# screening: a candidate whose speed-up over fp32 stays below this in three timing rounds of
# four (p75) is measurably slower; it is reported as such and not verified (it cannot win)
SCREEN_SLOWER = 0.8
# the screening's first look: 3 rounds of one run each (after one warm-up run); a candidate
# slower than 1/FAR_SLOWER x fp32 in every round is decided on it (the segmenter's dynamic
# int8 at 1.6 s a run: 4 of its runs instead of the 10 a fitted warm-up asked, 18 -> 8 s)
FIRST_LOOK = {"rounds": 3, "runs": 1, "max_seconds": 0.0, "round_ms": 0.0, "tight": None}
FAR_SLOWER = 0.5
# ... and one faster than CLEARLY_FASTER x fp32 in them (p25) is decided too: it is far from
# SCREEN_SLOWER, and its verify times it again if it passes (the segmenter's int8 and mixed:
# about 3 s of screening rounds each, twice that on a 2x slower machine)
CLEARLY_FASTER = 1.25
# ... where one run of the baseline takes this long at least: a single run of a sub-millisecond
# model is mostly its threads waking (a 0.1 ms CNN on ncnn: int8 5.19x fp32 in single runs,
# 0.94x in the screening's rounds), so below it the rounds decide
FIRST_LOOK_MIN_MS = 5.0
SCREEN_SECONDS = 3.0  # the screening timing's budget per candidate (3 rounds at least)
# speed.interleaved's options; one process a build: a screening sorts out the clearly slower,
# the printed speed-up is the verify's (two processes a short build, speed.SHORT_RUN_MS)
SCREEN_TIMING = {"rounds": 5, "max_seconds": SCREEN_SECONDS, "tight": None, "processes": 1}
SLOWER = "slower than fp32"


def screened(fp32: Optional[RunOutcome], built: RunOutcome, checked) -> Optional[dict]:
    """The candidate's speed-up on a short interleaved timing of one validation sample: with
    the verdict SLOWER where it is measurably slower than fp32 (SCREEN_SLOWER), else to keep
    in its row while it is verified; None where it is not screened. A candidate that cannot
    win on speed is not verified in full (int8 with dynamic ranges ran 6x slower than fp32 on
    a convolutional network, and its verify took 155 s). Not screened: a run with a memory
    budget (a slower build may be the one that fits) and a model of several input shapes
    (speed as served is a stream, timed after verify)."""
    if fp32 is None or checked.validation.max_memory_mb is not None:
        return None
    timings, timed_on = _screen_timings(fp32, built, checked)
    up = speed.speedups(timings).get("candidate")
    if up is None:
        return None
    if up["speedup_p75"] >= SCREEN_SLOWER:
        return {"speedup": up, "latency": timings["candidate"], "timed_on": f"{timed_on}, before verification"}
    return {"verdict": SLOWER, "speedup": up, "latency": timings["candidate"], "timed_on": timed_on,
            "reasons": [f"{up['speedup']:.2f}x fp32 (rounds {up['speedup_p25']:.2f}-{up['speedup_p75']:.2f}x) on a "
                        f"short timing before verification: {_how_slower(timed_on)}, so it "
                        f"cannot ship and was not verified"]}


def _how_slower(timed_on: str) -> str:
    if "first look" in timed_on:
        return f"under {FAR_SLOWER:g}x fp32 in each of {FIRST_LOOK['rounds']} single runs"
    return "slower than fp32 in three rounds of four"


def _screen_timings(fp32: RunOutcome, built: RunOutcome, checked) -> Tuple[dict, str]:
    """The screening's timings of fp32 and the candidate, taken once per pair of builds,
    runtime versions and machine: a warm rerun reads them from the stage cache."""
    from pipeline import environment
    from pipeline.artifacts import read_json, write_json
    from stages import memo

    def produce(folder: Path) -> None:
        job_step("timing against fp32")
        found = time_builds({REFERENCE: fp32, "candidate": built}, checked, one_sample_only=True,
                             first_look=decided_at_first_look, **SCREEN_TIMING)
        write_json(folder / "timings.json", {"timings": found[0], "timed_on": found[1]} if found else {})

    material = {"format": 2, "builds": [artifact(fp32), artifact(built)], "threads": checked.target.threads,
                "data": str(checked.data), "machine": environment.fingerprint(), "runtimes": environment.versions()}
    cache = Path(checked.pipeline.cache_dir).expanduser() if checked.pipeline.cache else None
    folder, _ = memo(cache, built.run_dir, "auto-screen", material, produce)
    found = read_json(folder / "timings.json")
    return found.get("timings", {}), found.get("timed_on", "")


def decided_at_first_look(timings: dict, candidate: str = "candidate", baseline: str = REFERENCE,
                          slower: float = FAR_SLOWER) -> bool:
    """A first look already shows ``candidate`` under ``slower`` x ``baseline``'s speed (p75:
    far slower than fp32), or clearly faster (p25 at least CLEARLY_FASTER), with runs of
    ``baseline`` long enough to be measured one at a time (FIRST_LOOK_MIN_MS)."""
    up = speed.speedups(timings, baseline=baseline).get(candidate)
    long_enough = (timings.get(baseline) or {}).get("median_ms", 0.0) >= FIRST_LOOK_MIN_MS
    return up is not None and long_enough and (up["speedup_p75"] < slower or up["speedup_p25"] >= CLEARLY_FASTER)


def time_builds(builds: Dict[str, RunOutcome], run_cfg, one_sample_only: bool = False,
                 first_look: Optional[Callable[[dict], bool]] = None, **overrides):
    """(timings by name, what they were timed on) of the builds interleaved in their own
    workers, or None when a worker crashed. ``overrides``: speed.interleaved's options
    (a screening's shorter timing). A model whose samples differ in shape is timed on the
    stream of samples in order (speed as served), except with ``one_sample_only``, which
    then times nothing (None). ``first_look``: one sample, FIRST_LOOK's single-run rounds
    first, which stand when it says they decide (a dynamic int8 build 3x slower than fp32
    took 89 s of full screening rounds on a 320x320 segmenter)."""
    from pipeline.data import TensorSpec, open_dataset
    from pipeline.worker import BackendWorker

    validation = run_cfg.validation
    first = next(iter(builds.values()))
    inputs = [TensorSpec(**spec) for spec in first.results["convert"].summary.inputs]
    split = open_dataset(run_cfg.data, inputs).validation
    stream = speed.stream_samples(split, validation.timing_stream_samples)
    several_shapes = len({shapes.shape_key(feeds) for feeds in stream}) > 1  # decide on speed as served
    if several_shapes and one_sample_only:  # decided before any build is loaded
        return None
    with contextlib.ExitStack() as stack:
        workers = {}
        for name, outcome in builds.items():
            build = outcome.results["build"]
            settings = yaml.safe_load((build.out_dir / "runtime.yaml").read_text())
            worker = BackendWorker(backends.spec(settings["backend"]).__name__, build.out_dir, settings,
                                   label=f"{settings['backend']} {name}", timeout_s=validation.worker_timeout_s,
                                   memory_mb=validation.worker_memory_mb)
            stack.callback(worker.close)
            worker.launch()
            workers[name] = worker
        try:
            for worker in workers.values():
                worker.wait_loaded()
            if several_shapes:
                return (speed.stream_interleaved(workers, stream, **speed.options(validation, stream=True)),
                        f"stream of {len(stream)} validation samples in order")
            if first_look is not None:
                look = speed.interleaved(workers, split.read(0), **FIRST_LOOK)
                if first_look(look):
                    return look, "one validation sample (a first look of single runs)"
            return (speed.interleaved(workers, split.read(0), **{**speed.options(validation), **overrides},
                                      warm=first_look is not None), "one validation sample")
        except BackendCrashed as err:
            log.warning("precision=auto: timing stopped: %s", first_line(err))
            return None


def artifact(outcome: RunOutcome) -> Optional[dict]:
    """What runs: the build's files by content and the runtime options it loads them with
    (OpenVINO's fp32 and bf16 share their files and differ by the precision hint)."""
    from pipeline.artifacts import sha256_file

    build = outcome.results.get("build")
    if build is None:
        return None
    runtime = yaml.safe_load((build.out_dir / "runtime.yaml").read_text())
    return {"files": {name: sha256_file(build.out_dir / name) for name in build.summary.files},
            "options": runtime.get("options"), "device": runtime.get("device")}
