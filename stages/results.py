"""The shape of each stage's result summary (``StageResult.summary``): one dataclass per stage.

A stage builds its summary as JSON (what result.json and report.json hold) and types it
with ``<Stage>Summary.from_json``; every other module reads it by attribute, never by
string key (tests/test_stage_results.py). A key that another module reads is a field; the
keys only the report shows stay in ``detail``, as they are. ``to_json`` gives back exactly
the JSON it was made from, keys in their order, so result.json, report.json and a summary
served from the stage cache (pipeline/app/runner.py) are the same as before the types.

A field's value is JSON, or a nested shape (build's ``quantization``); the sections that
a library module of pipeline/ writes in its own format (verify's speed, memory, data; a
refinement's summary) stay that module's JSON.
"""

from __future__ import annotations

import typing
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Dict, List, Optional, Tuple

from pipeline.model import QUANTIZED_OP_TYPES

BASE_FIELDS = ("detail", "key_order")


@dataclass
class Shape:
    """What every summary shares: the keys no other module reads (``detail``) and the
    JSON's key order (``key_order``, so that to_json writes the keys as they came)."""
    detail: Dict[str, Any] = field(default_factory=dict)
    key_order: Tuple[str, ...] = field(default=(), repr=False, compare=False)

    @classmethod
    def from_json(cls, data: Optional[dict]):
        """The typed summary of ``data`` (None stays None)."""
        if data is None:
            return None
        hints = typing.get_type_hints(cls)
        names = _typed_fields(cls)
        values = {name: _typed(hints[name], data[name]) for name in names if name in data}
        detail = {key: value for key, value in data.items() if key not in names}
        return cls(detail=detail, key_order=tuple(data), **values)

    def to_json(self) -> dict:
        """The JSON it was made from: its keys in their order; a field set since, after them
        (one left at its default is not written)."""
        names = _typed_fields(type(self))
        found = {}
        for key in self.key_order:
            if key in names:
                found[key] = _plain(getattr(self, key))
            elif key in self.detail:
                found[key] = self.detail[key]
        for f in fields(self):
            if f.name in names and f.name not in found and getattr(self, f.name) != _default(f):
                found[f.name] = _plain(getattr(self, f.name))
        for key, value in self.detail.items():
            found.setdefault(key, value)
        return found


def _typed_fields(cls) -> Tuple[str, ...]:
    return tuple(f.name for f in fields(cls) if f.name not in BASE_FIELDS)


def _default(f):
    if f.default is not MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not MISSING else None


def _typed(hint, value):
    """``value`` as a field of type ``hint``: a nested shape from its JSON, anything else as it is."""
    for candidate in (hint, *typing.get_args(hint)):  # Optional[X] is Union[X, None]
        if isinstance(candidate, type) and issubclass(candidate, Shape) and isinstance(value, dict):
            return candidate.from_json(value)
    return value


def _plain(value):
    return value.to_json() if isinstance(value, Shape) else value


@dataclass
class ConvertSummary(Shape):
    source_sha256: Optional[str] = None
    inputs: List[dict] = field(default_factory=list)  # TensorSpec's fields (pipeline/data), one per input
    outputs: List[dict] = field(default_factory=list)
    preflight: List[dict] = field(default_factory=list)  # findings: check, severity, tensor, detail
    output_shapes: Optional[dict] = None
    op_types: Dict[str, int] = field(default_factory=dict)

    @property
    def quantized(self) -> str:
        """What makes the model quantized already ("12 QuantizeLinear, 12 DequantizeLinear"), or ""."""
        return ", ".join(f"{n} {op}" for op, n in self.op_types.items() if op in QUANTIZED_OP_TYPES)

    @property
    def output_names(self) -> List[str]:
        return [output["name"] for output in self.outputs]

    @property
    def shape_mismatches(self) -> List[dict]:
        """Outputs whose declared shape the model does not return (output, declared, returned)."""
        return list((self.output_shapes or {}).get("mismatches", []))


@dataclass
class CalibrateSummary(Shape):
    skipped: Optional[str] = None
    warnings: Optional[List[str]] = None
    equalization: Optional[dict] = None  # pipeline/precision/equalization.py's summary

    def report(self) -> dict:
        """report.json's calibration section: the per-tensor method errors (``auto``) stay in the stage folder."""
        return {key: value for key, value in self.to_json().items() if key != "auto"}

    @property
    def rescaled(self) -> List[str]:
        """The activations equalization scaled per channel (none unless it applied)."""
        equalized = self.equalization or {}
        if not equalized.get("applied"):
            return []
        return [name for pair in equalized.get("outlier_pairs") or [] for name in pair.get("rescaled") or []]


@dataclass
class SensitivitySummary(Shape):
    skipped: Optional[str] = None
    warning: Optional[str] = None  # the target was not reached


@dataclass
class Quantization(Shape):
    """build's ``quantization``: what the quantizer (or fp16 conversion) did; nested keys as the builder wrote them."""
    float_ops: Optional[List[str]] = None  # quantized ops kept in float (keep_float, the backend's own)
    passthrough_float: Optional[List[str]] = None  # pass-through ops float beside them (float_neighbours)
    quantized_inputs: Optional[List[str]] = None  # float ops reading their inputs quantized (keep_in_float)
    int8_ops: Optional[int] = None
    quantized_ops: Optional[List[str]] = None  # precision.quantize_ops
    passthrough_ops: Optional[List[str]] = None  # precision.passthrough_ops as resolved (none: absent)
    keep_float_not_found: Optional[List[str]] = None
    slower_in_int8: Optional[dict] = None  # precision.int8_where_faster's finding
    weight_rounding: Optional[dict] = None  # pipeline/precision/calibration/weight_rounding.py's summary
    bias_correction: Optional[dict] = None  # pipeline/precision/calibration/bias_correction.py's summary
    relus_folded: Optional[int] = None  # pass-through Relus and Clips folded into the Q before them (passthrough.fold_relus)
    convs_widened: Optional[List[str]] = None  # narrow int8 Convs widened to the kernel block (narrow_convs)

    def refinements(self) -> List[Tuple[str, dict]]:
        """(step, its summary) of weight rounding and bias correction, each where it ran."""
        return [(step, summary) for step, summary in (("weight_rounding", self.weight_rounding),
                                                      ("bias_correction", self.bias_correction)) if summary]

    def refined(self, step: str) -> bool:
        """Whether the build applied that refinement (enabled, no error, not cut by the budget)."""
        summary = dict(self.refinements()).get(step) or {}
        return bool(summary.get("enabled")) and not summary.get("error") and not summary.get("cut")

    def refinement_seconds(self) -> float:
        return sum(float(summary.get("seconds") or 0.0) for _, summary in self.refinements())

    @property
    def none_slower_in_int8(self) -> bool:
        """Whether int8_where_faster kept every op in float because none was faster in int8."""
        return bool((self.slower_in_int8 or {}).get("ops"))


@dataclass
class BuildSummary(Shape):
    files: List[str] = field(default_factory=list)  # the artifact's files, in build's folder
    bytes: Optional[int] = None
    quantization: Optional[Quantization] = None

    @property
    def float_ops(self) -> Optional[List[str]]:
        """The quantized ops the build kept in float; None for a build with no such list."""
        return self.quantization.float_ops if self.quantization else None

    @property
    def kept_float(self) -> List[str]:
        """Every op the build left float on purpose: float_ops and the pass-through ops beside them."""
        quantization = self.quantization
        return [*(quantization.float_ops or []), *(quantization.passthrough_float or [])] if quantization else []


@dataclass
class TuneSummary(Shape):
    ran: bool = False
    chosen: Optional[dict] = None  # the kept trial (pipeline/tuning.py Trial.to_json)

    @property
    def changes(self) -> dict:
        """The runtime settings tune changed ({} when it kept the build's)."""
        from pipeline.tuning import Trial

        return Trial.from_json(self.chosen).changes if self.chosen else {}


@dataclass
class VerifySummary(Shape):
    verdict: str = "unverified"
    exit_code: int = 0
    reasons: List[str] = field(default_factory=list)
    checks: List[dict] = field(default_factory=list)  # pipeline/verification/verdict.py's checks
    outputs: List[dict] = field(default_factory=list)  # per output: name, metrics, thresholds
    task: Optional[dict] = None  # the task metric's figures
    comparison: Optional[dict] = None  # precision -> its side-by-side row
    speed: Optional[dict] = None  # pipeline/verification/speed.py's section
    memory: Optional[dict] = None  # pipeline/verification/memory.py's section
    data: Optional[dict] = None  # the dataset's summary (pipeline/data)
    truth: Optional[dict] = None  # pipeline/verification/truth.py's section

    @property
    def data_warnings(self) -> List[str]:
        return list((self.data or {}).get("warnings", []))

    @property
    def check_warnings(self) -> List[str]:
        """The checks' lines that warn (int8 ran partly in float), then the reference's against float64 truth."""
        return [check["text"] for check in self.checks or [] if check["severity"] == "warning"] + \
            list((self.truth or {}).get("warnings", []))

    @property
    def speed_warning(self) -> Optional[str]:
        return (self.speed or {}).get("warning")

    def failed_check(self, name: str) -> bool:
        return any(c.get("check") == name and c.get("severity") == "fail" for c in self.checks or [])


@dataclass
class ProfileSummary(Shape):
    ran: bool = False
    reason: Optional[str] = None


@dataclass
class PackageSummary(Shape):
    bundle: str = ""  # the bundle's folder
    manifest_sha256: Optional[str] = None


SHAPES = {"convert": ConvertSummary, "calibrate": CalibrateSummary, "sensitivity": SensitivitySummary,
          "build": BuildSummary, "tune": TuneSummary, "verify": VerifySummary, "profile": ProfileSummary,
          "package": PackageSummary}


def summary_of(stage: str, data: dict) -> Shape:
    """A stage's summary from its JSON (result.json, the stage cache)."""
    return SHAPES[stage].from_json(data)
