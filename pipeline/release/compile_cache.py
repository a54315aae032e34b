"""Compile caches shipped in bundles: what a runtime produces when it compiles a model
(OpenVINO's CACHE_DIR blob, ONNX Runtime's optimized model), made at build time so that
loading a bundle skips the compilation.

A cache lives in the artifact folder as ``compile_cache/`` with ``key.json``: the backend,
its runtime versions, the device, the machine's fingerprint (CPU model and flags), a
hash of the runtime options it was compiled with and the sha256 of the artifact it was
compiled from (``artifact_sha256``: a changed model never runs from an old cache). A
loader uses the cache only when the whole key matches the artifact, machine and settings
it runs with; otherwise it compiles from the model as if there were no cache, and says
why ("stale: ..."). The blobs are not
byte-reproducible (runtimes embed pointers and timings), so bundles keep them out of
their content hash (pipeline/release/bundle.py)."""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path
from typing import Optional, Tuple

from pipeline import environment
from pipeline.artifacts import sha256_file, sha256_json, write_json
from pipeline.errors import first_line

FOLDER = "compile_cache"
KEY_FILE = "key.json"
CACHE_FIELD = "compile_cache"  # runtime.yaml: the folder, relative to the artifact


def key(backend_name: str, versions: dict, settings: dict, artifact_dir: Path) -> dict:
    """The cache's key. target.memory (options.memory) is left out: each runtime applies its
    memory settings where it loads the cache (ONNX Runtime's session options, OpenVINO's
    import config), so a build and its memory=default twin (verify.memory) load the same cache."""
    options = {name: value for name, value in settings.get("options", {}).items() if name != "memory"}
    return {"backend": backend_name, "versions": versions, "device": str(settings.get("device", "CPU")).upper(),
            "fingerprint": environment.fingerprint(), "options_sha256": sha256_json(options)[:16],
            "artifact_sha256": artifact_sha256(artifact_dir, settings)}


def artifact_sha256(artifact_dir: Path, settings: dict) -> str:
    """sha256 over the artifact's files (runtime.yaml's ``files``: the model, its weights)."""
    files = settings.get("files") or [settings["model"]]
    return sha256_json({name: sha256_file(Path(artifact_dir) / name) for name in sorted(files)})


def recorded_key(artifact_dir: Path, settings: dict) -> Optional[dict]:
    """The key.json of the artifact's compile cache; None without a cache or when unreadable."""
    name = settings.get(CACHE_FIELD)
    try:
        return json.loads((Path(artifact_dir) / name / KEY_FILE).read_text()) if name else None
    except (OSError, ValueError):
        return None


def write(backend, artifact_dir: Path, settings: dict) -> Optional[dict]:
    """Compile the artifact once with the backend's cache switched on and keep what it
    wrote; records the folder in ``settings``. None for a backend without a compile cache,
    or (with a warning) when compiling for it fails: the artifact then loads without one."""
    if not backend.CAPABILITIES.compile_cache:
        settings.pop(CACHE_FIELD, None)
        return None
    folder = Path(artifact_dir) / FOLDER
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    started = time.perf_counter()
    try:
        backend.write_compile_cache(Path(artifact_dir), settings, folder)
    except OSError:
        raise  # the file system's refusal is the run's error (pipeline/errors.py), not the model's
    except Exception as err:  # noqa: BLE001 - e.g. ONNX Runtime's type inference failing on an If/LSTM graph
        shutil.rmtree(folder, ignore_errors=True)
        settings.pop(CACHE_FIELD, None)
        logging.getLogger("parity").warning(f"no compile cache: {backend.NAME} failed compiling the artifact for "
                                            f"it ({first_line(err)}); the artifact loads without one")
        return None
    seconds = time.perf_counter() - started
    cache_key = key(backend.NAME, backend.versions(), settings, Path(artifact_dir))
    write_json(folder / KEY_FILE, cache_key)
    settings[CACHE_FIELD] = FOLDER
    files = sorted(p.relative_to(artifact_dir).as_posix() for p in folder.rglob("*") if p.is_file())
    return {"folder": FOLDER, "files": files, "bytes": sum((Path(artifact_dir) / f).stat().st_size for f in files),
            "compile_seconds": round(seconds, 4), "key": cache_key}


def usable(artifact_dir: Path, settings: dict, backend_name: str, versions: dict) -> Tuple[Optional[Path], str]:
    """The cache folder when its key matches this machine and these settings, else None;
    and a status for reports: "none", "hit", or "stale: <what differs>"."""
    name = settings.get(CACHE_FIELD)
    if not name:
        return None, "none"
    recorded = recorded_key(artifact_dir, settings)
    if not isinstance(recorded, dict):
        return None, f"stale: {FOLDER}/{KEY_FILE} is missing or unreadable"
    current = key(backend_name, versions, settings, Path(artifact_dir))
    differs = [field for field in current if recorded.get(field) != current[field]]
    if differs:
        return None, "stale: " + "; ".join(_difference(field, recorded.get(field), current[field]) for field in differs)
    return Path(artifact_dir) / name, "hit"


def _difference(field: str, recorded, current) -> str:
    if field == "versions":
        changed = [f"{name} {recorded.get(name) if isinstance(recorded, dict) else None} -> {current[name]}"
                   for name in current if not isinstance(recorded, dict) or recorded.get(name) != current[name]]
        return "built with " + ", ".join(changed)
    if field == "fingerprint":
        return "built on another machine (CPU fingerprint differs)"
    if field == "options_sha256":
        return "built for other runtime options"
    if field == "artifact_sha256":
        return "built for another model (the artifact's sha256 differs: the model changed after the cache was made)"
    return f"{field} {recorded} -> {current}"


def without_cache(settings: dict) -> dict:
    """The same runtime settings with the compile cache left out (a cold start)."""
    return {k: v for k, v in settings.items() if k != CACHE_FIELD}
