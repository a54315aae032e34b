"""Verify tells the whole truth (docs/verify.md): every failing check is a reason in a
fixed order, int8 that ran partly in float is its own check, the advice was built and
measured before it is printed (and applying it verbatim gives what was printed), a
keep_float naming an op the build does not quantize is exit 2, parity-bundle check agrees
with the run, and the reference is checked against float64 before a kernel is blamed."""

from __future__ import annotations

import importlib.resources
import xml.etree.ElementTree as ET

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from conftest import cpu_note, read_report, run_cli, run_dirs, single_bundle
from textlines import NEEDS_FONTS_SKIPPED, write_dataset

CLS = importlib.resources.files("rapidocr_onnxruntime") / "models" / "ch_ppocr_mobile_v2.0_cls_infer.onnx"
QUANTIZE_OPS = "quantize_ops=[Conv, ConvTranspose, Gemm, MatMul]"


def deconv_model(path):
    """Conv -> Relu -> ConvTranspose -> Relu -> Conv: ONNX Runtime has no int8 ConvTranspose kernel."""
    rng = np.random.default_rng(0)
    weights = [numpy_helper.from_array(rng.normal(0, 0.3, shape).astype(np.float32), name)
               for name, shape in (("w1", (8, 3, 3, 3)), ("w2", (8, 8, 2, 2)), ("w3", (4, 8, 3, 3)))]
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c1"], name="conv1", pads=[1, 1, 1, 1], strides=[2, 2]),
             helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
             helper.make_node("ConvTranspose", ["r1", "w2"], ["d1"], name="deconv1", strides=[2, 2]),
             helper.make_node("Relu", ["d1"], ["r2"], name="relu2"),
             helper.make_node("Conv", ["r2", "w3"], ["y"], name="conv2", pads=[1, 1, 1, 1])]
    graph = helper.make_graph(nodes, "deconv", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 16, 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 16, 16])], weights)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8), str(path))
    return path


def cdist_model(path, offset=1000.0):
    """Pairwise distances in the matmul form sqrt(|x|^2 + |y|^2 - 2 x.y^T) of points far from
    the origin: float32 cancels most digits, so the fp32 reference is far from the truth."""
    points = (offset + np.random.default_rng(1).uniform(0, 1, (16, 32))).astype(np.float32)
    constants = {"offset": np.float32(offset).reshape(()), "yt": points.T.copy(),
                 "ysq": (points.astype(np.float64) ** 2).sum(1).astype(np.float32)[None, :],
                 "axes": np.array([1], dtype=np.int64), "minus2": np.float32(-2.0).reshape(()),
                 "zero": np.float32(0.0).reshape(())}
    nodes = [helper.make_node("Add", ["x", "offset"], ["xs"], name="shift"),
             helper.make_node("Mul", ["xs", "xs"], ["xx"], name="square"),
             helper.make_node("ReduceSum", ["xx", "axes"], ["xsq"], name="xsq", keepdims=1),
             helper.make_node("MatMul", ["xs", "yt"], ["xy"], name="xy"),
             helper.make_node("Mul", ["xy", "minus2"], ["m2xy"], name="m2xy"),
             helper.make_node("Add", ["xsq", "ysq"], ["sq"], name="sumsq"),
             helper.make_node("Add", ["sq", "m2xy"], ["d2"], name="d2"),
             helper.make_node("Max", ["d2", "zero"], ["d2p"], name="clamp"),
             helper.make_node("Sqrt", ["d2p"], ["dist"], name="dist")]
    graph = helper.make_graph(nodes, "cdist", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, 32])],
                              [helper.make_tensor_value_info("dist", TensorProto.FLOAT, [8, 16])],
                              [numpy_helper.from_array(value, name) for name, value in constants.items()])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8), str(path))
    return path


def assert_advice_was_tried(report: dict, stdout: str) -> None:
    """Every printed recommendation of a failing int8/mixed build was built and measured."""
    verify = report["verify"]
    advice = verify["recommendations"]
    assert advice and all(a.get("tried") for a in advice), advice
    tried = {tuple(t["keep_float"]): t for t in verify["advice_tried"]}
    for recommendation in advice:
        assert recommendation["text"] in stdout
        measured = recommendation["measured"]
        assert tried[tuple(measured["keep_float"])]["cosine"] == measured["cosine"]
        if measured["passed"]:
            assert f"-> cosine {measured['cosine']:.6f} (pass" in recommendation["text"]
        else:  # a trial that does not pass is never a ready-to-apply line
            assert recommendation["kind"] == "tried_none_passed" and "keep_float" not in recommendation["action"]
            assert "(apply:" not in recommendation["text"] and f"cosine {measured['cosine']:.6f}" in recommendation["text"]


def assert_applying_it_gives_what_was_printed(args, cwd, recommendation: dict, tolerance: float = 1e-6) -> None:
    """A passing recommendation's apply line, or the closest failing trial's ops, rerun:
    measures as recorded. ``tolerance``: mixed builds rerun the sensitivity search, which sees
    keep_float and may pick other threshold methods for the table (docs/verify.md, "Advice")."""
    keep = recommendation["measured"]["keep_float"]
    if recommendation["measured"]["passed"]:
        keep = recommendation["action"]["keep_float"]
        assert f"(apply: precision.keep_float=[{','.join(keep)}])" in recommendation["text"]
    rerun = run_cli([*args, f"precision.keep_float=[{','.join(keep)}]"], cwd)
    measured = recommendation["measured"]
    report = read_report(run_dirs(cwd)[-1])
    cosine = min(o["metrics"]["cosine"] for o in report["verify"]["outputs"])
    assert cosine == pytest.approx(measured["cosine"], abs=tolerance), rerun.stdout
    assert (rerun.returncode == 0) == measured["passed"], rerun.stdout + rerun.stderr


@pytest.mark.skipif(NEEDS_FONTS_SKIPPED, reason="needs Debian's fonts-dejavu-core")
def test_classifier_kl_int8_on_ort_fails_on_cosine_with_advice_that_works(tmp_path):
    data = write_dataset(tmp_path / "textlines", calibration=8, validation=24)
    args = [f"model.path={CLS}", "+model.input_shapes.x=[1,3,48,192]", "data.kind=images", f"data.path={data}",
            "data.calibration_size=8", "data.validation_size=24", "data.preprocess.keep_aspect=true",
            "data.preprocess.color=bgr", "data.preprocess.mean=[0.5]", "data.preprocess.std=[0.5]",
            "target=ort_cpu", "precision=int8", "calibration=kl", "validation.min_cosine=0.999",
            "validation.task_min_cosine=null", "validation.diagnosis_min_seconds=60",
            "pipeline.stages=[convert,calibrate,build,verify]"]
    result = run_cli(args, tmp_path)
    assert result.returncode == 3, result.stdout + result.stderr
    report = read_report(run_dirs(tmp_path)[-1])
    # the cosine below 0.999 on every CPU (VNNI 0.99..., an AVX2-only CPU's 7-bit weights 0.98...)
    reason = report["reasons"][0]
    assert reason.startswith("output save_infer_model/scale_0.tmp_1: cosine ") and reason.endswith(" < 0.999"), reason
    assert 0.9 < float(reason.split("cosine ")[1].split(" ")[0]) < 0.999, f"{cpu_note()}: {reason}"
    assert f"verdict: FAIL (exit 3): {report['reasons'][0]}" in result.stdout
    assert_advice_was_tried(report, result.stdout)
    # screened on ONNX Runtime itself, as the build was refined: predicted next to measured.
    # Whether the screening "predicts the target" (every confirmed trial within the build's gap
    # to the threshold) sits at its margin here: keep_float=[Conv@1] measures 0.0029-0.0030 from
    # its prediction against a gap of 0.0029-0.0030 (its own build judges weight rounding not
    # worth keeping, the screened build kept it); the report says which, and names the miss
    diagnosis = report["verify"]["diagnosis"]
    screening = diagnosis["screening"]
    assert screening["on"] == "target" and screening["predicts_target"] in (True, False), diagnosis
    assert bool(screening.get("misses")) == (screening["predicts_target"] is False), screening
    # predicted within what the int8 kernels' rounding allows (VNNI's differs from AVX2's):
    # the cosine's distance from 1 within a factor 3 of the measured one (AVX2: within 0.002)
    confirmed = [s for s in diagnosis["screened"] if "measured_cosine" in s]
    assert confirmed and all(_predicted_within_rounding(s) for s in confirmed), f"{cpu_note()}: {confirmed}"
    assert f"predicted cosine {confirmed[0]['predicted_cosine']:.6f}, measured" in result.stdout
    assert "predicted on the target" in (run_dirs(tmp_path)[-1] / "report.md").read_text()
    assert_applying_it_gives_what_was_printed(args, tmp_path, report["verify"]["recommendations"][0])


def _predicted_within_rounding(screened: dict) -> bool:
    """Close, or the prediction on the safe side: on an AVX2-only AMD EPYC (7-bit weights)
    the trial predicted 0.99225 and its build measured 0.99935 (noticed, not explained)."""
    predicted, measured = screened["predicted_cosine"], screened["measured_cosine"]
    return abs(predicted - measured) < 0.002 or 1 / 3 <= (1 - measured) / max(1 - predicted, 1e-9) <= 3 \
        or measured > predicted


@pytest.fixture(scope="module")
def deconv_strict(tmp_path_factory):
    """The ConvTranspose model in int8 on ONNX Runtime with thresholds int8 cannot meet and the
    partial float fallback made a failing check: three reasons, packaged."""
    root = tmp_path_factory.mktemp("deconv")
    model = deconv_model(root / "deconv.onnx")
    args = [f"model.path={model}", "data=random", "target=ort_cpu", "precision=int8",
            "validation.min_cosine=0.99999", "validation.min_sqnr_db=60", "validation.fail_on_float_fallback=true",
            "validation.diagnosis_min_seconds=60"]
    result = run_cli([*args, "pipeline.stages=[convert,calibrate,build,verify,package]"], root)
    return root, args, result, run_dirs(root)[-1]


def test_every_failing_check_is_a_reason_in_order(deconv_strict):
    root, _, result, run_dir = deconv_strict
    assert result.returncode == 4, result.stdout + result.stderr  # the fallback made fatal: "this machine cannot"
    report = read_report(run_dir)
    cosine, sqnr, fallback = report["reasons"]
    assert cosine.startswith("output y: cosine 0.99") and sqnr.startswith("output y: SQNR")
    # conv2: its output is the model's, left float, so ONNX Runtime has no int8 Conv for it; deconv1
    # is not among them: ONNX Runtime has no int8 ConvTranspose, so the build keeps it float
    assert fallback == ("int8 ran partly: 1 quantized op ran in float, the runtime has no int8 kernel for it here "
                        "(1 Conv: conv2)")
    assert report["build"]["quantization"]["backend_float_ops"]["ops"] == ["deconv1"]
    assert f"verdict: FAIL (exit 4): {cosine}; {sqnr} (+1 more in report.md)" in result.stdout
    markdown = (run_dir / "report.md").read_text()
    assert all(reason in markdown for reason in report["reasons"])
    suite = ET.parse(run_dir / "junit.xml").getroot().find("testsuite")
    assert suite.find("system-out").text.splitlines() == report["reasons"]
    (case,) = [c for c in suite.iter("testcase") if c.get("name") == "quantized ops ran in int8"]
    assert case.find("failure").get("type") == "float_fallback"
    assert_advice_was_tried(report, result.stdout)


# The rerun gets the trial's table: calibrate's auto choice leaves precision.keep_float out (on
# this AVX2 machine it chose percentile for the build and kl with deconv1 float: 0.999808
# printed, 0.999861 rerun, before).
def test_the_best_candidate_applied_verbatim_measures_as_printed(deconv_strict):
    root, args, _, run_dir = deconv_strict
    (advice,) = read_report(run_dir)["verify"]["recommendations"]
    assert advice["kind"] == "tried_none_passed" and advice["text"].startswith("none of the ")
    assert_applying_it_gives_what_was_printed([*args, "pipeline.stages=[convert,calibrate,build,verify]"], root,
                                              advice)


def test_bundle_check_agrees_with_the_failing_run(deconv_strict):
    root, _, result, run_dir = deconv_strict
    check = run_cli(["check", single_bundle(run_dir)], root, program="parity-bundle")
    report = read_report(run_dir)
    assert check.returncode == result.returncode == 4, check.stdout + check.stderr
    assert "the bundle reproduces the packaged run's outputs" in check.stdout
    assert "verdict: FAIL (exit 4; packaged verdict: fail, exit 4)" in check.stdout
    assert [line[4:] for line in check.stdout.splitlines() if line.startswith("  - ")] == report["reasons"]


def test_a_partial_float_fallback_is_a_warning_by_default_and_keep_float_must_be_quantized(deconv_strict):
    root, args, _, _ = deconv_strict
    default = [a for a in args if not a.startswith("validation.")]
    result = run_cli([*default, "validation.layerwise=off", "pipeline.stages=[convert,calibrate,build,verify]"], root)
    report = read_report(run_dirs(root)[-1])
    (check,) = [c for c in report["verify"]["checks"] if c["check"] == "float_fallback"]
    assert check["severity"] == "warning" and check["ops"] == ["conv2"] and check["counts"] == {"Conv": 1}
    assert not any(r.startswith("int8 ran partly") for r in report["reasons"])
    assert any(w.startswith("int8 ran partly") for w in report["warnings"])
    assert "warning: int8 ran partly" in result.stdout
    assert "⚠ MISMATCH" not in (run_dirs(root)[-1] / "report.md").read_text()
    refused = run_cli([*default, "precision.keep_float=[relu2]"], root)
    assert refused.returncode == 2
    # deconv1 between them is float on ONNX Runtime: the nearest quantized op upstream is conv1
    assert [line for line in refused.stderr.splitlines() if not line.startswith("INFO")] == [
        f"parity: config error: precision.keep_float: relu2 is not quantized in this build: {QUANTIZE_OPS}; its "
        "quantized producers are conv1 (keep those in float instead)"]
    # an op the backend keeps float here anyway is let through (a sweep's list may name it)
    named = run_cli([*default, "precision.keep_float=[deconv1]", "pipeline.stages=[convert,calibrate,build]"], root)
    assert named.returncode == 0, named.stdout + named.stderr


def test_a_mixed_build_with_an_empty_qtable_ran_int8_without_a_mismatch(tmp_path):
    args = ["precision=mixed", "validation.min_cosine=0.999997", "validation.task_min_cosine=null",
            "sensitivity.expected_cos=0.999",
            "validation.diagnosis_min_seconds=60",
            "pipeline.stages=[convert,calibrate,sensitivity,build,verify]"]
    result = run_cli(args, tmp_path)
    run_dir = run_dirs(tmp_path)[-1]
    report = read_report(run_dir)
    assert report["build"]["quantization"]["float_ops"] == [] and report["verify"]["effective"]["precision"] == "int8"
    assert result.returncode == 3, result.stdout + result.stderr
    assert report["reasons"][0].startswith("output logits: cosine") and not any(
        r.startswith("requested") for r in report["reasons"])
    markdown = (run_dir / "report.md").read_text()
    assert "| precision | mixed | int8 | yes |" in markdown and "MISMATCH" not in markdown
    assert_advice_was_tried(report, result.stdout)
    assert_applying_it_gives_what_was_printed(args, tmp_path, report["verify"]["recommendations"][0], 1e-5)


def test_cdist_reference_far_from_float64_truth(tmp_path):
    """ort_cpu passes with a warning that the reference itself is far from float64; OpenVINO
    fails but is as close to the truth as the reference: no kernel is blamed."""
    model = cdist_model(tmp_path / "cdist.onnx")
    args = [f"model.path={model}", "data=random", "precision=fp32", "pipeline.stages=[convert,build,verify]"]
    passed = run_cli([*args, "target=ort_cpu"], tmp_path)
    assert passed.returncode == 0, passed.stdout + passed.stderr
    truth = read_report(run_dirs(tmp_path)[-1])["verify"]["truth"]
    assert truth["ran"] and truth["outputs"]["dist"]["reference_cosine"] < 0.99
    assert "warning: output dist: the fp32 reference itself is only 0." in passed.stdout
    failed = run_cli([*args, "target=openvino_cpu"], tmp_path)
    report = read_report(run_dirs(tmp_path)[-1])
    assert failed.returncode == 3, failed.stdout + failed.stderr
    result = report["verify"]["outputs"][0]["truth"]
    assert result["target_as_close"]
    reason = report["reasons"][0]
    assert "as close to the float64 truth" in reason or "closer to the float64 truth" in reason
    assert not any("upstream" in a["text"] for a in report["verify"]["recommendations"])
    assert any(a["kind"] == "reference_imprecise" for a in report["verify"]["recommendations"])


def test_float64_truth_names_the_closer_side():
    from pipeline.verification import truth

    assert truth.judge(0.98, 0.99, 4, "x")["verdict"].startswith("the target is closer to the float64 truth")
    assert truth.judge(0.98, 0.975, 4, "x")["target_as_close"]
    farther = truth.judge(0.999999999, 0.95, 4, "x")
    assert not farther["target_as_close"] and "the difference is the target's" in farther["verdict"]
    assert not truth.judge(0.99, 0.9, 4, "x")["target_as_close"]


def test_float64_copy_runs_where_onnx_runtime_has_no_float64_kernel(tmp_path):
    """Conv has no float64 kernel in ONNX Runtime: the reference evaluator runs the copy."""
    from pipeline.verification import truth

    model = onnx.load(str(deconv_model(tmp_path / "deconv.onnx")))
    feeds = {"x": np.random.default_rng(0).uniform(0, 1, (1, 3, 16, 16)).astype(np.float32)}
    (exact,), engine = truth.run_float64(model, [feeds])
    assert engine == "onnx.reference float64" and exact["y"].dtype == np.float64
    import onnxruntime as ort

    single = ort.InferenceSession(str(tmp_path / "deconv.onnx"), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    assert np.abs(exact["y"] - single).max() < 1e-4


def test_float64_copy_is_not_started_where_the_numpy_evaluator_would_take_longer_than_the_check(tmp_path):
    """A 320x320 network through ONNX's NumPy evaluator took 25 s a sample (3 s with parity's ops): a model whose
    float32 run projects past the budget is not run, and says why; a quick one still is."""
    from pipeline.verification import truth

    model = onnx.load(str(deconv_model(tmp_path / "deconv.onnx")))
    feeds = {"x": np.random.default_rng(0).uniform(0, 1, (1, 3, 16, 16)).astype(np.float32)}
    slow = truth.BUDGET_S / truth.EVALUATOR_SLOWDOWN * 2
    with pytest.raises(truth.TooSlow, match=rf"NumPy evaluator would take about {2 * truth.BUDGET_S:.0f} s a sample"):
        truth.run_float64(model, [feeds], float32_s=slow)
    (exact,), engine = truth.run_float64(model, [feeds], float32_s=slow / 4)
    assert engine == "onnx.reference float64" and exact["y"].dtype == np.float64


def test_a_float_conv_with_its_activation_fused_is_named_by_the_conv(tmp_path):
    """ONNX Runtime's NCHWc Conv with a Sigmoid fused in is named after the Sigmoid's output:
    the float op verify reports (and checks against what the build kept float) is the Conv."""
    from pipeline.backends.onnxruntime import Session

    rng = np.random.default_rng(0)
    const = [numpy_helper.from_array(rng.normal(0, 0.3, shape).astype(np.float32), name)
             for name, shape in (("w1", (16, 8, 3, 3)), ("w2", (8, 16, 3, 3)))]
    const += [numpy_helper.from_array(np.array(v, dtype=np.float32), n) for n, v in (("s", 0.02), ("ws", 0.01))]
    const += [numpy_helper.from_array(np.array(0, dtype=np.uint8), "z"),
              numpy_helper.from_array(np.array(0, dtype=np.int8), "wz")]
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["xd"]),
             helper.make_node("QuantizeLinear", ["w1", "ws", "wz"], ["w1q"]),
             helper.make_node("DequantizeLinear", ["w1q", "ws", "wz"], ["w1d"]),
             helper.make_node("Conv", ["xd", "w1d"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
             helper.make_node("QuantizeLinear", ["c1", "s", "z"], ["c1q"]),
             helper.make_node("DequantizeLinear", ["c1q", "s", "z"], ["c1d"]),
             helper.make_node("Conv", ["c1d", "w2"], ["c2"], name="conv2", pads=[1, 1, 1, 1]),
             helper.make_node("Sigmoid", ["c2"], ["y"], name="sigmoid")]
    graph = helper.make_graph(nodes, "float_head", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 32, 32])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 32, 32])], const)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8),
              str(tmp_path / "m.onnx"))
    effective = Session(tmp_path / "m.onnx", precision="mixed").effective()
    assert effective["precision"] == "mixed" and effective["float_ops"] == {"conv2": "Conv"}


def test_one_op_that_ran_float_is_named_in_the_singular():
    from pipeline.verification.verdict import partial_fallback

    one = partial_fallback({"float_ops": {"deconv1": "ConvTranspose", "conv2": "Conv"}}, intended_float=("conv2",))
    assert one["text"] == ("1 quantized op ran in float, the runtime has no int8 kernel for it here "
                           "(1 ConvTranspose: deconv1)") and one["ops"] == ["deconv1"]
