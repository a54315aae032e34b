"""package: the deployable bundle (artifact, runtime.yaml, manifest.json with sha256 of
every file, report.json/.md/.html, text data's tokenizer.json) written to a temporary
folder and renamed into place, plus a reproducible .tar.gz of it. The manifest's content_sha256 covers every file but
the reports (they hold this run's timings), the compile cache (runtimes write blobs that
differ from compile to compile) and itself: the same inputs and config give the same
content_sha256."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import List

import yaml

from pipeline import environment
from pipeline.precision import kinds
from pipeline.release import compile_cache
from pipeline.config.schemas import DataKind, plain
from pipeline.release.archive import write_tar_gz
from pipeline.artifacts import atomic_directory, hash_tree, remove_stale_temps, sha256_file, write_json
from pipeline.release.bundle import REPORTS, compile_cache_entry, content_sha256, is_cache
from pipeline.errors import writing
from pipeline.report import write_reports
from pipeline.report.assemble import assemble, model_name
from pipeline.data import preprocess_record
from pipeline.data.text import text_record
from pipeline.task_metrics import bundle_record
from stages import StageContext, StageResult, deployable
from stages.results import PackageSummary

NAME = "package"
CACHEABLE = False  # cheap, and it must reflect this run's report
MANIFEST = "manifest.json"
REPRODUCE = "reproduce.npz"


def key_config(cfg):
    return {"package": cfg.package}


def external_files(ctx: StageContext) -> List[Path]:
    return []


def bundle_name(cfg) -> str:
    """package.name, or model-target-precision; int8 with ranges computed per call says so
    (``-int8_dynamic``: a different build from static int8, with other speed and accuracy)."""
    precision = kinds.build_name(cfg.precision.kind, cfg.precision.dynamic_ranges)
    return cfg.package.name or f"{model_name(cfg)}-{cfg.target.name}-{precision}"


def run(ctx: StageContext) -> StageResult:
    """bundle/<name>/ and bundle/<name>.tar.gz written side by side in a staging folder
    that is renamed onto bundle/ last: a kill leaves the earlier bundle folder and archive,
    or the new ones, never a mix (and job.json, set aside at the run's start, is written
    after). Staging folders of earlier killed runs are removed first."""
    cfg = ctx.cfg
    name = bundle_name(cfg)
    parent = ctx.run_dir / "bundle"
    with writing(ctx.run_dir):
        remove_stale_temps(parent)
        with atomic_directory(parent, replace=True) as staged:
            _write_bundle(ctx, staged / name, name)
            if cfg.package.archive:
                write_tar_gz(staged / name, staged / f"{name}.tar.gz", name)
    final = parent / name
    files = {"bundle": f"../../bundle/{name}"}
    if cfg.package.archive:
        files["archive"] = f"../../bundle/{name}.tar.gz"
    summary = {"bundle": str(final), "archive": str(parent / f"{name}.tar.gz") if cfg.package.archive else None,
               "files": sorted(p.name for p in final.iterdir()), "manifest_sha256": sha256_file(final / MANIFEST)}
    return StageResult(ctx.out_dir, files, PackageSummary.from_json(summary))


def _write_bundle(ctx: StageContext, folder: Path, name: str) -> None:
    cfg = ctx.cfg
    artifact = deployable(ctx.results)  # build's folder, or tune's with the tuned runtime.yaml
    report = assemble(cfg, ctx.records, ctx.results)
    folder.mkdir()
    runtime = yaml.safe_load(artifact.path("runtime").read_text())
    # what parity-bundle run applies: the declared preprocessing, the metric (its decoder)
    preprocess, metric = preprocess_record(cfg.data.kind, cfg.data.preprocess), bundle_record(cfg.metric, folder)
    if cfg.data.kind is DataKind.text:  # the tokenizer travels with the bundle (pipeline/data/text.py)
        preprocess = text_record(cfg.data)
        shutil.copyfile(Path(cfg.data.tokenizer).expanduser(), folder / preprocess["tokenizer"])
    runtime.update({key: value for key, value in (("preprocess", preprocess), ("metric", metric)) if value})
    (folder / "runtime.yaml").write_text(yaml.safe_dump(runtime, sort_keys=False))
    for file in runtime["files"]:
        shutil.copyfile(artifact.out_dir / file, folder / file)
    if runtime.get(compile_cache.CACHE_FIELD):
        _copy_files(artifact.out_dir / runtime[compile_cache.CACHE_FIELD], folder / runtime[compile_cache.CACHE_FIELD])
    verify = ctx.results.get("verify")
    if verify and "reproduce" in verify.files:  # inputs and reference outputs: parity-bundle check
        shutil.copyfile(verify.path("reproduce"), folder / REPRODUCE)
    write_reports(report, folder)
    write_json(folder / MANIFEST, manifest(folder, name, cfg, report))


def _copy_files(source: Path, destination: Path) -> None:
    """The files under ``source``, with new folders and files (the umask's modes, where
    copytree would copy the stage cache's folder modes)."""
    for path in sorted(p for p in source.rglob("*") if p.is_file()):
        target = destination / path.relative_to(source)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, target)


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
        "compile_cache": compile_cache_entry(bundle, files),
        "content_sha256": content_sha256(files),
        "versions": environment.versions(),
        "cpu": environment.cpu(),
        "config": plain(cfg),
    }

