"""Twenty agreeing samples are not certainty (issue 37 item 2; docs/verify.md, "Task-first
verdicts"): the disagreement count gets an exact Clopper-Pearson interval next to the
drop's bootstrap, a passing drop that the counts cannot resolve warns naming the samples
that would (a failure with validation.require_confidence), at 0, 1 and many disagreements."""

from __future__ import annotations

import math

import numpy as np
import pytest

from conftest import read_report, run_cli, run_dirs

from pipeline.errors import ExitCode
from pipeline.task_metrics import load_metric
from pipeline.verification.scoring import TaskScorer
from pipeline.verification import confidence, verdict

# (k, n): [low, high] of the two-sided 95 % Clopper-Pearson interval, from scipy.stats.beta.ppf
KNOWN = {
    (0, 20): (0.0, 0.16843347098308530),
    (1, 20): (0.0012650894979498038, 0.24873276277202777),
    (5, 20): (0.08657146910143461, 0.49104587170795744),
    (20, 20): (0.8315665290169146, 1.0),
    (0, 200): (0.0, 0.01827534035513624),
    (3, 200): (0.003104107621553509, 0.0432082819177126),
    (150, 400): (0.32738623872952000, 0.42447821133857505),
    (1000, 100000): (0.009392556089098503, 0.010636111529354269),
}


@pytest.mark.parametrize("count, samples", list(KNOWN), ids=lambda v: str(v))
def test_the_clopper_pearson_interval_matches_known_values_at_zero_one_and_many(count, samples):
    low, high = confidence.clopper_pearson(count, samples)
    assert (low, high) == pytest.approx(KNOWN[count, samples], rel=1e-9, abs=1e-12)
    if count == 0:  # exactly 1 - 0.025^(1/n) at zero events
        assert high == pytest.approx(1 - 0.025 ** (1 / samples), rel=1e-12)


def test_the_interval_agrees_with_scipy_where_it_is_installed():
    stats = pytest.importorskip("scipy.stats")
    special = pytest.importorskip("scipy.special")
    for count, samples in [(0, 7), (1, 50), (2, 368), (17, 90), (250, 1000), (7, 10 ** 6)]:
        low = 0.0 if count == 0 else stats.beta.ppf(0.025, count, samples - count + 1)
        high = stats.beta.ppf(0.975, count + 1, samples - count)
        assert confidence.clopper_pearson(count, samples) == pytest.approx([low, high], rel=1e-9, abs=1e-12)
    for x, a, b in [(0.3, 2, 5), (0.9, 50, 3), (0.01, 1, 1000), (0.5, 1e4, 1e4 + 3), (0.999, 0.5, 0.5)]:
        assert confidence.regularized_beta(x, a, b) == pytest.approx(special.betainc(a, b, x), rel=1e-10)


def test_the_samples_that_resolve_a_drop_by_counts():
    """0 disagreements: the smallest n with 1 - 0.025^(1/n) <= the limit (368 for a point,
    between the rule of three's 300 and Wilson's); at a rate above 0 the bound shrinks as
    the samples grow, and no count resolves a drop with no room left."""
    needed = confidence.counted_samples(0.0, 0.0, 0.01)
    assert needed == 368 == math.ceil(math.log(0.025) / math.log(0.99))
    assert confidence.clopper_pearson(0, needed)[1] <= 0.01 < confidence.clopper_pearson(0, needed - 1)[1]
    assert confidence.counted_samples(0.0, 0.0, 0.05) == 72
    many = confidence.counted_samples(0.0, 0.03, 0.01)  # 3 % of samples disagree, none lost on balance
    assert confidence.clopper_pearson(0.03 * many, many)[1] - 0.03 <= 0.01
    assert confidence.clopper_pearson(0.03 * (many - 1), many - 1)[1] - 0.03 > 0.01
    assert confidence.counted_samples(0.01, 0.0, 0.01) is None and confidence.counted_samples(0.0, 0.0, 0.0) is None


def _top1(reference_classes, build_classes, labels) -> TaskScorer:
    """Top-1 with labels on one-hot outputs of 10 classes."""
    scorer = TaskScorer(load_metric({"_target_": "pipeline.task_metrics.Top1", "needs_labels": True}), "y")
    eye = np.eye(10, dtype=np.float32)
    for ref, out, label in zip(reference_classes, build_classes, labels):
        scorer.active(label)
        scorer.add("reference", eye[ref], eye[ref], label)
        scorer.add("build", eye[out], eye[ref], label)
    scorer.finish()
    return scorer


def _judged(task: dict):
    return verdict.judge([{"name": "y", "failures": []}], [], task, {"device": "CPU", "precision": "int8"},
                         {"device": "CPU", "precision": "int8"}, task["samples"])


def test_twenty_agreeing_samples_warn_naming_the_samples_that_would_resolve_the_drop():
    classes = list(range(10)) * 2
    task = _top1(classes, classes, classes).result("build", max_drop=0.01)
    assert task["passed"] and task["drop"] == 0.0 and task["interval"] == [0.0, 0.0]  # the bootstrap sees nothing
    counts = task["disagreement"]
    assert counts["by"] == "agreement" and (counts["count"], counts["samples"]) == (0, 20)
    assert counts["interval"] == pytest.approx([0.0, 0.168433470983], abs=1e-9)
    assert counts["drop_high"] == pytest.approx(0.168433470983) and not counts["resolved"]
    assert task["uncertain"] and task["samples_to_resolve"] == counts["samples_to_resolve"] == 368
    checks, reasons, code = _judged(task)
    assert code == ExitCode.OK and not reasons and checks[0]["severity"] == "warning"
    text = checks[0]["text"]
    assert "0 of 20 samples disagree with the reference" in text and "up to 0.168" in text
    assert "about 368 samples would resolve it" in text and "[0, 0]" not in text  # the bootstrap is not the reason
    strict = _top1(classes, classes, classes).result("build", max_drop=0.01, require_confidence=True)
    checks, reasons, code = _judged(strict)
    assert code == ExitCode.THRESHOLD and reasons[0].endswith("(validation.require_confidence)")
    # enough agreeing samples resolve a looser limit: 0 of 20 bound the drop at 0.168
    loose = _top1(classes, classes, classes).result("build", max_drop=0.2, require_confidence=True)
    assert loose["disagreement"]["resolved"] and not loose["uncertain"] and _judged(loose)[2] == ExitCode.OK
    # a limit of 0 (fp32's) asks for no change on these samples: no count bounds a rate to 0
    exact = _top1(classes, classes, classes).result("build", max_drop=0.0, require_confidence=True)
    assert not exact["disagreement"]["resolved"] and exact["disagreement"]["samples_to_resolve"] is None
    assert not exact["uncertain"] and _judged(exact)[2] == ExitCode.OK


def test_one_disagreement_counts_even_where_the_score_is_unchanged():
    """A class changed from one wrong class to another costs no point, yet it is a
    disagreement: 1 of 20 leaves the rate up to 0.249. One flipped correct sample is a
    5-point drop: it fails on its own, with the counts recorded."""
    classes = list(range(10)) * 2
    labels = [9 - c if i == 0 else c for i, c in enumerate(classes)]  # sample 0: the reference is wrong
    build = list(classes)
    build[0] = 5  # wrong before, wrong after
    task = _top1(classes, build, labels).result("build", max_drop=0.01)
    assert task["drop"] == 0.0 and task["interval"] == [0.0, 0.0]
    counts = task["disagreement"]
    assert counts["count"] == 1 and counts["interval"][1] == pytest.approx(0.248732762772)
    assert counts["drop_high"] == pytest.approx(0.248732762772 - 0.05) and task["uncertain"]
    assert "1 of 20 samples disagree" in _judged(task)[0][0]["text"]
    build = list(classes)
    build[3] = 4  # a correct sample lost
    task = _top1(classes, build, classes).result("build", max_drop=0.01)
    assert not task["passed"] and task["drop"] == pytest.approx(0.05)
    assert task["disagreement"]["count"] == 1 and task["uncertain"] is False


def test_many_disagreements_that_cancel_are_resolved_as_the_bootstrap_resolves_them():
    """3000 samples, 30 lost and 30 gained (2 % of classes changed, no drop on balance):
    the counts bound is about the bootstrap's and resolves a 2-point limit; a half-point
    limit is resolved by neither, and the samples named resolve the counts bound."""
    rng = np.random.default_rng(0)
    labels = list(rng.integers(0, 10, 3000))
    reference = [int(label) if i % 2 else (int(label) + 1) % 10 for i, label in enumerate(labels)]  # half right
    build = list(reference)
    for i in range(60):
        build[i] = int(labels[i]) if i % 2 == 0 else (reference[i] + 1) % 10  # 30 gained, 30 lost
    task = _top1(reference, build, labels).result("build", max_drop=0.02)
    counts = task["disagreement"]
    assert task["drop"] == pytest.approx(0.0) and counts["count"] == 60 and counts["rate"] == pytest.approx(0.02)
    margin = counts["drop_high"] - task["drop"]
    assert 0.5 < margin / (task["interval"][1] - task["drop"]) < 2.0  # about the bootstrap's margin
    assert counts["resolved"] and not task["uncertain"]
    tight = _top1(reference, build, labels).result("build", max_drop=0.005)
    assert tight["uncertain"] and not tight["disagreement"]["resolved"]
    needed = tight["disagreement"]["samples_to_resolve"]
    assert needed > 3000 and tight["samples_to_resolve"] >= needed
    assert confidence.clopper_pearson(0.02 * needed, needed)[1] - 0.02 <= 0.005


def test_metrics_without_a_count_keep_the_bootstrap_alone():
    """map_iou's per-page IoUs are no 0/1 and it has no agreement; regression aggregates
    its own way: no disagreement interval. A 0/1 metric without agreement counts samples
    whose score changed; agreeing samples that score differently bound nothing."""
    rng = np.random.default_rng(1)
    maps = TaskScorer(load_metric({"_target_": "pipeline.task_metrics.MapIoU"}), "y")
    for _ in range(20):
        page = rng.random((8, 8)).astype(np.float32)
        maps.add("reference", page, page, None)
        maps.add("build", page + 0.05, page, None)
    maps.finish()
    assert maps.result("build", max_drop=0.01)["disagreement"] is None
    assert confidence.disagreement(np.ones(20), np.ones(20), None, 0.0, 0.01)["by"] == "scores"
    assert confidence.disagreement(np.full(20, 0.5), np.full(20, 0.5), None, 0.0, 0.01) is None
    mismatched = confidence.disagreement(np.ones(4), np.array([1.0, 0.5, 1.0, 1.0]), np.ones(4), 0.125, 0.2)
    assert mismatched is None  # "agreeing" samples that score differently
    wide = confidence.disagreement(np.full(20, 10.0), np.full(20, 2.0), np.array([1.0] * 19 + [0.0]), 0.0, 1.0)
    assert wide is None  # agreeing samples differ in score
    scaled = confidence.disagreement(np.array([0.0, 10.0] * 10), np.array([0.0, 10.0] * 10), np.ones(20), 0.0, 1.0)
    assert scaled["span"] == 10.0 and scaled["drop_high"] == pytest.approx(10 * 0.168433470983)


def test_the_cli_warns_on_twenty_samples_and_require_confidence_fails_it(tmp_path):
    """`parity precision=int8 data.validation_size=20` on the default model: every sample
    keeps its class, the bootstrap says [0, 0], and the warning names the 368 samples
    that would resolve a 1-point limit; validation.require_confidence=true exits 3."""
    args = ["precision=int8", "data.validation_size=20", "pipeline.stages=[convert,calibrate,build,verify]",
            "validation.require_confidence=true"]
    result = run_cli(args, tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode == 3, output
    task = read_report(run_dirs(tmp_path)[-1])["verify"]["task"]  # checked against the schema
    counts = task["disagreement"]
    assert task["samples"] == 20 and task["passed"] and task["uncertain"] and not counts["resolved"]
    assert counts["method"] == "clopper-pearson" and counts["interval"][1] >= 0.168433470983 - 1e-9
    assert f"about {task['samples_to_resolve']} samples would resolve it" in output
    assert "(validation.require_confidence)" in output and f"{counts['count']}/20 disagree" in output
    if counts["count"] == 0:  # the case: 20 of 20 keep their class
        assert task["interval"] == [0.0, 0.0] and task["samples_to_resolve"] == 368
    # without require_confidence: the same build passes with the warning (convert to build from the cache)
    result = run_cli(args[:-1], tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "warning: task metric top1: the drop" in result.stdout
    assert f"about {task['samples_to_resolve']} samples would resolve it (a warning" in result.stdout
