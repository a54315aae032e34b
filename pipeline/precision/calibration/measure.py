"""A candidate model's outputs against the float model's on a set of samples: the measure
that calibration=auto (pipeline/precision/calibration/auto.py) and the mixed search
(stages/sensitivity.py) decide on. The reference outputs are computed once."""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence

import numpy as np
import onnx

from pipeline.precision.calibration.statistics import model_outputs

CHUNK = 32  # samples per ONNX Runtime run (bounded memory on large validation sets)


class OutputJudge:
    """``samples``: one feeds dict per sample (batch 1, as the data reader gives them);
    ``labels``: class indices for top-1 on the first output, or None."""

    def __init__(self, reference: onnx.ModelProto, samples: Sequence[Dict[str, np.ndarray]],
                 labels: Optional[Sequence[int]] = None):
        if not samples:
            raise ValueError("no samples to measure on")
        self.samples, self.labels = list(samples), labels
        self.outputs = float_outputs(reference)
        self.reference = self._run(reference)
        self.reference_top1 = self._top1(self.reference)

    @property
    def count(self) -> int:
        return len(self.samples)

    def subset(self, indices: Sequence[int]) -> "OutputJudge":
        """The judge of the samples at ``indices`` (positions in this one's, ascending), its
        reference outputs taken from this one's instead of run again."""
        judge = object.__new__(OutputJudge)
        judge.samples = [self.samples[i] for i in indices]
        judge.labels = None if self.labels is None else [self.labels[i] for i in indices]
        judge.outputs = self.outputs
        per_output = []  # each output's slices of the samples picked (sample i: its i-th equal slice)
        for index in range(len(self.outputs)):
            whole = np.concatenate([chunk[index] for chunk in self.reference])
            rows = len(whole) // self.count
            per_output.append([whole[i * rows:(i + 1) * rows] for i in indices])
        judge.reference = [[np.concatenate(slices[start:start + CHUNK]) for slices in per_output]
                           for start in range(0, judge.count, CHUNK)]  # _run's chunks
        judge.reference_top1 = judge._top1(judge.reference)
        return judge

    def __call__(self, model: onnx.ModelProto) -> dict:
        """cosine: verify's (all samples together, per output), averaged over the outputs;
        worst_sample_cosine: the lowest cosine of one sample's output; sqnr_db over
        everything; top1_drop against the float model's top-1 (None without labels)."""
        return self.score(self._run(model))

    def score(self, actual: List[List[np.ndarray]]) -> dict:
        """__call__'s measure of outputs already computed (chunks in _run's layout)."""
        refs, outs = [], []
        for index in range(len(self.outputs)):
            refs.append(np.concatenate([chunk[index] for chunk in self.reference]).reshape(self.count, -1))
            out = np.concatenate([chunk[index] for chunk in actual]).reshape(self.count, -1)
            outs.append(out if np.isfinite(out).all() else np.nan_to_num(out, nan=0.0, posinf=0.0, neginf=0.0))
        agreement = output_agreement(refs, outs)
        top1 = self._top1(actual)
        return {"cosine": agreement["cosine"], "worst_sample_cosine": agreement["worst_sample_cosine"],
                "sqnr_db": agreement["sqnr_db"], "top1_drop": None if top1 is None else self.reference_top1 - top1}

    def _run(self, model: onnx.ModelProto) -> List[List[np.ndarray]]:
        """The outputs chunk by chunk; sample i of a chunk is the i-th of its equal slices
        along axis 0 (BatchRunner runs a model that takes no batch one sample at a time)."""
        parts = [self.samples[start:start + CHUNK] for start in range(0, self.count, CHUNK)]
        return [[values[name] for name in self.outputs] for values in model_outputs(model, self.outputs, parts)]

    def _top1(self, chunks) -> Optional[float]:
        if self.labels is None:
            return None
        first = np.concatenate([chunk[0] for chunk in chunks]).reshape(self.count, -1)
        return float(np.mean(np.argmax(first, axis=1) == np.asarray(self.labels)))


def float_outputs(model: onnx.ModelProto) -> List[str]:
    """The outputs a cosine means something for: the float ones (class ids and masks are
    decisions, verify compares them exactly); every output when none is float."""
    from pipeline.precision.quantize import FLOAT_TYPES

    names = [o.name for o in model.graph.output if o.type.tensor_type.elem_type in FLOAT_TYPES]
    return names or [o.name for o in model.graph.output]


def output_agreement(reference: Sequence[np.ndarray], actual: Sequence[np.ndarray]) -> dict:
    """Outputs (axis 0: samples) against the reference's: ``cosine``, verify's (all samples
    together, per output) averaged over the outputs; ``loss``, 1 - cosine averaged over
    samples and outputs; ``worst_sample_cosine``, the lowest cosine of one sample's output;
    ``sqnr_db`` over everything. Float64 sums per sample without float64 copies of the
    outputs (einsum casts as it goes): the search scores ~40 whole models of 200 samples
    each, and copies took longer than running them."""
    cosines, losses, worst, signal, noise = [], [], 1.0, 0.0, 0.0
    for ref, out in zip(reference, actual):
        a, b = ref.reshape(ref.shape[0], -1), out.reshape(out.shape[0], -1)
        dots, ref_sq, out_sq = (np.einsum("ij,ij->i", x, y, dtype=np.float64) for x, y in ((a, b), (a, a), (b, b)))
        norms = np.sqrt(ref_sq * out_sq)
        both_zero = (ref_sq == 0) & (out_sq == 0)  # identical; one zero and not the other: cosine 0
        per_sample = np.where(norms > 0, dots / np.where(norms > 0, norms, 1), both_zero * 1.0)
        losses.append(float(np.mean(1.0 - per_sample)))
        worst = min(worst, float(per_sample.min())) if per_sample.size else worst
        total = math.sqrt(float(ref_sq.sum()) * float(out_sq.sum()))
        cosines.append(float(dots.sum()) / total if total else float(ref_sq.sum() == out_sq.sum() == 0))
        signal += float(ref_sq.sum())
        noise += max(float(ref_sq.sum() + out_sq.sum() - 2.0 * dots.sum()), 0.0)
    return {"cosine": float(np.mean(cosines)), "loss": float(np.mean(losses)), "worst_sample_cosine": worst,
            "sqnr_db": 10 * math.log10(signal / noise) if noise and signal else None}
