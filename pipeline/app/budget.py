"""precision.budget_s for precision=auto: the seconds its candidates may take, kept as a
promise rather than a starting rule.

Before a candidate starts, its cost is estimated from a probe: one validation sample's fp32
run time on ONNX Runtime (what calibration, the search and the reference run on) times the
model runs the candidate makes, counted per calibration sample and per validation sample
(COST_RUNS). A candidate whose estimate does not fit in what is left, less what fp32's verify
would need should it ship (its answers at the speed a screening timed fp32 at, the
reference's until a verify stored them, its timing), is
not started; its row says what it would have cost. Inside a
started candidate the steps that refine or search are cut the same way (pipeline/deadline.py). After each candidate the estimate is compared with what
it took, and later estimates are scaled by the ratio seen so far (a machine, a backend or a
model that costs more or less than the counts assume).

The counts were read off the real-size segmenter (tests/assets/u2netp_320.onnx, 119
convolutions at 320x320, 16 calibration and 40 validation samples, 2 cores, docs/time.md):
its int8 candidate took about 30 runs a calibration sample since calibrate's judges and
the build's refinements run on subsamples sized to the model (docs/calibration.md, "Judges
sized to the model"): 159 s at a 257 ms probe on a VNNI AMD EPYC, against 45 runs before
(51 on an AVX2 AMD EPYC, 41 on an Intel Xeon with AMX). Since bias correction reads
weight rounding's pass and a failing candidate's verify leaves its timing out, 84 s at a
236 ms probe there: calibrate 14.3 runs a calibration sample, the refinements 4.2, the
screening and verify 1.6 a validation sample. Since the screening's first look decides a
candidate clearly faster than fp32 (the thirteenth session), 91 s at 283 ms: calibrate 13.4,
the refinements 4.3, screening and verify 1.0; the counts are those with about 15 % more
(16, 5; 1.2 a validation sample), and a verify that may pass adds its timing
(validation.timing_max_seconds with its warm-up). The mixed search: about one run of half
the graph per quantized op and ranking sample, and 2 log2(ops) whole-model passes over the
validation set to select; with sensitivity.heads_first, three whole-model passes (plain
int8, the output heads float, the heads and input stems float; plain int8 is not measured
again after int8's candidate failed) before a ranking the deadline cuts where it does not
fit; then its build, screening and verify, 2 runs a validation sample besides its timing
(the segmenter's: 1.5).
mixed reuses int8's calibration and refined all-int8 model where int8's candidate ran (its
build inherits those refinements: docs/sensitivity.md), else pays for its own."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Dict, Optional

from pipeline.precision import kinds

CUT = "cut by the budget"
CALIBRATE_RUNS = 16.0  # a calibration sample's runs in calibrate (statistics, auto's tables, equalization)
REFINE_RUNS = 5.0  # ... in the build's weight rounding and bias correction
# model runs a candidate costs: (per calibration sample, per validation sample); a verify
# that may pass times its build on top (timing_s: it lasts seconds, not runs)
COST_RUNS = {"int8": (CALIBRATE_RUNS + REFINE_RUNS, 1.2), "int8_dynamic": (0.0, 4.0)}
VERIFY_RUNS = 4.0  # any other candidate: verified against the reference (fp16, bf16, ...)
MIXED_RUNS = 2.0  # mixed after its search, a validation sample's runs: its build, screening and verify
# fp32's verify: its own answers, and the reference's until a candidate's verify stored them;
# its timing; worker starts, the memory reading, the float64 check (the segmenter: 26 s with
# the answers stored, 42 s without, at a 283 ms probe and a 10 s timing_max_seconds)
FP32_FIXED_S = 6.0
# after the candidates, whichever ships: its profile (3 warm-up and up to 20 profiled runs, at
# most profile.max_seconds=5) and its bundle, reports and worker starts (PP-OCRv4 det at 736:
# profile 5.4 s, package 1.6 s, the shipped run's cached stages 2.1 s)
PROFILE_RUNS, PROFILE_MAX_S = 23.0, 5.0
CLOSING_S = 4.0
TIMING_WARMUP = 1.2  # a verify's timing lasts this multiple of validation.timing_max_seconds at most


class Budget:
    """precision.budget_s: the seconds auto's candidates may take, from its start."""

    def __init__(self, seconds: Optional[float]):
        self.seconds, self.started = seconds, time.monotonic()
        self.probe_s: Optional[float] = None  # one validation sample's fp32 run, ONNX Runtime
        self.counts: Dict[str, int] = {}  # calibration, validation, sensitivity samples, quantized ops
        self.ratios: list = []  # what each estimated candidate took / its estimate
        self.ran: set = set()  # candidates started and not cut (int8: mixed reuses its calibration)
        self.verify_s = 0.0  # the slowest candidate's verify so far: what another's would take at least
        self.stored = False  # a candidate's verify stored the reference's answers: fp32's does not run them
        self.fp32_run_s: Optional[float] = None  # fp32's run on the target, as a screening timed it
        self.passed = False  # a candidate other than fp32 passed: fp32 cannot ship, its verify needs no time
        self.deferrable: set = set()  # candidates verified after the int8 ones (auto.DEFERRED) ...
        self.deferred: set = set()  # ... built and screened, their verify still to come: set aside
        self.previewed: set = set()  # ... and timed against int8's preview first (app/int8_preview.py)

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def left(self) -> Optional[float]:
        return None if self.seconds is None else self.seconds - self.elapsed()

    def spent(self) -> bool:
        return self.seconds is not None and self.elapsed() >= self.seconds

    def probe(self, model: Path, feeds: dict, threads: int, counts: Dict[str, int]) -> None:
        """One validation sample's fp32 run time (the best of three after a warm-up)."""
        import onnxruntime as ort

        from pipeline.backends.onnxruntime import fastest_run, untimed_options

        options = untimed_options()
        options.log_severity_level = 4
        if threads:
            options.intra_op_num_threads = threads
        session = ort.InferenceSession(str(model), options, providers=["CPUExecutionProvider"])
        self.probe_s, self.counts = fastest_run(session, feeds, 3), counts

    def estimate(self, precision: str) -> Optional[float]:
        """The seconds ``precision``'s candidate is expected to take, or None before the probe."""
        if self.probe_s is None:
            return None
        calibration, validation = self.counts.get("calibration", 0), self.counts.get("validation", 0)
        per_calibration, per_validation = COST_RUNS.get(precision, (0.0, VERIFY_RUNS))
        runs = per_calibration * calibration + per_validation * validation
        if kinds.searched(precision):  # mixed: the search, a build, a verify
            whole_ran = kinds.partial_of(precision) in self.ran  # int8's calibration and refinements are cached
            runs = self._search_runs(whole_ran) + MIXED_RUNS * validation
            runs += 0.0 if whole_ran else (CALIBRATE_RUNS + REFINE_RUNS) * calibration
        return (runs * self.probe_s + self.timing_s()) * self.correction()

    def timing_s(self, alone: bool = False) -> float:
        """A passing build's timing in its verify: validation.timing_max_seconds and its warm-up;
        ``alone``: fp32 timed by itself, in the fewest rounds (speed.alone_max_seconds)."""
        return TIMING_WARMUP * self.counts.get("alone_timing_s" if alone else "timing_s", 0.0)

    def _search_runs(self, whole_ran: bool) -> float:
        """The mixed search's runs: with sensitivity.heads_first, three whole-model passes over
        the validation set (plain int8, the heads float, the heads and stems float; two where
        int8's candidate ran: it failed, and its verify stands for plain int8), the ranking
        after them cut by the deadline where it does not fit; else the per-layer ranking and
        the selection."""
        validation = self.counts.get("validation", 0)
        if self.counts.get("heads_first"):
            return (2.0 if whole_ran else 3.0) * validation
        ops = max(self.counts.get("quantized_ops", 1), 2)
        return 0.5 * ops * self.counts.get("sensitivity", 8) + 2 * math.log2(ops) * validation

    def correction(self) -> float:
        """How much more (or less) the candidates took than estimated so far: the median ratio."""
        if not self.ratios:
            return 1.0
        ordered = sorted(self.ratios)
        return ordered[len(ordered) // 2]

    def took(self, estimate: Optional[float], seconds: float) -> None:
        """A verified candidate's seconds against its estimate (None: not estimated)."""
        if estimate:
            self.ratios.append(seconds / (estimate / self.correction()))

    def cut(self, precision: str) -> dict:
        return {"precision": precision, "verdict": CUT,
                "reasons": [f"not tried: precision.budget_s={self.seconds:g} s was spent after "
                            f"{self.elapsed():.0f} s on the candidates before it"]}

    def cut_ahead(self, precision: str, estimate: float) -> dict:
        """The row of a candidate not started because its estimate does not fit."""
        reserved = self.reserve()
        return {"precision": precision, "verdict": CUT, "estimate_s": round(estimate, 1),
                "reserved_s": round(reserved, 1),
                "reasons": [f"not tried: estimated {estimate:.0f} s ({self.describe()}), "
                            f"{max(self.left(), 0):.0f} s of precision.budget_s={self.seconds:g} s left, "
                            f"{reserved:.0f} s of it set aside for the closing steps (fp32's verify, "
                            "the profile, the package)"]}

    def describe(self) -> str:
        corrected = f", x{self.correction():.2f} from the candidates so far" if self.ratios else ""
        return (f"one sample's fp32 run {1000 * self.probe_s:.0f} ms x the runs it makes over "
                f"{self.counts.get('calibration', 0)} calibration and {self.counts.get('validation', 0)} "
                f"validation samples{corrected}")

    def fits(self, precision: str) -> Optional[float]:
        """None when ``precision`` may start, else its estimate (which does not fit in what is
        left once the closing steps are set aside)."""
        estimate, left = self.estimate(precision), self.left()
        return estimate if estimate is not None and left is not None and estimate > left - self.reserve() else None

    def verified(self, seconds: float, fp32_run_s: Optional[float] = None, timing_left_out: float = 0.0) -> None:
        """A candidate's verify took ``seconds``; it stored the reference's answers, which
        fp32's verify then reads. ``fp32_run_s``: fp32's run on the target as the candidate's
        screening timed it (what fp32's verify runs its samples at; else the probe: capped to
        AVX2, OpenVINO's fp32 ran det 736 slower than ONNX Runtime's probe). Another
        candidate's verify (a deferred one, a started one's own) is set aside as the slowest
        so far. ``timing_left_out``: the timing a failing candidate's verify left out
        (validation.time_failing), which another's would add: validation.timing_max_seconds,
        plus its warm-up (the segmenter's: 11.8 s of 10)."""
        self.verify_s = max(self.verify_s, seconds + TIMING_WARMUP * timing_left_out)
        self.stored = True
        self.fp32_run_s = max(self.fp32_run_s or 0.0, fp32_run_s or 0.0) or None

    def reserve(self) -> float:
        """The seconds set aside for after the candidates: fp32's verify, should it ship (none
        once another candidate passed), each deferred candidate's verify, and the shipped
        build's profile and package."""
        verify = (0.0 if self.passed else self.verify_estimate(fp32=True)) + len(self.deferred) * self.verify_estimate()
        profile = 0.0 if self.probe_s is None else min(PROFILE_RUNS * self.run_s(), PROFILE_MAX_S)
        return verify + profile + CLOSING_S

    def verify_estimate(self, fp32: bool = False) -> float:
        """One verify of the validation set: 4 runs a sample, or the slowest verify so far;
        ``fp32``: fp32's answers (and the reference's until a verify stored them), its timing
        and FP32_FIXED_S."""
        run_s, validation = self.run_s() or 0.0, self.counts.get("validation", 0)
        if not fp32:
            return max(VERIFY_RUNS * validation * run_s, self.verify_s)
        if self.probe_s is None:
            return 0.0
        own = self.fp32_run_s or run_s
        return validation * (own + (0.0 if self.stored else run_s)) + self.timing_s(alone=True) + FP32_FIXED_S

    def deadline(self, own_verify: bool = False) -> Optional[float]:
        """When a started candidate's steps must be done (time.monotonic()), or None;
        ``own_verify``: less the candidate's own verify after them (openvino_cpu's mixed search
        on PP-OCRv4 det at 736 ended at the deadline and its 25 s verify carried the job to 322 s)."""
        if self.seconds is None:
            return None
        return self.started + self.seconds - self.reserve() - (self.verify_estimate() if own_verify else 0.0)

    def run_s(self) -> Optional[float]:
        """One model run's estimated seconds (the probe, corrected), or None before the probe."""
        return None if self.probe_s is None else self.probe_s * self.correction()

    def record(self, tried: Dict[str, dict]) -> dict:
        return {"seconds": self.seconds, "elapsed_s": round(self.elapsed(), 1),
                "cut": [p for p, row in tried.items() if row["verdict"] == CUT],
                "probe_ms": None if self.probe_s is None else round(1000 * self.probe_s, 2),
                "estimates_s": {p: row["estimate_s"] for p, row in tried.items() if "estimate_s" in row},
                "correction": round(self.correction(), 2)}
