"""Calibration tables: parity's model and its exports.

A table is ``dict[str, dict]``: tensor name -> {"threshold": T, "min": signed min,
"max": signed max, "method": name} plus, when built from a histogram, "histogram":
{"bins", "width", "count", "zero_count", "abs_max"}. INT8 scale = T / 127.

Formats written by ``write_exports``:

- ``calibration_table.txt``, TPU-MLIR's table (run_calibration.py writes it,
  model_deploy.py --calibration_table reads it): ``#`` comment lines, the header
  ``# op_name    threshold    min    max``, then one ``name threshold min max`` row per
  tensor, separated by spaces. TPU-MLIR prints ``%.7f``; parity prints the shortest
  repr that round-trips, without ``+`` in exponents (``1e-08``, ``1e30``), because
  TPU-MLIR's row pattern ``\\S+\\s+[-0-9.e]+\\s+[-0-9.e]+\\s+[-0-9.e]+`` silently skips a
  row with a ``+``. Comment lines containing ``#weight_scale``, ``#int4_th``,
  ``#tpu-mlir-fp8``, ``mqbench-fp8``, ``asym_op`` or ``int4_op`` start sections that
  are not INT8 thresholds; any other comment returns to the INT8 section (as in
  TPU-MLIR's ImportCalibrationTable pass). The reader keeps the INT8 section only.
- ``ort_calibration.json``: the JSON ONNX Runtime's
  ``quant_utils.write_calibration_table`` writes to ``calibration.json`` for a
  ``TensorsData``: ``{"CLS": "TensorsData", "data": {name: {"lowest": A, "highest": A,
  "CLS": "TensorData"}}, "calibration_method": {"CLS": "CalibrationMethod", "value":
  "CalibrationMethod.<Name>"}}`` with A = ``{"data": float, "dtype": "float32", "CLS":
  "numpy.array"}``; ``onnxruntime.quantization.calibrate.TensorsData.from_dict`` and
  ``load_tensors_data`` read it back. highest = T, lowest = -T, or 0 for a tensor
  whose min is >= 0 (TPU-MLIR's rule for symmetric tables).
- ``calibration.cache``: the plain text ORT writes next to it for TensorRT: one
  ``name value`` line per tensor, sorted by name, value = ``str(max(highest, lowest))``
  of the float32 numbers, i.e. Python's repr of T rounded to float32.
"""

from __future__ import annotations

import json
import math
import numbers
import re
from pathlib import Path
from typing import List, Mapping

import numpy as np

from pipeline.artifacts import atomic_write_bytes
from pipeline.precision.calibration.histogram import AbsHistogram
from pipeline.precision.calibration.thresholds import compute

Table = dict[str, dict]

TPU_MLIR_FILE = "calibration_table.txt"
ORT_JSON_FILE = "ort_calibration.json"
ORT_CACHE_FILE = "calibration.cache"

TPU_MLIR_HEADER = "# op_name    threshold    min    max"
TPU_MLIR_METHOD_PREFIX = "# quantization threshold calculation method:"
UNKNOWN_METHOD = "unknown"
_TPU_MLIR_OTHER_SECTIONS = ("#weight_scale", "#int4_th", "#tpu-mlir-fp8", "mqbench-fp8", "asym_op", "int4_op")

# parity method -> ORT CalibrationMethod; a table of several methods, or of "mse" (no
# ORT counterpart), is labelled MinMax: ORT's quantizer reads only lowest/highest.
_ORT_METHODS = {"max": "MinMax", "percentile": "Percentile", "kl": "Entropy"}


def table_entry(h: AbsHistogram, method: str, **options) -> dict:
    threshold = compute(h, method, **options)
    low, high = options.get("sample_range") or (h.min, h.max)  # mean_min_max: the mean per-sample range
    return {
        "threshold": threshold,
        "min": 0.0 if low is None else low,
        "max": 0.0 if high is None else high,
        "method": method,
        "clipped": h.fraction_above(threshold),  # share of calibration values beyond the threshold
        "histogram": h.summary(),
    }


def build_table(histograms: Mapping[str, AbsHistogram], method: str, **options) -> Table:
    return {name: table_entry(h, method, **options) for name, h in histograms.items()}


def check_entry(name: str, entry: Mapping) -> None:
    """Raise ValueError unless threshold >= 0 and min <= max are finite numbers.
    (0 is accepted because TPU-MLIR writes it for all-zero tensors.)"""
    values = {key: entry.get(key) for key in ("threshold", "min", "max")}
    for key, value in values.items():
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise ValueError(f"tensor {name!r}: {key} must be a finite number, got {value!r}")
    if values["threshold"] < 0:
        raise ValueError(f"tensor {name!r}: negative threshold {values['threshold']!r}")
    if values["min"] > values["max"]:
        raise ValueError(f"tensor {name!r}: min {values['min']!r} > max {values['max']!r}")


def to_tpu_mlir(table: Mapping[str, Mapping]) -> str:
    lines = ["# parity calibration table"]
    methods = {entry.get("method") for entry in table.values()}
    if len(methods) == 1 and None not in methods:
        lines.append(f"{TPU_MLIR_METHOD_PREFIX} {methods.pop()}")
    lines.append(TPU_MLIR_HEADER)
    for name, entry in table.items():
        _check_tpu_mlir_name(name)
        check_entry(name, entry)
        numbers = (_format_number(entry[key]) for key in ("threshold", "min", "max"))
        lines.append(" ".join([name, *numbers]))
    return "\n".join(lines) + "\n"


def from_tpu_mlir(text: str) -> Table:
    """Read the INT8 section; the method comes from the method header, else "unknown"."""
    method = UNKNOWN_METHOD
    in_int8_section = True
    rows: dict[str, tuple[float, float, float]] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line:
            continue
        if line.startswith("#"):
            in_int8_section = not any(marker in line for marker in _TPU_MLIR_OTHER_SECTIONS)
            if line.startswith(TPU_MLIR_METHOD_PREFIX):
                method = line[len(TPU_MLIR_METHOD_PREFIX):].strip() or UNKNOWN_METHOD
            continue
        if in_int8_section:
            name, values = _parse_row(line, number)
            if name in rows:
                raise ValueError(f"line {number}: tensor {name!r} appears twice")
            rows[name] = values
    return {name: {"threshold": t, "min": low, "max": high, "method": method}
            for name, (t, low, high) in rows.items()}


def to_ort_calibration_cache(table: Mapping[str, Mapping]) -> dict:
    """The document ORT's write_calibration_table writes to calibration.json."""
    data = {}
    for name, entry in table.items():
        check_entry(name, entry)
        lowest, highest = _ort_range(name, entry)
        data[name] = {"lowest": _ort_array(lowest), "highest": _ort_array(highest), "CLS": "TensorData"}
    return {
        "CLS": "TensorsData",
        "data": data,
        "calibration_method": {"CLS": "CalibrationMethod", "value": f"CalibrationMethod.{_ort_method(table)}"},
    }


def to_ort_cache_text(table: Mapping[str, Mapping]) -> str:
    """calibration.cache exactly as ORT's write_calibration_table writes it."""
    lines = []
    for name in sorted(table):
        check_entry(name, table[name])
        lowest, highest = _ort_range(name, table[name])
        lines.append(f"{name} {max(float(highest), float(lowest))}\n")
    return "".join(lines)


def write_exports(table: Mapping[str, Mapping], folder: Path) -> dict[str, Path]:
    """Write the three formats into folder; returns {format: path}. Every file is
    rendered before any is written, so a table that one format rejects writes none."""
    texts = {
        "tpu_mlir": (TPU_MLIR_FILE, to_tpu_mlir(table)),
        "ort_json": (ORT_JSON_FILE, json.dumps(to_ort_calibration_cache(table))),
        "ort_cache": (ORT_CACHE_FILE, to_ort_cache_text(table)),
    }
    written = {}
    for kind, (file_name, text) in texts.items():
        path = Path(folder) / file_name
        atomic_write_bytes(path, lambda temp, text=text: temp.write_bytes(text.encode()))
        written[kind] = path
    return written


def _check_tpu_mlir_name(name: str) -> None:
    if not name or re.search(r"\s", name) or name.startswith("#"):
        raise ValueError(f"tensor name {name!r} cannot be written to a TPU-MLIR table "
                         "(empty, contains whitespace, or starts with '#')")


def _format_number(value: float) -> str:
    return repr(float(value)).replace("e+", "e")


def _parse_row(line: str, number: int) -> tuple[str, tuple[float, float, float]]:
    fields = line.split()
    if len(fields) != 4:
        raise ValueError(f"line {number}: expected 'op_name threshold min max', got {line!r}")
    try:
        values = tuple(float(field) for field in fields[1:])
    except ValueError:
        raise ValueError(f"line {number}: threshold, min and max must be numbers, got {line!r}") from None
    try:
        check_entry(fields[0], dict(zip(("threshold", "min", "max"), values)))
    except ValueError as error:
        raise ValueError(f"line {number}: {error}") from None
    return fields[0], values


def _ort_range(name: str, entry: Mapping) -> tuple[np.float32, np.float32]:
    highest = np.float32(entry["threshold"])
    if not np.isfinite(highest):
        raise ValueError(f"tensor {name!r}: threshold {entry['threshold']!r} overflows float32")
    lowest = -highest if entry["min"] < 0 else np.float32(0.0)
    return lowest, highest


def _ort_array(value: np.float32) -> dict:
    return {"data": float(value), "dtype": "float32", "CLS": "numpy.array"}


def _ort_method(table: Mapping[str, Mapping]) -> str:
    methods = {_ORT_METHODS.get(entry.get("method")) for entry in table.values()}
    return methods.pop() if len(methods) == 1 and None not in methods else "MinMax"


def to_tpu_mlir_qtable(float_ops: List[str]) -> str:
    """TPU-MLIR's quantize table: one 'op_name mode' row per op kept in float."""
    return "# op_name quantize_mode\n" + "".join(f"{op} F32\n" for op in float_ops)


def from_tpu_mlir_qtable(text: str) -> List[str]:
    ops = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        fields = line.split()
        if len(fields) != 2:
            raise ValueError(f"line {number}: expected 'op_name quantize_mode', got {line!r}")
        if fields[1].upper() in ("F32", "F16", "BF16"):
            ops.append(fields[0])
    return ops
