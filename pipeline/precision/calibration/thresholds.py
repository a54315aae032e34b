"""Clipping thresholds T from an AbsHistogram (symmetric INT8: scale = T / 127).

Every method returns at least MIN_THRESHOLD, and exactly that for a histogram with no
non-zero value, so a scale is never 0. docs/calibration.md gives the algorithms."""

from __future__ import annotations

import numpy as np

from pipeline.precision.calibration.histogram import AbsHistogram

# Floor for all-zero tensors: far below any useful activation range, yet T/127 and
# 127/T stay finite, normal float32 numbers.
MIN_THRESHOLD = 1e-8
# KL smoothing: empty bins of the candidate Q get this count before normalizing, the
# eps=1e-4 (in counts) of ONNX Runtime's and MXNet's smooth_distribution.
KL_SMOOTHING_EPS = 1e-4
# Rows of the (candidates x bins) KL matrices computed at once, bounding memory.
_KL_MATRIX_ELEMENTS = 1 << 21

METHODS = ("max", "percentile", "kl", "mse", "mean_min_max")


def max_threshold(h: AbsHistogram) -> float:
    return _floored(h.abs_max)


def percentile_threshold(h: AbsHistogram, percentile: float = 99.99) -> float:
    """The percentile of |x|: zeros are a point mass at 0, and inside the bin where the
    cumulative count crosses percentile/100 * count the value is interpolated linearly."""
    if not 0.0 < percentile <= 100.0:
        raise ValueError(f"percentile must be in (0, 100], got {percentile}")
    target = percentile / 100.0 * h.count
    if not h.has_nonzero or target <= h.zero_count:
        return MIN_THRESHOLD
    cumulative = np.cumsum(h.counts)
    crossing = int(np.searchsorted(cumulative, target, side="left"))
    below = int(cumulative[crossing - 1]) if crossing else h.zero_count
    inside = int(cumulative[crossing]) - below
    position = crossing + (target - below) / inside
    return _floored(min(position * h.width, h.abs_max))


def kl_threshold(h: AbsHistogram, quantized_levels: int = 128, step: int | None = None,
                 max_clipped: float | None = None) -> float:
    """TensorRT's entropy calibration (Migacz 2017) on the non-zero counts.

    Candidates keep the first i bins, i in range(quantized_levels, bins + 1, step); step
    defaults to quantized_levels (TensorRT's slides use step 1). The threshold is
    min(i * width, abs_max) for the i with the smallest KL(P || Q), the first on ties.
    With max_clipped, candidates that clip more than that fraction of the non-zero values
    are left out (the full range always stays a candidate)."""
    step = quantized_levels if step is None else step
    if quantized_levels < 2 or step < 1:
        raise ValueError(f"need quantized_levels >= 2 and step >= 1, got {quantized_levels}, {step}")
    if h.bins < quantized_levels:
        raise ValueError(f"a histogram of {h.bins} bins cannot hold {quantized_levels} levels")
    if not h.has_nonzero:
        return MIN_THRESHOLD
    counts = _nonzero_counts(h)
    sizes = np.arange(quantized_levels, h.bins + 1, step)
    rows = max(1, _KL_MATRIX_ELEMENTS // h.bins)
    divergences = np.concatenate([
        kl_divergences(counts, sizes[start:start + rows], quantized_levels)
        for start in range(0, sizes.size, rows)
    ])
    if max_clipped is not None:
        kept_mass = np.cumsum(counts)[sizes - 1]
        clipped = 1.0 - kept_mass / max(kept_mass[-1] if sizes[-1] == h.bins else counts.sum(), 1)
        divergences = np.where(clipped <= max_clipped, divergences, np.inf)
        if not np.isfinite(divergences).any():
            return _floored(h.abs_max)
    best = int(sizes[int(np.argmin(divergences))])
    return _floored(min(best * h.width, h.abs_max))


def kl_divergences(counts: np.ndarray, sizes: np.ndarray, levels: int) -> np.ndarray:
    """KL(P || Q) for each candidate size i (row), all bins at once (columns).

    P: counts[:i] with the outlier mass sum(counts[i:]) added to P[i-1].
    Q: counts[:i] summed in `levels` groups of i // levels bins (the last group also takes
    the remainder), each group's sum spread evenly over its non-empty bins; empty bins of
    Q get KL_SMOOTHING_EPS. Both are normalized to sum 1."""
    counts = np.asarray(counts, dtype=np.float64)
    sizes = np.asarray(sizes, dtype=np.int64)[:, None]
    column = np.arange(counts.size)[None, :]
    inside = column < sizes
    occupied = counts > 0
    merged = sizes // levels
    group = np.minimum(column // merged, levels - 1)
    start = group * merged
    stop = np.where(group == levels - 1, sizes, start + merged)
    cumulative = np.concatenate([[0.0], np.cumsum(counts)])
    cumulative_occupied = np.concatenate([[0], np.cumsum(occupied)])
    group_total = cumulative[stop] - cumulative[start]
    group_occupied = cumulative_occupied[stop] - cumulative_occupied[start]
    q = np.where(inside & occupied, group_total / np.maximum(group_occupied, 1), 0.0)
    q = np.where(inside & (q == 0.0), KL_SMOOTHING_EPS, q)
    p = np.where(inside, counts, 0.0)
    rows = np.arange(sizes.shape[0])
    p[rows, sizes[:, 0] - 1] += cumulative[-1] - cumulative[sizes[:, 0]]
    p /= p.sum(axis=1, keepdims=True)
    q /= q.sum(axis=1, keepdims=True)
    ratio = np.divide(p, q, out=np.ones_like(p), where=p > 0.0)  # terms with P = 0 are 0
    return (p * np.log(ratio)).sum(axis=1)


def mse_threshold(h: AbsHistogram, bits: int = 8, max_iter: int = 100) -> float:
    """OCTAV (Sakr et al. 2022): the fixed point of
        T <- sum_{c > T} n_c c / ( 4**-bits / 3 * sum_{c <= T} n_c + sum_{c > T} n_c )
    over bin centers c with non-zero counts n_c, which minimizes the expected squared error
        J(T) = 4**-bits / 3 * T**2 * sum_{c <= T} n_c + sum_{c > T} n_c (c - T)**2
    of a symmetric bits-bit quantizer. It starts from the mean of |x| over non-zero
    values (T_0 = abs_max would map to 0), and the result is kept only if J is lower
    than at abs_max."""
    if bits < 1 or max_iter < 1:
        raise ValueError(f"need bits >= 1 and max_iter >= 1, got {bits}, {max_iter}")
    if not h.has_nonzero:
        return MIN_THRESHOLD
    counts = _nonzero_counts(h).astype(np.float64)
    centers = np.minimum((np.arange(h.bins) + 0.5) * h.width, h.abs_max)
    noise = 4.0**-bits / 3.0
    threshold = float(counts @ centers / counts.sum())
    for _ in range(max_iter):
        clipped = centers > threshold
        denominator = noise * counts[~clipped].sum() + counts[clipped].sum()
        following = float(counts[clipped] @ centers[clipped] / denominator)
        converged = abs(following - threshold) <= 1e-6 * h.width
        threshold = following
        if converged:
            break
    threshold = min(threshold, h.abs_max)
    if _expected_error(counts, centers, threshold, noise) > _expected_error(counts, centers, h.abs_max, noise):
        threshold = h.abs_max
    return _floored(threshold)


def mean_min_max_threshold(h: AbsHistogram, sample_range=None) -> float:
    """NNCF/OpenVINO's mean_min_max range estimator: the larger magnitude of the mean over
    calibration samples of each sample's min and of each sample's max (statistics.py
    collects them in the streaming pass). A rare extreme sample widens the range by its
    share only. Without per-sample ranges (an imported or older table): abs_max."""
    if sample_range is None:
        return max_threshold(h)
    low, high = sample_range
    return _floored(min(max(abs(low), abs(high)), h.abs_max))


def compute(h: AbsHistogram, method: str, **options) -> float:
    functions = {"max": max_threshold, "percentile": percentile_threshold,
                 "kl": kl_threshold, "mse": mse_threshold, "mean_min_max": mean_min_max_threshold}
    if method not in functions:
        raise ValueError(f"unknown calibration method {method!r}; choose one of {', '.join(METHODS)}")
    return functions[method](h, **options)


def _nonzero_counts(h: AbsHistogram) -> np.ndarray:
    """The counts without the exact zeros: they quantize exactly and would otherwise
    dominate bin 0 (TPU-MLIR leaves them out of its histograms too)."""
    counts = h.counts.copy()
    counts[0] -= h.zero_count
    return counts


def _expected_error(counts: np.ndarray, centers: np.ndarray, threshold: float, noise: float) -> float:
    clipped = centers > threshold
    clipping = counts[clipped] @ (centers[clipped] - threshold) ** 2
    return float(clipping + noise * threshold**2 * counts[~clipped].sum())


def _floored(threshold: float) -> float:
    return max(float(threshold), MIN_THRESHOLD)
