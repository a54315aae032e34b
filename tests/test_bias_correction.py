"""Bias correction (pipeline/precision/calibration/bias_correction.py): on by default in int8 builds,
recorded in the build summary, switched off by precision.bias_correction=false, and it
reduces the per-channel mean error of the quantized ops on real models."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper

from conftest import model_copy, run_cli, run_dirs, run_with_outputs
from pipeline.precision.calibration import bias_correction
from pipeline.precision.passthrough import fold_relus
from pipeline.precision.quantize import QdqSettings, build_qdq

STAGES = "pipeline.stages=[convert,calibrate,build]"


@pytest.fixture(scope="module")
def digits_builds(tmp_path_factory):
    """The embedded digits job built int8 with and without bias correction (one cache; weight
    rounding off in both)."""
    cwd = tmp_path_factory.mktemp("bias")
    runs = {}
    for switch in ("true", "false"):
        result = run_cli(["precision=int8", STAGES, f"precision.bias_correction={switch}",
                          "precision.weight_rounding=false"], cwd)  # the biases alone differ
        assert result.returncode == 0, result.stdout + result.stderr
        runs[switch] = run_dirs(cwd)[-1]
    return runs


def _build_summary(run) -> dict:
    return json.loads((run / "stages" / "build" / "result.json").read_text())["summary"]["quantization"]


def _biases(model: onnx.ModelProto) -> dict:
    """op name -> the int32 bias values it reads through its DequantizeLinear."""
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    producer = {out: node for node in model.graph.node for out in node.output}
    found = {}
    for node in model.graph.node:
        if node.op_type in ("Conv", "Gemm") and len(node.input) > 2 and node.input[2] in producer:
            found[node.name] = inits[producer[node.input[2]].input[0]]
    return found


def test_int8_build_corrects_biases_by_default_and_records_them(digits_builds):
    summary = _build_summary(digits_builds["true"])["bias_correction"]
    assert summary["enabled"] is True and summary["applied"] is True and summary["samples"] >= 8
    assert summary["output_cosine"]["with"] > summary["output_cosine"]["without"]
    assert set(summary["corrected"]) == {"conv1", "conv2", "conv3", "fc1", "fc2"}, summary
    assert all(shift > 0 for shift in summary["corrected"].values())
    corrected = _biases(onnx.load(str(digits_builds["true"] / "stages" / "build" / "model.onnx")))
    plain = _biases(onnx.load(str(digits_builds["false"] / "stages" / "build" / "model.onnx")))
    assert corrected.keys() == plain.keys() == {"conv1", "conv2", "conv3", "fc1", "fc2"}
    assert all(not np.array_equal(corrected[op], plain[op]) for op in corrected)


def test_switched_off_gives_the_uncorrected_build(digits_builds):
    run = digits_builds["false"]
    assert _build_summary(run)["bias_correction"] == {"enabled": False}
    calibrate = run / "stages" / "calibrate"
    table = json.loads((calibrate / "calibration.json").read_text())["tensors"]
    summary = _build_summary(run)
    settings = QdqSettings(reduce_range=summary["reduce_range"], passthrough_ops=tuple(summary["passthrough_ops"]))
    rebuilt = run / "rebuilt.onnx"
    build_qdq(calibrate / "prepared.onnx", table, rebuilt, settings)
    expected = onnx.load(str(rebuilt))
    assert fold_relus(expected) == summary["relus_folded"]  # the build's last step (pass-through Relus)
    built = onnx.load(str(run / "stages" / "build" / "model.onnx"))
    same = hashlib.sha256(built.graph.SerializeToString()).digest() == \
        hashlib.sha256(expected.graph.SerializeToString()).digest()
    assert same, "the build without bias correction differs from the plain QDQ build"


@pytest.fixture(scope="module")
def classifier(classifier_qdq):
    return classifier_qdq


def _isolated_errors(prepared, quantized, samples, ops) -> dict:
    """Per op: |per-channel mean of (fp32 op output - quantized op output)| with both fed the
    fp32 model's input activation, the quantized op cut out of ``quantized`` with its Q/DQ
    nodes and bias (onnx.utils.Extractor), independent of the module's own measuring."""
    sources = {op.node.name: op.source for op in ops}
    wanted = list(dict.fromkeys([*sources.values(), *(op.node.output[0] for op in ops)]))
    reference = run_with_outputs(prepared, wanted, samples)
    errors = {}
    for op in ops:
        cut = onnx.utils.Extractor(quantized).extract_model([op.source], [op.node.output[0]])
        session = ort.InferenceSession(cut.SerializeToString(), providers=["CPUExecutionProvider"])
        built = [session.run(None, {op.source: values[op.source]})[0] for values in reference]
        difference = np.stack([values[op.node.output[0]] - out for values, out in zip(reference, built)])
        errors[op.node.name] = np.abs(difference.mean(axis=(0, 1, 3, 4)))
    return errors


def test_shifts_remove_each_ops_channel_mean_error(classifier):
    prepared, quantized, samples = classifier
    corrected = model_copy(quantized)
    ops, skipped = bias_correction.quantized_ops(corrected, prepared)
    assert not skipped and {op.node.name for op in ops} == \
        {n.name for n in prepared.graph.node if n.op_type in ("Conv", "Gemm")}
    bias_correction.measure(ops, corrected, prepared, [samples[i:i + 4] for i in range(0, len(samples), 4)])
    for op in ops:
        assert bias_correction.apply_shift(corrected, op.node, op.shift) is None
    convs = [op for op in ops if op.node.op_type == "Conv"]
    before = _isolated_errors(prepared, quantized, samples, convs)
    after = _isolated_errors(prepared, corrected, samples, convs)
    for op in convs:  # what is left is the int32 bias's rounding
        assert after[op.node.name].mean() < 0.2 * before[op.node.name].mean() + 1e-6, op.node.name


def test_correction_is_kept_only_when_the_output_gets_closer_to_fp32(classifier):
    prepared, quantized, samples = classifier
    model = model_copy(quantized)
    summary = bias_correction.correct(model, prepared, samples)
    cosine = summary["output_cosine"]
    weighted = {n.name for n in prepared.graph.node if n.op_type in ("Conv", "Gemm")}
    assert summary["samples"] == 16 and set(summary["measured"]) == weighted
    assert summary["applied"] == (cosine["with"] >= cosine["without"])
    unchanged = model.SerializeToString() == quantized.SerializeToString()
    assert unchanged != summary["applied"]
    assert summary["corrected"] == (summary["measured"] if summary["applied"] else {})


def test_a_mixed_build_is_the_refined_all_int8_model_the_search_measured(tmp_path):
    """A mixed build keeping ops float is the int8 build's refined all-int8 model with those
    ops back in float: its refinements are inherited, not measured again on the mixed model
    (100 s on the real-size segmenter), and verify finds the very cosine the search chose the
    float ops at (both on ONNX Runtime, the same validation samples)."""
    result = run_cli(["precision=mixed", "sensitivity.expected_cos=0.999997", "data.validation_size=30",
                      "sensitivity.samples=30", "sensitivity.heads_first=false"], tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    run = run_dirs(tmp_path)[-1]
    search = json.loads((run / "stages" / "sensitivity" / "result.json").read_text())["summary"]
    assert search["float_ops"] and search["refined"] == {"weight_rounding": True, "bias_correction": True}
    built = _build_summary(run)
    assert all(built[step]["inherited"] for step in ("weight_rounding", "bias_correction")), built
    assert built["bias_correction"]["judged_on"] == "calibration"
    (output,) = json.loads((run / "report.json").read_text())["verify"]["outputs"]
    assert output["metrics"]["cosine"] == pytest.approx(search["mixed"]["cosine"], abs=1e-9)


def test_a_large_models_refinements_measure_fewer_samples_sized_to_its_activations(classifier, monkeypatch):
    from pipeline.precision.calibration import weight_rounding

    prepared, quantized, samples = classifier
    ops, _ = bias_correction.quantized_ops(model_copy(quantized), prepared)
    sources = {op.source for op in ops}
    per_sample = sum(int(v.size) for v in run_with_outputs(prepared, sorted(sources), samples[:1])[0].values())
    # as if each sample's activations were a fifth of what the refinements may read: 5 samples,
    # then the floor of MIN_SAMPLES
    monkeypatch.setattr(bias_correction, "REFINE_VALUES", 5 * per_sample)
    monkeypatch.setattr(bias_correction, "MIN_SAMPLES", 2)
    assert bias_correction.correct(model_copy(quantized), prepared, samples)["samples"] == 8  # batches of 4
    assert weight_rounding.round_weights(model_copy(quantized), prepared, samples)["samples"] == 8
    monkeypatch.setattr(bias_correction, "MIN_SAMPLES", 12)
    assert bias_correction.correct(model_copy(quantized), prepared, samples)["samples"] == 12
    monkeypatch.setattr(bias_correction, "REFINE_VALUES", 1 << 40)  # a small model: every sample, up to the cap
    assert bias_correction.correct(model_copy(quantized), prepared, samples)["samples"] == len(samples) == 16


def test_a_model_already_judged_on_the_same_samples_is_not_run_again(classifier, monkeypatch):
    prepared, quantized, samples = classifier
    batches = [samples[i:i + 4] for i in range(0, 8, 4)]
    reference = bias_correction.reference_outputs(prepared, batches)
    other = bias_correction.reference_outputs(prepared, batches[:1])
    monkeypatch.setattr(bias_correction, "_COSINES", {})
    runs = []
    real = bias_correction.model_outputs
    monkeypatch.setattr(bias_correction, "model_outputs", lambda *args: runs.append(1) or real(*args))
    first = bias_correction.output_cosine(quantized, batches, reference)
    assert bias_correction.output_cosine(model_copy(quantized), batches, reference) == first and len(runs) == 1
    bias_correction.output_cosine(quantized, batches[:1], other)  # other samples: measured
    assert len(runs) == 2


def test_bias_correction_reads_weight_roundings_fp32_pass(classifier):
    """Weight rounding's fp32 pass keeps every op's patch means, the fp32 outputs and the
    batches (bias_correction.Fp32Pass): bias correction of the rounded model reads them and
    runs no pass of its own (it is given no samples at all here), finding the shifts and
    cosines it finds on its own."""
    from pipeline.precision.calibration import weight_rounding

    prepared, quantized, samples = classifier
    fp32_pass = bias_correction.Fp32Pass()
    rounded = model_copy(quantized)
    weight_rounding.round_weights(rounded, prepared, samples, fp32_pass=fp32_pass)
    assert fp32_pass.means is not None and fp32_pass.batches and fp32_pass.reference
    on_its_own = bias_correction.correct(model_copy(rounded), prepared, samples)
    from_pass = bias_correction.correct(model_copy(rounded), prepared, iter(()), fp32_pass=fp32_pass)
    assert from_pass["samples"] == on_its_own["samples"] and from_pass["applied"] == on_its_own["applied"]
    assert from_pass["measured"].keys() == on_its_own["measured"].keys() and from_pass["measured"]
    for name, shift in on_its_own["measured"].items():
        assert from_pass["measured"][name] == pytest.approx(shift, rel=1e-3, abs=1e-6), name
    for key, cosine in on_its_own["output_cosine"].items():
        assert from_pass["output_cosine"][key] == pytest.approx(cosine, abs=1e-6), key
