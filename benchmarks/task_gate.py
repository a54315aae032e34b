"""Task-first verdicts on a real model: PP-OCRv4 rec (rapidocr wheel) on openvino_cpu with
metric=ctc and the rendered lines' texts as labels, default thresholds (issue figures).

    pip install -e .[test,bench]
    python benchmarks/task_gate.py [--validation 200]

Rows, each a fresh folder (cold cache), 2 threads:
- `parity precision=int8` with a task metric (the drop gates, cosine is a 0.98 floor), and
  the same build with `metric=none` (min_cosine 0.995 gates): the verdicts side by side;
- `parity` (precision=auto) with the task metric: what it ships and its speed-up;
- fp32's character accuracy as parity's ctc metric scores it next to PaddleOCR's decoding
  (rapidocr's CTCLabelDecode, stripped, the same per-sample normalized edit distance);
- the bootstrap's cost (pipeline/verification/confidence.py on the int8 run's sample count) against the
  verify stage's seconds (goal <= 2 %).
Prints the CPU flags; absolute seconds are this machine's.
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
sys.path.insert(0, str(REPO / "benchmarks"))
from mixed import FILES, MODELS, charset, rec_samples  # noqa: E402

from pipeline.verification import confidence  # noqa: E402
from pipeline.environment import cpu  # noqa: E402


def parity(args, cwd: Path) -> tuple:
    """(seconds, exit code, report.json, console text) of one `parity` run in a fresh ``cwd``."""
    cwd.mkdir(parents=True)
    started = time.perf_counter()
    result = subprocess.run([str(Path(sys.executable).parent / "parity"), *map(str, args)], cwd=cwd,
                            capture_output=True, text=True, env={**os.environ, "NO_COLOR": "1", "COLUMNS": "160"})
    seconds = time.perf_counter() - started
    runs = sorted((cwd / "outputs").glob("*/*_*"))
    if not runs or not (runs[-1] / "report.json").exists():
        raise SystemExit(f"parity {' '.join(map(str, args))} failed:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}")
    return seconds, result.returncode, json.loads((runs[-1] / "report.json").read_text()), result.stdout


def verdict_line(name: str, seconds: float, code: int, report: dict) -> str:
    verify = report["verify"]
    output = verify["outputs"][0]
    task = verify.get("task") or {}
    gate = output["thresholds"]["min_cosine"]
    text = (f"  {name:<28} exit {code} ({seconds:.1f} s): cosine {output['metrics']['cosine']:.5f} gated at {gate}"
            f" ({output.get('cosine_gate')})")
    if task:
        low, high = task["interval"]
        text += (f"; ctc reference {task['reference']:.4f}, target {task['target']:.4f}, drop {task['drop']:.4f} "
                 f"(95 % CI {low:.4f} to {high:.4f}) <= {task['max_drop']}"
                 + (", uncertain" if task.get("uncertain") else ""))
    return text + (f"\n      reasons: {report['reasons']}" if report["reasons"] else "")


def paddle_agreement(validation: np.ndarray, truth: list, report: dict) -> str:
    """fp32's character accuracy: parity's figure (the report) next to PaddleOCR's decoding."""
    import onnxruntime as ort
    from rapidocr_onnxruntime.ch_ppocr_rec.utils import CTCLabelDecode

    from pipeline.task_metrics import char_accuracy

    session = ort.InferenceSession(str(MODELS / FILES["rec"]), providers=["CPUExecutionProvider"])
    decode = CTCLabelDecode(character=charset()[1:-1])
    texts = [decode(session.run(None, {"x": line[np.newaxis]})[0])[0][0].strip() for line in validation]
    theirs = float(np.mean([char_accuracy(text, label.strip()) for text, label in zip(texts, truth)]))
    ours = report["verify"]["task"]["reference"]
    return (f"  fp32 char accuracy: parity ctc {ours:.6f}, PaddleOCR decoding {theirs:.6f}, "
            f"difference {abs(ours - theirs):.2e} (goal <= 1e-4)")


def bootstrap_cost(samples: int, verify_seconds: float) -> str:
    rng = np.random.default_rng(0)
    reference, target = rng.random(samples), rng.random(samples)
    started = time.perf_counter()
    for _ in range(10):
        confidence.drop_interval(reference, target, True)
        confidence.rate_interval(target > 0.5)
    seconds = (time.perf_counter() - started) / 10
    return (f"  bootstrap (drop and agreement intervals, {samples} samples, {confidence.RESAMPLES} resamples): "
            f"{seconds * 1000:.1f} ms = {100 * seconds / verify_seconds:.3f} % of verify's {verify_seconds:.1f} s "
            "(goal <= 2 %)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calibration", type=int, default=64)
    parser.add_argument("--validation", type=int, default=200)
    args = parser.parse_args()
    info = cpu()
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; CPU {info['model']}; flags {' '.join(info['flags'])}")
    calibration, _ = rec_samples(args.calibration, seed=1)
    validation, truth = rec_samples(args.validation, seed=2)
    with tempfile.TemporaryDirectory(prefix="parity-gate-") as scratch:
        work = Path(scratch)
        data = work / "data.npz"
        np.savez(data, **{"calibration/x": calibration, "validation/x": validation,
                          "validation/labels": np.array(truth)})
        symbols = work / "charset.txt"
        symbols.write_text("\n".join(charset()[1:]) + "\n", encoding="utf-8")
        base = [f"model.path={MODELS / FILES['rec']}", "+model.input_shapes.x=[1,3,48,320]", "data.kind=tensors",
                f"data.path={data}", f"data.calibration_size={args.calibration}",
                f"data.validation_size={args.validation}", "target=openvino_cpu", "target.threads=2"]
        ctc = ["metric=ctc", f"metric.charset={symbols}"]
        rows = {}
        for name, extra in (("int8, metric=ctc", ["precision=int8", *ctc]),
                            ("int8, metric=none", ["precision=int8", "metric=none"]),
                            ("auto, metric=ctc", ctc)):
            rows[name] = parity(base + extra, work / name.replace(", ", "_").replace("=", "-"))
            print(verdict_line(name, rows[name][0], rows[name][1], rows[name][2]), flush=True)
        auto = rows["auto, metric=ctc"][2]
        speed = auto["verify"].get("speed") or {}
        chosen = (auto.get("auto") or {}).get("chosen")
        print(f"  auto shipped {chosen}: speed-up vs fp32 {(speed.get('speedups') or {}).get(speed.get('shipped'))}; "
              f"candidates: {[(c.get('precision'), c.get('verdict')) for c in (auto.get('auto') or {}).get('candidates', [])]}")
        print(paddle_agreement(validation, truth, rows["int8, metric=ctc"][2]))
        int8 = rows["int8, metric=ctc"][2]
        verify_seconds = next(s["seconds"] for s in int8["stages"] if s["stage"] == "verify")
        print(bootstrap_cost(int8["verify"]["samples"], verify_seconds))


if __name__ == "__main__":
    main()
