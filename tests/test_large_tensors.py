"""Calibration sized to large activations (pipeline/precision/calibration/statistics.py): a
tensor of more than HISTOGRAM_VALUES values a sample feeds its histogram every p-th value,
every channel still read and its range exact; calibration=auto keeps fewer samples of a
tensor beyond KEPT_VALUES, and its per-tensor choice runs a consumer on the samples all its
inputs kept."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from pipeline.data import Sample
from pipeline.precision.calibration import auto, statistics, tables


@pytest.mark.parametrize("shape, channel_axis", [((2, 24, 64, 64), 1), ((2, 64 * 64, 24), 2)])
def test_every_channel_feeds_the_histogram_of_a_large_tensor(monkeypatch, shape, channel_axis):
    monkeypatch.setattr(statistics, "HISTOGRAM_VALUES", 4096)
    channels = shape[channel_axis]
    # channel c holds only the value c + 1: the channels read are the distinct values seen
    value = np.broadcast_to(np.arange(1, channels + 1, dtype=np.float32).reshape(
        [channels if axis == channel_axis else 1 for axis in range(len(shape))]), shape).copy()
    read = statistics.histogram_values(value, samples=2)
    assert read.size <= 2 * 4096 * 1.01 and read.size < value.size / 5
    assert set(np.unique(read)) == set(range(1, channels + 1))


def test_a_small_tensor_is_read_whole():
    value = np.arange(1000, dtype=np.float32)
    assert statistics.histogram_values(value, samples=1) is value


def _wide_model():
    """x [1,4,64,64] -> conv a (16 channels, 64x64: large) -> conv b; and x -> conv c."""
    rng = np.random.default_rng(0)
    weights = [numpy_helper.from_array(rng.normal(0, 0.3, s).astype(np.float32), n)
               for n, s in (("wa", (16, 4, 3, 3)), ("wb", (2, 16, 1, 1)), ("wc", (2, 4, 1, 1)))]
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "wa"], ["a"], name="conv_a", pads=[1, 1, 1, 1]),
         helper.make_node("Relu", ["a"], ["r"], name="relu"),
         helper.make_node("Conv", ["r", "wb"], ["b"], name="conv_b"),
         helper.make_node("Conv", ["x", "wc"], ["c"], name="conv_c")],
        "wide", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 64, 64])],
        [helper.make_tensor_value_info("b", TensorProto.FLOAT, [1, 2, 64, 64]),
         helper.make_tensor_value_info("c", TensorProto.FLOAT, [1, 2, 64, 64])], initializer=weights)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return onnx.shape_inference.infer_shapes(model)


def test_a_large_tensor_keeps_fewer_samples_and_auto_still_chooses(monkeypatch):
    monkeypatch.setattr(statistics, "KEPT_VALUES", 16 * 64 * 64 * 2)  # two samples of the 16-channel tensor
    monkeypatch.setattr(statistics, "HISTOGRAM_VALUES", 8192)
    model = _wide_model()
    rng = np.random.default_rng(1)
    samples = [Sample(f"s{i}", {"x": rng.normal(0, 1, (1, 4, 64, 64)).astype(np.float32)}) for i in range(6)]
    stats = statistics.collect(model, samples, len(samples), keep=4, batch_size=1,
                               around=["Conv"])
    assert len(stats.kept["r"]) == 2 and len(stats.kept["x"]) == 4
    for name, histogram in stats.histograms.items():  # ranges exact, counts from the strided values
        assert histogram.count <= 6 * max(8192 * 1.01, 4 * 64 * 64)
    assert stats.histograms["r"].abs_max == pytest.approx(max(
        float(np.abs(statistics.BatchRunner(model, ["r"], 1).run(s.feeds, 1)["r"]).max()) for s in samples))
    candidates = {name: {m: tables.table_entry(stats.histograms[name], m) for m in ("max", "percentile")}
                  for name in stats.histograms}
    chosen = auto.choose(model, stats.kept, candidates, "uint8")
    assert set(chosen) == set(stats.histograms) and all(c["method"] in ("max", "percentile") for c in chosen.values())


def test_statistics_record_which_sample_holds_each_peak():
    model = _wide_model()
    rng = np.random.default_rng(2)
    samples = [Sample(f"s{i}", {"x": rng.normal(0, 1, (1, 4, 64, 64)).astype(np.float32) * (9.0 if i == 3 else 1.0)})
               for i in range(6)]
    stats = statistics.collect(model, samples, len(samples), keep=1, batch_size=2, around=["Conv"])
    assert stats.sample_names == [s.name for s in samples]
    sizes = {"x": 4, "a": 16, "r": 16, "b": 2, "c": 2}  # channels of 64x64
    assert stats.sample_values == sum(sizes[name] * 64 * 64 for name in stats.histograms)
    for name, peaks in stats.sample_peaks.items():
        assert len(peaks) == 6 and int(np.argmax(peaks)) == 3, name  # the scaled-up sample holds every peak
        assert max(peaks) == pytest.approx(stats.histograms[name].abs_max)


def _peaked_statistics(count: int, values: int, holders: dict) -> statistics.Statistics:
    """Statistics of ``count`` samples of ``values`` values each, where holders[i] tensors peak on sample i."""
    peaks, index = {}, 0
    for holder, tensors in holders.items():
        for _ in range(tensors):
            row = [1.0] * count
            row[holder] = 5.0
            peaks[f"t{index}"] = row
            index += 1
    return statistics.Statistics({}, sample_peaks=peaks, sample_names=[f"s{i}" for i in range(count)],
                                 sample_values=values)


def test_a_large_model_is_judged_on_a_subsample_that_keeps_the_outlier_samples():
    samples = [Sample(f"s{i}", {"x": np.zeros(1, np.float32)}) for i in range(16)]
    stats = _peaked_statistics(16, 128 << 20, {9: 5, 13: 3, 2: 1})  # the real-size segmenter's 128 M values
    chosen = statistics.judge_samples(samples, stats)
    assert len(chosen) == statistics.JUDGE_MIN == 4
    names = [s.name for s in chosen]
    assert "s9" in names and "s13" in names  # the two samples holding the most peaks (half the subsample)
    assert names == sorted(names, key=lambda n: int(n[1:]))  # in the calibration set's order
    assert len(set(names)) == 4


def test_a_small_model_is_judged_on_every_sample_up_to_the_cap():
    samples = [Sample(f"s{i}", {"x": np.zeros(1, np.float32)}) for i in range(40)]
    small = _peaked_statistics(40, 10_000, {39: 4})
    assert len(statistics.judge_samples(samples[:12], small)) == 12
    chosen = statistics.judge_samples(samples, small)
    assert len(chosen) == statistics.JUDGE_MAX and chosen[-1].name == "s39"
    middle = _peaked_statistics(40, statistics.JUDGE_VALUES // 6, {})  # sized between the bounds, no peaks known
    spread = statistics.judge_samples(samples, middle)
    assert len(spread) == 6 and spread[0].name == "s0" and spread[-1].name == "s39"
