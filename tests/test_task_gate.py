"""Task-first verdicts (docs/verify.md, "Task-first verdicts"): with a task metric scored,
the metric's drop gates and the task output's cosine is only a floor
(validation.task_min_cosine); every drop comes with a paired bootstrap interval
(pipeline/verification/confidence.py), and a drop that passes while its interval reaches past the
limit is a warning, or a failure with validation.require_confidence."""

from __future__ import annotations

import functools
import json
import xml.etree.ElementTree as ET
from types import SimpleNamespace

import numpy as np
import pytest

from conftest import read_report
from side_by_side import NO_DIAGNOSIS, SIDE_BY_SIDE_ENV, Jobs, new_run, selected, stages

from pipeline.verification import confidence, verdict
from pipeline.config.schemas import ValidationConfig
from pipeline.errors import ExitCode
from pipeline.task_metrics import load_metric
from pipeline.verification.scoring import TaskScorer


def test_the_paired_interval_is_about_the_difference_and_reproducible():
    """Hard samples shared by both cancel: a build that loses 2 of 200 samples the reference
    got right has a narrow interval above 0, whatever the reference's own accuracy."""
    rng = np.random.default_rng(3)
    reference = (rng.random(200) < 0.7).astype(float)
    target = reference.copy()
    target[np.flatnonzero(reference)[:2]] = 0.0
    low, high = confidence.drop_interval(reference, target, higher_is_better=True)
    assert 0.0 <= low <= 0.01 <= high <= 0.03
    assert confidence.drop_interval(reference, target, True) == [low, high]  # a fixed seed
    # lower is better: the sign flips; a metric's own aggregate is used on each resample
    flipped = confidence.drop_interval(reference, target, higher_is_better=False)
    assert flipped == pytest.approx([-high, -low])
    rms = confidence.drop_interval(reference, target, True, aggregate=lambda s: float(np.sqrt(np.mean(s))))
    assert rms[0] >= 0.0 and rms[1] > 0.0
    assert confidence.drop_interval(reference[:1], target[:1], True) is None
    # half-width 0.02 where 0.01 is left: four times the samples
    assert confidence.samples_to_resolve(200, 0.0, 0.02, 0.01) == 800
    assert confidence.samples_to_resolve(200, 0.02, 0.03, 0.01) is None  # the point fails already


def _scored(reference: np.ndarray, target: np.ndarray) -> TaskScorer:
    """A TaskScorer (top1 with labels) fed one-hot outputs: class 1 where the score is 1."""
    scorer = TaskScorer(load_metric({"_target_": "pipeline.task_metrics.Top1", "needs_labels": True}), "y")
    for ref, out in zip(reference, target):
        scorer.active(1)
        scorer.add("reference", np.eye(2, dtype=np.float32)[int(ref)], np.eye(2, dtype=np.float32)[int(ref)], 1)
        scorer.add("build", np.eye(2, dtype=np.float32)[int(out)], np.eye(2, dtype=np.float32)[int(ref)], 1)
    scorer.finish()
    return scorer


def _judged(task: dict):
    requested = {"device": "CPU", "precision": "int8"}
    outputs = [{"name": "y", "failures": []}]
    return verdict.judge(outputs, [], task, requested, {"device": "CPU", "precision": "int8"}, 40)


def test_a_passing_drop_with_an_interval_past_the_limit_warns_or_fails():
    reference = np.ones(40)
    target = reference.copy()
    target[[3, 17]] = 0  # 2 of 40 samples lost: drop 0.05, interval about [0, 0.125]
    task = _scored(reference, target).result("build", max_drop=0.06)
    assert task["passed"] and task["drop"] == pytest.approx(0.05)
    assert task["interval"][0] >= 0.0 and task["interval"][1] > 0.06 and task["uncertain"]
    assert task["samples_to_resolve"] > 40 and task["agreement_interval"][1] == 1.0
    checks, reasons, code = _judged(task)
    assert code == ExitCode.OK and not reasons
    assert [c["check"] for c in checks] == ["task_confidence"] and checks[0]["severity"] == "warning"
    assert f"about {task['samples_to_resolve']} samples would resolve it" in checks[0]["text"]
    strict = _scored(reference, target).result("build", max_drop=0.06, require_confidence=True)
    checks, reasons, code = _judged(strict)
    assert code == ExitCode.THRESHOLD and "validation.require_confidence" in reasons[0]
    # resolved: nothing lost, the interval is [0, 0]
    same = _scored(reference, reference).result("build", max_drop=0.0, require_confidence=True)
    assert same["interval"] == [0.0, 0.0] and not same["uncertain"] and _judged(same)[2] == ExitCode.OK


def test_the_search_aims_at_the_task_floor_when_a_metric_is_scored():
    from stages.sensitivity import goal

    cfg = SimpleNamespace(sensitivity=SimpleNamespace(expected_cos=None, max_drop=None),  # as config.validate gives it
                          validation=ValidationConfig(min_cosine=0.995, task_min_cosine=0.98, max_metric_drop=0.01))
    assert goal(cfg) == (0.995, 0.01) and goal(cfg, task=True) == (0.98, 0.01)
    cfg.validation.task_min_cosine = None
    assert goal(cfg, task=True) == (0.995, 0.01)
    cfg.sensitivity.expected_cos = 0.999  # an explicit goal wins
    assert goal(cfg, task=True) == (0.999, 0.01)


# digits int8 with a cosine threshold no int8 build reaches
STRICT = ["precision=int8", "validation.min_cosine=0.9999999", "validation.max_metric_drop=0.05",
          stages("convert", "calibrate", "build", "verify"), *NO_DIAGNOSIS]
GATES = {"floor": ["validation.require_confidence=true"], "no_metric": ["metric=none"],
         "no_floor": ["validation.task_min_cosine=null"]}


@pytest.fixture(scope="module")
def gate_runs(request, tmp_path_factory):
    """The strict job with each of GATES, each in its own folder, run side by side:
    {name: (completed process, run folder)}."""
    jobs = Jobs()
    if selected(request, "test_a_build_that_keeps_the_task_passes_below_the_cosine_threshold"):
        for name, gate in GATES.items():
            jobs.submit(name, functools.partial(new_run, [*STRICT, *gate], tmp_path_factory.mktemp(name),
                                                env=SIDE_BY_SIDE_ENV))
    yield jobs
    jobs.close()


def test_a_build_that_keeps_the_task_passes_below_the_cosine_threshold(gate_runs):
    """digits int8 with a cosine threshold no int8 build reaches: with top-1 scored (labels)
    the task output's cosine is gated at the 0.98 floor and the build passes; with no task
    metric, or without the floor, the same build fails on cosine. The drop's interval is in
    report.json, report.md, report.html and junit.xml."""
    result, run_dir = gate_runs["floor"]
    verify = read_report(run_dir)["verify"]
    assert verify["task"]["require_confidence"] is True
    assert result.returncode == (3 if verify["task"]["uncertain"] else 0), result.stdout + result.stderr
    output = verify["outputs"][0]
    assert output["cosine_gate"] == "task_min_cosine" and output["thresholds"]["min_cosine"] == 0.98
    assert output["metrics"]["cosine"] < 0.9999999
    task = verify["task"]
    assert task["metric"] == "top1" and len(task["interval"]) == 2 and task["confidence"] == 0.95
    assert "floor: the task metric gates" in result.stdout and "95 % CI" in result.stdout
    assert "drop 95 % interval" in (run_dir / "report.md").read_text()
    assert "drop 95 % interval" in (run_dir / "report.html").read_text()
    cases = [c.get("name") for c in ET.parse(run_dir / "junit.xml").getroot().iter("testcase")]
    assert any("95 % interval within" in name for name in cases)
    # no task metric: the cosine threshold gates
    result, run_dir = gate_runs["no_metric"]
    assert result.returncode == 3, result.stdout + result.stderr
    report = read_report(run_dir)
    assert report["verify"]["outputs"][0]["cosine_gate"] == "min_cosine" and report["verify"]["task"] is None
    # the floor off: the same
    result, run_dir = gate_runs["no_floor"]
    assert result.returncode == 3 and "cosine" in json.dumps(read_report(run_dir)["reasons"])
