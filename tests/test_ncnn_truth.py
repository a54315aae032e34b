"""ncnn says what ran and finds the layers to mask (issue 21, items 2 and 5), on a small
StyleGAN2-style demodulation: conv -> x*x -> ReduceSum -> Add 1e-8 -> Sqrt -> Div, whose
sum of squares (~6e5) overflows fp16."""

from __future__ import annotations

import os

import numpy as np
import pytest

from conftest import read_report
from ncnn_helpers import (NO_VULKAN, cosine, has_vulkan, modulated_conv_model, modulated_sample, reference,
                          searched_masks, target)
from pipeline.precision import feature_masks
from pipeline.backends import ncnn as backend
from side_by_side import VERIFIED, Jobs, new_run

VULKAN_RUNS = has_vulkan() or bool(os.environ.get("CI"))
needs_vulkan = pytest.mark.skipif(not VULKAN_RUNS, reason=NO_VULKAN)
FP16_OFF = {"use_fp16_storage": False, "use_fp16_packed": False, "use_fp16_arithmetic": False}


@pytest.fixture(scope="module")
def modulated_model(tmp_path_factory):
    root = tmp_path_factory.mktemp("modulated")
    model = modulated_conv_model(root / "modulated.onnx")
    args = [f"model.path={model}", "data=random", "data.high=4.0", "data.calibration_size=8",
            "data.validation_size=8", "precision=fp16"]
    return root, model, args


@pytest.fixture(scope="module")
def jobs(modulated_model, tmp_path_factory):
    """The fp16 CLI jobs on ncnn_cpu and ncnn_vulkan, each in its own folder, started side
    by side (tests/side_by_side.py); no profile, no bundle, a short speed measure: no test here
    looks at them."""
    _, _, args = modulated_model
    pool = Jobs()
    for name in ("ncnn_vulkan", "ncnn_cpu") if VULKAN_RUNS else ("ncnn_cpu",):
        cwd = tmp_path_factory.mktemp(f"fp16-{name}")
        pool.submit(name, lambda cwd=cwd, name=name: new_run([*args, f"target={name}", VERIFIED], cwd))
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def modulated(modulated_model):
    root, model, args = modulated_model
    out = root / "cpu-fp16"
    out.mkdir()
    _, settings = backend.build(model, None, out, target("CPU"), "fp16")
    return model, out, settings, args


def test_the_model_overflows_fp16_only_in_the_sum(modulated_model):
    _, model, _ = modulated_model
    values = reference(model, {"x": modulated_sample(0)}, ["sum_out", "conv_out"])
    assert values["sum_out"].min() > 65504 and np.abs(values["conv_out"]).max() < 65504


def test_cpu_fp16_reports_the_precision_that_ran(jobs, modulated):
    """Evidence: the fp16-switched net's outputs against the same net with fp16 off."""
    model, out, settings, args = modulated
    fp16 = backend.load(out, settings)
    fp32 = backend.load(out, {**settings, "options": {**settings["options"], **FP16_OFF}})
    x = {"x": modulated_sample(3)}
    identical = np.array_equal(fp16.run(x)["y"], fp32.run(x)["y"])
    effective = fp16.effective()
    assert identical == (effective["precision"] == "fp32")  # bit-identical on a non-trivial input: fp32 ran
    assert effective["precision"] == ("fp16" if backend.cpu_fp16_storage() else "fp32")

    result, run_dir = jobs["ncnn_cpu"]
    assert run_dir is not None, result.stdout + result.stderr
    report = read_report(run_dir)
    ran = report["verify"]["effective"]
    assert ran["precision"] == effective["precision"] and ran["device"] == "CPU"
    if ran["precision"] == "fp32":
        assert result.returncode == 4, result.stdout + result.stderr
        assert "requested precision fp16 but fp32 ran: ncnn's CPU path" in result.stdout
        assert ran["note"] == backend.CPU_FP32_NOTE
    else:  # real fp16 activations overflow in the sum: the accuracy gate fails
        assert result.returncode == 3, result.stdout + result.stderr


@needs_vulkan
def test_vulkan_fp16_mask_search_masks_the_add_between_sum_and_sqrt(jobs):
    found = searched_masks(jobs["ncnn_vulkan"])
    masked = {m["onnx_op"] for m in found["masks"]}
    assert "add_eps" in masked and {"sum", "sqrt"} <= masked
    assert all(m["mask"] == feature_masks.NO_VULKAN for m in found["masks"])
    verify = read_report(jobs["ncnn_vulkan"][1])["verify"]
    assert verify["effective"]["device"] == "VULKAN" and verify["effective"]["precision"] == "fp16"
    assert verify["outputs"][0]["metrics"]["cosine"] >= 0.999


def test_layers_with_equal_outputs_are_mapped_by_structure(modulated):
    """sum_out + 1e-8 == sum_out in fp32: both blobs reproduce both tensors; order decides."""
    _, out, settings, _ = modulated
    layers = backend.layer_map(out, settings)
    types = {layer.name: layer.type for layer in backend.Param.read(out / "model.param").layers}
    assert types[layers["sum"]] == "Reduction" and types[layers["add_eps"]] == "BinaryOp"
    assert types[layers["sqrt"]] == "UnaryOp" and layers["add_eps"] not in settings["options"]["layers"]["sum"]
    blobs = settings["options"]["blobs"]
    assert blobs["sum_out"] != blobs["add_out"]
    assert backend.layer_consumers(out, settings)[layers["sum"]] == [layers["add_eps"]]


def test_resolve_by_structure_pairs_chains_end_aligned():
    onnx_after = {"conv": {"relu", "add"}, "relu": {"add"}, "add": set()}
    ncnn_after = {"b_conv": {"b_add"}, "b_add": set()}
    # convrelu fused: one blob, two tensors -> the later one; then the Add's own blob
    resolved = backend.resolve_by_structure({"b_conv": {"conv", "relu", "add"}, "b_add": {"conv", "relu", "add"}},
                                            onnx_after.get, ncnn_after.get)
    assert resolved == {"b_conv": {"relu"}, "b_add": {"add"}}
    # a blob with no chain keeps its matches (a Reshape's copy stays an alias)
    assert backend.resolve_by_structure({"b": {"t"}}, onnx_after.get, ncnn_after.get) == {"b": {"t"}}


def test_mask_set_grows_along_consumers_until_it_passes():
    consumers = {"sum": ["add"], "add": ["sqrt"], "sqrt": ["div"], "div": []}
    tried = []

    def passes(masks):
        tried.append(sorted(masks))
        return {"sum", "add", "sqrt"} <= set(masks)

    assert feature_masks._passing_set(["sum"], 16, passes, consumers) == ["sum", "add", "sqrt"]
    assert tried == [["sum"], ["add", "sum"], ["add", "sqrt", "sum"]]
    assert feature_masks._passing_set(["div"], 16, lambda masks: False, consumers) is None
