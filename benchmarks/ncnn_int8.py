"""ncnn int8 vs ncnn fp32 on the PP-OCR text-direction classifier of the rapidocr wheel,
on the CPU: accuracy and latency of every int8 variant side by side with fp32, in one run.

    pip install -e .[test,ncnn]       # rapidocr-onnxruntime ships the model; DejaVu fonts
    python benchmarks/ncnn_int8.py [--calibration 32] [--validation 64] [--rounds 15]

Data: rendered text lines, upright or rotated 180 degrees (tests/textlines.py), the
classifier's own preprocessing. Builds, through the `parity` CLI (stages up to build),
ncnn_cpu: fp32; int8 (parity's ncnn int8 format, pipeline/backends/ncnn/int8.py, with
requantize between int8 convolutions, and on an x86 CPU the depthwise convolutions float:
the default); int8 with the depthwise convolutions int8 too (target.ncnn.int8_depthwise=true);
int8 without requantize (target.ncnn.int8_requantize=false); int8 on the Convolution layers
only (the depthwise and InnerProduct layers fp32; with and without requantize) and int8 on
the projection convolutions only (1x1, at least 64 inputs, fewer outputs than inputs), the
other ops kept float with precision.keep_float. Runtime variants load the fp32 and the default int8 build
with other ncnn options (2 threads, use_sgemm_convolution off, lightmode off,
use_packing_layout off): their speed-up is against fp32 with the same options. Printed:
cosine of each int8 build's outputs vs fp32's and top-1 agreement over the validation
lines; latency of every build, all timed interleaved in the same rounds (pipeline/verification/speed.py:
order rotated, median of round medians, speed-up the median of the per-round ratios with
its quartiles); per layer type, each build's time from ncnn's incremental extraction (the
profile stage's method), which says where int8 wins or loses.
"""

from __future__ import annotations

import argparse
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
from textlines import write_ppocr_configs  # noqa: E402

SHAPE = [1, 3, 48, 192]
COSINE_GOAL = 0.99


class Build:
    """One ncnn build loaded on the CPU (1 thread unless ``options`` say otherwise), in this process."""

    def __init__(self, run: Path, **options):
        from pipeline.backends import ncnn

        folder = run / "stages" / "build"
        self.run_dir = run
        self.settings = yaml.safe_load((folder / "runtime.yaml").read_text())
        self.settings["options"] = {**self.settings["options"], "threads": 1, **options}
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
    """The validation lines, preprocessed as the data config declares (pipeline/data/__init__.py)."""
    from pipeline.config.schemas import Color, PreprocessConfig
    from pipeline.data import TensorSpec, load_image

    folder = Path(yaml.safe_load((conf / "data" / "textlines.yaml").read_text())["path"]) / "validation"
    pre = PreprocessConfig(keep_aspect=True, color=Color.bgr, mean=[0.5], std=[0.5], pad_value=0.0)
    spec = TensorSpec("x", SHAPE, "float32")
    return [{"x": load_image(path, spec, pre)} for path in sorted(folder.glob("*.png"))]


def cosine(a: list, b: list) -> float:
    a, b = (np.concatenate([o.ravel() for o in side]).astype(np.float64) for side in (a, b))
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


RUNTIME_VARIANTS = {"2 threads": {"threads": 2}, "sgemm off": {"use_sgemm_convolution": False},
                    "lightmode off": {"lightmode": False}, "packing off": {"use_packing_layout": False}}


def keep_float_lists(run: Path) -> dict:
    """precision.keep_float of the layer-selection variants, from the default int8 build:
    variant -> the quantized ops whose layers stay fp32."""
    from pipeline.backends.ncnn import Param

    options = yaml.safe_load((run / "stages" / "build" / "runtime.yaml").read_text())["options"]
    layers = {layer.name: layer for layer in Param.read(run / "stages" / "build" / "model.param").layers}
    ops = options["int8"]["layers"]  # ncnn layer -> ONNX op

    def projection(layer) -> bool:
        outputs = int(layer.param(0))
        inputs = int(layer.param(6)) // outputs
        return layer.param(1) == "1" and inputs >= 64 and outputs < inputs

    conv = {name for name in ops if layers[name].type == "Convolution"}
    return {"int8, Convolution only": sorted(op for name, op in ops.items() if name not in conv),
            "int8, projection convs only": sorted(op for name, op in ops.items()
                                                  if name not in conv or not projection(layers[name]))}


def make_builds(root: Path, conf: Path) -> dict:
    """name -> Build: the parity builds, then the runtime variants of fp32 and int8."""
    base = ["--config-dir", conf, "model=ppocr_cls", "data=textlines", "target=ncnn_cpu", "target.threads=1"]
    int8 = [*base, "precision=int8", "pipeline.stages=[convert,calibrate,build]"]
    runs = {"fp32": parity([*base, "precision=fp32", "pipeline.stages=[convert,build]"], root),
            "int8": parity(int8, root),
            "int8, depthwise int8 too": parity([*int8, "target.ncnn.int8_depthwise=true"], root),
            "int8, where faster": parity([*int8, "precision.int8_where_faster=true"], root),
            "int8, no requantize": parity([*int8, "target.ncnn.int8_requantize=false"], root)}
    for name, ops in keep_float_lists(runs["int8, depthwise int8 too"]).items():
        runs[name] = parity([*int8, f"precision.keep_float=[{','.join(ops)}]"], root)
        if name == "int8, Convolution only":  # the depthwise layers fp32: requantize only where convs chain
            runs[f"{name}, no requantize"] = parity([*int8, f"precision.keep_float=[{','.join(ops)}]",
                                                     "target.ncnn.int8_requantize=false"], root)
    builds = {name: Build(run) for name, run in runs.items()}
    for label, options in RUNTIME_VARIANTS.items():
        builds[f"fp32, {label}"] = Build(runs["fp32"], **options)
        builds[f"int8, {label}"] = Build(runs["int8"], **options)
    return builds


def baseline(name: str) -> str:
    """The fp32 build a variant is compared with: fp32 with the same runtime options."""
    label = name.split(", ", 1)[-1]
    return f"fp32, {label}" if label in RUNTIME_VARIANTS else "fp32"


def speedup_of(timings: dict, name: str) -> dict:
    from pipeline.verification.speed import speedups

    return speedups({"fp32": timings[baseline(name)], name: timings[name]})[name]


def report(builds: dict, outputs: dict, timings: dict, layers: dict) -> dict:
    """The table, the per layer type times, and the JSON line; {name: figures}."""
    figures = {}
    print("| build | read back | cosine vs ncnn fp32 | top-1 agreement | latency ms | speed-up vs fp32 (p25-p75) "
          "| bytes |")
    print("|---|---|---|---|---|---|---|")
    for name, build in builds.items():
        if name.startswith("fp32"):
            print(f"| {name} | fp32 | 1.0000 | 1.0000 | {timings[name]['median_ms']:.3f} | "
                  f"{'1.00' if name == 'fp32' else 'baseline of ' + name.replace('fp32', 'int8')} | {build.bytes} |")
            continue
        value = cosine(outputs[name], outputs["fp32"])
        agreement = float(np.mean([a.argmax() == b.argmax() for a, b in zip(outputs[name], outputs["fp32"])]))
        up = speedup_of(timings, name)
        layers_text = build.session.effective()["layers"].split("; ", 1)[-1]
        print(f"| {name} | {layers_text} | {value:.4f} | {agreement:.4f} | {timings[name]['median_ms']:.3f} | "
              f"{up['speedup']:.2f} ({up['speedup_p25']:.2f}-{up['speedup_p75']:.2f}) vs {baseline(name)} | "
              f"{build.bytes} |")
        figures[name] = {"cosine": value, "agreement": agreement, "ms": timings[name]["median_ms"], **up}
    names = list(layers)
    print("\nper layer type, ms per run (incremental extraction, 1 thread):")
    print("  " + " | ".join(["layer type", *names]))
    for kind in sorted(layers["fp32"], key=lambda k: -layers["fp32"][k]):
        print("  " + " | ".join([kind, *(f"{layers[n].get(kind, 0.0):.4f}" for n in names)]))
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calibration", type=int, default=32)
    parser.add_argument("--validation", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--runs", type=int, default=20, help="inferences per build per round")
    args = parser.parse_args()
    import ncnn

    from pipeline.environment import cpu
    from pipeline.verification.speed import interleaved

    info = cpu()
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; CPU {info['model']}; flags {' '.join(info['flags'])}")
    print(f"ncnn {ncnn.__version__}, CPU; builds timed interleaved in {args.rounds} rounds of {args.runs} runs "
          f"(pipeline/verification/speed.py)\n")
    with tempfile.TemporaryDirectory(prefix="parity-ncnn-int8-bench-") as scratch:
        root = Path(scratch)
        write_ppocr_configs(root, calibration=args.calibration, validation=args.validation)
        conf = root / "conf"
        builds = make_builds(root, conf)
        samples = validation_feeds(conf)
        outputs = {name: [build.run(feeds) for feeds in samples] for name, build in builds.items()}
        timings = interleaved(builds, {"x": samples[0]["x"]}, args.rounds, args.runs, 300.0)
        layers = {name: builds[name].by_layer_type(samples[0], args.runs)
                  for name in ("fp32", "int8", "int8, depthwise int8 too", "int8, Convolution only")}
    figures = report(builds, outputs, timings, layers)
    value, up = figures["int8"]["cosine"], figures["int8"]
    print(f"\n  {'met ' if value >= COSINE_GOAL else 'MISS'} int8 cosine vs fp32 >= {COSINE_GOAL}: {value:.4f}")
    print(f"  {'met ' if up['faster'] else 'MISS'} int8 faster than fp32 (lower-quartile speed-up > 1): "
          f"{up['speedup_p25']:.2f}")
    measured = figures["int8, where faster"]
    print(f"  {'met ' if measured['faster'] else 'MISS'} int8 with precision.int8_where_faster faster than fp32 "
          f"(lower-quartile speed-up > 1): {measured['speedup_p25']:.2f}, cosine {measured['cosine']:.4f}")
    fastest = min(figures, key=lambda name: figures[name]["ms"])
    print(f"  fastest build with int8 layers: {fastest}, {figures[fastest]['ms']:.3f} ms, "
          f"{figures[fastest]['speedup']:.2f}x {baseline(fastest)} (p25 {figures[fastest]['speedup_p25']:.2f}), "
          f"cosine {figures[fastest]['cosine']:.4f}")
    print(json.dumps({"fp32_ms": timings["fp32"]["median_ms"], "builds": figures}))


if __name__ == "__main__":
    main()
