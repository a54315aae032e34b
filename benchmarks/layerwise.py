"""Layerwise-compare figures on the real PP-OCR models from the rapidocr wheel, int8 on
ONNX Runtime vs the fp32 reference, 30 layerwise samples:

- PP-OCRv4 detector at 320x320 (failing int8: layerwise runs to name the culprit), and
- PP-OCR text-direction classifier (kl int8, 8 calibration samples, validation.min_cosine=0.99999:
  failing too),

each with validation.layerwise=on_fail (stops at the first divergence) and =always (the
full table), next to the figures before this version (docs/verify.md, "Layerwise").

    python benchmarks/layerwise.py [--skip-always]

Prints the layerwise time (the verify stage's own measure), the machine's load average
before and after each run (other processes share the cores: timings under load are
inflated), the CPU flags, the peak memory of the `parity` process and of its largest
worker, and the side file's size. Needs DejaVu fonts (text-line images)."""

from __future__ import annotations

import argparse
import importlib.resources
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from calibration import classifier_args, last_report, last_run, parity, write_dataset  # benchmarks/calibration.py

MODELS = importlib.resources.files("rapidocr_onnxruntime") / "models"
DETECTOR = MODELS / "ch_PP-OCRv4_det_infer.onnx"
# Before (verify VERSION 8): every tensor, float64 stats through threaded BLAS, one side after the other.
BEFORE = {"detector": "96-186 s (issue 16; 257 s measured here at load 8)", "classifier": "2.6 s (issue 16)"}
# The classifier with 8 calibration samples and min_cosine 0.99999 fails, so on_fail runs layerwise.
TARGET_S = {"detector": 15.0, "classifier": 5.0}


def detector_args(data: Path):
    return [f"model.path={DETECTOR}", "+model.input_shapes.x=[1,3,320,320]", "data.kind=images", f"data.path={data}",
            "data.calibration_size=16", "data.validation_size=30", "data.preprocess.keep_aspect=true",
            "data.preprocess.mean=[0.485,0.456,0.406]", "data.preprocess.std=[0.229,0.224,0.225]"]


def peak_run(args, cwd: Path):
    """(peak RSS of the parity process, of its largest child) in MiB."""
    code = ("import resource, sys; from pipeline.app.cli import main; sys.argv = ['parity'] + sys.argv[1:]\n"
            "try:\n    main()\nfinally:\n"
            "    print('PEAK_KB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,"
            " resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr)")
    result = subprocess.run([sys.executable, "-c", code, *map(str, args)], cwd=cwd, capture_output=True, text=True)
    own, child = result.stderr.rsplit("PEAK_KB", 1)[1].split()[:2]
    return int(own) / 1024, int(child) / 1024, result


def measure(name: str, base: list, work: Path, mode: str) -> dict:
    load_before = os.getloadavg()[0]
    own, child, result = peak_run([*base, f"validation.layerwise={mode}", "validation.layerwise_samples=30",
                                   "validation.advice_trials=0", "pipeline.stages=[convert,calibrate,build,verify]"],
                                  work)
    report = last_report(work)
    layers = report["verify"]["layerwise"]
    if not layers["ran"]:
        cosine = report["verify"]["outputs"][0]["metrics"]["cosine"]
        print(f"  {name:10s} layerwise={mode:8s} not run: {layers['reason']} (output cosine {cosine:.6f})")
        return {"model": name, "mode": mode, "ran": False}
    side = last_run(work) / "stages" / "verify" / layers["side_file"]
    culprit = layers["first_divergence"]
    found = {"model": name, "mode": mode, "seconds": layers["seconds"], "compared": layers["compared"],
             "stopped": layers.get("stopped"), "load_before": round(load_before, 2),
             "load_after": round(os.getloadavg()[0], 2),
             "culprit": culprit["op"] if culprit else None, "exit": result.returncode,
             "peak_parity_mib": round(own), "peak_worker_mib": round(child),
             "side_mb": round(side.stat().st_size / 1e6, 3)}
    print(f"  {name:10s} layerwise={mode:8s} {found['seconds']:7.2f} s  (target <= {TARGET_S[name]:.0f} s in on_fail; "
          f"before: {BEFORE[name]})  {found['compared']} tensors compared, first divergence "
          f"{found['culprit']}, load {found['load_before']} -> {found['load_after']}, exit {found['exit']}")
    return found


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--skip-always", action="store_true", help="only validation.layerwise=on_fail")
    parser.add_argument("--only", choices=("detector", "classifier"), help="one model only")
    options = parser.parse_args()
    from pipeline import environment

    print(f"== layerwise: int8 (ort_cpu) vs fp32 reference, 30 samples; CPU {environment.cpu()['model']}, "
          f"flags {' '.join(environment.cpu()['flags'])}, {os.cpu_count()} cores ==")
    results = []
    with tempfile.TemporaryDirectory(prefix="parity-bench-layerwise-") as scratch:
        work = Path(scratch)
        data = write_dataset(work / "textlines", calibration=100, validation=30)
        for labels in data.glob("*/labels.csv"):  # no classes for the detector
            labels.unlink()
        cases = {"detector": [*detector_args(data), "precision=int8", "target=ort_cpu"],
                 "classifier": [*classifier_args(data, 8, 30), "precision=int8", "target=ort_cpu", "calibration=kl",
                                "validation.min_cosine=0.99999"]}
        for name, base in cases.items() if not options.only else [(options.only, cases[options.only])]:
            prepared = parity([*base, "pipeline.stages=[convert,calibrate,build]"], work)  # cached for the runs
            assert prepared.returncode == 0, prepared.stderr
            for mode in ("on_fail",) if options.skip_always else ("on_fail", "always"):
                results.append(measure(name, base, work, mode))
    print(json.dumps(results))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    main()
