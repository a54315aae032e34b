"""The task metrics' interface and its wrapper: what a metric is called with, what it
declares, and ``TaskMetric``, a metric as parity uses it (checked scores, one-line errors).

The interface (docs/metrics.md), the same for the built-ins and for user code::

    metric(outputs, reference, labels) -> per-sample scores, shape [N]

``outputs`` and ``reference`` are one model output (``metric.output``, default the first)
for a batch of N validation samples, stacked on a new axis 0 (shape [N, *output shape]; a
metric naming two outputs, a detector's boxes and scores: a tuple of the two stacks);
``labels`` is the list of the N samples' labels from labels.csv (an int, a str or a
float each), or None when the split has none. parity aggregates the scores (their mean,
or the metric's ``aggregate``) for the reference (``metric(reference, reference, labels)``)
and for each build, and gates on the drop. A metric declares ``higher_is_better``
(default True) and ``needs_labels`` (default False); it may define ``decode(output)`` (one
sample's output as text: ``parity-bundle run`` prints it), ``agreement(outputs,
reference)`` (per-sample 0/1: the build's prediction equals the reference's),
``extras(outputs, reference, labels)`` (named secondary per-sample scores, reported) and,
for a metric that needs labels, ``without_labels(shape, output)`` (what it measures on a
split without labels for one sample's output of that shape and name, called then with
labels None, its scores the agreement with the reference; None: nothing. top1: on class
scores), and ``records(outputs, reference, labels)`` (one object per sample, or None) with
``set_extras(records)`` (figures of the whole set from every sample's record, reported
beside the extras: detection's mAPs against box labels), and ``describe(shape)`` (what it
reads on the first sample's output of that shape, reported as the task's ``format``:
detection's head).
A ``set_level`` metric (nearest neighbours: pipeline/metrics/embedding.py) is called once on
every sample's ``features``. Samples whose outputs differ in shape are scored per shape.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import numpy as np

from pipeline.errors import ConfigError
from pipeline.verification.sample_groups import count_of

# read by parity, not passed to the metric
PARITY_KEYS = ("output", "path", "higher_is_better", "needs_labels", "set_level", "name")
CHARSET_FILE = "charset.txt"  # in a bundle
BATCH = 16  # samples per metric call during verify: bounded memory for large outputs


class MetricError(ConfigError):
    label = "metric error"


@dataclass
class TaskMetric:
    """A metric as parity uses it: the user's callable and what it declares."""

    name: str
    score: Callable[..., Any]
    output: Optional[str] = None
    higher_is_better: bool = True
    needs_labels: bool = False
    config: Dict[str, Any] = field(default_factory=dict)
    set_level: bool = False  # scored once on the whole set (nearest neighbours), not in batches
    names: Tuple[str, ...] = ()  # metric.output's names: one, or two for a pair (a detector's boxes and scores)

    def aggregate(self, scores: np.ndarray) -> float:
        own = getattr(self.score, "aggregate", None)
        return float(own(scores)) if own else float(np.mean(scores))

    def hook(self, name: str) -> Optional[Callable]:
        """The metric's optional ``decode``, ``agreement``, ``extras`` or ``without_labels``."""
        return getattr(self.score, name, None)

    def without_labels(self, shape: Sequence[int], output: str) -> Optional[str]:
        """What a metric that needs labels measures on a split without them, for one
        sample's output ``output`` of this shape (its ``without_labels`` hook: top1 on class
        scores, the agreement with the reference's argmax), or None: it measures nothing there."""
        hook = self.hook("without_labels")
        found = self.call(hook, tuple(int(size) for size in shape), str(output)) if hook else None
        return str(found) if found else None

    def __call__(self, outputs: np.ndarray, reference: np.ndarray, labels: Optional[Sequence]) -> np.ndarray:
        """Per-sample scores, checked: one finite number per sample, or a MetricError
        naming the metric (exit 2). A set-level metric scores the samples' features."""
        if self.set_level:
            outputs, reference = self.features(outputs), self.features(reference)
        return self.scored(outputs, reference, labels)

    def scored(self, outputs: np.ndarray, reference: np.ndarray, labels: Optional[Sequence]) -> np.ndarray:
        """The metric on what it takes as is (a set-level metric: features), checked."""
        return check_scores(self.name, self.call(self.score, outputs, reference, labels), count_of(outputs))

    def features(self, outputs: np.ndarray) -> np.ndarray:
        """A set-level metric's reduction of each sample's output (``features``: one
        embedding per sample), or the outputs themselves where it has none."""
        reduce = self.hook("features")
        if reduce is None:
            return outputs
        found = np.asarray(self.call(reduce, outputs))
        if found.ndim == 0 or len(found) != len(outputs):
            raise MetricError(f"metric {self.name}: features returned shape {tuple(found.shape)} for "
                              f"{len(outputs)} samples; it returns one row per sample")
        return found

    def call(self, function: Callable, *args):
        """``function(*args)``: an exception in the metric's code becomes one line naming it."""
        try:
            return function(*args)
        except MetricError as err:
            raise MetricError(f"metric {self.name}: {err.args[0] if err.args else err}") from err
        except Exception as err:  # noqa: BLE001 - the user's code: one line, not a traceback
            text = str(err).strip().splitlines()
            raise MetricError(f"metric {self.name} raised {type(err).__name__}: {text[0] if text else ''}") from err


def check_scores(name: str, scores, count: int, what: str = "scores") -> np.ndarray:
    try:
        values = np.asarray(scores, dtype=np.float64)
    except (TypeError, ValueError):
        raise MetricError(f"metric {name}: returned {type(scores).__name__}, not numbers; "
                          f"a metric returns one score per sample (shape ({count},))") from None
    if values.shape != (count,):
        raise MetricError(f"metric {name}: returned {what} of shape {tuple(values.shape)} for a batch of {count} "
                          f"samples; a metric returns one score per sample (shape ({count},))")
    bad = np.flatnonzero(~np.isfinite(values))
    if bad.size:
        raise MetricError(f"metric {name}: returned {values[bad[0]]} for sample {int(bad[0])} of the batch; "
                          "scores must be finite numbers")
    return values


def check_records(name: str, records, count: int) -> list:
    """A metric's ``records``: one object per sample, or a MetricError naming it."""
    try:
        found = list(records)
    except TypeError:
        found = None
    if found is None or len(found) != count:
        raise MetricError(f"metric {name}: records returned {type(records).__name__} for a batch of {count} "
                          f"samples; it returns one record per sample, or None")
    return found


def output_names(output) -> Tuple[str, ...]:
    """metric.output as names: none (null), one, or a list of them (a pair metric's two); a
    name is a string however it looks (torch.onnx.export names outputs by number)."""
    if output is None:
        return ()
    if isinstance(output, Sequence) and not isinstance(output, str):  # a list (Hydra's ListConfig too)
        return tuple(str(name) for name in output)
    return (str(output),)
