"""``metric=embedding``: sentence embedders judged by their nearest neighbours.

For each validation sample, the other sample its embedding is nearest to (cosine
similarity, the sample itself excluded) under the build and under the fp32 reference:

- NN@1 agreement (the score, per sample 1 or 0): the build's nearest neighbour is the
  reference's, or one the reference ranks as near to within ``tie`` (a duplicate
  sentence; a larger ``tie`` forgives swaps among neighbours the reference hardly tells
  apart);
- recall@k (an extra, per sample): the share of the reference's k nearest neighbours
  found among the build's k nearest (k at most N - 1).

Neighbours exist only within a set, so the metric is set-level (``set_level``): parity
reduces each sample's output to a unit vector batch by batch (``features``: an output of
several vectors per sample, such as token embeddings [1, tokens, dim], is mean-pooled over
them) and scores the whole validation set once. The reference agrees with itself: its
score is 1 by definition, and the drop is 1 - agreement. numpy only; pipeline.embedding_metric,
its old path, re-exports it for older imports.
"""

from __future__ import annotations

from typing import Dict, Optional, Sequence, Tuple

import numpy as np

TIE = 1e-6  # reference similarities this close count as equally near (exact ties: duplicates)
ROWS = 256  # similarity rows computed at once: bounded memory on large validation sets


class Embedding:
    """Nearest-neighbour agreement of a build's embeddings with the reference's over the
    validation set (per sample 1/0), with recall@k as an extra. Needs no labels."""

    set_level = True

    def __init__(self, k: int = 5, tie: float = TIE):
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"metric.k={k!r}: the neighbours recall@k counts, an integer >= 1")
        if not 0 <= float(tie) < 1:
            raise ValueError(f"metric.tie={tie!r}: a cosine-similarity margin in [0, 1)")
        self.k, self.tie = k, float(tie)
        self._recent: Optional[tuple] = None  # (outputs, reference, result): score and extras share one search

    def __call__(self, outputs: np.ndarray, reference: np.ndarray, labels: Optional[Sequence]) -> np.ndarray:
        return self._neighbours(outputs, reference)[0]

    def extras(self, outputs: np.ndarray, reference: np.ndarray, labels: Optional[Sequence]) -> Dict[str, np.ndarray]:
        return {f"recall@{self.k}": self._neighbours(outputs, reference)[1]}

    @staticmethod
    def features(outputs: np.ndarray) -> np.ndarray:
        """Each sample's output as one unit vector (float64, [N, dim]): leading axes of 1
        dropped, several vectors per sample mean-pooled; a zero vector stays zero. Applied
        twice it gives the same vectors."""
        values = np.asarray(outputs, dtype=np.float64)
        values = values.reshape(len(values), 1) if values.ndim == 1 else values
        vectors = values.reshape(len(values), -1, values.shape[-1]).mean(axis=1)
        norms = np.linalg.norm(vectors, axis=1, keepdims=True)
        return vectors / np.where(norms > 0, norms, 1.0)

    def _neighbours(self, outputs: np.ndarray, reference: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """(NN@1 agreement, recall@k) per sample."""
        if self._recent is not None and self._recent[0] is outputs and self._recent[1] is reference:
            return self._recent[2]
        mine, theirs = self.features(outputs), self.features(reference)
        if len(mine) != len(theirs):
            raise ValueError(f"{len(mine)} outputs but {len(theirs)} reference outputs")
        if len(mine) < 2:
            raise ValueError("needs at least 2 validation samples: a sample's nearest neighbour is another sample")
        k = min(self.k, len(mine) - 1)
        first, recall = np.empty(len(mine)), np.empty(len(mine))
        for start in range(0, len(mine), ROWS):
            rows = slice(start, min(start + ROWS, len(mine)))
            own, expected = _similarities(mine, rows), _similarities(theirs, rows)
            broken = ~np.isfinite(own.max(axis=1))  # a NaN embedding has no neighbour: no agreement
            picked = own.argmax(axis=1)
            first[rows] = (expected[np.arange(len(own)), picked] >= expected.max(axis=1) - self.tie) & ~broken
            nearest = np.argpartition(-own, k - 1, axis=1)[:, :k]  # the build's k nearest, in any order
            kth = -np.partition(-expected, k - 1, axis=1)[:, k - 1]  # the reference's k-th similarity
            found = (np.take_along_axis(expected, nearest, axis=1) >= kth[:, np.newaxis] - self.tie).sum(axis=1)
            recall[rows] = np.where(broken, 0.0, found / k)
        self._recent = (outputs, reference, (first, recall))
        return first, recall


def _similarities(vectors: np.ndarray, rows: slice) -> np.ndarray:
    """Cosine similarities of the unit vectors in ``rows`` with every vector, each with
    itself at -inf (a sample is not its own neighbour); NaN (a broken build) as -inf."""
    found = vectors[rows] @ vectors.T
    found[np.isnan(found)] = -np.inf
    found[np.arange(found.shape[0]), np.arange(rows.start, rows.start + found.shape[0])] = -np.inf
    return found
