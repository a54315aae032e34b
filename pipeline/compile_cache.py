"""Compile caches shipped in bundles: what a runtime produces when it compiles a model
(OpenVINO's CACHE_DIR blob, ONNX Runtime's optimized model), made at build time so that
loading a bundle skips the compilation.

A cache lives in the artifact folder as ``compile_cache/`` with ``key.json``: the backend,
its runtime versions, the device, the machine's fingerprint (CPU model and flags) and a
hash of the runtime options it was compiled with. A loader uses the cache only when the
whole key matches the machine and settings it runs with; otherwise it compiles from the
model as if there were no cache, and says why ("stale: ..."). The blobs are not
byte-reproducible (runtimes embed pointers and timings), so bundles keep them out of
their content hash (pipeline/bundle.py)."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Optional, Tuple

from pipeline import environment
from pipeline.artifacts import sha256_json, write_json

FOLDER = "compile_cache"
KEY_FILE = "key.json"
CACHE_FIELD = "compile_cache"  # runtime.yaml: the folder, relative to the artifact


def key(backend_name: str, versions: dict, settings: dict) -> dict:
    return {"backend": backend_name, "versions": versions, "device": str(settings.get("device", "CPU")).upper(),
            "fingerprint": environment.fingerprint(), "options_sha256": sha256_json(settings.get("options", {}))[:16]}


def write(backend, artifact_dir: Path, settings: dict) -> Optional[dict]:
    """Compile the artifact once with the backend's cache switched on and keep what it
    wrote; records the folder in ``settings``. None for a backend without a compile cache."""
    if not hasattr(backend, "write_compile_cache"):
        settings.pop(CACHE_FIELD, None)
        return None
    folder = Path(artifact_dir) / FOLDER
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    started = time.perf_counter()
    backend.write_compile_cache(Path(artifact_dir), settings, folder)
    seconds = time.perf_counter() - started
    cache_key = key(backend.NAME, backend.versions(), settings)
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
    folder = Path(artifact_dir) / name
    try:
        recorded = json.loads((folder / KEY_FILE).read_text())
    except (OSError, ValueError):
        return None, f"stale: {FOLDER}/{KEY_FILE} is missing or unreadable"
    current = key(backend_name, versions, settings)
    differs = [field for field in current if recorded.get(field) != current[field]]
    if differs:
        return None, "stale: " + "; ".join(_difference(field, recorded.get(field), current[field]) for field in differs)
    return folder, "hit"


def _difference(field: str, recorded, current) -> str:
    if field == "versions":
        changed = [f"{name} {recorded.get(name) if isinstance(recorded, dict) else None} -> {current[name]}"
                   for name in current if not isinstance(recorded, dict) or recorded.get(name) != current[name]]
        return "built with " + ", ".join(changed)
    if field == "fingerprint":
        return "built on another machine (CPU fingerprint differs)"
    if field == "options_sha256":
        return "built for other runtime options"
    return f"{field} {recorded} -> {current}"


def without_cache(settings: dict) -> dict:
    """The same runtime settings with the compile cache left out (a cold start)."""
    return {k: v for k, v in settings.items() if k != CACHE_FIELD}
