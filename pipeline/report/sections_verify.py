"""The report's first part as blocks: title and verdict banner, reasons and warnings, a
backend crash, precision=auto's candidates, the Verification section (metrics,
thresholds, per-sample errors, task metric, requested vs effective, the side-by-side
comparison), the layerwise comparison and the recommendations.

Each ``*_section`` function takes one part of the report dict and returns blocks
(pipeline/report/document.py); a part that is missing or malformed gives fewer blocks,
never an error.
"""

from __future__ import annotations

from typing import Any, Callable, List

from pipeline.precision import kinds
from pipeline.report.charts import LineChart, bar_chart, line_chart
from pipeline.report.document import Banner, Charts, Heading, Items, KeyValues, Para, Pre, Table
from pipeline.report.junit import uncertainty
from pipeline.report.sections_memory import memory_section
from pipeline.verification.memory import candidate_peak
from pipeline.verification.speed import how_sure, interval_keys
from pipeline.report.formatting import (FIRST_NAMES, NA, STDERR_LINES, STDERR_WIDTH, as_dict, as_list,
                                        column_headers, finite, first_names, fmt_attribute, fmt_cells, fmt_cosine,
                                        fmt_error, fmt_interval, fmt_number, fmt_pass, fmt_ratio, fmt_seconds, fmt_sqnr,
                                        fmt_value, is_number, truncate)


def report_verdict(report: dict) -> str:
    return str(report.get("verdict") or "unverified").lower()


def report_title(report: dict) -> str:
    model = as_dict(report.get("model")).get("name") or "unknown model"
    target = as_dict(report.get("target")).get("name") or "unknown target"
    precision = report.get("precision") or "?"
    return f"parity report: {model} on {target} ({precision})"


def header_section(report: dict) -> list:
    blocks: list = [Heading(1, report_title(report))]
    exit_code = report.get("exit_code")
    detail = f"exit code {exit_code}" if exit_code is not None else ""
    blocks.append(Banner(report_verdict(report), detail))
    about = []
    if report.get("parity_version"):
        about.append(f"parity {report['parity_version']}")
    if report.get("schema_version") is not None:
        about.append(f"report schema {report['schema_version']}")
    if about:
        blocks.append(Para(" · ".join(about), css="muted"))

    target = as_dict(report.get("target"))
    if target:
        pairs = [("target", fmt_value(target.get("name")))]
        for key, label in (("backend", "backend"), ("device", "device"), ("threads", "threads"),
                           ("memory", "memory"), ("memory_mode", "memory mode")):
            if key in target:
                pairs.append((label, fmt_value(target[key])))
        blocks.append(KeyValues(pairs))

    reasons = [str(r) for r in as_list(report.get("reasons"))]
    if reasons:
        blocks += [Heading(3, "Reasons"), Items(reasons, css="reasons")]
    warnings = [str(w) for w in as_list(report.get("warnings"))]
    if warnings:
        blocks += [Heading(3, "Warnings"), Items(warnings, css="warnings")]
    crash = as_dict(report.get("verify")).get("crash")
    if isinstance(crash, dict):
        blocks += _crash_blocks(crash)
    return blocks


CRASH_TITLES = {
    "crashed": "crashed",
    "hung": "hung (stopped after the time limit)",
    "error": "failed with an error",
    "memory": "ran out of memory",
}


def _crash_blocks(crash: dict) -> list:
    """The backend process died, hung or failed: shown under the reasons, before Verification."""
    kind = str(crash.get("kind") or "crashed")
    backend = str(crash.get("backend") or "the backend")
    blocks: list = [Heading(2, f"⚠ Backend {backend} {CRASH_TITLES.get(kind, kind)}")]
    pairs = [("kind", kind), ("backend", backend)]
    if crash.get("detail"):
        pairs.append(("detail", fmt_value(crash["detail"])))
    blocks.append(KeyValues(pairs))
    tail = [str(line).rstrip("\n") for line in as_list(crash.get("stderr_tail"))]
    if tail:
        shown = [truncate(line, STDERR_WIDTH) for line in tail[-STDERR_LINES:]]
        label = f"stderr (last {len(shown)} lines)" if len(tail) > len(shown) else "stderr"
        blocks += [Para(label, css="muted"), Pre(shown)]
    return blocks


def verification_section(verify: dict) -> list:
    blocks: list = [Heading(2, "Verification")]
    if verify.get("samples") is not None:
        blocks.append(Para(f"samples compared: {verify['samples']}"))
    outputs = [o for o in as_list(verify.get("outputs")) if isinstance(o, dict)]
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
        blocks += _device_precision_blocks(as_dict(verify.get("requested")),
                                           as_dict(verify.get("effective")))
    if isinstance(verify.get("comparison"), dict):
        blocks += _comparison_blocks(verify["comparison"], as_dict(verify.get("task")).get("metric"))
    if verify.get("shapes"):
        blocks += _shape_blocks(as_list(verify.get("shapes")), as_dict(as_dict(verify.get("speed")).get("by_shape")))
    if as_dict(as_dict(verify.get("speed")).get("stream")):
        blocks += _stream_blocks(as_dict(as_dict(verify.get("speed")).get("stream")))
    blocks += memory_section(verify)
    return blocks


def _stream_blocks(stream: dict) -> list:
    """Speed as served: the validation samples in order, each at its own shape."""
    medians, speedups = as_dict(stream.get("median_ms")), as_dict(stream.get("speedups"))
    rows = [[str(build), fmt_number(ms, ".3f"),
             fmt_speedup(as_dict(speedups.get(build))) if build in speedups else "1.00x (reference)"]
            for build, ms in medians.items()]
    return [Heading(3, "Speed as served"), Table(["build", "mean ms per call", "speed-up vs fp32"], rows),
            Para(f"{stream.get('samples')} validation samples of {stream.get('shapes')} input shapes run in their "
                 f"order, one call each, every build once a round ({stream.get('rounds')} rounds, order rotated): "
                 "what a service fed requests of varying shape sees. The speed warning and validation.min_speedup "
                 "judge this figure.")]


def _shape_blocks(groups: list, curve: dict) -> list:
    """A dynamic model: accuracy per input shape, and latency at min, opt and max."""
    rows = []
    for group in groups:
        group = as_dict(group)
        cosines = [as_dict(v).get("cosine") for v in as_dict(group.get("outputs")).values()]
        worst = min((c for c in cosines if is_number(c)), default=None)
        rows.append([str(group.get("shape")), ", ".join(str(b) for b in as_list(group.get("buckets"))),
                     str(group.get("samples")), fmt_cosine(worst)])
    blocks = [Heading(3, "By input shape"), Table(["shape", "bucket", "samples", "lowest output cosine"], rows)]
    if curve:
        builds = list(as_dict(next(iter(curve.values()))).get("median_ms") or {})
        timed = [[which, str(as_dict(found).get("shape")),
                  *[fmt_number(as_dict(as_dict(found).get("median_ms")).get(b), ".3f") for b in builds]]
                 for which, found in curve.items()]
        blocks += [Table(["timed at", "shape", *[f"{b} median ms" for b in builds]], timed),
                   Para("latency curve: each shape timed like the side-by-side table (interleaved rounds)")]
    return blocks


def _comparison_blocks(comparison: dict, metric=None) -> list:
    """The build next to an fp32 build on the same backend, timed interleaved."""
    rows = []
    labels = {"fp32": "FLOAT", "int8": "INT8", "mixed": "MIX"}
    for precision, row in comparison.items():
        row = as_dict(row)
        timing, speedup = as_dict(row.get("latency")), as_dict(row.get("speedup"))
        size = row.get("bytes")
        compared = row.get("compared", True)
        rows.append([labels.get(str(precision), str(precision)),
                     fmt_cosine(row.get("cosine")) if compared else "not compared",
                     fmt_ratio(row.get("task_metric", row.get("top1"))) if compared else "not compared",
                     fmt_number(timing.get("median_ms"), ".3f"),
                     f"{fmt_number(timing.get('p25_ms'), '.3f')} - {fmt_number(timing.get('p75_ms'), '.3f')}",
                     fmt_speedup(speedup) if speedup else ("1.00x" if precision == kinds.REFERENCE else "n/a"),
                     f"{size / 1024:.1f}" if is_number(size) else "n/a"])
    title = "Latency and size" if len(rows) == 1 else "Side by side on the same backend"
    headers = ["build", "cosine", "top-1" if metric in (None, "top1") else str(metric), "median latency ms",
               "round medians p25 - p75 ms", "speed-up vs fp32", "artifact KiB"]
    first = as_dict(next(iter(comparison.values()), None)).get("latency") or {}
    how = (f"latency: one sample, {first.get('runs_per_round', '?')} runs a round, {first.get('rounds', '?')} "
           "rounds with every build timed in turn (order rotated); median of round medians. Speed-up: median of "
           f"the per-round ratios, in brackets {_bracket(comparison)}; a build counts as faster only when "
           "its rounds' p25 is above 1.00x (three rounds in four).")
    if not all(as_dict(row).get("compared", True) for row in comparison.values()):
        how += (" Not compared: a baseline only timed and run on one sample per input shape for its memory "
                "(validation.baselines=timed, precision=auto's default: fp32 is verified only when it could ship).")
    return [Heading(3, title), Table(headers, rows), Para(how)]


def _bracket(comparison: dict) -> str:
    """What the brackets beside a speed-up hold, in the words of the report's own figures."""
    found = next((as_dict(row).get("speedup") for row in comparison.values() if as_dict(row).get("speedup")), {})
    if "level" in found:
        return (f"where one more round's ratio falls, {100 * found['level']:.0f} % sure (a prediction interval: a "
                "timing of the same builds of your own lands inside it about as often)")
    return how_sure(found) if found else "the rounds' spread"


def fmt_speedup(speedup: dict) -> str:
    low, high = interval_keys(speedup)
    text = (f"{fmt_number(speedup.get('speedup'), '.2f')}x ({fmt_number(speedup.get(low), '.2f')} - "
            f"{fmt_number(speedup.get(high), '.2f')})")
    return text if speedup.get("faster") else f"{text} not faster"


def auto_section(section: dict) -> list:
    """precision=auto: every candidate, what it reached, and why the shipped one won."""
    rows = []
    for row in [r for r in as_list(section.get("candidates")) if isinstance(r, dict)]:
        up = as_dict(row.get("speedup"))
        speedup = fmt_speedup(up) if up else ("1.00x (reference)" if row.get("latency") else "-")
        metric = (f"{row.get('metric')} {fmt_number(row.get('metric_value'), '.4f')}"
                  if row.get("metric_value") is not None else "-")
        shipped = " (shipped)" if row.get("precision") == section.get("chosen") else ""
        rows.append([str(row.get("precision")), fmt_cosine(row.get("cosine")), metric, speedup,
                     fmt_number((row.get("bytes") or 0) / 1e6, ".2f") + " MB" if row.get("bytes") else "-",
                     candidate_peak(row, [r for r in as_list(section.get("candidates")) if isinstance(r, dict)]),
                     fmt_number(row.get("seconds"), ".1f") if row.get("seconds") is not None else "-",
                     f"{row.get('verdict')}{shipped}", "; ".join(map(str, as_list(row.get("reasons"))))[:200]])
    charts = [(str(r.get("precision")), as_dict(r.get("speedup")).get("speedup", 1.0 if r.get("latency") else None))
              for r in as_list(section.get("candidates")) if isinstance(r, dict)]
    charts = [(name, value) for name, value in charts if value is not None]
    budget = as_dict(section.get("budget"))
    allowed = (f"of precision.budget_s {fmt_number(budget.get('seconds'), '.0f')} s" if budget.get("seconds")
               is not None else "(no precision.budget_s)")
    spent = (f" The candidates took {fmt_number(budget.get('elapsed_s'), '.1f')} s {allowed}"
             + (f"; cut: {', '.join(budget['cut'])}" if budget.get("cut") else "") + "." if budget else "")
    blocks = [Heading(2, "precision=auto"), Para(f"Shipped {section.get('why')}.{spent}"),
              Table(["precision", "cosine", "task metric", "speed-up vs fp32", "size", "peak memory", "seconds",
                     "verdict", "reasons"], rows)]
    if charts:
        blocks.append(Charts([bar_chart([n for n, _ in charts], [v for _, v in charts],
                                            title="speed-up over fp32 (interleaved rounds)", x_label="x fp32",
                                            value_format=lambda v: f"{v:.2f}x")]))
    return blocks


def _count_with_reference(count: Any, reference: Any) -> str:
    text = fmt_value(count)
    if is_number(reference) and reference:
        text += f" (reference: {reference})"
    return text


OUTPUT_COLUMNS = (("output", "name", fmt_value), ("result", "passed", fmt_pass))
METRIC_COLUMNS = (("cosine", "cosine", fmt_cosine), ("min sample cosine", "min_sample_cosine", fmt_cosine),
                  ("max abs", "max_abs", fmt_error), ("mean abs", "mean_abs", fmt_error),
                  ("rel L2", "rel_l2", fmt_error), ("SQNR dB", "sqnr_db", fmt_sqnr),
                  ("exact agreement", "agreement", fmt_ratio))  # integer and boolean outputs only


def _output_metrics_table(outputs: list) -> Table:
    headers = [*column_headers(OUTPUT_COLUMNS), *column_headers(METRIC_COLUMNS), "NaN", "Inf", "failed checks"]
    rows, classes = [], []
    for out in outputs:
        m = as_dict(out.get("metrics"))
        failures = [str(f) for f in as_list(out.get("failures"))]
        rows.append([*fmt_cells(out, OUTPUT_COLUMNS), *fmt_cells(m, METRIC_COLUMNS),
                     _count_with_reference(m.get("nan"), m.get("reference_nan")),
                     _count_with_reference(m.get("inf"), m.get("reference_inf")),
                     "; ".join(failures) if failures else "none"])
        classes.append("row-fail" if out.get("passed") is False else "")
    return Table(headers, rows, classes)


THRESHOLD_LABELS = {
    "min_cosine": "min cosine",
    "max_abs_error": "max abs error",
    "max_mean_abs_error": "max mean abs error",
    "min_sqnr_db": "min SQNR dB",
    "min_agreement": "min exact agreement",
}


def _fmt_threshold(key: str, value: Any) -> str:
    if value is None:
        return "not checked"
    if "cosine" in key:
        return fmt_cosine(value)
    if "sqnr" in key:
        return fmt_number(value, ".1f")
    return fmt_error(value)


def _threshold_cell(out: dict, key: str, value: Any) -> str:
    """A threshold as it applied: an integer output is judged by exact agreement alone (1
    unless set), and the task output's cosine is a floor when a task metric gates."""
    exact = as_dict(out.get("metrics")).get("exact")
    if key == "min_agreement":
        return _fmt_threshold(key, 1.0 if value is None else value) if exact else "not checked"
    if exact:
        return "not checked (exact)"
    text = _fmt_threshold(key, value)
    return f"{text} (task floor)" if key == "min_cosine" and out.get("cosine_gate") == "task_min_cosine" else text


def _thresholds_blocks(outputs: list) -> list:
    keys: List[str] = []
    for out in outputs:
        for key in as_dict(out.get("thresholds")):
            if key not in keys:
                keys.append(key)
    if not keys:
        return []
    headers = ["output"] + [THRESHOLD_LABELS.get(k, k.replace("_", " ")) for k in keys]
    rows = []
    for out in outputs:
        thresholds = as_dict(out.get("thresholds"))
        rows.append([fmt_value(out.get("name"))] + [_threshold_cell(out, k, thresholds.get(k)) for k in keys])
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
    candidates = [(v, i) for i, v in enumerate(values) if finite(v)]
    if not candidates:
        return NA
    value, index = pick(candidates, key=lambda pair: pair[0])
    return f"{fmt(value)} (sample {index})"


def _per_sample_blocks(outputs: list) -> list:
    rows, charts = [], []
    for out in outputs:
        per_sample = as_dict(out.get("per_sample"))
        cosines = as_list(per_sample.get("cosine"))
        max_abs = as_list(per_sample.get("max_abs"))
        if not cosines and not max_abs:
            continue
        name = fmt_value(out.get("name"))
        non_finite = sum(1 for v in cosines + max_abs if not finite(v))
        rows.append([
            name,
            str(max(len(cosines), len(max_abs))),
            _worst(cosines, min, fmt_cosine),
            _worst(max_abs, max, fmt_error),
            str(non_finite),
        ])
        thresholds = as_dict(out.get("thresholds"))
        if cosines:
            charts.append(line_chart(
                cosines, title=f"{name}: per-sample cosine", x_label="sample index",
                y_label="cosine", value_format=fmt_cosine,
                threshold=thresholds.get("min_cosine"), threshold_label="min cosine"))
        if max_abs:
            charts.append(line_chart(
                max_abs, title=f"{name}: per-sample max abs error", x_label="sample index",
                y_label="max abs error", value_format=fmt_error, include_zero=True,
                threshold=thresholds.get("max_abs_error"), threshold_label="max abs error",
                color="#bc4c00"))
    if not rows:
        return []
    headers = ["output", "samples", "worst cosine", "worst max abs", "non-finite values"]
    return [Heading(3, "Per-sample errors"), Table(headers, rows), Charts(charts)]


TASK_COLUMNS = (("metric", "metric", fmt_value), ("output", "output", fmt_value),
                ("reference", "reference", fmt_ratio), ("target", "target", fmt_ratio), ("drop", "drop", fmt_ratio),
                ("drop 95 % interval", "interval", fmt_interval), ("max drop", "max_drop", fmt_ratio),
                ("agreement", "agreement", fmt_ratio), ("agreement 95 % interval", "agreement_interval", fmt_interval),
                ("result", "passed", fmt_pass))


def _task_blocks(task: dict) -> list:
    row_class = "row-fail" if task.get("passed") is False else ""
    notes = [f"{key}: reference {fmt_ratio(as_dict(v).get('reference'))}, target {fmt_ratio(as_dict(v).get('target'))}"
             for key, v in as_dict(task.get("extras")).items()]
    if task.get("judged_as"):  # a metric that needs labels on a split without them (top1: agreement)
        what = (", so reference and target are the share of samples whose class is the reference's (ties within "
                "float noise agree), not accuracy" if task.get("metric") == "top1" else "")
        notes.insert(0, f"{task['judged_as']}: the validation split has no labels (labels.csv){what}")
    if task.get("float_noise"):
        notes.append(f"passes as {task['float_noise']}")
    if task.get("uncertain"):
        needed = task.get("samples_to_resolve")
        notes.append(f"uncertain: the drop passes but {uncertainty(task)} reaches past the allowed "
                     f"{fmt_ratio(task.get('max_drop'))}"
                     + (f"; about {needed} validation samples would resolve it" if needed else "")
                     + (" (a failure: validation.require_confidence)" if task.get("require_confidence") else ""))
    table = Table(column_headers(TASK_COLUMNS), [fmt_cells(task, TASK_COLUMNS)], [row_class])
    return [Heading(3, "Task metric"), table] + ([Items(notes)] if notes else [])


def _device_precision_blocks(requested: dict, effective: dict) -> list:
    keys = list(requested) + [k for k in effective if k not in requested]
    # what verify accepts for the request (mixed with an empty qtable runs int8): not a mismatch
    accepted = {"precision": [str(p).lower() for p in as_list(requested.get("accepted_precisions"))]}
    rows, classes = [], []
    for key in keys:
        if key in requested and key in effective:
            same = str(effective[key]).lower() in (accepted.get(key) or [str(requested[key]).lower()])
            match = "yes" if same else "⚠ MISMATCH"
            if key == "precision" and not same and kinds.ran_partly(requested[key], effective[key]):
                match = "⚠ partly: some quantized ops ran in float (see the warnings)"
        else:
            same, match = True, "—"
        rows.append([key, fmt_value(requested.get(key)) if key in requested else "—",
                     fmt_value(effective.get(key)) if key in effective else "—", match])
        classes.append("" if same else "row-mismatch")
    return [Heading(3, "Requested vs effective"),
            Table(["setting", "requested", "effective", "match"], rows, classes)]


TENSOR_COLUMNS = (("tensor", "tensor", fmt_value), ("op", "op", fmt_value), ("op type", "op_type", fmt_value),
                  ("depth", "index", fmt_value), ("cosine", "cosine", fmt_cosine), ("max abs", "max_abs", fmt_error),
                  ("SQNR dB", "sqnr_db", fmt_sqnr), ("NaN", "nan", fmt_value), ("Inf", "inf", fmt_value),
                  ("result", "passed", fmt_pass))


def layerwise_section(layerwise: dict) -> list:
    """Every intermediate tensor of the target against the reference, in network order."""
    blocks: list = [Heading(2, "Layerwise comparison")]
    threshold = layerwise.get("threshold")
    if layerwise.get("ran") is False:
        why = layerwise.get("reason") or "not run"
        return blocks + [Para(f"not run ({fmt_value(layerwise.get('mode'))} mode): {why}", css="muted")]
    blocks.append(KeyValues(_layerwise_pairs(layerwise)))

    divergence = layerwise.get("first_divergence")
    depth = [d for d in as_list(layerwise.get("depth")) if isinstance(d, dict)]
    if depth:
        blocks.append(Charts([_depth_chart(depth, divergence, threshold)]))

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

    worst = [w for w in as_list(layerwise.get("worst")) if isinstance(w, dict)][:FIRST_NAMES]
    if worst:
        rows = [fmt_cells(w, TENSOR_COLUMNS) for w in worst]
        classes = ["row-fail" if w.get("passed") is False else "" for w in worst]
        blocks += [Heading(3, f"Worst {len(worst)} tensors"), Table(column_headers(TENSOR_COLUMNS), rows, classes)]

    return blocks


def _layerwise_pairs(layerwise: dict) -> list:
    pairs = [("mode", fmt_value(layerwise.get("mode")))]
    for key, label, fmt in (("reason", "why", fmt_value), ("samples", "samples", fmt_value),
                            ("seconds", "seconds", fmt_seconds), ("compared", "tensors compared", fmt_value),
                            ("threshold", "per-tensor min cosine", fmt_cosine)):
        if layerwise.get(key) is not None:
            pairs.append((label, fmt(layerwise[key])))
    for key, label in (("not_exposed", "not exposed by the backend"),
                       ("unmappable", "backend tensors without an ONNX name")):
        if layerwise.get(key) is not None:
            pairs.append((label, first_names(layerwise[key])))
    if layerwise.get("side_file"):
        pairs.append(("every tensor", fmt_value(layerwise["side_file"])))
    return pairs


def _depth_chart(depth: list, divergence: Any, threshold: Any) -> LineChart:
    """Per-tensor cosine against the topological index, the first divergence marked."""
    xs = [d.get("index") if finite(d.get("index")) else i for i, d in enumerate(depth)]
    labels = [f"{d.get('tensor')} ({d.get('op')}): cosine {fmt_cosine(d.get('cosine'))}" for d in depth]
    mark = None
    if isinstance(divergence, dict):
        hit = next((x for x, d in zip(xs, depth) if d.get("tensor") == divergence.get("tensor")), None)
        if hit is not None:
            mark = (hit, f"first divergence: {divergence.get('op')}")
    return line_chart(
        [d.get("cosine") for d in depth], x_values=xs, title="per-tensor cosine along the network",
        x_label="topological index", y_label="cosine", value_format=fmt_cosine,
        threshold=threshold, threshold_label="threshold", flag_below=True, point_labels=labels,
        mark_x=mark, width=900)


def _divergence_blocks(divergence: dict, threshold: Any) -> list:
    limit = divergence.get("threshold", threshold)
    pairs = [("tensor", fmt_value(divergence.get("tensor"))), ("op", fmt_value(divergence.get("op"))),
             ("op type", fmt_value(divergence.get("op_type"))),
             ("cosine", fmt_cosine(divergence.get("cosine")) +
              (f" (threshold {fmt_cosine(limit)})" if limit is not None else "")),
             ("max abs", fmt_error(divergence.get("max_abs")))]
    attributes = as_dict(divergence.get("attributes"))
    if attributes:
        pairs.append(("attributes", ", ".join(f"{k}={fmt_attribute(v)}" for k, v in attributes.items())))
    region = [str(op) for op in as_list(divergence.get("region"))]
    if region:
        pairs.append(("region", " → ".join(region)))
    blocks: list = [Heading(3, "First divergence"), KeyValues(pairs)]
    inputs = [i for i in as_list(divergence.get("inputs")) if isinstance(i, dict)]
    if inputs:
        rows = [[fmt_value(i.get("tensor")), fmt_cosine(i.get("cosine"))] for i in inputs]
        classes = ["row-fail" if finite(i.get("cosine")) and finite(limit) and i["cosine"] < limit else ""
                   for i in inputs]
        blocks.append(Table(["input tensor", "cosine"], rows, classes))
    return blocks


def recommendations_section(recommendations: list) -> list:
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




def diagnosis_section(diagnosis: dict) -> list:
    """What a failing verdict's diagnosis ran within its budget, and what the budget cut."""
    if not diagnosis.get("ran"):
        return []
    steps = [s for s in as_list(diagnosis.get("steps")) if isinstance(s, dict)]
    blocks = [Heading(2, "Diagnosis"),
              Para(f"{fmt_value(diagnosis.get('seconds'))} s of a {fmt_value(diagnosis.get('budget_seconds'))} s "
                   f"budget (validation.diagnosis_budget times the check's own time); the check itself was "
                   f"{fmt_value(diagnosis.get('measurement'))}.")]
    if steps:
        blocks.append(Table(["step", "seconds"], [[fmt_value(s.get("step")), fmt_value(s.get("seconds"))]
                                                  for s in steps]))
    blocks += _screening_blocks(diagnosis)
    cut = [str(c) for c in as_list(diagnosis.get("cut"))]
    if cut:
        blocks += [Para("Cut by the budget:"), Items(cut)]
    return blocks


def _screening_blocks(diagnosis: dict) -> list:
    """The keep-in-float candidates as ranked: screened, predicted and measured side by side."""
    screened = [s for s in as_list(diagnosis.get("screened")) if isinstance(s, dict)]
    screening = diagnosis.get("screening") if isinstance(diagnosis.get("screening"), dict) else {}
    if not screened:
        return []
    where = "the target's runtime" if screening.get("on") == "target" else "the reference runtime"
    text = (f"Candidates screened on {where} and ranked by the cosine predicted on the target: the build's "
            f"measured {fmt_value(screening.get('build_cosine'))} plus each one's gain over the build screened "
            f"the same way ({fmt_value(screening.get('build_screened_cosine'))}).")
    if screening.get("predicts_target") is False:
        text += " The screening did not predict this target: " + "; ".join(map(str, as_list(screening.get("misses"))))
    rows = [[", ".join(map(str, as_list(s.get("keep_float")))), fmt_value(s.get("cosine")),
             fmt_value(s.get("predicted_cosine")), fmt_value(s.get("measured_cosine"))] for s in screened]
    return [Para(text), Table(["keep_float", "screened cosine", "predicted on the target", "measured on the target"],
                              rows)]
