"""Box labels for metric=detection (pipeline/data/boxes.py): YOLO txt per image and a COCO
json, read for the validation images and mapped into the model input's pixels through the
declared resize; bad label files are one line (InputError, exit 2), never a traceback."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from pipeline.config.schemas import DataConfig, DataKind, PreprocessConfig
from pipeline.data import TensorSpec, open_dataset
from pipeline.errors import InputError

SPEC = TensorSpec("images", [1, 3, 64, 64], "float32")


def _folder(tmp_path, sizes=((128, 64), (64, 64))):
    """calibration/ and validation/ with one image each per (width, height)."""
    for split in ("calibration", "validation"):
        (tmp_path / split).mkdir()
        for index, size in enumerate(sizes):
            Image.new("RGB", size, (90, 120, 150)).save(tmp_path / split / f"photo{index}.png")
    return tmp_path


def _validation(tmp_path, **data):
    pre = data.pop("preprocess", PreprocessConfig())
    return open_dataset(DataConfig(kind=DataKind.images, path=str(tmp_path), preprocess=pre, **data), [SPEC]).validation


def _yolo(folder, **files):
    folder.mkdir(exist_ok=True)
    for stem, text in files.items():
        (folder / f"{stem}.txt").write_text(text)


def test_yolo_txt_in_a_labels_folder_is_found_and_follows_the_resize(tmp_path):
    """photo0 is 128x64, stretched to 64x64 (x halves); with keep_aspect it fits as 64x32,
    so y halves as well. photo1 has no objects (an empty file)."""
    data = _folder(tmp_path)
    _yolo(data / "validation" / "labels", photo0="2 0.5 0.5 0.25 0.5\n\n", photo1="")
    stretched = _validation(data)
    assert stretched.labels[0].tolist() == [[24, 16, 40, 48, 1, 2]] and stretched.labels[1].shape == (0, 6)
    kept = _validation(data, preprocess=PreprocessConfig(keep_aspect=True)).labels[0]
    assert kept.tolist() == [[24, 8, 40, 24, 1, 2]]
    assert open_dataset(DataConfig(kind=DataKind.images, path=str(data)), [SPEC]).calibration.labels is None


def test_yolo_txt_beside_the_images_with_data_labels_dot(tmp_path):
    data = _folder(tmp_path, sizes=((64, 64),))
    _yolo(data / "validation", photo0="0 0.25 0.25 0.5 0.5\n1 0.75 0.75 0.5 0.5\n")
    labels = _validation(data, labels=".").labels
    assert labels[0].tolist() == [[0, 0, 32, 32, 1, 0], [32, 32, 64, 64, 1, 1]]


def test_a_coco_json_maps_categories_in_id_order_and_leaves_crowds_out(tmp_path):
    """COCO's ids 1 and 3 are classes 0 and 1; bbox [x, y, w, h] in the image's 128x64
    pixels, scaled to the 64x64 input (x halves)."""
    data = _folder(tmp_path)
    coco = {"images": [{"id": 7, "file_name": "val/photo0.png", "width": 128, "height": 64},
                       {"id": 8, "file_name": "photo1.png", "width": 64, "height": 64}],
            "annotations": [{"id": 1, "image_id": 7, "category_id": 3, "bbox": [32, 16, 64, 32]},
                            {"id": 2, "image_id": 7, "category_id": 1, "bbox": [0, 0, 10, 10], "iscrowd": 1},
                            {"id": 3, "image_id": 8, "category_id": 1, "bbox": [1, 2, 3, 4]}],
            "categories": [{"id": 3, "name": "b"}, {"id": 1, "name": "a"}]}
    (data / "validation" / "boxes.json").write_text(json.dumps(coco))
    labels = _validation(data, labels="boxes.json").labels
    assert labels[0].tolist() == [[16, 16, 48, 48, 1, 1]] and labels[1].tolist() == [[1, 2, 4, 6, 1, 0]]


def test_images_without_labels_are_unlabeled_as_before(tmp_path):
    assert _validation(_folder(tmp_path)).labels is None


@pytest.mark.parametrize("text, says", [("0 0.5 0.5 0.2\n", "photo0.txt:1: expected 'class cx cy w h'"),
                                        ("0 0.5 0.5 0.2 0.2\ncar 0.5 0.5 0.2 0.2\n", "photo0.txt:2: expected"),
                                        ("1.5 0.5 0.5 0.2 0.2\n", "class '1.5' is not a class index"),
                                        ("0 32 32 10 10\n", "is not normalised")])
def test_a_malformed_yolo_line_is_one_line_naming_file_and_line(tmp_path, text, says):
    data = _folder(tmp_path)
    _yolo(data / "validation" / "labels", photo0=text, photo1="")
    with pytest.raises(InputError, match=says) as caught:
        _validation(data)
    assert "\n" not in str(caught.value)


def test_a_missing_yolo_file_says_which_image(tmp_path):
    data = _folder(tmp_path)
    _yolo(data / "validation" / "labels", photo0="")
    with pytest.raises(InputError, match=r"photo1.txt does not exist.*an empty one for an image without objects"):
        _validation(data)


@pytest.mark.parametrize("document, says", [
    ("{not json", "cannot be read as JSON"),
    ({"images": []}, "is not a COCO json"),
    ({"images": [{"id": 1, "file_name": "photo0.png"}], "annotations": []}, "has no image 'photo1.png'"),
    ({"images": [{"id": 1, "file_name": "photo0.png"}, {"id": 2, "file_name": "photo1.png"}],
      "annotations": [{"id": 5, "image_id": 1, "category_id": 1, "bbox": [1, 2, 3]}]}, "annotation 5 has bbox"),
    ({"images": [{"id": 1, "file_name": "photo0.png"}, {"id": 2, "file_name": "photo1.png"}],
      "annotations": [{"id": 5, "image_id": 1, "category_id": 9, "bbox": [1, 2, 3, 4]}],
      "categories": [{"id": 1}]}, "category_id 9"),
    (None, "does not exist")])
def test_a_bad_coco_json_is_one_line(tmp_path, document, says):
    data = _folder(tmp_path)
    if document is not None:
        text = document if isinstance(document, str) else json.dumps(document)
        (data / "validation" / "coco.json").write_text(text)
    with pytest.raises(InputError, match=says) as caught:
        _validation(data, labels="coco.json")
    assert "\n" not in str(caught.value)


def test_box_labels_need_images(tmp_path):
    for split in ("calibration", "validation"):
        (tmp_path / split / "labels").mkdir(parents=True)
        np.save(tmp_path / split / "sample.npy", np.zeros((1, 3, 64, 64), np.float32))
    with pytest.raises(InputError, match="need data.kind=images"):
        open_dataset(DataConfig(kind=DataKind.tensors, path=str(tmp_path), labels="labels"), [SPEC])
    # left at its default, a labels/ folder beside tensors is not searched: unlabeled, as before
    assert open_dataset(DataConfig(kind=DataKind.tensors, path=str(tmp_path)), [SPEC]).validation.labels is None
