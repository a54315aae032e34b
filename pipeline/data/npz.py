"""Arrays of a .npz without reading them whole: an uncompressed member is memory-mapped
where it lies in the file, so opening the data is instant and a sample is read when asked.

``np.load`` reads an .npz member whole on every access (its ``mmap_mode`` applies to .npy
files only): PP-OCRv4 det's 164 pages at 736x736 (1.07 GB, stored) took 2.3 s an open, and
a job opens its data several times a candidate (calibrate, verify, the stage keys).
A compressed member has no bytes to map: it is read whole, once per open, as before."""

from __future__ import annotations

import struct
import zipfile
from pathlib import Path

import numpy as np

_LOCAL_HEADER = 30  # bytes of a zip local file header before its name and extra field
_HEADER_READERS = {(1, 0): "read_array_header_1_0", (2, 0): "read_array_header_2_0"}  # 3.0: read whole


def member(archive, path: Path, key: str) -> np.ndarray:
    """The array ``key`` of the open ``archive`` (np.load's NpzFile of ``path``): mapped
    read-only where the member is stored uncompressed, else read."""
    mapped = _mapped(path, f"{key}.npy")
    return archive[key] if mapped is None else mapped


def _mapped(path: Path, name: str):
    with zipfile.ZipFile(path) as archive:
        info = archive.getinfo(name)
    if info.compress_type != zipfile.ZIP_STORED:
        return None
    with open(path, "rb") as handle:
        handle.seek(info.header_offset)
        local = handle.read(_LOCAL_HEADER)
        name_length, extra_length = struct.unpack("<HH", local[26:30])
        handle.seek(info.header_offset + _LOCAL_HEADER + name_length + extra_length)
        version = np.lib.format.read_magic(handle)
        if version not in _HEADER_READERS:
            return None
        shape, fortran_order, dtype = getattr(np.lib.format, _HEADER_READERS[version])(handle)
        offset = handle.tell()
    if dtype.hasobject or not shape or 0 in shape:
        return None  # pickled objects stay refused by np.load; an empty array has no bytes to map
    return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=shape, order="F" if fortran_order else "C")
