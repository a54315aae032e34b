"""The rich consoles parity prints to: results on stdout, logs and errors on stderr."""

from __future__ import annotations

import logging
from contextlib import contextmanager
from functools import lru_cache

from rich.console import Console
from rich.logging import RichHandler


@lru_cache(maxsize=1)
def stdout_console() -> Console:
    return Console(soft_wrap=True)


@lru_cache(maxsize=1)
def stderr_console() -> Console:
    return Console(stderr=True, soft_wrap=True)


def rich_handler(level: str = "INFO") -> logging.Handler:
    """Console log handler (used by conf/hydra/job_logging/parity.yaml)."""
    handler = RichHandler(console=stderr_console(), show_path=False, show_time=False, markup=False, rich_tracebacks=False)
    handler.setLevel(level)
    return handler


_PLAIN = {"progress": False}


def set_plain_progress() -> None:
    """No live bars in this process (a sweep's parallel jobs share one terminal)."""
    _PLAIN["progress"] = True


_LIVE: list = []  # the progress display in use: a step inside another adds its bar to it


@contextmanager
def progress_bar():
    """A live bar with an ETA on a terminal; nothing when output goes to a file or a CI
    log, or when jobs run in parallel (the log lines of each stage remain). Nested uses
    (weight rounding inside verify's advice trials) share the display that is already
    live: rich allows one live display at a time."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    if _LIVE:
        yield _LIVE[-1]
        return
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                        console=stderr_console(), transient=True,
                        disable=_PLAIN["progress"] or not stderr_console().is_terminal)
    with progress:
        _LIVE.append(progress)
        try:
            yield progress
        finally:
            _LIVE.pop()
