"""A build's peak memory as a deployment sees it (verify.memory, docs/verify.md "Memory").

Every build verify runs lives in its own worker process (pipeline/worker.py), which holds
that build's session and nothing else of parity's: the interpreter, the runtime's libraries,
the model, its compiled form and the runtime's buffers. The worker reads its own peak
resident set (VmHWM) right after loading and compiling (``load_peak_mb``), resets it, and
reads it again once the validation samples ran (``run_peak_mb``). The reference, the
comparisons and the reports stay in other processes.

With ``target.memory=low`` the same artifact also runs the validation samples with
``target.memory=default`` in a worker of its own: when ``low`` saves less than
LOWERED_SHARE of that peak (and less than LOWERED_MB), the report says that it lowered
nothing on this model (a warning of the verdict)."""

from __future__ import annotations

from typing import Dict, Optional

from pipeline.precision import kinds

LOWERED_SHARE = 0.02  # low must save at least this share of the default's peak ...
LOWERED_MB = 1.0  # ... and this many MB to count as lowering it (readings repeat within 0.5 MB)
FIELDS = ("load_peak_mb", "run_peak_mb")


def reading(worker) -> Optional[dict]:
    """{"load_peak_mb", "run_peak_mb", "peak_mb", "source", "reset"} of a worker, or None
    when it cannot answer (it crashed) or its platform has no way to read the figures."""
    from pipeline.errors import BackendCrashed

    try:
        found = worker.memory()
    except (BackendCrashed, RuntimeError):
        return None
    if found.get("load_peak_mb") is None or found.get("run_peak_mb") is None:
        return {"source": found.get("source")}
    figures = {key: round(float(found[key]), 1) for key in FIELDS}
    return {**figures, "peak_mb": max(figures.values()), "source": found.get("source"),
            "reset": bool(found.get("reset"))}


def summary(target: Optional[dict], baselines: Dict[str, Optional[dict]], twin: Optional[dict], mode: str,
            samples: int, baseline_samples: Optional[int] = None) -> dict:
    """verify.memory from the readings of the target's worker, its side-by-side baselines
    (fp32; plain int8 for mixed) and, for target.memory=low, its memory=default twin.
    ``baseline_samples``: the baselines ran one sample per input shape, this many
    (validation.baselines=timed), not every validation sample."""
    if not target or target.get("peak_mb") is None:
        why = (target or {}).get("source") or "the worker could not report its memory"
        return {"measured": False, "reason": why, "mode": mode}
    found = {"measured": True, "method": method(target, samples), "source": target["source"], "mode": mode,
             "samples": samples, **_figures(target)}
    found["fp32"] = _figures(baselines.get(kinds.REFERENCE))  # report field fp32: the reference's figures
    if baseline_samples is not None and baselines:
        found["baseline_samples"] = baseline_samples
        found["method"] += (f"; the side-by-side baselines ran one validation sample of each input shape "
                            f"({baseline_samples}) twice, what their run peak depends on (a runtime's memory "
                            f"settles on a shape's second run; validation.baselines=timed)")
    others = {name: _figures(value) for name, value in baselines.items() if name != kinds.REFERENCE}
    if others:
        found["baselines"] = others
    if mode == "low":
        found["default_mode"] = _figures(twin)
        found["low"] = low_effect(found, found["default_mode"])
    return found


def _figures(found: Optional[dict]) -> Optional[dict]:
    if not found or found.get("peak_mb") is None:
        return None
    return {key: found[key] for key in (*FIELDS, "peak_mb")}


def method(target: dict, samples: int) -> str:
    source = ("VmHWM of /proc/self/status" if target["source"] == "VmHWM"
              else "getrusage's ru_maxrss" if target["source"] == "ru_maxrss" else str(target["source"]))
    run = ("since the load (the peak reset after it)" if target.get("reset")
           else "since the process started (no reset on this platform: it includes the load)")
    return (f"peak resident set ({source}) of the build's own worker process, which holds only that build on its "
            f"runtime: load_peak_mb right after loading and compiling, run_peak_mb {run} over the {samples} "
            "validation samples; peak_mb is the larger")


def low_effect(low: dict, default: Optional[dict]) -> Optional[dict]:
    """What target.memory=low saved against the same build with memory=default."""
    if default is None:
        return {"lowered": None, "text": "target.memory=low: the comparison with target.memory=default did not run "
                                         "(its worker failed)"}
    saved = default["peak_mb"] - low["peak_mb"]
    lowered = saved >= LOWERED_MB and saved >= LOWERED_SHARE * default["peak_mb"]
    both = f"peak {low['peak_mb']:.1f} MB, {default['peak_mb']:.1f} MB with target.memory=default"
    text = (f"target.memory=low lowered the peak by {saved:.1f} MB ({saved / default['peak_mb'] * 100:.0f} %): {both}"
            if lowered else f"target.memory=low lowered nothing on this model ({both}): target.memory=default does "
                            "as well without low's settings and what they may cost in speed (docs/targets.md, "
                            "\"Memory modes\")")
    return {"lowered": lowered, "saved_mb": round(saved, 1), "text": text}


def budget_check(memory: Optional[dict], budget: Optional[float]) -> Optional[dict]:
    """validation.max_memory_mb against the measured peak: ("fail", text) above it,
    ("warning", text) when it could not be measured, None within it or without a budget."""
    if budget is None or memory is None:
        return None
    if not memory.get("measured"):
        return {"severity": "warning", "text": f"memory: not measured ({memory.get('reason')}): validation."
                                               f"max_memory_mb {budget:g} MB was not checked"}
    peak = memory["peak_mb"]
    if peak <= budget:
        return None
    when = "while loading and compiling" if memory["load_peak_mb"] >= memory["run_peak_mb"] else \
        "while running the validation samples"
    return {"severity": "fail", "text": f"memory: peak {peak:.1f} MB ({when}) is above validation.max_memory_mb "
                                        f"{budget:g} MB"}


def line(memory: dict, budget: Optional[float] = None) -> str:
    """The console's memory line."""
    if not memory.get("measured"):
        return f"memory: not measured ({memory.get('reason')})"
    text = (f"memory: peak {memory['peak_mb']:.1f} MB (load {memory['load_peak_mb']:.1f}, run "
            f"{memory['run_peak_mb']:.1f})")
    if memory.get("fp32"):
        text += f"; fp32 {memory['fp32']['peak_mb']:.1f} MB (load {memory['fp32']['load_peak_mb']:.1f}, " \
                f"run {memory['fp32']['run_peak_mb']:.1f})"
    if memory.get("mode") == "low" and memory.get("low"):
        text += f"; {memory['low']['text'].split(':')[0]}"
    if budget is not None:
        text += f"; budget {budget:g} MB: {'within' if memory['peak_mb'] <= budget else 'over'}"
    return text


def candidate_peak(row: dict, rows: list) -> str:
    """precision=auto's table: a candidate's peak from its own verify.memory; for the fp32
    reference when it was not verified, fp32's peak measured beside another candidate."""
    own = (row.get("memory") or {}).get("peak_mb")
    if own is not None:
        return f"{own:.1f} MB"
    if row.get("precision") == kinds.REFERENCE:
        for other in rows:
            fp32 = (((other.get("memory") or {}).get("fp32")) or {}).get("peak_mb")
            if fp32 is not None:
                return f"{fp32:.1f} MB (beside {other.get('precision')})"
    return "-"
