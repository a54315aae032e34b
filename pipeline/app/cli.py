"""``parity``: the Hydra application. One run composes the config, validates it, runs
the configured stages and exits with the verdict's code (see pipeline.errors.ExitCode).

Errors meant for users are one line on stderr; tracebacks go to the run's log file."""

from __future__ import annotations

import logging
import os
import sys
from contextlib import contextmanager
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from hydra.errors import HydraException, MissingConfigException
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException
from rich.markup import escape

import conf
from pipeline.config import resolvers, validation
from pipeline.app import auto, skip_final_collection
from pipeline.precision import kinds
from pipeline.console import job_display, set_plain_progress, stderr_console
from pipeline.environment import cores, share_cores
from pipeline.errors import (EnvironmentFault, ExitCode, ParityError, RunFolderBusy, environment_fault,
                             worst_exit_code, writing)
from pipeline.report import write_junit, write_reports
from pipeline.report.assemble import assemble
from pipeline.report.summary import print_summary
from pipeline.app.runner import run_pipeline
from pipeline.backends.ncnn.common import wait_passively
from pipeline.release.sweep import claim_run_folder, packaged_bundles, worst_exit_codes, write_job_record

CONFIG_DIR = str(Path(conf.__file__).parent)
log = logging.getLogger("parity")
_exit_codes: list = []  # one per job of this process (several in a sequential multirun)


def main() -> None:
    try:
        _main()
    finally:
        skip_final_collection()


def _main() -> None:
    # Hydra prints its own multi-line errors and exits 1 unless told to re-raise.
    os.environ["HYDRA_FULL_ERROR"] = "1"
    wait_passively()  # before the fork server and any ncnn worker start
    resolvers.register()
    try:
        with _no_mode_probe(sys.argv[1:]):
            _hydra_app()
    except SystemExit:
        raise
    except BrokenPipeError:  # `parity --help | head`: the reader left, nothing to report
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(int(ExitCode.OK))
    except (HydraException, OmegaConfBaseException) as err:
        _fail(f"config error: {_describe_composition_error(err)}", ExitCode.USAGE)
    except ParityError as err:
        _fail(str(err), err.exit_code)
    except (FileExistsError, NotADirectoryError) as err:  # Hydra makes the run folder where a file is
        _fail(f"config error: the run folder {err.filename} cannot be made, a file is in its way ({err.strerror}): "
              "move the file or set hydra.run.dir (hydra.sweep.dir) to a folder", ExitCode.USAGE)
    except Exception as err:  # noqa: BLE001 - the last line of defence
        fault = environment_fault(err)  # e.g. Hydra cannot create a read-only run folder
        _fail(str(fault), fault.exit_code) if fault else _fail(f"internal error: {type(err).__name__}: {err}",
                                                                  ExitCode.INTERNAL)
    sys.exit(worst_exit_code([*_exit_codes, *worst_exit_codes]))


# Hydra composes the whole config an extra time before a job only to read hydra.mode
# (Hydra.get_mode, a fifth of a cached job's start). None of parity's configs sets it, so
# where no user config folder, config name or override of Hydra's own keys could, the
# probe's answer is None, and Hydra then adds hydra.mode=RUN (MULTIRUN with -m) itself.
_CONFIG_FLAGS = ("--config-dir", "-cd", "--config-path", "-cp", "--config-name", "-cn", "--experimental-rerun")
_MODE_FREE_HYDRA_KEYS = ("hydra.run.", "hydra.sweep.", "hydra.job.", "hydra.launcher.", "hydra/launcher=",
                         "hydra.verbose=")


def mode_is_known(argv) -> bool:
    """Whether none of ``argv`` can set hydra.mode (so Hydra's mode probe would find none)."""
    for arg in argv:
        key = arg.lstrip("+~")
        if arg.split("=")[0] in _CONFIG_FLAGS or ("hydra" in key and not key.startswith(_MODE_FREE_HYDRA_KEYS)):
            return False
    return True


@contextmanager
def _no_mode_probe(argv):
    from hydra._internal.hydra import Hydra  # hydra-core 1.3 (pinned in pyproject.toml)

    probe = Hydra.get_mode
    if mode_is_known(argv):
        Hydra.get_mode = lambda self, config_name, overrides: None
    try:
        yield
    finally:
        Hydra.get_mode = probe


def _fail(message: str, code: int) -> None:
    stderr_console().print(f"[bold red]parity:[/] {escape(message)}", soft_wrap=True)
    sys.exit(int(code))


def _describe_composition_error(err: BaseException) -> str:
    if isinstance(err, MissingConfigException) and err.options is not None:
        group = (err.missing_cfg_file or "").rsplit("/", 1)[0]
        wanted = (err.missing_cfg_file or "").rsplit("/", 1)[-1]
        return f"{group}={wanted}: no such config; allowed: {', '.join(sorted(err.options))}"
    return validation.describe_config_error(err)


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="config")
def _hydra_app(cfg: DictConfig) -> int:
    code = execute(cfg, Path(HydraConfig.get().runtime.output_dir))
    _exit_codes.append(int(code))
    return int(code)


def execute(cfg: DictConfig, run_dir: Path) -> ExitCode:
    """One job, holding its run folder's lock: a second run into the same folder stops at
    once with one line (exit 2) and leaves the first one's files alone."""
    try:
        with claim_run_folder(run_dir):
            return _execute(cfg, run_dir)
    except (RunFolderBusy, EnvironmentFault) as err:
        stderr_console().print(f"[bold red]parity:[/] {escape(str(err))}", soft_wrap=True)
        return err.exit_code


def _execute(cfg: DictConfig, run_dir: Path) -> ExitCode:
    hydra_cfg = HydraConfig.get()
    log_file = run_dir / f"{hydra_cfg.job.name}.log"
    if hydra_cfg.mode == RunMode.MULTIRUN and "BasicLauncher" not in str(hydra_cfg.launcher.get("_target_")):
        set_plain_progress()  # jobs run side by side: log lines, not live bars fighting over one terminal
        share_cores(_jobs_side_by_side(hydra_cfg.launcher))
    code, error, outcome = ExitCode.INTERNAL, None, None
    try:
        run_cfg = validation.validate(cfg)
        chosen = None
        with job_display():  # one live line on a terminal; each stage's lines go to parity.log
            if run_cfg.precision.kind == kinds.AUTO:
                outcome, run_cfg, chosen = auto.run(cfg, run_cfg, run_dir)
            else:
                outcome = run_pipeline(run_cfg, run_dir)
        report = assemble(run_cfg, outcome.records, outcome.results,
                          considered=[row["precision"] for row in chosen["candidates"]] if chosen else None)
        if chosen:
            report["auto"] = chosen
        _write_run_report(run_dir, report)
        package = outcome.results.get("package")
        print_summary(outcome.records, report, package.summary.bundle if package else None, outcome.run_dir)
        code = outcome.exit_code
    except ParityError as err:
        log.debug("stopped by %s", type(err).__name__, exc_info=True)
        stderr_console().print(f"[bold red]parity:[/] {escape(str(err))}", soft_wrap=True)
        code, error = err.exit_code, str(err)
        if getattr(err, "partial", None):  # a valid model a tool could not handle: the report says how far it got
            _write_run_report(run_dir, {**assemble(run_cfg, *err.partial), "exit_code": int(code), "reasons": [error]})
    except Exception as err:  # noqa: BLE001 - reported, with the traceback in the log
        log.debug("internal error", exc_info=True)
        fault = environment_fault(err)  # a read-only or full disk: exit 5, one line
        error = str(fault) if fault else f"internal error: {type(err).__name__}: {err} (traceback in {log_file})"
        code = fault.exit_code if fault else ExitCode.INTERNAL
        stderr_console().print(f"[bold red]parity:[/] {escape(error)}", soft_wrap=True)
    try:
        with writing(run_dir):
            write_job_record(run_dir, code, list(hydra_cfg.overrides.task), dict(hydra_cfg.runtime.choices), error,
                             packaged_bundles(outcome))
    except EnvironmentFault as err:  # said once: the disk that stopped the run refuses job.json too
        if code != err.exit_code:
            stderr_console().print(f"[bold red]parity:[/] {escape(str(err))}", soft_wrap=True)
        code = err.exit_code
    return code


def _jobs_side_by_side(launcher) -> int:
    """How many jobs of a parallel sweep share this machine's cores: joblib's n_jobs (-1:
    one per core). A submitit job counts as one: on SLURM its allocation is its affinity
    mask already."""
    jobs = launcher.get("n_jobs")
    if jobs is None:
        return 1
    return cores() if int(jobs) < 0 else int(jobs)


def _write_run_report(run_dir: Path, report: dict) -> None:
    write_reports(report, run_dir)
    write_junit(report, run_dir / "junit.xml")
