"""Task-metric figures on the real PP-OCRv4 recognizer (rapidocr-onnxruntime's wheel).

    python benchmarks/metrics.py [--samples 200] [--precision int8]

1. metric overhead: `parity` with metric=ctc on N rendered text lines (labels: the texts),
   verify's stage time from the report; then the scoring verify did (the reference, the
   shipped build and the fp32 side-by-side build, in TaskScorer batches) timed alone on
   the same outputs. Target: <= 5 % of verify's time.
2. instantiating a custom metric (a class in a file outside the package) in a fresh
   process: its time and the runtimes imported (none), next to loading the model into
   an ONNX Runtime session, which it must not do.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from textlines import FONTS, WORDS, render  # noqa: E402

import importlib.resources  # noqa: E402

REC = importlib.resources.files("rapidocr_onnxruntime") / "models" / "ch_PP-OCRv4_rec_infer.onnx"
CUSTOM = "import numpy as np\n\nclass Distance:\n    higher_is_better = False\n\n" \
         "    def __call__(self, outputs, reference, labels):\n" \
         "        return np.abs(outputs - reference).reshape(len(outputs), -1).mean(axis=1)\n"


def write_lines(folder: Path, count: int, seed: int) -> None:
    """`count` distinct two-word lines (labels: the texts)."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True)
    rows = ["sample,label"]
    for index in range(count):
        text = " ".join(rng.choice(WORDS, size=2, replace=False))
        render(text, int(rng.integers(26, 35)), FONTS[index % len(FONTS)]).save(folder / f"{index:04d}.png")
        rows.append(f"{index:04d}.png,{text}")
    (folder / "labels.csv").write_text("\n".join(rows) + "\n", encoding="utf-8")


def charset(work: Path) -> Path:
    metadata = {p.key: p.value for p in onnx.load(str(REC), load_external_data=False).metadata_props}
    path = work / "charset.txt"
    path.write_text(metadata["character"] + "\n \n", encoding="utf-8")
    return path


def overhead(work: Path, samples: int, precision: str) -> None:
    data = work / "lines"
    write_lines(data / "calibration", 16, seed=1)
    write_lines(data / "validation", samples, seed=2)
    keys = charset(work)
    args = [f"model.path={REC}", "+model.input_shapes.x=[1,3,48,320]", "data.kind=images", f"data.path={data}",
            "data.preprocess.keep_aspect=true", "data.preprocess.color=bgr", "data.preprocess.mean=[0.5]",
            "data.preprocess.std=[0.5]", f"precision={precision}", "calibration=max", "metric=ctc",
            f"metric.charset={keys}", "validation.min_cosine=null", "validation.max_metric_drop=1",
            "validation.layerwise=off", "pipeline.stages=[convert,calibrate,build,verify]"]
    subprocess.run([sys.executable, "-m", "pipeline", *args], cwd=work, check=True, capture_output=True)
    run = sorted((work / "outputs").glob("*/*"))[-1]
    report = json.loads((run / "report.json").read_text())
    verify_s = next(s for s in report["stages"] if s["stage"] == "verify")["seconds"]
    task = report["verify"]["task"]
    builds = 1 + len(report["verify"]["comparison"])  # the reference, the shipped build, the baselines
    seconds = time_scoring(run, data / "validation", keys, builds)
    print(f"== 1. metric=ctc on {samples} lines, {precision} (ort_cpu) ==")
    print(f"  char accuracy fp32 {task['reference']:.4f}, {precision} {task['target']:.4f}; exact match "
          f"{task['extras']['exact_match']['reference']:.4f} / {task['extras']['exact_match']['target']:.4f}")
    print(f"  verify stage {verify_s:.2f} s; scoring {builds} builds (reference + {builds - 1}) {seconds:.3f} s "
          f"= {100 * seconds / verify_s:.2f} % of verify   (target <= 5 %)")


def time_scoring(run: Path, folder: Path, keys: Path, builds: int) -> float:
    """TaskScorer as verify runs it, on the reference's real outputs for every sample
    (each build scored against them: the same work as different outputs)."""
    import onnxruntime as ort

    from pipeline.config.schemas import Color, PreprocessConfig
    from pipeline.data import TensorSpec, load_image
    from pipeline.task_metrics import load_metric
    from pipeline.verification.scoring import TaskScorer

    session = ort.InferenceSession(str(run / "stages" / "convert" / "model.onnx"), providers=["CPUExecutionProvider"])
    spec = TensorSpec("x", [1, 3, 48, 320], "float32")
    pre = PreprocessConfig(keep_aspect=True, color=Color.bgr, mean=[0.5], std=[0.5])
    labels = dict(line.split(",", 1) for line in (folder / "labels.csv").read_text().splitlines()[1:])
    outputs = [(session.run(None, {"x": load_image(path, spec, pre)})[0], labels[path.name])
               for path in sorted(folder.glob("*.png"))]
    metric = load_metric({"_target_": "pipeline.task_metrics.CTC", "charset": str(keys)})
    started = time.perf_counter()
    scorer = TaskScorer(metric, "y")
    for output, label in outputs:
        scorer.active(label)
        scorer.add("reference", output, output, label)
        for build in range(builds - 1):
            scorer.add(f"build{build}", output, output, label)
    scorer.finish()
    scorer.result("build0", 0.01)
    return time.perf_counter() - started


def instantiation(work: Path) -> None:
    (work / "user").mkdir()
    (work / "user" / "usermetrics.py").write_text(CUSTOM)
    code = ("import sys, time; from pipeline.task_metrics import load_metric; t = time.perf_counter(); "
            f"load_metric({{'_target_': 'usermetrics.Distance', 'path': {str(work / 'user')!r}}}); "
            "print(time.perf_counter() - t, [m for m in ('onnxruntime', 'openvino', 'ncnn', 'MNN', 'onnx') "
            "if m in sys.modules])")
    seconds, loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                     check=True).stdout.split(" ", 1)
    import onnxruntime as ort

    started = time.perf_counter()
    ort.InferenceSession(str(REC), providers=["CPUExecutionProvider"])
    model_s = time.perf_counter() - started
    print("== 2. instantiating a custom metric (fresh process) ==")
    print(f"  load_metric: {float(seconds) * 1000:.1f} ms, runtimes imported: {loaded.strip()}; "
          f"loading the recognizer into ONNX Runtime: {model_s * 1000:.0f} ms")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=200)
    parser.add_argument("--precision", default="int8")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="parity-metrics-") as scratch:
        overhead(Path(scratch), args.samples, args.precision)
        instantiation(Path(scratch))


if __name__ == "__main__":
    main()
