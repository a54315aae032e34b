"""Cross-layer equalization of outlier channels (pipeline/precision/equalization.py): the
pairs it finds through Relu, MaxPool, Resize and a channel Concat, the float model
unchanged, the int8 model judged better, and a tensor a non-absorbing op reads left alone.
The CLI side, on the real segmenter: tests/test_segmenter.py."""

from types import SimpleNamespace

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from conftest import cpu_note
from pipeline.config.schemas import Precision, PrecisionConfig
from pipeline.precision import equalization
from pipeline.precision.quantize import QdqSettings

OUTLIER = 3  # the channel of conv1 that a saturated folded batch norm holds at 228


def _model(add_reader: bool = False) -> onnx.ModelProto:
    """conv1 (3->8) relu -> maxpool (ceil) -> conv2 (8->8) relu -> resize x2 -> concat with
    conv1's relu -> conv3 (16->1) -> sigmoid; conv1's channel OUTLIER is constant 228."""
    rng = np.random.default_rng(0)
    w1 = rng.normal(0, 0.4, (8, 3, 3, 3)).astype(np.float32)
    b1 = rng.normal(0, 0.1, 8).astype(np.float32)
    w1[OUTLIER], b1[OUTLIER] = 0.0, 228.0
    w2 = rng.normal(0, 0.2, (8, 8, 3, 3)).astype(np.float32)
    w2[:, OUTLIER] *= 0.01  # the model uses the constant channel as a small bias
    w3 = rng.normal(0, 0.2, (1, 16, 3, 3)).astype(np.float32)
    w3[:, 8 + OUTLIER] *= 0.01
    weights = [numpy_helper.from_array(a, n) for a, n in ((w1, "w1"), (b1, "b1"), (w2, "w2"), (np.zeros(8, np.float32), "b2"),
                                                          (w3, "w3"), (np.zeros(1, np.float32), "b3"),
                                                          (np.array([1, 1, 2, 2], np.float32), "scales"))]
    conv = {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1]}
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", **conv),
             helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
             helper.make_node("MaxPool", ["r1"], ["p1"], name="pool", kernel_shape=[2, 2], strides=[2, 2], ceil_mode=1),
             helper.make_node("Conv", ["p1", "w2", "b2"], ["c2"], name="conv2", **conv),
             helper.make_node("Relu", ["c2"], ["r2"], name="relu2"),
             helper.make_node("Resize", ["r2", "", "scales"], ["u2"], name="up", mode="linear"),
             helper.make_node("Concat", ["u2", "r1"], ["cat"], name="cat", axis=1),
             helper.make_node("Conv", ["cat", "w3", "b3"], ["c3"], name="conv3", **conv),
             helper.make_node("Sigmoid", ["c3"], ["1959"], name="map")]
    outputs = [helper.make_tensor_value_info("1959", TensorProto.FLOAT, [1, 1, 16, 16])]
    if add_reader:  # a reader that cannot absorb a per-channel scale
        nodes.append(helper.make_node("ReduceSum", ["r1"], ["total"], name="sum", keepdims=0))
        outputs.append(helper.make_tensor_value_info("total", TensorProto.FLOAT, None))
    graph = helper.make_graph(nodes, "outlier", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 16, 16])],
                              outputs, weights)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def _samples(count: int):
    rng = np.random.default_rng(1)
    return [SimpleNamespace(feeds={"x": rng.normal(0, 1, (1, 3, 16, 16)).astype(np.float32)}) for _ in range(count)]


def _run(model, samples):
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return [session.run(None, s.feeds)[0] for s in samples]


def test_pairs_follow_pass_through_ops_and_the_concat_offset():
    pairs = {p.producer: p for p in equalization.pairs(_model())}
    assert pairs["conv1"].consumers == [("conv2", 0), ("conv3", 8)]  # through MaxPool, and at offset 8 of the Concat
    assert pairs["conv2"].consumers == [("conv3", 0)]  # through Relu and Resize
    assert "conv3" not in pairs  # its output is the Sigmoid's
    # every tensor between a producer and its consumers is scaled too: layerwise leaves them out
    assert pairs["conv1"].rescaled == ["c1", "r1", "p1", "cat"] and pairs["conv2"].rescaled == ["c2", "r2", "u2", "cat"]


def test_a_reader_that_cannot_absorb_the_scale_leaves_the_pair_out():
    assert "conv1" not in {p.producer for p in equalization.pairs(_model(add_reader=True))}


def test_the_outlier_channel_is_scaled_and_the_float_model_is_unchanged():
    model, samples = onnx.shape_inference.infer_shapes(_model()), _samples(8)  # typed, as prepare leaves it
    found = equalization.pairs(model)
    from pipeline.precision.calibration import statistics

    maxima = statistics.channel_maxima(model, (s.feeds for s in samples), [p.tensor for p in found], axis=1)
    assert maxima["c1"][OUTLIER] == 228.0 and np.delete(maxima["c1"], OUTLIER).max() < 20
    (ready,) = [p for p in equalization.with_scales(found, maxima) if p.producer == "conv1"]
    assert np.flatnonzero(ready.scale > 1.0).tolist() == [OUTLIER]
    assert abs(maxima["c1"][OUTLIER] / ready.scale[OUTLIER] - np.delete(maxima["c1"], OUTLIER).max()) < 1e-6
    equalized = equalization.equalized(model, [ready])
    for before, after in zip(_run(model, samples), _run(equalized, samples)):
        np.testing.assert_allclose(after, before, rtol=1e-4, atol=1e-5)


def test_choose_keeps_equalization_only_where_the_int8_model_does_better():
    from pipeline.precision.calibration import tables

    def make_table(stats):
        return {name: tables.table_entry(histogram, "max") for name, histogram in stats.histograms.items()}

    samples = _samples(16)
    precision = PrecisionConfig(name=Precision.int8)
    model, summary = equalization.choose(_model(), samples, True, QdqSettings.resolve(precision, "onnxruntime"),
                                         make_table)
    scores = summary["candidates"]
    assert summary["applied"] is True and summary["alpha"] in equalization.ALPHAS
    assert scores[f"alpha {summary['alpha']:g}"]["loss"] < scores["none"]["loss"]
    assert summary["outlier_pairs"][0]["producer"] == "conv1" and summary["outlier_pairs"][0]["channels"] == [OUTLIER]
    off, why = equalization.choose(_model(), samples, False, None, make_table)
    assert why == {"applied": False, "reason": "off (precision.equalization=false)"}


def test_the_judge_recollects_only_the_scaled_tensors_and_scores_as_a_full_pass():
    """Equalization changes only the scaled activations (the consumers take the scale back in
    float): recollecting just those gives the same loss as a pass over every tensor."""
    from pipeline.precision.calibration import tables
    from pipeline.precision.calibration import statistics
    from pipeline.precision.smoothing import Judge

    def make_table(stats):
        return {name: tables.table_entry(histogram, "kl") for name, histogram in stats.histograms.items()}

    model, samples = onnx.shape_inference.infer_shapes(_model()), _samples(8)  # typed, as prepare leaves it
    found = equalization.pairs(model)
    maxima = statistics.channel_maxima(model, (s.feeds for s in samples), [p.tensor for p in found], axis=1)
    scaled = equalization.with_scales(found, maxima)
    changed = {name for pair in scaled for name in [pair.tensor, *pair.rescaled]}
    equalized = equalization.equalized(model, scaled)
    judge = Judge(model, samples, QdqSettings.resolve(PrecisionConfig(name=Precision.int8), "onnxruntime"), (),
                  make_table)
    assert changed and len(changed) < len(judge.base)
    assert judge.recollected_loss(equalized, changed) == judge.recollected_loss(equalized)
    assert judge.recollected_loss(equalized, changed) != judge.recollected_loss(equalized, set())


def test_calibration_measures_again_only_the_tensors_equalization_scaled():
    """calibrate's one pass over the prepared model serves the judge and the table: merged with
    a pass over the scaled tensors of the equalized model, every tensor's histogram, kept
    samples and ranges are what a full pass over the equalized model gives."""
    from pipeline.precision.calibration import statistics, tables

    def make_table(stats):
        return {name: tables.table_entry(histogram, "max") for name, histogram in stats.histograms.items()}

    model, samples = onnx.shape_inference.infer_shapes(_model()), _samples(16)
    settings = QdqSettings.resolve(PrecisionConfig(name=Precision.int8), "onnxruntime")
    base = statistics.collect(model, samples, len(samples), keep=4, around=settings.quantize_ops)
    equalized, summary = equalization.choose(model, samples, True, settings, make_table, base_statistics=base)
    # conv1's output and what carries its channels to the consumers: the Relu, the pool, the Concat
    assert summary["applied"] and summary["scaled_tensors"] == ["c1", "cat", "p1", "r1"], summary
    again = statistics.collect(equalized, samples, len(samples), keep=4, around=settings.quantize_ops,
                               only=set(summary["scaled_tensors"]))
    merged, full = base.merged(again), statistics.collect(equalized, samples, len(samples), keep=4,
                                                          around=settings.quantize_ops)
    assert merged.histograms.keys() == full.histograms.keys()
    for name, histogram in full.histograms.items():  # the consumers take the scale back in float: rounding apart
        ours, theirs = merged.histograms[name].to_json(), histogram.to_json()
        # an AVX2-only CPU's float kernels round the rescaled consumers otherwise (max 3.3457532 vs 3.3457537)
        for key in ("min", "max", "width"):
            assert ours[key] == pytest.approx(theirs[key], rel=1e-5), (name, key, cpu_note())
        assert (ours["count"], ours["zero_count"]) == (theirs["count"], theirs["zero_count"]), name
        moved = np.abs(np.array(ours["counts"]) - np.array(theirs["counts"])).sum()
        assert moved <= 2e-3 * theirs["count"], (name, moved, cpu_note())  # a value on a bin edge may move
        np.testing.assert_allclose(merged.kept[name], full.kept[name], rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(merged.sample_ranges[name], full.sample_ranges[name], rtol=1e-4, atol=1e-6)
    # the judge given the base scores "none" as it does collecting it itself
    _, own = equalization.choose(model, samples, True, settings, make_table)
    assert own["candidates"] == summary["candidates"]


def test_the_statistics_pass_keeps_the_channel_maxima_equalization_scales_by(tmp_path, monkeypatch):
    """calibrate's statistics pass keeps the pairs' channel maxima (saved with the statistics):
    the same as a pass of their own, so equalization runs none."""
    from pipeline.precision.calibration import statistics, tables

    def make_table(stats):
        return {name: tables.table_entry(histogram, "max") for name, histogram in stats.histograms.items()}

    model, samples = onnx.shape_inference.infer_shapes(_model()), _samples(16)
    settings = QdqSettings.resolve(PrecisionConfig(name=Precision.int8), "onnxruntime")
    tensors = [pair.tensor for pair in equalization.pairs(model)]
    base = statistics.collect(model, samples, len(samples), keep=4, around=settings.quantize_ops, batch_size=4,
                              channels=tensors)
    own = statistics.channel_maxima(model, (s.feeds for s in samples), tensors, axis=1)
    assert tensors and set(base.channel_maxima) == set(tensors)
    for name in tensors:
        np.testing.assert_array_equal(base.channel_maxima[name], own[name])
    base.save(tmp_path)
    assert statistics.Statistics.load(tmp_path).channel_maxima.keys() == own.keys()
    expected = equalization.choose(model, samples, True, settings, make_table)
    monkeypatch.setattr(statistics, "channel_maxima", lambda *args, **kwargs: pytest.fail("a pass of its own"))
    equalized, summary = equalization.choose(model, samples, True, settings, make_table, maxima=base.channel_maxima)
    assert summary["candidates"] == expected[1]["candidates"] and summary["alpha"] == expected[1]["alpha"]
