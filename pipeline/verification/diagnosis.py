"""The time a failing verdict's diagnosis may take: ``validation.diagnosis_budget`` times
what the check itself took (the measurement of reference, target and baselines), never less
than ``validation.diagnosis_min_seconds`` (a small model's check takes a second or two;
starting the workers of its diagnosis takes longer). Layerwise runs first and stops at the deadline; the advice candidates are ranked
while time is left, and a candidate is confirmed on the target only when what that is
expected to take (the check's own time plus the build's refinements) fits in what is left,
so the diagnosis overruns its budget by at most the step in flight. What the
budget cut is recorded (report.json verify.diagnosis) and printed."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import List, Optional


@dataclass
class Budget:
    seconds: float
    check_seconds: float = 0.0  # what the check itself took: about what confirming a trial on the target takes
    started: float = field(default_factory=time.perf_counter)
    steps: List[dict] = field(default_factory=list)
    cut: List[str] = field(default_factory=list)
    screened: List[dict] = field(default_factory=list)  # advice candidates as ranked: screened, predicted, measured
    screening: dict = field(default_factory=dict)  # where they were screened; whether it predicted the target

    @classmethod
    def of(cls, validation, measured_seconds: float) -> "Budget":
        return cls(max(validation.diagnosis_min_seconds, validation.diagnosis_budget * float(measured_seconds)),
                   float(measured_seconds))

    @property
    def deadline(self) -> float:
        return self.started + self.seconds

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def left(self) -> float:
        return self.seconds - self.elapsed()

    def exhausted(self) -> bool:
        return self.left() <= 0

    def fits(self, seconds: float) -> bool:
        """A step expected to take ``seconds`` ends within the budget."""
        return self.left() >= seconds

    def spent(self, step: str, seconds: float, cut: Optional[str] = None) -> None:
        self.steps.append({"step": step, "seconds": round(float(seconds), 3)})
        if cut:
            self.cut.append(f"{step}: {cut}")

    def skipped(self, what: str, needs: float = 0.0) -> None:
        """Something the diagnosis would have run, not started: the budget was spent, or
        what was left is less than the ``needs`` seconds it takes."""
        if needs > 0 and not self.exhausted():
            self.cut.append(f"{what}: not started, it takes about {needs:.0f} s and {self.left():.1f} s of the "
                            f"budget ({self.seconds:.1f} s) were left")
        else:
            self.cut.append(f"{what}: not started, the budget ({self.seconds:.1f} s) was spent")

    def summary(self, ran: bool, measurement_reused: bool) -> dict:
        return {"ran": ran and bool(self.steps or self.cut), "budget_seconds": round(self.seconds, 3),
                "seconds": round(sum(s["seconds"] for s in self.steps), 3), "steps": self.steps, "cut": self.cut,
                "screened": self.screened, "screening": self.screening,
                "measurement": "reused from the cache" if measurement_reused else "measured"}
