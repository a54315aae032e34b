"""``parity-release``: collect a sweep's passing bundles into one release folder and a
reproducible .tar.gz, with release.json (see docs/release.md).

    parity-release SWEEP_DIR [--output DIR] [--name NAME] [--include-failing]

writes the release folder DIR (default SWEEP_DIR/release) and DIR.tar.gz next to it.

Exit codes: 0 released, 2 usage or input error, 3 no passing bundle (nothing written
unless --include-failing shipped failing ones), 5 the output could not be written
(read-only or full disk).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rich.markup import escape

from pipeline.app import skip_final_collection
from pipeline.release import signing
from pipeline.console import stderr_console, stdout_console
from pipeline.errors import ExitCode, ParityError, environment_fault
from pipeline.release.publish import Job, Release, make_release


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="parity-release",
                                     description="Collect a sweep's passing bundles into one release.")
    parser.add_argument("sweep", type=Path, metavar="SWEEP_DIR", help="a sweep folder, e.g. multirun/<date>/<time>")
    parser.add_argument("--output", type=Path, metavar="DIR",
                        help="the release folder; DIR.tar.gz is written next to it (default: SWEEP_DIR/release)")
    parser.add_argument("--name", help="the release's name in release.json and the archive's top folder "
                                       "(default: the release folder's name)")
    parser.add_argument("--include-failing", action="store_true",
                        help="also ship the bundles of failing jobs (they stay marked fail)")
    parser.add_argument("--sign", type=Path, metavar="KEY",
                        help="an Ed25519 private key (PEM): sign every shipped bundle's manifest.json and "
                             "release.json (parity-bundle verify/check --verify-key KEY.pub)")
    parser.add_argument("--allow-partial", action="store_true",
                        help="release what passed although jobs the sweep intended never ran or failed "
                             "(release.json lists them); without it such a sweep is refused, exit 3")
    args = parser.parse_args(argv)
    try:
        code = _release(args)
    except ParityError as err:
        _error(str(err))
        code = err.exit_code
    except Exception as err:  # noqa: BLE001
        fault = environment_fault(err)  # a full or read-only disk: exit 5
        _error(str(fault) if fault else f"internal error: {type(err).__name__}: {err}")
        code = fault.exit_code if fault else ExitCode.INTERNAL
    skip_final_collection()
    sys.exit(int(code))


def _release(args) -> ExitCode:
    if args.sign is not None:
        signing.check_private_key(args.sign)  # a bad key before any work
    release = make_release(args.sweep, args.output, args.name, args.include_failing, args.allow_partial, args.sign)
    console = stdout_console()
    for job in release.jobs:
        console.print(escape(_job_line(job, release)))
    for missing in release.missing:
        console.print(escape(f"miss  {','.join(f'{k}={v}' for k, v in sorted(missing.items()))}  never ran"))
    if release.refused:
        _error(f"nothing released: {release.refused}")
        return ExitCode.THRESHOLD
    if release.folder:
        manifest = release.manifest
        console.print(f"release: {escape(str(release.folder))} ({len(manifest['bundles'])} bundles, "
                      f"{len(manifest['files'])} files), archive: {escape(str(release.archive))}")
    if not release.passing:
        written = "failing bundles only" if release.folder else "nothing written; --include-failing ships failing bundles"
        _error(f"no passing bundle in {args.sweep} ({len(release.jobs)} jobs, 0 pass): {written}")
        return ExitCode.THRESHOLD
    return ExitCode.OK


def _job_line(job: Job, release: Release) -> str:
    shipped = any(bundle["job"] == job.dir for bundle in release.manifest.get("bundles", []))
    code = "no exit code" if job.exit_code is None else f"exit {job.exit_code}"
    status = "pass" if job.passed else f"{job.verdict} ({code}): {job.reason}"
    return f"{'ship' if shipped else 'skip'}  {job.dir}  {status}"


def _error(message: str) -> None:
    stderr_console().print(f"[bold red]parity-release:[/] {escape(' '.join(message.split()))}", soft_wrap=True)
