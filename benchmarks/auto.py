"""precision=auto: the default `parity` cold end to end, and what auto ships next to every
candidate's measured speed-up, on ort_cpu and openvino_cpu, for the embedded digits model
and the PP-OCRv4 text recognizer of the rapidocr wheel.

    python benchmarks/auto.py [--skip-rec] [--cold-runs 3]

Every run is the `parity` CLI in a fresh folder (no stage cache: cold). The candidate
speed-ups are auto's own measurement: every passing build and fp32 timed interleaved in
rounds on the target (pipeline/verification/speed.py); the figure is the ratio, taken in one run.
"""

from __future__ import annotations

import argparse
import importlib.resources
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from mixed import rec_samples  # noqa: E402  (rendered text lines, the same data as benchmarks/mixed.py)

REC = importlib.resources.files("rapidocr_onnxruntime") / "models" / "ch_PP-OCRv4_rec_infer.onnx"
COLD_GOAL_S = 8.0


def parity(args, cwd: Path) -> tuple:
    """(seconds, report.json of the run) for one cold `parity` run."""
    started = time.perf_counter()
    result = subprocess.run([str(Path(sys.executable).parent / "parity"), *args], cwd=cwd, capture_output=True,
                            text=True, env={**os.environ, "NO_COLOR": "1"})
    seconds = time.perf_counter() - started
    runs = sorted((cwd / "outputs").glob("*/*_*"))
    if not runs or not (runs[-1] / "report.json").exists():
        raise SystemExit(f"parity {' '.join(args)} failed:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}")
    return seconds, json.loads((runs[-1] / "report.json").read_text())


def candidate_table(title: str, report: dict) -> str:
    section = report["auto"]
    lines = [f"{title}: shipped {section['chosen']} (exit {report['exit_code']}): {section['why']}",
             f"  {'precision':<10}{'verdict':<22}{'cosine':>10}{'speed-up vs fp32 (p25-p75)':>30}{'size MB':>10}"]
    for row in section["candidates"]:
        up = row.get("speedup")
        speed = (f"{up['speedup']:.2f}x ({up['speedup_p25']:.2f}-{up['speedup_p75']:.2f})" if up
                 else "1.00x (reference)" if row.get("latency") else "-")
        cosine = f"{row['cosine']:.6f}" if row.get("cosine") is not None else "-"
        size = f"{row['bytes'] / 1e6:.2f}" if row.get("bytes") else "-"
        mark = " <- shipped" if row["precision"] == section["chosen"] else ""
        lines.append(f"  {row['precision']:<10}{row['verdict'][:21]:<22}{cosine:>10}{speed:>30}{size:>10}{mark}")
    fastest = _fastest_passing(section)
    if fastest == "-":
        lines.append(f"  no two passing builds to time; shipped: {section['chosen']}")
    else:
        same = fastest == section["chosen"]
        lines.append(f"  fastest passing by median: {fastest}; shipped: {section['chosen']} "
                     f"({'the same' if same else 'a tie within the spread, decided by size, then precision'})")
    return "\n".join(lines)


def _fastest_passing(section: dict) -> str:
    timed = [r for r in section["candidates"] if r["verdict"] == "pass" and r.get("latency")]
    return min(timed, key=lambda r: r["latency"]["median_ms"])["precision"] if timed else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cold-runs", type=int, default=3)
    parser.add_argument("--skip-rec", action="store_true")
    args = parser.parse_args()
    from pipeline.environment import cpu

    info = cpu()
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; CPU {info['model']}; {os.cpu_count()} cores; "
          f"flags {' '.join(info['flags'])}\n")
    with tempfile.TemporaryDirectory(prefix="parity-auto-bench-") as scratch:
        cold = []
        for index in range(args.cold_runs):
            folder = Path(scratch) / f"cold{index}"
            folder.mkdir()
            seconds, report = parity([], folder)
            cold.append(seconds)
        print(f"`parity` (embedded default, precision=auto, ort_cpu) cold end to end: median "
              f"{statistics.median(cold):.2f} s of {len(cold)} runs ({', '.join(f'{s:.2f}' for s in cold)}) "
              f"vs the goal {COLD_GOAL_S:.0f} s: {'met' if statistics.median(cold) <= COLD_GOAL_S else 'MISS'}")
        print(candidate_table("digits ort_cpu", report) + "\n")
        folder = Path(scratch) / "digits_openvino"
        folder.mkdir()
        print(candidate_table("digits openvino_cpu", parity(["target=openvino_cpu"], folder)[1]) + "\n")
        if args.skip_rec:
            return
        lines, _ = rec_samples(96, seed=3)
        data = Path(scratch) / "rec.npz"
        np.savez(data, **{"calibration/x": lines[:32], "validation/x": lines[32:]})
        rec = [f"model.path={REC}", "+model.input_shapes.x=[1,3,48,320]", "data.kind=tensors", f"data.path={data}",
               "data.calibration_size=32", "data.validation_size=64", "metric=none", "target.threads=1"]
        for target in ("ort_cpu", "openvino_cpu"):
            folder = Path(scratch) / f"rec_{target}"
            folder.mkdir()
            seconds, report = parity([*rec, f"target={target}"], folder)
            print(candidate_table(f"PP-OCRv4 rec {target} (1 thread, {seconds:.0f} s)", report) + "\n")


if __name__ == "__main__":
    main()
