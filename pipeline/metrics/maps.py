"""``metric=map_iou``: segmentation and text detection, by the IoU of the binarized output
map with the reference's."""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np


class MapIoU:
    """Segmentation / text detection: IoU of the output map binarized at ``threshold``
    with the reference's map binarized the same way (both empty: 1). Needs no labels.
    Per page (default): the mean of the pages' IoUs, every page counts the same; ``pooled``:
    all intersections over all unions, a page counts by its area (the union-weighted mean
    of the pages' IoUs: ``weights``)."""

    def __init__(self, threshold: float = 0.3, pooled: bool = False):
        self.threshold, self.pooled = float(threshold), bool(pooled)

    def __call__(self, outputs: np.ndarray, reference: np.ndarray, labels: Optional[Sequence]) -> np.ndarray:
        both, union = self._areas(outputs, reference)
        return np.where(union > 0, both / np.maximum(union, 1), 1.0)

    def weights(self, outputs: np.ndarray, reference: np.ndarray, labels: Optional[Sequence]) -> Optional[np.ndarray]:
        """Each page's union when pooled (None: every page weighs the same)."""
        return self._areas(outputs, reference)[1].astype(np.float64) if self.pooled else None

    def _areas(self, outputs: np.ndarray, reference: np.ndarray) -> tuple:
        mine = outputs.reshape(len(outputs), -1) > self.threshold
        theirs = reference.reshape(len(reference), -1) > self.threshold
        return (mine & theirs).sum(axis=1), (mine | theirs).sum(axis=1)
