"""metric=embedding (issue 36 item 5): a sentence embedder judged by its nearest neighbours
over the validation set (pipeline/embedding_metric.py), set-level in TaskScorer, and the
tiny BERT of scripts/make_tiny_bert.py through the CLI on ONNX Runtime and OpenVINO."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import composed, read_report, run_cli, run_dirs, text_args

from pipeline.embedding_metric import Embedding
from pipeline.task_metrics import BATCH, MetricError, load_metric
from pipeline.verification.scoring import TaskScorer

CONFIG = {"_target_": "pipeline.task_metrics.Embedding", "output": "sentence_embedding", "k": 2}


def clusters(count=12, dim=8, seed=0):
    """Embeddings [count, 1, dim] in pairs: each sample's nearest neighbour is its pair's
    other sample, the next ones are far away."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(count // 2, dim))
    points = np.repeat(centres, 2, axis=0) + 0.05 * rng.normal(size=(count, dim))
    return points[:, np.newaxis].astype(np.float32)


def test_nn1_and_recall_against_a_hand_count():
    reference = np.array([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0], [0.1, 0.9]])[:, np.newaxis]
    metric = Embedding(k=2)
    assert metric(reference, reference, None).tolist() == [1.0] * 4  # the reference agrees with itself
    assert metric.extras(reference, reference, None) == {"recall@2": pytest.approx([1.0] * 4)}
    build = reference.copy()
    build[1] = [[0.05, 1.0]]  # sample 1 moves next to samples 2 and 3
    # nearest under the reference 0->1, 1->0, 2->3, 3->2; under the build 0->3, 1->2, 2->1, 3->1
    assert metric(build, reference, None).tolist() == [0.0, 0.0, 0.0, 0.0]
    # 2 nearest, reference 0:{1,3} 1:{0,3} 2:{3,1} 3:{2,1}; build 0:{3,1} 1:{2,3} 2:{1,3} 3:{1,2}
    assert metric.extras(build, reference, None)["recall@2"].tolist() == [1.0, 0.5, 1.0, 1.0]


def neighbours(vectors, k):
    """Each sample's k nearest others by cosine, by sorting (the test's own count)."""
    unit = vectors / np.linalg.norm(vectors, axis=1, keepdims=True)
    return [sorted((j for j in range(len(unit)) if j != i), key=lambda j: -float(unit[i] @ unit[j]))[:k]
            for i in range(len(unit))]


def test_agrees_with_a_sorted_count_on_noisy_embeddings():
    rng = np.random.default_rng(3)
    reference = rng.normal(size=(40, 1, 16))
    build = reference + 0.3 * rng.normal(size=reference.shape)  # a lossy build: some neighbours change
    theirs, mine = neighbours(reference[:, 0], 5), neighbours(build[:, 0], 5)
    metric = Embedding(k=5)
    nn1 = metric(build, reference, None)
    assert nn1.tolist() == [float(a[0] == b[0]) for a, b in zip(mine, theirs)]
    assert 0 < nn1.mean() < 1
    assert metric.extras(build, reference, None)["recall@5"].tolist() == pytest.approx(
        [len(set(a) & set(b)) / 5 for a, b in zip(mine, theirs)])


def test_ties_and_duplicates_count_as_agreement():
    """A duplicate sentence: its twin is nearest under both, whichever twin the build picks."""
    reference = np.array([[1.0, 0.0], [0.0, 1.0], [0.0, 1.0], [0.7, 0.7]])[:, np.newaxis]
    build = reference + np.array([[0.0, 0.0], [0.0, 0.0], [0.0, 0.0], [0.0, 1e-9]])[:, np.newaxis]
    assert Embedding(k=1)(build, reference, None).tolist() == [1.0] * 4
    near = np.array([[1.0, 0.0], [0.6, 0.8], [0.6002, 0.7998], [0.0, 1.0]])[:, np.newaxis]  # 1 and 2 nearly tie for 0
    swapped = near.copy()
    swapped[2] = [[0.5999, 0.8001]]  # the build ranks 1 and 2 the other way round for sample 0
    assert Embedding(k=1)(swapped, near, None)[0] == 0.0  # a swap counts fully by default
    assert Embedding(k=1, tie=1e-3)(swapped, near, None)[0] == 1.0  # within metric.tie of the nearest: agreement


def test_features_pool_token_embeddings_and_are_unit_vectors():
    tokens = np.ones((3, 1, 5, 4))  # 3 samples of [1, tokens, dim]
    tokens[1, 0, :, 0] = 3.0
    tokens[2] = 0.0  # a zero vector stays zero
    found = Embedding.features(tokens)
    assert found.shape == (3, 4)
    assert np.linalg.norm(found, axis=1) == pytest.approx([1.0, 1.0, 0.0])
    np.testing.assert_allclose(Embedding.features(found), found)  # applied twice: the same


def test_a_broken_build_disagrees_and_bad_settings_are_one_line():
    reference = clusters(6)
    build = reference.copy()
    build[2] = np.nan
    scores = Embedding(k=2)(build, reference, None)
    assert scores[2] == 0.0 and np.isfinite(scores).all()
    with pytest.raises(MetricError, match="metric nn@1: .*metric.k=0"):
        load_metric({**CONFIG, "k": 0})
    metric = load_metric(CONFIG)
    with pytest.raises(MetricError, match="needs at least 2 validation samples"):
        metric(reference[:1], reference[:1], None)


def test_the_scorer_scores_the_whole_set_once_with_an_interval():
    """Set-level across batches of BATCH: the scores are the metric's on every sample at
    once; the reference scores 1, the drop is 1 - agreement, with its bootstrap interval."""
    count = 2 * BATCH + 4
    reference = clusters(count)
    build = reference.copy()
    build[[0, 5, 9]] = build[[9, 0, 5]]  # three samples swap embeddings: they and their pairs change neighbour
    metric = load_metric(CONFIG)
    assert (metric.name, metric.set_level, metric.needs_labels) == ("nn@1", True, False)
    scorer = TaskScorer(metric, "sentence_embedding")
    for index in range(count):
        assert scorer.active(None)
        scorer.add("reference", reference[index], reference[index], None)
        scorer.add("int8", build[index], reference[index], None)
    assert scorer.value("int8") is None  # nothing scored before the set is complete
    scorer.finish()
    direct = Embedding(k=2)(build, reference, None)
    assert np.concatenate(scorer.scores["int8"]).tolist() == direct.tolist()
    assert 0 < direct.mean() < 1
    task = scorer.result("int8", max_drop=0.05)
    assert task["reference"] == 1.0 and task["target"] == pytest.approx(direct.mean())
    assert task["drop"] == pytest.approx(1 - direct.mean()) and not task["passed"]
    assert task["interval"][0] <= task["drop"] <= task["interval"][1]
    assert set(task["extras"]) == {"recall@2"} and task["extras"]["recall@2"]["reference"] == 1.0
    scorer.finish()  # again: the same scores, not twice as many
    assert scorer.result("int8", max_drop=0.05)["samples"] == count


def test_the_config_group_defaults():
    cfg = composed("metric=embedding", "precision=int8")
    assert cfg.metric.output == "sentence_embedding" and cfg.metric.k == 5
    assert cfg.validation.max_metric_drop == 0.05
    assert composed("metric=embedding", "validation.max_metric_drop=0.02").validation.max_metric_drop == 0.02
    assert composed("metric=embedding", "precision.max_metric_drop=0.1").validation.max_metric_drop == 0.1
    assert composed("metric=top1", "precision=int8").validation.max_metric_drop == 0.01  # others: the precision's


# --- the tiny BERT through the CLI -----------------------------------------------------------

@pytest.mark.parametrize("target", ["ort_cpu", "openvino_cpu"])
def test_int8_sentence_embedder_gated_on_nearest_neighbours(sentence_folder, tmp_path, target):
    # the tiny model's embeddings are crowded (mean pairwise cosine 0.94): its int8 build swaps
    # a few nearest neighbours that the reference tells apart by < 1e-3, more than the default
    # 0.05 allows on 30 sentences; the gate is the user's, here a looser one
    done = run_cli([*text_args(sentence_folder), "metric=embedding", "precision=int8",
                    f"target={target}", "pipeline.stages=[convert,calibrate,build,verify]",
                    "validation.max_metric_drop=0.3"], tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    verify = read_report(run_dirs(tmp_path)[-1])["verify"]
    task = verify["task"]
    assert (task["metric"], task["output"], task["samples"], task["reference"]) == ("nn@1", "sentence_embedding", 24, 1.0)
    assert task["drop"] == pytest.approx(1 - task["target"]) and task["max_drop"] == 0.3 and task["passed"]
    assert 0 <= task["extras"]["recall@5"]["target"] <= 1 and task["labeled"] is False
    gates = {o["name"]: o for o in verify["outputs"]}
    assert gates["sentence_embedding"]["cosine_gate"] == "task_min_cosine"  # the floor: the task decides
    assert gates["input_ids_out"]["metrics"]["exact"]  # integer outputs stay exact
    assert f"nn@1: reference 1.0000, target {task['target']:.4f}" in done.stdout
    assert "nn@1 drop" in done.stdout
    assert verify["speed"]["stream"]["shapes"] > 1  # sentences at their own lengths: timed as served
    assert len([o for o in verify["outputs"] if o["name"].endswith("_out") and o["metrics"]["changed"] == 0]) == 2


def test_the_mixed_search_leaves_a_set_metric_out_on_one_sample():
    """The search measures on the samples of one input shape; sentences at their natural
    lengths may leave one: no neighbour to agree on, so the search ranks by cosine alone."""
    from stages.sensitivity import TaskDrop

    cfg = composed("metric=embedding")
    one = [np.ones((1, 4), np.float32)]
    assert TaskDrop(cfg, ["sentence_embedding"], one, None, 1)(one) is None
    three = [np.eye(3, 4, dtype=np.float32)]
    assert TaskDrop(cfg, ["sentence_embedding"], three, None, 3)(three) == 0.0
