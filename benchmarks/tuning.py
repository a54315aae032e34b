"""Tuning and compile-cache figures, each printed next to its reference from the same run.

    python benchmarks/tuning.py [--targets ort_cpu,openvino_cpu,ncnn_cpu,mnn_cpu] [--rounds 5]

1. tuned vs default runtime settings: median latency of the build's settings (each
   backend's defaults) and of the settings `tuning=fast` chose, measured alternately in
   fresh worker processes, on the PP-OCR classifier and the embedded digits model
2. the time tuning at level fast takes per target (figure: <= 20 s for the classifier)
3. start-up (load + first inference, in a fresh process with the runtime imported) of the
   OpenVINO bundle with and without its compile cache (figure: >= 2x faster with it)
Needs `pip install -e .[test,ncnn,mnn]` (the classifier ships in rapidocr-onnxruntime).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from calibration import classifier_args, last_report, parity, write_dataset  # benchmarks/calibration.py

STARTUP = """
import sys, time, yaml, numpy as np, importlib
from pathlib import Path
module, bundle, cached = sys.argv[1], Path(sys.argv[2]), sys.argv[3] == "1"
backend = importlib.import_module(module)
__import__(module.rsplit(".", 1)[1])  # the runtime and parity's loader, imported before the clock starts
import pipeline.release.compile_cache
settings = yaml.safe_load((bundle / "runtime.yaml").read_text())
if not cached:
    settings.pop("compile_cache", None)
feeds = {i["name"]: np.zeros(i["shape"], np.float32) for i in settings["inputs"]}
started = time.perf_counter()
session = backend.load(bundle, settings)
session.run(feeds)
print(time.perf_counter() - started, session.effective()["compile_cache"])
"""


def tune(model_args, target: str, work: Path) -> dict:
    """`parity tuning=fast` on a fresh cache: the run folder, tune seconds and chosen settings."""
    result = parity([*model_args, f"target={target}", "precision=fp32", "tuning=fast",
                     f"pipeline.cache_dir={work / 'cache'}"], work)
    report = last_report(work)
    assert result.returncode == 0, result.stdout + result.stderr
    run = sorted((work / "outputs").glob("*/*_*"))[-1]
    seconds = next(s["seconds"] for s in report["stages"] if s["stage"] == "tune")
    tuned = run / "stages" / "tune"
    folder = tuned if (tuned / "runtime.yaml").exists() else run / "stages" / "build"
    return {"build": run / "stages" / "build", "tuned": folder, "seconds": seconds, "tuning": report["tuning"]}


def alternate_latency(backend: str, runs: dict, feeds, rounds: int) -> dict:
    """Median over rounds of each variant's median latency, variants measured in turn in
    fresh worker processes (so drift on the machine hits both alike)."""
    from pipeline.worker import BackendWorker

    medians = {name: [] for name in runs}
    for _ in range(rounds):
        for name, folder in runs.items():
            settings = yaml.safe_load((folder / "runtime.yaml").read_text())
            with BackendWorker(f"pipeline.backends.{backend}", folder, settings, label=name) as worker:
                medians[name].append(worker.latency(feeds, 20, 200)["median_ms"])
    return {name: statistics.median(values) for name, values in medians.items()}


def startup(bundle: Path, rounds: int) -> dict:
    times = {"cold": [], "warm": []}
    statuses = {}
    for _ in range(rounds):
        for name in ("cold", "warm"):
            result = subprocess.run([sys.executable, "-c", STARTUP, "pipeline.backends.openvino", str(bundle),
                                     "1" if name == "warm" else "0"], capture_output=True, text=True, check=True)
            seconds, status = result.stdout.split()[-2:]
            times[name].append(float(seconds))
            statuses[name] = status
    return {name: statistics.median(values) for name, values in times.items()} | {"status": statuses}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", default="ort_cpu,openvino_cpu,ncnn_cpu,mnn_cpu")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="parity-bench-") as scratch:
        work = Path(scratch)
        data = work / "textlines"
        write_dataset(data, calibration=32, validation=32)
        models = {"ppocr_cls": classifier_args(data, 32, 32), "digits": []}
        rows = []
        bundles = {}
        for model, model_args in models.items():
            for target in args.targets.split(","):
                found = tune(model_args, target, work)
                backend = found["tuning"]["backend"]
                settings = yaml.safe_load((found["build"] / "runtime.yaml").read_text())
                import numpy as np

                feeds = {i["name"]: np.random.default_rng(0).random(i["shape"], dtype=np.float32)
                         for i in settings["inputs"]}
                latency = alternate_latency(backend, {"defaults": found["build"], "tuned": found["tuned"]}, feeds,
                                            args.rounds)
                chosen = found["tuning"]["chosen"]["changes"]
                rows.append((model, target, found["seconds"], latency["defaults"], latency["tuned"], chosen))
                if target == "openvino_cpu":
                    bundles[model] = next((sorted((work / "outputs").glob("*/*_*"))[-1] / "bundle").glob("*/"))
        print("\n== tuned vs default runtime settings (median latency, alternating fresh workers) ==")
        print(f"  {'model':10s} {'target':13s} {'tune s':>7s} {'default ms':>10s} {'tuned ms':>9s} "
              f"{'default/tuned':>13s}  chosen")
        for model, target, seconds, default, tuned, chosen in rows:
            print(f"  {model:10s} {target:13s} {seconds:7.1f} {default:10.4f} {tuned:9.4f} {default / tuned:13.2f}  "
                  f"{json.dumps(chosen) if chosen else 'the defaults'}")
        print("  figures: tuned at least as fast as the defaults (ratio >= 1 within noise); "
              "tuning=fast <= 20 s per target on the classifier")
        print("\n== OpenVINO start-up: load + first inference in a fresh process, with vs without the compile cache ==")
        for model, bundle in bundles.items():
            times = startup(bundle, args.rounds)
            print(f"  {model:10s} without cache {times['cold'] * 1000:7.1f} ms   with cache {times['warm'] * 1000:7.1f} ms"
                  f"   {times['cold'] / times['warm']:.2f}x faster   (cache: {times['status']['warm']})")
        print("  figure: >= 2x faster with the cache")


if __name__ == "__main__":
    main()
