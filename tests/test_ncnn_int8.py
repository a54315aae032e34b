"""ncnn int8 and mixed, written by parity in ncnn's own int8 format (pipeline/backends/ncnn/int8.py):
the CLI as users run it on the embedded digits model, the per-layer read-back checked
against an int8 convolution computed here, Vulkan (lavapipe) running the same int8 math."""

from __future__ import annotations

import platform

import numpy as np
import onnx
import pytest
import yaml

from conftest import read_report, single_bundle
from ncnn_helpers import CLS_SHAPE, cosine, digits_inputs, reference, require_vulkan
from side_by_side import PACKAGED, VERIFIED, Jobs, new_run
from textlines import NEEDS_FONTS_SKIPPED, write_ppocr_configs
from pipeline.backends import ncnn as backend
from pipeline.backends.ncnn.int8 import INT8_TAG, vulkan_int8_problem
from pipeline.precision.quantize import ops_of_kinds

pytest.importorskip("ncnn")

QUANTIZED = {"conv1", "conv2", "conv3", "fc1", "fc2"}  # the digits model's Conv and Gemm ops
FAST = ["target.threads=1"]  # 2 OpenMP threads per ncnn worker stall on a busy 2-core machine


def classifier_run(root, *args):
    """`parity ARGS` on the PP-OCR classifier's config folder and rendered text lines in
    ``root`` (written by the first run): (completed process, run folder, the lines' folder)."""
    if not (root / "conf").is_dir():
        write_ppocr_configs(root, calibration=16, validation=8)
    return (*new_run(["--config-dir", root / "conf", "model=ppocr_cls", "data=textlines", "target=ncnn_cpu",
                      *args, *FAST], root), root / "textlines")


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """Every CLI job of this module started side by side (tests/side_by_side.py): the digits jobs
    each in its own folder, the classifier's one after another in one folder (the later
    ones reuse its convert and calibrate). No profile (and no bundle where a test reads
    none), a short speed measure: no test here looks at them."""
    pool = Jobs()

    def digits(name, *args):
        cwd = tmp_path_factory.mktemp(f"ncnn-{name}")
        pool.submit(name, lambda: new_run([*args], cwd))

    root = tmp_path_factory.mktemp("ncnn-classifier")
    if not NEEDS_FONTS_SKIPPED:  # the longest chain first
        pool.submit("classifier-int8-depthwise", lambda: classifier_run(
            root, "precision=int8", "pipeline.stages=[convert,calibrate,build]", "target.ncnn.int8_depthwise=true"))
    digits("int8", "target=ncnn_cpu", "precision=int8", *FAST, PACKAGED)
    if not NEEDS_FONTS_SKIPPED:
        pool.submit("classifier-int8-verified", lambda: classifier_run(
            root, "precision=int8", "pipeline.stages=[convert,calibrate,build,verify]"),
            after="classifier-int8-depthwise")
        pool.submit("classifier-mixed-search", lambda: classifier_run(
            root, "precision=mixed", "sensitivity=top_n", "sensitivity.top_n=2", "sensitivity.samples=2",
            "sensitivity.methods=[max]", "pipeline.stages=[convert,calibrate,sensitivity]"),
            after="classifier-int8-verified")
    digits("mixed", "target=ncnn_cpu", "precision=mixed", "sensitivity=top_n", "sensitivity.top_n=1", *FAST,
           PACKAGED)
    digits("vulkan", "target=ncnn_vulkan", "precision=int8", PACKAGED)
    digits("int8-where-faster", "target=ncnn_cpu", "precision=int8", "precision.int8_where_faster=true", *FAST,
           VERIFIED)
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def int8_run(jobs):
    result, run_dir = jobs["int8"]
    assert result.returncode == 0, result.stdout + result.stderr
    return result, run_dir, read_report(run_dir)


def int8_layers(param_path) -> dict:
    return {layer.name: layer.param(8) for layer in backend.Param.read(param_path).layers if layer.param(8)}


def test_int8_cli_passes_with_every_quantized_layer_read_back_as_int8(int8_run):
    result, run_dir, report = int8_run
    effective = report["verify"]["effective"]
    assert effective["device"] == "CPU" and effective["precision"] == "int8"
    assert set(effective["int8_layers"].values()) == QUANTIZED
    assert effective["float_ops"] == {}
    assert "int8: 5 of 5 compute layers" in effective["layers"]
    assert report["verify"]["outputs"][0]["metrics"]["cosine"] > 0.999
    bundle = single_bundle(run_dir)
    assert set(int8_layers(bundle / "model.param")) == set(effective["int8_layers"])
    runtime = yaml.safe_load((bundle / "runtime.yaml").read_text())
    assert runtime["precision"] == "int8" and runtime["options"]["use_int8_inference"] is True
    assert "precision ran" in result.stdout


def test_read_back_is_true_the_first_conv_computes_in_int8(int8_run):
    """The int8 layer's output, extracted from ncnn, is the int8 convolution computed here
    from the bin's int8 weights and scales (and not the fp32 one), requantized to int8 with
    the top scale (conv2, an int8 convolution, is its only reader); the session divides the
    extracted int8 values by that scale."""
    import ncnn

    _, run_dir, _ = int8_run
    bundle = single_bundle(run_dir)
    data = (bundle / "model.bin").read_bytes()
    layer = backend.Param.read(bundle / "model.param").layers[1]  # conv1 + relu: C outputs, 1x3x3, pad 1
    assert layer.type == "Convolution" and int.from_bytes(data[:4], "little") == INT8_TAG
    assert layer.param(8) == "102"  # per-channel weight scales (2) + requantize (100)
    channels = int(layer.param(0))
    # the bin: the int8 tag, C x 1x3x3 int8 weights, then float32 bias (C), weight scales (C),
    # bottom scale and top scale
    weights = np.frombuffer(data, np.int8, 9 * channels, 4).reshape(channels, 1, 3, 3).astype(np.int64)
    floats = 4 + 9 * channels
    bias, weight_scales, (bottom_scale,), (top_scale,) = (
        np.frombuffer(data, "<f4", n, floats + 4 * at)
        for n, at in ((channels, 0), (channels, channels), (1, 2 * channels), (1, 2 * channels + 1)))
    x = digits_inputs(1)[0]
    scaled = x[0, 0].astype(np.float64) * bottom_scale
    quantized = np.pad(np.clip(np.sign(scaled) * np.floor(np.abs(scaled) + 0.5), -127, 127), 1).astype(np.int64)
    sums = np.array([[[np.sum(quantized[i:i + 3, j:j + 3] * weights[o, 0]) for j in range(x.shape[3])]
                      for i in range(x.shape[2])] for o in range(channels)])
    expected = np.maximum(sums / (bottom_scale * weight_scales[:, None, None]) + bias[:, None, None], 0)

    net = ncnn.Net()
    net.opt.num_threads, net.opt.use_vulkan_compute, net.opt.use_int8_inference = 1, False, True
    assert net.load_param(str(bundle / "model.param")) == 0 and net.load_model(str(bundle / "model.bin")) == 0
    extractor = net.create_extractor()
    extractor.input("in0", ncnn.Mat(np.ascontiguousarray(x[0])))
    _, mat = extractor.extract(layer.tops[0])
    ran = np.array(mat)  # the int8 values, cast to float by ncnn's extract

    def requantized(values):
        scaled = values * top_scale
        return np.clip(np.sign(scaled) * np.floor(np.abs(scaled) + 0.5), -127, 127)

    fp32 = reference(run_dir / "stages" / "convert" / "model.onnx", {"input": x}, ["relu1_out"])["relu1_out"][0]
    assert np.abs(ran - requantized(expected)).max() <= 1 and np.mean(ran == requantized(expected)) > 0.99
    assert np.mean(ran == requantized(fp32)) < 0.97  # int8 rounding shows (measured: 0.92)
    settings = yaml.safe_load((bundle / "runtime.yaml").read_text())
    session = backend.load(bundle, {**settings, "options": {**settings["options"], "threads": 1}})
    session.probe(["relu1_out"])
    probed = session.run_probe({"input": x})["relu1_out"][0]
    assert np.abs(probed - ran / top_scale).max() < 1e-6 * np.abs(probed).max()
    assert np.abs(probed - fp32).max() < 2 / top_scale  # within a step or so of the int8 grid


def classifier_int8_build(jobs, name):
    """parity int8 of the PP-OCR classifier for ncnn_cpu (job ``name``), stages up to build,
    calibrated on 16 rendered text lines: (the build folder, 8 validation inputs)."""
    from pipeline.config.schemas import Color, PreprocessConfig
    from pipeline.data import TensorSpec, load_image

    result, run_dir, data = jobs[name]
    assert result.returncode == 0, result.stdout + result.stderr
    pre = PreprocessConfig(keep_aspect=True, color=Color.bgr, mean=[0.5], std=[0.5], pad_value=0.0)
    spec = TensorSpec("x", CLS_SHAPE, "float32")
    inputs = [load_image(path, spec, pre) for path in sorted((data / "validation").glob("*.png"))]
    return run_dir, inputs


@pytest.mark.skipif(NEEDS_FONTS_SKIPPED, reason="needs Debian's fonts-dejavu-core (installed by .ci/run)")
def test_classifier_int8_stays_int8_between_convolutions_and_matches_fp32(jobs):
    """The real classifier (pnnx leaves its HardSwish layers unfused): each int8 convolution
    whose output only int8 convolutions read (directly or through a Split) requantizes
    (int8_scale_term 101/102), a HardSwish in between folded into it; read back as int8,
    the output within cosine 0.99 of fp32. Depthwise convolutions int8 too (on x86 they stay
    float by default: the next test)."""
    run_dir, inputs = classifier_int8_build(jobs, "classifier-int8-depthwise")  # target.ncnn.int8_depthwise=true
    build = run_dir / "stages" / "build"
    network = backend.Param.read(build / "model.param")
    terms = {layer.name: int(layer.param(8) or 0) for layer in network.layers}
    readers = {}
    for layer in network.layers:
        for blob in layer.bottoms:
            readers.setdefault(blob, []).append(layer)

    def readers_of(blob):  # through Splits
        found = []
        for user in readers[blob]:
            found += [r for top in user.tops for r in readers_of(top)] if user.type == "Split" else [user]
        return found

    requantized = [layer for layer in network.layers if terms[layer.name] > 100]
    assert len(requantized) == 15 and {terms[layer.name] for layer in requantized} == {101, 102}
    for layer in requantized:
        assert all(r.type.startswith("Convolution") and terms[r.name] for r in readers_of(layer.tops[0]))
    stem = network.layers[1]  # conv + BatchNorm + HardSwish, then the first pointwise conv
    assert stem.param(9) == "6" and terms[stem.name] == 102 and network.layers[2].type == "Convolution"
    settings = yaml.safe_load((build / "runtime.yaml").read_text())
    session = backend.load(build, {**settings, "options": {**settings["options"], "threads": 1}})
    effective = session.effective()
    assert effective["precision"] == "int8" and effective["float_ops"] == {}
    assert "int8: 54 of 54 compute layers (15 output int8: requantize)" in effective["layers"]
    (name,) = session.outputs
    ran = np.concatenate([session.run({"x": x})[name] for x in inputs])
    fp32 = np.concatenate([reference(run_dir / "stages" / "convert" / "model.onnx", {"x": x})[name] for x in inputs])
    assert cosine(ran, fp32) >= 0.99  # measured 0.996


@pytest.mark.skipif(NEEDS_FONTS_SKIPPED, reason="needs Debian's fonts-dejavu-core (installed by .ci/run)")
def test_classifier_int8_keeps_depthwise_float_on_x86_and_verify_passes_it_as_int8(jobs):
    """By default an x86 CPU keeps the depthwise convolutions float (ncnn's int8 depthwise
    kernel is slower there than its fp32 one): the build records them as the backend's float
    ops, the param writes them fp32, the read-back says mixed without any fallback, and
    verify passes precision=int8 with them."""
    x86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686", "x86")
    run_dir, _ = classifier_int8_build(jobs, "classifier-int8-verified")
    report = read_report(run_dir)
    assert report["verdict"] == "pass" and report["exit_code"] == 0, report["reasons"]
    quantization = report["build"]["quantization"]
    depthwise = quantization["backend_float_ops"]["ops"]
    assert quantization["backend_float_ops"]["kinds"] == (["depthwise"] if x86 else [])
    assert (len(depthwise) > 0) == x86 and set(depthwise) <= set(quantization["float_ops"])
    network = backend.Param.read(run_dir / "stages" / "build" / "model.param")
    depthwise_layers = [layer for layer in network.layers if layer.type == "ConvolutionDepthWise"]
    assert len(depthwise_layers) == (len(depthwise) if x86 else len(depthwise_layers)) > 0
    assert all(not int(layer.param(8) or 0) for layer in depthwise_layers) == x86
    effective = report["verify"]["effective"]
    assert effective["precision"] == ("mixed" if x86 else "int8") and effective["float_ops"] == {}
    assert not [c for c in report["verify"]["checks"] if c["check"] in ("precision", "float_fallback")]


def test_mixed_keeps_the_qtable_op_in_fp32_read_back(jobs):
    result, run_dir = jobs["mixed"]  # sensitivity=top_n sensitivity.top_n=1
    assert result.returncode == 0, result.stdout + result.stderr
    report = read_report(run_dir)
    (kept,) = report["build"]["quantization"]["float_ops"]
    effective = report["verify"]["effective"]
    assert effective["precision"] == "mixed" and effective["float_ops"] == {}  # kept on purpose: no fallback
    assert set(effective["int8_layers"].values()) == QUANTIZED - {kept}
    assert "int8: 4 of 5 compute layers" in effective["layers"]
    layers = yaml.safe_load((run_dir / "stages" / "build" / "runtime.yaml").read_text())["options"]["layers"]
    assert layers[kept][0] not in int8_layers(single_bundle(run_dir) / "model.param")


def test_vulkan_runs_the_int8_layers_with_the_cpu_int8_numbers(jobs):
    require_vulkan()
    result, run_dir = jobs["vulkan"]
    assert result.returncode == 0, result.stdout + result.stderr
    effective = read_report(run_dir)["verify"]["effective"]
    assert effective["device"] == "VULKAN" and effective["precision"] == "int8"
    assert set(effective["int8_layers"].values()) == QUANTIZED and "vulkan: 7;" in effective["layers"]
    bundle = single_bundle(run_dir)
    settings = yaml.safe_load((bundle / "runtime.yaml").read_text())
    on_cpu = {**settings, "device": "CPU", "options": {**settings["options"], "use_vulkan": False, "threads": 1}}
    feeds = {"input": digits_inputs(1)[0]}
    gpu, cpu = (backend.load(bundle, s).run(feeds)["logits"] for s in (settings, on_cpu))
    fp32 = reference(run_dir / "stages" / "convert" / "model.onnx", feeds)["logits"]
    assert 1 - cosine(gpu, cpu) < 1e-3 * (1 - cosine(gpu, fp32))  # the same int8 math, not fp32


def test_vulkan_int8_needs_an_ncnn_with_vulkan_int8_kernels():
    assert vulkan_int8_problem("1.0.20261020") is None
    assert "ncnn 1.0.20250503 turns Vulkan off for int8 layers" in vulkan_int8_problem("1.0.20250503")


def test_int8_where_faster_keeps_float_exactly_the_ops_measured_slower_in_int8(jobs):
    """precision.int8_where_faster on the digits model on ncnn: every quantized op is timed in
    ncnn's fp32 and int8 builds, the ops slower in int8 (and only those) are kept float in
    the built model, and verify judges the result: accepted as int8/mixed while an op is left
    int8, nothing_int8 (exit 3) saying to ship fp32 when none is."""
    result, run_dir = jobs["int8-where-faster"]
    assert run_dir is not None, result.stdout + result.stderr
    report = read_report(run_dir)
    quantization = report["build"]["quantization"]
    measured = quantization["slower_in_int8"]["measured"]["ops"]
    assert set(measured) == QUANTIZED and all(e["fp32_ms"] > 0 for e in measured.values())
    slower = {op for op, e in measured.items() if e["int8_ms"] > 0 and e["cost_ms"] < 0}
    assert set(quantization["slower_in_int8"]["ops"]) == slower <= set(quantization["float_ops"])
    assert quantization["int8_ops"] == len(QUANTIZED - slower)
    checks = {check["check"]: check for check in report["verify"]["checks"]}
    assert "precision" not in checks
    if slower == QUANTIZED:
        assert result.returncode == 3 and "ship fp32" in checks["nothing_int8"]["text"]
    else:
        assert result.returncode == 0, result.stdout + result.stderr
        assert set(report["verify"]["effective"]["int8_layers"].values()) == QUANTIZED - slower


@pytest.mark.skipif(NEEDS_FONTS_SKIPPED, reason="needs Debian's fonts-dejavu-core (installed by .ci/run)")
def test_the_mixed_search_measures_depthwise_float_as_the_x86_build_keeps_it(jobs):
    """The sensitivity search for ncnn_cpu on x86 measures every mixed model with the
    depthwise convolutions float, as the build will keep them, and never spends a float
    place on one of them."""
    x86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686", "x86")
    result, run_dir, _ = jobs["classifier-mixed-search"]  # top_n=2 on 2 samples, the max method
    assert result.returncode == 0, result.stdout + result.stderr
    sensitivity = read_report(run_dir)["sensitivity"]
    prepared = onnx.load(str(run_dir / "stages" / "calibrate" / "prepared.onnx"))
    depthwise = ops_of_kinds(prepared, ["depthwise"], ["Conv"])
    assert len(depthwise) > 0 and sensitivity["always_float"] == (depthwise if x86 else [])
    ranked = {row["op"] for row in sensitivity["ranking"]}
    assert not ranked & set(sensitivity["always_float"]) and len(sensitivity["float_ops"]) == 2
