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
    # no labels: the reference's detections stand for them (the reference against itself: 1)
    assert metric.set_extras(metric.records(PERFECT, PERFECT, None)) == {"map50_reference": 1.0,
                                                                         "map50_95_reference": 1.0}
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
    assert set(unlabeled["extras"]) == {"ap50", "map50_reference", "map50_95_reference"} and not unlabeled["labeled"]
    assert unlabeled["target"] == labeled["target"] and unlabeled["extras"]["ap50"] == labeled["extras"]["ap50"]
    # without labels the set's mAP is the build's against the reference's detections (which score 1)
    assert unlabeled["extras"]["map50_reference"]["reference"] == 1.0
    assert 0.0 < unlabeled["extras"]["map50_reference"]["target"] < 1.0
    assert unlabeled["extras"]["map50_95_reference"]["target"] <= unlabeled["extras"]["map50_reference"]["target"]


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


def test_the_head_format_is_described_as_given_or_recognised():
    """What TaskScorer reports as the task's ``format``: the head, and how parity knows it."""
    assert Detection().describe((1, 7, 2100)) == "yolov8 head (recognised from the shape: [1, 7, 2100])"
    assert Detection().describe(((1, 4, 4), (1, 4, 2))) == "pair head (recognised from the shapes: [1, 4, 4] and [1, 4, 2])"
    assert Detection(format="pair").describe(((1, 4, 4), (1, 4, 2))) == "pair head (given: [1, 4, 4] and [1, 4, 2])"


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


@pytest.mark.parametrize("overrides, says", [
    (["metric.format=pair"], "metric.format=pair reads two outputs, boxes \\[1, N, 4\\] then scores \\[1, N, C\\], "
                             "and metric.output names none"),
    (["metric.format=pair", "metric.output=boxes"], "and metric.output names one, 'boxes'"),
    (["metric.format=yolov8", "metric.output=[boxes,scores]"], "metric detection_f1 reads one output"),
    (["metric.output=[boxes,scores]"], "the model has no output 'boxes'; outputs: "),  # the digits model's
])
def test_a_pair_config_that_cannot_be_scored_stops_at_validation_in_one_line(overrides, says):
    from conftest import composed
    from pipeline.config import validation
    from pipeline.errors import ConfigError

    with pytest.raises(ConfigError, match=says):
        validation.validate(composed("metric=detection", *overrides))
    with pytest.raises(ConfigError, match="metric top1 reads one output; two \\(boxes, then scores\\) are for"):
        validation.validate(composed("metric=top1", "metric.output=[boxes,scores]"))


def test_the_mixed_search_scores_a_pair_from_both_outputs():
    """sensitivity's TaskDrop reads the two outputs metric.output names, wherever they are
    among the graph's outputs, and gives the F1's drop of a build that moves one image's box."""
    from conftest import composed
    from stages.sensitivity import TaskDrop

    cfg = composed("metric=detection", "metric.format=pair", "metric.output=[boxes,scores]")
    boxes = np.concatenate([PAIR_BOXES, PAIR_BOXES + 200])  # 2 samples on axis 0, as the search runs them
    scores = np.concatenate([PAIR_SCORES, PAIR_SCORES])
    other = np.zeros((2, 5), np.float32)
    drop = TaskDrop(cfg, ["other", "scores", "boxes"], [other, scores, boxes], None, 2)
    assert drop.indices == (2, 1) and drop.reference_value == 1.0
    assert drop([other, scores, boxes]) == 0.0
    moved = boxes.copy()
    moved[1, :2] += 60  # image 2's class-0 box moved away: its F1 1/2, the mean 3/4
    assert drop([other, scores, moved]) == pytest.approx(0.25)


# --- a pair detector through parity and parity-bundle, as a user runs them -----------------

CELL, GRID, CLASSES = 4, 8, 3  # a 32x32 input, one anchor a 4-pixel cell


def _ssd_like(path) -> None:
    """A tiny SSD-like detector, fixed weights: boxes [1, 64, 4] (a 24-pixel anchor per cell,
    moved a little by a 1x1 conv of the features: a square's cells overlap, NMS keeps one) and sigmoid class scores [1, 64, 3] (a cell's mean
    colour: class c where colour plane c is bright and the others dark)."""
    from onnx import TensorProto, helper, numpy_helper, save

    rng = np.random.default_rng(0)
    features = np.zeros((8, 3, 3, 3), np.float32)
    features[[0, 1, 2], [0, 1, 2], 1, 1] = 1.0  # the colour planes as they are, then five textures
    features[3:] = rng.normal(0, 0.2, (5, 3, 3, 3))
    classes = np.zeros((CLASSES, 8, 1, 1), np.float32)
    classes[:, :3] = -4.0
    classes[[0, 1, 2], [0, 1, 2]] = 12.0
    centres = (np.arange(GRID) + 0.5) * CELL
    y, x = np.meshgrid(centres, centres, indexing="ij")
    anchors = np.stack([x - 12, y - 12, x + 12, y + 12], axis=-1).reshape(1, GRID * GRID, 4)
    weights = {"w_features": features, "b_features": np.zeros(8), "w_classes": classes,
               "b_classes": np.full(CLASSES, -6.0), "w_boxes": rng.normal(0, 0.1, (4, 8, 1, 1)),
               "b_boxes": np.zeros(4), "anchors": anchors, "step": np.array(2.0),
               "to_scores": np.array([1, CLASSES, GRID * GRID]), "to_boxes": np.array([1, 4, GRID * GRID])}
    node = helper.make_node
    nodes = [node("Conv", ["images", "w_features", "b_features"], ["c"], pads=[1, 1, 1, 1]),
             node("Relu", ["c"], ["r"]), node("AveragePool", ["r"], ["cells"], kernel_shape=[CELL, CELL],
                                              strides=[CELL, CELL]),
             node("Conv", ["cells", "w_classes", "b_classes"], ["logits"]), node("Sigmoid", ["logits"], ["s"]),
             node("Reshape", ["s", "to_scores"], ["s2"]), node("Transpose", ["s2"], ["scores"], perm=[0, 2, 1]),
             node("Conv", ["cells", "w_boxes", "b_boxes"], ["d"]), node("Reshape", ["d", "to_boxes"], ["d2"]),
             node("Transpose", ["d2"], ["d3"], perm=[0, 2, 1]), node("Mul", ["d3", "step"], ["d4"]),
             node("Add", ["anchors", "d4"], ["boxes"])]
    initializers = [numpy_helper.from_array(np.asarray(value, np.int64 if name.startswith("to_") else np.float32), name)
                    for name, value in weights.items()]
    size = CELL * GRID
    graph = helper.make_graph(nodes, "ssd_like", [helper.make_tensor_value_info("images", TensorProto.FLOAT,
                                                                                [1, 3, size, size])],
                              [helper.make_tensor_value_info("boxes", TensorProto.FLOAT, [1, GRID * GRID, 4]),
                               helper.make_tensor_value_info("scores", TensorProto.FLOAT, [1, GRID * GRID, CLASSES])],
                              initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], producer_name="parity-tests")
    model.ir_version = 8
    save(model, str(path))


def _scenes(count: int, seed: int):
    """Images [count, 3, 32, 32] of dark noise with one to three 8x8 squares on the cell grid,
    each bright in one colour plane, its class (a class a square: class-wise NMS keeps one
    box each); and each image's classes."""
    rng = np.random.default_rng(seed)
    images = rng.uniform(0.0, 0.15, (count, 3, CELL * GRID, CELL * GRID)).astype(np.float32)
    blocks = GRID // 2  # 2x2 cells a square
    kinds = []
    for image in images:
        chosen = rng.permutation(CLASSES)[:int(rng.integers(1, CLASSES + 1))]
        for kind, block in zip(chosen, rng.choice(blocks * blocks, size=len(chosen), replace=False)):
            y, x = block // blocks * 2 * CELL, block % blocks * 2 * CELL
            image[kind, y:y + 2 * CELL, x:x + 2 * CELL] = 0.9
        kinds.append(sorted(int(kind) for kind in chosen))
    return images, kinds


@pytest.fixture(scope="module")
def pair_job(tmp_path_factory):
    from conftest import run_cli, run_dirs

    cwd = tmp_path_factory.mktemp("pair")
    _ssd_like(cwd / "ssd.onnx")
    np.savez(cwd / "scenes.npz", **{"calibration/images": _scenes(8, 1)[0], "validation/images": _scenes(12, 2)[0]})
    result = run_cli([f"model.path={cwd / 'ssd.onnx'}", "data.kind=tensors", f"data.path={cwd / 'scenes.npz'}",
                      "metric=detection", "metric.format=pair", "metric.output=[boxes,scores]", "precision=int8",
                      "target.threads=2"], cwd)
    return cwd, result, run_dirs(cwd)[-1]


def test_a_pair_detector_is_verified_on_both_outputs(pair_job):
    """metric.output=[boxes,scores] through parity: the reference, the int8 build and the fp32
    build beside it are scored on both outputs, the F1 against the reference's boxes; both
    outputs are the task's (their cosine a floor); the head's format is in the report."""
    from conftest import read_report, single_bundle

    _, result, run_dir = pair_job
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    verify = read_report(run_dir)["verify"]
    task = verify["task"]
    assert (task["metric"], task["output"], task["outputs"]) == ("detection_f1", "boxes, scores", ["boxes", "scores"])
    assert task["format"] == "pair head (given: [1, 64, 4] and [1, 64, 3])", task
    assert task["samples"] == 12 and task["reference"] == 1.0 and task["target"] >= 0.95, task
    assert "ap50" in task["extras"] and verify["comparison"]["fp32"]["task_metric"] == 1.0, verify["comparison"]
    assert {o["name"]: o["cosine_gate"] for o in verify["outputs"]} == {"boxes": "task_min_cosine",
                                                                        "scores": "task_min_cosine"}
    assert "boxes, scores" in result.stdout and "detection_f1" in result.stdout
    import yaml

    recorded = yaml.safe_load((single_bundle(run_dir) / "runtime.yaml").read_text())["metric"]
    assert (recorded["format"], recorded["output"]) == ("pair", ["boxes", "scores"])


def test_a_pair_detector_bundle_prints_its_detections_as_json(pair_job, tmp_path):
    """parity-bundle run decodes the two outputs together: one JSON list of boxes, scores and
    classes, on this image one box of each square's class."""
    import json

    from conftest import run_cli, single_bundle

    _, _, run_dir = pair_job
    images, kinds = _scenes(12, 2)
    np.save(tmp_path / "scene.npy", images[:1])
    result = run_cli(["run", str(single_bundle(run_dir)), str(tmp_path / "scene.npy")], tmp_path,
                     program="parity-bundle")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "boxes: shape [1, 64, 4]" in result.stdout and "scores: shape [1, 64, 3]" in result.stdout
    line = next(line for line in result.stdout.splitlines()
                if line.startswith("decoded boxes, scores (detection_f1): "))
    found = json.loads(line.split("): ", 1)[1])
    assert all(set(row) == {"box", "score", "class"} and row["score"] >= 0.25 for row in found), found
    assert sorted(row["class"] for row in found) == kinds[0], (found, kinds[0])
