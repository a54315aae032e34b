"""Sweeps (Hydra multirun): each job leaves ``job.json`` in its folder; at the end of the
sweep the ``SweepSummary`` callback (conf/config.yaml, hydra.callbacks) collects every
job into ``sweep.json``, ``sweep.md``, ``sweep.html`` and one ``junit.xml`` in the sweep
folder, prints the matrix, and makes the sweep's exit code the worst of its jobs.

The callback runs in the process that launched the sweep, whatever the launcher (basic,
joblib, submitit), so it reads what the jobs wrote rather than their return values."""

from __future__ import annotations

import contextlib
import logging
import os
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

import yaml
from filelock import FileLock, Timeout
from hydra.experimental.callback import Callback
from omegaconf import DictConfig
from rich.markup import escape
from rich.table import Table as RichTable

from pipeline.backends import GPU_DEVICES  # every device name that runs on a GPU
from pipeline.artifacts import atomic_write_bytes, remove_stale_temps, write_json
from pipeline.console import stderr_console, stdout_console
from pipeline.errors import ExitCode, RunFolderBusy, worst_exit_code, writing
from pipeline.precision import kinds
from pipeline.report.junit import build_junit
from pipeline.report.document import Banner, Heading, Items, Para, Table
from pipeline.report.formatting import fmt_device
from pipeline.report.render import html_document, markdown_document
from pipeline.release.jobs import JOB_FILE, find_jobs, read_optional_json

LOCK_FILE = ".parity.lock"  # held by the run writing the folder
RUN_RESULTS = (JOB_FILE, "report.json", "report.md", "report.html", "junit.xml")  # what a finished run leaves
TIE = 0.05  # latencies within 5 % of the fastest are a tie on a shared machine
worst_exit_codes: List[int] = []  # the sweep's exit code, read by pipeline.app.cli.main


def write_job_record(run_dir: Path, exit_code: int, overrides: List[str], choices: Dict[str, str],
                     error: Optional[str] = None, bundles: Optional[Dict[str, str]] = None) -> None:
    """What a job leaves for the sweep summary, whether or not it got as far as a report;
    ``bundles``: {bundle name: sha256 of its manifest.json} of the bundles this run packaged."""
    record = {"exit_code": int(exit_code), "error": error, "overrides": list(overrides),
              "target": choices.get("target"), "precision": choices.get("precision"), "bundles": dict(bundles or {})}
    atomic_write_bytes(Path(run_dir) / JOB_FILE, lambda temp: write_json(temp, record))  # whole or absent
    if (Path(run_dir) / "report.json").is_file():  # this run reported: the earlier run's reports are history
        for name in RUN_RESULTS:
            stale_name(Path(run_dir) / name).unlink(missing_ok=True)


def packaged_bundles(outcome) -> Dict[str, str]:
    """{bundle name: sha256 of its manifest.json} of what this run's package stage wrote."""
    package = outcome.results.get("package") if outcome is not None else None
    if package is None:
        return {}
    return {Path(package.summary.bundle).name: package.summary.manifest_sha256}


def stale_name(path: Path) -> Path:
    """report.json -> report.stale.json: an earlier run's result, kept for reading only."""
    return path.with_name(f"{path.stem}.stale{path.suffix}")


@contextlib.contextmanager
def claim_run_folder(run_dir: Path) -> Iterator[None]:
    """Hold the run folder's lock for the run (a second run into the same folder is
    refused at once: RunFolderBusy, exit 2) and set the earlier run's results aside
    (report.json -> report.stale.json, ...), so that a run that fails or is killed never
    leaves an earlier run's report or job.json looking like its own."""
    run_dir = Path(run_dir)
    with writing(run_dir):
        run_dir.mkdir(parents=True, exist_ok=True)
        lock = FileLock(str(run_dir / LOCK_FILE))
        try:
            lock.acquire(timeout=0)
        except Timeout:
            raise RunFolderBusy(f"{run_dir} is being written by another parity run (it holds {LOCK_FILE}); "
                                f"wait for it to finish or choose another hydra.run.dir") from None
    try:
        with writing(run_dir):
            remove_stale_temps(run_dir / JOB_FILE)
            for name in RUN_RESULTS:
                if (run_dir / name).is_file():
                    os.replace(run_dir / name, stale_name(run_dir / name))
        yield
    finally:
        lock.release()


def job_folder(overrides, sweep_dir: str, number: int) -> str:
    """A job's folder name: its values of the swept keys, as Hydra's override_dirname
    writes them (``precision=int8,target=ort_cpu``). Overrides every job shares (a
    model.path, a data folder) stay out of the name, so that a path never nests the
    folder. The swept keys are read from the sweep's multirun.yaml, which Hydra writes
    before it launches a job; without it, or without a swept key, the job's number."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    try:
        sweep = yaml.safe_load((Path(sweep_dir) / "multirun.yaml").read_text())["hydra"]["overrides"]["task"]
        swept = {o.key_or_group for o in parser.parse_overrides(sweep) if o.is_sweep_override()}
    except (OSError, KeyError, TypeError, yaml.YAMLError):
        swept = set()
    mine = [o for o in parser.parse_overrides(list(overrides)) if o.key_or_group in swept]
    named = ",".join(sorted(f"{o.key_or_group}={o.value()}".replace(os.sep, "_") for o in mine))
    return named or str(number)


class QuietSacct(logging.Filter):
    """submitit polls ``sacct`` for the states of a SLURM sweep's jobs and logs every
    failure, three lines a poll. On a cluster without slurmdbd (accounting storage
    disabled) every poll fails, so parity says it once, in its own words."""

    NOTE = ("sacct fails on this cluster (without slurmdbd SLURM has no accounting storage; sacct's own "
            "'Slurm accounting storage is disabled' repeats at each poll): the sweep learns that a job finished "
            "from its result file instead, and submitit's sacct errors are not shown. A job that SLURM ends "
            "before it writes its result (scancel, say) keeps the sweep waiting: watch squeue")

    def __init__(self) -> None:
        super().__init__()
        self.said = False

    def filter(self, record: logging.LogRecord) -> bool:
        if "Bypassing sacct error" not in record.getMessage():
            return True
        if not self.said:
            self.said = True
            stderr_console().print(f"[yellow]warning:[/] {escape(self.NOTE)}", soft_wrap=True)
        return False


def quiet_sacct() -> None:
    """On submitit's logger, in the process that launches the sweep (the filter stays
    when submitit configures its logger on import)."""
    submitit_log = logging.getLogger("submitit")
    if not any(isinstance(found, QuietSacct) for found in submitit_log.filters):
        submitit_log.addFilter(QuietSacct())


class SweepSummary(Callback):
    def __init__(self) -> None:
        self.sweep_dir: Optional[Path] = None

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self.sweep_dir = Path(config.hydra.sweep.dir)
        quiet_sacct()

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        summary = summarize(self.sweep_dir or Path(config.hydra.sweep.dir))
        worst_exit_codes.append(summary["exit_code"])


def summarize(sweep_dir: Path) -> dict:
    """Collect the sweep's jobs, write the summary files and print the matrix."""
    jobs = [_job(folder, sweep_dir) for folder in find_jobs(sweep_dir)]
    summary = {"format": 1, "sweep_dir": str(sweep_dir), "jobs": jobs,
               "exit_code": worst_exit_code(job["exit_code"] for job in jobs),
               "matrix": _matrix(jobs), "recommendation": recommend(jobs), "shared_work": _shared_work(jobs)}
    write_json(sweep_dir / "sweep.json", summary)
    blocks = _document(summary)
    (sweep_dir / "sweep.md").write_text(markdown_document(blocks))
    (sweep_dir / "sweep.html").write_text(html_document("parity sweep", blocks))
    _write_junit(jobs, sweep_dir, sweep_dir / "junit.xml")
    _print(summary)
    return summary


def _job(folder: Path, sweep_dir: Path) -> dict:
    record = read_optional_json(folder / JOB_FILE)
    report = read_optional_json(folder / "report.json")
    hydra_overrides = folder / ".hydra" / "overrides.yaml"
    overrides = record.get("overrides") or (yaml.safe_load(hydra_overrides.read_text())
                                            if hydra_overrides.is_file() else None) or []
    pairs = dict(o.split("=", 1) for o in overrides if "=" in o)
    job = {"dir": folder.relative_to(sweep_dir).as_posix(), "overrides": pairs,
           "target": record.get("target") or pairs.get("target", "?"),
           "precision": record.get("precision") or pairs.get("precision", "?")}
    if not record:
        return {**job, "exit_code": int(ExitCode.INTERNAL), "verdict": "error",
                "reason": "the job left no job.json (killed or crashed before the end)"}
    job.update(exit_code=record["exit_code"], verdict="error", reason=record.get("error"))
    if report:
        job.update(_from_report(report, folder, sweep_dir))
    return job


def _from_report(report: dict, folder: Path, sweep_dir: Path) -> dict:
    verify = report.get("verify") or {}
    precision = report.get("precision")
    row = (verify.get("comparison") or {}).get(precision) or {}
    cosines = [o["metrics"]["cosine"] for o in verify.get("outputs") or [] if o.get("metrics", {}).get("cosine") is not None]
    bundles = sorted(p for p in (folder / "bundle").glob("*") if p.is_dir()) if (folder / "bundle").is_dir() else []
    effective = verify.get("effective") or {}
    return {"verdict": report.get("verdict"), "reason": "; ".join(report.get("reasons") or []) or None,
            "cosine": min(cosines) if cosines else None,
            "top1": (verify.get("task") or {}).get("target"),  # the task metric's value (top-1 by default)
            "task_metric": (verify.get("task") or {}).get("metric"),
            "latency_ms": (row.get("latency") or {}).get("median_ms"),
            "bytes": (report.get("build") or {}).get("bytes"),
            "device": str((verify.get("requested") or report.get("target") or {}).get("device", "CPU")).upper(),
            "effective": {key: effective[key] for key in ("device", "device_name", "device_type") if key in effective},
            "profile": _profile_brief(report.get("profile")),
            "stages": {s["stage"]: s["status"] for s in report.get("stages") or []},
            "side_by_side": ((report.get("environment") or {}).get("cores") or {}).get("jobs_side_by_side", 1),
            "bundle": bundles[0].relative_to(sweep_dir).as_posix() if bundles else None,
            "auto": _auto_brief(report.get("auto"))}


def _auto_brief(section: Optional[dict]) -> Optional[dict]:
    """precision=auto: what the job shipped and its measured speed-up over fp32."""
    if not section:
        return None
    chosen = next((row for row in section["candidates"] if row["precision"] == section["chosen"]), {})
    return {"chosen": section["chosen"], "speedup": (chosen.get("speedup") or {}).get("speedup"),
            "why": section.get("why")}


def _profile_brief(profile: Optional[dict]) -> Optional[dict]:
    """The job's profile in one line: its slowest layer and op type."""
    if not profile or not profile.get("ran"):
        return None
    top = (profile.get("top") or [None])[0] or {}
    kind = (profile.get("by_op_type") or [None])[0] or {}
    return {"total_ms": profile.get("total_ms"), "layers": profile.get("layers"),
            "slowest_layer": top.get("onnx_node") or top.get("name"), "slowest_layer_share": top.get("share"),
            "slowest_op_type": kind.get("op_type"), "slowest_op_type_share": kind.get("share")}


def _row_key(job: dict, varying: set) -> str:
    """A matrix row: the target plus any setting other than target and precision that
    differs between the sweep's jobs."""
    rest = ",".join(f"{k}={v}" for k, v in sorted(job["overrides"].items()) if k in varying)
    return job["target"] + (f" ({rest})" if rest else "")


def _matrix(jobs: List[dict]) -> dict:
    """Rows (targets) x columns (precisions) of job indices, and the best passing job per
    row: the lowest median latency, then the smallest artifact."""
    precisions = sorted({j["precision"] for j in jobs}, key=kinds.listed_order)
    keys = {key for job in jobs for key in job["overrides"]} - {"target", "precision"}
    varying = {key for key in keys if len({job["overrides"].get(key) for job in jobs}) > 1}
    rows: Dict[str, Dict[str, int]] = {}
    for index, job in enumerate(jobs):
        rows.setdefault(_row_key(job, varying), {})[job["precision"]] = index
    best = {}
    for row, cells in rows.items():
        passing = [i for i in cells.values() if jobs[i]["verdict"] == "pass"]
        if passing:
            best[row] = min(passing, key=lambda i: (jobs[i].get("latency_ms") or float("inf"),
                                                    jobs[i].get("bytes") or 0))
    return {"precisions": precisions, "rows": rows, "best": best}


def _label(job: dict) -> str:
    return f"{job['target']} {job['precision']}"


def _ran_on(job: dict) -> str:
    return fmt_device(job.get("effective") or {"device": job.get("device")})


def recommend(jobs: List[dict]) -> dict:
    """Which passing target/precision to ship for latency: the lowest median latency
    (verify's measure of the build, batch 1); others within ``TIE`` of it are ties. And
    where a GPU-device job measured slower than a CPU job of the same precision, that,
    with the numbers."""
    timed = [job for job in jobs if job["verdict"] == "pass" and job.get("latency_ms")]
    found: dict = {"objective": "latency: median of verify's latency runs of the build, one sample",
                   "ship": None, "ties": [], "gpu_vs_cpu": _gpu_vs_cpu(jobs)}
    if not timed:
        found["text"] = "no passing job with a latency measurement: nothing to recommend"
        return found
    timed.sort(key=lambda job: (job["latency_ms"], job.get("bytes") or 0))
    best, rest = timed[0], timed[1:]
    ties = [job for job in rest if job["latency_ms"] <= best["latency_ms"] * (1 + TIE)]
    found["ship"] = {"job": best["dir"], "target": best["target"], "precision": best["precision"],
                     "latency_ms": best["latency_ms"], "ran_on": _ran_on(best)}
    found["ties"] = [{"job": job["dir"], "target": job["target"], "precision": job["precision"],
                      "latency_ms": job["latency_ms"]} for job in ties]
    text = (f"ship {_label(best)}: the fastest passing job, {best['latency_ms']:.3f} ms median latency, "
            f"ran on {_ran_on(best)}")
    if rest:
        runner = rest[0]
        text += f"; next {_label(runner)} {runner['latency_ms']:.3f} ms ({runner['latency_ms'] / best['latency_ms']:.2f}x)"
    if ties:
        text += (f". Within {TIE:.0%} of it, a tie on this machine's noise: "
                 + ", ".join(f"{_label(job)} {job['latency_ms']:.3f} ms" for job in ties))
    side_by_side = max(job.get("side_by_side") or 1 for job in timed)
    if side_by_side > 1:
        found["contended"] = side_by_side
        text += (f". These latencies were measured with {side_by_side} jobs side by side sharing the cores: "
                 "re-time the candidates alone (a sequential sweep, or parity-bundle run) before choosing")
    found["text"] = text
    return found


def _gpu_vs_cpu(jobs: List[dict]) -> List[dict]:
    """GPU-device jobs slower than the fastest CPU job of the same precision, said with
    what really ran (a requested GPU that fell back to the CPU is said as such)."""
    notes = []
    for job in jobs:
        if job.get("device") not in GPU_DEVICES or not job.get("latency_ms"):
            continue
        cpus = [other for other in jobs if other.get("latency_ms") and other["precision"] == job["precision"]
                and other.get("device") == "CPU" and (other.get("effective") or {}).get("device") == "CPU"]
        if cpus:
            note = _gpu_note(job, min(cpus, key=lambda other: other["latency_ms"]))
            notes += [note] if note else []
    return notes


def _gpu_note(job: dict, cpu: dict) -> Optional[dict]:
    note = {"job": job["dir"], "cpu_job": cpu["dir"], "gpu_ms": job["latency_ms"], "cpu_ms": cpu["latency_ms"]}
    effective = job.get("effective") or {}
    if effective.get("device") != job["device"]:
        return {**note, "kind": "fallback", "text": f"{_label(job)} requested {job['device']} but ran on "
                                                    f"{_ran_on(job)}: no {job['device']} measurement"}
    if job["latency_ms"] <= cpu["latency_ms"]:
        return None
    lesson = ("MNN's lesson: for a small model the GPU's dispatch and copy overhead dominates the compute, "
              "so the GPU is slower than the CPU")
    if effective.get("device_type") == "CPU":
        lesson = (f"no GPU computed here (the driver runs the shaders on the CPU), so the gap is the "
                  f"{job['device']} path's dispatch, submit and copy overhead on top of the CPU's work; MNN's "
                  "lesson is that for a small model this overhead dominates on a real GPU too: measure there "
                  "before shipping the GPU path")
    ratio = job["latency_ms"] / cpu["latency_ms"]
    return {**note, "kind": "slower", "text": f"{_label(job)} on {_ran_on(job)}: {job['latency_ms']:.3f} ms, "
                                              f"{ratio:.1f}x the {cpu['latency_ms']:.3f} ms of {_label(cpu)} on "
                                              f"the CPU: {lesson}"}


def _shared_work(jobs: List[dict]) -> Dict[str, dict]:
    """Per stage: how many jobs computed it and how many were served from the shared cache."""
    counts: Dict[str, dict] = {}
    for job in jobs:
        for stage, status in (job.get("stages") or {}).items():
            counts.setdefault(stage, {"computed": 0, "cached": 0})
            counts[stage][status if status in ("computed", "cached") else "computed"] += 1
    return counts


def _cell(job: dict, best: bool) -> str:
    if job["verdict"] == "error":
        return f"error (exit {job['exit_code']})"
    parts = [("★ " if best else "") + f"{job['verdict']} (exit {job['exit_code']})"]
    if job.get("auto"):
        up = job["auto"]["speedup"]
        parts.append(f"shipped {job['auto']['chosen']}" + (f" {up:.2f}x fp32" if up is not None else ""))
    if job.get("cosine") is not None:
        parts.append(f"cos {job['cosine']:.6f}")
    if job.get("top1") is not None:
        metric = job.get("task_metric") or "top1"
        parts.append(f"{'top-1' if metric == 'top1' else metric} {job['top1']:.4f}")
    if job.get("latency_ms") is not None:
        parts.append(f"{job['latency_ms']:.3f} ms")
    if job.get("bytes") is not None:
        parts.append(f"{job['bytes'] / 1024:.0f} KiB")
    return ", ".join(parts)


def _matrix_rows(summary: dict) -> List[List[str]]:
    jobs, matrix = summary["jobs"], summary["matrix"]
    return [[row] + [_cell(jobs[cells[p]], matrix["best"].get(row) == cells[p]) if p in cells else "-"
                     for p in matrix["precisions"]]
            for row, cells in matrix["rows"].items()]


def _document(summary: dict) -> list:
    jobs = summary["jobs"]
    passed = sum(job["verdict"] == "pass" for job in jobs)
    verdict = "pass" if summary["exit_code"] == 0 and jobs else "fail"
    blocks: list = [Heading(1, "parity sweep"),
                    Banner(verdict, f"{passed} of {len(jobs)} jobs passed · exit code {summary['exit_code']}"),
                    Heading(2, "Matrix"),
                    Para("Each cell: verdict, lowest output cosine, top-1 of the target, median latency, artifact "
                         "size. ★ marks the best passing configuration of each target (lowest latency)."),
                    Table(["target", *summary["matrix"]["precisions"]], _matrix_rows(summary))]
    blocks += _recommendation_blocks(summary["recommendation"])
    profiled = [job for job in jobs if job.get("profile")]
    if profiled:
        blocks += [Heading(2, "Profiles"),
                   Para("Per-layer time of each job's build (its report's Profile section has the layers)."),
                   Table(["job", "ran on", "sum of layers ms", "slowest layer", "slowest op type"],
                         [[_label(job), _ran_on(job), f"{job['profile']['total_ms']:.4f}",
                           f"{job['profile']['slowest_layer']} ({_share(job['profile']['slowest_layer_share'])})",
                           f"{job['profile']['slowest_op_type']} ({_share(job['profile']['slowest_op_type_share'])})"]
                          for job in profiled])]
    failing = [f"{job['dir']}: {job['reason'] or 'failed'}" for job in jobs if job["verdict"] != "pass"]
    if failing:
        blocks += [Heading(2, "Failing jobs"), Items(failing, css="reasons")]
    shared = summary["shared_work"]
    if shared:
        rows = [[stage, str(c["computed"]), str(c["cached"])] for stage, c in shared.items()]
        blocks += [Heading(2, "Shared work"),
                   Para("Jobs of a sweep share the stage cache: a stage is computed by the first job that needs "
                        "it and reused by every other job with the same inputs."),
                   Table(["stage", "computed", "reused"], rows),
                   Table(["job", *shared],
                         [[job["dir"], *[(job.get("stages") or {}).get(s, "-") for s in shared]] for job in jobs])]
    return blocks


def _share(value) -> str:
    return f"{value * 100:.0f}%" if isinstance(value, (int, float)) else "n/a"


def _recommendation_blocks(found: dict) -> list:
    blocks = [Heading(2, "Recommendation"), Para(f"Objective: {found['objective']}."), Para(found["text"])]
    if found["gpu_vs_cpu"]:
        blocks += [Heading(3, "GPU devices against the CPU"), Items([note["text"] for note in found["gpu_vs_cpu"]])]
    return blocks


def _write_junit(jobs: List[dict], sweep_dir: Path, path: Path) -> None:
    root = ET.Element("testsuites", {"name": "parity sweep"})
    for job in jobs:
        report = read_optional_json(sweep_dir / job["dir"] / "report.json")
        if report:
            suite = build_junit(report).find("testsuite")
            suite.set("name", f"{suite.get('name')} [{job['dir']}]")
        else:
            suite = ET.Element("testsuite", {"name": f"parity [{job['dir']}]", "tests": "1", "failures": "0",
                                             "errors": "1", "skipped": "0", "time": "0"})
            case = ET.SubElement(suite, "testcase", {"classname": "parity.job", "name": "job ran to a report"})
            ET.SubElement(case, "error", {"message": job["reason"] or f"exit {job['exit_code']}",
                                          "type": f"exit_{job['exit_code']}"})
        root.append(suite)
    for key in ("tests", "failures", "errors"):
        root.set(key, str(sum(int(s.get(key, "0")) for s in root)))
    ET.indent(root)
    path.write_text('<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n")


def _print(summary: dict) -> None:
    table = RichTable(title=f"sweep: {len(summary['jobs'])} jobs, exit code {summary['exit_code']}",
                      title_justify="left")
    for column in ["target", *summary["matrix"]["precisions"]]:
        table.add_column(column)
    for row in _matrix_rows(summary):
        table.add_row(*[escape(cell) for cell in row])
    console = stdout_console()
    console.print(table)
    found = summary["recommendation"]
    console.print(f"recommendation: {escape(found['text'])}")
    for note in found["gpu_vs_cpu"]:
        console.print(f"  {escape(note['text'])}")
    console.print(f"sweep summary: {escape(str(Path(summary['sweep_dir']) / 'sweep.md'))} (.json, .html, junit.xml)")
