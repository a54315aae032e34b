"""metric=top1 (the default) on a validation split without labels (issue 46 item 2): on class
scores it judges the agreement of each build's argmax with the reference's (ties within
float noise agree), with its interval, and says so; on any other output (a map, token
logits, an embedding) there is still no task metric."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import TINY_BERT, composed, read_report, run_cli, run_dirs, text_args
from pipeline.task_metrics import TIE_RTOL, UNLABELED_TOP1, Top1, class_scores, load_metric, tie_agreement
from pipeline.verification.scoring import TaskScorer
from pipeline.verification import verdict

TOP1 = {"_target_": "pipeline.task_metrics.Top1"}


def scored(references, builds, output="logits", max_drop=0.01):
    """The top1 task result of ``builds`` (one output a sample) against ``references``, no labels."""
    scorer = TaskScorer(load_metric(TOP1), output)
    for reference, build in zip(references, builds):
        if scorer.active(None, reference):
            scorer.add("reference", reference, reference, None)
            scorer.add("int8", build, reference, None)
    scorer.finish()
    return scorer.result("int8", max_drop)


# --- the metric -----------------------------------------------------------------------------------

def test_a_tie_within_float_noise_agrees_and_a_real_flip_does_not():
    top = 7.25
    reference = np.array([[top, top - 0.5 * TIE_RTOL * top, -3.0],  # classes 0 and 1 tie within float noise
                          [top, top - 0.1, -3.0],  # a clear top class
                          [top, top - 0.1, -3.0]], dtype=np.float32)
    build = np.array([[top - 1e-6, top, -3.0],  # argmax 1: the reference's tie, agreeing
                      [top, top - 0.2, -3.0],  # argmax 0, as the reference
                      [top - 0.2, top, -3.0]], dtype=np.float32)  # argmax 1: a real flip
    assert np.argmax(reference[0]) != np.argmax(build[0])
    assert tie_agreement(build, reference).tolist() == [1.0, 1.0, 0.0]
    # the tolerance is relative to the sample's scale: the same gap on small logits is no tie
    small = reference / 1e4
    small[0, 1] = small[0, 0] - 10 * TIE_RTOL * abs(small[0, 0])
    assert tie_agreement(build / 1e4, small).tolist()[0] == 0.0
    # a build sample that is not finite never agrees
    broken = build.copy()
    broken[1, 2] = np.nan
    assert tie_agreement(broken, reference).tolist() == [1.0, 0.0, 0.0]


def test_unlabeled_top1_is_the_agreement_with_the_reference_with_its_interval():
    rng = np.random.default_rng(0)
    references = [rng.normal(size=(1, 10)).astype(np.float32) for _ in range(40)]
    builds = [r.copy() for r in references]
    for index in (3, 17):  # two real flips: the reference's second class on top
        order = np.argsort(builds[index][0])
        builds[index][0, order[-2]] = builds[index][0, order[-1]] + 0.5
    task = scored(references, builds)
    assert task["metric"] == "top1" and task["labeled"] is False and task["judged_as"] == UNLABELED_TOP1
    assert task["reference"] == 1.0 and task["target"] == pytest.approx(38 / 40)
    assert task["agreement"] == pytest.approx(38 / 40) and task["drop"] == pytest.approx(2 / 40)
    assert task["passed"] is False and len(task["interval"]) == 2
    assert task["interval"][0] <= task["drop"] <= task["interval"][1]
    assert task["disagreement"]["count"] == 2 and task["agreement_interval"][0] < 38 / 40
    checks = verdict._task(task)
    assert "top-1 agreement with the reference dropped 5.00 points" in checks[0]["text"]


def test_labels_keep_top1_accuracy():
    scorer = TaskScorer(load_metric(TOP1), "logits")
    for label, (ref, out) in enumerate([([3.0, 1.0], [3.0, 1.0]), ([1.0, 3.0], [3.0, 1.0])]):
        reference, build = np.array(ref), np.array(out)
        assert scorer.active(label, reference)
        scorer.add("reference", reference, reference, label)
        scorer.add("int8", build, reference, label)
    scorer.finish()
    task = scorer.result("int8", 0.01)
    assert task["labeled"] is True and "judged_as" not in task
    assert (task["reference"], task["target"]) == (1.0, 0.5)
    assert "top-1 accuracy dropped 50.00 points" in verdict._task(task)[0]["text"]


@pytest.mark.parametrize("shape, output, expected", [
    ((1, 10), "logits", True), ((10,), "logits", True), ((10, 1), "logits", True), ((1, 1, 2), "prob", True),
    ((1, 3, 8, 8), "logits", False),  # a segmentation map
    ((1, 5, 30), "logits", False),  # token logits
    ((1,), "logits", False), ((), "logits", False),  # no classes to choose from
    ((1, 64), "sentence_embedding", False), ((1, 512), "image_embeds", False), ((1, 64), "pooler_output", False),
])
def test_only_class_scores_are_judged_without_labels(shape, output, expected):
    assert class_scores(shape, output) is expected
    assert (Top1().without_labels(shape, output) == UNLABELED_TOP1) is expected


def test_other_shapes_keep_no_task_metric():
    rng = np.random.default_rng(1)
    maps = [rng.normal(size=(1, 3, 8, 8)).astype(np.float32) for _ in range(4)]
    assert scored(maps, maps) is None
    # token logits: one sample of one token looks like class scores, the split is still not judged
    tokens = [rng.normal(size=(1, length, 30)).astype(np.float32) for length in (1, 5, 7, 1)]
    assert scored(tokens, tokens) is None
    embeddings = [rng.normal(size=(1, 64)).astype(np.float32) for _ in range(4)]
    assert scored(embeddings, embeddings, output="sentence_embedding") is None
    assert scored(embeddings, embeddings, output="logits") is not None


def test_the_sensitivity_search_counts_the_agreement_without_labels():
    from stages.sensitivity import TaskDrop

    rng = np.random.default_rng(2)
    reference = rng.normal(size=(20, 10)).astype(np.float32)  # 20 samples of [1, 10], batched on axis 0
    flipped = reference.copy()
    flipped[0, np.argsort(flipped[0])[-2]] += 10.0
    drop = TaskDrop(composed("metric=top1"), ["logits"], [reference], None, 20)
    assert drop.index == 0 and drop([reference]) == 0.0 and drop([flipped]) == pytest.approx(1 / 20)
    maps = rng.normal(size=(4, 3, 8, 8)).astype(np.float32)
    assert TaskDrop(composed("metric=top1"), ["logits"], [maps], None, 4).index is None


# --- as a user runs it: a text classifier on unlabeled texts ------------------------------------------

CLASSES = 12


def text_classifier(path):
    """The packaged sentence embedder with a fixed seeded linear head on sentence_embedding:
    a 12-class text classifier whose only output is ``logits`` [batch, 12]."""
    import onnx
    from onnx import helper, numpy_helper

    model = onnx.load(str(TINY_BERT))
    rng = np.random.default_rng(46)
    dim = 64
    weight = rng.normal(scale=1.0, size=(dim, CLASSES)).astype(np.float32)
    bias = rng.normal(scale=0.1, size=(CLASSES,)).astype(np.float32)
    graph = model.graph
    graph.initializer.extend([numpy_helper.from_array(weight, "head_weight"),
                              numpy_helper.from_array(bias, "head_bias")])
    graph.node.extend([
        helper.make_node("MatMul", ["sentence_embedding", "head_weight"], ["head_scores"], "head_matmul"),
        helper.make_node("Add", ["head_scores", "head_bias"], ["logits"], "head_add")])
    batch = graph.output[0].type.tensor_type.shape.dim[0]
    logits = helper.make_tensor_value_info("logits", onnx.TensorProto.FLOAT, [None, CLASSES])
    logits.type.tensor_type.shape.dim[0].CopyFrom(batch)
    del graph.output[:]
    graph.output.append(logits)
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


@pytest.fixture(scope="module")
def unlabeled_texts(tmp_path_factory):
    """The classifier and a folder of texts with no labels: 12 calibration, 24 validation."""
    from sentences import write_folder

    root = tmp_path_factory.mktemp("top1_unlabeled")
    return text_classifier(root / "classifier.onnx"), write_folder(root / "texts", 12, 24, seed=3)


def args_for(model, folder, *more):
    return [*[a for a in text_args(folder) if not a.startswith("model.path=")], f"model.path={model}",
            "metric=top1", "target=ort_cpu", *more]


@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_an_unlabeled_text_classifier_gets_an_agreement_verdict(tmp_path, unlabeled_texts, precision):
    model, folder = unlabeled_texts
    result = run_cli(args_for(model, folder, f"precision={precision}"), tmp_path)
    assert result.returncode in (0, 3), result.stdout + result.stderr
    run_dir = run_dirs(tmp_path)[-1]
    report = read_report(run_dir)
    task = report["verify"]["task"]
    assert isinstance(task, dict), report["warnings"]
    assert task["metric"] == "top1" and task["output"] == "logits" and task["labeled"] is False
    assert task["judged_as"] == "top-1 agreement with the reference (no labels)"
    assert task["samples"] == 24 and task["reference"] == 1.0 and task["target"] == task["agreement"]
    assert len(task["interval"]) == 2 and len(task["agreement_interval"]) == 2
    assert not any("needs labels" in w for w in report["warnings"])
    assert "the task verdict is top-1 agreement with the reference (no labels), not accuracy" in result.stdout
    markdown = (run_dir / "report.md").read_text()
    assert "top-1 agreement with the reference (no labels): the validation split has no labels" in markdown
    if not task["passed"]:  # worded as agreement, not accuracy
        assert result.returncode == 3 and any(r.startswith("top-1 agreement with the reference dropped")
                                              for r in report["reasons"]), report["reasons"]
    assert not any("top-1 accuracy" in reason for reason in report["reasons"]), report["reasons"]
    if precision == "fp32":
        assert task["drop"] == 0.0 and task["passed"], task


def test_a_failing_agreement_says_so(tmp_path, unlabeled_texts):
    """A negative allowed drop asks the build to beat the reference: agreement cannot, so the
    unlabeled verdict fails, worded as agreement."""
    model, folder = unlabeled_texts
    result = run_cli(args_for(model, folder, "precision=fp32", "validation.max_metric_drop=-0.5"), tmp_path)
    assert result.returncode == 3, result.stdout + result.stderr
    report = read_report(run_dirs(tmp_path)[-1])
    assert report["verify"]["task"]["passed"] is False
    assert any(r.startswith("top-1 agreement with the reference dropped 0.00 points") for r in report["reasons"]), \
        report["reasons"]
