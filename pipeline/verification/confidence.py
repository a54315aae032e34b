"""How certain a task figure is: a 95 % paired bootstrap interval of the metric's drop
(reference vs build on the same validation samples), and how many samples would resolve
a drop whose interval reaches past the allowed one (docs/verify.md, "Task-first verdicts").

Paired: each resample draws sample indices once and aggregates both the reference's and
the build's scores on them, so what the two share (hard samples) cancels and the
interval is about the difference alone. Percentile interval, a fixed seed (the same
scores always give the same interval).

A bootstrap cannot see what the sample never showed: 20 samples that all agree give
[0, 0]. Next to it, the disagreement rate (the share of samples whose decision differs
from the reference's) gets an exact Clopper-Pearson interval, honest at zero and few
events (0 of 20: up to 0.168), and the drop a bound from it (``disagreement``); a passing
drop is resolved only when both stay within the allowed one (``resolution``)."""

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


# --- counts: the disagreement rate's exact interval -------------------------------------

MAX_SAMPLES = 10 ** 8  # beyond this no sample count "resolves" a drop


def clopper_pearson(count: float, samples: float, level: float = LEVEL) -> list:
    """[low, high] of a rate seen ``count`` times in ``samples`` at ``level`` (two-sided,
    exact: the beta quantiles of the binomial; 0 of n: high = 1 - ((1 - level) / 2) ** (1 / n))."""
    tail = (1.0 - level) / 2
    if samples <= 0:
        return [0.0, 1.0]
    low = 0.0 if count <= 0 else (tail ** (1.0 / samples) if count >= samples
                                  else beta_quantile(tail, count, samples - count + 1))
    high = 1.0 if count >= samples else (1.0 - tail ** (1.0 / samples) if count <= 0
                                         else beta_quantile(1.0 - tail, count + 1, samples - count))
    return [float(low), float(high)]


def t_quantile(level: float, df: int) -> float:
    """t with P(|T| <= t) = ``level`` for Student's t of ``df`` degrees of freedom: from
    P(|T| > t) = I_{df / (df + t^2)}(df / 2, 1 / 2)."""
    x = beta_quantile(1.0 - level, df / 2, 0.5)
    return math.sqrt(df * (1.0 - x) / x)


def beta_quantile(q: float, a: float, b: float) -> float:
    """x with I_x(a, b) = q, by bisection (I rises with x) to 1e-14."""
    low, high = 0.0, 1.0
    while high - low > 1e-14:
        middle = (low + high) / 2
        low, high = (middle, high) if regularized_beta(middle, a, b) < q else (low, middle)
    return (low + high) / 2


def regularized_beta(x: float, a: float, b: float) -> float:
    """I_x(a, b), the beta distribution's CDF: x^a (1-x)^b / (a B(a, b)) times its continued
    fraction (DLMF 8.17.22), which converges fast below x = (a + 1) / (a + b + 2); above,
    1 - I_{1-x}(b, a)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    if x > (a + 1.0) / (a + b + 2.0):
        return 1.0 - regularized_beta(1.0 - x, b, a)
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    return front / a / _fraction(x, a, b)


def _fraction(x: float, a: float, b: float) -> float:
    """1 + d1 / (1 + d2 / (1 + ...)) by the modified Lentz method; d(2m+1) = -(a+m)(a+b+m)x /
    ((a+2m)(a+2m+1)), d(2m) = m(b-m)x / ((a+2m-1)(a+2m))."""
    tiny = 1e-300
    value, c, d = 1.0, 1.0, 0.0
    for k in range(1, 100000):
        m = k // 2
        term = (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)) if k % 2 == 0
                else -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)))
        d = 1.0 + term * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + term / c
        c = c if abs(c) > tiny else tiny
        value *= c * d
        if abs(c * d - 1.0) < 1e-15:
            break
    return value


def disagreement(reference: np.ndarray, target: np.ndarray, agreement: Optional[np.ndarray], drop: float,
                 max_drop: float) -> Optional[dict]:
    """The disagreement rate's Clopper-Pearson interval and the bound it puts on the drop.

    A disagreement: a sample whose ``agreement`` with the reference (the metric's own, e.g.
    top-1's class kept) is broken; a metric with none whose per-sample scores are all 0 or
    1: a sample whose score changed. Samples that agree must score alike (else None: no
    bound follows), and one that disagrees moves the drop by at most ``span`` / n (1 for
    scores in [0, 1], else the scores' range). The drop's upper end by counts is the drop
    plus the rate's upper margin (high - rate) times ``span``: at zero disagreements the
    drop is 0 and the bound the rate's upper end exactly; at many, about the bootstrap's.
    None where a metric has neither, or for fewer than one sample."""
    reference, target = np.asarray(reference, dtype=np.float64), np.asarray(target, dtype=np.float64)
    if len(reference) < 1 or len(reference) != len(target):
        return None
    scores = np.concatenate([reference, target])
    binary = bool(np.all((scores == 0.0) | (scores == 1.0)))
    if agreement is not None and len(agreement) == len(reference):
        agree, by = np.asarray(agreement, dtype=np.float64) >= 1.0, "agreement"
    elif agreement is None and binary:
        agree, by = reference == target, "scores"
    else:
        return None
    if np.any(reference[agree] != target[agree]):
        return None
    span = 1.0 if scores.min() >= 0.0 and scores.max() <= 1.0 else float(scores.max() - scores.min())
    count, samples = int(np.count_nonzero(~agree)), len(agree)
    low, high = clopper_pearson(count, samples)
    bound = float(drop + span * (high - count / samples))
    resolved = bound <= max_drop + 1e-12
    return {"method": "clopper-pearson", "by": by, "count": count, "samples": samples, "rate": count / samples,
            "interval": [low, high], "span": span, "drop_high": bound, "resolved": resolved,
            "samples_to_resolve": None if resolved else counted_samples(drop, count / samples, max_drop, span)}


def counted_samples(drop: float, rate: float, max_drop: float, span: float = 1.0) -> Optional[int]:
    """The fewest samples whose counts bound, at the same disagreement rate and drop, is
    within ``max_drop`` (0 disagreements: the n with span * (1 - ((1 - LEVEL) / 2) ** (1 / n))
    <= max_drop - drop, 368 for a point); None when no count up to MAX_SAMPLES does."""
    room = (max_drop - drop) / span if span > 0 else 0.0
    if room <= 0:
        return None
    if rate <= 0:
        return int(math.ceil(math.log((1.0 - LEVEL) / 2) / math.log1p(-room))) if room < 1 else 1

    def fits(samples: int) -> bool:
        return clopper_pearson(rate * samples, samples)[1] - rate <= room + 1e-12

    high = 1
    while not fits(high):
        if high >= MAX_SAMPLES:
            return None
        high *= 2
    low = high // 2  # does not fit (or 0)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if fits(middle) else (middle, high)
    return high


def resolution(drop: float, max_drop: float, samples: int, interval: Optional[list],
               counts: Optional[dict]) -> dict:
    """Whether a passing drop is resolved: ``uncertain`` when the bootstrap interval's upper
    end or the counts bound (``disagreement``) is past ``max_drop``; ``samples_to_resolve``
    the larger of the two estimates (None when either has none). A limit of 0 (fp32's)
    asks for no change on these samples, which no count can bound a rate to: there the
    counts bound is reported but the bootstrap alone decides."""
    needed = []
    if interval and interval[1] > max_drop + 1e-12:
        needed.append(samples_to_resolve(samples, drop, interval[1], max_drop))
    if counts and not counts["resolved"] and max_drop > 0:
        needed.append(counts["samples_to_resolve"])
    if not needed:
        return {"uncertain": False}
    return {"uncertain": True, "samples_to_resolve": None if None in needed else max(needed)}
