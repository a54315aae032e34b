"""Narrow int8 convolutions widened to the runtime's kernel block (Capabilities.qdq_conv_block).

ONNX Runtime's int8 convolution runs its fast (symmetric, direct) kernels only where a Conv
has at least 16 output channels, in multiples of 8 (4 with AVX-512), and input channels in
multiples of 4 (MLAS's MlasConvSymPackWSize); any other Conv falls to a general path about
twice as slow (a segmentation head's 64 -> 1 channels at 320x320: 7.0 against 3.7 ms on AMX;
on U^2-Net-p's largest head 11.0 against 2.3 ms). The int8 build gives such a Conv zero
filters up to the next count the fast kernels take and slices the quantized output back to
its own channels: the same values, the graph's tensor names and shapes outside the Conv
unchanged (docs/calibration.md, "Narrow convolutions")."""

from __future__ import annotations

from typing import List

import numpy as np

from pipeline.precision.passthrough import producers_and_readers

WIDE_SUFFIX = "_widened"
OUTPUT_ALIGNMENT, INPUT_ALIGNMENT = 8, 4  # the fast kernels' channel multiples (AVX2's, the strictest)


def widened_channels(outputs: int, inputs: int, block: int) -> int:
    """The output channels the fast kernels take for a Conv of these, or ``outputs`` where
    widening gains nothing (input channels off their multiple: a 3-channel image's first Conv)."""
    if inputs % INPUT_ALIGNMENT:
        return outputs
    return max(block, -(-outputs // OUTPUT_ALIGNMENT) * OUTPUT_ALIGNMENT)


def widen_narrow_convs(model, block: int) -> List[str]:
    """In place: each quantized Conv (group 1, weights through a DequantizeLinear of a constant,
    its output read by one QuantizeLinear alone) whose output channels the fast kernels do not
    take (widened_channels) gets zero filters up to a count they take and a Slice of the
    quantized output. Returns the Convs' names."""
    from onnx import helper, numpy_helper

    graph = model.graph
    constants = {t.name: t for t in graph.initializer}
    producer, readers = producers_and_readers(graph)
    outputs = {o.name for o in graph.output}
    widened, slices = [], {}
    for conv in [node for node in graph.node if node.op_type == "Conv"]:
        quantize = _only_quantize_reader(conv, readers, outputs)
        weights = _constant_dequantize(conv.input[1], producer, constants)
        if quantize is None or weights is None or _group(conv) != 1 or _shared(conv, producer, readers):
            continue
        channels, inputs = numpy_helper.to_array(constants[weights.input[0]]).shape[:2]
        wide = widened_channels(channels, inputs, block)
        if wide == channels or not _pad_inputs(conv, weights, producer, constants, channels, wide):
            continue
        narrow = quantize.output[0]
        conv.output[0] += WIDE_SUFFIX
        quantize.input[0], quantize.output[0] = conv.output[0], narrow + WIDE_SUFFIX
        bounds = [numpy_helper.from_array(np.array(v, dtype=np.int64), f"{conv.name}{WIDE_SUFFIX}_{k}")
                  for k, v in (("starts", [0]), ("ends", [channels]), ("axes", [1]))]
        graph.initializer.extend(bounds)
        slices[id(quantize)] = helper.make_node("Slice", [quantize.output[0], *(b.name for b in bounds)], [narrow],
                                                name=f"{conv.name}{WIDE_SUFFIX}_slice")
        widened.append(conv.name)
    if slices:  # each Slice right after its QuantizeLinear: the graph stays in topological order
        nodes = [placed for node in graph.node for placed in (node, slices.get(id(node))) if placed is not None]
        del graph.node[:]
        graph.node.extend(nodes)
    return widened


def _only_quantize_reader(conv, readers, outputs):
    after = readers.get(conv.output[0], [])
    if conv.output[0] in outputs or len(after) != 1 or after[0].op_type != "QuantizeLinear":
        return None
    return after[0]


def _shared(conv, producer, readers) -> bool:
    """Whether the Conv's weights or bias, or the constants they are dequantized from, are
    read elsewhere too (a network applied twice with one set of weights): widening them
    would widen the other reader."""
    direct = [name for name in conv.input[1:3] if name]
    sources = [source for name in direct if name in producer for source in producer[name].input if source]
    return any(len(readers.get(name, [])) > 1 for name in direct + sources)


def _constant_dequantize(name: str, producer, constants):
    node = producer.get(name)
    if node is None or node.op_type != "DequantizeLinear" or node.input[0] not in constants:
        return None
    return node


def _group(conv) -> int:
    return next((attribute.i for attribute in conv.attribute if attribute.name == "group"), 1)


def _pad_inputs(conv, weights, producer, constants, channels: int, wide: int) -> bool:
    """The weights (their scale and zero point where per output channel) and the bias padded
    to ``wide`` filters: zero weights and bias, the first filter's scale. False (nothing
    changed) where one of them is not a constant (or a constant's DequantizeLinear)."""
    bias_name = conv.input[2] if len(conv.input) > 2 else ""
    bias = _constant_dequantize(bias_name, producer, constants) if bias_name else None
    if bias_name and bias is None and bias_name not in constants:
        return False
    rank = len(constants[weights.input[0]].dims)
    padded = [(weights.input[0], False), *(_parameters(weights) if _axis(weights, rank) == 0 else [])]
    if bias is not None:  # a bias is a vector: its parameters are per channel where they are not scalars
        padded += [(bias.input[0], False), *_parameters(bias)]
    elif bias_name:
        padded.append((bias_name, False))
    if any(name not in constants for name, _ in padded):  # a parameter computed at run time
        return False
    for name, is_scale in padded:
        _pad(constants[name], channels, wide, is_scale)
    return True


def _parameters(dequantize) -> list:
    """(name, is_scale) of a DequantizeLinear's constant scale and zero point."""
    return [(name, at == 1) for at, name in enumerate(dequantize.input) if at and name]


def _axis(dequantize, rank: int) -> int:
    axis = next((attribute.i for attribute in dequantize.attribute if attribute.name == "axis"), 1)
    return axis + rank if axis < 0 else axis


def _pad(tensor, channels: int, wide: int, is_scale: bool) -> None:
    """A per-channel constant (first axis of ``channels``) padded to ``wide``: zeros, or for
    a scale the first channel's; a scalar is left as it is."""
    from onnx import numpy_helper

    values = numpy_helper.to_array(tensor)
    if values.ndim == 0 or values.shape[0] != channels:
        return
    fill = values[:1] if is_scale else np.zeros_like(values[:1])
    padded = np.concatenate([values, np.repeat(fill, wide - channels, axis=0)])
    tensor.CopyFrom(numpy_helper.from_array(padded.astype(values.dtype), tensor.name))

