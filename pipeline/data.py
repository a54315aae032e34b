"""Calibration and validation data: tensor files, images with declared preprocessing,
or seeded random tensors. Samples are read lazily, one at a time, so memory does not
grow with the size of a split; every sample is checked against the model's inputs.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Sequence

import numpy as np

from pipeline.config import Color, DataConfig, DataKind, Layout, PreprocessConfig
from pipeline.errors import InputError

SPLITS = ("calibration", "validation")
TENSOR_SUFFIXES = (".npy", ".npz")
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".webp", ".tif", ".tiff")


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: List[int]
    dtype: str  # numpy dtype name


@dataclass
class Sample:
    name: str
    feeds: Dict[str, np.ndarray]
    label: Optional[int] = None


@dataclass
class Split:
    """One split: a count, where the samples come from, and a lazy sample reader."""

    name: str
    source: str
    names: List[str]
    read: Callable[[int], Dict[str, np.ndarray]]
    labels: Optional[List[int]] = None

    def __len__(self) -> int:
        return len(self.names)

    def __iter__(self) -> Iterator[Sample]:
        for index, name in enumerate(self.names):
            label = self.labels[index] if self.labels is not None else None
            yield Sample(name, self.read(index), label)


@dataclass
class Dataset:
    kind: str
    calibration: Split
    validation: Split
    files: List[Path] = field(default_factory=list)  # everything read, for cache keys
    warnings: List[str] = field(default_factory=list)

    def summary(self) -> dict:
        return {"kind": self.kind, "warnings": self.warnings,
                "splits": {s.name: {"samples": len(s), "source": s.source, "labeled": s.labels is not None}
                           for s in (self.calibration, self.validation)}}


def open_dataset(cfg: DataConfig, inputs: Sequence[TensorSpec]) -> Dataset:
    if cfg.kind is DataKind.random:
        return _random_dataset(cfg, inputs)
    path = Path(cfg.path).expanduser()
    if not path.exists():
        raise InputError(f"data.path: {path} does not exist (set data.path=... to a data directory or .npz file)")
    if path.is_file():
        if cfg.kind is not DataKind.tensors or path.suffix != ".npz":
            raise InputError(f"data.path: {path} is a file; only data.kind=tensors accepts a file (an .npz)")
        return _npz_dataset(path, cfg, inputs)
    return _directory_dataset(path, cfg, inputs)


# --- checks shared by every source -------------------------------------------------

def conform(array: np.ndarray, spec: TensorSpec, where: str, label: str = "data") -> np.ndarray:
    """The array with the model's batch axis and dtype, or an InputError naming the sample."""
    array = np.asarray(array)
    shape = list(spec.shape)
    if list(array.shape) == shape[1:] and shape and shape[0] == 1:
        array = array[np.newaxis]
    if list(array.shape) != shape:
        raise InputError(f"{label}: {where} has shape {list(array.shape)} but model input "
                         f"'{spec.name}' expects {shape}")
    if array.dtype.kind == "f" or np.dtype(spec.dtype).kind == "f":
        bad = ~np.isfinite(array.astype(np.float64, copy=False)) if array.dtype.kind in "fc" else None
        if bad is not None and bad.any():
            kind = "NaN" if np.isnan(array).any() else "Inf"
            raise InputError(f"{label}: {where} contains {kind} ({int(bad.sum())} non-finite values); "
                             "fix or remove that sample")
    return np.ascontiguousarray(array.astype(spec.dtype, copy=False))


def _read_tensor_file(path: Path, inputs: Sequence[TensorSpec], where: str) -> Dict[str, np.ndarray]:
    try:
        if path.suffix == ".npy":
            if len(inputs) != 1:
                raise InputError(f"data: {where} is a .npy file but the model has {len(inputs)} inputs; "
                                 f"use .npz files with keys {', '.join(i.name for i in inputs)}")
            return {inputs[0].name: conform(np.load(path, allow_pickle=False), inputs[0], where)}
        with np.load(path, allow_pickle=False) as archive:
            arrays = {key: archive[key] for key in archive.files}
    except (ValueError, OSError, EOFError) as err:
        raise InputError(f"data: {where} cannot be read as a NumPy file ({err})") from err
    if len(inputs) == 1 and len(arrays) == 1:
        arrays = {inputs[0].name: next(iter(arrays.values()))}
    missing = [i.name for i in inputs if i.name not in arrays]
    if missing:
        raise InputError(f"data: {where} has keys {sorted(arrays)} but the model needs {missing}")
    return {i.name: conform(arrays[i.name], i, where) for i in inputs}


# --- a directory of tensors or images ---------------------------------------------

def _directory_dataset(path: Path, cfg: DataConfig, inputs: Sequence[TensorSpec]) -> Dataset:
    warnings: List[str] = []
    folders = {s: path / s for s in SPLITS if (path / s).is_dir()}
    if not folders:
        folders = {s: path for s in SPLITS}
        warnings.append(f"{path} has no calibration/ and validation/ folders: the same samples serve both")
    for split in SPLITS:
        if split not in folders:
            other = next(iter(folders.values()))
            folders[split] = other
            warnings.append(f"no {split}/ folder in {path}: {split} uses {other.name}/")
    suffixes = IMAGE_SUFFIXES if cfg.kind is DataKind.images else TENSOR_SUFFIXES
    if cfg.kind is DataKind.images:
        _check_image_model(inputs)
    splits, files = {}, []
    for split in SPLITS:
        size = cfg.calibration_size if split == "calibration" else cfg.validation_size
        folder = folders[split]
        found = sorted(p for p in folder.iterdir() if p.suffix.lower() in suffixes and p.is_file())
        if not found and (size > 0 or split == "validation"):
            raise InputError(f"data.path: {folder} contains no {'/'.join(suffixes)} files "
                             f"(data.kind={cfg.kind.value})")
        chosen = found[:size]
        if len(chosen) < size:
            warnings.append(f"{split}: {len(chosen)} samples found, {size} requested")
        labels, label_file = _read_labels(folder / cfg.labels, chosen)
        files += chosen + ([label_file] if label_file else [])
        if cfg.kind is DataKind.images:
            reader = _image_reader(chosen, inputs[0], cfg.preprocess)
        else:
            reader = _tensor_file_reader(chosen, inputs)
        splits[split] = Split(split, str(folder), [p.name for p in chosen], reader, labels)
    return Dataset(cfg.kind.value, splits["calibration"], splits["validation"], files, warnings)


def _tensor_file_reader(paths: List[Path], inputs: Sequence[TensorSpec]):
    return lambda index: _read_tensor_file(paths[index], inputs, str(paths[index]))


def _read_labels(label_file: Path, samples: List[Path]):
    """Labels for the chosen samples from a 'sample,class' CSV, or None when there is none."""
    if not label_file.is_file():
        return None, None
    table = {}
    with open(label_file, newline="") as handle:
        for row_number, row in enumerate(csv.reader(handle), start=1):
            if not row or row[0].startswith("#"):
                continue
            if len(row) < 2:
                raise InputError(f"data: {label_file}:{row_number}: expected 'sample,class', got {','.join(row)!r}")
            try:
                table[row[0].strip()] = int(row[1])
            except ValueError:
                if row_number == 1:
                    continue  # a header row
                raise InputError(f"data: {label_file}:{row_number}: class {row[1]!r} is not an integer") from None
    labels = []
    for sample in samples:
        label = table.get(sample.name, table.get(sample.stem))
        if label is None:
            raise InputError(f"data: {label_file} has no label for {sample.name}")
        labels.append(label)
    return labels, label_file


# --- images ------------------------------------------------------------------------

def _check_image_model(inputs: Sequence[TensorSpec]) -> None:
    if len(inputs) != 1 or len(inputs[0].shape) != 4:
        raise InputError("data.kind=images needs a model with one 4-D image input; "
                         f"this model has inputs {[(i.name, i.shape) for i in inputs]}")


def _image_reader(paths: List[Path], spec: TensorSpec, pre: PreprocessConfig):
    return lambda index: {spec.name: conform(load_image(paths[index], spec, pre), spec, str(paths[index]))}


def load_image(path: Path, spec: TensorSpec, pre: PreprocessConfig) -> np.ndarray:
    """One image as a batch-of-one tensor, preprocessed as the config declares."""
    from PIL import Image, UnidentifiedImageError

    channels_first = pre.layout is Layout.nchw
    height, width = spec.shape[2:4] if channels_first else spec.shape[1:3]
    channels = spec.shape[1] if channels_first else spec.shape[3]
    if pre.resize:
        height, width = pre.resize
    try:
        with Image.open(path) as image:
            image = image.convert("L" if pre.color is Color.gray else "RGB")
            if pre.keep_aspect:
                ratio = min(height / image.height, width / image.width)
                size = (max(1, min(width, round(image.width * ratio))), max(1, min(height, round(image.height * ratio))))
            else:
                size = (width, height)
            pixels = np.asarray(image.resize(size, Image.BILINEAR), dtype=np.float32)
    except (UnidentifiedImageError, OSError) as err:
        raise InputError(f"data: {path} cannot be read as an image ({err})") from err
    if pixels.ndim == 2:
        pixels = pixels[..., np.newaxis]
    if pre.color is Color.bgr:
        pixels = pixels[..., ::-1]
    if pixels.shape[-1] != channels:
        raise InputError(f"data: {path} gives {pixels.shape[-1]} channels with data.preprocess.color="
                         f"{pre.color.value} but model input '{spec.name}' has {channels}")
    mean = np.asarray(pre.mean, dtype=np.float32)
    std = np.asarray(pre.std, dtype=np.float32)
    normalized = (pixels / pre.scale - mean) / std
    canvas = np.full((height, width, channels), pre.pad_value, dtype=np.float32)
    canvas[: normalized.shape[0], : normalized.shape[1]] = normalized
    tensor = canvas.transpose(2, 0, 1) if channels_first else canvas
    return tensor[np.newaxis]


# --- one .npz holding every sample -----------------------------------------------------

def _npz_dataset(path: Path, cfg: DataConfig, inputs: Sequence[TensorSpec]) -> Dataset:
    """Keys '<split>/<input>' (and '<split>/labels'), or plain '<input>' keys for both splits.
    Arrays hold samples along axis 0."""
    try:
        archive = np.load(path, allow_pickle=False)
        keys = set(archive.files)
    except (ValueError, OSError, EOFError) as err:
        raise InputError(f"data.path: {path} cannot be read as an .npz file ({err})") from err
    warnings: List[str] = []
    splits = {}
    for split in SPLITS:
        prefix = f"{split}/" if any(k.startswith(f"{split}/") for k in keys) else ""
        if not prefix and any("/" in k for k in keys):
            other = next(s for s in SPLITS if any(k.startswith(f"{s}/") for k in keys))
            prefix = f"{other}/"
            warnings.append(f"{path.name} has no {split}/ arrays: {split} uses {other}/")
        arrays = {}
        for spec in inputs:
            key = prefix + spec.name
            if key not in keys and len(inputs) == 1 and prefix + "input" in keys:
                key = prefix + "input"
            if key not in keys:
                raise InputError(f"data: {path} has no array '{key}' for model input '{spec.name}' "
                                 f"(keys: {', '.join(sorted(keys))})")
            arrays[spec.name] = archive[key]
        count = min(len(a) for a in arrays.values())
        size = cfg.calibration_size if split == "calibration" else cfg.validation_size
        if count < size:
            warnings.append(f"{split}: {count} samples found, {size} requested")
        count = min(count, size)
        if count == 0 and split == "validation":
            raise InputError(f"data: {path} holds no validation samples")
        labels = archive[prefix + "labels"][:count].astype(int).tolist() if prefix + "labels" in keys else None

        def read(index, arrays=arrays, split=split):
            return {name: conform(array[index], spec, f"{path.name}[{split}][{index}]")
                    for (name, array), spec in zip(arrays.items(), inputs)}

        splits[split] = Split(split, f"{path}:{prefix or '*'}", [f"{split}[{i}]" for i in range(count)], read, labels)
    return Dataset("tensors", splits["calibration"], splits["validation"], [path], warnings)


# --- seeded random tensors --------------------------------------------------------------

def _random_dataset(cfg: DataConfig, inputs: Sequence[TensorSpec]) -> Dataset:
    splits = {}
    for offset, split in enumerate(SPLITS):
        size = cfg.calibration_size if split == "calibration" else cfg.validation_size

        def read(index, offset=offset):
            rng = np.random.default_rng([cfg.seed, offset, index])
            return {i.name: _random_tensor(rng, i, cfg) for i in inputs}

        splits[split] = Split(split, f"random(seed={cfg.seed})", [f"{split}[{i}]" for i in range(size)], read)
    warning = ("random data: seeded uniform tensors in "
               f"[{cfg.low}, {cfg.high}] are not representative of real inputs; metrics only show numerical agreement")
    return Dataset("random", splits["calibration"], splits["validation"], [], [warning])


def _random_tensor(rng: np.random.Generator, spec: TensorSpec, cfg: DataConfig) -> np.ndarray:
    if np.dtype(spec.dtype).kind in "iub":
        return rng.integers(int(cfg.low), int(cfg.high) + 1, size=spec.shape).astype(spec.dtype)
    return rng.uniform(cfg.low, cfg.high, size=spec.shape).astype(spec.dtype)
