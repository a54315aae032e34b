"""Loading a packaged bundle: integrity against its manifest, then a backend session."""

from __future__ import annotations

import hashlib
from pathlib import Path, PurePosixPath
from typing import Dict, List, Optional

import numpy as np
import yaml

from pipeline import backends
from pipeline.release import compile_cache
from pipeline.artifacts import read_json, sha256_file
from pipeline.data import TensorSpec, conform, load_arrays
from pipeline.errors import BackendUnavailable, ExitCode, InputError

MANIFEST = "manifest.json"
REPORTS = ("report.html", "report.json", "report.md")  # this run's timings: not reproducible


def is_cache(path: str) -> bool:
    """A compile-cache file (pipeline/release/compile_cache.py): checked by sha256 like every file,
    but runtimes do not write the same bytes twice, so it is not part of content_sha256."""
    return PurePosixPath(path).parts[0] == compile_cache.FOLDER


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
    check_compile_cache(bundle, manifest)
    return manifest


def compile_cache_entry(bundle: Path, files: Dict[str, str]) -> Optional[dict]:
    """The manifest's ``compile_cache`` entry: the sha256 of the cache files' listing (they
    are left out of content_sha256) and of the artifact the cache was compiled from."""
    caches = {path: digest for path, digest in files.items() if is_cache(path)}
    if not caches:
        return None
    recorded = compile_cache.recorded_key(bundle, runtime_settings(bundle)) or {}
    listing = "".join(f"{caches[path]}  {path}\n" for path in sorted(caches))
    return {"files_sha256": hashlib.sha256(listing.encode()).hexdigest(),
            "artifact_sha256": recorded.get("artifact_sha256")}


def check_compile_cache(bundle: Path, manifest: dict) -> None:
    """A compile cache compiled from another model than the bundle's (the model was
    changed after packaging, or the cache swapped) is refused: a loader would run it."""
    if not (bundle / "runtime.yaml").is_file() or not any(is_cache(path) for path in manifest["files"]):
        return
    files = {path: entry["sha256"] for path, entry in manifest["files"].items()}
    entry = manifest.get("compile_cache")
    if entry is not None and entry != compile_cache_entry(bundle, files):
        raise InputError(f"bundle: {bundle / MANIFEST}: its compile_cache entry does not match the cache's files "
                         f"and key (tampered or corrupt)")
    settings = runtime_settings(bundle)
    built_for = (compile_cache.recorded_key(bundle, settings) or {}).get("artifact_sha256")
    if built_for is not None and built_for != compile_cache.artifact_sha256(bundle, settings):
        raise InputError(f"bundle: its compile cache ({compile_cache.FOLDER}/) was compiled from another model "
                         f"than the bundle's {settings['model']} (changed after packaging); rebuild the bundle")


def check_files(root: Path, listed: dict, manifest_name: str, label: str) -> None:
    """Every listed file under root present with its sha256, and no other file but the
    manifest itself and its signature; otherwise an InputError naming the first offending file."""
    for name, entry in sorted(listed.items()):
        if PurePosixPath(name).is_absolute() or ".." in PurePosixPath(name).parts:
            raise InputError(f"{label}: {manifest_name} lists {name!r}, a path outside the folder")
        path = root / name
        if not path.is_file():
            raise InputError(f"{label}: {name} is listed in the manifest but missing")
        if sha256_file(path) != entry["sha256"]:
            raise InputError(f"{label}: {name} does not match its sha256 in the manifest (tampered or corrupt)")
    own = (manifest_name, f"{manifest_name}.sig")  # the manifest and its signature (pipeline/release/signing.py)
    extra = sorted(p.relative_to(root).as_posix() for p in root.rglob("*")
                   if p.is_file() and p.relative_to(root).as_posix() not in (*own, *listed))
    if extra:
        raise InputError(f"{label}: {extra[0]} is not listed in the manifest (added after packaging)")


def runtime_settings(bundle: Path) -> dict:
    """The bundle's runtime.yaml; one written in a layout newer than this parity's is refused
    (a bundle from before the field was written reads as format 1)."""
    from pipeline.backends.artifact import RUNTIME, RUNTIME_FORMAT

    path = Path(bundle) / RUNTIME
    settings = yaml.safe_load(path.read_text())
    found = settings.get("format", 1) if isinstance(settings, dict) else None
    if not isinstance(found, int) or isinstance(found, bool) or found > RUNTIME_FORMAT:
        raise InputError(f"bundle: {path} is in runtime.yaml format {found!r}; this parity reads format "
                         f"{RUNTIME_FORMAT} and older: run the bundle with the parity that packaged it, or upgrade")
    return settings


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
        arrays = load_arrays(path, specs) if path.suffix != ".npy" or len(specs) == 1 else {}
    except (ValueError, OSError, EOFError) as err:
        raise InputError(f"--input: {path} cannot be read as a NumPy file ({err})") from err
    missing = [s.name for s in specs if s.name not in arrays]
    if missing:
        raise InputError(f"--input: {path} lacks {missing}; the bundle's inputs are {[s.name for s in specs]}")
    return {s.name: conform(arrays[s.name], s, str(path), label="--input") for s in specs}


def recorded_samples(bundle: Path) -> List[dict]:
    """The validation inputs, reference outputs and (since verify VERSION 8) the target's
    outputs verify recorded in the bundle: [{"inputs": {name: array}, "reference": {...},
    "target": {...}}] in sample order."""
    path = Path(bundle) / "reproduce.npz"
    if not path.is_file():
        raise InputError(f"bundle: {path.name} is missing: the bundle was packaged without the verify stage")
    samples: Dict[int, dict] = {}
    roles = {"input": "inputs", "reference": "reference", "target": "target"}
    for key, value in load_arrays(path).items():
        role, index, name = key.split("/", 2)
        samples.setdefault(int(index), {"inputs": {}, "reference": {}, "target": {}})[roles[role]][name] = value
    return [samples[i] for i in sorted(samples)]


REPRODUCED_COSINE = 0.999999  # the bundle's outputs on this machine vs the packaged run's own outputs


def _run_recorded(backend, bundle: Path, settings: dict, samples: list, thresholds: dict, timeout_s: float,
                  label: str = ""):
    """The recorded inputs through the bundle in a worker: (stats against the reference,
    stats against the packaged run's outputs, what ran, the outputs)."""
    from pipeline.verification.metrics import OutputStats
    from pipeline.worker import BackendWorker

    stats: Dict[str, OutputStats] = {}
    same: Dict[str, OutputStats] = {}
    outputs = []
    with BackendWorker(backend.__name__, bundle, settings, label=f"bundle {bundle.name}{label}",
                       timeout_s=timeout_s) as worker:
        for sample in samples:
            actual = worker.run(sample["inputs"])
            outputs.append(actual)
            for name, expected in sample["reference"].items():
                if name in thresholds and name in actual:
                    stats.setdefault(name, OutputStats()).update(expected, actual[name])
                if name in sample["target"] and name in actual:
                    same.setdefault(name, OutputStats()).update(sample["target"][name], actual[name])
        effective = worker.effective()
    return stats, same, effective, outputs


def _check_cache_runs_the_artifact(backend, bundle: Path, settings: dict, samples: list, artifact_outputs: list,
                                   timeout_s: float) -> None:
    """The bundle is judged by what its artifact computes (a machine without the cache
    compiles it); its compile cache must compute the same, or it is another model's (a
    cache and its key.json rewritten with the model and the manifest): InputError."""
    from pipeline.verification.metrics import OutputStats

    cached = _run_recorded(backend, bundle, settings, samples, {}, timeout_s, " (compile cache)")[3]
    agreement: Dict[str, OutputStats] = {}
    for expected, actual in zip(artifact_outputs, cached):
        for name in expected.keys() & actual.keys():
            agreement.setdefault(name, OutputStats()).update(expected[name], actual[name])
    for name, found in agreement.items():
        cosine = found.result()["cosine"]
        if cosine < REPRODUCED_COSINE:
            raise InputError(f"bundle: its compile cache ({compile_cache.FOLDER}/) does not compute what its model "
                             f"{settings['model']} computes (output {name}: cosine {cosine:.6f} between them): the "
                             "cache or the model was changed after packaging; rebuild the bundle")


def reproduce(bundle: Path, timeout_s: float = 600.0) -> dict:
    """Run the bundle on its recorded inputs, in a worker process, and judge it with the
    verdict the run used (pipeline.verification.verdict). When its outputs reproduce the packaged run's
    own outputs, the packaged accuracy, task, speed and memory results stand (they were
    measured on the whole validation set) and this machine's device and precision are judged anew:
    the same bundle on the same machine gets the run's verdict and exit code. Otherwise
    the outputs are judged on the recorded samples against the recorded reference."""
    from pipeline.config.schemas import OutputThresholds
    from pipeline.verification.metrics import failures
    from pipeline.verification.verdict import judge

    bundle = Path(bundle)
    settings = runtime_settings(bundle)
    report = read_json(bundle / "report.json")
    verify = report.get("verify") or {}
    thresholds = {o["name"]: OutputThresholds(**o["thresholds"]) for o in verify.get("outputs", [])}
    samples = recorded_samples(bundle)
    backend = backends.spec(settings["backend"])
    ok, reason = backend.available()
    if not ok:
        raise BackendUnavailable(reason)
    stats, same, effective, outputs = _run_recorded(backend, bundle, compile_cache.without_cache(settings), samples,
                                                    thresholds, timeout_s)
    if settings.get(compile_cache.CACHE_FIELD):
        _check_cache_runs_the_artifact(backend, bundle, settings, samples, outputs, timeout_s)
    outputs = []
    for name, limits in thresholds.items():
        metrics = stats[name].result() if name in stats else None
        failed = failures(metrics, limits) if metrics else ["not produced"]
        outputs.append({"name": name, "metrics": metrics, "failures": failed, "passed": not failed})
    reproduced = bool(same) and len(same) == len(thresholds) and all(
        s.result()["cosine"] >= REPRODUCED_COSINE for s in same.values())
    judged = verify.get("judged_with") or {}
    _, reasons, code = judge(verify["outputs"] if reproduced else outputs, [], verify.get("task") if reproduced
                             else None, verify["requested"], effective, len(samples), None,
                             judged.get("fail_on_float_fallback", False), tuple(judged.get("intended_float", ())),
                             verify.get("memory") if reproduced else None, judged.get("max_memory_mb"))
    speed_failure = (verify.get("speed") or {}).get("failure")
    if reproduced and speed_failure:  # as verify appends it: after every other reason
        reasons.append(speed_failure)
        code = code if reasons[:-1] else ExitCode.THRESHOLD
    return {"samples": len(samples), "outputs": outputs, "effective": effective, "reproduced": reproduced,
            "reasons": reasons, "exit_code": int(code), "packaged_verdict": report.get("verdict"),
            "packaged_exit_code": report.get("exit_code"), "verdict": "pass" if not reasons else "fail"}
