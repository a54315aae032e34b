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
- figures of the whole set: mAP@0.5 and mAP@0.5:0.95 of the detections down to ``low_conf``,
  COCO's way (``records`` per image, ``set_extras`` over the set), against the labels where
  the data have them (boxes in the input's pixels, pipeline/data/boxes.py; ``map50_labels``,
  ``map50_95_labels``), else against the reference's detections at ``conf``
  (``map50_reference``, ``map50_95_reference``; the reference scores 1); reported, not gated.

Heads (``format``, or recognised from the output's shape and said in the report):
- ``yolov8``: [1, 4+C, N], rows 0-3 box centre and size, then C class scores (YOLOv8/v11:
  no objectness);
- ``yolov5``: [1, N, 5+C], columns box centre and size, objectness, C class scores
  (YOLOv5/v7: the score is objectness x class);
- ``nms``: [1, K, 6] rows already NMS'd, x0, y0, x1, y1, score, class;
- ``pair``: two outputs (SSD / RetinaNet), boxes [1, N, 4] (``box_format`` xyxy or
  cxcywh) and scores [1, N, C]; the metric gets them as a pair (boxes, scores) of stacked
  arrays, and ``auto`` recognises such a pair.

numpy only; pipeline.detection_metric, its old path, re-exports it for older imports."""

from __future__ import annotations

import json
from typing import Dict, List, NamedTuple, Optional, Sequence

import numpy as np

FORMATS = ("auto", "yolov8", "yolov5", "nms", "pair")
BOX_FORMATS = ("xyxy", "cxcywh")  # a pair's boxes: corners, or centre and size
LOW_CONF = 0.001  # what a validation run keeps for its AP
IOU_THRESHOLDS = np.linspace(0.5, 0.95, 10)  # COCO's mAP@0.5:0.95
RECENT = 4  # batches whose detections are kept: the build's at two thresholds, the reference's


class Detection:
    """Per-image F1 of the build's detections against the reference's (extra: per-image AP)."""

    def __init__(self, format: str = "auto", conf: float = 0.25, iou: float = 0.45, match_iou: float = 0.5,
                 agnostic: bool = False, max_det: int = 300, low_conf: float = LOW_CONF, box_format: str = "xyxy"):
        if format not in FORMATS:
            raise ValueError(f"metric.format={format!r}: one of {', '.join(FORMATS)}")
        if box_format not in BOX_FORMATS:
            raise ValueError(f"metric.box_format={box_format!r}: one of {', '.join(BOX_FORMATS)} (a pair's boxes)")
        for name, value in (("conf", conf), ("iou", iou), ("match_iou", match_iou), ("low_conf", low_conf)):
            if not 0.0 <= float(value) <= 1.0:
                raise ValueError(f"metric.{name}={value!r}: a number in [0, 1]")
        if isinstance(max_det, bool) or not isinstance(max_det, int) or max_det < 1:
            raise ValueError(f"metric.max_det={max_det!r}: an integer >= 1")
        self.format, self.conf, self.iou, self.match_iou = format, float(conf), float(iou), float(match_iou)
        self.agnostic, self.max_det, self.low_conf = bool(agnostic), max_det, float(low_conf)
        self.box_format = box_format
        self._recent: List[tuple] = []  # (batch, conf, detections), newest first

    def __call__(self, outputs: np.ndarray, reference: np.ndarray, labels: Optional[Sequence]) -> np.ndarray:
        return np.array([f1(mine, theirs, self.match_iou) for mine, theirs in
                         zip(self.detections(outputs, self.conf), self.detections(reference, self.conf))])

    def extras(self, outputs: np.ndarray, reference: np.ndarray, labels: Optional[Sequence]) -> Dict[str, np.ndarray]:
        key = f"ap{round(100 * self.match_iou)}"
        return {key: np.array([average_precision(mine, theirs, self.match_iou) for mine, theirs in
                               zip(self.detections(outputs, self.low_conf), self.detections(reference, self.conf))])}

    def records(self, outputs: np.ndarray, reference: np.ndarray, labels: Optional[Sequence]) -> list:
        """Per image what the set's mAP counts (``LabelRecord``): the build's detections down
        to ``low_conf`` matched at COCO's 10 IoU thresholds against the labels, or without
        labels against the reference's detections at ``conf`` (what the app shows)."""
        found = self.detections(outputs, self.low_conf)
        if labels is None:
            return [label_record(mine, theirs, REFERENCE)
                    for mine, theirs in zip(found, self.detections(reference, self.conf))]
        return [label_record(mine, _label_boxes(label)) for mine, label in zip(found, labels)]

    @staticmethod
    def set_extras(records: Sequence["LabelRecord"]) -> Dict[str, float]:
        """mAP@0.5 and mAP@0.5:0.95 over every image's detections against the labels
        (``map50_labels``, ...), or against the reference's (``map50_reference``, ...; the
        reference scores 1); none where no image has a box to find."""
        per_threshold = dataset_ap(records)
        if per_threshold is None:
            return {}
        against = records[0].against
        return {f"map50_{against}": float(per_threshold[0]), f"map50_95_{against}": float(np.mean(per_threshold))}

    def detections(self, outputs: np.ndarray, conf: float) -> List[np.ndarray]:
        """``detect`` on each image of a batch; the last few batches' kept, as the score,
        the extras and the records of one batch (and the reference's, for every build)
        decode the same arrays."""
        for batch, threshold, found in self._recent:
            if batch is outputs and threshold == conf:
                return found
        found = [self.detect(head, conf) for head in images(outputs)]
        self._recent = [(outputs, conf, found), *self._recent[:RECENT - 1]]
        return found

    def decode(self, output) -> str:
        """One image's detections at ``conf`` as JSON (what ``parity-bundle run`` prints)."""
        rows = self.detect(output, self.conf)
        return json.dumps([{"box": [round(float(v), 2) for v in row[:4]], "score": round(float(row[4]), 4),
                            "class": int(row[5])} for row in rows])

    def detect(self, head, conf: float) -> np.ndarray:
        """One image's detections: rows x0, y0, x1, y1, score, class after NMS, best first.
        ``head``: the output, or a pair's (boxes, scores)."""
        kind = self.kind_of(head)
        rows = decode_pair(*head, self.box_format) if kind == "pair" else decode(_table(head), kind)
        rows = rows[rows[:, 4] >= conf]
        if kind != "nms":
            rows = nms(rows, self.iou, self.agnostic)
        return rows[: self.max_det]

    def kind_of(self, head) -> str:
        """One image's head format: ``format``, or recognised from the shape (two arrays: a pair)."""
        shape = head_shape(head)
        kind = self.format if self.format != "auto" else recognise(shape)
        if kind == "pair":
            return _pair_kind(shape)
        if is_pair(head):
            raise ValueError(f"metric.format={kind} takes one output, but the metric was given two "
                             f"({', '.join(str(list(s)) for s in shape)}); a box and score pair: metric.format=pair")
        return kind

    def describe(self, shape) -> str:
        """The head's format on one image's output shape (a pair's: the two shapes), and whether
        metric.format gave it or its shape told it: TaskScorer reports it as the task's ``format``."""
        kind = self.format if self.format != "auto" else recognise(shape)
        how = "given" if self.format != "auto" else "recognised from the shape"
        pair = bool(len(shape)) and not isinstance(shape[0], (int, np.integer))
        shapes = " and ".join(str([int(d) for d in part]) for part in shape) if pair else str([int(d) for d in shape])
        return f"{kind} head ({how}{'s' if pair and how != 'given' else ''}: {shapes})"


def images(outputs) -> list:
    """Each image's head of a batch: the outputs stacked [N, ...], or a pair of them
    (boxes [N, ...], scores [N, ...]) as one (boxes, scores) per image."""
    if is_pair(outputs):
        if len(outputs) != 2:
            raise ValueError(f"a detector's outputs are one array or a pair (boxes, scores), not {len(outputs)}")
        return list(zip(*outputs))
    return list(outputs)


def is_pair(head) -> bool:
    return isinstance(head, (tuple, list))


def head_shape(head) -> tuple:
    """One image's output shape; a pair's: the two arrays' shapes."""
    if is_pair(head):
        return tuple(tuple(np.shape(part)) for part in head)
    return tuple(np.shape(head))


def _table(head) -> np.ndarray:
    head = np.asarray(head)
    return head.reshape(head.shape[-2:]) if head.ndim > 2 else head  # a leading batch of 1


def recognise(shape) -> str:
    """A head's format from one image's output shape (its leading batch of 1 dropped), or
    from two outputs' shapes (a pair)."""
    if len(shape) and not isinstance(shape[0], (int, np.integer)):
        return _pair_kind(shape)
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


def _pair_kind(shapes) -> str:
    """"pair" where the two shapes are boxes [1, N, 4] and scores [1, N, C], in that order."""
    two = len(shapes) == 2 and not any(isinstance(s, (int, np.integer)) for s in shapes)
    if two:
        boxes, scores = (_last_two(shape) for shape in shapes)
        if boxes and scores and boxes[1] == 4 and boxes[0] == scores[0]:
            return "pair"
    given = (f"outputs of shapes {list(shapes[0])} and {list(shapes[1])}" if two
             else f"one output of shape {list(shapes)}")
    raise ValueError(f"{given}: metric.format=pair takes two outputs, boxes [1, N, 4] and scores [1, N, C], "
                     "named in that order by metric.output")


def _last_two(shape) -> Optional[List[int]]:
    dims = [int(d) for d in shape]
    return dims[-2:] if len(dims) >= 2 and all(d == 1 for d in dims[:-2]) else None


def decode_pair(boxes: np.ndarray, scores: np.ndarray, box_format: str = "xyxy") -> np.ndarray:
    """Rows x0, y0, x1, y1, score, class of a box and score pair (SSD, RetinaNet): boxes
    [1, N, 4] (``box_format`` xyxy: corners; cxcywh: centre and size), scores [1, N, C], each
    box's class its best score's."""
    corners = np.asarray(boxes, dtype=np.float32).reshape(-1, 4)
    table = np.asarray(scores, dtype=np.float32).reshape(len(corners), -1)
    if box_format == "cxcywh":
        centre, size = corners[:, :2], corners[:, 2:]
        corners = np.column_stack([centre - size / 2, centre + size / 2])
    classes = table.argmax(axis=1)
    best = table[np.arange(len(table)), classes]
    return np.column_stack([corners, best, classes]).astype(np.float32)


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


def pairwise_iou(found: np.ndarray, expected: np.ndarray) -> np.ndarray:
    """[len(found), len(expected)] IoUs, -1 where the classes differ."""
    one, many = found[:, np.newaxis, :], expected[np.newaxis, :, :]
    width = np.clip(np.minimum(one[..., 2], many[..., 2]) - np.maximum(one[..., 0], many[..., 0]), 0, None)
    height = np.clip(np.minimum(one[..., 3], many[..., 3]) - np.maximum(one[..., 1], many[..., 1]), 0, None)
    inter = width * height
    area = (one[..., 2] - one[..., 0]) * (one[..., 3] - one[..., 1])
    areas = (many[..., 2] - many[..., 0]) * (many[..., 3] - many[..., 1])
    overlap = inter / np.maximum(area + areas - inter, 1e-9)
    return np.where(one[..., 5] == many[..., 5], overlap, -1.0)


def match_table(found: np.ndarray, expected: np.ndarray, thresholds: Sequence[float]) -> np.ndarray:
    """[len(found), len(thresholds)]: at each IoU threshold, whether each of ``found`` (best
    first) matches a not yet matched box of ``expected`` of its class at IoU >= the
    threshold, the best-overlapping one (COCO's matching, per image)."""
    hits = np.zeros((len(found), len(thresholds)), bool)
    if not len(found) or not len(expected):
        return hits
    overlaps = pairwise_iou(found, expected)
    for column, threshold in enumerate(thresholds):
        taken = np.zeros(len(expected), bool)
        for index in np.flatnonzero(overlaps.max(axis=1) >= threshold):  # a box overlapping none matches nothing
            overlap = np.where(taken, -1.0, overlaps[index])
            best = int(np.argmax(overlap))
            if overlap[best] >= threshold:
                taken[best], hits[index, column] = True, True
    return hits


def matches(found: np.ndarray, expected: np.ndarray, match_iou: float) -> np.ndarray:
    """For each of ``found`` (best first), whether it matches a not yet matched box of
    ``expected`` of its class at IoU >= match_iou (the best-overlapping one)."""
    return match_table(found, expected, [match_iou])[:, 0]


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


class LabelRecord(NamedTuple):
    """One image's detections against its labels: their scores and classes, and whether each
    matched a label box at each of IOU_THRESHOLDS ([D, 10]); the labels' classes."""

    scores: np.ndarray
    classes: np.ndarray
    hits: np.ndarray
    labelled: np.ndarray
    against: str = "labels"  # or REFERENCE: the reference's detections stand for the labels


REFERENCE = "reference"


def label_record(found: np.ndarray, labels: np.ndarray, against: str = "labels") -> LabelRecord:
    ranked = found[np.argsort(-found[:, 4], kind="stable")]
    return LabelRecord(ranked[:, 4], ranked[:, 5], match_table(ranked, labels, IOU_THRESHOLDS), labels[:, 5], against)


def dataset_ap(records: Sequence[LabelRecord]) -> Optional[np.ndarray]:
    """AP at each of IOU_THRESHOLDS over the whole set (COCO's way: every image's detections
    of a class ranked together, ``ranked_ap`` against the class's label boxes), averaged
    over the classes that have label boxes; None where no image has one."""
    labelled = np.concatenate([record.labelled for record in records]) if records else np.zeros(0)
    if not len(labelled):
        return None
    scores, classes = (np.concatenate([getattr(r, key) for r in records]) for key in ("scores", "classes"))
    hits = np.concatenate([record.hits for record in records]).reshape(-1, len(IOU_THRESHOLDS))
    order = np.argsort(-scores, kind="stable")  # ties keep the images' order, as pycocotools' mergesort
    per_class = []
    for kind in np.unique(labelled):
        ranked = order[classes[order] == kind]
        expected = int(np.sum(labelled == kind))
        per_class.append([ranked_ap(hits[ranked, column], expected) for column in range(len(IOU_THRESHOLDS))])
    return np.mean(per_class, axis=0)


def _label_boxes(label) -> np.ndarray:
    """One image's label boxes ([K, 6], pipeline/data/boxes.py), or a one-line error."""
    boxes = np.asarray(label, dtype=np.float32) if isinstance(label, np.ndarray) else None
    if boxes is None or boxes.ndim != 2 or boxes.shape[1] != 6:
        raise ValueError(f"label {label!r} is not a list of boxes: detection labels come as YOLO txt files or a "
                         "COCO json (data.labels, docs/metrics.md), not labels.csv")
    return boxes
