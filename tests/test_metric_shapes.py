"""Every task metric on samples of mixed shapes (issue 37 item 3): scored per shape, a
set-level metric on features, the custom-metric hook too."""

from __future__ import annotations

import numpy as np
import pytest

from test_task_metrics import custom_metrics  # noqa: F401 - the fixture: the custom metric's file

from pipeline.task_metrics import MetricError, TaskMetric, load_metric
from pipeline.verification.scoring import TaskScorer

# --- samples of mixed shapes (issue 37 item 3) ------------------------------------------------

def mixed_samples(metric: str, count: int = 21, seed: int = 0):
    """(outputs, references, labels) of ``count`` samples whose outputs come in several
    shapes, interleaved (more samples than one TaskScorer batch)."""
    rng = np.random.default_rng(seed)
    outputs, references, labels = [], [], []
    for index in range(count):
        if metric == "map_iou":  # a text detector's probability map on pages of 4 sizes
            height, width = [(640, 480), (480, 640), (960, 736), (320, 320)][index % 4]
            reference = np.zeros((1, 1, height, width), dtype=np.float32)
            reference[0, 0, 10:10 + height // 4, 20:20 + width // 2] = 0.9  # a text line
            output = reference + rng.normal(0, 0.15, reference.shape).astype(np.float32)
        elif metric == "ctc":  # a recognizer's [1, steps, classes] on lines of 2 widths
            steps = rng.integers(1, 5, size=(40, 80)[index % 2])
            reference = np.eye(5, dtype=np.float32)[steps][np.newaxis]
            output = reference + rng.normal(0, 0.3, reference.shape).astype(np.float32)
        elif metric == "embedding":  # token embeddings [1, tokens, dim] of sentences of 3 lengths
            reference = rng.normal(size=(1, (7, 12, 30)[index % 3], 16)).astype(np.float32)
            output = reference + rng.normal(0, 0.2, reference.shape).astype(np.float32)
        else:  # top1, regression, custom: class scores with and without the batch axis
            reference = rng.normal(size=((1, 10), (10,))[index % 2]).astype(np.float32)
            output = reference + rng.normal(0, 0.5, reference.shape).astype(np.float32)
        outputs.append(output)
        references.append(reference)
        labels.append(int(np.argmax(reference)) if metric == "top1" else None)
    return outputs, references, (labels if metric == "top1" else None)


MIXED = {"top1": {"_target_": "pipeline.task_metrics.Top1"},
         "ctc": {"_target_": "pipeline.task_metrics.CTC", "charset": ["a", "b", "c", "d"]},
         "map_iou": {"_target_": "pipeline.task_metrics.MapIoU"},
         "map_iou_pooled": {"_target_": "pipeline.task_metrics.MapIoU", "pooled": True},
         "regression": {"_target_": "pipeline.task_metrics.Regression"},
         "embedding": {"_target_": "pipeline.task_metrics.Embedding", "k": 3},
         "custom": {"_target_": "usermetrics.Distance"}}


@pytest.mark.parametrize("name", sorted(MIXED))
def test_every_metric_scores_samples_of_mixed_shapes(name, custom_metrics):
    """Each batch's samples grouped by shape, their scores back in the samples' order: the
    same scores as the metric gives each sample alone (all samples at once, set-level)."""
    config = {**MIXED[name], **({"path": str(custom_metrics)} if name == "custom" else {})}
    metric = load_metric(config)
    outputs, references, labels = mixed_samples(name.replace("_pooled", ""))
    scorer = TaskScorer(metric, "y")
    for index, (output, reference) in enumerate(zip(outputs, references)):
        label = labels[index] if labels else None
        scorer.active(label)
        scorer.add("reference", reference, reference, label)
        scorer.add("int8", output, reference, label)
    scorer.finish()
    scores = np.concatenate(scorer.scores["int8"])
    if metric.set_level:  # every sample reduced to one vector, scored at once
        expected = metric(np.stack([metric.features(o[np.newaxis])[0] for o in outputs]),
                          np.stack([metric.features(r[np.newaxis])[0] for r in references]), None)
    else:
        expected = np.concatenate([metric(o[np.newaxis], r[np.newaxis], None if labels is None else [labels[i]])
                                   for i, (o, r) in enumerate(zip(outputs, references))])
    np.testing.assert_allclose(scores, expected)
    assert len(set(scores.tolist())) > 1  # the outputs differ: a misordered score would show
    task = scorer.result("int8", max_drop=1.0)
    assert task["samples"] == len(outputs) and task["interval"][0] <= task["drop"] <= task["interval"][1]
    if name == "map_iou_pooled":
        weights = np.concatenate(scorer.weights["int8"])
        assert task["target"] == pytest.approx(float((expected * weights).sum() / weights.sum()))
    if name == "ctc":
        assert len(np.concatenate(scorer.agreement["int8"])) == len(outputs)
        assert len(np.concatenate(scorer.extras["int8"]["exact_match"])) == len(outputs)


def test_equal_shapes_keep_one_call_per_batch_and_mixed_ones_one_per_shape():
    calls = []

    def spy(outputs, reference, labels):
        calls.append(outputs.shape)
        return np.abs(outputs - reference).reshape(len(outputs), -1).mean(axis=1)

    for shapes, expected in (([(1, 4)], [(16, 1, 4), (4, 1, 4)]),
                             ([(1, 4), (1, 6)], [(8, 1, 4), (8, 1, 6), (2, 1, 4), (2, 1, 6)])):
        calls.clear()
        scorer = TaskScorer(TaskMetric(name="spy", score=spy), "y")
        for index in range(20):
            value = np.full(shapes[index % len(shapes)], float(index), dtype=np.float32)
            scorer.add("int8", value + 1, value, None)
        scorer.finish()
        assert calls == expected
        assert np.concatenate(scorer.scores["int8"]).tolist() == [1.0] * 20


def test_a_set_level_metric_without_features_needs_one_shape():
    def spread(outputs, reference, labels):
        return np.full(len(outputs), float(np.std(outputs)))

    scorer = TaskScorer(TaskMetric(name="spread", score=spread, set_level=True), "y")
    for index in range(3):
        scorer.add("int8", np.zeros((1, 2 + index)), np.zeros((1, 2 + index)), None)
    with pytest.raises(MetricError, match="metric spread: .*differ in shape.*features"):
        scorer.finish()
