"""Honest speed: the builds of one verify timed side by side, not one after another.

Each round times every build once (``runs`` back-to-back inferences of one sample, the
median kept), the order rotated from round to round so that no build always runs
right after a warm-up or a slow neighbour. A build's latency is the median of its
round medians; its speed-up over fp32 is the median of the per-round ratios, so
that a machine that slows down for a while slows every build of that round alike.
A build counts as faster than fp32 only when its lower-quartile speed-up is above 1
(three rounds in four faster), never on one lucky median (docs/verify.md)."""

from __future__ import annotations

import time
from typing import Dict, List, Optional

import numpy as np

from pipeline.environment import VNNI_FLAGS
from pipeline.errors import BackendCrashed

WARMUP = 3
STREAM_MAX_BYTES = 64 << 20  # input data of the stream timing, held by every build's worker
CHANGES_PRECISION = ("int8", "mixed", "fp16", "bf16")  # builds that exist to be faster than fp32


def interleaved(workers: Dict[str, object], feeds: dict, rounds: int, runs: int, max_seconds: float) -> Dict[str, dict]:
    """Latency of every worker's build: ``rounds`` rounds (at least 3 once ``max_seconds``
    is spent), rotated order. A worker that fails is reported as ``{"error": ...}``."""
    order = list(workers)
    medians: Dict[str, List[float]] = {name: [] for name in order}
    errors: Dict[str, str] = {}
    for name in order:
        _time(workers, name, feeds, WARMUP, 1, errors)
    started = time.perf_counter()
    for index in range(rounds):
        if index >= 3 and time.perf_counter() - started > max_seconds:
            break
        shift = index % len(order)
        for name in order[shift:] + order[:shift]:
            median = _time(workers, name, feeds, 0, runs, errors)
            if median is not None:
                medians[name].append(median)
    return {name: ({"error": errors[name]} if name in errors else _summary(medians[name], runs)) for name in order}


def stream_interleaved(workers: Dict[str, object], samples: List[dict], rounds: int, max_seconds: float
                       ) -> Dict[str, dict]:
    """Speed as served: each build runs ``samples`` in their order, one call per sample at
    its own shape, once a round (after one warm-up pass that meets every shape once); the
    round's figure is the pass's time per call. Rounds rotate the order as ``interleaved``
    does, so ``speedups`` reads the result alike (``runs_per_round``: calls of a pass)."""
    order = list(workers)
    medians: Dict[str, List[float]] = {name: [] for name in order}
    errors: Dict[str, str] = {}
    for name in order:
        try:
            workers[name].stream_load(samples)
        except BackendCrashed as err:
            errors[name] = str(err)
        _pass(workers, name, errors)
    started = time.perf_counter()
    for index in range(rounds):
        if index >= 3 and time.perf_counter() - started > max_seconds:
            break
        shift = index % len(order)
        for name in order[shift:] + order[:shift]:
            mean = _pass(workers, name, errors)
            if mean is not None:
                medians[name].append(mean)
    return {name: ({"error": errors[name]} if name in errors else _summary(medians[name], len(samples)))
            for name in order}


def _pass(workers, name, errors) -> Optional[float]:
    if name in errors:
        return None
    try:
        return workers[name].stream()["mean_ms"]
    except BackendCrashed as err:
        errors[name] = str(err)
        return None


def stream_samples(count: int, read, limit: int, max_bytes: int) -> List[dict]:
    """The first validation samples in their order, at most ``limit`` of them and
    ``max_bytes`` of input data (each worker holds them all)."""
    samples, size = [], 0
    for index in range(min(count, limit)):
        feeds = read(index)
        size += sum(np.asarray(value).nbytes for value in feeds.values())
        if samples and size > max_bytes:
            break
        samples.append(feeds)
    return samples


def _time(workers, name, feeds, warmup, runs, errors) -> Optional[float]:
    if name in errors:
        return None
    try:
        return workers[name].latency(feeds, warmup, runs)["median_ms"]
    except BackendCrashed as err:  # a side-by-side build is information: its row shows the error
        errors[name] = str(err)
        return None


def _summary(medians: List[float], runs: int) -> dict:
    low, median, high = (float(v) for v in np.percentile(medians, [25, 50, 75]))
    return {"median_ms": median, "p25_ms": low, "p75_ms": high, "min_ms": min(medians), "max_ms": max(medians),
            "rounds": len(medians), "runs_per_round": runs, "runs": len(medians) * runs,
            "round_medians_ms": medians}


def speedups(timings: Dict[str, dict], baseline: str = "fp32") -> Dict[str, dict]:
    """Per build: the median of the per-round ratios baseline/build and their quartiles."""
    base = timings.get(baseline) or {}
    found = {}
    for name, timing in timings.items():
        if name == baseline or "error" in timing or "error" in base or not base:
            continue
        ratios = [b / t for b, t in zip(base["round_medians_ms"], timing["round_medians_ms"]) if t > 0]
        if ratios:
            low, median, high = (float(v) for v in np.percentile(ratios, [25, 50, 75]))
            found[name] = {"speedup": median, "speedup_p25": low, "speedup_p75": high,
                           "faster": low > 1.0}
    return found


def slow_build_warning(shipped: str, speedup: Optional[dict], backend: str, cpu_flags: List[str],
                       fp32_ms: Optional[float]) -> Optional[str]:
    """One line when a build that exists to be faster is not faster than fp32 here."""
    if shipped not in CHANGES_PRECISION or speedup is None or speedup["faster"]:
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
    int8 = precision in ("int8", "mixed")
    if int8 and x86 and not flags & VNNI_FLAGS:
        kernels = "ONNX Runtime's u8s8" if backend == "onnxruntime" else "the runtime's"
        return f"x86 without VNNI: {kernels} int8 kernels are slower than fp32 on this CPU"
    if precision == "fp16" and backend == "onnxruntime" and x86:
        return "ONNX Runtime has no fp16 CPU kernels on x86: the fp16 model is computed with casts around fp32"
    if precision == "bf16" and x86 and not flags & {"avx512_bf16", "amx_bf16"}:
        return "this CPU has no native bf16 arithmetic (avx512_bf16 or AMX): bf16 is emulated"
    if precision == "fp16" and x86 and not flags & {"avx512_fp16", "amx_fp16"}:
        return "this CPU has no native fp16 arithmetic: the runtime computes an fp16 request in bf16 or fp32"
    if int8 and fp32_ms is not None and fp32_ms < 1.0:
        return (f"a small model ({fp32_ms:.3f} ms per inference in fp32): the quantize/dequantize steps "
                "between layers likely cost more than int8 arithmetic saves")
    return None


def min_speedup_failure(shipped: str, speedup: Optional[dict], minimum: Optional[float]) -> Optional[str]:
    """The failing check ``validation.min_speedup`` asks for, or None."""
    if minimum is None or shipped == "fp32":
        return None
    if speedup is None:
        return f"speed: the {shipped} build's speed-up over fp32 could not be measured (validation.min_speedup={minimum})"
    if speedup["speedup"] < minimum:
        return (f"speed: the {shipped} build is {speedup['speedup']:.2f}x fp32 (rounds {speedup['speedup_p25']:.2f}-"
                f"{speedup['speedup_p75']:.2f}x), below validation.min_speedup {minimum}")
    return None
