"""Bad inputs that ended in an internal error (exit 1): each is one line naming what is
wrong and how to fix it, a usage or input exit code, and nothing outside the run folder
changed (issue 28, items 4 and 5)."""

from __future__ import annotations

import os

import pytest

from conftest import run_cli

from pipeline.errors import ExitCode


def _files(folder):
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def _one_line_error(result, code: int, *parts: str) -> None:
    assert result.returncode == code, result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("parity:")]
    assert len(lines) == 1 and "internal error" not in lines[0] and "Traceback" not in result.stderr
    for part in parts:
        assert part in lines[0], lines[0]


def test_a_negative_input_dim_is_a_config_error(tmp_path):
    result = run_cli(["+model.input_shapes.input=[1,-1,28,28]"], tmp_path)
    _one_line_error(result, ExitCode.USAGE, "model.input_shapes.input[1]=-1", "must be >= 1")
    assert not (tmp_path / "outputs").exists() or not list((tmp_path / "outputs").rglob("report.json"))


def test_a_run_folder_where_a_file_is_says_so(tmp_path):
    (tmp_path / "taken").write_text("keep me")
    before = _files(tmp_path)
    result = run_cli(["hydra.run.dir=taken"], tmp_path)
    _one_line_error(result, ExitCode.USAGE, "run folder taken cannot be made", "hydra.run.dir")
    assert (tmp_path / "taken").read_text() == "keep me" and _files(tmp_path) == before


@pytest.mark.parametrize("special", ["fifo", "device"])
def test_a_model_path_that_is_not_a_regular_file(tmp_path, special):
    path = "/dev/zero"
    if special == "fifo":
        path = str(tmp_path / "model.fifo")
        os.mkfifo(path)  # reading it would wait forever
    result = run_cli([f"model.path={path}", "precision=fp32"], tmp_path, timeout=60)
    _one_line_error(result, ExitCode.USAGE, f"model.path: {path} is not a regular file")


def test_an_unquoted_non_ascii_path_says_how_to_quote_it(tmp_path):
    result = run_cli(["model.path=/data/modèles/net.onnx"], tmp_path)
    _one_line_error(result, ExitCode.USAGE, "'è' cannot stand unquoted", "\"model.path='/data/modèles/net.onnx'\"")
