"""Calibration math: streaming |x| histograms, thresholds against loop-based references
and numpy, and the calibration table formats."""

from __future__ import annotations

import json
import math
import re
import warnings

import numpy as np
import pytest

from pipeline.precision.calibration import tables
from pipeline.precision.calibration.histogram import AbsHistogram
from pipeline.precision.calibration.thresholds import (
    METHODS,
    MIN_THRESHOLD,
    compute,
    kl_divergences,
    kl_threshold,
    max_threshold,
    mse_threshold,
    percentile_threshold,
)

SAMPLES = 200_000


def distributions() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(20240607)
    gaussian = rng.standard_normal(SAMPLES)
    with_outliers = gaussian.copy()
    with_outliers[rng.choice(SAMPLES, 5, replace=False)] = [25.0, -40.0, 60.0, 18.0, -33.0]
    return {
        "gaussian": gaussian,
        "laplace": rng.laplace(size=SAMPLES),
        "relu_gaussian": np.maximum(rng.standard_normal(SAMPLES), 0.0),
        "gaussian_outliers": with_outliers,
    }


DATA = distributions()


def histogram_of(values: np.ndarray, batches: int = 1, bins: int = 2048) -> AbsHistogram:
    h = AbsHistogram(bins)
    for batch in np.array_split(values, batches):
        h.update(batch)
    return h


def quantization_mse(values: np.ndarray, threshold: float) -> float:
    scale = threshold / 127
    restored = np.clip(np.round(values / scale), -127, 127) * scale
    return float(np.mean((restored - values) ** 2))


# Histogram


def test_streamed_batches_equal_one_batch_when_the_widths_meet():
    rng = np.random.default_rng(1)
    values = rng.standard_normal(100_000)
    first_max = float(np.abs(values[:100]).max())
    values = np.clip(values, -7 * first_max, 7 * first_max)
    values[60_000] = -8 * first_max  # a power-of-two multiple: 3 doublings land on the same width
    streamed = histogram_of(values, batches=1000)
    whole = histogram_of(values)
    assert streamed.width == whole.width
    assert streamed == whole
    for method in METHODS:
        assert compute(streamed, method) == compute(whole, method)


def test_streaming_in_any_order_keeps_thresholds_within_a_bin():
    values = np.random.default_rng(2).permutation(DATA["laplace"])
    streamed = histogram_of(values, batches=500)
    whole = histogram_of(values)
    assert streamed.count == whole.count == SAMPLES and streamed.abs_max == whole.abs_max
    width = max(streamed.width, whole.width)
    assert abs(percentile_threshold(streamed, 99.9) - percentile_threshold(whole, 99.9)) <= width


def test_doubling_merges_pairs_and_keeps_the_total():
    h = AbsHistogram(bins=8)
    h.update(np.array([0.0, 0.1, 0.2, 0.5, 0.7, -0.79]))
    first_width = h.width
    before = h.counts.copy()
    h.update(np.array([3.0]))  # needs width * 8 > 3: two doublings
    assert h.width == 4 * first_width
    twice = before.reshape(-1, 4).sum(axis=1)
    expected = np.concatenate([twice, np.zeros(6, dtype=np.int64)])
    expected[int(3.0 / h.width)] += 1
    np.testing.assert_array_equal(h.counts, expected)
    assert h.counts.sum() == h.count == 7 and h.zero_count == 1
    assert (h.min, h.max, h.abs_max) == (-0.79, 3.0, 3.0)
    assert h.edges.shape == (9,) and h.edges[-1] == h.width * 8 > h.abs_max


def test_first_batch_max_lands_in_the_top_bin():
    h = AbsHistogram()
    h.update(np.array([-2.5, 1.0, 0.0]))
    assert int(2.5 / h.width) == h.bins - 1 and h.counts[-1] == 1


def test_non_finite_values_raise_and_change_nothing():
    h = histogram_of(DATA["gaussian"][:1000])
    snapshot = h.to_json()
    for bad in (np.nan, np.inf, -np.inf):
        with pytest.raises(ValueError, match="non-finite"):
            h.update(np.array([1.0, bad], dtype=np.float32))
    assert h.to_json() == snapshot


def test_integer_input_does_not_overflow():
    h = AbsHistogram()
    h.update(np.array([-128, 127], dtype=np.int8))
    assert h.abs_max == 128.0 and h.min == -128.0


def test_json_round_trip_is_exact():
    h = histogram_of(DATA["relu_gaussian"], batches=7)
    copy = AbsHistogram.from_json(json.loads(json.dumps(h.to_json())))
    assert copy == h and copy.count == h.count and copy.zero_count == h.zero_count > 0
    assert AbsHistogram.from_json(AbsHistogram().to_json()) == AbsHistogram()
    broken = h.to_json()
    broken["counts"][0] += 1
    with pytest.raises(ValueError, match="add up"):
        AbsHistogram.from_json(broken)


def test_merge_of_same_base_histograms_is_exact():
    values = DATA["gaussian"]
    first_max = float(np.abs(values[:SAMPLES // 2]).max())
    values = np.clip(values, -first_max, first_max)
    values[-1] = 2 * first_max  # the second half's histogram has twice the first one's width
    left, right = histogram_of(values[:SAMPLES // 2]), histogram_of(values[SAMPLES // 2:])
    assert right.width == 2 * left.width
    left.merge(right)
    assert left == histogram_of(values)


def test_merge_of_unrelated_widths_keeps_totals_and_percentiles():
    values = DATA["laplace"]
    left, right = histogram_of(values[:50_000]), histogram_of(values[50_000:] * 1.3)
    whole = histogram_of(np.concatenate([values[:50_000], values[50_000:] * 1.3]))
    left.merge(right)
    assert (left.count, left.zero_count, left.abs_max, left.min, left.max) == (
        whole.count, whole.zero_count, whole.abs_max, whole.min, whole.max)
    assert left.counts.sum() == left.count and (left.counts >= 0).all()
    assert abs(percentile_threshold(left, 99.9) - percentile_threshold(whole, 99.9)) <= 2 * left.width


# Thresholds


def test_all_zero_tensors_give_the_floor_without_warnings():
    zeros = AbsHistogram()
    zeros.update(np.zeros((4, 16), dtype=np.float32))
    with warnings.catch_warnings(), np.errstate(all="raise"):
        warnings.simplefilter("error")
        for h in (zeros, AbsHistogram()):
            for method in METHODS:
                assert compute(h, method) == MIN_THRESHOLD
    assert zeros.counts[0] == zeros.zero_count == zeros.count == 64


def test_thresholds_are_positive_and_never_above_abs_max():
    with warnings.catch_warnings(), np.errstate(all="raise"):
        warnings.simplefilter("error")
        for values in DATA.values():
            h = histogram_of(values, batches=20)
            assert max_threshold(h) == float(np.abs(values).max())
            for method in METHODS:
                assert MIN_THRESHOLD <= compute(h, method) <= h.abs_max


def test_unknown_method_and_bad_options_raise():
    h = histogram_of(DATA["gaussian"])
    with pytest.raises(ValueError, match="unknown calibration method"):
        compute(h, "entropy")
    with pytest.raises(ValueError):
        percentile_threshold(h, 0.0)
    with pytest.raises(ValueError):
        kl_threshold(histogram_of(DATA["gaussian"], bins=64), quantized_levels=128)


@pytest.mark.parametrize("name", sorted(DATA))
@pytest.mark.parametrize("percentile", [99.0, 99.9, 99.99])
def test_percentile_within_one_bin_of_numpy(name, percentile):
    values = DATA[name]
    h = histogram_of(values, batches=10)
    expected = float(np.percentile(np.abs(values), percentile))
    assert abs(percentile_threshold(h, percentile) - expected) <= h.width


def test_percentile_interpolates_inside_the_crossing_bin():
    def histogram(counts, zero_count):
        return AbsHistogram.from_json({
            "bins": 4, "width": 1.0, "count": sum(counts), "zero_count": zero_count,
            "abs_max": 2.9, "min": -2.9, "max": 2.5, "counts": counts})

    assert percentile_threshold(histogram([2, 4, 4, 0], 0), 50.0) == 1.75  # 1 + (5 - 2) / 4
    assert percentile_threshold(histogram([6, 4, 0, 0], 4), 50.0) == 0.5  # (5 - 4 zeros) / 2 non-zeros
    assert percentile_threshold(histogram([2, 4, 4, 0], 0), 100.0) == 2.9  # capped at abs_max


def test_percentile_inside_the_zero_mass_is_the_floor():
    h = AbsHistogram()
    h.update(np.concatenate([np.zeros(999), [1.0]]))
    assert percentile_threshold(h, 99.0) == MIN_THRESHOLD
    assert percentile_threshold(h, 100.0) == 1.0


KL_SMOOTHING_EPS = 1e-4  # docs/calibration.md: empty Q bins get 1e-4 (in counts)


def reference_divergences(counts: list[int], levels: int, sizes: list[int]) -> list[float]:
    """KL(P || Q) per candidate size, loop by loop, from docs/calibration.md."""
    divergences = []
    for size in sizes:
        p = [float(c) for c in counts[:size]]
        p[size - 1] += sum(counts[size:])
        merged = size // levels
        q = [0.0] * size
        for group in range(levels):
            start = group * merged
            stop = size if group == levels - 1 else start + merged
            total = sum(counts[start:stop])
            occupied = sum(1 for b in range(start, stop) if counts[b] > 0)
            for b in range(start, stop):
                if counts[b] > 0:
                    q[b] = total / occupied
        q = [value if value > 0 else KL_SMOOTHING_EPS for value in q]
        p_sum, q_sum = sum(p), sum(q)
        divergence = 0.0
        for p_value, q_value in zip(p, q):
            if p_value > 0:
                divergence += p_value / p_sum * math.log((p_value / p_sum) / (q_value / q_sum))
        divergences.append(divergence)
    return divergences


def reference_kl_threshold(h: AbsHistogram, levels: int = 128, step: int = 128) -> float:
    counts = [int(c) for c in h.counts]
    counts[0] -= h.zero_count  # exact zeros are left out
    sizes = list(range(levels, h.bins + 1, step))
    divergences = reference_divergences(counts, levels, sizes)
    best_size = sizes[divergences.index(min(divergences))]
    return max(min(best_size * h.width, h.abs_max), MIN_THRESHOLD)


def test_kl_divergences_match_the_loop_reference_on_sparse_counts():
    # many empty bins: candidates that end in an empty bin with outliers beyond need smoothing
    rng = np.random.default_rng(5)
    counts = rng.integers(1, 50, 96) * (rng.random(96) < 0.4)
    sizes = list(range(8, 97))
    expected = reference_divergences([int(c) for c in counts], 8, sizes)
    np.testing.assert_allclose(kl_divergences(counts, np.array(sizes), 8), expected, rtol=1e-12)


@pytest.mark.parametrize("name", sorted(DATA))
def test_kl_matches_the_loop_reference(name):
    h = histogram_of(DATA[name], batches=10)
    assert kl_threshold(h) == pytest.approx(reference_kl_threshold(h), rel=1e-12)


@pytest.mark.parametrize("name", ["laplace", "gaussian_outliers"])
def test_kl_matches_the_loop_reference_with_uneven_groups(name):
    # step 1 makes most candidates not a multiple of 128: the last group takes the remainder
    h = histogram_of(DATA[name], bins=512)
    assert kl_threshold(h, step=1) == pytest.approx(reference_kl_threshold(h, step=1), rel=1e-12)
    assert kl_threshold(h, quantized_levels=100, step=7) == pytest.approx(
        reference_kl_threshold(h, levels=100, step=7), rel=1e-12)


def test_kl_clips_outliers():
    h = histogram_of(DATA["gaussian_outliers"])
    assert kl_threshold(h) < 0.25 * h.abs_max


def test_mse_on_uniform_is_close_to_max():
    values = np.random.default_rng(3).uniform(-1.0, 1.0, SAMPLES)
    h = histogram_of(values)
    assert 0.98 * h.abs_max <= mse_threshold(h) <= h.abs_max


def test_mse_on_laplace_with_outliers_clips_and_lowers_the_error():
    rng = np.random.default_rng(4)
    values = np.concatenate([rng.laplace(size=SAMPLES), [30.0, -35.0, 40.0]])
    h = histogram_of(values, batches=10)
    threshold = mse_threshold(h)
    assert threshold < 0.7 * h.abs_max
    assert quantization_mse(values, threshold) < 0.7 * quantization_mse(values, h.abs_max)


@pytest.mark.parametrize("name", ["laplace", "relu_gaussian"])
def test_mse_is_near_the_best_threshold_on_a_grid(name):
    values = DATA[name]
    h = histogram_of(values)
    grid = np.linspace(0.3, 1.0, 71) * h.abs_max
    best = min(quantization_mse(values, t) for t in grid)
    assert quantization_mse(values, mse_threshold(h)) <= 1.01 * best


# Tables

TABLE = {
    "images": {"threshold": 1.0000080108642578, "min": 0.0, "max": 1.0000080108642578, "method": "kl"},
    "122_Conv": {"threshold": 56.42818030000001, "min": -102.5830231, "max": 97.6811752, "method": "kl"},
    "/blocks.0/act/Relu_output_0": {"threshold": MIN_THRESHOLD, "min": 0.0, "max": 0.0, "method": "kl"},
    "huge": {"threshold": 3.0e30, "min": -3.5e30, "max": 2.0e-30, "method": "kl"},
}


def test_tpu_mlir_round_trip_is_exact_and_matches_tpu_mlir_row_pattern():
    text = tables.to_tpu_mlir(TABLE)
    assert tables.from_tpu_mlir(text) == TABLE
    assert tables.TPU_MLIR_HEADER in text.splitlines()
    rows = [line for line in text.splitlines() if not line.startswith("#")]
    assert len(rows) == len(TABLE)
    for row in rows:  # the pattern TPU-MLIR's ImportCalibrationTable pass accepts
        assert re.fullmatch(r"\S+\s+[-0-9.e]+\s+[-0-9.e]+\s+[-0-9.e]+", row), row


def test_tpu_mlir_reads_tpu_mlir_output():
    text = (
        "# genetated time: 2022-08-11 10:00:59.743675\n# histogram number: 2048\n"
        "# sample number: 100\n# tune number: 5\n###\n# op_name    threshold    min    max\n"
        "images 1.0000080 0.0000000 1.0000080\r\n122_Conv 56.4281803 -102.5830231 97.6811752\n"
        "\n#weight_scale\n122_Conv_weight 2 0.5 0.25\n#int4_th\n122_Conv 7.0 -7.0 7.0\n"
    )
    table = tables.from_tpu_mlir(text)
    assert table == {
        "images": {"threshold": 1.000008, "min": 0.0, "max": 1.000008, "method": "unknown"},
        "122_Conv": {"threshold": 56.4281803, "min": -102.5830231, "max": 97.6811752, "method": "unknown"},
    }


@pytest.mark.parametrize("bad_row", [
    "conv 1.0 -1.0", "conv 1.0 -1.0 1.0 extra", "conv one -1.0 1.0", "conv nan -1.0 1.0",
    "conv -1.0 -1.0 1.0", "conv 1.0 2.0 1.0", "images 2.0 0.0 2.0",
])
def test_tpu_mlir_malformed_rows_name_their_line(bad_row):
    text = f"# op_name    threshold    min    max\nimages 1.0 0.0 1.0\n{bad_row}\n"
    with pytest.raises(ValueError, match=r"^line 3: "):
        tables.from_tpu_mlir(text)


@pytest.mark.parametrize("name", ["has space", "tab\there", "", "#comment"])
def test_tpu_mlir_export_rejects_names_it_cannot_hold(name):
    with pytest.raises(ValueError, match="TPU-MLIR"):
        tables.to_tpu_mlir({name: {"threshold": 1.0, "min": -1.0, "max": 1.0, "method": "max"}})


def test_exports_are_written_and_parsable(tmp_path):
    histograms = {name: histogram_of(values) for name, values in DATA.items()}
    table = tables.build_table(histograms, "kl")
    written = tables.write_exports(table, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [tables.ORT_JSON_FILE, tables.ORT_CACHE_FILE, tables.TPU_MLIR_FILE])

    imported = tables.from_tpu_mlir(written["tpu_mlir"].read_text())
    assert {n: {k: e[k] for k in ("threshold", "min", "max", "method")} for n, e in table.items()} == imported

    document = json.loads(written["ort_json"].read_text())
    assert document["calibration_method"]["value"] == "CalibrationMethod.Entropy"
    relu = document["data"]["relu_gaussian"]
    assert relu["lowest"]["data"] == 0.0
    assert relu["highest"]["data"] == float(np.float32(table["relu_gaussian"]["threshold"]))
    assert document["data"]["gaussian"]["lowest"]["data"] == -document["data"]["gaussian"]["highest"]["data"]

    lines = written["ort_cache"].read_text().splitlines()
    assert [line.split(" ")[0] for line in lines] == sorted(table)
    for line in lines:
        name, value = line.split(" ")
        assert float(value) == float(np.float32(table[name]["threshold"]))


def test_ort_exports_equal_what_onnxruntime_writes(tmp_path):
    pytest.importorskip("flatbuffers")
    from onnxruntime.quantization.calibrate import CalibrationMethod, TensorData, TensorsData
    from onnxruntime.quantization.quant_utils import write_calibration_table

    table = {name: dict(entry, method="percentile") for name, entry in TABLE.items() if name != "huge"}
    ort_ranges = {
        name: TensorData(lowest=np.array(-e["threshold"] if e["min"] < 0 else 0.0, dtype=np.float32),
                         highest=np.array(e["threshold"], dtype=np.float32))
        for name, e in table.items()
    }
    write_calibration_table(TensorsData(CalibrationMethod.Percentile, ort_ranges), dir=str(tmp_path))
    assert (tmp_path / "calibration.json").read_text() == json.dumps(tables.to_ort_calibration_cache(table))
    assert (tmp_path / "calibration.cache").read_text() == tables.to_ort_cache_text(table)
    if hasattr(TensorsData, "from_dict"):
        loaded = TensorsData.from_dict(tables.to_ort_calibration_cache(table))
        assert float(loaded["122_Conv"].range_value[1]) == float(np.float32(56.42818030000001))


def test_mixed_or_mse_tables_are_labelled_minmax_for_ort():
    mixed = {"a": dict(TABLE["images"], method="mse"), "b": dict(TABLE["122_Conv"], method="kl")}
    assert tables.to_ort_calibration_cache(mixed)["calibration_method"]["value"] == "CalibrationMethod.MinMax"
    assert tables.TPU_MLIR_METHOD_PREFIX not in tables.to_tpu_mlir(mixed)
    assert {e["method"] for e in tables.from_tpu_mlir(tables.to_tpu_mlir(mixed)).values()} == {"unknown"}


def test_kl_max_clipped_skips_candidates_that_clip_too_much():
    from pipeline.precision.calibration.histogram import AbsHistogram
    from pipeline.precision.calibration.thresholds import kl_threshold

    rng = np.random.default_rng(7)
    values = np.concatenate([rng.normal(0, 1, 200_000), rng.normal(0, 1, 20_000) * 30])  # heavy shoulder
    h = AbsHistogram()
    h.update(values)
    free, guarded = kl_threshold(h), kl_threshold(h, max_clipped=0.001)
    clipped = np.mean(np.abs(values) > guarded)
    assert guarded >= free and clipped <= 0.0011
    assert kl_threshold(h, max_clipped=1.0) == free


def test_large_samples_run_in_batches_of_bounded_size_with_the_same_values():
    """BatchRunner runs at most BATCH_VALUES input values at a time (a 16-sample batch of the
    320x320 segmenter ran 2.8x slower a sample than one at a time): the packed values are
    those of the samples run one at a time, in order."""
    from onnx import TensorProto, helper

    from pipeline.precision.calibration import statistics

    side = 256  # 3 x 256 x 256 = 192 Ki values: one sample a run
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, side, side])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1, side, side])
    graph = helper.make_graph([helper.make_node("ReduceMean", ["x"], ["y"], axes=[1], keepdims=1)], "g", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    samples = np.random.default_rng(0).standard_normal((5, 3, side, side)).astype(np.float32)
    runner = statistics.BatchRunner(model, ["y"], 5)
    calls = []
    original = runner._run_batch
    runner._run_batch = lambda batch: calls.append(len(batch)) or original(batch)
    values = runner.run({"x": samples}, 5)
    assert calls == [1, 1, 1, 1, 1] and runner.batch_size == 5  # still batched, one sample a run
    assert np.allclose(values["y"], samples.mean(axis=1, keepdims=True), atol=1e-5)
    small = samples[:, :, :64, :64].copy()  # 12 Ki values a sample: all five in one run
    tiny = helper.make_model(helper.make_graph(
        [helper.make_node("ReduceMean", ["x"], ["y"], axes=[1], keepdims=1)], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 64, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1, 64, 64])]),
        opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    runner, calls = statistics.BatchRunner(tiny, ["y"], 5), []
    original = runner._run_batch
    runner._run_batch = lambda batch: calls.append(len(batch)) or original(batch)
    assert np.allclose(runner.run({"x": small}, 5)["y"], small.mean(axis=1, keepdims=True), atol=1e-5)
    assert calls == [5]


@pytest.mark.parametrize("bad", [0, 3])  # the first sample's run, and the last's (its histograms fill after the loop)
def test_a_tensor_turning_non_finite_is_named_with_its_sample_whenever_its_histogram_fills(bad):
    """The statistics pass fills a sample's histograms beside the next sample's run: a
    non-finite activation still stops it with the tensor and the sample named."""
    from onnx import TensorProto, helper

    from pipeline.data import Sample
    from pipeline.errors import InputError
    from pipeline.precision.calibration import statistics

    graph = helper.make_graph([helper.make_node("Log", ["x"], ["y"], name="log")], "log",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    samples = [Sample(f"s{i}", {"x": np.full((1, 4), 0.0 if i == bad else 1.0 + i, np.float32)}) for i in range(4)]
    with pytest.raises(InputError, match=f"tensor 'y' holds non-finite values for samples s{bad}..s{bad}"):
        statistics.collect(model, samples, len(samples), batch_size=1)
    assert statistics.collect(model, samples[bad + 1:] or samples[:bad], 3, batch_size=1).histograms["y"].count > 0


@pytest.mark.parametrize("activations", ["uint8", "int8"])
def test_fake_quantization_equals_onnx_runtimes_quantize_and_dequantize(activations):
    """The search's fake quantization, a block at a time, gives what ONNX Runtime's
    QuantizeLinear -> DequantizeLinear give, value for value, ties at half a step included,
    on a tensor larger than a block and not a multiple of it."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from pipeline.precision.calibration.auto import BLOCK_VALUES, fake_quantize
    from pipeline.precision.quantize import scale_and_zero_point

    entry = {"threshold": 3.0, "min": -1.7, "max": 4.2, "method": "max"}
    scale, zero = scale_and_zero_point(entry, activations)
    zero_type = np.uint8 if activations == "uint8" else np.int8
    graph = helper.make_graph(
        [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"]), helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"])],
        "qdq", [helper.make_tensor_value_info("x", TensorProto.FLOAT, None)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        initializer=[numpy_helper.from_array(np.array(scale, np.float32), "s"),
                     numpy_helper.from_array(np.array(zero, zero_type), "z")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    values = (np.random.default_rng(1).standard_normal((3, 5, 111, 97)) * 3).astype(np.float32)
    values.ravel()[:1000] = (np.arange(1000) - 500) * scale * np.float32(0.5)  # exact halves of a step
    assert values.size > BLOCK_VALUES and values.size % BLOCK_VALUES
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    expected = session.run(None, {"x": values})[0]
    assert np.array_equal(fake_quantize(values, entry, activations), expected)
    assert fake_quantize(values.astype(np.float64), entry, activations).dtype == np.float64


def test_the_op_screen_runs_a_large_inputs_first_samples_and_a_small_ones_all():
    """The op screen's samples (sensitivity.screen_samples): a 320 x 320 image a sample, 4 of
    8 (the packed form's first slices); a small model's samples, all of them."""
    from pipeline.precision.calibration.sensitivity import SCREEN_SAMPLES, first_samples, screen_samples

    large = {"input": np.zeros((8, 3, 320, 320), np.float32)}
    assert screen_samples(large, 8) == SCREEN_SAMPLES == 4
    assert first_samples(large, 8, 4)["input"].shape == (4, 3, 320, 320)
    small = {"x": np.zeros((8, 1, 8, 8), np.float32), "rate": np.full(8, 16000, np.int64)}
    assert screen_samples(small, 8) == 8
    assert first_samples(small, 8, 2)["rate"].shape == (2,)
