"""Bias correction's measurement on the real-size segmenter: shifts read off the inputs'
patch means against every op run twice.

    python benchmarks/bias_correction_means.py [--rounds 3] [--samples 8]

tests/assets/u2netp_320.onnx (119 convolutions at 320x320) is prepared and quantized with
a max table from its calibration photos (benchmarks/time_to_bundle.seg_samples); then
``bias_correction.measure`` runs on ``--samples`` of them (what the build measures on this
model: bias_correction.sized_runs), once with the per-op shifts read off the patch means
(pipeline/precision/calibration/input_means.py) and once with every op run twice in ONNX
Runtime (fp32 and with its Q/DQ nodes), in interleaved rounds. Prints the median seconds
of each, their ratio (the figure, taken in one run), the largest difference between the two
shifts, and the CPU's flags.
"""

from __future__ import annotations

import argparse
import statistics as stats
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from pipeline.data import Sample  # noqa: E402
from pipeline.environment import cpu, own_threads  # noqa: E402
from pipeline.precision.calibration import bias_correction, input_means, statistics, tables  # noqa: E402
from pipeline.precision.prepare import prepare  # noqa: E402
from pipeline.precision.quantize import QdqSettings, quantize_static_qdq  # noqa: E402
from time_to_bundle import seg_samples  # noqa: E402

MODEL = REPO / "tests" / "assets" / "u2netp_320.onnx"


def built(work: Path, count: int) -> tuple:
    """(prepared model, its int8 QDQ model, ``count`` calibration samples)."""
    calibration, _ = seg_samples(work, 16, 1)
    prepare(MODEL, work / "prepared.onnx")
    samples = [{"input": calibration[i:i + 1]} for i in range(len(calibration))]
    collected = statistics.collect(work / "prepared.onnx", [Sample(str(i), s) for i, s in enumerate(samples)],
                                   len(samples), 2048, 4, 0)
    prepared = onnx.load(str(work / "prepared.onnx"))
    quantized = quantize_static_qdq(prepared, tables.build_table(collected.histograms, "max"), QdqSettings())
    return prepared, quantized, samples[:count]


def measured(prepared, quantized, samples, read_off: bool) -> tuple:
    """(seconds, {op: shift}) of one measurement."""
    ops, _ = bias_correction.quantized_ops(quantized, prepared)
    batches = bias_correction.sample_batches(samples, len(samples), bias_correction.batch_size_for(
        prepared, [op.source for op in ops]))
    original = input_means.PatchMeans.of
    if not read_off:
        input_means.PatchMeans.of = classmethod(lambda cls, op, constants: None)
    try:
        started = time.perf_counter()
        bias_correction.measure(ops, quantized, prepared, batches)
        seconds = time.perf_counter() - started
    finally:
        input_means.PatchMeans.of = original
    return seconds, {op.node.name: op.shift for op in ops}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--samples", type=int, default=8)
    args = parser.parse_args()
    found = cpu()
    print(f"CPU: {found['model']}; flags: {' '.join(found['flags'])}; threads: {own_threads()}")
    with tempfile.TemporaryDirectory() as scratch:
        prepared, quantized, samples = built(Path(scratch), args.samples)
    seconds = {"patch means": [], "ops run twice": []}
    shifts = {}
    for round_index in range(args.rounds):
        order = list(seconds) if round_index % 2 == 0 else list(reversed(seconds))
        for name in order:
            took, shifts[name] = measured(prepared, quantized, samples, read_off=name == "patch means")
            seconds[name].append(took)
    worst = max(float(np.abs(shifts["patch means"][op] - shifts["ops run twice"][op]).max()
                      / max(np.abs(shifts["ops run twice"][op]).max(), 1e-12)) for op in shifts["ops run twice"])
    medians = {name: stats.median(values) for name, values in seconds.items()}
    print(f"{len(samples)} calibration samples, {len(shifts['ops run twice'])} ops, {args.rounds} interleaved rounds")
    for name, median in medians.items():
        print(f"  {name}: {median:.2f} s (rounds {', '.join(f'{v:.2f}' for v in seconds[name])})")
    print(f"  ratio: {medians['ops run twice'] / medians['patch means']:.2f}x; largest shift difference "
          f"{worst:.2e} of the op's largest shift")


if __name__ == "__main__":
    main()
