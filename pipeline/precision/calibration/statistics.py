"""One streaming pass over the calibration set: for every float activation the int8
build may quantize, min, max and a histogram of |x|. Nothing grows with the number of
samples except the few samples kept (``keep``) for comparing methods."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Tuple, Union

import numpy as np
import onnx

from pipeline.precision.calibration.histogram import AbsHistogram
from pipeline.data import Sample, pack, stack, unpack
from pipeline.environment import own_threads
from pipeline.errors import InputError
from pipeline.model import bodies, signature
from pipeline.shapes import elements, shape_key

ACTIVATION_BUDGET = 256 << 20  # bytes of activations held per group of samples
# values of one tensor a sample adds to its histogram: a larger tensor is read at a prime
# stride (its min and max stay exact). The real-size segmenter's 329 tensors hold 128 M
# values a sample: its histograms took 1.6 s a sample against a 0.47 s run (docs/time.md)
HISTOGRAM_VALUES = 1 << 20
# values of one tensor kept for calibration=auto's per-tensor choice: fewer than ``keep``
# samples of a large tensor (the segmenter's kept values took 2 GB, written to the cache
# and read back in 14 s)
KEPT_VALUES = 1 << 22


@dataclass
class Statistics:
    histograms: Dict[str, AbsHistogram]
    kept: Dict[str, np.ndarray] = field(default_factory=dict)  # tensor -> first samples, stacked
    samples: int = 0
    batch_size: int = 1
    batch_note: str = ""  # why samples ran one at a time, when they did
    # tensor -> [mean over samples of the sample's min, ... of its max] (range estimator mean_min_max)
    sample_ranges: Dict[str, List[float]] = field(default_factory=dict)
    # tensor -> each sample's largest |value|, in the order of sample_names: which samples hold
    # the outliers (judge_samples keeps them)
    sample_peaks: Dict[str, List[float]] = field(default_factory=dict)
    sample_names: List[str] = field(default_factory=list)
    sample_values: int = 0  # values of the measured tensors in one sample (the largest shape's)
    # tensor -> max |x| per channel (axis 1, or the axis asked) over every sample, for the tensors asked (``channels``)
    channel_maxima: Dict[str, np.ndarray] = field(default_factory=dict)
    # tensor -> each sample's [min, max], in the order of sample_names: a max table over any
    # of the samples (bounds_over) without a pass of its own
    sample_bounds: Dict[str, List[List[float]]] = field(default_factory=dict)

    def bounds_over(self, names: List[str]) -> Optional[Dict[str, Tuple[float, float]]]:
        """Each tensor's (min, max) over the samples named, or None where a sample or a
        tensor's per-sample bounds are missing (a batch that did not split into samples)."""
        at = {name: index for index, name in enumerate(self.sample_names)}
        if not names or any(name not in at for name in names) or set(self.sample_bounds) != set(self.histograms):
            return None
        picked = [at[name] for name in names]
        return {tensor: (min(bounds[i][0] for i in picked), max(bounds[i][1] for i in picked))
                for tensor, bounds in self.sample_bounds.items()}

    def save(self, folder: Path) -> None:
        meta = {"samples": self.samples, "batch_size": self.batch_size, "batch_note": self.batch_note,
                "sample_ranges": self.sample_ranges, "sample_peaks": self.sample_peaks,
                "sample_bounds": self.sample_bounds,
                "sample_names": self.sample_names, "sample_values": self.sample_values,
                "histograms": {name: h.to_json() for name, h in self.histograms.items()}}
        (folder / "statistics.json").write_text(json.dumps(meta))
        np.savez(folder / "kept.npz", **self.kept)
        np.savez(folder / "channels.npz", **self.channel_maxima)

    def merged(self, other: "Statistics", names: Optional[List[str]] = None) -> "Statistics":
        """These statistics with ``other``'s tensors in place of their own (the same samples);
        ``names``: the tensors kept, in this order (a rewritten model's own, where a tensor
        was added or no longer measured)."""
        def joined(mine: dict, theirs: dict) -> dict:
            both = {**mine, **theirs}
            return both if names is None else {name: both[name] for name in names if name in both}

        return Statistics(joined(self.histograms, other.histograms), joined(self.kept, other.kept), self.samples,
                          self.batch_size, self.batch_note, joined(self.sample_ranges, other.sample_ranges),
                          joined(self.sample_peaks, other.sample_peaks), self.sample_names, self.sample_values,
                          {**self.channel_maxima, **other.channel_maxima},
                          joined(self.sample_bounds, other.sample_bounds))

    @classmethod
    def load(cls, folder: Path) -> "Statistics":
        meta = json.loads((folder / "statistics.json").read_text())
        with np.load(folder / "kept.npz") as kept:
            arrays = {key: kept[key] for key in kept.files}
        channels = folder / "channels.npz"
        with np.load(channels) if channels.is_file() else nullcontext({}) as found:
            maxima = {key: found[key] for key in found}
        return cls({n: AbsHistogram.from_json(h) for n, h in meta["histograms"].items()},
                   arrays, meta["samples"], meta["batch_size"], meta.get("batch_note", ""),
                   meta.get("sample_ranges", {}), meta.get("sample_peaks", {}), meta.get("sample_names", []),
                   meta.get("sample_values", 0), maxima, meta.get("sample_bounds", {}))


# calibration samples the int8 judges (equalization, smoothing, calibration=auto's tables)
# run on: as many as hold JUDGE_VALUES activation values, between JUDGE_MIN and JUDGE_MAX.
# The real-size segmenter's 128 M values a sample: 4 samples (its judges ran 16 and took
# 73 s of equalization and 43 s of auto's tables on an AVX2 CPU; docs/time.md)
JUDGE_VALUES = 512 << 20
JUDGE_MIN, JUDGE_MAX = 4, 16


def judge_count(stats: Optional["Statistics"], available: int) -> int:
    """How many calibration samples the judges run on, sized to the model's activations."""
    if stats is None or stats.sample_values <= 0:
        return min(available, JUDGE_MAX)
    return min(available, max(JUDGE_MIN, min(JUDGE_MAX, JUDGE_VALUES // stats.sample_values)))


def judge_samples(samples, stats: Optional["Statistics"]) -> List[Sample]:
    """The calibration samples a method is judged on (judge_count of them, in their order):
    first the samples that hold the largest value of the most tensors (the outliers a
    clipping range must keep: up to half of them), then samples spread evenly over the rest.
    ``samples``: a data Split (only the chosen samples are read) or a list of samples."""
    names = list(samples.names) if hasattr(samples, "names") else [sample.name for sample in samples]
    chosen = judge_indices(names, stats)
    if hasattr(samples, "names"):
        return [samples.at(index) for index in chosen]
    return [samples[index] for index in chosen]


def judge_indices(names: Sequence[str], stats: Optional["Statistics"]) -> List[int]:
    """judge_samples' choice as positions in ``names`` (the calibration samples' names)."""
    count = judge_count(stats, len(names))
    if count >= len(names):
        return list(range(len(names)))
    position = {name: index for index, name in enumerate(names)}
    wins: Dict[int, int] = {}
    for peaks in (stats.sample_peaks.values() if stats is not None else ()):
        if len(peaks) == len(stats.sample_names) and peaks:
            holder = position.get(stats.sample_names[int(np.argmax(peaks))])
            if holder is not None:
                wins[holder] = wins.get(holder, 0) + 1
    chosen = sorted(wins, key=lambda index: (-wins[index], index))[:count // 2]
    rest = [index for index in range(len(names)) if index not in chosen]
    needed = count - len(chosen)
    chosen += [rest[int(i)] for i in np.floor(np.linspace(0, len(rest) - 1, needed) + 0.5)] if needed else []
    return sorted(set(chosen))


def activation_names(model: onnx.ModelProto, around: Optional[Iterable[str]] = None) -> List[str]:
    """Float tensors that depend on the graph inputs (weights and constant subgraphs are
    not activations), in topological order; ``around``: only the inputs and outputs of
    these op types and the outputs of the ops that read theirs (what an int8 build can
    quantize: ONNX Runtime's quantizer also asks for the range of a Relu it fuses into the
    Q/DQ of the op before it)."""
    if around is not None:
        kinds = set(around)
        made = {o for node in model.graph.node if node.op_type in kinds for o in node.output}
        touching = {t for node in model.graph.node if node.op_type in kinds for t in [*node.input, *node.output]}
        touching.update(o for node in model.graph.node if made & set(node.input) for o in node.output)
        return [n for n in activation_names(model) if n in touching]
    initializers = {t.name for t in model.graph.initializer}
    types = element_types(model)
    names = [i.name for i in model.graph.input if i.name not in initializers]
    reachable = set(names)
    for node in model.graph.node:
        if any(i in reachable for i in node.input):
            outputs = [o for o in node.output if o]
            reachable.update(outputs)
            names += outputs
    return [n for n in dict.fromkeys(names) if types.get(n) == onnx.TensorProto.FLOAT]


def element_types(model: onnx.ModelProto) -> Dict[str, int]:
    """The ONNX element type of every tensor the graph declares (inputs, value_info as the
    convert stage inferred it, outputs)."""
    return {v.name: v.type.tensor_type.elem_type
            for v in list(model.graph.input) + list(model.graph.value_info) + list(model.graph.output)}


def collect(model_path: Path, samples: Iterable[Sample], count: int, bins: int = 2048,
            batch_size: int = 16, keep: int = 4, progress=None, around: Optional[Iterable[str]] = None,
            only: Optional[Iterable[str]] = None, channels: Union[Iterable[str], Dict[str, int]] = ()) -> Statistics:
    """``around``: the op types whose tensors are measured (activation_names); None: all. ``only``
    (a set): of those, just these. ``channels``: tensors whose channel maxima are kept too
    (axis 1; a dict: each tensor's own axis, -1 for a MatMul input's last)."""
    model = model_path if isinstance(model_path, onnx.ModelProto) else onnx.load(str(model_path))
    names = [name for name in activation_names(model, around) if only is None or name in only]
    histograms, kept = {name: AbsHistogram(bins) for name in names}, _Kept(names, keep)
    facts = _PerSample(names, channels)
    runner = BatchRunner(model, names, batch_size)
    batch: List[Sample] = []
    pending: Dict[str, List[Sample]] = {}  # shape -> samples waiting: a batch stacks samples of one shape
    seen = 0
    group = 1  # the first sample alone measures how much memory a sample's activations take

    def flush():
        nonlocal seen, group
        feeds = pack([s.feeds for s in batch])
        values = runner.run(feeds, len(batch))  # while the last batch's histograms fill
        filler.settle()
        batch_bytes = sum(v.nbytes for v in values.values())
        facts.start(batch, values)
        # one sample at a time when the model takes no batch: grouping would only copy them together
        group = 1 if runner.batch_size == 1 else int(max(1, min(batch_size, ACTIVATION_BUDGET // max(
            batch_bytes / len(batch), 1))))
        kept.start(batch)
        filler.fill(values, batch, wait=2 * batch_bytes > ACTIVATION_BUDGET)
        del values
        seen += len(batch)
        if progress:
            progress(len(batch))
        batch.clear()

    with ThreadPoolExecutor(max_workers=own_threads()) as pool:
        filler = _Filler(histograms, facts, kept, pool)
        for sample in samples:
            waiting = pending.setdefault(shape_key(sample.feeds), [])
            waiting.append(sample)
            if len(waiting) >= group:  # histograms update once per group, whatever the runner's batch
                batch.extend(waiting)
                waiting.clear()
                flush()
        for waiting in [samples for samples in pending.values() if samples]:
            batch.extend(waiting)
            flush()
        filler.settle()
    stacked = {name: np.concatenate(parts) for name, parts in kept.values.items() if parts}
    return Statistics(histograms, stacked, seen, min(runner.batch_size, group), runner.note, facts.ranges(seen),
                      facts.complete_peaks(), facts.order, facts.largest, facts.maxima, facts.complete_bounds())


class _Filler:
    """A batch's values into each tensor's histogram, per-sample facts and kept values, one
    tensor a thread. numpy releases the GIL in its loops (and ONNX Runtime in its run), so
    the histograms of different tensors fill in parallel, and beside the next batch's run
    where two batches' activations fit in ACTIVATION_BUDGET (PP-OCRv4 rec's 64 lines, 68 MB
    of activations each, one at a time: the pass 6.6 -> 5.3-5.8 s)."""

    def __init__(self, histograms: Dict[str, AbsHistogram], facts: "_PerSample", kept: "_Kept", pool):
        self.histograms, self.facts, self.kept, self.pool = histograms, facts, kept, pool
        self.filling: list = []  # the last batch's updates, still running

    def fill(self, values: Dict[str, np.ndarray], batch: List[Sample], wait: bool) -> None:
        span = f"{getattr(batch[0], 'name', '?')}..{getattr(batch[-1], 'name', '?')}"
        self.filling.extend(self.pool.submit(self._update, name, value, len(batch), span)
                            for name, value in values.items())
        if wait:
            self.settle()

    def settle(self) -> None:
        for update_done in self.filling:
            update_done.result()  # raises a tensor's InputError
        self.filling.clear()

    def _update(self, name: str, value: np.ndarray, count: int, span: str) -> None:
        per_sample = value.reshape(count, -1) if value.size % count == 0 else value.reshape(1, -1)
        lows, highs = (per_sample.min(axis=1), per_sample.max(axis=1)) if per_sample.size else (None, None)
        bounds = None if lows is None else (float(lows.min()), float(highs.max()))  # exact, whatever is read
        try:
            self.histograms[name].update(histogram_values(value, count), bounds)
        except ValueError as err:  # NaN/Inf inside the network, not in the data
            raise InputError(f"calibration: tensor '{name}' holds non-finite values for samples {span} ({err})") from err
        if per_sample.size:
            self.facts.add(name, value, lows, highs, count)
        self.kept.add(name, value)


class _PerSample:
    """What a statistics pass learns sample by sample beside the histograms: each tensor's
    summed per-sample min and max (mean_min_max), each sample's peak |value| per tensor
    (judge_samples), the sample names in the order seen, the values a sample holds, and the
    channel maxima (axis 1, or each one's own) of the ``channels`` tensors."""

    def __init__(self, names: List[str], channels: Union[Iterable[str], Dict[str, int]]):
        self.extremes = {name: np.zeros(2) for name in names}
        self.peaks: Dict[str, List[float]] = {name: [] for name in names}
        self.bounds: Dict[str, List[List[float]]] = {name: [] for name in names}
        self.maxima: Dict[str, np.ndarray] = {}
        axes = channels if isinstance(channels, dict) else dict.fromkeys(channels, 1)
        self.wanted = {name: axis for name, axis in axes.items() if name in set(names)}
        self.order: List[str] = []
        self.largest = 0

    def start(self, batch: List[Sample], values: Dict[str, np.ndarray]) -> None:
        self.largest = max(self.largest, sum(v.size for v in values.values()) // len(batch))
        seen = len(self.order)  # a sample without a name (a judge's feeds) is named by its place
        self.order += [getattr(s, "name", f"#{seen + i}") for i, s in enumerate(batch)]

    def add(self, name: str, value: np.ndarray, lows: np.ndarray, highs: np.ndarray, count: int) -> None:
        """One tensor's values for ``count`` samples; lows, highs: per sample where the values
        split into samples, else one row."""
        self.extremes[name] += (lows.sum() * count / len(lows), highs.sum() * count / len(lows))
        if name in self.wanted and value.ndim >= 2:
            others = tuple(a for a in range(value.ndim) if a != self.wanted[name] % value.ndim)
            found = np.maximum(-value.min(axis=others), value.max(axis=others)).astype(np.float64)
            self.maxima[name] = found if name not in self.maxima else np.maximum(self.maxima[name], found)
        peak = np.maximum(-lows, highs)
        self.peaks[name] += [float(v) for v in (peak if len(peak) == count else np.repeat(peak.max(), count))]
        if len(lows) == count:  # values that did not split into samples give no sample's bounds
            self.bounds[name] += [[float(low), float(high)] for low, high in zip(lows, highs)]

    def ranges(self, seen: int) -> Dict[str, List[float]]:
        return {name: [float(low) / max(seen, 1), float(high) / max(seen, 1)]
                for name, (low, high) in self.extremes.items()}

    def complete_peaks(self) -> Dict[str, List[float]]:
        return {name: values for name, values in self.peaks.items() if len(values) == len(self.order)}

    def complete_bounds(self) -> Dict[str, List[List[float]]]:
        return {name: values for name, values in self.bounds.items() if len(values) == len(self.order)}


def histogram_values(value: np.ndarray, samples: int) -> np.ndarray:
    """``value`` (``samples`` samples' worth), or at most about HISTOGRAM_VALUES of its
    values a sample: every p-th, p the smallest prime at or above the needed stride that does
    not divide the last axis, so that every channel is read whether channels come first
    (each channel a run longer than p) or last (p and the channel count coprime)."""
    needed = -(-value.size // max(samples, 1) // HISTOGRAM_VALUES)
    if needed <= 1:
        return value
    stride = needed
    while not _prime(stride) or (value.ndim and value.shape[-1] % stride == 0):
        stride += 1
    return value.reshape(-1)[::stride]


def _prime(number: int) -> bool:
    return number > 1 and all(number % d for d in range(2, int(number ** 0.5) + 1))


def channel_maxima(model: onnx.ModelProto, samples: Iterable[Dict[str, np.ndarray]], names: List[str],
                   batch_size: int = 16, axis: int = -1) -> Dict[str, np.ndarray]:
    """max |x| per channel (the last axis, or ``axis``) of each named tensor over the samples:
    what SmoothQuant divides an activation by (pipeline/precision/smoothing.py), and what
    equalization scales a convolution's output channels by (pipeline/precision/equalization.py)."""
    return {name: np.maximum(-low, high) for name, (low, high) in
            channel_ranges(model, samples, names, batch_size, axis).items()}


def channel_ranges(model: onnx.ModelProto, samples: Iterable[Dict[str, np.ndarray]], names: List[str],
                   batch_size: int = 16, axis: int = -1) -> Dict[str, Tuple[np.ndarray, np.ndarray]]:
    """(min, max) per channel (the last axis, or ``axis``: 1 for NCHW) of each named tensor
    over the samples, float64. One light pass: only these tensors are fetched, samples of
    one shape run together."""
    from pipeline.shapes import uniform_groups

    runner = BatchRunner(model, names, batch_size)
    found: Dict[str, Tuple[np.ndarray, np.ndarray]] = {}
    for group in uniform_groups(samples, max(batch_size, 1)):
        values = runner.run(pack(group), len(group))
        for name in names:
            value = values[name]
            if value.ndim == 0 or value.size == 0:
                continue
            if not np.isfinite(value).all():
                raise InputError(f"calibration: tensor '{name}' holds non-finite values")
            # reduced in place over the other axes: a moved-axis copy of a batch of 16 at
            # 64x320x320 took most of equalization's 10 s channel pass (docs/time.md)
            others = tuple(a for a in range(value.ndim) if a != axis % value.ndim)
            low, high = value.min(axis=others).astype(np.float64), value.max(axis=others).astype(np.float64)
            if name in found:
                low, high = np.minimum(found[name][0], low), np.maximum(found[name][1], high)
            found[name] = (low, high)
    return found


class _Kept:
    """The values of every tensor for the first ``keep`` samples of one input shape, the
    smallest seen: what auto compares methods on (each tensor's kept values must come from
    the same samples, and the smallest shape is the cheapest to compare on)."""

    def __init__(self, names: List[str], keep: int):
        self.keep, self.names = keep, names
        self.values: Dict[str, List[np.ndarray]] = {name: [] for name in names}
        self.shape: Optional[str] = None
        self.size = 0  # elements of a sample of the kept shape
        self.taking = False

    def start(self, batch: List[Sample]) -> None:
        """Before a batch's values: keep them when its shape is the kept one, or smaller."""
        key, size = shape_key(batch[0].feeds), elements(batch[0].feeds)
        if self.shape is None or size < self.size:
            self.values = {name: [] for name in self.names}
            self.shape, self.size = key, size
        self.taking = key == self.shape

    def add(self, name: str, value: np.ndarray) -> None:
        rows = self.keep if value.ndim == 0 or value[:1].size == 0 else \
            max(1, min(self.keep, KEPT_VALUES // value[:1].size))
        room = rows - sum(len(part) for part in self.values[name])
        if self.taking and room > 0:
            self.values[name].append(value[:room])


# input values one batched run takes at most: a batch of large samples runs slower per sample
# than the samples one at a time (2 cores, ONNX Runtime, ms a sample at 1 / 4 / 16 or 32 a run:
# U^2-Net-p 320x320 227 / 299 / 645; PP-OCRv4 det 736x736 73 / 111 / 191; PP-OCRv4 rec
# 48x320 18.2 / 12.3 / 25.8; the 96x96 segmenter 2.5 / 2.3 / 2.7): rec runs 4 a batch here,
# the 320x320 and 736x736 models one at a time
BATCH_VALUES = 192 * 1024


class BatchRunner:
    """ONNX Runtime on the model with the named tensors as outputs (graph inputs among them
    come straight from the feeds). Feeds and results are packed (pipeline.data.pack):
    sample i is the i-th of equal slices of axis 0. Samples run as one batch, stacked on
    each input's batch axis, when the model takes it: the first batch is checked against
    its first sample run alone. Otherwise they run one at a time (batch_size 1, ``note``)."""

    def __init__(self, model: onnx.ModelProto, names: List[str], batch_size: int):
        self.model = model
        self.specs = signature(model)
        self.shapes = {spec.name: spec.shape for spec in self.specs}
        self.names = [n for n in names if n not in self.shapes]  # what ORT computes
        self.fed = [n for n in names if n in self.shapes]  # graph inputs asked for
        self.batch_size = batch_size
        self.note = ""
        self._axes: Optional[Dict[str, int]] = None  # output -> the axis its batch came out on, once checked
        self._session = self._open(batched=True) if batch_size > 1 and self.names else None
        if self._session is None and self.names:
            self._use_single("the model does not take a free batch dimension")

    @property
    def batch_on_axis0(self) -> bool:
        """Batches are plain: every input and every output carries its batch on axis 0."""
        return self.batch_size > 1 and all(s.batch_axis == 0 for s in self.specs) and \
            all(axis == 0 for axis in (self._axes or {}).values())

    def _use_single(self, why: str) -> None:
        if self.batch_size > 1:
            self.note = f"calibration runs one sample at a time: {why}"
        self.batch_size = 1
        self._session = self._open(batched=False)

    def _open(self, batched: bool):
        import onnxruntime as ort
        from pipeline.backends.onnxruntime import untimed_options

        augmented = onnx.ModelProto()
        augmented.CopyFrom(self.model)
        del augmented.graph.value_info[:]
        del augmented.graph.output[:]
        types = element_types(self.model)
        for name in self.names:
            augmented.graph.output.append(onnx.helper.make_tensor_value_info(
                name, types.get(name, onnx.TensorProto.FLOAT), None))
        if batched:
            axes = {spec.name: spec.batch_axis for spec in self.specs}
            for value in augmented.graph.input:
                dims = value.type.tensor_type.shape.dim
                if axes.get(value.name) is not None and axes[value.name] < len(dims):
                    dims[axes[value.name]].Clear()
                    dims[axes[value.name]].dim_param = "batch"
            free_reshape_batch(augmented)
            _forget_subgraph_shapes(augmented.graph)
        options = untimed_options()
        options.log_severity_level = 4
        try:
            return ort.InferenceSession(augmented.SerializeToString(), options, providers=["CPUExecutionProvider"])
        except Exception:  # noqa: BLE001 - a model that cannot take a free batch axis
            if batched:
                return None
            raise

    def run(self, feeds: Dict[str, np.ndarray], count: int) -> Dict[str, np.ndarray]:
        samples = [unpack(feeds, i, count, self.shapes) for i in range(count)] if self.names else []
        values = self._run_batches(samples) if self.batch_size > 1 and samples else None
        if values is None:
            rows = [self._session.run(self.names, sample) for sample in samples]
            values = {name: np.atleast_1d(rows[0][j]) if len(rows) == 1 else
                      np.concatenate([np.atleast_1d(row[j]) for row in rows]) for j, name in enumerate(self.names)}
        values.update({name: np.atleast_1d(feeds[name]) for name in self.fed})
        return values

    def _run_batches(self, samples: List[Dict[str, np.ndarray]]) -> Optional[Dict[str, np.ndarray]]:
        """The samples in batches of at most BATCH_VALUES input values (at least one sample a
        run), packed; None where the model does not batch them."""
        per_run = max(1, BATCH_VALUES // max(1, sum(np.size(v) for v in samples[0].values())))
        parts = []
        for start in range(0, len(samples), per_run):
            part = self._run_batch(samples[start:start + per_run])
            if part is None:
                return None
            parts.append(part)
        if len(parts) == 1:
            return parts[0]
        return {name: np.concatenate([part[name] for part in parts]) for name in parts[0]}

    def _run_batch(self, samples: List[Dict[str, np.ndarray]]) -> Optional[Dict[str, np.ndarray]]:
        """The batch's values packed, or None (and one at a time from now on) when the
        model does not batch these samples correctly."""
        feeds = stack(samples, self.specs)
        if feeds is None:
            self.note = self.note or ("some samples ran one at a time: an input without a batch axis differs "
                                      "between them")
            return None
        try:
            batched = dict(zip(self.names, self._session.run(self.names, feeds)))
            if len(samples) == 1:
                return {name: np.atleast_1d(value) for name, value in batched.items()}
            if self._axes is None:
                alone = dict(zip(self.names, self._session.run(self.names, samples[0])))
                self._axes = _batch_axes(batched, alone, len(samples))
            packed = _packed(batched, self._axes, len(samples))
        except Exception:  # noqa: BLE001 - e.g. a Reshape with a batch of 1 baked in
            packed = None
        if packed is None:
            self._use_single("a batch of samples does not give each sample's own values (a batch of 1 baked "
                             "into the graph, or ops that mix samples)")
        return packed


def _forget_subgraph_shapes(graph: onnx.GraphProto) -> None:
    """Drop the shapes inside If/Loop/Scan bodies: inferred for batch 1, they would pin it."""
    for node in graph.node:
        for body in bodies(node):
            del body.value_info[:]
            for output in body.output:
                output.type.tensor_type.ClearField("shape")
            _forget_subgraph_shapes(body)


def _batch_axes(batched: Dict[str, np.ndarray], alone: Dict[str, np.ndarray], count: int) -> Optional[Dict[str, int]]:
    """For each output, the axis the batch came out on: the one axis where the batch's shape
    is ``count`` times the first sample's, and the first slice there equals that sample.
    None when an output has no such axis."""
    axes = {}
    for name, value in batched.items():
        single = alone[name]
        found = [a for a in range(single.ndim) if value.shape[a] == count * single.shape[a]
                 and value.shape[:a] + value.shape[a + 1:] == single.shape[:a] + single.shape[a + 1:]]
        if value.ndim != single.ndim or not found:
            return None
        first = np.take(value, range(single.shape[found[0]]), axis=found[0])
        scale = float(np.max(np.abs(single))) if single.size and single.dtype.kind == "f" else 1.0
        # batched kernels differ a little from single-sample ones; mixed-up samples differ a lot
        if not np.allclose(first, single, rtol=1e-3, atol=1e-3 * max(scale, 1e-6), equal_nan=True):
            return None
        axes[name] = found[0]
    return axes


def _packed(batched: Dict[str, np.ndarray], axes: Optional[Dict[str, int]],
            count: int) -> Optional[Dict[str, np.ndarray]]:
    """Batch values in the packed form: each sample's slice on its batch axis, on axis 0."""
    if axes is None or any(batched[n].shape[axes[n]] % count for n in batched):
        return None
    return {name: value if axes[name] == 0 else np.concatenate(np.split(value, count, axis=axes[name]))
            for name, value in batched.items()}


def free_reshape_batch(model: onnx.ModelProto) -> None:
    """Reshape targets exported for batch 1 ([1, ...]) copy the batch dim instead (0 means
    "copy this dim" in ONNX Reshape): the same result for one sample, and a batch can
    flow through. A model where this is wrong fails the batch check and runs one by one."""
    initializers = {t.name: t for t in model.graph.initializer}
    for index, node in enumerate(model.graph.node):
        shape = initializers.get(node.input[1]) if node.op_type == "Reshape" and len(node.input) > 1 else None
        if shape is None or any(a.name == "allowzero" and a.i for a in node.attribute):
            continue
        target = onnx.numpy_helper.to_array(shape).copy()
        if target.ndim == 1 and target.size and target[0] == 1:
            target[0] = 0
            name = f"{shape.name}__batch_free_{index}"
            model.graph.initializer.append(onnx.numpy_helper.from_array(target, name))
            node.input[1] = name


def model_outputs(model: onnx.ModelProto, names: List[str], batches) -> List[Dict[str, np.ndarray]]:
    """The model's ``names`` (graph outputs) per batch, as BatchRunner packs them; a model
    that takes no batch runs several samples at once, one thread each (PP-OCRv4 rec's int8
    model, 32 lines: 0.9 -> 0.6 s, the same values)."""
    runner = BatchRunner(model, names, len(batches[0]))
    if runner.batch_size > 1 or not names or runner.fed:  # batched, or an input passed through
        return [runner.run(pack(batch), len(batch)) for batch in batches]
    from pipeline.backends.onnxruntime import run_each, sample_parallel_session

    session = sample_parallel_session(model)
    found = []
    for batch in batches:
        rows = run_each(session, names, batch)
        found.append({name: np.concatenate([np.atleast_1d(row[j]) for row in rows]) for j, name in enumerate(names)})
    return found
