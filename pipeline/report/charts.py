"""Chart layouts: where each bar, tick, line and point of a report chart goes.

The numbers are worked out here; the SVG itself is written by the macros of
pipeline/report/templates/charts.svg.j2 (``bar_chart``, ``line_chart``: a layout's
``kind`` names its macro). Values are formatted into text here too, so a template
only places finished strings. Missing or non-finite values are never drawn: a bar
chart shows them as empty bars labelled n/a, a line chart counts them in its subtitle.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, List, Optional, Sequence, Tuple

from pipeline.report.formatting import NA, finite, fmt_error, fmt_seconds, truncate

COMPUTED_COLOR = "#0969da"  # the series colour, and stages/layers computed in this run
CACHED_COLOR = "#8c959f"  # cached stages, layers the runtime added
CHAR_WIDTH = 7  # rough width of one 12px character, for layout only
MAX_POINTS = 300  # above this many points the line is drawn without a dot per point
MAX_FLAGGED = 300  # flagged (below-threshold) points drawn with a dot and a tooltip


def _nice_step(raw: float) -> float:
    exponent = math.floor(math.log10(raw))
    fraction = raw / 10 ** exponent
    for nice in (1, 2, 5):
        if fraction <= nice:
            return nice * 10 ** exponent
    return 10 * 10 ** exponent


def nice_ticks(lo: float, hi: float, count: int = 5, integer: bool = False) -> Tuple[list, float]:
    """Round tick values covering [lo, hi], and the step between them."""
    if hi < lo:
        lo, hi = hi, lo
    if hi - lo <= abs(hi) * 1e-12:
        pad = abs(hi) * 1e-3 or 1.0
        lo, hi = lo - pad, hi + pad
    step = _nice_step((hi - lo) / max(count - 1, 1))
    if integer:
        step = max(1.0, step)
    first = math.floor(lo / step + 1e-9)
    last = math.ceil(hi / step - 1e-9)
    return [k * step for k in range(first, last + 1)], step


def tick_labels(ticks: Sequence[float], step: float) -> List[str]:
    """Labels precise enough to tell neighbouring ticks apart."""
    biggest = max(abs(t) for t in ticks)
    smallest = min((abs(t) for t in ticks if t), default=0.0)
    if biggest < 1e6 and (smallest == 0.0 or smallest >= 1e-3):
        decimals = min(15, max(0, -math.floor(math.log10(step))))
        return [f"{t:.{decimals}f}" for t in ticks]
    digits = max(3, 1 + math.ceil(math.log10(biggest / step)))
    return [f"{t:.{digits}g}" for t in ticks]


# ---------------------------------------------------------------------------
# Bar chart


@dataclass
class Bar:
    y: int  # top edge
    label: str  # shortened to fit the label column
    width: float
    color: str
    value: str  # the formatted value, or n/a


@dataclass
class BarChart:
    """Horizontal bars, one per label; the value axis runs along x from ``label_w``."""
    title: str
    x_label: str
    width: int
    height: int
    label_w: int  # the label column left of the plot
    plot_w: int
    top: int  # the plot's top edge (below the title and the legend)
    axis_y: int  # the value axis
    bar_h: int
    bars: List[Bar]
    ticks: List[Tuple[float, str]]  # x, label
    legend: List[Tuple[int, str, str]] = field(default_factory=list)  # x, colour, text
    kind: ClassVar[str] = "bar_chart"


def bar_chart(labels: Sequence[str], values: Sequence[Any], *, title: str, x_label: str,
              colors: Optional[Sequence[str]] = None, legend: Sequence[Tuple[str, str]] = (),
              value_format: Callable[[Any], str] = fmt_seconds) -> BarChart:
    """One bar per label. ``colors`` gives one fill per bar; ``legend`` is a list of
    (colour, text). Missing or non-finite values are drawn as empty bars labelled n/a."""
    bar_h, gap, plot_w, value_w = 18, 8, 380, 70
    label_w = min(240, 16 + CHAR_WIDTH * max((len(str(label)) for label in labels), default=4))
    top = 34 + (22 if legend else 0)
    plot_h = len(labels) * (bar_h + gap) + gap
    numbers = [v if finite(v) and v > 0 else 0.0 for v in values]
    ticks, step = nice_ticks(0.0, max(numbers, default=0.0) or 1.0)

    def x_of(value: float) -> float:
        return label_w + value / ticks[-1] * plot_w

    bars = [Bar(y=top + gap + i * (bar_h + gap), label=truncate(str(label), (label_w - 16) // CHAR_WIDTH),
                width=x_of(numbers[i]) - label_w, color=colors[i] if colors and i < len(colors) else COMPUTED_COLOR,
                value=value_format(value) if finite(value) else NA)
            for i, (label, value) in enumerate(zip(labels, values))]
    return BarChart(title=title, x_label=x_label, width=label_w + plot_w + value_w, height=top + plot_h + 44,
                    label_w=label_w, plot_w=plot_w, top=top, axis_y=top + plot_h, bar_h=bar_h, bars=bars,
                    ticks=[(x_of(tick), text) for tick, text in zip(ticks, tick_labels(ticks, step))],
                    legend=[(label_w + i * 110, color, text) for i, (color, text) in enumerate(legend)])


# ---------------------------------------------------------------------------
# Line chart


@dataclass
class LineChart:
    """One series against its index or given x values, in a fixed 300 px high frame."""
    title: str
    subtitle: str  # the range, values not drawn, the threshold and points below it
    x_label: str
    y_label: str
    color: str
    width: int
    height: int
    left: int
    top: int
    plot_w: int
    plot_h: int
    y_ticks: List[Tuple[float, str]]  # y, label
    x_ticks: List[Tuple[float, str]]  # x, label
    line: str = ""  # the polyline's points, "x,y x,y ..."; empty without finite values
    dots: List[Tuple[float, float]] = field(default_factory=list)  # one per point, up to MAX_POINTS
    flagged: List[Tuple[float, float, str]] = field(default_factory=list)  # x, y, tooltip
    threshold: Optional[Tuple[float, float, str]] = None  # line y, label y, label
    mark: Optional[Tuple[float, str, str]] = None  # x, text anchor (start/end), label
    kind: ClassVar[str] = "line_chart"

    @property
    def bottom(self) -> int:
        return self.top + self.plot_h


@dataclass
class _Scale:
    """Maps data to pixels: x and y ranges (the outer ticks) onto the plot box."""
    x0: float
    x1: float
    y0: float
    y1: float
    left: int
    top: int
    plot_w: int
    plot_h: int

    def px(self, x: float) -> float:
        return self.left + (x - self.x0) / (self.x1 - self.x0) * self.plot_w

    def py(self, value: float) -> float:
        return self.top + self.plot_h - (value - self.y0) / (self.y1 - self.y0) * self.plot_h


def _finite_points(values: Sequence[Any], x_values: Optional[Sequence[Any]]) -> list:
    """(x, value, index) of every finite value; x is the index unless ``x_values`` has a finite one."""
    xs = [x_values[i] if x_values is not None and i < len(x_values) and finite(x_values[i]) else i
          for i in range(len(values))]
    return [(float(x), float(v), i) for i, (x, v) in enumerate(zip(xs, values)) if finite(v)]


def _subtitle(points: list, skipped: int, value_format: Callable[[Any], str], threshold: Any,
              threshold_label: str, flagged: Optional[list]) -> str:
    if points:
        y_values = [v for _, v, _ in points]
        text = f"range {value_format(min(y_values))} … {value_format(max(y_values))}"
    else:
        text = "no finite values"
    if skipped:
        text += f" · {skipped} non-finite not drawn"
    if finite(threshold):
        text += f" · {threshold_label} {value_format(threshold)}"
        if flagged is not None:
            text += f" · {len(flagged)} below"
    return text


def _ticks(points: list, count: int, include_zero: bool, use_x: bool) -> tuple:
    """Y and x ticks with their labels: y covers the values (and 0 with ``include_zero``),
    x the given x values or the indexes 0 .. count-1."""
    lo, hi = (min(v for _, v, _ in points), max(v for _, v, _ in points)) if points else (0.0, 1.0)
    if include_zero:
        lo, hi = min(lo, 0.0), max(hi, 0.0)
        if hi == lo:
            hi = 1.0
    y_ticks, y_step = nice_ticks(lo, hi)
    x_lo = min((x for x, _, _ in points), default=0.0) if use_x else 0.0
    x_hi = max((x for x, _, _ in points), default=0.0) if use_x else count - 1
    x_ticks, x_step = nice_ticks(min(x_lo, 0.0), max(x_hi, 1.0), integer=True)
    return (list(zip(y_ticks, tick_labels(y_ticks, y_step))), list(zip(x_ticks, tick_labels(x_ticks, x_step))))


def _threshold_line(scale: _Scale, threshold: Any, label: str,
                    value_format: Callable[[Any], str]) -> Optional[Tuple[float, float, str]]:
    """The dashed threshold line where it falls inside the plotted range, its label kept inside the plot."""
    if not (finite(threshold) and scale.y0 <= threshold <= scale.y1):
        return None
    y = scale.py(threshold)
    return y, (y + 15 if y < scale.top + scale.plot_h / 2 else y - 5), f"{label} {value_format(threshold)}"


def _marker(scale: _Scale, mark_x: Optional[Tuple[float, str]]) -> Optional[Tuple[float, str, str]]:
    if mark_x is None or not finite(mark_x[0]) or not scale.x0 <= mark_x[0] <= scale.x1:
        return None
    x = scale.px(mark_x[0])
    return x, ("start" if x < scale.left + scale.plot_w / 2 else "end"), truncate(str(mark_x[1]), 60)


def line_chart(values: Sequence[Any], *, title: str, x_label: str, y_label: str,
               value_format: Callable[[Any], str] = fmt_error, include_zero: bool = False,
               threshold: Any = None, threshold_label: str = "threshold",
               color: str = COMPUTED_COLOR, x_values: Optional[Sequence[Any]] = None,
               flag_below: bool = False, point_labels: Optional[Sequence[str]] = None,
               mark_x: Optional[Tuple[float, str]] = None, width: int = 520) -> LineChart:
    """Line/point chart of one series against its index (x = 0 .. n-1) or ``x_values``.

    Non-finite values are not drawn (their count is stated under the title). The
    threshold, if any, is stated under the title and, when it falls inside the plotted
    range, drawn as a dashed red line. ``flag_below`` draws the points under the
    threshold as red dots, with ``point_labels`` as their tooltips; ``mark_x`` =
    (x, label) draws a labelled vertical marker.
    """
    height, left, top = 300, 84, 48
    plot_w, plot_h = width - left - 16, height - top - 48
    points = _finite_points(values, x_values)
    below = [p for p in points if p[1] < threshold] if flag_below and finite(threshold) else None
    y_ticks, x_ticks = _ticks(points, len(values), include_zero, x_values is not None)
    scale = _Scale(x_ticks[0][0], x_ticks[-1][0], y_ticks[0][0], y_ticks[-1][0], left, top, plot_w, plot_h)
    chart = LineChart(
        title=title, x_label=x_label, y_label=y_label, color=color, width=width, height=height, left=left,
        top=top, plot_w=plot_w, plot_h=plot_h,
        subtitle=_subtitle(points, len(values) - len(points), value_format, threshold, threshold_label, below),
        y_ticks=[(scale.py(tick), text) for tick, text in y_ticks],
        x_ticks=[(scale.px(tick), text) for tick, text in x_ticks],
        threshold=_threshold_line(scale, threshold, threshold_label, value_format),
        mark=_marker(scale, mark_x))
    chart.line = " ".join(f"{scale.px(x):.1f},{scale.py(v):.1f}" for x, v, _ in points)
    if len(points) <= MAX_POINTS:
        chart.dots = [(scale.px(x), scale.py(v)) for x, v, _ in points]
    chart.flagged = [(scale.px(x), scale.py(v), point_labels[i] if point_labels is not None and i < len(point_labels)
                      else "") for x, v, i in (below or [])[:MAX_FLAGGED]]
    return chart
