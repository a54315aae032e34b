"""A quantized op's per-output-channel mean error from the means of its input, without
running the op.

A Conv, Gemm or MatMul is linear in its input, so the mean over the output positions of
fp32 minus quantized output, y(x, W) - y(DQ(Q(x)), Wq), is W applied to the mean of each
input patch column minus Wq applied to the same mean of DQ(Q(x)): a patch column is one
input channel at one kernel offset, averaged over the positions the kernel visits
(padding counts as zeros). Two vectors per op, summed batch by batch, give bias
correction its shifts: the real-size segmenter ran each of its 119 convolutions twice on
every sample for them (docs/calibration.md, "Bias correction").

Ops whose mean is not read off that way are left to bias correction's own run
(``PatchMeans.of`` gives None): ConvTranspose, convolutions other than 2-D, auto_pad,
Gemm with transA, a MatMul whose weight is its first input or is not a matrix, and an
input quantized with more than one scale."""

from __future__ import annotations

from typing import Optional, Tuple

import numpy as np
from onnx import helper, numpy_helper


class PatchMeans:
    """Running sums of an op's input patch columns, of x and of DQ(Q(x))."""

    def __init__(self, node, attributes: dict, quantizer: Optional[Tuple[np.float32, int, int, int]], kernel: tuple):
        self.node, self.attributes = node, attributes
        self.quantizer, self.kernel = quantizer, kernel  # (scale, zero point, qmin, qmax); the conv's (kh, kw)
        self.sums: Optional[np.ndarray] = None  # [2, columns]: x, DQ(Q(x))
        self.positions = 0

    @classmethod
    def of(cls, op, constants: dict) -> Optional["PatchMeans"]:
        """The op's means, or None where its mean error is not read off its input's means."""
        attributes = {a.name: helper.get_attribute_value(a) for a in op.node.attribute}
        weight_rank = len(op.float_weight.dims)
        if op.activation_index != 0 or op.node.op_type == "ConvTranspose" or attributes.get("transA", 0):
            return None
        if op.node.op_type == "Conv" and (weight_rank != 4 or attributes.get("auto_pad", b"NOTSET") not in
                                          (b"NOTSET", "NOTSET")):
            return None
        if op.node.op_type == "MatMul" and weight_rank != 2:
            return None
        quantizer = _quantizer(op.quantizers, constants)
        if op.quantizers and quantizer is None:
            return None
        kernel = tuple(op.float_weight.dims[2:]) if op.node.op_type == "Conv" else ()
        return cls(op.node, attributes, quantizer, kernel)

    def add(self, activation: np.ndarray) -> None:
        """A batch of the op's fp32 input: its patch sums, and those of DQ(Q(input)), which
        are the scale times the sums of the saturated integer steps off the zero point."""
        if self.quantizer is None:
            stepped, scale = activation, 1.0
        else:
            scale, zero, qmin, qmax = self.quantizer
            stepped = np.rint(activation / scale)
            np.clip(stepped, qmin - zero, qmax - zero, out=stepped)
        found = [self._sums(activation), self._sums(stepped)]
        positions = found[0][1]
        stacked = np.stack([found[0][0], scale * found[1][0]])
        self.sums = stacked if self.sums is None else self.sums + stacked
        self.positions += positions

    def _sums(self, values: np.ndarray) -> Tuple[np.ndarray, int]:
        """(sum of each patch column over the batch's output positions, the positions)."""
        if not self.kernel:
            rows = values.shape[-1]
            return values.reshape(-1, rows).sum(axis=0, dtype=np.float64), values.size // rows
        return self._window_sums(values)

    def _window_sums(self, values: np.ndarray) -> Tuple[np.ndarray, int]:
        """Per (channel, kh, kw), the sum of the input values the kernel offset visits over
        every output position and sample, and the output positions: the input summed over
        its samples, then over the columns each kernel column visits (one pass for all of
        them at stride 1: a row's total less the few columns at its edges), then over rows."""
        size = values.shape[2:]
        pads, strides, dilations, out = conv_geometry(self.attributes, self.kernel, size)
        summed = values.sum(axis=0) if values.shape[0] > 1 else values[0]  # [C, H, W]
        whole = summed.sum(axis=2, dtype=np.float64) if strides[1] == 1 else None  # [C, H]
        found = np.zeros((values.shape[1], self.kernel[0], self.kernel[1]))
        for j in range(self.kernel[1]):
            visited = _visited(j * dilations[1] - pads[1], strides[1], out[1], size[1])
            per_row = summed[:, :, visited].sum(axis=2, dtype=np.float64) if whole is None else \
                whole - summed[:, :, :visited.start].sum(axis=2, dtype=np.float64) \
                - summed[:, :, visited.stop:].sum(axis=2, dtype=np.float64)
            for i in range(self.kernel[0]):
                found[:, i, j] = per_row[:, _visited(i * dilations[0] - pads[0], strides[0], out[0], size[0])].sum(1)
        return found.reshape(-1), values.shape[0] * out[0] * out[1]

    def shift(self, float_weight: np.ndarray, quantized_weight: np.ndarray) -> np.ndarray:
        """The per-output-channel mean of fp32 minus quantized output, bias left out."""
        means = self.sums / max(self.positions, 1)
        groups = int(self.attributes.get("group", 1)) if self.kernel else 1
        shifts = [np.einsum("gok,gk->go", weight_matrix(weight, self.node.op_type, self.attributes, groups),
                            part.reshape(groups, -1)).reshape(-1)
                  for weight, part in ((float_weight.astype(np.float64), means[0]),
                                       (quantized_weight.astype(np.float64), means[1]))]
        alpha = float(self.attributes.get("alpha", 1.0)) if self.node.op_type == "Gemm" else 1.0
        return alpha * (shifts[0] - shifts[1])


def _visited(start: int, stride: int, count: int, size: int) -> slice:
    """The input indices start, start + stride, ... (count of them) that lie in [0, size)."""
    first = start if start >= 0 else start + -(-(-start) // stride) * stride
    last = start + (count - 1) * stride
    if first >= size or last < 0:
        return slice(0, 0)
    return slice(first, min(last, size - 1) + 1, stride)


def conv_geometry(attributes: dict, kernel, size) -> tuple:
    """(pads, strides, dilations, output size) of a 2-D convolution of ``kernel`` over an
    input of ``size`` (H, W)."""
    pads = list(attributes.get("pads", [0, 0, 0, 0]))
    strides, dilations = attributes.get("strides", [1, 1]), attributes.get("dilations", [1, 1])
    out = [(size[a] + pads[a] + pads[a + 2] - (kernel[a] - 1) * dilations[a] - 1) // strides[a] + 1 for a in (0, 1)]
    return pads, strides, dilations, out


def weight_transposed(op_type: str, attributes: dict) -> bool:
    """The weight stores output channels on its last axis (MatMul, Gemm without transB)."""
    return op_type == "MatMul" or (op_type == "Gemm" and not attributes.get("transB", 0))


def weight_matrix(weight: np.ndarray, op_type: str, attributes: dict, groups: int = 1) -> np.ndarray:
    """[groups, outputs per group, patch columns per group] view of an op's weight (a
    convolution's columns in its (channel, kh, kw) order)."""
    flat = weight.T if weight_transposed(op_type, attributes) else weight.reshape(weight.shape[0], -1)
    return flat.reshape(groups, flat.shape[0] // groups, flat.shape[1])


def _quantizer(quantizers, constants: dict):
    """(scale, zero point, qmin, qmax) of the input's QuantizeLinear, or None (not per tensor)."""
    if not quantizers:
        return None
    quantize = quantizers[0]
    if len(quantize.input) < 3 or quantize.input[1] not in constants or quantize.input[2] not in constants:
        return None
    scale = numpy_helper.to_array(constants[quantize.input[1]])
    zero = numpy_helper.to_array(constants[quantize.input[2]])
    if scale.size != 1 or zero.size != 1 or zero.dtype not in (np.uint8, np.int8):
        return None
    limits = np.iinfo(zero.dtype)
    return np.float32(scale.ravel()[0]), int(zero.ravel()[0]), int(limits.min), int(limits.max)


def dequantized_weight(weight_dq, constants: dict) -> np.ndarray:
    """The float weight a DequantizeLinear of an initializer gives (per tensor or per axis)."""
    values, scale = (numpy_helper.to_array(constants[name]) for name in weight_dq.input[:2])
    zero = numpy_helper.to_array(constants[weight_dq.input[2]]) if len(weight_dq.input) > 2 and weight_dq.input[2] \
        else np.zeros_like(scale)
    axis = next((helper.get_attribute_value(a) for a in weight_dq.attribute if a.name == "axis"), 1)
    return dequantize(values, scale, zero, axis)


def dequantize(values: np.ndarray, scale: np.ndarray, zero: np.ndarray, axis: int = 1) -> np.ndarray:
    """What DequantizeLinear gives for ``values`` (float64): per tensor, or per ``axis`` where
    ``scale`` holds one value per channel."""
    values, scale, zero = (np.asarray(a, dtype=np.float64) for a in (values, scale, zero))
    if scale.size > 1 and values.ndim > 1:
        shape = [1] * values.ndim
        shape[axis % values.ndim] = scale.size
        scale, zero = scale.reshape(shape), zero.reshape(shape)
    return (values - zero) * scale
