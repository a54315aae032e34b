"""``metric=top1``: classifiers, by the argmax of their class scores against the label's
class, or without labels against the reference's argmax (float-noise ties agreeing)."""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from pipeline.metrics.base import MetricError

# Top-1 without labels: the build's class agrees with the reference's when the reference's
# score of that class is within float noise of its top score (a tie the reference itself
# breaks by float rounding is no disagreement): a relative tolerance of the sample's
# largest |score| (float32 sums of a few thousand terms reorder at about this level) plus
# a tiny absolute one for all-zero scores.
TIE_RTOL = 1e-5
TIE_ATOL = 1e-12
UNLABELED_TOP1 = "top-1 agreement with the reference (no labels)"


class Top1:
    """Top-1 accuracy: the argmax of each sample's output against its class label. Without
    labels, on class scores (``class_scores``: one dimension larger than 1 per sample, not
    named as an embedding), the agreement of the build's argmax with the reference's,
    float-noise ties agreeing (``tie_agreement``); on any other output (masks, token
    tensors, embeddings) nothing."""

    needs_labels = True

    def __call__(self, outputs: np.ndarray, reference: np.ndarray, labels: Optional[Sequence]) -> np.ndarray:
        if labels is None:  # the scorer asks for this only on class scores (without_labels)
            return tie_agreement(outputs, reference)
        classes = np.asarray([_class_index(label) for label in labels])
        return (_argmax(outputs) == classes).astype(np.float64)

    def without_labels(self, shape: Sequence[int], output: str = "") -> Optional[str]:
        """What top-1 measures without labels on output ``output`` of this per-sample shape,
        or None where it measures nothing (not class scores)."""
        return UNLABELED_TOP1 if class_scores(shape, output) else None

    def agreement(self, outputs: np.ndarray, reference: np.ndarray) -> np.ndarray:
        return (_argmax(outputs) == _argmax(reference)).astype(np.float64)

    def decode(self, output: np.ndarray) -> str:
        return f"class {int(np.argmax(np.asarray(output).reshape(-1)))}"


def _argmax(batch: np.ndarray) -> np.ndarray:
    return np.argmax(batch.reshape(len(batch), -1), axis=1)


# outputs shaped like class scores ([1, dim]) whose names say they are embeddings (a sentence
# embedder's sentence_embedding, BERT's pooler_output, CLIP's image_embeds): the argmax of an
# embedding is no class (metric=embedding judges those)
EMBEDDING_NAMES = ("embed", "pooler", "hidden")


def class_scores(shape: Sequence[int], output: str = "") -> bool:
    """Whether one sample's output of this shape holds class scores: exactly one dimension
    larger than 1 ([C], [1, C]; C >= 2), not a map or a sequence an argmax would flatten,
    and not named as an embedding (EMBEDDING_NAMES)."""
    if any(word in str(output).lower() for word in EMBEDDING_NAMES):
        return False
    return sum(int(size) > 1 for size in shape) == 1


def tie_agreement(outputs: np.ndarray, reference: np.ndarray) -> np.ndarray:
    """Per sample 1.0 where the build's argmax is the reference's, or a class whose reference
    score is within float noise (TIE_RTOL of the sample's largest |score|, plus TIE_ATOL)
    of the reference's top score; 0.0 else, and for a build sample that is not finite."""
    mine = outputs.reshape(len(outputs), -1)
    theirs = reference.reshape(len(reference), -1).astype(np.float64)
    chosen = np.argmax(mine, axis=1)
    top = theirs.max(axis=1)
    noise = TIE_RTOL * np.abs(theirs).max(axis=1) + TIE_ATOL
    agree = theirs[np.arange(len(theirs)), chosen] >= top - noise
    return (agree & np.isfinite(mine).all(axis=1)).astype(np.float64)


LABEL_HINT = "top1 needs class indices in labels.csv (texts: metric=ctc, numbers: metric=regression, none: metric=none)"


def _class_index(label) -> int:
    try:
        number = float(label)
    except (TypeError, ValueError):
        raise MetricError(f"label {label!r} is not a class index; {LABEL_HINT}") from None
    if not number.is_integer():
        raise MetricError(f"label {label!r} is not a class index; {LABEL_HINT}")
    return int(number)
