"""Samples whose outputs differ in shape (text-detector pages of several sizes, text lines
of several widths) cannot be stacked into one [N, *shape] array: the task metrics score
them in groups of one shape (pipeline/verification/scoring.py, TaskScorer) and put the groups'
values back in the samples' order here; per_sample and weighted_mean shape and pool
the stacked samples' values. A leaf module (numpy only)."""

from __future__ import annotations

from typing import Dict, List, Sequence

import numpy as np


def shape_groups(outputs: Sequence[np.ndarray], reference: Sequence[np.ndarray]) -> List[List[int]]:
    """The samples' indices grouped by (output shape, reference shape), first seen first:
    one group when every sample's outputs agree in shape (the usual case, one metric call)."""
    groups: Dict[tuple, List[int]] = {}
    for index, (mine, theirs) in enumerate(zip(outputs, reference)):
        groups.setdefault((shape_of(mine), shape_of(theirs)), []).append(index)
    return list(groups.values())


# A metric that reads two outputs (a detector's boxes and scores) gets each sample's as a
# tuple of two arrays, and a batch of them as a tuple of two stacks.

def shape_of(value) -> tuple:
    """One sample's output shape; a pair's: the two shapes."""
    if isinstance(value, tuple):
        return tuple(tuple(np.shape(part)) for part in value)
    return tuple(np.shape(value))


def count_of(batch) -> int:
    """The samples in a stacked batch (a pair: in its first stack)."""
    return len(batch[0]) if isinstance(batch, tuple) else len(batch)


def stack(values: Sequence):
    """The samples' outputs stacked on a new axis 0; pairs: a tuple of the two stacks."""
    if len(values) and isinstance(values[0], tuple):
        return tuple(np.stack(parts) for parts in zip(*values))
    return np.stack(values)


def in_order(parts: List[Dict[str, np.ndarray]], groups: List[List[int]]) -> Dict[str, np.ndarray]:
    """Per-group values (``parts[g][key]``: [len(groups[g]), ...]) as one array per key, in
    the samples' order. ValueError where the groups do not combine: a key some groups lack,
    or values whose shapes differ past axis 0."""
    if len(parts) == 1:
        return parts[0]
    if any(set(part) != set(parts[0]) for part in parts):
        raise ValueError("returned weights, extras or agreement for samples of some output shapes only")
    order = np.concatenate([np.asarray(group, dtype=np.int64) for group in groups])
    found = {}
    for key in parts[0]:
        shapes = {part[key].shape[1:] for part in parts}
        if len(shapes) > 1:
            raise ValueError(f"its {key} differ in shape as the samples' outputs do ({', '.join(map(str, shapes))}); "
                             "a set-level metric reduces every sample to one shape in features(outputs)")
        values = np.concatenate([part[key] for part in parts])
        found[key] = np.empty_like(values)
        found[key][order] = values
    return found


def weighted_mean(scores: np.ndarray, weights: np.ndarray) -> float:
    """A pooled metric's value: the weighted mean (the plain mean where nothing weighs)."""
    total = float(weights.sum())
    return float((scores * weights).sum() / total) if total > 0 else float(np.mean(scores))


def per_sample(batched: np.ndarray, count: int) -> np.ndarray:
    """Outputs of ``count`` samples concatenated on axis 0 (a batched run) as the
    interface's [N, *output shape] stack."""
    return batched.reshape(count, batched.shape[0] // count, *batched.shape[1:])
