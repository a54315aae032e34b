"""``metric=ctc``: text recognition, greedy CTC decoding and character accuracy against the
text labels (or the reference's text), with the charset read from a file or a list."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from pipeline.metrics.base import MetricError


class CTC:
    """Text recognition: greedy CTC decoding (argmax per step, repeats merged, blanks
    dropped), then character accuracy = 1 - edit distance / max(len(label), len(text))
    per sample; ``exact_match`` is reported next to it. Without labels, the reference's
    decoded text is the label. ``charset``: a file with one symbol per line, or a list;
    class ``blank`` is the CTC blank, the other classes map to the charset in order.
    ``strip``: surrounding whitespace dropped from texts and labels (PaddleOCR's
    post-processing: its recognizer emits leading spaces on some lines); ``casefold``:
    compared case-insensitively; ``ignore_space``: every space dropped (PaddleOCR's
    training metric, RecMetric, does this by default)."""

    def __init__(self, charset: Any, blank: int = 0, root: Optional[str] = None, strip: bool = True,
                 casefold: bool = False, ignore_space: bool = False):
        self.symbols = read_charset(charset, root)
        self.blank = int(blank)
        self.strip, self.casefold, self.ignore_space = bool(strip), bool(casefold), bool(ignore_space)
        self._recent: List[tuple] = []  # (batch, texts): score, extras and agreement decode the same batches

    def __call__(self, outputs: np.ndarray, reference: np.ndarray, labels: Optional[Sequence]) -> np.ndarray:
        texts, truth = self.decode_batch(outputs), self._truth(reference, labels)
        return np.asarray([char_accuracy(text, label) for text, label in zip(texts, truth)])

    def extras(self, outputs: np.ndarray, reference: np.ndarray, labels: Optional[Sequence]) -> Dict[str, np.ndarray]:
        texts, truth = self.decode_batch(outputs), self._truth(reference, labels)
        return {"exact_match": np.asarray([float(a == b) for a, b in zip(texts, truth)])}

    def _truth(self, reference: np.ndarray, labels: Optional[Sequence]) -> List[str]:
        """The labels, normalized as the decoded texts are; without labels the reference's texts."""
        return [self._normal(str(label)) for label in labels] if labels is not None else self.decode_batch(reference)

    def _normal(self, text: str) -> str:
        text = text.replace(" ", "") if self.ignore_space else text
        text = text.strip() if self.strip else text
        return text.casefold() if self.casefold else text

    def agreement(self, outputs: np.ndarray, reference: np.ndarray) -> np.ndarray:
        return np.asarray([float(a == b) for a, b in zip(self.decode_batch(outputs), self.decode_batch(reference))])

    def decode(self, output: np.ndarray) -> str:
        return self.decode_batch(np.asarray(output)[np.newaxis])[0]

    def decode_batch(self, outputs: np.ndarray) -> List[str]:
        """Each sample's [steps, classes] scores (leading 1-axes dropped) as text."""
        for batch, texts in self._recent:
            if batch is outputs:
                return texts
        texts = self._decode(outputs)
        self._recent = [(outputs, texts), *self._recent[:1]]
        return texts

    def _decode(self, outputs: np.ndarray) -> List[str]:
        steps = np.argmax(outputs.reshape(len(outputs), -1, outputs.shape[-1]), axis=2)
        if outputs.shape[-1] != len(self.symbols) + 1:
            raise MetricError(f"the output has {outputs.shape[-1]} classes but the charset has "
                              f"{len(self.symbols)} symbols plus the blank; check metric.charset")
        texts = []
        for row in steps:
            keep = np.ones(len(row), dtype=bool)
            keep[1:] = row[1:] != row[:-1]
            keep &= row != self.blank
            texts.append(self._normal("".join(self.symbols[c - (c > self.blank)] for c in row[keep])))
        return texts


def read_charset(charset: Any, root: Optional[str] = None) -> List[str]:
    """A list of symbols, or a file of one symbol per line (a line holding one space is
    the space symbol; only the line break is stripped)."""
    if isinstance(charset, (list, tuple)):
        return [str(symbol) for symbol in charset]
    if not isinstance(charset, str) or not charset:
        raise MetricError("metric.charset must be a file (one symbol per line) or a list of symbols")
    path = Path(charset).expanduser()
    if not path.is_absolute() and root:
        path = Path(root) / path
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise MetricError(f"metric.charset {path} cannot be read ({err})") from err
    symbols = text.split("\n")
    if symbols and symbols[-1] == "":
        symbols.pop()  # the file's final line break
    return [symbol.rstrip("\r") for symbol in symbols]


def char_accuracy(text: str, label: str) -> float:
    longest = max(len(text), len(label))
    return 1.0 - edit_distance(text, label) / longest if longest else 1.0


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance (insertions, deletions, substitutions)."""
    if a == b:  # most predictions: no table to fill
        return 0
    previous = list(range(len(b) + 1))
    for i, char_a in enumerate(a, start=1):
        current = [i]
        for j, char_b in enumerate(b, start=1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (char_a != char_b)))
        previous = current
    return previous[-1]
