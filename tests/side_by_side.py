"""Tests that run `parity` jobs whose speed figures they do not judge: the settings that
keep such jobs short, and Jobs, which runs a test module's CLI jobs in the background
while its tests read them: two at a time in one pytest process, one at a time per worker
under `pytest -n` (SIDE_BY_SIDE).

A `parity` job keeps about one core busy (the CLI, then one worker process at a time), so
on the 2-core CI machine two jobs take little more wall time than one; under `pytest -n 2`
the other worker's jobs fill the second core. A module fixture
submits every job up front; a test waits for the one it reads (``jobs[name]``), and a job
not started yet when a test asks for it goes first, after the job it runs after (``pytest
-k`` waits for its own). A job that runs ``after`` another can reuse that one's folder, and
so its stage cache."""

from __future__ import annotations

import os
import re
import threading
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

from conftest import WORKERS, run_cli, run_dirs

SIDE_BY_SIDE = 1 if WORKERS > 1 else 2  # under pytest -n the other workers fill the cores


class Jobs:
    """Named callables (one or a few conftest.run_cli calls each), run by SIDE_BY_SIDE
    threads in the order submitted; ``[name]`` returns one's result, or raises its error."""

    def __init__(self, workers: int = SIDE_BY_SIDE):
        self._cv = threading.Condition()
        self._jobs: Dict[str, Callable[[], object]] = {}
        self._after: Dict[str, str] = {}
        self._pending: List[str] = []
        self._done: Dict[str, Tuple[bool, object]] = {}
        self._closed = False
        self._threads = [threading.Thread(target=self._work, daemon=True) for _ in range(workers)]
        for thread in self._threads:
            thread.start()

    def submit(self, name: str, job: Callable[[], object], after: Optional[str] = None) -> None:
        """Run ``job()`` as ``name``; with ``after`` (a job submitted before), once that one ended."""
        with self._cv:
            assert name not in self._jobs and (after is None or after in self._jobs), (name, after)
            self._jobs[name] = job
            if after is not None:
                self._after[name] = after
            self._pending.append(name)
            self._cv.notify_all()

    def __getitem__(self, name: str):
        with self._cv:
            if name not in self._jobs:
                raise KeyError(f"no job {name!r} was submitted")
            first = name
            while first is not None and first in self._pending:  # it, and the jobs it runs after, go first
                self._pending.remove(first)
                self._pending.insert(0, first)
                first = self._after.get(first)
            self._cv.notify_all()
            while name not in self._done:
                self._cv.wait()
            ok, value = self._done[name]
        if not ok:
            raise value
        return value

    def close(self) -> None:
        """Drop the jobs not started (a test selection that reads none of them) and wait
        for the running ones."""
        with self._cv:
            self._pending.clear()
            self._closed = True
            self._cv.notify_all()
        for thread in self._threads:
            thread.join()

    def _next(self) -> Optional[str]:
        """The first pending job that runs after no job, or after one that ended."""
        return next((name for name in self._pending if name not in self._after or self._after[name] in self._done),
                    None)

    def _work(self) -> None:
        while True:
            with self._cv:
                while not self._closed and self._next() is None:
                    self._cv.wait()
                name = self._next()
                if name is None:  # closed: close() dropped the pending jobs
                    return
                self._pending.remove(name)
            try:
                outcome = (True, self._jobs[name]())
            except BaseException as error:  # noqa: B036 - re-raised in the test that reads the job
                outcome = (False, error)
            with self._cv:
                self._done[name] = outcome
                self._cv.notify_all()


def stages(*names: str) -> str:
    """``pipeline.stages=[...]``: only the stages a test looks at (and those they need)."""
    return f"pipeline.stages=[{','.join(names)}]"


UP_TO_VERIFY = ("convert", "calibrate", "sensitivity", "build", "tune", "verify")
VERIFIED = stages(*UP_TO_VERIFY)  # no profile, no bundle
PACKAGED = stages(*UP_TO_VERIFY, "package")  # the bundle, no profile
PROFILED = stages(*UP_TO_VERIFY, "profile")  # the profile, no bundle


def new_run(args, cwd, **kwargs):
    """conftest.run_cli(ARGS, cwd) and the run folder it made (None unless exactly one):
    (completed process, run folder)."""
    before = set(run_dirs(cwd))
    result = run_cli(args, cwd, **kwargs)
    made = set(run_dirs(cwd)) - before
    return result, (made.pop() if len(made) == 1 else None)


# a failing verdict's diagnosis (layerwise comparison, keep-in-float trials), for tests that
# read only the verdict
NO_DIAGNOSIS = ["validation.layerwise=off", "validation.advice_trials=0"]


def sweep_folders(cwd: Path) -> set:
    return set((Path(cwd) / "multirun").glob("*/*"))


def run_sweep(args, cwd, **kwargs) -> Tuple[object, Path]:
    """conftest.run_cli(ARGS, cwd) for a sweep (``-m`` in ARGS) and the one sweep folder it
    made: (completed process, folder)."""
    before = sweep_folders(cwd)
    result = run_cli(args, cwd, **kwargs)
    made = sweep_folders(cwd) - before
    assert len(made) == 1, (sorted(made), result.stdout + result.stderr)
    return result, made.pop()


def job_outputs(stdout: str) -> Dict[str, str]:
    """A basic-launcher sweep's stdout split by job: {the job's overrides as Hydra lists
    them ('#0 : a=1 b=2'): what the job printed}."""
    found, current = {}, None
    for line in stdout.splitlines(keepends=True):
        launched = re.match(r"\[[^]]*\]\[HYDRA\] \t#\d+ : (.*)$", line.rstrip("\n"))
        if launched:
            current = launched.group(1)
            found[current] = ""
        elif current is not None:
            found[current] += line
    return found


def job_output(stdout: str, override: str) -> str:
    """What the one job of a sweep whose overrides include ``override`` printed."""
    (printed,) = [text for overrides, text in job_outputs(stdout).items() if override in overrides.split()]
    return printed


def selected(request, *tests: str) -> bool:
    """Whether this session runs one of ``tests`` of the module that requests the fixture
    (a module fixture submits only the jobs its selected tests read): test function names,
    or names with their parameters ('test_x[a]')."""
    return any(getattr(item, "module", None) is request.module
               and (item.name in tests or getattr(item, "originalname", None) in tests)
               for item in request.session.items)


# A job run beside another gets half the cores for its own BLAS threads, as a worker of
# parity's joblib launcher does (two OpenBLAS pools spinning on 2 cores slow numpy down
# many times over: build's weight rounding).
SIDE_BY_SIDE_ENV = {"OPENBLAS_NUM_THREADS": str(max(1, len(os.sched_getaffinity(0)) // (2 * WORKERS)))}
