"""int8 with activations quantized per call at run time (precision.activation_ranges=dynamic,
pipeline/precision/dynamic.py) on ONNX Runtime: built without calibration, verified as int8
by the ops that ran, tried by precision=auto next to static int8, refused elsewhere. On the
real tiny BERT sentence embedder (pipeline/assets/tiny_bert.onnx) and real sentences."""

from __future__ import annotations

import time
from collections import Counter

import numpy as np
import onnx
import pytest
import yaml

from conftest import REPO, composed, cpu_note, read_report, run_cli, run_dirs, single_bundle
from pipeline.errors import ConfigError
from pipeline.precision import dynamic
from pipeline.precision.quantize import needs_reduce_range

MODEL = REPO / "pipeline" / "assets" / "tiny_bert.onnx"
DIGITS = REPO / "pipeline" / "assets" / "digits_cnn.onnx"
BERT = [f"model.path={MODEL}", "metric=none"]


@pytest.fixture(scope="module")
def dynamic_run(tiny_bert_tensors, tmp_path_factory):
    cwd = tmp_path_factory.mktemp("dynamic")
    done = run_cli([*BERT, f"data.path={tiny_bert_tensors}", "target=ort_cpu", "precision=int8_dynamic",
                    "pipeline.stages=[convert,calibrate,sensitivity,build,tune,verify,package]"], cwd)
    return done, run_dirs(cwd)[-1]


def test_the_name_the_candidate_table_shows_is_a_precision_meaning_the_same_build():
    """precision=auto's table and bundles say int8_dynamic: typed back, it is precision=int8
    with activation_ranges=dynamic, and a typo's error lists it."""
    from omegaconf import OmegaConf

    typed = OmegaConf.to_container(composed("precision=int8_dynamic").precision)
    spelled = OmegaConf.to_container(composed("precision=int8", "precision.activation_ranges=dynamic").precision)
    assert typed == spelled and str(typed["name"]) in ("int8", "Precision.int8")


def test_a_typo_lists_int8_dynamic(tmp_path):
    result = run_cli(["precision=int8_dynamc"], tmp_path)
    assert result.returncode == 2 and "allowed: auto, bf16, fp16, fp32, int8, int8_dynamic, mixed" in result.stderr


def test_a_dynamic_build_runs_int8_without_calibration(dynamic_run):
    done, run_dir = dynamic_run
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = read_report(run_dir)
    build = report["build"]
    assert build["activation_ranges"] == "dynamic"
    quantization = build["quantization"]
    # 6 weighted MatMuls a layer; attention's two activation x activation MatMuls stay float
    assert quantization["int8_ops"] == 12 and len(quantization["quantized"]) == 12
    assert set(quantization["not_quantized"].values()) == {
        "MatMul of two activations: the dynamic quantizer quantizes a constant B only"}
    assert quantization["bias_correction"]["enabled"] is False and quantization["weight_rounding"]["enabled"] is False
    assert "float_ops" not in quantization  # none kept float by request: verify's intended-float list stays empty
    # 7-bit weights chosen by the automatic rule (x86 without VNNI) are measured against 8 bits
    assert ("weight_widths" in quantization) is needs_reduce_range("onnxruntime"), cpu_note()
    # the build was not calibrated: the stage says why and wrote no table
    assert "activation_ranges=dynamic" in report["calibration"]["skipped"]
    assert not (run_dir / "stages" / "calibrate" / "calibration.json").exists()
    # verify saw int8 run: the integer ops of the executed graph, the float ones the build's own
    effective = report["verify"]["effective"]
    assert effective["activation_ranges"] == "dynamic" and effective["dynamic_quantizers"] > 0
    assert "int8: 12" in effective["layers"] and effective["float_ops"] == {}
    assert not [c for c in report["verify"]["checks"] if c["check"] in ("precision", "float_fallback", "nothing_int8")]
    assert report["verdict"] == "pass"
    # the shipped model: activations quantized per call, weights int8
    bundle = single_bundle(run_dir)
    assert bundle.name.endswith("-ort_cpu-int8_dynamic")  # named apart from a static int8 bundle
    ops = Counter(node.op_type for node in onnx.load(str(bundle / "model.onnx")).graph.node)
    assert ops["DynamicQuantizeLinear"] > 0 and ops["MatMulInteger"] == 12 and not ops["QuantizeLinear"]
    assert yaml.safe_load((bundle / "runtime.yaml").read_text())["activation_ranges"] == "dynamic"


def test_other_targets_refuse_dynamic_ranges_in_one_line(tiny_bert_tensors, tmp_path):
    done = run_cli([*BERT, f"data.path={tiny_bert_tensors}", "target=openvino_cpu", "precision=int8",
                    "precision.activation_ranges=dynamic"], tmp_path)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "precision.activation_ranges=dynamic is not supported by target openvino_cpu" in lines[0]
    assert "Traceback" not in done.stdout + done.stderr


@pytest.mark.parametrize("overrides, phrase", [
    (["precision=mixed"], "precision=mixed searches on static ranges"),
    (["precision=int8", "precision.activations=int8"], "precision.activations=int8"),
    (["precision=int8", "precision.int8_where_faster=true"], "precision.int8_where_faster"),
    (["precision=int8", "calibration.table=table.txt"], "calibration.table"),
    (["precision=int8", "target=mnn_cpu"], "not supported by target mnn_cpu"),
])
def test_what_a_dynamic_build_cannot_take_is_a_config_error(overrides, phrase):
    from pipeline.config.validation import validate

    with pytest.raises(ConfigError, match=phrase.replace(".", r"\.")):
        validate(composed(*BERT, "data.path=x", "precision.activation_ranges=dynamic", *overrides))


def test_float_precisions_ignore_the_key_as_the_other_int8_keys():
    from pipeline.config.validation import validate

    run = validate(composed(*BERT, "data.path=x", "precision=fp32", "precision.activation_ranges=dynamic"))
    assert not run.precision.dynamic_ranges


def test_auto_tries_dynamic_int8_where_the_backend_declares_it():
    from pipeline.app import auto
    from pipeline.config.validation import validate

    ort = validate(composed(*BERT, "data.path=x", "precision=auto"))
    assert auto.candidates(ort) == ["fp32", "int8", "int8_dynamic", "mixed"]
    chosen = auto.candidate_config(composed(*BERT, "data.path=x", "precision=auto"), "int8_dynamic")
    assert validate(chosen).precision.dynamic_ranges and chosen.precision.name == "int8"
    assert "int8_dynamic" not in auto.candidates(validate(composed(*BERT, "data.path=x", "target=openvino_cpu")))
    with pytest.raises(ConfigError, match="cannot build 'int8_dynamic'"):
        auto.candidates(validate(composed(*BERT, "data.path=x", "target=openvino_cpu",
                                          "precision.candidates=[fp32,int8_dynamic]")))
    with pytest.raises(ConfigError, match="tries static and dynamic int8 itself"):
        auto.candidates(validate(composed(*BERT, "data.path=x", "precision.activation_ranges=dynamic")))


def test_auto_tries_dynamic_int8_last_on_a_convolutional_network():
    """ConvInteger runs 0.15-0.37x fp32: on a network of convolutions int8_dynamic comes after
    mixed, where the budget may cut it; on the MatMul network it stays right after int8."""
    from pipeline.app.candidate_order import ordered

    wanted = ["int8", "int8_dynamic", "mixed"]
    assert ordered(wanted, composed(*BERT, "data.path=x", "precision=auto")) == ["fp32", *wanted]
    segmenter = REPO / "pipeline" / "assets" / "segmenter.onnx"
    convolutional = composed(f"model.path={segmenter}", "metric=none", "data.path=x", "precision=auto")
    assert ordered(wanted, convolutional) == ["fp32", "int8", "mixed", "int8_dynamic"]
    assert ordered(["mixed", "int8_dynamic", "int8"], convolutional) == ["fp32", "int8", "mixed", "int8_dynamic"]
    unreadable = composed("model.path=/nonexistent.onnx", "metric=none", "data.path=x", "precision=auto")
    assert ordered(wanted, unreadable) == ["fp32", *wanted]  # convert says what is wrong with it


def test_auto_lists_static_and_dynamic_int8(tiny_bert_tensors, tmp_path):
    done = run_cli([*BERT, f"data.path={tiny_bert_tensors}", "precision=auto",
                    "precision.candidates=[fp32,int8,int8_dynamic]"], tmp_path, default_precision=None)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run_dir = run_dirs(tmp_path)[-1]
    section = read_report(run_dir)["auto"]
    rows = {row["precision"]: row for row in section["candidates"]}
    assert list(rows) == ["fp32", "int8", "int8_dynamic"]
    assert rows["int8_dynamic"]["verdict"] == "pass" and rows["int8_dynamic"]["cosine"] > 0.99
    assert "int8_dynamic" in done.stdout  # the candidate table
    candidate = run_dir / "candidates" / "int8_dynamic"
    assert yaml.safe_load((candidate / "stages" / "build" / "runtime.yaml").read_text())["activation_ranges"] == "dynamic"
    assert not (candidate / "stages" / "calibrate" / "calibration.json").exists()
    assert (run_dir / "candidates" / "int8" / "stages" / "calibrate" / "calibration.json").exists()


def test_conv_weights_are_per_channel_and_close_to_fp32(tmp_path):
    """quantize_dynamic gives ConvInteger per-tensor weights; parity re-quantizes them per
    output channel (the scale Mul after ConvInteger becomes a vector)."""
    import onnxruntime as ort

    out = tmp_path / "digits_dynamic.onnx"
    summary = dynamic.build(DIGITS, out, dynamic.DynamicSettings(per_channel=True, reduce_range=True))
    assert summary["conv_per_channel"] == ["conv1", "conv2", "conv3"] and summary["int8_ops"] == 5
    model = onnx.load(str(out))
    scales = {init.name: list(init.dims) for init in model.graph.initializer if init.name.endswith("_scale")}
    assert any(dims[1:] == [1, 1] and dims[0] > 1 for dims in scales.values())
    samples = np.load(REPO / "pipeline" / "assets" / "digits.npz")["validation/input"][:32]
    fp32, int8 = (ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]) for path in (DIGITS, out))
    for x in samples:
        a, b = fp32.run(None, {"input": x[None]})[0].ravel(), int8.run(None, {"input": x[None]})[0].ravel()
        assert a @ b / np.linalg.norm(a) / np.linalg.norm(b) > 0.999


def _largest_weight(path) -> int:
    model = onnx.load(str(path))
    return max(int(np.abs(onnx.numpy_helper.to_array(init).astype(np.int32)).max())
               for init in model.graph.initializer if init.data_type == onnx.TensorProto.INT8)


def test_the_automatic_7_bit_width_is_measured_against_8_bits_and_the_closer_kept(tmp_path):
    """precision.reduce_range null chose 7 bits (x86 without VNNI): both widths are built,
    run on the samples, and the one closer to fp32 is the file left; an explicit width or no
    samples measures nothing."""
    samples = np.load(REPO / "pipeline" / "assets" / "digits.npz")["validation/input"][:24]
    feeds = [{"input": x[None]} for x in samples]
    out = tmp_path / "measured.onnx"
    summary = dynamic.build(DIGITS, out, dynamic.DynamicSettings(reduce_range=True), samples=iter(feeds))
    widths = summary["weight_widths"]
    cosines = widths["output_cosine"]
    assert widths["measured_on"] == "24 calibration samples" and set(cosines) == {"7-bit", "8-bit"}
    assert widths["kept"] == (8 if cosines["8-bit"] > cosines["7-bit"] else 7)
    assert summary["reduce_range"] is (widths["kept"] == 7)
    assert summary["reduce_range_rule"].startswith(f"measured on 24 calibration samples: {widths['kept']}-bit")
    assert (_largest_weight(out) <= 64) is (widths["kept"] == 7)  # the file is the width kept
    assert sorted(p.name for p in tmp_path.iterdir()) == ["measured.onnx"]  # the other width is not left behind
    for settings, given in ((dynamic.DynamicSettings(reduce_range=True), None),
                            (dynamic.DynamicSettings(reduce_range=True, reduce_range_automatic=False), iter(feeds))):
        summary = dynamic.build(DIGITS, tmp_path / "rule.onnx", settings, samples=given)
        assert "weight_widths" not in summary and summary["reduce_range"] is True
        assert _largest_weight(tmp_path / "rule.onnx") <= 64


def test_a_build_that_quantized_nothing_is_refused_and_would_not_pass_as_int8(tmp_path):
    from pipeline.backends.onnxruntime import Session
    from pipeline.verification import verdict

    out = tmp_path / "nothing.onnx"
    summary = dynamic.build(MODEL, out, dynamic.DynamicSettings(quantize_ops=("ConvTranspose",)))
    assert summary["int8_ops"] == 0 and "quantized none" in dynamic.nothing_quantized(summary)
    effective = Session(out).effective()
    assert effective["precision"] == "fp32" and "activation_ranges" not in effective
    _, reasons, code = verdict.judge([{"name": "sentence_embedding", "failures": []}], [], None,
                                     {"device": "CPU", "precision": "int8"}, effective, 1)
    assert code == 4 and reasons == ["requested precision int8 but fp32 ran"]


def test_under_a_budget_a_build_slower_than_fp32_keeps_the_rules_width_unmeasured(tmp_path, monkeypatch):
    """precision.budget_s set (auto's candidates): where the 7-bit build runs slower than fp32
    on one calibration sample, the 8-bit build is neither made nor run (auto screens the build
    out whatever its width); at fp32's speed or faster both widths are measured as without a
    budget. The screen itself is a real timing: a positive speed-up."""
    from pipeline import deadline

    samples = np.load(REPO / "pipeline" / "assets" / "digits.npz")["validation/input"][:8]
    feeds = [{"input": x[None]} for x in samples]
    assert dynamic._speed_vs_float(DIGITS, DIGITS, feeds[0]) > 0
    for speed, measured in ((0.3, False), (1.4, True)):
        monkeypatch.setattr(dynamic, "_speed_vs_float", lambda *_, value=speed: value)
        out = tmp_path / f"{speed}.onnx"
        with deadline.until(time.monotonic() + 600, 0.001):
            summary = dynamic.build(DIGITS, out, dynamic.DynamicSettings(reduce_range=True), samples=iter(feeds))
        widths = summary["weight_widths"]
        assert ("output_cosine" in widths) is measured
        assert summary["reduce_range"] is True or measured
        if not measured:
            assert widths == {"measured_on": "one calibration sample's speed", "kept": 7, "speed_vs_fp32": 0.3}
            assert "not measured against 8-bit: the build ran 0.30x fp32" in summary["reduce_range_rule"]
            assert _largest_weight(out) <= 64
        assert not out.with_name(out.stem + "-8bit.onnx").exists()
