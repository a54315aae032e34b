"""The report's later parts as blocks: profile, stages, model and conversion, pre-flight
findings, calibration, sensitivity search, data, build, tuning and environment.

Like sections_verify.py: each ``*_section`` function turns one part of the report dict
into blocks (pipeline/report/document.py) and never raises on a missing or odd value.
"""

from __future__ import annotations

from typing import Any

from pipeline.report.charts import CACHED_COLOR, COMPUTED_COLOR, bar_chart, line_chart
from pipeline.report.document import Charts, Heading, Items, KeyValues, Para, Pre, Table
from pipeline.report.formatting import (STDERR_LINES, STDERR_WIDTH, as_dict, as_list, finite, first_names,
                                        fmt_cosine, fmt_device, fmt_error, fmt_from_to, fmt_ms, fmt_number,
                                        fmt_ratio, fmt_seconds, fmt_share, fmt_shape, fmt_sqnr, fmt_value,
                                        fmt_yes_no, is_number, short_hash, truncate)


def _first_tries(sensitivity: dict) -> list:
    """Heads first (and with the stems), then the inputs given back: a line each."""
    blocks: list = []
    for key, what in (("heads_first", "the output heads"), ("heads_and_stems", "the output heads and input stems")):
        tried = as_dict(sensitivity.get(key))
        if tried:
            blocks.append(Para(f"{what} in float ({len(as_list(tried.get('float_ops')))} ops, "
                               f"sensitivity.heads_first): cosine {fmt_cosine(tried.get('cosine'))}, "
                               + ("the target met: no per-layer ranking" if tried.get("met")
                                  else "the target not met: the next try follows")))
    given = [t for t in as_list(sensitivity.get("inputs_given_back")) if isinstance(t, dict)]
    if given:
        blocks.append(Para("float ops reading their inputs quantized, as int8 gives them: " + "; ".join(
            f"{t.get('op')} {'kept' if t.get('kept') else 'not kept'} (cosine {fmt_cosine(t.get('cosine'))}"
            f"{'' if t.get('metric_drop') is None else ', task drop ' + fmt_value(t.get('metric_drop'))})"
            for t in given)))
    return blocks


def sensitivity_section(sensitivity: dict) -> list:
    blocks: list = [Heading(2, "Sensitivity search (ops kept in float)")]
    if sensitivity.get("skipped") and not sensitivity.get("int8"):
        return blocks + [Para(str(sensitivity["skipped"]))]
    int8, mixed = as_dict(sensitivity.get("int8")), as_dict(sensitivity.get("mixed"))
    pairs = [("selection", fmt_value(sensitivity.get("select"))),
             ("target cosine", fmt_value(sensitivity.get("expected_cos"))),
             ("samples", fmt_value(sensitivity.get("samples"))),
             ("plain int8 cosine", fmt_cosine(int8.get("cosine")))]
    if sensitivity.get("skipped"):
        return blocks + [KeyValues(pairs), Para(str(sensitivity["skipped"]))]
    pairs += [("mixed cosine", fmt_cosine(mixed.get("cosine"))),
              ("ops kept in float", ", ".join(map(str, as_list(sensitivity.get("float_ops")))) or "none"),
              ("trials measured in full", f"{sensitivity.get('measured')} of {sensitivity.get('trials')}")]
    blocks.append(KeyValues(pairs))
    blocks += _first_tries(sensitivity)
    ranking = [r for r in as_list(sensitivity.get("ranking")) if isinstance(r, dict)][:10]
    if ranking:
        blocks += [Heading(3, "Most sensitive ops"),
                   Table(["op", "type", "best method", "loss (1 - cos)", "SQNR dB"],
                         [[str(r.get("op")), str(r.get("op_type")), str(r.get("method")),
                           fmt_error(r.get("loss")), fmt_sqnr(r.get("sqnr_db"))] for r in ranking]),
                   Charts([bar_chart([str(r.get("op")) for r in ranking], [r.get("loss") for r in ranking],
                                         title="loss when only this op is int8", x_label="1 - cosine",
                                         value_format=fmt_error)])]
    details = [d for d in as_list(sensitivity.get("float_op_details")) if isinstance(d, dict)]
    if details:
        latency = as_dict(sensitivity.get("latency"))
        priced = any("conversions_ms" in d for d in details)  # the runtime's conversions priced
        about = (f"cost: ms given back when the op stays float ({latency.get('measured_by')}; fp32 "
                 f"{fmt_number(latency.get('fp32_ms'), '.2f')} ms, int8 {fmt_number(latency.get('int8_ms'), '.2f')} "
                 "ms a run); gain: cosine lost when the prune put it back to int8"
                 + ("; conversions: ms of int8/float conversions its staying float costs in this set, negative "
                    f"where it saves them ({latency.get('conversions')})" if priced else ""))
        blocks += [Heading(3, "Ops kept in float"),
                   Table(["op", "loss alone (1 - cos)", "gain (cosine)", "cost ms",
                          *(["conversions ms"] if priced else [])],
                         [[str(d.get("op")), fmt_error(d.get("loss")), fmt_error(d.get("gain")),
                           fmt_number(d.get("cost_ms"), '.3f'),
                           *([fmt_number(d.get("conversions_ms"), '.3f')] if priced else [])] for d in details]),
                   Para(about if latency.get("measured_by") else str(latency.get("skipped") or latency.get("error")
                                                                      or "no latency costs"))]
    curve = [p for p in as_list(sensitivity.get("curve")) if isinstance(p, dict)]
    if curve:
        blocks += [Heading(3, "Selection"),
                   Table(["step", "float ops", "cosine", "task metric drop", "est. cost ms"],
                         [[_curve_step(p), fmt_value(p.get("float_ops")),
                           fmt_cosine(p.get("cosine", p.get("without_cosine"))),
                           fmt_ratio(p.get("metric_drop", p.get("without_metric_drop", p.get("top1_drop")))),
                           fmt_number(p.get("cost_ms"), '.3f')]
                          for p in curve]),
                   Charts([line_chart([p.get("cosine") for p in curve if not p.get("kept")],
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


def calibration_section(calibration: dict) -> list:
    blocks: list = [Heading(2, "Calibration")]
    if calibration.get("skipped"):
        return blocks + [Para(str(calibration["skipped"]))]
    pairs = [(key.replace("_", " "), fmt_value(calibration.get(key)))
             for key in ("method", "tensors", "samples", "batch_size", "statistics", "statistics_seconds",
                         "thresholds_seconds", "source") if calibration.get(key) is not None]
    blocks.append(KeyValues(pairs))
    chosen = as_dict(calibration.get("methods_chosen"))
    if chosen:
        blocks.append(Table(["method", "tensors"], [[str(k), str(v)] for k, v in chosen.items()]))
    zero = [str(z) for z in as_list(calibration.get("zero_tensors"))]
    if zero:
        blocks += [Heading(3, "Always-zero tensors (threshold floor)"), Items(zero[:20])]
    warnings = [str(w) for w in as_list(calibration.get("warnings"))]
    if warnings:
        blocks += [Heading(3, "Calibration warnings"), Items(warnings)]
    return blocks


def profile_section(profile: dict) -> list:
    """Per-layer time on the target's backend: top layers and time by op type."""
    blocks: list = [Heading(2, "Profile (time per layer)")]
    if not profile.get("ran"):
        blocks.append(Para(f"not profiled: {fmt_value(profile.get('reason'))}", css="muted"))
        tail = [str(line) for line in as_list(as_dict(profile.get("crash")).get("stderr_tail"))]
        return blocks + ([Pre([truncate(line, STDERR_WIDTH) for line in tail[-STDERR_LINES:]])] if tail else [])
    pairs = [("measured by", fmt_value(profile.get("measured_by"))), ("device", fmt_device(profile)),
             ("sample", fmt_value(profile.get("sample"))),
             ("runs", f"{fmt_value(profile.get('runs'))} after {fmt_value(profile.get('warmup'))} warm-up runs"),
             ("sum of layers", f"{fmt_ms(profile.get('total_ms'))} ms per run"),
             ("whole run", f"{fmt_ms(profile.get('run_ms'))} ms per run"),
             ("layers with an ONNX node", f"{fmt_value(profile.get('mapped'))} of {fmt_value(profile.get('layers'))}")]
    unmapped = [str(name) for name in as_list(profile.get("unmapped"))]
    if unmapped:
        pairs.append(("inserted by the runtime (no ONNX node)", first_names(unmapped)))
    startup = as_dict(profile.get("startup"))
    if startup:
        pairs.append(("start-up (load + first inference)",
                      f"{fmt_number((startup.get('warm_s') or 0) * 1000, '.1f')} ms with the compile cache "
                      f"({fmt_value(startup.get('compile_cache'))}), "
                      f"{fmt_number((startup.get('cold_s') or 0) * 1000, '.1f')} ms compiling: "
                      f"{fmt_number(startup.get('speedup'), '.2f')}x"))
    blocks.append(KeyValues(pairs))
    if profile.get("note"):
        blocks.append(Para(str(profile["note"]), css="muted"))
    top = [row for row in as_list(profile.get("top")) if isinstance(row, dict)]
    if top:
        rows = [[fmt_value(r.get("onnx_node")) if r.get("onnx_node") else "—", ", ".join(map(str, as_list(
            r.get("onnx_nodes"))[1:])) or "—", fmt_value(r.get("onnx_op_type") or r.get("type")),
                 fmt_value(r.get("name")), fmt_value(r.get("kernel")), fmt_ms(r.get("ms")), fmt_ms(r.get("median_ms")),
                 fmt_share(r.get("share"))] for r in top]
        colors = [COMPUTED_COLOR if r.get("onnx_node") else CACHED_COLOR for r in top]
        blocks += [Heading(3, f"Top {len(top)} layers by time"),
                   Table(["ONNX node", "also computes", "op type", "runtime layer", "kernel", "mean ms", "median ms",
                          "share"], rows),
                   Charts([bar_chart([str(r.get("onnx_node") or r.get("name")) for r in top],
                                         [r.get("ms") for r in top], title="time per layer (mean per run)",
                                         x_label="ms", colors=colors, value_format=fmt_ms,
                                         legend=[(COMPUTED_COLOR, "ONNX node"), (CACHED_COLOR, "runtime only")])])]
    kinds = [k for k in as_list(profile.get("by_op_type")) if isinstance(k, dict)]
    if kinds:
        rows = [[fmt_value(k.get("op_type")) + (" (runtime only)" if k.get("runtime_only") else ""),
                 fmt_value(k.get("layers")), fmt_ms(k.get("ms")), fmt_share(k.get("share"))] for k in kinds]
        blocks += [Heading(3, "Time by op type"), Table(["op type", "layers", "ms", "share"], rows),
                   Charts([bar_chart([str(k.get("op_type")) for k in kinds], [k.get("ms") for k in kinds],
                                         title="time per op type (mean per run)", x_label="ms",
                                         colors=[CACHED_COLOR if k.get("runtime_only") else COMPUTED_COLOR
                                                 for k in kinds], value_format=fmt_ms)])]
    return blocks


def stages_section(stages: list) -> list:
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
    total = sum(s["seconds"] for s in stages if finite(s.get("seconds")))
    cached = sum(1 for s in stages if s.get("status") == "cached")
    blocks.append(Para(f"total: {fmt_seconds(total)} s over {len(stages)} stages ({cached} cached)"))
    colors = [CACHED_COLOR if s.get("status") == "cached" else COMPUTED_COLOR for s in stages]
    blocks.append(Charts([bar_chart(
        [fmt_value(s.get("stage")) for s in stages],
        [s.get("seconds") for s in stages],
        title="stage wall time", x_label="seconds", colors=colors,
        legend=[(COMPUTED_COLOR, "computed"), (CACHED_COLOR, "cached")])]))
    return blocks


def _io_rows(role: str, tensors: Any) -> list:
    return [[role, fmt_value(t.get("name")), fmt_shape(t.get("shape")), fmt_value(t.get("dtype"))]
            for t in as_list(tensors) if isinstance(t, dict)]


def model_section(model: dict, convert: dict) -> list:
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

    op_types = as_dict(convert.get("op_types"))
    if op_types:
        ranked = sorted(op_types.items(), key=lambda kv: (-kv[1] if is_number(kv[1]) else 0, str(kv[0])))
        blocks += [Heading(3, "Op types (top 10 by count)"),
                   Table(["op type", "count"], [[str(op), fmt_value(n)] for op, n in ranked[:10]])]
        if len(ranked) > 10:
            rest = sum(n for _, n in ranked[10:] if is_number(n))
            blocks.append(Para(f"+{len(ranked) - 10} more op types ({rest} nodes)", css="muted"))

    fixed = as_dict(convert.get("fixed_shapes"))
    if fixed:
        rows = [[str(name), fmt_shape(as_dict(s).get("from")), fmt_shape(as_dict(s).get("to"))]
                for name, s in fixed.items()]
        blocks += [Heading(3, "Fixed shapes"), Table(["tensor", "from", "to"], rows)]
    return blocks


SEVERITY_CLASSES = {"error": "row-fail", "warning": "row-mismatch"}


def preflight_section(findings: list) -> list:
    blocks: list = [Heading(2, "Pre-flight findings")]
    findings = [f for f in findings if isinstance(f, dict)]
    if not findings:
        return blocks + [Para("no findings")]
    rows = [[fmt_value(f.get("tensor")), fmt_value(f.get("check")), fmt_value(f.get("count")),
             fmt_value(f.get("detail")), fmt_value(f.get("severity"))] for f in findings]
    classes = [SEVERITY_CLASSES.get(str(f.get("severity")).lower(), "") for f in findings]
    return blocks + [Table(["tensor", "check", "count", "detail", "severity"], rows, classes)]


def _heading_and_value(title: str, part: dict, key: str) -> list:
    """A section's heading, then the part's value under ``key`` where it has one."""
    blocks: list = [Heading(2, title)]
    if key in part:
        blocks.append(KeyValues([(key, fmt_value(part.get(key)))]))
    return blocks


def data_section(data: dict) -> list:
    blocks = _heading_and_value("Data", data, "kind")
    warnings = [str(w) for w in as_list(data.get("warnings"))]
    if warnings:
        blocks.append(Items(warnings, css="warnings"))
    splits = as_dict(data.get("splits"))
    if splits:
        rows = []
        for name, split in splits.items():
            split = as_dict(split)
            rows.append([str(name), fmt_value(split.get("used", split.get("samples"))),
                         fmt_yes_no(split.get("labeled")), fmt_value(split.get("source"))])
        blocks.append(Table(["split", "samples", "labeled", "source"], rows))
    return blocks


def build_section(build: dict) -> list:
    blocks = _heading_and_value("Build", build, "backend")
    files = [str(f) for f in as_list(build.get("files"))]
    if files:
        blocks += [Heading(3, "Artifact files"), Items(files)]
    if "options" in build:
        options = as_dict(build.get("options"))
        blocks.append(Heading(3, "Runtime options"))
        if options:
            rows = [[str(k), fmt_value(v)] for k, v in options.items()]
            blocks.append(Table(["option", "value"], rows))
        else:
            blocks.append(Para("runtime defaults (no options set)"))
    masks = as_dict(as_dict(build.get("quantization")).get("feature_masks"))
    if masks:
        blocks += _feature_masks_blocks(masks)
    blocks += _compile_cache_blocks(as_dict(build.get("compile_cache")))
    return blocks


def _compile_cache_blocks(cache: dict) -> list:
    if not cache:
        return []
    key = as_dict(cache.get("key"))
    return [Heading(3, "Compile cache"),
            Para(f"{fmt_value(len(as_list(cache.get('files'))))} file(s), "
                 f"{fmt_number((cache.get('bytes') or 0) / 1024, '.1f')} KiB in {fmt_value(cache.get('folder'))}/, "
                 f"written in {fmt_seconds(cache.get('compile_seconds'))}; used where the runtime versions, device, "
                 f"machine fingerprint ({fmt_value(key.get('fingerprint'))}) and runtime options match.")]


def _fmt_changes(changes: Any) -> str:
    changes = as_dict(changes)
    return ", ".join(f"{k}={fmt_value(v)}" for k, v in changes.items()) or "build's settings"


def _trial_cost(trial: dict, unit: str = "") -> str:
    """A trial's median latency in ms, or its throughput per second."""
    measurement = as_dict(trial.get("measurement"))
    if "throughput" in measurement:
        return f"{fmt_number(measurement.get('throughput'), '.1f')}{unit and ' inferences/s'}"
    return f"{fmt_number(measurement.get('median_ms'), '.4f')}{unit and ' ms'}"


def tuning_section(tuning: dict) -> list:
    blocks: list = [Heading(2, "Tuning")]
    if not tuning.get("ran"):
        return blocks + [Para(fmt_value(tuning.get("reason")))]
    chosen, baseline = as_dict(tuning.get("chosen")), as_dict(tuning.get("baseline"))
    throughput = tuning.get("objective") == "throughput"
    pairs = [("level", fmt_value(tuning.get("level"))), ("objective", fmt_value(tuning.get("objective"))),
             ("measurements", "reused from the tuning cache" if tuning.get("reused") else "measured in this run"),
             ("chosen", _fmt_changes(chosen.get("changes"))),
             ("build's settings", _trial_cost(baseline, unit="yes")), ("tuned", _trial_cost(chosen, unit="yes")),
             ("speed-up", f"{fmt_number(tuning.get('speedup'), '.2f')}x"),
             ("re-verified", f"on {fmt_value(tuning.get('verify_samples'))} validation samples; "
                             f"{fmt_value(tuning.get('refused'))} setting(s) refused")]
    blocks.append(KeyValues(pairs))
    if tuning.get("note"):
        blocks.append(Para(fmt_value(tuning["note"])))
    trials = [t for t in as_list(tuning.get("trials")) if isinstance(t, dict)]
    unit = "inferences/s" if throughput else "median ms"
    rows, classes = [], []
    for trial in trials:
        measurement = as_dict(trial.get("measurement"))
        spread = (f"{fmt_number(measurement.get('p25_ms'), '.4f')} - {fmt_number(measurement.get('p75_ms'), '.4f')}"
                  if "p25_ms" in measurement else "")
        verified = {True: "pass", False: "refused: " + "; ".join(map(str, as_list(trial.get("failures"))))}.get(
            trial.get("verified"), "")
        rows.append([_fmt_changes(trial.get("changes")), trial.get("error") and "error" or _trial_cost(trial), spread,
                     verified or (fmt_value(trial.get("error")) if trial.get("error") else "")])
        classes.append("fail" if trial.get("verified") is False or trial.get("error") else "")
    blocks += [Heading(3, "Candidates"), Table(["settings", unit, "interquartile ms", "re-verification"], rows, classes),
               Charts([bar_chart([_fmt_changes(t.get("changes")) for t in trials],
                                     [t.get("score_ms") for t in trials], title="time per inference by candidate",
                                     x_label="ms", value_format=lambda v: fmt_number(v, ".4f"))])]
    return blocks


def _feature_masks_blocks(masks: dict) -> list:
    """ncnn's per-layer feature masks (31=) found by the search: layer, mask, where it runs."""
    blocks: list = [Heading(3, "ncnn feature masks")]
    if not masks.get("searched"):
        return blocks + [Para(f"no search: {fmt_value(masks.get('reason'))}")]
    rows = [[fmt_value(m.get("layer")), fmt_value(m.get("onnx_op")), fmt_value(m.get("mask")), fmt_value(m.get("runs"))]
            for m in as_list(masks.get("masks")) if isinstance(m, dict)]
    verdict = "passes" if masks.get("passed") else "still fails"
    blocks.append(Para(f"{len(rows)} layer(s) masked after {fmt_value(len(as_list(masks.get('trials'))))} "
                       f"verified trial(s); the masked build {verdict} on the search samples."))
    if rows:
        blocks.append(Table(["ncnn layer", "ONNX op", "mask (31=)", "runs"], rows))
    return blocks


def environment_section(env: dict) -> list:
    blocks: list = [Heading(2, "Environment")]
    cpu = as_dict(env.get("cpu"))
    pairs = []
    if env.get("platform") is not None:
        pairs.append(("platform", fmt_value(env["platform"])))
    if cpu.get("model") is not None:
        pairs.append(("CPU", fmt_value(cpu["model"])))
    if pairs:
        blocks.append(KeyValues(pairs))
    versions = as_dict(env.get("versions"))
    if versions:
        rows = [[str(k), fmt_value(v)] for k, v in versions.items()]
        blocks.append(Table(["component", "version"], rows))
    flags = [str(f) for f in as_list(cpu.get("flags"))]
    if flags:
        blocks.append(Para(f"CPU flags ({len(flags)}): " + " ".join(flags), css="flags"))
    return blocks


