"""The real-size YOLOv8n-architecture detector (tests/assets/yolov8n_320.onnx, issue 56): its
run-time anchor grid, DFL decode and one Concat of pixel boxes and 0..1 scores go through
calibrate, build and verify with metric=detection, and the verdict judges the boxes. One
job on ort_cpu (int8, 8 calibration / 16 validation photos of tests/detector_data.py as PNGs, the
validation photos' boxes as YOLO labels)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from conftest import read_report, run_cli, run_dirs, single_bundle
from detector_data import CALIBRATION_SEED, DETECTOR, SIZE, VALIDATION_SEED, scenes, to_input


def _photos(folder, count: int, seed: int, labels: bool = False) -> None:
    """PNG photos (read as the exported detector takes them: RGB / 255, already 320x320) and,
    with ``labels``, their boxes as YOLO txt files in labels/."""
    from PIL import Image

    folder.mkdir(parents=True)
    if labels:
        (folder / "labels").mkdir()
    for index, (image, boxes) in enumerate(scenes(count, seed)):
        Image.fromarray(image).save(folder / f"photo{index:02d}.png")
        if labels:
            lines = [f"{kind} {(x0 + x1) / 2 / SIZE:.6f} {(y0 + y1) / 2 / SIZE:.6f} {(x1 - x0) / SIZE:.6f} "
                     f"{(y1 - y0) / SIZE:.6f}" for kind, x0, y0, x1, y1 in boxes]
            (folder / "labels" / f"photo{index:02d}.txt").write_text("\n".join(lines) + "\n")


@pytest.fixture(scope="module")
def detector_job(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("detector")
    _photos(cwd / "photos" / "calibration", 8, CALIBRATION_SEED)
    _photos(cwd / "photos" / "validation", 16, VALIDATION_SEED, labels=True)
    result = run_cli([f"model.path={DETECTOR}", "data.kind=images", f"data.path={cwd / 'photos'}",
                      "data.preprocess.resize=[320,320]", "metric=detection", "precision=int8", "target.threads=2"],
                     cwd, timeout=600)
    return result, run_dirs(cwd)[-1]


def test_the_asset_is_a_yolov8_head_with_run_time_anchors():
    model = onnx.load(str(DETECTOR))
    ops = {node.op_type for node in model.graph.node}
    assert {"Shape", "Range", "Expand", "Softmax", "Concat", "Split"} <= ops
    (output,) = model.graph.output
    assert output.name == "output0" and output.type.tensor_type.shape.dim[1].dim_value in (0, 7)


def test_a_detector_goes_through_every_stage_and_is_judged_by_its_boxes(detector_job):
    result, run_dir = detector_job
    assert result.returncode in (0, 3), result.stdout[-3000:] + result.stderr[-3000:]  # a verdict, no internal error
    report = read_report(run_dir)
    task = report["verify"]["task"]
    assert task["metric"] == "detection_f1" and 0.0 <= task["target"] <= 1.0 and task["reference"] == 1.0, task
    assert "ap50" in str(report["verify"]), "the per-image AP@0.5 extra is reported"
    # the photos' boxes as YOLO labels: the set's mAPs against them, fp32's beside the build's
    assert report["data"]["splits"]["validation"]["labeled"] and task["labeled"], report["data"]
    at50, at50_95 = task["extras"]["map50_labels"], task["extras"]["map50_95_labels"]
    assert 0.4 < at50["reference"] <= 1.0 and 0.0 < at50["target"] <= 1.0, task["extras"]  # fp32 0.61 on these 16
    assert all(at50_95[build] <= at50[build] for build in ("reference", "target")), task["extras"]
    assert [stage["stage"] for stage in report["stages"]][:4] == ["convert", "calibrate", "sensitivity", "build"]
    assert report["build"]["quantization"]["int8_ops"] > 50
    # every SiLU after a convolution runs int8 on ONNX Runtime; the decode's Sigmoid and Muls stay float
    assert report["build"]["quantization"]["swish"].startswith("quantized")
    model = onnx.load(str(single_bundle(run_dir) / "model.onnx"))
    producer = {out: node.op_type for node in model.graph.node for out in node.output}
    int8_sigmoids = [node.name for node in model.graph.node
                     if node.op_type == "Sigmoid" and producer.get(node.input[0]) == "DequantizeLinear"
                     and any(reader.op_type == "QuantizeLinear" for reader in model.graph.node
                             if node.output[0] in reader.input)]
    assert len(int8_sigmoids) == 57 and "/model.22/Sigmoid" not in int8_sigmoids, len(int8_sigmoids)
    # boxes in pixels beside scores in 0..1: each group of like rows judged apart, the worst gated
    (output,) = report["verify"]["outputs"]
    metrics = output["metrics"]
    assert [group["rows"] for group in metrics["row_groups"]] == ["0-3", "4-6"], metrics
    assert metrics["cosine"] == min(group["cosine"] for group in metrics["row_groups"]) <= metrics["whole_cosine"]
    # the bundle records the detection post-processing for parity-bundle run
    import yaml

    runtime = yaml.safe_load((single_bundle(run_dir) / "runtime.yaml").read_text())
    assert runtime["metric"]["_target_"].endswith("Detection") and runtime["metric"]["conf"] == 0.25


def test_the_detector_bundle_prints_its_detections_as_json(detector_job, tmp_path):
    """parity-bundle run decodes the head with the recorded post-processing: boxes, scores
    and classes as JSON beside the raw tensor's summary; on this photo, the shapes drawn."""
    import json

    _, run_dir = detector_job
    image, boxes = scenes(1, VALIDATION_SEED)[0]
    np.save(tmp_path / "photo.npy", to_input(image))
    result = run_cli(["run", str(single_bundle(run_dir)), str(tmp_path / "photo.npy")], tmp_path,
                     program="parity-bundle")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "output0: shape [1, 7, 2100]" in result.stdout
    line = next(line for line in result.stdout.splitlines() if line.startswith("decoded output0 (detection_f1): "))
    found = json.loads(line.split(": ", 1)[1])
    assert found and all(set(row) == {"box", "score", "class"} and row["score"] >= 0.25 for row in found)
    assert sorted(row["class"] for row in found) == sorted(kind for kind, *_ in boxes), (found, boxes)
