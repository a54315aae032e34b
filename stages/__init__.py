"""The pipeline's stages, one module each.

A stage module defines:

    NAME        the stage's name in ``pipeline.stages``
    VERSION     bumped when the stage's output for the same inputs changes
    CACHEABLE   whether the runner may reuse an earlier run's output
    key_config(cfg) -> dict          the config the output depends on
    external_files(ctx) -> [Path]    files outside the run that it reads (hashed)
    run(ctx) -> StageResult

A stage reads what earlier stages produced through ``ctx.results`` (never by importing
another stage) and writes only into ``ctx.out_dir``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Dict, List

from pipeline.config import RunConfig

STAGE_NAMES = ("convert", "build", "verify", "package")


@dataclass
class StageResult:
    out_dir: Path
    files: Dict[str, str] = field(default_factory=dict)  # artifact role -> path relative to out_dir
    summary: dict = field(default_factory=dict)  # JSON for the report

    def path(self, role: str) -> Path:
        return self.out_dir / self.files[role]

    def to_json(self) -> dict:
        return {"files": self.files, "summary": self.summary}


@dataclass
class StageContext:
    cfg: RunConfig
    run_dir: Path
    out_dir: Path
    results: Dict[str, StageResult]  # earlier stages of this run, by name
    records: List[dict]  # timing records of earlier stages


def load(name: str) -> ModuleType:
    return importlib.import_module(f"stages.{name}")
