"""Images of rendered text lines, upright (class 0) or rotated 180 degrees (class 1):
real inputs with known labels for the PP-OCR text-direction classifier. Every image of a
dataset is a different (word, font size, font) line: no image repeats within a split or
across the calibration and validation splits."""

from __future__ import annotations

import importlib.resources
import os
import random
from pathlib import Path
from typing import Optional

import numpy as np
from PIL import Image, ImageDraw, ImageFont

FONT = Path("/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf")  # Debian fonts-dejavu-core
# Tests that render text lines skip without the fonts, except in CI (.ci/run installs them),
# where a missing font must fail the run rather than hide the tests.
NEEDS_FONTS_SKIPPED = not FONT.exists() and not os.environ.get("CI")
FONTS = tuple(FONT.parent / name for name in (  # every face fonts-dejavu-core installs
    "DejaVuSans.ttf", "DejaVuSans-Bold.ttf", "DejaVuSansMono.ttf", "DejaVuSansMono-Bold.ttf",
    "DejaVuSerif.ttf", "DejaVuSerif-Bold.ttf"))
SIZES = range(26, 35)
WORDS = ("parity deploy model runtime verify bundle vulkan tensor layer accuracy "
         "Quick brown fox jumps over lazy dog 2026 ONNX OpenVINO calibration").split()


def write_split(folder: Path, styles) -> None:
    """One PNG text line per (word, size, font) in ``styles``, in `folder` with a
    labels.csv; every second one rotated."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    for index, (text, size, font) in enumerate(styles):
        image = render(text, size, font)
        label = index % 2
        if label:
            image = image.rotate(180)
        name = f"{index:03d}.png"
        image.save(folder / name)
        rows.append(f"{name},{label}")
    (folder / "labels.csv").write_text("sample,label\n" + "\n".join(rows) + "\n")


def render(text: str, size: int, font: Path = FONT) -> Image.Image:
    face = ImageFont.truetype(str(font), size)
    left, top, right, bottom = face.getbbox(text)
    margin = size // 4
    image = Image.new("RGB", (right - left + 2 * margin, bottom - top + 2 * margin), "white")
    ImageDraw.Draw(image).text((margin - left, margin - top), text, font=face, fill="black")
    return image


def line_tensor(text: str, size: int, font: Path = FONT) -> np.ndarray:
    """One rendered line as the classifier's [1, 3, 48, 192] input (PP-OCR's normalization,
    resized to height 48, right-padded with zeros)."""
    image = render(text, size, font)
    width = min(192, int(np.ceil(48 * image.width / image.height)))
    pixels = np.asarray(image.resize((width, 48)), dtype=np.float32)
    tensor = np.zeros((1, 3, 48, 192), np.float32)
    tensor[0, :, :, :width] = ((pixels / 255.0 - 0.5) / 0.5).transpose(2, 0, 1)
    return tensor


def write_dataset(root: Path, calibration: int = 8, validation: int = 24, seed: int = 1) -> Path:
    """Calibration and validation splits of distinct lines (at most 1296 in all). Short
    words only: the model's 48x192 input fits aspect ratios up to 4."""
    styles = [(word, size, font) for word in WORDS for size in SIZES for font in FONTS]
    if calibration + validation > len(styles):
        raise ValueError(f"at most {len(styles)} distinct text lines")
    random.Random(seed).shuffle(styles)
    write_split(root / "calibration", styles[:calibration])
    write_split(root / "validation", styles[calibration:calibration + validation])
    return root


def write_ppocr_configs(root: Path, calibration: int, validation: int,
                        calibration_size: Optional[int] = None) -> Path:
    """A user config directory, ``root/conf``, for the PP-OCR text-direction classifier
    (``--config-dir root/conf model=ppocr_cls data=textlines``) and the rendered lines it
    names, in ``root/textlines`` (returned); the job calibrates on ``calibration_size`` of
    the ``calibration`` lines, all by default."""
    model = importlib.resources.files("rapidocr_onnxruntime") / "models" / "ch_ppocr_mobile_v2.0_cls_infer.onnx"
    used = calibration if calibration_size is None else calibration_size
    data = write_dataset(root / "textlines", calibration=calibration, validation=validation)
    for group in ("model", "data"):
        (root / "conf" / group).mkdir(parents=True)
    (root / "conf" / "model" / "ppocr_cls.yaml").write_text(
        f"path: {model}\nname: ppocr_cls\ninput_shapes:\n  x: [1, 3, 48, 192]\n")
    (root / "conf" / "data" / "textlines.yaml").write_text(
        f"kind: images\npath: {data}\ncalibration_size: {used}\nvalidation_size: {validation}\n"
        "preprocess:\n  keep_aspect: true\n  color: bgr\n  mean: [0.5]\n  std: [0.5]\n  pad_value: 0.0\n")
    return data
