"""One reference pass per model, data and machine (docs/verify.md, "One reference pass").

The fp32 reference (ONNX Runtime on the converted model, graph optimizations off) answers
the same for the same model file, validation sample, runtime, CPU and threads. So verify
keeps its answers in the stage cache as it gets them, one file per validation sample, and
every later verify of that model and data reads them instead of running the reference
again: precision=auto's candidates, a sweep of targets or precisions over one model, a
rerun with other thresholds. precision=auto also fills the store ahead, in a process of the
lowest CPU priority, while its first candidate calibrates and builds (``Ahead``): on
PP-OCRv4 rec that process ran the 200 lines in 17.8 s of the build's idle core time, and
the calibration and build took 55.1 s beside it, 57.3 s without (docs/time.md).

A sample's file is written whole under a temporary name, then renamed: a reader finds the
sample or nothing, and a writer stopped midway loses only what it was writing. The store
stops growing at MAX_BYTES (a detector's maps can be large); later samples run live."""

from __future__ import annotations

import importlib
import logging
import multiprocessing
import os
import zipfile
from pathlib import Path
from typing import Callable, Dict, List, Optional

import numpy as np

from pipeline.artifacts import atomic_write_bytes, hash_files, sha256_json, write_npz

log = logging.getLogger("parity")
MAX_BYTES = 512 << 20  # of outputs kept per model and data
FOLDER = "reference"  # in the stage cache
# how long stopping waits for the sample in progress before it kills the process: about one
# reference run where the caller knows it (verify would run that sample live in as long, so a
# longer wait cannot pay: on a loaded machine the nice-19 process starves, and a 2x slowed
# segmenter job waited out the whole 30 s), else STOP_S
STOP_S = 30.0
STOP_RUNS, STOP_MARGIN_S = 1.5, 1.0


def store_key(convert_hashes: dict, data_cfg, data_files: List[Path], settings: dict) -> str:
    """What the reference's answers depend on: the converted model's files (the stage
    cache's hashes of them), the data and its files, the reference's settings, the
    runtime's version, the machine and the threads this job may use."""
    from pipeline import environment
    from pipeline.config.schemas import plain

    return sha256_json({"convert": convert_hashes, "data": plain(data_cfg), "files": hash_files(data_files),
                        "settings": settings, "runtimes": environment.versions(),
                        "machine": environment.fingerprint(), "threads": environment.own_threads()})[:32]


class ReferenceStore:
    """The reference's outputs of each validation sample by index, in ``folder``."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self._bytes: Optional[int] = None  # counted at the first put
        self.full = False
        self.served = self.ran = 0  # answer()'s samples read from the store, and run

    @classmethod
    def of(cls, cache_root: Optional[Path], key: str) -> Optional["ReferenceStore"]:
        """The store of ``key`` in the stage cache; None without a cache."""
        return None if cache_root is None else cls(Path(cache_root) / FOLDER / key)

    def _path(self, index: int) -> Path:
        return self.folder / f"{index}.npz"

    def has(self, index: int) -> bool:
        return self._path(index).is_file()

    def holds(self, count: int) -> bool:
        """Whether samples 0 .. count-1 are all stored."""
        return all(self.has(index) for index in range(count))

    def get(self, index: int) -> Optional[Dict[str, np.ndarray]]:
        """Sample ``index``'s outputs, or None when they are not stored (or unreadable)."""
        try:
            with np.load(self._path(index), allow_pickle=False) as found:
                return {name: found[name] for name in found.files}
        except (OSError, ValueError, EOFError, zipfile.BadZipFile):
            return None

    def stacked(self, count: int, outputs: List[str]) -> Optional[Dict[str, np.ndarray]]:
        """Samples 0 .. count-1's ``outputs`` stacked on axis 0 (as BatchRunner packs samples);
        None where one is not stored."""
        answers = [self.get(index) for index in range(count)] if self.holds(count) else [None]
        if any(answer is None or any(name not in answer for name in outputs) for answer in answers):
            return None
        return {name: np.concatenate([np.atleast_1d(answer[name]) for answer in answers]) for name in outputs}

    def put(self, index: int, outputs: Dict[str, np.ndarray], replace: bool = False) -> None:
        """Keep sample ``index``'s outputs, within MAX_BYTES (``replace``: over a file that
        is there but unreadable); outputs numpy cannot store without pickling (strings) are
        not kept."""
        if self.full or (self.has(index) and not replace):
            return
        if self._bytes is None:
            self._bytes = sum(p.stat().st_size for p in self.folder.glob("*.npz")) if self.folder.is_dir() else 0
        size = sum(np.asarray(value).nbytes for value in outputs.values())
        if self._bytes + size > MAX_BYTES:
            self.full = True
            return
        try:
            atomic_write_bytes(self._path(index), lambda temp: write_npz(temp, outputs, compress=False))
        except (ValueError, OSError) as err:  # an object array, a full disk: the reference runs live
            log.debug("reference store: sample %d not kept: %s", index, err)
            self.full = True
            return
        self._bytes += size

    def answer(self, index: int, feeds: dict, run: Callable[[dict], dict]) -> dict:
        """Sample ``index``'s outputs from the store, else ``run(feeds)``'s, then kept."""
        found = self.get(index)
        if found is not None:
            self.served += 1
            return found
        found = run(feeds)
        self.ran += 1
        self.put(index, found, replace=True)  # a broken file is written again, not kept
        return found


def fill(folder: str, module: str, artifact_dir: str, settings: dict, data_cfg, inputs: list, stop) -> None:
    """The reference's outputs of every validation sample into the store at ``folder``, at
    the lowest CPU priority, until done, full or ``stop`` (a multiprocessing Event) is set."""
    from pipeline.data import open_dataset

    quiet = os.open(os.devnull, os.O_WRONLY)
    os.dup2(quiet, 1)  # the runtime's messages, a Ctrl-C's traceback: verify reports what matters
    os.dup2(quiet, 2)
    with_lowest_priority()
    try:
        session = importlib.import_module(module).load(Path(artifact_dir), settings)
        store = ReferenceStore(Path(folder))
        for index, sample in enumerate(open_dataset(data_cfg, inputs).validation):
            if stop.is_set() or store.full:
                return
            if not store.has(index):
                store.put(index, session.run(sample.feeds))
    except Exception:  # noqa: BLE001 - what it did not store, verify runs live (and reports any error)
        return


def with_lowest_priority() -> None:
    try:
        os.nice(19)
    except (AttributeError, OSError):  # no nice on this platform: it still only runs ahead
        pass


class Ahead:
    """``fill`` in a process of its own while the caller works on; ``stop()`` before the
    reference is needed live (what it stored by then is used, the rest runs live)."""

    def __init__(self, store: ReferenceStore, module: str, artifact_dir: Path, settings: dict, data_cfg, inputs):
        from pipeline.worker import start_process

        self._stop = multiprocessing.get_context("spawn").Event()
        self._process = start_process(fill, (str(store.folder), module, str(artifact_dir), settings, data_cfg,
                                             list(inputs), self._stop), "parity-reference-ahead")

    def stop(self, run_s: Optional[float] = None) -> None:
        """``run_s``: one reference run's seconds where known (the wait is sized to it)."""
        if self._process is None:
            return
        self._stop.set()
        self._process.join(STOP_S if run_s is None else min(STOP_S, STOP_MARGIN_S + STOP_RUNS * run_s))
        if self._process.is_alive():
            self._process.kill()
            self._process.join()
        self._process = None
