"""``parity-release`` on a real sweep (two targets x a passing and a failing threshold),
``parity-bundle verify`` on releases and archives, and safe extraction: unsafe or broken
archives are refused with exit 2 and one line, and nothing is written outside."""

from __future__ import annotations

import functools
import hashlib
import io
import json
import shutil
import subprocess
import tarfile
from importlib import metadata
from pathlib import Path

import pytest

from conftest import run_cli
from side_by_side import NO_DIAGNOSIS, SIDE_BY_SIDE_ENV, Jobs, selected, stages
from pipeline.release.archive import safe_extract
from pipeline.errors import InputError
from pipeline.release.publish import SUMMARY_FILES

# 1.0 fails every job: ONNX Runtime's optimized graph and OpenVINO round differently from the
# unoptimized reference (cosine 0.99999999999998 on ort_cpu), and cosine is at most 1
PASS_COSINE, FAIL_COSINE = "0.999", "1.0"
PASS, FAIL = f"validation.min_cosine={PASS_COSINE}", f"validation.min_cosine={FAIL_COSINE}"
TRACEBACK = "Traceback (most recent call last)"


# --- helpers ---------------------------------------------------------------------------

def release_cli(args, cwd, env=None):
    return run_cli(args, cwd, program="parity-release", env=env)


def bundle_cli(args, cwd, env=None):
    return run_cli(args, cwd, program="parity-bundle", env=env)


def assert_ok(result):
    assert TRACEBACK not in result.stdout + result.stderr
    assert result.returncode == 0, result.stdout + result.stderr


def assert_one_line_error(result, program, code, phrases) -> str:
    """Exit ``code``, no traceback, and exactly one '<program>: ...' line on stderr holding every phrase."""
    assert TRACEBACK not in result.stdout + result.stderr, result.stderr
    assert result.returncode == code, f"exit {result.returncode}, expected {code}:\n{result.stdout}{result.stderr}"
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{program}:"), result.stderr
    for phrase in phrases:
        assert phrase in lines[0], f"{phrase!r} not in {lines[0]!r}"
    return lines[0]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def tree(root: Path) -> dict:
    return {p.relative_to(root).as_posix(): sha256(p) for p in sorted(root.rglob("*")) if p.is_file()}


def git_head(folder: Path):
    """Commit once in a fresh repository at ``folder``; its HEAD, or None without git."""
    if shutil.which("git") is None:
        return None
    quiet = {"cwd": folder, "capture_output": True, "check": True}
    subprocess.run(["git", "init", "-q"], **quiet)
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--allow-empty", "-m", "c"],
                   **quiet)
    return subprocess.run(["git", "rev-parse", "HEAD"], text=True, **quiet).stdout.strip()


# --- fixtures ----------------------------------------------------------------------------

@pytest.fixture(scope="module", autouse=True)
def release_jobs(request, tmp_path_factory):
    """The sweep, and the CLI runs of the tests that need no sweep, each in its own folder,
    submitted when the module starts and run side by side; the tests read their results."""
    jobs = Jobs()
    if any(getattr(item, "module", None) is request.module and "sweep" in getattr(item, "fixturenames", ())
           for item in request.session.items):
        jobs.submit("sweep", functools.partial(sweep_run, tmp_path_factory.mktemp("sweep")))
    for kind in UNSAFE:
        if selected(request, f"test_unsafe_archive_is_refused[{kind}]"):
            jobs.submit(f"unsafe-{kind}", functools.partial(unsafe_archive_run, tmp_path_factory.mktemp(kind), kind))
    for case in BAD_SWEEP_FOLDERS:
        if selected(request, f"test_bad_sweep_folder_is_exit_2[{case}]"):
            jobs.submit(f"bad-{case}", functools.partial(bad_sweep_folder_run, tmp_path_factory.mktemp(case), case))
    yield jobs
    jobs.close()


def sweep_run(cwd):
    return cwd, run_cli(["-m", "target=ort_cpu,openvino_cpu", "precision=fp32",
                         f"validation.min_cosine={PASS_COSINE},{FAIL_COSINE}",
                         stages("convert", "build", "verify", "package"), *NO_DIAGNOSIS], cwd,
                        env=SIDE_BY_SIDE_ENV)


@pytest.fixture(scope="module")
def sweep(release_jobs):
    """A real sweep: ort_cpu and openvino_cpu, each with a passing and a failing min_cosine."""
    cwd, result = release_jobs["sweep"]
    assert result.returncode == 3, result.stdout + result.stderr  # the failing threshold
    (folder,) = list(cwd.glob("multirun/*/*"))
    return folder, git_head(cwd)


@pytest.fixture(scope="module")
def release(sweep):
    folder, _ = sweep
    result = release_cli([folder, "--allow-partial"], folder.parent)  # two jobs fail their threshold
    assert_ok(result)
    return folder / "release", json.loads((folder / "release" / "release.json").read_text()), result


# --- parity-release ----------------------------------------------------------------------

def test_release_ships_the_passing_bundles(sweep, release):
    folder, head = sweep
    path, manifest, result = release
    assert (folder / "release.tar.gz").is_file()
    bundles = manifest["bundles"]
    assert sorted(b["target"] for b in bundles) == ["openvino_cpu", "ort_cpu"]
    for bundle in bundles:
        assert bundle["verdict"] == "pass" and bundle["exit_code"] == 0 and bundle["precision"] == "fp32"
        assert PASS in bundle["job"] and bundle["path"] == f"bundles/{bundle['name']}"
        packaged = json.loads((path / bundle["path"] / "manifest.json").read_text())
        assert bundle["content_sha256"] == packaged["content_sha256"]
    assert manifest["parity_version"] == metadata.version("parity")
    assert manifest["git_revision"] == head
    assert manifest["sweep"]["summary_files"] == [f for f in SUMMARY_FILES if (folder / f).is_file()]
    assert result.stdout.count("ship  ") == 2 and result.stdout.count("skip  ") == 2


def test_release_lists_every_file_with_its_sha256(release):
    path, manifest, _ = release
    files = tree(path)
    files.pop("release.json")
    assert {name: entry["sha256"] for name, entry in manifest["files"].items()} == files


def test_release_lists_failing_jobs_with_reasons(release):
    _, manifest, _ = release
    failing = manifest["failing"]
    assert sorted(f["target"] for f in failing) == ["openvino_cpu", "ort_cpu"]
    for job in failing:
        assert FAIL in job["job"] and job["verdict"] == "fail" and job["exit_code"] == 3
        assert "cosine" in job["reason"] and job["shipped"] == []


def test_verify_release_folder_and_archive(sweep, release):
    folder, _ = sweep
    for target in (folder / "release", folder / "release.tar.gz"):
        result = bundle_cli(["verify", target], folder)
        assert_ok(result)
        assert "bundle digits_cnn-ort_cpu-fp32:" in result.stdout
        assert "bundle digits_cnn-openvino_cpu-fp32:" in result.stdout
        assert "2 bundles verified" in result.stdout


def test_release_archive_is_byte_identical_when_made_again(sweep, release, tmp_path):
    folder, _ = sweep
    first = (folder / "release.tar.gz").read_bytes()
    assert_ok(release_cli([folder, "--output", tmp_path / "release", "--allow-partial"], tmp_path))
    assert (tmp_path / "release.tar.gz").read_bytes() == first
    assert_ok(release_cli([folder, "--allow-partial"], tmp_path))  # an earlier release in the way is replaced
    assert (folder / "release.tar.gz").read_bytes() == first


def test_a_partial_sweep_is_refused_unless_allowed(sweep, tmp_path):
    """Half a release never exits 0: jobs that failed, or that the sweep intended and that
    never ran (the sweep killed after its first jobs: their folders never appeared), refuse
    the release (exit 3, nothing written) unless --allow-partial, and then release.json
    lists what is missing."""
    folder, _ = sweep
    result = release_cli([folder, "--output", tmp_path / "refused"], tmp_path)
    assert_one_line_error(result, "parity-release", 3, ["nothing released", "2 of 4 jobs passed",
                                                        "2 jobs did not pass", "--allow-partial"])
    assert not (tmp_path / "refused").exists() and not (tmp_path / "refused.tar.gz").exists()
    killed = tmp_path / "killed"
    shutil.copytree(folder, killed, ignore=shutil.ignore_patterns("release*"))
    for job in killed.iterdir():
        if job.is_dir() and (FAIL in job.name or "openvino_cpu" in job.name):
            shutil.rmtree(job)  # 3 of the 4 intended jobs never started
    result = release_cli([killed], tmp_path)
    line = assert_one_line_error(result, "parity-release", 3, ["1 of 4 jobs passed", "3 intended jobs never ran"])
    assert "target=openvino_cpu" in line and result.stdout.count("miss  ") == 3
    assert not (killed / "release").exists()
    result = release_cli([killed, "--allow-partial"], tmp_path)
    assert_ok(result)
    manifest = json.loads((killed / "release" / "release.json").read_text())
    assert len(manifest["bundles"]) == 1 and len(manifest["missing"]) == 3
    assert {m["target"] for m in manifest["missing"]} == {"ort_cpu", "openvino_cpu"}
    assert all(set(m) == {"target", "validation.min_cosine"} for m in manifest["missing"])


def test_bad_name_is_exit_2(sweep, tmp_path):
    folder, _ = sweep
    result = release_cli([folder, "--output", tmp_path / "out", "--name", "../x"], tmp_path)
    assert_one_line_error(result, "parity-release", 2, ["'../x'", "plain folder name"])
    assert not list(tmp_path.iterdir())


def test_include_failing_ships_them_marked(sweep, tmp_path):
    folder, _ = sweep
    result = release_cli([folder, "--include-failing", "--output", tmp_path / "all", "--name", "everything"], tmp_path)
    assert_ok(result)
    manifest = json.loads((tmp_path / "all" / "release.json").read_text())
    assert len(manifest["bundles"]) == 4
    for job in manifest["failing"]:  # two jobs make each bundle name: one folder per job
        (shipped,) = job["shipped"]
        assert shipped.startswith("bundles/") and FAIL in shipped, shipped
        assert (tmp_path / "all" / shipped / "manifest.json").is_file()
    assert {b["verdict"] for b in manifest["bundles"]} == {"pass", "fail"}
    assert manifest["name"] == "everything"
    with tarfile.open(tmp_path / "all.tar.gz") as archive:
        assert {name.split("/")[0] for name in archive.getnames()} == {"everything"}
    assert_ok(bundle_cli(["verify", tmp_path / "all.tar.gz"], tmp_path))


def test_no_passing_bundle_is_exit_3_and_writes_nothing(sweep, tmp_path):
    folder, _ = sweep
    failing = tmp_path / "failing"
    for job in folder.iterdir():
        if FAIL in job.name:
            shutil.copytree(job, failing / job.name)
    (failing / "target=unfinished" / ".hydra").mkdir(parents=True)  # a job that died before its report
    result = release_cli([failing], tmp_path)
    assert_one_line_error(result, "parity-release", 3, ["no passing bundle", "3 jobs"])
    assert "skip  target=unfinished  fail (no exit code): no report.json or job.json" in result.stdout
    assert not (failing / "release").exists() and not (failing / "release.tar.gz").exists()
    result = release_cli([failing, "--include-failing"], tmp_path)
    assert_one_line_error(result, "parity-release", 3, ["no passing bundle", "failing bundles only"])
    assert_ok(bundle_cli(["verify", failing / "release.tar.gz"], tmp_path))


BAD_SWEEP_FOLDERS = ["missing", "empty"]


def bad_sweep_folder_run(tmp_path, case):
    folder = tmp_path / "sweep"
    if case == "empty":
        folder.mkdir()
    return folder, release_cli([folder], tmp_path, env=SIDE_BY_SIDE_ENV)


@pytest.mark.parametrize("case", BAD_SWEEP_FOLDERS)
def test_bad_sweep_folder_is_exit_2(case, release_jobs):
    folder, result = release_jobs[f"bad-{case}"]
    assert_one_line_error(result, "parity-release", 2, [str(folder), "sweep folder"])


def test_existing_folder_that_is_not_a_release_is_kept(sweep, tmp_path):
    folder, _ = sweep
    (tmp_path / "release").mkdir()
    (tmp_path / "release" / "mine.txt").write_text("keep")
    result = release_cli([folder, "--output", tmp_path / "release"], tmp_path)
    assert_one_line_error(result, "parity-release", 2, ["is not a release"])
    assert (tmp_path / "release" / "mine.txt").read_text() == "keep"


def test_tampered_release_is_refused(release, tmp_path):
    path, manifest, _ = release
    copy = tmp_path / "release"
    shutil.copytree(path, copy)
    model = copy / "bundles" / "digits_cnn-ort_cpu-fp32" / "model.onnx"
    model.write_bytes(model.read_bytes()[:-1] + b"\0")
    result = bundle_cli(["verify", copy], tmp_path)
    assert_one_line_error(result, "parity-bundle", 2, ["bundles/digits_cnn-ort_cpu-fp32/model.onnx", "sha256"])


# --- archives: safe extraction ----------------------------------------------------------

def archive_with(path: Path, bad: tarfile.TarInfo) -> Path:
    """A .tar.gz holding a harmless file, then ``bad``."""
    with tarfile.open(path, "w:gz") as archive:
        good = tarfile.TarInfo("bundle/manifest.json")
        good.size = 2
        archive.addfile(good, io.BytesIO(b"{}"))
        archive.addfile(bad, io.BytesIO(b"evil") if bad.isfile() else None)
    return path


def member(name: str, kind=tarfile.REGTYPE, link: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, link
    info.size = 4 if kind == tarfile.REGTYPE else 0
    return info


UNSAFE = {
    "absolute": lambda outside: member(str(outside / "evil.txt")),
    "dotdot": lambda outside: member("bundle/../../../evil.txt"),
    "symlink": lambda outside: member("bundle/link", tarfile.SYMTYPE, str(outside / "evil.txt")),
    "hardlink": lambda outside: member("bundle/hard", tarfile.LNKTYPE, "bundle/manifest.json"),
    "chardev": lambda outside: member("bundle/null", tarfile.CHRTYPE),
    "fifo": lambda outside: member("bundle/pipe", tarfile.FIFOTYPE),
}


def unsafe_archive_run(tmp_path, kind):
    """`parity-bundle verify` on an archive holding UNSAFE[kind]: (the bad member, completed
    process, tmp_path's files before and after, what the CLI left in its temporary folder,
    whether tmp_path/evil.txt exists)."""
    scratch = tmp_path / "tmp"  # the CLI's temporary folders: a member with ../../../ aims at tmp_path
    scratch.mkdir()
    bad = UNSAFE[kind](tmp_path)
    archive = archive_with(tmp_path / "bad.tar.gz", bad)
    before = tree(tmp_path)
    result = bundle_cli(["verify", archive], tmp_path, env={"TMPDIR": str(scratch), **SIDE_BY_SIDE_ENV})
    return bad, result, before, tree(tmp_path), list(scratch.iterdir()), (tmp_path / "evil.txt").exists()


@pytest.mark.parametrize("kind", list(UNSAFE))
def test_unsafe_archive_is_refused(kind, release_jobs):
    bad, result, before, after, left, evil = release_jobs[f"unsafe-{kind}"]
    assert_one_line_error(result, "parity-bundle", 2, [bad.name, "refused"])
    assert after == before and not left
    assert not evil


@pytest.mark.parametrize("kind", ["truncated", "garbage"])
def test_broken_archive_is_refused(kind, release, tmp_path):
    path, _, _ = release
    whole = (path.parent / "release.tar.gz").read_bytes()
    archive = tmp_path / "broken.tar.gz"
    archive.write_bytes(whole[: len(whole) // 2] if kind == "truncated" else b"not an archive" * 100)
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    result = bundle_cli(["verify", archive], tmp_path, env={"TMPDIR": str(scratch)})
    assert_one_line_error(result, "parity-bundle", 2, [str(archive), "truncated or corrupt"])
    assert not list(scratch.iterdir())


def test_every_member_is_checked_before_anything_is_written(tmp_path):
    archive = archive_with(tmp_path / "bad.tar.gz", member("bundle/link", tarfile.SYMTYPE, "/etc/passwd"))
    destination = tmp_path / "out"
    destination.mkdir()
    with pytest.raises(InputError, match="bundle/link"):
        safe_extract(archive, destination)
    assert not list(destination.iterdir())


def test_bundle_archive_verifies(sweep):
    folder, _ = sweep
    archive = folder / f"target=ort_cpu,{PASS}" / "bundle" / "digits_cnn-ort_cpu-fp32.tar.gz"
    result = bundle_cli(["verify", archive], folder)
    assert_ok(result)
    assert "bundle digits_cnn-ort_cpu-fp32: 8 files match" in result.stdout  # 6 + the compile cache (2)
