"""build: the deployable artifact for the target's backend and the runtime settings a
loader needs (runtime.yaml)."""

from __future__ import annotations

from pathlib import Path
from typing import List

import yaml

from pipeline import backends
from pipeline.errors import BackendUnavailable
from stages import StageContext, StageResult

NAME = "build"
VERSION = 1
CACHEABLE = True


def key_config(cfg):
    return {"target": cfg.target, "precision": cfg.precision.name}


def external_files(ctx: StageContext) -> List[Path]:
    return []


def run(ctx: StageContext) -> StageResult:
    target, precision = ctx.cfg.target, ctx.cfg.precision.name.value
    backend = backends.spec(target.backend.value)
    ok, reason = backend.available()
    if not ok:
        raise BackendUnavailable(f"target {target.name}: {reason}")
    convert = ctx.results["convert"]
    ir_dir = convert.out_dir if "ir_xml" in convert.files else None
    artifacts, settings = backend.build(convert.path("model"), ir_dir, ctx.out_dir, target, precision)
    runtime = {
        "format": 1,
        "backend": backend.NAME,
        "target": target.name,
        "device": target.device.upper(),
        "precision": precision,
        "memory_mode": target.memory_mode.value,
        "model": settings["model"],
        "files": artifacts,
        "options": settings.get("options", {}),
        "inputs": convert.summary["inputs"],
        "outputs": convert.summary["outputs"],
    }
    (ctx.out_dir / "runtime.yaml").write_text(yaml.safe_dump(runtime, sort_keys=False))
    files = {"runtime": "runtime.yaml", **{f"artifact:{name}": name for name in artifacts}}
    summary = {"backend": backend.NAME, "files": artifacts, "options": runtime["options"],
               "versions": backend.versions()}
    return StageResult(ctx.out_dir, files, summary)
