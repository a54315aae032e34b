"""verify's view of a dynamic-shape build (docs/targets.md, "Dynamic shapes"): accuracy
grouped by input shape, with each group's bucket (the range's min, opt or max, else the
data's own shape), and the shapes the latency curve is timed at."""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence

import numpy as np

from pipeline import shapes
from pipeline.verification.metrics import OutputStats

CURVE = ("min", "opt", "max")


class ShapeAccuracy:
    """Per-shape OutputStats of the shipped build against the reference, and per shape the
    index of its first sample (what the latency curve re-reads and is timed on: holding a
    sample per shape would grow with data of many sizes)."""

    def __init__(self, inputs: Sequence):
        self.inputs = list(inputs)
        self.active = any(spec.dynamic for spec in self.inputs)
        self.ranges = {spec.name: shapes.ShapeRange.from_json(spec.range) if spec.range else None
                       for spec in self.inputs if spec.dynamic}
        self.groups: Dict[str, Dict[str, OutputStats]] = {}
        self.counts: Dict[str, int] = {}
        self.first: Dict[str, int] = {}  # shape -> index of its first sample
        self.sizes: Dict[str, int] = {}  # shape -> elements of a sample
        self.buckets: Dict[str, List[str]] = {}

    def update(self, index: int, feeds: dict, expected: dict, actual: dict) -> None:
        if not self.active:
            return
        key = shapes.shape_key(feeds)
        if key not in self.first:
            self.first[key], self.sizes[key] = index, shapes.elements(feeds)
            self.buckets[key] = shapes.bucket_names(feeds, self.ranges) or ["data"]
        self.counts[key] = self.counts.get(key, 0) + 1
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
        for key in sorted(self.groups, key=self.sizes.get):
            found = {name: stats.result() for name, stats in self.groups[key].items()}
            rows.append({"shape": key, "buckets": self.buckets[key], "samples": self.counts[key],
                         "outputs": {name: {"cosine": r["cosine"], "max_abs": r["max_abs"]}
                                     for name, r in found.items()}})
        return rows

    def first_feeds(self, read: Callable[[int], dict], last: Optional[dict]) -> List[dict]:
        """The first sample of each input shape seen (re-read with ``read(index)``); for a
        static model the last sample, where there was one."""
        if not self.active or not self.first:
            return [last] if last is not None else []
        return [read(index) for index in self.first.values()]

    def curve_feeds(self, read: Callable[[int], dict], seed: int = 0) -> Dict[str, dict]:
        """{min, opt, max: feeds} to time: the range's shapes (a sample of that shape where the
        data has one, re-read with ``read(index)``, else seeded uniform values), or without a
        range the data's smallest, median and largest shapes. Empty for a static model."""
        if not self.active or not self.first:
            return {}
        if all(found is not None for found in self.ranges.values()):
            return {which: self._at(which, read, seed) for which in CURVE}
        seen = sorted(self.first, key=self.sizes.get)
        picks = {"min": seen[0], "opt": seen[len(seen) // 2], "max": seen[-1]}
        return {which: read(self.first[key]) for which, key in picks.items()}

    def _at(self, which: str, read: Callable[[int], dict], seed: int) -> dict:
        held = next((key for key, names in self.buckets.items() if which in names), None)
        if held is not None:
            return read(self.first[held])
        rng = np.random.default_rng(seed)
        return {spec.name: rng.uniform(0.0, 1.0, getattr(self.ranges[spec.name], which) if spec.name in self.ranges
                                       else spec.shape).astype(spec.dtype) for spec in self.inputs}
