"""Value formatting shared by the report's sections: numbers, shapes, hashes and names as
short text. Every function takes whatever the report dict holds (None, NaN, a string
where a number was expected) and returns text; none of them raises."""

from __future__ import annotations

import json
import math
from typing import Any, Callable, List, Sequence, Tuple

NA = "n/a"


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def fmt_number(value: Any, spec: str) -> str:
    if value is None:
        return NA
    if not is_number(value):
        return str(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "∞" if value > 0 else "-∞"
    return format(value, spec)


def fmt_cosine(value: Any) -> str:
    return fmt_number(value, ".6f")


def fmt_error(value: Any) -> str:
    return fmt_number(value, ".3g")


def fmt_seconds(value: Any) -> str:
    return fmt_number(value, ".2f")


def fmt_ratio(value: Any) -> str:
    return fmt_number(value, ".4f")


def fmt_interval(value: Any) -> str:
    """A [low, high] interval (the task metric drop's bootstrap interval)."""
    if not isinstance(value, (list, tuple)) or len(value) != 2 or not all(is_number(v) for v in value):
        return NA
    return f"[{fmt_number(value[0], '.4f')}, {fmt_number(value[1], '.4f')}]"


def fmt_sqnr(value: Any) -> str:
    """SQNR in dB; None means the outputs were identical (infinite SQNR)."""
    if value is None:
        return "∞ (identical)"
    return fmt_number(value, ".1f")


def fmt_value(value: Any) -> str:
    """Any JSON-able value as short text (options, versions, ...)."""
    if value is None:
        return NA
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    if is_number(value):
        return str(value)
    return json.dumps(value, sort_keys=True, ensure_ascii=False, default=str)


def fmt_shape(shape: Any) -> str:
    if shape is None:
        return "?"
    if isinstance(shape, (list, tuple)):
        return "[" + ", ".join("?" if d is None else str(d) for d in shape) + "]"
    return str(shape)


def fmt_from_to(value: Any, fmt: Callable[[Any], str] = fmt_value) -> str:
    """``{"from": a, "to": b}`` as ``a → b`` (or ``b (unchanged)``)."""
    if not isinstance(value, dict):
        return fmt(value)
    before, after = value.get("from"), value.get("to")
    if before == after:
        return f"{fmt(after)} (unchanged)"
    return f"{fmt(before)} → {fmt(after)}"


def fmt_yes_no(value: Any) -> str:
    if value is None:
        return NA
    return "yes" if value else "no"


def fmt_pass(value: Any) -> str:
    if value is None:
        return NA
    return "PASS" if value else "FAIL"


def short_hash(value: Any, length: int = 12) -> str:
    if not value:
        return NA
    text = str(value)
    return text if len(text) <= length else text[:length] + "…"


def as_dict(value: Any) -> dict:
    return value if isinstance(value, dict) else {}


def as_list(value: Any) -> list:
    return list(value) if isinstance(value, (list, tuple)) else []


def finite(value: Any) -> bool:
    return is_number(value) and math.isfinite(value)


# A table column: its header, the key of its value in a row's record, and that value's formatter.
Column = Tuple[str, str, Callable[[Any], str]]


def column_headers(columns: Sequence[Column]) -> List[str]:
    return [header for header, _, _ in columns]


def fmt_cells(record: dict, columns: Sequence[Column]) -> List[str]:
    """One table row: each column's value in ``record``, formatted. A key the record lacks
    is n/a, which only fmt_sqnr tells apart from a None value (None: identical outputs)."""
    return [fmt(record[key]) if key in record else NA for _, key, fmt in columns]



# ---------------------------------------------------------------------------
# Names, devices, layer times

FIRST_NAMES = 10  # names listed for long tensor lists (the rest is counted)
STDERR_LINES = 40  # last lines of a backend's stderr shown in the report
STDERR_WIDTH = 300  # characters per stderr line


def first_names(names: Any) -> str:
    names = [str(n) for n in as_list(names)]
    if not names:
        return "0"
    shown = ", ".join(names[:FIRST_NAMES])
    more = f", … (+{len(names) - FIRST_NAMES} more)" if len(names) > FIRST_NAMES else ""
    return f"{len(names)}: {shown}{more}"


def fmt_attribute(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(fmt_value(v) for v in value) + "]"
    return fmt_value(value)


def fmt_device(found: dict) -> str:
    """The device that ran, saying what a Vulkan device really is (Mesa's lavapipe is a CPU)."""
    device = fmt_value(found.get("device"))
    name, kind = found.get("device_name"), found.get("device_type")
    if not name and not kind:
        return device
    if kind == "CPU":
        return f"{device} on {name or 'a CPU device'}, a driver that computes on the CPU (not a GPU)"
    return f"{device} on {name or 'an unnamed device'}" + (f" ({kind})" if kind else "")


def fmt_ms(value: Any) -> str:
    return fmt_number(value, ".4f")


def fmt_share(value: Any) -> str:
    return f"{value * 100:.1f}%" if finite(value) else NA



def truncate(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:max(limit - 1, 1)] + "…"

