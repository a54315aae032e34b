"""Verify's scoring beside a running worker: one BLAS thread against OpenBLAS's default.

    python benchmarks/scoring_threads.py [--rounds 5] [--samples 20]

While verify compares a sample's outputs (pipeline/verification/metrics.py: float64 dot
products per 32 Ki-value slice), the target's worker runs the next sample on the same cores
with its runtime's threads spinning. This times that scoring on the real-size segmenter's
seven 320x320 maps (tests/assets/u2netp_320.onnx) beside a separate process running the
model on 2 ONNX Runtime threads, in interleaved rounds: BLAS at its default thread count
against one thread (what stages/verify sets with threadpoolctl), and alone for reference.
Figures: ms a sample, median of round medians; the ratio is the figure, taken in one run.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
from threadpoolctl import threadpool_limits

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from pipeline.environment import cpu  # noqa: E402
from pipeline.verification.metrics import OutputStats  # noqa: E402

MODEL = REPO / "tests" / "assets" / "u2netp_320.onnx"
BESIDE = """
import sys
import numpy as np, onnxruntime as ort
options = ort.SessionOptions(); options.intra_op_num_threads = 2
session = ort.InferenceSession(sys.argv[1], options, providers=["CPUExecutionProvider"])
feeds = {session.get_inputs()[0].name: np.random.default_rng(0).standard_normal((1, 3, 320, 320), np.float32)}
print("ready", flush=True)
while True:
    session.run(None, feeds)
"""


def outputs() -> tuple:
    """The model's outputs on one input, and the same with int8-sized noise."""
    session = ort.InferenceSession(str(MODEL), providers=["CPUExecutionProvider"])
    feeds = {session.get_inputs()[0].name: np.random.default_rng(1).standard_normal((1, 3, 320, 320), np.float32)}
    reference = session.run(None, feeds)
    noise = np.random.default_rng(2)
    return reference, [out + noise.normal(0, 1e-3, out.shape).astype(np.float32) for out in reference]


def score_ms(reference, actual, samples: int, blas_threads) -> float:
    """Milliseconds a sample to score the seven maps (median over ``samples``)."""
    times = []
    with threadpool_limits(limits=blas_threads, user_api="blas"):
        for _ in range(samples):
            started = time.perf_counter()
            for ref, out in zip(reference, actual):
                OutputStats().update(ref, out)
            times.append(1000 * (time.perf_counter() - started))
    return float(np.median(times))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--samples", type=int, default=20)
    args = parser.parse_args()
    reference, actual = outputs()
    alone = [score_ms(reference, actual, args.samples, None) for _ in range(args.rounds)]
    beside = subprocess.Popen([sys.executable, "-c", BESIDE, str(MODEL)], stdout=subprocess.PIPE, text=True)
    try:
        beside.stdout.readline()  # its model loaded and running
        time.sleep(1.0)
        rounds = {"default": [], "one": []}
        for index in range(args.rounds):
            for name in (("default", "one") if index % 2 == 0 else ("one", "default")):
                rounds[name].append(score_ms(reference, actual, args.samples, None if name == "default" else 1))
    finally:
        beside.kill()
    default, one = (float(np.median(rounds[name])) for name in ("default", "one"))
    print(f"CPU: {cpu()['model']}; flags: {' '.join(cpu()['flags'])}")
    print(f"scoring a sample (7 maps of 320x320), median of {args.rounds} rounds of {args.samples} samples:")
    print(f"  alone, BLAS default threads:                    {float(np.median(alone)):7.2f} ms")
    print(f"  beside a 2-thread ONNX Runtime process, default: {default:7.2f} ms")
    print(f"  beside it, one BLAS thread (verify's setting):   {one:7.2f} ms  ({default / one:.2f}x faster)")


if __name__ == "__main__":
    main()
