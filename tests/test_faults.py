"""Faults a user meets outside the model: a changed model in a bundle, a read-only or
full disk, kill -9 during package, a failed run after a passing one, two runs into one
folder, a huge archive member, the umask. Every case runs the real CLI on real files."""

from __future__ import annotations

import hashlib
import io
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import yaml
from filelock import FileLock
from onnx import TensorProto, helper, numpy_helper

from conftest import TEST_PRECISION, run_cli
from pipeline.release.archive import safe_extract
from pipeline.release.bundle import MANIFEST, content_sha256
from pipeline.errors import InputError

TRACEBACK = "Traceback (most recent call last)"
FP32 = ["target=ort_cpu", "precision=fp32"]
BUNDLE = "digits_cnn-ort_cpu-fp32"


# --- helpers ---------------------------------------------------------------------------

def parity(args, cwd, umask=None, file_limit=None, popen=False):
    """`parity ARGS` as a user runs it, optionally under a umask or RLIMIT_FSIZE."""
    def prepare():
        if umask is not None:
            os.umask(umask)
        if file_limit is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (file_limit, file_limit))

    env = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1"}
    env.pop("HYDRA_FULL_ERROR", None)
    args = [str(a) for a in args]
    if not any(a.split("=")[0] == "precision" for a in args):
        args = [TEST_PRECISION, *args]  # one build per job, as conftest.run_cli runs them
    command = [str(Path(sys.executable).parent / "parity"), *args]
    if popen:
        return subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, preexec_fn=prepare)
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=300, preexec_fn=prepare)


def one_line_error(result, program, code, phrases) -> str:
    """Exit ``code``, no traceback, one '<program>: ...' line on stderr holding every phrase."""
    output = result.stdout + result.stderr
    assert TRACEBACK not in output, output
    assert result.returncode == code, f"exit {result.returncode}, expected {code}:\n{output}"
    lines = [line for line in result.stderr.splitlines() if line.startswith(f"{program}:")]
    assert len(lines) == 1, result.stderr
    for phrase in phrases:
        assert phrase in lines[0], f"{phrase!r} not in {lines[0]!r}"
    return lines[0]


def sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def tree(root: Path) -> dict:
    return {p.relative_to(root).as_posix(): sha256(p) for p in sorted(root.rglob("*")) if p.is_file()}


def mount_tmpfs(folder: Path, options: str) -> bool:
    """A tmpfs at ``folder`` (root with mount rights only); False where this machine refuses."""
    folder.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)],
                          capture_output=True).returncode == 0


def unmount(folder: Path) -> None:
    subprocess.run(["umount", str(folder)], capture_output=True, check=True)


# --- fixtures ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A folder with one passing ort_cpu fp32 run (run/) and the stage cache the other tests share."""
    cwd = tmp_path_factory.mktemp("faults")
    result = parity([*FP32, "hydra.run.dir=run"], cwd)
    assert result.returncode == 0, result.stdout + result.stderr
    return cwd


@pytest.fixture
def read_only_dir(tmp_path):
    """A folder that refuses writes, the way this machine allows: a read-only tmpfs (root
    with mount rights: EROFS), mode 0555 (not root: EACCES; root ignores modes), else a
    path under /sys, which refuses new entries (EPERM, or EROFS where mounted read-only)."""
    folder = tmp_path / "ro"
    if mount_tmpfs(folder, "ro,size=1m"):
        yield folder
        unmount(folder)
    elif os.geteuid() != 0:
        folder.mkdir()
        folder.chmod(0o555)
        yield folder
        folder.chmod(0o755)
    else:
        yield Path("/sys/parity-test")


def tampered_copy(bundle: Path, destination: Path) -> Path:
    """The bundle with its first convolution's weights negated and the manifest's hashes
    rewritten to match, as someone who edits a bundle by hand would."""
    copy = destination / bundle.name
    shutil.copytree(bundle, copy)
    model = onnx.load(str(copy / "model.onnx"))
    weight = next(init for init in model.graph.initializer if init.name == "conv1.weight")
    weight.CopyFrom(numpy_helper.from_array(-numpy_helper.to_array(weight), weight.name))
    onnx.save(model, str(copy / "model.onnx"))
    manifest = json.loads((copy / MANIFEST).read_text())
    manifest["files"]["model.onnx"].update(sha256=sha256(copy / "model.onnx"),
                                           bytes=(copy / "model.onnx").stat().st_size)
    manifest["content_sha256"] = content_sha256({k: v["sha256"] for k, v in manifest["files"].items()})
    (copy / MANIFEST).write_text(json.dumps(manifest))
    return copy


# --- item 3: a changed model in a bundle ---------------------------------------------------

def test_changed_model_in_a_bundle_is_caught(workspace, tmp_path):
    bundle = workspace / "run" / "bundle" / BUNDLE
    manifest = json.loads((bundle / MANIFEST).read_text())
    key = json.loads((bundle / "compile_cache" / "key.json").read_text())
    assert manifest["compile_cache"]["artifact_sha256"] == key["artifact_sha256"]  # the manifest covers the cache
    copy = tampered_copy(bundle, tmp_path)
    for command in (["check", copy], ["verify", copy], ["run", copy, "--input", copy / "reproduce.npz"]):
        result = run_cli(command, tmp_path, program="parity-bundle")
        one_line_error(result, "parity-bundle", 2, ["compile cache", "another model", "model.onnx"])


def test_a_cache_built_for_another_model_is_not_loaded(workspace, tmp_path):
    from pipeline.backends import onnxruntime as backend

    copy = tampered_copy(workspace / "run" / "bundle" / BUNDLE, tmp_path)
    settings = yaml.safe_load((copy / "runtime.yaml").read_text())
    x = np.random.default_rng(0).random(settings["inputs"][0]["shape"], dtype=np.float32)
    session = backend.load(copy, settings)
    assert session.effective()["compile_cache"].startswith("stale: built for another model")
    changed = ort.InferenceSession(str(copy / "model.onnx"), providers=["CPUExecutionProvider"]).run(None, {"input": x})
    np.testing.assert_allclose(session.run({"input": x})["logits"], changed[0], rtol=1e-5, atol=1e-5)
    original = backend.load(workspace / "run" / "bundle" / BUNDLE, settings)
    assert original.effective()["compile_cache"] == "hit"
    assert not np.allclose(original.run({"input": x})["logits"], changed[0], atol=1e-3)


def test_a_swapped_cache_key_does_not_match_the_manifest(workspace, tmp_path):
    copy = tmp_path / BUNDLE
    shutil.copytree(workspace / "run" / "bundle" / BUNDLE, copy)
    key_file = copy / "compile_cache" / "key.json"
    key_file.write_text(key_file.read_text().replace('"artifact_sha256": "', '"artifact_sha256": "0'))
    manifest = json.loads((copy / MANIFEST).read_text())
    manifest["files"]["compile_cache/key.json"]["sha256"] = sha256(key_file)
    manifest["files"]["compile_cache/key.json"]["bytes"] = key_file.stat().st_size
    (copy / MANIFEST).write_text(json.dumps(manifest))
    result = run_cli(["verify", copy], tmp_path, program="parity-bundle")
    one_line_error(result, "parity-bundle", 2, ["compile_cache entry does not match"])


# --- item 8: environment errors --------------------------------------------------------------

ENVIRONMENT_ERRNOS = ("[Errno 30] Read-only file system", "[Errno 13] Permission denied",
                      "[Errno 1] Operation not permitted")


def environment_error(result, path: Path) -> str:
    line = one_line_error(result, "parity", 5, ["environment error: cannot", str(path)])
    assert any(errno in line for errno in ENVIRONMENT_ERRNOS), line
    return line


def test_read_only_output_folder_is_exit_5(workspace, read_only_dir):
    result = parity([*FP32, f"hydra.run.dir={read_only_dir}/run"], workspace)
    environment_error(result, read_only_dir)


def test_read_only_cache_folder_is_exit_5(workspace, read_only_dir, tmp_path):
    run_dir = tmp_path / "run"
    result = parity([*FP32, f"hydra.run.dir={run_dir}", f"pipeline.cache_dir={read_only_dir}/cache"], workspace)
    line = environment_error(result, read_only_dir)
    record = json.loads((run_dir / "job.json").read_text())  # the run folder still says why
    assert record["exit_code"] == 5 and record["error"] == line.removeprefix("parity: ")


def test_bundle_output_into_a_read_only_folder_is_exit_5(workspace, read_only_dir, tmp_path):
    folder = read_only_dir if read_only_dir.is_dir() else read_only_dir.parent  # /sys itself refuses new files
    bundle = workspace / "run" / "bundle" / BUNDLE
    shape = yaml.safe_load((bundle / "runtime.yaml").read_text())["inputs"][0]["shape"]
    np.save(tmp_path / "x.npy", np.zeros(shape, np.float32))
    result = run_cli(["run", bundle, "--input", tmp_path / "x.npy", "--output", folder / "y.npz"], tmp_path,
                     program="parity-bundle")
    line = one_line_error(result, "parity-bundle", 5, ["environment error: cannot", str(folder / "y.npz")])
    assert any(errno in line for errno in ENVIRONMENT_ERRNOS), line


def test_full_disk_is_exit_5(workspace, tmp_path):
    """A 64 KiB tmpfs where this machine lets root mount one (ENOSPC); elsewhere a 32 KiB
    file size limit (RLIMIT_FSIZE: EFBIG) stops the first big write the same way."""
    full = tmp_path / "full"
    mounted = mount_tmpfs(full, "size=64k")
    try:
        result = parity([*FP32, f"hydra.run.dir={full}/run", "pipeline.cache=false"], workspace,
                        file_limit=None if mounted else 32 << 10)
        errno = "[Errno 28] No space left on device" if mounted else "[Errno 27] File too large"
        line = one_line_error(result, "parity", 5, ["environment error: cannot write", str(full / "run"), errno])
        assert not (full / "run" / "job.json").exists() or json.loads((full / "run" / "job.json").read_text())
    finally:
        if mounted:
            unmount(full)
    assert line


# --- item 9: kill -9 during package --------------------------------------------------------

def kill_during_package(cwd: Path, run_dir: Path, attempts: int = 8) -> bool:
    """Start a run into ``run_dir`` and kill -9 it while package writes its staging folder
    (.bundle.*): True once a kill landed there."""
    for _ in range(attempts):
        process = parity([*FP32, f"hydra.run.dir={run_dir}"], cwd, popen=True)
        while process.poll() is None:
            if any(p.name.startswith(".bundle.") for p in os.scandir(run_dir)):
                process.send_signal(signal.SIGKILL)
                process.communicate()
                return True
        process.communicate()
    return False


def test_kill_during_package_then_rerun_leaves_one_consistent_bundle(workspace, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(workspace / "run", run_dir)  # an earlier finished run in the folder
    before = tree(run_dir / "bundle")
    assert kill_during_package(workspace, run_dir), "no kill landed during package"
    leftovers = [p.name for p in run_dir.iterdir() if p.name.startswith(".bundle.")]
    assert leftovers  # what a kill -9 leaves
    assert tree(run_dir / "bundle") == before  # the earlier bundle folder and archive, whole
    assert not (run_dir / "job.json").exists() and (run_dir / "job.stale.json").exists()
    again = parity([*FP32, f"hydra.run.dir={run_dir}"], workspace)
    assert again.returncode == 0, again.stdout + again.stderr
    assert not [p.name for p in run_dir.iterdir() if p.name.startswith(".bundle.")]
    assert not [p for p in run_dir.rglob(".*") if p.name != ".hydra" and ".hydra" not in p.parts
                and p.name != ".parity.lock"]
    record = json.loads((run_dir / "job.json").read_text())
    bundle = run_dir / "bundle" / BUNDLE
    assert record["bundles"] == {BUNDLE: sha256(bundle / MANIFEST)}
    with tarfile.open(run_dir / "bundle" / f"{BUNDLE}.tar.gz") as archive:  # the archive holds the folder
        members = {m.name.split("/", 1)[1]: hashlib.sha256(archive.extractfile(m).read()).hexdigest()
                   for m in archive.getmembers() if m.isfile()}
    assert members == tree(bundle)
    assert sorted(p.name for p in (run_dir / "bundle").iterdir()) == [BUNDLE, f"{BUNDLE}.tar.gz"]


# --- item 10: a failed run after a passing one ---------------------------------------------------

def release(sweep: Path, cwd: Path, *options: str):
    return run_cli([sweep, *options], cwd, program="parity-release")


def test_failed_run_sets_the_earlier_report_aside_and_release_skips_it(workspace, tmp_path):
    sweep = tmp_path / "sweep"
    job = sweep / "job"
    shutil.copytree(workspace / "run", job)
    failed = parity([*FP32, f"hydra.run.dir={job}", f"model.path={tmp_path}/missing.onnx"], workspace)
    assert failed.returncode == 2, failed.stdout + failed.stderr
    assert not (job / "report.json").exists()
    assert json.loads((job / "report.stale.json").read_text())["verdict"] == "pass"  # kept, marked stale
    assert json.loads((job / "job.json").read_text())["exit_code"] == 2
    result = release(sweep, tmp_path)
    assert result.returncode == 3, result.stdout + result.stderr
    assert "skip  job  fail (exit 2)" in result.stdout
    assert not (sweep / "release").exists()


def test_release_skips_a_job_whose_files_disagree(workspace, tmp_path):
    """A job folder whose job.json says exit 1 next to a passing report.json (as an older
    parity left it after a failed run) or whose bundle is not the one its run packaged."""
    sweep = tmp_path / "sweep"
    for name in ("exit", "bundle", "good"):
        shutil.copytree(workspace / "run", sweep / name)
    record = json.loads((sweep / "exit" / "job.json").read_text())
    (sweep / "exit" / "job.json").write_text(json.dumps({**record, "exit_code": 1}))
    (sweep / "bundle" / "job.json").write_text(json.dumps({**record, "bundles": {BUNDLE: "0" * 64}}))
    result = release(sweep, tmp_path)  # two of three jobs do not count as passing: a partial sweep
    assert result.returncode == 3 and "2 jobs did not pass (bundle; exit)" in result.stderr, result.stderr
    result = release(sweep, tmp_path, "--allow-partial")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "skip  exit  pass (exit 0): inconsistent job: job.json says exit 1 but report.json exit 0" in result.stdout
    assert f"skip  bundle  pass (exit 0): inconsistent job: bundle {BUNDLE} is not the one" in result.stdout
    assert "ship  good  pass" in result.stdout
    shipped = json.loads((sweep / "release" / "release.json").read_text())["bundles"]
    assert [bundle["job"] for bundle in shipped] == ["good"]


# --- item 11: two runs into one folder -----------------------------------------------------------

def test_second_run_into_a_locked_folder_is_refused(workspace, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(workspace / "run", run_dir)
    before = tree(run_dir)
    with FileLock(str(run_dir / ".parity.lock")):  # a run in progress holds it
        result = parity([*FP32, f"hydra.run.dir={run_dir}"], workspace)
    one_line_error(result, "parity", 2, ["run folder in use", str(run_dir), "hydra.run.dir"])
    after = tree(run_dir)
    assert {k: v for k, v in after.items() if k != "parity.log" and not k.startswith(".hydra/")} == \
        {k: v for k, v in before.items() if k != "parity.log" and not k.startswith(".hydra/")}


def test_two_concurrent_runs_into_one_folder(workspace, tmp_path):
    run_dir = tmp_path / "run"
    processes = [parity([*FP32, f"hydra.run.dir={run_dir}", "pipeline.cache=false"], workspace, popen=True)
                 for _ in range(2)]
    results = [(p.wait(timeout=300), *p.communicate()) for p in processes]
    codes = sorted(code for code, _, _ in results)
    for code, out, err in results:
        assert TRACEBACK not in out + err and code in (0, 2), out + err
        if code == 2:
            assert "run folder in use" in err
    assert codes == [0, 2]  # started together, each runs for seconds: the second finds the folder held
    record = json.loads((run_dir / "job.json").read_text())
    assert record["exit_code"] == 0 and record["bundles"] == {BUNDLE: sha256(run_dir / "bundle" / BUNDLE / MANIFEST)}
    assert json.loads((run_dir / "report.json").read_text())["verdict"] == "pass"


# --- item 12: a huge member is refused from its header -------------------------------------------

def sparse_tar(bundle: Path, path: Path, extra: str = "", extra_size: int = 0, resize: str = "") -> Path:
    """An uncompressed tar of ``bundle`` plus a member ``extra`` whose header claims
    ``extra_size`` bytes (or ``resize``'s header claiming it); its data is a hole, so the
    file takes a few KiB on disk whatever the size claimed."""
    with open(path, "wb") as handle:
        for file in sorted(p for p in bundle.rglob("*") if p.is_file()):
            name = f"{bundle.name}/{file.relative_to(bundle).as_posix()}"
            data = file.read_bytes()
            size = extra_size if name.endswith(f"/{resize}") and resize else len(data)
            _add(handle, name, size, data)
        if extra:
            _add(handle, f"{bundle.name}/{extra}", extra_size, b"")
        handle.write(b"\0" * 1024)
    return path


def _add(handle, name: str, size: int, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode = size, 0o644
    handle.write(info.tobuf(format=tarfile.PAX_FORMAT))
    handle.write(data[:size])
    handle.seek(handle.tell() + size - min(size, len(data)) + (-size) % 512)  # a hole: no bytes written


@pytest.mark.parametrize("case", ["unlisted", "resized"])
def test_huge_member_is_refused_before_anything_is_written(workspace, tmp_path, case):
    bundle = workspace / "run" / "bundle" / BUNDLE
    gib = 1 << 30
    archive = sparse_tar(bundle, tmp_path / "big.tar", extra="big.bin" if case == "unlisted" else "",
                         extra_size=gib, resize="model.onnx" if case == "resized" else "")
    bundle_bytes = sum(f.stat().st_size for f in bundle.rglob("*") if f.is_file())
    assert archive.stat().st_blocks * 512 < bundle_bytes + (1 << 20)  # the 1 GiB member a hole: small on disk
    destination = tmp_path / "out"
    destination.mkdir()
    with pytest.raises(InputError, match="refused before extracting"):
        safe_extract(archive, destination, manifests=("release.json", MANIFEST))
    assert not any(destination.iterdir())
    result = run_cli(["verify", archive], tmp_path, program="parity-bundle")
    phrase = f"is not listed in {BUNDLE}/manifest.json" if case == "unlisted" else f"claims {gib} bytes in its header"
    one_line_error(result, "parity-bundle", 2, [phrase, "refused before extracting"])


def test_members_larger_than_the_free_space_are_refused(tmp_path):
    free = shutil.disk_usage(tmp_path).free
    archive = tmp_path / "huge.tar"
    with open(archive, "wb") as handle:
        _add(handle, "folder/huge.bin", free + (1 << 30), b"")
        handle.write(b"\0" * 1024)
    destination = tmp_path / "out"
    destination.mkdir()
    with pytest.raises(InputError, match="free in"):
        safe_extract(archive, destination)
    assert not any(destination.iterdir())


# --- item 14: permissions follow the umask ---------------------------------------------------

@pytest.mark.parametrize("umask,folder_mode,file_mode", [(0o022, 0o755, 0o644), (0o027, 0o750, 0o640)])
def test_bundle_and_archive_modes_follow_the_umask(workspace, tmp_path, umask, folder_mode, file_mode):
    run_dir = tmp_path / "run"
    result = parity([*FP32, f"hydra.run.dir={run_dir}"], workspace, umask=umask)
    assert result.returncode == 0, result.stdout + result.stderr
    mode = lambda path: path.stat().st_mode & 0o777  # noqa: E731
    bundle = run_dir / "bundle" / BUNDLE
    assert mode(run_dir / "bundle") == mode(bundle) == mode(bundle / "compile_cache") == folder_mode
    assert mode(run_dir / "bundle" / f"{BUNDLE}.tar.gz") == mode(bundle / MANIFEST) == file_mode
    assert mode(run_dir / "job.json") == file_mode
    released = run_cli([tmp_path], tmp_path, program="parity-release")  # the run folder as a one-job sweep
    assert released.returncode == 0, released.stdout + released.stderr
    mine = os.umask(0o022)
    os.umask(mine)  # the umask this process (and so parity-release) runs with
    assert mode(tmp_path / "release") == 0o777 & ~mine and mode(tmp_path / "release.tar.gz") == 0o666 & ~mine
