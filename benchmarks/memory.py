"""Peak memory of every build, and target.memory=low against default (issue 39), on the
PP-OCRv4 detector, recognizer and the text-direction classifier from the rapidocr wheel.

    pip install -e .[ncnn,mnn,test]
    python benchmarks/memory.py [--models det rec cls] [--targets ort_cpu openvino_cpu ncnn_cpu mnn_cpu]
                                [--precisions fp32 int8] [--runs 5] [--builds DIR] [--json FILE]

Per model, target and precision, one `parity` run builds the artifact (convert, calibrate for
int8, build; data=random, 8 calibration samples; det at 1x3x640x960, rec 1x3x48x320, cls
1x3x48x192, the shapes PaddleOCR feeds them). Each build is then loaded twice, in two fresh
worker processes (pipeline/worker.py, the workers verify runs): runtime.yaml's options.memory
default and low, the same artifact, the mode applied where the runtime loads it. Each worker
reads its peak resident set (VmHWM) right after the load, resets it, runs ``--runs`` times one
input, and reads it again (``BackendWorker.memory()``, what verify.memory reports). Then low's latency
cost: the two workers timed in alternating blocks (``timed``).

Printed side by side in one run, after the CPU flags: per build and mode the load, run and
peak MB; the int8 build's peak against fp32's (same target and mode); low's peak against
default's, and low's median latency against default's. A build a target cannot make (ncnn
and the recognizer: pnnx has no layer for some of its ops) is a row saying why.
"""

from __future__ import annotations

import argparse
import importlib.resources
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from pipeline import backends  # noqa: E402
from pipeline.environment import cpu  # noqa: E402
from pipeline.errors import BackendCrashed  # noqa: E402
from pipeline.verification import memory  # noqa: E402
from pipeline.worker import BackendWorker  # noqa: E402

MODELS = importlib.resources.files("rapidocr_onnxruntime") / "models"
FILES = {"det": "ch_PP-OCRv4_det_infer.onnx", "rec": "ch_PP-OCRv4_rec_infer.onnx",
         "cls": "ch_ppocr_mobile_v2.0_cls_infer.onnx"}
SHAPES = {"det": [1, 3, 640, 960], "rec": [1, 3, 48, 320], "cls": [1, 3, 48, 192]}
TARGETS = ("ort_cpu", "openvino_cpu", "ncnn_cpu", "mnn_cpu")
BUILD_ARGS = ["data=random", "data.calibration_size=8", "data.validation_size=4", "metric=none", "calibration=max",
              "precision.bias_correction=false", "precision.weight_rounding=false"]
ROUNDS, BLOCK_MS = 7, 300.0  # latency: rounds of one block of back-to-back runs per mode, order alternated


def build(folder: Path, model: str, target: str, precision: str) -> tuple:
    """(the build stage's folder, None) or (None, why it could not be built)."""
    run = folder / f"{model}_{target}_{precision}"
    built = run / "stages" / "build"
    if not (built / "runtime.yaml").is_file():
        stages = "[convert,calibrate,build]" if precision == "int8" else "[convert,build]"
        shape = ",".join(map(str, SHAPES[model]))
        result = subprocess.run([sys.executable, "-m", "pipeline", f"model.path={MODELS / FILES[model]}",
                                 f"+model.input_shapes.x=[{shape}]", f"target={target}", f"precision={precision}",
                                 f"pipeline.stages={stages}", f"hydra.run.dir={run}", *BUILD_ARGS],
                                cwd=folder, capture_output=True, text=True)
        if result.returncode != 0:
            lines = [line for line in result.stderr.splitlines() if line.startswith("parity:")]
            return None, (lines[-1].split("cannot build this model: ")[-1] if lines else result.stderr.strip()[-200:])
    return built, None


def measure(built: Path, model: str, runs: int) -> dict:
    """{mode: memory reading} of the build in default and low, and low's latency against default's."""
    settings = yaml.safe_load((built / "runtime.yaml").read_text())
    module = backends.spec(settings["backend"]).__name__
    feeds = {"x": np.random.default_rng(0).random(SHAPES[model], dtype=np.float32)}
    workers, found = {}, {}
    try:
        for mode in ("default", "low"):
            moded = {**settings, "options": {**settings.get("options", {}), "memory": mode}}
            workers[mode] = BackendWorker(module, built, moded, label=f"{built.parent.parent.name} {mode}")
            workers[mode].start()
            for _ in range(runs):
                workers[mode].run(feeds)
            found[mode] = memory.reading(workers[mode])
        found.update(timed(workers, feeds))
    except BackendCrashed as err:
        found["error"] = str(err).splitlines()[0]
    finally:
        for worker in workers.values():
            worker.close()
    return found


def timed(workers: dict, feeds: dict) -> dict:
    """low's latency against default's: ROUNDS rounds, each a block of at least BLOCK_MS of
    back-to-back runs per mode (the first mode alternating), the per-round ratios' median and
    quartiles. Blocks, not verify's 5 ms slices: an ncnn worker's OpenMP threads spin-wait
    20 ms after each run, which slices of another ncnn worker on 2 cores would pay for."""
    medians = {mode: [] for mode in workers}
    for index in range(ROUNDS):
        for mode in (list(workers) if index % 2 == 0 else list(workers)[::-1]):
            medians[mode].append(workers[mode].latency(feeds, warmup=2, repeats=3, min_ms=BLOCK_MS)["median_ms"])
    ratios = [low / default for low, default in zip(medians["low"], medians["default"])]
    p25, median, p75 = (float(v) for v in np.percentile(ratios, [25, 50, 75]))
    return {"ms": {mode: float(np.median(values)) for mode, values in medians.items()},
            "low_vs_default": {"ratio": median, "p25": p25, "p75": p75}}


def rows(results: dict) -> list:
    """The table's rows: per build and mode, its peaks, against fp32's and against default's."""
    lines = []
    for (model, target, precision), found in results.items():
        if "error" in found:
            why = found["error"] if len(found["error"]) <= 110 else found["error"][:107] + "..."
            lines.append(f"| {model} | {target} | {precision} | - | not built or not run: {why} |||||||")
            continue
        fp32 = results.get((model, target, "fp32"), {})
        for mode in ("default", "low"):
            own = found.get(mode) or {}
            if own.get("peak_mb") is None:
                lines.append(f"| {model} | {target} | {precision} | {mode} | not measured |||||||")
                continue
            versus = ((fp32.get(mode) or {}).get("peak_mb") if precision != "fp32" else None)
            ratio = f"{own['peak_mb'] / versus:.2f}x" if versus else "-"
            default = found["default"]["peak_mb"]
            low = f"{own['peak_mb'] - default:+.1f} MB ({(own['peak_mb'] / default - 1) * 100:+.0f} %)" \
                if mode == "low" else "-"
            ms, up = found["ms"][mode], found.get("low_vs_default")
            cost = f"{up['ratio']:.2f}x ({up['p25']:.2f}-{up['p75']:.2f})" if mode == "low" and up else "-"
            lines.append(f"| {model} | {target} | {precision} | {mode} | {own['load_peak_mb']:.1f} | "
                         f"{own['run_peak_mb']:.1f} | {own['peak_mb']:.1f} | {ratio} | {low} | "
                         f"{ms:.2f} | {cost} |")
    return lines


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(FILES), choices=list(FILES))
    parser.add_argument("--targets", nargs="+", default=list(TARGETS), choices=list(TARGETS))
    parser.add_argument("--precisions", nargs="+", default=["fp32", "int8"], choices=["fp32", "int8"])
    parser.add_argument("--runs", type=int, default=5, help="runs of one input before the run peak is read")
    parser.add_argument("--builds", type=Path, help="keep (and reuse) the builds in this folder")
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    args = parser.parse_args(argv)
    found = cpu()
    print(f"CPU: {found.get('model', '?')} ({found.get('machine', '?')}), {os.cpu_count()} cores, flags: "
          f"{' '.join(found['flags'])}")
    folder = args.builds or Path(tempfile.mkdtemp(prefix="parity-memory-"))
    folder.mkdir(parents=True, exist_ok=True)
    results = {}
    for model in args.models:
        for target in args.targets:
            for precision in args.precisions:
                built, why = build(folder, model, target, precision)
                results[(model, target, precision)] = {"error": why} if built is None else measure(built, model,
                                                                                                     args.runs)
                print(f"  {model} {target} {precision}: done", file=sys.stderr, flush=True)
    print(f"\nPeak resident memory of each build's worker process (MB), {args.runs} runs of one input; low's peak "
          f"against default's, and its latency against default's (median of {ROUNDS} per-round ratios, p25-p75, "
          f"blocks of {BLOCK_MS:g} ms a mode and round):\n")
    print("| model | target | precision | target.memory | load peak | run peak | peak | vs fp32 | low vs default | "
          "median ms | low's latency |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows(results)))
    if args.json:
        args.json.write_text(json.dumps({" ".join(key): value for key, value in results.items()}, indent=1))


if __name__ == "__main__":
    main()
