"""A sweep's job folders and the records in them, read without Hydra: parity-release and
parity-bundle import this, and the sweep's callback (pipeline/release/sweep.py) too."""

from __future__ import annotations

import os
from pathlib import Path
from typing import List, Optional

from pipeline.artifacts import read_json

JOB_FILE = "job.json"


def find_jobs(sweep: Path, skip: Optional[Path] = None) -> List[Path]:
    """Job folders under ``sweep``: folders with .hydra/, job.json or report.json that are
    not bundles or releases. A job folder can nest: an override value holding a path
    (model.path=/m/a.onnx) puts slashes into the folder name Hydra derives from it."""
    found = []
    for root, dirs, files in os.walk(sweep):
        here = Path(root)
        if here != Path(sweep) and _is_job(dirs, files):
            found.append(here)
            dirs.clear()
            continue
        # not every dot-folder: a path-valued override nests folders such as /root/.pyenv/...
        dirs[:] = sorted(d for d in dirs if d != ".hydra" and (skip is None or (here / d).resolve() != skip))
    return sorted(found)


def _is_job(dirs: List[str], files: List[str]) -> bool:
    if "manifest.json" in files or "release.json" in files:  # a bundle or a release
        return False
    return ".hydra" in dirs or JOB_FILE in files or "report.json" in files


def read_optional_json(path: Path) -> dict:
    """The JSON object in ``path``, or {} when it is missing, unreadable or not an object."""
    try:
        data = read_json(path)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
