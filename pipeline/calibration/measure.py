"""A candidate model's outputs against the float model's on a set of samples: the measure
that calibration=auto (pipeline/calibration/auto.py) and the mixed search
(stages/sensitivity.py) decide on. The reference outputs are computed once."""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence

import numpy as np
import onnx

from pipeline.calibration.statistics import BatchRunner
from pipeline.data import pack

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

    def __call__(self, model: onnx.ModelProto) -> dict:
        """cosine: verify's (all samples together, per output), averaged over the outputs;
        worst_sample_cosine: the lowest cosine of one sample's output; sqnr_db over
        everything; top1_drop against the float model's top-1 (None without labels)."""
        return self.score(self._run(model))

    def score(self, actual: List[List[np.ndarray]]) -> dict:
        """__call__'s measure of outputs already computed (chunks in _run's layout)."""
        cosines, worst, signal, noise = [], 1.0, 0.0, 0.0
        for index in range(len(self.outputs)):
            ref = np.concatenate([chunk[index] for chunk in self.reference]).reshape(self.count, -1)
            out = np.concatenate([chunk[index] for chunk in actual]).reshape(self.count, -1)
            if not np.isfinite(out).all():
                out = np.nan_to_num(out, nan=0.0, posinf=0.0, neginf=0.0)
            # float64 sums without float64 copies of the outputs (einsum casts as it goes)
            dots, ref_sq, out_sq = (np.einsum("ij,ij->i", a, b, dtype=np.float64)
                                    for a, b in ((ref, out), (ref, ref), (out, out)))
            cosines.append(_cosine(dots.sum(), ref_sq.sum(), out_sq.sum()))
            worst = min(worst, min(_cosine(*row) for row in zip(dots, ref_sq, out_sq)))
            signal += float(ref_sq.sum())
            noise += float(max(ref_sq.sum() + out_sq.sum() - 2.0 * dots.sum(), 0.0))
        top1 = self._top1(actual)
        return {"cosine": float(np.mean(cosines)), "worst_sample_cosine": worst,
                "sqnr_db": 10 * math.log10(signal / noise) if noise and signal else None,
                "top1_drop": None if top1 is None else self.reference_top1 - top1}

    def _run(self, model: onnx.ModelProto) -> List[List[np.ndarray]]:
        """The outputs chunk by chunk; sample i of a chunk is the i-th of its equal slices
        along axis 0 (BatchRunner runs a model that takes no batch one sample at a time)."""
        runner = BatchRunner(model, self.outputs, min(CHUNK, self.count))
        chunks = []
        for start in range(0, self.count, CHUNK):
            part = self.samples[start:start + CHUNK]
            feeds = pack(part)  # scalars count as [1]; BatchRunner unpacks them
            values = runner.run(feeds, len(part))
            chunks.append([values[name] for name in self.outputs])
        return chunks

    def _top1(self, chunks) -> Optional[float]:
        if self.labels is None:
            return None
        first = np.concatenate([chunk[0] for chunk in chunks]).reshape(self.count, -1)
        return float(np.mean(np.argmax(first, axis=1) == np.asarray(self.labels)))


def float_outputs(model: onnx.ModelProto) -> List[str]:
    """The outputs a cosine means something for: the float ones (class ids and masks are
    decisions, verify compares them exactly); every output when none is float."""
    from pipeline.quantize import FLOAT_TYPES

    names = [o.name for o in model.graph.output if o.type.tensor_type.elem_type in FLOAT_TYPES]
    return names or [o.name for o in model.graph.output]


def _cosine(dot: float, ref_sq: float, out_sq: float) -> float:
    norm = math.sqrt(ref_sq * out_sq)
    if norm == 0.0:
        return 1.0 if ref_sq == out_sq == 0 else 0.0
    return float(dot / norm)
