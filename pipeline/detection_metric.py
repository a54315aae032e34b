"""``metric=detection``: detectors judged as their users judge them, by the boxes.

The raw head is decoded, NMS'd, and the build's detections are compared with the fp32
reference's (no labels needed):

- the score, per image: F1 of the build's detections at ``conf`` (the deployed threshold)
  against the reference's at the same threshold, a pair matching when the classes agree and
  the IoU is at least ``match_iou`` (greedy, highest score first); an image where neither
  detects anything scores 1. It drives the drop gate and the bootstrap interval.
- an extra, per image: AP@``match_iou`` of the build's detections down to ``low_conf``
  (0.001, as a validation run scores them) ranked against the reference's at ``conf``,
  which score 1 (the reference against itself: 1).

Heads (``format``, or recognised from the output's shape and said in the report):
- ``yolov8``: [1, 4+C, N], rows 0-3 box centre and size, then C class scores (YOLOv8/v11:
  no objectness);
- ``yolov5``: [1, N, 5+C], columns box centre and size, objectness, C class scores
  (YOLOv5/v7: the score is objectness x class);
- ``nms``: [1, K, 6] rows already NMS'd, x0, y0, x1, y1, score, class.

A leaf module (numpy only): pipeline/task_metrics.py exports the class as a built-in."""

from __future__ import annotations

import json
from typing import Dict, List, Optional, Sequence

import numpy as np

FORMATS = ("auto", "yolov8", "yolov5", "nms")
LOW_CONF = 0.001  # what a validation run keeps for its AP


class Detection:
    """Per-image F1 of the build's detections against the reference's (extra: per-image AP)."""

    def __init__(self, format: str = "auto", conf: float = 0.25, iou: float = 0.45, match_iou: float = 0.5,
                 agnostic: bool = False, max_det: int = 300, low_conf: float = LOW_CONF):
        if format not in FORMATS:
            raise ValueError(f"metric.format={format!r}: one of {', '.join(FORMATS)}")
        for name, value in (("conf", conf), ("iou", iou), ("match_iou", match_iou), ("low_conf", low_conf)):
            if not 0.0 <= float(value) <= 1.0:
                raise ValueError(f"metric.{name}={value!r}: a number in [0, 1]")
        if isinstance(max_det, bool) or not isinstance(max_det, int) or max_det < 1:
            raise ValueError(f"metric.max_det={max_det!r}: an integer >= 1")
        self.format, self.conf, self.iou, self.match_iou = format, float(conf), float(iou), float(match_iou)
        self.agnostic, self.max_det, self.low_conf = bool(agnostic), max_det, float(low_conf)

    def __call__(self, outputs: np.ndarray, reference: np.ndarray, labels: Optional[Sequence]) -> np.ndarray:
        return np.array([f1(self.detect(mine, self.conf), self.detect(theirs, self.conf), self.match_iou)
                         for mine, theirs in zip(outputs, reference)])

    def extras(self, outputs: np.ndarray, reference: np.ndarray, labels: Optional[Sequence]) -> Dict[str, np.ndarray]:
        key = f"ap{round(100 * self.match_iou)}"
        return {key: np.array([average_precision(self.detect(mine, self.low_conf), self.detect(theirs, self.conf),
                                                 self.match_iou) for mine, theirs in zip(outputs, reference)])}

    def decode(self, output: np.ndarray) -> str:
        """One image's detections at ``conf`` as JSON (what ``parity-bundle run`` prints)."""
        rows = self.detect(np.asarray(output), self.conf)
        return json.dumps([{"box": [round(float(v), 2) for v in row[:4]], "score": round(float(row[4]), 4),
                            "class": int(row[5])} for row in rows])

    def detect(self, head: np.ndarray, conf: float) -> np.ndarray:
        """One image's detections: rows x0, y0, x1, y1, score, class after NMS, best first."""
        head = np.asarray(head)
        head = head.reshape(head.shape[-2:]) if head.ndim > 2 else head  # a leading batch of 1
        kind = self.format if self.format != "auto" else recognise(head.shape)
        rows = decode(head, kind)
        rows = rows[rows[:, 4] >= conf]
        if kind != "nms":
            rows = nms(rows, self.iou, self.agnostic)
        return rows[: self.max_det]

    def describe(self, shape: Sequence[int]) -> str:
        kind = self.format if self.format != "auto" else recognise(shape)
        how = "given" if self.format != "auto" else "recognised from the shape"
        return f"{kind} head ({how}: {list(shape)})"


def recognise(shape: Sequence[int]) -> str:
    """A head's format from one image's output shape (its leading batch of 1 dropped)."""
    dims = [int(d) for d in shape if int(d) != 1] if len(shape) > 2 else [int(d) for d in shape]
    if len(dims) != 2:
        raise ValueError(f"a detection head of shape {list(shape)}: expected [1, 4+C, N], [1, N, 5+C] or "
                         "[1, K, 6] (set metric.format)")
    rows, columns = dims
    if columns == 6 and rows != 6:
        return "nms"
    if rows < columns:  # [4+C, N]: the anchors outnumber the channels
        return "yolov8"
    return "yolov5"


def decode(head: np.ndarray, kind: str) -> np.ndarray:
    """Rows x0, y0, x1, y1, score, class (every candidate, unthresholded)."""
    table = np.asarray(head, dtype=np.float32)
    table = table.reshape(-1, table.shape[-1]) if table.ndim > 2 else table
    if kind == "yolov8":
        table = table.T  # [N, 4+C]
        scores = table[:, 4:]
    elif kind == "yolov5":
        scores = table[:, 5:] * table[:, 4:5]
    elif kind == "nms":
        return table[:, :6].astype(np.float32)
    else:
        raise ValueError(f"unknown detection head format {kind!r}")
    if scores.shape[1] == 0:
        raise ValueError("the detection head has no class scores")
    classes = scores.argmax(axis=1)
    best = scores[np.arange(len(scores)), classes]
    centre, size = table[:, :2], table[:, 2:4]
    return np.column_stack([centre - size / 2, centre + size / 2, best, classes]).astype(np.float32)


def box_iou(one: np.ndarray, many: np.ndarray) -> np.ndarray:
    """IoU of a box (x0, y0, x1, y1) with each of ``many``."""
    width = np.clip(np.minimum(one[2], many[:, 2]) - np.maximum(one[0], many[:, 0]), 0, None)
    height = np.clip(np.minimum(one[3], many[:, 3]) - np.maximum(one[1], many[:, 1]), 0, None)
    inter = width * height
    area = (one[2] - one[0]) * (one[3] - one[1])
    areas = (many[:, 2] - many[:, 0]) * (many[:, 3] - many[:, 1])
    return inter / np.maximum(area + areas - inter, 1e-9)


def nms(rows: np.ndarray, iou: float, agnostic: bool = False) -> np.ndarray:
    """Greedy non-maximum suppression, class-wise unless ``agnostic``; best first."""
    order = rows[np.argsort(-rows[:, 4], kind="stable")]
    kept: List[np.ndarray] = []
    while len(order):
        best, order = order[0], order[1:]
        kept.append(best)
        if len(order):
            overlap = box_iou(best, order)
            same = np.ones(len(order), bool) if agnostic else order[:, 5] == best[5]
            order = order[~((overlap > iou) & same)]
    return np.array(kept, dtype=np.float32).reshape(-1, 6)


def matches(found: np.ndarray, expected: np.ndarray, match_iou: float) -> np.ndarray:
    """For each of ``found`` (best first), whether it matches a not yet matched box of
    ``expected`` of its class at IoU >= match_iou (the best-overlapping one)."""
    taken = np.zeros(len(expected), bool)
    hits = np.zeros(len(found), bool)
    for index, row in enumerate(found):
        if not len(expected):
            break
        overlap = np.where((expected[:, 5] == row[5]) & ~taken, box_iou(row, expected), -1.0)
        best = int(np.argmax(overlap))
        if overlap[best] >= match_iou:
            taken[best], hits[index] = True, True
    return hits


def f1(found: np.ndarray, expected: np.ndarray, match_iou: float) -> float:
    """F1 of ``found`` against ``expected`` (both empty: 1)."""
    if not len(found) and not len(expected):
        return 1.0
    true = int(matches(found, expected, match_iou).sum())
    return 2.0 * true / (len(found) + len(expected))


def average_precision(found: np.ndarray, expected: np.ndarray, match_iou: float) -> float:
    """AP of ``found`` (ranked by score) against ``expected``, COCO's way (``ranked_ap``).
    Nothing expected: 1 when nothing is found, else 0."""
    if not len(expected):
        return 1.0 if not len(found) else 0.0
    ranked = found[np.argsort(-found[:, 4], kind="stable")]
    return ranked_ap(matches(ranked, expected, match_iou), len(expected))


def ranked_ap(hits: np.ndarray, expected: int) -> float:
    """AP of detections ranked best first (``hits``: whether each matched) against
    ``expected`` boxes: the mean over the 101 recall thresholds 0, 0.01, ..., 1 of the best
    precision at a recall at least that high, 0 where none reaches it (pycocotools' way)."""
    if not len(hits) or not expected:
        return 0.0
    true = np.cumsum(hits)
    precision = true / np.arange(1, len(hits) + 1)
    recall = true / expected
    envelope = np.maximum.accumulate(precision[::-1])[::-1]
    at = np.searchsorted(recall, np.linspace(0.0, 1.0, 101), side="left")
    return float(np.mean(np.where(at < len(envelope), envelope[np.minimum(at, len(envelope) - 1)], 0.0)))
