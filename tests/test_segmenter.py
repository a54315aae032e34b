"""A model family the other tests do not have: a salient-object segmenter of the U^2-Net-p
kind (pipeline/assets/segmenter.onnx: run-time Resize sizes, ceil-mode pooling, five
sigmoid maps named by number, one folded-BN channel saturated at 228) on real photos, as
a user runs it: the default job, fp32 on other runtimes, int8 with and without
equalization. Issue 45: a true verdict in bounded time on a model nobody tuned for."""

from __future__ import annotations

import functools
import json

import pytest

from conftest import read_report, run_cli, run_dirs
from pipeline.app.auto import CUT, NOT_BUILT, SLOWER
from pipeline.app.screening import SCREEN_SLOWER
from pipeline.environment import cpu
from segmenter_data import FUSED_OUTPUT, MEAN, MODEL, STD, write_photos
from side_by_side import Jobs

OUTLIER_PRODUCER = "/enc1/enc1.0/Conv"  # its channel 5 sits at 228 (scripts/train_segmenter.py)


def _args(photos):
    # the output name typed as a user types it: Hydra reads 162 as an int, parity as a name
    return [f"model.path={MODEL}", "data.kind=images", f"data.path={photos}", f"data.preprocess.mean={list(MEAN)}",
            f"data.preprocess.std={list(STD)}", "metric=map_iou", "metric.threshold=0.5",
            f"metric.output={FUSED_OUTPUT}"]


def _job(photos, cwd, *extra):
    cwd.mkdir(parents=True, exist_ok=True)
    result = run_cli([*_args(photos), *extra], cwd, default_precision=None)
    return result, run_dirs(cwd)[-1] if run_dirs(cwd) else None


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("segmenter")
    photos = write_photos(folder / "photos", calibration=8, validation=24)
    queue = Jobs()
    for name, extra in (("auto", ()), ("int8_ov", ("target=openvino_cpu", "precision=int8")),
                        ("int8_ov_plain", ("target=openvino_cpu", "precision=int8", "precision.equalization=false")),
                        ("fp32_ncnn", ("target=ncnn_cpu", "precision=fp32")),
                        ("fp32_mnn", ("target=mnn_cpu", "precision=fp32"))):
        queue.submit(name, functools.partial(_job, photos, folder / name, *extra))
    yield queue
    queue.close()


def _flags() -> str:
    return " ".join(cpu()["flags"])


def test_the_default_job_ships_a_passing_build_and_never_verifies_what_cannot_win(jobs):
    result, run_dir = jobs["auto"]
    assert result.returncode == 0, result.stdout + result.stderr
    section = read_report(run_dir)["auto"]
    rows = {row["precision"]: row for row in section["candidates"]}
    assert set(rows) == {"fp32", "int8", "int8_dynamic", "mixed"}
    _screened_by_the_rule(rows["int8_dynamic"], run_dir)
    assert all(row["verdict"] in ("pass", "fail", SLOWER, NOT_BUILT, "not verified", "same build as int8")
               for row in rows.values()), rows
    assert section["budget"]["cut"] == [] and CUT not in {row["verdict"] for row in rows.values()}
    assert rows[section["chosen"]]["verdict"] == "pass"
    assert f"precision=auto shipped {section['chosen']}" in result.stdout


def _screened_by_the_rule(dynamic: dict, run_dir):
    """int8 with dynamic ranges runs ConvInteger, 0.2-0.3x fp32 on this net on every idle CPU
    measured: timed in seconds, never verified. Beside the suite's other jobs on 2 cores it
    is not: fp32 gains 1.7x from its second thread, this build 1.2x (measured alone), and
    fp32's spinning threads lose most when a core is taken. A screening there once saw it at
    >= 0.8x, and then the rule verifies it."""
    screened_at = dynamic["speedup"]["speedup_p75"]
    verified = (run_dir / "candidates" / "int8_dynamic" / "stages" / "verify").exists()
    if dynamic["verdict"] != SLOWER:
        assert screened_at >= SCREEN_SLOWER and dynamic["timed_on"].endswith("before verification"), dynamic
        assert verified and dynamic["verdict"] in ("pass", "fail"), dynamic
        return
    assert screened_at < SCREEN_SLOWER and not verified, (dynamic, _flags())
    if dynamic["timed_on"].endswith("(a first look of single runs)"):  # decided without the screening's rounds
        assert dynamic["latency"]["rounds"] == 3 and screened_at < 0.5, dynamic
        assert "under 0.5x fp32 in each of 3 single runs" in dynamic["reasons"][0], dynamic


def test_equalization_moves_the_saturated_channel_into_the_consumers(jobs):
    """The int8 candidate's calibration scales channel 5 down in the conv making it and up
    in both convs reading it (through the pool, and through the skip's Concat)."""
    _, run_dir = jobs["auto"]
    calibrate = json.loads((run_dir / "candidates" / "int8" / "stages" / "calibrate" / "result.json").read_text())
    equalized = calibrate["summary"]["equalization"]
    assert equalized["applied"] is True
    (pair,) = equalized["outlier_pairs"]
    assert pair["producer"] == OUTLIER_PRODUCER and pair["channels"] == [5] and len(pair["consumers"]) == 2
    scores = equalized["candidates"]
    assert scores[f"alpha {equalized['alpha']:g}"]["loss"] < scores["none"]["loss"] / 5


def test_the_int8_build_widens_its_narrow_convs_for_onnx_runtime(jobs):
    """The side maps' 1-channel Convs and the 8-channel ones run ONNX Runtime's slower int8
    kernel: the ort_cpu build widens them to 16 filters (precision/narrow_convs.py), but not
    the first Conv, whose 3 input channels the fast kernel does not take either; the OpenVINO
    build, whose kernels have no such block, keeps them as they are."""
    _, run_dir = jobs["auto"]
    build = json.loads((run_dir / "candidates" / "int8" / "stages" / "build" / "result.json").read_text())
    widened = build["summary"]["quantization"]["convs_widened"]
    assert {"/sides.0/Conv", "/sides.3/Conv", "/fuse/Conv", "/dec1/dec1.0/Conv"} <= set(widened), widened
    assert OUTLIER_PRODUCER not in widened
    _, openvino = jobs["int8_ov"]
    assert "convs_widened" not in read_report(openvino)["build"]["quantization"]


def test_equalization_keeps_the_map_where_plain_int8_loses_it(jobs):
    """One per-tensor scale spent on the 228 channel costs plain int8 the map (IoU about
    0.84, as the peers' int8 does); equalized, int8 keeps it within a few hundredths."""
    (with_it, run_with), (without, run_without) = jobs["int8_ov"], jobs["int8_ov_plain"]
    assert with_it.returncode in (0, 3) and without.returncode in (0, 3), with_it.stdout + without.stdout
    kept = read_report(run_with)["verify"]["task"]["target"]
    plain = read_report(run_without)["verify"]["task"]["target"]
    assert kept >= 0.96 and kept - plain >= 0.05, (kept, plain, _flags())
    assert read_report(run_without)["calibration"]["equalization"]["reason"].startswith("off")


@pytest.mark.parametrize("job", ["fp32_ncnn", "fp32_mnn"])
def test_fp32_on_another_runtime_passes_float_noise_and_says_why(jobs, job):
    """fp32 is allowed a drop of 0; a few map pixels flipped by float reordering pass as
    float noise (the reason is recorded), never as a FAIL on every target."""
    result, run_dir = jobs[job]
    assert result.returncode == 0, result.stdout + result.stderr
    task = read_report(run_dir)["verify"]["task"]
    assert task["passed"] is True and task["max_drop"] == 0.0
    if task["drop"] > 0:  # where this runtime flipped boundary pixels on these photos
        assert task["float_noise"].startswith("float noise: a fp32 build") and "reason" not in task
        assert "passes as float noise" in result.stdout


def test_an_output_the_model_lacks_is_a_config_error_before_any_work(tmp_path):
    """Typed as a number or not, an output name is a name; one the model lacks stops the
    job at start (exit 2), not after calibrate and build."""
    photos = write_photos(tmp_path / "photos", calibration=1, validation=1)
    result = run_cli([*_args(photos), "metric.output=461", "precision=int8"], tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "metric.output: the model has no output '461'; outputs: 162, 163, 164, 165, 166" in result.stderr
    assert not any(run_dirs(tmp_path)[-1].glob("stages/*/result.json")) if run_dirs(tmp_path) else True
