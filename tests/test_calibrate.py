"""The calibrate stage and int8 builds through the CLI, on the embedded digits model."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from conftest import read_report, run_cli, run_dirs, single_bundle
from pipeline.precision.calibration import tables

CALIBRATION_ONLY = "pipeline.stages=[convert,calibrate]"  # for what the calibration alone decides


@pytest.fixture(scope="module")
def int8_run(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("int8")
    result = run_cli(["precision=int8"], cwd)
    assert result.returncode == 0, result.stdout + result.stderr
    return cwd, run_dirs(cwd)[-1], result


def test_int8_on_ort_runs_integer_kernels_and_reports_side_by_side(int8_run):
    cwd, run_dir, result = int8_run
    report = read_report(run_dir)
    calibration = report["calibration"]
    assert calibration["method"] == "auto" and calibration["statistics"] == "computed"
    assert calibration["tensors"] >= 9 and calibration["samples"] == 64
    assert sum(calibration["methods_chosen"].values()) == calibration["tensors"]
    assert calibration["methods_chosen"]["max"] >= 1  # at least the input
    stage = run_dir / "stages" / "calibrate"
    table = json.loads((stage / "calibration.json").read_text())["tensors"]
    assert table["conv1_out"]["threshold"] <= table["conv1_out"]["histogram"]["abs_max"]
    assert tables.from_tpu_mlir((stage / "calibration_table.txt").read_text()).keys() == table.keys()
    assert (stage / "calibration.cache").read_text().count("\n") == len(table)  # TensorRT-style, as ORT writes it
    verify = report["verify"]
    assert verify["effective"]["precision"] == "int8"  # QLinearConv etc. in ORT's optimized graph
    assert verify["verdict"] == "pass"
    assert verify["task"]["drop"] <= 0.01
    comparison = verify["comparison"]
    assert comparison["int8"]["bytes"] < comparison["fp32"]["bytes"] / 2
    fp32 = comparison["fp32"]["latency"]  # interleaved rounds of 20 ms at least, 10 runs the fewest
    assert comparison["int8"]["latency"]["median_ms"] > 0 and fp32["rounds"] >= 3 and fp32["runs"] >= fp32["rounds"] * 10
    assert "| INT8 |" in (run_dir / "report.md").read_text() and "| FLOAT |" in (run_dir / "report.md").read_text()
    model = onnx.load(str(single_bundle(run_dir) / "model.onnx"))
    ops = {n.op_type for n in model.graph.node}
    assert {"QuantizeLinear", "DequantizeLinear"} <= ops
    weights = [t for t in model.graph.initializer if t.data_type == TensorProto.INT8]
    assert weights, "weights are stored as int8"


def test_switching_method_reuses_statistics(int8_run):
    cwd, _, _ = int8_run
    for method in ("mse", "percentile", "kl"):  # the calibration alone: what is reused is its statistics
        result = run_cli(["precision=int8", f"calibration={method}", CALIBRATION_ONLY], cwd)
        assert result.returncode == 0, result.stdout + result.stderr
        report = read_report(run_dirs(cwd)[-1])
        assert report["calibration"]["method"] == method
        assert report["calibration"]["statistics"] == "reused"
        assert report["calibration"]["thresholds_seconds"] < 1.0
    assert report["calibration"]["methods_chosen"] == {"kl": report["calibration"]["tensors"] - 1, "max": 1}


def test_ort_calibration_cache_is_usable_by_onnxruntime(int8_run, tmp_path):
    from onnxruntime.quantization import CalibrationMethod, quantize_static

    _, run_dir, _ = int8_run
    stage = run_dir / "stages" / "calibrate"
    quantize_static(str(stage / "prepared.onnx"), str(tmp_path / "q.onnx"), None,
                    calibration_cache_path=str(stage / "ort_quantize_cache.json"),
                    calibrate_method=CalibrationMethod.MinMax)
    assert any(n.op_type == "QuantizeLinear" for n in onnx.load(str(tmp_path / "q.onnx")).graph.node)


def test_tpu_mlir_table_import_round_trip(int8_run, tmp_path):
    cwd, run_dir, _ = int8_run
    exported = run_dir / "stages" / "calibrate" / "calibration_table.txt"
    result = run_cli(["precision=int8", f"calibration.table={exported}", CALIBRATION_ONLY], cwd)
    assert result.returncode == 0, result.stdout + result.stderr
    imported = run_dirs(cwd)[-1] / "stages" / "calibrate" / "calibration.json"
    original = json.loads((run_dir / "stages" / "calibrate" / "calibration.json").read_text())["tensors"]
    for name, entry in json.loads(imported.read_text())["tensors"].items():
        assert entry["threshold"] == pytest.approx(original[name]["threshold"], rel=1e-12)
    broken = tmp_path / "broken.txt"
    broken.write_text("# op_name threshold min max\nconv1_out 1.0 -1.0\n")
    result = run_cli(["precision=int8", f"calibration.table={broken}"], cwd)
    assert result.returncode == 2 and "line 2" in result.stderr
    unknown = tmp_path / "unknown.txt"
    unknown.write_text("# op_name threshold min max\nno_such_tensor 1.0 -1.0 1.0\n")
    result = run_cli(["precision=int8", f"calibration.table={unknown}"], cwd)
    assert result.returncode == 2 and "no_such_tensor" in result.stderr


def test_int8_on_openvino_runs_int8_convolutions(tmp_path):
    result = run_cli(["precision=int8", "target=openvino_cpu", "calibration=kl"], tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    verify = read_report(run_dirs(tmp_path)[-1])["verify"]
    assert verify["effective"]["precision"] == "int8"
    assert "int8" in verify["effective"]["layers"]


def test_an_isa_cap_below_vnni_gives_openvino_7_bit_weights(tmp_path):
    """oneDNN capped to AVX2 runs OpenVINO's int8 without VNNI on any CPU, where 8-bit
    weights saturate VPMADDUBSW's 16-bit sums: the build quantizes weights to 7 bits, and
    the report records the cap next to the CPU flags."""
    result = run_cli(["precision=int8", "target=openvino_cpu", "calibration=max"], tmp_path,
                     env={"ONEDNN_MAX_CPU_ISA": "AVX2", "OV_CPU_MAX_ISA": "AVX2"})
    assert result.returncode == 0, result.stdout + result.stderr
    run = run_dirs(tmp_path)[-1]
    summary = json.loads((run / "stages" / "build" / "result.json").read_text())["summary"]["quantization"]
    assert summary["reduce_range"] is True
    assert read_report(run)["environment"]["cpu"]["isa_cap"] == {"ONEDNN_MAX_CPU_ISA": "AVX2", "OV_CPU_MAX_ISA": "AVX2"}


@pytest.mark.parametrize("cap, below", [("AVX2", True), ("avx512_core", True), ("SSE41", True),
                                        ("AVX2_VNNI", False), ("AVX512_CORE_VNNI", False),
                                        ("AVX512_CORE_BF16", False), ("AVX512_CORE_AMX", False), ("ALL", False)])
def test_isa_caps_below_vnni_are_told_apart(monkeypatch, cap, below):
    from pipeline import environment
    from pipeline.precision.quantize import needs_reduce_range

    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
    environment.cpu.cache_clear()
    try:
        found = environment.cpu()
        assert found["isa_cap"] == {"ONEDNN_MAX_CPU_ISA": cap}
        x86 = found["machine"] in ("x86_64", "AMD64")
        unmarked = x86 and not environment.VNNI_FLAGS & set(found["flags"])
        assert needs_reduce_range("openvino") == (x86 and below or unmarked)
        assert needs_reduce_range("onnxruntime") == unmarked  # ONNX Runtime's kernels ignore the cap
    finally:
        monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
        environment.cpu.cache_clear()


def test_too_few_samples_warn(tmp_path):
    result = run_cli(["precision=int8", "data.calibration_size=4", CALIBRATION_ONLY], tmp_path)
    assert "only 4 calibration samples" in result.stdout
    assert read_report(run_dirs(tmp_path)[-1])["calibration"]["samples"] == 4


def test_nan_in_calibration_data_is_exit_2_naming_the_file(tmp_path):
    data = tmp_path / "data"
    for split in ("calibration", "validation"):
        (data / split).mkdir(parents=True)
        for index in range(3):
            np.save(data / split / f"{index}.npy", np.full((1, 1, 8, 8), 0.5, dtype=np.float32))
    bad = np.full((1, 1, 8, 8), 0.5, dtype=np.float32)
    bad[0, 0, 3, 3] = np.nan
    np.save(data / "calibration" / "1.npy", bad)
    result = run_cli(["precision=int8", f"data.path={data}"], tmp_path)
    assert result.returncode == 2
    assert "calibration/1.npy contains NaN" in result.stderr


def test_int8_without_calibrate_stage_is_a_config_error(tmp_path):
    result = run_cli(["precision=int8", "pipeline.stages=[convert,build,verify,package]"], tmp_path)
    assert result.returncode == 2
    assert "needs the calibrate stage" in result.stderr


def test_always_zero_tensor_gets_the_floor_and_is_named(tmp_path):
    """y = conv(x); z = y * 0; out = y + z: z is zero on every sample."""
    rng = np.random.default_rng(0)
    weight = helper.make_tensor("w", TensorProto.FLOAT, [4, 1, 3, 3], rng.normal(size=36).astype(np.float32))
    zero = helper.make_tensor("zero", TensorProto.FLOAT, [1], [0.0])
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["y"], name="conv", pads=[1, 1, 1, 1]),
         helper.make_node("Mul", ["y", "zero"], ["z"], name="times_zero"),
         helper.make_node("Add", ["y", "z"], ["out"], name="add")],
        "zero_tensor", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 8, 8])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, 4, 8, 8])], initializer=[weight, zero])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(tmp_path / "zero.onnx"))
    result = run_cli([f"model.path={tmp_path / 'zero.onnx'}", "data=random", "precision=int8"], tmp_path)
    assert result.returncode in (0, 3), result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    report = read_report(run_dirs(tmp_path)[-1])
    assert report["calibration"]["zero_tensors"] == ["z"]
    assert any("always zero" in w and "z" in w for w in report["warnings"])
    table = json.loads((run_dirs(tmp_path)[-1] / "stages" / "calibrate" / "calibration.json").read_text())
    assert table["tensors"]["z"]["threshold"] == pytest.approx(1e-8)


def test_model_outputs_stay_float(int8_run):
    _, run_dir, _ = int8_run
    model = onnx.load(str(single_bundle(run_dir) / "model.onnx"))
    producer = {o: n for n in model.graph.node for o in n.output}
    assert producer["logits"].op_type == "Gemm"


def _dequantized_readers(model: onnx.ModelProto) -> set:
    """Op types that read a DequantizeLinear output of an activation (weights are initializers)."""
    initializers = {t.name for t in model.graph.initializer}
    activation_dq = {n.output[0] for n in model.graph.node
                     if n.op_type == "DequantizeLinear" and n.input[0] not in initializers}
    return {n.op_type for n in model.graph.node if n.op_type != "QuantizeLinear" and set(n.input) & activation_dq}


def test_only_conv_and_gemm_inputs_are_quantized(int8_run, tmp_path):
    """The placement (precision.quantize_ops): ORT gets Q/DQ at Conv/Gemm inputs and outputs
    (its int8 kernels need both) and around the pass-through ops between them (Relu, MaxPool:
    precision.passthrough_ops, the Relus folded into the Q before them), OpenVINO at their inputs
    only; Flatten runs in float, on the last MaxPool's dequantized output."""
    from pipeline.precision.quantize import QdqSettings, build_qdq

    _, run_dir, _ = int8_run
    ort_model = onnx.load(str(single_bundle(run_dir) / "model.onnx"))
    # each Relu is folded into the Q of the op before it (its zero point 0 clamps): none is left
    assert _dequantized_readers(ort_model) == {"Conv", "Gemm", "MaxPool", "Flatten"}
    assert "Relu" not in {n.op_type for n in ort_model.graph.node}
    quantized = {n.input[0] for n in ort_model.graph.node if n.op_type == "QuantizeLinear"}
    assert {"conv1_out", "pool1_out", "flatten_out"} <= quantized
    quantization = read_report(run_dir)["build"]["quantization"]
    assert quantization["quantized"] == "inputs and outputs" and quantization["relus_folded"] >= 2
    assert quantization["passthrough_ops"] == ["Relu", "Clip", "MaxPool", "Resize", "Concat"]
    calibrate = run_dir / "stages" / "calibrate"
    table = json.loads((calibrate / "calibration.json").read_text())["tensors"]
    build_qdq(calibrate / "prepared.onnx", table, tmp_path / "inputs_only.onnx", QdqSettings(quantize_outputs=False))
    inputs_only = onnx.load(str(tmp_path / "inputs_only.onnx"))
    assert _dequantized_readers(inputs_only) == {"Conv", "Gemm"}
    assert "conv1_out" not in {n.input[0] for n in inputs_only.graph.node if n.op_type == "QuantizeLinear"}


@pytest.mark.parametrize("cap", ["AVX2", "AVX512_CORE_VNNI", None])
def test_an_isa_cap_below_bf16_takes_bf16_out_of_openvinos_auto_candidates(monkeypatch, cap):
    """OpenVINO reports no BF16 capability under ONEDNN_MAX_CPU_ISA=AVX2 on a BF16 CPU and runs
    a bf16 request in f32 (a 0.95x candidate verified for 48 s): auto leaves it out, as on a CPU
    without the flags. ONNX Runtime's kernels ignore the cap."""
    from conftest import composed
    from pipeline import environment
    from pipeline.app import auto
    from pipeline.config.validation import validate

    if cap:
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
    else:
        monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("OV_CPU_MAX_ISA", raising=False)
    environment.cpu.cache_clear()
    try:
        flags = set(environment.cpu()["flags"])
        capped = set(environment.kernel_flags("openvino"))
        assert set(environment.kernel_flags("onnxruntime")) == flags
        if cap == "AVX2":
            assert not capped & {"avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "avx_vnni"}
            assert capped == flags - {f for f in flags if f in environment.FLAG_LEVELS
                                      and environment.FLAG_LEVELS[f] not in ("AVX", "AVX2")}
        elif cap == "AVX512_CORE_VNNI":
            assert "avx512_bf16" not in capped and capped >= flags & {"avx512f", "avx512_vnni"}
        else:
            assert capped == flags
        chosen = auto.candidates(validate(composed("target=openvino_cpu")))
        assert ("bf16" in chosen) == bool(capped & {"avx512_bf16", "amx_bf16"})
    finally:
        environment.cpu.cache_clear()


def test_a_judge_of_a_subsample_reads_the_whole_sets_reference_outputs():
    """calibration=auto screens its tables on a subsample: that judge takes its fp32 outputs
    from the whole set's judge (across its chunks of 32 samples) instead of running the
    model again, and measures exactly as a judge made from those samples would."""
    from pipeline.precision.calibration.measure import OutputJudge

    model = onnx.load(str(Path(__file__).resolve().parent.parent / "pipeline" / "assets" / "segmenter.onnx"))
    rng = np.random.default_rng(0)
    samples = [{"input": rng.standard_normal((1, 3, 96, 96), np.float32)} for _ in range(35)]
    whole = OutputJudge(model, samples)
    picked = [0, 7, 31, 32, 34]
    subset, fresh = whole.subset(picked), OutputJudge(model, [samples[i] for i in picked])
    assert subset.count == fresh.count == 5 and subset.outputs == fresh.outputs
    for mine, theirs in zip(subset.reference, fresh.reference):
        for a, b in zip(mine, theirs):
            np.testing.assert_array_equal(a, b)
    noisy = [[values + np.float32(0.01) * rng.standard_normal(values.shape, np.float32) for values in chunk]
             for chunk in fresh.reference]
    assert subset.score(noisy) == fresh.score(noisy) and subset.score(noisy)["cosine"] < 1.0


def test_a_table_measured_after_its_screening_runs_only_the_other_samples():
    """calibration=auto's finalists: a table screened on a subsample is measured on the whole
    set by running only the samples the screening did not, and scores exactly as a table
    measured on every sample; a table never screened runs every sample."""
    from pipeline.precision.calibration import statistics, tables
    from pipeline.precision.calibration.fake_quant import FakeQuantModel
    from pipeline.precision.calibration.measure import OutputJudge
    from pipeline.data import Sample
    from pipeline.precision.quantize import QdqSettings
    from stages.calibrate import _table_measures

    path = Path(__file__).resolve().parent.parent / "pipeline" / "assets" / "segmenter.onnx"
    model = onnx.load(str(path))
    rng = np.random.default_rng(1)
    samples = [{"input": rng.standard_normal((1, 3, 96, 96), np.float32)} for _ in range(9)]
    found = statistics.collect(path, [Sample(str(i), s) for i, s in enumerate(samples)], len(samples), 512, 8, 0)
    table = tables.build_table(found.histograms, "max")
    other = tables.build_table(found.histograms, "percentile")
    fake = FakeQuantModel(model, table, QdqSettings())
    whole, ran = OutputJudge(model, samples), []
    run_each = fake.run_each
    fake.run_each = lambda t, picked, outputs=None: ran.append(len(picked)) or run_each(t, picked, outputs)
    plain, _ = _table_measures(fake, whole, None)
    expected = plain(table)
    measure, screen = _table_measures(fake, whole, [4, 0, 7])
    ran.clear()
    screened = screen(table)
    assert measure(table) == expected and screened["cosine"] < 1.0
    assert ran == [3, 6]  # the screening's three samples, then the six others
    ran.clear()
    assert measure(other) == plain(other) and ran == [9, 9]


def test_the_judges_max_table_is_read_off_the_statistics_per_sample_bounds():
    """Equalization's and smoothing's judges on a subsample of the calibration set take their
    max table from the statistics pass's per-sample bounds: the same entries a pass of their
    own over those samples gives; None where a sample is unknown."""
    from types import SimpleNamespace

    from pipeline.data import Sample
    from pipeline.precision.calibration import statistics, tables
    from stages.calibrate import _judge_table_from_bounds

    path = Path(__file__).resolve().parent.parent / "pipeline" / "assets" / "segmenter.onnx"
    rng = np.random.default_rng(2)
    samples = [Sample(f"s{i}", {"input": rng.standard_normal((1, 3, 96, 96), np.float32) * (1 + i)})
               for i in range(9)]
    stats = statistics.collect(path, samples, len(samples), 512, 4, 0)
    picked = [samples[i] for i in (5, 1, 7)]
    own = statistics.collect(path, picked, len(picked), 512, 4, 0)
    judged: dict = {}
    auto = SimpleNamespace(calibration=SimpleNamespace(method=SimpleNamespace(value="auto"),
                                                       inputs=SimpleNamespace(value="max")))
    _judge_table_from_bounds(auto, stats, picked, judged)
    assert judged["samples"] == ["s5", "s1", "s7"] and set(judged["base_table"]) == set(own.histograms)
    for name, histogram in own.histograms.items():
        expected = tables.table_entry(histogram, "max")
        assert {k: judged["base_table"][name][k] for k in ("threshold", "min", "max")} == \
            {k: expected[k] for k in ("threshold", "min", "max")}, name
    assert stats.bounds_over(["s1", "elsewhere"]) is None
    kl = SimpleNamespace(calibration=SimpleNamespace(method=SimpleNamespace(value="kl"), inputs=None))
    untouched: dict = {}
    _judge_table_from_bounds(kl, stats, picked, untouched)  # a histogram method: the judges collect their own
    assert untouched == {}


def test_where_int8_is_slower_is_judged_on_the_graph_as_built(tmp_path):
    """precision.int8_where_faster profiles the int8 model as the build runs it (on ONNX
    Runtime its pass-through Relus folded, narrow Convs widened): an unwidened 1-channel head
    read 11 ms in int8 against 6 in fp32 and was kept float for it."""
    result = run_cli(["precision=int8", "precision.int8_where_faster=true",
                      "pipeline.stages=[convert,calibrate,build]"], tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    slower = read_report(run_dirs(tmp_path)[-1])["build"]["quantization"]["slower_in_int8"]
    assert slower["measured"]["int8_as_built"]["relus_folded"] >= 2, slower
