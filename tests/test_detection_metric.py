"""metric=detection (pipeline/detection_metric.py): the head decoded, NMS'd, the build's boxes
against the reference's; hand-computed cases and a well-known implementation's numbers."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.detection_metric import Detection, average_precision, decode, f1, nms, recognise


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
