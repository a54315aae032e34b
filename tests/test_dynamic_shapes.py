"""Dynamic shapes (issue 29): ranges parsed and checked, dynamic dims kept by convert and
by each target's build, samples verified at their own shapes (grouped per shape, timed at
min/opt/max), bundles that take any shape inside the range and refuse one outside it; on
a small onnx.helper model and on the real PP-OCRv4 detector and recognizer."""

from __future__ import annotations

import importlib.resources
import json
import random
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from PIL import Image

from conftest import read_report, run_cli, run_dirs, single_bundle
from textlines import FONTS, NEEDS_FONTS_SKIPPED, WORDS, render

from pipeline import shapes
from pipeline.config.schemas import PreprocessConfig
from pipeline.data import TensorSpec, image_size
from pipeline.errors import ConfigError, ExitCode

RANGE = "+model.input_shapes.x={min:[1,3,16,16],opt:[1,3,32,48],max:[1,3,64,64]}"
MODELS = importlib.resources.files("rapidocr_onnxruntime") / "models"


def dynamic_model(path: Path) -> Path:
    """Conv-Relu-Conv-Sigmoid on x [batch, 3, h, w]: any image size."""
    rng = np.random.default_rng(0)
    weights = [numpy_helper.from_array((rng.standard_normal(shape) * 0.3).astype(np.float32), name)
               for name, shape in (("w1", (8, 3, 3, 3)), ("b1", (8,)), ("w2", (4, 8, 3, 3)), ("b2", (4,)))]
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1], name="conv1"),
             helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
             helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], pads=[1, 1, 1, 1], name="conv2"),
             helper.make_node("Sigmoid", ["c2"], ["y"], name="sig")]
    graph = helper.make_graph(nodes, "dynamic", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                                ["batch", 3, "h", "w"])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4, "h", "w"])],
                              weights)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    onnx.save(model, str(path))
    return path


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> Path:
    return dynamic_model(tmp_path_factory.mktemp("dynamic") / "dyn.onnx")


def _run(tmp_path, model, *args):
    result = run_cli([f"model.path={model}", "data.kind=random", "metric=none", *args], tmp_path)
    return result, (run_dirs(tmp_path) or [None])[-1]


# --- ranges ------------------------------------------------------------------------------------

def test_ranges_parse_and_refuse_what_cannot_be():
    found = shapes.parse("x", {"min": [1, 3, 16, 16], "opt": [1, 3, 32, 48], "max": [1, 3, 64, 64]})
    assert found.dynamic_axes == [2, 3] and found.contains([1, 3, 20, 64]) and not found.contains([1, 3, 8, 16])
    assert shapes.parse("x", [1, 3, 8, 8]).dynamic_axes == []
    for bad, words in (({"min": [1, 3], "max": [1, 3]}, "missing opt"),
                       ({"min": [1, 3, 9], "opt": [1, 3, 8], "max": [1, 3, 9]}, "min <= opt <= max"),
                       ({"min": [1, 3], "opt": [1, 3, 8], "max": [1, 3, 9]}, "different numbers of dims"),
                       ([1, 0, 8], "must be >= 1"), ("big", "a list of dims")):
        with pytest.raises(ConfigError, match=words):
            shapes.parse("x", bad)


def test_a_range_contradicting_the_model_is_exit_2(tmp_path, small):
    result, _ = _run(tmp_path, small, "+model.input_shapes.x={min:[1,1,16,16],opt:[1,3,16,16],max:[1,4,16,16]}")
    assert result.returncode == ExitCode.USAGE, result.stdout + result.stderr
    assert "dim 1 is fixed at 3 in the model" in result.stderr and "Traceback" not in result.stderr
    result, _ = _run(tmp_path, small, "+model.input_shapes.x={min:[1,3,16],opt:[1,3,16],max:[1,3,16]}")
    assert result.returncode == ExitCode.USAGE and "3 dims given, the input has 4" in result.stderr


def test_random_data_needs_a_range_for_a_dynamic_input(tmp_path, small):
    result, _ = _run(tmp_path, small, "precision=fp32")
    assert result.returncode == ExitCode.USAGE, result.stdout + result.stderr
    assert "cannot choose the shape of dynamic input 'x'" in result.stderr


def test_resize_policies_keep_each_image_at_its_own_size():
    spec = TensorSpec("x", [1, 3, 0, 0], "float32", 0)
    limit = PreprocessConfig(resize="limit_side", side=960, multiple_of=32)
    assert image_size(1200, 1600, spec, limit)[0] == (704, 960)  # scaled down to 960, rounded to 32
    assert image_size(100, 200, spec, limit)[0] == (96, 192)  # never scaled up
    height = PreprocessConfig(resize="height", side=48, multiple_of=8)
    assert image_size(30, 200, spec, height)[0] == (48, 320)
    ranged = TensorSpec("x", [1, 3, 48, 0], "float32", 0, {"min": [1, 3, 48, 8], "opt": [1, 3, 48, 160],
                                                          "max": [1, 3, 48, 320]})
    assert image_size(30, 600, ranged, height)[0] == (48, 320)  # the range's max width caps it


# --- builds that keep the range ------------------------------------------------------------------

@pytest.mark.parametrize("target", ["ort_cpu", "openvino_cpu"])
def test_int8_bundle_keeps_the_range_and_is_verified_per_shape(tmp_path, small, target):
    # openvino_cpu also with the baselines only timed: fp32 then runs one sample per shape
    baselines = "full" if target == "ort_cpu" else "timed"
    result, run_dir = _run(tmp_path, small, RANGE, f"target={target}", "precision=int8",
                           "data.calibration_size=12", "data.validation_size=6", "validation.timing_rounds=3",
                           f"validation.baselines={baselines}")
    assert result.returncode == 0, result.stdout + result.stderr
    report = read_report(run_dir)
    fp32, memory = report["verify"]["comparison"]["fp32"], report["verify"]["memory"]
    if baselines == "full":
        assert fp32["cosine"] > 0.99 and "compared" not in fp32 and "baseline_samples" not in memory
    else:  # one sample of each of the 3 shapes: what the peak depends on; timed all the same
        assert fp32["compared"] is False and fp32["cosine"] is None and fp32["latency"]["median_ms"] > 0
        assert memory["baseline_samples"] == 3 and memory["samples"] == 6 and memory["fp32"]["run_peak_mb"] > 0
    assert report["convert"]["dynamic_shapes"]["x"]["max"] == [1, 3, 64, 64]
    groups = report["verify"]["shapes"]
    assert [g["buckets"] for g in groups] == [["min"], ["opt"], ["max"]] and all(g["samples"] == 2 for g in groups)
    curve = report["verify"]["speed"]["by_shape"]
    assert [curve[w]["shape"] for w in ("min", "opt", "max")] == ["x=1x3x16x16", "x=1x3x32x48", "x=1x3x64x64"]
    assert curve["max"]["median_ms"]["int8"] > 0 and "shapes: 3 input shapes verified" in result.stdout
    # inputs at opt run a static copy made for that shape (dynamic shapes cost more there)
    assert report["verify"]["effective"]["static_copy_at"] == {"x": "1x3x32x48"}
    bundle = single_bundle(run_dir)
    if target == "ort_cpu":
        dims = onnx.load(str(bundle / "model.onnx")).graph.input[0].type.tensor_type.shape.dim
        assert [d.dim_value or d.dim_param for d in dims][:2] == [1, 3] and all(d.dim_param for d in dims[2:])
    else:
        import openvino as ov

        shape = ov.Core().read_model(str(bundle / "model.xml")).inputs[0].get_partial_shape()
        assert str(shape) == "[1,3,16..64,16..64]"
    if target == "ort_cpu":  # the range check is parity-bundle's own, whatever the runtime
        _bundle_takes_the_range(tmp_path, bundle)


def _bundle_runs_at(tmp_path, bundle: Path, height: int, width: int) -> None:
    """`parity-bundle run` on one [1, 3, height, width] input writes y of that size."""
    np.save(tmp_path / "input.npy", np.random.default_rng(1).random((1, 3, height, width), np.float32))
    found = run_cli(["run", bundle, "--input", tmp_path / "input.npy", "--output", tmp_path / "out.npz"],
                    tmp_path, program="parity-bundle")
    assert found.returncode == 0, found.stdout + found.stderr
    with np.load(tmp_path / "out.npz") as written:
        assert written["y"].shape == (1, 4, height, width)


def _bundle_takes_the_range(tmp_path, bundle: Path) -> None:
    _bundle_runs_at(tmp_path, bundle, 40, 24)
    np.save(tmp_path / "outside.npy", np.random.default_rng(1).random((1, 3, 80, 24), np.float32))
    outside = run_cli(["run", bundle, "--input", tmp_path / "outside.npy"], tmp_path, program="parity-bundle")
    assert outside.returncode == ExitCode.USAGE and "takes 1x3x16x16 .. 1x3x64x64" in outside.stderr
    check = run_cli(["check", bundle], tmp_path, program="parity-bundle")  # recorded samples at their shapes
    assert check.returncode == 0, check.stdout + check.stderr


@pytest.mark.parametrize("target", ["ncnn_cpu", "mnn_cpu"])
def test_ncnn_and_mnn_run_each_sample_at_its_shape(tmp_path, small, target):
    result, run_dir = _run(tmp_path, small, RANGE, f"target={target}", "precision=fp32",
                           "data.validation_size=6", "data.calibration_size=0", "validation.timing_rounds=3")
    assert result.returncode == 0, result.stdout + result.stderr
    groups = read_report(run_dir)["verify"]["shapes"]
    assert len(groups) == 3 and min(g["outputs"]["y"]["cosine"] for g in groups) > 0.9999


def test_ncnn_without_a_range_is_traced_at_the_data_s_range(tmp_path, small):
    """pnnx traces at given shapes: with no model.input_shapes the build takes the range the
    samples span (opt: their most common shape) and every sample is verified at its own shape."""
    data = tmp_path / "data"
    data.mkdir()
    for index, size in enumerate((16, 24, 24)):
        np.save(data / f"{index}.npy", np.ones((1, 3, size, size), np.float32) * (index + 1) / 3)
    result = run_cli([f"model.path={small}", f"data.path={data}", "metric=none", "target=ncnn_cpu",
                      "precision=fp32", "validation.timing_rounds=3"], tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    run_dir = run_dirs(tmp_path)[-1]
    build = json.loads((run_dir / "stages" / "build" / "result.json").read_text())["summary"]
    assert build["traced_at_data_ranges"] == {
        "x": {"min": [1, 3, 16, 16], "opt": [1, 3, 24, 24], "max": [1, 3, 24, 24]}}
    assert min(g["outputs"]["y"]["cosine"] for g in read_report(run_dir)["verify"]["shapes"]) > 0.9999


@pytest.mark.parametrize("target", ["ort_cpu", "openvino_cpu"])
def test_a_dynamic_input_fed_at_one_shape_runs_a_static_copy_and_takes_any(tmp_path, small, target):
    """No range, and every sample at one shape (a detector exported with dynamic axes, served
    at one size): runtime.yaml records that shape as served, the build runs a static copy
    compiled for it, and the bundle still takes another shape (its dims stay dynamic)."""
    data = tmp_path / "data"
    for split, count in (("calibration", 4), ("validation", 4)):
        (data / split).mkdir(parents=True)
        for index in range(count):
            np.save(data / split / f"{index}.npy", np.random.default_rng(index).random((1, 3, 24, 40), np.float32))
    result = run_cli([f"model.path={small}", f"data.path={data}", "metric=none", f"target={target}",
                      "precision=int8", "validation.timing_rounds=3"], tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    run_dir = run_dirs(tmp_path)[-1]
    assert read_report(run_dir)["verify"]["effective"]["static_copy_at"] == {"x": "1x3x24x40"}
    bundle = single_bundle(run_dir)
    import yaml

    spec = yaml.safe_load((bundle / "runtime.yaml").read_text())["inputs"][0]
    assert spec["served"] == [1, 3, 24, 40] and spec["range"] is None and spec["shape"] == [1, 3, 0, 0]
    _bundle_runs_at(tmp_path, bundle, 32, 16)
    if target == "openvino_cpu":  # the dynamic model is compiled only when another shape comes
        from pipeline.release.bundle import open_session

        session, _ = open_session(bundle)
        served = np.random.default_rng(1).random((1, 3, 24, 40), np.float32)
        assert session.run({"x": served})["y"].shape == (1, 4, 24, 40) and session._dynamic is None
        assert session.run({"x": np.ones((1, 3, 8, 8), np.float32)})["y"].shape == (1, 4, 8, 8)
        assert session._dynamic is not None


# --- the real PP-OCRv4 models from the wheel, unchanged -----------------------------------------

def _pages(folder: Path, count: int, seed: int) -> None:
    rng = random.Random(seed)
    folder.mkdir(parents=True)
    for index in range(count):
        width, height = ((160, 96), (224, 128), (128, 128))[index % 3]
        page = Image.new("RGB", (width, height), (rng.randint(225, 255),) * 3)
        for _ in range(rng.randint(2, 3)):
            line = render(" ".join(rng.sample(WORDS, 2)), rng.randint(12, 18), rng.choice(FONTS))
            page.paste(line, (rng.randint(0, max(0, width - line.width)), rng.randint(0, max(0, height - line.height))))
        page.save(folder / f"{index:03d}.png")


@pytest.mark.skipif(NEEDS_FONTS_SKIPPED, reason="needs Debian's fonts-dejavu-core (installed by .ci/run)")
def test_ppocr_det_with_no_input_shapes_takes_the_pages_as_they_are(tmp_path):
    """No model.input_shapes at all: the data decides (limit_side 160, multiples of 32),
    openvino_cpu keeps the dynamic dims, accuracy grouped by the data's own shapes (int8's
    Q/DQ model keeping the dims: the small model's tests above)."""
    _pages(tmp_path / "pages" / "calibration", 4, 1)
    _pages(tmp_path / "pages" / "validation", 4, 2)
    result = run_cli([f"model.path={MODELS / 'ch_PP-OCRv4_det_infer.onnx'}", "data.kind=images",
                      f"data.path={tmp_path / 'pages'}", "data.preprocess.resize=limit_side",
                      "data.preprocess.side=160", "data.preprocess.multiple_of=32",
                      "data.preprocess.mean=[0.485,0.456,0.406]", "data.preprocess.std=[0.229,0.224,0.225]",
                      "data.calibration_size=0", "metric=none", "target=openvino_cpu", "precision=fp32",
                      "validation.timing_rounds=3"], tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    report = read_report(run_dirs(tmp_path)[-1])
    assert report["convert"]["dynamic_shapes"] == {"x": "data"}
    groups = report["verify"]["shapes"]
    assert [g["shape"] for g in groups] == ["x=1x3x96x160", "x=1x3x128x128"]
    assert all(g["buckets"] == ["data"] for g in groups) and sum(g["samples"] for g in groups) == 4
    import openvino as ov

    bundle = single_bundle(run_dirs(tmp_path)[-1])
    assert str(ov.Core().read_model(str(bundle / "model.xml")).inputs[0].get_partial_shape()) == "[1,3,?,?]"


@pytest.mark.skipif(NEEDS_FONTS_SKIPPED, reason="needs Debian's fonts-dejavu-core (installed by .ci/run)")
def test_ppocr_rec_lines_at_their_own_width_within_a_range(tmp_path):
    rng = random.Random(3)
    for split, count in (("calibration", 0), ("validation", 4)):
        folder = tmp_path / "lines" / split
        folder.mkdir(parents=True)
        for index in range(count):
            render(" ".join(rng.sample(WORDS, 1 + index % 3)), 30, FONTS[0]).save(folder / f"{index}.png")
    result = run_cli([f"model.path={MODELS / 'ch_PP-OCRv4_rec_infer.onnx'}",
                      "+model.input_shapes.x={min:[1,3,48,48],opt:[1,3,48,320],max:[1,3,48,960]}",
                      "data.kind=images", f"data.path={tmp_path / 'lines'}", "data.calibration_size=0",
                      "data.preprocess.resize=height", "data.preprocess.multiple_of=8", "data.preprocess.mean=[0.5]",
                      "data.preprocess.std=[0.5]", "metric=none", "target=ort_cpu", "precision=fp32",
                      "validation.timing_rounds=3", "validation.timing_runs=2",
                      "pipeline.stages=[convert,build,verify]"], tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    report = read_report(run_dirs(tmp_path)[-1])
    widths = [int(g["shape"].split("x")[-1]) for g in report["verify"]["shapes"]]
    assert len(widths) >= 3 and widths == sorted(widths) and all(w % 8 == 0 and 48 <= w <= 960 for w in widths)
    assert sorted(report["verify"]["speed"]["by_shape"]) == ["max", "min", "opt"]


def test_auto_on_samples_of_several_shapes_times_a_failing_candidate_too(tmp_path, small):
    """No screening times a candidate when the samples differ in shape (speed as served is a
    stream): a failing int8 had no speed-up in its row. It is timed on the stream with fp32."""
    result, run_dir = _run(tmp_path, small, RANGE, "precision=auto", "precision.candidates=[fp32,int8]",
                           "validation.min_cosine=0.9999999", "data.calibration_size=8", "data.validation_size=6")
    assert result.returncode == 0, result.stdout + result.stderr
    rows = {row["precision"]: row for row in read_report(run_dir)["auto"]["candidates"]}
    assert rows["int8"]["verdict"] == "fail" and rows["fp32"]["verdict"] == "pass"
    assert rows["int8"]["speedup"]["speedup"] > 0 and rows["int8"]["timed_on"].startswith("stream of")
