"""``parity``: the Hydra application. One run composes the config, validates it, runs
the configured stages and exits with the verdict's code (see pipeline.errors.ExitCode).

Errors meant for users are one line on stderr; tracebacks go to the run's log file."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException, MissingConfigException
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException
from rich.markup import escape
from rich.table import Table

import conf
from pipeline import config
from pipeline.console import stderr_console, stdout_console
from pipeline.errors import ExitCode, ParityError
from pipeline.report import render_html, render_markdown
from pipeline.report.assemble import assemble
from pipeline.artifacts import write_json
from pipeline.runner import RunOutcome, run_pipeline

CONFIG_DIR = str(Path(conf.__file__).parent)
log = logging.getLogger("parity")
_exit_codes: list = []  # one per job of this process (several in a sequential multirun)


def main() -> None:
    # Hydra prints its own multi-line errors and exits 1 unless told to re-raise.
    os.environ["HYDRA_FULL_ERROR"] = "1"
    config.register()
    try:
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
    except Exception as err:  # noqa: BLE001 - the last line of defence
        _fail(f"internal error: {type(err).__name__}: {err}", ExitCode.INTERNAL)
    sys.exit(max(_exit_codes, default=ExitCode.OK))


def _fail(message: str, code: int) -> None:
    stderr_console().print(f"[bold red]parity:[/] {escape(message)}", soft_wrap=True)
    sys.exit(int(code))


def _describe_composition_error(err: BaseException) -> str:
    if isinstance(err, MissingConfigException) and err.options is not None:
        group = (err.missing_cfg_file or "").rsplit("/", 1)[0]
        wanted = (err.missing_cfg_file or "").rsplit("/", 1)[-1]
        return f"{group}={wanted}: no such config; allowed: {', '.join(sorted(err.options))}"
    return config.describe_config_error(err)


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="config")
def _hydra_app(cfg: DictConfig) -> int:
    code = execute(cfg, Path(HydraConfig.get().runtime.output_dir))
    _exit_codes.append(int(code))
    return int(code)


def execute(cfg: DictConfig, run_dir: Path) -> ExitCode:
    log_file = run_dir / f"{HydraConfig.get().job.name}.log"
    try:
        run_cfg = config.validate(cfg)
        outcome = run_pipeline(run_cfg, run_dir)
        report = assemble(run_cfg, outcome.records, outcome.results)
        _write_run_report(run_dir, report)
        _print_summary(outcome, report)
        return outcome.exit_code
    except ParityError as err:
        log.debug("stopped by %s", type(err).__name__, exc_info=True)
        stderr_console().print(f"[bold red]parity:[/] {escape(str(err))}", soft_wrap=True)
        return err.exit_code
    except Exception as err:  # noqa: BLE001 - reported, with the traceback in the log
        log.debug("internal error", exc_info=True)
        stderr_console().print(f"[bold red]parity: internal error:[/] {escape(type(err).__name__)}: "
                               f"{escape(str(err))} (traceback in {escape(str(log_file))})", soft_wrap=True)
        return ExitCode.INTERNAL


def _write_run_report(run_dir: Path, report: dict) -> None:
    write_json(run_dir / "report.json", report)
    (run_dir / "report.md").write_text(render_markdown(report))
    (run_dir / "report.html").write_text(render_html(report))


def _print_summary(outcome: RunOutcome, report: dict) -> None:
    console = stdout_console()
    stages = Table(title="stages", title_justify="left")
    for column in ("stage", "status", "seconds"):
        stages.add_column(column)
    for record in outcome.records:
        stages.add_row(record["stage"], record["status"], f"{record['seconds']:.2f}")
    console.print(stages)
    verify = outcome.verify
    if verify:
        table = Table(title=f"verify: {report['target']['name']} {report['precision']} vs ONNX Runtime fp32 "
                            f"({verify['samples']} samples)", title_justify="left")
        table.add_column("output", overflow="fold")
        for column in ("cosine", "max abs", "mean abs", "SQNR dB", "NaN/Inf", "result"):
            table.add_column(column, no_wrap=True)
        for output in verify["outputs"]:
            m = output["metrics"]
            sqnr = "inf" if m["sqnr_db"] is None else f"{m['sqnr_db']:.1f}"
            table.add_row(escape(output["name"]), f"{m['cosine']:.6f}", f"{m['max_abs']:.3g}",
                          f"{m['mean_abs'] or 0:.3g}", sqnr, f"{m['nan']}/{m['inf']}",
                          "[green]pass[/]" if output["passed"] else "[red]fail[/]")
        console.print(table)
        if verify["task"]:
            task = verify["task"]
            console.print(f"top-1: reference {task['reference']:.4f}, target {task['target']:.4f}, "
                          f"drop {task['drop'] * 100:.2f} points, agreement {task['agreement']:.4f}")
        effective = verify["effective"]
        console.print(f"ran on: {escape(effective['device'])}, {escape(effective['precision'])}"
                      + (f" (layers: {escape(effective['layers'])})" if effective.get("layers") else ""))
    for warning in report["warnings"]:
        console.print(f"[yellow]warning:[/] {escape(warning)}")
    colour = {"pass": "green", "fail": "red"}.get(report["verdict"], "yellow")
    console.print(f"verdict: [bold {colour}]{report['verdict'].upper()}[/] (exit {report['exit_code']})")
    for reason in report["reasons"] if report["verdict"] != "pass" else []:
        console.print(f"  - {escape(reason)}")
    package = outcome.results.get("package")
    if package:
        console.print(f"bundle: {escape(package.summary['bundle'])}")
    console.print(f"run folder: {escape(str(outcome.run_dir))}")
