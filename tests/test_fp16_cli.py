"""precision=fp16 through the CLI on the fp16-overflow model (x*x -> ReduceSum -> Sqrt)."""

from __future__ import annotations

import onnx

import overflow_model
from conftest import read_report, run_cli, run_dirs, single_bundle


def test_overflowing_reduction_and_its_consumer_stay_fp32(tmp_path):
    model = overflow_model.build(tmp_path / "overflow.onnx")
    result = run_cli([f"model.path={model}", "data=random", "data.high=4", "precision=fp16"], tmp_path)
    run_dir = run_dirs(tmp_path)[-1]
    build = read_report(run_dir)["build"]["quantization"]
    assert [f["tensor"] for f in build["findings"] if f["check"] == "fp16_overflow"] == ["reduce_out"]
    assert build["blocked"] == ["reduce", "sqrt"]
    half = onnx.load(str(single_bundle(run_dir) / "model.onnx"))
    weights = {t.name: t.data_type for t in half.graph.initializer}
    assert onnx.TensorProto.FLOAT16 in weights.values()  # the rest really is fp16
    types = {v.name: v.type.tensor_type.elem_type for v in list(half.graph.value_info) + list(half.graph.output)}
    reduce = next(n for n in half.graph.node if n.name == "reduce")
    assert types.get(reduce.output[0]) == onnx.TensorProto.FLOAT
    verify = read_report(run_dir)["verify"]
    assert verify["outputs"][0]["metrics"]["inf"] == 0
    # ONNX Runtime has no fp16 CPU kernels here: it computes in fp32, and verify says so
    assert verify["effective"]["precision"] == "fp32" and result.returncode == 4
    assert "requested precision fp16 but fp32 ran" in result.stdout


def test_fp16_on_openvino_reports_what_ran(tmp_path):
    model = overflow_model.build(tmp_path / "overflow.onnx")
    result = run_cli([f"model.path={model}", "data=random", "data.high=4", "precision=fp16",
                      "target=openvino_cpu"], tmp_path)
    verify = read_report(run_dirs(tmp_path)[-1])["verify"]
    assert verify["outputs"][0]["metrics"]["inf"] == 0 and verify["outputs"][0]["metrics"]["nan"] == 0
    if verify["effective"]["precision"] == "fp16":
        assert result.returncode == 0, result.stdout + result.stderr
    else:
        assert result.returncode == 4
