"""Gemm outputs left float where int8 does not flow on from them (ONNX Runtime's placement).

ONNX Runtime runs DequantizeLinear -> Gemm without a QuantizeLinear after it as QGemm with a
float output: int8 all the same. Where the Gemm's reader is another quantized op or an op
that int8 passes through (a Relu before the next Gemm: a classifier's MLP head), its output's
Q/DQ pair lets int8 flow on and stays. Elsewhere the pair only rounds: a fixed-shape
transformer's MatMul + Add, which the prepare step fuses into Reshape -> Gemm -> Reshape,
feeds a GELU, a residual Add or the attention's reshapes, and there the pair cost accuracy
and speed (ONNX Runtime copies the DequantizeLinear for each reader, and the GELU pattern
then reads two tensors and is not fused: a ViT-tiny at 224 ran int8 at 1.08x fp32, 1.28x
without the pairs; docs/calibration.md, "What stays float")."""

from __future__ import annotations

from typing import Iterable, List, Set

from pipeline.precision.passthrough import SWISH_OPS, producers_and_readers, remove_nodes


def flowing_into(settings) -> List[str]:
    """The op types int8 flows on into from a Gemm's output: the quantized ones, those it
    passes through, and a SiLU's where the settings quantize it after a Gemm (QdqSettings)."""
    swish = SWISH_OPS if "Gemm" in settings.swish_after else ()
    return [*settings.quantize_ops, *settings.passthrough_ops, *swish]


def applies(settings) -> bool:
    """Outputs quantized with the default exceptions (FLOAT_OUTPUT_OPS), not every output."""
    return bool(settings.quantize_outputs and settings.float_output_ops)


def float_output_gemms(model, settings) -> Set[str]:
    """The Gemms of the float ``model`` whose outputs the build leaves float (float_gemm_outputs'
    rule), for the simulations of the build (fake quantization, the op-level screen)."""
    if not applies(settings):
        return set()
    _, readers = producers_and_readers(model.graph)
    into = set(flowing_into(settings))
    return {node.name for node in model.graph.node if node.op_type == "Gemm"
            and not any(reader.op_type in into for reader in readers.get(node.output[0], []))}


def float_gemm_outputs(model, into: Iterable[str]) -> List[str]:
    """Remove the output Q -> DQ pair of each int8 Gemm none of whose readers is of an op type
    in ``into`` (flowing_into's) or a graph output; its readers get the float tensor. Returns
    the Gemms changed."""
    graph = model.graph
    producer, readers = producers_and_readers(graph)
    outputs, into, changed = {o.name for o in graph.output}, set(into), []
    for gemm in [n for n in graph.node if n.op_type == "Gemm"]:
        if getattr(producer.get(gemm.input[0]), "op_type", None) != "DequantizeLinear":
            continue  # a Gemm kept in float
        after = readers.get(gemm.output[0], [])
        if len(after) != 1 or after[0].op_type != "QuantizeLinear":
            continue
        quantize = after[0]
        pairs = readers.get(quantize.output[0], [])
        if not pairs or any(dq.op_type != "DequantizeLinear" or dq.output[0] in outputs for dq in pairs):
            continue
        if any(reader.op_type in into for dq in pairs for reader in readers.get(dq.output[0], [])):
            continue
        for dq in pairs:
            for reader in readers.get(dq.output[0], []):
                reader.input[:] = [gemm.output[0] if name == dq.output[0] else name for name in reader.input]
        remove_nodes(graph, [quantize, *pairs])
        changed.append(gemm.name)
    return changed
