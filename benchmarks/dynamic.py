"""Dynamic-shape bundles against fixed-shape ones (issue 29), on the PP-OCRv4 detector and
recognizer from the rapidocr wheel, unchanged (dynamic HxW; dynamic width).

    pip install -e .[test,bench]
    python benchmarks/dynamic.py [--models det rec] [--targets openvino_cpu ort_cpu]
                                 [--precisions int8 auto] [--per-shape 4 4] [--isa native|AVX2]
                                 [--same-calibration] [--control] [--nncf] [--keep DIR]

Per model, target and precision, two `parity` runs in fresh folders (cold cache):
- dynamic: every sample at its own shape (det pages 480x640 / 640x960 / 960x960 after
  PaddleOCR's limit-side-960 policy, multiples of 32; rec lines 160 / 320 / 960 wide), the
  range given in model.input_shapes with opt = the middle shape;
- fixed: model.input_shapes = opt, the same opt-shaped validation samples, as many
  calibration samples as the dynamic run, all of the opt shape.
Figures, side by side in one run:
- accuracy at opt: the dynamic bundle's cosine on the opt-shaped samples (verify's per-shape
  group) against the fixed build's on the same samples (goal: within 0.002), and the mean
  per-sample gap with its 95 % paired bootstrap interval (verify's confidence method);
- latency at opt: both bundles loaded in workers and timed interleaved (pipeline.verification.speed, the
  same method as verify) at the opt shape (goal: dynamic within 10 % of fixed);
- calibration cost: the calibrate stage's seconds per sample and per megapixel, mixed shapes
  against the opt shape (goal: no more per sample).
With --control, one more: a second fixed build calibrated on other opt-shaped samples (another
seed), so that the gap the choice of calibration samples alone makes sits next to the others.
With --nncf (openvino_cpu rows), the peer: NNCF quantize (MIXED preset) on each run's converted
model and calibration samples, cold in a fresh process, its seconds next to parity's and its
own dynamic-vs-fixed gap at opt.
With --same-calibration, a third run per row: the dynamic bundle calibrated on the fixed
run's opt-shaped samples, so that its cosine gap to the fixed build is the dynamic dims'
alone, not the calibration data's.
Validation thresholds are lowered (validation.min_cosine=0): this measures, it does not gate.
Prints the CPU flags; absolute seconds are this machine's.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

import numpy as np
import yaml
from PIL import Image

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from avx2_only import become  # noqa: E402
from mixed import FILES, FONTS, MODELS, noisy, normalized, render_line, text_line  # noqa: E402
from time_to_bundle import kernels  # noqa: E402

from pipeline import backends  # noqa: E402
from pipeline.verification import confidence, speed  # noqa: E402
from pipeline.environment import cpu  # noqa: E402
from pipeline.worker import BackendWorker  # noqa: E402

# (height, width) per bucket; opt is the fixed build's shape
SHAPES = {"det": {"min": (480, 640), "opt": (640, 960), "max": (960, 960)},
          "rec": {"min": (48, 160), "opt": (48, 320), "max": (48, 960)}}
PER_SHAPE = {"calibration": 4, "validation": 4}
# the extra runs a row can add: (data folder, dynamic?)
EXTRAS = {"same_calibration": ("dynamic_optcal", True), "control": ("fixed_control", False)}
GOALS = {"cosine_gap": 0.002, "latency_ratio": 1.10}


def page(height: int, width: int, rng: random.Random, noise) -> np.ndarray:
    image = Image.new("RGB", (width, height), (rng.randint(225, 255),) * 3)
    for _ in range(rng.randint(4, 9)):
        line = render_line(text_line(rng), rng.randint(14, 36), rng.choice(FONTS), image.getpixel((0, 0))[0])
        image.paste(line, (rng.randint(0, max(0, width - line.width)), rng.randint(0, max(0, height - 40))))
    return normalized(noisy(image, noise))[np.newaxis]


def line(width: int, rng: random.Random, noise) -> np.ndarray:
    """A text line at height 48, its width by aspect (PaddleOCR rec), right-padded to ``width``."""
    while True:
        image = render_line(text_line(rng), rng.randint(20, 40), rng.choice(FONTS), rng.randint(225, 255))
        own = int(np.ceil(48 * image.width / image.height))
        if width // 3 <= own <= width:
            break
    canvas = np.zeros((1, 3, 48, width), np.float32)
    canvas[0, :, :, :own] = normalized(noisy(image.resize((own, 48), Image.BILINEAR), noise))
    return canvas


def write_data(kind: str, root: Path) -> None:
    """root/dynamic/{split}/ every bucket; root/fixed/validation/ the opt bucket only, and
    root/fixed/calibration/ as many samples as the dynamic run's, all at opt."""
    for split, count in PER_SHAPE.items():
        rng, noise = random.Random(f"{kind}{split}"), np.random.default_rng(len(split))
        for which, (height, width) in SHAPES[kind].items():
            for index in range(count):
                sample = page(height, width, rng, noise) if kind == "det" else line(width, rng, noise)
                _save(root / "dynamic" / split, f"{which}_{index}", sample)
                if which == "opt":
                    _save(root / "fixed" / split, f"{which}_{index}", sample)
        height, width = SHAPES[kind]["opt"]
        for index in range(count, 3 * count if split == "calibration" else count):
            _save(root / "fixed" / split, f"opt_{index}", page(height, width, rng, noise) if kind == "det"
                  else line(width, rng, noise))


def same_calibration_data(root: Path) -> None:
    """root/dynamic_optcal/: the fixed run's calibration samples, the dynamic run's validation."""
    shutil.copytree(root / "fixed" / "calibration", root / "dynamic_optcal" / "calibration")
    shutil.copytree(root / "dynamic" / "validation", root / "dynamic_optcal" / "validation")


def control_data(kind: str, root: Path) -> None:
    """root/fixed_control/: as many opt-shaped calibration samples as the fixed run's, drawn
    with another seed, and the fixed run's validation: two fixed builds whose only
    difference is which calibration samples they drew."""
    rng, noise = random.Random(f"{kind}control"), np.random.default_rng(7)
    height, width = SHAPES[kind]["opt"]
    for index in range(3 * PER_SHAPE["calibration"]):
        _save(root / "fixed_control" / "calibration", f"opt_{index}",
              page(height, width, rng, noise) if kind == "det" else line(width, rng, noise))
    shutil.copytree(root / "fixed" / "validation", root / "fixed_control" / "validation")


def _save(folder: Path, name: str, sample: np.ndarray) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    np.save(folder / f"{name}.npy", sample)


def shape_args(kind: str, dynamic: bool) -> str:
    dims = {w: [1, 3, *hw] for w, hw in SHAPES[kind].items()}
    if not dynamic:
        return f"+model.input_shapes.x={dims['opt']}".replace(" ", "")
    return ("+model.input_shapes.x={" + ",".join(f"{w}:{dims[w]}" for w in ("min", "opt", "max")) + "}").replace(" ", "")


def parity(args, cwd: Path) -> tuple:
    cwd.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200"}
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "pipeline", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, check=False)
    seconds = time.perf_counter() - started
    reports = sorted(cwd.glob("outputs/*/*/report.json"))
    if not reports:
        raise SystemExit(f"parity {' '.join(args)} wrote no report (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return seconds, done.returncode, json.loads(reports[-1].read_text()), reports[-1].parent


def opt_cosine(report: dict, dynamic: bool):
    """The shipped build's cosine on the opt-shaped samples."""
    verify = report["verify"]
    if not dynamic:
        return verify["outputs"][0]["metrics"]["cosine"]
    opt = next(g for g in verify["shapes"] if "opt" in g["buckets"])
    return next(iter(opt["outputs"].values()))["cosine"]


def opt_sample_cosines(report: dict, dynamic: bool) -> np.ndarray:
    """Per-sample cosines on the opt-shaped samples, in file order. The files sort as
    max_*, min_*, opt_* (the fixed run has only opt_*), so the opt block is the last third."""
    found = np.asarray(report["verify"]["outputs"][0]["per_sample"]["cosine"])
    return found[-PER_SHAPE["validation"]:] if dynamic else found


def paired_gap(dynamic: np.ndarray, fixed: np.ndarray) -> tuple:
    """(mean per-sample cosine gap dynamic - fixed on the same opt samples, its 95 % paired
    bootstrap interval): verify's method (pipeline.verification.confidence)."""
    low, high = confidence.drop_interval(fixed, dynamic, higher_is_better=True) or (float("nan"),) * 2
    return float(np.mean(dynamic) - np.mean(fixed)), [-high, -low]


def calibrate_cost(report: dict, kind: str, dynamic: bool):
    """(seconds, per sample, per megapixel) of the calibrate stage, or None when it did not run."""
    stage = next((s for s in report["stages"] if s["stage"] == "calibrate"), None)
    samples = PER_SHAPE["calibration"] * 3
    pixels = PER_SHAPE["calibration"] * (sum(h * w for h, w in SHAPES[kind].values()) if dynamic
                                         else 3 * SHAPES[kind]["opt"][0] * SHAPES[kind]["opt"][1])
    if not stage or not stage.get("computed_seconds") or report["precision"] not in ("int8", "mixed"):
        return None  # a float build shipped (auto): nothing calibrated
    seconds = stage["computed_seconds"]
    return seconds, seconds / samples, seconds / (pixels / 1e6)


NNCF_RUN = """
import json, sys, time
from pathlib import Path
import numpy as np
started = time.perf_counter()
import nncf, openvino as ov
from pipeline.verification.metrics import cosine
fp32, calibration, validation, out = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4])
core = ov.Core()
model = core.read_model(str(fp32))
samples = [np.load(f) for f in sorted(calibration.glob("*.npy"))]
quantized = nncf.quantize(model, nncf.Dataset(samples), preset=nncf.QuantizationPreset.MIXED, subset_size=len(samples))
ov.save_model(quantized, str(out), compress_to_fp16=False)
seconds = time.perf_counter() - started
hint = {"INFERENCE_PRECISION_HINT": "f32", "INFERENCE_NUM_THREADS": 2}
reference, built = (core.compile_model(m, "CPU", hint) for m in (model, core.read_model(str(out))))
cosines = []
for f in sorted(validation.glob("opt_*.npy")):
    x = np.load(f)
    cosines.append(cosine(*(np.asarray(c({0: x})[0]) for c in (reference, built))))
print(json.dumps({"seconds": seconds, "version": nncf.__version__, "cosines": cosines}))
"""


def nncf_peer(run_dir: Path, data: Path, work: Path) -> dict:
    """NNCF (the peer, OpenVINO) on the run's converted fp32 model and calibration samples,
    in a fresh process (cold, as the parity runs are): its seconds from import to the saved
    IR, and its per-sample cosines on the opt-shaped validation samples."""
    work.mkdir(parents=True, exist_ok=True)
    done = subprocess.run([sys.executable, "-c", NNCF_RUN, str(run_dir / "stages" / "convert" / "model.onnx"),
                           str(data / "calibration"), str(data / "validation"), str(work / "nncf.xml")],
                          capture_output=True, text=True, check=False, env={**os.environ, "PYTHONPATH": str(REPO)})
    if done.returncode != 0:
        raise SystemExit(f"NNCF failed:\n{done.stderr[-2000:]}")
    found = json.loads(done.stdout.strip().splitlines()[-1])
    found["cosines"] = np.asarray(found["cosines"])
    return found


def interleaved_latency(bundles: dict, kind: str) -> dict:
    """Both bundles in workers, timed interleaved at the opt shape (verify's method)."""
    height, width = SHAPES[kind]["opt"]
    feeds = {"x": np.random.default_rng(0).uniform(-1, 1, (1, 3, height, width)).astype(np.float32)}
    workers = {}
    try:
        for name, bundle in bundles.items():
            settings = yaml.safe_load((bundle / "runtime.yaml").read_text())
            module = backends.spec(settings["backend"]).__name__
            workers[name] = BackendWorker(module, bundle, settings, label=name, timeout_s=600)
            workers[name].launch()
        for worker in workers.values():
            worker.wait_loaded()
        return speed.interleaved(workers, feeds, rounds=9, runs=10, max_seconds=60)
    finally:
        for worker in workers.values():
            worker.close()


def bundle_of(run_dir: Path) -> Path:
    return next(p for p in (run_dir / "bundle").iterdir() if p.is_dir())


def one(kind: str, target: str, precision: str, root: Path, extras: Sequence[str] = (), peer: bool = False) -> dict:
    """``extras``: names in EXTRAS, one more parity run each."""
    model = MODELS / FILES[kind]
    common = [f"model.path={model}", "data.kind=tensors", "metric=none", f"target={target}", "target.threads=2",
              f"precision={precision}", "validation.min_cosine=0", "validation.task_min_cosine=null",
              "validation.layerwise=off"]
    found = {}
    for dynamic in (True, False):
        name = "dynamic" if dynamic else "fixed"
        data = root / "data" / kind / name
        seconds, code, report, run_dir = parity([*common, shape_args(kind, dynamic), f"data.path={data}"],
                                                root / "runs" / f"{kind}-{target}-{precision}-{name}")
        found[name] = {"seconds": seconds, "exit": code, "cosine": opt_cosine(report, dynamic),
                       "per_sample": opt_sample_cosines(report, dynamic),
                       "shipped": report["precision"], "calibrate": calibrate_cost(report, kind, dynamic),
                       "bundle": bundle_of(run_dir), "run": run_dir}
        if peer and target == "openvino_cpu":
            found[name]["nncf"] = nncf_peer(run_dir, data, root / "nncf" / f"{kind}-{name}")
    for extra in extras:  # the dynamic bundle on the fixed run's samples; a fixed one on other samples
        folder, dynamic = EXTRAS[extra]
        _, _, report, _ = parity([*common, shape_args(kind, dynamic), f"data.path={root / 'data' / kind / folder}"],
                                 root / "runs" / f"{kind}-{target}-{precision}-{folder}")
        found[extra] = {"cosine": opt_cosine(report, dynamic),
                        "gap": paired_gap(opt_sample_cosines(report, dynamic), found["fixed"]["per_sample"])}
    found["paired_gap"] = paired_gap(found["dynamic"]["per_sample"], found["fixed"]["per_sample"])
    timing = interleaved_latency({n: found[n]["bundle"] for n in ("dynamic", "fixed")}, kind)
    ratios = [d / f for d, f in zip(timing["dynamic"]["round_medians_ms"], timing["fixed"]["round_medians_ms"])]
    found["latency"] = {n: timing[n]["median_ms"] for n in ("dynamic", "fixed")}
    found["latency_ratio"] = float(np.median(ratios))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["det", "rec"], choices=["det", "rec"])
    parser.add_argument("--targets", nargs="+", default=["openvino_cpu", "ort_cpu"])
    parser.add_argument("--precisions", nargs="+", default=["int8", "auto"])
    parser.add_argument("--per-shape", nargs=2, type=int, metavar=("CALIBRATION", "VALIDATION"),
                        default=[PER_SHAPE["calibration"], PER_SHAPE["validation"]],
                        help="samples per shape bucket (default 4 4); the fixed run calibrates on 3x CALIBRATION")
    parser.add_argument("--control", action="store_true",
                        help="one more run: a second fixed build calibrated on other opt samples, the gap that the "
                             "choice of calibration samples alone makes")
    parser.add_argument("--nncf", action="store_true",
                        help="openvino_cpu rows: NNCF (pip install -e .[bench]) on each run's converted model and "
                             "calibration samples, its seconds and its own dynamic-vs-fixed gap at opt")
    parser.add_argument("--isa", choices=["native", "AVX2"], default="native",
                        help="AVX2: every run and timing as on an AVX2-only CPU (benchmarks/avx2_only.py; where "
                             "this machine cannot present one, OpenVINO's oneDNN capped only)")
    parser.add_argument("--keep", type=Path, help="write data and runs here and keep them (default: a temporary folder)")
    parser.add_argument("--same-calibration", action="store_true",
                        help="a third run: the dynamic bundle calibrated on the fixed run's samples, so that the "
                             "cosine gap is the dynamic dims' alone")
    args = parser.parse_args()
    PER_SHAPE.update(calibration=args.per_shape[0], validation=args.per_shape[1])
    extras = [name for name in EXTRAS if getattr(args, name)]
    isa = become(args.isa)  # inherited by the parity runs and the timing workers
    info = cpu()
    print(f"CPU: {info.get('model')}; flags: {', '.join(info.get('flags', []))}; 2 threads; ISA {args.isa}: {isa}")
    with tempfile.TemporaryDirectory(prefix="parity-dynamic-") as scratch:
        root = args.keep or Path(scratch)
        for kind in args.models:
            write_data(kind, root / "data" / kind)
            if "same_calibration" in extras:
                same_calibration_data(root / "data" / kind)
            if "control" in extras:
                control_data(kind, root / "data" / kind)
            print(f"\n{kind}: shapes {SHAPES[kind]} ({PER_SHAPE} samples per shape)")
            print(f"{'target':<13} {'prec':<5} {'shipped d/f':<12} {'cos@opt dyn':>11} {'fixed':>9} {'gap':>7} "
                  f"{'ms@opt dyn':>10} {'fixed':>8} {'ratio':>6} {'calib s/sample dyn':>18} {'fixed':>6} "
                  f"{'s/MP dyn':>9} {'fixed':>6} {'run s dyn':>9} {'fixed':>6}  per-sample gap dyn-fixed [95 %]")
            for target in args.targets:
                for precision in args.precisions:
                    found = one(kind, target, precision, root, extras, args.nncf)
                    print(_row(target, precision, found), flush=True)
                    if args.isa != "native" and target == "openvino_cpu":  # what really dispatched
                        print(f"  kernels (fixed build): {kernels(found['fixed']['run'], dict(os.environ))}")
    print(f"\ngoals: cosine gap <= {GOALS['cosine_gap']}, latency ratio <= {GOALS['latency_ratio']:.2f}, "
          "calibration s/sample dynamic <= fixed (per megapixel shown because the shapes differ in size)")


def _row(target: str, precision: str, found: dict) -> str:
    dyn, fix = found["dynamic"], found["fixed"]
    gap = abs(dyn["cosine"] - fix["cosine"])
    cal = [c[1] if c else float("nan") for c in (dyn["calibrate"], fix["calibrate"])]
    per_mp = [c[2] if c else float("nan") for c in (dyn["calibrate"], fix["calibrate"])]
    return (f"{target:<13} {precision:<5} {dyn['shipped'] + '/' + fix['shipped']:<12} {dyn['cosine']:>11.6f} "
            f"{fix['cosine']:>9.6f} {gap:>7.4f} {found['latency']['dynamic']:>10.3f} {found['latency']['fixed']:>8.3f} "
            f"{found['latency_ratio']:>6.3f} {cal[0]:>18.3f} {cal[1]:>6.3f} {per_mp[0]:>9.3f} {per_mp[1]:>6.3f} "
            f"{dyn['seconds']:>9.1f} {fix['seconds']:>6.1f}  {_gap_text(found['paired_gap'])}"
            + "".join(f"  {label}: cos@opt {found[extra]['cosine']:.6f}, gap "
                      f"{abs(found[extra]['cosine'] - fix['cosine']):.4f}, per sample {_gap_text(found[extra]['gap'])}"
                      for extra, label in (("same_calibration", "same calibration"),
                                           ("control", "control (fixed, other calibration samples)")) if extra in found)
            + (f"  NNCF {dyn['nncf']['version']}: quantize s dyn {dyn['nncf']['seconds']:.1f} fixed "
               f"{fix['nncf']['seconds']:.1f}, mean per-sample cos@opt dyn {dyn['nncf']['cosines'].mean():.6f} "
               f"fixed {fix['nncf']['cosines'].mean():.6f} (parity's: {dyn['per_sample'].mean():.6f}, "
               f"{fix['per_sample'].mean():.6f}), NNCF's per-sample gap "
               f"{_gap_text(paired_gap(dyn['nncf']['cosines'], fix['nncf']['cosines']))}" if "nncf" in dyn else ""))


def _gap_text(gap: tuple) -> str:
    mean, (low, high) = gap
    return f"{mean:+.4f} [{low:+.4f}, {high:+.4f}]"


if __name__ == "__main__":
    main()
