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

import json
import tempfile
from pathlib import Path

import numpy as np

from int8_peers import arguments, ort_runner, ort_static, parity_build, timed
from segmenter_data import (CALIBRATION_SEED, MEAN, REAL_FUSED_OUTPUT, REAL_MODEL, REAL_SIZE, STD,  # noqa: E402
                            VALIDATION_SEED, crops, photos)


def samples(count: int, seed: int) -> np.ndarray:
    images = photos()
    return np.stack([((crop / 255.0 - np.array(MEAN)) / np.array(STD)).transpose(2, 0, 1).astype(np.float32)
                     for crop in crops(images, count, seed, REAL_SIZE)])


def _iou(a: np.ndarray, b: np.ndarray, threshold: float = 0.5) -> float:
    x, y = a > threshold, b > threshold
    union = (x | y).sum()
    return 1.0 if union == 0 else float((x & y).sum() / union)


def main() -> None:
    args = arguments(__doc__)
    calibration, validation = samples(16, CALIBRATION_SEED), samples(40, VALIDATION_SEED)
    with tempfile.TemporaryDirectory(prefix="parity-int8-speed-") as scratch:
        work = Path(scratch)
        data = work / "data.npz"
        np.savez(data, **{"calibration/input": calibration, "validation/input": validation})
        model_args = [f"model.path={REAL_MODEL}", "data.kind=tensors", f"data.path={data}", "metric=map_iou",
                      f"metric.output='{REAL_FUSED_OUTPUT}'"]
        builds = {"fp32": REAL_MODEL,
                  "parity int8": parity_build(work, model_args),
                  "parity int8, no pass-through": parity_build(work, [*model_args, "precision.passthrough_ops=[]"]),
                  "ONNX Runtime quantize_static": ort_static(REAL_MODEL, "input", calibration,
                                                             work / "ort_static.onnx")}
        runners = {name: ort_runner(path, "input") for name, path in builds.items()}  # output 0: the fused map
        result = timed(runners, validation, args.rounds, args.images)
        maps = {name: [run(x[None]) for x in validation] for name, run in runners.items()}
    for name in result:
        result[name]["iou"] = float(np.mean([_iou(a, b) for a, b in zip(maps[name], maps["fp32"])]))
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
