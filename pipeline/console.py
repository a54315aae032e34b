"""The rich consoles parity prints to: results on stdout, logs and errors on stderr.

A job's progress (which candidate, which stage) is one live line on a terminal
(``job_display``); the lines that record it, logged to ``PROGRESS`` ("parity.progress":
stage running / computed / cached, precision=auto's candidate), go to the run folder's
parity.log and not to the console, except in a sweep's parallel jobs, where no live display
runs and those lines are the progress a person sees."""

from __future__ import annotations

import logging
import os
import sys
import time
from contextlib import contextmanager
from functools import lru_cache

from rich.console import Console
from rich.logging import RichHandler
from rich.spinner import Spinner
from rich.text import Text

PROGRESS = "parity.progress"  # the logger of the progress lines (parity.log; the console in parallel jobs)


# stdout not a terminal and no COLUMNS (a CI log, a file): rich would lay tables out in 80
# columns and cut names, verdicts and numbers with an ellipsis; up to this width a table is
# as wide as its content
LOG_WIDTH = 240


@lru_cache(maxsize=1)
def stdout_console() -> Console:
    console = Console(soft_wrap=True)
    if not console.is_terminal and not os.environ.get("COLUMNS"):
        return Console(soft_wrap=True, width=LOG_WIDTH)
    return console


@lru_cache(maxsize=1)
def stderr_console() -> Console:
    return Console(stderr=True, soft_wrap=True)


def rich_handler(level: str = "INFO") -> logging.Handler:
    """Console log handler (used by conf/hydra/job_logging/parity.yaml). Where stderr is not a
    terminal (a CI log, a file), one plain line a record: rich wrapped a record at 80 columns
    there ("1.8" on one line, "s)" on the next) and padded every line with spaces."""
    if not stderr_console().is_terminal:
        handler: logging.Handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)-8s %(message)s"))
    else:
        handler = RichHandler(console=stderr_console(), show_path=False, show_time=False, markup=False,
                              rich_tracebacks=False)
    handler.setLevel(level)
    handler.addFilter(_console_filter)
    return handler


def _console_filter(record: logging.LogRecord) -> bool:
    """The progress lines below WARNING stay off the console (the live line shows where the
    job is; parity.log keeps them), except in parallel jobs, which have no live line."""
    return _PLAIN["progress"] or record.levelno >= logging.WARNING or \
        not (record.name == PROGRESS or record.name.startswith(PROGRESS + "."))


_PLAIN = {"progress": False}


def set_plain_progress() -> None:
    """No live bars in this process (a sweep's parallel jobs share one terminal)."""
    _PLAIN["progress"] = True


_LIVE: list = []  # the progress display in use: a step inside another adds its bar to it
_JOB: list = []  # the job's live display (job_display), where one is in use


def _live_disabled() -> bool:
    return _PLAIN["progress"] or not stderr_console().is_terminal


@contextmanager
def progress_bar():
    """A live bar with an ETA on a terminal; nothing when output goes to a file or a CI
    log, or when jobs run in parallel (the log lines of each stage remain). Nested uses
    (weight rounding inside verify's advice trials) share the display that is already
    live: rich allows one live display at a time."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    if _LIVE:  # its tasks leave the shared display when the step ends
        shared = _LIVE[-1]
        before = set(shared.task_ids)
        try:
            yield shared
        finally:
            for task in set(shared.task_ids) - before:
                shared.remove_task(task)
        return
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                        console=stderr_console(), transient=True,
                        disable=_live_disabled())
    with progress:
        _LIVE.append(progress)
        try:
            yield progress
        finally:
            _LIVE.pop()


class _JobProgress:
    """The job's live display: a spinner line saying what the job is doing (the candidate,
    the stage, the seconds so far), above the bars of the steps that show one."""

    def __init__(self):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        job = self
        self.started = time.monotonic()
        self.phase, self.step = "", ""
        self.spinner = Spinner("dots")

        class _Progress(Progress):
            def get_renderables(self):
                yield job.line()
                if self.tasks:
                    yield self.make_tasks_table(self.tasks)

        self.progress = _Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                  TimeRemainingColumn(), console=stderr_console(), transient=True,
                                  disable=_live_disabled())

    def line(self):
        doing = " · ".join(part for part in (self.phase, self.step) if part)
        self.spinner.update(text=Text(f"parity: {doing or 'running'} ({time.monotonic() - self.started:.0f} s)"))
        return self.spinner


@contextmanager
def job_display():
    """One live display for the whole job on a terminal: the line ``job_phase`` and
    ``job_step`` set, and below it the bars of long steps (``progress_bar`` adds them to
    it). Transient: the results print where it was. Nothing off a terminal or in parallel jobs."""
    job = _JobProgress()
    with job.progress:
        _LIVE.append(job.progress)
        _JOB.append(job)
        try:
            yield job
        finally:
            _JOB.pop()
            _LIVE.pop()


def job_phase(text: str) -> None:
    """What the job is doing now, e.g. "precision=auto: candidate int8 (2 of 4)"."""
    if _JOB:
        _JOB[-1].phase, _JOB[-1].step = text, ""


def job_step(text: str) -> None:
    """The step of the phase now, e.g. "stage build" (run or read from the cache); "": none."""
    if _JOB:
        _JOB[-1].step = text
