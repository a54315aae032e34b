"""int8 builds of the real-size YOLOv8n-architecture detector judged as detections, in one run
(issue 56): parity's int8 beside ONNX Runtime's quantize_static and NNCF's quantize, default
and with the trainer's own ignored scope.

    pip install -e .[bench]
    python benchmarks/detector_int8.py [--rounds 5] [--images 8]

Model: tests/assets/yolov8n_320.onnx (scripts/train_yolo.py), 16 calibration and 40
validation photos of tests/detector_data.py at 320x320.
Builds, each timed against its own runtime's fp32 (2 threads, OpenVINO's in f32 as parity asks, `--rounds` interleaved rounds
of `--images` images, median of round medians, the per-round ratio's p25-p75):
- ONNX Runtime: fp32; parity int8 (`parity precision=int8 metric=detection target=ort_cpu`,
  its build stage); `quantize_static` (QDQ, MinMax, per-channel int8 weights, uint8
  activations, its default op list);
- OpenVINO: fp32; parity int8 (`target=openvino_cpu`); NNCF `quantize` (default); NNCF with
  the ignored scope the trainer's exporter gives it (MIXED preset; the head's Add, Sub, Mul,
  Div, every Sigmoid and the DFL ops ignored).
Judged against fp32's detections of the same runtime: the class rows' cosine; mAP@0.5 over
the 40 photos of the build's boxes down to conf 0.001 against fp32's at 0.25 (one ranking
over all photos per class, COCO's 101 points, as a validation run scores it); mAP@0.5 of the
boxes cut at 0.25 (what the application shows); the per-image F1 at 0.25 (parity's
metric=detection). The CPU's int8-relevant flags are printed with the result.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))
from detector_data import CALIBRATION_SEED, DETECTOR, VALIDATION_SEED, scenes, to_input  # noqa: E402
from pipeline.detection_metric import Detection, f1, matches  # noqa: E402

INPUT = "images"


def photos(count: int, seed: int) -> np.ndarray:
    return np.concatenate([to_input(image) for image, _ in scenes(count, seed)])


def parity_build(work: Path, data: Path, target: str) -> Path:
    args = [str(Path(sys.executable).parent / "parity"), f"model.path={DETECTOR}", "data.kind=tensors",
            f"data.path={data}", "metric=detection", "precision=int8", f"target={target}",
            "pipeline.stages=[convert,calibrate,sensitivity,build]", "target.threads=2"]
    started = time.perf_counter()
    done = subprocess.run(args, cwd=work, capture_output=True, text=True, env={**os.environ, "NO_COLOR": "1"})
    runs = sorted((work / "outputs").glob("*/*_*"), key=lambda p: p.stat().st_mtime)
    folder = runs[-1] / "stages" / "build" if runs else None
    found = sorted(folder.glob("*.xml" if target == "openvino_cpu" else "model.onnx")) if folder else []
    if not found:
        raise SystemExit(f"parity failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    print(f"  parity int8 {target}: {time.perf_counter() - started:.1f} s")
    return found[0]


def ort_static(calibration: np.ndarray, out: Path) -> Path:
    from onnxruntime import quantization as q

    class Reader(q.CalibrationDataReader):
        def __init__(self):
            self.items = iter([{INPUT: sample[None]} for sample in calibration])

        def get_next(self):
            return next(self.items, None)

    started = time.perf_counter()
    q.quantize_static(str(DETECTOR), str(out), Reader(), quant_format=q.QuantFormat.QDQ, per_channel=True,
                      activation_type=q.QuantType.QUInt8, weight_type=q.QuantType.QInt8,
                      calibrate_method=q.CalibrationMethod.MinMax)
    print(f"  ONNX Runtime quantize_static: {time.perf_counter() - started:.1f} s")
    return out


def nncf_builds(calibration: np.ndarray, work: Path) -> dict:
    """NNCF's default quantize, and the one the trainer's exporter runs (its ignored scope)."""
    import nncf
    import openvino as ov

    model = ov.Core().read_model(str(DETECTOR))
    model.reshape({INPUT: [1, 3, 320, 320]})
    dataset = nncf.Dataset([sample[None] for sample in calibration])
    head = [op.get_friendly_name() for op in model.get_ops()
            if op.get_type_name() in ("Add", "Subtract", "Multiply", "Divide", "Sigmoid")
            or "dfl" in op.get_friendly_name().lower()]
    found = {}
    for name, extra in (("NNCF quantize", {}),
                        ("NNCF, the trainer's ignored scope", {
                            "preset": nncf.QuantizationPreset.MIXED,
                            "ignored_scope": nncf.IgnoredScope(names=head, validate=False)})):
        started = time.perf_counter()
        quantized = nncf.quantize(model, dataset, subset_size=len(calibration), **extra)
        path = work / f"{name.split(',')[0].replace(' ', '_')}_{len(found)}.xml"
        ov.save_model(quantized, str(path))
        print(f"  {name}: {time.perf_counter() - started:.1f} s")
        found[name] = path
    return found


def ort_runner(path: Path):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = 2, 1
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return lambda x: session.run(None, {INPUT: x})[0]


def ov_runner(path: Path):
    import openvino as ov

    core = ov.Core()
    model = core.read_model(str(path))
    model.reshape({model.inputs[0].get_any_name(): [1, 3, 320, 320]})
    # f32 as parity's builds ask: on a CPU with avx512_bf16 or AMX OpenVINO would run "fp32" in bf16
    compiled = core.compile_model(model, "CPU", {"INFERENCE_NUM_THREADS": 2, "PERFORMANCE_HINT": "LATENCY",
                                                 "INFERENCE_PRECISION_HINT": "f32"})
    request = compiled.create_infer_request()
    return lambda x: next(iter(request.infer({0: x}).values())).copy()


def timed(runners: dict, validation: np.ndarray, rounds: int, images: int) -> dict:
    """Per build: median ms and the per-round speed-up against the first build (fp32)."""
    for run in runners.values():
        run(validation[:1])
    medians = {name: [] for name in runners}
    for number in range(rounds):
        for name in (list(runners) if number % 2 == 0 else list(reversed(runners))):
            times = []
            for x in validation[:images]:
                started = time.perf_counter()
                runners[name](x[None])
                times.append(time.perf_counter() - started)
            medians[name].append(float(np.median(times)))
    base = np.array(next(iter(medians.values())))
    return {name: {"ms": 1000 * float(np.median(m)), "speedup": float(np.median(base / np.array(m))),
                   "p25": float(np.percentile(base / np.array(m), 25)),
                   "p75": float(np.percentile(base / np.array(m), 75))} for name, m in medians.items()}


def dataset_ap(found: list, expected: list, match_iou: float = 0.5) -> float:
    """mAP@match_iou over the photos: per class, every photo's boxes ranked together."""
    classes = sorted({int(c) for rows in expected for c in rows[:, 5]})
    aps = []
    for kind in classes:
        hits, scores, total = [], [], 0
        for mine, theirs in zip(found, expected):
            mine, theirs = mine[mine[:, 5] == kind], theirs[theirs[:, 5] == kind]
            total += len(theirs)
            order = np.argsort(-mine[:, 4], kind="stable")
            hits += list(matches(mine[order], theirs, match_iou))
            scores += list(mine[order, 4])
        if not total:
            continue
        order = np.argsort(-np.array(scores), kind="stable")
        true = np.cumsum(np.array(hits, dtype=float)[order]) if hits else np.zeros(0)
        if not len(true):
            aps.append(0.0)
            continue
        precision, recall = true / np.arange(1, len(true) + 1), true / total
        envelope = np.maximum.accumulate(precision[::-1])[::-1]
        at = np.searchsorted(recall, np.linspace(0, 1, 101), side="left")
        aps.append(float(np.mean(np.where(at < len(envelope), envelope[np.minimum(at, len(envelope) - 1)], 0.0))))
    return float(np.mean(aps)) if aps else 1.0


def judged(runners: dict, validation: np.ndarray) -> dict:
    """Per build, against the first (fp32) build's detections at conf 0.25."""
    metric = Detection()
    heads = {name: [run(x[None])[0] for x in validation] for name, run in runners.items()}
    reference = heads[next(iter(heads))]
    expected = [metric.detect(head, 0.25) for head in reference]
    result = {}
    for name, outputs in heads.items():
        scores = np.concatenate([h[4:].ravel() for h in outputs]).astype(np.float64)
        truth = np.concatenate([h[4:].ravel() for h in reference]).astype(np.float64)
        norm = np.sqrt((scores @ scores) * (truth @ truth))
        result[name] = {"class_cosine": float(scores @ truth / norm) if norm else 0.0,  # all scores zero: 0
                        "map_low": dataset_ap([metric.detect(h, 0.001) for h in outputs], expected),
                        "map_cut": dataset_ap([metric.detect(h, 0.25) for h in outputs], expected),
                        "f1": float(np.mean([f1(metric.detect(h, 0.25), e, 0.5) for h, e in zip(outputs, expected)]))}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--images", type=int, default=8)
    args = parser.parse_args()
    from pipeline.environment import cpu

    info = cpu()
    print(f"CPU: {info.get('model')}; flags: {' '.join(info.get('flags', []))}")
    calibration, validation = photos(16, CALIBRATION_SEED), photos(40, VALIDATION_SEED)
    with tempfile.TemporaryDirectory(prefix="parity-detector-") as scratch:
        work = Path(scratch)
        data = work / "data.npz"
        np.savez(data, **{f"calibration/{INPUT}": calibration, f"validation/{INPUT}": validation})
        on_ort = {"fp32": ort_runner(DETECTOR), "parity int8": ort_runner(parity_build(work, data, "ort_cpu")),
                  "quantize_static": ort_runner(ort_static(calibration, work / "ort_static.onnx"))}
        on_ov = {"fp32": ov_runner(DETECTOR), "parity int8": ov_runner(parity_build(work, data, "openvino_cpu")),
                 **{name: ov_runner(path) for name, path in nncf_builds(calibration, work).items()}}
        for runtime, runners in (("ONNX Runtime", on_ort), ("OpenVINO", on_ov)):
            speed, accuracy = timed(runners, validation, args.rounds, args.images), judged(runners, validation)
            print(f"\n{runtime}: {'build':34s} {'class rows cos':>14s} {'mAP@0.5 (0.001)':>16s} "
                  f"{'mAP@0.5 (0.25)':>15s} {'F1@0.25':>8s} {'speed-up vs fp32 (p25-p75)':>27s}")
            for name in runners:
                a, s = accuracy[name], speed[name]
                print(f"{'':{len(runtime) + 2}s}{name:34s} {a['class_cosine']:14.4f} {a['map_low']:16.3f} "
                      f"{a['map_cut']:15.3f} {a['f1']:8.3f} {s['speedup']:>14.2f}x ({s['p25']:.2f}-{s['p75']:.2f})")


if __name__ == "__main__":
    main()
