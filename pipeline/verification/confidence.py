"""How certain a task figure is: a 95 % paired bootstrap interval of the metric's drop
(reference vs build on the same validation samples), and how many samples would resolve
a drop whose interval reaches past the allowed one (docs/verify.md, "Task-first verdicts").

Paired: each resample draws sample indices once and aggregates both the reference's and
the build's scores on them, so what the two share (hard samples) cancels and the
interval is about the difference alone. Percentile interval, a fixed seed (the same
scores always give the same interval)."""

from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

import numpy as np

RESAMPLES = 1000
LEVEL = 0.95
SEED = 0


def drop_interval(reference: np.ndarray, target: np.ndarray, higher_is_better: bool,
                  aggregate: Optional[Callable[[np.ndarray], float]] = None,
                  weights: Optional[tuple] = None) -> Optional[list]:
    """[low, high] of the drop (reference - target where higher is better, else target -
    reference) at LEVEL; ``aggregate``: the metric's own (default: the mean); ``weights``:
    (reference's, target's) per-sample weights of a pooled metric (weighted means). None
    with fewer than two samples."""
    reference, target = np.asarray(reference, dtype=np.float64), np.asarray(target, dtype=np.float64)
    if len(reference) < 2 or len(reference) != len(target):
        return None
    if weights is not None:
        drops = _weighted(reference, target, *(np.asarray(w, dtype=np.float64) for w in weights))
    else:
        drops = _resampled(reference, target, aggregate)
    return _percentiles(drops * (1.0 if higher_is_better else -1.0))


def rate_interval(values: Sequence[float]) -> Optional[list]:
    """[low, high] of a per-sample rate's mean (e.g. top-1 agreement) at LEVEL."""
    values = np.asarray(values, dtype=np.float64)
    if len(values) < 2:
        return None
    return _percentiles(values[_indices(len(values))].mean(axis=1))


def samples_to_resolve(count: int, drop: float, high: float, max_drop: float) -> Optional[int]:
    """About how many samples would bring the interval's upper end down to ``max_drop``
    (its half-width shrinks as 1/sqrt(samples)); None when the point estimate itself
    does not pass."""
    room, half = max_drop - drop, high - drop
    if room <= 0 or half <= 0:
        return None
    return int(math.ceil(count * (half / room) ** 2))


def _resampled(reference: np.ndarray, target: np.ndarray, aggregate) -> np.ndarray:
    indices = _indices(len(reference))
    if aggregate is None:
        return reference[indices].mean(axis=1) - target[indices].mean(axis=1)
    return np.array([aggregate(reference[row]) - aggregate(target[row]) for row in indices])


def _weighted(reference: np.ndarray, target: np.ndarray, ref_weights: np.ndarray,
              target_weights: np.ndarray) -> np.ndarray:
    indices = _indices(len(reference))

    def means(scores, weights):
        total = weights[indices].sum(axis=1)
        plain = scores[indices].mean(axis=1)
        return np.where(total > 0, (scores * weights)[indices].sum(axis=1) / np.where(total > 0, total, 1), plain)

    return means(reference, ref_weights) - means(target, target_weights)


def _indices(count: int) -> np.ndarray:
    return np.random.default_rng(SEED).integers(0, count, size=(RESAMPLES, count))


def _percentiles(values: np.ndarray) -> list:
    tail = (1.0 - LEVEL) / 2 * 100
    low, high = np.percentile(values, [tail, 100 - tail])
    return [float(low), float(high)]
