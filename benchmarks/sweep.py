"""Sweep figures on the real PP-OCR text-direction classifier, side by side in one run:

    python benchmarks/sweep.py [--calibration 64] [--validation 64] [--workers 2]

A sweep of 2 targets (ort_cpu, openvino_cpu) x 3 precisions (fp32, int8, mixed):
1. six independent single runs (each with its own empty cache): the sum of their wall times
2. the sequential sweep (basic launcher, one shared empty cache)
3. the parallel sweep (joblib launcher, --workers processes, one shared empty cache)
   target: wall time <= 0.7 x the sequential sweep; again with the precisions listed
   slowest first (mixed,int8,fp32), which the launchers start first
   Each sweep's CPU time (all its processes) is printed with its wall time: a sweep whose
   jobs already use most of the cores one at a time leaves a parallel launcher little to gain.
4. from the parallel sweep's sweep.json: calibration and sensitivity computed once per
   precision for the whole sweep, every other job served from the shared cache
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import tempfile
import time
from pathlib import Path

from calibration import classifier_args, parity, write_dataset  # benchmarks/calibration.py

TARGETS = ("ort_cpu", "openvino_cpu")
PRECISIONS = ("fp32", "int8", "mixed")
SEARCH = ["sensitivity.samples=30", "sensitivity.expected_cos=0.999"]


def timed(args, cwd: Path) -> float:
    return timed_with_cpu(args, cwd)[0]


def timed_with_cpu(args, cwd: Path):
    """Wall seconds and CPU seconds (user + system of every process the run started)."""
    cwd.mkdir(parents=True, exist_ok=True)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    result = parity(args, cwd)
    seconds = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if result.returncode not in (0, 3):
        raise SystemExit(f"parity {' '.join(map(str, args))} failed ({result.returncode}):\n{result.stderr[-2000:]}")
    return seconds, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def sweep_args(base, extra, precisions=PRECISIONS):
    return ["-m", *extra, f"target={','.join(TARGETS)}", f"precision={','.join(precisions)}", *base]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calibration", type=int, default=64)
    parser.add_argument("--validation", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    print(f"CPU cores: {os.cpu_count()}")
    with tempfile.TemporaryDirectory(prefix="parity-bench-") as scratch:
        work = Path(scratch)
        data = work / "textlines"
        write_dataset(data, calibration=args.calibration, validation=args.validation)
        base = [*classifier_args(data, args.calibration, args.validation), *SEARCH]

        singles = {(t, p): timed([*base, f"target={t}", f"precision={p}", "pipeline.cache=false"], work / "single")
                   for t in TARGETS for p in PRECISIONS}
        single_sum = sum(singles.values())
        sequential, sequential_cpu = timed_with_cpu(sweep_args(base, []), work / "sequential")
        parallel_dir = work / "parallel"
        joblib = ["hydra/launcher=joblib", f"hydra.launcher.n_jobs={args.workers}"]
        parallel, parallel_cpu = timed_with_cpu(sweep_args(base, joblib), parallel_dir)
        slowest_first, slowest_first_cpu = timed_with_cpu(sweep_args(base, joblib, PRECISIONS[::-1]),
                                                          work / "slowest-first")
        sweep_json = next(parallel_dir.glob("multirun/*/*/sweep.json"))
        summary = json.loads(sweep_json.read_text())
        reports = [json.loads((sweep_json.parent / job["dir"] / "report.json").read_text())
                   for job in summary["jobs"]]
        search = max(s["computed_seconds"] for r in reports for s in r["stages"] if s["stage"] == "sensitivity")

    print("\n== single runs (own cache each) ==")
    for (target, precision), seconds in singles.items():
        print(f"  {target:>13} {precision:>5}: {seconds:6.1f} s")
    print("\n== wall time of the 2 x 3 sweep ==")
    print(f"  sum of six independent single runs: {single_sum:6.1f} s")
    print(f"  sequential sweep (basic launcher):  {sequential:6.1f} s  ({sequential / single_sum:.2f} x the sum)"
          f"   CPU {sequential_cpu:5.1f} s = {sequential_cpu / sequential:.2f} cores busy on average")
    print(f"  parallel sweep (joblib, {args.workers} workers): {parallel:6.1f} s  "
          f"({parallel / sequential:.2f} x sequential; target <= 0.70)"
          f"   CPU {parallel_cpu:5.1f} s = {parallel_cpu / parallel:.2f} cores busy")
    print(f"  the same, precisions {','.join(PRECISIONS[::-1])}: {slowest_first:6.1f} s  "
          f"({slowest_first / sequential:.2f} x sequential; target <= 0.70)"
          f"   CPU {slowest_first_cpu:5.1f} s = {slowest_first_cpu / slowest_first:.2f} cores busy")
    cores = len(os.sched_getaffinity(0))
    print(f"  bound: the parallel sweep's CPU time spread evenly over {cores} cores: {parallel_cpu / cores:6.1f} s "
          f"({parallel_cpu / cores / sequential:.2f} x sequential)")
    print(f"  the one shared sensitivity search alone: {search:6.1f} s = {search / sequential:.2f} x sequential: "
          "no launcher can finish the sweep sooner than the job that waits for it")
    print("\n== shared work in the parallel sweep (computed / served from the shared cache) ==")
    for stage, counts in summary["shared_work"].items():
        print(f"  {stage:>12}: computed {counts['computed']}, reused {counts['cached']}")
    jobs = {f"{j['target']} {j['precision']}": j.get("stages", {}) for j in summary["jobs"]}
    for name, stages in jobs.items():
        print(f"  {name:>20}: calibrate {stages.get('calibrate')}, sensitivity {stages.get('sensitivity')}")
    print(f"\nsweep exit code {summary['exit_code']}")


if __name__ == "__main__":
    main()
