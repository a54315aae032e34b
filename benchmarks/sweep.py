"""Sweep figures on the real PP-OCR text-direction classifier, side by side in one run:

    python benchmarks/sweep.py [--calibration 64] [--validation 64] [--workers 2]

A sweep of 2 targets (ort_cpu, openvino_cpu) x 3 precisions (fp32, int8, mixed):
1. six independent single runs (each with its own empty cache): the sum of their wall times
2. the sequential sweep (basic launcher, one shared empty cache)
3. the parallel sweep (joblib launcher, --workers processes, one shared empty cache)
   target: wall time <= 0.7 x the sequential sweep
4. from the parallel sweep's sweep.json: calibration and sensitivity computed once per
   precision for the whole sweep, every other job served from the shared cache
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from calibration import classifier_args, parity, write_dataset  # benchmarks/calibration.py

TARGETS = ("ort_cpu", "openvino_cpu")
PRECISIONS = ("fp32", "int8", "mixed")
SEARCH = ["sensitivity.samples=30", "sensitivity.expected_cos=0.999"]


def timed(args, cwd: Path) -> float:
    cwd.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    result = parity(args, cwd)
    seconds = time.perf_counter() - started
    if result.returncode not in (0, 3):
        raise SystemExit(f"parity {' '.join(map(str, args))} failed ({result.returncode}):\n{result.stderr[-2000:]}")
    return seconds


def sweep_args(base, extra):
    return ["-m", *extra, f"target={','.join(TARGETS)}", f"precision={','.join(PRECISIONS)}", *base]


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
        sequential = timed(sweep_args(base, []), work / "sequential")
        parallel_dir = work / "parallel"
        parallel = timed(sweep_args(base, ["hydra/launcher=joblib", f"hydra.launcher.n_jobs={args.workers}"]),
                         parallel_dir)
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
    print(f"  sequential sweep (basic launcher):  {sequential:6.1f} s  ({sequential / single_sum:.2f} x the sum)")
    print(f"  parallel sweep (joblib, {args.workers} workers): {parallel:6.1f} s  "
          f"({parallel / sequential:.2f} x sequential; target <= 0.70)")
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
