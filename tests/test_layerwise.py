"""Layerwise comparison on real ONNX Runtime and OpenVINO sessions: the first divergence
on models with a known culprit, the NaN/Inf origin, chunking, the side file, and the
recommendations drawn from them."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import overflow_model
from pipeline.precision import fp16
from pipeline.verification import layerwise
from pipeline.backends import onnxruntime as ort_backend
from pipeline.backends import openvino as ov_backend
from pipeline.verification.recommend import recommend
from pipeline.backends.tensor_names import onnx_name

SHAPE = (1, 4, 16, 16)


class InProcess:
    """The call protocol of pipeline.worker.BackendWorker, on an in-process session."""

    def __init__(self, session):
        self.session = session

    def call(self, method, *args):
        return getattr(self.session, method)(*args)


def chain_model(path: Path, broken: str = "", scale: float = 1.0) -> Path:
    """x -> conv_a -> relu_a -> conv_b -> relu_b -> conv_c -> y. ``broken`` names a conv
    whose weights are perturbed (same tensor names): the known culprit."""
    rng = np.random.default_rng(1)
    nodes, inits, previous = [], [], "x"
    for name in ("a", "b", "c"):
        weight = rng.normal(0, 0.3, (4, 4, 3, 3)).astype(np.float32)
        if name == broken:
            weight = weight * scale + rng.normal(0, 0.3, weight.shape).astype(np.float32)
        inits.append(numpy_helper.from_array(weight, f"w_{name}"))
        nodes.append(helper.make_node("Conv", [previous, f"w_{name}"], [f"conv_{name}_out"], name=f"conv_{name}",
                                      kernel_shape=[3, 3], pads=[1, 1, 1, 1]))
        if name != "c":
            nodes.append(helper.make_node("Relu", [f"conv_{name}_out"], [f"relu_{name}_out"], name=f"relu_{name}"))
            previous = f"relu_{name}_out"
    nodes[-1].output[0] = "y"
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(SHAPE))],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(SHAPE))], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def samples(count=4, shape=SHAPE, seed=0):
    rng = np.random.default_rng(seed)
    return [{"x": rng.normal(size=shape).astype(np.float32)} for _ in range(count)]


def test_first_divergence_is_the_perturbed_op_on_onnxruntime(tmp_path):
    reference = chain_model(tmp_path / "ref.onnx")
    target = chain_model(tmp_path / "target.onnx", broken="b", scale=0.2)
    graph = layerwise.Graph(onnx.load(str(reference)))
    unfused = layerwise.compare(InProcess(ort_backend.reference(reference)),
                                InProcess(ort_backend.Session(target, graph_optimization_level="disabled")),
                                graph, samples(), threshold=0.999)
    culprit = unfused.first_divergence()
    assert culprit["op"] == "conv_b" and culprit["op_type"] == "Conv" and culprit["region"] == ["conv_b"]
    assert culprit["attributes"]["kernel_shape"] == [3, 3]
    assert [i["tensor"] for i in culprit["inputs"]] == ["relu_a_out"] and culprit["inputs"][0]["cosine"] > 0.9999
    assert culprit["cosine"] < 0.999
    assert unfused.nan_origin() is None
    assert unfused.passes("conv_a_out") and not unfused.passes("y")
    # What ORT executes fuses Conv+Relu: conv_b_out no longer exists, the region names both ops
    fused = layerwise.compare(InProcess(ort_backend.reference(reference)), InProcess(ort_backend.Session(target)),
                              graph, samples(), threshold=0.999)
    assert "conv_b_out" in fused.not_exposed
    assert fused.first_divergence()["region"] == ["conv_b", "relu_b"]


def test_identical_models_have_no_divergence_and_chunks_change_nothing(tmp_path):
    model = chain_model(tmp_path / "ref.onnx")
    graph = layerwise.Graph(onnx.load(str(model)))
    whole = layerwise.compare(InProcess(ort_backend.reference(model)), InProcess(ort_backend.Session(model)),
                              graph, samples(), threshold=0.9999)
    assert len(graph.chunks([t.name for t in graph.tensors], budget=4 * 16 * 16 * 4)) == len(graph.tensors)
    chunked = layerwise.compare(InProcess(ort_backend.reference(model)), InProcess(ort_backend.Session(model)),
                                graph, samples(), threshold=0.9999, budget=4 * 16 * 16 * 4)
    assert whole.first_divergence() is None
    assert set(whole.stats) == set(chunked.stats) and len(whole.stats) >= 3
    for name in whole.stats:
        assert whole.stats[name].result()["cosine"] == pytest.approx(chunked.stats[name].result()["cosine"])


def test_first_divergence_on_openvino_names_the_perturbed_op(tmp_path):
    reference = chain_model(tmp_path / "ref.onnx")
    target = chain_model(tmp_path / "target.onnx", broken="c", scale=0.0)
    ir = tmp_path / "ir"
    ir.mkdir()
    ov_backend.convert(target, ir)
    session = ov_backend.load(ir, {"model": "model.xml", "options": {"INFERENCE_PRECISION_HINT": "f32"}})
    graph = layerwise.Graph(onnx.load(str(reference)))
    result = layerwise.compare(InProcess(ort_backend.reference(reference)), InProcess(session), graph, samples(),
                               threshold=0.999)
    assert result.first_divergence()["op"] == "conv_c"
    assert result.passes("relu_b_out")


def scaled_overflow_model(path: Path, gain: float) -> Path:
    """overflow_model with a gain on its input: gain 1e20 makes x*x overflow float32 at
    the reduction on any backend (ONNX Runtime's CPU fp16 build computes in fp32 here)."""
    model = onnx.load(str(overflow_model.build(path)))
    model.graph.initializer.append(numpy_helper.from_array(np.array(gain, dtype=np.float32), "gain"))
    model.graph.node.insert(0, helper.make_node("Mul", ["x", "gain"], ["x_gained"], name="gain"))
    model.graph.node[1].input[0] = "x_gained"
    onnx.save(model, str(path))
    return path


def test_nan_inf_origin_is_the_first_tensor_that_overflows(tmp_path):
    reference = scaled_overflow_model(tmp_path / "ref.onnx", 1.0)
    target = scaled_overflow_model(tmp_path / "target.onnx", 1e17)  # square 1e36 fits, the sum does not
    graph = layerwise.Graph(onnx.load(str(reference)))
    feeds = [{"x": overflow_model.sample(seed)} for seed in range(2)]
    result = layerwise.compare(InProcess(ort_backend.reference(reference)), InProcess(ort_backend.reference(target)),
                               graph, feeds, threshold=0.99)
    origin = result.nan_origin()
    assert origin["op"] == "reduce" and origin["inf"] > 0 and origin["consumers"] == ["sqrt"]
    assert origin["reference_max_abs"] > 65504  # the fp32 reference sum would overflow fp16 too
    assert result.passes("square_out")  # a gain keeps the cosine: only the overflow fails
    summary = result.summary("always", "always", "layerwise.json.gz")
    (advice,) = recommend("fp16", "onnxruntime", {"device": "CPU", "precision": "fp16"},
                          {"device": "CPU", "precision": "fp16"}, summary, None)
    assert advice["kind"] == "fp16_overflow" and advice["action"]["keep_float"] == ["reduce", "sqrt"]
    assert "overflows fp16" in advice["text"] and "65504" in advice["text"]
    (advice,) = recommend("fp32", "onnxruntime", {"device": "CPU", "precision": "fp32"},  # nothing to keep in fp32
                          {"device": "CPU", "precision": "fp32"}, summary, None)
    assert advice["kind"] == "kernel_nan" and advice["action"]["inspect"] == ["reduce"]
    assert "in an fp32 build" in advice["text"] and "keep" not in advice["text"]


def test_fp16_cast_pairs_that_onnxruntime_removes_map_back(tmp_path):
    model = overflow_model.build(tmp_path / "overflow.onnx")
    half = tmp_path / "half.onnx"
    fp16.convert(model, half, block=[])
    graph = layerwise.Graph(onnx.load(str(model)))
    result = layerwise.compare(InProcess(ort_backend.reference(model)), InProcess(ort_backend.Session(half)),
                               graph, [{"x": overflow_model.sample(0)}], threshold=0.99)
    assert {"relu_out", "square_out", "reduce_out"} <= set(result.stats)
    assert result.unmappable == ["sqrt_cast_to_y"]  # made by the fp16 converter: listed, not dropped


def test_side_file_holds_every_tensor_and_the_summary_only_the_worst(tmp_path):
    reference = chain_model(tmp_path / "ref.onnx")
    target = chain_model(tmp_path / "target.onnx", broken="a", scale=0.5)
    graph = layerwise.Graph(onnx.load(str(reference)))
    result = layerwise.compare(InProcess(ort_backend.reference(reference)),
                               InProcess(ort_backend.Session(target)), graph, samples(3), threshold=0.999)
    result.write_side_file(tmp_path / "side.json.gz")
    first = (tmp_path / "side.json.gz").read_bytes()
    result.write_side_file(tmp_path / "side.json.gz")
    assert (tmp_path / "side.json.gz").read_bytes() == first  # no timestamp inside
    document = json.loads(gzip.decompress(first))
    assert [t["tensor"] for t in document["tensors"]] == [t.name for t in graph.tensors if t.name in result.stats]
    assert all(len(t["per_sample_cosine"]) == 3 for t in document["tensors"])
    summary = result.summary("always", "always", "side.json.gz")
    assert len(summary["worst"]) <= 10 and summary["worst"][0]["passed"] is False
    assert summary["compared"] == len(document["tensors"])


def test_qdq_names_map_back_to_onnx_names():
    assert onnx_name("conv_out_QuantizeLinear_Output") == "conv_out"
    assert onnx_name("conv_out_DequantizeLinear_Output") == "conv_out"
    assert onnx_name("conv_out") == "conv_out"


def test_precision_fallback_advice_names_the_hint():
    (advice,) = recommend("fp32", "openvino", {"device": "CPU", "precision": "fp32"},
                          {"device": "CPU", "precision": "bf16"}, None, None)
    assert advice["kind"] == "precision_fallback" and advice["action"] == {"precision_hint": "f32"}
    assert "INFERENCE_PRECISION_HINT=f32" in advice["text"]
