"""An .npz's arrays are mapped where they lie, not read whole on each open
(pipeline/data/npz.py): every dtype and layout np.save writes reads back equal, whether the
member is stored or compressed, and the dataset built on them serves the same samples; a
large data file is hashed once while it stays the same."""

from __future__ import annotations

import zipfile

import numpy as np
import pytest

from pipeline.config.schemas import DataConfig, DataKind
from pipeline.data import TensorSpec, npz, open_dataset


ARRAYS = {
    "float32": np.random.default_rng(0).standard_normal((5, 3, 4, 4)).astype(np.float32),
    "int64": np.arange(5 * 7, dtype=np.int64).reshape(5, 7),
    "bool": np.random.default_rng(1).random((5, 6)) > 0.5,
    "fortran": np.asfortranarray(np.random.default_rng(2).standard_normal((5, 8)).astype(np.float32)),
    "big_endian": np.arange(10, dtype=">f4").reshape(5, 2),
    "empty": np.zeros((0, 3), np.float32),
    "scalar": np.float32(3.5),
}


@pytest.mark.parametrize("compressed", [False, True])
def test_every_member_reads_back_equal_mapped_or_not(tmp_path, compressed):
    path = tmp_path / "data.npz"
    (np.savez_compressed if compressed else np.savez)(path, **ARRAYS)
    archive = np.load(path, allow_pickle=False)
    for key, expected in ARRAYS.items():
        found = npz.member(archive, path, key)
        assert found.dtype == expected.dtype and found.shape == expected.shape
        np.testing.assert_array_equal(found, expected)
        mappable = not compressed and expected.size > 0 and expected.ndim > 0
        assert isinstance(found, np.memmap) == mappable, key


def test_a_mapped_member_is_read_only_and_the_dataset_hands_out_writable_copies(tmp_path):
    path = tmp_path / "data.npz"
    samples = np.random.default_rng(3).standard_normal((6, 1, 3, 8, 8)).astype(np.float32)
    np.savez(path, x=samples)
    assert zipfile.ZipFile(path).getinfo("x.npy").compress_type == zipfile.ZIP_STORED
    with pytest.raises(ValueError):
        npz.member(np.load(path), path, "x")[0, 0, 0, 0, 0] = 1.0
    spec = TensorSpec(name="x", shape=[1, 3, 8, 8], dtype="float32")
    dataset = open_dataset(DataConfig(kind=DataKind.tensors, path=str(path), calibration_size=2, validation_size=4), [spec])
    first = dataset.validation.read(1)["x"]
    np.testing.assert_array_equal(first, samples[1])
    first += 1.0  # a writable copy: the file's bytes stay as they were
    np.testing.assert_array_equal(dataset.validation.read(1)["x"], samples[1])


def test_a_large_file_is_hashed_once_while_it_stays_the_same_and_again_once_it_changes(tmp_path, monkeypatch):
    """artifacts.sha256_file remembers a large file's hash by its identity, size and times
    (the data of a precision=auto job, keyed many times); a rewrite is hashed again."""
    import hashlib
    import os

    from pipeline import artifacts

    monkeypatch.setattr(artifacts, "REMEMBERED_BYTES", 1024)
    path = tmp_path / "data.npz"
    path.write_bytes(b"a" * 4096)
    first = artifacts.sha256_file(path)
    assert first == hashlib.sha256(b"a" * 4096).hexdigest()
    reads = []
    real_open = open
    monkeypatch.setattr("builtins.open", lambda *a, **k: reads.append(a[0]) or real_open(*a, **k))
    assert artifacts.sha256_file(path) == first and not reads  # remembered, not read
    path.write_bytes(b"b" * 4096)  # the same size, rewritten: new times
    os.utime(path, ns=(1, 1))  # even with the old modification time set back, its change time moved
    assert artifacts.sha256_file(path) == hashlib.sha256(b"b" * 4096).hexdigest() and reads
    small = tmp_path / "model.onnx"
    small.write_bytes(b"c" * 100)
    reads.clear()
    artifacts.sha256_file(small)
    artifacts.sha256_file(small)
    assert len(reads) == 2  # small files are read every time
