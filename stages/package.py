"""package: the deployable bundle (artifact, runtime.yaml, manifest.json with sha256 of
every file, report.json/.md/.html) written to a temporary folder and renamed into place,
plus a reproducible .tar.gz of it. The manifest's content_sha256 covers every file but
the reports (they hold this run's timings), the compile cache (runtimes write blobs that
differ from compile to compile) and itself: the same inputs and config give the same
content_sha256."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import List

import yaml

from pipeline import compile_cache, environment
from pipeline.config import plain
from pipeline.archive import write_tar_gz
from pipeline.artifacts import atomic_directory, atomic_write_bytes, hash_tree, write_json
from pipeline.bundle import REPORTS, content_sha256, is_cache
from pipeline.report import render_html, render_markdown
from pipeline.report.assemble import assemble, model_name
from stages import StageContext, StageResult, deployable

NAME = "package"
VERSION = 2
CACHEABLE = False  # cheap, and it must reflect this run's report
MANIFEST = "manifest.json"
REPRODUCE = "reproduce.npz"


def key_config(cfg):
    return {"package": cfg.package}


def external_files(ctx: StageContext) -> List[Path]:
    return []


def bundle_name(cfg) -> str:
    return cfg.package.name or f"{model_name(cfg)}-{cfg.target.name}-{cfg.precision.name.value}"


def run(ctx: StageContext) -> StageResult:
    cfg = ctx.cfg
    artifact = deployable(ctx.results)  # build's folder, or tune's with the tuned runtime.yaml
    name = bundle_name(cfg)
    final = ctx.run_dir / "bundle" / name
    report = assemble(cfg, ctx.records, ctx.results)
    with atomic_directory(final, replace=True) as temp:
        runtime = yaml.safe_load(artifact.path("runtime").read_text())
        if cfg.data.kind.value == "images":
            runtime["preprocess"] = plain(cfg.data.preprocess)
        (temp / "runtime.yaml").write_text(yaml.safe_dump(runtime, sort_keys=False))
        for file in runtime["files"]:
            shutil.copyfile(artifact.out_dir / file, temp / file)
        if runtime.get(compile_cache.CACHE_FIELD):
            shutil.copytree(artifact.out_dir / runtime[compile_cache.CACHE_FIELD], temp / runtime[compile_cache.CACHE_FIELD])
        verify = ctx.results.get("verify")
        if verify and "reproduce" in verify.files:  # inputs and reference outputs: parity-bundle check
            shutil.copyfile(verify.path("reproduce"), temp / REPRODUCE)
        write_json(temp / "report.json", report)
        (temp / "report.md").write_text(render_markdown(report))
        (temp / "report.html").write_text(render_html(report))
        write_json(temp / MANIFEST, manifest(temp, name, cfg, report))
    files = {"bundle": f"../../bundle/{name}"}
    if cfg.package.archive:
        archive = final.parent / f"{name}.tar.gz"
        atomic_write_bytes(archive, lambda temp: write_tar_gz(final, temp, name))
        files["archive"] = f"../../bundle/{name}.tar.gz"
    summary = {"bundle": str(final), "archive": str(final.parent / f"{name}.tar.gz") if cfg.package.archive else None,
               "files": sorted(p.name for p in final.iterdir())}
    return StageResult(ctx.out_dir, files, summary)


def manifest(bundle: Path, name: str, cfg, report: dict) -> dict:
    files = hash_tree(bundle)
    files.pop(MANIFEST, None)
    return {
        "format": 1,
        "name": name,
        "verdict": report["verdict"],
        "files": {path: {"sha256": digest, "bytes": (bundle / path).stat().st_size} for path, digest in files.items()},
        "reports": [path for path in files if path in REPORTS],
        "caches": [path for path in files if is_cache(path)],
        "content_sha256": content_sha256(files),
        "versions": environment.versions(),
        "cpu": environment.cpu(),
        "config": plain(cfg),
    }

