"""Error-compensating weight rounding (GPTQ-style, Frantar et al. 2023, after Optimal Brain
Quantization): each quantized op's int8 weights chosen so that the op's output on the
calibration activations stays close to fp32's, not each weight to its own float value.

Rounding each weight to the nearest step ("round to nearest") makes every weight's error
as small as possible but lets the errors add up in the op's output wherever inputs are
correlated. Here the weights of one output channel are rounded one input column at a time,
and the rounding error of a column is pushed onto the columns not rounded yet, weighted by
the inverse of the inputs' second-moment matrix H = X^T X (X: the op's fp32 input
activations on the calibration samples, as im2col patches for a convolution). The scales,
zero points and the integer range stay the built model's own (read from its
DequantizeLinear and int8 weights), so only which integer each weight gets changes.

PP-OCRv4 det (OpenVINO, weights int8 and activations float): output cosine 0.99280 with
round to nearest, 0.99528 with this (docs/calibration.md). The rounded model is kept only
when its outputs are closer to fp32 on the calibration samples than the model it started
from (``weight_rounding``), as bias correction is."""

from __future__ import annotations

import time
from typing import Dict, Iterable, List, Optional

import numpy as np
import onnx
from onnx import helper, numpy_helper

from pipeline.precision.calibration import bias_correction
from pipeline.precision.calibration.input_means import PatchMeans, conv_geometry, weight_matrix, weight_transposed
from pipeline.precision.calibration.statistics import BatchRunner
from pipeline.console import progress_bar

MAX_SAMPLES = 32  # calibration samples whose activations make H
MAX_ROWS = 1024  # input rows (output positions) per sample and op, evenly strided
ROWS_PER_COLUMN = 32  # ... and no more than this many per column of the op's patch (H is columns x columns)
DAMPING = 0.01  # of H's mean diagonal, added to its diagonal (GPTQ's default)
BLOCK = 128  # columns rounded per block before the later columns are updated (GPTQ's)
# a layer whose input rows on the calibration samples stay below this fraction of H's columns
# keeps round to nearest (``_Layer.rounded``): H's rank is far below its size
MIN_ROWS_PER_COLUMN = 1 / 32


def unsupported(op) -> Optional[str]:
    """Why an op's weights are left as rounded to nearest, or None."""
    attributes = {a.name: helper.get_attribute_value(a) for a in op.node.attribute}
    if op.node.op_type == "Conv" and len(op.float_weight.dims) != 4:
        return "weight rounding: only 2-D convolutions"
    if op.node.op_type == "ConvTranspose":
        return "weight rounding: not for ConvTranspose"
    if op.node.op_type == "MatMul" and op.activation_index != 0:
        return "weight rounding: the weight is the MatMul's first input"
    if op.node.op_type == "Gemm" and attributes.get("transA", 0):
        return "weight rounding: Gemm with transA"
    return None


class _Layer:
    """One quantized op seen as out = W @ x per output position: W's rows are output
    channels (one row set per group), its columns the op's input patch."""

    def __init__(self, op, quantized: onnx.ModelProto):
        self.op, self.node = op, op.node
        self.attributes = {a.name: helper.get_attribute_value(a) for a in op.node.attribute}
        constants = {t.name: t for t in quantized.graph.initializer}
        self.int8_name = op.weight_dq.input[0]
        self.int8 = numpy_helper.to_array(constants[self.int8_name])
        self.scale = numpy_helper.to_array(constants[op.weight_dq.input[1]]).astype(np.float64)
        self.float_weight = numpy_helper.to_array(op.float_weight).astype(np.float64)
        self.groups = int(self.attributes.get("group", 1)) if self.node.op_type == "Conv" else 1
        self.hessian: Optional[np.ndarray] = None
        self.rows = 0
        self._pending: List[np.ndarray] = []  # input patches held until the rows reach MIN_ROWS_PER_COLUMN

    def matrix(self, weight: np.ndarray) -> np.ndarray:
        """[groups, out per group, in per group] view of a weight."""
        return weight_matrix(weight, self.node.op_type, self.attributes, self.groups)

    def width(self) -> int:
        """H's columns: the op's input patch (per group)."""
        return self.matrix(self.float_weight).shape[2]

    def row_scales(self) -> np.ndarray:
        channels = self.matrix(self.float_weight).shape[1] * self.groups
        return np.broadcast_to(self.scale.ravel(), (channels,)).reshape(self.groups, -1)

    def accumulate(self, activation: np.ndarray, samples: int) -> None:
        """Add this batch's input patches to H = X^T X (per group), once the rows seen reach
        MIN_ROWS_PER_COLUMN of the columns: before, they are held (they take less memory than
        H), and a layer that never gets there keeps round to nearest (``rounded``)."""
        columns = self._columns(activation, samples)
        self.rows += columns.shape[2]
        self._pending.append(columns)
        if self.rows < MIN_ROWS_PER_COLUMN * columns.shape[1]:
            return
        for held in self._pending:
            hessian = np.matmul(held, held.transpose(0, 2, 1)).astype(np.float64)
            self.hessian = hessian if self.hessian is None else self.hessian + hessian
        self._pending = []

    def _columns(self, activation: np.ndarray, samples: int) -> np.ndarray:
        """The input patches as columns: [groups, in per group, rows] float32, at most
        MAX_ROWS rows per sample and ROWS_PER_COLUMN per column (a depthwise 5x5 has 25
        columns: 800 rows per sample estimate its 25 x 25 H well enough; 8 per column lost
        PP-OCRv4 det's gain, docs/time.md)."""
        limit = min(MAX_ROWS, ROWS_PER_COLUMN * self.matrix(self.float_weight).shape[2])
        if self.node.op_type != "Conv":
            rows = activation.reshape(-1, activation.shape[-1])
            return _strided(rows, limit * samples).T[None].astype(np.float32, copy=False)
        return np.concatenate([_conv_columns(sample, self.attributes, self.float_weight.shape, self.groups, limit)
                               for sample in np.split(activation, samples)], axis=2)

    def rounded(self) -> Optional[np.ndarray]:
        """The int8 weight rounded against H, in the built weight's layout; None without H:
        no rows, or fewer than MIN_ROWS_PER_COLUMN of H's columns. Then H's rank is far below
        its size and the error it spreads mostly the damping's: the default model's fc1 (2048
        columns, one row a sample: 32 rows) took 1.2-1.7 s of a 2 s rounding for the same
        output cosine on the validation digits (0.99999374 with and without), where fc2 (256
        columns, 32 rows) is most of the rounding's gain (without it 0.99999166, round to
        nearest 0.99999150; docs/calibration.md, why not a sixteenth)."""
        if self.hessian is None or self.rows == 0:
            return None
        weights, scales = self.matrix(self.float_weight), self.row_scales()
        limits = np.abs(self.matrix(self.int8.astype(np.int64))).max(axis=2)
        chosen = compensated_rounding(weights, scales, limits, self.hessian)
        flat = chosen.reshape(-1, chosen.shape[2])
        transposed = weight_transposed(self.node.op_type, self.attributes)
        return (flat.T if transposed else flat).reshape(self.int8.shape).astype(self.int8.dtype)


def _strided(rows: np.ndarray, limit: int) -> np.ndarray:
    step = max(1, -(-rows.shape[0] // limit))
    return rows[::step]


def _conv_columns(sample: np.ndarray, attributes: dict, weight_shape, groups: int, rows: int) -> np.ndarray:
    """im2col of one [1, C, H, W] sample as columns: [groups, C/groups * kh * kw, positions],
    in the weight's (channel, kh, kw) order; output positions evenly strided on both axes
    to at most about ``rows``.
    Built from one strided slice of the input per kernel offset: a depthwise 5x5's
    sliding-window copy took most of the rounding's time (PP-OCRv4 rec)."""
    kernel = weight_shape[2:]
    if len(kernel) != 2:
        raise ValueError(f"{len(kernel)}-D convolution")
    pads, strides, dilations, out = conv_geometry(attributes, kernel, sample.shape[2:])
    padded = np.pad(sample[0], ((0, 0), (pads[0], pads[2]), (pads[1], pads[3])))
    every = max(1, int(np.ceil(np.sqrt(out[0] * out[1] / rows))))
    steps = [strides[0] * every, strides[1] * every]
    stop = [(o - 1) * s + 1 for o, s in zip(out, strides)]
    shifted = [padded[:, i * dilations[0]:i * dilations[0] + stop[0]:steps[0],
                      j * dilations[1]:j * dilations[1] + stop[1]:steps[1]]
               for i in range(kernel[0]) for j in range(kernel[1])]
    stacked = np.stack(shifted, axis=1)  # [C, kh * kw, picked rows, picked columns]
    channels = stacked.shape[0]
    return stacked.reshape(groups, channels // groups * kernel[0] * kernel[1], -1).astype(np.float32, copy=False)


def compensated_rounding(weights: np.ndarray, scales: np.ndarray, limits: np.ndarray,
                         hessian: np.ndarray) -> np.ndarray:
    """Integers for ``weights`` [G, O, I] on the grid ``scales`` [G, O] within +-``limits``
    [G, O], column by column, each column's error spread over the later ones through the
    upper Cholesky factor of H^-1 (H [G, I, I]). Vectorized over groups and rows; columns
    go in blocks (GPTQ's lazy batch updates): inside a block the errors are spread column by
    column, onto the columns after it in one matrix product per block."""
    work = weights.astype(np.float64).copy()
    inverse = _inverse_factor(hessian, work)
    chosen = np.zeros_like(work)
    steps = np.where(scales > 0, scales, 1.0)
    columns = work.shape[2]
    for start in range(0, columns, BLOCK):
        end = min(start + BLOCK, columns)
        errors = np.empty(work.shape[:2] + (end - start,))
        for column in range(start, end):
            values = work[:, :, column]
            integers = np.clip(np.round(values / steps), -limits, limits)
            chosen[:, :, column] = integers
            error = (values - integers * scales) / inverse[:, column, column][:, None]
            work[:, :, column + 1:end] -= error[:, :, None] * inverse[:, None, column, column + 1:end]
            errors[:, :, column - start] = error
        if end < columns:
            work[:, :, end:] -= np.matmul(errors, inverse[:, start:end, end:])
    return chosen.astype(np.int64)


def _inverse_factor(hessian: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Upper Cholesky factor of the damped H^-1 per group; input columns that never see a
    non-zero input keep their weight's nearest rounding (their H row is set to identity)."""
    damped = hessian.copy()
    for group in range(damped.shape[0]):
        diagonal = np.diagonal(damped[group]).copy()
        dead = diagonal <= 0
        damped[group][dead, :] = 0
        damped[group][:, dead] = 0
        diagonal[dead] = 1
        damped[group][np.diag_indices_from(damped[group])] = diagonal + DAMPING * diagonal[~dead].mean() \
            if (~dead).any() else 1.0
    return np.stack([_upper_factor_of_inverse(matrix) for matrix in damped])


def _upper_factor_of_inverse(matrix: np.ndarray) -> np.ndarray:
    """U, upper triangular with H^-1 = U^T U, without forming H^-1: with J the reversal of
    the axes and J H J = L L^T (Cholesky), U = J L^-1 J. A Cholesky factor and a triangular
    inverse cost a third of the general inverse each (fc1 of the default model, 2048
    columns: 0.6 s of inverse per build before)."""
    lower = np.linalg.cholesky(matrix[::-1, ::-1])
    return np.ascontiguousarray(_lower_inverse(lower)[::-1, ::-1])


def _lower_inverse(lower: np.ndarray) -> np.ndarray:
    """The inverse of a lower triangular matrix by halves, [[A, 0], [C, B]]^-1 =
    [[A^-1, 0], [-B^-1 C A^-1, B^-1]]: matrix products, as fast as LAPACK's dtrtri here
    (2048 columns: 0.27 s against 0.16 s, equal to 1e-16) without importing scipy.linalg,
    which took 0.35 s of every build's start."""
    size = lower.shape[0]
    if size <= 64:
        return np.tril(np.linalg.inv(lower))
    half = size // 2
    first, second = _lower_inverse(lower[:half, :half]), _lower_inverse(lower[half:, half:])
    inverse = np.zeros_like(lower)
    inverse[:half, :half], inverse[half:, half:] = first, second
    inverse[half:, :half] = -second @ (lower[half:, :half] @ first)
    return inverse


def round_file(quantized_path, prepared_path, samples: Iterable[Dict[str, np.ndarray]],
               judged_on: Optional["bias_correction.Judged"] = None,
               fp32_pass: Optional["bias_correction.Fp32Pass"] = None) -> dict:
    """``round_weights`` on a QDQ model file, rewritten in place when the rounding is kept."""
    model = onnx.load(str(quantized_path))
    summary = round_weights(model, onnx.load(str(prepared_path)), samples, judged_on=judged_on, fp32_pass=fp32_pass)
    if summary["applied"]:
        onnx.save(model, str(quantized_path))
    return summary


def round_weights(quantized: onnx.ModelProto, prepared: onnx.ModelProto,
                  samples: Iterable[Dict[str, np.ndarray]], max_samples: int = MAX_SAMPLES,
                  only_if_closer: bool = True, judged_on: Optional["bias_correction.Judged"] = None,
                  fp32_pass: Optional["bias_correction.Fp32Pass"] = None) -> dict:
    """Re-round the int8 weights of ``quantized`` (built from ``prepared``) in place, when
    that brings its outputs closer to fp32 on the samples (on ``judged_on``, a
    bias_correction.Judged, when given). ``fp32_pass``: filled for the bias correction
    after it where every op's patch means can be read (bias_correction.Fp32Pass).
    Returns the build's summary."""
    started = time.perf_counter()
    ops, skipped = bias_correction.quantized_ops(quantized, prepared)
    reasons = {op.node.name: unsupported(op) for op in ops}
    skipped.update({name: why for name, why in reasons.items() if why})
    layers = [_Layer(op, quantized) for op in ops if not reasons[op.node.name]]
    kept = [feeds for _, feeds in zip(range(max_samples), samples)]
    if not layers or not kept:
        return {"enabled": True, "applied": False, "ops": [], "skipped": skipped,
                "reason": "no calibration samples" if layers else "no quantized op with a constant weight"}
    size = bias_correction.batch_size_for(prepared, [layer.op.source for layer in layers])
    batches = bias_correction.sample_batches(kept, max_samples, size)
    with progress_bar() as progress:  # a live bar with an ETA on a terminal (docs/verify.md)
        task = progress.add_task("weight rounding", total=len(batches) + len(layers))
        means = _patch_means(ops, quantized) if fp32_pass is not None and len(layers) == len(ops) else None
        reference, batches = _hessians(layers, prepared, batches, lambda: progress.advance(task), means)
        if means is not None:
            fp32_pass.means, fp32_pass.reference, fp32_pass.batches = means, reference, batches
        candidate = onnx.ModelProto()
        candidate.CopyFrom(quantized)
        rounded = _apply(layers, candidate, skipped, lambda: progress.advance(task))
    if judged_on is not None:  # validation samples, shared with bias correction
        without, with_ = judged_on.cosine(quantized), judged_on.cosine(candidate)
    else:
        without, with_ = (bias_correction.output_cosine(model, batches, reference) for model in (quantized, candidate))
    applied = bool(rounded) and (with_ > without or not only_if_closer)
    if applied:
        quantized.CopyFrom(candidate)
    return {"enabled": True, "applied": applied, "samples": sum(len(batch) for batch in batches), "ops": rounded,
            "skipped": skipped,
            "judged_on": "calibration" if judged_on is None else "validation",
            "output_cosine": {"without": round(without, 6), "with": round(with_, 6)},
            "seconds": round(time.perf_counter() - started, 3)}


def _patch_means(ops, quantized: onnx.ModelProto) -> Optional[Dict[str, PatchMeans]]:
    """Every op's PatchMeans, or None where one op's mean error is not read off them."""
    constants = {t.name: t for t in quantized.graph.initializer}
    means = {op.node.name: PatchMeans.of(op, constants) for op in ops}
    return means if all(found is not None for found in means.values()) else None


def _hessians(layers: List[_Layer], prepared: onnx.ModelProto, batches, advance=lambda: None,
              means: Optional[Dict[str, PatchMeans]] = None) -> tuple:
    """Accumulate every layer's H over the batches' fp32 activations (as many as
    bias_correction.sized_runs takes), and its patch means into ``means``; the fp32
    outputs and the batches measured."""
    outputs = [o.name for o in prepared.graph.output]
    names = list(dict.fromkeys([*(layer.op.source for layer in layers), *outputs]))
    runner = BatchRunner(prepared, names, len(batches[0]))
    reference, measured = [], []
    for batch, values in bias_correction.sized_runs(runner, batches, [layer.op.source for layer in layers]):
        for layer in layers:
            layer.accumulate(values[layer.op.source], len(batch))
            if means is not None:
                means[layer.node.name].add(values[layer.op.source])
        reference.append({name: values[name] for name in outputs})
        measured.append(batch)
        advance()
    return reference, measured


def _apply(layers: List[_Layer], model: onnx.ModelProto, skipped: Dict[str, str], advance=lambda: None) -> List[str]:
    """Write each layer's re-rounded int8 weight into ``model``; the ops changed."""
    constants = {t.name: t for t in model.graph.initializer}
    changed = []
    for layer in layers:
        advance()
        try:
            values = layer.rounded()
        except (ValueError, np.linalg.LinAlgError) as err:
            skipped[layer.node.name] = f"weight rounding: {err}"
            continue
        if values is None:
            skipped[layer.node.name] = (f"weight rounding: {layer.rows} input rows for {layer.width()} columns "
                                        "(round to nearest kept)" if layer.rows else "weight rounding: no input rows")
        elif not np.array_equal(values, layer.int8):
            constants[layer.int8_name].CopyFrom(numpy_helper.from_array(values, layer.int8_name))
            changed.append(layer.node.name)
    return changed
