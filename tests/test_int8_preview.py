"""int8's preview (pipeline/app/int8_preview.py): int8's graph built cheaply and timed
against a deferred float candidate, so that a float build that outruns int8 is verified at
once and int8's calibration is not paid for."""

from __future__ import annotations

import json

import pytest

from conftest import composed
from pipeline.app import int8_preview
from pipeline.app.auto import candidate_config


def _timing(median, p25, p75):
    return {"speedup": median, "speedup_p25": p25, "speedup_p75": p75}


def test_only_a_float_candidate_with_int8_after_it_is_previewed():
    assert int8_preview.wanted(["fp32", "bf16", "int8", "mixed"], "bf16")
    assert not int8_preview.wanted(["fp32", "int8", "bf16"], "bf16")
    assert not int8_preview.wanted(["fp32", "bf16", "mixed"], "bf16")
    assert not int8_preview.wanted(["fp32", "int8", "mixed"], "int8")


def test_not_faster_reads_three_rounds_of_four():
    assert int8_preview.not_faster(_timing(0.9, 0.85, 0.95))
    assert int8_preview.not_faster(_timing(0.99, 0.96, 1.04))  # a tie: int8's calibration would not buy speed
    assert not int8_preview.not_faster(_timing(1.1, 1.02, 1.2))  # faster in three rounds of four: int8 is built
    assert not int8_preview.not_faster(None)  # no preview: as without one


def test_int8_and_mixed_are_not_built_only_behind_a_passing_build_that_outran_the_preview():
    tried = {"fp32": {"verdict": "not verified"},
             "bf16": {"verdict": "pass", "int8_preview": _timing(0.91, 0.88, 0.94)}}
    int8 = int8_preview.outrun("int8", tried)
    assert int8["verdict"] == "not built" and int8["outrun_by"] == "bf16"
    assert int8["reasons"][0].startswith("not built: bf16 passes, and int8 would run no faster here")
    assert "0.91x bf16's speed, rounds 0.88-0.94x" in int8["reasons"][0]
    assert "mixed is int8 with some ops float" in int8_preview.outrun("mixed", tried)["reasons"][0]
    assert int8_preview.outrun("int8_dynamic", tried) is None  # no calibration to save
    assert int8_preview.outrun("int8", {**tried, "bf16": {**tried["bf16"], "verdict": "fail"}}) is None
    faster = {**tried, "bf16": {"verdict": "pass", "int8_preview": _timing(1.1, 1.02, 1.2)}}
    assert int8_preview.outrun("int8", faster) is None


def test_the_preview_config_is_int8_made_cheap_and_leaves_int8_s_own_alone():
    cfg = composed("precision=auto", "target=openvino_cpu")
    int8 = candidate_config(cfg, "int8")
    cheap = int8_preview.preview_config(int8)
    assert cheap.data.calibration_size == 1 and cheap.calibration.method == "max"
    assert not cheap.precision.equalization and not cheap.precision.weight_rounding
    assert not cheap.precision.bias_correction and cheap.precision.smoothing is None
    assert list(cheap.pipeline.stages) == ["convert", "calibrate", "sensitivity", "build"]
    assert list(cheap.precision.quantize_ops) == list(int8.precision.quantize_ops)  # the same graph
    assert int8.precision.equalization and getattr(int8.calibration.method, "value", None) == "auto"
    assert "verify" in int8.pipeline.stages


@pytest.mark.parametrize("target", ["openvino_cpu"])
def test_the_preview_is_built_on_one_sample_and_timed_against_the_float_build(tmp_path, target):
    """A real preview on the default model: int8's build from one sample's max ranges, no
    equalization, in previews/int8 of the run folder, timed against OpenVINO's bf16 build."""
    from pipeline.app.runner import run_pipeline
    from pipeline.config.validation import validate

    cfg = composed("precision=auto", f"target={target}", f"pipeline.cache_dir={tmp_path / 'cache'}")
    bf16 = validate(candidate_config(cfg, "bf16"))
    bf16.pipeline.stages = ["convert", "calibrate", "sensitivity", "build"]
    floated = run_pipeline(bf16, tmp_path / "candidates" / "bf16", until="build")
    found = int8_preview.against(candidate_config(cfg, "int8"), floated, bf16, tmp_path)
    assert found is not None and 0 < found["speedup_p25"] <= found["speedup"] <= found["speedup_p75"]
    assert "one validation sample" in found["timed_on"]
    calibrate = json.loads((tmp_path / "previews" / "int8" / "stages" / "calibrate" / "result.json").read_text())
    assert calibrate["summary"]["samples"] == 1 and calibrate["summary"]["method"] == "max"
    assert calibrate["summary"]["equalization"]["applied"] is False
    assert (tmp_path / "previews" / "int8" / "stages" / "build" / "runtime.yaml").is_file()
    assert not (tmp_path / "previews" / "int8" / "stages" / "verify").exists()
