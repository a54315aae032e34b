"""Real photos for the salient-object segmenter (pipeline/assets/segmenter.onnx, trained
by scripts/train_segmenter.py): square crops of the photos that ship inside scikit-image's
wheel. Only files bundled in the wheel are read (never a pooch download), so tests,
benchmarks and the training script get the same pictures offline. For metric=map_iou the
fp32 reference's map is the truth: no labels are written."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator, List

import numpy as np
from PIL import Image

MODEL = Path(__file__).resolve().parent.parent / "pipeline" / "assets" / "segmenter.onnx"
FUSED_OUTPUT = "162"  # the fused map: the first output (scripts/train_segmenter.py prints it); 163-166 are the side maps
# The real-size stand-in (issue 55): U^2-Net-p's architecture, 119 convolutions at 320x320, 7 sigmoid maps
# (scripts/train_u2netp.py). For benchmarks and one shared test job; the 96x96 model above for unit tests.
REAL_MODEL = Path(__file__).resolve().parent / "assets" / "u2netp_320.onnx"
REAL_FUSED_OUTPUT = "1204"  # the fused map, the first output; 1205-1210 are the side maps
REAL_SIZE = 320
MEAN = (0.485, 0.456, 0.406)  # ImageNet normalization the model was trained with
STD = (0.229, 0.224, 0.225)
# Photos in scikit-image's wheel (skimage/data/), colour first; the grayscale ones (camera,
# coins) are replicated to RGB. Read as files, so no loader can fall back to a download.
PHOTOS = ("astronaut.png", "chelsea.png", "coffee.png", "rocket.jpg", "retina.jpg", "ihc.png", "camera.png",
          "coins.png")
CALIBRATION_SEED, VALIDATION_SEED = 1, 2  # the training script draws with other seeds


def photos() -> List[np.ndarray]:
    """The bundled photos as uint8 RGB arrays, in PHOTOS order."""
    import skimage.data

    folder = Path(skimage.data.__file__).parent
    found = []
    for name in PHOTOS:
        with Image.open(folder / name) as image:
            found.append(np.asarray(image.convert("RGB")))
    return found


def crops(images: List[np.ndarray], count: int, seed: int, size: int = 96) -> Iterator[np.ndarray]:
    """`count` square crops, size x size uint8 RGB: sample i comes from photo i mod len,
    at a random scale (45 to 100 % of the short side) and place, resized with PIL."""
    rng = np.random.default_rng(seed)
    for index in range(count):
        image = images[index % len(images)]
        height, width = image.shape[:2]
        side = int(rng.uniform(0.45, 1.0) * min(height, width))
        top, left = rng.integers(0, height - side + 1), rng.integers(0, width - side + 1)
        patch = Image.fromarray(image[top:top + side, left:left + side])
        yield np.asarray(patch.resize((size, size), Image.LANCZOS))


def write_photos(folder: Path, calibration: int = 8, validation: int = 24, size: int = 96) -> Path:
    """`folder`/calibration/ and validation/ with PNG crops (data.kind=images); the two
    splits are drawn with different seeds and share no crop. Returns `folder`."""
    folder = Path(folder)
    images = photos()
    drawn = {"calibration": list(crops(images, calibration, CALIBRATION_SEED, size)),
             "validation": list(crops(images, validation, VALIDATION_SEED, size))}
    seen = {crop.tobytes() for crop in drawn["calibration"]}
    assert not any(crop.tobytes() in seen for crop in drawn["validation"]), "a crop is in both splits"
    for split, samples in drawn.items():
        (folder / split).mkdir(parents=True, exist_ok=True)
        for index, crop in enumerate(samples):
            Image.fromarray(crop).save(folder / split / f"{Path(PHOTOS[index % len(PHOTOS)]).stem}_{index:03d}.png")
    return folder
