"""The MNN backend on the real runtime (pip mnn): conversion without network, outputs and
intermediate tensors against ONNX Runtime, the silent GPU fallback caught, the GPU mode
bits, fp16 reported as what ran, and int8 through MNN's own quantizer."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from importlib import resources
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from conftest import cli_env, run_cli

from pipeline.config.schemas import Backend, MemoryMode, MnnOptions, MnnPrecision, MnnTarget, Tuning

mnn = pytest.importorskip("pipeline.backends.mnn")
# skipped without the extra locally; in CI (which installs it) the tests run and fail
pytestmark = pytest.mark.skipif(not mnn.available()[0] and not os.environ.get("CI"),
                                reason="MNN is not installed: pip install 'parity[mnn]'")

ASSETS = Path(__file__).resolve().parents[1] / "pipeline" / "assets"
DIGITS = ASSETS / "digits_cnn.onnx"
DIGITS_INPUTS = [{"name": "input", "shape": [1, 1, 8, 8], "dtype": "float32"}]
DIGITS_OUTPUTS = [{"name": "logits", "shape": [1, 10], "dtype": "float32"}]
DIGITS_TENSORS = ["conv1_out", "relu1_out", "conv2_out", "relu2_out", "conv3_out", "relu3_out", "pool1_out",
                  "flatten_out", "fc1_out", "relu4_out", "logits"]


def target(device: str = "CPU", threads: int = 0, **options) -> MnnTarget:
    return MnnTarget(name=f"mnn_{device.lower()}", backend=Backend.mnn, device=device, threads=threads,
                     mnn=MnnOptions(**options))


def digits_data():
    data = np.load(ASSETS / "digits.npz")
    return data["calibration/input"], data["validation/input"]


def built(tmp_path: Path, device: str = "CPU", precision: str = "fp32", model: Path = DIGITS, **fields):
    out = tmp_path / f"{device}-{precision}"
    out.mkdir()
    files, settings = mnn.build(model, None, out, target(device, **fields), precision)
    return out, files, settings


def loaded(folder: Path, settings: dict, device: str = "CPU", precision: str = "fp32"):
    """What parity's verify does: runtime.yaml's dict handed to load()."""
    runtime = {**settings, "backend": "mnn", "device": device, "precision": precision,
               "inputs": DIGITS_INPUTS, "outputs": DIGITS_OUTPUTS}
    return mnn.load(folder, json.loads(json.dumps(runtime)))  # YAML/JSON-able


def cosine(a, b) -> float:
    a = np.concatenate([np.ravel(x) for x in a]).astype(np.float64)
    b = np.concatenate([np.ravel(x) for x in b]).astype(np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def reference_outputs(model: Path, names, feeds_list):
    """ONNX Runtime (optimizations off) on a copy of the model with ``names`` as outputs."""
    proto = onnx.load(str(model))
    del proto.graph.output[:]
    proto.graph.output.extend(onnx.ValueInfoProto(name=name) for name in names)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return [dict(zip(names, session.run(list(names), feeds))) for feeds in feeds_list]


def test_digits_cpu_fp32_matches_onnxruntime(tmp_path):
    folder, files, settings = built(tmp_path)
    assert files == ["model.mnn", "tensors.json"] and all((folder / f).is_file() for f in files)
    assert settings["model"] == "model.mnn"
    assert settings["options"]["forward_type"] == 0 and settings["options"]["precision"] == "high"
    assert "cache_file" not in settings["options"] and "mode" not in settings["options"]
    session = loaded(folder, settings)
    assert session.inputs == ["input"] and session.outputs == ["logits"]
    _, validation = digits_data()
    feeds = [{"input": x[None]} for x in validation[:64]]
    got = [session.run(f) for f in feeds]
    assert all(set(g) == {"logits"} and g["logits"].shape == (1, 10) and g["logits"].dtype == np.float32 for g in got)
    expected = reference_outputs(DIGITS, ["logits"], feeds)
    assert cosine([g["logits"] for g in got], [e["logits"] for e in expected]) > 0.99999
    with pytest.raises(ValueError, match="missing"):
        session.run({})  # MNN itself would run on the last input again
    effective = session.effective()
    assert effective["device"] == "CPU" and effective["precision"] == "fp32"
    assert effective["layers"] == "fp32: 5"  # conv1-3, fc1 and fc2 (MNN runs the Gemms as 1x1 convolutions)
    assert "note" not in effective


def test_converter_runs_without_network_or_console_script(tmp_path):
    """The mnnconvert console script and MNN.tools.mnnconvert pip-install a logging SDK and
    post usage logs: an MNN job calls the converter function (in a child process, followed
    by strace -f) and opens no AF_INET socket, runs no MNN tool or pip, reads nothing of
    MNN.tools."""
    strace = shutil.which("strace")
    assert strace, "strace is needed (Debian: apt-get install strace; .ci/run installs it)"
    trace = tmp_path / "mnn.trace"
    script = Path(sys.executable).parent / "parity"
    done = subprocess.run([strace, "-f", "-qq", "-e", "trace=execve,socket,connect,openat", "-e", "signal=none",
                           "-o", str(trace), str(script), "target=mnn_cpu", "precision=fp32"],
                          cwd=tmp_path, env=cli_env({"PARITY_CACHE_DIR": str(tmp_path / "cache")}),  # converts
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    calls = trace.read_text().splitlines()
    programs = {line.split('execve("', 1)[1].split('"', 1)[0] for line in calls if 'execve("' in line}
    assert [p for p in programs if any(word in Path(p).name for word in ("mnn", "pip", "curl", "wget"))] == []
    assert [line for line in calls if "AF_INET" in line or "MNN/tools" in line or "aliyun" in line] == []
    assert any("_tools" in line and "openat" in line for line in calls), "the converter extension was not loaded"


def test_converter_failure_is_a_clear_error(tmp_path):
    broken = tmp_path / "broken.onnx"
    broken.write_bytes(b"not an onnx model")
    with pytest.raises(RuntimeError, match=r"MNN's converter on broken.onnx failed \(exit 3\)"):
        mnn.convert(broken, tmp_path / "model.mnn")
    assert not (tmp_path / "model.mnn").exists()


def test_a_converter_crash_is_an_error_and_parity_goes_on(tmp_path):
    """MNN 3.6.1's converter segfaults on a one-layer ONNX LSTM rewritten as a While loop
    (its default) or aborts: in the child process that is a RuntimeError naming the signal."""
    from pipeline.backends.mnn.common import run_tool

    model = _lstm(tmp_path)
    dst = tmp_path / "crashed.mnn"
    with pytest.raises(RuntimeError, match=r"failed \(signal SIG(SEGV|ABRT)\)"):  # memory corrupted: either
        run_tool("mnnconvert", ["mnnconvert", "-f", "ONNX", "--modelFile", str(model), "--MNNModel", str(dst)],
                 dst, 120, "MNN's converter")
    assert not dst.exists()


def _lstm(folder: Path, steps: int = 10, features: int = 8, hidden: int = 16) -> Path:
    """One ONNX LSTM op (a keyword spotter's recurrent layer), its last hidden state out."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    weights = [numpy_helper.from_array(rng.normal(size=shape).astype(np.float32) * 0.3, name)
               for name, shape in (("W", (1, 4 * hidden, features)), ("R", (1, 4 * hidden, hidden)),
                                   ("B", (1, 8 * hidden)))]
    graph = helper.make_graph([helper.make_node("LSTM", ["x", "W", "R", "B"], ["y", "state"], hidden_size=hidden)],
                              "lstm", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [steps, 1, features])],
                              [helper.make_tensor_value_info("state", TensorProto.FLOAT, [1, 1, hidden])], weights)
    path = folder / "lstm.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), path)
    return path


def test_an_lstm_quantizes_and_is_judged_on_the_fp32_models_outputs(tmp_path):
    """MNN's quantizer gives an LSTM's int8 model more outputs than the fp32 one (its states):
    each method is judged on the fp32 model's outputs alone (a shape error before)."""
    model = _lstm(tmp_path)
    rng = np.random.default_rng(1)
    samples = [{"x": rng.normal(size=(10, 1, 8)).astype(np.float32)} for _ in range(8)]
    out = tmp_path / "int8"
    out.mkdir()
    _, settings = mnn.build_int8(model, out, target(), samples, "auto", float_ops=[])
    scores = settings["options"]["quantization"]["output_cosine_vs_fp32"]
    assert scores and max(scores.values()) > 0.99, settings["options"]["quantization"]


def test_an_lstm_converts_runs_and_matches_onnxruntime(tmp_path):
    """`parity target=mnn_cpu precision=fp32` on an LSTM: MNN's own RNN op (RNN_AS_IS), verified
    against ONNX Runtime on every sample, exit 0."""
    model = _lstm(tmp_path)
    done = run_cli([f"model.path={model}", "data=random", "target=mnn_cpu", "precision=fp32"], tmp_path)
    assert done.returncode == 0, done.stdout[-2000:]
    report = json.loads(next(tmp_path.glob("outputs/*/*/report.json")).read_text())
    (state,) = report["verify"]["outputs"]
    assert state["name"] == "state" and state["passed"] and state["metrics"]["cosine"] > 0.99999 and report["verify"]["effective"]["precision"] == "fp32"


@pytest.mark.parametrize("device, forward_type", [("OPENCL", 3), ("VULKAN", 7)])
def test_gpu_request_that_runs_on_the_cpu_is_reported(tmp_path, device, forward_type):
    folder, files, settings = built(tmp_path, device)
    options = settings["options"]
    assert options["forward_type"] == forward_type and options["mode"] == mnn.GPU_TUNING["none"]
    assert options["cache_file"] == "tuning.cache"
    session = loaded(folder, settings, device)
    _, validation = digits_data()
    session.run({"input": validation[:1]})
    effective = session.effective()
    if mnn.runtime_exists(device):  # an MNN build with this GPU backend
        assert effective["device"] == device and mnn.fallback_reason(session) == ""
        return
    # the pip wheel: MNN prints "Can't Find type=N backend, use 0 instead" and runs on the CPU
    assert effective["device"] == "CPU"
    assert session.backend_type() in (0, 13)  # MNN_FORWARD_CPU, MNN_FORWARD_CPU_EXTENSION
    assert f"no {device} backend" in effective["note"] and effective["note"] == mnn.fallback_reason(session)
    assert "tuning.cache" not in files  # nothing was tuned: no GPU ran at build time


def test_cpu_session_reports_no_fallback(tmp_path):
    folder, _, settings = built(tmp_path)
    assert mnn.runtime_exists("CPU")
    assert mnn.fallback_reason(loaded(folder, settings)) == ""


def test_gpu_mode_bits():
    assert mnn.GPU_TUNING == {"none": 1, "heavy": 2, "wide": 4, "normal": 8, "fast": 16}
    assert mnn.GPU_MEMORY == {"auto": 0, "buffer": 64, "image": 128}
    assert mnn.gpu_mode() == 1
    assert mnn.gpu_mode("wide", "image") == (1 << 2) | (1 << 7) == 132
    assert mnn.gpu_mode("heavy", "buffer") == (1 << 1) | (1 << 6) == 66
    assert mnn.gpu_mode("fast", "auto") == 1 << 4
    assert mnn.gpu_mode("normal", "buffer") == (1 << 3) | (1 << 6)
    options = mnn.session_options(target("OPENCL", tuning=Tuning.wide, memory_mode=MemoryMode.image), "fp32")
    assert options["mode"] == 132 and options["forward_type"] == 3 and "numThread" not in options
    # ScheduleConfig keeps numThread and mode in one union: the GPU mode travels as numThread
    assert mnn.schedule_config(options) == {"backend": 3, "precision": 1, "numThread": 132}
    cpu = mnn.session_options(target("CPU", threads=2), "fp16")
    assert mnn.schedule_config(cpu) == {"backend": 0, "precision": 2, "numThread": 2}
    assert mnn.session_options(target("VULKAN", precision=MnnPrecision.normal), "fp16")["precision_mode"] == 0


def test_gpu_build_keeps_the_tuning_cache_setting(tmp_path):
    folder, files, settings = built(tmp_path, "OPENCL", tuning=Tuning.heavy, memory_mode=MemoryMode.buffer)
    assert settings["options"]["cache_file"] == "tuning.cache"
    assert settings["options"]["mode"] == (1 << 1) | (1 << 6)
    assert ("tuning.cache" in files) == mnn.runtime_exists("OPENCL") == (folder / "tuning.cache").is_file()
    before = sorted(p.name for p in folder.iterdir())
    session = loaded(folder, settings, "OPENCL")
    session.run({"input": digits_data()[1][:1]})
    assert sorted(p.name for p in folder.iterdir()) == before  # the bundle is read, never rewritten


@pytest.mark.parametrize("device, fields, problem", [
    ("CPU", {"memory_mode": MemoryMode.image}, "target.mnn.memory_mode=image needs an MNN GPU device"),
    ("VULKAN", {"memory_mode": MemoryMode.buffer}, "no runtime memory mode"),
    ("CPU", {"tuning": Tuning.wide}, "target.mnn.tuning=wide needs an MNN GPU device"),
    ("VULKAN", {"tuning": Tuning.fast}, "OpenCL-only"),
    ("OPENCL", {"threads": 4}, "target.threads=4"),
    ("CPU", {"precision": MnnPrecision.low}, "precision=fp32 needs high or normal"),
])
def test_check_config_names_what_mnn_cannot_do(device, fields, problem):
    assert problem in mnn.check_config(target(device, **fields), "fp32")


def test_check_config_accepts_the_shipped_targets():
    assert mnn.check_config(target("CPU"), "fp32") is None
    assert mnn.check_config(target("CPU", threads=2), "int8") is None
    assert mnn.check_config(target("OPENCL", memory_mode=MemoryMode.image, tuning=Tuning.fast), "fp16") is None
    assert mnn.check_config(target("VULKAN", tuning=Tuning.wide), "fp32") is None


def test_probe_exposes_the_digits_tensors_as_onnx_has_them(tmp_path):
    folder, _, settings = built(tmp_path)
    session = loaded(folder, settings)
    found = session.probe(DIGITS_TENSORS)
    exposed = found["exposed"]
    assert {"relu1_out", "relu2_out", "pool1_out", "flatten_out", "relu3_out", "logits"} <= set(exposed)
    # MNN fuses fc1's ReLU into the convolution it runs fc1 as: its tensor "fc1_out" holds
    # relu3_out's values, so it must not stand for ONNX's fc1_out
    assert "fc1_out" not in exposed and "fc1_out" in json.loads((folder / "tensors.json").read_text())["fused"]
    assert not {"conv1_out", "conv2_out"} & set(exposed)  # fused away
    assert {"relu1_out", "logits"} <= set(found["tensors"])
    _, validation = digits_data()
    feeds = [{"input": x[None]} for x in validation[:8]]
    expected = reference_outputs(DIGITS, exposed, feeds)
    actual = [session.run_probe(f) for f in feeds]
    for name in exposed:
        assert actual[0][name].shape == expected[0][name].shape and actual[0][name].dtype == np.float32
        assert cosine([a[name] for a in actual], [e[name] for e in expected]) > 0.99999, name


def test_fp16_runs_and_reports_what_ran(tmp_path):
    folder, _, settings = built(tmp_path, precision="fp16")
    assert settings["options"]["precision"] == "low" and settings["options"]["precision_mode"] == 2
    session = loaded(folder, settings, precision="fp16")
    _, validation = digits_data()
    feeds = {"input": validation[:1]}
    low = session.run(feeds)["logits"]
    high_folder, _, high_settings = built(tmp_path, precision="fp32")
    high = loaded(high_folder, high_settings).run(feeds)["logits"]
    effective = session.effective()
    assert effective["device"] == "CPU"
    if np.array_equal(low, high):  # x86: MNN's CPU backend has no fp16 arithmetic
        assert effective["precision"] == "fp32" and "bit-identical" in effective["note"]
    else:
        assert effective["precision"] == "fp16"
    assert cosine([low], [high]) > 0.999


@pytest.fixture(scope="module")
def int8_auto(tmp_path_factory):
    calibration, _ = digits_data()
    out = tmp_path_factory.mktemp("int8")
    files, settings = mnn.build_int8(DIGITS, out, target(), [{"input": x[None]} for x in calibration[:32]], "auto")
    return out, files, settings


def test_int8_through_mnns_quantizer_stays_close_to_fp32(int8_auto):
    folder, files, settings = int8_auto
    assert files == ["model.mnn", "tensors.json"]
    quantization = settings["options"]["quantization"]
    assert quantization["samples"] == 32 and quantization["method"] == "auto"
    assert set(quantization["output_cosine_vs_fp32"]) == {"KL", "ADMM", "EMA"}
    scores = quantization["output_cosine_vs_fp32"]
    assert quantization["feature_quantize_method"] == max(scores, key=scores.get)
    session = loaded(folder, settings, precision="int8")
    _, validation = digits_data()
    feeds = [{"input": x[None]} for x in validation[:64]]
    expected = reference_outputs(DIGITS, ["logits"], feeds)
    assert cosine([session.run(f)["logits"] for f in feeds], [e["logits"] for e in expected]) > 0.99
    effective = session.effective()
    assert effective["precision"] == "int8" and effective["layers"] == "int8: 5" and effective["device"] == "CPU"


def test_int8_method_mapping_is_recorded(tmp_path):
    calibration, validation = digits_data()
    samples = [{"input": x[None]} for x in calibration[:32]]
    files, settings = mnn.build_int8(DIGITS, tmp_path, target(), samples, "max")
    quantization = settings["options"]["quantization"]
    assert quantization["feature_quantize_method"] == "EMA" and "closest" in quantization["mapping"]
    assert mnn.FEATURE_METHODS["kl"][0] == "KL" and mnn.FEATURE_METHODS["mse"][0] == "ADMM"
    # MNN's EMA quantizer rebuilds the graph and names tensors after ops (its "conv1_out"
    # holds relu1_out's values): each exposed tensor must be closest to its ONNX namesake
    session = loaded(tmp_path, settings, precision="int8")
    exposed = session.probe(DIGITS_TENSORS)["exposed"]
    assert exposed and "conv1_out" not in exposed and "fc1_out" not in exposed
    feeds = [{"input": x[None]} for x in validation[:8]]
    expected = reference_outputs(DIGITS, DIGITS_TENSORS, feeds)
    actual = [session.run_probe(f) for f in feeds]
    for name in exposed:
        own = cosine([a[name] for a in actual], [e[name] for e in expected])
        others = [cosine([a[name] for a in actual], [e[other] for e in expected]) for other in DIGITS_TENSORS
                  if other != name and expected[0][other].size == expected[0][name].size]
        # own: int8 against float through MNN's EMA on 32 samples (0.88 at pool1_out, after the
        # 128-channel conv2); the mapping is right when no other tensor is closer
        assert own > 0.8 and all(own >= other - 1e-6 for other in others), name


def test_int8_quantizer_failure_is_reported(tmp_path):
    src = tmp_path / "fp32.mnn"
    mnn.convert(DIGITS, src)
    config = tmp_path / "config.json"
    mnn.write_json(config, {"path": str(tmp_path / "missing"), "feature_quantize_method": "KL",
                            "input_type": "sequence"})
    with pytest.raises(RuntimeError, match="MNN's quantizer failed"):
        mnn.quantize(src, tmp_path / "int8.mnn", config)


@pytest.fixture(scope="module")
def ppocr_classifier(tmp_path_factory):
    """PP-OCR's text-direction classifier with its dynamic input fixed to 1x3x48x192."""
    pytest.importorskip("rapidocr_onnxruntime")
    source = resources.files("rapidocr_onnxruntime") / "models" / "ch_ppocr_mobile_v2.0_cls_infer.onnx"
    model = onnx.load(str(source))
    for dim, value in zip(model.graph.input[0].type.tensor_type.shape.dim, (1, 3, 48, 192)):
        dim.Clear()
        dim.dim_value = value
    path = tmp_path_factory.mktemp("ppocr") / "cls.onnx"
    onnx.save(model, str(path))
    return path


def test_ppocr_classifier_converts_and_agrees_with_onnxruntime(tmp_path, ppocr_classifier):
    folder, _, settings = built(tmp_path, model=ppocr_classifier)
    output = onnx.load(str(ppocr_classifier)).graph.output[0].name
    session = mnn.load(folder, {**settings, "inputs": [{"name": "x", "shape": [1, 3, 48, 192]}],
                                "outputs": [{"name": output, "shape": [1, 2]}]})
    rng = np.random.default_rng(0)
    feeds = [{"x": rng.uniform(-1, 1, (1, 3, 48, 192)).astype(np.float32)} for _ in range(4)]
    expected = reference_outputs(ppocr_classifier, [output], feeds)
    assert cosine([session.run(f)[output] for f in feeds], [e[output] for e in expected]) > 0.9999
    assert session.effective()["precision"] == "fp32"
    # every intermediate tensor the session exposes is the ONNX tensor of that name
    from pipeline.verification.layerwise import Graph

    names = [t.name for t in Graph(onnx.load(str(ppocr_classifier))).tensors]
    exposed = session.probe(names)["exposed"]
    assert len(exposed) > 50
    expected = reference_outputs(ppocr_classifier, exposed, feeds[:1])[0]
    actual = session.run_probe(feeds[0])
    low = [name for name in exposed if cosine([actual[name]], [expected[name]]) < 0.9999
           and np.abs(actual[name] - expected[name]).max() > 1e-4]
    assert not low
