"""Train the YOLOv8n-architecture detector and write ``tests/assets/yolov8n_320.onnx``.

Why: issue 56. Detectors are the models deployed most, and parity had never seen one. The
network is built by the ``ultralytics`` package from its own architecture file
(``yolov8n.yaml``, 3 classes here: no weights downloaded), trained briefly on synthetic
photos (coloured discs, squares and triangles pasted on crops of scikit-image's photos,
tests/detector_data.py) so that its scores are those of a trained detector, then exported
by the trainer's own ONNX exporter, opset 17, with dynamic axes (input [batch, 3, height,
width], served at [1, 3, 320, 320]): one raw head output ``output0`` [1, 4+3, 2100] at 320
(box centre and size in input pixels, then the class scores after their sigmoid, joined by
one Concat), the anchor grid built at run time from Shape/Range/Expand, the DFL decode in
the graph, no NMS.

``ultralytics`` is AGPL: a script-time dependency (``pip install ultralytics``), never
imported by parity. Everything runs offline: settings sync off, no plots (they fetch a
font), no AMP check (it fetches weights), no ONNX simplifier (it pip-installs one).

Trained at 160x160 (the shapes are 12-40 % of the side at any size; a fully convolutional
network at a quarter of the pixels trains 4x faster), exported at 320x320. Deterministic
seeds; about 10 minutes on 2 CPU cores.

Run, in a venv of its own (ultralytics needs a torchvision built for its torch; the index here
has no CPU torchvision for parity's torch 2.13.0+cpu), which is what ``.[yolo]`` lists:
    python -m venv /tmp/yolo && /tmp/yolo/bin/pip install ultralytics==8.4.190 onnx scikit-image
    /tmp/yolo/bin/python scripts/train_yolo.py
(as it was made: ultralytics 8.4.190 with torch 2.14.1 and torchvision 0.29.1).
"""
import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("YOLO_OFFLINE", "1")
os.environ.setdefault("YOLO_VERBOSE", "False")

from PIL import Image  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
import detector_data  # noqa: E402

TRAIN_SEED, VAL_SEED = 41, 42


def write_split(folder: Path, count: int, seed: int, size: int) -> None:
    """YOLO's layout: images/<name>.png and labels/<name>.txt (class cx cy w h, 0..1)."""
    (folder / "images").mkdir(parents=True)
    (folder / "labels").mkdir(parents=True)
    for index, (image, boxes) in enumerate(detector_data.scenes(count, seed, size)):
        Image.fromarray(image).save(folder / "images" / f"{index:04d}.png")
        lines = [f"{kind} {(x0 + x1) / 2 / size:.6f} {(y0 + y1) / 2 / size:.6f} {(x1 - x0) / size:.6f} "
                 f"{(y1 - y0) / size:.6f}" for kind, x0, y0, x1, y1 in boxes]
        (folder / "labels" / f"{index:04d}.txt").write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=200)
    parser.add_argument("--epochs", type=int, default=60)
    parser.add_argument("--train-size", type=int, default=160, help="trained at this size, exported at 320")
    parser.add_argument("--out", type=Path, default=detector_data.DETECTOR)
    args = parser.parse_args()

    from ultralytics import YOLO, settings

    settings.update({"sync": False})
    work = Path(tempfile.mkdtemp(prefix="parity-yolo-"))
    try:
        write_split(work / "train", args.images, TRAIN_SEED, args.train_size)
        write_split(work / "val", 40, VAL_SEED, args.train_size)
        names = "\n".join(f"  {i}: {name}" for i, name in enumerate(detector_data.CLASSES))
        (work / "data.yaml").write_text(f"path: {work}\ntrain: train/images\nval: val/images\nnames:\n{names}\n")
        started = time.time()
        model = YOLO("yolov8n.yaml")  # the architecture alone, built offline
        model.train(data=str(work / "data.yaml"), epochs=args.epochs, imgsz=args.train_size, batch=16,
                    device="cpu", workers=0, seed=0, deterministic=True, plots=False, amp=False, val=True,
                    project=str(work / "runs"), name="train", exist_ok=True, verbose=False)
        print(f"trained in {time.time() - started:.0f} s")
        metrics = model.val(data=str(work / "data.yaml"), imgsz=args.train_size, device="cpu", plots=False,
                            verbose=False)
        print(f"held-out mAP@0.5 {metrics.box.map50:.3f}, mAP@0.5:0.95 {metrics.box.map:.3f}")
        exported = Path(model.export(format="onnx", imgsz=detector_data.SIZE, opset=17, simplify=False,
                                     dynamic=True, device="cpu"))
        args.out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(exported, args.out)
        print(f"wrote {args.out} ({args.out.stat().st_size / 2**20:.1f} MiB)")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
