"""Errors users can act on, each with the exit code the CLI returns for it."""

import contextlib
import errno
import re
from enum import IntEnum
from typing import Iterator, Optional, Sequence


class ExitCode(IntEnum):
    OK = 0
    INTERNAL = 1
    USAGE = 2  # usage, config or input error
    THRESHOLD = 3  # an accuracy threshold failed
    BACKEND = 4  # a backend could not run
    ENVIRONMENT = 5  # this machine's file system refused a write (read-only, full, no permission)


# Least to most severe, for the one code of several jobs (a sweep, a sequential multirun):
# a crash of parity itself (1) outranks any verdict, and a refused write (5), which can be
# what made another job crash, outranks everything.
SEVERITY = (ExitCode.OK, ExitCode.USAGE, ExitCode.THRESHOLD, ExitCode.BACKEND, ExitCode.INTERNAL,
            ExitCode.ENVIRONMENT)


def worst_exit_code(codes) -> int:
    """The most severe of the codes (SEVERITY; a code parity does not know, such as a killed
    process's, above all); 0 for none."""
    def rank(code: int) -> int:
        return SEVERITY.index(code) if code in SEVERITY else len(SEVERITY)

    return max((int(code) for code in codes), key=rank, default=int(ExitCode.OK))


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


class ReferenceUnavailable(BackendUnavailable):
    """ONNX Runtime, the fp32 reference, cannot load the model: no job can verify anything."""

    label = "reference unavailable"


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


class RunFolderBusy(ParityError):
    """Another parity run holds the run folder's lock."""

    exit_code = ExitCode.USAGE
    label = "run folder in use"


class EnvironmentFault(ParityError):
    """A write the file system refused: a read-only or full disk, a missing permission.
    Nothing is wrong with the model, the data or the config; the machine needs fixing."""

    exit_code = ExitCode.ENVIRONMENT
    label = "environment error"


# errnos that mean "this machine cannot store what parity writes", not a parity bug
ENVIRONMENT_ERRNOS = frozenset({errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.EFBIG})


def environment_fault(err: BaseException, path=None) -> Optional[EnvironmentFault]:
    """An EnvironmentFault for an OSError with one of ENVIRONMENT_ERRNOS (looked for along
    the exception's causes), naming the path and the errno, or for a MemoryError (this
    machine's memory, not a bug: exit 5 with what is available); None for anything else."""
    seen = err
    while seen is not None and not (isinstance(seen, OSError) and seen.errno in ENVIRONMENT_ERRNOS) \
            and not isinstance(seen, MemoryError):
        seen = seen.__cause__ or seen.__context__
    if seen is None:
        return None
    if isinstance(seen, MemoryError):
        available = available_memory_bytes()
        free = f"; {available / 2**30:.1f} GiB available now" if available else ""
        return EnvironmentFault(f"out of memory (MemoryError{f': {seen}' if str(seen) else ''}){free}: lower "
                                "data.validation_size / data.calibration_size, or run on a machine with more memory")
    where = seen.filename or path or "?"
    verb = "access" if seen.errno in (errno.EACCES, errno.EPERM) else "write"  # a refused read is EACCES too
    return EnvironmentFault(f"cannot {verb} {where}: [Errno {seen.errno}] {seen.strerror}")


@contextlib.contextmanager
def writing(path) -> Iterator[None]:
    """Turns a refused write below ``path`` into an EnvironmentFault (one line, exit 5)."""
    try:
        yield
    except OSError as err:
        fault = environment_fault(err, path)
        if fault is None:
            raise
        raise fault from err


def available_memory_bytes() -> Optional[int]:
    """MemAvailable of /proc/meminfo (Linux); None elsewhere."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def first_line(err: BaseException) -> str:
    """The first line of an exception's message (runtimes raise multi-page ones)."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


# lines of a runtime's message that say where in its sources it stopped, not what went wrong
_PLUMBING = re.compile(r"^\s*(Exception from \S+|Check '.*' failed at \S+|Traceback|File \"|at \S+:\d+|-+$|\[ERROR\]\s*$)")


def meaningful_line(err: BaseException) -> str:
    """The line of a runtime's message that says what is wrong: the first naming an
    operation or node, else the first that is not plumbing (OpenVINO's frontend prefixes
    "Exception from src/...cpp:123:" lines and ends with a summary), source paths dropped."""
    lines = [re.sub(r"\S+\.(?:cpp|hpp|cc|h):\d+:?", "", line).strip(" :-") for line in str(err).splitlines()
             if not _PLUMBING.match(line)]
    lines = [line for line in lines if line]
    naming = [line for line in lines if re.search(r"\b(operations?|ops?|node|layer)\b", line, re.IGNORECASE)]
    return (naming or lines or [first_line(err)])[0]


def target_cannot(target: str, doing: str, err: BaseException) -> "BackendUnavailable":
    """A converter or frontend that rejects or crashes on the model (pnnx, MNN's converter,
    OpenVINO's frontend): this target's limitation, exit 4, one line naming what it could
    not take; ``doing``: "build", "read"."""
    return BackendUnavailable(f"target {target} cannot {doing} this model: {meaningful_line(err)}; ort_cpu runs it "
                              "as the fp32 reference does (or change the model)")
