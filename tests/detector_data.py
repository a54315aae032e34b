"""Synthetic detection photos: coloured shapes pasted on crops of scikit-image's bundled
photos, with their boxes. What scripts/train_yolo.py trains the YOLOv8n-architecture
detector on (tests/assets/yolov8n_320.onnx) and what its tests and benchmark feed it.

Classes: 0 disc, 1 square, 2 triangle; 1 to 4 shapes a photo, 12 to 40 % of its side,
any colour, partly overlapping allowed."""

from __future__ import annotations

from pathlib import Path
from typing import List, Tuple

import numpy as np
from PIL import Image, ImageDraw

from segmenter_data import crops, photos

ROOT = Path(__file__).resolve().parent.parent
DETECTOR = ROOT / "tests" / "assets" / "yolov8n_320.onnx"
SIZE = 320
CLASSES = ("disc", "square", "triangle")
CALIBRATION_SEED, VALIDATION_SEED = 31, 32


def scene(background: np.ndarray, rng: np.random.Generator) -> Tuple[np.ndarray, List[Tuple[int, float, float, float, float]]]:
    """(an RGB uint8 photo with shapes, [(class, x0, y0, x1, y1) in pixels])."""
    size = background.shape[0]
    image = Image.fromarray(background.copy())
    draw = ImageDraw.Draw(image)
    boxes = []
    for _ in range(int(rng.integers(1, 5))):
        kind = int(rng.integers(0, len(CLASSES)))
        side = rng.uniform(0.12, 0.40) * size
        x0, y0 = rng.uniform(0, size - side), rng.uniform(0, size - side)
        x1, y1 = x0 + side, y0 + side * (rng.uniform(0.7, 1.3) if kind != 0 else 1.0)
        y1 = min(y1, size - 1)
        colour = tuple(int(c) for c in rng.integers(0, 256, 3))
        if kind == 0:
            draw.ellipse([x0, y0, x1, y1], fill=colour)
        elif kind == 1:
            draw.rectangle([x0, y0, x1, y1], fill=colour)
        else:
            draw.polygon([((x0 + x1) / 2, y0), (x1, y1), (x0, y1)], fill=colour)
        boxes.append((kind, x0, y0, x1, y1))
    return np.asarray(image), boxes


def scenes(count: int, seed: int, size: int = SIZE):
    """``count`` (photo, boxes) pairs, deterministic for a seed."""
    rng = np.random.default_rng(seed + 1000)
    return [scene(background, rng) for background in crops(photos(), count, seed, size)]


def to_input(image: np.ndarray) -> np.ndarray:
    """What the exported detector takes: [1, 3, H, W] float32 RGB in 0..1."""
    return (image.astype(np.float32) / 255.0).transpose(2, 0, 1)[None]
