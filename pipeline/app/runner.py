"""Runs the configured stages in order, each one computed or served from the cache.

The cache key of a stage is a hash of: the stage's name and version, the parity and
runtime versions, the config the stage declares it depends on, the files every earlier
stage produced, and the external files it reads (model, data). A hit copies the cached
output folder into the run; a miss runs the stage and stores its output atomically.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional


import stages
from pipeline import environment
from pipeline.artifacts import (atomic_directory, cache_lock, hash_files, hash_tree, read_json, remove_stale_temps,
                                sha256_json, write_json)
from pipeline.config.schemas import RunConfig, plain
from pipeline.console import PROGRESS, job_step
from pipeline.errors import ExitCode, writing
from pipeline.report.render import keep_compiled_templates
from stages import StageContext, StageResult
from stages.results import VerifySummary, summary_of

log = logging.getLogger("parity")
# "stage X: running / computed / cached": parity.log's record of each stage; on a terminal
# the job's live line shows the stage instead (pipeline/console.py)
progress_log = logging.getLogger(PROGRESS)
# results computed in this process and not cached (a step cut by precision.budget_s): the
# stage folder that holds each, by cache key. precision=auto builds a candidate, then runs
# the same folder again through verify: the cut result serves that second run instead of
# being computed again past the deadline (the mixed search of PP-OCRv4 det at 736: 66 s)
_UNCACHED_THIS_JOB: Dict[tuple, Path] = {}


@dataclass
class RunOutcome:
    run_dir: Path
    results: Dict[str, StageResult] = field(default_factory=dict)
    records: List[dict] = field(default_factory=list)

    @property
    def verify(self) -> Optional[VerifySummary]:
        result = self.results.get("verify")
        return result.summary if result else None

    @property
    def exit_code(self) -> ExitCode:
        return ExitCode(self.verify.exit_code) if self.verify else ExitCode.OK


def run_pipeline(cfg: RunConfig, run_dir: Path, until: Optional[str] = None) -> RunOutcome:
    """The configured stages in order; ``until``: stopping after that stage (precision=auto
    builds a candidate before it decides to verify it: the build made for a config with
    verify makes what verify needs, and the verified run is served it from the cache)."""
    outcome = RunOutcome(Path(run_dir))
    cache_root = Path(cfg.pipeline.cache_dir).expanduser() if cfg.pipeline.cache else None
    if cache_root:
        keep_compiled_templates(cache_root / "templates")
    output_hashes: Dict[str, dict] = {}  # each finished stage's files, hashed once
    for name in cfg.pipeline.stages:
        stage = stages.load(name)
        job_step(f"stage {name}")
        out_dir = outcome.run_dir / "stages" / name
        ctx = StageContext(cfg, outcome.run_dir, out_dir, outcome.results, outcome.records, cache_root, output_hashes)
        started = time.perf_counter()
        key = _stage_key(stage, ctx, _inputs_of(stage, outcome.results, output_hashes)) \
            if cache_root and stage.CACHEABLE else None
        # Jobs of a sweep share the cache: the first to take an entry's lock computes it,
        # the others wait and are served from it.
        with _locked_entry(cache_root, name, key):
            cached = _from_cache(cache_root / name / key, out_dir, name) if key else None
            if cached is None and key:
                cached = _from_this_job(cache_root, name, key, out_dir)
            if cached is not None:
                result, computed_seconds = cached
                status = "cached"
            else:
                result, computed_seconds = _compute(stage, ctx, out_dir, started)
                if key and result.cache:
                    _to_cache(out_dir, cache_root / name / key)
                elif key:
                    _UNCACHED_THIS_JOB[(str(cache_root), name, key)] = out_dir
                status = "cached" if result.reused else "computed"
        seconds = time.perf_counter() - started
        progress_log.info("stage %s: %s in %.2f s", name, status, seconds)
        outcome.results[name] = result
        if cache_root:
            output_hashes[name] = {path: digest for path, digest in hash_tree(out_dir).items() if path != "result.json"}
        outcome.records.append({"stage": name, "status": status, "seconds": round(seconds, 4),
                                "computed_seconds": round(computed_seconds, 4), "key": key})
        if name == until:
            break
    job_step("")
    return outcome


@contextlib.contextmanager
def _locked_entry(cache_root: Optional[Path], name: str, key: Optional[str]):
    """The cache entry's lock (none without a key); a cache folder that cannot be written
    (read-only, full) is an environment error, exit 5."""
    with contextlib.ExitStack() as stack:
        if key:
            with writing(cache_root):
                stack.enter_context(cache_lock(cache_root, name, key))
        yield


def _compute(stage, ctx: StageContext, out_dir: Path, started: float):
    progress_log.info("stage %s: running", stage.NAME)
    with writing(out_dir):
        if out_dir.exists():
            shutil.rmtree(out_dir)
        out_dir.mkdir(parents=True)
        result = stage.run(ctx)
        computed_seconds = time.perf_counter() - started
        write_json(out_dir / "result.json", {**result.to_json(), "computed_seconds": computed_seconds})
    return result, computed_seconds


def _inputs_of(stage, results: Dict[str, StageResult], output_hashes: Dict[str, dict]) -> Dict[str, dict]:
    """Hashes of the earlier outputs the stage reads: all of them unless the stage
    declares ``READS = {stage: [roles]}`` (None: every file of that stage). Declaring
    lets e.g. calibration be shared by targets whose convert output differs only by an
    OpenVINO IR that calibration never reads."""
    reads = getattr(stage, "READS", None)
    if reads is None:
        return output_hashes
    chosen = {}
    for earlier, roles in reads.items():
        if earlier not in output_hashes:
            continue
        hashes = output_hashes[earlier]
        if roles is not None:
            names = {results[earlier].files[role] for role in roles if role in results[earlier].files}
            hashes = {path: digest for path, digest in hashes.items() if path in names}
        chosen[earlier] = hashes
    return chosen


def _stage_key(stage, ctx: StageContext, earlier: Dict[str, dict]) -> str:
    material = {
        "stage": stage.NAME,
        "code": stages.code_version(),
        "runtimes": environment.versions(),
        "config": plain(stage.key_config(ctx.cfg)),
        "earlier": earlier,
        "external": list(hash_files(stage.external_files(ctx)).values()),
    }
    if getattr(stage, "ON_MACHINE", None):
        material["machine"] = stages.machine(ctx.cfg.target, with_device=stage.ON_MACHINE == "device")
    return sha256_json(material)[:32]


def _from_cache(entry: Path, out_dir: Path, name: str):
    """The cached result of stage ``name`` (its summary typed again, stages/results.py), or
    None on a miss. An unreadable entry is a miss, never an error."""
    if not (entry / "result.json").is_file():
        return None
    if out_dir.exists():
        shutil.rmtree(out_dir)
    try:
        shutil.copytree(entry, out_dir)
        result, computed_seconds = _saved_result(out_dir, name)
        missing = [f for f in result.files.values() if not (out_dir / f).exists() and not f.startswith("..")]
        if missing:
            raise OSError(f"missing {missing[0]}")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        log.warning("ignoring broken stage cache entry %s: %s", entry, err)
        shutil.rmtree(out_dir, ignore_errors=True)
        shutil.rmtree(entry, ignore_errors=True)  # the recomputed output takes its place
        return None
    return result, computed_seconds


def _saved_result(out_dir: Path, name: str):
    """(the stage's result as its result.json in ``out_dir`` records it, typed, its computed seconds)."""
    saved = read_json(out_dir / "result.json")
    return StageResult(out_dir, saved["files"], summary_of(name, saved["summary"])), saved.get("computed_seconds", 0.0)


def _from_this_job(cache_root: Path, name: str, key: str, out_dir: Path):
    """An uncached result this process computed under the same key in this job's run folder
    (see _UNCACHED_THIS_JOB): served in place, or copied from the candidate's folder into the
    run's (precision=auto's shipped run: its build is the one verified, and a mixed search the
    deadline cut is not run again without a deadline: a style-transfer net's job took 473 s of
    its 300, the search 190 s of it twice); None otherwise (a later job, in its own run
    folder, computes it again with the time it has)."""
    folder = _UNCACHED_THIS_JOB.get((str(cache_root), name, key))
    folder = folder.resolve() if folder is not None else None
    if folder is None or not folder.is_relative_to(out_dir.resolve().parent.parent) \
            or not (folder / "result.json").is_file():  # out_dir: <run folder>/stages/<stage>
        return None
    if folder != out_dir.resolve():
        if out_dir.exists():
            shutil.rmtree(out_dir)
        shutil.copytree(folder, out_dir)
    return _saved_result(out_dir, name)


def _to_cache(out_dir: Path, entry: Path) -> None:
    with writing(entry):  # a full or read-only cache: exit 5, naming the path
        remove_stale_temps(entry)  # of writers killed mid-way; the entry's lock is held
        with atomic_directory(entry) as temp:
            shutil.copytree(out_dir, temp, dirs_exist_ok=True)
