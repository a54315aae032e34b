"""What verify says OpenVINO ran is what OpenVINO ran, and an OpenVINO job sends no telemetry.

- fp16 asked, another precision compiled: OpenVINO's CPU plugin compiles an f16 hint in the
  precision the CPU has (bf16 here, f32 without bf16); fp16-compressed weights are storage,
  not execution. The reported precision is the compiled model's, read back in the test
  through OpenVINO itself, and anything but fp16 is exit 4 naming it.
- Precisions read back as OpenVINO Type objects are parity's names (fp32, ...), never "<Type".
- An openvino_cpu job with a fresh $HOME writes nothing there and makes no network lookup.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import yaml
from onnx import TensorProto, helper, numpy_helper

from conftest import read_report, run_cli, run_dirs, single_bundle

CHANNELS, KERNEL = 16, 3
# OpenVINO's per-kernel name (rt_info primitiveType, e.g. brgconv_avx512_bf16) ends in the
# precision the kernel computes in: independent evidence from the data types parity reads.
KERNEL_SUFFIXES = {"f32": "fp32", "bf16": "bf16", "f16": "fp16", "fp16": "fp16", "i8": "int8", "u8": "int8"}


def _save(graph, path: Path, opset: int = 18) -> Path:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, str(path))
    return path


def modulated_conv(path: Path) -> Path:
    """StyleGAN2's modulated conv: weights scaled by a style input, demodulated by
    1/sqrt(sum of squares + 1e-8), then a Conv. With style s in [0, 4] the sum of squares
    is at least sum(w^2) per output channel, beyond fp16's 65504."""
    weight = (np.random.RandomState(0).randn(1, CHANNELS, CHANNELS, KERNEL, KERNEL) * 30).astype(np.float32)
    assert (weight ** 2).sum(axis=(2, 3, 4)).min() > 65504 * 1.5
    inits = [numpy_helper.from_array(weight, "w"), numpy_helper.from_array(np.array([1e-8], np.float32), "eps"),
             numpy_helper.from_array(np.array([1.0], np.float32), "one"),
             numpy_helper.from_array(np.array([1, 1, CHANNELS, 1, 1], np.int64), "style_shape"),
             numpy_helper.from_array(np.array([CHANNELS, CHANNELS, KERNEL, KERNEL], np.int64), "conv_shape"),
             numpy_helper.from_array(np.array([2, 3, 4], np.int64), "axes")]
    nodes = [helper.make_node("Add", ["s", "one"], ["s1"], name="style_offset"),
             helper.make_node("Reshape", ["s1", "style_shape"], ["s5"], name="style_reshape"),
             helper.make_node("Mul", ["w", "s5"], ["wm"], name="modulate"),
             helper.make_node("Mul", ["wm", "wm"], ["sq"], name="square"),
             helper.make_node("ReduceSum", ["sq", "axes"], ["sum_sq"], keepdims=1, name="sum_sq"),
             helper.make_node("Add", ["sum_sq", "eps"], ["sum_eps"], name="eps_add"),
             helper.make_node("Sqrt", ["sum_eps"], ["norm"], name="sqrt"),
             helper.make_node("Div", ["wm", "norm"], ["wd"], name="demodulate"),
             helper.make_node("Reshape", ["wd", "conv_shape"], ["w4"], name="weight_reshape"),
             helper.make_node("Conv", ["x", "w4"], ["y"], pads=[1, 1, 1, 1], name="conv")]
    graph = helper.make_graph(nodes, "modulated_conv",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, CHANNELS, 8, 8]),
                               helper.make_tensor_value_info("s", TensorProto.FLOAT, [1, CHANNELS])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, CHANNELS, 8, 8])], inits)
    return _save(graph, path)


def cdist_matmul(path: Path) -> Path:
    """Squared distances in the matmul form: ||a||^2 - 2 a.b^T + ||b||^2."""
    inits = [numpy_helper.from_array(np.array([1], np.int64), "axis"),
             numpy_helper.from_array(np.array(2.0, np.float32), "two")]
    nodes = [helper.make_node("Mul", ["a", "a"], ["aa"]), helper.make_node("ReduceSum", ["aa", "axis"], ["a2"]),
             helper.make_node("Mul", ["b", "b"], ["bb"]), helper.make_node("ReduceSum", ["bb", "axis"], ["b2_col"]),
             helper.make_node("Transpose", ["b2_col"], ["b2"], perm=[1, 0]),
             helper.make_node("Transpose", ["b"], ["bt"], perm=[1, 0]),
             helper.make_node("MatMul", ["a", "bt"], ["ab"]), helper.make_node("Mul", ["ab", "two"], ["ab2"]),
             helper.make_node("Sub", ["a2", "ab2"], ["diff"]), helper.make_node("Add", ["diff", "b2"], ["d"])]
    graph = helper.make_graph(nodes, "cdist", [helper.make_tensor_value_info("a", TensorProto.FLOAT, [4, 16]),
                                               helper.make_tensor_value_info("b", TensorProto.FLOAT, [8, 16])],
                              [helper.make_tensor_value_info("d", TensorProto.FLOAT, [4, 8])], inits)
    return _save(graph, path, opset=13)


def compiled_truth(model_xml: Path, options: dict) -> dict:
    """What OpenVINO itself says it compiled: the hint read back and each compute kernel's precision."""
    import openvino as ov

    compiled = ov.Core().compile_model(str(model_xml), "CPU", options)
    kernels = []
    for op in compiled.get_runtime_model().get_ordered_ops():
        info = op.get_rt_info()
        if info["layerType"].astype(str) in ("Convolution", "FullyConnected", "MatMul"):
            kernels.append(info["primitiveType"].astype(str))
    suffixes = {KERNEL_SUFFIXES.get(kernel.rsplit("_", 1)[-1].lower()) for kernel in kernels}
    return {"hint": compiled.get_property("INFERENCE_PRECISION_HINT").get_type_name(), "kernels": kernels,
            "kernel_precisions": suffixes}


def test_fp16_on_openvino_reports_the_precision_the_compiled_model_runs(tmp_path):
    model = modulated_conv(tmp_path / "modconv.onnx")
    result = run_cli([f"model.path={model}", "data=random", "data.high=4", "precision=fp16",
                      "target=openvino_cpu", "metric=none"], tmp_path)
    run_dir = run_dirs(tmp_path)[-1]
    verify = read_report(run_dir)["verify"]
    bundle = single_bundle(run_dir)
    options = yaml.safe_load((bundle / "runtime.yaml").read_text())["options"]
    assert options["INFERENCE_PRECISION_HINT"] == "f16"
    truth = compiled_truth(bundle / "model.xml", options)
    from pipeline.backends.openvino import parity_precision

    ran = parity_precision(truth["hint"])
    assert truth["kernel_precisions"] == {ran}, truth  # every compute kernel runs the hint's precision
    effective = verify["effective"]
    assert effective["precision"] == ran and effective["layers"] == f"{ran}: 1", effective
    assert effective["runtime_options"]["INFERENCE_PRECISION_HINT"] == truth["hint"]
    if ran == "fp16":
        assert not any(reason.startswith("requested precision") for reason in verify["reasons"])
    else:
        assert result.returncode == 4, result.stdout + result.stderr
        reason = next(r for r in verify["reasons"] if r.startswith("requested precision"))
        assert reason.startswith(f"requested precision fp16 but {ran} ran: OpenVINO compiled "
                                 f"INFERENCE_PRECISION_HINT=f16 as {truth['hint']}; CPU OPTIMIZATION_CAPABILITIES: ")
        assert f"verdict: FAIL (exit 4): requested precision fp16 but {ran} ran" in result.stdout


def test_fp16_compressed_weights_are_not_fp16_execution(tmp_path):
    """An IR with fp16 weights compiled with the f32 hint: OpenVINO's rt_info runtimePrecision
    of the Conv reads f16 (the weights' type) while the kernel computes f32 on f32 data."""
    import openvino as ov

    from pipeline.backends.openvino import Session

    core = ov.Core()
    ov.save_model(core.read_model(str(modulated_conv(tmp_path / "m.onnx"))), str(tmp_path / "m.xml"),
                  compress_to_fp16=True)
    plain = tmp_path / "plain.onnx"
    _save(helper.make_graph([helper.make_node("Conv", ["x", "w"], ["y"])], "conv",
                            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
                            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 6, 6])],
                            [numpy_helper.from_array(np.ones((4, 3, 3, 3), np.float32), "w")]), plain)
    ov.save_model(core.read_model(str(plain)), str(tmp_path / "conv.xml"), compress_to_fp16=True)
    compiled = core.compile_model(str(tmp_path / "conv.xml"), "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    conv = next(op.get_rt_info() for op in compiled.get_runtime_model().get_ordered_ops()
                if op.get_rt_info()["layerType"].astype(str) == "Convolution")
    assert conv["runtimePrecision"].astype(str) == "f16" and conv["primitiveType"].astype(str).endswith("_f32")
    for xml in ("m.xml", "conv.xml"):
        session = Session(tmp_path / xml, "CPU", {"INFERENCE_PRECISION_HINT": "f32"}, ["y"])
        effective = session.effective()
        assert effective["precision"] == "fp32" and effective["layers"] == "fp32: 1", effective
        assert "note" not in effective


def test_precisions_read_back_as_openvino_types_get_parity_names(tmp_path):
    import openvino as ov

    from pipeline.backends.openvino import Session, parity_precision

    expected = {ov.Type.f32: "fp32", ov.Type.f16: "fp16", ov.Type.bf16: "bf16", ov.Type.u8: "int8",
                ov.Type.i8: "int8", "f32": "fp32", "bf16": "bf16", "float16": "fp16"}
    assert {str(key): parity_precision(key) for key in expected} == {str(k): v for k, v in expected.items()}
    # elementwise only: no compute layer, the precision is the hint read back (an ov.Type)
    square = helper.make_graph([helper.make_node("Mul", ["x", "x"], ["y"])], "square",
                               [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8])],
                               [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8])])
    path = _save(square, tmp_path / "sq.onnx")
    effective = Session(path, "CPU", {"INFERENCE_PRECISION_HINT": "f32"}, ["y"]).effective()
    assert effective["precision"] == "fp32" and effective["layers"] == ""
    assert all(isinstance(value, str) for value in effective["runtime_options"].values())
    assert effective["runtime_options"]["INFERENCE_PRECISION_HINT"] == "f32"


def test_cdist_at_fp32_on_openvino_reports_plain_names(tmp_path):
    model = cdist_matmul(tmp_path / "cdist.onnx")
    result = run_cli([f"model.path={model}", "data=random", "precision=fp32", "target=openvino_cpu", "metric=none"],
                     tmp_path)
    run_dir = run_dirs(tmp_path)[-1]
    text = (run_dir / "report.json").read_text()
    assert "<Type" not in text and "<Type" not in result.stdout
    verify = read_report(run_dir)["verify"]
    assert verify["effective"]["precision"] == "fp32"
    assert not any(reason.startswith("requested precision") for reason in verify["reasons"]), verify["reasons"]
    assert result.returncode != 4, result.stdout + result.stderr


STRACE = shutil.which("strace")


def test_an_openvino_job_sends_no_telemetry_and_writes_nothing_into_home(tmp_path):
    """`import openvino` alone would look up its telemetry host and write ~/intel/*; ONNX
    Runtime (the reference) would write ~/.cache/Microsoft/DeveloperTools/.onnxruntime.
    strace -f follows the CLI and its workers: not one AF_INET/AF_INET6 socket."""
    assert STRACE, "strace is needed (Debian: apt-get install strace; .ci/run installs it)"
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    # no XDG_* (caches default under $HOME) and none of the variables with which
    # openvino_telemetry stays quiet in CI (CI, TF_BUILD, JENKINS_URL): parity's own opt-out is checked
    env = {key: value for key, value in os.environ.items()
           if not key.startswith("XDG_") and key not in ("CI", "TF_BUILD", "JENKINS_URL")}
    env.update(HOME=str(home), COLUMNS="200", NO_COLOR="1")
    trace = tmp_path / "network.trace"
    script = Path(sys.executable).parent / "parity"
    result = subprocess.run([STRACE, "-f", "-qq", "-e", "trace=execve,socket,connect,sendto,sendmsg", "-e",
                             "signal=none", "-o", str(trace), str(script), "target=openvino_cpu", "precision=fp32"],
                            cwd=work, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert json.loads((run_dirs(work)[-1] / "report.json").read_text())["verify"]["effective"]["device"] == "CPU"
    calls = trace.read_text().splitlines()
    # the workers' fork server (pipeline/worker.py), or spawned workers where there is none
    assert any("multiprocessing.forkserver" in line or "--multiprocessing-fork" in line for line in calls), \
        "the workers were not traced"
    new_in_home = sorted(str(p.relative_to(home)) for p in home.rglob("*"))
    assert (new_in_home, [line for line in calls if "AF_INET" in line]) == ([], [])


def test_the_opt_out_is_in_place_once_parity_is_imported():
    """pipeline/__init__.py, which every parity process imports first, holds the opt-out."""
    code = ("import pipeline, os\ntry:\n    import openvino_telemetry\nexcept ImportError:\n"
            "    print('blocked', os.environ['ORT_DISABLE_TELEMETRY'])")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "blocked 1", result.stdout + result.stderr
