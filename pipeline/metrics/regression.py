"""``metric=regression``: numbers, by their absolute or squared error against numeric labels
(or the reference's output). Lower is better."""

from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np

from pipeline.metrics.base import MetricError


class Regression:
    """Numbers: per-sample mean absolute error (``statistic: mae``) or mean squared error
    aggregated as its root (``statistic: rmse``), against the label (a number) or, without
    labels, against the reference's output. Lower is better."""

    higher_is_better = False

    def __init__(self, statistic: str = "mae"):
        if statistic not in ("mae", "rmse"):
            raise MetricError(f"metric.statistic={statistic!r}; allowed: mae, rmse")
        self.statistic = statistic

    def __call__(self, outputs: np.ndarray, reference: np.ndarray, labels: Optional[Sequence]) -> np.ndarray:
        values = outputs.reshape(len(outputs), -1).astype(np.float64)
        if labels is not None:
            truth = np.asarray([_number(label) for label in labels])[:, np.newaxis]
        else:
            truth = reference.reshape(len(reference), -1).astype(np.float64)
        error = values - truth
        return np.mean(np.abs(error) if self.statistic == "mae" else error * error, axis=1)

    def aggregate(self, scores: np.ndarray) -> float:
        return float(np.mean(scores)) if self.statistic == "mae" else math.sqrt(float(np.mean(scores)))


def _number(label) -> float:
    try:
        return float(label)
    except (TypeError, ValueError):
        raise MetricError(f"label {label!r} is not a number") from None
