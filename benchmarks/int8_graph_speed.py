"""parity's int8 graph against ONNX Runtime's own quantizer's graph of the same model, on ONNX
Runtime, in one run (issue 55, item 3: "parity's all-int8 graph runs at least as fast as
the runtime's own quantizer's graph").

    python benchmarks/int8_graph_speed.py [--rounds 5] [--images 8]

Model: the real-size segmenter (tests/assets/u2netp_320.onnx: U^2-Net-p, 119 convolutions
at 320x320) with 16 calibration and 40 validation photos (tests/segmenter_data.py).
Builds:
- fp32: the model as it is (the reference of every ratio);
- parity int8: `parity precision=int8 pipeline.stages=[convert,calibrate,sensitivity,build]`
  (the default job's int8 build: calibration=auto, equalization, weight rounding, bias
  correction where they pay, and the pass-through ops);
- parity int8 without pass-through: the same with `precision.passthrough_ops=[]` (Q/DQ at
  the convolutions only, as before issue 55), from the same stage cache;
- ONNX Runtime quantize_static: QDQ, MinMax, per-channel int8 weights, uint8 activations,
  its default op list, on the same calibration photos.
Timing: one ONNX Runtime session per build, 2 intra-op threads, `--rounds` interleaved
rounds (order alternated), each build runs `--images` validation images a round; the
figure is the median of round medians and the per-round ratio to fp32 (p25-p75).
Accuracy: map IoU at 0.5 of the fused map against fp32's, mean over the 40 images.
The CPU's int8-relevant flags are printed with the result.
"""

from __future__ import annotations

import argparse
import json
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
from segmenter_data import (CALIBRATION_SEED, MEAN, REAL_FUSED_OUTPUT, REAL_MODEL, REAL_SIZE, STD,  # noqa: E402
                            VALIDATION_SEED, crops, photos)


def samples(count: int, seed: int) -> np.ndarray:
    images = photos()
    return np.stack([((crop / 255.0 - np.array(MEAN)) / np.array(STD)).transpose(2, 0, 1).astype(np.float32)
                     for crop in crops(images, count, seed, REAL_SIZE)])


def parity_build(work: Path, data: Path, extra: list) -> Path:
    args = [str(Path(sys.executable).parent / "parity"), f"model.path={REAL_MODEL}", "data.kind=tensors",
            f"data.path={data}", "metric=map_iou", f"metric.output='{REAL_FUSED_OUTPUT}'", "precision=int8",
            "pipeline.stages=[convert,calibrate,sensitivity,build]", "target.threads=2", *extra]
    started = time.perf_counter()
    done = subprocess.run(args, cwd=work, capture_output=True, text=True, env={**os.environ, "NO_COLOR": "1"})
    runs = sorted((work / "outputs").glob("*/*_*"), key=lambda p: p.stat().st_mtime)
    model = runs[-1] / "stages" / "build" / "model.onnx" if runs else None
    if model is None or not model.is_file():
        raise SystemExit(f"parity failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    print(f"  parity {' '.join(extra) or '(defaults)'}: {time.perf_counter() - started:.1f} s")
    return model


def ort_static(calibration: np.ndarray, out: Path) -> Path:
    from onnxruntime import quantization as q

    class Reader(q.CalibrationDataReader):
        def __init__(self):
            self.items = iter([{"input": sample[None]} for sample in calibration])

        def get_next(self):
            return next(self.items, None)

    started = time.perf_counter()
    q.quantize_static(str(REAL_MODEL), str(out), Reader(), quant_format=q.QuantFormat.QDQ, per_channel=True,
                      activation_type=q.QuantType.QUInt8, weight_type=q.QuantType.QInt8,
                      calibrate_method=q.CalibrationMethod.MinMax)
    print(f"  ONNX Runtime quantize_static: {time.perf_counter() - started:.1f} s")
    return out


def timed(builds: dict, validation: np.ndarray, rounds: int, images: int) -> dict:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = 2, 1
    sessions = {name: ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
                for name, path in builds.items()}
    for session in sessions.values():
        session.run(None, {"input": validation[:1]})
    medians = {name: [] for name in sessions}
    for number in range(rounds):
        order = list(sessions) if number % 2 == 0 else list(reversed(sessions))
        for name in order:
            times = []
            for x in validation[:images]:
                started = time.perf_counter()
                sessions[name].run(None, {"input": x[None]})
                times.append(time.perf_counter() - started)
            medians[name].append(float(np.median(times)))
    maps = {name: [session.run(None, {"input": x[None]})[0] for x in validation] for name, session in sessions.items()}
    result = {}
    for name in sessions:
        ratios = np.array(medians["fp32"]) / np.array(medians[name])
        ious = [_iou(a, b) for a, b in zip(maps[name], maps["fp32"])]
        result[name] = {"ms": 1000 * float(np.median(medians[name])), "speedup": float(np.median(ratios)),
                        "p25": float(np.percentile(ratios, 25)), "p75": float(np.percentile(ratios, 75)),
                        "iou": float(np.mean(ious))}
    return result


def _iou(a: np.ndarray, b: np.ndarray, threshold: float = 0.5) -> float:
    x, y = a > threshold, b > threshold
    union = (x | y).sum()
    return 1.0 if union == 0 else float((x & y).sum() / union)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--images", type=int, default=8)
    args = parser.parse_args()
    from pipeline.environment import cpu

    info = cpu()
    print(f"CPU: {info.get('model')}; flags: {' '.join(info.get('flags', []))}")
    calibration, validation = samples(16, CALIBRATION_SEED), samples(40, VALIDATION_SEED)
    with tempfile.TemporaryDirectory(prefix="parity-int8-speed-") as scratch:
        work = Path(scratch)
        data = work / "data.npz"
        np.savez(data, **{"calibration/input": calibration, "validation/input": validation})
        builds = {"fp32": REAL_MODEL,
                  "parity int8": parity_build(work, data, []),
                  "parity int8, no pass-through": parity_build(work, data, ["precision.passthrough_ops=[]"]),
                  "ONNX Runtime quantize_static": ort_static(calibration, work / "ort_static.onnx")}
        result = timed(builds, validation, args.rounds, args.images)
    print(f"\n{'build':32s} {'ms':>8s} {'speed-up vs fp32 (p25-p75)':>28s} {'IoU@0.5 vs fp32':>16s}")
    for name, row in result.items():
        print(f"{name:32s} {row['ms']:8.1f} {row['speedup']:>10.2f}x ({row['p25']:.2f}-{row['p75']:.2f}) "
              f"{row['iou']:16.3f}")
    ours, theirs = result["parity int8"]["speedup"], result["ONNX Runtime quantize_static"]["speedup"]
    print(f"\nparity int8 / ONNX Runtime's own int8 graph, speed: {ours / theirs:.2f} (goal >= 1.0); "
          f"parity int8 speed-up {ours:.2f}x (goal >= 1.5x)")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
