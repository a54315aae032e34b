"""int8 builds of the real-size YOLOv8n-architecture detector judged as detections, in one run
(issue 56): parity's int8 beside ONNX Runtime's quantize_static and NNCF's quantize, default
and with the trainer's own ignored scope.

    pip install -e .[bench]
    python benchmarks/detector_int8.py [--rounds 5] [--images 8] [--size 320]

Model: tests/assets/yolov8n_320.onnx (scripts/train_yolo.py; exported with dynamic axes, so
that `--size 640` serves the same network at 640x640, the trainer's default, [1, 7, 8400]),
16 calibration and 40 validation photos of tests/detector_data.py at that size.
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

import tempfile
import time
from pathlib import Path

import numpy as np

from int8_peers import arguments, ort_runner, ort_static, parity_build, timed
from detector_data import CALIBRATION_SEED, DETECTOR, VALIDATION_SEED, scenes, to_input  # noqa: E402
from pipeline.detection_metric import Detection, f1, matches, ranked_ap  # noqa: E402

INPUT = "images"


SIZE = [320]  # --size: the served input's side


def photos(count: int, seed: int) -> np.ndarray:
    return np.concatenate([to_input(image) for image, _ in scenes(count, seed, SIZE[0])])


def nncf_builds(calibration: np.ndarray, work: Path) -> dict:
    """NNCF's default quantize, and the one the trainer's exporter runs (its ignored scope)."""
    import nncf
    import openvino as ov

    model = ov.Core().read_model(str(DETECTOR))
    model.reshape({INPUT: [1, 3, SIZE[0], SIZE[0]]})
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
        path = work / f"nncf_{len(found)}.xml"
        ov.save_model(quantized, str(path))
        print(f"  {name}: {time.perf_counter() - started:.1f} s")
        found[name] = path
    return found


def ov_runner(path: Path):
    import openvino as ov

    core = ov.Core()
    model = core.read_model(str(path))
    model.reshape({model.inputs[0].get_any_name(): [1, 3, SIZE[0], SIZE[0]]})
    # f32 as parity's builds ask: on a CPU with avx512_bf16 or AMX OpenVINO would run "fp32" in bf16
    compiled = core.compile_model(model, "CPU", {"INFERENCE_NUM_THREADS": 2, "PERFORMANCE_HINT": "LATENCY",
                                                 "INFERENCE_PRECISION_HINT": "f32"})
    request = compiled.create_infer_request()
    return lambda x: next(iter(request.infer({0: x}).values())).copy()


def dataset_ap(found: list, expected: list, match_iou: float = 0.5) -> float:
    """mAP@match_iou over the photos: per class, every photo's boxes ranked together."""
    aps = []
    for kind in sorted({int(c) for rows in expected for c in rows[:, 5]}):
        hits, scores, total = [], [], 0
        for mine, theirs in zip(found, expected):
            mine, theirs = mine[mine[:, 5] == kind], theirs[theirs[:, 5] == kind]
            total += len(theirs)
            order = np.argsort(-mine[:, 4], kind="stable")
            hits += list(matches(mine[order], theirs, match_iou))
            scores += list(mine[order, 4])
        order = np.argsort(-np.array(scores), kind="stable")
        aps.append(ranked_ap(np.array(hits, dtype=bool)[order], total))
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
    args = arguments(__doc__, sizes=True)
    SIZE[0] = args.size
    print(f"input: [1, 3, {args.size}, {args.size}]")
    calibration, validation = photos(16, CALIBRATION_SEED), photos(40, VALIDATION_SEED)
    with tempfile.TemporaryDirectory(prefix="parity-detector-") as scratch:
        work = Path(scratch)
        data = work / "data.npz"
        np.savez(data, **{f"calibration/{INPUT}": calibration, f"validation/{INPUT}": validation})
        model_args = [f"model.path={DETECTOR}", "data.kind=tensors", f"data.path={data}", "metric=detection"]
        on_ort = {"fp32": ort_runner(DETECTOR, INPUT),
                  "parity int8": ort_runner(parity_build(work, [*model_args, "target=ort_cpu"]), INPUT),
                  "quantize_static": ort_runner(ort_static(DETECTOR, INPUT, calibration, work / "static.onnx"), INPUT)}
        on_ov = {"fp32": ov_runner(DETECTOR),
                 "parity int8": ov_runner(parity_build(work, [*model_args, "target=openvino_cpu"], "*.xml")),
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
