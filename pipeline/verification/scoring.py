"""Scoring builds during verify: the task metric (pipeline/metrics/) of the reference
and of each build, batch by batch, with the drop's confidence (confidence.py)."""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import numpy as np

from pipeline.metrics.base import BATCH, MetricError, TaskMetric, check_records, check_scores
from pipeline.verification import confidence
from pipeline.verification.sample_groups import count_of, in_order, shape_groups, shape_of, stack, weighted_mean


class TaskScorer:
    """Per-sample scores of the reference and of each build, from outputs added one
    sample at a time and scored in batches of BATCH; the samples of a batch whose outputs
    differ in shape in groups of one shape (pages of several sizes), their scores back in
    the samples' order. A set-level metric is scored once, at ``finish``, on every sample's
    features (computed batch by batch)."""

    def __init__(self, metric: TaskMetric, output: str):
        self.metric, self.output = metric, output
        self.pending: Dict[str, list] = {}
        self.scores: Dict[str, List[np.ndarray]] = {}
        self.extras: Dict[str, Dict[str, List[np.ndarray]]] = {}
        self.agreement: Dict[str, List[np.ndarray]] = {}
        self.weights: Dict[str, List[np.ndarray]] = {}  # per-sample weights of a pooled metric
        self.records: Dict[str, List[np.ndarray]] = {}  # what a metric's set_extras count (objects, per sample)
        self.labeled: Optional[bool] = None
        # a metric that needs labels on a split without them: what it measures instead (top1
        # on class scores: the agreement with the reference), and whether some sample's output
        # was not such (then nothing is scored: a flattened argmax of a map judges nothing)
        self.unlabeled: Optional[str] = None
        self.refused = False
        self._without: Dict[tuple, Optional[str]] = {}  # without_labels by output shape
        self.sets: Dict[str, List[tuple]] = {}  # set-level: per build, (features, reference's, labels) per batch
        self._batch: tuple = ()  # the ids of the current batch's reference outputs
        self._stacks: Dict[tuple, tuple] = {}  # its stacks by the arrays' ids, shared by the builds
        # the outputs the metric reads: the task output, or the two a pair metric names (boxes, scores)
        self.names = tuple(metric.names) if len(metric.names) > 1 else (output,)
        self._shape: Optional[tuple] = None  # the first reference sample's (what ``describe`` says of it)

    def active(self, label, reference: Optional[np.ndarray] = None) -> bool:
        """Whether a sample with this label can be scored. A metric that needs labels scores
        an unlabeled sample only where it measures something without them on the sample's
        ``reference`` output (its ``without_labels``: top1 on class scores); one unlabeled
        sample it cannot score leaves the whole split unscored (``refused``)."""
        self.labeled = label is not None if self.labeled is None else self.labeled and label is not None
        if not self.metric.needs_labels or self.labeled:
            return True
        shape = None if reference is None else shape_of(reference)
        if shape not in self._without:
            self._without[shape] = None if shape is None else self.metric.without_labels(shape, self.output)
        measures = self._without[shape]
        if measures is None:
            self.refused = True
            return False
        self.unlabeled = measures
        return True

    def task_values(self, values: Dict[str, np.ndarray]):
        """What the metric scores of one run's outputs by name: the task output, or the two
        outputs a pair metric names (a tuple); None where the run lacks one."""
        if any(name not in values for name in self.names):
            return None
        return values[self.names[0]] if len(self.names) == 1 else tuple(values[name] for name in self.names)

    def add(self, build: str, output: np.ndarray, reference: np.ndarray, label) -> None:
        if self._shape is None:
            self._shape = shape_of(reference)
        pending = self.pending.setdefault(build, [])
        pending.append((output, reference, label))
        if len(pending) >= BATCH:
            self._flush(build)

    def finish(self) -> None:
        for build in list(self.pending):
            self._flush(build)
        for build, parts in self.sets.items():  # set-level: every sample at once (again on a second call)
            labels = [label for part in parts for label in part[2]] if self.labeled else None
            try:
                outputs, reference = (np.concatenate([part[i] for part in parts]) for i in (0, 1))
            except ValueError:  # the batches' features differ in shape
                raise MetricError(f"metric {self.metric.name}: the samples' features differ in shape; a set-level "
                                  "metric reduces every sample to one shape in features(outputs)") from None
            found = self._measured(build, outputs, reference, labels)
            for known in (self.scores, self.weights, self.extras, self.agreement, self.records):
                known.pop(build, None)
            self._record(build, found)

    def _flush(self, build: str) -> None:
        pending, self.pending[build] = self.pending[build], []
        if not pending:
            return
        references = [p[1] for p in pending]
        if self._batch != tuple(map(id, references)):  # a new batch: the last one's stacks go
            self._batch, self._stacks = tuple(map(id, references)), {}
        labels = [p[2] for p in pending] if self.labeled else None
        groups = shape_groups([p[0] for p in pending], references)
        parts = [self._group(build, [pending[i][0] for i in group], [references[i] for i in group],
                             None if labels is None else [labels[i] for i in group]) for group in groups]
        try:
            found = in_order(parts, groups)
        except ValueError as err:
            raise MetricError(f"metric {self.metric.name}: {err}") from None
        if self.metric.set_level:
            self.sets.setdefault(build, []).append((found["features"], found["reference"], labels))
        else:
            self._record(build, found)

    def _group(self, build: str, outputs: List[np.ndarray], references: List[np.ndarray], labels) -> dict:
        """One shape's samples scored (a set-level metric: their features, kept until finish)."""
        reference = self._stacked(references, keep=True)
        stacked = self._stacked(outputs, keep=False)
        if self.metric.set_level:
            return {"features": self.metric.features(stacked), "reference": self.metric.features(reference)}
        return self._measured(build, stacked, reference, labels)

    def _measured(self, build: str, outputs: np.ndarray, reference: np.ndarray, labels) -> Dict[str, Any]:
        """The scores of samples stacked alike (a set-level metric: their features), with
        the weights, extras and agreement the metric defines."""
        name, count = self.metric.name, count_of(outputs)
        found: Dict[str, Any] = {"scores": self.metric.scored(outputs, reference, labels)}
        weights = self.metric.hook("weights")
        weighed = self.metric.call(weights, outputs, reference, labels) if weights else None
        if weighed is not None:  # a pooled metric: the samples weigh differently (map_iou pooled: by area)
            found["weights"] = check_scores(name, weighed, count, "weights")
        extras = self.metric.hook("extras")
        for key, values in (self.metric.call(extras, outputs, reference, labels) if extras else {}).items():
            found[f"extras/{key}"] = check_scores(name, values, count, f"extras[{key!r}]")
        records = self.metric.hook("records")
        kept = self.metric.call(records, outputs, reference, labels) if records else None
        if kept is not None:  # objects, one per sample: an array of them keeps the samples' order
            found["records"] = np.empty(count, dtype=object)
            for index, record in enumerate(check_records(name, kept, count)):
                found["records"][index] = record
        agreement = self.metric.hook("agreement")
        if labels is None and self.metric.needs_labels:  # scored without labels: the scores are the agreement
            if build != "reference":
                found["agreement"] = found["scores"]
        elif agreement and build != "reference":
            found["agreement"] = check_scores(name, self.metric.call(agreement, outputs, reference), count,
                                              "agreement")
        return found

    def _record(self, build: str, found: Dict[str, np.ndarray]) -> None:
        self.scores.setdefault(build, []).append(found["scores"])
        if "weights" in found:
            self.weights.setdefault(build, []).append(found["weights"])
        if "agreement" in found:
            self.agreement.setdefault(build, []).append(found["agreement"])
        if "records" in found:
            self.records.setdefault(build, []).append(found["records"])
        for key, values in found.items():
            if key.startswith("extras/"):
                self.extras.setdefault(build, {}).setdefault(key[len("extras/"):], []).append(values)

    def _stacked(self, arrays: List[np.ndarray], keep: bool) -> np.ndarray:
        """The arrays stacked on a new axis 0; the reference's stacks of the current batch
        are kept (``keep``) for the other builds, and a build's outputs that are the
        reference's (the reference scored against itself) reuse them."""
        key = tuple(id(array) for array in arrays)
        if key in self._stacks:
            return self._stacks[key][1]
        stacked = stack(arrays)
        if keep:
            self._stacks[key] = (arrays, stacked)  # the arrays kept: their ids stay theirs
        return stacked

    def value(self, build: str) -> Optional[float]:
        parts = self.scores.get(build)
        if not parts or self.refused:
            return None
        if build in self.weights:
            return weighted_mean(np.concatenate(parts), np.concatenate(self.weights[build]))
        return self.metric.aggregate(np.concatenate(parts))

    def result(self, build: str, max_drop: float, require_confidence: bool = False) -> Optional[dict]:
        """The task-metric verdict of ``build`` against the reference (None when nothing was
        scored), with the drop's paired bootstrap interval (pipeline/verification/confidence.py): a drop
        that passes while its interval reaches past ``max_drop`` is ``uncertain``, a
        failure with ``require_confidence``."""
        reference, target = self.value("reference"), self.value(build)
        if reference is None or target is None:
            return None
        drop = reference - target if self.metric.higher_is_better else target - reference
        agreement = self.agreement.get(build)
        task = self._verdict(build, max_drop, drop, reference, target, agreement)
        task.update(self._confidence(build, task, require_confidence))
        return task

    def _verdict(self, build: str, max_drop: float, drop: float, reference: float, target: float,
                 agreement: Optional[List[np.ndarray]]) -> dict:
        extras = {key: {"reference": float(np.mean(np.concatenate(self.extras["reference"][key]))),
                        "target": float(np.mean(np.concatenate(values)))}
                  for key, values in self.extras.get(build, {}).items()}
        theirs, mine = self.set_extras("reference"), self.set_extras(build)
        extras.update({key: {"reference": theirs[key], "target": value}
                       for key, value in mine.items() if key in theirs})
        task = {"metric": self.metric.name, "output": ", ".join(self.names),
                "samples": int(sum(len(p) for p in self.scores[build])), "reference": reference, "target": target,
                "drop": drop, "agreement": float(np.mean(np.concatenate(agreement))) if agreement else None,
                "max_drop": max_drop, "passed": drop <= max_drop + 1e-12,
                "higher_is_better": self.metric.higher_is_better, "labeled": bool(self.labeled), "extras": extras}
        if len(self.names) > 1:  # a pair metric (a detector's boxes and scores): both outputs, in order
            task["outputs"] = list(self.names)
        described = self._described()
        if described:
            task["format"] = described  # detection: the head's format, given or recognised from the shapes
        if not self.labeled and self.unlabeled:
            task["judged_as"] = self.unlabeled  # a metric that needs labels, measuring what it can without
        if not task["passed"] and self.metric.name != "top1":  # top-1 keeps its points wording (pipeline/verification/verdict.py)
            worse = "dropped" if self.metric.higher_is_better else "rose"
            task["reason"] = (f"task metric {self.metric.name} {worse} by {abs(drop):.4g} ({reference:.4f} -> "
                              f"{target:.4f}), allowed {max_drop:.4g} (validation.max_metric_drop)")
        return task

    def _described(self) -> Optional[str]:
        """What the metric's ``describe(shape)`` says it read on the first reference sample's
        output (detection: "pair head (given: [1, 100, 4] and [1, 100, 3])"), or None."""
        describe = self.metric.hook("describe")
        if describe is None or self._shape is None:
            return None
        found = self.metric.call(describe, self._shape)
        return str(found) if found else None

    def set_extras(self, build: str) -> Dict[str, float]:
        """The metric's figures of the whole set (``set_extras`` of every sample's ``records``:
        a detector's mAP over all images against the labels), {} where it has none."""
        summarize = self.metric.hook("set_extras")
        if summarize is None or not self.records.get(build):
            return {}
        found = dict(self.metric.call(summarize, list(np.concatenate(self.records[build]))) or {})
        for key, value in found.items():
            check_scores(self.metric.name, [value], 1, f"set_extras[{key!r}]")  # a finite number each
        return {str(key): float(value) for key, value in found.items()}

    def _confidence(self, build: str, task: dict, require: bool) -> dict:
        """The drop's interval, the agreement's, the disagreement rate's exact one (a plain
        mean's drop only), and whether a passing drop is resolved (confidence.resolution)."""
        own = getattr(self.metric.score, "aggregate", None)
        weights = ((np.concatenate(self.weights["reference"]), np.concatenate(self.weights[build]))
                   if build in self.weights and "reference" in self.weights else None)
        paired = np.concatenate(self.scores["reference"]), np.concatenate(self.scores[build])
        interval = confidence.drop_interval(*paired, self.metric.higher_is_better,
                                            (lambda scores: float(own(scores))) if own else None, weights)
        agreement = np.concatenate(self.agreement[build]) if self.agreement.get(build) else None
        counts = None if own or weights else confidence.disagreement(*paired, agreement, task["drop"], task["max_drop"])
        found = {"interval": interval, "confidence": confidence.LEVEL, "resamples": confidence.RESAMPLES,
                 "agreement_interval": None if agreement is None else confidence.rate_interval(agreement),
                 "disagreement": counts, "uncertain": False, "require_confidence": bool(require)}
        if task["passed"]:
            found.update(confidence.resolution(task["drop"], task["max_drop"], task["samples"], interval, counts))
        return found


def task_outputs(task: Optional[dict]) -> List[str]:
    """The outputs a task verdict (``TaskScorer.result``) scored: its output, or a pair
    metric's two (``outputs``); none without a task."""
    if not task:
        return []
    return list(task.get("outputs") or [task["output"]])
