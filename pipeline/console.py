"""The rich consoles parity prints to: results on stdout, logs and errors on stderr."""

from __future__ import annotations

import logging
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


def progress_bar():
    """A live bar on a terminal; nothing when output goes to a file or a CI log, or when
    jobs run in parallel (the log lines of each stage remain)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                    console=stderr_console(), transient=True, disable=_PLAIN["progress"] or not stderr_console().is_terminal)
