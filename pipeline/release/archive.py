"""Deterministic .tar.gz archives, and extraction that refuses anything unsafe.

Writing: members in sorted order, regular files only, mtime 0, owner 0/0 without names,
mode 0644, and a gzip header without time or file name, so the same files always give
the same bytes.

Reading: every member is checked before anything is written; absolute paths, ``..``
components, links, devices, fifos and duplicate names are refused, and a truncated or
corrupt archive is an InputError. Sizes come from the member headers, so that a huge
member is refused before a byte of it is written: the members must fit the free space,
and with ``manifests`` every member must be listed, with its size, in the manifest at the
top of the archive (a bundle's manifest.json, a release's release.json)."""

from __future__ import annotations

import contextlib
import gzip
import json
import shutil
import tarfile
import zlib
from pathlib import Path, PurePosixPath
from typing import Dict, List, Sequence

from pipeline.errors import InputError

FILE_MODE = 0o644
CHUNK = 1 << 20
MANIFEST_LIMIT = 64 << 20  # a manifest is a few KiB; a bigger one is not read into memory
_CORRUPT = (tarfile.TarError, EOFError, zlib.error, OSError)


def write_tar_gz(source: Path, destination: Path, root: str) -> None:
    """Every file under ``source`` as ``root/<relative path>`` in a reproducible .tar.gz."""
    source = Path(source)
    with open(destination, "wb") as raw, \
            gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0, compresslevel=9) as compressed, \
            tarfile.open(fileobj=compressed, mode="w", format=tarfile.PAX_FORMAT) as archive:
        for path in sorted(p for p in source.rglob("*") if p.is_file()):
            info = _file_info(f"{root}/{path.relative_to(source).as_posix()}", path.stat().st_size)
            with open(path, "rb") as handle:
                archive.addfile(info, handle)


def _file_info(name: str, size: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = size, FILE_MODE, 0
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


def is_archive(path: Path) -> bool:
    return Path(path).is_file() and Path(path).name.endswith((".tar.gz", ".tgz", ".tar"))


def safe_extract(archive: Path, destination: Path, manifests: Sequence[str] = ()) -> List[str]:
    """Extract ``archive`` into the existing folder ``destination`` once every member is
    known to be safe; returns the member names. ``manifests``: file names of which the
    first found in the archive's top folder must list every other member with its size
    (``{"files": {path: {"bytes": n}}}``)."""
    archive, destination = Path(archive), Path(destination)
    with _reading(archive):
        tar = tarfile.open(archive, "r:*")
    with tar:
        with _reading(archive):
            members = tar.getmembers()
        for member in members:
            _check_member(archive, member)
        _check_duplicates(archive, members)
        _check_free_space(archive, members, destination)
        if manifests:
            _check_listed_sizes(archive, tar, members, manifests)
        for member in members:
            _extract_member(archive, tar, member, destination)
    return [m.name for m in members]


@contextlib.contextmanager
def _reading(archive: Path):
    """Errors while reading the archive become one InputError line."""
    try:
        yield
    except _CORRUPT as err:
        raise InputError(f"archive {archive} is truncated or corrupt: {_describe(err)}") from err


def _check_member(archive: Path, member: tarfile.TarInfo) -> None:
    name = member.name
    if name.startswith("/") or PurePosixPath(name).is_absolute() or "\\" in name:
        raise InputError(f"archive {archive}: member {name!r} has an absolute path; refused")
    if ".." in PurePosixPath(name).parts:
        raise InputError(f"archive {archive}: member {name!r} leaves the folder ('..'); refused")
    if member.issym() or member.islnk():
        raise InputError(f"archive {archive}: member {name!r} is a link; refused")
    if not (member.isfile() or member.isdir()):
        raise InputError(f"archive {archive}: member {name!r} is not a regular file or folder "
                         f"(device, fifo or other special file); refused")


def _check_duplicates(archive: Path, members: List[tarfile.TarInfo]) -> None:
    """No name twice, and no member inside a member that is a file."""
    names = [PurePosixPath(member.name) for member in members]
    files = {name for name, member in zip(names, members) if member.isfile()}
    seen = set()
    for name in names:
        if name in seen:
            raise InputError(f"archive {archive}: member {name.as_posix()!r} appears twice; refused")
        seen.add(name)
        inside = next((parent for parent in name.parents if parent in files), None)
        if inside is not None:
            raise InputError(f"archive {archive}: member {name.as_posix()!r} is inside the file "
                             f"{inside.as_posix()!r}; refused")


def _check_free_space(archive: Path, members: List[tarfile.TarInfo], destination: Path) -> None:
    needed = sum(member.size for member in members if member.isfile())
    free = shutil.disk_usage(destination).free
    if needed > free:
        raise InputError(f"archive {archive}: its members' headers claim {needed} bytes, more than the {free} bytes "
                         f"free in {destination}; refused before extracting")


SIGNATURE_LIMIT = 1024  # a base64 Ed25519 signature is 89 bytes


def _check_listed_sizes(archive: Path, tar: tarfile.TarFile, members: List[tarfile.TarInfo],
                        manifests: Sequence[str]) -> None:
    """Every file member listed in the top folder's manifest with the size its header
    claims; nothing is written before this holds."""
    by_name = {member.name: member for member in members if member.isfile()}
    roots = {PurePosixPath(name).parts[0] for name in by_name}
    found = [f"{root}/{name}" for name in manifests for root in sorted(roots) if f"{root}/{name}" in by_name]
    if len(roots) != 1 or not found:
        return  # not one bundle or release folder: the caller says what is wrong
    manifest, root = found[0], roots.pop()
    listed = _read_listing(archive, tar, by_name[manifest])
    for name, member in sorted(by_name.items()):
        relative = PurePosixPath(name).relative_to(root).as_posix()
        if name == manifest:
            continue
        if name == f"{manifest}.sig":  # its signature (pipeline/release/signing.py): small, checked after extracting
            if member.size > SIGNATURE_LIMIT:
                raise InputError(f"archive {archive}: {name} claims {member.size} bytes, more than a signature")
            continue
        if relative not in listed:
            raise InputError(f"archive {archive}: member {name!r} ({member.size} bytes) is not listed in "
                             f"{manifest}; refused before extracting")
        if listed[relative] != member.size:
            raise InputError(f"archive {archive}: member {name!r} claims {member.size} bytes in its header, "
                             f"{manifest} lists {listed[relative]}; refused before extracting")


def _read_listing(archive: Path, tar: tarfile.TarFile, member: tarfile.TarInfo) -> Dict[str, int]:
    """{path: bytes} of a manifest member (read into memory, at most MANIFEST_LIMIT bytes)."""
    if member.size > MANIFEST_LIMIT:
        raise InputError(f"archive {archive}: {member.name} claims {member.size} bytes, more than a manifest "
                         f"holds ({MANIFEST_LIMIT}); refused")
    with _reading(archive):
        text = tar.extractfile(member).read()
    try:
        return {path: int(entry["bytes"]) for path, entry in json.loads(text)["files"].items()}
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise InputError(f"archive {archive}: {member.name} is not a readable manifest ({_describe(err)}); "
                         f"refused") from err


def _extract_member(archive: Path, tar: tarfile.TarFile, member: tarfile.TarInfo, destination: Path) -> None:
    target = destination.joinpath(*PurePosixPath(member.name).parts)
    if member.isdir():
        target.mkdir(parents=True, exist_ok=True)
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    with _reading(archive):
        source = tar.extractfile(member)
    copied = 0
    with open(target, "wb") as handle:
        while True:
            with _reading(archive):
                chunk = source.read(CHUNK)
            if not chunk:
                break
            handle.write(chunk)
            copied += len(chunk)
    if copied != member.size:
        raise InputError(f"archive {archive} is truncated or corrupt: member {member.name!r} ends early")


def _describe(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text}" if text else type(err).__name__
