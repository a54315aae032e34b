"""int8 and mixed-precision figures on the PP-OCRv4 text detector and recognizer of the
rapidocr wheel, next to fp32 and NNCF's MIXED preset, on OpenVINO CPU with 1 thread.

    pip install -e .[test,bench]      # nncf is a benchmark-only extra
    python benchmarks/mixed.py [--models det rec] [--calibration 32] [--validation 64]

Data is rendered here: det = 320x320 pages of text lines (varied words, fonts, sizes,
light noise), rec = 48x320 text lines with their text as truth. Builds: fp32 (the
converted model), parity int8 (defaults; weights rounded to nearest; neither weight rounding
nor bias correction), parity mixed (through
the `parity` CLI, stages up to build), and `nncf.quantize(preset=MIXED)` on the same
calibration samples. Every build is compiled the same way (OpenVINO CPU, f32 hint, 1
thread) and timed interleaved in rounds (pipeline/verification/speed.py). Printed per build: cosine
vs fp32 over the validation outputs, the task metric (det: IoU of the map binarized at
0.3 vs fp32's; rec: character accuracy of the greedy CTC decoding vs the rendered
text), latency ratio vs fp32, and the build's own time.
"""

from __future__ import annotations

import argparse
import importlib.resources
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml
from PIL import Image, ImageDraw, ImageFont

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
from textlines import FONTS  # noqa: E402

MODELS = importlib.resources.files("rapidocr_onnxruntime") / "models"
SHAPES = {"det": [1, 3, 320, 320], "rec": [1, 3, 48, 320]}
FILES = {"det": "ch_PP-OCRv4_det_infer.onnx", "rec": "ch_PP-OCRv4_rec_infer.onnx"}
WORDS = ("parity deploy model runtime verify bundle vulkan tensor layer accuracy quick brown fox jumps over "
         "the lazy dog 2026 ONNX OpenVINO calibration invoice total amount date receipt order number street "
         "station Berlin Paris 42 17.50 EUR kg page chapter").split()
BINARY_THRESHOLD = 0.3  # rapidocr's det thresh


def noisy(image: Image.Image, rng: np.random.Generator) -> np.ndarray:
    pixels = np.asarray(image, dtype=np.float32) + rng.normal(0, 6, (image.height, image.width, 1))
    return np.clip(pixels, 0, 255)


def normalized(pixels: np.ndarray) -> np.ndarray:
    """rapidocr's normalization: (x / 255 - 0.5) / 0.5, HWC -> CHW."""
    return ((pixels / 255.0 - 0.5) / 0.5).transpose(2, 0, 1).astype(np.float32)


def text_line(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 3)))


def render_line(text: str, size: int, font: Path, shade: int) -> Image.Image:
    face = ImageFont.truetype(str(font), size)
    left, top, right, bottom = face.getbbox(text)
    margin = size // 4
    image = Image.new("RGB", (right - left + 2 * margin, bottom - top + 2 * margin), (shade,) * 3)
    ImageDraw.Draw(image).text((margin - left, margin - top), text, font=face, fill=(shade - 215,) * 3)
    return image


def rec_samples(count: int, seed: int):
    """[count, 3, 48, 320] lines resized to height 48 (rapidocr's rec preprocessing) and their text."""
    rng, noise = random.Random(seed), np.random.default_rng(seed)
    tensors, truth = [], []
    while len(tensors) < count:
        text = text_line(rng)
        image = render_line(text, rng.randint(20, 40), rng.choice(FONTS), rng.randint(225, 255))
        width = int(np.ceil(48 * image.width / image.height))
        if width > 320:
            continue  # the line does not fit the model's 320 columns: draw another
        pixels = noisy(image.resize((width, 48), Image.BILINEAR), noise)
        canvas = np.zeros((3, 48, 320), np.float32)
        canvas[:, :, :width] = normalized(pixels)
        tensors.append(canvas)
        truth.append(text)
    return np.stack(tensors), truth


def det_samples(count: int, seed: int, size: int = 320) -> np.ndarray:
    """[count, 3, size, size] pages with 3 to 7 lines of text at random places (at 736, the
    size rapidocr serves a square page at, the lines are drawn at the same scale, 2.3x more of
    them)."""
    rng, noise = random.Random(seed), np.random.default_rng(seed)
    scale = size / 320
    pages = []
    for _ in range(count):
        page = Image.new("RGB", (size, size), (rng.randint(225, 255),) * 3)
        for _ in range(round(rng.randint(3, 7) * scale)):
            line = render_line(text_line(rng), round(rng.randint(12, 30) * scale ** 0.5), rng.choice(FONTS),
                               page.getpixel((0, 0))[0])
            page.paste(line, (rng.randint(0, max(0, size - line.width)), rng.randint(0, size - 20)))
        pages.append(normalized(noisy(page, noise)))
    return np.stack(pages)


def charset() -> list:
    """rapidocr's CTC classes: blank, the model's `character` metadata, then a space."""
    import onnxruntime as ort

    meta = ort.InferenceSession(str(MODELS / FILES["rec"]), providers=["CPUExecutionProvider"]).get_modelmeta()
    return ["blank", *meta.custom_metadata_map["character"].splitlines(), " "]


def ctc_greedy(probabilities: np.ndarray, characters: list) -> str:
    best = probabilities.argmax(-1)
    kept = [index for position, index in enumerate(best) if index != 0 and (position == 0 or index != best[position - 1])]
    return "".join(characters[index] for index in kept)


def edit_distance(a: str, b: str) -> int:
    row = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        previous, row[0] = row[0], i
        for j, cb in enumerate(b, 1):
            previous, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, previous + (ca != cb))
    return row[-1]


def char_accuracy(outputs: list, truth: list, characters: list) -> float:
    errors = sum(edit_distance(ctc_greedy(out[0], characters), text) for out, text in zip(outputs, truth))
    return 1.0 - errors / sum(len(text) for text in truth)


def binary_iou(outputs: list, reference: list) -> float:
    built = np.concatenate([o.ravel() for o in outputs]) > BINARY_THRESHOLD
    fp32 = np.concatenate([o.ravel() for o in reference]) > BINARY_THRESHOLD
    return float((built & fp32).sum() / max((built | fp32).sum(), 1))


def cosine(outputs: list, reference: list) -> float:
    a = np.concatenate([o.ravel() for o in outputs]).astype(np.float64)
    b = np.concatenate([o.ravel() for o in reference]).astype(np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


# --- builds -----------------------------------------------------------------------------

def parity(args, cwd: Path) -> Path:
    """One `parity` run (stages up to build); its run folder."""
    command = [str(Path(sys.executable).parent / "parity"), *map(str, args)]
    result = subprocess.run(command, cwd=cwd, capture_output=True, text=True, env={**os.environ, "NO_COLOR": "1"})
    if result.returncode != 0:
        raise SystemExit(f"parity {' '.join(map(str, args))} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return sorted((cwd / "outputs").glob("*/*_*"))[-1]


def stage_seconds(run: Path, stage: str) -> float:
    report = json.loads((run / "report.json").read_text())
    return next(s["seconds"] for s in report["stages"] if s["stage"] == stage)


METRIC_DROP = 0.005  # the figure: mixed's task metric within 0.5 pt of fp32's


def metric_args(kind: str, work: Path) -> list:
    """The task metric parity's search and verify hold mixed to, the benchmark's own: det IoU
    of the map binarized at 0.3 vs fp32's (map_iou), rec character accuracy of the greedy CTC
    decoding vs the rendered text (ctc, the text as validation labels)."""
    if kind == "det":
        return ["metric=map_iou", f"metric.threshold={BINARY_THRESHOLD}", f"validation.max_metric_drop={METRIC_DROP}"]
    symbols = work / "charset.txt"
    symbols.write_text("\n".join(charset()[1:]) + "\n", encoding="utf-8")
    return ["metric=ctc", f"metric.charset={symbols}", f"validation.max_metric_drop={METRIC_DROP}"]


def parity_builds(kind: str, data: Path, work: Path, calibration: int, validation: int,
                  accuracy_order: bool = False) -> dict:
    """name -> (model file, build seconds, note) for fp32 and parity's int8 / mixed builds
    (with ``accuracy_order``, also the mixed build selected by accuracy alone)."""
    base = [f"model.path={MODELS / FILES[kind]}", f"+model.input_shapes.x={SHAPES[kind]}".replace(" ", ""),
            "data.kind=tensors", f"data.path={data}", f"data.calibration_size={calibration}",
            f"data.validation_size={validation}", "target=openvino_cpu", "target.threads=1", *metric_args(kind, work)]
    int8 = ["precision=int8", "pipeline.stages=[convert,calibrate,build]"]
    runs = {"parity int8": parity([*base, *int8], work),
            "parity int8, round to nearest": parity([*base, *int8, "precision.weight_rounding=false"], work),
            "parity int8, neither": parity([*base, *int8, "precision.weight_rounding=false",
                                            "precision.bias_correction=false"], work),
            "parity mixed": parity([*base, "precision=mixed", "pipeline.stages=[convert,calibrate,sensitivity,build]"],
                                   work)}
    if accuracy_order:
        runs["parity mixed, accuracy order"] = parity([*base, "precision=mixed", "sensitivity.latency_aware=false",
                                                       "pipeline.stages=[convert,calibrate,sensitivity,build]"], work)
    builds = {"fp32": (runs["parity int8"] / "stages" / "convert" / "model.onnx", 0.0, "")}
    for name, run in runs.items():
        runtime = yaml.safe_load((run / "stages" / "build" / "runtime.yaml").read_text())
        summary = json.loads((run / "stages" / "build" / "result.json").read_text())["summary"]["quantization"]
        seconds = stage_seconds(run, "build") + (stage_seconds(run, "sensitivity") if "mixed" in name else 0.0)
        note = search_note(run) if "mixed" in name else ""
        note += refinement_note(summary.get("weight_rounding") or {}, "weight rounding", "weights rounded to nearest")
        note += "; " + refinement_note(summary.get("bias_correction") or {}, "bias correction", "bias correction off")
        builds[name] = (run / "stages" / "build" / runtime["model"], seconds, note)
    return builds


def search_note(run: Path) -> str:
    """Float ops and where the search's time went."""
    summary = json.loads((run / "stages" / "sensitivity" / "result.json").read_text())["summary"]
    parts = ", ".join(f"{k} {v:.1f}" for k, v in (summary.get("seconds") or {}).items())
    return (f"{len(summary.get('float_ops', []))} ops float (target cosine {summary.get('expected_cos')}), "
            f"search {stage_seconds(run, 'sensitivity'):.1f} s ({parts}); ")


def refinement_note(summary: dict, name: str, off: str) -> str:
    """What the build's weight rounding or bias correction did, from its summary."""
    if not summary.get("enabled"):
        return off
    cosine = summary["output_cosine"]
    verdict = "kept" if summary["applied"] else "not kept"
    return (f"{name} {verdict} ({summary.get('judged_on', 'calibration')} cosine {cosine['without']:.4f} -> "
            f"{cosine['with']:.4f}, {summary['seconds']:.1f} s)")


def nncf_build(fp32: Path, calibration: np.ndarray, out: Path):
    """nncf.quantize with the MIXED preset on the same calibration samples."""
    import nncf
    import openvino as ov

    started = time.perf_counter()
    model = ov.Core().read_model(str(fp32))
    dataset = nncf.Dataset([sample[None] for sample in calibration])
    quantized = nncf.quantize(model, dataset, preset=nncf.QuantizationPreset.MIXED, subset_size=len(calibration))
    ov.save_model(quantized, str(out), compress_to_fp16=False)
    return out, time.perf_counter() - started, "nncf " + nncf.__version__


# --- measuring --------------------------------------------------------------------------

class Compiled:
    """One build compiled for OpenVINO CPU (f32 hint, 1 thread, 1 stream), in this process."""

    def __init__(self, path: Path):
        import openvino as ov

        core = ov.Core()
        self.compiled = core.compile_model(core.read_model(str(path)), "CPU", {
            "INFERENCE_PRECISION_HINT": "f32", "INFERENCE_NUM_THREADS": 1, "NUM_STREAMS": 1,
            "PERFORMANCE_HINT": "LATENCY"})
        self.request = self.compiled.create_infer_request()

    def run(self, x: np.ndarray) -> np.ndarray:
        self.request.infer({0: x})
        return self.request.get_output_tensor(0).data.copy()

    def latency(self, feeds: dict, warmup: int, runs: int) -> dict:
        x = feeds["x"]
        for _ in range(warmup):
            self.request.infer({0: x})
        times = []
        for _ in range(runs):
            started = time.perf_counter()
            self.request.infer({0: x})
            times.append(time.perf_counter() - started)
        return {"median_ms": float(np.median(times)) * 1e3}


def measure(kind: str, builds: dict, validation: np.ndarray, truth, rounds: int) -> dict:
    from pipeline.verification.speed import interleaved

    compiled = {name: Compiled(path) for name, (path, _, _) in builds.items()}
    outputs = {name: [model.run(x[None]) for x in validation] for name, model in compiled.items()}
    characters = charset() if kind == "rec" else None
    rows = {}
    for name in builds:
        metric = binary_iou(outputs[name], outputs["fp32"]) if kind == "det" else \
            char_accuracy(outputs[name], truth, characters)
        rows[name] = {"cosine": cosine(outputs[name], outputs["fp32"]), "metric": metric}
    timings = interleaved(compiled, {"x": validation[:1]}, rounds, 5 if kind == "det" else 10, 90.0)
    for name, timing in timings.items():
        ratios = [t / f for t, f in zip(timing["round_medians_ms"], timings["fp32"]["round_medians_ms"])]
        rows[name].update(ms=timing["median_ms"], ratio=float(np.median(ratios)),
                          spread=(float(np.percentile(ratios, 25)), float(np.percentile(ratios, 75))))
    return rows


# --- report -----------------------------------------------------------------------------

NNCF = "NNCF MIXED"


def table(kind: str, rows: dict, builds: dict) -> str:
    metric = "IoU vs fp32 (map > 0.3)" if kind == "det" else "char accuracy vs truth"
    lines = [f"| model | build | cosine vs fp32 | {metric} | latency ms | vs fp32 (rounds p25-p75) | build s | note |",
             "|---|---|---|---|---|---|---|---|"]
    for name, row in rows.items():
        _, seconds, note = builds[name]
        lines.append(f"| {kind} | {name} | {row['cosine']:.4f} | {row['metric']:.4f} | {row['ms']:.2f} | "
                     f"{row['ratio']:.2f} ({row['spread'][0]:.2f}-{row['spread'][1]:.2f}) | {seconds:.1f} | {note} |")
    return "\n".join(lines)


SEARCH_GOAL_S = {"det": 60.0, "rec": 40.0}


def goals(kind: str, rows: dict, search_s: float) -> list:
    """The issue's figures, each next to its reference: (text, met)."""
    int8, mixed, peer, fp32 = rows["parity int8"], rows["parity mixed"], rows[NNCF], rows["fp32"]
    nearest, plain = rows["parity int8, round to nearest"], rows["parity int8, neither"]
    checks = [
        ("int8 cosine >= NNCF's", int8["cosine"], peer["cosine"], int8["cosine"] >= peer["cosine"]),
        ("int8 task metric >= NNCF's", int8["metric"], peer["metric"], int8["metric"] >= peer["metric"]),
        ("int8 latency <= NNCF's (ratio to fp32)", int8["ratio"], peer["ratio"], int8["ratio"] <= peer["ratio"]),
        ("mixed cosine >= 0.995", mixed["cosine"], 0.995, mixed["cosine"] >= 0.995),
        ("mixed task metric within 0.005 of fp32's", mixed["metric"], fp32["metric"] - 0.005,
         mixed["metric"] >= fp32["metric"] - 0.005),
        ("mixed latency <= 1.1x int8's", mixed["ratio"], 1.1 * int8["ratio"], mixed["ratio"] <= 1.1 * int8["ratio"]),
        ("mixed latency <= NNCF's", mixed["ratio"], peer["ratio"], mixed["ratio"] <= peer["ratio"]),
        ("weight rounding: task metric vs round to nearest", int8["metric"], nearest["metric"],
         int8["metric"] >= nearest["metric"]),
        ("weight rounding and bias correction: cosine vs neither", int8["cosine"], plain["cosine"],
         int8["cosine"] >= plain["cosine"]),
        ("mixed search seconds", search_s, SEARCH_GOAL_S[kind], search_s <= SEARCH_GOAL_S[kind]),
    ]
    return [f"  {'met ' if met else 'MISS'} {kind} {text}: {value:.4f} vs {reference:.4f} ({value - reference:+.4f})"
            for text, value, reference, met in checks]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["det", "rec"], choices=["det", "rec"])
    parser.add_argument("--calibration", type=int, default=32)
    parser.add_argument("--validation", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--accuracy-order", action="store_true",
                        help="also build mixed with sensitivity.latency_aware=false (a second search)")
    args = parser.parse_args()
    from pipeline.environment import cpu

    info = cpu()
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; CPU {info['model']}; flags {' '.join(info['flags'])}")
    print("OpenVINO CPU, f32 hint, 1 thread, builds timed interleaved in rounds (pipeline/verification/speed.py)\n")
    with tempfile.TemporaryDirectory(prefix="parity-mixed-bench-") as scratch:
        for kind in args.models:
            work = Path(scratch) / kind
            work.mkdir()
            if kind == "rec":
                calibration, _ = rec_samples(args.calibration, seed=1)
                validation, truth = rec_samples(args.validation, seed=2)
            else:
                calibration, validation, truth = det_samples(args.calibration, 1), det_samples(args.validation, 2), None
            data = work / "data.npz"
            labels = {"validation/labels": np.array(truth)} if truth is not None else {}
            np.savez(data, **{"calibration/x": calibration, "validation/x": validation, **labels})
            builds = parity_builds(kind, data, work, args.calibration, args.validation, args.accuracy_order)
            builds[NNCF] = nncf_build(builds["fp32"][0], calibration, work / "nncf.xml")
            rows = measure(kind, builds, validation, truth, args.rounds)
            print(table(kind, rows, builds))
            search_s = stage_seconds(builds["parity mixed"][0].parents[2], "sensitivity")
            print("\n".join(goals(kind, rows, search_s)) + "\n", flush=True)


if __name__ == "__main__":
    main()
