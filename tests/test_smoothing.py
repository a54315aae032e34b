"""SmoothQuant before static int8 (pipeline/precision/smoothing.py, precision.smoothing) and
the transformer placement of the Q/DQ build (MatMul outputs float where outputs are
quantized, MatMuls of two activations float, per-channel MatMul weights on their output
axis): the math on small real graphs, the alpha choice, and the CLI on the real tiny BERT
sentence embedder (pipeline/assets/tiny_bert.onnx) with real sentences."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from conftest import REPO, composed, read_report, run_cli, run_dirs
from pipeline.data import Sample
from pipeline.errors import ConfigError
from pipeline.precision import smoothing
from pipeline.precision.calibration import statistics, tables
from pipeline.precision.quantize import (MixedModels, QdqSettings, activation_matmuls, quantize_static_qdq,
                                         settings_float_ops)

CHANNELS, OUT = 8, 6
OUTLIERS = {2: 40.0, 5: 15.0}  # LayerNorm scale of the outlier channels, as in BERT's


def layer_norm_model(residual: bool, seed: int = 0) -> onnx.ModelProto:
    """x [1, T, 8] -> LayerNormalization -> h -> MatMul(W [8, 6]) -> Add(bias) -> y; with
    ``residual`` h also feeds an Add (a post-norm block's skip connection) -> r."""
    rng = np.random.default_rng(seed)
    gamma = np.ones(CHANNELS, np.float32)
    for channel, value in OUTLIERS.items():
        gamma[channel] = value
    init = [numpy_helper.from_array(gamma, "gamma"), numpy_helper.from_array(rng.normal(0, 0.1, CHANNELS).astype(np.float32), "beta"),
            numpy_helper.from_array(rng.normal(0, 0.3, (CHANNELS, OUT)).astype(np.float32), "w"),
            numpy_helper.from_array(rng.normal(0, 0.1, OUT).astype(np.float32), "b")]
    nodes = [helper.make_node("LayerNormalization", ["x", "gamma", "beta"], ["h"], name="norm", axis=-1),
             helper.make_node("MatMul", ["h", "w"], ["m"], name="dense"),
             helper.make_node("Add", ["m", "b"], ["y"], name="bias")]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "T", OUT])]
    if residual:
        nodes.append(helper.make_node("Add", ["h", "x"], ["r"], name="skip"))
        outputs.append(helper.make_tensor_value_info("r", TensorProto.FLOAT, [1, "T", CHANNELS]))
    graph = helper.make_graph(nodes, "ln_dense", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "T", CHANNELS])],
                              outputs, init)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return onnx.shape_inference.infer_shapes(model)


def samples(count: int = 16, seed: int = 1):
    rng = np.random.default_rng(seed)
    return [Sample(f"{i:03d}", {"x": rng.normal(0, 1, (1, 4 + i % 5, CHANNELS)).astype(np.float32)}) for i in range(count)]


def run(model: onnx.ModelProto, feeds, names):
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(names, feeds)


@pytest.mark.parametrize("residual", [False, True])
def test_smoothing_keeps_the_float_model_and_flattens_the_activation_channels(residual):
    model = layer_norm_model(residual)
    data = samples()
    found = smoothing.groups(model)
    assert [(g.source, g.ops, g.weights, g.after_norm) for g in found] == [("h", ["dense"], [("w", 0)], True)]
    # the skip connection also reads h: scaling h in the LayerNorm would change it, so a Mul goes in front
    assert found[0].fold == (None if residual else "norm")
    maxima = statistics.channel_maxima(model, (s.feeds for s in data), ["h"])
    assert maxima["h"].shape == (CHANNELS,) and maxima["h"][2] > 10 * np.median(maxima["h"])
    weight = numpy_helper.to_array(model.graph.initializer[2])
    for alpha in (0.5, 1.0):
        ready = smoothing.with_scales(model, found, maxima, alpha)
        expected = maxima["h"] ** alpha / np.abs(weight).max(axis=1) ** (1 - alpha)
        np.testing.assert_allclose(ready[0].scale, expected, rtol=1e-6)
        smoothed = smoothing.smoothed(model, ready)
        onnx.checker.check_model(smoothed, full_check=True)
        muls = [n for n in smoothed.graph.node if n.op_type == "Mul"]
        assert len(muls) == (1 if residual else 0)
        names = [o.name for o in model.graph.output]
        for sample in data:
            for before, after in zip(run(model, sample.feeds, names), run(smoothed, sample.feeds, names)):
                np.testing.assert_allclose(after, before, rtol=1e-5, atol=1e-5 * float(np.abs(before).max()))
        # what the MatMul now reads: channel j's maximum is (max|X_j| max|W_j|)^(1 - alpha), flat at alpha 1
        dense = next(n for n in smoothed.graph.node if n.name == "dense")
        after = statistics.channel_maxima(smoothed, (s.feeds for s in data), [dense.input[0]])[dense.input[0]]
        np.testing.assert_allclose(after, (maxima["h"] * np.abs(weight).max(axis=1)) ** (1 - alpha), rtol=1e-4)
        if alpha == 1.0:
            np.testing.assert_allclose(after, 1.0, rtol=1e-4)


def test_ops_that_cannot_take_the_scale_are_left_alone():
    model = layer_norm_model(residual=False)
    assert smoothing.groups(model, keep_float=["dense"]) == []  # kept float: nothing to quantize
    assert smoothing.groups(model, op_types=["Conv"]) == []
    shared = onnx.ModelProto()
    shared.CopyFrom(model)
    shared.graph.node.append(helper.make_node("MatMul", ["x", "w"], ["m2"], name="other"))
    assert smoothing.groups(shared) == []  # w is read twice: scaled for one reader it would change the other
    two_activations = helper.make_node("MatMul", ["h", "h_t"], ["s"], name="scores")
    assert smoothing._weight_axis(two_activations, {}) is None
    gemm = helper.make_node("Gemm", ["h", "w"], ["g"], transB=1)
    assert smoothing._weight_axis(gemm, {"w": model.graph.initializer[2]}) == 1



def _viewed_norm_model(perm) -> onnx.ModelProto:
    """x [1, 4, 8] -> LayerNormalization -> Transpose(perm) -> Reshape [-1, 8] -> Gemm(W [8, 6]) -> y,
    the way a fixed-shape transformer reads its normalized tokens after the prepare step; a
    second LayerNormalization shares the scale (an exporter shares equal constants) -> r."""
    rng = np.random.default_rng(5)
    gamma = np.ones(CHANNELS, np.float32)
    for channel, value in OUTLIERS.items():
        gamma[channel] = value
    init = [numpy_helper.from_array(gamma, "gamma"), numpy_helper.from_array(np.zeros(CHANNELS, np.float32), "beta"),
            numpy_helper.from_array(rng.normal(0, 0.1, CHANNELS).astype(np.float32), "beta2"),
            numpy_helper.from_array(rng.normal(0, 0.3, (CHANNELS, OUT)).astype(np.float32), "w"),
            numpy_helper.from_array(rng.normal(0, 0.1, OUT).astype(np.float32), "b"),
            numpy_helper.from_array(np.array([-1, CHANNELS], np.int64), "flat")]
    nodes = [helper.make_node("LayerNormalization", ["x", "gamma", "beta"], ["h"], name="norm", axis=-1),
             helper.make_node("Transpose", ["h"], ["t"], name="swap", perm=perm),
             helper.make_node("Reshape", ["t", "flat"], ["h2"], name="view"),
             helper.make_node("Gemm", ["h2", "w", "b"], ["y"], name="dense"),
             helper.make_node("LayerNormalization", ["x", "gamma", "beta2"], ["r"], name="other_norm", axis=-1)]
    graph = helper.make_graph(nodes, "viewed", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, CHANNELS])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, OUT]),
                               helper.make_tensor_value_info("r", TensorProto.FLOAT, [1, 4, CHANNELS])], init)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def test_smoothing_folds_into_a_norm_read_through_views_that_keep_the_channels_last():
    """A Gemm reading a LayerNorm's output through a transpose of the token axes and a 2-D
    reshape takes the scale in the norm (a copy of the shared scale: the other norm keeps its
    own), no Mul; the tensors on the way are named as changed. A transpose that moves the
    channel axis keeps the Mul."""
    model = _viewed_norm_model([1, 0, 2])
    found = smoothing.groups(model)
    assert [(g.source, g.ops, g.fold, g.views) for g in found] == [("h2", ["dense"], "norm", ["h", "t"])]
    feeds = {"x": np.random.default_rng(6).normal(0, 1, (1, 4, CHANNELS)).astype(np.float32)}
    ready = smoothing.with_scales(model, found, statistics.channel_maxima(model, [feeds], ["h2"]), 0.8)
    smoothed = smoothing.smoothed(model, ready)
    onnx.checker.check_model(smoothed, full_check=True)
    assert not [n for n in smoothed.graph.node if n.op_type == "Mul"]
    norms = {n.name: list(n.input) for n in smoothed.graph.node if n.op_type == "LayerNormalization"}
    assert norms["other_norm"] == ["x", "gamma", "beta2"] and norms["norm"][1:] == ["gamma_smoothed", "beta"]
    np.testing.assert_array_equal(numpy_helper.to_array(next(t for t in smoothed.graph.initializer if t.name == "gamma")),
                                  numpy_helper.to_array(model.graph.initializer[0]))
    for before, after in zip(run(model, feeds, ["y", "r"]), run(smoothed, feeds, ["y", "r"])):
        np.testing.assert_allclose(after, before, rtol=1e-5, atol=1e-5 * float(np.abs(before).max()))
    assert smoothing.changed_tensors(smoothed, ready) == ["h2", "h", "t"]
    moved = smoothing.groups(_viewed_norm_model([0, 2, 1]))
    assert [(g.fold, g.views) for g in moved] == [(None, [])]

def test_the_setting_is_null_auto_or_an_alpha():
    assert [smoothing.parse(v) for v in (None, "null", "off", "auto", "0.5", 0.75, "1")] == \
        [None, None, None, "auto", 0.5, 0.75, 1.0]
    for bad in ("2", "-0.1", "yes"):
        with pytest.raises(ValueError, match="precision.smoothing"):
            smoothing.parse(bad)
    from pipeline.config.validation import validate

    with pytest.raises(ConfigError, match=r"precision\.smoothing"):
        validate(composed(f"model.path={REPO / 'pipeline' / 'assets' / 'tiny_bert.onnx'}", "data.path=x",
                          "metric=none", "precision=int8", "precision.smoothing=1.5"))


def _max_table(stats):
    return {name: tables.table_entry(h, "max") for name, h in stats.histograms.items()}


@pytest.mark.parametrize("residual", [True, False])
def test_the_judge_derives_a_smoothed_table_from_one_statistics_pass(residual):
    """The smoothed activation's range is the per-channel range divided by s (a Mul in front
    of the dense op, or folded into the norm): the same entry recollecting it gives."""
    model, data = layer_norm_model(residual=residual), samples()
    settings = QdqSettings(reduce_range=True)
    found = smoothing.groups(model, settings.quantize_ops)
    maxima = statistics.channel_maxima(model, (s.feeds for s in data), [g.source for g in found])
    ready = smoothing.with_scales(model, found, maxima, 0.7)
    judge = smoothing.Judge(model, data, settings, (), _max_table, [g.source for g in ready])
    assert judge.ranges is not None
    candidate = smoothing.smoothed(model, ready)
    derived = judge.table(candidate, ready)
    collected = _max_table(statistics.collect(candidate, data, len(data), keep=0, around=settings.quantize_ops))
    assert set(derived) >= set(collected)
    smoothed_name = next(n for n in candidate.graph.node if n.name == "dense").input[0]
    assert (smoothed_name != ready[0].source) == residual  # a Mul when the norm output has other readers
    for name, entry in collected.items():
        for key in ("threshold", "min", "max"):
            assert derived[name][key] == pytest.approx(entry[key], rel=1e-5, abs=1e-7), (name, key)
    assert derived[smoothed_name] != judge.base.get(smoothed_name)  # the smoothing did change that range


@pytest.mark.parametrize("residual", [False, True])
def test_only_the_smoothed_tensors_are_measured_again(residual):
    """Calibration measures again only what smoothing names as changed (the folded norm's
    output, or the inserted Mul's): merged into the prepared model's statistics they give
    every tensor a full pass over the smoothed model gives, in its order."""
    model, data = layer_norm_model(residual=residual), samples()
    settings = QdqSettings(reduce_range=True)
    around = settings.quantize_ops
    smoothed_model, summary = smoothing.choose(model, data, 0.7, settings, (), _max_table)
    changed = summary["smoothed_tensors"]
    assert changed == [next(n for n in smoothed_model.graph.node if n.name == "dense").input[0]]
    base = statistics.collect(model, data, len(data), around=around)
    again = statistics.collect(smoothed_model, data, len(data), around=around, only=set(changed))
    assert list(again.histograms) == changed
    merged = base.merged(again, statistics.activation_names(smoothed_model, around))
    full = statistics.collect(smoothed_model, data, len(data), around=around)
    assert list(merged.histograms) == list(full.histograms)
    for name, histogram in full.histograms.items():
        assert merged.histograms[name].abs_max == pytest.approx(histogram.abs_max, rel=1e-5), name
        assert merged.histograms[name].count == histogram.count, name
    assert (changed[0] in base.histograms) == (not residual)  # folded: the norm's own output changed
    if not residual:
        assert merged.histograms["h"].abs_max != pytest.approx(base.histograms["h"].abs_max, rel=1e-3)


def test_judges_of_one_calibration_share_the_prepared_models_outputs_and_statistics(monkeypatch):
    """Equalization's judge, then smoothing's on the same prepared model and samples: the fp32
    outputs and statistics are computed once; other samples compute their own."""
    model, data = layer_norm_model(residual=True), samples()
    settings = QdqSettings(reduce_range=True)
    calls = []
    for method in ("_statistics", "_run_float"):
        original = getattr(smoothing.Judge, method)
        monkeypatch.setattr(smoothing.Judge, method,
                            lambda self, *args, _original=original, _name=method, **kw: calls.append(_name)
                            or _original(self, *args, **kw))
    shared = {}
    first = smoothing.Judge(model, data, settings, (), _max_table, shared=shared)
    assert sorted(calls) == ["_run_float", "_statistics"]
    second = smoothing.Judge(model, data, settings, (), _max_table, shared=shared)
    assert len(calls) == 2 and second.base == first.base and second.loss(model) == first.loss(model)
    smoothing.Judge(model, data[:8], settings, (), _max_table, shared=shared)  # other samples
    assert len(calls) == 4


def test_the_statistics_pass_gives_smoothing_its_channel_maxima_on_the_last_axis(monkeypatch):
    """calibrate's statistics pass keeps the smoothed activations' channel maxima (last axis)
    beside equalization's (axis 1): smoothing takes them instead of a pass of its own, and
    chooses the same."""
    model, data = layer_norm_model(residual=True), samples()
    settings = QdqSettings(reduce_range=True)
    kept = statistics.collect(model, data, len(data), around=settings.quantize_ops, channels={"h": -1}).channel_maxima
    alone = statistics.channel_maxima(model, (s.feeds for s in data), ["h"])
    assert kept["h"].shape == (CHANNELS,) and np.allclose(kept["h"], alone["h"])
    expected = smoothing.choose(model, data, "auto", settings, (), _max_table)[1]
    monkeypatch.setattr(statistics, "channel_maxima", lambda *a, **k: pytest.fail("a pass of its own"))
    chosen = smoothing.choose(model, data, "auto", settings, (), _max_table, maxima=kept)[1]
    assert chosen["alpha"] == expected["alpha"] and chosen["candidates"] == expected["candidates"]
    rng = np.random.default_rng(3)
    even = [Sample(f"{i:03d}", {"x": rng.normal(0, 1, (1, 6, CHANNELS)).astype(np.float32)}) for i in range(8)]
    wrong_axis = statistics.collect(model, even, len(even), around=settings.quantize_ops, channels={"h": 1})
    with pytest.raises(pytest.fail.Exception):  # per position, not per channel: not taken
        smoothing.choose(model, even, "auto", settings, (), _max_table, maxima=wrong_axis.channel_maxima)


def test_auto_measures_alphas_and_keeps_the_best_or_none(monkeypatch):
    """The grid, then the best one's neighbours; no smoothing wins ties; a fixed alpha is
    applied without a search."""
    model, data = layer_norm_model(residual=True), samples()
    settings = QdqSettings(reduce_range=True)
    chosen, summary = smoothing.choose(model, data, "auto", settings, (), _max_table)
    assert summary["applied"] and 0 < summary["alpha"] <= 1
    scores = summary["candidates"]
    assert set(scores) >= {"none", "0.4", "0.6", "0.8"}
    assert scores[str(summary["alpha"])]["loss"] == min(s["loss"] for s in scores.values()) < scores["none"]["loss"]
    assert summary["judged_on"] == len(data) and summary["groups"][0]["ops"] == ["dense"]
    assert any(n.op_type == "Mul" for n in chosen.graph.node)

    monkeypatch.setattr(smoothing.Judge, "loss", lambda self, *candidate: {"loss": 0.5})
    same, tie = smoothing.choose(model, data, "auto", settings, (), _max_table)
    assert not tie["applied"] and tie["alpha"] is None and same is model

    fixed, summary = smoothing.choose(model, data, 0.5, settings, (), _max_table)
    assert summary["applied"] and summary["alpha"] == 0.5 and "candidates" not in summary
    off, summary = smoothing.choose(model, data, None, settings, (), _max_table)
    assert off is model and summary == {"setting": None, "applied": False, "reason": "off"}


def test_the_search_steps_from_the_best_of_the_grid_while_the_loss_falls():
    measured = []

    def loss(alpha):
        measured.append(alpha)
        return {"loss": 0.1 if alpha is None else round((alpha - 0.93) ** 2, 6)}

    best, scores = smoothing.search(loss, (0.4, 0.6, 0.8))
    assert best == 0.9 and measured == [None, 0.4, 0.6, 0.8, 0.7, 0.9, 1.0]  # 0.7 and 1.0 are worse: stop
    assert list(scores) == ["none", "0.4", "0.6", "0.8", "0.7", "0.9", "1.0"]
    best, _ = smoothing.search(lambda alpha: {"loss": 0.0 if alpha is None else 0.01 * alpha}, (0.4, 0.6, 0.8))
    assert best is None  # smoothing never paid
    best, scores = smoothing.search(lambda alpha: {"loss": 0.5 if alpha is None else alpha}, (0.4, 0.6, 0.8))
    assert best == 0.1 and "0.0" not in scores  # down to the lowest step in (0, 1]


def test_auto_searches_only_models_with_a_normalization_before_a_matmul():
    model = layer_norm_model(residual=False)
    plain = onnx.ModelProto()
    plain.CopyFrom(model)
    plain.graph.node[0].op_type = "Relu"  # the MatMul now reads a Relu: no transformer here
    del plain.graph.node[0].input[1:]
    del plain.graph.node[0].attribute[:]
    found = smoothing.groups(plain)
    assert found and not found[0].after_norm
    assert not smoothing.applies(found, "auto") and smoothing.applies(found, 0.5)
    chosen, summary = smoothing.choose(plain, samples(), "auto", QdqSettings(), (), _max_table)
    assert chosen is plain and summary["reason"] == "auto: no MatMul/Gemm reads a normalization's output"


def attention_model() -> onnx.ModelProto:
    """x [1, T, 8] -> q, k, v = x Wq, x Wk, x Wv; scores = q k^T; out = Softmax(scores) v ->
    MatMul(Wo) -> y: two MatMuls of two activations, four with constant weights."""
    rng = np.random.default_rng(3)
    init = [numpy_helper.from_array(rng.normal(0, 0.3, (CHANNELS, CHANNELS)).astype(np.float32), n)
            for n in ("wq", "wk", "wv", "wo")]
    nodes = [helper.make_node("MatMul", ["x", "wq"], ["q"], name="q"), helper.make_node("MatMul", ["x", "wk"], ["k"], name="k"),
             helper.make_node("MatMul", ["x", "wv"], ["v"], name="v"),
             helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 2, 1], name="kt"),
             helper.make_node("MatMul", ["q", "kt"], ["s"], name="scores"),
             helper.make_node("Softmax", ["s"], ["p"], axis=-1, name="softmax"),
             helper.make_node("MatMul", ["p", "v"], ["c"], name="context"),
             helper.make_node("MatMul", ["c", "wo"], ["y"], name="out")]
    graph = helper.make_graph(nodes, "attention", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "T", CHANNELS])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "T", CHANNELS])], init)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return onnx.shape_inference.infer_shapes(model)


def _table(model):
    data = samples(8)
    stats = statistics.collect(model, data, len(data), keep=0)
    return {name: tables.table_entry(h, "max") for name, h in stats.histograms.items()}


def test_transformer_placement_matmul_weights_per_output_channel_outputs_and_scores_float():
    model = attention_model()
    table = _table(model)
    assert activation_matmuls(model) == ["scores", "context"]
    ort_like = QdqSettings(reduce_range=True, float_output_ops=("MatMul",), activation_matmuls=False)
    assert settings_float_ops(model, ort_like) == ["scores", "context"]
    built = MixedModels(model, table, ort_like).build()
    producer = {o: n for n in built.graph.node for o in n.output}
    def dequantized(name):  # read through a DequantizeLinear of the build's own (not a requantized output)
        made = producer.get(name)
        return made is not None and made.op_type == "DequantizeLinear" and not made.name.endswith("_requant_DequantizeLinear")

    reads_dq = {n.name for n in built.graph.node if n.op_type == "MatMul" and any(dequantized(i) for i in n.input)}
    assert reads_dq == {"q", "k", "v", "out"}  # the attention MatMuls stay float
    quantized_outputs = {producer[n.input[0]].name: n.name for n in built.graph.node
                         if n.op_type == "QuantizeLinear" and n.input[0] in producer}
    # MatMul outputs float (MatMulIntegerToFloat) where a bias Add follows; without one ORT
    # would run the MatMul in float, so its output Q/DQ is put back (requantize_unfused_matmuls)
    assert all(quantized_outputs[name].endswith("_requant_QuantizeLinear")
               for name in {"q", "k", "v", "out"} & set(quantized_outputs))
    initializers = {t.name: t for t in built.graph.initializer}
    for node in built.graph.node:
        if node.op_type == "DequantizeLinear" and initializers.get(node.input[0]) is not None \
                and initializers[node.input[0]].data_type == TensorProto.INT8:
            # a MatMul weight [in, out] is per output channel: axis 1, one scale per column
            assert {a.name: a.i for a in node.attribute}.get("axis") == 1
            assert list(initializers[node.input[1]].dims) == [CHANNELS]
    everything = quantize_static_qdq(model, table, QdqSettings(reduce_range=True))
    producer = {o: n for n in everything.graph.node for o in n.output}
    assert {n.name for n in everything.graph.node if n.op_type == "MatMul"
            and any(producer.get(i) is not None and producer[i].op_type == "DequantizeLinear" for i in n.input)} \
        == {"q", "k", "v", "scores", "context", "out"}


def test_the_resolved_settings_follow_the_config():
    bert = [f"model.path={REPO / 'pipeline' / 'assets' / 'tiny_bert.onnx'}", "data.path=x", "metric=none", "precision=int8"]
    from pipeline.config.validation import validate

    ort_settings = QdqSettings.resolve(validate(composed(*bert)).precision, "onnxruntime")
    assert ort_settings.float_output_ops == ("MatMul",) and not ort_settings.activation_matmuls
    assert ort_settings.quantizes_output("Conv") and not ort_settings.quantizes_output("MatMul")
    every = QdqSettings.resolve(validate(composed(*bert, "precision.quantize_outputs=true",
                                                  "precision.quantize_activation_matmuls=true")).precision, "onnxruntime")
    assert every.float_output_ops == () and every.quantizes_output("MatMul") and every.activation_matmuls
    assert not QdqSettings.resolve(validate(composed(*bert)).precision, "openvino").quantizes_output("Conv")


def test_cli_smooths_the_tiny_bert_and_records_it(tiny_bert_tensors, tmp_path):
    done = run_cli([f"model.path={REPO / 'pipeline' / 'assets' / 'tiny_bert.onnx'}", f"data.path={tiny_bert_tensors}",
                    "metric=none", "target=ort_cpu", "precision=int8",
                    "pipeline.stages=[convert,calibrate,build,verify]"], tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run_dir = run_dirs(tmp_path)[-1]
    report = read_report(run_dir)
    recorded = report["calibration"]["smoothing"]
    assert recorded["setting"] == "auto" and recorded["judged_on"] == 12 and "none" in recorded["candidates"]
    prepared = onnx.load(str(run_dir / "stages" / "calibrate" / "prepared.onnx"))
    muls = [n.name for n in prepared.graph.node if n.name.endswith("/smoothing")]
    if recorded["applied"]:  # post-norm BERT: every LayerNorm output also feeds a residual Add
        assert len(muls) == len(recorded["groups"]) > 0
    else:
        assert not muls
    quantization = report["build"]["quantization"]
    attention = [name for name in quantization["float_ops"] if name.endswith(("self/MatMul", "self/MatMul_1"))]
    assert len(attention) == 4 and quantization["float_outputs"] == ["MatMul"]
    assert report["verify"]["verdict"] == "pass" and "int8 ran partly" not in done.stdout
