"""ncnn int8 vs ncnn fp32 on the PP-OCR text-direction classifier of the rapidocr wheel,
on the CPU with 1 thread: accuracy and latency side by side.

    pip install -e .[test,ncnn]       # rapidocr-onnxruntime ships the model; DejaVu fonts
    python benchmarks/ncnn_int8.py [--calibration 32] [--validation 64] [--rounds 15]

Data: rendered text lines, upright or rotated 180 degrees (tests/textlines.py), the
classifier's own preprocessing. Builds, through the `parity` CLI (stages up to build):
ncnn_cpu fp32 and ncnn_cpu int8 (parity's ncnn int8 format from the calibration table,
pipeline/backends/ncnn_int8.py). Printed: cosine of the int8 outputs vs the fp32 ones and
top-1 agreement over the validation lines; latency of both, timed interleaved in rounds
(pipeline/speed.py: order rotated, median of round medians, speed-up the median of the
per-round ratios with its quartiles); per layer type, each build's time from ncnn's
incremental extraction (the profile stage's method), which says where int8 wins or loses.
"""

from __future__ import annotations

import argparse
import importlib.resources
import json
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "benchmarks"))
from mixed import parity  # noqa: E402  (one `parity` run, its run folder)
from textlines import write_dataset  # noqa: E402

MODEL = importlib.resources.files("rapidocr_onnxruntime") / "models" / "ch_ppocr_mobile_v2.0_cls_infer.onnx"
SHAPE = [1, 3, 48, 192]
COSINE_GOAL = 0.99


def configs(root: Path, calibration: int, validation: int) -> Path:
    """A user config directory (as tests/test_ppocr.py writes it) with the rendered data."""
    data = write_dataset(root / "textlines", calibration=calibration, validation=validation)
    for group in ("model", "data"):
        (root / "conf" / group).mkdir(parents=True)
    (root / "conf" / "model" / "ppocr_cls.yaml").write_text(
        f"path: {MODEL}\nname: ppocr_cls\ninput_shapes:\n  x: {SHAPE}\n")
    (root / "conf" / "data" / "textlines.yaml").write_text(
        f"kind: images\npath: {data}\ncalibration_size: {calibration}\nvalidation_size: {validation}\n"
        "preprocess:\n  keep_aspect: true\n  color: bgr\n  mean: [0.5]\n  std: [0.5]\n  pad_value: 0.0\n")
    return root / "conf"


class Build:
    """One ncnn build loaded on the CPU with 1 thread, in this process."""

    def __init__(self, run: Path):
        from pipeline.backends import ncnn

        folder = run / "stages" / "build"
        self.settings = yaml.safe_load((folder / "runtime.yaml").read_text())
        self.settings["options"]["threads"] = 1
        self.session = ncnn.load(folder, self.settings)
        self.bytes = sum((folder / name).stat().st_size for name in self.settings["files"])

    def run(self, feeds: dict) -> np.ndarray:
        return next(iter(self.session.run(feeds).values()))

    def latency(self, feeds: dict, warmup: int, runs: int) -> dict:
        for _ in range(warmup):
            self.session.run(feeds)
        times = []
        for _ in range(runs):
            started = time.perf_counter()
            self.session.run(feeds)
            times.append(time.perf_counter() - started)
        return {"median_ms": float(np.median(times)) * 1e3}

    def by_layer_type(self, feeds: dict, runs: int) -> dict:
        """ms per run per ncnn layer type (incremental extraction, light mode off)."""
        totals = defaultdict(float)
        for layer in self.session.profile(feeds, runs)["layers"]:
            totals[layer["type"]] += layer["ms"]
        return dict(totals)


def validation_feeds(conf: Path) -> list:
    """The validation lines, preprocessed as the data config declares (pipeline/data.py)."""
    from pipeline.config import Color, PreprocessConfig
    from pipeline.data import TensorSpec, load_image

    folder = Path(yaml.safe_load((conf / "data" / "textlines.yaml").read_text())["path"]) / "validation"
    pre = PreprocessConfig(keep_aspect=True, color=Color.bgr, mean=[0.5], std=[0.5], pad_value=0.0)
    spec = TensorSpec("x", SHAPE, "float32")
    return [{"x": load_image(path, spec, pre)} for path in sorted(folder.glob("*.png"))]


def cosine(a: list, b: list) -> float:
    a, b = (np.concatenate([o.ravel() for o in side]).astype(np.float64) for side in (a, b))
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calibration", type=int, default=32)
    parser.add_argument("--validation", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--runs", type=int, default=20, help="inferences per build per round")
    args = parser.parse_args()
    import ncnn

    from pipeline.environment import cpu
    from pipeline.speed import interleaved, speedups

    info = cpu()
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; CPU {info['model']}; flags {' '.join(info['flags'])}")
    print(f"ncnn {ncnn.__version__}, CPU, 1 thread; builds timed interleaved in {args.rounds} rounds "
          f"of {args.runs} runs (pipeline/speed.py)\n")
    with tempfile.TemporaryDirectory(prefix="parity-ncnn-int8-bench-") as scratch:
        root = Path(scratch)
        conf = configs(root, args.calibration, args.validation)
        base = ["--config-dir", conf, "model=ppocr_cls", "data=textlines", "target=ncnn_cpu", "target.threads=1"]
        runs = {"fp32": parity([*base, "precision=fp32", "pipeline.stages=[convert,build]"], root),
                "int8": parity([*base, "precision=int8", "pipeline.stages=[convert,calibrate,build]"], root)}
        builds = {name: Build(run) for name, run in runs.items()}
        samples = validation_feeds(conf)
        outputs = {name: [build.run(feeds) for feeds in samples] for name, build in builds.items()}
        agreement = float(np.mean([a.argmax() == b.argmax() for a, b in zip(outputs["int8"], outputs["fp32"])]))
        effective = builds["int8"].session.effective()
        timings = interleaved(builds, {"x": samples[0]["x"]}, args.rounds, args.runs, 120.0)
        speedup = speedups(timings)["int8"]
        layers = {name: build.by_layer_type(samples[0], args.runs) for name, build in builds.items()}

    value = cosine(outputs["int8"], outputs["fp32"])
    print(f"int8 read back: {effective['precision']} ({effective['layers']})")
    print("| build | cosine vs ncnn fp32 | top-1 agreement | latency ms | speed-up vs fp32 (rounds p25-p75) | bytes |")
    print("|---|---|---|---|---|---|")
    print(f"| ncnn fp32 | 1.0000 | 1.0000 | {timings['fp32']['median_ms']:.3f} | 1.00 | {builds['fp32'].bytes} |")
    print(f"| ncnn int8 | {value:.4f} | {agreement:.4f} | {timings['int8']['median_ms']:.3f} | "
          f"{speedup['speedup']:.2f} ({speedup['speedup_p25']:.2f}-{speedup['speedup_p75']:.2f}) | "
          f"{builds['int8'].bytes} |")
    print("\nper layer type, ms per run (incremental extraction):")
    for kind in sorted(layers["fp32"], key=lambda k: -layers["fp32"][k]):
        print(f"  {kind:22s} fp32 {layers['fp32'][kind]:.4f}  int8 {layers['int8'].get(kind, 0.0):.4f}")
    print(f"\n  {'met ' if value >= COSINE_GOAL else 'MISS'} int8 cosine vs fp32 >= {COSINE_GOAL}: {value:.4f}")
    faster = speedup["faster"]
    print(f"  {'met ' if faster else 'MISS'} int8 faster than fp32 (lower-quartile speed-up > 1): "
          f"{speedup['speedup_p25']:.2f}")
    print(json.dumps({"cosine": value, "agreement": agreement, "speedup": speedup,
                      "fp32_ms": timings["fp32"]["median_ms"], "int8_ms": timings["int8"]["median_ms"]}))


if __name__ == "__main__":
    main()
