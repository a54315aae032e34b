"""Errors users can act on, each with the exit code the CLI returns for it."""

from enum import IntEnum
from typing import Sequence


class ExitCode(IntEnum):
    OK = 0
    INTERNAL = 1
    USAGE = 2  # usage, config or input error
    THRESHOLD = 3  # an accuracy threshold failed
    BACKEND = 4  # a backend could not run


class ParityError(Exception):
    """An error with a one-line message meant for the user."""

    exit_code = ExitCode.INTERNAL
    label = "error"

    def __str__(self) -> str:
        return f"{self.label}: {super().__str__()}"


class ConfigError(ParityError):
    exit_code = ExitCode.USAGE
    label = "config error"


class InputError(ParityError):
    """A model, data or bundle file that cannot be used as it is."""

    exit_code = ExitCode.USAGE
    label = "input error"


class BackendUnavailable(ParityError):
    exit_code = ExitCode.BACKEND
    label = "backend unavailable"


class BackendCrashed(ParityError):
    """A backend session that crashed, hung, ran out of memory or raised in its worker
    process (pipeline/worker.py). ``kind``: "crashed", "hung", "error" or "memory"."""

    exit_code = ExitCode.BACKEND
    label = "backend crashed"

    def __init__(self, kind: str, detail: str, stderr_tail: Sequence[str] = (), worker: str = ""):
        self.kind, self.detail, self.stderr_tail, self.worker = kind, detail, list(stderr_tail), worker
        last = self.stderr_tail[-1].strip() if self.stderr_tail else ""
        message = f"{detail}; last stderr: {last}" if last and last not in detail else detail
        super().__init__(" ".join(message.split()))  # one line

    def __reduce__(self):
        return type(self), (self.kind, self.detail, self.stderr_tail, self.worker)


def first_line(err: BaseException) -> str:
    """The first line of an exception's message (runtimes raise multi-page ones)."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
