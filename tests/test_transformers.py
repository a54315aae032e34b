"""A transformer sentence embedder end to end (issue 36): the tiny BERT of
scripts/make_tiny_bert.py on real sentences at their natural lengths, integer inputs and
outputs, four outputs of three ranks, dynamic batch and sequence, no model.input_shapes."""

from __future__ import annotations

import json

import pytest

from conftest import read_report, run_cli, run_dirs, text_args


@pytest.fixture(scope="module")
def auto_ort(sentence_folder, tmp_path_factory):
    cwd = tmp_path_factory.mktemp("auto_ort")
    done = run_cli([*text_args(sentence_folder), "metric=none"], cwd,
                   default_precision=None)
    return done, cwd


def test_default_job_ships_a_verified_build(auto_ort):
    done, cwd = auto_ort
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = read_report(run_dirs(cwd)[-1])
    assert report["verdict"] == "pass"
    names = {o["name"] for o in report["verify"]["outputs"]}
    assert {"input_ids_out", "attention_mask_out", "token_embeddings", "sentence_embedding"} <= names


def test_speed_as_served_is_timed_on_the_stream(auto_ort):
    done, cwd = auto_ort
    report = read_report(run_dirs(cwd)[-1])
    stream = report["verify"]["speed"]["stream"]
    assert stream["samples"] == 24 and stream["shapes"] > 1 and stream["rounds"] >= 3
    shipped = report["verify"]["requested"]["precision"]
    if shipped != "fp32":
        up = stream["speedups"][shipped]
        assert up["speedup_p25"] <= up["speedup"] <= up["speedup_p75"]
        assert report["verify"]["speed"]["judged_on"] == "stream"
        assert "speed as served (24 samples in order" in done.stdout
    timed = [c for c in report["auto"]["candidates"] if c.get("latency")]
    assert timed and all(c["timed_on"].startswith("stream of 24") for c in timed)
    markdown = (run_dirs(cwd)[-1] / "report.md").read_text()
    assert "Speed as served" in markdown


@pytest.mark.parametrize("method", ["max", "percentile", "kl", "mse", "auto"])
def test_every_calibration_method_takes_integer_inputs_and_outputs(sentence_folder, tmp_path, method):
    done = run_cli([*text_args(sentence_folder), "metric=none", "precision=int8",
                    f"calibration={method}", "pipeline.stages=[convert,calibrate]"], tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    table = json.loads(next(run_dirs(tmp_path)[-1].glob("stages/calibrate/calibration.json")).read_text())
    assert table


def test_ncnn_default_job_is_exit_4_naming_what_pnnx_cannot_trace(sentence_folder, tmp_path):
    """No model.input_shapes: pnnx is given the data's range and crashes on the random token
    ids it traces with; every auto candidate stops there, so the job is exit 4, not 1 or 2."""
    done = run_cli([*text_args(sentence_folder), "metric=none", "target=ncnn_cpu"], tmp_path,
                   default_precision=None)
    assert done.returncode == 4, done.stdout[-2000:] + done.stderr[-2000:]
    (line,) = [line for line in done.stderr.splitlines() if line.startswith("parity:")]
    assert "no candidate could be built for target ncnn_cpu: fp32, fp16: " in line
    assert "pnnx crashed" in line and "token_type_embeddings" in line
