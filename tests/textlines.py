"""Images of rendered text lines, upright (class 0) or rotated 180 degrees (class 1):
real inputs with known labels for the PP-OCR text-direction classifier."""

from __future__ import annotations

import random
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

FONT = Path("/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf")  # Debian fonts-dejavu-core
WORDS = ("parity deploy model runtime verify bundle vulkan tensor layer accuracy "
         "Quick brown fox jumps over lazy dog 2026 ONNX OpenVINO calibration").split()


def write_split(folder: Path, count: int, seed: int) -> None:
    """`count` PNG text lines in `folder` with a labels.csv, half of them rotated."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    rows = []
    for index in range(count):
        text = rng.choice(WORDS)  # short lines: the model's 48x192 input fits aspect ratios up to 4
        image = render(text, size=rng.randint(26, 34))
        label = index % 2
        if label:
            image = image.rotate(180)
        name = f"{index:03d}.png"
        image.save(folder / name)
        rows.append(f"{name},{label}")
    (folder / "labels.csv").write_text("sample,label\n" + "\n".join(rows) + "\n")


def render(text: str, size: int) -> Image.Image:
    font = ImageFont.truetype(str(FONT), size)
    left, top, right, bottom = font.getbbox(text)
    margin = size // 4
    image = Image.new("RGB", (right - left + 2 * margin, bottom - top + 2 * margin), "white")
    ImageDraw.Draw(image).text((margin - left, margin - top), text, font=font, fill="black")
    return image


def write_dataset(root: Path, calibration: int = 8, validation: int = 24) -> Path:
    write_split(root / "calibration", calibration, seed=1)
    write_split(root / "validation", validation, seed=2)
    return root
