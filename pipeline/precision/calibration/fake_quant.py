"""One model that measures many calibration tables: the prepared model with each activation
the int8 build quantizes passed through QuantizeLinear -> DequantizeLinear whose scale and
zero point are graph inputs, and each quantized op's weights fake-quantized once (per
channel, symmetric, as the build stores them). Measuring a table is then feeding its
ranges to one ONNX Runtime session, not building and loading an int8 model per table:
calibration=auto's choice between tables (stages/calibrate.py) took 1.3 s per table to
build through ONNX Runtime's quantizer on PP-OCRv4 rec, and a session load per table on top.

What it leaves out of the int8 build is the same for every table (int32 biases, the
runtime's own fusions), so the tables are ranked as the builds would rank them."""

from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from pipeline.backends.onnxruntime import run_each
from pipeline.precision.calibration.sensitivity import fake_quantize_weight
from pipeline.precision.gemm_outputs import float_output_gemms
from pipeline.precision.quantize import scale_and_zero_point, settings_float_ops


class FakeQuantModel:
    """``settings``: pipeline.precision.quantize.QdqSettings (activation type, per-channel weights,
    7-bit weights, quantized op types, outputs quantized too); ``keep_float``: ops left float."""

    def __init__(self, prepared: onnx.ModelProto, table_names: Iterable[str], settings, keep_float: Iterable[str] = ()):
        self.activations = settings.activations
        model = onnx.ModelProto()
        model.CopyFrom(prepared)
        keep_float = set(keep_float) | set(settings_float_ops(prepared, settings))  # as MixedModels keeps them
        self.tensors = _quantized_tensors(model, set(table_names), settings, keep_float)
        _fake_quantize_weights(model, settings, set(keep_float))
        _insert_qdq(model, self.tensors, TensorProto.INT8 if self.activations == "int8" else TensorProto.UINT8)
        self.outputs = [o.name for o in prepared.graph.output]
        self.model = model
        self._session = None

    def run(self, table: Dict[str, dict], samples: Sequence[Dict[str, np.ndarray]],
            outputs: Optional[Sequence[str]] = None) -> List[List[np.ndarray]]:
        """The ``outputs`` (default: every graph output) under ``table``'s ranges, sample by
        sample, as one chunk of measure.OutputJudge's layout (each output's samples stacked
        on axis 0): pass the judge's outputs, which leave integer outputs out."""
        rows = self.run_each(table, samples, outputs)
        count = len(rows[0]) if rows else len(outputs or self.outputs)
        return [[np.concatenate([np.atleast_1d(row[index]) for row in rows]) for index in range(count)]]

    def run_each(self, table: Dict[str, dict], samples: Sequence[Dict[str, np.ndarray]],
                 outputs: Optional[Sequence[str]] = None) -> List[List[np.ndarray]]:
        """Each sample's ``outputs`` under ``table``'s ranges (samples may differ in shape),
        several samples at once on a multi-core machine (onnxruntime.run_each)."""
        if self._session is None:
            from pipeline.backends.onnxruntime import sample_parallel_session

            # ONNX Runtime's Q/DQ graph transformations change what Q/DQ pairs whose scales
            # are graph inputs compute (PP-OCRv4 rec: output cosine 0.987 -> 0.962); its other
            # optimizations stay on (twice as fast as none)
            self._session = sample_parallel_session(self.model, {"session.disable_quant_qdq": "1"})
        ranges, names = self._ranges(table), list(outputs or self.outputs)
        return run_each(self._session, names, [{**sample, **ranges} for sample in samples])

    def _ranges(self, table: Dict[str, dict]) -> Dict[str, np.ndarray]:
        """Each quantized tensor's scale and zero point from its table entry, as ONNX
        Runtime's quantizer writes them into the build (quantize.scale_and_zero_point)."""
        dtype = np.int8 if self.activations == "int8" else np.uint8
        feeds = {}
        for name in self.tensors:
            scale, zero = scale_and_zero_point(table[name], self.activations)
            feeds[_scale(name)] = np.asarray(scale, dtype=np.float32)
            feeds[_zero(name)] = np.asarray(zero, dtype=dtype)
        return feeds


def _scale(name: str) -> str:
    return f"{name}__fq_scale"


def _zero(name: str) -> str:
    return f"{name}__fq_zero"


def _quantized_tensors(model: onnx.ModelProto, in_table: set, settings, keep_float: set) -> List[str]:
    """The activations the build quantizes: the inputs of the quantized ops (and their
    outputs where the backend quantizes outputs) that the table holds."""
    initializers = {t.name for t in model.graph.initializer}
    graph_outputs = {o.name for o in model.graph.output}
    float_gemms = float_output_gemms(model, settings)
    found = []
    for node in model.graph.node:
        if node.op_type not in settings.quantize_ops or node.name in keep_float:
            continue
        names = [i for i in node.input[:2] if i and i not in initializers]
        # not a graph output: the build strips what only rounds the user's output
        if settings.quantizes_output(node.op_type) and node.name not in float_gemms:
            names += [o for o in node.output[:1] if o and o not in graph_outputs]
        found += [n for n in names if n in in_table]
    return list(dict.fromkeys(found))


def _fake_quantize_weights(model: onnx.ModelProto, settings, keep_float: set) -> None:
    """Each quantized op's weight initializer rounded to int8 and back as the mixed search
    does it (sensitivity.fake_quantize_weight: symmetric per output channel, 7-bit where
    the build reduces the range)."""
    initializers = {t.name: t for t in model.graph.initializer}
    done = set()
    for node in model.graph.node:
        if node.op_type not in settings.quantize_ops or node.name in keep_float or len(node.input) < 2:
            continue
        weight = initializers.get(node.input[1])
        if weight is None or weight.name in done or weight.data_type != TensorProto.FLOAT:
            continue
        rounded = fake_quantize_weight(numpy_helper.to_array(weight), node, settings)
        weight.CopyFrom(numpy_helper.from_array(rounded, weight.name))
        done.add(weight.name)


def _insert_qdq(model: onnx.ModelProto, tensors: List[str], zero_type: int) -> None:
    """T -> QuantizeLinear -> DequantizeLinear -> T__fq for each tensor, right after the
    node that makes T; every reader of T reads T__fq (one shared Q/DQ pair, as ONNX
    Runtime's quantizer places it), and a graph output named T is the fake-quantized value."""
    graph = model.graph
    wanted = set(tensors)
    outputs = {o.name for o in graph.output}

    def qdq(name: str) -> list:
        graph.input.append(helper.make_tensor_value_info(_scale(name), TensorProto.FLOAT, []))
        graph.input.append(helper.make_tensor_value_info(_zero(name), zero_type, []))
        source = f"{name}__fq_source" if name in outputs else name
        made = [helper.make_node("QuantizeLinear", [source, _scale(name), _zero(name)], [f"{name}__fq_q"],
                                 name=f"{name}__fq_quantize"),
                helper.make_node("DequantizeLinear", [f"{name}__fq_q", _scale(name), _zero(name)], [f"{name}__fq"],
                                 name=f"{name}__fq_dequantize")]
        if name in outputs:
            made.append(helper.make_node("Identity", [f"{name}__fq"], [name], name=f"{name}__fq_output"))
        return made

    graph_inputs = {i.name for i in graph.input}
    ordered = [n for name in tensors if name in graph_inputs for n in qdq(name)]
    for node in graph.node:
        node.input[:] = [f"{i}__fq" if i in wanted else i for i in node.input]
        made = [n for o in node.output if o in wanted for n in qdq(o)]
        node.output[:] = [f"{o}__fq_source" if o in wanted and o in outputs else o for o in node.output]
        ordered += [node, *made]
    del graph.node[:]
    graph.node.extend(ordered)
