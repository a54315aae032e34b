"""Output agreement metrics, accumulated one sample at a time (memory does not grow
with the number of samples), and their comparison with thresholds."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, List, Optional

import numpy as np

if TYPE_CHECKING:  # the workers' fork server preloads this module, and needs no OmegaConf
    from pipeline.config.schemas import OutputThresholds

FIRST_MISMATCHES = 5  # sample indices listed for an integer output that changed
CHUNK = 1 << 15  # values compared at a time (OutputStats.update)


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    norm = math.sqrt(float(a @ a) * float(b @ b))
    if norm == 0.0:
        return 1.0 if not a.any() and not b.any() else 0.0
    return float(a @ b) / norm


@dataclass
class OutputStats:
    """Streaming agreement between a reference output and a target output."""

    dot: float = 0.0
    ref_sq: float = 0.0
    out_sq: float = 0.0
    err_sq: float = 0.0
    err_abs: float = 0.0
    max_abs: float = 0.0
    elements: int = 0
    compared: int = 0  # the elements finite on both sides, which the sums hold
    nan: int = 0
    inf: int = 0
    reference_nan: int = 0
    reference_inf: int = 0
    new_nonfinite: int = 0  # NaN/Inf where the reference has a number (or another non-finite value)
    reference_max_abs: float = 0.0
    max_rel: float = 0.0  # max |target - reference| / |reference|; inf where the reference is 0
    sample_cosine: List[float] = field(default_factory=list)
    sample_max_abs: List[float] = field(default_factory=list)
    # integer and boolean outputs (class ids, masks, counts) are compared exactly
    exact: bool = False
    changed: int = 0  # elements that differ
    mismatched: List[int] = field(default_factory=list)  # indices of the samples with a change

    # an output whose rows differ in scale by orders of magnitude (a detector's boxes in pixels
    # beside its scores in 0..1): each group of like rows is also judged alone (row_groups)
    groups: Optional[List["RowGroup"]] = None

    def update(self, reference: np.ndarray, output: np.ndarray) -> None:
        if np.asarray(reference).dtype.kind in "biu":
            self._count_changes(np.asarray(reference), np.asarray(output))
        elif self.groups is None:
            self.groups = row_groups(np.asarray(reference))
        if self.groups and np.shape(reference) == np.shape(output):
            for group in self.groups:
                group.stats.update(group.take(np.asarray(reference)), group.take(np.asarray(output)))
        ref, out = np.asarray(reference).ravel(), np.asarray(output).ravel()
        if ref.shape != out.shape:
            raise ValueError(f"shape {np.shape(output)} differs from the reference's {np.shape(reference)}")
        self.elements += int(ref.size)
        sums = np.zeros(5)  # dot, ref_sq, out_sq, err_sq, err_abs of the finite elements
        sample_max, kept = 0.0, 0
        # in slices that stay in the CPU's cache: whole float64 copies of a large output
        # (PP-OCRv4 rec's 265k values) cost more in fresh pages than in arithmetic
        for begin in range(0, ref.size, CHUNK):
            part = self._update_part(ref[begin:begin + CHUNK].astype(np.float64),
                                     out[begin:begin + CHUNK].astype(np.float64), sums)
            sample_max, kept = max(sample_max, part[0]), kept + part[1]
        self.compared += kept
        if not kept:
            self.sample_cosine.append(0.0)
            self.sample_max_abs.append(0.0)
            return
        dot, ref_sq, out_sq, err_sq, err_abs = (float(v) for v in sums)
        self.dot, self.ref_sq, self.out_sq = self.dot + dot, self.ref_sq + ref_sq, self.out_sq + out_sq
        self.err_sq, self.err_abs = self.err_sq + err_sq, self.err_abs + err_abs
        self.max_abs = max(self.max_abs, sample_max)
        norm = math.sqrt(ref_sq * out_sq)
        self.sample_cosine.append(dot / norm if norm else (1.0 if ref_sq == out_sq == 0 else 0.0))
        self.sample_max_abs.append(sample_max)

    def _update_part(self, ref: np.ndarray, out: np.ndarray, sums: np.ndarray) -> tuple:
        """One slice of a sample into ``sums`` and the counters: (its largest |error|, the
        finite elements compared)."""
        ref_sq, out_sq = float(ref @ ref), float(out @ out)
        if not (math.isfinite(ref_sq) and math.isfinite(out_sq)):  # a NaN or Inf somewhere: find them
            ref, out = self._finite_part(ref, out)
            ref_sq, out_sq = float(ref @ ref), float(out @ out)
        if not ref.size:
            return 0.0, 0
        diff = out - ref
        np.abs(diff, out=diff)
        ref_abs = np.abs(ref)
        sums += (ref @ out, ref_sq, out_sq, diff @ diff, diff.sum())
        self.reference_max_abs = max(self.reference_max_abs, float(ref_abs.max()))
        zero = ref_abs == 0
        if zero.any():
            relative = np.divide(diff, ref_abs, out=np.zeros_like(diff), where=~zero)
            if (diff[zero] > 0).any():  # no relative tolerance covers an error on a zero
                self.max_rel = math.inf
        else:
            relative = np.divide(diff, ref_abs, out=ref_abs)
        self.max_rel = max(self.max_rel, float(relative.max()))
        return float(diff.max()), int(ref.size)

    def _finite_part(self, ref: np.ndarray, out: np.ndarray) -> tuple:
        """The elements finite on both sides; NaN and Inf counted on each."""
        finite_ref, finite_out = np.isfinite(ref), np.isfinite(out)
        if finite_ref.any():  # the reference's own peak, also where the target overflowed
            self.reference_max_abs = max(self.reference_max_abs, float(np.abs(ref[finite_ref]).max()))
        self.nan += int(np.isnan(out).sum())
        self.inf += int(np.isinf(out).sum())
        self.reference_nan += int(np.isnan(ref).sum())
        self.reference_inf += int(np.isinf(ref).sum())
        as_reference = (np.isnan(out) & np.isnan(ref)) | (np.isinf(out) & (out == ref))  # log(-1) in both: agreed
        self.new_nonfinite += int((~finite_out & ~as_reference).sum())
        finite = finite_ref & finite_out
        return ref[finite], out[finite]

    def _count_changes(self, reference: np.ndarray, output: np.ndarray) -> None:
        self.exact = True
        if reference.shape != output.shape:
            return  # update() raises with both shapes
        changed = int(np.count_nonzero(reference != output))
        if changed:
            self.changed += changed
            self.mismatched.append(len(self.sample_cosine))

    def result(self) -> dict:
        found = self._float_result()
        if self.groups:  # the gated cosine and SQNR are the worst group's; the whole output's stay beside
            judged = [{"rows": group.label, **{key: group.stats.result()[key] for key in ("cosine", "sqnr_db")}}
                      for group in self.groups]
            worst = min(judged, key=lambda g: g["cosine"])
            sqnrs = [g["sqnr_db"] for g in judged if g["sqnr_db"] is not None]
            found.update({"row_groups": judged, "whole_cosine": found["cosine"], "whole_sqnr_db": found["sqnr_db"],
                          "cosine": min(found["cosine"], worst["cosine"]), "worst_rows": worst["rows"],
                          "sqnr_db": min([found["sqnr_db"], *sqnrs]) if found["sqnr_db"] is not None else None})
        if self.exact:
            samples = len(self.sample_cosine)
            found.update({"exact": True, "changed": self.changed, "mismatched_samples": len(self.mismatched),
                          "agreement": 1.0 - len(self.mismatched) / samples if samples else None,
                          "first_mismatches": self.mismatched[:FIRST_MISMATCHES]})
        return found

    def _float_result(self) -> dict:
        norm = math.sqrt(self.ref_sq * self.out_sq)
        # zeros on both sides agree; an output of NaN/Inf alone, nothing compared, does not
        both_zero = self.ref_sq == self.out_sq == 0 and (self.compared or not self.new_nonfinite)
        total_cos = self.dot / norm if norm else (1.0 if both_zero else 0.0)
        return {
            "cosine": total_cos,
            "min_sample_cosine": min(self.sample_cosine) if self.sample_cosine else None,
            "max_abs": self.max_abs,
            "mean_abs": self.err_abs / self.elements if self.elements else None,
            "rel_l2": math.sqrt(self.err_sq / self.ref_sq) if self.ref_sq else (0.0 if self.err_sq == 0 else None),
            # None: infinite, the outputs are identical
            "sqnr_db": 10 * math.log10(self.ref_sq / self.err_sq) if self.err_sq and self.ref_sq else None,
            "nan": self.nan, "inf": self.inf,
            "reference_nan": self.reference_nan, "reference_inf": self.reference_inf,
            "new_nonfinite": self.new_nonfinite,
            "elements": self.elements,
        }


GROUP_RATIO = 100.0  # rows this many times apart in scale (RMS) are judged apart
MAX_ROWS = 1024  # an axis longer than this holds samples of one kind (anchors, pixels), not rows
# a table has few rows beside many entries (YOLOv8n at 320: 84 x 2100, YOLOv5: 25200 x 85);
# axes within 4x of each other are a map's (PP-OCRv4 det's 736 x 736, whose blank rows are
# 1e-12 in float64 and 0 in float32: cosine 0 for that "group")
MAP_RATIO = 4


@dataclass
class RowGroup:
    """Consecutive rows of like scale along one axis of an output, with their own stats."""
    axis: int
    start: int
    stop: int
    stats: "OutputStats" = field(default_factory=lambda: OutputStats(groups=[]))

    @property
    def label(self) -> str:
        return f"{self.start}-{self.stop - 1}" if self.stop - self.start > 1 else str(self.start)

    def take(self, values: np.ndarray) -> np.ndarray:
        """The group's rows, a view (no copy)."""
        return values[(slice(None),) * self.axis + (slice(self.start, self.stop),)]


def row_groups(reference: np.ndarray) -> List[RowGroup]:
    """The groups of an output whose rows differ in scale by GROUP_RATIO or more, from one
    sample's table (two axes larger than 1, the last two, one 4x the other): along the shorter (a YOLOv8 head
    [1, 4+C, N]: axis 1; a YOLOv5 one [1, N, 5+C]: the last), consecutive rows within a factor
    10 of their group's first; [] for an output of like rows (one group), a vector, or
    non-finite values."""
    table = [size for size in reference.shape if size != 1]
    if len(table) != 2 or reference.shape[-2:] != tuple(table) or reference.dtype.kind != "f" \
            or not np.isfinite(reference).all():
        return []  # a table per sample only: not a map, a vector, a batch of tables
    if MAP_RATIO * min(table) > max(table):
        return []  # an image's rows and columns (a probability map with blank rows), not a table's
    axis = reference.ndim - 2 if reference.shape[-2] <= reference.shape[-1] else reference.ndim - 1
    rows = reference.shape[axis]
    if not 2 <= rows <= MAX_ROWS:
        return []
    others = tuple(a for a in range(reference.ndim) if a != axis)
    scale = np.sqrt(np.mean(np.square(reference.astype(np.float64)), axis=others))
    nonzero = scale[scale > 0]
    if nonzero.size < 2 or nonzero.max() / nonzero.min() < GROUP_RATIO:
        return []
    found, start = [], 0
    for row in range(1, rows + 1):
        if row == rows or not _alike(scale[start], scale[row]):
            found.append(RowGroup(axis, start, row))
            start = row
    return found if len(found) > 1 else []


def _alike(first: float, other: float) -> bool:
    """Within a factor 10 (all-zero rows join any group)."""
    return first == 0 or other == 0 or max(first, other) / min(first, other) < 10.0


def nonfinite_failure(metrics: dict) -> str:
    """The NaN/Inf an output must not have, said, or "": those where the reference has a
    number; the same NaN or Inf as the reference's (a log of a masked value) is agreement."""
    nan, inf = metrics.get("nan") or 0, metrics.get("inf") or 0
    new = metrics.get("new_nonfinite", nan + inf)  # reports from before it was counted
    if not new:
        return ""
    shared = nan + inf - new
    return f"{nan} NaN and {inf} Inf values in the output" + (f", {new} where the reference has a number"
                                                               if shared else "")


def failures(metrics: dict, limits: OutputThresholds) -> List[str]:
    """Which thresholds the metrics miss; NaN/Inf never pass. An integer or boolean output
    is judged by its agreement alone (samples whose values all equal the reference's; every
    sample by default, ``min_agreement``), never by cosine or errors."""
    if metrics.get("exact"):
        return _exact_failures(metrics, limits)
    failed = []
    if nonfinite_failure(metrics):
        failed.append(nonfinite_failure(metrics))
    if limits.min_cosine is not None and not metrics["cosine"] >= limits.min_cosine:
        where = f" in rows {metrics['worst_rows']} (the whole output: {metrics['whole_cosine']:.6f})" \
            if metrics.get("worst_rows") and metrics["cosine"] < metrics["whole_cosine"] else ""
        failed.append(f"cosine {metrics['cosine']:.6f} < {limits.min_cosine}{where}")
    if limits.max_abs_error is not None and not metrics["max_abs"] <= limits.max_abs_error:
        failed.append(f"max abs error {metrics['max_abs']:.3g} > {limits.max_abs_error}")
    if limits.max_mean_abs_error is not None and not (metrics["mean_abs"] or 0.0) <= limits.max_mean_abs_error:
        failed.append(f"mean abs error {metrics['mean_abs']:.3g} > {limits.max_mean_abs_error}")
    sqnr = metrics["sqnr_db"]
    if limits.min_sqnr_db is not None and sqnr is not None and not sqnr >= limits.min_sqnr_db:
        failed.append(f"SQNR {sqnr:.1f} dB < {limits.min_sqnr_db} dB")
    return failed


def _exact_failures(metrics: dict, limits: OutputThresholds) -> List[str]:
    needed = 1.0 if limits.min_agreement is None else limits.min_agreement
    agreement = metrics["agreement"]
    if agreement is None or agreement >= needed:
        return []
    where = ", ".join(str(i) for i in metrics["first_mismatches"])
    more = metrics["mismatched_samples"] - len(metrics["first_mismatches"])
    return [f"{metrics['changed']} values changed in {metrics['mismatched_samples']} samples (agreement "
            f"{agreement:.4f} < {needed}; samples {where}{f', +{more} more' if more > 0 else ''})"]


def output_failures(run, samples, expected, thresholds_for) -> List[str]:
    """Each sample through ``run`` (feeds -> outputs), its outputs compared with the
    ``expected`` ones: one line per failed threshold ("output NAME: what failed"), a line
    for an output the run did not produce, and one when nothing was compared."""
    stats = {}
    missing = set()
    for feeds, reference in zip(samples, expected):
        actual = run(feeds)
        for name, value in reference.items():
            if name in actual:
                stats.setdefault(name, OutputStats()).update(value, actual[name])
            else:
                missing.add(name)
    if not stats:
        return ["no output was compared"]
    return [f"output {name} was not produced" for name in sorted(missing)] + [
        f"output {name}: {failure}" for name, output in stats.items()
        for failure in failures(output.result(), thresholds_for(name))]


def latency(run, feeds, warmup: int = 3, repeats: int = 20, min_ms: float = 0.0) -> dict:
    """Median and spread of repeated single-sample runs, after warm-up runs: ``repeats``
    runs, and more until ``min_ms`` have passed (a warm-up that sizes the timing rounds:
    ``total_ms``/``runs`` is the time a run takes back to back, tails included)."""
    import time

    for _ in range(warmup):
        run(feeds)
    times = []
    begun = time.perf_counter()
    while len(times) < repeats or (time.perf_counter() - begun) * 1000 < min_ms:
        started = time.perf_counter()
        run(feeds)
        times.append((time.perf_counter() - started) * 1000)
    total = (time.perf_counter() - begun) * 1000
    p25, median, p75 = (float(v) for v in np.percentile(times, [25, 50, 75]))
    return {"median_ms": median, "min_ms": min(times), "max_ms": max(times), "p25_ms": p25, "p75_ms": p75,
            "runs": len(times), "total_ms": total}


def stream_pass(run, samples) -> dict:
    """One pass over ``samples`` in their order, one call each: what a service answering
    requests of varying shape spends. ``mean_ms``: the pass's time per call."""
    import time

    started = time.perf_counter()
    for feeds in samples:
        run(feeds)
    total = (time.perf_counter() - started) * 1000
    return {"total_ms": total, "mean_ms": total / max(len(samples), 1), "calls": len(samples)}


def throughput(runners, feeds, warmup: int = 3, repeats: int = 20, rounds: int = 5, min_round_s: float = 0.05) -> dict:
    """Inferences per second with the session's concurrent requests (``runners``: the
    session's ``parallel_runners()``, one per request the runtime runs best with, where its
    backend declares them; else ``[session.run]``), each request in its own thread;
    a round lasts until every request ran ``repeats`` inferences and ``min_round_s`` passed
    (tiny models would otherwise time thread start-up). Median and quartiles over rounds."""
    import threading
    import time

    for runner in runners:
        for _ in range(warmup):
            runner(feeds)

    def loop(runner, counts, index, deadline):
        while counts[index] < repeats or time.perf_counter() < deadline:
            runner(feeds)
            counts[index] += 1

    rates, total = [], 0
    for _ in range(rounds):
        counts = [0] * len(runners)
        started = time.perf_counter()
        threads = [threading.Thread(target=loop, args=(runner, counts, i, started + min_round_s))
                   for i, runner in enumerate(runners)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        rates.append(sum(counts) / (time.perf_counter() - started))
        total += sum(counts)
    p25, median, p75 = (float(v) for v in np.percentile(rates, [25, 50, 75]))
    return {"throughput": median, "p25_throughput": p25, "p75_throughput": p75, "requests": len(runners),
            "runs": total}


def startup(load, variants: dict, feeds, rounds: int = 3) -> dict:
    """Seconds from loading a session to the end of its first inference, for each named
    settings variant (e.g. with and without a compile cache), median over ``rounds``
    alternating rounds in one process whose runtime is already imported and initialised;
    and the compile-cache status each variant's session reported."""
    import statistics
    import time

    times = {name: [] for name in variants}
    status = {}
    for _ in range(rounds):
        for name, settings in variants.items():
            started = time.perf_counter()
            session = load(settings)
            session.run(feeds)
            times[name].append(time.perf_counter() - started)
            status[name] = session.effective().get("compile_cache")
            del session
    return {"seconds": {name: statistics.median(values) for name, values in times.items()},
            "compile_cache": status, "rounds": rounds}
