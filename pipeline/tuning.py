"""The runtime-settings search of the tune stage (docs/tuning.md).

A backend names its tunable runtime options and their values (``tuning_space``, the
current value first). The search is a coordinate descent: one option at a time, every
value measured with the others held at the best found so far; ``passes`` rounds of it.
Every candidate runs in a fresh worker process (pipeline/worker.py), so that no thread
pool or allocator of one candidate serves the next, and so that a setting that crashes
the runtime only loses that candidate. Warm-up runs are not measured.

Noise: a candidate ties with the best when its score is within ``noise`` (a fraction)
of the best's, or within the best's interquartile range; among tied candidates the one
that changes fewest options from the build's settings wins, then the one tried first."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from pipeline.release import compile_cache
from pipeline.environment import cores


@dataclass(frozen=True)
class Level:
    warmup: int
    repeats: int
    passes: int


LEVELS = {"fast": Level(warmup=3, repeats=15, passes=1), "normal": Level(warmup=5, repeats=30, passes=1),
          "heavy": Level(warmup=10, repeats=60, passes=2)}

Space = List[Tuple[str, list]]
Changes = Dict[str, object]


def thread_counts(current: int) -> list:
    """Thread counts worth trying on this machine: the current one, the runtime's
    default (0), 1, half and all of the cores this process may use."""
    count = cores()
    return current_first(current, [0, 1, max(1, count // 2), count])


def current_first(current, values: Sequence) -> list:
    return list(dict.fromkeys([current, *values]))


def apply(backend, settings: dict, changes: Changes) -> dict:
    """The runtime settings with ``changes`` made (through the backend's ``with_options``
    where an option is more than a key of ``options``), without a compile cache: the
    cache belongs to the settings it was compiled with."""
    changed = copy.deepcopy(compile_cache.without_cache(settings))
    if backend.CAPABILITIES.option_mapping:
        return backend.with_options(changed, dict(changes))
    changed.setdefault("options", {}).update(changes)
    return changed


def score(measurement: dict) -> float:
    """Milliseconds per inference: lower is better for either objective."""
    if "throughput" in measurement:
        return 1000.0 / measurement["throughput"]
    return measurement["median_ms"]


def spread(measurement: dict) -> float:
    """The interquartile range of the measurement, in the score's unit."""
    if "throughput" in measurement:
        low, high = measurement["p25_throughput"], measurement["p75_throughput"]
        return 1000.0 / low - 1000.0 / high if low > 0 and high > 0 else 0.0
    return measurement["p75_ms"] - measurement["p25_ms"]


@dataclass
class Trial:
    changes: Changes
    measurement: Optional[dict] = None  # None until measured
    error: Optional[str] = None
    order: int = 0

    @property
    def ok(self) -> bool:
        return self.measurement is not None and self.error is None

    def to_json(self) -> dict:
        return {"changes": self.changes, "measurement": self.measurement, "error": self.error, "order": self.order,
                "score_ms": round(score(self.measurement), 6) if self.ok else None}

    @classmethod
    def from_json(cls, data: dict) -> "Trial":
        return cls(dict(data["changes"]), data.get("measurement"), data.get("error"), int(data.get("order", 0)))


def best(trials: Sequence[Trial], noise: float) -> Optional[Trial]:
    """The fastest trial, or among those tied with it the simplest."""
    usable = [trial for trial in trials if trial.ok]
    if not usable:
        return None
    fastest = min(usable, key=lambda trial: score(trial.measurement))
    band = max(noise * score(fastest.measurement), spread(fastest.measurement))
    tied = [trial for trial in usable if score(trial.measurement) <= score(fastest.measurement) + band]
    return min(tied, key=lambda trial: (len(trial.changes), trial.order))


def ranked(trials: Sequence[Trial], noise: float) -> List[Trial]:
    """Every trial that ran, best first."""
    left = [trial for trial in trials if trial.ok]
    order = []
    while left:
        chosen = best(left, noise)
        order.append(chosen)
        left.remove(chosen)
    return order


class Search:
    """Coordinate descent over ``space``; ``measure(changes) -> measurement dict``
    raises on a candidate that cannot run (recorded as its error)."""

    def __init__(self, space: Space, measure: Callable[[Changes], dict], noise: float, passes: int,
                 on_trial: Callable[[], None] = lambda: None):
        self.space, self.measure, self.noise, self.passes = space, measure, noise, passes
        self.on_trial = on_trial
        self.trials: Dict[Tuple, Trial] = {}

    def planned(self) -> int:
        """Candidates a full search measures at most (for progress bars)."""
        return 1 + self.passes * sum(len(values) - 1 for _, values in self.space)

    def run(self) -> List[Trial]:
        """Every trial, in the order measured; the baseline (no changes) first. The search
        stops early when the baseline cannot run."""
        current: Changes = {}
        if not self._trial(current).ok:
            return list(self.trials.values())
        for _ in range(self.passes):
            for name, values in self.space:
                options = [self._trial(self._set(current, name, value, values[0])) for value in values]
                current = best(options, self.noise).changes
        return list(self.trials.values())

    @staticmethod
    def _set(current: Changes, name: str, value, baseline) -> Changes:
        changed = {key: val for key, val in current.items() if key != name}
        if value != baseline:
            changed[name] = value
        return changed

    def _trial(self, changes: Changes) -> Trial:
        key = tuple(sorted((name, repr(value)) for name, value in changes.items()))
        if key not in self.trials:
            trial = Trial(dict(changes), order=len(self.trials))
            try:
                trial.measurement = self.measure(trial.changes)
            except Exception as err:  # noqa: BLE001 - a setting the runtime refuses or crashes on
                trial.error = str(err)
            self.trials[key] = trial
            self.on_trial()
        return self.trials[key]
