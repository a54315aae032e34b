"""The verdict of one verification: every check that fails is a reason, in a fixed order
(accuracy, task metric, NaN/Inf, then device and precision), and the exit code.

Shared by the verify stage and ``parity-bundle check`` so that a run and a check of its
bundle on the same machine reach the same verdict and exit code (docs/verify.md)."""

from __future__ import annotations

from typing import List, Optional, Tuple

from pipeline.errors import ExitCode
from pipeline.precision import kinds

# Order of the reasons: a crash (it stops everything else), what the model computes, what the machine ran.
ORDER = ("crash", "nothing", "accuracy", "task", "task_confidence", "nothing_int8", "nan_inf", "device", "precision",
         "float_fallback", "memory")
BACKEND_CHECKS = ("crash", "device", "precision", "float_fallback")  # a failing one: exit 4
ACCURACY_CHECKS = ("accuracy", "nan_inf", "task", "task_confidence")  # what the build computes against the reference


def judge(outputs: List[dict], missing: List[str], task: Optional[dict], requested: dict, effective: dict,
          samples: int, crash: Optional[dict] = None, fail_on_float_fallback: bool = False,
          intended_float: Tuple[str, ...] = (), memory: Optional[dict] = None,
          max_memory_mb: Optional[float] = None) -> Tuple[List[dict], List[str], ExitCode]:
    """(checks, reasons, exit code). ``checks`` lists every check that did not pass, each
    {"check", "severity": "fail" | "warning", "text"}; ``reasons`` the failing ones' texts
    in ORDER. 4 when the backend crashed or ran another device/precision than asked (or
    a partial float fallback that validation.fail_on_float_fallback makes fatal), else 3
    when any other check fails. ``intended_float``: ops the build kept in float itself.
    ``memory``: verify.memory, judged against ``max_memory_mb`` (pipeline/verification/memory.py)."""
    checks = [*_nothing(outputs, missing, samples), *_outputs(outputs), *_task(task)]
    if crash:
        checks.append(_check("crash", _crash_text(crash)))
    else:
        checks += _ran(requested, effective, fail_on_float_fallback, intended_float) + _memory(memory, max_memory_mb)
    checks.sort(key=lambda c: ORDER.index(c["check"]))  # stable: outputs keep their order
    reasons = [c["text"] for c in checks if c["severity"] == "fail"]
    backend = any(c["severity"] == "fail" and c["check"] in BACKEND_CHECKS for c in checks)
    code = ExitCode.BACKEND if backend else ExitCode.THRESHOLD if reasons else ExitCode.OK
    return checks, reasons, code


def _check(kind: str, text: str, severity: str = "fail", **extra) -> dict:
    return {"check": kind, "severity": severity, "text": text, **extra}


def _nothing(outputs, missing, samples) -> List[dict]:
    found = [_check("nothing", f"output {name} was not produced by the target") for name in missing]
    if samples == 0:
        found.append(_check("nothing", "no validation samples were compared"))
    if not outputs:
        found.append(_check("nothing", "no outputs were compared"))
    return found


def _outputs(outputs) -> List[dict]:
    found = []
    for output in outputs:
        for failure in output["failures"]:
            kind = "nan_inf" if "NaN" in failure and "Inf" in failure else "accuracy"
            text = f"output {output['name']}: {failure}" + _truth_note(output, kind)
            found.append(_check(kind, text))
    return found


def _truth_note(output: dict, kind: str) -> str:
    """Which of target and reference is closer to the float64 truth (pipeline/verification/truth.py)."""
    truth = output.get("truth")
    if kind != "accuracy" or not truth or truth.get("verdict") is None:
        return ""
    return f" ({truth['verdict']})"


def _task(task: Optional[dict]) -> List[dict]:
    if task and task.get("passed", True) and task.get("uncertain"):
        return [_uncertain(task)]
    if not task or task.get("passed", True):
        return []
    if task.get("reason"):
        return [_check("task", str(task["reason"]))]
    metric = str(task.get("metric", "top1"))
    if metric == "top1":  # without labels: the agreement with the reference's argmax (pipeline/metrics/)
        metric = "top-1 accuracy" if task.get("labeled", True) else "top-1 agreement with the reference"
    return [_check("task", f"{metric} dropped {task['drop'] * 100:.2f} points ({task['reference']:.4f} -> "
                           f"{task['target']:.4f}), allowed {task['max_drop'] * 100:.2f}")]


def _uncertain(task: dict) -> dict:
    """A drop that passes while its bootstrap interval, or the bound its disagreement count
    puts on it (pipeline/verification/confidence.py), reaches past the allowed one: a
    warning, or a failure with validation.require_confidence."""
    needed, level, limit = task.get("samples_to_resolve"), f"{task['confidence'] * 100:.0f} %", task["max_drop"]
    why = []
    if task.get("interval") and task["interval"][1] > limit + 1e-12:
        low, high = task["interval"]
        why.append(f"its {level} interval [{low:.4g}, {high:.4g}] reaches past the allowed {limit:.4g} "
                   f"on {task['samples']} samples")
    counts = task.get("disagreement")
    if counts and not counts["resolved"]:
        how = "disagree with the reference" if counts["by"] == "agreement" else "score differently from the reference"
        why.append(f"{counts['count']} of {counts['samples']} samples {how}, so at {level} (Clopper-Pearson) the "
                   f"disagreement rate may be up to {counts['interval'][1]:.3g} and the drop up to "
                   f"{counts['drop_high']:.3g}, past the allowed {limit:.4g}")
    text = (f"task metric {task['metric']}: the drop {task['drop']:.4g} passes but " + "; and ".join(why)
            + (f"; about {needed} samples would resolve it" if needed else ""))
    if task.get("require_confidence"):
        return _check("task_confidence", text + " (validation.require_confidence)")
    return _check("task_confidence", text + " (a warning; validation.require_confidence=true fails on it)",
                  "warning")


def _memory(memory: Optional[dict], budget: Optional[float]) -> List[dict]:
    """The peak above validation.max_memory_mb (a failure; a warning when it could not be
    measured), and target.memory=low that lowered nothing here (a warning)."""
    from pipeline.verification.memory import budget_check

    found = []
    over = budget_check(memory, budget)
    if over:
        found.append(_check("memory", over["text"], over["severity"]))
    low = (memory or {}).get("low") or {}
    if low.get("lowered") is False:
        found.append(_check("memory", f"memory: {low['text']}", "warning"))
    return found


def _crash_text(crash: dict) -> str:
    what = "hung" if crash["kind"] == "hung" else "crashed"
    tail = "; ".join(crash.get("stderr_tail", [])[-3:])
    return f"backend {what}: {crash['detail']}" + (f" (stderr: {tail})" if tail else "")


def _ran(requested: dict, effective: dict, fail_on_float_fallback: bool, intended_float) -> List[dict]:
    """Device and precision that ran. A build asked for int8 whose runtime ran some of its
    quantized ops in float (no int8 kernel for them) ran int8 partly: its own check, a
    warning unless validation.fail_on_float_fallback."""
    if not effective:
        return []
    found = []
    note = effective.get("note")
    device = str(effective.get("device", ""))
    if device.lower() != str(requested["device"]).lower():
        text = f"requested device {requested['device']} but {device} ran"
        found.append(_check("device", f"{text}: {note}" if note else text))
    if requested.get("nothing_int8") is not None:
        found.append(_check("nothing_int8", requested["nothing_int8"]))
    ran = str(effective.get("precision", "")).lower()
    accepted = {p.lower() for p in requested.get("accepted_precisions") or [requested["precision"]]}
    partly_int8 = kinds.ran_partly(requested["precision"], ran)  # int8 asked, mixed ran
    if ran not in accepted and not partly_int8:
        text = f"requested precision {requested['precision']} but {effective.get('precision')} ran"
        text += f"; {requested['control_flow']}" if requested.get("control_flow") else ""
        return found + [_check("precision", f"{text}: {note}" if note else text)]
    fallback = partial_fallback(effective, intended_float)
    if kinds.quantized(requested["precision"]) and (fallback["ops"] or (partly_int8 and not fallback["reported"])):
        severity = "fail" if fail_on_float_fallback else "warning"
        text = f"int8 ran partly: {fallback['text']}" + (
            "" if fail_on_float_fallback else " (a warning; validation.fail_on_float_fallback=true fails on it)")
        found.append(_check("float_fallback", text, severity, ops=fallback["ops"], counts=fallback["counts"]))
    return found


def partial_fallback(effective: dict, intended_float=()) -> dict:
    """The ops that ran float although the build quantized them, by op type, from the
    backend's ``float_ops`` ({op name: op type}) when it reports them, else its layer counts."""
    ops = {name: kind for name, kind in (effective.get("float_ops") or {}).items() if name not in set(intended_float)}
    counts: dict = {}
    for kind in ops.values():
        counts[kind] = counts.get(kind, 0) + 1
    if ops:
        by_type = ", ".join(f"{n} {kind}" for kind, n in sorted(counts.items()))
        names = ", ".join(list(ops)[:5]) + (f", ... (+{len(ops) - 5} more)" if len(ops) > 5 else "")
        one = len(ops) == 1
        text = (f"{len(ops)} quantized op{'' if one else 's'} ran in float, the runtime has no int8 kernel for "
                f"{'it' if one else 'them'} here "
                f"({by_type}: {names})")
    else:
        text = f"the runtime ran some quantized ops in float (layers: {effective.get('layers') or 'not reported'})"
    return {"text": text, "ops": list(ops), "counts": counts, "reported": "float_ops" in effective}
