"""precision.budget_s inside a started candidate: the steps that refine or search ask before
they start whether their estimated cost fits in what is left, and are cut when it does not.

precision=auto sets the deadline around each candidate (pipeline/app/auto.py), from its
Budget: the end of the budget less what the closing steps need, and the one-sample probe
(one validation sample's fp32 run on ONNX Runtime, scaled by how much more the candidates
so far took than estimated). A step estimates itself as model runs x the probe. Outside
precision=auto, or before the probe, nothing is cut.

A cut step is logged, named in its stage's summary with what it would have cost, and its
stage's result is not cached (a later job with more time computes it)."""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

log = logging.getLogger("parity")


@dataclass(frozen=True)
class Deadline:
    ends_at: float  # time.monotonic() seconds
    run_s: float  # one model run's estimated seconds (the probe, corrected)

    def left(self) -> float:
        return self.ends_at - time.monotonic()


_current: Optional[Deadline] = None


@contextmanager
def until(ends_at: Optional[float], run_s: Optional[float]) -> Iterator[None]:
    """The deadline while the block runs (none where either is None)."""
    global _current
    before = _current
    _current = Deadline(ends_at, run_s) if ends_at is not None and run_s is not None else None
    try:
        yield
    finally:
        _current = before


def current() -> Optional[Deadline]:
    return _current


def passed() -> bool:
    return _current is not None and _current.left() <= 0


def loop_stop() -> Callable[..., bool]:
    """A stop check for a loop of like steps, asked before each: True where the deadline
    passed or the longest step so far (the time between two asks) would end past it. Asking
    only whether it passed let PP-OCRv4 det's ranking start a 30 s chunk with 10 s left.
    ``remaining``: the steps left, for a loop whose partial result is worth nothing (a
    ranking cut half-way ranks nothing): True as soon as the mean of the steps done since it
    was first given, times those left, passes the deadline (a 512x512 U-Net's ranking ran
    110 s to be cut)."""
    asked, longest, counted = [None], [0.0], [None]  # counted: (when, remaining) at the first count

    def stop(remaining: Optional[int] = None) -> bool:
        now = time.monotonic()
        if asked[0] is not None:
            longest[0] = max(longest[0], now - asked[0])
        asked[0] = now
        if _current is None:
            return False
        if remaining is None:
            return _current.left() <= longest[0]
        counted[0] = counted[0] or (now, remaining)
        done = counted[0][1] - remaining
        return done > 0 and _current.left() <= (now - counted[0][0]) / done * remaining

    return stop


def cut(step: str, runs: float) -> Optional[str]:
    """Why ``step``, ``runs`` model runs long, is not started (logged), or None where it fits
    or no deadline is set."""
    if _current is None:
        return None
    return _why(step, runs * _current.run_s, f"{runs:.0f} runs of {1000 * _current.run_s:.0f} ms")


def cut_seconds(step: str, seconds: float, how: str) -> Optional[str]:
    """As cut, for a step whose cost is known in seconds (``how``: where the figure comes from,
    e.g. the same step measured before)."""
    return None if _current is None else _why(step, seconds, how)


def _why(step: str, estimate: float, how: str) -> Optional[str]:
    left = _current.left()
    if estimate <= left:
        return None
    why = f"cut by precision.budget_s: {step} estimated {estimate:.0f} s ({how}), {max(left, 0):.0f} s left"
    log.info("%s", why)
    return why
