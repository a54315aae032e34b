"""The task metric's drop of a candidate's stacked outputs against the float reference's, as
verify scores it: what the mixed search (stages/sensitivity.py) ranks and selects on."""

from __future__ import annotations

from typing import List, Optional, Tuple

import numpy as np

from pipeline.errors import ConfigError
from pipeline.task_metrics import load_metric, per_sample
from pipeline.verification.sample_groups import shape_of


class TaskDrop:
    """The task metric's drop (cfg.metric, as verify scores it) of outputs against the float
    reference outputs of the same ``count`` samples; None without a metric, or when it needs
    labels the samples lack and measures nothing without them (top1 without labels: the
    agreement with the reference's argmax, on class scores only). A pair metric (a
    detector's boxes and scores, metric.output naming two) reads both outputs, as verify
    hands them (TaskScorer.task_values)."""

    def __init__(self, cfg, output_names: List[str], reference: List[np.ndarray], labels, count: int):
        self.metric, self.labels, self.count = load_metric(cfg.metric), labels, count
        self.indices: Optional[Tuple[int, ...]] = None  # the outputs the metric reads, in graph order's places
        # a metric of the whole set (embedding's neighbours) needs two samples at least; the
        # search's samples are those of one input shape, which text of natural lengths may not have
        too_few = getattr(self.metric, "set_level", False) and count < 2
        if self.metric is not None and not too_few:
            names = self._names(cfg, output_names)
            indices = tuple(output_names.index(name) for name in names)
            # a metric that needs labels counts on samples without them only where it measures something
            # there, as verify scores it (top1 on class scores: the agreement with the reference's argmax)
            shape = shape_of(_first(self._read(reference, indices)))
            if labels is not None or not self.metric.needs_labels or self.metric.without_labels(shape, names[0]):
                self.indices = indices
        self.reference = reference
        # the reference's input once: a metric keeping its decoding by identity (detection) decodes it once
        self.theirs = None if self.indices is None else self._read(reference, self.indices)
        self.reference_value = self._value(reference)

    @property
    def index(self) -> Optional[int]:
        """The (first) output the metric reads; None: nothing is scored."""
        return None if self.indices is None else self.indices[0]

    def _names(self, cfg, output_names: List[str]) -> Tuple[str, ...]:
        """metric.output's names: a pair metric's two, else the one task output."""
        names = tuple(self.metric.names) if len(self.metric.names) > 1 else \
            (self.metric.output or cfg.validation.task_output or output_names[0],)
        for name in names:
            if name not in output_names:
                raise ConfigError(f"metric.output: the model has no output {name!r}; outputs: {', '.join(output_names)}")
        return names

    def _read(self, outputs: List[np.ndarray], indices: Tuple[int, ...]):
        """The metric's input of these outputs: [count, *output shape], a pair's as a tuple of two."""
        parts = tuple(per_sample(outputs[index], self.count) for index in indices)
        return parts[0] if len(parts) == 1 else parts

    def _value(self, outputs: List[np.ndarray]) -> Optional[float]:
        if self.indices is None:
            return None
        scores = self.metric(self._read(outputs, self.indices), self.theirs, self.labels)
        return self.metric.aggregate(scores)

    def __call__(self, outputs: List[np.ndarray]) -> Optional[float]:
        value = self._value(outputs)
        if value is None:
            return None
        return self.reference_value - value if self.metric.higher_is_better else value - self.reference_value


def _first(stacked):
    """The first sample of a stack (a pair's: of each of its two)."""
    return tuple(part[0] for part in stacked) if isinstance(stacked, tuple) else stacked[0]
