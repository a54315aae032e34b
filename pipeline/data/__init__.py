"""Calibration and validation data: tensor files, images with declared preprocessing,
texts through a tokenizer (pipeline/data/text.py) or seeded random tensors. Samples are
read lazily, one at a time, so memory does not grow with the size of a split; every
sample is checked against the model's inputs.
"""

from __future__ import annotations

import csv
import logging
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Union

import numpy as np

from pipeline.config.schemas import Color, DataConfig, DataKind, Layout, PreprocessConfig
from pipeline import shapes
from pipeline.data import npz
from pipeline.errors import InputError

SPLITS = ("calibration", "validation")
TENSOR_SUFFIXES = (".npy", ".npz")
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".webp", ".tif", ".tiff")


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: List[int]
    dtype: str  # numpy dtype name
    # the axis samples stack on; None: the input has none (a scalar, a shared setting)
    batch_axis: Optional[int] = 0
    # a dynamic input's {min, opt, max} (pipeline.shapes); None: fixed, or the data decides
    range: Optional[dict] = None
    # a dynamic input without a range that the data fed at one shape: that shape (runtime.yaml;
    # backends compile a static copy for it, StageContext.served_inputs)
    served: Optional[List[int]] = None

    @property
    def dynamic(self) -> bool:
        """Some dim is dynamic (0 in ``shape``): samples may differ in shape there."""
        return 0 in self.shape


@dataclass
class Sample:
    name: str
    feeds: Dict[str, np.ndarray]
    # a class index, a number, a text, or a detector's boxes ([K, 6]: pipeline/data/boxes.py); task metrics convert it
    label: Union[int, float, str, np.ndarray, None] = None


@dataclass
class Split:
    """One split: a count, where the samples come from, and a lazy sample reader."""

    name: str
    source: str
    names: List[str]
    read: Callable[[int], Dict[str, np.ndarray]]
    labels: Optional[List[Any]] = None
    found: Optional[int] = None  # samples available; len(names) of them are used

    def __len__(self) -> int:
        return len(self.names)

    def __iter__(self) -> Iterator[Sample]:
        for index in range(len(self.names)):
            yield self.at(index)

    def at(self, index: int) -> Sample:
        """Sample ``index`` alone (only its data read)."""
        return Sample(self.names[index], self.read(index), self.labels[index] if self.labels is not None else None)


@dataclass
class Dataset:
    kind: str
    calibration: Split
    validation: Split
    files: List[Path] = field(default_factory=list)  # everything read, for cache keys
    warnings: List[str] = field(default_factory=list)

    def summary(self) -> dict:
        return {"kind": self.kind, "warnings": self.warnings,
                "splits": {s.name: {"samples": len(s), "found": s.found if s.found is not None else len(s),
                                    "used": f"used {len(s)} of {s.found if s.found is not None else len(s)}",
                                    "source": s.source, "labeled": s.labels is not None}
                           for s in (self.calibration, self.validation)}}


def split_size(cfg: DataConfig, split: str, found: int, warnings: List[str]) -> int:
    """How many of the ``found`` samples a split uses: data.<split>_size when set (a
    warning when fewer exist), else every sample up to data.<split>_cap (a warning when
    the cap cuts)."""
    size = cfg.calibration_size if split == "calibration" else cfg.validation_size
    if size is not None:
        if found < size:
            warnings.append(f"{split}: {found} samples found, {size} requested")
        return min(found, size)
    cap = cfg.calibration_cap if split == "calibration" else cfg.validation_cap
    if found > cap:
        warnings.append(f"{split}: used {cap} of {found} samples (data.{split}_cap); "
                        f"set data.{split}_size={found} to use them all")
    return min(found, cap)


def open_dataset(cfg: DataConfig, inputs: Sequence[TensorSpec]) -> Dataset:
    if cfg.kind is DataKind.random:
        return _random_dataset(cfg, inputs)
    if cfg.kind is DataKind.text:
        return _text_dataset(cfg, inputs)
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
    """The array with the model's batch axis and dtype, or an InputError naming the sample.
    A scalar input stays 0-d (np.ascontiguousarray would make it 1-d)."""
    array = np.asarray(array)
    shape = list(spec.shape)
    axis = spec.batch_axis
    if axis is not None and axis < len(shape) and shape[axis] == 1 \
            and shapes.fits(array.shape, shape[:axis] + shape[axis + 1:]):
        array = np.expand_dims(array, axis)
    if not shapes.fits(array.shape, shape):
        expected = "x".join(str(d) if d else "?" for d in shape) if spec.dynamic else shape
        raise InputError(f"{label}: {where} has shape {list(array.shape)} but model input "
                         f"'{spec.name}' expects {expected}")
    if spec.range:
        shapes.check_in_range(spec.name, array.shape, shapes.ShapeRange.from_json(spec.range), where, label)
    if array.dtype.kind == "f" or np.dtype(spec.dtype).kind == "f":
        bad = ~np.isfinite(array.astype(np.float64, copy=False)) if array.dtype.kind in "fc" else None
        if bad is not None and bad.any():
            kind = "NaN" if np.isnan(array).any() else "Inf"
            raise InputError(f"{label}: {where} contains {kind} ({int(bad.sum())} non-finite values); "
                             "fix or remove that sample")
    array = _cast(array, spec, where, label)
    return array if array.flags.c_contiguous else array.copy(order="C")


_CASTS_LOGGED: set = set()  # (input, data dtype, model dtype): warned once per process


def _cast(array: np.ndarray, spec: TensorSpec, where: str, label: str) -> np.ndarray:
    """The array in the model input's dtype; a warning the first time an input's data has
    another dtype, an InputError when the cast would change values (fractions or
    out-of-range values into an integer input, values beyond the range of a float type)."""
    wanted = np.dtype(spec.dtype)
    if array.dtype == wanted:
        return array
    cast = array.astype(wanted)
    changed = _cast_changes(array, cast, wanted)
    if changed:
        raise InputError(f"{label}: {where} is {array.dtype} but model input '{spec.name}' is {wanted}, and the "
                         f"cast would change values ({changed}); convert the data to {wanted} yourself")
    if (spec.name, array.dtype.name, wanted.name) not in _CASTS_LOGGED:
        _CASTS_LOGGED.add((spec.name, array.dtype.name, wanted.name))
        logging.getLogger("parity").warning(f"{label}: model input '{spec.name}' is {wanted} but the data is "
                                            f"{array.dtype} ({where}...): cast to {wanted}")
    return cast


def _cast_changes(array: np.ndarray, cast: np.ndarray, wanted: np.dtype) -> str:
    if wanted.kind in "iub" and array.dtype.kind in "fc":
        fractional = int(np.count_nonzero(np.asarray(array != np.round(array))))
        if fractional:
            return f"{fractional} non-integer values"
    if wanted.kind in "iu" and array.dtype.kind in "iufc":
        info = np.iinfo(wanted)
        outside = int(np.count_nonzero((array < info.min) | (array > info.max)))
        if outside:
            return f"{outside} values outside [{info.min}, {info.max}]"
    if wanted.kind == "f" and array.dtype.kind in "iuf":
        overflow = int(np.count_nonzero(~np.isfinite(cast) & np.isfinite(array.astype(np.float64))))
        if overflow:
            return f"{overflow} values beyond the {wanted} range"
    return ""


# --- samples as one batch, and the packed form calibration passes around -------------------

def stack(samples: Sequence[Dict[str, np.ndarray]], inputs: Sequence[TensorSpec]) -> Optional[Dict[str, np.ndarray]]:
    """The samples as one batch, each input concatenated on its own batch axis; an input
    with no batch axis (a scalar such as a sample rate) is fed once, which needs the same
    value in every sample. None when the samples cannot form one batch."""
    batch = {}
    for spec in inputs:
        values = [s[spec.name] for s in samples]
        if spec.batch_axis is None or spec.batch_axis >= values[0].ndim:
            if any(not np.array_equal(v, values[0]) for v in values[1:]):
                return None
            batch[spec.name] = values[0]
        else:
            batch[spec.name] = np.concatenate(values, axis=spec.batch_axis)
    return batch


def pack(samples: Sequence[Dict[str, np.ndarray]]) -> Dict[str, np.ndarray]:
    """The samples' tensors concatenated on axis 0, a scalar counting as shape [1]: sample i
    is the i-th of equal slices (``unpack``), whatever the input's batch axis."""
    return {name: np.concatenate([np.atleast_1d(s[name]) for s in samples]) for name in samples[0]}


def unpack(packed: Dict[str, np.ndarray], index: int, count: int,
           shapes: Dict[str, Sequence[int]]) -> Dict[str, np.ndarray]:
    """Sample ``index`` of ``count`` from ``pack``'s form, in its own shape (``shapes``;
    tensors not named there, or with a dynamic dim, keep their slice's shape)."""
    sample = {}
    for name, values in packed.items():
        size = len(values) // count
        part = values[index * size:(index + 1) * size]
        shape = shapes.get(name)
        sample[name] = part.reshape(shape) if shape is not None and 0 not in shape else part
    return sample


def load_arrays(path: Path, inputs: Sequence[TensorSpec] = ()) -> Dict[str, np.ndarray]:
    """Every array of a .npy (key "") or .npz file (its keys), read whole, no pickles; the
    one array of a file fed to a one-input model is that input's, whatever its key. Raises
    NumPy's ValueError, OSError or EOFError for a file it cannot read."""
    path = Path(path)
    if path.suffix == ".npy":
        arrays = {"": np.load(path, allow_pickle=False)}
    else:
        with np.load(path, allow_pickle=False) as archive:
            arrays = {key: archive[key] for key in archive.files}
    if len(inputs) == 1 and len(arrays) == 1:
        arrays = {inputs[0].name: next(iter(arrays.values()))}
    return arrays


def _read_tensor_file(path: Path, inputs: Sequence[TensorSpec], where: str) -> Dict[str, np.ndarray]:
    if path.suffix == ".npy" and len(inputs) != 1:
        raise InputError(f"data: {where} is a .npy file but the model has {len(inputs)} inputs; "
                         f"use .npz files with keys {', '.join(i.name for i in inputs)}")
    try:
        arrays = load_arrays(path, inputs)
    except (ValueError, OSError, EOFError) as err:
        raise InputError(f"data: {where} cannot be read as a NumPy file ({err})") from err
    missing = [i.name for i in inputs if i.name not in arrays]
    if missing:
        raise InputError(f"data: {where} has keys {sorted(arrays)} but the model needs {missing}")
    return {i.name: conform(arrays[i.name], i, where) for i in inputs}


def _text_dataset(cfg: DataConfig, inputs: Sequence[TensorSpec]) -> Dataset:
    """data.kind=text (pipeline/data/text.py): each text tokenized on its own, batch 1."""
    from pipeline.data import text as text_data

    encode = text_data.Encoder(cfg.tokenizer, cfg.max_length, [(i.name, i.dtype) for i in inputs])
    source = text_data.open_texts(cfg)
    warnings, splits = list(source.warnings), {}
    for split in SPLITS:
        found = source.texts[split]
        chosen = found[:split_size(cfg, split, len(found), warnings)]

        def read(index, chosen=chosen):
            name, text = chosen[index]
            arrays = encode(text)
            return {i.name: conform(arrays[i.name], i, name) for i in inputs}

        splits[split] = Split(split, source.sources[split], [name for name, _ in chosen], read, None, len(found))
    return Dataset("text", splits["calibration"], splits["validation"], [*source.files, encode.path], warnings)


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
    if cfg.kind is DataKind.images:
        _check_image_model(inputs)
    splits, files = {}, []
    for split in SPLITS:
        folder = folders[split]
        found = sorted(p for p in folder.iterdir() if p.is_file() and _is_sample(p, cfg))
        if not found and (cfg.calibration_size != 0 or split == "validation"):
            raise InputError(f"data.path: {folder} contains no {_sample_kinds(cfg)} files "
                             f"(data.kind={cfg.kind.value})")
        chosen = found[:split_size(cfg, split, len(found), warnings)]
        labels, label_files = _split_labels(folder, split, chosen, cfg, inputs)
        files += chosen + label_files
        reader = file_reader(cfg.kind, cfg.preprocess, inputs)
        splits[split] = Split(split, str(folder), [p.name for p in chosen],
                              lambda index, chosen=chosen, reader=reader: reader(chosen[index]), labels, len(found))
    return Dataset(cfg.kind.value, splits["calibration"], splits["validation"], files, warnings)


def _is_sample(path: Path, cfg: DataConfig) -> bool:
    if cfg.kind is DataKind.custom:  # any file but the labels and hidden files
        return path.name != cfg.labels and not path.name.startswith(".")
    return path.suffix.lower() in (IMAGE_SUFFIXES if cfg.kind is DataKind.images else TENSOR_SUFFIXES)


def _sample_kinds(cfg: DataConfig) -> str:
    if cfg.kind is DataKind.custom:
        return "sample"
    return "/".join(IMAGE_SUFFIXES if cfg.kind is DataKind.images else TENSOR_SUFFIXES)


def file_reader(kind: DataKind, pre: PreprocessConfig, inputs: Sequence[TensorSpec], label: str = "data"):
    """path -> model feeds, through the declared preprocessing: the one reader that
    calibration, validation and ``parity-bundle run`` use for a file of this kind."""
    if kind is DataKind.images:
        _check_image_model(inputs)
        return lambda path: {inputs[0].name: conform(load_image(path, inputs[0], pre, label), inputs[0], str(path),
                                                     label)}
    if kind is DataKind.custom:
        return custom_reader(pre, inputs, label)
    return lambda path: _read_tensor_file(path, inputs, str(path))


def custom_reader(pre: PreprocessConfig, inputs: Sequence[TensorSpec], label: str = "data"):
    """data.preprocess._target_ (through hydra.utils.instantiate): a callable taking a
    file path and returning the input arrays, a dict by input name or one array."""
    from hydra.utils import instantiate

    if pre.path:
        folder = str(Path(pre.path).expanduser().resolve())
        if folder not in sys.path:
            sys.path.insert(0, folder)
    try:
        function = instantiate({"_target_": pre._target_, "_partial_": True})
    except Exception as err:  # noqa: BLE001 - the user's import path
        cause = err.__cause__ or err
        raise InputError(f"data.preprocess._target_: cannot import {pre._target_!r} ({type(cause).__name__}: "
                         f"{str(cause).splitlines()[0] if str(cause) else ''}); set data.preprocess.path to the "
                         "folder holding its module") from None

    def read(path: Path) -> Dict[str, np.ndarray]:
        try:
            arrays = function(str(path))
        except Exception as err:  # noqa: BLE001 - the user's code: one line
            raise InputError(f"{label}: preprocess {pre._target_} raised {type(err).__name__} on {path}: "
                             f"{str(err).splitlines()[0] if str(err) else ''}") from None
        if not isinstance(arrays, dict):
            arrays = {inputs[0].name: arrays} if len(inputs) == 1 else {}
        missing = [i.name for i in inputs if i.name not in arrays]
        if missing:
            raise InputError(f"{label}: preprocess {pre._target_} returned no array for inputs {missing} on {path}")
        return {i.name: conform(arrays[i.name], i, str(path), label) for i in inputs}

    return read


def preprocess_record(kind: DataKind, pre: PreprocessConfig) -> Optional[dict]:
    """The declared preprocessing as runtime.yaml records it (None for tensor data)."""
    from pipeline.config.schemas import plain

    if kind not in (DataKind.images, DataKind.custom):
        return None
    record = {"kind": kind.value, **plain(pre)}
    if record.get("path"):  # a custom preprocess's folder, for loaders on this machine
        record["path"] = str(Path(record["path"]).expanduser().resolve())
    return record


def preprocess_from_record(record: dict):
    """(kind, PreprocessConfig) from a runtime.yaml record."""
    values = {key: value for key, value in record.items() if key != "kind"}
    kind = DataKind(record.get("kind", "images"))
    for key, enum in (("color", Color), ("layout", Layout)):
        if key in values:
            values[key] = enum(values[key])
    return kind, PreprocessConfig(**values)


LABEL_HEADERS = {"sample", "file", "name", "image", "path"}


def _split_labels(folder: Path, split: str, chosen: List[Path], cfg: DataConfig, inputs: Sequence[TensorSpec]):
    """(the split's labels or None, the files read): box labels (pipeline/data/boxes.py, YOLO
    txt or COCO json) for the validation images, mapped into the input's pixels; else a
    labels.csv. The calibration split never scores a metric: it reads no box labels."""
    from pipeline.data import boxes

    if split != "validation":
        return (None, []) if boxes.names_boxes(folder / cfg.labels) else _csv_labels(folder / cfg.labels, chosen)
    source = boxes.box_source(folder, cfg.labels, cfg.labels == DataConfig.labels and cfg.kind is DataKind.images)
    if source is None:
        return _csv_labels(folder / cfg.labels, chosen)
    if cfg.kind is not DataKind.images:
        raise InputError(f"data.labels: {source[1]} holds box labels, which need data.kind=images (the boxes "
                         f"follow the image's resize); data.kind={cfg.kind.value}")
    spec, pre = inputs[0], cfg.preprocess
    return boxes.read_boxes(source, chosen, lambda height, width: image_size(height, width, spec, pre)[1])


def _csv_labels(label_file: Path, samples: List[Path]):
    labels, found = _read_labels(label_file, samples)
    return labels, [found] if found else []


def _read_labels(label_file: Path, samples: List[Path]):
    """Labels for the chosen samples from a 'sample,label' CSV, or None when there is none.
    A label is kept as written (a class index, a number or a text); the task metric
    converts it."""
    if not label_file.is_file():
        return None, None
    table = {}
    with open(label_file, newline="", encoding="utf-8") as handle:
        for row_number, row in enumerate(csv.reader(handle), start=1):
            if not row or row[0].startswith("#"):
                continue
            if len(row) < 2:
                raise InputError(f"data: {label_file}:{row_number}: expected 'sample,label', got {','.join(row)!r}")
            if row_number == 1 and row[0].strip().lower() in LABEL_HEADERS:
                continue  # a header row
            table[row[0].strip()] = _label(",".join(row[1:]))
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


def _label(text: str):
    """An int where the label is written as one (a class index: "7", not "007"), else
    the text as written: str(label) gives the written text back."""
    stripped = text.strip()
    try:
        number = int(stripped)
    except ValueError:
        return text
    return number if str(number) == stripped else text


def load_image(path: Path, spec: TensorSpec, pre: PreprocessConfig, label: str = "data") -> np.ndarray:
    """One image as a batch-of-one tensor, preprocessed as the config declares: resized to
    the model's size (or data.preprocess.resize), or at its own size under a resize policy."""
    from PIL import Image, UnidentifiedImageError

    channels_first = pre.layout is Layout.nchw
    channels = spec.shape[1] if channels_first else spec.shape[3]
    try:
        with Image.open(path) as image:
            image = image.convert("L" if pre.color is Color.gray else "RGB")
            (height, width), size = image_size(image.height, image.width, spec, pre)
            pixels = np.asarray(image.resize(size, Image.BILINEAR), dtype=np.float32)
    except (UnidentifiedImageError, OSError) as err:
        raise InputError(f"{label}: {path} cannot be read as an image ({err})") from err
    if pixels.ndim == 2:
        pixels = pixels[..., np.newaxis]
    if pre.color is Color.bgr:
        pixels = pixels[..., ::-1]
    if pixels.shape[-1] != channels:
        raise InputError(f"{label}: {path} gives {pixels.shape[-1]} channels with data.preprocess.color="
                         f"{pre.color.value} but model input '{spec.name}' has {channels}")
    mean = np.asarray(pre.mean, dtype=np.float32)
    std = np.asarray(pre.std, dtype=np.float32)
    normalized = (pixels / pre.scale - mean) / std
    canvas = np.full((height, width, channels), pre.pad_value, dtype=np.float32)
    canvas[: normalized.shape[0], : normalized.shape[1]] = normalized
    tensor = canvas.transpose(2, 0, 1) if channels_first else canvas
    return tensor[np.newaxis]


def image_size(image_height: int, image_width: int, spec: TensorSpec, pre: PreprocessConfig):
    """((canvas height, width), (resized width, height) for PIL): the canvas is the tensor's
    size; the resized image fills it (keep_aspect: fits inside, the rest padded)."""
    axes = (2, 3) if pre.layout is Layout.nchw else (1, 2)
    model = [spec.shape[a] for a in axes]
    opt = [spec.range["opt"][a] for a in axes] if spec.range else model
    high = [spec.range["max"][a] for a in axes] if spec.range else [0, 0]
    if pre.resize == "limit_side":
        ratio = min(1.0, (pre.side or 960) / max(image_height, image_width))
        canvas = [_multiple(image_height * ratio, pre.multiple_of), _multiple(image_width * ratio, pre.multiple_of)]
        return tuple(canvas), (canvas[1], canvas[0])
    if pre.resize == "height":
        height = pre.side or model[0] or opt[0]
        width = _multiple(image_width * height / image_height, pre.multiple_of, up=True)
        canvas = [height, min(width, high[1]) if high[1] else width]
        return tuple(canvas), (canvas[1], canvas[0])
    height, width = pre.resize if isinstance(pre.resize, list) else [m or o for m, o in zip(model, opt)]
    if not height or not width:
        raise InputError(f"data.preprocess.resize: model input '{spec.name}' has a dynamic image size: set "
                         "data.preprocess.resize to [height, width], limit_side or height, or give a range "
                         f"model.input_shapes.{spec.name}")
    if not pre.keep_aspect:
        return (height, width), (width, height)
    ratio = min(height / image_height, width / image_width)
    size = (max(1, min(width, round(image_width * ratio))), max(1, min(height, round(image_height * ratio))))
    return (height, width), size


def _multiple(value: float, multiple: int, up: bool = False) -> int:
    """``value`` rounded (up) to a multiple of ``multiple``, at least one multiple."""
    steps = math.ceil(value / multiple) if up else round(value / multiple)
    return int(max(1, steps) * multiple)


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
            arrays[spec.name] = npz.member(archive, path, key)
        found = min(len(a) for a in arrays.values())
        count = split_size(cfg, split, found, warnings)
        if count == 0 and split == "validation":
            raise InputError(f"data: {path} holds no validation samples")
        labels = archive[prefix + "labels"][:count].tolist() if prefix + "labels" in keys else None

        def read(index, arrays=arrays, split=split):
            return {name: conform(np.array(array[index]), spec, f"{path.name}[{split}][{index}]")  # a mapped one: copied
                    for (name, array), spec in zip(arrays.items(), inputs)}

        splits[split] = Split(split, f"{path}:{prefix or '*'}", [f"{split}[{i}]" for i in range(count)], read, labels,
                              found)
    return Dataset("tensors", splits["calibration"], splits["validation"], [path], warnings)


# --- seeded random tensors --------------------------------------------------------------

RANDOM_SIZE = 16


def _random_dataset(cfg: DataConfig, inputs: Sequence[TensorSpec]) -> Dataset:
    """Seeded uniform tensors; a dynamic input's samples take its range's min, opt and max
    shapes in turn (one without a range cannot be made up: an InputError)."""
    undecided = [spec.name for spec in inputs if spec.dynamic and not spec.range]
    if undecided:
        raise InputError(f"data.kind=random cannot choose the shape of dynamic input '{undecided[0]}': set "
                         f"model.input_shapes.{undecided[0]} to a shape or a range {{min: [...], opt: [...], "
                         "max: [...]}}, or give real data")
    splits = {}
    for offset, split in enumerate(SPLITS):
        size = cfg.calibration_size if split == "calibration" else cfg.validation_size
        size = RANDOM_SIZE if size is None else size  # random data has no "every sample found"

        def read(index, offset=offset):
            rng = np.random.default_rng([cfg.seed, offset, index])
            return {i.name: _random_tensor(rng, i, cfg, _random_shape(i, index)) for i in inputs}

        splits[split] = Split(split, f"random(seed={cfg.seed})", [f"{split}[{i}]" for i in range(size)], read)
    warning = ("random data: seeded uniform tensors in "
               f"[{cfg.low}, {cfg.high}] are not representative of real inputs; metrics only show numerical agreement")
    return Dataset("random", splits["calibration"], splits["validation"], [], [warning])


def _random_shape(spec: TensorSpec, index: int) -> List[int]:
    return spec.range[shapes.RANGE_KEYS[index % 3]] if spec.range else spec.shape


def _random_tensor(rng: np.random.Generator, spec: TensorSpec, cfg: DataConfig, shape: List[int]) -> np.ndarray:
    if np.dtype(spec.dtype).kind in "iub":
        return rng.integers(int(cfg.low), int(cfg.high) + 1, size=shape).astype(spec.dtype)
    return rng.uniform(cfg.low, cfg.high, size=shape).astype(spec.dtype)
