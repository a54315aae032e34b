"""Run several `parity` command lines through the console script's entry point
(pipeline.app.cli.main) in this one interpreter, as tests/test_config_errors.py does for
its table of mistakes (a process each took 1.2 s of CPU, most of it the interpreter and
its imports). Usage: python cli_in_one_process.py '[[arg, ...], ...]'; prints a JSON list
of {"code", "stdout", "stderr"}, one per command line, in order."""

from __future__ import annotations

import contextlib
import io
import json
import sys

from pipeline.app import cli


def run(argv: list) -> dict:
    out, err = io.StringIO(), io.StringIO()
    sys.argv = ["parity", *argv]
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            cli.main()
        except SystemExit as done:
            code = done.code if isinstance(done.code, int) else 1
    return {"code": code, "stdout": out.getvalue(), "stderr": err.getvalue()}


if __name__ == "__main__":
    print(json.dumps([run(argv) for argv in json.loads(sys.argv[1])]))
