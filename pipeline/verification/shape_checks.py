"""verify's view of a dynamic-shape build (docs/targets.md, "Dynamic shapes"): accuracy
grouped by input shape, with each group's bucket (the range's min, opt or max, else the
data's own shape), and the shapes the latency curve is timed at."""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import numpy as np

from pipeline import shapes
from pipeline.verification.metrics import OutputStats

CURVE = ("min", "opt", "max")


class ShapeAccuracy:
    """Per-shape OutputStats of the shipped build against the reference, and one sample's
    feeds per shape (what the latency curve is timed on)."""

    def __init__(self, inputs: Sequence):
        self.inputs = list(inputs)
        self.active = any(spec.dynamic for spec in self.inputs)
        self.ranges = {spec.name: shapes.ShapeRange.from_json(spec.range) if spec.range else None
                       for spec in self.inputs if spec.dynamic}
        self.groups: Dict[str, Dict[str, OutputStats]] = {}
        self.counts: Dict[str, int] = {}
        self.feeds: Dict[str, dict] = {}

    def update(self, feeds: dict, expected: dict, actual: dict) -> None:
        if not self.active:
            return
        key = shapes.shape_key(feeds)
        self.counts[key] = self.counts.get(key, 0) + 1
        self.feeds.setdefault(key, feeds)
        stats = self.groups.setdefault(key, {})
        for name, value in actual.items():
            if name in expected:
                stats.setdefault(name, OutputStats()).update(expected[name], value)

    def result(self) -> Optional[List[dict]]:
        """One row per shape seen, smallest first: samples, buckets and each output's
        cosine and max |error|; None for a model without dynamic inputs."""
        if not self.active:
            return None
        rows = []
        for key in sorted(self.groups, key=_elements):
            found = {name: stats.result() for name, stats in self.groups[key].items()}
            rows.append({"shape": key, "buckets": shapes.bucket_names(key, self.ranges) or ["data"],
                         "samples": self.counts[key],
                         "outputs": {name: {"cosine": r["cosine"], "max_abs": r["max_abs"]}
                                     for name, r in found.items()}})
        return rows

    def curve_feeds(self, seed: int = 0) -> Dict[str, dict]:
        """{min, opt, max: feeds} to time: the range's shapes (a sample of that shape where the
        data has one, else seeded uniform values), or without a range the data's smallest,
        median and largest shapes. Empty for a static model."""
        if not self.active:
            return {}
        if self.ranges and all(found is not None for found in self.ranges.values()):
            return {which: self._at(which, seed) for which in CURVE}
        seen = sorted(self.feeds, key=_elements)
        if not seen:
            return {}
        picks = {"min": seen[0], "opt": seen[len(seen) // 2], "max": seen[-1]}
        return {which: self.feeds[key] for which, key in picks.items()}

    def _at(self, which: str, seed: int) -> dict:
        wanted = {spec.name: list(getattr(self.ranges[spec.name], which)) if spec.name in self.ranges else spec.shape
                  for spec in self.inputs}
        for feeds in self.feeds.values():
            if all(list(feeds[name].shape) == shape for name, shape in wanted.items()):
                return feeds
        rng = np.random.default_rng(seed)
        return {spec.name: rng.uniform(0.0, 1.0, wanted[spec.name]).astype(spec.dtype) for spec in self.inputs}


def _elements(key: str) -> int:
    total = 0
    for part in key.split(";"):
        dims = part.split("=", 1)[1]
        total += int(np.prod([int(d) for d in dims.split("x")])) if dims else 1
    return total
