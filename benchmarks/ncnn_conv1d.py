"""ncnn: a Conv1d network as ncnn's Convolution1D against its 1 x k Convolution form, in one run.

    pip install -e .[ncnn]
    python benchmarks/ncnn_conv1d.py [--rounds 7] [--runs 5]

The model: a wav2vec 2.0-style speech front-end at its real size with a keyword head, made
with onnx.helper (random weights: speed does not depend on training): raw audio [1, 16000]
(1 s at 16 kHz) -> 7 Conv1d of 512 channels (kernels 10,3,3,3,3,2,2, strides 5,2,2,2,2,2,2),
an InstanceNormalization after the first (PyTorch's GroupNorm(512, 512)), GELU after each
(the Erf form PyTorch exports) -> mean over time -> Gemm to 12 logits; 4.2 M parameters.
Builds on ncnn_cpu: fp32 as ncnn's Convolution1D (pnnx's own conversion, parity's rewrite
turned off in this process), and through the `parity` CLI fp32 and int8 as parity builds them
(every Conv1d a 1 x k Convolution: pipeline/backends/ncnn/conversion.py, conv1d_as_2d; int8
from 16 random calibration clips). Each loaded with its runtime.yaml (2 threads), timed in this
process: `--rounds` rounds, each build in turn (order rotated) `--runs` runs on one clip, the
round's figure the median; speed-up vs the Convolution1D fp32 build: the median of the
per-round ratios and where the next round's ratio falls, 90 % (speed.round_interval). The CPU's
int8-relevant flags are printed with the result: run it through benchmarks/avx2_only.py for
an AVX2-only CPU. Measured (docs/targets.md, ncnn "Conversion"): on an AMX Xeon fp32 1.55x and
int8 2.91x, as an AVX2 CPU 1.67x and 2.03x.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
from mixed import parity  # noqa: E402  (one `parity` run, its run folder)
from pipeline.environment import cpu  # noqa: E402
from pipeline.verification.speed import round_interval  # noqa: E402

KERNELS = [(10, 5), (3, 2), (3, 2), (3, 2), (3, 2), (2, 2), (2, 2)]
CHANNELS, SAMPLES, CLASSES = 512, 16000, 12
INT8_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8")


def front_end(path: Path) -> Path:
    """The speech front-end as an ONNX file (onnx.helper, random He-scaled weights)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    constants, nodes, current, inputs = {}, [], "audio_3d", 1
    nodes.append(helper.make_node("Unsqueeze", ["audio", "axis1"], [current], name="to_channels"))
    constants["axis1"] = np.array([1], np.int64)
    for index, (kernel, stride) in enumerate(KERNELS):
        weight = f"conv{index}.weight"
        constants[weight] = rng.normal(0, np.sqrt(2 / (inputs * kernel)), (CHANNELS, inputs, kernel)).astype(np.float32)
        nodes.append(helper.make_node("Conv", [current, weight], [f"conv{index}"], name=f"conv{index}",
                                      kernel_shape=[kernel], strides=[stride]))
        current, inputs = f"conv{index}", CHANNELS
        if index == 0:
            constants.update({"norm.scale": np.ones(CHANNELS, np.float32), "norm.bias": np.zeros(CHANNELS, np.float32)})
            nodes.append(helper.make_node("InstanceNormalization", [current, "norm.scale", "norm.bias"], ["norm0"],
                                          name="norm0"))
            current = "norm0"
        current = _gelu(nodes, constants, current, f"gelu{index}")
    constants.update({"head.weight": rng.normal(0, 0.05, (CLASSES, CHANNELS)).astype(np.float32),
                      "head.bias": np.zeros(CLASSES, np.float32)})
    nodes += [helper.make_node("ReduceMean", [current], ["pooled"], name="pool", axes=[2], keepdims=0),
              helper.make_node("Gemm", ["pooled", "head.weight", "head.bias"], ["logits"], name="head", transB=1)]
    graph = helper.make_graph(nodes, "speech_front_end",
                              [helper.make_tensor_value_info("audio", TensorProto.FLOAT, [1, SAMPLES])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, CLASSES])],
                              [numpy_helper.from_array(value, name) for name, value in constants.items()])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), str(path))
    return path


def _gelu(nodes: list, constants: dict, source: str, name: str) -> str:
    """x * 0.5 * (1 + erf(x / sqrt(2))), as PyTorch exports GELU (pnnx fuses it to ncnn's GELU)."""
    from onnx import helper

    constants.update({"sqrt2": np.array(np.sqrt(2), np.float32), "one": np.array(1, np.float32),
                      "half": np.array(0.5, np.float32)})
    steps = [("Div", [source, "sqrt2"]), ("Erf", None), ("Add", "one"), ("Mul", source), ("Mul", "half")]
    current = source
    for number, (op, other) in enumerate(steps):
        inputs = other if isinstance(other, list) else [current] + ([other] if other else [])
        nodes.append(helper.make_node(op, inputs, [f"{name}.{number}"], name=f"{name}.{number}"))
        current = f"{name}.{number}"
    return current


def clips(folder: Path, count: int, rng) -> None:
    folder.mkdir(parents=True)
    t = np.arange(SAMPLES) / SAMPLES
    for index in range(count):
        tone = np.sin(2 * np.pi * rng.uniform(100, 3000) * t) * rng.uniform(0.2, 0.8)
        np.save(folder / f"{index:03d}.npy", (tone + rng.normal(0, 0.05, SAMPLES)).astype(np.float32)[None])


def convolution_1d_build(model: Path, out: Path) -> Path:
    """fp32 as pnnx converts the Conv1d ops itself (ncnn's Convolution1D)."""
    from pipeline.backends import ncnn
    from pipeline.backends.ncnn import conversion
    from pipeline.config.schemas import Backend, NcnnOptions, NcnnTarget

    conversion.conv1d_as_2d = lambda model: model  # this process only: the reference build
    out.mkdir()
    target = NcnnTarget(name="ncnn_cpu", backend=Backend.ncnn, device="CPU", ncnn=NcnnOptions())
    files, settings = ncnn.build(model, None, out, target, "fp32")
    (out / "runtime.yaml").write_text(yaml.safe_dump({**settings, "files": files, "backend": "ncnn", "device": "CPU"}))
    return out


def loaded(folder: Path):
    from pipeline.backends import ncnn

    settings = yaml.safe_load((folder / "runtime.yaml").read_text())
    return ncnn.load(folder, settings)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    info = cpu()
    flags = [flag for flag in INT8_FLAGS if flag in info.get("flags", [])]
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; CPU {info.get('model')}; int8-relevant flags: "
          f"{' '.join(flags) or 'none'}")
    with tempfile.TemporaryDirectory(prefix="parity-conv1d-") as scratch:
        work = Path(scratch)
        model = front_end(work / "front_end.onnx")
        rng = np.random.default_rng(1)
        clips(work / "data" / "calibration", 16, rng)
        clips(work / "data" / "validation", 4, rng)
        common = [f"model.path={model}", f"data.path={work / 'data'}", "target=ncnn_cpu", "metric=none"]
        runs = {"1 x k fp32": parity([*common, "precision=fp32", "pipeline.stages=[convert,build]"], work),
                "1 x k int8": parity([*common, "precision=int8", "pipeline.stages=[convert,calibrate,build]"], work)}
        folders = {"Convolution1D fp32": convolution_1d_build(model, work / "conv1d"),
                   **{name: run / "stages" / "build" for name, run in runs.items()}}
        sessions = {name: loaded(folder) for name, folder in folders.items()}
        feeds = {"audio": np.load(work / "data" / "validation" / "000.npy")}
        medians = timed(sessions, feeds, args.rounds, args.runs)
    reference = np.array(medians["Convolution1D fp32"])
    print(f"ncnn_cpu, one clip [1, {SAMPLES}], {args.rounds} rounds of {args.runs} runs, each build in turn:")
    print("| build | ms a run | speed-up vs Convolution1D fp32 (the next round's 90 % range) |")
    print("|---|---|---|")
    for name, own in medians.items():
        ratios = list(reference / np.array(own))
        low, high = round_interval(ratios)
        print(f"| {name} | {np.median(own):.2f} | {np.median(ratios):.2f}x ({low:.2f}-{high:.2f}) |")


def timed(sessions: dict, feeds: dict, rounds: int, runs: int) -> dict:
    """Per build, its round medians (ms): rounds with every build in turn, order rotated."""
    for session in sessions.values():
        for _ in range(3):
            session.run(feeds)
    names, medians = list(sessions), {name: [] for name in sessions}
    for number in range(rounds):
        for name in names[number % len(names):] + names[:number % len(names)]:
            times = []
            for _ in range(runs):
                started = time.perf_counter()
                sessions[name].run(feeds)
                times.append(1000 * (time.perf_counter() - started))
            medians[name].append(float(np.median(times)))
    return medians


if __name__ == "__main__":
    main()
