"""Task metrics: what a user's model is for (top-1, text, masks, numbers), measured on the
validation set for the fp32 reference and every build, as a Hydra ``metric`` config group.

The interface (docs/metrics.md), the same for the built-ins and for user code::

    metric(outputs, reference, labels) -> per-sample scores, shape [N]

``outputs`` and ``reference`` are one model output (``metric.output``, default the first)
for a batch of N validation samples, stacked on a new axis 0 (shape [N, *output shape]);
``labels`` is the list of the N samples' labels from labels.csv (an int, a str or a
float each), or None when the split has none. parity aggregates the scores (their mean,
or the metric's ``aggregate``) for the reference (``metric(reference, reference, labels)``)
and for each build, and gates on the drop. A metric declares ``higher_is_better``
(default True) and ``needs_labels`` (default False); it may define ``decode(output)`` (one
sample's output as text: ``parity-bundle run`` prints it), ``agreement(outputs,
reference)`` (per-sample 0/1: the build's prediction equals the reference's),
``extras(outputs, reference, labels)`` (named secondary per-sample scores, reported) and,
for a metric that needs labels, ``without_labels(shape, output)`` (what it measures on a
split without labels for one sample's output of that shape and name, called then with
labels None, its scores the agreement with the reference; None: nothing. top1: on class
scores), and ``records(outputs, reference, labels)`` (one object per sample, or None) with
``set_extras(records)`` (figures of the whole set from every sample's record, reported
beside the extras: detection's mAPs against box labels).
A ``set_level`` metric (nearest neighbours: pipeline/embedding_metric.py) is called once on
every sample's ``features``. Samples whose outputs differ in shape are scored per shape.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from pipeline.detection_metric import Detection  # noqa: F401 - a built-in: metric=detection
from pipeline.embedding_metric import Embedding  # noqa: F401 - a built-in: metric=embedding
from pipeline.errors import ConfigError
from pipeline.verification.sample_groups import count_of, per_sample  # noqa: F401 - per_sample: sensitivity

# read by parity, not passed to the metric
PARITY_KEYS = ("output", "path", "higher_is_better", "needs_labels", "set_level", "name")
CHARSET_FILE = "charset.txt"  # in a bundle
BATCH = 16  # samples per metric call during verify: bounded memory for large outputs


class MetricError(ConfigError):
    label = "metric error"


# --- built-in metrics ---------------------------------------------------------------

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


class MapIoU:
    """Segmentation / text detection: IoU of the output map binarized at ``threshold``
    with the reference's map binarized the same way (both empty: 1). Needs no labels.
    Per page (default): the mean of the pages' IoUs, every page counts the same; ``pooled``:
    all intersections over all unions, a page counts by its area (the union-weighted mean
    of the pages' IoUs: ``weights``)."""

    def __init__(self, threshold: float = 0.3, pooled: bool = False):
        self.threshold, self.pooled = float(threshold), bool(pooled)

    def __call__(self, outputs: np.ndarray, reference: np.ndarray, labels: Optional[Sequence]) -> np.ndarray:
        both, union = self._areas(outputs, reference)
        return np.where(union > 0, both / np.maximum(union, 1), 1.0)

    def weights(self, outputs: np.ndarray, reference: np.ndarray, labels: Optional[Sequence]) -> Optional[np.ndarray]:
        """Each page's union when pooled (None: every page weighs the same)."""
        return self._areas(outputs, reference)[1].astype(np.float64) if self.pooled else None

    def _areas(self, outputs: np.ndarray, reference: np.ndarray) -> tuple:
        mine = outputs.reshape(len(outputs), -1) > self.threshold
        theirs = reference.reshape(len(reference), -1) > self.threshold
        return (mine & theirs).sum(axis=1), (mine | theirs).sum(axis=1)


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


class Regression:
    """Numbers: per-sample mean absolute error (``statistic: mae``) or mean squared error
    aggregated as its root (``statistic: rmse``), against the label (a number) or, without
    labels, against the reference's output. Lower is better."""

    higher_is_better = False

    def __init__(self, statistic: str = "mae"):
        if statistic not in ("mae", "rmse"):
            raise MetricError(f"metric.statistic={statistic!r}; allowed: mae, rmse")
        self.statistic = statistic

    def __call__(self, outputs: np.ndarray, reference: np.ndarray, labels: Optional[Sequence]) -> np.ndarray:
        values = outputs.reshape(len(outputs), -1).astype(np.float64)
        if labels is not None:
            truth = np.asarray([_number(label) for label in labels])[:, np.newaxis]
        else:
            truth = reference.reshape(len(reference), -1).astype(np.float64)
        error = values - truth
        return np.mean(np.abs(error) if self.statistic == "mae" else error * error, axis=1)

    def aggregate(self, scores: np.ndarray) -> float:
        return float(np.mean(scores)) if self.statistic == "mae" else math.sqrt(float(np.mean(scores)))


def _number(label) -> float:
    try:
        return float(label)
    except (TypeError, ValueError):
        raise MetricError(f"label {label!r} is not a number") from None


# --- loading a metric from its config ---------------------------------------------------

@dataclass
class TaskMetric:
    """A metric as parity uses it: the user's callable and what it declares."""

    name: str
    score: Callable[..., Any]
    output: Optional[str] = None
    higher_is_better: bool = True
    needs_labels: bool = False
    config: Dict[str, Any] = field(default_factory=dict)
    set_level: bool = False  # scored once on the whole set (nearest neighbours), not in batches
    names: Tuple[str, ...] = ()  # metric.output's names: one, or two for a pair (a detector's boxes and scores)

    def aggregate(self, scores: np.ndarray) -> float:
        own = getattr(self.score, "aggregate", None)
        return float(own(scores)) if own else float(np.mean(scores))

    def hook(self, name: str) -> Optional[Callable]:
        """The metric's optional ``decode``, ``agreement``, ``extras`` or ``without_labels``."""
        return getattr(self.score, name, None)

    def without_labels(self, shape: Sequence[int], output: str) -> Optional[str]:
        """What a metric that needs labels measures on a split without them, for one
        sample's output ``output`` of this shape (its ``without_labels`` hook: top1 on class
        scores, the agreement with the reference's argmax), or None: it measures nothing there."""
        hook = self.hook("without_labels")
        found = self.call(hook, tuple(int(size) for size in shape), str(output)) if hook else None
        return str(found) if found else None

    def __call__(self, outputs: np.ndarray, reference: np.ndarray, labels: Optional[Sequence]) -> np.ndarray:
        """Per-sample scores, checked: one finite number per sample, or a MetricError
        naming the metric (exit 2). A set-level metric scores the samples' features."""
        if self.set_level:
            outputs, reference = self.features(outputs), self.features(reference)
        return self.scored(outputs, reference, labels)

    def scored(self, outputs: np.ndarray, reference: np.ndarray, labels: Optional[Sequence]) -> np.ndarray:
        """The metric on what it takes as is (a set-level metric: features), checked."""
        return check_scores(self.name, self.call(self.score, outputs, reference, labels), count_of(outputs))

    def features(self, outputs: np.ndarray) -> np.ndarray:
        """A set-level metric's reduction of each sample's output (``features``: one
        embedding per sample), or the outputs themselves where it has none."""
        reduce = self.hook("features")
        if reduce is None:
            return outputs
        found = np.asarray(self.call(reduce, outputs))
        if found.ndim == 0 or len(found) != len(outputs):
            raise MetricError(f"metric {self.name}: features returned shape {tuple(found.shape)} for "
                              f"{len(outputs)} samples; it returns one row per sample")
        return found

    def call(self, function: Callable, *args):
        """``function(*args)``: an exception in the metric's code becomes one line naming it."""
        try:
            return function(*args)
        except MetricError as err:
            raise MetricError(f"metric {self.name}: {err.args[0] if err.args else err}") from err
        except Exception as err:  # noqa: BLE001 - the user's code: one line, not a traceback
            text = str(err).strip().splitlines()
            raise MetricError(f"metric {self.name} raised {type(err).__name__}: {text[0] if text else ''}") from err


def check_scores(name: str, scores, count: int, what: str = "scores") -> np.ndarray:
    try:
        values = np.asarray(scores, dtype=np.float64)
    except (TypeError, ValueError):
        raise MetricError(f"metric {name}: returned {type(scores).__name__}, not numbers; "
                          f"a metric returns one score per sample (shape ({count},))") from None
    if values.shape != (count,):
        raise MetricError(f"metric {name}: returned {what} of shape {tuple(values.shape)} for a batch of {count} "
                          f"samples; a metric returns one score per sample (shape ({count},))")
    bad = np.flatnonzero(~np.isfinite(values))
    if bad.size:
        raise MetricError(f"metric {name}: returned {values[bad[0]]} for sample {int(bad[0])} of the batch; "
                          "scores must be finite numbers")
    return values


def check_records(name: str, records, count: int) -> list:
    """A metric's ``records``: one object per sample, or a MetricError naming it."""
    try:
        found = list(records)
    except TypeError:
        found = None
    if found is None or len(found) != count:
        raise MetricError(f"metric {name}: records returned {type(records).__name__} for a batch of {count} "
                          f"samples; it returns one record per sample, or None")
    return found


def load_metric(config: Optional[Dict[str, Any]], root: Optional[str] = None) -> Optional[TaskMetric]:
    """The configured metric (``metric`` group) through ``hydra.utils.instantiate``, or
    None for ``metric=none``. A class is instantiated with the config's other keys; a
    function is the metric itself (its keys bound as keyword arguments). ``root``:
    the folder relative files (a charset) are read from, for bundles. Imports the
    metric's code only: no model is loaded."""
    config = dict(config or {})
    target = config.get("_target_")
    if not target:
        return None
    name = config.get("name") or _short_name(str(target))
    if config.get("path"):
        folder = str(Path(config["path"]).expanduser().resolve())
        if folder not in sys.path:
            sys.path.insert(0, folder)
    arguments = {key: value for key, value in config.items() if key not in PARITY_KEYS}
    if target == f"{__name__}.CTC" and root:
        arguments.setdefault("root", root)
    target, score = _instantiate(name, arguments)

    def declared(key: str, default: bool) -> bool:  # the config, else the metric (instance, then class/function)
        value = config.get(key)
        return bool(getattr(score, key, getattr(target, key, default)) if value is None else value)

    names = output_names(config.get("output"))
    return TaskMetric(name=name, score=score, output=names[0] if names else None,
                      higher_is_better=declared("higher_is_better", True),
                      needs_labels=declared("needs_labels", False), config=config,
                      set_level=declared("set_level", False), names=names)


def output_names(output) -> Tuple[str, ...]:
    """metric.output as names: none (null), one, or a list of them (a pair metric's two); a
    name is a string however it looks (torch.onnx.export names outputs by number)."""
    if output is None:
        return ()
    if isinstance(output, Sequence) and not isinstance(output, str):  # a list (Hydra's ListConfig too)
        return tuple(str(name) for name in output)
    return (str(output),)


def _instantiate(name: str, arguments: Dict[str, Any]):
    from hydra.errors import InstantiationException
    from hydra.utils import get_object, instantiate

    try:
        target = get_object(arguments["_target_"])
    except Exception as err:  # noqa: BLE001 - ImportError, AttributeError...: the user's path
        raise MetricError(f"metric {name}: cannot import {arguments['_target_']!r} ({_cause(err)}); "
                          "set metric._target_ to module.callable and metric.path to the folder holding "
                          "the module") from None
    plain = {**arguments, "_convert_": "all"}  # lists and dicts as Python's, not OmegaConf's
    try:
        if isinstance(target, type):
            return target, instantiate(plain)
        if not callable(target):
            raise MetricError(f"metric {name}: {arguments['_target_']!r} is not callable")
        return target, instantiate({**plain, "_partial_": True}) if len(arguments) > 1 else target
    except InstantiationException as err:
        own = _metric_error(err)  # the metric's own account (a charset it cannot read)
        raise MetricError(f"metric {name}: {own.args[0] if own else _cause(err)}") from None


def _metric_error(err: Optional[BaseException]) -> Optional[MetricError]:
    while err is not None and not isinstance(err, MetricError):
        err = err.__cause__ or err.__context__
    return err


def _cause(err: BaseException) -> str:
    while err.__cause__ is not None:
        err = err.__cause__
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__


def _short_name(target: str) -> str:
    builtin = {f"{__name__}.{cls}": short for cls, short in
               (("Top1", "top1"), ("MapIoU", "map_iou"), ("CTC", "ctc"), ("Regression", "regression"))}
    builtin[f"{__name__}.Embedding"] = "nn@1"  # the share of samples keeping their nearest neighbour
    return builtin.get(target, target.rsplit(".", 1)[-1])


def files(config: Optional[Dict[str, Any]]) -> List[Path]:
    """Files a metric's results depend on, for cache keys: a charset file and the
    source file of a custom metric's module."""
    config = config or {}
    found = []
    charset = config.get("charset")
    if isinstance(charset, str) and Path(charset).expanduser().is_file():
        found.append(Path(charset).expanduser())
    target = str(config.get("_target_") or "")
    if config.get("path") and "." in target:
        module = Path(config["path"]).expanduser() / (target.rsplit(".", 1)[0].replace(".", "/") + ".py")
        if module.is_file():
            found.append(module)
    return found


def bundle_record(config: Optional[Dict[str, Any]], folder: Path) -> Optional[Dict[str, Any]]:
    """The metric as a bundle's runtime.yaml records it (``parity-bundle run`` decodes
    outputs with it): a charset file is copied into the bundle as CHARSET_FILE."""
    if not config or not config.get("_target_"):
        return None
    record = dict(config)
    charset = record.get("charset")
    if isinstance(charset, str) and charset:
        (Path(folder) / CHARSET_FILE).write_text("\n".join(read_charset(charset)) + "\n", encoding="utf-8")
        record["charset"] = CHARSET_FILE
    if record.get("path"):
        record["path"] = str(Path(record["path"]).expanduser().resolve())
    return record
