"""Errors users can act on, each with the exit code the CLI returns for it."""

from enum import IntEnum


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


def first_line(err: BaseException) -> str:
    """The first line of an exception's message (runtimes raise multi-page ones)."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
