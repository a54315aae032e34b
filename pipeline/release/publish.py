"""Releases: the passing bundles of a sweep in one folder plus a reproducible .tar.gz,
with release.json listing every bundle, every file's sha256 and the failing jobs.

    <output>/                                      (default: SWEEP_DIR/release)
      release.json
      sweep.json sweep.md sweep.html junit.xml     (the sweep summary, when present)
      bundles/<bundle name>/...                    (bundles/<job>/<bundle name>/ when two jobs share a name)
    <output>.tar.gz                                (<name>/ at its top; name: the output folder's by default)
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path, PurePosixPath
from typing import Dict, List, Optional, Tuple

import yaml

import pipeline
from pipeline.release import signing
from pipeline.release.archive import write_tar_gz
from pipeline.artifacts import (atomic_directory, atomic_write_bytes, read_json, remove_stale_temps, sha256_file,
                                write_json)
from pipeline.release.bundle import MANIFEST, check_files, check_integrity
from pipeline.errors import InputError
from pipeline.release.jobs import find_jobs, read_optional_json

RELEASE_MANIFEST = "release.json"
SUMMARY_FILES = ("sweep.json", "sweep.md", "sweep.html", "junit.xml")
BUNDLES = "bundles"
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]*")


@dataclass
class Job:
    """One job folder of a sweep, as its report.json (or job.json) describes it."""

    dir: str  # relative to the sweep folder
    target: Optional[str]
    precision: Optional[str]
    verdict: str
    exit_code: Optional[int]
    reason: Optional[str]
    bundles: List[Path] = field(default_factory=list)
    inconsistent: Optional[str] = None  # why job.json, report.json and the bundles disagree

    @property
    def passed(self) -> bool:
        return self.verdict == "pass" and self.exit_code == 0 and bool(self.bundles) and not self.inconsistent


@dataclass
class Release:
    jobs: List[Job]
    folder: Optional[Path] = None  # None: nothing was written
    archive: Optional[Path] = None
    manifest: dict = field(default_factory=dict)
    missing: List[Dict[str, str]] = field(default_factory=list)  # intended jobs with no folder
    refused: Optional[str] = None  # why nothing was written although bundles passed (exit 3)

    @property
    def passing(self) -> List[Job]:
        return [job for job in self.jobs if job.passed]


# ---------------------------------------------------------------- reading a sweep


def read_job(sweep: Path, folder: Path) -> Job:
    report, record = read_optional_json(folder / "report.json"), read_optional_json(folder / "job.json")
    source = report or record
    exit_code = source.get("exit_code")
    verdict = source.get("verdict") or ("pass" if report and exit_code == 0 else "fail")
    bundles = sorted(p.parent for p in (folder / "bundle").glob(f"*/{MANIFEST}"))
    job = Job(dir=folder.relative_to(sweep).as_posix(), target=_name(source.get("target")),
              precision=_name(source.get("precision")), verdict=verdict, exit_code=exit_code,
              reason=None, bundles=bundles, inconsistent=_inconsistency(report, record, bundles))
    job.reason = None if job.passed else _reason(job, report, record)
    return job


def _inconsistency(report: dict, record: dict, bundles: List[Path]) -> Optional[str]:
    """Why the job's files are not one run's: job.json (written last), report.json and
    the bundles must agree (a run that failed or was killed sets the earlier run's
    report aside, but a folder may come from elsewhere); None when they agree."""
    if not report:
        return None  # no report: failing already
    if not record:
        return "report.json without job.json: the run that wrote it did not finish"
    if record.get("exit_code") != report.get("exit_code"):
        return (f"job.json says exit {record.get('exit_code')} but report.json exit {report.get('exit_code')}: "
                f"the report is from another run")
    packaged = record.get("bundles") or {}
    for bundle in bundles:
        if packaged.get(bundle.name) != sha256_file(bundle / MANIFEST):
            return f"bundle {bundle.name} is not the one the job's last run packaged (job.json names its manifest)"
    missing = sorted(set(packaged) - {bundle.name for bundle in bundles})
    return f"bundle {missing[0]} named in job.json is missing" if missing else None


def _reason(job: Job, report: dict, record: dict) -> str:
    if job.inconsistent:
        return f"inconsistent job: {job.inconsistent}"
    if report.get("reasons"):
        return "; ".join(str(r) for r in report["reasons"])
    if record.get("error"):
        return str(record["error"])
    if not report and not record:
        return "no report.json or job.json: the job did not finish"
    if job.verdict == "pass" and job.exit_code == 0:
        return "no bundle: the package stage did not run"
    return f"verdict {job.verdict}, exit code {job.exit_code}"


def _name(value) -> Optional[str]:
    return value.get("name") if isinstance(value, dict) else value


# ---------------------------------------------------------------- writing a release


def make_release(sweep: Path, output: Optional[Path], name: Optional[str], include_failing: bool,
                 allow_partial: bool = False, sign_key: Optional[Path] = None) -> Release:
    """Collect the sweep's passing bundles (and failing ones with ``include_failing``)
    into the folder ``output`` (default SWEEP_DIR/release) and ``<output>.tar.gz`` next to
    it. Nothing is written when there is no bundle to ship, nor when a job the sweep
    intended (its multirun.yaml) never ran or did not pass, unless ``allow_partial``
    (release.json then lists the missing and failing jobs). ``sign_key``: an Ed25519
    private key; each shipped bundle's manifest.json and release.json get a signature."""
    sweep = Path(sweep)
    if not sweep.is_dir():
        raise InputError(f"release: {sweep} is not a folder; pass a sweep folder such as multirun/<date>/<time>")
    final = Path(output if output is not None else sweep / "release").resolve()
    name = name or final.name
    if not NAME_PATTERN.fullmatch(name):
        raise InputError(f"release: name {name!r} must be a plain folder name (letters, digits, . _ + -); "
                         f"pass --name")
    jobs = [read_job(sweep, folder) for folder in find_jobs(sweep, skip=final)]
    if not jobs:
        raise InputError(f"release: {sweep} holds no jobs (no folder with report.json, job.json or .hydra/); "
                         f"pass a sweep folder such as multirun/<date>/<time>")
    release = Release(jobs, missing=missing_jobs(sweep, jobs))
    shipped = [job for job in jobs if job.passed or (include_failing and job.bundles)]
    if not shipped:
        return release
    _check_output(final)
    for job in shipped:
        for bundle in job.bundles:
            _check_bundle(job, bundle)
    release.refused = None if allow_partial else _partial(release, include_failing)
    if release.refused:
        return release
    places = _places(shipped)
    remove_stale_temps(final)  # folders and archives of a release killed mid-way (.<name>.*)
    with atomic_directory(final, replace=True) as temp:
        for _, bundle, place in places:
            shutil.copytree(bundle, temp / place)
            if sign_key is not None:
                signing.sign(temp / place / MANIFEST, sign_key)
        summary = [f for f in SUMMARY_FILES if (sweep / f).is_file()]
        for file in summary:
            shutil.copyfile(sweep / file, temp / file)
        release.manifest = _manifest(temp, name, sweep, jobs, places, summary)
        release.manifest["missing"] = release.missing
        write_json(temp / RELEASE_MANIFEST, release.manifest)
        if sign_key is not None:
            signing.sign(temp / RELEASE_MANIFEST, sign_key)
    release.folder, release.archive = final, final.parent / f"{final.name}.tar.gz"
    atomic_write_bytes(release.archive, lambda path: write_tar_gz(final, path, name))
    return release


def _partial(release: Release, include_failing: bool) -> Optional[str]:
    """Why a release without --allow-partial is refused: intended jobs that never ran, or
    jobs that did not pass (unless --include-failing ships them, marked fail)."""
    failing = [] if include_failing else [job.dir for job in release.jobs if not job.passed]
    parts = []
    if release.missing:
        names = [",".join(f"{k}={v}" for k, v in sorted(job.items())) for job in release.missing]
        parts.append(f"{len(names)} intended jobs never ran ({'; '.join(names[:4])}"
                     f"{f'; +{len(names) - 4} more' if len(names) > 4 else ''})")
    if failing:
        parts.append(f"{len(failing)} jobs did not pass ({'; '.join(failing[:4])}"
                     f"{f'; +{len(failing) - 4} more' if len(failing) > 4 else ''})")
    if not parts:
        return None
    total = len(release.jobs) + len(release.missing)
    return (f"the sweep is partial, {sum(j.passed for j in release.jobs)} of {total} jobs passed: "
            f"{'; '.join(parts)}: rerun them, or pass --allow-partial to release what passed "
            "(release.json then lists the rest)")


def missing_jobs(sweep: Path, jobs: List[Job]) -> List[Dict[str, str]]:
    """The swept values of every job the sweep's multirun.yaml intended that has no job
    folder (never started: the sweep was killed or a launcher lost it). Empty when the
    sweep has no readable multirun.yaml (nothing to compare with)."""
    intended = intended_jobs(sweep)
    if intended is None:
        return []
    found = [_swept(sweep / job.dir, intended[0].keys()) for job in jobs] if intended else []
    return [job for job in intended if job not in found]


def intended_jobs(sweep: Path) -> Optional[List[Dict[str, str]]]:
    """Each job of the multirun as {swept key: value}, expanded from its multirun.yaml the
    way Hydra's basic sweeper does (command-line overrides and hydra.sweeper.params)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        hydra = yaml.safe_load((Path(sweep) / "multirun.yaml").read_text())["hydra"]
        task = list(hydra["overrides"]["task"])
        params = (hydra.get("sweeper") or {}).get("params") or {}
    except (OSError, KeyError, TypeError, yaml.YAMLError):
        return None
    task += [f"{key}={value}" for key, value in params.items()]
    parsed = OverridesParser.create().parse_overrides(task)
    swept = {o.key_or_group for o in parsed if o.is_sweep_override()}
    if not swept:
        return None
    jobs = [overrides for batch in BasicSweeper.split_arguments(parsed, None) for overrides in batch]
    return [_pairs(overrides, swept) for overrides in jobs]


def _swept(folder: Path, keys) -> Dict[str, str]:
    """A job folder's values of the swept keys, from Hydra's .hydra/overrides.yaml."""
    try:
        overrides = yaml.safe_load((folder / ".hydra" / "overrides.yaml").read_text()) or []
    except (OSError, yaml.YAMLError):
        return {}
    return _pairs(overrides, set(keys))


def _pairs(overrides, keys) -> Dict[str, str]:
    pairs = dict(str(o).split("=", 1) for o in overrides if "=" in str(o))
    return {key.lstrip("+~"): value for key, value in pairs.items() if key.lstrip("+~") in keys}


def _check_output(final: Path) -> None:
    """An existing output is replaced only when it is an earlier release (or empty)."""
    if final.exists() and not (final.is_dir() and ((final / RELEASE_MANIFEST).is_file() or not any(final.iterdir()))):
        raise InputError(f"release: {final} exists and is not a release; choose another --output")


def _check_bundle(job: Job, bundle: Path) -> None:
    try:
        check_integrity(bundle)
    except InputError as err:
        raise InputError(f"release: job {job.dir}: {err.args[0]}") from err


def _places(shipped: List[Job]) -> List[Tuple[Job, Path, str]]:
    """(job, bundle, place in the release): bundles/<name>, or bundles/<job>/<name> for
    bundle names that several jobs share."""
    pairs = [(job, bundle) for job in shipped for bundle in job.bundles]
    names = [bundle.name for _, bundle in pairs]
    return [(job, bundle, f"{BUNDLES}/{bundle.name}" if names.count(bundle.name) == 1
             else f"{BUNDLES}/{_slug(job.dir)}/{bundle.name}") for job, bundle in pairs]


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._=,+-]", "_", text)


def _manifest(folder: Path, name: str, sweep: Path, jobs: List[Job], places: List[Tuple[Job, Path, str]],
              summary: List[str]) -> dict:
    bundles = []
    for job, bundle, place in places:
        packaged = read_json(folder / place / MANIFEST)
        bundles.append({"name": bundle.name, "path": place, "job": job.dir, "target": job.target,
                        "precision": job.precision, "verdict": job.verdict, "exit_code": job.exit_code,
                        "content_sha256": packaged.get("content_sha256")})
    failing = [{"job": job.dir, "target": job.target, "precision": job.precision, "verdict": job.verdict,
                "exit_code": job.exit_code, "reason": job.reason,
                "shipped": [place for shipped, _, place in places if shipped is job]}
               for job in jobs if not job.passed]
    files = {p.relative_to(folder).as_posix(): {"sha256": sha256_file(p), "bytes": p.stat().st_size}
             for p in sorted(folder.rglob("*")) if p.is_file()}
    return {"format": 1, "name": name, "parity_version": parity_version(),
            "git_revision": git_revision(sweep, Path.cwd()),
            "sweep": {"name": sweep.resolve().name, "jobs": len(jobs), "passing": sum(j.passed for j in jobs),
                      "summary_files": summary},
            "bundles": bundles, "failing": failing, "files": files}


def parity_version() -> str:
    try:
        return metadata.version("parity")
    except metadata.PackageNotFoundError:
        return pipeline.__version__


def git_revision(*places: Path) -> Optional[str]:
    """HEAD of the first git repository holding one of ``places``; None without git."""
    for place in places:
        try:
            result = subprocess.run(["git", "-C", str(place), "rev-parse", "--verify", "-q", "HEAD"],
                                    capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        if result.returncode == 0 and result.stdout.strip():
            return result.stdout.strip()
    return None


# ---------------------------------------------------------------- checking a release


def is_release(folder: Path) -> bool:
    return (Path(folder) / RELEASE_MANIFEST).is_file()


def check_release(folder: Path) -> tuple:
    """(release manifest, [bundle manifest, ...]) once every file matches release.json
    and every bundle its own manifest; otherwise an InputError naming the file."""
    folder = Path(folder)
    try:
        manifest = read_json(folder / RELEASE_MANIFEST)
        listed, bundles = manifest["files"], manifest["bundles"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise InputError(f"release: {folder / RELEASE_MANIFEST} is missing or unreadable ({err})") from err
    check_files(folder, listed, RELEASE_MANIFEST, "release")
    checked = []
    for entry in bundles:
        path = PurePosixPath(entry["path"])
        if path.is_absolute() or ".." in path.parts:
            raise InputError(f"release: {RELEASE_MANIFEST} names bundle path {entry['path']!r} outside the release")
        checked.append(check_integrity(folder / path))
    return manifest, checked
