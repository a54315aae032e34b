"""Reproducible bundles: the same inputs and config, run twice from the CLI in two folders,
give byte-identical non-report files, the same manifest content_sha256, and archives whose
members match header for header (the reports inside hold this run's timings, so the
archives as a whole differ only by them)."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import tarfile
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from conftest import REPO, run_cli, run_dirs, single_bundle
from pipeline.release.archive import write_tar_gz
from pipeline.release.bundle import REPORTS, content_sha256, is_cache

CONFIGS = {"ort_cpu-fp32": [], "openvino_cpu-int8": ["target=openvino_cpu", "precision=int8"]}
SKIPPED = set(REPORTS) | {"manifest.json"}


def run_twice(args, root: Path):
    """The same job in two fresh folders at once (no stage cache): the two bundles."""
    folders = [root / "first", root / "second"]
    for folder in folders:
        folder.mkdir()
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda cwd: run_cli(["pipeline.cache=false", *args], cwd), folders))
    for result in results:
        assert result.returncode == 0, result.stdout + result.stderr
    return [single_bundle(run_dirs(folder)[0]) for folder in folders]


@pytest.fixture(scope="module", params=list(CONFIGS))
def bundle_pair(request, tmp_path_factory):
    return run_twice(CONFIGS[request.param], tmp_path_factory.mktemp(request.param))


def manifest(bundle: Path) -> dict:
    return json.loads((bundle / "manifest.json").read_text())


def test_non_report_files_are_byte_identical(bundle_pair):
    first, second = bundle_pair
    names = sorted(p.name for p in first.iterdir())
    assert names == sorted(p.name for p in second.iterdir())
    compared = [name for name in names if name not in SKIPPED and not is_cache(name)]
    assert {"runtime.yaml", "reproduce.npz"} <= set(compared) and len(compared) >= 3, compared
    assert "compile_cache" in names  # shipped, but runtimes write different blob bytes each compile
    for name in compared:
        assert (first / name).read_bytes() == (second / name).read_bytes(), f"{name} differs between two runs"


def test_manifest_differs_only_in_report_hashes(bundle_pair):
    first, second = (manifest(b) for b in bundle_pair)
    assert first["content_sha256"] == second["content_sha256"]
    assert first["reports"] == second["reports"] == sorted(REPORTS)
    assert first["caches"] == second["caches"] and first["caches"]
    for data in (first, second):
        for name in [*REPORTS, *data["caches"]]:
            data["files"].pop(name)
    assert first == second


def test_content_sha256_is_the_sha256sum_listing(bundle_pair):
    bundle = bundle_pair[0]
    data = manifest(bundle)
    listing = "".join(f"{hashlib.sha256((bundle / name).read_bytes()).hexdigest()}  {name}\n"
                      for name in sorted(data["files"]) if name not in SKIPPED and not is_cache(name))
    assert data["content_sha256"] == hashlib.sha256(listing.encode()).hexdigest()
    assert data["content_sha256"] == content_sha256({n: e["sha256"] for n, e in data["files"].items()})


def test_archives_match_member_by_member(bundle_pair):
    """Same member names, order and headers; same bytes for every member but the reports
    (timings) and manifest.json (it lists the reports' sha256), so the .tar.gz files as a
    whole are not compared."""
    members = [archive_members(b.parent / f"{b.name}.tar.gz") for b in bundle_pair]
    assert [m[0] for m in members[0]] == [m[0] for m in members[1]]
    for (name, header, digest), (_, other_header, other_digest) in zip(*members):
        assert header == other_header, name
        inside = name.split("/", 1)[1]
        if inside not in SKIPPED and not is_cache(inside):
            assert digest == other_digest, f"{name} differs between two runs"


def test_archive_headers_hold_no_time_or_owner(bundle_pair):
    archive = bundle_pair[0].parent / f"{bundle_pair[0].name}.tar.gz"
    raw = archive.read_bytes()
    assert raw[4:8] == b"\0\0\0\0", "gzip header mtime is not 0"
    assert not raw[3] & 0x08, "gzip header holds a file name"
    for name, header, _ in archive_members(archive):
        assert header == (tarfile.REGTYPE, 0o644, 0, 0, 0, "", ""), (name, header)


def test_reproduce_npz_has_fixed_entry_times(bundle_pair):
    path = bundle_pair[0] / "reproduce.npz"
    with zipfile.ZipFile(path) as archive:
        assert {info.date_time for info in archive.infolist()} == {(1980, 1, 1, 0, 0, 0)}
    with np.load(path, allow_pickle=False) as data:
        assert any(key.startswith("input/0/") for key in data.files)
        assert all(data[key].size for key in data.files)


def test_same_folder_gives_the_same_archive_bytes(tmp_path):
    """The archive writer alone: one folder archived twice, a second apart in time and
    with different file times and modes, gives identical bytes."""
    folder = tmp_path / "bundle"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.txt").write_text("a")
    (folder / "sub" / "b.bin").write_bytes(bytes(range(256)))
    write_tar_gz(folder, tmp_path / "one.tar.gz", "bundle")
    (folder / "a.txt").chmod(0o600)
    (folder / "a.txt").touch()
    write_tar_gz(folder, tmp_path / "two.tar.gz", "bundle")
    assert (tmp_path / "one.tar.gz").read_bytes() == (tmp_path / "two.tar.gz").read_bytes()
    with tarfile.open(tmp_path / "one.tar.gz") as archive:
        assert archive.getnames() == ["bundle/a.txt", "bundle/sub/b.bin"]


def test_mnn_conversion_is_byte_identical(tmp_path):
    """MNN's converter writes a random model UUID; parity replaces it by one derived from
    the model, so that two conversions of one ONNX model give the same bytes."""
    mnn = pytest.importorskip("pipeline.backends.mnn")
    if not mnn.available()[0] and not os.environ.get("CI"):  # CI installs it: there the test runs
        pytest.skip("MNN is not installed: pip install 'parity[mnn]'")
    model = REPO / "pipeline" / "assets" / "digits_cnn.onnx"
    mnn.convert(model, tmp_path / "one.mnn")
    mnn.convert(model, tmp_path / "two.mnn")
    assert (tmp_path / "one.mnn").read_bytes() == (tmp_path / "two.mnn").read_bytes()
    assert len(mnn.MODEL_UUID.findall((tmp_path / "one.mnn").read_bytes())) == 1


def archive_members(archive: Path):
    """[(name, (type, mode, mtime, uid, gid, uname, gname), sha256 of the content)] in order."""
    with gzip.open(archive) as raw, tarfile.open(fileobj=raw, mode="r:") as tar:
        return [(m.name, (m.type, m.mode, m.mtime, m.uid, m.gid, m.uname, m.gname),
                 hashlib.sha256(tar.extractfile(m).read()).hexdigest()) for m in tar.getmembers()]
