"""Render a parity report dict as Markdown or as a self-contained HTML page.

Both renderers share one description of the document: the section functions
below turn parts of the report into a flat list of blocks (heading, banner,
paragraph, bullet list, key/value list, table, preformatted text, charts) and each renderer only
knows how to write blocks. Charts are hand-written inline SVG and appear in the
HTML page only.

The HTML page has inline CSS and inline SVG, no JavaScript and no external
resources. Every dynamic string is escaped with ``html.escape``. Output is
deterministic: same report in, byte-identical text out (no timestamps, no
randomness; dicts are shown in the order they were given).

Every section is optional: a section whose key is missing or None is skipped.
"""

from __future__ import annotations

import html
import json
import math
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Sequence, Tuple

NA = "n/a"

# ---------------------------------------------------------------------------
# Value formatting


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _fmt_number(value: Any, spec: str) -> str:
    if value is None:
        return NA
    if not _is_number(value):
        return str(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "∞" if value > 0 else "-∞"
    return format(value, spec)


def fmt_cosine(value: Any) -> str:
    return _fmt_number(value, ".6f")


def fmt_error(value: Any) -> str:
    return _fmt_number(value, ".3g")


def fmt_seconds(value: Any) -> str:
    return _fmt_number(value, ".2f")


def fmt_ratio(value: Any) -> str:
    return _fmt_number(value, ".4f")


def fmt_sqnr(value: Any) -> str:
    """SQNR in dB; None means the outputs were identical (infinite SQNR)."""
    if value is None:
        return "∞ (identical)"
    return _fmt_number(value, ".1f")


def fmt_value(value: Any) -> str:
    """Any JSON-able value as short text (options, versions, ...)."""
    if value is None:
        return NA
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    if _is_number(value):
        return str(value)
    return json.dumps(value, sort_keys=True, ensure_ascii=False, default=str)


def fmt_shape(shape: Any) -> str:
    if shape is None:
        return "?"
    if isinstance(shape, (list, tuple)):
        return "[" + ", ".join("?" if d is None else str(d) for d in shape) + "]"
    return str(shape)


def fmt_from_to(value: Any, fmt: Callable[[Any], str] = fmt_value) -> str:
    """``{"from": a, "to": b}`` as ``a → b`` (or ``b (unchanged)``)."""
    if not isinstance(value, dict):
        return fmt(value)
    before, after = value.get("from"), value.get("to")
    if before == after:
        return f"{fmt(after)} (unchanged)"
    return f"{fmt(before)} → {fmt(after)}"


def fmt_yes_no(value: Any) -> str:
    if value is None:
        return NA
    return "yes" if value else "no"


def fmt_pass(value: Any) -> str:
    if value is None:
        return NA
    return "PASS" if value else "FAIL"


def short_hash(value: Any, length: int = 12) -> str:
    if not value:
        return NA
    text = str(value)
    return text if len(text) <= length else text[:length] + "…"


def _as_dict(value: Any) -> dict:
    return value if isinstance(value, dict) else {}


def _as_list(value: Any) -> list:
    return list(value) if isinstance(value, (list, tuple)) else []


def _finite(value: Any) -> bool:
    return _is_number(value) and math.isfinite(value)


# ---------------------------------------------------------------------------
# Document blocks


@dataclass
class Heading:
    level: int
    text: str


@dataclass
class Banner:
    verdict: str  # "pass" | "fail" | "unverified" (anything else renders grey)
    detail: str


@dataclass
class Para:
    text: str
    css: str = ""


@dataclass
class Items:
    items: List[str]
    css: str = ""


@dataclass
class KeyValues:
    pairs: List[Tuple[str, str]]


@dataclass
class Table:
    headers: List[str]
    rows: List[List[str]]
    row_classes: List[str] = field(default_factory=list)  # HTML only, one per row or empty


@dataclass
class Charts:
    svgs: List[str]  # HTML only


@dataclass
class Pre:
    lines: List[str]  # preformatted text: <pre> in HTML, a fenced code block in Markdown


VERDICT_LABELS = {"pass": "PASS", "fail": "FAIL", "unverified": "UNVERIFIED"}
VERDICT_ICONS = {"pass": "🟢", "fail": "🔴", "unverified": "⚪"}


def _verdict(report: dict) -> str:
    return str(report.get("verdict") or "unverified").lower()


def _title(report: dict) -> str:
    model = _as_dict(report.get("model")).get("name") or "unknown model"
    target = _as_dict(report.get("target")).get("name") or "unknown target"
    precision = report.get("precision") or "?"
    return f"parity report: {model} on {target} ({precision})"


# ---------------------------------------------------------------------------
# Sections: report dict -> blocks


def _header_section(report: dict) -> list:
    blocks: list = [Heading(1, _title(report))]
    exit_code = report.get("exit_code")
    detail = f"exit code {exit_code}" if exit_code is not None else ""
    blocks.append(Banner(_verdict(report), detail))
    about = []
    if report.get("parity_version"):
        about.append(f"parity {report['parity_version']}")
    if report.get("schema_version") is not None:
        about.append(f"report schema {report['schema_version']}")
    if about:
        blocks.append(Para(" · ".join(about), css="muted"))

    target = _as_dict(report.get("target"))
    if target:
        pairs = [("target", fmt_value(target.get("name")))]
        for key, label in (("backend", "backend"), ("device", "device"),
                           ("threads", "threads"), ("memory_mode", "memory mode")):
            if key in target:
                pairs.append((label, fmt_value(target[key])))
        blocks.append(KeyValues(pairs))

    reasons = [str(r) for r in _as_list(report.get("reasons"))]
    if reasons:
        blocks += [Heading(3, "Reasons"), Items(reasons, css="reasons")]
    warnings = [str(w) for w in _as_list(report.get("warnings"))]
    if warnings:
        blocks += [Heading(3, "Warnings"), Items(warnings, css="warnings")]
    crash = _as_dict(report.get("verify")).get("crash")
    if isinstance(crash, dict):
        blocks += _crash_blocks(crash)
    return blocks


CRASH_TITLES = {
    "crashed": "crashed",
    "hung": "hung (stopped after the time limit)",
    "error": "failed with an error",
    "memory": "ran out of memory",
}
STDERR_LINES = 40  # last lines of the backend's stderr shown in the report
STDERR_WIDTH = 300  # characters per stderr line


def _crash_blocks(crash: dict) -> list:
    """The backend process died, hung or failed: shown under the reasons, before Verification."""
    kind = str(crash.get("kind") or "crashed")
    backend = str(crash.get("backend") or "the backend")
    blocks: list = [Heading(2, f"⚠ Backend {backend} {CRASH_TITLES.get(kind, kind)}")]
    pairs = [("kind", kind), ("backend", backend)]
    if crash.get("detail"):
        pairs.append(("detail", fmt_value(crash["detail"])))
    blocks.append(KeyValues(pairs))
    tail = [str(line).rstrip("\n") for line in _as_list(crash.get("stderr_tail"))]
    if tail:
        shown = [_truncate(line, STDERR_WIDTH) for line in tail[-STDERR_LINES:]]
        label = f"stderr (last {len(shown)} lines)" if len(tail) > len(shown) else "stderr"
        blocks += [Para(label, css="muted"), Pre(shown)]
    return blocks


def _verification_section(verify: dict) -> list:
    blocks: list = [Heading(2, "Verification")]
    if verify.get("samples") is not None:
        blocks.append(Para(f"samples compared: {verify['samples']}"))
    outputs = [o for o in _as_list(verify.get("outputs")) if isinstance(o, dict)]
    if outputs:
        blocks.append(_output_metrics_table(outputs))
        blocks += _thresholds_blocks(outputs)
        blocks += _min_tolerance_blocks(outputs)
        blocks += _per_sample_blocks(outputs)
    else:
        blocks.append(Para("no outputs were compared"))
    if isinstance(verify.get("task"), dict):
        blocks += _task_blocks(verify["task"])
    if verify.get("requested") or verify.get("effective"):
        blocks += _device_precision_blocks(_as_dict(verify.get("requested")),
                                           _as_dict(verify.get("effective")))
    if isinstance(verify.get("comparison"), dict):
        blocks += _comparison_blocks(verify["comparison"], _as_dict(verify.get("task")).get("metric"))
    return blocks


def _comparison_blocks(comparison: dict, metric=None) -> list:
    """The build next to an fp32 build on the same backend, timed interleaved."""
    rows = []
    labels = {"fp32": "FLOAT", "int8": "INT8", "mixed": "MIX"}
    for precision, row in comparison.items():
        row = _as_dict(row)
        timing, speedup = _as_dict(row.get("latency")), _as_dict(row.get("speedup"))
        size = row.get("bytes")
        rows.append([labels.get(str(precision), str(precision)), fmt_cosine(row.get("cosine")),
                     fmt_ratio(row.get("task_metric", row.get("top1"))), _fmt_number(timing.get("median_ms"), ".3f"),
                     f"{_fmt_number(timing.get('p25_ms'), '.3f')} - {_fmt_number(timing.get('p75_ms'), '.3f')}",
                     _fmt_speedup(speedup) if speedup else ("1.00x" if precision == "fp32" else "n/a"),
                     f"{size / 1024:.1f}" if _is_number(size) else "n/a"])
    title = "Latency and size" if len(rows) == 1 else "Side by side on the same backend"
    headers = ["build", "cosine", "top-1" if metric in (None, "top1") else str(metric), "median latency ms", "round medians p25 - p75 ms", "speed-up vs fp32",
               "artifact KiB"]
    first = _as_dict(next(iter(comparison.values()), None)).get("latency") or {}
    how = (f"latency: one sample, {first.get('runs_per_round', '?')} runs a round, {first.get('rounds', '?')} "
           "rounds with every build timed in turn (order rotated); median of round medians. Speed-up: median of "
           "the per-round ratios (p25 - p75); a build counts as faster only when its p25 is above 1.00x.")
    return [Heading(3, title), Table(headers, rows), Para(how)]


def _fmt_speedup(speedup: dict) -> str:
    text = (f"{_fmt_number(speedup.get('speedup'), '.2f')}x ({_fmt_number(speedup.get('speedup_p25'), '.2f')} - "
            f"{_fmt_number(speedup.get('speedup_p75'), '.2f')})")
    return text if speedup.get("faster") else f"{text} not faster"


def _auto_section(section: dict) -> list:
    """precision=auto: every candidate, what it reached, and why the shipped one won."""
    rows = []
    for row in [r for r in _as_list(section.get("candidates")) if isinstance(r, dict)]:
        up = _as_dict(row.get("speedup"))
        speedup = _fmt_speedup(up) if up else ("1.00x (reference)" if row.get("latency") else "-")
        metric = (f"{row.get('metric')} {_fmt_number(row.get('metric_value'), '.4f')}"
                  if row.get("metric_value") is not None else "-")
        shipped = " (shipped)" if row.get("precision") == section.get("chosen") else ""
        rows.append([str(row.get("precision")), fmt_cosine(row.get("cosine")), metric, speedup,
                     _fmt_number((row.get("bytes") or 0) / 1e6, ".2f") + " MB" if row.get("bytes") else "-",
                     f"{row.get('verdict')}{shipped}", "; ".join(map(str, _as_list(row.get("reasons"))))[:200]])
    charts = [(str(r.get("precision")), _as_dict(r.get("speedup")).get("speedup", 1.0 if r.get("latency") else None))
              for r in _as_list(section.get("candidates")) if isinstance(r, dict)]
    charts = [(name, value) for name, value in charts if value is not None]
    blocks = [Heading(2, "precision=auto"), Para(f"Shipped {section.get('why')}."),
              Table(["precision", "cosine", "task metric", "speed-up vs fp32", "size", "verdict", "reasons"], rows)]
    if charts:
        blocks.append(Charts([svg_bar_chart([n for n, _ in charts], [v for _, v in charts],
                                            title="speed-up over fp32 (interleaved rounds)", x_label="x fp32",
                                            value_format=lambda v: f"{v:.2f}x")]))
    return blocks


def _sensitivity_section(sensitivity: dict) -> list:
    blocks: list = [Heading(2, "Sensitivity search (ops kept in float)")]
    if sensitivity.get("skipped") and not sensitivity.get("int8"):
        return blocks + [Para(str(sensitivity["skipped"]))]
    int8, mixed = _as_dict(sensitivity.get("int8")), _as_dict(sensitivity.get("mixed"))
    pairs = [("selection", fmt_value(sensitivity.get("select"))),
             ("target cosine", fmt_value(sensitivity.get("expected_cos"))),
             ("samples", fmt_value(sensitivity.get("samples"))),
             ("plain int8 cosine", fmt_cosine(int8.get("cosine")))]
    if sensitivity.get("skipped"):
        return blocks + [KeyValues(pairs), Para(str(sensitivity["skipped"]))]
    pairs += [("mixed cosine", fmt_cosine(mixed.get("cosine"))),
              ("ops kept in float", ", ".join(map(str, _as_list(sensitivity.get("float_ops")))) or "none"),
              ("trials measured in full", f"{sensitivity.get('measured')} of {sensitivity.get('trials')}")]
    blocks.append(KeyValues(pairs))
    ranking = [r for r in _as_list(sensitivity.get("ranking")) if isinstance(r, dict)][:10]
    if ranking:
        blocks += [Heading(3, "Most sensitive ops"),
                   Table(["op", "type", "best method", "loss (1 - cos)", "SQNR dB"],
                         [[str(r.get("op")), str(r.get("op_type")), str(r.get("method")),
                           fmt_error(r.get("loss")), fmt_sqnr(r.get("sqnr_db"))] for r in ranking]),
                   Charts([svg_bar_chart([str(r.get("op")) for r in ranking], [r.get("loss") for r in ranking],
                                         title="loss when only this op is int8", x_label="1 - cosine",
                                         value_format=fmt_error)])]
    details = [d for d in _as_list(sensitivity.get("float_op_details")) if isinstance(d, dict)]
    if details:
        latency = _as_dict(sensitivity.get("latency"))
        about = (f"cost: ms given back when the op stays float ({latency.get('measured_by')}; fp32 "
                 f"{_fmt_number(latency.get('fp32_ms'), '.2f')} ms, int8 {_fmt_number(latency.get('int8_ms'), '.2f')} "
                 "ms a run); gain: cosine lost when the prune put it back to int8")
        blocks += [Heading(3, "Ops kept in float"),
                   Table(["op", "loss alone (1 - cos)", "gain (cosine)", "cost ms"],
                         [[str(d.get("op")), fmt_error(d.get("loss")), fmt_error(d.get("gain")),
                           _fmt_number(d.get("cost_ms"), '.3f')] for d in details]),
                   Para(about if latency.get("measured_by") else str(latency.get("skipped") or latency.get("error")
                                                                      or "no latency costs"))]
    curve = [p for p in _as_list(sensitivity.get("curve")) if isinstance(p, dict)]
    if curve:
        blocks += [Heading(3, "Selection"),
                   Table(["step", "float ops", "cosine", "task metric drop", "est. cost ms"],
                         [[_curve_step(p), fmt_value(p.get("float_ops")),
                           fmt_cosine(p.get("cosine", p.get("without_cosine"))),
                           fmt_ratio(p.get("metric_drop", p.get("without_metric_drop", p.get("top1_drop")))),
                           _fmt_number(p.get("cost_ms"), '.3f')]
                          for p in curve]),
                   Charts([svg_line_chart([p.get("cosine") for p in curve if not p.get("kept")],
                                          title="output cosine per selection step", x_label="step",
                                          y_label="cosine", value_format=fmt_cosine,
                                          threshold=sensitivity.get("expected_cos"), threshold_label="target")])]
    return blocks


def _curve_step(point: dict) -> str:
    if point.get("added"):
        return "+ " + str(point["added"])
    if point.get("kept_best"):
        return "best kept"
    if point.get("kept"):
        return f"keep {point['kept']} (int8: misses the target)"
    return "- " + str(point.get("removed"))


def _calibration_section(calibration: dict) -> list:
    blocks: list = [Heading(2, "Calibration")]
    if calibration.get("skipped"):
        return blocks + [Para(str(calibration["skipped"]))]
    pairs = [(key.replace("_", " "), fmt_value(calibration.get(key)))
             for key in ("method", "tensors", "samples", "batch_size", "statistics", "statistics_seconds",
                         "thresholds_seconds", "source") if calibration.get(key) is not None]
    blocks.append(KeyValues(pairs))
    chosen = _as_dict(calibration.get("methods_chosen"))
    if chosen:
        blocks.append(Table(["method", "tensors"], [[str(k), str(v)] for k, v in chosen.items()]))
    zero = [str(z) for z in _as_list(calibration.get("zero_tensors"))]
    if zero:
        blocks += [Heading(3, "Always-zero tensors (threshold floor)"), Items(zero[:20])]
    warnings = [str(w) for w in _as_list(calibration.get("warnings"))]
    if warnings:
        blocks += [Heading(3, "Calibration warnings"), Items(warnings)]
    return blocks


def _count_with_reference(count: Any, reference: Any) -> str:
    text = fmt_value(count)
    if _is_number(reference) and reference:
        text += f" (reference: {reference})"
    return text


def _output_metrics_table(outputs: list) -> Table:
    headers = ["output", "result", "cosine", "min sample cosine", "max abs", "mean abs",
               "rel L2", "SQNR dB", "NaN", "Inf", "failed checks"]
    rows, classes = [], []
    for out in outputs:
        m = _as_dict(out.get("metrics"))
        failures = [str(f) for f in _as_list(out.get("failures"))]
        rows.append([
            fmt_value(out.get("name")),
            fmt_pass(out.get("passed")),
            fmt_cosine(m.get("cosine")),
            fmt_cosine(m.get("min_sample_cosine")),
            fmt_error(m.get("max_abs")),
            fmt_error(m.get("mean_abs")),
            fmt_error(m.get("rel_l2")),
            fmt_sqnr(m["sqnr_db"]) if "sqnr_db" in m else NA,
            _count_with_reference(m.get("nan"), m.get("reference_nan")),
            _count_with_reference(m.get("inf"), m.get("reference_inf")),
            "; ".join(failures) if failures else "none",
        ])
        classes.append("row-fail" if out.get("passed") is False else "")
    return Table(headers, rows, classes)


THRESHOLD_LABELS = {
    "min_cosine": "min cosine",
    "max_abs_error": "max abs error",
    "max_mean_abs_error": "max mean abs error",
    "min_sqnr_db": "min SQNR dB",
}


def _fmt_threshold(key: str, value: Any) -> str:
    if value is None:
        return "not checked"
    if "cosine" in key:
        return fmt_cosine(value)
    if "sqnr" in key:
        return _fmt_number(value, ".1f")
    return fmt_error(value)


def _thresholds_blocks(outputs: list) -> list:
    keys: List[str] = []
    for out in outputs:
        for key in _as_dict(out.get("thresholds")):
            if key not in keys:
                keys.append(key)
    if not keys:
        return []
    headers = ["output"] + [THRESHOLD_LABELS.get(k, k.replace("_", " ")) for k in keys]
    rows = []
    for out in outputs:
        thresholds = _as_dict(out.get("thresholds"))
        rows.append([fmt_value(out.get("name"))]
                    + [_fmt_threshold(k, thresholds.get(k)) for k in keys])
    return [Heading(3, "Thresholds"), Table(headers, rows)]


def _min_tolerance_blocks(outputs: list) -> list:
    """Per output, the smallest abs / rel tolerances under which it would have passed."""
    rows = []
    for out in outputs:
        tolerances = out.get("min_tolerances")
        if isinstance(tolerances, dict):
            rows.append([fmt_value(out.get("name")), fmt_error(tolerances.get("abs")),
                         fmt_error(tolerances.get("rel"))])
    if not rows:
        return []
    return [Heading(3, "Minimum tolerances that would pass"),
            Table(["output", "abs tolerance", "rel tolerance"], rows)]


def _worst(values: list, pick: Callable, fmt: Callable[[Any], str]) -> str:
    """'value (sample i)' for the worst finite value, picked by min or max."""
    finite = [(v, i) for i, v in enumerate(values) if _finite(v)]
    if not finite:
        return NA
    value, index = pick(finite, key=lambda pair: pair[0])
    return f"{fmt(value)} (sample {index})"


def _per_sample_blocks(outputs: list) -> list:
    rows, charts = [], []
    for out in outputs:
        per_sample = _as_dict(out.get("per_sample"))
        cosines = _as_list(per_sample.get("cosine"))
        max_abs = _as_list(per_sample.get("max_abs"))
        if not cosines and not max_abs:
            continue
        name = fmt_value(out.get("name"))
        non_finite = sum(1 for v in cosines + max_abs if not _finite(v))
        rows.append([
            name,
            str(max(len(cosines), len(max_abs))),
            _worst(cosines, min, fmt_cosine),
            _worst(max_abs, max, fmt_error),
            str(non_finite),
        ])
        thresholds = _as_dict(out.get("thresholds"))
        if cosines:
            charts.append(svg_line_chart(
                cosines, title=f"{name}: per-sample cosine", x_label="sample index",
                y_label="cosine", value_format=fmt_cosine,
                threshold=thresholds.get("min_cosine"), threshold_label="min cosine"))
        if max_abs:
            charts.append(svg_line_chart(
                max_abs, title=f"{name}: per-sample max abs error", x_label="sample index",
                y_label="max abs error", value_format=fmt_error, include_zero=True,
                threshold=thresholds.get("max_abs_error"), threshold_label="max abs error",
                color="#bc4c00"))
    if not rows:
        return []
    headers = ["output", "samples", "worst cosine", "worst max abs", "non-finite values"]
    return [Heading(3, "Per-sample errors"), Table(headers, rows), Charts(charts)]


def _task_blocks(task: dict) -> list:
    headers = ["metric", "output", "reference", "target", "drop", "max drop",
               "agreement", "result"]
    row = [
        fmt_value(task.get("metric")),
        fmt_value(task.get("output")),
        fmt_ratio(task.get("reference")),
        fmt_ratio(task.get("target")),
        fmt_ratio(task.get("drop")),
        fmt_ratio(task.get("max_drop")),
        fmt_ratio(task.get("agreement")),
        fmt_pass(task.get("passed")),
    ]
    row_class = "row-fail" if task.get("passed") is False else ""
    extras = [f"{key}: reference {fmt_ratio(_as_dict(v).get('reference'))}, target {fmt_ratio(_as_dict(v).get('target'))}"
              for key, v in _as_dict(task.get("extras")).items()]
    return [Heading(3, "Task metric"), Table(headers, [row], [row_class])] + ([Items(extras)] if extras else [])


def _device_precision_blocks(requested: dict, effective: dict) -> list:
    keys = list(requested) + [k for k in effective if k not in requested]
    # what verify accepts for the request (mixed with an empty qtable runs int8): not a mismatch
    accepted = {"precision": [str(p).lower() for p in _as_list(requested.get("accepted_precisions"))]}
    rows, classes = [], []
    for key in keys:
        if key in requested and key in effective:
            same = str(effective[key]).lower() in (accepted.get(key) or [str(requested[key]).lower()])
            match = "yes" if same else "⚠ MISMATCH"
            if key == "precision" and not same and (requested[key], effective[key]) == ("int8", "mixed"):
                match = "⚠ partly: some quantized ops ran in float (see the warnings)"
        else:
            same, match = True, "—"
        rows.append([key, fmt_value(requested.get(key)) if key in requested else "—",
                     fmt_value(effective.get(key)) if key in effective else "—", match])
        classes.append("" if same else "row-mismatch")
    return [Heading(3, "Requested vs effective"),
            Table(["setting", "requested", "effective", "match"], rows, classes)]


FIRST_NAMES = 10  # names listed for long tensor lists (the rest is counted)


def _first_names(names: Any) -> str:
    names = [str(n) for n in _as_list(names)]
    if not names:
        return "0"
    shown = ", ".join(names[:FIRST_NAMES])
    more = f", … (+{len(names) - FIRST_NAMES} more)" if len(names) > FIRST_NAMES else ""
    return f"{len(names)}: {shown}{more}"


def _fmt_attribute(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(fmt_value(v) for v in value) + "]"
    return fmt_value(value)


def _layerwise_section(layerwise: dict) -> list:
    """Every intermediate tensor of the target against the reference, in network order."""
    blocks: list = [Heading(2, "Layerwise comparison")]
    threshold = layerwise.get("threshold")
    if layerwise.get("ran") is False:
        why = layerwise.get("reason") or "not run"
        return blocks + [Para(f"not run ({fmt_value(layerwise.get('mode'))} mode): {why}", css="muted")]
    pairs = [("mode", fmt_value(layerwise.get("mode")))]
    for key, label, fmt in (("reason", "why", fmt_value), ("samples", "samples", fmt_value),
                            ("seconds", "seconds", fmt_seconds), ("compared", "tensors compared", fmt_value),
                            ("threshold", "per-tensor min cosine", fmt_cosine)):
        if layerwise.get(key) is not None:
            pairs.append((label, fmt(layerwise[key])))
    for key, label in (("not_exposed", "not exposed by the backend"),
                       ("unmappable", "backend tensors without an ONNX name")):
        if layerwise.get(key) is not None:
            pairs.append((label, _first_names(layerwise[key])))
    if layerwise.get("side_file"):
        pairs.append(("every tensor", fmt_value(layerwise["side_file"])))
    blocks.append(KeyValues(pairs))

    divergence = layerwise.get("first_divergence")
    depth = [d for d in _as_list(layerwise.get("depth")) if isinstance(d, dict)]
    if depth:
        xs = [d.get("index") if _finite(d.get("index")) else i for i, d in enumerate(depth)]
        labels = [f"{d.get('tensor')} ({d.get('op')}): cosine {fmt_cosine(d.get('cosine'))}" for d in depth]
        mark = None
        if isinstance(divergence, dict):
            hit = next((x for x, d in zip(xs, depth) if d.get("tensor") == divergence.get("tensor")), None)
            if hit is not None:
                mark = (hit, f"first divergence: {divergence.get('op')}")
        blocks.append(Charts([svg_line_chart(
            [d.get("cosine") for d in depth], x_values=xs, title="per-tensor cosine along the network",
            x_label="topological index", y_label="cosine", value_format=fmt_cosine,
            threshold=threshold, threshold_label="threshold", flag_below=True, point_labels=labels,
            mark_x=mark, width=900)]))

    if isinstance(divergence, dict):
        blocks += _divergence_blocks(divergence, threshold)
    elif "first_divergence" in layerwise:
        blocks.append(Para("no tensor fell below the per-tensor threshold"))
    origin = layerwise.get("nan_origin")
    if isinstance(origin, dict):
        blocks += [Heading(3, "First NaN/Inf"), KeyValues([
            ("tensor", fmt_value(origin.get("tensor"))), ("op", fmt_value(origin.get("op"))),
            ("op type", fmt_value(origin.get("op_type"))), ("NaN", fmt_value(origin.get("nan"))),
            ("Inf", fmt_value(origin.get("inf"))),
            ("reference max abs", fmt_error(origin.get("reference_max_abs")))])]

    worst = [w for w in _as_list(layerwise.get("worst")) if isinstance(w, dict)][:FIRST_NAMES]
    if worst:
        rows = [[fmt_value(w.get("tensor")), fmt_value(w.get("op")), fmt_value(w.get("op_type")),
                 fmt_value(w.get("index")), fmt_cosine(w.get("cosine")), fmt_error(w.get("max_abs")),
                 fmt_sqnr(w["sqnr_db"]) if "sqnr_db" in w else NA, fmt_value(w.get("nan")),
                 fmt_value(w.get("inf")), fmt_pass(w.get("passed"))] for w in worst]
        classes = ["row-fail" if w.get("passed") is False else "" for w in worst]
        blocks += [Heading(3, f"Worst {len(worst)} tensors"),
                   Table(["tensor", "op", "op type", "depth", "cosine", "max abs", "SQNR dB", "NaN",
                          "Inf", "result"], rows, classes)]

    return blocks


def _divergence_blocks(divergence: dict, threshold: Any) -> list:
    limit = divergence.get("threshold", threshold)
    pairs = [("tensor", fmt_value(divergence.get("tensor"))), ("op", fmt_value(divergence.get("op"))),
             ("op type", fmt_value(divergence.get("op_type"))),
             ("cosine", fmt_cosine(divergence.get("cosine")) +
              (f" (threshold {fmt_cosine(limit)})" if limit is not None else "")),
             ("max abs", fmt_error(divergence.get("max_abs")))]
    attributes = _as_dict(divergence.get("attributes"))
    if attributes:
        pairs.append(("attributes", ", ".join(f"{k}={_fmt_attribute(v)}" for k, v in attributes.items())))
    region = [str(op) for op in _as_list(divergence.get("region"))]
    if region:
        pairs.append(("region", " → ".join(region)))
    blocks: list = [Heading(3, "First divergence"), KeyValues(pairs)]
    inputs = [i for i in _as_list(divergence.get("inputs")) if isinstance(i, dict)]
    if inputs:
        rows = [[fmt_value(i.get("tensor")), fmt_cosine(i.get("cosine"))] for i in inputs]
        classes = ["row-fail" if _finite(i.get("cosine")) and _finite(limit) and i["cosine"] < limit else ""
                   for i in inputs]
        blocks.append(Table(["input tensor", "cosine"], rows, classes))
    return blocks


def _recommendations_section(recommendations: list) -> list:
    texts = []
    for rec in recommendations:
        if isinstance(rec, dict):
            if rec.get("text"):
                texts.append(str(rec["text"]))
        elif rec:
            texts.append(str(rec))
    if not texts:
        return []
    return [Heading(2, "Recommendations"), Items(texts, css="recommendations")]


def fmt_device(found: dict) -> str:
    """The device that ran, saying what a Vulkan device really is (Mesa's lavapipe is a CPU)."""
    device = fmt_value(found.get("device"))
    name, kind = found.get("device_name"), found.get("device_type")
    if not name and not kind:
        return device
    if kind == "CPU":
        return f"{device} on {name or 'a CPU device'}, a driver that computes on the CPU (not a GPU)"
    return f"{device} on {name or 'an unnamed device'}" + (f" ({kind})" if kind else "")


def fmt_ms(value: Any) -> str:
    return _fmt_number(value, ".4f")


def fmt_share(value: Any) -> str:
    return f"{value * 100:.1f}%" if _finite(value) else NA


def _profile_section(profile: dict) -> list:
    """Per-layer time on the target's backend: top layers and time by op type."""
    blocks: list = [Heading(2, "Profile (time per layer)")]
    if not profile.get("ran"):
        blocks.append(Para(f"not profiled: {fmt_value(profile.get('reason'))}", css="muted"))
        tail = [str(line) for line in _as_list(_as_dict(profile.get("crash")).get("stderr_tail"))]
        return blocks + ([Pre([_truncate(line, STDERR_WIDTH) for line in tail[-STDERR_LINES:]])] if tail else [])
    pairs = [("measured by", fmt_value(profile.get("measured_by"))), ("device", fmt_device(profile)),
             ("sample", fmt_value(profile.get("sample"))),
             ("runs", f"{fmt_value(profile.get('runs'))} after {fmt_value(profile.get('warmup'))} warm-up runs"),
             ("sum of layers", f"{fmt_ms(profile.get('total_ms'))} ms per run"),
             ("whole run", f"{fmt_ms(profile.get('run_ms'))} ms per run"),
             ("layers with an ONNX node", f"{fmt_value(profile.get('mapped'))} of {fmt_value(profile.get('layers'))}")]
    unmapped = [str(name) for name in _as_list(profile.get("unmapped"))]
    if unmapped:
        pairs.append(("inserted by the runtime (no ONNX node)", _first_names(unmapped)))
    startup = _as_dict(profile.get("startup"))
    if startup:
        pairs.append(("start-up (load + first inference)",
                      f"{_fmt_number((startup.get('warm_s') or 0) * 1000, '.1f')} ms with the compile cache "
                      f"({fmt_value(startup.get('compile_cache'))}), "
                      f"{_fmt_number((startup.get('cold_s') or 0) * 1000, '.1f')} ms compiling: "
                      f"{_fmt_number(startup.get('speedup'), '.2f')}x"))
    blocks.append(KeyValues(pairs))
    if profile.get("note"):
        blocks.append(Para(str(profile["note"]), css="muted"))
    top = [row for row in _as_list(profile.get("top")) if isinstance(row, dict)]
    if top:
        rows = [[fmt_value(r.get("onnx_node")) if r.get("onnx_node") else "—", ", ".join(map(str, _as_list(
            r.get("onnx_nodes"))[1:])) or "—", fmt_value(r.get("onnx_op_type") or r.get("type")),
                 fmt_value(r.get("name")), fmt_value(r.get("kernel")), fmt_ms(r.get("ms")), fmt_ms(r.get("median_ms")),
                 fmt_share(r.get("share"))] for r in top]
        colors = [COMPUTED_COLOR if r.get("onnx_node") else CACHED_COLOR for r in top]
        blocks += [Heading(3, f"Top {len(top)} layers by time"),
                   Table(["ONNX node", "also computes", "op type", "runtime layer", "kernel", "mean ms", "median ms",
                          "share"], rows),
                   Charts([svg_bar_chart([str(r.get("onnx_node") or r.get("name")) for r in top],
                                         [r.get("ms") for r in top], title="time per layer (mean per run)",
                                         x_label="ms", colors=colors, value_format=fmt_ms,
                                         legend=[(COMPUTED_COLOR, "ONNX node"), (CACHED_COLOR, "runtime only")])])]
    kinds = [k for k in _as_list(profile.get("by_op_type")) if isinstance(k, dict)]
    if kinds:
        rows = [[fmt_value(k.get("op_type")) + (" (runtime only)" if k.get("runtime_only") else ""),
                 fmt_value(k.get("layers")), fmt_ms(k.get("ms")), fmt_share(k.get("share"))] for k in kinds]
        blocks += [Heading(3, "Time by op type"), Table(["op type", "layers", "ms", "share"], rows),
                   Charts([svg_bar_chart([str(k.get("op_type")) for k in kinds], [k.get("ms") for k in kinds],
                                         title="time per op type (mean per run)", x_label="ms",
                                         colors=[CACHED_COLOR if k.get("runtime_only") else COMPUTED_COLOR
                                                 for k in kinds], value_format=fmt_ms)])]
    return blocks


def _stages_section(stages: list) -> list:
    stages = [s for s in stages if isinstance(s, dict)]
    blocks: list = [Heading(2, "Stages")]
    if not stages:
        return blocks + [Para("no stages recorded")]
    rows, classes = [], []
    for stage in stages:
        rows.append([fmt_value(stage.get("stage")), fmt_value(stage.get("status")),
                     fmt_seconds(stage.get("seconds")), fmt_seconds(stage.get("computed_seconds"))])
        classes.append("row-cached" if stage.get("status") == "cached" else "")
    blocks.append(Table(["stage", "status", "seconds", "computed seconds"], rows, classes))
    total = sum(s["seconds"] for s in stages if _finite(s.get("seconds")))
    cached = sum(1 for s in stages if s.get("status") == "cached")
    blocks.append(Para(f"total: {fmt_seconds(total)} s over {len(stages)} stages ({cached} cached)"))
    colors = [CACHED_COLOR if s.get("status") == "cached" else COMPUTED_COLOR for s in stages]
    blocks.append(Charts([svg_bar_chart(
        [fmt_value(s.get("stage")) for s in stages],
        [s.get("seconds") for s in stages],
        title="stage wall time", x_label="seconds", colors=colors,
        legend=[(COMPUTED_COLOR, "computed"), (CACHED_COLOR, "cached")])]))
    return blocks


def _io_rows(role: str, tensors: Any) -> list:
    return [[role, fmt_value(t.get("name")), fmt_shape(t.get("shape")), fmt_value(t.get("dtype"))]
            for t in _as_list(tensors) if isinstance(t, dict)]


def _model_section(model: dict, convert: dict) -> list:
    blocks: list = [Heading(2, "Model & conversion")]
    pairs = []
    if model:
        pairs += [("model", fmt_value(model.get("name"))), ("path", fmt_value(model.get("path"))),
                  ("sha256", short_hash(model.get("sha256")))]
    if convert:
        pairs += [("source", fmt_value(convert.get("source"))),
                  ("source sha256", short_hash(convert.get("source_sha256")))]
        for key, label in (("opset", "opset"), ("ir_version", "IR version"), ("nodes", "nodes")):
            if key in convert:
                pairs.append((label, fmt_from_to(convert[key])))
    blocks.append(KeyValues(pairs))

    io_rows = _io_rows("input", convert.get("inputs")) + _io_rows("output", convert.get("outputs"))
    if io_rows:
        blocks += [Heading(3, "Inputs and outputs"), Table(["role", "name", "shape", "dtype"], io_rows)]

    op_types = _as_dict(convert.get("op_types"))
    if op_types:
        ranked = sorted(op_types.items(), key=lambda kv: (-kv[1] if _is_number(kv[1]) else 0, str(kv[0])))
        blocks += [Heading(3, "Op types (top 10 by count)"),
                   Table(["op type", "count"], [[str(op), fmt_value(n)] for op, n in ranked[:10]])]
        if len(ranked) > 10:
            rest = sum(n for _, n in ranked[10:] if _is_number(n))
            blocks.append(Para(f"+{len(ranked) - 10} more op types ({rest} nodes)", css="muted"))

    fixed = _as_dict(convert.get("fixed_shapes"))
    if fixed:
        rows = [[str(name), fmt_shape(_as_dict(s).get("from")), fmt_shape(_as_dict(s).get("to"))]
                for name, s in fixed.items()]
        blocks += [Heading(3, "Fixed shapes"), Table(["tensor", "from", "to"], rows)]
    return blocks


SEVERITY_CLASSES = {"error": "row-fail", "warning": "row-mismatch"}


def _preflight_section(findings: list) -> list:
    blocks: list = [Heading(2, "Pre-flight findings")]
    findings = [f for f in findings if isinstance(f, dict)]
    if not findings:
        return blocks + [Para("no findings")]
    rows = [[fmt_value(f.get("tensor")), fmt_value(f.get("check")), fmt_value(f.get("count")),
             fmt_value(f.get("detail")), fmt_value(f.get("severity"))] for f in findings]
    classes = [SEVERITY_CLASSES.get(str(f.get("severity")).lower(), "") for f in findings]
    return blocks + [Table(["tensor", "check", "count", "detail", "severity"], rows, classes)]


def _data_section(data: dict) -> list:
    blocks: list = [Heading(2, "Data")]
    if "kind" in data:
        blocks.append(KeyValues([("kind", fmt_value(data.get("kind")))]))
    warnings = [str(w) for w in _as_list(data.get("warnings"))]
    if warnings:
        blocks.append(Items(warnings, css="warnings"))
    splits = _as_dict(data.get("splits"))
    if splits:
        rows = []
        for name, split in splits.items():
            split = _as_dict(split)
            rows.append([str(name), fmt_value(split.get("used", split.get("samples"))),
                         fmt_yes_no(split.get("labeled")), fmt_value(split.get("source"))])
        blocks.append(Table(["split", "samples", "labeled", "source"], rows))
    return blocks


def _build_section(build: dict) -> list:
    blocks: list = [Heading(2, "Build")]
    if "backend" in build:
        blocks.append(KeyValues([("backend", fmt_value(build.get("backend")))]))
    files = [str(f) for f in _as_list(build.get("files"))]
    if files:
        blocks += [Heading(3, "Artifact files"), Items(files)]
    if "options" in build:
        options = _as_dict(build.get("options"))
        blocks.append(Heading(3, "Runtime options"))
        if options:
            rows = [[str(k), fmt_value(v)] for k, v in options.items()]
            blocks.append(Table(["option", "value"], rows))
        else:
            blocks.append(Para("runtime defaults (no options set)"))
    masks = _as_dict(_as_dict(build.get("quantization")).get("feature_masks"))
    if masks:
        blocks += _feature_masks_blocks(masks)
    blocks += _compile_cache_blocks(_as_dict(build.get("compile_cache")))
    return blocks


def _compile_cache_blocks(cache: dict) -> list:
    if not cache:
        return []
    key = _as_dict(cache.get("key"))
    return [Heading(3, "Compile cache"),
            Para(f"{fmt_value(len(_as_list(cache.get('files'))))} file(s), "
                 f"{_fmt_number((cache.get('bytes') or 0) / 1024, '.1f')} KiB in {fmt_value(cache.get('folder'))}/, "
                 f"written in {fmt_seconds(cache.get('compile_seconds'))}; used where the runtime versions, device, "
                 f"machine fingerprint ({fmt_value(key.get('fingerprint'))}) and runtime options match.")]


def _fmt_changes(changes: Any) -> str:
    changes = _as_dict(changes)
    return ", ".join(f"{k}={fmt_value(v)}" for k, v in changes.items()) or "build's settings"


def _trial_cost(trial: dict, unit: str = "") -> str:
    """A trial's median latency in ms, or its throughput per second."""
    measurement = _as_dict(trial.get("measurement"))
    if "throughput" in measurement:
        return f"{_fmt_number(measurement.get('throughput'), '.1f')}{unit and ' inferences/s'}"
    return f"{_fmt_number(measurement.get('median_ms'), '.4f')}{unit and ' ms'}"


def _tuning_section(tuning: dict) -> list:
    blocks: list = [Heading(2, "Tuning")]
    if not tuning.get("ran"):
        return blocks + [Para(fmt_value(tuning.get("reason")))]
    chosen, baseline = _as_dict(tuning.get("chosen")), _as_dict(tuning.get("baseline"))
    throughput = tuning.get("objective") == "throughput"
    pairs = [("level", fmt_value(tuning.get("level"))), ("objective", fmt_value(tuning.get("objective"))),
             ("measurements", "reused from the tuning cache" if tuning.get("reused") else "measured in this run"),
             ("chosen", _fmt_changes(chosen.get("changes"))),
             ("build's settings", _trial_cost(baseline, unit="yes")), ("tuned", _trial_cost(chosen, unit="yes")),
             ("speed-up", f"{_fmt_number(tuning.get('speedup'), '.2f')}x"),
             ("re-verified", f"on {fmt_value(tuning.get('verify_samples'))} validation samples; "
                             f"{fmt_value(tuning.get('refused'))} setting(s) refused")]
    blocks.append(KeyValues(pairs))
    if tuning.get("note"):
        blocks.append(Para(fmt_value(tuning["note"])))
    trials = [t for t in _as_list(tuning.get("trials")) if isinstance(t, dict)]
    unit = "inferences/s" if throughput else "median ms"
    rows, classes = [], []
    for trial in trials:
        measurement = _as_dict(trial.get("measurement"))
        spread = (f"{_fmt_number(measurement.get('p25_ms'), '.4f')} - {_fmt_number(measurement.get('p75_ms'), '.4f')}"
                  if "p25_ms" in measurement else "")
        verified = {True: "pass", False: "refused: " + "; ".join(map(str, _as_list(trial.get("failures"))))}.get(
            trial.get("verified"), "")
        rows.append([_fmt_changes(trial.get("changes")), trial.get("error") and "error" or _trial_cost(trial), spread,
                     verified or (fmt_value(trial.get("error")) if trial.get("error") else "")])
        classes.append("fail" if trial.get("verified") is False or trial.get("error") else "")
    blocks += [Heading(3, "Candidates"), Table(["settings", unit, "interquartile ms", "re-verification"], rows, classes),
               Charts([svg_bar_chart([_fmt_changes(t.get("changes")) for t in trials],
                                     [t.get("score_ms") for t in trials], title="time per inference by candidate",
                                     x_label="ms", value_format=lambda v: _fmt_number(v, ".4f"))])]
    return blocks


def _feature_masks_blocks(masks: dict) -> list:
    """ncnn's per-layer feature masks (31=) found by the search: layer, mask, where it runs."""
    blocks: list = [Heading(3, "ncnn feature masks")]
    if not masks.get("searched"):
        return blocks + [Para(f"no search: {fmt_value(masks.get('reason'))}")]
    rows = [[fmt_value(m.get("layer")), fmt_value(m.get("onnx_op")), fmt_value(m.get("mask")), fmt_value(m.get("runs"))]
            for m in _as_list(masks.get("masks")) if isinstance(m, dict)]
    verdict = "passes" if masks.get("passed") else "still fails"
    blocks.append(Para(f"{len(rows)} layer(s) masked after {fmt_value(len(_as_list(masks.get('trials'))))} "
                       f"verified trial(s); the masked build {verdict} on the search samples."))
    if rows:
        blocks.append(Table(["ncnn layer", "ONNX op", "mask (31=)", "runs"], rows))
    return blocks


def _environment_section(env: dict) -> list:
    blocks: list = [Heading(2, "Environment")]
    cpu = _as_dict(env.get("cpu"))
    pairs = []
    if env.get("platform") is not None:
        pairs.append(("platform", fmt_value(env["platform"])))
    if cpu.get("model") is not None:
        pairs.append(("CPU", fmt_value(cpu["model"])))
    if pairs:
        blocks.append(KeyValues(pairs))
    versions = _as_dict(env.get("versions"))
    if versions:
        rows = [[str(k), fmt_value(v)] for k, v in versions.items()]
        blocks.append(Table(["component", "version"], rows))
    flags = [str(f) for f in _as_list(cpu.get("flags"))]
    if flags:
        blocks.append(Para(f"CPU flags ({len(flags)}): " + " ".join(flags), css="flags"))
    return blocks


def build_document(report: dict) -> list:
    """The report as a list of blocks, shared by both renderers."""
    if not isinstance(report, dict):
        raise TypeError(f"report must be a dict, got {type(report).__name__}")
    blocks = _header_section(report)
    if isinstance(report.get("auto"), dict):
        blocks += _auto_section(report["auto"])
    if isinstance(report.get("verify"), dict):
        verify = report["verify"]
        blocks += _verification_section(verify)
        if isinstance(verify.get("layerwise"), dict):
            blocks += _layerwise_section(verify["layerwise"])
        if isinstance(verify.get("recommendations"), (list, tuple)):
            blocks += _recommendations_section(list(verify["recommendations"]))
    if isinstance(report.get("profile"), dict):
        blocks += _profile_section(report["profile"])
    if isinstance(report.get("stages"), (list, tuple)):
        blocks += _stages_section(list(report["stages"]))
    model, convert = _as_dict(report.get("model")), _as_dict(report.get("convert"))
    if model or convert:
        blocks += _model_section(model, convert)
    if convert.get("preflight") is not None:
        blocks += _preflight_section(_as_list(convert["preflight"]))
    if isinstance(report.get("calibration"), dict):
        blocks += _calibration_section(report["calibration"])
    if isinstance(report.get("sensitivity"), dict) and not _as_dict(report["sensitivity"]).get("skipped", "").startswith("precision"):
        blocks += _sensitivity_section(report["sensitivity"])
    if isinstance(report.get("data"), dict):
        blocks += _data_section(report["data"])
    if isinstance(report.get("build"), dict):
        blocks += _build_section(report["build"])
    if isinstance(report.get("tuning"), dict):
        blocks += _tuning_section(report["tuning"])
    if isinstance(report.get("environment"), dict):
        blocks += _environment_section(report["environment"])
    return blocks


# ---------------------------------------------------------------------------
# SVG charts


COMPUTED_COLOR = "#0969da"
CACHED_COLOR = "#8c959f"
GRID_COLOR = "#d0d7de"
TEXT_COLOR = "#1f2328"
CHAR_WIDTH = 7  # rough width of one 12px character, for layout only


def _nice_step(raw: float) -> float:
    exponent = math.floor(math.log10(raw))
    fraction = raw / 10 ** exponent
    for nice in (1, 2, 5):
        if fraction <= nice:
            return nice * 10 ** exponent
    return 10 * 10 ** exponent


def nice_ticks(lo: float, hi: float, count: int = 5, integer: bool = False) -> Tuple[list, float]:
    """Round tick values covering [lo, hi], and the step between them."""
    if hi < lo:
        lo, hi = hi, lo
    if hi - lo <= abs(hi) * 1e-12:
        pad = abs(hi) * 1e-3 or 1.0
        lo, hi = lo - pad, hi + pad
    step = _nice_step((hi - lo) / max(count - 1, 1))
    if integer:
        step = max(1.0, step)
    first = math.floor(lo / step + 1e-9)
    last = math.ceil(hi / step - 1e-9)
    return [k * step for k in range(first, last + 1)], step


def tick_labels(ticks: Sequence[float], step: float) -> List[str]:
    """Labels precise enough to tell neighbouring ticks apart."""
    biggest = max(abs(t) for t in ticks)
    smallest = min((abs(t) for t in ticks if t), default=0.0)
    if biggest < 1e6 and (smallest == 0.0 or smallest >= 1e-3):
        decimals = min(15, max(0, -math.floor(math.log10(step))))
        return [f"{t:.{decimals}f}" for t in ticks]
    digits = max(3, 1 + math.ceil(math.log10(biggest / step)))
    return [f"{t:.{digits}g}" for t in ticks]


def _e(text: Any) -> str:
    return html.escape(str(text), quote=True)


def _truncate(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:max(limit - 1, 1)] + "…"


def _svg_open(width: int, height: int, title: str) -> List[str]:
    return [
        f'<svg class="chart" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
        f'role="img" aria-label="{_e(title)}" font-family="system-ui, sans-serif" '
        f'font-size="12" fill="{TEXT_COLOR}">',
        f"<title>{_e(title)}</title>",
        f'<text x="{width / 2:.1f}" y="18" text-anchor="middle" font-size="14" '
        f'font-weight="600">{_e(title)}</text>',
    ]


def svg_bar_chart(labels: Sequence[str], values: Sequence[Any], *, title: str, x_label: str,
                  colors: Optional[Sequence[str]] = None,
                  legend: Sequence[Tuple[str, str]] = (),
                  value_format: Callable[[Any], str] = fmt_seconds) -> str:
    """Horizontal bar chart: one bar per label, value axis along x.

    ``colors`` gives one fill per bar; ``legend`` is a list of (colour, text).
    Missing or non-finite values are drawn as empty bars labelled n/a.
    """
    bar_h, gap = 18, 8
    label_w = min(240, 16 + CHAR_WIDTH * max((len(str(l)) for l in labels), default=4))
    plot_w, value_w = 380, 70
    top = 34 + (22 if legend else 0)
    plot_h = len(labels) * (bar_h + gap) + gap
    width = label_w + plot_w + value_w
    height = top + plot_h + 44
    numbers = [v if _finite(v) and v > 0 else 0.0 for v in values]
    ticks, step = nice_ticks(0.0, max(numbers, default=0.0) or 1.0)
    x_max = ticks[-1]

    def x_of(value: float) -> float:
        return label_w + value / x_max * plot_w

    parts = _svg_open(width, height, title)
    for i, (color, text) in enumerate(legend):
        lx = label_w + i * 110
        parts.append(f'<rect x="{lx}" y="28" width="12" height="12" fill="{_e(color)}"/>')
        parts.append(f'<text x="{lx + 17}" y="38">{_e(text)}</text>')
    axis_y = top + plot_h
    for tick, text in zip(ticks, tick_labels(ticks, step)):
        x = x_of(tick)
        parts.append(f'<line x1="{x:.1f}" y1="{top}" x2="{x:.1f}" y2="{axis_y}" '
                     f'stroke="{GRID_COLOR}"/>')
        parts.append(f'<text x="{x:.1f}" y="{axis_y + 16}" text-anchor="middle">{_e(text)}</text>')
    for i, (label, value) in enumerate(zip(labels, values)):
        y = top + gap + i * (bar_h + gap)
        color = colors[i] if colors and i < len(colors) else COMPUTED_COLOR
        bar_w = x_of(numbers[i]) - label_w
        parts.append(f'<text x="{label_w - 6}" y="{y + bar_h - 5}" text-anchor="end">'
                     f'{_e(_truncate(str(label), (label_w - 16) // CHAR_WIDTH))}</text>')
        parts.append(f'<rect x="{label_w}" y="{y}" width="{bar_w:.1f}" height="{bar_h}" '
                     f'fill="{_e(color)}"/>')
        shown = value_format(value) if _finite(value) else NA
        parts.append(f'<text x="{label_w + bar_w + 5:.1f}" y="{y + bar_h - 5}">{_e(shown)}</text>')
    parts.append(f'<line x1="{label_w}" y1="{top}" x2="{label_w}" y2="{axis_y}" stroke="{TEXT_COLOR}"/>')
    parts.append(f'<line x1="{label_w}" y1="{axis_y}" x2="{label_w + plot_w}" y2="{axis_y}" '
                 f'stroke="{TEXT_COLOR}"/>')
    parts.append(f'<text x="{label_w + plot_w / 2:.1f}" y="{axis_y + 36}" '
                 f'text-anchor="middle">{_e(x_label)}</text>')
    parts.append("</svg>")
    return "\n".join(parts)


FLAG_COLOR = "#cf222e"
MAX_POINTS = 300  # above this many points the line is drawn without a dot per point
MAX_FLAGGED = 300  # flagged (below-threshold) points drawn with a dot and a tooltip


def svg_line_chart(values: Sequence[Any], *, title: str, x_label: str, y_label: str,
                   value_format: Callable[[Any], str] = fmt_error, include_zero: bool = False,
                   threshold: Any = None, threshold_label: str = "threshold",
                   color: str = COMPUTED_COLOR, x_values: Optional[Sequence[Any]] = None,
                   flag_below: bool = False, point_labels: Optional[Sequence[str]] = None,
                   mark_x: Optional[Tuple[float, str]] = None, width: int = 520) -> str:
    """Line/point chart of one series against its index (x = 0 .. n-1) or ``x_values``.

    Non-finite values are not drawn (their count is stated under the title).
    The threshold, if any, is stated under the title and, when it falls inside
    the plotted range, drawn as a dashed red line. ``flag_below`` draws the points
    under the threshold as red dots, with ``point_labels`` as their tooltips;
    ``mark_x`` = (x, label) draws a labelled vertical marker.
    """
    height = 300
    left, right, top, bottom = 84, 16, 48, 48
    plot_w, plot_h = width - left - right, height - top - bottom
    xs = [x_values[i] if x_values is not None and i < len(x_values) and _finite(x_values[i]) else i
          for i in range(len(values))]
    points = [(float(x), float(v), i) for i, (x, v) in enumerate(zip(xs, values)) if _finite(v)]
    skipped = len(values) - len(points)

    parts = _svg_open(width, height, title)
    if points:
        y_values = [v for _, v, _ in points]
        lo, hi = min(y_values), max(y_values)
        subtitle = f"range {value_format(lo)} … {value_format(hi)}"
    else:
        lo, hi = 0.0, 1.0
        subtitle = "no finite values"
    if skipped:
        subtitle += f" · {skipped} non-finite not drawn"
    flagged = []
    if _finite(threshold):
        subtitle += f" · {threshold_label} {value_format(threshold)}"
        if flag_below:
            flagged = [p for p in points if p[1] < threshold]
            subtitle += f" · {len(flagged)} below"
    parts.append(f'<text x="{width / 2:.1f}" y="36" text-anchor="middle" fill="#57606a">'
                 f'{_e(subtitle)}</text>')
    if include_zero:
        lo, hi = min(lo, 0.0), max(hi, 0.0)
        if hi == lo:
            hi = 1.0
    y_ticks, y_step = nice_ticks(lo, hi)
    x_lo = min((x for x, _, _ in points), default=0.0) if x_values is not None else 0.0
    x_hi = max((x for x, _, _ in points), default=0.0) if x_values is not None else len(values) - 1
    x_ticks, x_step = nice_ticks(min(x_lo, 0.0), max(x_hi, 1.0), integer=True)
    y0, y1, x0, x1 = y_ticks[0], y_ticks[-1], x_ticks[0], x_ticks[-1]

    def px(x: float) -> float:
        return left + (x - x0) / (x1 - x0) * plot_w

    def py(value: float) -> float:
        return top + plot_h - (value - y0) / (y1 - y0) * plot_h

    bottom_y = top + plot_h
    for tick, text in zip(y_ticks, tick_labels(y_ticks, y_step)):
        y = py(tick)
        parts.append(f'<line x1="{left}" y1="{y:.1f}" x2="{left + plot_w}" y2="{y:.1f}" '
                     f'stroke="{GRID_COLOR}"/>')
        parts.append(f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">{_e(text)}</text>')
    for tick, text in zip(x_ticks, tick_labels(x_ticks, x_step)):
        x = px(tick)
        parts.append(f'<line x1="{x:.1f}" y1="{bottom_y}" x2="{x:.1f}" y2="{bottom_y + 4}" '
                     f'stroke="{TEXT_COLOR}"/>')
        parts.append(f'<text x="{x:.1f}" y="{bottom_y + 17}" text-anchor="middle">{_e(text)}</text>')
    parts.append(f'<line x1="{left}" y1="{top}" x2="{left}" y2="{bottom_y}" stroke="{TEXT_COLOR}"/>')
    parts.append(f'<line x1="{left}" y1="{bottom_y}" x2="{left + plot_w}" y2="{bottom_y}" '
                 f'stroke="{TEXT_COLOR}"/>')

    if _finite(threshold) and y0 <= threshold <= y1:
        y = py(threshold)
        parts.append(f'<line x1="{left}" y1="{y:.1f}" x2="{left + plot_w}" y2="{y:.1f}" '
                     f'stroke="{FLAG_COLOR}" stroke-dasharray="6 4"/>')
        label_y = y + 15 if y < top + plot_h / 2 else y - 5  # keep the label inside the plot
        parts.append(f'<text x="{left + plot_w - 4}" y="{label_y:.1f}" text-anchor="end" fill="{FLAG_COLOR}">'
                     f'{_e(threshold_label)} {_e(value_format(threshold))}</text>')
    if mark_x is not None and _finite(mark_x[0]) and x0 <= mark_x[0] <= x1:
        x = px(mark_x[0])
        parts.append(f'<line x1="{x:.1f}" y1="{top}" x2="{x:.1f}" y2="{bottom_y}" '
                     f'stroke="#8250df" stroke-dasharray="3 3"/>')
        anchor = "start" if x < left + plot_w / 2 else "end"
        offset = 4 if anchor == "start" else -4
        parts.append(f'<text x="{x + offset:.1f}" y="{top + 28}" text-anchor="{anchor}" fill="#8250df">'
                     f'{_e(_truncate(str(mark_x[1]), 60))}</text>')
    if points:
        coords = " ".join(f"{px(x):.1f},{py(v):.1f}" for x, v, _ in points)
        parts.append(f'<polyline points="{coords}" fill="none" stroke="{_e(color)}" stroke-width="1.5"/>')
        if len(points) <= MAX_POINTS:
            parts += [f'<circle cx="{px(x):.1f}" cy="{py(v):.1f}" r="2" fill="{_e(color)}"/>'
                      for x, v, _ in points]
    for x, v, i in flagged[:MAX_FLAGGED]:
        tip = point_labels[i] if point_labels is not None and i < len(point_labels) else None
        tooltip = f"<title>{_e(tip)}</title>" if tip else ""
        parts.append(f'<circle class="flagged" cx="{px(x):.1f}" cy="{py(v):.1f}" r="3" '
                     f'fill="{FLAG_COLOR}">{tooltip}</circle>')

    parts.append(f'<text x="{left + plot_w / 2:.1f}" y="{height - 8}" text-anchor="middle">'
                 f'{_e(x_label)}</text>')
    cy = top + plot_h / 2
    parts.append(f'<text x="14" y="{cy:.1f}" text-anchor="middle" '
                 f'transform="rotate(-90 14 {cy:.1f})">{_e(y_label)}</text>')
    parts.append("</svg>")
    return "\n".join(parts)


# ---------------------------------------------------------------------------
# Markdown


def _md_text(text: str) -> str:
    return str(text).replace("\r", " ").replace("\n", " ")


def _md_cell(text: str) -> str:
    return _md_text(text).replace("|", "\\|")


def _md_table(table: Table) -> List[str]:
    lines = ["| " + " | ".join(_md_cell(h) for h in table.headers) + " |",
             "|" + "|".join("---" for _ in table.headers) + "|"]
    lines += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in table.rows]
    return lines


def _md_block(block: Any) -> List[str]:
    if isinstance(block, Heading):
        return ["#" * block.level + " " + _md_text(block.text)]
    if isinstance(block, Banner):
        label = VERDICT_LABELS.get(block.verdict, block.verdict.upper())
        icon = VERDICT_ICONS.get(block.verdict, "⚪")
        line = f"> **{icon} {_md_text(label)}**"
        return [line + (f" · {_md_text(block.detail)}" if block.detail else "")]
    if isinstance(block, Para):
        return [_md_text(block.text)]
    if isinstance(block, Items):
        return [f"- {_md_text(item)}" for item in block.items]
    if isinstance(block, KeyValues):
        return [f"- **{_md_text(k)}:** {_md_text(v)}" for k, v in block.pairs]
    if isinstance(block, Table):
        return _md_table(block)
    if isinstance(block, Pre):
        fence = "```"
        while any(fence in line for line in block.lines):
            fence += "`"
        return [fence + "text"] + [line.replace("\r", "") for line in block.lines] + [fence]
    return []  # charts are HTML only


def render_markdown(report: dict) -> str:
    """The report as a Markdown document (tables, no charts)."""
    return markdown_document(build_document(report))


def markdown_document(blocks: list) -> str:
    """Document blocks as Markdown (shared by run and sweep reports)."""
    chunks = [_md_block(block) for block in blocks]
    return "\n\n".join("\n".join(lines) for lines in chunks if lines) + "\n"


# ---------------------------------------------------------------------------
# HTML

CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; color: #1f2328;
       max-width: 1180px; margin: 0 auto; padding: 1.5rem; line-height: 1.45; }
h1 { font-size: 1.5rem; margin-bottom: .6rem; }
h2 { font-size: 1.25rem; border-bottom: 1px solid #d0d7de; padding-bottom: .3rem; margin-top: 2rem; }
h3 { font-size: 1.05rem; margin-top: 1.3rem; }
.banner { color: #fff; border-radius: 6px; padding: .8rem 1.2rem; font-size: 1.5rem;
          font-weight: 700; display: flex; gap: 1rem; align-items: baseline; }
.banner .detail { font-size: 1rem; font-weight: 400; opacity: .9; }
.verdict-pass { background: #1a7f37; }
.verdict-fail { background: #cf222e; }
.verdict-unverified, .verdict-other { background: #6e7781; }
.muted { color: #57606a; }
ul.reasons li { color: #a40e26; font-weight: 600; }
ul.warnings li { color: #7d4e00; }
table { border-collapse: collapse; margin: .5rem 0 1rem; font-size: .9rem; }
th, td { border: 1px solid #d0d7de; padding: .3rem .6rem; text-align: left; vertical-align: top; }
th { background: #f6f8fa; }
td { font-variant-numeric: tabular-nums; }
table.kv th { width: 9rem; }
tr.row-fail td { background: #ffebe9; }
tr.row-mismatch td { background: #fff8c5; }
tr.row-cached td { color: #57606a; }
tr.row-best td { background: #dafbe1; font-weight: 600; }
.charts { display: flex; flex-wrap: wrap; gap: 1rem; }
svg.chart { border: 1px solid #d0d7de; border-radius: 6px; background: #fff; }
pre.stderr { background: #f6f8fa; border: 1px solid #d0d7de; border-radius: 6px; padding: .6rem .8rem;
             font-size: .8rem; overflow-x: auto; white-space: pre; }
ul.recommendations li { font-weight: 600; }
svg.chart circle.flagged { cursor: help; }
p.flags { font-family: ui-monospace, monospace; font-size: .8rem; word-break: break-word; }
"""


def _html_table(table: Table) -> str:
    lines = ["<table>", "<thead><tr>" + "".join(f"<th>{_e(h)}</th>" for h in table.headers)
             + "</tr></thead>", "<tbody>"]
    for i, row in enumerate(table.rows):
        css = table.row_classes[i] if i < len(table.row_classes) else ""
        attr = f' class="{_e(css)}"' if css else ""
        lines.append(f"<tr{attr}>" + "".join(f"<td>{_e(c)}</td>" for c in row) + "</tr>")
    lines += ["</tbody>", "</table>"]
    return "\n".join(lines)


def _html_block(block: Any) -> str:
    if isinstance(block, Heading):
        return f"<h{block.level}>{_e(block.text)}</h{block.level}>"
    if isinstance(block, Banner):
        css = block.verdict if block.verdict in VERDICT_LABELS else "other"
        label = VERDICT_LABELS.get(block.verdict, block.verdict.upper())
        detail = f'<span class="detail">{_e(block.detail)}</span>' if block.detail else ""
        return f'<div class="banner verdict-{css}"><span class="verdict">{_e(label)}</span>{detail}</div>'
    if isinstance(block, Para):
        attr = f' class="{_e(block.css)}"' if block.css else ""
        return f"<p{attr}>{_e(block.text)}</p>"
    if isinstance(block, Items):
        attr = f' class="{_e(block.css)}"' if block.css else ""
        return f"<ul{attr}>" + "".join(f"<li>{_e(item)}</li>" for item in block.items) + "</ul>"
    if isinstance(block, KeyValues):
        rows = "".join(f"<tr><th>{_e(k)}</th><td>{_e(v)}</td></tr>" for k, v in block.pairs)
        return f'<table class="kv"><tbody>{rows}</tbody></table>'
    if isinstance(block, Table):
        return _html_table(block)
    if isinstance(block, Pre):
        return '<pre class="stderr">' + "\n".join(_e(line) for line in block.lines) + "</pre>"
    if isinstance(block, Charts):
        return '<div class="charts">\n' + "\n".join(block.svgs) + "\n</div>" if block.svgs else ""
    raise TypeError(f"unknown block {type(block).__name__}")


def render_html(report: dict) -> str:
    """The report as one self-contained HTML page (inline CSS and SVG, no scripts)."""
    return html_document(_title(report), build_document(report))


def html_document(title: str, blocks: list) -> str:
    """Document blocks as one self-contained HTML page (shared by run and sweep reports)."""
    body = "\n".join(part for part in (_html_block(b) for b in blocks) if part)
    return (
        "<!DOCTYPE html>\n"
        '<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        f"<title>{_e(title)}</title>\n"
        f"<style>{CSS}</style>\n</head>\n<body>\n{body}\n</body>\n</html>\n"
    )
