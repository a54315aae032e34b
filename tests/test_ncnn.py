"""The ncnn backend on real ncnn and pnnx: build, run, effective device/precision, the
ONNX <-> ncnn name mapping, per-layer feature masks (the fp16 overflow seed case) and
pnnx's failures. Vulkan runs on whatever device ncnn finds (Mesa's lavapipe in CI)."""

from __future__ import annotations

import builtins
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import overflow_model
from ncnn_helpers import (DIGITS_MODEL, cls_model, cosine, digits_inputs, reference, require_vulkan, target,
                          unsupported_model)
from pipeline import backends
from pipeline.backends import ncnn as backend
from pipeline.verification.layerwise import Graph

import onnx


def build(tmp_path, model, device="CPU", precision="fp32", **overrides):
    out = tmp_path / f"{device}-{precision}"
    out.mkdir()
    files, settings = backend.build(model, None, out, target(device, **overrides), precision)
    return out, files, settings


@pytest.fixture(scope="module")
def digits_cpu(tmp_path_factory):
    return build(tmp_path_factory.mktemp("digits"), DIGITS_MODEL)


@pytest.fixture(scope="module")
def seed(tmp_path_factory):
    root = tmp_path_factory.mktemp("seed")
    model = overflow_model.build(root / "overflow.onnx")
    return model, build(root, model, "VULKAN", "fp16")


def test_digits_cpu_fp32_matches_onnxruntime(digits_cpu):
    out, files, settings = digits_cpu
    assert sorted(files) == ["model.bin", "model.param"]
    assert sorted(p.name for p in out.iterdir()) == ["model.bin", "model.param"]  # no pnnx side files
    options = settings["options"]
    assert settings["model"] == "model.param"
    assert not (options["use_vulkan"] or options["use_fp16_storage"] or options["use_fp16_arithmetic"]
                or options["use_bf16_storage"])
    params = sum(int(np.prod(t.dims)) for t in onnx.load(str(DIGITS_MODEL)).graph.initializer)
    assert (out / "model.bin").stat().st_size >= 4 * params  # weights stay fp32 on disk (pnnx fp16=0)
    session = backend.load(out, settings)
    assert session.inputs == ["input"] and session.outputs == ["logits"]
    effective = session.effective()
    assert {key: effective[key] for key in ("device", "precision", "layers")} == {
        "device": "CPU", "precision": "fp32", "layers": "cpu: 7"}
    assert "device_name" not in effective  # named only for a Vulkan device
    for x in digits_inputs(20):
        expected = reference(DIGITS_MODEL, {"input": x})["logits"]
        actual = session.run({"input": x})["logits"]
        assert actual.shape == expected.shape == (1, 10) and actual.dtype == np.float32
        assert cosine(expected, actual) > 0.99999
        assert np.abs(expected - actual).max() < 1e-3


def test_digits_vulkan_fp32_matches_onnxruntime(tmp_path):
    require_vulkan()
    out, _, settings = build(tmp_path, DIGITS_MODEL, "VULKAN", "fp32")
    assert settings["options"]["use_vulkan"] and not settings["options"]["use_fp16_storage"]
    session = backend.load(out, settings)
    effective = session.effective()
    assert effective["device"] == "VULKAN" and effective["precision"] == "fp32"
    assert effective["layers"] == "vulkan: 7"
    import ncnn

    info = ncnn.get_gpu_info(0)  # what the device really is: Mesa's lavapipe is a CPU
    assert effective["device_name"] == info.device_name() and effective["device_type"] == backend.VULKAN_DEVICE_TYPES[info.type()]
    for x in digits_inputs(10):
        expected = reference(DIGITS_MODEL, {"input": x})["logits"]
        actual = session.run({"input": x})["logits"]
        assert cosine(expected, actual) > 0.99999 and np.abs(expected - actual).max() < 1e-3


def test_vulkan_requested_without_a_device_reports_the_cpu(digits_cpu, tmp_path):
    """effective() reads what ncnn runs: with no Vulkan driver visible the net falls back."""
    out, _, settings = digits_cpu
    options = {**settings["options"], "use_vulkan": True}
    script = textwrap.dedent(f"""
        import json, pathlib
        from pipeline.backends import ncnn
        session = ncnn.load(pathlib.Path({str(out)!r}), {{"model": "model.param", "options": {options!r}}})
        print(json.dumps(session.effective()))
    """)
    env = {**os.environ, "VK_ICD_FILENAMES": str(tmp_path / "none.json"), "VK_DRIVER_FILES": str(tmp_path / "none.json")}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert '"device": "CPU"' in done.stdout.splitlines()[-1]


def test_cpu_bf16_runs_bf16(tmp_path):
    out, _, settings = build(tmp_path, DIGITS_MODEL, "CPU", "bf16")
    assert settings["options"]["use_bf16_storage"]
    session = backend.load(out, settings)
    assert session.effective()["precision"] == "bf16"
    x = digits_inputs(1)[0]
    expected = reference(DIGITS_MODEL, {"input": x})["logits"]
    actual = session.run({"input": x})["logits"]
    assert cosine(expected, actual) > 0.999 and not np.array_equal(expected, actual)


def test_check_config():
    assert backend.check_config(target("VULKAN"), "bf16") == \
        "precision=bf16 on ncnn is CPU-only (bf16 storage); use target=ncnn_cpu"
    assert backend.check_config(target("CPU"), "bf16") is None
    assert backend.check_config(target("VULKAN"), "fp16") is None
    off = target("VULKAN", fp16_storage=False, fp16_packed=False, fp16_arithmetic=False)
    assert "all false" in backend.check_config(off, "fp16")


def test_seed_overflow_on_vulkan_fp16_fixed_by_no_vulkan_masks(seed, tmp_path):
    require_vulkan()
    model, (out, _, settings) = seed
    options = settings["options"]
    assert options["use_fp16_storage"] and options["use_fp16_packed"] and options["use_fp16_arithmetic"]
    samples = [overflow_model.sample(seed) for seed in range(3)]
    expected = [reference(model, {"x": x})["y"] for x in samples]
    assert all(np.isfinite(e).all() for e in expected)

    plain = backend.load(out, settings)
    assert plain.effective()["device"] == "VULKAN" and plain.effective()["precision"] == "fp16"
    overflowed = sum(int(np.isinf(plain.run({"x": x})["y"]).sum()) for x in samples)
    assert overflowed > 0

    layers = backend.layer_map(out, settings)
    masks = {layers["reduce"]: backend.MASK_BITS["no_vulkan"], layers["sqrt"]: backend.MASK_BITS["no_vulkan"]}
    assert len(masks) == 2  # the reduction and its consumer are two ncnn layers
    masked_dir = tmp_path / "masked"
    files, masked = backend.apply_masks(out, settings, masks, masked_dir)
    assert sorted(files) == ["model.bin", "model.param"]
    assert masked["options"]["layer_masks"] == masks and settings["options"]["layer_masks"] == {}
    lines = (masked_dir / "model.param").read_text().splitlines()
    assert sorted(line.split()[1] for line in lines if "31=16" in line.split()) == sorted(masks)
    session = backend.load(masked_dir, masked)
    effective = session.effective()
    assert effective["device"] == "VULKAN" and effective["precision"] == "fp16"
    assert effective["layers"].startswith("vulkan: 3, cpu: 2")
    for x, e in zip(samples, expected):
        y = session.run({"x": x})["y"]
        assert y.shape == e.shape and np.isfinite(y).all()
        assert cosine(e, y) > 0.999

    again, cleared = backend.apply_masks(masked_dir, masked, {}, tmp_path / "cleared")
    assert "31=" not in (tmp_path / "cleared" / "model.param").read_text() and cleared["options"]["layer_masks"] == {}
    with pytest.raises(ValueError, match="no ncnn layer 'nope'"):
        backend.apply_masks(out, settings, {"nope": 16}, tmp_path / "bad")


def test_seed_layer_map_names_every_node(seed):
    _, (out, _, settings) = seed
    layers = backend.layer_map(out, settings)
    assert set(layers) == {"conv", "relu", "square", "reduce", "sqrt"}
    assert layers["conv"] == layers["relu"]  # Conv + Relu fused into one ncnn Convolution
    assert len({layers["square"], layers["reduce"], layers["sqrt"], layers["conv"]}) == 4


def test_probe_exposes_intermediate_tensors_with_onnxruntime_values(digits_cpu):
    out, _, settings = digits_cpu
    session = backend.load(out, settings)
    graph = Graph(onnx.load(str(DIGITS_MODEL)))
    names = [t.name for t in graph.tensors]
    probe = session.probe(names)
    exposed = probe["exposed"]
    assert {"relu1_out", "relu2_out", "pool1_out", "flatten_out", "relu3_out", "relu4_out", "logits"} <= set(exposed)
    assert "conv1_out" not in exposed  # fused into ncnn's Convolution with its Relu
    assert all(name in graph.by_name for name in probe["tensors"])  # every ncnn blob maps to an ONNX tensor
    for x in digits_inputs(3):
        expected = reference(DIGITS_MODEL, {"input": x}, exposed)
        actual = session.run_probe({"input": x})
        assert sorted(actual) == sorted(exposed)
        for name in exposed:
            assert actual[name].shape == expected[name].shape, name
            assert cosine(expected[name], actual[name]) > 0.99999, name
            assert np.abs(expected[name] - actual[name]).max() < 1e-3, name


def test_unsupported_op_fails_the_build_naming_it(tmp_path):
    model = unsupported_model(tmp_path / "det.onnx")
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(RuntimeError) as raised:
        backend.build(model, None, out, target(), "fp32")
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith("pnnx cannot convert op Det (node /head/Det_3)")
    assert list(out.iterdir()) == []


def _speech_front_end(path):
    """wav2vec 2.0's feature encoder in small: Conv1d -> GroupNorm with a group per channel
    (ONNX InstanceNormalization of a [N, C, L] tensor) -> Relu -> Conv1d, raw audio in."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    weights = {"w1": rng.normal(0, 0.3, (16, 1, 10)), "w2": rng.normal(0, 0.2, (8, 16, 3)),
               "scale": rng.uniform(0.5, 1.5, 16), "bias": rng.normal(0, 0.1, 16)}
    nodes = [helper.make_node("Conv", ["audio", "w1"], ["c1"], name="conv1", strides=[5]),
             helper.make_node("InstanceNormalization", ["c1", "scale", "bias"], ["n1"], name="norm1"),
             helper.make_node("Relu", ["n1"], ["r1"], name="relu1"),
             helper.make_node("Conv", ["r1", "w2"], ["features"], name="conv2", strides=[2])]
    graph = helper.make_graph(nodes, "front_end", [helper.make_tensor_value_info("audio", TensorProto.FLOAT, [1, 1, 800])],
                              [helper.make_tensor_value_info("features", TensorProto.FLOAT, [1, 8, 79])],
                              [numpy_helper.from_array(value.astype(np.float32), name) for name, value in weights.items()])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), str(path))
    return path


def _grouped_front_end(path):
    """A Conv1d and GroupNorm(4 groups, 16 channels) as PyTorch exports it: Reshape to 4 groups,
    InstanceNormalization, Reshape back, the per-channel Mul and Add."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(1)
    constants = {"w1": rng.normal(0, 0.3, (16, 1, 10)).astype(np.float32), "b1": np.zeros(16, np.float32),
                 "gamma": rng.uniform(0.5, 1.5, (16, 1)).astype(np.float32),
                 "beta": rng.normal(0, 0.1, (16, 1)).astype(np.float32)}
    made = {"groups": np.array([0, 4, -1]), "ones": np.ones(4, np.float32), "zeros": np.zeros(4, np.float32)}
    nodes = [helper.make_node("Constant", [], [name], name=name, value=numpy_helper.from_array(value))
             for name, value in made.items()]
    nodes += [helper.make_node("Conv", ["audio", "w1", "b1"], ["c1"], name="conv1", strides=[5]),
             helper.make_node("Reshape", ["c1", "groups"], ["g1"], name="to_groups"),
             helper.make_node("InstanceNormalization", ["g1", "ones", "zeros"], ["n1"], name="norm1"),
             helper.make_node("Shape", ["c1"], ["shape1"], name="shape1"),
             helper.make_node("Reshape", ["n1", "shape1"], ["n2"], name="to_channels"),
             helper.make_node("Mul", ["n2", "gamma"], ["n3"], name="gamma1"),
             helper.make_node("Add", ["n3", "beta"], ["features"], name="beta1")]
    graph = helper.make_graph(nodes, "grouped", [helper.make_tensor_value_info("audio", TensorProto.FLOAT, [1, 1, 800])],
                              [helper.make_tensor_value_info("features", TensorProto.FLOAT, [1, 16, 159])],
                              [numpy_helper.from_array(value, name) for name, value in constants.items()])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), str(path))
    return path


def test_an_instance_norm_of_a_1d_signal_converts_as_its_2d_form(tmp_path):
    """pnnx stops at InstanceNorm1d ("cannot convert op nn.InstanceNorm1d"): the build converts
    again with it run on [N, C, 1, L] between an Unsqueeze and a Squeeze, which pnnx converts to
    ncnn's InstanceNorm, and ncnn's outputs match ONNX Runtime's on the original model. A
    GroupNorm of fewer groups than channels, which pnnx converts (PyTorch's export of it: into
    ncnn's GroupNorm), is converted as it was."""
    model = _speech_front_end(tmp_path / "front_end.onnx")
    rewritten = backend.conversion.instance_norms_as_2d(onnx.load(str(model)))
    assert [n.op_type for n in rewritten.graph.node] == ["Conv", "Unsqueeze", "InstanceNormalization", "Squeeze",
                                                          "Relu", "Conv"]
    out, _, settings = build(tmp_path, model)
    session = backend.load(out, settings)
    for seed in range(3):
        audio = np.random.default_rng(seed).normal(0, 0.3, (1, 1, 800)).astype(np.float32)
        expected = reference(model, {"audio": audio})["features"]
        actual = session.run({"audio": audio})["features"]
        assert actual.shape == expected.shape == (1, 8, 79) and cosine(expected, actual) > 0.99999
    assert "InstanceNorm " in (out / "model.param").read_text()
    digits = onnx.load(str(DIGITS_MODEL))
    assert backend.conversion.instance_norms_as_2d(digits) is digits  # nothing to rewrite: the model itself
    grouped = _grouped_front_end(tmp_path / "grouped.onnx")
    (tmp_path / "grouped").mkdir()
    out, _, settings = build(tmp_path / "grouped", grouped)
    layers = (out / "model.param").read_text()
    assert layers.count("ExpandDims") == 1, layers  # the Conv1d's 2-D form's: the norm converted as it was
    audio = np.random.default_rng(3).normal(0, 0.3, (1, 1, 800)).astype(np.float32)
    expected = reference(grouped, {"audio": audio})["features"]
    assert cosine(expected, backend.load(out, settings).run({"audio": audio})["features"]) > 0.99999


def test_a_conv1d_runs_as_a_1_by_k_convolution_in_int8_too(tmp_path):
    """ncnn's Convolution1D has no int8 kernel: a Conv1d is converted as a 1 x k Convolution
    (conv1d_as_2d), so an int8 build runs every convolution int8, its name in the layer map
    kept, and the fp32 build matches ONNX Runtime."""
    from conftest import read_report, run_cli, run_dirs

    model = _speech_front_end(tmp_path / "front_end.onnx")
    out, _, settings = build(tmp_path, model)
    layers = (out / "model.param").read_text()
    assert "Convolution1D" not in layers and layers.count("Convolution ") == 2, layers
    audio = np.random.default_rng(5).normal(0, 0.3, (1, 1, 800)).astype(np.float32)
    expected = reference(model, {"audio": audio})["features"]
    assert cosine(expected, backend.load(out, settings).run({"audio": audio})["features"]) > 0.99999
    result = run_cli([f"model.path={model}", "data=random", "target=ncnn_cpu", "precision=int8", "metric=none",
                      "data.calibration_size=16", "data.validation_size=16", "pipeline.stages=[convert,calibrate,build,verify]"],
                     tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    effective = read_report(run_dirs(tmp_path)[-1])["verify"]["effective"]
    assert effective["precision"] == "int8" and "int8: 2 of 2 compute layers" in effective["layers"], effective
    assert set(effective["int8_layers"].values()) == {"conv1", "conv2"}


def _conv1d_chain(path, gain_shape):
    """Conv1d -> Relu -> Mul by ``gain`` -> Conv1d: a scalar gain (shape []) or one per channel."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(2)
    constants = {"w1": rng.normal(0, 0.3, (16, 1, 10)), "w2": rng.normal(0, 0.2, (8, 16, 3)),
                 "gain": rng.uniform(0.5, 1.5, gain_shape)}
    nodes = [helper.make_node("Conv", ["audio", "w1"], ["c1"], name="conv1", strides=[5]),
             helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
             helper.make_node("Mul", ["r1", "gain"], ["g1"], name="gain1"),
             helper.make_node("Conv", ["g1", "w2"], ["features"], name="conv2", strides=[2])]
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("audio", TensorProto.FLOAT, [1, 1, 800])],
                              [helper.make_tensor_value_info("features", TensorProto.FLOAT, [1, 8, 79])],
                              [numpy_helper.from_array(np.asarray(v, np.float32), n) for n, v in constants.items()])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), str(path))
    return path


@pytest.mark.parametrize("gain_shape, kept_4d", [((), True), ((16, 1), False)])
def test_elementwise_ops_between_two_conv1d_stay_4d(tmp_path, gain_shape, kept_4d):
    """Between two Conv1d's 1 x k forms, a Relu and a Mul by a scalar run on the 4-D tensor (no
    Squeeze and ExpandDims layer pair between them); a Mul by a per-channel gain, which would
    broadcast otherwise in 4-D, keeps the pair. Either way ncnn matches ONNX Runtime."""
    model = _conv1d_chain(tmp_path / "chain.onnx", gain_shape)
    ops = [n.op_type for n in backend.conversion.conv1d_as_2d(onnx.load(str(model))).graph.node]
    assert ops.count("Squeeze") == (1 if kept_4d else 2) and ops.count("Unsqueeze") == (1 if kept_4d else 2), ops
    out, _, settings = build(tmp_path, model)
    audio = np.random.default_rng(4).normal(0, 0.3, (1, 1, 800)).astype(np.float32)
    expected = reference(model, {"audio": audio})["features"]
    actual = backend.load(out, settings).run({"audio": audio})["features"]
    assert actual.shape == expected.shape and cosine(expected, actual) > 0.99999


def test_not_installed_message(monkeypatch):
    real_import = builtins.__import__

    def hide_ncnn(name, *args, **kwargs):
        if name == "ncnn" or name.startswith("ncnn."):
            raise ImportError("No module named 'ncnn'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", hide_ncnn)
    assert backend.available() == (False, "ncnn is not installed: pip install 'parity[ncnn]' (ncnn + pnnx)")
    monkeypatch.setattr(builtins, "__import__", real_import)
    assert backend.available() == (True, "")
    monkeypatch.setattr(backend.common, "pnnx_executable", lambda: None)  # where available() reads it
    assert backend.available()[0] is False


def test_ppocr_classifier_cpu_matches_onnxruntime(tmp_path):
    pytest.importorskip("rapidocr_onnxruntime")
    model = cls_model(tmp_path / "cls.onnx")
    out, _, settings = build(tmp_path, model)
    session = backend.load(out, settings)
    assert session.inputs == ["x"] and session.outputs == ["save_infer_model/scale_0.tmp_1"]
    rng = np.random.default_rng(7)
    for _ in range(3):
        x = rng.uniform(-1, 1, (1, 3, 48, 192)).astype(np.float32)
        expected = reference(model, {"x": x})
        actual = session.run({"x": x})
        for name, value in expected.items():
            assert actual[name].shape == value.shape == (1, 2)
            assert cosine(value, actual[name]) > 0.9999 and np.abs(value - actual[name]).max() < 1e-3
    # the name mapping on a real model: most activations exposed, each with the reference's values
    graph = Graph(onnx.load(str(model)))
    probe = session.probe([t.name for t in graph.tensors])
    assert len(probe["exposed"]) >= 100
    expected = reference(model, {"x": x}, probe["exposed"])
    actual = session.run_probe({"x": x})
    worst = min(probe["exposed"], key=lambda name: cosine(expected[name], actual[name]))
    assert cosine(expected[worst], actual[worst]) > 0.9999, worst
    assert settings["options"]["layers"]  # every node that feeds a mapped tensor has its layer
    assert set(backend.layer_map(out, settings)) == {t.op for t in graph.tensors}


@pytest.mark.parametrize("device, asked, machine, kinds", [
    ("CPU", None, "x86_64", ["depthwise"]),  # ncnn's x86 int8 depthwise kernel is slower than fp32
    ("CPU", None, "AMD64", ["depthwise"]),
    ("CPU", None, "aarch64", []),
    ("VULKAN", None, "x86_64", []),
    ("CPU", True, "x86_64", []),
    ("VULKAN", False, "aarch64", ["depthwise"]),
])
def test_int8_builds_keep_depthwise_float_on_x86_cpus_unless_asked(monkeypatch, device, asked, machine, kinds):
    from pipeline.backends.ncnn import common

    monkeypatch.setattr(common.platform, "machine", lambda: machine)
    assert backends.float_op_kinds(backend, target(device, int8_depthwise=asked)) == kinds


_POLICY_AT_EXIT = "import atexit, os, sys\natexit.register(lambda: print('policy', os.environ.get('OMP_WAIT_POLICY')))\n"


@pytest.mark.parametrize("user_policy", [None, "ACTIVE"])
def test_libgomp_waits_passively_in_a_job_and_as_ncnn_defaults_it_in_a_bundle(tmp_path, user_policy):
    """A parity job makes libgomp's threads (ncnn's) wait passively, for the workers it runs
    side by side; the bundle loader leaves libgomp's default, the faster one for a bundle
    served alone; a policy the user set is kept by both."""
    env = {key: value for key, value in os.environ.items() if key != "OMP_WAIT_POLICY"}
    if user_policy:
        env["OMP_WAIT_POLICY"] = user_policy
    job = subprocess.run([sys.executable, "-c", _POLICY_AT_EXIT + "sys.argv = ['parity', 'model.path=/no/such.onnx']\n"
                          "from pipeline.app.cli import main\nmain()"], env=env, cwd=tmp_path, capture_output=True,
                         text=True, timeout=120)
    assert job.returncode == 2, job.stderr
    assert job.stdout.splitlines()[-1] == f"policy {user_policy or 'PASSIVE'}"
    served = subprocess.run([sys.executable, "-c", _POLICY_AT_EXIT + "import pipeline.app.bundle_cli, "
                             "pipeline.release.bundle, pipeline.backends.ncnn"], env=env, cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert served.stdout.splitlines()[-1] == f"policy {user_policy}", served.stderr
