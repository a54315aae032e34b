"""Tensor fingerprints for the name mapping: ONNX Runtime's activations and ncnn's blobs
for the same inputs, reduced to small samples compared by value."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from pipeline.backends.ncnn.common import MATCH_SAMPLE, MATCH_TOLERANCE, _ALIAS_LAYERS
from pipeline.backends.ncnn.options import _set_options
from pipeline.backends.ncnn.param import Param


def node_key(node, position: int) -> str:
    """An ONNX node's name as parity's reports give it (pipeline.verification.layerwise.Graph)."""
    return node.name or f"{node.op_type}_{position}"


class _Fingerprint:
    """What the name mapping compares of a tensor over the mapping runs: its shape, and per
    run its norm and the values at a fixed sample of positions."""

    def __init__(self):
        self.size: Optional[int] = None
        self.shape: Tuple[int, ...] = ()
        self.nonfinite = 0
        self.norms: List[float] = []
        self.samples: List[np.ndarray] = []

    def add(self, value: np.ndarray) -> None:
        flat = np.asarray(value, dtype=np.float64).reshape(-1)
        if self.size is None:
            self.size, self.shape = flat.size, tuple(int(d) for d in np.shape(value))
        elif flat.size != self.size:
            self.size = -1  # not one tensor: matches nothing
        finite = np.isfinite(flat)
        self.nonfinite += int(flat.size - finite.sum())
        flat = np.where(finite, flat, 0.0)
        self.norms.append(float(np.linalg.norm(flat)))
        self.samples.append(flat[_positions(flat.size)])

    def error(self, other: "_Fingerprint") -> float:
        """The worst relative L2 error of ``self`` against ``other`` over the runs, on the
        sampled positions (inf: no match; a tensor that is zero in every run matches nothing)."""
        if self.size != other.size or self.size in (None, -1) or len(self.norms) != len(other.norms) \
                or self.nonfinite != other.nonfinite or not any(other.norms):
            return float("inf")
        worst = 0.0
        for norm, other_norm, sample, other_sample in zip(self.norms, other.norms, self.samples, other.samples):
            if abs(norm - other_norm) > 2 * MATCH_TOLERANCE * other_norm:
                return float("inf")
            scale = np.linalg.norm(other_sample)
            difference = np.linalg.norm(sample - other_sample)
            if scale == 0:
                if difference:
                    return float("inf")
                continue
            worst = max(worst, float(difference / scale))
        return worst


_POSITIONS: Dict[int, np.ndarray] = {}


def _positions(size: int) -> np.ndarray:
    if size not in _POSITIONS:
        if size <= MATCH_SAMPLE:
            _POSITIONS[size] = np.arange(size)
        else:
            _POSITIONS[size] = np.sort(np.random.default_rng(size).choice(size, MATCH_SAMPLE, replace=False))
    return _POSITIONS[size]


def _squeezed(shape: Sequence[int]) -> Tuple[int, ...]:
    return tuple(d for d in shape if d != 1)


def _ncnn_shape(onnx_shape: Sequence[int]) -> Tuple[int, ...]:
    shape = tuple(onnx_shape)
    return shape[1:] if len(shape) > 1 and shape[0] == 1 else shape


def _match_inputs(inputs, rng) -> Dict[str, np.ndarray]:
    feeds = {}
    for name, dims, dtype in inputs:
        if np.issubdtype(dtype, np.floating):
            feeds[name] = rng.standard_normal(dims).astype(dtype)
        else:
            feeds[name] = np.zeros(dims, dtype=dtype)
    return feeds


def _onnx_fingerprints(model, runs: List[Dict[str, np.ndarray]],
                       budget: int = 256 << 20) -> Tuple[Dict[str, _Fingerprint], Dict[str, list]]:
    """Fingerprints and shapes of every float activation of the ONNX model, by ONNX Runtime
    (fp32, optimizations off), in sessions whose outputs stay under ``budget`` bytes."""
    import onnx
    import onnxruntime as ort

    from pipeline.backends.onnxruntime import untimed_options
    from pipeline.verification.layerwise import dynamic_outputs, element_counts

    initializers = {t.name for t in model.graph.initializer}
    inputs = [i.name for i in model.graph.input if i.name not in initializers]
    names = list(dict.fromkeys(dynamic_outputs(model.graph.node, inputs)))
    counts = element_counts(model)  # chunking only
    groups, current, size = [], [], 0
    for name in names:
        nbytes = 4 * counts.get(name, 1 << 20)
        if current and size + nbytes > budget:
            groups.append(current)
            current, size = [], 0
        current.append(name)
        size += nbytes
    groups += [current] if current else []
    prints: Dict[str, _Fingerprint] = {}
    shapes: Dict[str, list] = {}
    options = untimed_options()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    with tempfile.TemporaryDirectory(prefix="parity-ncnn-map-") as scratch:
        for number, group in enumerate(groups):
            probe = onnx.ModelProto()
            probe.CopyFrom(model)
            del probe.graph.output[:]
            probe.graph.output.extend(onnx.ValueInfoProto(name=name) for name in group)
            path = Path(scratch) / f"probe{number}.onnx"
            onnx.save(probe, str(path))
            session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
            for feeds in runs:
                for name, value in zip(group, session.run(group, feeds)):
                    value = np.asarray(value)
                    if np.issubdtype(value.dtype, np.floating) and value.size:
                        prints.setdefault(name, _Fingerprint()).add(value)
                        shapes.setdefault(name, [int(d) for d in value.shape])
            del session
    return {name: p for name, p in prints.items() if len(p.norms) == len(runs)}, shapes


def _ncnn_fingerprints(param_path: Path, bin_path: Path, network: Param, runs: List[Dict[str, np.ndarray]],
                       input_blobs: Dict[str, str]) -> Dict[str, _Fingerprint]:
    """Fingerprints of every activation blob of the converted net, on the CPU in fp32."""
    import ncnn

    net = ncnn.Net()
    _set_options(net.opt, {"use_vulkan": False})
    producers = network.producers()
    blobs = [blob for blob in network.dynamic_blobs()
             if blob in producers and producers[blob].type not in (*_ALIAS_LAYERS, "Input")]
    prints: Dict[str, _Fingerprint] = {}
    try:
        if net.load_param(str(param_path)) != 0 or net.load_model(str(bin_path)) != 0:
            raise RuntimeError("ncnn cannot load the param/bin pnnx wrote")
        for feeds in runs:
            extractor = net.create_extractor()
            extractor.set_light_mode(False)
            held = []
            for onnx_name, blob in input_blobs.items():
                value = feeds[onnx_name]
                array = np.ascontiguousarray(value.reshape(_ncnn_shape(value.shape)), dtype=np.float32)
                held.append(array)
                extractor.input(blob, ncnn.Mat(array))
            for blob in blobs:
                code, mat = extractor.extract(blob)
                value = np.array(mat, dtype=np.float32) if code == 0 else None
                if value is not None and value.size:
                    prints.setdefault(blob, _Fingerprint()).add(value)
            extractor.clear()
            del extractor, held
    finally:
        net.clear()
    return {blob: p for blob, p in prints.items() if len(p.norms) == len(runs)}
