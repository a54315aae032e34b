"""Input shapes: what ``model.input_shapes`` may say (a fixed shape, or a range
``{min, opt, max}``), the ranges convert records in the model, and the shape buckets
verify groups samples by. docs/targets.md, "Dynamic shapes"."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from pipeline.errors import ConfigError, InputError

RANGE_KEYS = ("min", "opt", "max")
RANGES_KEY = "parity.shape_ranges"  # metadata_props: {input: {min, opt, max} or null (the data decides)}


@dataclass(frozen=True)
class ShapeRange:
    """One input's shapes: ``min`` <= every sample's shape <= ``max`` dim by dim; ``opt``
    the shape speed is tuned and reported for. Dims equal in min and max are fixed."""

    min: Tuple[int, ...]
    opt: Tuple[int, ...]
    max: Tuple[int, ...]

    @property
    def dynamic_axes(self) -> List[int]:
        return [axis for axis, (low, high) in enumerate(zip(self.min, self.max)) if low != high]

    def contains(self, shape: Sequence[int]) -> bool:
        return len(shape) == len(self.min) and all(lo <= d <= hi for d, lo, hi in zip(shape, self.min, self.max))

    def to_json(self) -> dict:
        return {key: list(getattr(self, key)) for key in RANGE_KEYS}

    @classmethod
    def from_json(cls, value: dict) -> "ShapeRange":
        return cls(*(tuple(int(d) for d in value[key]) for key in RANGE_KEYS))

    def describe(self) -> str:
        return " .. ".join("x".join(str(d) for d in getattr(self, key)) for key in ("min", "max"))


def parse(name: str, value) -> Optional[ShapeRange]:
    """A ``model.input_shapes`` entry: a list of dims (fixed: a range with min = opt = max)
    or a mapping with min, opt and max. A ConfigError naming the key for anything else."""
    key = f"model.input_shapes.{name}"
    if isinstance(value, dict):
        unknown = sorted(set(value) - set(RANGE_KEYS))
        missing = [k for k in RANGE_KEYS if k not in value]
        if unknown or missing:
            raise ConfigError(f"{key}: a range has exactly the keys min, opt and max "
                              f"({'unknown ' + ', '.join(unknown) if unknown else 'missing ' + ', '.join(missing)})")
        dims = {k: _dims(f"{key}.{k}", value[k]) for k in RANGE_KEYS}
        if len({len(d) for d in dims.values()}) != 1:
            raise ConfigError(f"{key}: min, opt and max have different numbers of dims "
                              f"({', '.join(str(len(dims[k])) for k in RANGE_KEYS)})")
        found = ShapeRange(dims["min"], dims["opt"], dims["max"])
        for axis, (low, opt, high) in enumerate(zip(found.min, found.opt, found.max)):
            if not low <= opt <= high:
                raise ConfigError(f"{key}: dim {axis} must have min <= opt <= max, got {low}, {opt}, {high}")
        return found
    dims = _dims(key, value)
    return ShapeRange(dims, dims, dims)


def _dims(key: str, value) -> Tuple[int, ...]:
    if not isinstance(value, (list, tuple)) or not all(isinstance(d, int) and not isinstance(d, bool) for d in value):
        raise ConfigError(f"{key}={value!r}: give a list of dims ([1,3,224,224]) or a range "
                          "({min: [...], opt: [...], max: [...]})")
    for axis, dim in enumerate(value):
        if dim < 1:
            raise ConfigError(f"{key}[{axis}]={dim} is out of range: must be >= 1")
    return tuple(int(d) for d in value)


def parse_all(requested: Dict[str, object]) -> Dict[str, ShapeRange]:
    return {name: parse(name, value) for name, value in (requested or {}).items()}


# --- ranges recorded in the converted model ------------------------------------------------

def record(model, ranges: Dict[str, Optional[ShapeRange]]) -> None:
    """Keep each dynamic input's range (None: the data decides) in the model's metadata."""
    import onnx

    props = {p.key: p.value for p in model.metadata_props}
    props.pop(RANGES_KEY, None)
    if ranges:
        props[RANGES_KEY] = json.dumps({n: r.to_json() if r else None for n, r in ranges.items()}, sort_keys=True)
    del model.metadata_props[:]
    onnx.helper.set_model_props(model, props)


def recorded(model) -> Dict[str, Optional[ShapeRange]]:
    text = {p.key: p.value for p in model.metadata_props}.get(RANGES_KEY)
    if not text:
        return {}
    return {n: ShapeRange.from_json(r) if r else None for n, r in json.loads(text).items()}


# --- a sample's shape against its input ------------------------------------------------------

def fits(shape: Sequence[int], declared: Sequence[int]) -> bool:
    """``shape`` matches the declared dims, 0 standing for a dynamic dim (any size >= 1)."""
    return len(shape) == len(declared) and all(d == want or (want == 0 and d >= 1) for d, want in zip(shape, declared))


def check_in_range(name: str, shape: Sequence[int], found: Optional[ShapeRange], where: str, label: str) -> None:
    if found is not None and not found.contains(shape):
        raise InputError(f"{label}: {where} has shape {list(shape)} but model input '{name}' takes "
                         f"{found.describe()} (model.input_shapes.{name}); resize the sample or widen the range")


# --- shape buckets -------------------------------------------------------------------------

def shape_text(shape: Sequence[int]) -> str:
    return "x".join(str(d) for d in shape)


def shape_key(feeds: Dict[str, object]) -> str:
    """A sample's shapes as one text: "x=1x3x320x320" (inputs joined by ";")."""
    return ";".join(f"{name}={shape_text(getattr(value, 'shape', ()))}" for name, value in feeds.items())


def elements(feeds: Dict[str, object]) -> int:
    """A sample's input size: every input's element count, summed."""
    return sum(int(getattr(value, "size", 1)) for value in feeds.values())


def bucket_names(feeds: Dict[str, object], ranges: Dict[str, Optional[ShapeRange]]) -> List[str]:
    """Which of min, opt and max a sample's ranged inputs are at (none: the data's own
    shape, or an input without a range)."""
    if not ranges or any(r is None for r in ranges.values()):
        return []
    return [which for which in RANGE_KEYS
            if all(tuple(feeds[name].shape) == getattr(found, which) for name, found in ranges.items())]


def opt_shapes(inputs: Sequence[dict]) -> Dict[str, Tuple[int, ...]]:
    """runtime.yaml's inputs with a range or a served shape: {input: the range's opt shape, or
    the one shape the data fed it} (what a backend compiles its static copy for)."""
    found = {}
    for spec in inputs:
        shape = spec["range"]["opt"] if spec.get("range") else spec.get("served")
        if shape:
            found[spec["name"]] = tuple(int(d) for d in shape)
    return found


def served_shapes(inputs: Sequence[dict]) -> Dict[str, Tuple[int, ...]]:
    """runtime.yaml's served shapes, where no input has a range: {input: the one shape the data
    fed it} (a backend may compile the model at these shapes and the dynamic one on demand)."""
    if any(spec.get("range") for spec in inputs):
        return {}
    return {spec["name"]: tuple(int(d) for d in spec["served"]) for spec in inputs if spec.get("served")}


def at_shapes(feeds: Dict[str, object], wanted: Dict[str, Tuple[int, ...]]) -> bool:
    return all(tuple(getattr(feeds.get(name), "shape", ())) == shape for name, shape in wanted.items())


def uniform_groups(items: Iterable, size: int, feeds_of=lambda item: item) -> Iterable[list]:
    """Consecutive items in groups of at most ``size`` whose feeds all have the same
    shapes: the calibration runners stack a group into one batch."""
    group: list = []
    current = None
    for item in items:
        key = shape_key(feeds_of(item))
        if group and (key != current or len(group) >= size):
            yield group
            group = []
        current = key
        group.append(item)
    if group:
        yield group


def one_shape(items: Sequence, feeds_of=lambda item: item) -> list:
    """The items of the most common shape, in order (ties: the shape seen first): what the
    measurements that compare samples as equal slices (the mixed search, auto's table
    choice) run on when the data's shapes differ."""
    keys = [shape_key(feeds_of(item)) for item in items]
    best = Counter(keys).most_common(1)[0][0] if keys else None  # ties: the first counted
    return [item for item, key in zip(items, keys) if key == best]


def of_samples(feeds: Iterable[Dict[str, object]], names: Sequence[str]) -> Dict[str, ShapeRange]:
    """Each named input's range over the samples: min and max dim by dim, opt its most
    common shape (ties: the first seen). What a converter that traces at fixed shapes is
    given when no model.input_shapes range says (StageContext.traceable)."""
    seen: Dict[str, List[Tuple[int, ...]]] = {name: [] for name in names}
    for sample in feeds:
        for name in names:
            seen[name].append(tuple(int(d) for d in sample[name].shape))
    found = {}
    for name, all_shapes in seen.items():
        if all_shapes and len({len(s) for s in all_shapes}) == 1:
            found[name] = ShapeRange(tuple(map(min, zip(*all_shapes))), Counter(all_shapes).most_common(1)[0][0],
                                     tuple(map(max, zip(*all_shapes))))
    return found
