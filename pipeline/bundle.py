"""Loading a packaged bundle: integrity against its manifest, then a backend session."""

from __future__ import annotations

import hashlib
from pathlib import Path, PurePosixPath
from typing import Dict, List

import numpy as np
import yaml

from pipeline import backends
from pipeline.artifacts import read_json, sha256_file
from pipeline.data import TensorSpec, conform
from pipeline.errors import BackendUnavailable, InputError

MANIFEST = "manifest.json"
REPORTS = ("report.html", "report.json", "report.md")  # this run's timings: not reproducible


def is_cache(path: str) -> bool:
    """A compile-cache file (pipeline/compile_cache.py): checked by sha256 like every file,
    but runtimes do not write the same bytes twice, so it is not part of content_sha256."""
    from pipeline.compile_cache import FOLDER

    return PurePosixPath(path).parts[0] == FOLDER


def content_sha256(files: Dict[str, str]) -> str:
    """sha256 of the `sha256sum` listing ("<sha256>  <path>" lines sorted by path) of every
    file but the reports, the compile cache and the manifest: equal for bundles built
    from the same inputs."""
    listing = "".join(f"{files[path]}  {path}\n" for path in sorted(files)
                      if path not in (*REPORTS, MANIFEST) and not is_cache(path))
    return hashlib.sha256(listing.encode()).hexdigest()


def check_integrity(bundle: Path) -> dict:
    """The manifest, once every file in it is present with its recorded sha256 and no
    file was added; otherwise an InputError naming the first offending file."""
    bundle = Path(bundle)
    if not bundle.is_dir():
        raise InputError(f"bundle: {bundle} is not a bundle directory")
    try:
        manifest = read_json(bundle / MANIFEST)
        listed = manifest["files"]
    except (OSError, ValueError, KeyError) as err:
        raise InputError(f"bundle: {bundle / MANIFEST} is missing or unreadable ({err})") from err
    check_files(bundle, listed, MANIFEST, "bundle")
    recorded = manifest.get("content_sha256")
    if recorded and recorded != content_sha256({name: entry["sha256"] for name, entry in listed.items()}):
        raise InputError(f"bundle: {bundle / MANIFEST} has a content_sha256 that does not match its file list")
    return manifest


def check_files(root: Path, listed: dict, manifest_name: str, label: str) -> None:
    """Every listed file under root present with its sha256, and no other file but the
    manifest itself; otherwise an InputError naming the first offending file."""
    for name, entry in sorted(listed.items()):
        if PurePosixPath(name).is_absolute() or ".." in PurePosixPath(name).parts:
            raise InputError(f"{label}: {manifest_name} lists {name!r}, a path outside the folder")
        path = root / name
        if not path.is_file():
            raise InputError(f"{label}: {name} is listed in the manifest but missing")
        if sha256_file(path) != entry["sha256"]:
            raise InputError(f"{label}: {name} does not match its sha256 in the manifest (tampered or corrupt)")
    extra = sorted(p.relative_to(root).as_posix() for p in root.rglob("*")
                   if p.is_file() and p.relative_to(root).as_posix() not in (manifest_name, *listed))
    if extra:
        raise InputError(f"{label}: {extra[0]} is not listed in the manifest (added after packaging)")


def runtime_settings(bundle: Path) -> dict:
    return yaml.safe_load((Path(bundle) / "runtime.yaml").read_text())


def open_session(bundle: Path):
    settings = runtime_settings(bundle)
    backend = backends.spec(settings["backend"])
    ok, reason = backend.available()
    if not ok:
        raise BackendUnavailable(reason)
    return backend.load(Path(bundle), settings), settings


def read_inputs(path: Path, settings: dict) -> Dict[str, np.ndarray]:
    """Feeds from a .npy (one-input models) or .npz (keys = input names) file."""
    specs: List[TensorSpec] = [TensorSpec(**spec) for spec in settings["inputs"]]
    path = Path(path)
    if not path.is_file():
        raise InputError(f"--input: {path} does not exist")
    try:
        if path.suffix == ".npy":
            arrays = {specs[0].name: np.load(path, allow_pickle=False)} if len(specs) == 1 else {}
        else:
            with np.load(path, allow_pickle=False) as archive:
                arrays = {key: archive[key] for key in archive.files}
    except (ValueError, OSError, EOFError) as err:
        raise InputError(f"--input: {path} cannot be read as a NumPy file ({err})") from err
    if len(specs) == 1 and len(arrays) == 1:
        arrays = {specs[0].name: next(iter(arrays.values()))}
    missing = [s.name for s in specs if s.name not in arrays]
    if missing:
        raise InputError(f"--input: {path} lacks {missing}; the bundle's inputs are {[s.name for s in specs]}")
    return {s.name: conform(arrays[s.name], s, str(path), label="--input") for s in specs}


def recorded_samples(bundle: Path) -> List[dict]:
    """The validation inputs and reference outputs verify recorded in the bundle:
    [{"inputs": {name: array}, "reference": {name: array}}] in sample order."""
    path = Path(bundle) / "reproduce.npz"
    if not path.is_file():
        raise InputError(f"bundle: {path.name} is missing: the bundle was packaged without the verify stage")
    samples: Dict[int, dict] = {}
    with np.load(path, allow_pickle=False) as archive:
        for key in archive.files:
            role, index, name = key.split("/", 2)
            samples.setdefault(int(index), {"inputs": {}, "reference": {}})[
                "inputs" if role == "input" else "reference"][name] = archive[key]
    return [samples[i] for i in sorted(samples)]


def reproduce(bundle: Path, timeout_s: float = 600.0) -> dict:
    """Run the bundle on its recorded inputs, in a worker process, and judge its outputs
    against the recorded reference outputs with the thresholds of the packaged verdict."""
    from pipeline.config import OutputThresholds
    from pipeline.metrics import OutputStats, failures
    from pipeline.worker import BackendWorker

    bundle = Path(bundle)
    settings = runtime_settings(bundle)
    report = read_json(bundle / "report.json")
    thresholds = {o["name"]: OutputThresholds(**o["thresholds"]) for o in (report.get("verify") or {}).get("outputs", [])}
    samples = recorded_samples(bundle)
    backend = backends.spec(settings["backend"])
    ok, reason = backend.available()
    if not ok:
        raise BackendUnavailable(reason)
    stats: Dict[str, OutputStats] = {}
    with BackendWorker(backend.__name__, bundle, settings, label=f"bundle {bundle.name}", timeout_s=timeout_s) as worker:
        for sample in samples:
            actual = worker.run(sample["inputs"])
            for name, expected in sample["reference"].items():
                if name in thresholds and name in actual:
                    stats.setdefault(name, OutputStats()).update(expected, actual[name])
        effective = worker.effective()
    outputs = []
    for name, limits in thresholds.items():
        metrics = stats[name].result() if name in stats else None
        failed = failures(metrics, limits) if metrics else ["not produced"]
        outputs.append({"name": name, "metrics": metrics, "failures": failed, "passed": not failed})
    passed = bool(outputs) and bool(samples) and all(o["passed"] for o in outputs)
    return {"samples": len(samples), "outputs": outputs, "effective": effective,
            "packaged_verdict": report.get("verdict"), "verdict": "pass" if passed else "fail"}
