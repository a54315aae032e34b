"""int8's speed before its calibration, where a float candidate already runs faster than fp32.

bf16 is verified after the int8 candidates (candidate_order.DEFERRED): on most CPUs that
compute it, int8 runs faster still. Not on every one: on a Xeon with AMX, OpenVINO's bf16
ran the real-size segmenter at 4.08x fp32 and its int8 at 3.73x, after a minute of
calibration and refinements and half a minute of mixed search that could not ship
(docs/time.md, fourteenth session). A build's speed depends on its graph, not on its
ranges: the preview is int8's graph (the same ops quantized, the same Q/DQ placement) with
the max ranges of one calibration sample and no refinement, timed against the float
candidate in the screening's interleaved rounds. Where it is not faster than the float
candidate in three rounds of four (p25 of the rounds' ratios at most 1: slower, or a tie
that int8's minutes of calibration would not change), that candidate is verified at once,
and if it passes, int8 and mixed (int8 with some ops float, no faster) are not built
(PP-OCRv4 det at 736 on the same Xeon: bf16 2.14x fp32, int8 2.08x, after 244 s)."""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Optional

from omegaconf import DictConfig, OmegaConf

from pipeline.app.runner import RunOutcome, run_pipeline
from pipeline.app.screening import SCREEN_TIMING, decided_at_first_look, time_builds
from pipeline.config.validation import validate
from pipeline.console import job_step
from pipeline.errors import ParityError, first_line
from pipeline.precision import kinds
from pipeline.verification import speed

log = logging.getLogger("parity")
PREVIEWED = "int8"  # the calibrated candidate whose calibration the preview may save
FOLDER = "previews"  # in the run folder, beside candidates/
# what makes the preview cheap: one sample's statistics, no threshold search, no refinement
CHEAP = {"data": {"calibration_size": 1}, "calibration": {"method": "max"},
         "precision": {"equalization": False, "smoothing": None, "weight_rounding": False, "bias_correction": False}}
BUILT_STAGES = ("convert", "calibrate", "sensitivity", "build")


def wanted(order: list, precision: str) -> bool:
    """Whether ``precision`` is a float candidate with int8 after it in ``order``."""
    return not kinds.quantized(precision) and PREVIEWED in order[order.index(precision) + 1:]


def preview_config(int8: DictConfig) -> DictConfig:
    """int8's candidate config made cheap to build (CHEAP), up to its build."""
    cheap = OmegaConf.merge(int8, CHEAP)
    cheap.pipeline.stages = [s for s in cheap.pipeline.stages if s in BUILT_STAGES]
    return cheap


def against(int8: DictConfig, floated: RunOutcome, checked, run_dir: Path) -> Optional[dict]:
    """int8's preview timed against the float candidate's build ``floated`` (``checked``:
    that candidate's config): its speed-up over it (speed.speedups' figures), or None where
    it could not be built or timed (int8 is then built as it would be without a preview)."""
    job_step("int8's speed, previewed")
    try:
        preview = run_pipeline(validate(preview_config(int8)), run_dir / FOLDER / PREVIEWED, until="build")
    except ParityError as err:
        log.info("precision=auto: no int8 preview (%s)", first_line(err))
        return None
    # the first look decides where int8 is slower than the float build in its single runs, or clearly faster
    decided = functools.partial(decided_at_first_look, candidate="int8", baseline="float", slower=1.0)
    found = time_builds({"float": floated, "int8": preview}, checked, one_sample_only=True, first_look=decided,
                        **SCREEN_TIMING)
    up = speed.speedups(found[0], baseline="float").get("int8") if found else None
    return {**up, "timed_on": found[1]} if up else None


def not_faster(preview: Optional[dict]) -> bool:
    """int8's preview was not faster than the float build in three rounds of four."""
    return preview is not None and preview["speedup_p25"] <= 1.0


def outrun(precision: str, tried: dict) -> Optional[dict]:
    """int8 (or mixed) not built: a float candidate passed that int8's preview did not outrun."""
    if PREVIEWED not in (precision, kinds.partial_of(precision)):
        return None
    for floated, row in tried.items():
        preview = row.get("int8_preview")
        if row.get("verdict") == "pass" and not_faster(preview):
            return {"precision": precision, "verdict": "not built", "outrun_by": floated, "reasons": [
                f"not built: {floated} passes, and int8 would run no faster here (int8's preview, its graph "
                f"with one sample's ranges: {preview['speedup']:.2f}x {floated}'s speed, rounds "
                f"{preview['speedup_p25']:.2f}-{preview['speedup_p75']:.2f}x)"
                + (f"; {precision} is int8 with some ops float" if precision != PREVIEWED else "")]}
    return None
