"""Bundles nobody can forge (issue 28, item 7): a bundle whose model, compile cache key and
manifest were rewritten together passed `parity-bundle check` on the old cache; check now
judges what the artifact computes and refuses a cache that computes something else. And a
real seal: Ed25519 signatures on the manifests (`parity-release --sign`, `parity-bundle
verify/check --verify-key`), any change after signing refused with exit 2."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from conftest import run_cli, run_dirs, single_bundle

from pipeline.release import compile_cache
from pipeline.artifacts import hash_tree, write_json
from pipeline.release.bundle import MANIFEST, compile_cache_entry, content_sha256

DIGITS = Path(__file__).resolve().parents[1] / "pipeline" / "assets" / "digits_cnn.onnx"


def bundle_cli(args, cwd):
    return run_cli([str(a) for a in args], cwd, program="parity-bundle")


def _one_line(result, code: int, *parts: str) -> str:
    assert result.returncode == code, result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("parity-bundle:")]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    for part in parts:
        assert part in lines[0], lines[0]
    return lines[0]


def negated(path: Path) -> Path:
    """The digits model with its last Gemm's weight and bias negated: logits times -1."""
    model = onnx.load(str(DIGITS))
    last = [n for n in model.graph.node if n.op_type == "Gemm"][-1]
    for initializer in model.graph.initializer:
        if initializer.name in last.input[1:]:
            initializer.CopyFrom(numpy_helper.from_array(-numpy_helper.to_array(initializer), initializer.name))
    onnx.save(model, str(path))
    return path


def _packaged(cwd: Path, *args) -> Path:
    cwd.mkdir(parents=True, exist_ok=True)
    result = run_cli(["target=openvino_cpu", "precision=fp32", "pipeline.stages=[convert,build,verify,package]",
                      *args], cwd)
    assert result.returncode == 0, result.stdout + result.stderr
    return single_bundle(run_dirs(cwd)[-1])


@pytest.fixture(scope="module")
def bundles(tmp_path_factory):
    root = tmp_path_factory.mktemp("forge")
    good = _packaged(root / "good")
    evil = _packaged(root / "evil", f"model.path={negated(root / 'evil.onnx')}")
    return good, evil


def forge(good: Path, evil: Path, into: Path) -> Path:
    """The good bundle with the evil model's IR, the cache key and the manifest rewritten
    to match it: every sha256 the integrity checks read agrees."""
    shutil.copytree(good, into)
    settings = json.loads(json.dumps(__import__("yaml").safe_load((into / "runtime.yaml").read_text())))
    for name in settings["files"]:
        shutil.copyfile(evil / name, into / name)
    key = into / compile_cache.FOLDER / compile_cache.KEY_FILE
    recorded = json.loads(key.read_text())
    recorded["artifact_sha256"] = compile_cache.artifact_sha256(into, settings)
    write_json(key, recorded)
    manifest = json.loads((into / MANIFEST).read_text())
    files = hash_tree(into)
    files.pop(MANIFEST)
    manifest["files"] = {p: {"sha256": d, "bytes": (into / p).stat().st_size} for p, d in files.items()}
    manifest["content_sha256"] = content_sha256(files)
    manifest["compile_cache"] = compile_cache_entry(into, files)
    write_json(into / MANIFEST, manifest)
    return into


def test_a_forged_model_behind_the_old_cache_is_refused(bundles, tmp_path):
    good, evil = bundles
    assert (good / compile_cache.FOLDER).is_dir()
    assert bundle_cli(["check", good], tmp_path).returncode == 0
    forged = forge(good, evil, tmp_path / "forged")
    assert bundle_cli(["verify", forged], tmp_path).returncode == 0  # every sha256 agrees
    result = bundle_cli(["check", forged], tmp_path)
    _one_line(result, 2, "compile cache", "does not compute what its model", "changed after packaging")
    # without the cache a machine compiles the forged model: judged on it, it fails
    shutil.rmtree(forged / compile_cache.FOLDER)
    runtime = forged / "runtime.yaml"
    runtime.write_text("\n".join(line for line in runtime.read_text().splitlines()
                                 if not line.startswith(f"{compile_cache.CACHE_FIELD}:")) + "\n")
    forge_manifest = json.loads((forged / MANIFEST).read_text())
    files = hash_tree(forged)
    files.pop(MANIFEST)
    forge_manifest.update(files={p: {"sha256": d, "bytes": (forged / p).stat().st_size} for p, d in files.items()},
                          content_sha256=content_sha256(files), compile_cache=None)
    write_json(forged / MANIFEST, forge_manifest)
    result = bundle_cli(["check", forged], tmp_path)
    assert result.returncode == 3 and "cosine -" in result.stdout, result.stdout + result.stderr


def test_signatures_round_trip_and_a_one_byte_change_is_refused(bundles, tmp_path):
    good, _ = bundles
    key = tmp_path / "release.key"
    result = bundle_cli(["keygen", key], tmp_path)
    assert result.returncode == 0 and (key.stat().st_mode & 0o777) == 0o600
    public = Path(f"{key}.pub")
    sweep = tmp_path / "sweep"
    shutil.copytree(good.parent.parent, sweep / "job")  # the run folder, as one job of a sweep
    result = run_cli(["--sign", key, sweep], tmp_path, program="parity-release")
    assert result.returncode == 0, result.stdout + result.stderr
    release = sweep / "release"
    assert (release / "release.json.sig").is_file()
    (shipped,) = [p for p in (release / "bundles").iterdir() if p.is_dir()]
    assert (shipped / "manifest.json.sig").is_file()
    for target in (release, sweep / "release.tar.gz", shipped):
        result = bundle_cli(["verify", target, "--verify-key", public], tmp_path)
        assert result.returncode == 0 and "signatures valid" in result.stdout, result.stdout + result.stderr
    assert bundle_cli(["check", shipped, "--verify-key", public], tmp_path).returncode == 0
    # another key: refused
    other = tmp_path / "other.key"
    bundle_cli(["keygen", other], tmp_path)
    _one_line(bundle_cli(["check", shipped, "--verify-key", f"{other}.pub"], tmp_path), 2,
              "manifest.json does not match manifest.json.sig")
    # one byte of the manifest changed (its file list still consistent for verify): refused
    manifest = shipped / MANIFEST
    data = json.loads(manifest.read_text())
    data["verdict"] = "pass "
    manifest.write_text(json.dumps(data, indent=2) + "\n")
    _one_line(bundle_cli(["check", shipped, "--verify-key", public], tmp_path), 2, "changed after signing")
    # an unsigned bundle with a key asked for: refused
    _one_line(bundle_cli(["verify", good, "--verify-key", public], tmp_path), 2, "was not signed")
    # a bad key file: one line
    (tmp_path / "junk.pub").write_text("not a key")
    _one_line(bundle_cli(["verify", good, "--verify-key", tmp_path / "junk.pub"], tmp_path), 2, "not a PEM public key")


def test_openssl_verifies_the_signature_too(bundles, tmp_path):
    """The signature is plain Ed25519 over the manifest's bytes: OpenSSL checks it."""
    if shutil.which("openssl") is None and not os.environ.get("CI"):  # .ci/run installs it: there it must run
        pytest.skip("needs the openssl command (apt-get install openssl)")
    from pipeline.release import signing

    good, _ = bundles
    key, public = signing.generate(tmp_path / "k")
    copy = tmp_path / "b"
    shutil.copytree(good, copy)
    signature = signing.sign(copy / MANIFEST, key)
    raw = tmp_path / "sig.bin"
    raw.write_bytes(__import__("base64").b64decode(signature.read_text()))
    result = subprocess.run(["openssl", "pkeyutl", "-verify", "-pubin", "-inkey", str(public), "-rawin",
                             "-in", str(copy / MANIFEST), "-sigfile", str(raw)], capture_output=True, text=True)
    assert result.returncode == 0 and "Success" in result.stdout, result.stdout + result.stderr
    assert np.array_equal(np.frombuffer(raw.read_bytes(), np.uint8).shape, (64,))
