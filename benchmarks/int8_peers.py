"""What the int8 benchmarks of a real-size model share (int8_graph_speed.py, detector_int8.py):
the command line, the CPU line, parity's build stage run as a user runs it, ONNX Runtime's
quantize_static on the same calibration samples, sessions, and the interleaved timing."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))


def arguments(doc: str, sizes: bool = False) -> argparse.Namespace:
    """--rounds and --images, the options of every int8 benchmark (``sizes``: --size, the
    served input's side, too); prints the CPU's flags."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--images", type=int, default=8)
    if sizes:
        parser.add_argument("--size", type=int, default=320)
    args = parser.parse_args()
    from pipeline.environment import cpu

    info = cpu()
    print(f"CPU: {info.get('model')}; flags: {' '.join(info.get('flags', []))}")
    return args


def parity_build(work: Path, model_args: List[str], pattern: str = "model.onnx") -> Path:
    """``parity precision=int8`` up to build in ``work``: the build folder's file matching ``pattern``."""
    args = [str(Path(sys.executable).parent / "parity"), *model_args, "precision=int8",
            "pipeline.stages=[convert,calibrate,sensitivity,build]", "target.threads=2"]
    started = time.perf_counter()
    done = subprocess.run(args, cwd=work, capture_output=True, text=True, env={**os.environ, "NO_COLOR": "1"})
    runs = sorted((work / "outputs").glob("*/*_*"), key=lambda p: p.stat().st_mtime)
    found = sorted((runs[-1] / "stages" / "build").glob(pattern)) if runs else []
    if not found:
        raise SystemExit(f"parity failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    print(f"  parity {' '.join(model_args[-1:])}: {time.perf_counter() - started:.1f} s")
    return found[0]


def ort_static(model: Path, input_name: str, calibration: np.ndarray, out: Path) -> Path:
    """ONNX Runtime's own int8: QDQ, MinMax, per-channel int8 weights, uint8 activations, its op list."""
    from onnxruntime import quantization as q

    class Reader(q.CalibrationDataReader):
        def __init__(self):
            self.items = iter([{input_name: sample[None]} for sample in calibration])

        def get_next(self):
            return next(self.items, None)

    started = time.perf_counter()
    q.quantize_static(str(model), str(out), Reader(), quant_format=q.QuantFormat.QDQ, per_channel=True,
                      activation_type=q.QuantType.QUInt8, weight_type=q.QuantType.QInt8,
                      calibrate_method=q.CalibrationMethod.MinMax)
    print(f"  ONNX Runtime quantize_static: {time.perf_counter() - started:.1f} s")
    return out


def ort_runner(path: Path, input_name: str, output: int = 0) -> Callable[[np.ndarray], np.ndarray]:
    """One image -> the model's ``output``-th output, in a 2-thread ONNX Runtime session."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = 2, 1
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return lambda x: session.run(None, {input_name: x})[output]


def timed(runners: Dict[str, Callable], validation: np.ndarray, rounds: int, images: int) -> Dict[str, dict]:
    """Per build: median ms (median of round medians) and the per-round speed-up against the
    first build (fp32), median and p25-p75; rounds interleaved, their order alternated."""
    for run in runners.values():
        run(validation[:1])
    medians: Dict[str, list] = {name: [] for name in runners}
    for number in range(rounds):
        for name in (list(runners) if number % 2 == 0 else list(reversed(runners))):
            times = []
            for x in validation[:images]:
                started = time.perf_counter()
                runners[name](x[None])
                times.append(time.perf_counter() - started)
            medians[name].append(float(np.median(times)))
    base = np.array(next(iter(medians.values())))
    found = {}
    for name, own in medians.items():
        ratios = base / np.array(own)
        found[name] = {"ms": 1000 * float(np.median(own)), "speedup": float(np.median(ratios)),
                       "p25": float(np.percentile(ratios, 25)), "p75": float(np.percentile(ratios, 75))}
    return found
