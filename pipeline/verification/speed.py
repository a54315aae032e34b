"""Honest speed: the builds of one verify timed side by side, not one after another.

Each round times every build in turn, the order rotated from round to round so that no
build always runs right after a warm-up or a slow neighbour. A round lasts long enough
that its median is stable: at least ``round_ms`` per build, made of slices of SLICE_MS of
back-to-back runs (as many as fit: the runs per round follow the model's latency, ``runs``
the fewest) that alternate between the builds, so that a load on the machine during the
round meets every build of it; a round's figure is the median of its slices. A build's
latency is the median of its round medians; its speed-up over fp32 is the median of the
per-round ratios, so that a machine that slows down for a while slows every build of that
round alike. A build counts as faster than fp32 only when its
lower-quartile speed-up is above 1 (three rounds in four faster), never on one lucky
median. Two builds compare as ``faster`` or ``slower`` (three rounds in four), a ``tie``
(ratios straddling 1 within ``tight``, p75/p25) or ``undecided`` (straddling 1, wider); an
undecided pair makes the rounds longer, measured again within ``max_seconds``
(``judge``, docs/verify.md)."""

from __future__ import annotations

import contextlib
import functools
import importlib
import math
import time
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

from pipeline.environment import VNNI_FLAGS
from pipeline.errors import BackendCrashed
from pipeline.precision import kinds
from pipeline.verification.confidence import t_quantile

WARMUP = 3
STREAM_MAX_BYTES = 64 << 20  # input data of the stream timing, held by every build's worker
SLICE_MS = 20.0  # a slice: back-to-back runs of one build; a round alternates the builds slice by slice
# (5 ms slices read a 0.1 ms model's int8 1.7-2.7 % faster against fp32 than the builds run alone do)
TIGHT = 1.25  # a spread of per-round ratios (outer p75/p25) at most this is tight: a tie can be called
MAX_PASSES = 32  # stream passes of one build a round (each pass is a call to its worker)
MIN_ROUNDS = 3  # rounds timed whatever max_seconds says
FIT_RUNS = 3  # runs of each build, after the warm-up, that fitted_runs sizes the rounds from
MAX_LENGTHEN = 2  # an undecided pair doubles the round length at most this often (4x), within the time budget
LEVEL = 0.9  # the printed interval of a speed-up: where one more round's ratio falls, this sure (round_interval)
MAD_TO_SD = 1.4826  # a normal sample's standard deviation over its median absolute deviation
SHORT_RUN_MS = 10.0  # builds this quick are timed in validation.timing_processes processes each (``_more_processes``)


def options(validation, stream: bool = False, alone: bool = False) -> dict:
    """The keyword arguments of ``interleaved`` (``stream_interleaved``) from validation.timing_*;
    ``alone``: a build timed by itself (fp32 with no other build beside it) has no ratio to
    resolve, its latency takes the fewest rounds (MIN_ROUNDS) in as much less time."""
    found = {"rounds": validation.timing_rounds, "max_seconds": validation.timing_max_seconds,
             "round_ms": validation.timing_round_ms, "tight": validation.timing_tight_spread}
    if alone:
        found.update(rounds=min(MIN_ROUNDS, validation.timing_rounds), max_seconds=alone_max_seconds(validation))
    return found if stream else {**found, "runs": validation.timing_runs, "processes": validation.timing_processes}


def alone_max_seconds(validation) -> float:
    """validation.timing_max_seconds for a build timed alone: its share for MIN_ROUNDS rounds."""
    return validation.timing_max_seconds * min(1.0, MIN_ROUNDS / max(validation.timing_rounds, 1))


def plan(runs: int, round_ms: float) -> Tuple[int, int]:
    """(slices a round, fewest runs a slice) so that every build's round lasts at least
    ``round_ms`` (each slice runs for SLICE_MS, as many runs as fit: the count follows the
    model's latency) and holds at least ``runs`` runs. ``round_ms`` 0: one slice of exactly
    ``runs`` runs (rounds sized by count alone)."""
    if round_ms <= 0:
        return 1, max(1, runs)
    slices = max(1, math.ceil(round_ms / SLICE_MS))
    return slices, max(1, math.ceil(runs / slices))


def fitted_runs(runs: int, max_seconds: float, run_ms: List[float], rounds: int = MIN_ROUNDS) -> int:
    """The runs a build's round holds: ``runs``, fewer where ``rounds`` rounds (at least
    MIN_ROUNDS) of every build's ``run_ms`` (each build's one run) would not end within
    ``max_seconds``; at least one. The real-size segmenter (0.44 s a run on an AVX2 CPU): 12
    runs a build and round made one verify's timing 35 s; a run that long is a stable figure
    alone, and 7 rounds of 4 runs give the speed-up's quartiles 7 ratios where 3 rounds of 12
    gave 3 in the same time."""
    if not run_ms or max_seconds <= 0:
        return runs
    return int(max(1, min(runs, (1000.0 * max_seconds) // (max(rounds, MIN_ROUNDS) * sum(run_ms)))))


def passes(pass_ms: Dict[str, float], round_ms: float) -> int:
    """Stream passes a round, from the warm-up pass of each build: the round of every
    build lasts at least ``round_ms`` (one pass when a pass is that long already; at most
    MAX_PASSES)."""
    shortest = min((ms for ms in pass_ms.values() if ms > 0), default=0.0)
    if round_ms <= 0 or shortest <= 0:
        return 1
    return min(MAX_PASSES, max(1, math.ceil(round_ms / shortest)))


def outer_quartiles(values: List[float]) -> Tuple[float, float]:
    """(p25, p75) read at the rounds on or beyond the quartiles (numpy's lower / higher):
    with four rounds, the lowest and the highest; "three rounds in four" read strictly."""
    return (float(np.percentile(values, 25, method="lower")), float(np.percentile(values, 75, method="higher")))


def spread(ratios: List[float]) -> float:
    """p75/p25 of per-round ratios (outer quartiles); inf when there are none."""
    if not ratios:
        return math.inf
    low, high = outer_quartiles(ratios)
    return high / low if low > 0 else math.inf


def judge(ratios: List[float], tight: float = TIGHT) -> str:
    """How a build compares with another from their per-round speed-ups (the other's round
    median over this build's): ``faster`` in three rounds of four (p25 above 1), ``slower``
    in three of four (p75 below 1); else a ``tie`` when the spread is tight (p75/p25 at most
    ``tight``), and ``undecided`` when it is not: the timing could not tell them apart."""
    if not ratios:
        return "undecided"
    low, high = outer_quartiles(ratios)
    if low > 1.0:
        return "faster"
    if high < 1.0:
        return "slower"
    return "tie" if spread(ratios) <= tight else "undecided"


def undecided(medians: Dict[str, List[float]], tight: float, baseline: str = kinds.REFERENCE) -> List[Tuple[str, str]]:
    """The pairs of builds the rounds leave ``undecided`` (``judge``): each build against the
    baseline (the speed-up verify reports) and against the fastest by median (the one auto
    weighs every build against). A pair decided faster or slower stays decided however wide."""
    timed = {name: found for name, found in medians.items() if found}
    if len(timed) < 2:
        return []
    fastest = min(timed, key=lambda name: float(np.median(timed[name])))
    pairs = {(name, other) for name in timed for other in (baseline, fastest) if other in timed and other != name}
    return sorted((name, other) for name, other in pairs
                  if judge([o / m for m, o in zip(timed[name], timed[other]) if m > 0], tight) == "undecided")


def _resuming(timing: Callable) -> Callable:
    """``timing`` (its first argument the workers) leaves every worker running when it ends,
    whatever ended it (_turn pauses the others)."""
    @functools.wraps(timing)
    def timed(workers, *args, **kwargs):
        try:
            return timing(workers, *args, **kwargs)
        finally:
            _resume_all(workers)
    return timed


@_resuming
def interleaved(workers: Dict[str, object], feeds: dict, rounds: int, runs: int, max_seconds: float,
                round_ms: float = 0.0, tight: Optional[float] = None, warm: bool = False,
                processes: int = 1) -> Dict[str, dict]:
    """Latency of every worker's build: ``rounds`` rounds (at least 3 once ``max_seconds``
    is spent), rotated order, each build's round lasting at least ``round_ms`` in slices
    alternating between the builds (``plan``; at least ``runs`` runs); with ``tight``, an
    undecided pair lengthens the rounds (``_interleave``). ``warm``: the workers ran these
    feeds just before (no WARMUP runs). ``processes``: builds of a short run are timed in
    that many processes each, round by round in turn (``_more_processes``). A worker that
    fails is reported as ``{"error": ...}``."""
    order = list(workers)
    errors: Dict[str, str] = {}
    pool = {name: [worker] for name, worker in workers.items()}
    fit_ms: Dict[str, float] = {}  # how long each build's fitting runs lasted
    with contextlib.ExitStack() as stack:
        if runs > 1 or round_ms > 0:  # rounds of single runs need no fitting (a first look: one warm-up run)
            # the median of FIT_RUNS: one run on a loaded 2-core machine took 100x its time and cut the rounds
            first = {name: _latency(pool, name, feeds, 0 if warm else WARMUP, FIT_RUNS, 0.0, errors)
                     for name in order}
            run_ms = [found["median_ms"] for found in first.values() if found]
            fit_ms = {name: (FIT_RUNS + (0 if warm else WARMUP)) * found["median_ms"]
                      for name, found in first.items() if found}
            if processes > 1 and run_ms and max(run_ms) <= SHORT_RUN_MS:
                _more_processes(pool, processes, stack, feeds)
                rounds = math.ceil(rounds / processes) * processes  # every process times as many rounds
            fitted = fitted_runs(runs, max_seconds, run_ms, rounds)
            if fitted < runs:  # runs long enough to time one by one: rounds sized by count, within max_seconds
                runs, round_ms = fitted, 0.0
        for name in order:  # warm-up: with round_ms, a round's worth of runs, unless the fitting lasted that long
            whole_round = round_ms > 0 and fit_ms.get(name, 0.0) < round_ms
            for index in range(len(pool[name])):
                _latency(pool, name, feeds, 0, runs if whole_round else 1, round_ms, errors, index)
        slices, fewest = plan(runs, round_ms)
        slice_ms = SLICE_MS if round_ms > 0 else 0.0

        def measure(name: str, index: int) -> Optional[Tuple[float, int]]:
            found = _latency(pool, name, feeds, 0, fewest, slice_ms, errors, index)
            return None if found is None else (found["median_ms"], int(found.get("runs", fewest)))

        medians, counts, how = _interleave(order, measure, slices, rounds, max_seconds, tight)
    how["processes"] = min(len(found) for found in pool.values())
    return {name: ({"error": errors[name]} if name in errors else _summary(medians[name], counts[name], how))
            for name in order}


def _more_processes(pool: Dict[str, list], processes: int, stack: contextlib.ExitStack, feeds: dict) -> None:
    """Each build's worker joined by ``processes - 1`` more of the same build (started side
    by side, closed with ``stack``, warmed up): round ``i`` times every build in its
    process ``i % processes``. Two processes of the same two builds differ by more than
    one process's rounds do: the three-convolution digits model's int8 read 1.57-1.61x fp32
    in six pairs of processes as an AVX2 CPU, each pair's p25-p75 often under 1 % wide;
    rounds taken in turn by two processes put that difference inside the interval. Only
    for short runs (SHORT_RUN_MS): another process costs a load and the build's memory
    again. A worker that cannot be started again (a benchmark's own), or whose second process
    fails to load, keeps one process: the build's timing stands on its first."""
    from pipeline.worker import BackendWorker

    if not all(isinstance(found[0], BackendWorker) for found in pool.values()):
        return
    started = {}
    for name, found in pool.items():
        first = found[0]
        for number in range(2, processes + 1):
            worker = BackendWorker(first.module, first.artifact_dir, first.settings, timeout_s=first.timeout_s,
                                   label=f"{first.label}, timing process {number}", memory_mb=first.memory_mb)
            stack.callback(_closed, worker)
            worker.launch()
            started.setdefault(name, []).append(worker)
    for name, more in started.items():
        try:
            for worker in more:
                worker.wait_loaded()
                worker.latency(feeds, WARMUP, FIT_RUNS)  # warmed up as the first process was
        except BackendCrashed:
            continue
        pool[name].extend(more)


@_resuming
def stream_interleaved(workers: Dict[str, object], samples: List[dict], rounds: int, max_seconds: float,
                       round_ms: float = 0.0, tight: Optional[float] = None) -> Dict[str, dict]:
    """Speed as served: each build runs ``samples`` in their order, one call per sample at
    its own shape (after one warm-up pass that meets every shape once); a round holds as
    many passes of every build as ``round_ms`` asks (one when a pass is that long), the
    round's figure the median of its passes' time per call. Rounds rotate the order and an
    undecided pair lengthens them as ``interleaved`` does, so ``speedups`` reads the result
    alike (``runs_per_round``: calls of a round)."""
    order = list(workers)
    errors: Dict[str, str] = {}
    pass_ms = {}
    pool = {name: [worker] for name, worker in workers.items()}
    for name in order:
        try:
            workers[name].stream_load(samples)
        except BackendCrashed as err:
            errors[name] = str(err)
        mean = _pass(pool, name, errors)
        if mean is not None:
            pass_ms[name] = mean * len(samples)

    def measure(name: str, index: int) -> Optional[Tuple[float, int]]:
        mean = _pass(pool, name, errors)
        return None if mean is None else (mean, len(samples))

    medians, counts, how = _interleave(order, measure, passes(pass_ms, round_ms), rounds, max_seconds, tight)
    return {name: ({"error": errors[name]} if name in errors else _summary(medians[name], counts[name], how))
            for name in order}


def _interleave(order: List[str], measure: Callable[[str, int], Optional[Tuple[float, int]]], slices: int, rounds: int,
                max_seconds: float, tight: Optional[float]
                ) -> Tuple[Dict[str, List[float]], Dict[str, List[int]], dict]:
    """Every build's round medians and runs per round: ``rounds`` rounds (at least 3 once
    ``max_seconds`` is spent), each of ``slices`` slices per build (``measure``: one slice
    of a build in round ``index``, its median and runs), the builds taking turns slice by slice in an order rotated by
    round and slice; a round's figure is the median of its slices. With ``tight``: while a
    pair of builds is ``undecided`` (their per-round ratios straddle 1 wider than ``tight``),
    the rounds are measured again twice as long (the shorter ones discarded), at most
    MAX_LENGTHEN times and only when the longer rounds are expected to end within
    ``max_seconds``."""
    started = time.perf_counter()
    lengthened = discarded = 0
    while True:
        begun = time.perf_counter()
        medians: Dict[str, List[float]] = {name: [] for name in order}
        counts: Dict[str, List[int]] = {name: [] for name in order}
        for index in range(rounds):
            if index >= MIN_ROUNDS and time.perf_counter() - started > max_seconds:
                break
            values: Dict[str, List[Tuple[float, int]]] = {name: [] for name in order}
            for part in range(slices):
                shift = (index + part) % len(order)
                for name in order[shift:] + order[:shift]:
                    found = measure(name, index)
                    if found is not None:
                        values[name].append(found)
            for name, found in values.items():
                if found:
                    medians[name].append(float(np.median([value for value, _ in found])))
                    counts[name].append(sum(count for _, count in found))
        now = time.perf_counter()
        wide = tight is not None and undecided(medians, tight)
        if not wide or lengthened >= MAX_LENGTHEN or (now - started) + 2 * (now - begun) > max_seconds:
            return medians, counts, {"slices": slices, "lengthened": lengthened, "discarded_rounds": discarded}
        discarded += max((len(found) for found in medians.values()), default=0)
        slices, lengthened = slices * 2, lengthened + 1


def _closed(worker) -> None:
    worker.resume()  # a stopped process would not answer its close
    worker.close()


def _pass(pool, name, errors) -> Optional[float]:
    if name in errors:
        return None
    _turn(pool, name, 0)
    try:
        return pool[name][0].stream()["mean_ms"]
    except BackendCrashed as err:
        errors[name] = str(err)
        return None


def stream_samples(split, limit: int, max_bytes: int = STREAM_MAX_BYTES) -> List[dict]:
    """The first samples of ``split`` (pipeline.data.Split) in their order, at most ``limit``
    of them and ``max_bytes`` of input data (each worker holds them all)."""
    samples, size = [], 0
    for index in range(min(len(split), limit)):
        feeds = split.read(index)
        size += sum(np.asarray(value).nbytes for value in feeds.values())
        if samples and size > max_bytes:
            break
        samples.append(feeds)
    return samples


def _turn(pool: Dict[str, list], name: str, index: int) -> None:
    """Only ``name``'s worker of round ``index`` may run while it is timed: the others (every
    process of every build) are paused (their request resumes them). An idle ONNX Runtime session's pool threads spin for tens of milliseconds
    after each run; side by side on 2 cores that took a core from the build being timed: the
    real-size segmenter's int8 read 1.63x fp32 against 1.73x each timed alone, 1.76x paused."""
    timed = _in_turn(pool, name, index)
    for worker in (worker for found in pool.values() for worker in found):
        if worker is not timed and hasattr(worker, "pause") and _idle_threads_spin(worker):
            worker.pause()


def _in_turn(pool: Dict[str, list], name: str, index: int):
    """The process of ``name`` that times round ``index``."""
    return pool[name][index % len(pool[name])]


def _idle_threads_spin(worker) -> bool:
    """The worker's backend's Capabilities.idle_threads_spin. Not ncnn's: its threads wait
    passively (backends/ncnn/common.py), and paused ncnn workers timed erratically (a
    MobileNetV3's fp16 build beside fp32: 1.06-3.08x, against 1.05-1.06x unpaused)."""
    module = getattr(worker, "module", None)
    return bool(module) and _module_spins(module)


@functools.lru_cache(maxsize=None)
def _module_spins(module: str) -> bool:  # asked for every worker at every slice of a timing
    return bool(getattr(getattr(importlib.import_module(module), "CAPABILITIES", None), "idle_threads_spin", False))


def _resume_all(workers: Dict[str, object]) -> None:
    for worker in workers.values():
        if hasattr(worker, "resume"):
            worker.resume()


def _latency(pool, name, feeds, warmup, runs, min_ms, errors, index: int = 0) -> Optional[dict]:
    if name in errors:
        return None
    _turn(pool, name, index)
    try:  # min_ms only where asked: a worker of a benchmark may take (feeds, warmup, runs) alone
        worker = _in_turn(pool, name, index)
        return worker.latency(feeds, warmup, runs, min_ms) if min_ms > 0 else worker.latency(feeds, warmup, runs)
    except BackendCrashed as err:  # a side-by-side build is information: its row shows the error
        errors[name] = str(err)
        return None


def _summary(medians: List[float], counts: List[int], how: dict) -> dict:
    """A build's timing; ``runs_per_round``: the median count of its rounds (runs, or calls of a stream)."""
    if not medians:
        return {"error": "no timing round completed"}
    low, median, high = (float(v) for v in np.percentile(medians, [25, 50, 75]))
    return {"median_ms": median, "p25_ms": low, "p75_ms": high, "min_ms": min(medians), "max_ms": max(medians),
            "rounds": len(medians), "runs_per_round": int(np.median(counts)), "runs": int(sum(counts)),
            "slices_per_round": how["slices"], "lengthened": how["lengthened"],
            "discarded_rounds": how["discarded_rounds"], "processes": how.get("processes", 1),
            "round_medians_ms": medians}


def speedups(timings: Dict[str, dict], baseline: str = kinds.REFERENCE, tight: float = TIGHT) -> Dict[str, dict]:
    """Per build: the median of the per-round ratios baseline/build and their quartiles;
    ``spread`` and ``call``: the outer p75/p25 and ``judge``'s word against the baseline."""
    base = timings.get(baseline) or {}
    found = {}
    for name, timing in timings.items():
        if name == baseline or "error" in timing or "error" in base or not base:
            continue
        ratios = [b / t for b, t in zip(base["round_medians_ms"], timing["round_medians_ms"]) if t > 0]
        if ratios:
            low, median, high = (float(v) for v in np.percentile(ratios, [25, 50, 75]))
            lowest, highest = round_interval(ratios)
            found[name] = {"speedup": median, "speedup_p25": low, "speedup_p75": high,
                           "speedup_low": lowest, "speedup_high": highest, "level": LEVEL,
                           "faster": low > 1.0, "spread": _finite(spread(ratios)), "call": judge(ratios, tight)}
    return found


def round_interval(ratios: List[float], level: float = LEVEL) -> Tuple[float, float]:
    """(low, high): where one more round's ratio falls, ``level`` sure, the interval printed
    beside a speed-up. A prediction interval in log space around the median ratio: median
    times or over exp(t(n - 1) s sqrt(1 + 1/n)), s the rounds' robust standard deviation
    (MAD_TO_SD times their median absolute deviation: one odd round does not widen it). What
    a user who times the two builds again (other processes, a minute later) compares with:
    the median's own interval shrinks with every round, the next timing's offset does not
    (docs/verify.md, "The interval printed beside a speed-up"). One round: the ratio alone."""
    logs = np.log(np.asarray(ratios, dtype=np.float64))
    center = math.log(float(np.median(ratios)))
    if logs.size < 2:
        return math.exp(center), math.exp(center)
    scale = MAD_TO_SD * float(np.median(np.abs(logs - center)))
    half = t_quantile(level, logs.size - 1) * scale * math.sqrt(1.0 + 1.0 / logs.size)
    return math.exp(center - half), math.exp(center + half)


def interval_keys(found: dict) -> Tuple[str, str]:
    """The keys of a speed-up's printed interval (``speedups``' entry): round_interval's (the
    median's interval in a report of 2026-12-04), or the rounds' p25-p75 in one from before."""
    return ("speedup_low", "speedup_high") if "speedup_low" in found else ("speedup_p25", "speedup_p75")


def interval(found: dict) -> Tuple[float, float]:
    """The printed interval of a speed-up (``interval_keys``)."""
    low, high = interval_keys(found)
    return found[low], found[high]


def speedup_text(found: dict) -> str:
    """A speed-up as printed: "1.57x (1.53-1.60)", the median and its interval."""
    low, high = interval(found)
    return f"{found['speedup']:.2f}x ({low:.2f}-{high:.2f})"


def how_sure(found: dict) -> str:
    """The words for the printed interval of a speed-up, e.g. "the next round's 90 % range"."""
    if "level" in found:
        return f"the next round's {100 * found['level']:.0f} % range"
    if "confidence" in found:  # a report of 2026-12-04
        return f"the median's {100 * found['confidence']:.0f} % interval"
    return "rounds p25-p75"


def _finite(value: float) -> Optional[float]:
    return value if math.isfinite(value) else None


def slow_build_warning(shipped: str, speedup: Optional[dict], backend: str, cpu_flags: List[str],
                       fp32_ms: Optional[float]) -> Optional[str]:
    """One line when a build that exists to be faster is not faster than fp32 here."""
    if not kinds.reduced(shipped) or speedup is None or speedup["faster"]:  # fp32 is not there to be faster
        return None
    ratio = f"{speedup['speedup']:.2f}x fp32 (rounds {speedup['speedup_p25']:.2f}-{speedup['speedup_p75']:.2f}x)"
    if speedup["speedup_p75"] < 1.0:
        text = f"the {shipped} build is slower than fp32 on this machine: {ratio}; fp32 is the faster build here"
    else:
        text = f"the {shipped} build is not faster than fp32 beyond the timing spread: {ratio}"
    why = slow_reason(shipped, backend, cpu_flags, fp32_ms)
    return f"{text} ({why})" if why else text


def slow_reason(precision: str, backend: str, cpu_flags: List[str], fp32_ms: Optional[float]) -> Optional[str]:
    """Why a precision is not faster, where the cause is known for this backend and CPU."""
    flags = set(cpu_flags)
    x86 = bool(flags & {"sse4_2", "avx", "avx2"})
    int8 = kinds.quantized(precision)
    if int8 and x86 and not flags & VNNI_FLAGS:
        kernels = "ONNX Runtime's u8s8" if backend == "onnxruntime" else "the runtime's"
        return f"x86 without VNNI: {kernels} int8 kernels are slower than fp32 on this CPU"
    if kinds.narrow(precision) and backend == "onnxruntime" and x86:
        return "ONNX Runtime has no fp16 CPU kernels on x86: the fp16 model is computed with casts around fp32"
    if x86 and not kinds.native(precision, flags):
        return kinds.of(precision).not_native
    if int8 and fp32_ms is not None and fp32_ms < 1.0:
        return (f"a small model ({fp32_ms:.3f} ms per inference in fp32): the quantize/dequantize steps "
                "between layers likely cost more than int8 arithmetic saves")
    return None


def min_speedup_failure(shipped: str, speedup: Optional[dict], minimum: Optional[float]) -> Optional[str]:
    """The failing check ``validation.min_speedup`` asks for, or None."""
    if minimum is None or shipped == kinds.REFERENCE:
        return None
    if speedup is None:
        return f"speed: the {shipped} build's speed-up over fp32 could not be measured (validation.min_speedup={minimum})"
    if speedup["speedup"] < minimum:
        return (f"speed: the {shipped} build is {speedup['speedup']:.2f}x fp32 (rounds {speedup['speedup_p25']:.2f}-"
                f"{speedup['speedup_p75']:.2f}x), below validation.min_speedup {minimum}")
    return None
