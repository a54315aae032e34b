"""Calibration and INT8 figures on the real PP-OCR text-direction classifier, each printed
next to its reference from the same run.

    python benchmarks/calibration.py [--samples 100] [--validation 400] [--skip-ort]

1. speed: the five threshold methods (max, percentile, kl, mse, auto) through the real
   calibrate stage on 100 calibration samples, vs ONNX Runtime's 2048-bin entropy calibrator
2. memory: peak RSS of a calibrate run with 512 samples vs 64 (separate processes)
3. accuracy: int8 (per-channel; kl and auto) vs fp32 on both targets, 400 validation images,
   and OpenVINO int8 latency vs fp32
Needs `pip install -e .[test]` (the model ships in rapidocr-onnxruntime) and DejaVu fonts.
"""

from __future__ import annotations

import argparse
import importlib.resources
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
from textlines import write_dataset  # noqa: E402

MODEL = importlib.resources.files("rapidocr_onnxruntime") / "models" / "ch_ppocr_mobile_v2.0_cls_infer.onnx"
METHODS = ("max", "percentile", "kl", "mse", "auto")


def parity(args, cwd: Path) -> subprocess.CompletedProcess:
    command = [str(Path(sys.executable).parent / "parity"), *map(str, args)]
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, env={**os.environ, "NO_COLOR": "1"})


def classifier_args(data: Path, calibration: int, validation: int):
    return [f"model.path={MODEL}", "+model.input_shapes.x=[1,3,48,192]", "data.kind=images", f"data.path={data}",
            f"data.calibration_size={calibration}", f"data.validation_size={validation}",
            "data.preprocess.keep_aspect=true", "data.preprocess.color=bgr", "data.preprocess.mean=[0.5]",
            "data.preprocess.std=[0.5]"]


def last_run(cwd: Path) -> Path:
    return sorted((cwd / "outputs").glob("*/*_*"))[-1]


def last_report(cwd: Path) -> dict:
    return json.loads((last_run(cwd) / "report.json").read_text())


def speed(work: Path, data: Path, samples: int, skip_ort: bool) -> None:
    print(f"\n== 1. speed: five methods, {samples} calibration samples ==")
    total = 0.0
    for method in METHODS:
        started = time.perf_counter()
        result = parity([*classifier_args(data, samples, 1), "precision=int8", f"calibration={method}",
                         "pipeline.stages=[convert,calibrate]"], work)
        assert result.returncode == 0, result.stderr
        calibrate = last_report(work)["calibration"]
        stage = calibrate["statistics_seconds"] + calibrate["thresholds_seconds"]
        total += stage
        print(f"  {method:10s} statistics {calibrate['statistics']:8s} {calibrate['statistics_seconds']:6.2f} s"
              f"  thresholds {calibrate['thresholds_seconds']:6.2f} s  ({calibrate['tensors']} tensors;"
              f" process {time.perf_counter() - started:.1f} s)")
    print(f"  parity, all five methods: {total:.2f} s   (target <= 3 s; TPU-MLIR run_calibration: 9.5-19 s per method)")
    if skip_ort:
        return
    print("  ONNX Runtime Entropy calibrator (num_bins 2048) on the same samples ...", flush=True)
    ort_seconds = ort_entropy(work, data, samples)
    print(f"  ONNX Runtime entropy, one method: {ort_seconds:.1f} s   vs parity five methods: {total:.2f} s")


def ort_entropy(work: Path, data: Path, samples: int) -> float:
    from onnxruntime.quantization import CalibrationDataReader, CalibrationMethod, create_calibrator

    from pipeline.config.schemas import DataConfig, DataKind, PreprocessConfig, Color
    from pipeline.data import TensorSpec, open_dataset

    converted = sorted((work / "outputs").glob("*/*_*"))[-1] / "stages" / "convert" / "model.onnx"
    pre = PreprocessConfig(keep_aspect=True, color=Color.bgr, mean=[0.5], std=[0.5])
    dataset = open_dataset(DataConfig(kind=DataKind.images, path=str(data), calibration_size=samples,
                                      preprocess=pre), [TensorSpec("x", [1, 3, 48, 192], "float32")])

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.samples = iter(dataset.calibration)

        def get_next(self):
            sample = next(self.samples, None)
            return sample.feeds if sample else None

    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        calibrator = create_calibrator(converted, None, augmented_model_path=f"{scratch}/augmented.onnx",
                                       calibrate_method=CalibrationMethod.Entropy, extra_options={"num_bins": 2048})
        calibrator.collect_data(Reader())
        calibrator.compute_data()
    return time.perf_counter() - started


def memory(work: Path, data: Path) -> None:
    print("\n== 2. memory: peak RSS of the calibrate run, 512 vs 64 samples ==")
    peaks = {}
    for samples in (64, 512):
        cache = work / f"cache-{samples}"
        code = ("import resource, sys; from pipeline.app.cli import main; sys.argv = ['parity'] + sys.argv[1:]\n"
                "try:\n    main()\nfinally:\n"
                "    print('PEAK_KB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)")
        args = [*classifier_args(data, samples, 1), "precision=int8", "calibration=kl",
                "pipeline.stages=[convert,calibrate]", f"pipeline.cache_dir={cache}"]
        result = subprocess.run([sys.executable, "-c", code, *args], cwd=work, capture_output=True, text=True)
        peak = int(result.stderr.rsplit("PEAK_KB", 1)[1].split()[0]) / 1024
        peaks[samples] = peak
        print(f"  {samples:4d} samples: peak RSS {peak:7.1f} MiB")
    growth = (peaks[512] / peaks[64] - 1) * 100
    print(f"  512 vs 64: {growth:+.1f} %   (target within 10 %)")


def accuracy(work: Path, data: Path, validation: int) -> None:
    print(f"\n== 4. accuracy: int8 vs fp32, {validation} validation images ==")
    fragile(data, validation)
    rows, bundles = [], {}
    for target in ("ort_cpu", "openvino_cpu"):
        for precision, method in (("fp32", None), ("int8", "kl"), ("int8", "auto")):
            args = [*classifier_args(data, 100, validation), f"target={target}", f"precision={precision}"]
            args += [f"calibration={method}"] if method else []
            result = parity(args, work)
            report = last_report(work)
            bundles[(target, precision, method)] = next(p for p in (last_run(work) / "bundle").iterdir() if p.is_dir())
            verify = report["verify"]
            comparison = verify["comparison"]
            rows.append((target, precision, method or "-", verify["task"]["reference"], verify["task"]["target"],
                         verify["task"]["agreement"], verify["outputs"][0]["metrics"]["cosine"],
                         comparison[precision]["latency"]["median_ms"], comparison["fp32"]["latency"]["median_ms"],
                         verify["effective"]["precision"], result.returncode))
    print(f"  {'target':13s} {'prec':5s} {'method':6s} {'fp32 top1':>9s} {'top1':>7s} {'drop pts':>8s} {'agree':>6s} "
          f"{'cosine':>8s} {'ms':>7s} {'fp32 ms':>7s} {'ran':>5s} exit")
    for target, precision, method, ref, top1, agree, cos, ms, fp32_ms, ran, code in rows:
        print(f"  {target:13s} {precision:5s} {method:6s} {ref:9.4f} {top1:7.4f} {(ref - top1) * 100:8.2f} {agree:6.4f} "
              f"{cos:8.5f} {ms:7.3f} {fp32_ms:7.3f} {ran:>5s} {code}")
    print("  targets: top-1 drop <= 1 point, cosine >= 0.995, OpenVINO int8 faster than fp32")
    interleaved(data, {key[2] or "-": path for key, path in bundles.items() if key[0] == "openvino_cpu"})


def interleaved(data: Path, bundles: dict, rounds: int = 5, runs: int = 200) -> None:
    """OpenVINO bundles timed in turns, so that a busy neighbour on the machine slows them all
    alike: the median over rounds of each round's median single-sample latency."""
    import statistics

    import yaml

    from pipeline.backends import openvino

    sessions = {}
    for method, bundle in bundles.items():
        settings = yaml.safe_load((bundle / "runtime.yaml").read_text())
        sessions[method] = openvino.load(bundle, settings)
    feeds = next(iter(validation_split(data, 1))).feeds
    times = {method: [] for method in sessions}
    for _ in range(rounds):
        for method, session in sessions.items():
            for _ in range(20):
                session.run(feeds)
            samples = []
            for _ in range(runs):
                started = time.perf_counter()
                session.run(feeds)
                samples.append((time.perf_counter() - started) * 1000)
            times[method].append(statistics.median(samples))
    fp32 = statistics.median(times["-"])
    print(f"  OpenVINO bundles timed in turns ({rounds} rounds x {runs} runs): fp32 {fp32:.3f} ms, " + ", ".join(
        f"int8 {m} {statistics.median(t):.3f} ms ({statistics.median(t) / fp32:.2f}x)"
        for m, t in times.items() if m != "-"))


def validation_split(data: Path, count: int):
    """The validation images preprocessed as classifier_args declares."""
    from pipeline.config.schemas import Color, DataConfig, DataKind, PreprocessConfig
    from pipeline.data import TensorSpec, open_dataset

    pre = PreprocessConfig(keep_aspect=True, color=Color.bgr, mean=[0.5], std=[0.5])
    return open_dataset(DataConfig(kind=DataKind.images, path=str(data), validation_size=count, preprocess=pre),
                        [TensorSpec("x", [1, 3, 48, 192], "float32")]).validation


def fragile(data: Path, validation: int) -> None:
    """How many validation images a small output change can flip: the distinct images, and
    those whose fp32 top-2 probabilities differ by less than 0.1 (one flip = 100/N points)."""
    import hashlib

    import numpy as np
    import onnxruntime as ort

    session = ort.InferenceSession(str(MODEL), providers=["CPUExecutionProvider"])
    margins, digests = [], set()
    for sample in validation_split(data, validation):
        digests.add(hashlib.sha256(sample.feeds["x"].tobytes()).hexdigest())
        top2 = np.sort(session.run(None, sample.feeds)[0].ravel())[-2:]
        margins.append(top2[1] - top2[0])
    close = int(np.sum(np.asarray(margins) < 0.1))
    print(f"  {len(margins)} images, {len(digests)} distinct; {close} with an fp32 top-2 margin < 0.1 "
          f"(each flip: {100 / len(margins):.2f} points)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=100)
    parser.add_argument("--validation", type=int, default=400)
    parser.add_argument("--skip-ort", action="store_true", help="skip ONNX Runtime's (slow) entropy calibrator")
    parser.add_argument("--only", choices=("speed", "memory", "accuracy"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="parity-bench-") as scratch:
        work = Path(scratch)
        data = work / "textlines"
        print(f"rendering {max(512, args.validation)} text lines ...", flush=True)
        write_dataset(data, calibration=512, validation=args.validation)
        if args.only in (None, "speed"):
            speed(work, data, args.samples, args.skip_ort)
        if args.only in (None, "memory"):
            memory(work, data)
        if args.only in (None, "accuracy"):
            accuracy(work, data, args.validation)


if __name__ == "__main__":
    main()
