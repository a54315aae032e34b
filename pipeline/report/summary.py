"""The job's summary on the console (what ``parity`` prints at the end of a run): rich
tables and lines drawn from the same report dict report.json, report.md and junit.xml are
written from."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from rich import box
from rich.markup import escape
from rich.table import Table

from pipeline.console import stdout_console
from pipeline.precision import kinds
from pipeline.verification import speed
from pipeline.verification.memory import candidate_peak, line as memory_line
from pipeline.verification.metrics import nonfinite_failure


def print_summary(records: list, report: dict, bundle: Optional[str], run_dir: Path) -> None:
    """The end of a job on the console: the stage table, the verify table and its lines,
    auto's candidates, warnings, the verdict and where everything is (``bundle``: the package
    stage's folder, None when it did not run)."""
    console = stdout_console()
    verify, profile = report.get("verify"), report.get("profile")
    stages = Table(title="stages", title_justify="left")
    for column in ("stage", "status", "seconds"):
        stages.add_column(column)
    for record in records:
        stages.add_row(record["stage"], record["status"], f"{record['seconds']:.2f}")
    console.print(stages)
    if verify:
        console.print(_verify_table(report, verify))
        if verify.get("crash"):
            for line in verify["crash"].get("stderr_tail", [])[-5:]:
                console.print(f"  [dim]{escape(line)}[/]")
        layers = verify.get("layerwise") or {}
        if layers.get("ran"):
            stopped = layers.get("stopped")
            console.print(f"layerwise: {layers['compared']} tensors compared on {layers['samples']} samples, "
                          f"{len(layers['not_exposed'])} not exposed by the target, {layers['seconds']:.1f} s"
                          + (f" (checkpoints, then {escape(' .. '.join(stopped['bracket']))}; "
                             "validation.layerwise=always compares every tensor)" if stopped else ""))
            for key, title in (("first_divergence", "first divergence"), ("nan_origin", "first NaN/Inf")):
                found = layers.get(key)
                if found:
                    console.print(f"  {title}: op {escape(found['op'])} ({escape(found['op_type'])}), "
                                  f"tensor {escape(found['tensor'])}")
        for advice in verify.get("recommendations", []):
            console.print(f"[cyan]recommendation:[/] {escape(advice['text'])}")
        _diagnosis_lines(console, verify.get("diagnosis") or {})
    if verify and (verify.get("speed") or {}).get("speedups"):
        console.print(_speed_line(verify))
    elif verify and (verify.get("speed") or {}).get("not_timed"):
        console.print(f"speed vs fp32: not timed: {escape(verify['speed']['not_timed'])}")
    if verify and ((verify.get("speed") or {}).get("stream") or {}).get("speedups") is not None:
        console.print(_stream_line(verify["speed"]["stream"]))
    if verify and verify.get("shapes"):
        console.print(_shape_line(verify))
    if verify and verify.get("memory"):
        console.print(escape(memory_line(verify["memory"], (verify.get("judged_with") or {}).get("max_memory_mb"))))
    if profile:
        console.print(_profile_line(profile))
    if report.get("auto"):
        console.print(_auto_table(report["auto"]))
        console.print(f"precision=auto shipped {escape(report['auto']['why'])}")
    for warning in report["warnings"]:
        console.print(f"[yellow]warning:[/] {escape(warning)}")
    colour = {"pass": "green", "fail": "red"}.get(report["verdict"], "yellow")
    console.print(f"verdict: [bold {colour}]{report['verdict'].upper()}[/] (exit {report['exit_code']})"
                  + _first_reasons(report))
    if bundle:
        console.print(f"bundle: {escape(bundle)}")
    console.print(f"run folder: {escape(str(run_dir))}")
    console.print(f"reports: {escape(', '.join(REPORT_FILES))} in the run folder")


def _auto_table(section: dict) -> Table:
    """precision=auto's candidates: what each reached, how fast, how big. Made to fit 100
    columns: no column rules, two spaces between columns, the task metric's name in the
    header (one metric for every candidate); the speed-up column never wraps, so
    "1.00x (reference)" stays whole, and "(shipped)" is one word of the verdict."""
    table = Table(title="precision=auto candidates", title_justify="left", box=box.SIMPLE_HEAD, show_edge=False,
                  pad_edge=False, padding=(0, 1, 0, 0))
    rows = section["candidates"]
    metrics = {row["metric"] for row in rows if row.get("metric_value") is not None}
    one_metric = next(iter(metrics)) if len(metrics) == 1 else None
    timed = any(row.get("speedup") or row.get("latency") for row in rows)
    for column in ("precision", "cosine", one_metric or "task metric"):
        table.add_column(escape(column))
    table.add_column("speed-up vs fp32", no_wrap=True)
    for column in ("size", "peak memory", "seconds", "verdict"):
        table.add_column(column)
    for row in rows:
        up = row.get("speedup")
        # fp32 is every speed-up's reference, a screening's too (fp32 then timed beside the candidate only)
        speedup = (speed.speedup_text(up) if up
                   else "1.00x (reference)" if row["precision"] == kinds.REFERENCE and timed else "-")
        metric = "-" if row.get("metric_value") is None else f"{row['metric_value']:.4f}" if one_metric else \
            f"{row['metric']} {row['metric_value']:.4f}"
        verdict = row["verdict"] + (f" (exit {row['exit_code']})" if row.get("exit_code") else "") + (
            " (shipped)" if row["precision"] == section["chosen"] else "") + (
            " (reference only)" if row["precision"] in section.get("reference_only", []) else "") + (
            f" (no faster than {row['outrun_by']})" if row.get("outrun_by") else "")
        size = f"{row['bytes'] / 1e6:.2f} MB" if row.get("bytes") else "-"
        seconds = f"{row['seconds']:.1f}" if row.get("seconds") is not None else "-"
        table.add_row(row["precision"], f"{row['cosine']:.6f}" if row.get("cosine") is not None else "-",
                      escape(metric), speedup, size, escape(candidate_peak(row, rows)), seconds, escape(verdict))
    return table


def _diagnosis_lines(console, diagnosis: dict) -> None:
    """What the failing verdict's diagnosis spent of its budget, and what the budget cut."""
    if not diagnosis.get("ran"):
        return
    console.print(f"diagnosis: {diagnosis['seconds']:.1f} s of a {diagnosis['budget_seconds']:.1f} s budget "
                  f"(validation.diagnosis_budget); the check itself was {diagnosis['measurement']}")
    for entry in diagnosis.get("screened") or []:
        if entry.get("measured_cosine") is not None:
            console.print(escape(f"  keep_float=[{','.join(entry['keep_float'])}]: predicted cosine "
                                 f"{entry['predicted_cosine']:.6f}, measured {entry['measured_cosine']:.6f} on the target"))
    for miss in (diagnosis.get("screening") or {}).get("misses") or []:
        console.print(f"  [yellow]the screening did not predict this target: {escape(miss)}[/]")
    for cut in diagnosis.get("cut") or []:
        console.print(f"  [dim]cut by the budget: {escape(cut)}[/]")


def _speed_line(verify: dict) -> str:
    """Each build's speed-up over fp32 on this backend, timed interleaved (pipeline.verification.speed)."""
    parts = []
    for name, found in verify["speed"]["speedups"].items():
        mark = "" if found["faster"] else " [yellow](not faster)[/]"
        parts.append(f"{escape(name)} {speed.speedup_text(found)}{mark}")
    rounds = (verify["comparison"].get(kinds.REFERENCE) or {}).get("latency") or {}
    processes = f", {rounds['processes']} processes a build" if rounds.get("processes", 1) > 1 else ""
    sure = next((f"; {speed.how_sure(found)}" for found in verify["speed"]["speedups"].values()), "")
    return f"speed vs fp32 ({rounds.get('rounds', '?')} interleaved rounds{processes}{sure}): " + ", ".join(parts)


def _stream_line(stream: dict) -> str:
    """Speed as served: the validation samples in order, each at its own shape."""
    parts = [f"{escape(name)} {speed.speedup_text(found)}"
             + ("" if found["faster"] else " [yellow](not faster)[/]") for name, found in stream["speedups"].items()]
    return (f"speed as served ({stream['samples']} samples in order, {stream['shapes']} shapes, "
            f"{stream['rounds']} interleaved rounds): " + (", ".join(parts) or "not measured"))


def _shape_line(verify: dict) -> str:
    """A dynamic model: how many shapes ran, the lowest cosine of any, and the latency curve."""
    groups = verify["shapes"]
    worst = min((o["cosine"] for g in groups for o in g["outputs"].values() if o.get("cosine") is not None),
                default=None)
    line = f"shapes: {len(groups)} input shapes verified" + (f", lowest cosine {worst:.6f}" if worst is not None else "")
    curve = (verify.get("speed") or {}).get("by_shape") or {}
    shipped = verify["requested"]["precision"]
    times = [f"{which} {found['shape']} {found['median_ms'].get(shipped):.3f} ms" for which, found in curve.items()
             if found["median_ms"].get(shipped) is not None]
    return line + ("; latency " + ", ".join(times) if times else "")


SHOWN_REASONS = 2  # on the verdict line; report.json, report.md and junit.xml carry every reason


def _first_reasons(report: dict) -> str:
    """": first; second (+N more in report.md)" after a failing verdict, in pipeline/verification/verdict.py's order."""
    reasons = report["reasons"] if report["verdict"] != "pass" else []
    if not reasons:
        return ""
    more = len(reasons) - SHOWN_REASONS
    return ": " + escape("; ".join(reasons[:SHOWN_REASONS]) + (f" (+{more} more in report.md)" if more > 0 else ""))


def _profile_line(profile: dict) -> str:
    if not profile.get("ran"):
        return f"profile: not profiled ({escape(str(profile.get('reason')))})"
    line = (f"profile: {profile['layers']} layers ({profile['mapped']} with an ONNX node), "
            f"{profile['total_ms']:.4f} ms per run in all")
    top = profile["top"][0] if profile["top"] else None
    if top:
        line += (f"; slowest: {escape(str(top['onnx_node'] or top['name']))} ({escape(str(top['onnx_op_type'] or top['type']))}) "
                 f"{top['share'] * 100:.0f}%")
    return line


REPORT_FILES = ("report.json", "report.md", "report.html", "junit.xml")


def _task_cells(task: dict) -> tuple:
    """(check, value with its interval, threshold) of the task metric's drop."""
    scale, unit = (100, " pts") if task["metric"] == "top1" else (1, "")
    check = "top-1 drop" if task["metric"] == "top1" else f"{escape(task['metric'])} drop"
    value, notes = f"{task['drop'] * scale:.4g}{unit}", []
    if task.get("interval"):
        low, high = (bound * scale for bound in task["interval"])
        notes.append(f"{task['confidence'] * 100:.0f} % CI {low:.4g} to {high:.4g}")
    counts = task.get("disagreement")
    if counts:  # the bound from the disagreement count's exact interval (pipeline/verification/confidence.py)
        notes.append(f"{counts['count']}/{counts['samples']} disagree: up to {counts['drop_high'] * scale:.3g}{unit}")
    value += f" ({'; '.join(notes)})" if notes else ""
    return check, value, f"<= {task['max_drop'] * scale:.4g}{unit}"


def _verify_table(report: dict, verify: dict) -> Table:
    """Target, precision, each metric against its threshold, and the result."""
    table = Table(title=f"verify: {report['target']['name']} {report['precision']} vs ONNX Runtime fp32 "
                        f"({verify['samples']} samples)", title_justify="left")
    for column in ("target", "precision", "output", "check", "value", "threshold"):
        table.add_column(column, overflow="fold")
    table.add_column("result", no_wrap=True)
    target, precision = report["target"]["name"], report["precision"]

    def row(output, check, value, threshold, passed):
        result = {True: "[green]pass[/]", False: "[red]fail[/]", None: "[yellow]pass, uncertain[/]"}[passed]
        table.add_row(escape(target), precision, escape(output), check, value, threshold, result)

    for output in verify["outputs"]:
        m, limits, failed = output["metrics"], output["thresholds"], " ".join(output["failures"])
        if m.get("exact"):  # an integer or boolean output: compared exactly
            agreement = "n/a" if m["agreement"] is None else f"{m['agreement']:.4f} ({m['changed']} values changed)"
            row(output["name"], "exact match", agreement, f">= {limits.get('min_agreement') or 1.0}", not failed)
            continue
        gate = f">= {limits['min_cosine']}" if limits["min_cosine"] is not None else "not gated"
        if output.get("cosine_gate") == "task_min_cosine":
            gate += " (floor: the task metric gates)"
        row(output["name"], "cosine", f"{m['cosine']:.6f}", gate, "cosine" not in failed)
        if limits.get("max_abs_error") is not None:
            row(output["name"], "max abs", f"{m['max_abs']:.3g}", f"<= {limits['max_abs_error']}",
                "max abs" not in failed)
        if limits.get("max_mean_abs_error") is not None:
            row(output["name"], "mean abs", f"{m['mean_abs'] or 0:.3g}", f"<= {limits['max_mean_abs_error']}",
                "mean abs" not in failed)
        sqnr = "inf" if m["sqnr_db"] is None else f"{m['sqnr_db']:.1f} dB"
        if limits.get("min_sqnr_db") is not None:
            row(output["name"], "SQNR", sqnr, f">= {limits['min_sqnr_db']} dB", "SQNR" not in failed)
        shared = (m.get("reference_nan") or 0, m.get("reference_inf") or 0)
        row(output["name"], "NaN/Inf", f"{m['nan']}/{m['inf']}", "0/0" if shared == (0, 0) else
            f"the reference's ({shared[0]}/{shared[1]})", not nonfinite_failure(m))
    task = verify.get("task")
    if task:
        passed = task["passed"] and not (task.get("uncertain") and task.get("require_confidence"))
        passed = None if passed and task.get("uncertain") else passed
        row(task["output"], *_task_cells(task), passed)
        agreement = f", agreement {task['agreement']:.4f}" if task.get("agreement") is not None else ""
        table.caption = (f"{'top-1' if task['metric'] == 'top1' else escape(task['metric'])}: reference "
                         f"{task['reference']:.4f}, target {task['target']:.4f}{agreement}"
                         + (f"; passes as {escape(task['float_noise'])}" if task.get("float_noise") else ""))
    if verify.get("crash"):
        row("-", "backend", verify["crash"]["kind"], "runs to the end", False)
        return table
    requested, effective = verify["requested"], verify.get("effective") or {}
    for key in ("device", "precision"):
        ran = str(effective.get(key, "n/a"))
        detail = f"{ran} (layers: {effective['layers']})" if key == "precision" and effective.get("layers") else ran
        row("-", f"{key} ran", escape(detail), requested[key],
            not any(reason.startswith(f"requested {key}") for reason in verify["reasons"]))
    return table
