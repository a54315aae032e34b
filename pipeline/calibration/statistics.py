"""One streaming pass over the calibration set: for every float activation the int8
build may quantize, min, max and a histogram of |x|. Nothing grows with the number of
samples except the few samples kept (``keep``) for comparing methods."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterable, List

import numpy as np
import onnx

from pipeline.calibration.histogram import AbsHistogram
from pipeline.data import Sample
from pipeline.environment import own_threads
from pipeline.errors import InputError

ACTIVATION_BUDGET = 256 << 20  # bytes of activations held per group of samples


@dataclass
class Statistics:
    histograms: Dict[str, AbsHistogram]
    kept: Dict[str, np.ndarray] = field(default_factory=dict)  # tensor -> first samples, stacked
    samples: int = 0
    batch_size: int = 1

    def save(self, folder: Path) -> None:
        meta = {"samples": self.samples, "batch_size": self.batch_size,
                "histograms": {name: h.to_json() for name, h in self.histograms.items()}}
        (folder / "statistics.json").write_text(json.dumps(meta))
        np.savez(folder / "kept.npz", **self.kept)

    @classmethod
    def load(cls, folder: Path) -> "Statistics":
        meta = json.loads((folder / "statistics.json").read_text())
        with np.load(folder / "kept.npz") as kept:
            arrays = {key: kept[key] for key in kept.files}
        return cls({n: AbsHistogram.from_json(h) for n, h in meta["histograms"].items()},
                   arrays, meta["samples"], meta["batch_size"])


def activation_names(model: onnx.ModelProto) -> List[str]:
    """Float tensors that depend on the graph inputs (weights and constant subgraphs are
    not activations), in topological order."""
    initializers = {t.name for t in model.graph.initializer}
    types = {v.name: v.type.tensor_type.elem_type
             for v in list(model.graph.input) + list(model.graph.value_info) + list(model.graph.output)}
    names = [i.name for i in model.graph.input if i.name not in initializers]
    reachable = set(names)
    for node in model.graph.node:
        if any(i in reachable for i in node.input):
            outputs = [o for o in node.output if o]
            reachable.update(outputs)
            names += outputs
    return [n for n in dict.fromkeys(names) if types.get(n) == onnx.TensorProto.FLOAT]


def collect(model_path: Path, samples: Iterable[Sample], count: int, bins: int = 2048,
            batch_size: int = 16, keep: int = 4, progress=None) -> Statistics:
    model = onnx.load(str(model_path))
    names = activation_names(model)
    histograms = {name: AbsHistogram(bins) for name in names}
    kept: Dict[str, List[np.ndarray]] = {name: [] for name in names}
    runner = BatchRunner(model, names, batch_size)
    batch: List[Sample] = []
    seen = 0
    group = 1  # the first sample alone measures how much memory a sample's activations take

    def update(item):
        name, value = item
        try:
            histograms[name].update(value)
        except ValueError as err:  # NaN/Inf inside the network, not in the data
            raise InputError(f"calibration: tensor '{name}' holds non-finite values for samples "
                             f"{batch[0].name}..{batch[-1].name} ({err})") from err
        room = keep - sum(len(k) for k in kept[name])
        if room > 0:
            kept[name].append(value[:room])

    def flush():
        nonlocal seen, group
        feeds = {key: np.concatenate([s.feeds[key] for s in batch]) for key in batch[0].feeds}
        values = runner.run(feeds, len(batch))
        per_sample = sum(v.nbytes for v in values.values()) / len(batch)
        group = int(max(1, min(batch_size, ACTIVATION_BUDGET // max(per_sample, 1))))
        # numpy releases the GIL in its loops: histograms of different tensors fill in parallel
        list(pool.map(update, values.items()))
        del values
        seen += len(batch)
        if progress:
            progress(len(batch))
        batch.clear()

    with ThreadPoolExecutor(max_workers=own_threads()) as pool:
        for sample in samples:
            batch.append(sample)
            if len(batch) >= group:  # histograms update once per group, whatever the runner's batch
                flush()
        if batch:
            flush()
    stacked = {name: np.concatenate(parts) for name, parts in kept.items() if parts}
    return Statistics(histograms, stacked, seen, min(runner.batch_size, group))


class BatchRunner:
    """ONNX Runtime on the model with every activation as an output. Samples run in
    batches when the model accepts a free batch axis (checked on the first batch),
    otherwise one at a time."""

    def __init__(self, model: onnx.ModelProto, names: List[str], batch_size: int):
        self.model = model
        self.names = names
        self.batch_size = batch_size
        self._session = self._open(batched=True) if batch_size > 1 else None
        if self._session is None:
            self._use_single()

    def _use_single(self) -> None:
        self.batch_size = 1
        self._session = self._open(batched=False)

    def _open(self, batched: bool):
        import onnxruntime as ort
        from pipeline.backends.onnxruntime import untimed_options

        augmented = onnx.ModelProto()
        augmented.CopyFrom(self.model)
        del augmented.graph.value_info[:]
        del augmented.graph.output[:]
        for name in self.names:
            augmented.graph.output.append(onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None))
        if batched:
            for value in augmented.graph.input:
                dims = value.type.tensor_type.shape.dim
                if dims:
                    dims[0].Clear()
                    dims[0].dim_param = "batch"
            free_reshape_batch(augmented)
        options = untimed_options()
        options.log_severity_level = 4
        try:
            return ort.InferenceSession(augmented.SerializeToString(), options, providers=["CPUExecutionProvider"])
        except Exception:  # noqa: BLE001 - a model that cannot take a free batch axis
            if batched:
                return None
            raise

    def run(self, feeds: Dict[str, np.ndarray], count: int) -> Dict[str, np.ndarray]:
        if self.batch_size > 1:
            try:
                values = self._session.run(self.names, feeds)
                if all(v.ndim and v.shape[0] == count for v in values):
                    return dict(zip(self.names, values))
            except Exception:  # noqa: BLE001 - e.g. a Reshape with a batch of 1 baked in
                pass
            self._use_single()
        if count == 1:
            return dict(zip(self.names, self._session.run(self.names, feeds)))
        rows = [self._session.run(self.names, {k: v[i:i + 1] for k, v in feeds.items()}) for i in range(count)]
        return {name: np.concatenate([row[j] for row in rows]) for j, name in enumerate(self.names)}


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
