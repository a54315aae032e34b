"""``precision=auto``: build and verify every precision the target can build, time the
builds side by side, and ship the fastest one that passes.

Each candidate is an ordinary run of the configured stages up to verify, in
``candidates/<precision>/`` of the run folder, with that precision's own defaults and
thresholds (``conf/precision/<name>.yaml``; ``precision.*`` overrides given with auto apply
to every candidate that has the key). The stage cache makes the shared work happen once:
convert for all, calibrate for int8 and mixed. The passing builds and the fp32 build are
then timed interleaved in rounds (pipeline/verification/speed.py, the target's own threads; rounds
sized to the model's latency, lengthened while a pair is undecided); the winner is the
fastest by median latency, and among the builds tied with it (as fast in at least a quarter
of the rounds, with a tight spread) the one keeping more of the task, then the artifact smaller
by shipped.SIZE_EDGE or more, then the higher precision; where
the timing stays undecided (wide after its budget), the higher precision.
The winner's configuration then runs the whole pipeline in the run folder (its stages up
to verify served from the cache), so the bundle, report and exit code are the winner's,
with the candidate table added (``report.json`` ``auto``). When nothing passes, the
candidate closest to passing (highest output cosine) runs instead, and its failing verdict,
reasons and recommendations are the run's.

auto decides, then explains once: candidates are verified for their verdict alone (no
layerwise, no advice trials), fp32 only when it could ship (it is built and timed as every
candidate's speed reference, and verified when no other candidate passes or it would win
the timing; beside a candidate it is timed and its memory read, not run on the validation
set: validation.baselines=timed); the shipped run's verify reuses that measurement (stored by
the build's files, not by the run's diagnosis settings) and diagnoses only when it fails.
A candidate that cannot win is not built: mixed only when plain int8 fails (with int8
passing, the search keeps nothing in float and mixed is the int8 build).

On a backend declaring ``dynamic_int8`` (ONNX Runtime) int8 is tried twice: ``int8`` with
static activation ranges (calibrated) and ``int8_dynamic``, precision=int8 with
``precision.activation_ranges=dynamic`` (ranges computed per call, no calibration); each is a
candidate of its own, timed and chosen like the others.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from omegaconf import DictConfig, OmegaConf

from pipeline import deadline
from pipeline.backends.protocol import memory_mode
from pipeline.config.schemas import Layerwise
from pipeline.config.validation import validate
from pipeline.precision import kinds
from pipeline.verification import speed
from pipeline.verification.verdict import ACCURACY_CHECKS
from pipeline.errors import (BackendUnavailable, ConfigError, ExitCode, InputError, ParityError, ReferenceUnavailable,
                             first_line)
from pipeline.app import int8_preview
from pipeline.app.budget import CUT, Budget
from pipeline.app.candidate_order import PRECISION_FILES, candidates, deferrable, ordered
from pipeline.app.reference_ahead import ReferenceAhead
from pipeline.app.runner import RunOutcome, run_pipeline
from pipeline.app.screening import SLOWER, artifact, screened, time_builds
from pipeline.app.shipped import NOT_BUILT, UNVERIFIED, choose
from stages.results import VerifySummary
from pipeline.console import PROGRESS, job_phase

log = logging.getLogger("parity")
progress_log = logging.getLogger(PROGRESS)  # parity.log's record of the candidates (pipeline/console.py)
REFERENCE = kinds.REFERENCE  # fp32: every candidate's speed reference, built always, verified when it could ship
NOT_CANDIDATE_STAGES = ("profile", "package")  # they serve the shipped build only
AUTO_ONLY = ("name", "candidates", "budget_s", "screen")  # precision keys of auto itself, not of its candidates


def candidate_config(cfg: DictConfig, precision: str) -> DictConfig:
    """The user's composed config with the precision group replaced by ``precision``'s
    file, keeping the precision.* values the user changed from auto's defaults
    (int8_dynamic: int8's file with precision.activation_ranges=dynamic)."""
    auto_defaults = OmegaConf.load(PRECISION_FILES / "auto.yaml")
    chosen = OmegaConf.load(PRECISION_FILES / f"{kinds.config_name(precision)}.yaml")
    for key, value in cfg.precision.items():
        if key not in AUTO_ONLY and (key not in auto_defaults or auto_defaults[key] != value):
            chosen[key] = value
    if kinds.dynamic(precision):
        chosen["activation_ranges"] = "dynamic"
    candidate = OmegaConf.create(OmegaConf.to_container(cfg, resolve=False))
    candidate.precision = chosen
    if candidate.validation.get("baselines") is None:  # fp32 is verified only when it could ship
        candidate.validation.baselines = "timed"
    if candidate.validation.get("time_failing") is None:  # a failing candidate's row shows its screening's speed
        candidate.validation.time_failing = False
    return candidate


def run(cfg: DictConfig, run_cfg, run_dir: Path) -> Tuple[RunOutcome, object, dict]:
    """(the shipped run's outcome, its validated config, the ``auto`` report section)."""
    if "verify" not in run_cfg.pipeline.stages:
        raise ConfigError("precision=auto needs the verify stage in pipeline.stages: it ships what passes verify")
    tried: Dict[str, dict] = {}
    configs: Dict[str, Tuple[DictConfig, object]] = {}
    outcomes: Dict[str, RunOutcome] = {}
    requested = candidates(run_cfg)
    budget = Budget(run_cfg.precision.budget_s)
    with contextlib.ExitStack() as stack:
        ahead = ReferenceAhead()
        stack.callback(ahead.stop)
        _candidates(cfg, requested, run_dir, ahead, (tried, configs, outcomes), budget, run_cfg.precision.screen)
    _verify_deferred((tried, configs, outcomes), run_dir, budget)
    _time(outcomes, run_cfg, tried)
    tight = run_cfg.validation.timing_tight_spread
    if _fp32_could_ship(tried, requested, tight):
        _verified_late(REFERENCE, (tried, configs, outcomes), run_dir, budget)
    elif tried.get(REFERENCE, {}).get("verdict") == UNVERIFIED:
        tried[REFERENCE]["not_verified"] = ("not verified: only the speed reference here" if REFERENCE not in requested
                                            else "not verified: a faster build passes, so fp32 could not ship")
    winner, why = choose({p: row for p, row in tried.items() if p in requested}, tight)
    if winner is None:
        raise _none_built(run_cfg.target.name, tried)
    raw, checked = configs[winner]
    job_phase(f"precision=auto: shipping {winner}")
    outcome = run_pipeline(checked, run_dir)
    section = {"requested": "auto", "candidates": [tried[p] for p in tried], "chosen": winner, "why": why,
               "reference_only": [p for p in tried if p not in requested], "budget": budget.record(tried)}
    return outcome, checked, section


def _candidates(cfg: DictConfig, requested: List[str], run_dir: Path, ahead: ReferenceAhead, found: tuple,
                budget: Budget, screen: bool = True) -> None:
    """Every candidate built, screened against fp32's speed and verified unless it is fp32
    (into ``found``: tried, configs, outcomes by precision), while the budget lasts; each
    row says how many seconds its candidate took."""
    tried = found[0]
    order = ordered(requested, cfg)
    budget.deferrable = deferrable(order)
    budget.previewed = {p for p in budget.deferrable if int8_preview.wanted(order, p)}
    for number, precision in enumerate(order, 1):
        started = time.monotonic()
        estimate = budget.estimate(precision) if precision != REFERENCE else None
        job_phase(f"precision=auto: candidate {precision} ({number} of {len(order)})")
        _candidate(cfg, precision, run_dir, ahead, found, budget, screen)
        tried[precision]["seconds"] = round(time.monotonic() - started, 1)
        if tried[precision]["verdict"] not in (CUT, NOT_BUILT):
            budget.ran.add(precision)
        budget.passed = budget.passed or (precision != REFERENCE and tried[precision]["verdict"] == "pass")
        if tried[precision]["verdict"] not in (CUT, SLOWER, NOT_BUILT, UNVERIFIED) and "same_as" not in tried[precision]:
            budget.took(estimate, tried[precision]["seconds"])  # built and verified: what it cost
        _settle_deferred(tried, budget)


def _candidate(cfg: DictConfig, precision: str, run_dir: Path, ahead: ReferenceAhead, found: tuple,
               budget: Budget, screen: bool = True) -> None:
    """One candidate: cut by the budget, not buildable, not worth building, built and
    screened slower than fp32, or verified (fp32: built only, its verification comes later)."""
    tried, configs, outcomes = found
    if precision != REFERENCE and budget.spent():  # fp32 is every candidate's reference, and the fallback
        tried[precision] = budget.cut(precision)
        return
    missing = _device_missing(tried)
    if precision != REFERENCE and missing:  # no build of another precision would run on it either
        tried[precision] = {"precision": precision, "verdict": NOT_BUILT, "reasons": [f"not built: {missing}"]}
        return
    raw = candidate_config(cfg, precision)
    _known_failing_whole(raw, precision, found)
    try:
        checked = validate(raw)
    except ConfigError as err:  # e.g. the backend's check_config: this target cannot build it
        tried[precision] = {"precision": precision, "verdict": NOT_BUILT, "reasons": [str(err)]}
        return
    configs[precision] = (raw, checked)
    decided = _decided_by_whole(precision, tried) or int8_preview.outrun(precision, tried)
    if decided is not None:
        tried[precision] = decided
        return
    too_long = budget.fits(precision) if precision != REFERENCE else None
    if too_long is not None:  # its estimate does not fit in what is left: the promise is kept
        tried[precision] = budget.cut_ahead(precision, too_long)
        return
    progress_log.info("precision=auto: candidate %s", precision)
    folder = run_dir / "candidates" / precision
    try:
        with deadline.until(budget.deadline(own_verify=precision != REFERENCE), budget.run_s()):
            _built_and_verified(checked, precision, folder, ahead, found, budget, screen,
                                int8=candidate_config(cfg, int8_preview.PREVIEWED) if precision in budget.previewed
                                else None)
    except ParityError as err:  # a candidate the tools cannot make (e.g. a quantizer failure)
        tried[precision] = {"precision": precision, "verdict": NOT_BUILT, "exit_code": int(err.exit_code),
                            "reasons": [str(err)]}


def _built_and_verified(checked, precision: str, folder: Path, ahead: ReferenceAhead, found: tuple,
                        budget: Budget, screen: bool, int8: Optional[DictConfig] = None) -> None:
    """A started candidate: built, then a twin of one built before, fp32 (probed, not
    verified), screened slower than fp32, deferred, or verified. ``int8``: int8's candidate
    config, where a deferred candidate is first timed against int8's preview (verified now
    where int8 would run no faster than it)."""
    tried, configs, outcomes = found
    built = run_pipeline(_candidate_stages(checked), folder, until="build")
    if precision == REFERENCE:  # timed before the reference's answers start beside it (148 against 68 ms on det)
        _probe(budget, built, checked)
    ahead.start(checked, built)  # the reference's answers, while the candidates calibrate and build
    twin = next((p for p, o in outcomes.items() if artifact(o) == artifact(built)), None)
    if twin:  # e.g. mixed with an empty qtable is the int8 build, byte for byte: verified once
        tried[precision] = {**tried[twin], "precision": precision, "verdict": f"same build as {twin}",
                            "same_as": twin, "run_folder": str(folder)}
        return
    if precision == REFERENCE:  # the speed reference; verified only when it could ship (below)
        outcomes[precision] = built
        tried[precision] = {**_row(precision, built), "verdict": UNVERIFIED}
        return
    timed = screened(outcomes.get(REFERENCE), built, checked) if screen else None
    if timed and timed.get("verdict") == SLOWER:
        tried[precision] = {**_row(precision, built), **timed}
        return
    if timed and precision in budget.deferrable:  # verified after the int8 candidates, where it could still ship
        preview = int8_preview.against(int8, built, checked, folder.parent.parent) if int8 else None
        timed = {**timed, **({"int8_preview": preview} if preview else {})}
        if not int8_preview.not_faster(preview):
            tried[precision] = {**_row(precision, built), **timed, "verdict": UNVERIFIED, "deferred": True}
            budget.deferred.add(precision)
            return
    ahead.stop(budget.run_s())  # from here verify runs the reference itself where the store has no answer
    tried[precision] = _verified_row(precision, found, folder, budget, timed or {})


def _verified_row(precision: str, found: tuple, folder: Path, budget: Budget, timing: dict) -> dict:
    """A candidate verified (its outcome and config into ``found``), its verify's seconds
    into the budget (with its speed-up over fp32), and its row. The timing so far (the
    screening's, or fp32's timing) stays on the row: a failing build's speed is what a
    looser threshold would buy (a passing one is timed again with the others, _time)."""
    _, configs, outcomes = found
    outcomes[precision], configs[precision] = _verified(configs[precision], folder)
    seconds = sum(r["seconds"] for r in outcomes[precision].records if r["stage"] == "verify")
    untimed = ((outcomes[precision].verify or VerifySummary()).speed or {}).get("not_timed") is not None
    budget.verified(seconds, _fp32_run_s(timing) if precision != REFERENCE else None,
                    timing_left_out=configs[precision][1].validation.timing_max_seconds if untimed else 0.0)
    return {**_row(precision, outcomes[precision]), **timing, "target_memory": _memory(configs[precision])}


def _fp32_run_s(timing: dict) -> Optional[float]:
    """fp32's run on the target in a candidate's screening: the candidate's median x its speed-up."""
    median, up = (timing.get("latency") or {}).get("median_ms"), (timing.get("speedup") or {}).get("speedup")
    return median * up / 1000.0 if median and up else None


def _verified_late(precision: str, found: tuple, run_dir: Path, budget: Budget) -> None:
    """A candidate built and timed before, verified after the others (fp32 where it could
    ship, a deferred bf16): its row keeps that timing and adds the verify's seconds."""
    tried = found[0]
    started = time.monotonic()
    job_phase(f"precision=auto: verifying {precision}")
    timing = {k: tried[precision][k] for k in ("latency", "timed_on", "speedup", "int8_preview")
              if k in tried[precision]}
    row = _verified_row(precision, found, run_dir / "candidates" / precision, budget, timing)
    tried[precision] = {**row, "seconds": round(tried[precision].get("seconds", 0.0) + time.monotonic() - started, 1)}


def _known_failing_whole(raw: DictConfig, precision: str, found: tuple) -> None:
    """mixed after an int8 that failed its verify on accuracy alone: the search takes that
    verify's figures for plain int8 (sensitivity.int8_failed), the same build on the same
    samples, instead of measuring it again (the segmenter: 7 s of 46, 18 s on a 2x slower
    machine)."""
    whole = kinds.partial_of(precision)
    outcome, row = found[2].get(whole), found[0].get(whole) or {}
    if outcome is None or outcome.verify is None or row.get("verdict") != "fail":
        return
    failing = {c["check"] for c in outcome.verify.checks or [] if c.get("severity") == "fail"}
    if failing and failing <= set(ACCURACY_CHECKS) and not raw.sensitivity.get("int8_failed"):
        raw.sensitivity.int8_failed = {"metric_drop": row.get("metric_drop"), "cosine": row.get("cosine")}


def _decided_by_whole(precision: str, tried: Dict[str, dict]) -> Optional[dict]:
    """mixed (int8 with the ops the search chooses in float) after int8: the same build where
    int8 passes, not built where int8 is slower than fp32 or fails no faster than it (three
    rounds of four); None otherwise."""
    whole = kinds.partial_of(precision)
    if whole and tried.get(whole, {}).get("verdict") == "pass":
        return {**tried[whole], "precision": precision, "same_as": whole, "verdict": f"same build as {whole}",
                "not_built": f"{whole} passes: the {precision} search would keep nothing in float"}
    if whole and tried.get(whole, {}).get("verdict") == SLOWER:
        return {"precision": precision, "verdict": NOT_BUILT, "reasons": [
            f"not built: {whole} is slower than fp32 here, and {precision} is {whole} with some ops in float"]}
    up = (tried.get(whole, {}).get("speedup") or {}) if whole else {}
    if tried.get(whole, {}).get("verdict") == "fail" and up.get("speedup_p25", math.inf) <= 1.0:
        # it could at best tie fp32, and a tie ships fp32 (it keeps the task): PP-OCRv4 det on
        # ort_cpu, int8 at 1.03x, took 136 s of mixed search that could not ship
        return {"precision": precision, "verdict": NOT_BUILT, "reasons": [
            f"not built: {whole} was not faster than fp32 in three rounds of four ({up['speedup']:.2f}x, rounds "
            f"{up['speedup_p25']:.2f}-{up['speedup_p75']:.2f}x), and {precision} is {whole} with some ops in float"]}
    return None


# verified after the int8 candidates that follow it, and only where none of them passes faster:
def _settle_deferred(tried: Dict[str, dict], budget: Budget) -> None:
    """A deferred candidate that a passing one outruns (its screening's p75 speed-up under
    the passing one's p25) cannot ship: it stays not verified, and its verify is no longer
    set aside."""
    for precision in sorted(budget.deferred):
        mine = (tried[precision].get("speedup") or {}).get("speedup_p75")
        faster = [(p, row["speedup"]) for p, row in tried.items() if row["verdict"] == "pass" and p != REFERENCE
                  and (row.get("speedup") or {}).get("speedup_p25", 0) > (mine or math.inf)]
        if faster:
            winner, up = max(faster, key=lambda found: found[1]["speedup_p25"])
            tried[precision]["not_verified"] = (f"not verified: {winner} passes and runs faster "
                                                f"({up['speedup']:.2f}x fp32 against {mine:.2f}x at most)")
            budget.deferred.discard(precision)


def _verify_deferred(found: tuple, run_dir: Path, budget: Budget) -> None:
    """The deferred candidates no passing one outran, verified now (their verify was set aside)."""
    tried = found[0]
    for precision in [p for p in tried if p in budget.deferred]:
        budget.deferred.discard(precision)
        try:
            _verified_late(precision, found, run_dir, budget)
        except ParityError as err:  # as a candidate verified in turn (_candidate)
            tried[precision] = {"precision": precision, "verdict": NOT_BUILT, "exit_code": int(err.exit_code),
                                "reasons": [str(err)], "seconds": tried[precision]["seconds"]}


def _probe(budget: Budget, built: RunOutcome, checked) -> None:
    """The budget's probe: one validation sample's fp32 run on ONNX Runtime, and the counts its
    estimates multiply (samples of each split, the ops an int8 build quantizes)."""
    from pipeline.data import TensorSpec, open_dataset

    if budget.seconds is None:
        return
    convert = built.results["convert"]
    try:
        dataset = open_dataset(checked.data, [TensorSpec(**spec) for spec in convert.summary.inputs])
        first = next(iter(dataset.validation), None)
        if first is None:
            return
        import onnx

        model = onnx.load(str(convert.path("model")), load_external_data=False)
        quantized = sum(node.op_type in set(checked.precision.quantize_ops) for node in model.graph.node)
        counts = {"calibration": len(dataset.calibration), "validation": len(dataset.validation),
                  "sensitivity": checked.sensitivity.samples, "quantized_ops": quantized,
                  "heads_first": checked.sensitivity.heads_first and checked.sensitivity.select.value == "target",
                  "timing_s": checked.validation.timing_max_seconds,
                  "alone_timing_s": speed.alone_max_seconds(checked.validation)}
        budget.probe(convert.path("model"), first.feeds, checked.target.threads, counts)
    except Exception as err:  # noqa: BLE001 - no estimates then: candidates start while time is left
        log.info("precision=auto: no cost estimates (the probe failed: %s)", first_line(err))


def _device_missing(tried: Dict[str, dict]) -> Optional[str]:
    """The verified candidate that the target's device did not run (e.g. MNN's pip wheel
    asked for OpenCL): "<precision>: requested device ... ran", or None."""
    return next((f"{precision}: {reason}" for precision, row in tried.items() for reason in row.get("reasons") or []
                 if reason.startswith("requested device")), None)


def _verified(config: Tuple[DictConfig, object], folder: Path) -> Tuple[RunOutcome, Tuple[DictConfig, object]]:
    """A candidate verified, and the config it passed with: a build over
    validation.max_memory_mb with target.memory=default is verified again with
    target.memory=low (beside it, in ``<folder>-memory-low``) before it is given up on;
    the low run's outcome stands, whichever way it goes."""
    raw, checked = config
    outcome = run_pipeline(_candidate_stages(checked), folder)
    if not _over_budget(outcome) or _memory(config) != "default":
        return outcome, config
    low = OmegaConf.create(OmegaConf.to_container(raw, resolve=False))
    low.target.memory = "low"
    log.info("precision=auto: %s is over validation.max_memory_mb with target.memory=default: trying "
             "target.memory=low", folder.name)
    low_checked = validate(low)
    return run_pipeline(_candidate_stages(low_checked), folder.with_name(f"{folder.name}-memory-low")), \
        (low, low_checked)


def _memory(config: Tuple[DictConfig, object]) -> str:
    """The candidate's target.memory."""
    return memory_mode(config[1].target)


def _over_budget(outcome: RunOutcome) -> bool:
    """Whether the verdict failed on validation.max_memory_mb."""
    return outcome.verify is not None and outcome.verify.failed_check("memory")


def _candidate_stages(checked):
    """The candidate's stages up to verify, verified for the verdict alone: the diagnosis
    (layerwise, advice trials) is the shipped run's, and only when it fails."""
    staged = copy.deepcopy(checked)
    staged.pipeline.stages = [s for s in checked.pipeline.stages if s not in NOT_CANDIDATE_STAGES]
    staged.validation.layerwise = Layerwise.off
    staged.validation.advice_trials = 0
    return staged



def _row(precision: str, outcome: RunOutcome) -> dict:
    verify = outcome.verify or VerifySummary()
    task = verify.task or {}
    build = outcome.results.get("build")
    return {"precision": precision, "verdict": verify.verdict,
            "exit_code": int(verify.exit_code), "reasons": list(verify.reasons or []),
            "cosine": min((o["metrics"]["cosine"] for o in verify.outputs or []), default=None),
            "metric": task.get("metric"), "metric_value": task.get("target"), "metric_drop": task.get("drop"),
            "bytes": build.summary.bytes if build else None,
            # verify.memory's peaks (docs/verify.md "Memory"), fp32's beside: the candidate table's column
            "memory": {key: verify.memory.get(key) for key in ("load_peak_mb", "run_peak_mb", "peak_mb", "fp32")}
            if (verify.memory or {}).get("measured") else None,
            "run_folder": str(outcome.run_dir)}


def _time(outcomes: Dict[str, RunOutcome], run_cfg, tried: Dict[str, dict]) -> None:
    """Every passing build and fp32, timed interleaved on one validation sample (on the
    stream of samples in order where their shapes differ); speed-ups vs fp32 into the rows.
    A failing build that no screening timed (samples of several shapes, a memory budget)
    is timed with them: its row shows what a looser threshold would buy."""
    untimed_failing = {p for p, row in tried.items() if row["verdict"] == "fail" and not row.get("speedup")}
    timed = [p for p, row in tried.items() if p in outcomes and (row["verdict"] == "pass" or p == REFERENCE
                                                                 or p in untimed_failing)]
    if REFERENCE not in timed or len(timed) < 2:
        return
    if _timed_by_verify(outcomes, timed, tried):
        return
    job_phase(f"precision=auto: timing {', '.join(timed)} interleaved")
    found = time_builds({p: outcomes[p] for p in timed}, run_cfg)
    if found is None:
        return
    timings, timed_on = found
    ups = speed.speedups(timings, tight=run_cfg.validation.timing_tight_spread)
    for precision in timed:
        tried[precision]["latency"] = timings[precision]
        tried[precision]["timed_on"] = timed_on
        if precision in ups:
            tried[precision]["speedup"] = ups[precision]
    _twins_as_timed(tried)


def _twins_as_timed(tried: Dict[str, dict]) -> None:
    """A row that is another candidate's build (``same_as``) shows that build's final timing,
    not the screening copied when it was found (ResNet-18 at 224: int8 2.69x, its twin 2.90x)."""
    for row in tried.values():
        twin = tried.get(row.get("same_as"))
        if twin is not None:
            row.update({key: twin[key] for key in ("latency", "timed_on", "speedup") if key in twin})


def _timed_by_verify(outcomes: Dict[str, RunOutcome], timed: List[str], tried: Dict[str, dict]) -> bool:
    """One candidate against fp32: its verify already timed the two interleaved on one
    validation sample (its side-by-side table), as this timing would; that measurement is
    taken instead of a second one (a model of several input shapes is timed here, on the
    stream, which verify keeps only as medians)."""
    other = next(p for p in timed if p != REFERENCE)
    verify = outcomes[other].verify or VerifySummary()
    speed_section = verify.speed or {}
    rows = verify.comparison or {}
    found = {p: (rows.get(p) or {}).get("latency") or {} for p in (REFERENCE, other)}
    if len(timed) != 2 or speed_section.get("judged_on") == "stream" or \
            not all("round_medians_ms" in latency for latency in found.values()):
        return False
    for precision in timed:
        tried[precision]["latency"] = found[precision]
        tried[precision]["timed_on"] = f"one validation sample, interleaved with fp32 in {other}'s verify"
    tried[other]["speedup"] = rows[other].get("speedup")
    _twins_as_timed(tried)
    return True


def _fp32_could_ship(tried: Dict[str, dict], requested: List[str], tight: float) -> bool:
    """Whether fp32, built but not verified, would ship if it passed: a full verification of
    fp32 is paid for only then (it is every candidate's speed reference either way)."""
    if tried.get(REFERENCE, {}).get("verdict") != UNVERIFIED or REFERENCE not in requested:
        return False
    if not any(row["verdict"] == "pass" and "median_ms" in (row.get("latency") or {})
               for p, row in tried.items() if p in requested and p != REFERENCE):
        return True  # nothing else passes, or nothing that passes was timed (a timing that crashed)
    hoped = {p: {**row, "verdict": "pass"} if p == REFERENCE else row for p, row in tried.items() if p in requested}
    return choose(hoped, tight)[0] == REFERENCE


def _none_built(target: str, tried: Dict[str, dict]) -> ParityError:
    """No candidate was built: each distinct reason once, with the candidates it stopped;
    exit 4 when the target could not make fp32, the model as given (pnnx crashing on a
    transformer, a quantized model MNN's converter crashes on while the others are refused
    as quantized already), else a config error. One input error stopping them
    all (a model path that does not exist), or the reference that cannot load the model, is
    that error alone."""
    stopped: Dict[str, List[str]] = {}
    for precision, row in tried.items():
        stopped.setdefault(first_line(row["reasons"][0] if row["reasons"] else "no reason given"), []).append(precision)
    (only, *others) = stopped
    for alone in (InputError, ReferenceUnavailable) if not others else ():  # the user's model or data file, or a
        if only.startswith(alone.label + ": "):  # model the reference cannot load: said as it is
            return alone(only.removeprefix(alone.label + ": "))
    text = (f"precision=auto: no candidate could be built for target {target}: "
            + "; ".join(f"{', '.join(precisions)}: {reason}" for reason, precisions in stopped.items()))
    fp32_impossible = tried.get(REFERENCE, {}).get("exit_code") == int(ExitCode.BACKEND)  # fp32 is always tried
    return BackendUnavailable(text) if fp32_impossible else ConfigError(text)
