"""fp16 building blocks (pipeline/precision/fp16.py) on real models in ONNX Runtime and in ONNX's
reference evaluator, which computes fp16 tensors in fp16: ONNX Runtime's CPU provider
has no fp16 kernels for these ops and runs them in float32, so in it an fp16 overflow
only shows in a tensor it must hand back as fp16."""

from __future__ import annotations

import importlib.util

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from overflow_model import build, sample
from pipeline.precision import fp16
from pipeline.precision.calibration.histogram import AbsHistogram

needs_converter = pytest.mark.skipif(importlib.util.find_spec("onnxconverter_common") is None,
                                     reason="onnxconverter-common is not installed")
CALIBRATION_SEEDS = range(4)
ACTIVATIONS = ["x", "conv_out", "relu_out", "square_out", "reduce_out", "y"]


def with_outputs(model: onnx.ModelProto, names) -> onnx.ModelProto:
    extended = onnx.ModelProto()
    extended.CopyFrom(model)
    present = {o.name for o in extended.graph.output}
    for name in names:
        if name not in present:
            extended.graph.output.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, None))
    return extended


def run_ort(model, feeds) -> dict:
    source = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    session = ort.InferenceSession(source, providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))


def run_fp16_reference(path, feeds) -> dict:
    model = onnx.load(str(path))
    with np.errstate(over="ignore", invalid="ignore"):  # the overflow is what these runs look for
        values = ReferenceEvaluator(model).run(None, feeds)
    return dict(zip([o.name for o in model.graph.output], values))


def relative_error(actual, expected) -> float:
    return float(np.max(np.abs(actual.astype(np.float64) - expected) / np.abs(expected)))


@pytest.fixture(scope="module")
def overflow_model(tmp_path_factory):
    return build(tmp_path_factory.mktemp("fp16") / "overflow.onnx")


@pytest.fixture(scope="module")
def activations(overflow_model):
    """Every activation of the fp32 model for each calibration sample, from ONNX Runtime."""
    model = with_outputs(onnx.load(str(overflow_model)), ACTIVATIONS[1:])
    runs = []
    for seed in CALIBRATION_SEEDS:
        x = sample(seed)
        runs.append({"x": x, **run_ort(model, {"x": x})})
    return runs


@pytest.fixture(scope="module")
def histograms(activations):
    result = {name: AbsHistogram() for name in ACTIVATIONS}
    for run in activations:
        for name, histogram in result.items():
            histogram.update(run[name])
    return result


def test_only_the_reduce_output_exceeds_fp16(histograms):
    assert histograms["reduce_out"].abs_max > fp16.FP16_MAX, histograms["reduce_out"]
    for name in set(ACTIVATIONS) - {"reduce_out"}:
        assert histograms[name].abs_max < fp16.FP16_MAX, (name, histograms[name])


def test_activation_findings_name_the_reduce_output(histograms, activations):
    findings = fp16.activation_findings(histograms)

    assert [(f["tensor"], f["check"], f["severity"]) for f in findings] == [("reduce_out", "fp16_overflow", "error")]
    exact = sum(int((np.abs(run["reduce_out"]) > fp16.FP16_MAX).sum()) for run in activations)
    assert abs(findings[0]["count"] - exact) <= 1, (findings[0], exact)
    assert "inf" in findings[0]["detail"]


def test_denormal_finding_needs_most_nonzero_values_below_the_normal_range():
    # max |x| 0.01: bins of ~4.9e-6, fine enough to resolve 2**-14 (~6.1e-5)
    mostly_tiny = AbsHistogram()
    mostly_tiny.update(np.concatenate([np.full(60, 1e-6), np.full(40, 0.01), np.zeros(500)]))
    mostly_normal = AbsHistogram()
    mostly_normal.update(np.concatenate([np.full(40, 1e-6), np.full(60, 0.01)]))

    findings = fp16.activation_findings({"tiny": mostly_tiny, "normal": mostly_normal})

    assert [(f["tensor"], f["check"], f["severity"]) for f in findings] == [("tiny", "fp16_denormal", "warning")]
    assert findings[0]["count"] == 60


def test_block_list_keeps_producer_and_consumer(overflow_model, histograms):
    findings = fp16.activation_findings(histograms)
    assert fp16.block_list(onnx.load(str(overflow_model)), findings) == ["reduce", "sqrt"]


def test_block_list_rejects_a_tensor_the_model_lacks(overflow_model):
    finding = {"tensor": "renamed_by_another_graph", "check": "fp16_overflow"}
    with pytest.raises(ValueError, match="renamed_by_another_graph"):
        fp16.block_list(onnx.load(str(overflow_model)), [finding])


@needs_converter
def test_without_a_block_list_fp16_overflows(overflow_model, activations, tmp_path):
    converted = tmp_path / "fp16.onnx"
    summary = fp16.convert(overflow_model, converted, [])
    onnx.checker.check_model(onnx.load(str(converted)), full_check=True)
    x = activations[0]["x"]
    overflowing = np.abs(activations[0]["reduce_out"]) > fp16.FP16_MAX

    computed_in_fp16 = run_fp16_reference(converted, {"x": x})["y"]
    assert np.array_equal(np.isinf(computed_in_fp16), overflowing)
    assert summary["blocked"] == [] and summary["clamped"] == []

    # ONNX Runtime must return the fp16 tensor itself to show it: its CPU kernels run in float32.
    exposed = tmp_path / "exposed.onnx"
    onnx.save(with_outputs(onnx.load(str(overflow_model)), ["reduce_out"]), str(exposed))
    fp16.convert(exposed, tmp_path / "exposed_fp16.onnx", [], keep_io_types=False)
    reduce_out = run_ort(tmp_path / "exposed_fp16.onnx", {"x": x.astype(np.float16)})["reduce_out"]
    assert reduce_out.dtype == np.float16
    assert np.array_equal(np.isinf(reduce_out), overflowing) and overflowing.sum() > 0


@needs_converter
def test_blocking_producer_and_consumer_matches_fp32(overflow_model, histograms, activations, tmp_path):
    block = fp16.block_list(onnx.load(str(overflow_model)), fp16.activation_findings(histograms))
    converted = tmp_path / "fp16.onnx"
    summary = fp16.convert(overflow_model, converted, block)
    onnx.checker.check_model(onnx.load(str(converted)), full_check=True)

    assert summary["blocked"] == ["reduce", "sqrt"]
    assert summary["converted_initializers"] == 2 and summary["clamped"] == []
    for run in activations:
        y = run_ort(converted, {"x": run["x"]})["y"]
        assert y.dtype == np.float32 and np.isfinite(y).all()
        assert relative_error(y, run["y"]) < 1e-2
        computed_in_fp16 = run_fp16_reference(converted, {"x": run["x"]})["y"]
        assert np.isfinite(computed_in_fp16).all()
        assert relative_error(computed_in_fp16, run["y"]) < 1e-2


@needs_converter
def test_blocking_only_the_producer_still_overflows(overflow_model, activations, tmp_path):
    converted = tmp_path / "fp16.onnx"
    fp16.convert(overflow_model, converted, ["reduce"])
    y = run_fp16_reference(converted, {"x": activations[0]["x"]})["y"]
    assert np.isinf(y).any()  # the producer's float32 output is cast to fp16 for Sqrt


@needs_converter
def test_a_blocked_output_that_is_also_read_stays_float32(overflow_model, activations, tmp_path):
    exposed = tmp_path / "exposed.onnx"
    onnx.save(with_outputs(onnx.load(str(overflow_model)), ["reduce_out"]), str(exposed))
    converted = tmp_path / "fp16.onnx"
    fp16.convert(exposed, converted, ["reduce", "sqrt"])
    onnx.checker.check_model(onnx.load(str(converted)), full_check=True)

    outputs = run_ort(converted, {"x": activations[0]["x"]})
    for name in ("y", "reduce_out"):
        assert outputs[name].dtype == np.float32 and np.isfinite(outputs[name]).all()
        assert relative_error(outputs[name], activations[0][name]) < 1e-2


def big_constant_model(path):
    """x -> (+ 1e8, initializer) -> (+ -1e8, Constant node) -> (* 0.5) -> y. Adding 1e8 in
    float32 rounds x to a multiple of 8, which fp16 then holds exactly."""
    nodes = [
        helper.make_node("Constant", [], ["offset"], name="offset",
                         value=numpy_helper.from_array(np.full(4, -1e8, dtype=np.float32))),
        helper.make_node("Add", ["x", "big"], ["shifted"], name="add"),
        helper.make_node("Add", ["shifted", "offset"], ["back"], name="sub"),
        helper.make_node("Mul", ["back", "half"], ["y"], name="scale"),
    ]
    graph = helper.make_graph(
        nodes, "big_constant", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
        initializer=[numpy_helper.from_array(np.full(4, 1e8, dtype=np.float32), "big"),
                     numpy_helper.from_array(np.full(4, 0.5, dtype=np.float32), "half")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


@needs_converter
def test_constant_beyond_fp16_is_found_and_kept_exact(tmp_path):
    source = big_constant_model(tmp_path / "big.onnx")
    model = onnx.load(str(source))
    findings = fp16.constant_findings(model)

    assert {(f["tensor"], f["check"], f["severity"], tuple(f["node"])) for f in findings} == {
        ("big", "fp16_overflow", "error", ("add",)), ("offset", "fp16_overflow", "error", ("sub",))}
    block = fp16.block_list(model, findings)
    assert block == ["offset", "add", "sub"]

    converted = tmp_path / "fp16.onnx"
    summary = fp16.convert(source, converted, block)
    onnx.checker.check_model(onnx.load(str(converted)), full_check=True)
    x = np.random.default_rng(0).uniform(0, 100, (1, 4)).astype(np.float32)
    expected = run_ort(source, {"x": x})["y"]
    assert np.array_equal(run_ort(converted, {"x": x})["y"], expected)
    initializers = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(converted)).graph.initializer}
    assert initializers["big"].dtype == np.float32 and (initializers["big"] == 1e8).all()
    assert initializers["half"].dtype == np.float16
    assert summary["clamped"] == []

    unblocked = fp16.convert(source, tmp_path / "clamped.onnx", [])
    assert {c["tensor"] for c in unblocked["clamped"]} == {"big", "offset"}


@needs_converter
def test_summary_names_what_the_library_defaults_would_clamp(tmp_path):
    weights = np.array([3e4, 1e-9, 1.0, -2.0], dtype=np.float32)
    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "w"], ["y"], name="mul")], "weights",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])],
        initializer=[numpy_helper.from_array(weights, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(tmp_path / "w.onnx"))

    summary = fp16.convert(tmp_path / "w.onnx", tmp_path / "fp16.onnx", [])

    assert summary["library_defaults_would_clamp"] == ["w"]
    assert [(c["tensor"], c["count"]) for c in summary["clamped"]] == [("w", 1)]  # 1e-9 -> 2**-24
    stored = numpy_helper.to_array(onnx.load(str(tmp_path / "fp16.onnx")).graph.initializer[0])
    assert stored[0] == 3e4 and stored[1] == np.float16(2.0**-24)


@needs_converter
def test_overflow_read_by_two_blocked_nodes_never_passes_through_fp16(tmp_path):
    """x * 1e3 overflows fp16 and feeds two nodes; an initializer is shared by a blocked
    and an unblocked node."""
    nodes = [
        helper.make_node("Mul", ["x", "thousand"], ["grown"], name="grow"),
        helper.make_node("Mul", ["grown", "milli"], ["a"], name="shrink_a"),
        helper.make_node("Mul", ["grown", "milli"], ["b"], name="shrink_b"),
        helper.make_node("Add", ["a", "b"], ["sum"], name="add"),
        helper.make_node("Mul", ["sum", "milli"], ["y"], name="tail"),
    ]
    graph = helper.make_graph(
        nodes, "two_readers", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [8])],
        initializer=[numpy_helper.from_array(np.full(8, 1e3, dtype=np.float32), "thousand"),
                     numpy_helper.from_array(np.full(8, 1e-3, dtype=np.float32), "milli")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(tmp_path / "two.onnx"))
    x = np.linspace(1, 100, 8, dtype=np.float32)
    grown = AbsHistogram()
    grown.update(x * 1e3)

    block = fp16.block_list(model, fp16.activation_findings({"grown": grown}))
    assert block == ["grow", "shrink_a", "shrink_b"]
    summary = fp16.convert(tmp_path / "two.onnx", tmp_path / "fp16.onnx", block)
    onnx.checker.check_model(onnx.load(str(tmp_path / "fp16.onnx")), full_check=True)

    expected = run_ort(tmp_path / "two.onnx", {"x": x})["y"]
    for outputs in (run_ort(tmp_path / "fp16.onnx", {"x": x}), run_fp16_reference(tmp_path / "fp16.onnx", {"x": x})):
        assert np.isfinite(outputs["y"]).all() and relative_error(outputs["y"], expected) < 1e-2
    assert "milli_fp32" in summary["fp32_initializers"]  # the blocked readers' copy


def test_name_nodes_is_idempotent_and_unique():
    nodes = [
        helper.make_node("Relu", ["x"], ["r0"]),
        helper.make_node("Relu", ["r0"], ["r1"], name="Relu_0"),
        helper.make_node("Abs", ["r1"], ["a2"], name="dup"),
        helper.make_node("Abs", ["a2"], ["a3"], name="dup"),
        helper.make_node("Neg", ["a3"], ["y"]),
    ]
    graph = helper.make_graph(nodes, "names", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])

    fp16.name_nodes(model)
    names = [node.name for node in model.graph.node]
    fp16.name_nodes(model)

    assert names == ["Relu_0_1", "Relu_0", "dup", "Abs_3", "Neg_4"]
    assert [node.name for node in model.graph.node] == names
