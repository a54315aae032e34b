"""Box labels for detectors (``metric=detection``): a YOLO txt per image or one COCO json,
read for the validation split and mapped into the model input's pixels.

- YOLO: a folder of ``<image stem>.txt`` files, one line a box, ``class cx cy w h``,
  normalised 0..1 to the image; an image without objects has an empty file.
- COCO: a json with ``images`` (``file_name``, ``width``, ``height``, ``id``) and
  ``annotations`` (``image_id``, ``bbox`` [x, y, width, height] in the image's pixels,
  ``category_id``); a category's class index is its place among the json's ``categories``
  sorted by id (COCO's 91 ids give the 80 classes a COCO-trained detector outputs; ids
  1..K give 0..K-1), or the id itself where there is no ``categories`` list. Crowd
  annotations (``iscrowd``) are left out.

A label is float32 rows x0, y0, x1, y1, 1, class ([K, 6]): the layout of the metric's
detections, a label box scoring 1. The boxes go through the image's resize as the reader
does it (``resized``: pipeline.data's image_size; the resized image sits at the top left of
the tensor, so a box only scales). This module imports nothing of ``pipeline.data``, which
passes ``resized`` in.
"""

from __future__ import annotations

import json
import math
from pathlib import Path, PurePosixPath
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from pipeline.errors import InputError

YOLO_FOLDER = "labels"  # a split folder's sub-folder found without data.labels set
YOLO_LINE = "'class cx cy w h' (5 numbers, the box normalised 0..1)"
Size = Tuple[int, int]  # (width, height)
Resized = Callable[[int, int], Size]  # an image's (height, width) -> (width, height) once resized


def names_boxes(path: Path) -> bool:
    """Whether ``data.labels`` names box labels: a folder (``.``: the split folder) or a ``.json``."""
    return path.suffix.lower() == ".json" or path.is_dir()


def box_source(folder: Path, name: str, search: bool) -> Optional[Tuple[str, Path]]:
    """("yolo", folder) or ("coco", file) where ``data.labels`` (``name``) names box labels;
    with ``search`` (data.labels at its default, images) and no such file, a ``labels/``
    sub-folder. None: a labels.csv, or nothing."""
    path = folder / name
    if path.suffix.lower() == ".json":
        if not path.is_file():
            raise InputError(f"data.labels: {path} does not exist (a COCO json of the validation images)")
        return "coco", path
    if path.is_dir():
        return "yolo", path
    if search and not path.exists() and (folder / YOLO_FOLDER).is_dir():
        return "yolo", folder / YOLO_FOLDER
    return None


def read_boxes(source: Tuple[str, Path], images: Sequence[Path],
               resized: Resized) -> Tuple[List[np.ndarray], List[Path]]:
    """(one [K, 6] label per image, in the input's pixels; the files read)."""
    kind, path = source
    sizes = _sizes(resized)
    if kind == "coco":
        return coco_boxes(path, images, sizes), [path]
    files = [path / f"{image.stem}.txt" for image in images]
    return [yolo_boxes(file, image, sizes) for file, image in zip(files, images)], files


def _sizes(resized: Resized) -> Callable[[Path], Tuple[Size, Size]]:
    """image -> (its (width, height), its (width, height) once resized), from its header."""
    from PIL import Image, UnidentifiedImageError

    def sizes(path: Path) -> Tuple[Size, Size]:
        try:
            with Image.open(path) as image:
                width, height = image.width, image.height
        except (UnidentifiedImageError, OSError) as err:
            raise InputError(f"data: {path} cannot be read as an image ({err})") from err
        return (width, height), resized(height, width)

    return sizes


def yolo_boxes(file: Path, image: Path, sizes) -> np.ndarray:
    if not file.is_file():
        raise InputError(f"data: {file} does not exist: every validation image needs its YOLO label file "
                         f"(an empty one for an image without objects), here for {image.name}")
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise InputError(f"data: {file} cannot be read ({err})") from err
    rows = [_yolo_row(line, file, number) for number, line in enumerate(text.splitlines(), start=1) if line.strip()]
    _, (width, height) = sizes(image)
    table = np.array(rows, dtype=np.float64).reshape(-1, 5)
    centre, size = table[:, 1:3] * (width, height), table[:, 3:5] * (width, height)
    return _labels(np.column_stack([centre - size / 2, centre + size / 2]), table[:, 0])


def _yolo_row(line: str, file: Path, number: int) -> List[float]:
    fields = line.split()
    try:
        values = [float(field) for field in fields]
    except ValueError:
        values = []
    if len(values) != 5 or not all(math.isfinite(v) for v in values):
        raise InputError(f"data: {file}:{number}: expected {YOLO_LINE}, got {line.strip()!r}")
    if values[0] < 0 or not values[0].is_integer():
        raise InputError(f"data: {file}:{number}: class {fields[0]!r} is not a class index (0, 1, ...)")
    if not all(0.0 <= v <= 1.0 + 1e-6 for v in values[1:]):
        raise InputError(f"data: {file}:{number}: {line.strip()!r} is not normalised: YOLO boxes are "
                         "fractions of the image (0..1), not pixels")
    return values


def coco_boxes(file: Path, images: Sequence[Path], sizes) -> List[np.ndarray]:
    document = _coco_document(file)
    entries = {PurePosixPath(str(entry.get("file_name", ""))).name: entry for entry in document["images"]}
    classes = _coco_classes(document, file)
    boxes: Dict[object, List[Tuple[List[float], int]]] = {}
    for annotation in document["annotations"]:
        if annotation.get("iscrowd"):
            continue
        box = _coco_box(annotation, file)
        category = annotation.get("category_id")
        if category not in classes:
            raise InputError(f"data: {file}: annotation {annotation.get('id', '?')} has category_id {category!r}, "
                             "which is not among the json's categories")
        boxes.setdefault(annotation.get("image_id"), []).append((box, classes[category]))
    labels = []
    for image in images:
        entry = entries.get(image.name)
        if entry is None:
            raise InputError(f"data: {file} has no image {image.name!r} (its images' file_name)")
        (width, height), (resized_width, resized_height) = sizes(image)
        frame = (float(entry.get("width") or width), float(entry.get("height") or height))  # the bbox's pixels
        scale = (resized_width / frame[0], resized_height / frame[1])
        found = boxes.get(entry.get("id"), [])
        corners = np.array([box for box, _ in found], dtype=np.float64).reshape(-1, 4) * (*scale, *scale)
        labels.append(_labels(corners, np.array([kind for _, kind in found], dtype=np.float64)))
    return labels


def _coco_document(file: Path) -> dict:
    try:
        document = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise InputError(f"data: {file} cannot be read as JSON ({str(err).splitlines()[0]})") from err
    if not isinstance(document, dict) or not isinstance(document.get("images"), list) \
            or not isinstance(document.get("annotations"), list) \
            or not all(isinstance(item, dict) for item in document["images"] + document["annotations"]):
        raise InputError(f"data: {file} is not a COCO json: it needs 'images' and 'annotations' lists of objects")
    return document


def _coco_classes(document: dict, file: Path) -> Dict[object, int]:
    """category_id -> class index: its place among the categories sorted by id (none listed:
    the id itself, for every id the annotations use)."""
    categories = document.get("categories")
    if categories is None:
        used = {a.get("category_id") for a in document["annotations"]}
        return {c: int(c) for c in used if isinstance(c, int) and not isinstance(c, bool) and c >= 0}
    try:
        ids = sorted(category["id"] for category in categories)
    except (TypeError, KeyError):
        raise InputError(f"data: {file}: 'categories' must be a list of objects with an 'id'") from None
    return {category: index for index, category in enumerate(ids)}


def _coco_box(annotation: dict, file: Path) -> List[float]:
    """[x0, y0, x1, y1] from the annotation's [x, y, width, height]."""
    bbox = annotation.get("bbox")
    try:
        values = [float(value) for value in bbox]
    except (TypeError, ValueError):
        values = []
    if len(values) != 4 or not all(math.isfinite(v) for v in values) or min(values[2:]) < 0:
        raise InputError(f"data: {file}: annotation {annotation.get('id', '?')} has bbox {bbox!r}; "
                         "expected [x, y, width, height] in pixels")
    x, y, width, height = values
    return [x, y, x + width, y + height]


def _labels(corners: np.ndarray, classes: np.ndarray) -> np.ndarray:
    return np.column_stack([corners, np.ones(len(classes)), classes]).astype(np.float32).reshape(-1, 6)
