"""A streaming histogram of |x| with a fixed number of bins and a range that grows by
doubling, so that calibration needs one pass over the data and O(bins) memory."""

from __future__ import annotations

import math

import numpy as np

DEFAULT_BINS = 2048
# The first non-zero batch sets width = max|x| / bins * FIRST_WIDTH_MARGIN: bins are
# half-open, so the margin puts max|x| inside the top bin instead of on its upper edge.
FIRST_WIDTH_MARGIN = 1.0 + 2.0**-12


class AbsHistogram:
    """Counts of |x| in ``bins`` equal bins [k*width, (k+1)*width), plus exact running
    min, max (signed), abs_max, count and zero_count. Exact zeros count in bin 0 and in
    zero_count. Invariant: every |x| seen is < width * bins."""

    def __init__(self, bins: int = DEFAULT_BINS):
        if bins < 2 or bins % 2:
            raise ValueError(f"bins must be an even number >= 2, got {bins}")
        self.bins = int(bins)
        self.counts = np.zeros(self.bins, dtype=np.int64)
        self.width = 0.0  # 0 until the first non-zero value
        self.min: float | None = None
        self.max: float | None = None
        self.abs_max = 0.0
        self.count = 0
        self.zero_count = 0

    @property
    def edges(self) -> np.ndarray:
        return np.arange(self.bins + 1, dtype=np.float64) * self.width

    @property
    def has_nonzero(self) -> bool:
        return self.abs_max > 0.0

    def fraction_above(self, threshold: float) -> float:
        """Share of the values with |x| > threshold (what a threshold clips), interpolated
        inside the bin the threshold falls in."""
        if self.count == 0 or self.width == 0.0 or threshold >= self.abs_max:
            return 0.0
        position = threshold / self.width
        whole = int(position)
        above = float(self.counts[whole + 1:].sum()) + float(self.counts[whole]) * (1.0 - (position - whole))
        return min(1.0, above / self.count)

    def update(self, values: np.ndarray, bounds: tuple = None) -> None:
        """Fold a batch in. Raises ValueError (and changes nothing) on NaN or Inf.

        Calibration pushes hundreds of millions of values through here, so the batch stays
        in its own float type and each pass over it is a single vectorized operation.
        ``bounds``: (min, max) of ``values`` when the caller has them already (one pass less)."""
        signed = np.asarray(values)
        if signed.dtype.kind != "f":
            signed = signed.astype(np.float64)
        signed = signed.ravel()
        if signed.size == 0:
            return
        low, high = bounds if bounds is not None else (float(signed.min()), float(signed.max()))
        low, high = float(low), float(high)  # NaN and Inf propagate here
        if not (math.isfinite(low) and math.isfinite(high)):
            bad = signed[~np.isfinite(signed)]
            raise ValueError(
                f"{bad.size} non-finite value(s) in a calibration batch "
                f"({int(np.isnan(bad).sum())} NaN, {int(np.isinf(bad).sum())} Inf)"
            )
        batch_max = max(-low, high)
        zeros = int(signed.size - np.count_nonzero(signed))
        if batch_max > 0.0:
            self._cover(batch_max)
            self.counts += self._bin_counts(signed)
        else:
            self.counts[0] += signed.size
        self._fold_stats(low, high, batch_max, signed.size, zeros)

    def merge(self, other: AbsHistogram) -> None:
        """Fold another histogram into this one (``bins`` stays this one's).

        Both are re-binned to a common width: the larger of the two widths, doubled until
        both abs_max fit. A histogram whose width is that width / 2**k is re-binned exactly
        by merging adjacent bins k times; any other ratio spreads each source bin's count
        over the target bins in proportion to overlap (linear interpolation of the
        cumulative counts, rounded to integers, so totals stay exact)."""
        if other.count == 0:
            return
        width = max(self.width, other.width)
        if width > 0.0:
            while max(self.abs_max, other.abs_max) >= width * self.bins:
                width *= 2.0
        self.counts = self._rebinned(width, self.bins) + other._rebinned(width, self.bins)
        self.width = width
        self._fold_stats(other.min, other.max, other.abs_max, other.count, other.zero_count)

    def summary(self) -> dict:
        return {"bins": self.bins, "width": self.width, "count": self.count,
                "zero_count": self.zero_count, "abs_max": self.abs_max}

    def to_json(self) -> dict:
        return {**self.summary(), "min": self.min, "max": self.max,
                "counts": [int(c) for c in self.counts]}

    @classmethod
    def from_json(cls, data: dict) -> AbsHistogram:
        histogram = cls(int(data["bins"]))
        counts = np.asarray(data["counts"], dtype=np.int64)
        if counts.shape != (histogram.bins,) or (counts < 0).any():
            raise ValueError(f"histogram JSON: expected {histogram.bins} non-negative counts")
        if int(counts.sum()) != int(data["count"]):
            raise ValueError("histogram JSON: counts do not add up to count")
        if not 0 <= int(data["zero_count"]) <= counts[0]:
            raise ValueError("histogram JSON: zero_count must be within the count of bin 0")
        if float(data["abs_max"]) >= float(data["width"]) * histogram.bins and data["abs_max"]:
            raise ValueError("histogram JSON: abs_max lies outside the bins")
        histogram.counts = counts
        histogram.width = float(data["width"])
        histogram.min = None if data["min"] is None else float(data["min"])
        histogram.max = None if data["max"] is None else float(data["max"])
        histogram.abs_max = float(data["abs_max"])
        histogram.count = int(data["count"])
        histogram.zero_count = int(data["zero_count"])
        return histogram

    def __eq__(self, other) -> bool:
        return isinstance(other, AbsHistogram) and self.to_json() == other.to_json()

    __hash__ = None

    def __repr__(self) -> str:
        return (f"AbsHistogram(bins={self.bins}, width={self.width!r}, count={self.count}, "
                f"abs_max={self.abs_max!r})")

    def _cover(self, magnitude: float) -> None:
        """Set or grow the range so that magnitude < width * bins."""
        if self.width == 0.0:
            # The floor keeps a subnormal max from making the width 0.
            self.width = max(magnitude / self.bins * FIRST_WIDTH_MARGIN, np.finfo(np.float64).tiny)
        while magnitude >= self.width * self.bins:
            self.counts = _merge_pairs(self.counts)
            self.width *= 2.0

    def _bin_counts(self, signed: np.ndarray) -> np.ndarray:
        scaled = np.abs(signed)
        if 1.0 / self.width > np.finfo(scaled.dtype).max / 2:  # tiny widths overflow float32
            scaled = scaled.astype(np.float64)
        scaled *= scaled.dtype.type(1.0 / self.width)
        # uint16 indices convert about twice as fast as int64 ones.
        index = scaled.astype(np.uint16 if self.bins < np.iinfo(np.uint16).max else np.int64)
        # A quotient rounded up to `bins` (a value just below the top edge) counts in the top
        # bin: folded after counting rather than clipped before (one pass less: 20 % of it).
        counts = np.bincount(index, minlength=self.bins + 1)
        counts[self.bins - 1] += counts[self.bins:].sum()
        return counts[:self.bins]

    def _fold_stats(self, low, high, abs_max, count, zero_count) -> None:
        self.min = low if self.min is None else min(self.min, low)
        self.max = high if self.max is None else max(self.max, high)
        self.abs_max = max(self.abs_max, abs_max)
        self.count += count
        self.zero_count += zero_count

    def _rebinned(self, width: float, bins: int) -> np.ndarray:
        """This histogram's counts on `bins` bins of `width` (>= self.width, covering abs_max)."""
        result = np.zeros(bins, dtype=np.int64)
        if self.width == 0.0 or width == self.width:
            if self.width == 0.0:
                result[0] = self.counts.sum()  # only zeros so far
            else:
                size = min(bins, self.bins)
                result[:size] = self.counts[:size]
            return result
        doublings = round(math.log2(width / self.width))
        if self.width * 2.0**doublings == width:
            counts = self.counts
            for _ in range(doublings):
                counts = _merge_pairs(counts)
            size = min(bins, counts.size)
            result[:size] = counts[:size]
            return result
        cumulative = np.concatenate([[0], np.cumsum(self.counts)]).astype(np.float64)
        target_edges = np.arange(bins + 1, dtype=np.float64) * width
        at_edges = np.rint(np.interp(target_edges, self.edges, cumulative)).astype(np.int64)
        at_edges[-1] = self.count  # interpolated mass past the top edge goes in the last bin
        return np.diff(at_edges)


def _merge_pairs(counts: np.ndarray) -> np.ndarray:
    """counts[i] = old[2i] + old[2i+1], padded with zeros back to the same length."""
    padded = counts if counts.size % 2 == 0 else np.append(counts, 0)
    merged = padded.reshape(-1, 2).sum(axis=1)
    return np.concatenate([merged, np.zeros(counts.size - merged.size, dtype=counts.dtype)])
