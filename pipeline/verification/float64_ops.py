"""Conv and ConvTranspose for ONNX's reference evaluator (onnx.reference), as matrix products.

ONNX Runtime has no float64 Conv, so the float64 truth check (truth.py) runs convolutional
models in onnx.reference, whose Conv builds its columns index by index in Python and whose
ConvTranspose scatters them back pixel by pixel: 52 s a sample on PP-OCRv4 det at 736x736,
38 s of it in ConvTranspose (2 cores); its MaxPool loops over windows (16 s of U^2-Net-p's
27 s at 320x320). Here Conv and ConvTranspose are NumPy matrix products over strided views
(float64 BLAS), MaxPool a maximum over them. 2-D only, explicit pads: anything else goes
to onnx.reference's own.

BatchNormalization is here for correctness: onnx.reference normalizes with the batch's own
statistics whenever a BatchNormalization of opset 9-13 carries a ``momentum`` attribute
(Paddle's exports do), where ONNX Runtime, like the opset, uses the stored mean and
variance; PP-OCRv4 det's float64 "truth" was 0.98 cosine from its float32 run that way."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import as_strided
from onnx.reference.op_run import OpRun
from onnx.reference.ops.op_conv import Conv as _ReferenceConv
from onnx.reference.ops.op_conv_transpose import ConvTranspose as _ReferenceConvTranspose
from onnx.reference.ops.op_max_pool import MaxPool as _ReferenceMaxPool

COLUMN_BYTES = 64 * 2**20  # the im2col block a Conv builds at once: rows of output until this size


def _handled(X, auto_pad, output_shape=None) -> bool:
    return X.ndim == 4 and auto_pad in (None, "NOTSET", "VALID") and output_shape is None


def _pads(auto_pad, pads) -> tuple:
    return (0, 0, 0, 0) if auto_pad == "VALID" or pads is None else tuple(pads)


class Conv(_ReferenceConv):
    op_domain = ""

    def _run(self, X, W, B=None, auto_pad=None, dilations=None, group=None, kernel_shape=None, pads=None,
             strides=None):
        if not _handled(X, auto_pad):
            return super()._run(X, W, B, auto_pad, dilations, group, kernel_shape, pads, strides)
        return (conv2d(X, W, B, tuple(dilations or (1, 1)), group or 1, _pads(auto_pad, pads),
                       tuple(strides or (1, 1))).astype(X.dtype),)


class ConvTranspose(_ReferenceConvTranspose):
    op_domain = ""

    def _run(self, X, W, B=None, auto_pad=None, dilations=None, group=None, kernel_shape=None,
             output_padding=None, output_shape=None, pads=None, strides=None):
        if not _handled(X, auto_pad, output_shape):
            return super()._run(X, W, B, auto_pad, dilations, group, kernel_shape, output_padding, output_shape,
                                pads, strides)
        return (conv_transpose2d(X, W, B, tuple(dilations or (1, 1)), group or 1, _pads(auto_pad, pads),
                                 tuple(strides or (1, 1)), tuple(output_padding or (0, 0))).astype(X.dtype),)


class MaxPool(_ReferenceMaxPool):
    op_domain = ""

    def _run(self, x, auto_pad=None, ceil_mode=None, dilations=None, kernel_shape=None, pads=None,
             storage_order=None, strides=None):
        if not _handled(x, auto_pad) or len(self.onnx_node.output) > 1:  # Indices: onnx.reference's
            return super()._run(x, auto_pad, ceil_mode, dilations, kernel_shape, pads, storage_order, strides)
        return (max_pool2d(x, tuple(kernel_shape), tuple(dilations or (1, 1)), _pads(auto_pad, pads),
                           tuple(strides or (1, 1)), bool(ceil_mode)),)


class BatchNormalization(OpRun):
    """Inference-mode batch normalization with the stored statistics (training_mode=1,
    opset 14's only training form, keeps onnx.reference's)."""

    op_domain = ""

    def _run(self, x, scale, bias, mean, var, epsilon=1e-5, training_mode=None, **_ignored):
        if training_mode:
            from onnx.reference.ops.op_batch_normalization import BatchNormalization_14

            return BatchNormalization_14._run(self, x, scale, bias, mean, var, epsilon, _ignored.get("momentum"),
                                              training_mode)
        shape = (1, -1) + (1,) * (x.ndim - 2)
        factor = scale / np.sqrt(var + epsilon)
        return ((x - mean.reshape(shape)) * factor.reshape(shape) + bias.reshape(shape),)


NEW_OPS = [Conv, ConvTranspose, MaxPool, BatchNormalization]


def conv2d(X: np.ndarray, W: np.ndarray, B, dilations: tuple, group: int, pads: tuple,
           strides: tuple) -> np.ndarray:
    """ONNX Conv on [N, C, H, W]: im2col over a strided view, one matrix product a group
    (batched across groups), in blocks of output rows so the columns stay under COLUMN_BYTES."""
    n, channels = X.shape[:2]
    out_channels, group_channels, kh, kw = W.shape
    x = np.pad(X, ((0, 0), (0, 0), (pads[0], pads[2]), (pads[1], pads[3])))
    (dh, dw), (sh, sw) = dilations, strides
    ho = (x.shape[2] - (kh - 1) * dh - 1) // sh + 1
    wo = (x.shape[3] - (kw - 1) * dw - 1) // sw + 1
    s = x.strides
    windows = as_strided(x, (n, group, group_channels, ho, wo, kh, kw),
                         (s[0], s[1] * group_channels, s[1], s[2] * sh, s[3] * sw, s[2] * dh, s[3] * dw),
                         writeable=False)
    weights = W.reshape(group, out_channels // group, group_channels * kh * kw)
    y = np.empty((n, out_channels, ho, wo), dtype=np.result_type(X, W))
    rows = max(1, COLUMN_BYTES // (8 * channels * kh * kw * wo * n))
    for top in range(0, ho, rows):
        block = windows[:, :, :, top:top + rows]
        height = block.shape[3]
        columns = block.transpose(1, 2, 5, 6, 0, 3, 4).reshape(group, group_channels * kh * kw, n * height * wo)
        found = np.matmul(weights, columns).reshape(out_channels, n, height, wo)
        y[:, :, top:top + height] = found.transpose(1, 0, 2, 3)
    if B is not None:
        y += B.reshape(1, -1, 1, 1)
    return y


def conv_transpose2d(X: np.ndarray, W: np.ndarray, B, dilations: tuple, group: int, pads: tuple,
                     strides: tuple, output_padding: tuple) -> np.ndarray:
    """ONNX ConvTranspose on [N, C, H, W]: one matrix product per kernel position (batched
    across groups) added into the strided places it reaches, then the pads cropped."""
    n, channels, h, w = X.shape
    _, group_out, kh, kw = W.shape
    group_channels = channels // group
    (dh, dw), (sh, sw) = dilations, strides
    full_h = sh * (h - 1) + (kh - 1) * dh + 1 + output_padding[0]
    full_w = sw * (w - 1) + (kw - 1) * dw + 1 + output_padding[1]
    full = np.zeros((n, group * group_out, full_h, full_w), dtype=np.result_type(X, W))
    x = X.reshape(n, group, group_channels, h * w)
    weights = W.reshape(group, group_channels, group_out, kh, kw)
    for i in range(kh):
        for j in range(kw):
            part = np.matmul(weights[:, :, :, i, j].transpose(0, 2, 1), x)  # [n, group, group_out, h*w]
            full[:, :, i * dh:i * dh + sh * (h - 1) + 1:sh, j * dw:j * dw + sw * (w - 1) + 1:sw] += \
                part.reshape(n, group * group_out, h, w)
    y = full[:, :, pads[0]:full_h - pads[2], pads[1]:full_w - pads[3]]
    if B is not None:
        y = y + B.reshape(1, -1, 1, 1)
    return np.ascontiguousarray(y)


def max_pool2d(X: np.ndarray, kernel: tuple, dilations: tuple, pads: tuple, strides: tuple,
               ceil_mode: bool) -> np.ndarray:
    """ONNX MaxPool on [N, C, H, W]: the maximum over each kernel position of a strided view
    of the input padded with -inf (ceil_mode: a last window that would start in the end
    padding is dropped, as ONNX Runtime does)."""
    sizes = []
    for axis in range(2):
        padded = X.shape[2 + axis] + pads[axis] + pads[axis + 2]
        span = (kernel[axis] - 1) * dilations[axis] + 1
        count = -(-(padded - span) // strides[axis]) + 1 if ceil_mode else (padded - span) // strides[axis] + 1
        if ceil_mode and (count - 1) * strides[axis] >= X.shape[2 + axis] + pads[axis]:
            count -= 1
        sizes.append((count, max(0, (count - 1) * strides[axis] + span - padded)))
    (ho, extra_h), (wo, extra_w) = sizes
    x = np.pad(X, ((0, 0), (0, 0), (pads[0], pads[2] + extra_h), (pads[1], pads[3] + extra_w)),
               constant_values=-np.inf)
    (kh, kw), (dh, dw), (sh, sw) = kernel, dilations, strides
    y = np.full(X.shape[:2] + (ho, wo), -np.inf, dtype=X.dtype)
    for i in range(kh):
        for j in range(kw):
            np.maximum(y, x[:, :, i * dh:i * dh + sh * (ho - 1) + 1:sh, j * dw:j * dw + sw * (wo - 1) + 1:sw], out=y)
    return y
