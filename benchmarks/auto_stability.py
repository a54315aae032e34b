"""precision=auto's choice on the default job, three runs in a row, next to an independent
timing of the same ONNX files (issue 37, item 1).

    python benchmarks/auto_stability.py [--runs 3] [--rounds 15] [--round-ms 50] [--source DIR]

Each run is `parity` with no arguments (the embedded digits CNN on ort_cpu, precision=auto)
in a fresh folder. From its report.json: the shipped precision, every candidate's speed-up
over fp32 with its p25-p75 interval and p75/p25, auto's call against fp32, and the shipped
run's own verify timing. Then the benchmark times the run's candidate files itself with
onnxruntime directly, in one process (not parity's workers, slices or rules): 15 rounds,
every build once a round for a number of runs sized so that a round lasts at least 50 ms,
the order alternated from round to round, the median of each round's run times, and the
median of round medians; the thread count is the target's (runtime.yaml). Printed per
build: the ratio of fp32's median to the build's, and the median of the per-round ratios
(paired, the steadier of the two) with p25-p75. The choice agrees when the shipped build is
the fastest by the per-round speed-up, or within 5 % of it.
``--source DIR`` runs parity from another checkout (e.g. `git archive` of an older commit),
for a before/after on the same machine.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
AGREE_WITHIN = 0.95  # the shipped build at least this fraction of the independent fastest's speed
TIGHT = 1.25  # the interval the issue asks of the int8 candidate: p75/p25 at most this


def parity(cwd: Path, source: Path = None) -> tuple:
    """(seconds, run folder, report.json) of one `parity` run with no arguments (from the
    checkout ``source`` when given)."""
    command, env = [str(Path(sys.executable).parent / "parity")], {**os.environ, "NO_COLOR": "1"}
    if source is not None:
        command = [sys.executable, "-c", "import sys; sys.argv = ['parity']; from pipeline.app.cli import main; main()"]
        env["PYTHONPATH"] = str(source)
    started = time.perf_counter()
    result = subprocess.run(command, cwd=cwd, capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - started
    runs = sorted((cwd / "outputs").glob("*/*_*"))
    if not runs or not (runs[-1] / "report.json").exists():
        raise SystemExit(f"parity failed:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}")
    return seconds, runs[-1], json.loads((runs[-1] / "report.json").read_text())


def independent(builds: dict, threads: int, rounds: int, round_ms: float) -> dict:
    """Per build: median of round medians (ms) and per-round speed-ups over fp32, timed
    with onnxruntime sessions of ``threads`` intra-op threads, order alternated by round."""
    import onnxruntime as ort

    sessions, feeds = {}, None
    for name, folder in builds.items():
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.log_severity_level = 3
        session = ort.InferenceSession(str(folder / "model.onnx"), options, providers=["CPUExecutionProvider"])
        if feeds is None:
            rng = np.random.default_rng(0)
            feeds = {i.name: rng.random([d if isinstance(d, int) else 1 for d in i.shape], dtype=np.float32)
                     for i in session.get_inputs()}
        sessions[name] = session
    per_run = {}
    for name, session in sessions.items():  # warm-up: round_ms of runs, the time a run takes back to back
        count, started = 0, time.perf_counter()
        while (time.perf_counter() - started) * 1000 < round_ms:
            session.run(None, feeds)
            count += 1
        per_run[name] = (time.perf_counter() - started) * 1000 / count
    runs = max(10, math.ceil(round_ms / min(per_run.values())))
    order = list(sessions)
    medians = {name: [] for name in order}
    for index in range(rounds):
        for name in (order if index % 2 == 0 else order[::-1]):
            times = []
            for _ in range(runs):
                started = time.perf_counter()
                sessions[name].run(None, feeds)
                times.append((time.perf_counter() - started) * 1000)
            medians[name].append(float(np.median(times)))
    found = {}
    for name in order:
        ratios = [f / b for f, b in zip(medians["fp32"], medians[name])]
        found[name] = {"median_ms": float(np.median(medians[name])), "runs_per_round": runs,
                       "speedup": float(np.median(medians["fp32"]) / np.median(medians[name])),
                       "round_speedup": float(np.median(ratios)),
                       "p25": float(np.percentile(ratios, 25)), "p75": float(np.percentile(ratios, 75))}
    return found


def candidate_lines(report: dict) -> list:
    section = report["auto"]
    lines = [f"  {'precision':<13}{'verdict':<20}{'auto speed-up (p25-p75)':>26}{'p75/p25':>9}{'call':>11}"
             f"{'rounds':>8}{'runs/round':>12}{'longer':>8}"]
    for row in section["candidates"]:
        up, latency = row.get("speedup") or {}, row.get("latency") or {}
        speedup = (f"{up['speedup']:.2f}x ({up['speedup_p25']:.2f}-{up['speedup_p75']:.2f})" if up
                   else "1.00x (reference)" if latency else "-")
        spread = f"{up['speedup_p75'] / up['speedup_p25']:.2f}" if up else "-"
        lines.append(f"  {row['precision']:<13}{row['verdict'][:19]:<20}{speedup:>26}{spread:>9}"
                     f"{up.get('call', '-'):>11}{latency.get('rounds', '-'):>8}{latency.get('runs_per_round', '-'):>12}"
                     f"{latency.get('lengthened', '-'):>8}" + ("  <- shipped" if row["precision"] == section["chosen"]
                                                               else ""))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--round-ms", type=float, default=50.0)
    parser.add_argument("--source", type=Path, help="run parity from this checkout instead of the installed one")
    args = parser.parse_args()
    import onnxruntime

    from pipeline.environment import cpu

    info = cpu()
    print(f"CPU: {info['model']} ({os.cpu_count()} cores), flags: {', '.join(info['flags'])}"
          + (f", ISA cap {info['isa_cap']}" if info.get("isa_cap") else ""))
    print(f"onnxruntime {onnxruntime.__version__}; load average at start {os.getloadavg()[0]:.2f}")
    summary = []
    for number in range(1, args.runs + 1):
        with tempfile.TemporaryDirectory(prefix="parity-auto-stability-") as folder:
            seconds, run_dir, report = parity(Path(folder), args.source)
            section = report["auto"]
            passing = [r["precision"] for r in section["candidates"]
                       if r["verdict"] == "pass" and r.get("latency") and not r.get("same_as")]
            # fp32, the speed reference, is built and timed but verified only where it could ship
            builds = {p: run_dir / "candidates" / p / "stages" / "build" for p in dict.fromkeys(["fp32", *passing])}
            settings = yaml.safe_load((builds["fp32"] / "runtime.yaml").read_text())
            threads = int(settings["options"].get("intra_op_num_threads", 0))
            own = independent(builds, threads, args.rounds, args.round_ms)
        chosen = section["chosen"]
        print(f"\nrun {number}: `parity` {seconds:.1f} s, shipped {chosen}: {section['why']}")
        print("\n".join(candidate_lines(report)))
        # the shipped run's verify names its build by its precision (int8_dynamic: int8)
        shipped_speed = (report["verify"]["speed"].get("speedups") or {}).get(report["precision"])
        print("  the shipped run's verify timing: " + (
            f"{shipped_speed['speedup']:.2f}x ({shipped_speed['speedup_p25']:.2f}-{shipped_speed['speedup_p75']:.2f})"
            if shipped_speed else "fp32 shipped: nothing to compare it with"))
        fastest = max(own, key=lambda p: own[p]["round_speedup"])
        print(f"  independent timing (onnxruntime in one process, {threads} intra-op threads (0: its default), "
              f"{args.rounds} rounds of >= {args.round_ms:g} ms, order alternated):")
        for name, found in own.items():
            print(f"    {name:<13}{found['median_ms']:.4f} ms  {found['speedup']:.2f}x fp32 (per round "
                  f"{found['round_speedup']:.2f}x, {found['p25']:.2f}-{found['p75']:.2f})  "
                  f"{found['runs_per_round']} runs a round")
        agrees = chosen == fastest or own[chosen]["round_speedup"] >= AGREE_WITHIN * own[fastest]["round_speedup"]
        int8 = next((r.get("speedup") for r in section["candidates"] if r["precision"] == "int8"), None)
        spread = int8["speedup_p75"] / int8["speedup_p25"] if int8 else None
        print(f"  independent fastest: {fastest}; auto shipped {chosen}: {'agrees' if agrees else 'DISAGREES'}")
        summary.append((chosen, spread, agrees, seconds))
    shipped = {s[0] for s in summary}
    tight = sum(1 for s in summary if s[1] is not None and s[1] <= TIGHT)
    same = "the same" if len(shipped) == 1 else "NOT the same"
    print(f"\nsummary: shipped {', '.join(s[0] for s in summary)} ({same}); "
          f"int8 p75/p25 {', '.join(f'{s[1]:.2f}' if s[1] else '-' for s in summary)} (<= {TIGHT} in {tight} of "
          f"{len(summary)}); agrees with the independent timing in {sum(s[2] for s in summary)} of {len(summary)}; "
          f"`parity` {', '.join(f'{s[3]:.1f}' for s in summary)} s; load average at end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
