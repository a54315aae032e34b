"""Integer and boolean outputs (class ids from ArgMax, TopK indices, masks) are compared
exactly, never by cosine: agreement, changed count and the first mismatching samples
(pipeline/verification/metrics.py). int8 builds of such a model calibrate, build and verify (exit 0 or
3, never 1)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from conftest import read_report, run_cli, run_dirs

from pipeline.config.schemas import OutputThresholds
from pipeline.verification.metrics import OutputStats, failures


def classifier_with_ids(path, features=16, hidden=32, classes=6, near_tie=False):
    """x [1, 16] -> Gemm -> Relu -> Gemm -> logits [1, 6], and ArgMax(logits) -> cls int64
    [1] and a boolean "confident" (max logit > 0): a classifier exporting its decision.
    ``near_tie``: classes 0 and 1 lead every sample by far and differ by 1e-4 of a weight,
    so int8's rounding decides between them: ids change on about half the samples while
    the logits' cosine stays near 1."""
    rng = np.random.default_rng(4)
    arrays = {"w1": rng.normal(0, 0.4, (features, hidden)), "b1": rng.normal(0, 0.1, hidden),
              "w2": rng.normal(0, 0.4, (hidden, classes)), "b2": rng.normal(0, 0.1, classes),
              "zero": np.zeros(1)}
    if near_tie:
        arrays["w2"][:, 1] = arrays["w2"][:, 0] + rng.normal(0, 1e-4, hidden)
        arrays["b2"][:2] = 5.0
    nodes = [helper.make_node("Gemm", ["x", "w1", "b1"], ["h"], name="dense"),
             helper.make_node("Relu", ["h"], ["r"], name="relu"),
             helper.make_node("Gemm", ["r", "w2", "b2"], ["logits"], name="head"),
             helper.make_node("ArgMax", ["logits"], ["cls"], name="decide", axis=1, keepdims=0),
             helper.make_node("ReduceMax", ["logits"], ["top"], name="top", keepdims=0),
             helper.make_node("Greater", ["top", "zero"], ["confident"], name="confident")]
    graph = helper.make_graph(
        nodes, "ids", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, features])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, classes]),
         helper.make_tensor_value_info("cls", TensorProto.INT64, [1]),
         helper.make_tensor_value_info("confident", TensorProto.BOOL, [1])],
        initializer=[numpy_helper.from_array(v.astype(np.float32), k) for k, v in arrays.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, str(path))
    return path


def test_integer_outputs_are_compared_exactly():
    """3 changed ids of 32 have a cosine of 0.99+ but fail: agreement 29/32, samples named."""
    stats = OutputStats()
    rng = np.random.default_rng(0)
    reference = rng.integers(1, 6, 32)
    changed = {4, 9, 30}
    for index, value in enumerate(reference):
        stats.update(np.array([value]), np.array([value + 1 if index in changed else value]))
    metrics = stats.result()
    assert metrics["exact"] and metrics["cosine"] > 0.98
    assert metrics["changed"] == 3 and metrics["mismatched_samples"] == 3
    assert metrics["agreement"] == pytest.approx(29 / 32) and metrics["first_mismatches"] == [4, 9, 30]
    failed = failures(metrics, OutputThresholds(min_cosine=0.9))
    assert len(failed) == 1 and "3 values changed in 3 samples" in failed[0] and "samples 4, 9, 30" in failed[0]
    assert failures(metrics, OutputThresholds(min_agreement=0.9)) == []
    same = OutputStats()
    same.update(np.array([True, False]), np.array([True, False]))
    assert same.result()["agreement"] == 1.0 and failures(same.result(), OutputThresholds()) == []


@pytest.mark.parametrize("target", ["ort_cpu", "openvino_cpu"])
def test_an_argmax_model_builds_int8_and_its_ids_are_compared_exactly(tmp_path, target):
    model = classifier_with_ids(tmp_path / "ids.onnx")
    common = [f"model.path={model}", "data=random", "data.calibration_size=16", "data.validation_size=40",
              f"target={target}", "precision=int8", "metric=none"]
    result = run_cli(common, tmp_path)
    assert result.returncode in (0, 3), result.stdout + result.stderr
    verify = read_report(run_dirs(tmp_path)[-1])["verify"]
    by_name = {o["name"]: o for o in verify["outputs"]}
    assert not by_name["logits"]["metrics"].get("exact")
    for name in ("cls", "confident"):
        metrics = by_name[name]["metrics"]
        assert metrics["exact"] and by_name[name]["passed"] == (metrics["mismatched_samples"] == 0)
    assert "exact match" in result.stdout
    # validation.outputs.<name>.min_agreement allows some ids to change
    result = run_cli([*common, "+validation.outputs={cls:{min_agreement:0},confident:{min_agreement:0}}",
                      "validation.min_cosine=0"], tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    thresholds = read_report(run_dirs(tmp_path)[-1])["verify"]["outputs"][1]["thresholds"]
    assert thresholds["min_agreement"] == 0


def test_a_changed_id_fails_the_verdict_whatever_the_cosine(tmp_path):
    model = classifier_with_ids(tmp_path / "tie.onnx", near_tie=True)
    result = run_cli([f"model.path={model}", "data=random", "data.calibration_size=16", "data.validation_size=40",
                      "precision=int8", "metric=none"], tmp_path)
    assert result.returncode == 3, result.stdout + result.stderr
    report = read_report(run_dirs(tmp_path)[-1])
    by_name = {o["name"]: o for o in report["verify"]["outputs"]}
    assert by_name["logits"]["passed"] and by_name["logits"]["metrics"]["cosine"] > 0.995
    cls = by_name["cls"]["metrics"]
    assert not by_name["cls"]["passed"] and cls["mismatched_samples"] >= 1 and cls["agreement"] < 1
    assert any("values changed in" in reason and "output cls" in reason for reason in report["reasons"])


def test_a_single_candidate_cut_by_the_budget_is_named_without_a_prediction():
    """One keep-in-float candidate is not screened (nothing to rank it against): when the
    budget runs out before it is confirmed (the tie model above on a busy machine), the
    advice names it with no predicted cosine instead of failing the run."""
    from pipeline.verification.diagnosis import Budget
    from stages.verify.advice import _unconfirmed

    cut = _unconfirmed({"order": [["head"]], "predicted": {}}, Budget(seconds=2.0))
    assert cut["kind"] == "diagnosis_cut" and "keep_float=[head]" in cut["text"]
    assert "predicted" not in cut["text"] and "larger budget" in cut["text"]
    ranked = _unconfirmed({"order": [["a", "b"]], "predicted": {"a,b": 0.9991}}, Budget(seconds=2.0))
    assert "keep_float=[a,b] (predicted cosine 0.999100)" in ranked["text"]


def test_ops_producing_ids_stay_float_even_when_their_type_is_quantized(tmp_path):
    """precision.quantize_ops naming ArgMax and Greater: the build still keeps them float."""
    from pipeline.precision.quantize import QdqSettings, build_qdq, decision_ops

    model = onnx.load(str(classifier_with_ids(tmp_path / "ids.onnx")))
    model = onnx.shape_inference.infer_shapes(model)
    kinds = ["Gemm", "ArgMax", "Greater"]
    assert decision_ops(model, kinds) == ["decide", "confident"]
    onnx.save(model, str(tmp_path / "inferred.onnx"))
    table = {name: {"min": -8.0, "max": 8.0, "threshold": 8.0} for name in ("x", "h", "r", "logits", "top", "zero")}
    build_qdq(tmp_path / "inferred.onnx", table, tmp_path / "q.onnx", QdqSettings(quantize_ops=kinds))
    built = onnx.load(str(tmp_path / "q.onnx"))
    readers = {node.name: list(node.input) for node in built.graph.node}
    producers = {o: node.op_type for node in built.graph.node for o in node.output}
    assert producers[readers["decide"][0]] != "DequantizeLinear"
    assert producers[readers["confident"][0]] != "DequantizeLinear"
    assert producers[readers["dense"][0]] == "DequantizeLinear"


def test_mixed_keeps_float_what_the_ids_need(tmp_path):
    """The search holds the integer outputs to their exact agreement as verify does: on the
    near-tie model it keeps the head float and the ids match."""
    model = classifier_with_ids(tmp_path / "tie.onnx", near_tie=True)
    result = run_cli([f"model.path={model}", "data=random", "data.calibration_size=16", "data.validation_size=40",
                      "precision=mixed", "metric=none"], tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    report = read_report(run_dirs(tmp_path)[-1])
    assert "head" in report["sensitivity"]["float_ops"]
    cls = next(o for o in report["verify"]["outputs"] if o["name"] == "cls")
    assert cls["metrics"]["agreement"] == 1.0
