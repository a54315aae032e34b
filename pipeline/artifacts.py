"""Files on disk: content hashes, JSON, and directories that appear whole or not at all."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import json
import os
import shutil
import uuid
import zipfile
from pathlib import Path
from typing import Iterable, Iterator, Mapping

import numpy as np
from filelock import FileLock

ZIP_EPOCH = (1980, 1, 1, 0, 0, 0)  # the earliest time a zip entry can hold


# A file this large is hashed once per process while its identity and times stay the same:
# PP-OCRv4 det's 1.07 GB of pages at 736x736 took 2.4 s a hash, and a precision=auto job keys
# its stages and its reference store on the data many times. Smaller files (models, outputs a
# test may rewrite within the clock's 4 ms) are hashed every time.
REMEMBERED_BYTES = 64 << 20
_remembered: dict = {}


def sha256_file(path: Path) -> str:
    status = os.stat(path)
    identity = (os.path.realpath(path), status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns,
                status.st_ctime_ns)
    if status.st_size >= REMEMBERED_BYTES and identity in _remembered:
        return _remembered[identity]
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    found = digest.hexdigest()
    if status.st_size >= REMEMBERED_BYTES:
        _remembered[identity] = found
    return found


def sha256_json(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def hash_tree(root: Path) -> dict:
    """{relative path: sha256} of every file under root, sorted."""
    return {p.relative_to(root).as_posix(): sha256_file(p) for p in sorted(root.rglob("*")) if p.is_file()}


def hash_files(paths: Iterable[Path]) -> dict:
    return {str(p): sha256_file(p) for p in paths}


def write_json(path: Path, obj) -> None:
    Path(path).write_text(json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")


def read_json(path: Path):
    return json.loads(Path(path).read_text())


def write_npz(path: Path, arrays: Mapping[str, np.ndarray], compress: bool = True) -> None:
    """A .npz (np.load reads it), compressed unless asked not to, whose bytes depend only on
    the arrays: fixed entry times and permissions, entries in the order given."""
    method = zipfile.ZIP_DEFLATED if compress else zipfile.ZIP_STORED
    with zipfile.ZipFile(path, "w", compression=method) as archive:
        for key, value in arrays.items():
            entry = zipfile.ZipInfo(f"{key}.npy", date_time=ZIP_EPOCH)
            entry.compress_type = method
            entry.external_attr = 0o644 << 16
            with archive.open(entry, "w", force_zip64=True) as handle:
                np.lib.format.write_array(handle, np.asanyarray(value), allow_pickle=False)


def _temp_name(final: Path) -> Path:
    """A fresh hidden name beside ``final`` (".<name>.<random>"; remove_stale_temps finds them)."""
    return final.parent / f".{final.name}.{uuid.uuid4().hex[:12]}"


def _aside_name(final: Path) -> Path:
    """Where a replaced ``final`` waits while the new one is renamed in (no atomic exchange)."""
    return final.parent / f".{final.name}.old.{uuid.uuid4().hex[:12]}"


def remove_stale_temps(final: Path) -> None:
    """Remove the temporary folders and files that writers killed mid-way (kill -9, power
    loss) left beside ``final``; an old ``final`` set aside by a writer killed before the
    new one took its place is put back, never removed. Only for a place no other process
    is writing."""
    final = Path(final)
    for aside in sorted(final.parent.glob(f".{final.name}.old.*")):
        if not final.exists() and not final.is_symlink():
            os.rename(aside, final)
    for leftover in final.parent.glob(f".{final.name}.*"):
        if leftover.is_dir() and not leftover.is_symlink():
            shutil.rmtree(leftover, ignore_errors=True)
        else:
            leftover.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_directory(final: Path, replace: bool = False) -> Iterator[Path]:
    """Yield an empty temporary directory next to ``final``; on success rename it into
    place, so readers never see half of it. With replace=False an existing ``final``
    wins (another writer finished first) and the temporary copy is dropped; with
    replace=True the old and the new ``final`` trade places in one atomic exchange
    (renameat2 RENAME_EXCHANGE) and the old one is removed last; where the file system has
    no exchange the old one is renamed aside first, and a kill between the two renames
    leaves it aside for remove_stale_temps to put back. The folder gets the umask's mode
    (mkdtemp's is 0700)."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    temp, aside = _temp_name(final), _aside_name(final)
    temp.mkdir()
    try:
        yield temp
        if final.exists() and replace and exchange(temp, final):
            return  # the old one is in temp now: removed below
        if final.exists() and replace:
            os.rename(final, aside)
        try:
            os.rename(temp, final)
        except OSError:
            if aside.exists():  # the new one could not take its place: the old one goes back
                os.rename(aside, final)
                raise
            if not final.exists():
                raise
    finally:
        if aside.exists() and not final.exists():  # interrupted between the renames: the old one goes back
            os.rename(aside, final)
        for leftover in (temp, aside):
            if leftover.exists():
                shutil.rmtree(leftover, ignore_errors=True)


RENAME_EXCHANGE = 2  # linux/fs.h
AT_FDCWD = -100


def exchange(first: Path, second: Path) -> bool:
    """Swap two existing paths atomically (Linux renameat2 RENAME_EXCHANGE): True when
    done, False where the C library or the file system has no such call."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    if renameat2(AT_FDCWD, os.fsencode(str(first)), AT_FDCWD, os.fsencode(str(second)), RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(code, os.strerror(code), str(second))


def atomic_write_bytes(final: Path, writer) -> None:
    """Call writer(temp_path) and rename the result onto ``final`` (mode 0666 less the
    umask, like any new file; mkstemp's would be 0600)."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    temp = _temp_name(final)
    os.close(os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    try:
        writer(Path(temp))
        os.replace(temp, final)
    finally:
        if os.path.exists(temp):
            os.unlink(temp)


@contextlib.contextmanager
def cache_lock(cache_root: Path, group: str, key: str) -> Iterator[None]:
    """An exclusive lock on one entry of the stage cache, across processes (a sweep's
    parallel jobs): the first holder computes the entry, the others wait for it."""
    lock_dir = Path(cache_root) / "locks" / group
    lock_dir.mkdir(parents=True, exist_ok=True)
    with FileLock(str(lock_dir / f"{key}.lock")):
        yield
