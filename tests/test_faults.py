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

from conftest import run_cli
from pipeline.archive import safe_extract
from pipeline.bundle import MANIFEST, content_sha256
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
    command = [str(Path(sys.executable).parent / "parity"), *map(str, args)]
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
