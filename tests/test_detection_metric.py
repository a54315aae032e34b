"""metric=detection (pipeline/detection_metric.py): the head decoded, NMS'd, the build's boxes
against the reference's; hand-computed cases and a well-known implementation's numbers."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.detection_metric import Detection, average_precision, decode, decode_pair, f1, nms, recognise


def _padded(candidates: np.ndarray, count: int = 16) -> np.ndarray:
    """Candidates plus empty anchors (all zero): a head has far more anchors than channels."""
    return np.concatenate([candidates, np.zeros((count - len(candidates), candidates.shape[1]), np.float32)])


def _rows(*boxes):
    return np.array(boxes, dtype=np.float32).reshape(-1, 6)


REFERENCE = _rows((10, 10, 50, 50, 0.9, 0), (100, 100, 150, 160, 0.8, 1), (200, 20, 260, 80, 0.6, 2))
FOUND = _rows((12, 10, 50, 52, 0.9, 0),  # hit
              (300, 300, 310, 310, 0.8, 0),  # a false positive
              (101, 99, 150, 158, 0.7, 1),  # hit
              (202, 22, 258, 80, 0.3, 2))  # hit, ranked last


def test_f1_and_ap_by_hand():
    """4 found, 3 expected, 3 true: F1 6/7. Ranked precision 1, 1/2, 2/3, 3/4 at recall 1/3,
    1/3, 2/3, 1; envelope 1, 3/4, 3/4, 3/4; COCO's 101 thresholds: 34 of them (0..0.33) at 1,
    67 at 3/4: AP = (34 + 50.25) / 101."""
    assert f1(FOUND, REFERENCE, 0.5) == pytest.approx(6 / 7)
    assert average_precision(FOUND, REFERENCE, 0.5) == pytest.approx((34 + 0.75 * 67) / 101)
    assert f1(FOUND[:0], REFERENCE[:0], 0.5) == 1.0 and average_precision(FOUND[:0], REFERENCE[:0], 0.5) == 1.0
    assert f1(FOUND, REFERENCE[:0], 0.5) == 0.0 and average_precision(FOUND[:0], REFERENCE, 0.5) == 0.0
    wrong_class = FOUND.copy()
    wrong_class[:, 5] = 3
    assert f1(wrong_class, REFERENCE, 0.5) == 0.0


def test_ap_against_a_well_known_implementation():
    """The same ranked hits through ultralytics 8.4.190's ``compute_ap`` (its default, a
    trapezoid over 101 interpolated points, run once by hand, 2026-12-02): 0.8300. COCO's
    sampling (pycocotools: the envelope at each of the 101 thresholds) gives 0.8342 here;
    the two integrate the same envelope and differ by under 0.005."""
    assert abs(average_precision(FOUND, REFERENCE, 0.5) - 0.8300) < 0.005


def test_a_yolov8_head_is_decoded_recognised_and_nms_d():
    """[1, 4+C, N]: centre and size rows, then class scores; two overlapping candidates of
    one class leave one box, another class's overlapping box stays (class-wise NMS)."""
    candidates = np.array([[30, 30, 20, 20, 0.9, 0.1], [31, 30, 20, 20, 0.8, 0.1], [30, 31, 20, 20, 0.1, 0.7],
                           [200, 200, 40, 40, 0.05, 0.02]], dtype=np.float32)  # [N, 4+C] with C = 2
    head = _padded(candidates).T[None]  # [1, 6, 16]
    assert recognise(head.shape) == "yolov8"
    rows = decode(head, "yolov8")
    assert rows.shape == (16, 6) and np.allclose(rows[0], [20, 20, 40, 40, 0.9, 0])
    metric = Detection()
    kept = metric.detect(head, 0.25)
    assert kept[:, 5].tolist() == [0, 1] and kept[:, 4].tolist() == pytest.approx([0.9, 0.7])
    assert len(Detection(agnostic=True).detect(head, 0.25)) == 1
    assert len(nms(rows[rows[:, 4] > 0.01], 0.45)) == 3


def test_a_yolov5_head_multiplies_objectness_and_an_nms_head_is_taken_as_is():
    v5 = _padded(np.array([[30, 30, 20, 20, 0.5, 0.9, 0.1], [200, 200, 40, 40, 0.9, 0.2, 0.6]], np.float32))[None]
    assert recognise(v5.shape) == "yolov5"
    kept = Detection().detect(v5, 0.25)
    assert kept[:, 4].tolist() == pytest.approx([0.54, 0.45]) and kept[:, 5].tolist() == [1, 0]
    done = np.array([[[10, 10, 50, 50, 0.9, 2], [0, 0, 0, 0, 0.0, 0]]], dtype=np.float32)  # padded rows
    assert recognise(done.shape) == "nms"
    assert Detection().detect(done, 0.25).tolist() == [[10, 10, 50, 50, pytest.approx(0.9), 2]]


def test_per_image_scores_and_the_ap_extra():
    """A build equal to the reference scores 1 everywhere; moving one image's boxes away
    scores that image 0 (both its F1 and its AP)."""
    candidates = np.array([[30, 30, 20, 20, 0.9, 0.1], [100, 120, 30, 40, 0.1, 0.8]], dtype=np.float32)
    reference = np.stack([_padded(candidates).T] * 2)  # 2 images, [2, 6, 16]
    moved = reference.copy()
    moved[1, :2] += 150
    metric = Detection()
    assert metric(reference, reference, None).tolist() == [1.0, 1.0]
    assert metric(moved, reference, None).tolist() == [1.0, 0.0]
    assert metric.extras(moved, reference, None)["ap50"].tolist() == [1.0, 0.0]


@pytest.mark.parametrize("bad", [{"format": "ssd"}, {"conf": 1.5}, {"max_det": 0}])
def test_bad_settings_say_which(bad):
    with pytest.raises(ValueError, match=f"metric.{next(iter(bad))}"):
        Detection(**bad)


def _head(*rows, count: int = 4) -> np.ndarray:
    """One image's NMS'd head [1, count, 6], padded with empty rows (score 0: below low_conf)."""
    head = np.zeros((count, 6), np.float32)
    head[:len(rows)] = rows
    return head[None]


def _labels(*boxes):
    """Label boxes as pipeline/data/boxes.py gives them: x0, y0, x1, y1, 1, class."""
    return np.array([(*box[1:], 1.0, box[0]) for box in boxes], dtype=np.float32).reshape(-1, 6)


LABELS = [_labels((0, 0, 0, 10, 10), (1, 20, 20, 40, 40)), _labels((0, 50, 50, 70, 70)),
          _labels((0, 100, 100, 120, 120))]
BUILD = np.stack([_head((0, 0, 10, 10, 0.9, 0), (21, 21, 40, 40, 0.6, 1), (0, 0, 10, 11, 0.3, 0)),
                  _head((50, 50, 70, 76, 0.8, 0)),
                  _head((200, 200, 220, 220, 0.7, 0))])
PERFECT = np.stack([_head(*[(*box[:4], 0.9, box[5]) for box in labels]) for labels in LABELS])


def test_map_against_labels_over_the_whole_set_by_hand():
    """Three images; class 0 has 3 label boxes, class 1 one. Class 0's detections ranked over
    the set: 0.9 (image 1, IoU 1), 0.8 (image 2, IoU 400/520 = 0.77), 0.7 (image 3, on
    nothing), 0.3 (image 1, a duplicate of a matched box): up to IoU 0.75 hits 1, 1, 0, 0
    (recall 2/3 at precision 1: 67 of the 101 recall points, AP 67/101); from 0.80 on
    hits 1, 0, 0, 0 (34 points, AP 34/101). Class 1: one detection at IoU 361/400 = 0.9025,
    AP 1 up to 0.90 and 0 at 0.95. mAP@0.5 = (67/101 + 1) / 2 = 168/202; mAP@0.5:0.95 =
    ((6 * 67 + 4 * 34) / 1010 + 9/10) / 2 = 1447/2020. pycocotools 2.0.11's COCOeval on the
    same boxes (run once by hand, bbox, maxDets 100): 0.716337 and 0.831683."""
    metric = Detection(format="nms")
    figures = metric.set_extras(metric.records(BUILD, BUILD, LABELS))
    assert figures["map50_labels"] == pytest.approx(168 / 202)
    assert figures["map50_95_labels"] == pytest.approx(1447 / 2020)
    assert metric.set_extras(metric.records(PERFECT, PERFECT, LABELS)) == {"map50_labels": 1.0,
                                                                             "map50_95_labels": 1.0}
    assert metric.records(BUILD, BUILD, None) is None  # no labels: nothing to count
    assert metric.set_extras(metric.records(BUILD, BUILD, [_labels()] * 3)) == {}  # no labelled box at all


def test_the_scorer_reports_fp32_and_the_build_against_the_labels_side_by_side():
    """Through TaskScorer as verify scores: the gate stays the F1 against the reference; the
    set's mAPs against the labels come as extras, the reference's (fp32) beside the build's.
    Without labels the task is what it was: F1 and the per-image ap50, nothing else."""
    from pipeline.task_metrics import load_metric
    from pipeline.verification.scoring import TaskScorer

    config = {"_target_": "pipeline.task_metrics.Detection", "name": "detection_f1", "format": "nms"}
    results = []
    for labels in (LABELS, [None] * 3):
        scorer = TaskScorer(load_metric(config), "output0")
        for build, reference, label in zip(BUILD, PERFECT, labels):
            assert scorer.active(label, reference)
            scorer.add("reference", reference, reference, label)
            scorer.add("int8", build, reference, label)
        scorer.finish()
        results.append(scorer.result("int8", 0.05))
    labeled, unlabeled = results
    assert labeled["labeled"] and labeled["extras"]["map50_labels"] == {"reference": 1.0,
                                                                        "target": pytest.approx(168 / 202)}
    assert labeled["extras"]["map50_95_labels"]["target"] == pytest.approx(1447 / 2020)
    assert set(unlabeled["extras"]) == {"ap50"} and not unlabeled["labeled"]
    assert unlabeled["target"] == labeled["target"] and unlabeled["extras"]["ap50"] == labeled["extras"]["ap50"]


def test_a_class_label_is_no_box_list():
    from pipeline.task_metrics import MetricError, load_metric

    metric = load_metric({"_target_": "pipeline.task_metrics.Detection", "name": "detection_f1"})
    with pytest.raises(MetricError, match="detection_f1 raised ValueError: label 3 is not a list of boxes"):
        metric.call(metric.hook("records"), BUILD, BUILD, [3, 1, 2])


# --- SSD / RetinaNet style: a box output and a score output, as a pair ---------------------

PAIR_BOXES = np.array([[[10, 10, 50, 50], [12, 10, 50, 52], [100, 100, 150, 160], [0, 0, 1, 1]]], np.float32)
PAIR_SCORES = np.array([[[0.9, 0.1], [0.8, 0.1], [0.2, 0.7], [0.01, 0.02]]], np.float32)


def test_a_box_and_score_pair_is_decoded_recognised_and_nms_d():
    """boxes [1, N, 4] corners and scores [1, N, C]: each box's class is its best score's; the
    two overlapping class-0 boxes leave one; centre-and-size boxes (box_format=cxcywh) give
    the same detections."""
    assert recognise(((1, 4, 4), (1, 4, 2))) == "pair"
    found = Detection().detect((PAIR_BOXES, PAIR_SCORES), 0.25)  # auto: two arrays are a pair
    assert found.tolist() == [[10, 10, 50, 50, pytest.approx(0.9), 0], [100, 100, 150, 160, pytest.approx(0.7), 1]]
    corners = PAIR_BOXES[0]
    centres = np.column_stack([(corners[:, :2] + corners[:, 2:]) / 2, corners[:, 2:] - corners[:, :2]])[None]
    assert Detection(format="pair", box_format="cxcywh").detect((centres, PAIR_SCORES), 0.25).tolist() == found.tolist()
    assert decode_pair(PAIR_BOXES, PAIR_SCORES).shape == (4, 6)


def test_a_pair_is_scored_as_a_stacked_pair_of_outputs():
    """The interface's outputs for a pair metric: (boxes [N, 1, A, 4], scores [N, 1, A, C]).
    The same detections as NMS'd rows score alike: F1, the ap50 extra and the label mAPs."""
    boxes = np.stack([PAIR_BOXES, PAIR_BOXES + 200])  # 2 images
    scores = np.stack([PAIR_SCORES, PAIR_SCORES])
    moved = (boxes.copy(), scores)
    moved[0][1, :, :2, :] += 60  # image 2's class-0 box moved away: 1 of its 2 boxes matches, F1 2/4
    metric = Detection(format="pair")
    assert metric((boxes, scores), (boxes, scores), None).tolist() == [1.0, 1.0]
    assert metric(moved, (boxes, scores), None).tolist() == [1.0, 0.5]
    rows = np.stack([metric.detect((b, s), 0.001)[None] for b, s in zip(*moved)])
    as_rows = Detection(format="nms")
    assert as_rows(rows, rows, None).tolist() == metric(moved, moved, None).tolist()
    labels = [_labels((0, 10, 10, 50, 50), (1, 100, 100, 150, 160))] * 2
    expected = as_rows.set_extras(as_rows.records(rows, None, labels))
    assert metric.set_extras(metric.records(moved, None, labels)) == expected


@pytest.mark.parametrize("detection, head, says", [
    ({"format": "pair"}, PAIR_BOXES, "one output of shape \\[1, 4, 4\\]: metric.format=pair takes two outputs"),
    ({"format": "yolov8"}, (PAIR_BOXES, PAIR_SCORES), "metric.format=yolov8 takes one output"),
    ({}, (PAIR_SCORES, PAIR_BOXES), "boxes \\[1, N, 4\\] and scores \\[1, N, C\\], named in that order"),
    ({}, (PAIR_BOXES, PAIR_SCORES[:, :3]), "shapes \\[1, 4, 4\\] and \\[1, 3, 2\\]")])
def test_a_pair_that_is_not_one_says_what_a_pair_is(detection, head, says):
    with pytest.raises(ValueError, match=says):
        Detection(**detection).detect(head, 0.25)


def test_the_scorer_hands_a_pair_metric_both_outputs():
    """TaskScorer.task_values picks the two outputs metric.output names from a run's outputs
    (a tuple), stacks each, and scores them as the metric's interface takes them."""
    from pipeline.task_metrics import load_metric
    from pipeline.verification.scoring import TaskScorer

    metric = load_metric({"_target_": "pipeline.task_metrics.Detection", "name": "detection_f1", "format": "pair",
                          "output": ["boxes", "scores"]})
    assert metric.names == ("boxes", "scores") and metric.output == "boxes"
    scorer = TaskScorer(metric, metric.output)
    run = {"boxes": PAIR_BOXES, "scores": PAIR_SCORES, "other": np.zeros(3)}
    assert scorer.task_values({"boxes": PAIR_BOXES}) is None
    for build in ("reference", "int8"):
        values = scorer.task_values(run)
        assert isinstance(values, tuple) and values[1] is PAIR_SCORES and scorer.active(None, values)
        scorer.add(build, values, scorer.task_values(run), None)
    scorer.finish()
    assert scorer.result("int8", 0.05)["target"] == 1.0


def test_two_metric_outputs_stop_at_validation_until_verify_passes_them():
    from conftest import composed
    from pipeline.config import validation
    from pipeline.errors import ConfigError

    with pytest.raises(ConfigError, match="two outputs \\(metric.format=pair\\) reach the metric through its "
                                          "Python interface, not through verify yet"):
        validation.validate(composed("metric=detection", "metric.format=pair", "metric.output=[boxes,scores]"))
