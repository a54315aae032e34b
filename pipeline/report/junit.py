"""The verification result of a parity report as JUnit XML, for CI test dashboards.

One ``<testsuite name="parity.<target>.<precision>">`` inside a ``<testsuites>``
root. Test cases, in this order:

- per compared output: "<output>: no NaN/Inf" and one case per set threshold
  ("<output>: min_cosine >= 0.995"), classname "<suite>.outputs" (an integer or boolean
  output: "<output>: exact match, agreement >= 1" instead of the thresholds); an output the
  target did not produce is one failing "<output>: produced by the target" case;
- the task metric ("top1 drop <= 0.01"), classname "<suite>.task", when present, and
  "top1 drop 95 % interval within 0.01": failing with validation.require_confidence
  when the drop passes but its bootstrap interval reaches past the limit, else
  ``<skipped>`` with that warning as its message;
- "requested device and precision ran", classname "<suite>.backend";
- "compared at least one output on at least one sample", classname "<suite>.verify":
  a verdict never passes on nothing;
- with validation.max_memory_mb set, "peak memory <= N MB", classname "<suite>.memory"
  (failing above it; when the peak could not be measured, passing with the warning in
  ``system-out``);
- "backend <name> <kind>" with an ``<error>`` when ``verify["crash"]`` is set.

Threshold cases are judged from the metrics with the same rules as the verify
stage (``pipeline.verification.metrics.failures``: NaN never passes, identical outputs have an
infinite SQNR). Should the stage say an output failed for a reason none of those
cases catches, one more failing "<output>: passed" case keeps the XML and the
verdict in agreement. Output is deterministic and only uses characters XML 1.0
allows (ANSI escapes in a backend's stderr are dropped).
"""

from __future__ import annotations

import math
import re
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any, List, Optional

from pipeline.verification.metrics import nonfinite_failure

# threshold key -> (metric key, comparison shown in the case name, passes(metric, limit))
THRESHOLDS = {
    "min_cosine": ("cosine", ">=", lambda value, limit: value >= limit),
    "max_abs_error": ("max_abs", "<=", lambda value, limit: value <= limit),
    "max_mean_abs_error": ("mean_abs", "<=", lambda value, limit: value <= limit),
    "min_sqnr_db": ("sqnr_db", ">=", lambda value, limit: value >= limit),
}

# characters XML 1.0 cannot carry at all, even escaped
_INVALID_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]")
_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")


def _clean(text: Any) -> str:
    return _INVALID_XML.sub("", _ANSI.sub("", str(text)))


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _as_dict(value: Any) -> dict:
    return value if isinstance(value, dict) else {}


def _as_list(value: Any) -> list:
    return list(value) if isinstance(value, (list, tuple)) else []


def _fmt(value: Any) -> str:
    if _is_number(value):
        return f"{value:.6g}"
    return str(value)


class _Suite:
    def __init__(self, name: str) -> None:
        self.name = name
        self.cases: List[ET.Element] = []
        self.failures = self.errors = 0

    def case(self, group: str, name: str, failure: Optional[str] = None, detail: str = "",
             kind: str = "failure", failure_type: str = "") -> ET.Element:
        case = ET.Element("testcase", {"classname": f"{self.name}.{group}", "name": _clean(name),
                                       "time": "0"})
        if failure is not None:
            attrs = {"message": _clean(failure)}
            if failure_type:
                attrs["type"] = _clean(failure_type)
            element = ET.SubElement(case, kind, attrs)
            element.text = _clean(detail or failure)
            if kind == "error":
                self.errors += 1
            else:
                self.failures += 1
        self.cases.append(case)
        return case


def _suite_name(report: dict) -> str:
    target = _as_dict(report.get("target")).get("name") or "unknown"
    precision = report.get("precision") or "unknown"
    return f"parity.{target}.{precision}"


def _threshold_case(suite: _Suite, output: str, key: str, limit: Any, metrics: dict) -> None:
    metric, sign, passes = THRESHOLDS.get(key, (key, "vs", None))
    name = f"{output}: {key} {sign} {_fmt(limit)}"
    value = metrics.get(metric)
    if key == "max_mean_abs_error" and value is None:
        value = 0.0  # no elements compared: no error (the "compared something" case says so)
    if key == "min_sqnr_db" and value is None and metric in metrics:
        suite.case("outputs", name)  # None: outputs identical, infinite SQNR
        return
    if passes is None:
        suite.case("outputs", name, f"unknown threshold {key}", failure_type="threshold")
    elif not _is_number(value):
        suite.case("outputs", name, f"{metric} was not measured", failure_type="threshold")
    elif not passes(value, limit):  # NaN compares false: fails
        opposite = "<" if sign == ">=" else ">"
        suite.case("outputs", name, f"{metric} {_fmt(value)} {opposite} {_fmt(limit)}", failure_type="threshold")
    else:
        suite.case("outputs", name)


def _exact_case(suite: _Suite, name: str, out: dict, metrics: dict) -> None:
    needed = _as_dict(out.get("thresholds")).get("min_agreement")
    case = f"{name}: exact match, agreement >= {_fmt(1.0 if needed is None else needed)}"
    failed = [str(f) for f in _as_list(out.get("failures"))]
    if failed:
        suite.case("outputs", case, "; ".join(failed), failure_type="threshold")
    else:
        suite.case("outputs", case)


def _output_cases(suite: _Suite, out: dict) -> None:
    name = str(out.get("name", "?"))
    metrics = _as_dict(out.get("metrics"))
    before = suite.failures
    nan, inf = metrics.get("nan"), metrics.get("inf")
    if not _is_number(nan) or not _is_number(inf):
        suite.case("outputs", f"{name}: no NaN/Inf", "NaN/Inf counts were not measured", failure_type="nan_inf")
    elif nonfinite_failure(metrics):
        suite.case("outputs", f"{name}: no NaN/Inf", nonfinite_failure(metrics), failure_type="nan_inf")
    else:
        suite.case("outputs", f"{name}: no NaN/Inf")
    if metrics.get("exact"):  # an integer or boolean output: its agreement is its only threshold
        _exact_case(suite, name, out, metrics)
    else:
        for key, limit in _as_dict(out.get("thresholds")).items():
            if limit is not None and key != "min_agreement":
                _threshold_case(suite, name, str(key), limit, metrics)
    if out.get("passed") is False and suite.failures == before:
        reasons = "; ".join(str(f) for f in _as_list(out.get("failures"))) or "the verify stage failed it"
        suite.case("outputs", f"{name}: passed", reasons, failure_type="verdict")


def _task_case(suite: _Suite, task: dict) -> None:
    metric = task.get("metric") or "task metric"
    name = f"{metric} drop <= {_fmt(task.get('max_drop'))}"
    if task.get("passed") is False:
        drop, reference, target = task.get("drop"), task.get("reference"), task.get("target")
        if task.get("reason"):  # metrics other than top-1 word their own failure
            message = str(task["reason"])
        elif all(_is_number(v) for v in (drop, reference, target)):
            what = task.get("judged_as") or metric  # top1 without labels: the agreement with the reference
            message = (f"{what} dropped {drop * 100:.2f} points ({reference:.4f} -> {target:.4f}), "
                       f"allowed {_fmt(task.get('max_drop'))}")
        else:
            message = f"{metric} dropped more than allowed"
        suite.case("task", name, message, failure_type="task_metric")
    else:
        suite.case("task", name)
    if task.get("interval") is not None or task.get("disagreement"):  # a passing drop that may be past the limit
        _confidence_case(suite, metric, task)


def _confidence_case(suite: _Suite, metric: str, task: dict) -> None:
    name = f"{metric} drop 95 % interval within {_fmt(task.get('max_drop'))}"
    if not task.get("uncertain"):
        suite.case("task", name)
        return
    needed = task.get("samples_to_resolve")
    message = (f"{metric} drop {_fmt(task.get('drop'))} passes but {uncertainty(task)} reaches past "
               f"{_fmt(task.get('max_drop'))}" + (f"; about {needed} samples would resolve it" if needed else ""))
    if task.get("require_confidence"):
        suite.case("task", name, message, failure_type="task_confidence")
    else:  # a warning: JUnit has no such outcome, the case is skipped with the reason
        case = suite.case("task", name)
        ET.SubElement(case, "skipped", {"message": _clean(message + " (a warning)")})


def _device_precision_case(suite: _Suite, verify: dict) -> None:
    """verify decides what satisfies a request (mixed accepts int8...): its reasons say."""
    mismatched = [str(r) for r in verify.get("reasons") or [] if str(r).startswith("requested ")]
    name = "requested device and precision ran"
    if mismatched:
        suite.case("backend", name, "; ".join(mismatched), failure_type="mismatch")
    else:
        suite.case("backend", name)
    fallback = [c for c in _as_list(verify.get("checks")) if isinstance(c, dict) and c.get("check") == "float_fallback"]
    for check in fallback:  # int8 that ran partly in float: a failure only when validation makes it one
        failed = check.get("severity") == "fail"
        case = suite.case("backend", "quantized ops ran in int8", str(check.get("text")) if failed else None,
                          failure_type="float_fallback")
        if not failed:
            ET.SubElement(case, "system-out").text = _clean(f"warning: {check.get('text')}")


def _memory_case(suite: _Suite, verify: dict) -> None:
    """validation.max_memory_mb against verify.memory (pipeline/verification/memory.py)."""
    budget = _as_dict(verify.get("judged_with")).get("max_memory_mb")
    if not _is_number(budget):
        return
    found = [c for c in _as_list(verify.get("checks")) if isinstance(c, dict) and c.get("check") == "memory"
             and "validation.max_memory_mb" in str(c.get("text"))]
    failed = next((str(c.get("text")) for c in found if c.get("severity") == "fail"), None)
    case = suite.case("memory", f"peak memory <= {budget:g} MB", failed, failure_type="memory")
    for check in found:
        if check.get("severity") == "warning":
            ET.SubElement(case, "system-out").text = _clean(f"warning: {check.get('text')}")


def _crash_case(suite: _Suite, crash: dict) -> None:
    kind = str(crash.get("kind") or "crashed")
    backend = str(crash.get("backend") or "backend")
    message = str(crash.get("detail") or f"{backend} {kind}")
    tail = "\n".join(str(line).rstrip("\n") for line in _as_list(crash.get("stderr_tail")))
    detail = message + ("\n\nstderr (tail):\n" + tail if tail else "")
    suite.case("backend", f"backend {backend} {kind}", message, detail, kind="error", failure_type=kind)


def build_junit(report: dict) -> ET.Element:
    """The report as a ``<testsuites>`` element with one ``<testsuite>``."""
    if not isinstance(report, dict):
        raise TypeError(f"report must be a dict, got {type(report).__name__}")
    verify = _as_dict(report.get("verify"))
    suite = _Suite(_suite_name(report))

    outputs = [o for o in _as_list(verify.get("outputs")) if isinstance(o, dict)]
    for out in outputs:
        _output_cases(suite, out)
    for name in _as_list(verify.get("missing_outputs")):
        suite.case("outputs", f"{name}: produced by the target", f"output {name} was not produced by the target",
                   failure_type="missing_output")
    if isinstance(verify.get("task"), dict):
        _task_case(suite, verify["task"])
    if verify.get("requested"):
        _device_precision_case(suite, verify)
    samples = verify.get("samples")
    nothing = []
    if not outputs:
        nothing.append("no outputs were compared")
    if not (_is_number(samples) and samples > 0):
        nothing.append("no validation samples were compared")
    if not verify:
        nothing = ["the verify stage did not run"]
    suite.case("verify", "compared at least one output on at least one sample",
               "; ".join(nothing) if nothing else None, failure_type="nothing_compared")
    if isinstance(verify.get("crash"), dict):
        _crash_case(suite, verify["crash"])
    else:
        _memory_case(suite, verify)

    seconds = next((s.get("seconds") for s in _as_list(report.get("stages"))
                    if isinstance(s, dict) and s.get("stage") == "verify" and _is_number(s.get("seconds"))), 0.0)
    seconds = seconds if math.isfinite(seconds) else 0.0
    counts = {"tests": str(len(suite.cases)), "failures": str(suite.failures), "errors": str(suite.errors),
              "skipped": "0", "time": f"{seconds:.3f}"}
    root = ET.Element("testsuites", {"name": "parity", **counts})
    element = ET.SubElement(root, "testsuite", {"name": suite.name, **counts})
    properties = ET.SubElement(element, "properties")
    model = _as_dict(report.get("model")).get("name")
    for key, value in (("model", model), ("target", _as_dict(report.get("target")).get("name")),
                       ("precision", report.get("precision")), ("verdict", report.get("verdict")),
                       ("exit_code", report.get("exit_code")), ("parity_version", report.get("parity_version")),
                       ("schema_version", report.get("schema_version"))):
        if value is not None:
            ET.SubElement(properties, "property", {"name": key, "value": _clean(value)})
    element.extend(suite.cases)
    reasons = [str(r) for r in _as_list(report.get("reasons"))]
    if reasons:
        ET.SubElement(element, "system-out").text = _clean("\n".join(reasons))
    return root


def junit_xml(report: dict) -> str:
    """The report as JUnit XML text (with an XML declaration)."""
    root = build_junit(report)
    ET.indent(root)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"


def write_junit(report: dict, path: Path) -> None:
    """Write the report's verification as JUnit XML to ``path`` (folders created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(junit_xml(report), encoding="utf-8")


def uncertainty(task: dict) -> str:
    """What leaves a passing drop unresolved: the bootstrap interval of the drop, or the
    exact interval of the disagreement count (0 of 20 disagreeing: up to 16.8 %)."""
    parts = []
    if task.get("interval") is not None:
        low, high = task["interval"]
        if _is_number(high) and _is_number(task.get("max_drop")) and high > task["max_drop"]:
            parts.append(f"its 95 % interval [{_fmt(low)}, {_fmt(high)}]")
    counts = task.get("disagreement") or {}
    if counts and not counts.get("resolved", True):
        parts.append(f"with {counts['count']} of {counts['samples']} samples disagreeing, the drop's 95 % bound "
                     f"{_fmt(counts['drop_high'])}")
    return " and ".join(parts) or "its 95 % interval"

