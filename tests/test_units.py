"""Functions under the CLI: metrics, data sources, model loading, atomic writes."""

from __future__ import annotations

import math

import numpy as np
import pytest
from PIL import Image

from pipeline.artifacts import atomic_directory
from pipeline.config.schemas import Color, DataConfig, DataKind, PreprocessConfig, ValidationConfig
from pipeline.data import TensorSpec, load_image, open_dataset
from pipeline.errors import InputError
from pipeline.verification.metrics import OutputStats, cosine, failures
from pipeline.task_metrics import load_metric
from pipeline.verification.scoring import TaskScorer

SPEC = TensorSpec("x", [1, 2, 3], "float32")


def test_stats_match_closed_form():
    ref = np.array([3.0, 4.0, 0.0])
    out = np.array([3.0, 4.0, 1.0])
    stats = OutputStats()
    stats.update(ref, out)
    stats.update(ref, ref)
    result = stats.result()
    assert result["max_abs"] == 1.0
    assert result["mean_abs"] == pytest.approx(1 / 6)
    assert result["sqnr_db"] == pytest.approx(10 * math.log10(50 / 1))
    assert result["cosine"] == pytest.approx(50 / math.sqrt(50 * 51))
    assert result["min_sample_cosine"] == pytest.approx(25 / math.sqrt(25 * 26))
    assert stats.sample_max_abs == [1.0, 0.0]


def test_a_large_output_compared_in_slices_matches_the_whole_array_formulas():
    """OutputStats.update works through a large output a slice at a time: every figure is
    the whole sample's, NaN/Inf and zeros in the reference included, wherever they fall."""
    from pipeline.verification.metrics import CHUNK

    rng = np.random.default_rng(3)
    ref = rng.normal(size=3 * CHUNK + 17).astype(np.float32)
    out = ref + rng.normal(scale=1e-3, size=ref.size).astype(np.float32)
    out[[5, CHUNK + 2]], out[2 * CHUNK + 1], ref[CHUNK - 1] = np.nan, np.inf, 0.0
    stats = OutputStats()
    stats.update(ref, out)
    keep = np.isfinite(out)
    a, b = ref[keep].astype(np.float64), out[keep].astype(np.float64)
    result = stats.result()
    assert (result["nan"], result["inf"], result["elements"]) == (2, 1, ref.size)
    assert result["cosine"] == pytest.approx(a @ b / math.sqrt((a @ a) * (b @ b)), rel=1e-12)
    assert result["max_abs"] == pytest.approx(np.abs(a - b).max(), rel=1e-12)
    assert result["mean_abs"] == pytest.approx(np.abs(a - b).sum() / ref.size, rel=1e-9)
    assert stats.max_rel == math.inf  # the error on the reference's zero
    assert stats.sample_cosine == [pytest.approx(result["cosine"], rel=1e-12)]


def test_identical_outputs_have_infinite_sqnr_and_nan_never_passes():
    stats = OutputStats()
    stats.update(np.ones(4), np.ones(4))
    assert stats.result()["sqnr_db"] is None and stats.result()["cosine"] == 1.0
    stats.update(np.ones(4), np.array([1.0, np.nan, 1.0, np.inf]))
    result = stats.result()
    assert (result["nan"], result["inf"]) == (1, 1)
    assert any("NaN" in f for f in failures(result, ValidationConfig().thresholds_for("y")))
    assert cosine(np.zeros(3), np.zeros(3)) == 1.0 and cosine(np.zeros(3), np.ones(3)) == 0.0


def test_an_output_of_nan_alone_has_no_cosine_of_one():
    """ncnn ran a GroupNorm audio net into 600 NaN of 600 scores: nothing finite to compare
    is a cosine of 0 (precision=auto's "comes closest" read 1.000000 off it), zeros on both
    sides still agree."""
    stats = OutputStats()
    for _ in range(3):
        stats.update(np.array([0.3, -0.1, 0.2]), np.full(3, np.nan))
    assert stats.result()["cosine"] == 0.0 and stats.result()["nan"] == 9
    both_zero = OutputStats()
    both_zero.update(np.zeros(3), np.array([0.0, np.nan, 0.0]))
    assert both_zero.result()["cosine"] == 1.0 and both_zero.result()["nan"] == 1


def test_nan_where_the_reference_has_nan_too_is_agreement():
    """A log of a negative input is NaN in the reference and in the build: no failure; a NaN
    where the reference has a number still fails, and says how many."""
    limits = ValidationConfig().thresholds_for("y")
    same = OutputStats()
    same.update(np.array([0.5, np.nan, -np.inf, 2.0]), np.array([0.5, np.nan, -np.inf, 2.0]))
    result = same.result()
    assert (result["nan"], result["inf"], result["new_nonfinite"]) == (1, 1, 0) and failures(result, limits) == []
    worse = OutputStats()
    worse.update(np.array([0.5, np.nan, -np.inf, 2.0]), np.array([np.nan, np.nan, np.inf, 2.0]))
    (text,) = failures(worse.result(), limits)
    assert text == "2 NaN and 1 Inf values in the output, 2 where the reference has a number"


def test_per_output_thresholds_override_the_defaults():
    validation = ValidationConfig(min_cosine=0.9, max_abs_error=1.0)
    validation.outputs["b"] = type(validation.thresholds_for("a"))(max_abs_error=0.5)
    assert validation.thresholds_for("a").max_abs_error == 1.0
    assert validation.thresholds_for("b").max_abs_error == 0.5
    assert validation.thresholds_for("b").min_cosine == 0.9


def test_top1_drop_and_agreement():
    scorer = TaskScorer(load_metric({"_target_": "pipeline.task_metrics.Top1"}), "y")
    for reference, output, label in (([0.1, 0.9], [0.9, 0.1], 1), ([0.9, 0.1], [0.9, 0.1], 0)):
        assert scorer.active(label)
        scorer.add("reference", np.array(reference), np.array(reference), label)
        scorer.add("int8", np.array(output), np.array(reference), label)
    scorer.finish()
    result = scorer.result("int8", max_drop=0.0)
    assert (result["reference"], result["target"], result["agreement"]) == (1.0, 0.5, 0.5)
    assert not result["passed"]


def test_npz_file_with_splits_and_labels(tmp_path):
    path = tmp_path / "d.npz"
    np.savez(path, **{"calibration/x": np.zeros((3, 1, 2, 3)), "validation/x": np.ones((5, 2, 3)),
                      "validation/labels": np.arange(5)})
    data = open_dataset(DataConfig(path=str(path), calibration_size=2, validation_size=4), [SPEC])
    assert (len(data.calibration), len(data.validation)) == (2, 4)
    samples = list(data.validation)
    assert samples[3].label == 3 and samples[0].feeds["x"].shape == (1, 2, 3)
    assert samples[0].feeds["x"].dtype == np.float32


def test_directory_without_splits_serves_both_and_warns(tmp_path):
    for index in range(3):
        np.save(tmp_path / f"{index}.npy", np.full((1, 2, 3), index, dtype=np.float32))
    (tmp_path / "labels.csv").write_text("sample,class\n0.npy,7\n1,8\n2.npy,9\n")
    data = open_dataset(DataConfig(path=str(tmp_path), calibration_size=2, validation_size=3), [SPEC])
    assert [s.label for s in data.validation] == [7, 8, 9]
    assert len(data.calibration) == 2
    assert any("serve both" in w for w in data.warnings)
    assert tmp_path / "labels.csv" in data.files


def test_missing_label_is_named(tmp_path):
    np.save(tmp_path / "a.npy", np.zeros((1, 2, 3), dtype=np.float32))
    (tmp_path / "labels.csv").write_text("b.npy,1\n")
    with pytest.raises(InputError, match="no label for a.npy"):
        open_dataset(DataConfig(path=str(tmp_path)), [SPEC])


def test_random_data_is_seeded_and_shaped():
    spec = TensorSpec("x", [1, 3, 4, 4], "float32")
    cfg = DataConfig(kind=DataKind.random, calibration_size=2, validation_size=2, seed=5)
    first = [s.feeds["x"] for s in open_dataset(cfg, [spec]).validation]
    again = [s.feeds["x"] for s in open_dataset(cfg, [spec]).validation]
    assert first[0].shape == (1, 3, 4, 4) and np.array_equal(first[0], again[0])
    assert not np.array_equal(first[0], first[1])


def test_image_keep_aspect_pads_in_normalized_units(tmp_path):
    path = tmp_path / "wide.png"
    Image.new("RGB", (40, 10), (255, 0, 0)).save(path)
    pre = PreprocessConfig(keep_aspect=True, color=Color.bgr, mean=[0.5], std=[0.5], pad_value=-7.0)
    tensor = load_image(path, TensorSpec("x", [1, 3, 8, 16], "float32"), pre)
    assert tensor.shape == (1, 3, 8, 16)
    # 40x10 fits 16x4: rows 0-3 hold the image, the rest is padding
    assert np.allclose(tensor[0, 2, :4], 1.0) and np.allclose(tensor[0, 0, :4], -1.0)  # BGR: red is channel 2
    assert np.allclose(tensor[0, :, 4:], -7.0)


def test_atomic_directory_leaves_nothing_on_failure(tmp_path):
    final = tmp_path / "bundle"
    with pytest.raises(RuntimeError):
        with atomic_directory(final) as temp:
            (temp / "half").write_text("x")
            raise RuntimeError("crash")
    assert list(tmp_path.iterdir()) == []
    with atomic_directory(final) as temp:
        (temp / "whole").write_text("x")
    assert [p.name for p in final.iterdir()] == ["whole"]


def test_preflight_warnings_sum_up_a_kind_found_in_many_tensors():
    from pipeline.report.assemble import preflight_warnings

    def finding(name, check="fp32_denormal", severity="warning"):
        return {"tensor": name, "check": check, "count": 1, "detail": "smallest |x| 1e-40 < 1.18e-38",
                "severity": severity}

    many = [finding(f"conv{i}.w") for i in range(5)]
    few = [finding("bn.var", "fp16_overflow"), finding("w", "fp16_underflow", "info")]
    lines = preflight_warnings(many + few)
    assert lines == ["pre-flight: bn.var: smallest |x| 1e-40 < 1.18e-38",
                     "pre-flight: 5 tensors hold float32 denormals (slow on CPUs): conv0.w, conv1.w, conv2.w, ... "
                     "(every one in the report's convert pre-flight table)"]


def test_an_output_of_rows_apart_in_scale_is_gated_on_its_worst_group():
    """A detector head [1, 4+C, N]: boxes in pixels, scores in 0..1. Scores ruined while the
    boxes hold: the whole output's cosine stays 1.0000, the scores' group fails the gate and
    the failure names its rows. Maps, vectors and tables of like rows are not grouped."""
    from pipeline.verification.metrics import OutputStats, failures, row_groups

    rng = np.random.default_rng(0)
    boxes, scores = rng.uniform(0, 320, (1, 4, 2100)), rng.uniform(0, 0.3, (1, 3, 2100)) ** 3
    reference = np.concatenate([boxes, scores], axis=1).astype(np.float32)
    assert [group.label for group in row_groups(reference)] == ["0-3", "4-6"]
    ruined = reference.copy()
    ruined[:, 4:] = rng.uniform(0, 0.03, (1, 3, 2100))
    stats = OutputStats()
    stats.update(reference, ruined)
    metrics = stats.result()
    assert metrics["whole_cosine"] > 0.9999 and metrics["cosine"] < 0.9 and metrics["worst_rows"] == "4-6"
    limits = type("Limits", (), {"min_cosine": 0.995, "max_abs_error": None, "max_mean_abs_error": None,
                                 "min_sqnr_db": None})
    (failure,) = failures(metrics, limits)
    assert failure.startswith("cosine 0.") and "in rows 4-6 (the whole output: 1.000000)" in failure
    for alike in (np.ones((1, 1, 320, 320)), np.ones((1, 1000)), rng.normal(0, 1, (1, 40, 6625))):
        assert row_groups(alike.astype(np.float32)) == []
    page = rng.uniform(0, 1, (1, 1, 96, 128))  # a text detector's map: lines of text, blank rows between
    page[:, :, 1::3] *= 1e-6
    assert row_groups(page.astype(np.float32)) == []
