"""INT8 QDQ models from parity's calibration table, through ONNX Runtime's quantizer
(fed parity's ranges via its calibration-cache file, so ORT computes no ranges itself)."""

from __future__ import annotations

import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np

from pipeline import backends
from pipeline.precision.narrow_convs import widen_narrow_convs
from pipeline.precision.gemm_bias import flatten_gemm_bias, gemm_bias_fixes  # noqa: F401 - re-exported
from pipeline.precision import gemm_outputs
from pipeline.precision.passthrough import (CLAMPS, SWISH_OPS, float_neighbours, fold_relus, int8_after, passthrough_for,
                                           producers_and_readers, quantizer_inputs, swish_ops)
from pipeline.errors import InputError, first_line

RANGE_FLOOR = 1e-6  # the narrowest activation range written (an all-zero tensor still gets a scale)


def activation_range(entry: dict, activations: str) -> Tuple[float, float]:
    """The [low, high] an activation is quantized over: symmetric +-threshold for int8;
    for uint8 the observed [min, max] clipped to +-threshold, always containing 0."""
    threshold = max(float(entry["threshold"]), RANGE_FLOOR)
    if activations == "int8":
        return -threshold, threshold
    low = min(max(float(entry["min"]), -threshold), 0.0)
    high = max(min(float(entry["max"]), threshold), 0.0)
    if high - low < RANGE_FLOOR:
        high = low + RANGE_FLOOR
    return low, high


def scale_and_zero_point(entry: dict, activations: str) -> Tuple[np.float32, int]:
    """The scale and zero point ONNX Runtime's quantizer writes for an activation with this
    table entry (its compute_scale_zp: float32 range ends that include 0, a float64 scale,
    the zero point rounded half to even; symmetric for int8). Every fake quantization
    (calibration=auto, the mixed search) uses these: a zero point of 128 where the build
    has 127 (float64 arithmetic on a symmetric range) moved PP-OCRv4 rec's cosine by 0.03."""
    qmin, qmax = (-127, 127) if activations == "int8" else (0, 255)  # symmetric int8: the restricted range
    low, high = (np.float32(v) for v in activation_range(entry, activations))
    low, high = min(low, np.float32(0)), max(high, np.float32(0))
    if activations == "int8":
        low, high = -max(-low, high), max(-low, high)
    scale = (np.float64(high) - np.float64(low)) / np.float64(qmax - qmin)
    zero = 0 if activations == "int8" else int(np.round(qmin - low / scale))
    return np.float32(scale), zero


def ort_tensors_data(table: Dict[str, dict], activations: str):
    from onnxruntime.quantization.calibrate import CalibrationMethod, TensorData, TensorsData

    ranges = {}
    for name, entry in table.items():
        low, high = activation_range(entry, activations)
        ranges[name] = TensorData(lowest=np.float32(low), highest=np.float32(high))
    return TensorsData(CalibrationMethod.MinMax, ranges)


def write_ort_cache(table: Dict[str, dict], activations: str, path: Path) -> None:
    """ONNX Runtime's own calibration-cache JSON (quantize_static(calibration_cache_path=...))."""
    from onnxruntime.quantization.calibrate import save_tensors_data

    save_tensors_data(ort_tensors_data(table, activations), path)


def needs_reduce_range(backend: Optional[str] = None) -> bool:
    """u8 x s8 int8 kernels use VPMADDUBSW on x86 CPUs without VNNI, whose 16-bit
    intermediate sums saturate (ONNX Runtime's quantization docs); 7-bit weights avoid it.
    Measured here for ONNX Runtime and OpenVINO alike (docs/calibration.md). An ISA cap
    below VNNI counts as none for OpenVINO (environment.int8_vnni)."""
    from pipeline.environment import cpu, int8_vnni

    return cpu()["machine"] in ("x86_64", "AMD64") and not int8_vnni(backend)


WEIGHTED_OPS = ("Conv", "ConvTranspose", "Gemm", "MatMul")
# Where outputs are quantized (ONNX Runtime's placement) these ops' outputs stay float unless
# precision.quantize_outputs=true: ONNX Runtime runs DQ -> MatMul without a Q after it as
# MatMulIntegerToFloat, int8 all the same, and a transformer's MatMul outputs (the FFN's
# before the residual Add) hold outliers one per-tensor range cannot: all-MiniLM-L6-v2
# embedding cosine 0.944 -> 0.989 (docs/calibration.md, "Transformers"). A Gemm's output
# stays float where int8 does not flow on from it (gemm_outputs.py).
FLOAT_OUTPUT_OPS = ("MatMul",)


@dataclass(frozen=True)
class QdqSettings:
    """How the QDQ model is quantized: activation type, weight granularity, 7-bit weights,
    which op types get quantized inputs, and whether their outputs are quantized too."""

    activations: str = "uint8"
    per_channel: bool = True
    reduce_range: bool = False
    quantize_ops: Tuple[str, ...] = WEIGHTED_OPS
    quantize_outputs: bool = True
    # op types whose outputs stay float even where outputs are quantized (FLOAT_OUTPUT_OPS)
    float_output_ops: Tuple[str, ...] = ()
    # MatMuls of two activations (attention's Q K^T and probabilities x V) quantized too
    activation_matmuls: bool = True
    # op types given Q/DQ around them only so that int8 flows through (passthrough_ranges)
    passthrough_ops: Tuple[str, ...] = ()
    # SiLU's Sigmoid and Mul after a quantized op quantized too (passthrough.swish_ops)
    swish: bool = False
    # the fewest output channels the runtime's fast int8 Conv takes: others widened (narrow_convs); 0: never
    conv_block: int = 0

    def quantizes_output(self, op_type: str) -> bool:
        """Whether an int8 op of this type gets a Q/DQ pair on its output."""
        return self.quantize_outputs and op_type not in self.float_output_ops

    @classmethod
    def resolve(cls, precision, backend: str) -> "QdqSettings":
        """From a PrecisionConfig; nulls resolved for this machine and this backend: outputs
        quantized unless the backend's ``qdq_placement`` is "inputs" (its int8 comes from
        quantized op inputs alone, OpenVINO's low-precision transformations; ONNX Runtime
        fuses DequantizeLinear -> op -> QuantizeLinear into its int8 kernels and runs the op
        in float when the output Q is missing)."""
        reduce_range = needs_reduce_range(backend) if precision.reduce_range is None else precision.reduce_range
        outputs = precision.quantize_outputs
        if outputs is None:
            outputs = backends.capabilities(backend).qdq_placement != "inputs"
        # null: MatMul outputs float (FLOAT_OUTPUT_OPS); true: every quantized op's output
        float_outputs = FLOAT_OUTPUT_OPS if precision.quantize_outputs is None and outputs else ()
        swish = precision.quantize_swish
        if swish is None:
            swish = backends.capabilities(backend).qdq_swish and outputs
        return cls(precision.activations.value, precision.per_channel, reduce_range,
                   tuple(precision.quantize_ops), outputs, float_outputs, precision.quantize_activation_matmuls,
                   passthrough_for(precision, backends.capabilities(backend), outputs), swish,
                   backends.capabilities(backend).qdq_conv_block if outputs else 0)

    @property
    def swish_after(self) -> Tuple[str, ...]:
        """The quantized op types whose SiLU is quantized too: those whose outputs are (a
        SwiGLU's gate MatMul keeps its float output, FLOAT_OUTPUT_OPS); none where swish is off
        or quantize_ops names Sigmoid or Mul itself (the user's own placement)."""
        if not self.swish or set(SWISH_OPS) & set(self.quantize_ops):
            return ()
        return tuple(t for t in self.quantize_ops if self.quantizes_output(t))

    def swish_ops(self, model) -> List[str]:
        """The model's SiLU ops these settings quantize (passthrough.swish_ops)."""
        return swish_ops(model, self.swish_after)

    @property
    def folds_relus(self) -> bool:
        """The int8 build folds each quantized Relu or Clip into the Q before it (passthrough.fold_relus)."""
        return any(op_type in self.passthrough_ops for op_type in CLAMPS)

    @property
    def rewrites_for_runtime(self) -> bool:
        """Whether rewrite_for_runtime can change a model (where not, it need not be loaded)."""
        return self.folds_relus or bool(self.conv_block)

    def rewrite_for_runtime(self, model) -> dict:
        """In place, after the mixed derivations and the refinements (which read the graph as
        the quantizer wrote it): pass-through Relus folded, narrow Convs widened. What changed."""
        folded = fold_relus(model) if self.folds_relus else 0
        widened = widen_narrow_convs(model, self.conv_block) if self.conv_block else []
        return {"relus_folded": folded, **({"convs_widened": widened} if widened else {})}

    @property
    def derives_mixed(self) -> bool:
        """Mixed models are derived from the all-int8 one (keep_in_float): every quantized op
        type is a weighted one. Otherwise the quantizer rewrites more than Q/DQ pairs (it fuses
        a quantized Relu into its QuantizeLinear) and builds each mixed model itself."""
        return set(self.quantize_ops) <= set(WEIGHTED_OPS)

    def float_neighbours(self, model, float_ops: Iterable[str]) -> set:
        """``float_ops`` with the pass-through and SiLU ops beside them (passthrough.float_neighbours)."""
        return float_neighbours(model, float_ops, self.passthrough_ops, self.swish_ops(model))

    def describe(self) -> dict:
        return {"weights": "int8 symmetric, " + ("per channel" if self.per_channel else "per tensor"),
                "activations": self.activations + (" symmetric" if self.activations == "int8" else " asymmetric")
                + ", per tensor", "bias": "int32", "reduce_range": self.reduce_range,
                "quantized_ops": list(self.quantize_ops),
                "quantized": "inputs and outputs" if self.quantize_outputs else "inputs",
                **({"float_outputs": list(self.float_output_ops)} if self.quantize_outputs and self.float_output_ops
                   else {}),
                **({} if self.activation_matmuls or "MatMul" not in self.quantize_ops
                   else {"activation_matmuls": "float (precision.quantize_activation_matmuls)"}),
                **({"passthrough_ops": list(self.passthrough_ops)} if self.passthrough_ops else {}),
                **({"swish": "quantized (SiLU's Sigmoid and Mul after a quantized op)"} if self.swish else {})}


def _is_depthwise(node, weights: Dict[str, tuple]) -> bool:
    """A Conv whose every group has one input channel (weight shape [C_out, 1, ...]) and
    more than one group."""
    group = next((attr.i for attr in node.attribute if attr.name == "group"), 1)
    shape = weights.get(node.input[1]) if len(node.input) > 1 else None
    return node.op_type == "Conv" and group > 1 and shape is not None and len(shape) > 1 and shape[1] == 1


def activation_matmuls(model) -> List[str]:
    """MatMul ops neither of whose inputs is a constant: attention's scores (Q K^T) and its
    probabilities times V. Kept float by default (QdqSettings.activation_matmuls), as NNCF's
    transformer preset keeps Softmax -> MatMul and ONNX Runtime's quantize_dynamic every
    MatMul without a constant B (docs/calibration.md, "Transformers")."""
    initializers = {t.name for t in model.graph.initializer}
    return [node.name for node in model.graph.node
            if node.op_type == "MatMul" and not any(name in initializers for name in node.input)]


def settings_float_ops(model, settings: QdqSettings) -> List[str]:
    """Ops of the quantized types that these settings keep float in every int8 model: the
    MatMuls of two activations unless settings.activation_matmuls."""
    if settings.activation_matmuls or "MatMul" not in settings.quantize_ops:
        return []
    return activation_matmuls(model)


def _is_conv_transpose(node, weights) -> bool:
    return node.op_type == "ConvTranspose"


# op kinds a backend may keep in float in its int8 builds (Capabilities.float_op_kinds)
OP_KINDS = {"depthwise": _is_depthwise, "conv_transpose": _is_conv_transpose}


def backend_float_ops(backend, target, model, quantize_ops) -> list:
    """The model's quantized ops (of ``quantize_ops`` types) that the backend's int8 builds
    keep in float for this target (backends.float_op_kinds), in graph order: what build,
    sensitivity and verify's int8 baseline all keep float."""
    return ops_of_kinds(model, backends.float_op_kinds(backend, target), quantize_ops)


def ops_of_kinds(model, kinds: Iterable[str], op_types: Iterable[str]) -> List[str]:
    """Names of the model's ops of these kinds (OP_KINDS) among ``op_types`` (the quantized
    op types), in graph order."""
    weights = {init.name: tuple(init.dims) for init in model.graph.initializer}
    tests, op_types = [OP_KINDS[kind] for kind in kinds], set(op_types)
    return [node.name for node in model.graph.node
            if node.op_type in op_types and any(test(node, weights) for test in tests)]


def int8_op_count(model) -> int:
    """Ops of WEIGHTED_OPS that read a dequantized input: how many ops a QDQ model runs int8."""
    dequantized = {out for node in model.graph.node if node.op_type == "DequantizeLinear" for out in node.output}
    return sum(node.op_type in WEIGHTED_OPS and any(name in dequantized for name in node.input)
               for node in model.graph.node)


class QuantizerFailed(InputError):
    """ONNX Runtime's quantizer raised on a valid model; the message names the op and the
    setting that avoids it. The run still writes its report (``partial``: the finished
    stages' records and results, set by the stage that ran the quantizer)."""

    label = "cannot quantize"
    partial = None

    def with_run(self, ctx) -> "QuantizerFailed":
        self.partial = (ctx.records, ctx.results)
        return self


def build_qdq(model_path: Path, table: Dict[str, dict], out_path: Path, settings: QdqSettings = QdqSettings(),
              keep_float: Iterable[str] = ()) -> List[dict]:
    """Weights symmetric int8 (per channel by default), activations per tensor, bias int32,
    only at the op types of ``settings.quantize_ops``; nodes named in keep_float stay in
    float. The model's outputs stay float. Returns the Gemm biases reshaped for the
    quantizer (gemm_bias_fixes)."""
    import onnx

    prepared = onnx.load(str(model_path))
    keep_float = list(keep_float)
    onnx.save(MixedModels(prepared, table, settings, always_float=keep_float).build(keep_float), str(out_path))
    return gemm_bias_notes(prepared, settings)


def gemm_bias_notes(prepared, settings: QdqSettings) -> List[dict]:
    """The Gemm biases the quantizer is given as vectors (flatten_gemm_bias), as the build records them."""
    return [{"op": node, "bias_from": list(old), "bias_to": [size]}
            for node, _, old, size in gemm_bias_fixes(prepared)] if settings.per_channel else []


FLOAT_TYPES = (1, 10, 11, 16)  # ONNX FLOAT, FLOAT16, DOUBLE, BFLOAT16


def decision_ops(model, quantize_ops: Iterable[str]) -> List[str]:
    """Ops of the quantized types that produce an integer or boolean output (ArgMax, TopK
    indices, comparisons, casts to int): kept float, an int8 input would change decisions
    (ties, near ties) that verify compares exactly."""
    from pipeline.precision.calibration.statistics import element_types

    types, kinds = element_types(model), set(quantize_ops)
    return [node.name for node in model.graph.node if node.op_type in kinds
            and any(types.get(o, 1) not in FLOAT_TYPES for o in node.output if o)]


class MixedModels:
    """QDQ models of one prepared model and one table with different ops kept in float.
    ONNX Runtime's quantizer runs once, for the all-int8 model; each mixed model is derived
    from it (keep_in_float), identical to what the quantizer builds with those ops
    excluded. Where the quantized op types include ops the quantizer rewrites beyond
    adding Q/DQ pairs (it fuses a quantized Relu into its QuantizeLinear), the quantizer
    builds every mixed model itself."""

    def __init__(self, prepared, table: Dict[str, dict], settings: QdqSettings, always_float: Iterable[str] = (),
                 refine=None):
        """always_float: ops float in every model (precision.keep_float), left out of the
        quantizer's own run too (names the prepared graph lacks are ignored). refine: the
        all-int8 model -> the same refined (weight rounding, bias correction as the build
        refines it), once, before every mixed model derives from it."""
        self.prepared, self.table, self.settings, self.refine = prepared, table, settings, refine
        names = {node.name for node in prepared.graph.node}
        self.always_float = sorted((set(always_float) | set(decision_ops(prepared, settings.quantize_ops))
                                    | set(settings_float_ops(prepared, settings))) & names)
        self._all_int8 = None

    def build(self, keep_float: Iterable[str] = (), quantized_inputs: Iterable[str] = ()):
        """quantized_inputs: float ops that read their activations as the int8 model gives them
        (keep_in_float); only where mixed models are derived."""
        keep_float = sorted(self.settings.float_neighbours(self.prepared, set(keep_float) | set(self.always_float)))
        if keep_float and not self.settings.derives_mixed:
            return quantize_static_qdq(self.prepared, self.table, self.settings, keep_float)
        if self._all_int8 is None:
            self._all_int8 = quantize_static_qdq(self.prepared, self.table, self.settings, sorted(
                self.settings.float_neighbours(self.prepared, self.always_float)))
            if self.refine is not None:
                self._all_int8 = self.refine(self._all_int8)
        return keep_in_float(self._all_int8, self.prepared, keep_float, self.settings, quantized_inputs)


def quantize_static_qdq(prepared, table: Dict[str, dict], settings: QdqSettings, keep_float: Iterable[str] = ()):
    """ONNX Runtime's quantizer fed parity's ranges; output Q/DQ pairs that only round what
    the user reads are removed. With per-channel weights, one-row Gemm biases are given as
    vectors first (flatten_gemm_bias). A quantizer failure is a QuantizerFailed naming the
    op and the setting that avoids it."""
    import onnx

    source = onnx.ModelProto()
    source.CopyFrom(prepared)
    if settings.per_channel:
        flatten_gemm_bias(source)
    keep_float = list(keep_float)
    try:
        model = _run_quantizer(source, table, settings, keep_float)
    except Exception as err:  # noqa: BLE001 - ORT's quantizer raises bare numpy/Python errors
        raise _explain_failure(source, table, settings, keep_float, err) from err
    if settings.quantize_outputs and "MatMul" in settings.float_output_ops:
        requantize_unfused_matmuls(model, table, settings.activations)
    if gemm_outputs.applies(settings):
        gemm_outputs.float_gemm_outputs(model, gemm_outputs.flowing_into(settings))
    strip_output_qdq(model)
    return model


REQUANTIZED = "_requant_QuantizeLinear"  # the Q of a pair requantize_unfused_matmuls put back


def requantize_unfused_matmuls(model, table: Dict[str, dict], activations: str) -> List[str]:
    """A Q/DQ pair back on the output of each int8 MatMul whose output does not go straight
    into one bias Add: ONNX Runtime runs DQ -> MatMul -> Add(bias) with a float output as
    MatMulIntegerToFloat, but DQ -> MatMul -> Relu stays a float MatMul (seen on ORT 1.31),
    so such a MatMul keeps its quantized output as before (FLOAT_OUTPUT_OPS). Returns them."""
    from onnx import TensorProto, helper, numpy_helper

    graph = model.graph
    constants = {t.name for t in graph.initializer}
    producer, readers = producers_and_readers(graph)
    outputs, done, nodes = {o.name for o in graph.output}, [], list(graph.node)
    for node in nodes:
        out = node.output[0] if node.op_type == "MatMul" else None
        if out is None or out in outputs or out not in table:
            continue
        if not all(getattr(producer.get(i), "op_type", None) == "DequantizeLinear" for i in node.input[:2]):
            continue  # a MatMul kept in float
        after = readers.get(out, [])
        if len(after) == 1 and after[0].op_type == "Add" and any(i in constants for i in after[0].input):
            continue
        scale, zero = scale_and_zero_point(table[out], activations)
        zero_type = TensorProto.INT8 if activations == "int8" else TensorProto.UINT8
        names = [f"{out}_requant_scale", f"{out}_requant_zero", f"{out}_requant_q", f"{out}_requant"]
        graph.initializer.extend([numpy_helper.from_array(np.asarray(scale, np.float32), names[0]),
                                  helper.make_tensor(names[1], zero_type, [], [zero])])
        for reader in after:
            reader.input[:] = [names[3] if i == out else i for i in reader.input]
        at = list(graph.node).index(node) + 1
        graph.node.insert(at, helper.make_node("DequantizeLinear", [names[2], names[0], names[1]], [names[3]],
                                               name=f"{out}_requant_DequantizeLinear"))
        graph.node.insert(at, helper.make_node("QuantizeLinear", [out, names[0], names[1]], [names[2]],
                                               name=f"{out}{REQUANTIZED}"))
        done.append(node.name)
    return done


def _run_quantizer(source, table: Dict[str, dict], settings: QdqSettings, keep_float: Sequence[str]):
    import onnx
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    symmetric = settings.activations == "int8"
    options = {"WeightSymmetric": True, "ActivationSymmetric": symmetric}
    if not settings.quantize_outputs:
        options["OpTypesToExcludeOutputQuantization"] = list(settings.quantize_ops)
    elif settings.float_output_ops:
        options["OpTypesToExcludeOutputQuantization"] = list(settings.float_output_ops)
    table, op_types, keep_float = quantizer_inputs(source, table, settings.quantize_ops, settings.passthrough_ops,
                                                   keep_float, options, settings.swish_after)
    with tempfile.TemporaryDirectory(prefix="parity-qdq-") as scratch:
        cache, model_in, out = (Path(scratch) / name for name in ("ranges.json", "prepared.onnx", "quantized.onnx"))
        write_ort_cache(table, settings.activations, cache)
        onnx.save(source, str(model_in))
        quiet = logging.getLogger().level
        logging.getLogger().setLevel(logging.ERROR)  # ORT logs advice on the root logger
        try:
            quantize_static(
                str(model_in), str(out), None,
                calibration_cache_path=str(cache),
                calibrate_method=CalibrationMethod.MinMax,
                quant_format=QuantFormat.QDQ,
                op_types_to_quantize=op_types,
                per_channel=settings.per_channel,
                reduce_range=settings.reduce_range,
                activation_type=QuantType.QInt8 if symmetric else QuantType.QUInt8,
                weight_type=QuantType.QInt8,
                nodes_to_exclude=list(keep_float),
                extra_options=options,
            )
        finally:
            logging.getLogger().setLevel(quiet)
        return onnx.load(str(out))


def _explain_failure(source, table, settings: QdqSettings, keep_float: Sequence[str], err) -> QuantizerFailed:
    """The op whose quantization alone fails (ONNX Runtime's errors name none), and whether
    per-tensor weights avoid it."""
    from dataclasses import replace

    ops = [n.name for n in source.graph.node if n.op_type in settings.quantize_ops and n.name not in keep_float]

    def fails(subset: Sequence[str], settings: QdqSettings = settings) -> bool:
        try:
            _run_quantizer(source, table, settings, [*keep_float, *(op for op in ops if op not in subset)])
        except Exception:  # noqa: BLE001 - the same failure, or another one of that op
            return True
        return False

    culprit = _first_failing(ops, fails)
    said = first_line(err)
    if culprit is None:
        return QuantizerFailed(f"ONNX Runtime's quantizer fails on this model ({type(err).__name__}: {said}) and on "
                               "no single op alone; try precision.per_channel=false, or precision=fp32")
    op_type = next(n.op_type for n in source.graph.node if n.name == culprit)
    per_tensor = settings.per_channel and not fails([culprit], replace(settings, per_channel=False))
    fix = (f"precision.per_channel=false or 'precision.keep_float=[{culprit}]' avoids it" if per_tensor
           else f"'precision.keep_float=[{culprit}]' avoids it")
    return QuantizerFailed(f"ONNX Runtime's quantizer fails on op {culprit!r} ({op_type}): "
                           f"{type(err).__name__}: {said}; {fix}")


def _first_failing(ops: List[str], fails: Callable[[Sequence[str]], bool]) -> Optional[str]:
    """The op that fails when quantized alone, halving the candidates at each step (a
    failure is taken to come from one op); None when the one found does not fail alone."""
    while len(ops) > 1:
        half = ops[:len(ops) // 2]
        ops = half if fails(half) else ops[len(ops) // 2:]
    return ops[0] if ops and fails(ops) else None


def keep_in_float(quantized, prepared, float_ops: Iterable[str], settings: QdqSettings,
                  quantized_inputs: Iterable[str] = ()):
    """A copy of ``quantized`` (every op of WEIGHTED_OPS in int8) with the ops named in
    ``float_ops`` and their pass-through neighbours (float_neighbours) back in float: their weights and biases are the prepared model's, and an
    activation keeps its Q/DQ pair only while an op still in int8 produces (with output
    quantization) or reads it, which is where ONNX Runtime's quantizer puts pairs for
    ``nodes_to_exclude=float_ops`` (checked graph for graph in tests/test_quantize.py), or
    while a float op of ``quantized_inputs`` reads it (it reads what its int8 self read).
    Deriving a mixed model costs milliseconds where re-running the quantizer costs a third
    of a second on PP-OCR, and the selection in stages/sensitivity.py measures dozens."""
    import onnx

    swish = settings.swish_ops(prepared)  # one scan of the graph: a search derives dozens of models
    float_ops = float_neighbours(prepared, float_ops, settings.passthrough_ops, swish)
    model = onnx.ModelProto()
    model.CopyFrom(quantized)
    if not float_ops:
        return model
    graph = model.graph
    nodes = {node.name: node for node in graph.node}
    original = {node.name: node for node in prepared.graph.node}
    absent = sorted(float_ops - nodes.keys())
    if absent:
        raise KeyError(f"no op named {absent[0]!r} in the quantized model")
    weights = {init.name: init for init in prepared.graph.initializer}
    producer = {out: node for node in graph.node for out in node.output}
    in_int8 = int8_after(graph, producer, settings.quantize_ops, settings.passthrough_ops, float_ops, swish)

    restored = []  # (node, input index, float initializer name): set once their DQ is gone
    for name in float_ops:
        node = nodes[name]
        del node.input[len(original[name].input):]  # a bias that bias correction gave an op without one
        for index, was in enumerate(original[name].input):
            now = producer.get(node.input[index])
            if was in weights and now is not None and now.op_type == "DequantizeLinear":
                restored.append((node, index, was))
                node.input[index] = ""
    _drop_unneeded_pairs(graph, in_int8, settings.quantize_outputs, settings.float_output_ops, set(quantized_inputs))
    _remove_dead_qdq(graph)
    taken = {out for node in graph.node for out in node.output} | {i.name for i in graph.initializer} | \
        {i.name for i in graph.input}
    added: Dict[str, str] = {}
    for node, index, was in restored:
        if was not in added:
            added[was] = was if was not in taken else _fresh_name(f"{was}_float", taken)
            taken.add(added[was])
            copy = graph.initializer.add()
            copy.CopyFrom(weights[was])
            copy.name = added[was]
        node.input[index] = added[was]
    return model


def _drop_unneeded_pairs(graph, in_int8: set, quantize_outputs: bool, float_output_ops: Iterable[str] = (),
                         reads_quantized: frozenset = frozenset()) -> None:
    """Remove each activation's Q -> DQ pair unless an int8 op produces the activation (and
    outputs are quantized) or reads the pair's result, or an op of ``reads_quantized`` reads
    it; its readers get the float tensor."""
    producer, readers = producers_and_readers(graph)
    outputs = {o.name for o in graph.output}
    for quantize in [n for n in graph.node if n.op_type == "QuantizeLinear"]:
        source = quantize.input[0]
        made_by = producer.get(source)
        if quantize_outputs and made_by is not None and made_by.name in in_int8 \
                and (made_by.op_type not in float_output_ops or quantize.name.endswith(REQUANTIZED)):
            continue
        dequantized = [dq.output[0] for dq in readers.get(quantize.output[0], []) if dq.op_type == "DequantizeLinear"]
        if any(name in outputs for name in dequantized) or \
                any(reader.name in in_int8 or reader.name in reads_quantized
                    for name in dequantized for reader in readers.get(name, [])):
            continue
        for name in dequantized:
            for reader in readers.get(name, []):
                for index, value in enumerate(reader.input):
                    if value == name:
                        reader.input[index] = source


def _remove_dead_qdq(graph) -> None:
    """Q/DQ nodes whose results nobody reads, and the initializers only they read."""
    outputs = {o.name for o in graph.output}
    before = {name for node in graph.node for name in node.input}
    while True:
        read = {name for node in graph.node for name in node.input} | outputs
        dead = [node for node in graph.node if node.op_type in ("QuantizeLinear", "DequantizeLinear")
                and not any(out in read for out in node.output)]
        if not dead:
            break
        for node in dead:
            graph.node.remove(node)
    _drop_unread_initializers(graph, before)


def _drop_unread_initializers(graph, before: set) -> None:
    """Initializers that were read (names in ``before``) and no longer are."""
    read = {name for node in graph.node for name in node.input}
    for init in [i for i in graph.initializer if i.name in before and i.name not in read]:
        graph.initializer.remove(init)


def _fresh_name(base: str, taken: set) -> str:
    name, number = base, 1
    while name in taken:
        number += 1
        name = f"{base}_{number}"
    return name


def strip_output_qdq(model) -> int:
    """Remove QuantizeLinear -> DequantizeLinear pairs whose result is a graph output: they
    save no compute and only round what the user reads. Returns how many were removed."""
    outputs = {o.name for o in model.graph.output}
    producer = {o: n for n in model.graph.node for o in n.output}
    read = {name for node in model.graph.node for name in node.input}
    removed = 0
    for name in outputs:
        dequantize = producer.get(name)
        quantize = producer.get(dequantize.input[0]) if dequantize is not None and dequantize.op_type == "DequantizeLinear" else None
        if quantize is None or quantize.op_type != "QuantizeLinear":
            continue
        source = quantize.input[0]
        if any(source in n.input for n in model.graph.node if n is not quantize) or source in outputs:
            continue  # the float tensor is used elsewhere too: leave the graph as it is
        producer[source].output[list(producer[source].output).index(source)] = name
        model.graph.node.remove(quantize)
        model.graph.node.remove(dequantize)
        removed += 1
    if removed:
        _drop_unread_initializers(model.graph, before=read)
    return removed
