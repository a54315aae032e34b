"""The ncnn blob <-> ONNX tensor and ncnn layer <-> ONNX node mapping (run in a child
process at build time)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Tuple

import numpy as np

from pipeline.backends.ncnn.common import (
    MAP_TIMEOUT_S, MATCH_RUNS, MATCH_TOLERANCE, _ALIAS_LAYERS, _NOT_COMPUTE, _graph_inputs, log)
from pipeline.backends.ncnn.fingerprints import (
    _match_inputs, _ncnn_fingerprints, _ncnn_shape, _onnx_fingerprints, _squeezed, node_key)
from pipeline.backends.ncnn.param import Param


# ops whose output holds their input's values in the same order
_VALUE_PRESERVING = {"Identity", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Dropout"}


def _computed_downstream(model, floats: set):
    """A function: tensor -> the float tensors computed from it through at least one op
    that changes values (a Relu that happened to see no negative input is such an op);
    shape computations (Shape -> ... -> a Reshape's shape input) are not followed."""
    consumers: Dict[str, list] = {}
    for node in model.graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)

    def successors(tensor: str):
        return [(output, node.op_type in _VALUE_PRESERVING) for node in consumers.get(tensor, [])
                for output in node.output if output in floats]

    return _cached_walk(successors)


def map_names(model, param_path: Path, bin_path: Path) -> dict:
    """ONNX <-> ncnn names of the converted net: the ``inputs``, ``outputs``, ``blobs``,
    ``blob_aliases``, ``shapes`` and ``layers`` entries of the build options (module docstring)."""
    network = Param.read(param_path)
    graph_inputs = _graph_inputs(model)
    blob_names = {top for layer in network.layers for top in layer.tops}
    inputs = {name: f"in{i}" for i, (name, _, _) in enumerate(graph_inputs)}
    outputs = {value.name: f"out{i}" for i, value in enumerate(model.graph.output)}
    missing = [blob for blob in [*inputs.values(), *outputs.values()] if blob not in blob_names]
    if missing:
        raise RuntimeError(f"pnnx's ncnn model has no blob {missing[0]!r} for the ONNX model's "
                           f"{len(inputs)} inputs and {len(outputs)} outputs")
    rng = np.random.default_rng(0)
    runs = [_match_inputs(graph_inputs, rng) for _ in range(MATCH_RUNS)]
    onnx_prints, shapes = _onnx_fingerprints(model, runs)
    if any(onnx_prints[name].nonfinite for name in outputs if name in onnx_prints):
        runs = [{name: (np.abs(value) if np.issubdtype(value.dtype, np.floating) else value)
                 for name, value in feeds.items()} for feeds in runs]  # e.g. a Log or Sqrt of the input
        onnx_prints, shapes = _onnx_fingerprints(model, runs)
    ncnn_prints = _ncnn_fingerprints(param_path, bin_path, network, runs, inputs)
    for name, dims, _ in graph_inputs:
        shapes[name] = list(dims)

    order = {blob: i for i, blob in enumerate(network.dynamic_blobs())}
    downstream = _computed_downstream(model, set(onnx_prints))
    best: Dict[str, Tuple[tuple, str]] = {}  # onnx tensor -> (rank, blob)
    reproduces: Dict[str, Tuple[tuple, str]] = {}  # blob -> (rank, onnx tensor)
    candidates = _value_matches(ncnn_prints, onnx_prints, shapes, order)
    resolved = resolve_by_structure({blob: set(m) for blob, m in candidates.items()}, downstream,
                                    _ncnn_downstream(network))
    for blob, matches in candidates.items():
        matches = {name: rank for name, rank in matches.items() if name in resolved[blob]}
        # a blob equal to a tensor and to one computed from it holds the computed one
        # (ncnn's fused convrelu holds the Relu's output even where the Conv's is >= 0)
        dropped = [name for name in matches if any(other in matches for other in downstream(name))]
        for name in dropped:
            del matches[name]
        for name, rank in matches.items():
            if name not in best or rank < best[name][0]:
                best[name] = (rank, blob)
            if blob not in reproduces or rank < reproduces[blob][0]:
                reproduces[blob] = (rank, name)
    blobs = {name: blob for name, (_, blob) in best.items()}
    blobs.update(outputs)  # inputs and outputs by position, whatever their values
    blobs.update(inputs)
    ordered = {name: blobs[name] for name in [*inputs, *_topological(model, blobs), *outputs] if name in blobs}
    chosen = set(ordered.values())
    # blobs holding the same values as a mapped tensor in another layout (before a Reshape)
    aliases = {blob: name for blob, (_, name) in sorted(reproduces.items(), key=lambda i: order.get(i[0], 0))
               if blob not in chosen and name in ordered}
    computed = dict(ordered)  # the first blob holding each tensor's values: its layer computes it
    for blob, name in aliases.items():
        if order.get(blob, 0) < order.get(computed[name], 0):
            computed[name] = blob
    layers = _map_layers(model, network, computed, set(inputs))
    return {"inputs": inputs, "outputs": outputs, "blobs": ordered, "blob_aliases": aliases,
            "shapes": {name: shapes[name] for name in ordered if name in shapes}, "layers": layers}


def _value_matches(ncnn_prints, onnx_prints, shapes, order) -> Dict[str, Dict[str, tuple]]:
    """{blob: {ONNX tensor it reproduces: rank}}; rank: shape differs, squeezed shape
    differs, error, the blob's position (smaller is better)."""
    by_size: Dict[int, List[str]] = {}
    for name, fingerprint in onnx_prints.items():
        by_size.setdefault(fingerprint.size, []).append(name)
    candidates = {}
    for blob, fingerprint in ncnn_prints.items():
        matches = {}
        for name in by_size.get(fingerprint.size, []):
            error = fingerprint.error(onnx_prints[name])
            if error <= MATCH_TOLERANCE:
                wanted = _ncnn_shape(shapes[name])
                matches[name] = (fingerprint.shape != wanted, _squeezed(fingerprint.shape) != _squeezed(wanted),
                                 error, order.get(blob, 0))
        candidates[blob] = matches
    return candidates


_VALUE_PRESERVING_LAYERS = {"Reshape", "Flatten", "Squeeze", "ExpandDims", "Noop", "Dropout", *_ALIAS_LAYERS}


def _ncnn_downstream(network: Param):
    """A function: blob -> the blobs computed from it through at least one ncnn layer that
    changes values (the ncnn side of _computed_downstream)."""
    consumers: Dict[str, list] = {}
    for layer in network.layers:
        for blob in layer.bottoms:
            consumers.setdefault(blob, []).append(layer)

    def successors(blob: str):
        return [(top, layer.type in _VALUE_PRESERVING_LAYERS) for layer in consumers.get(blob, []) for top in layer.tops]

    return _cached_walk(successors)


def _cached_walk(successors):
    """A function: node -> the nodes reached from it through at least one step that changes
    values; ``successors(node)`` gives (next node, whether that step preserves values)."""
    cache: Dict[str, set] = {}

    def downstream(start: str) -> set:
        if start not in cache:
            found, seen, stack = set(), set(), [(start, False)]
            while stack:
                current, changed = stack.pop()
                if (current, changed) in seen:
                    continue
                seen.add((current, changed))
                if changed:
                    found.add(current)
                stack.extend((after, changed or not preserves) for after, preserves in successors(current))
            cache[start] = found
        return cache[start]

    return downstream


def resolve_by_structure(matches: Dict[str, set], onnx_downstream, ncnn_downstream) -> Dict[str, set]:
    """Value matches made unambiguous by graph order. Where blobs reproduce a tensor *and*
    tensors computed from it (``x + 1e-8`` equals ``x`` in fp32: the reduction's blob and the
    Add's blob both match both tensors), the blobs and tensors of such a chain are ranked by
    how many value-changing ops of the chain precede them (in ncnn and in ONNX) and paired
    rank for rank, aligned at the end: ops ncnn fused away (a Conv's output inside
    ``convrelu``) have no blob and are the earlier ones of their group, so the first blob
    takes the later tensor. {blob: ONNX tensors} in, the same with those chains resolved out."""
    chained = {blob: {name for name in names if any(other in onnx_downstream(name) or name in onnx_downstream(other)
                                                    for other in names if other != name)}
               for blob, names in matches.items()}
    resolved = {blob: set(names) for blob, names in matches.items()}
    for blobs, tensors in _chains(chained):
        tensor_rank = {t: sum(t in onnx_downstream(o) for o in tensors if o != t) for t in tensors}
        blob_rank = {b: sum(b in ncnn_downstream(o) for o in blobs if o != b) for b in blobs}
        offset = max(0, max(tensor_rank.values()) - max(blob_rank.values()))
        for blob in blobs:
            keep = {t for t in chained[blob] if tensor_rank[t] == blob_rank[blob] + offset}
            if keep:
                resolved[blob] = (matches[blob] - chained[blob]) | keep
    return resolved


def _chains(chained: Dict[str, set]) -> List[Tuple[List[str], set]]:
    """Groups of blobs whose chained tensors overlap, with the union of those tensors."""
    groups: List[Tuple[List[str], set]] = []
    for blob, tensors in chained.items():
        if not tensors:
            continue
        joined = [g for g in groups if g[1] & tensors]
        merged = ([blob] + [b for g in joined for b in g[0]], set(tensors).union(*(g[1] for g in joined)))
        groups = [g for g in groups if g not in joined] + [merged]
    return groups


def _map_isolated(source: Path, param_path: Path, bin_path: Path, model) -> dict:
    """map_names in a child Python process: ncnn running a freshly converted net must not
    be able to take the build down. If the child dies or fails, only the inputs and outputs
    (named by position) are mapped and ``mapping_error`` says why."""
    result_path = source.parent / "mapping.json"
    command = [sys.executable, "-c", "import sys; from pipeline.backends.ncnn.names import _mapping_main; _mapping_main()",
               str(source), str(param_path), str(bin_path), str(result_path)]
    root = str(Path(__file__).resolve().parents[2])  # the folder holding the pipeline package
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    try:
        done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=MAP_TIMEOUT_S,
                              env=env, check=False)
        if done.returncode == 0 and result_path.exists():
            return json.loads(result_path.read_text())
        lines = [line for line in done.stdout.decode(errors="replace").splitlines() if line.strip()]
        status = f"signal {-done.returncode}" if done.returncode < 0 else f"exit status {done.returncode}"
        reason = f"the mapping process ended with {status}" + (f": {lines[-1].strip()}" if lines else "")
    except subprocess.TimeoutExpired:
        reason = f"the mapping process did not finish in {MAP_TIMEOUT_S} s"
    log.warning("ncnn: ONNX <-> ncnn names of intermediate tensors not mapped (%s); inputs and outputs only",
                reason)
    inputs = {name: f"in{i}" for i, (name, _, _) in enumerate(_graph_inputs(model))}
    outputs = {value.name: f"out{i}" for i, value in enumerate(model.graph.output)}
    return {"inputs": inputs, "outputs": outputs, "blobs": {**inputs, **outputs}, "blob_aliases": {},
            "shapes": {}, "layers": {}, "mapping_error": reason}


def _mapping_main() -> None:
    """Child entry of _map_isolated: argv = onnx, param, bin, result json."""
    import onnx

    source, param_path, bin_path, result_path = sys.argv[1:5]
    result = map_names(onnx.load(source), Path(param_path), Path(bin_path))
    Path(result_path).write_text(json.dumps(result))


def _topological(model, names) -> List[str]:
    from pipeline.verification.layerwise import dynamic_outputs

    initializers = {t.name for t in model.graph.initializer}
    inputs = [i.name for i in model.graph.input if i.name not in initializers]
    return [name for name in dynamic_outputs(model.graph.node, inputs) if name in names]


def _map_layers(model, network: Param, blobs: Dict[str, str], inputs: set) -> Dict[str, List[str]]:
    """{ONNX node: [ncnn layers]}: the layer producing the blob of the node's nearest
    mapped tensor (its own output, or the first mapped tensor it feeds), then the layers
    without a mapped output that feed that layer (one group computes the node)."""
    initializers = {t.name for t in model.graph.initializer}
    dynamic = set(inputs) | {i.name for i in model.graph.input if i.name not in initializers}
    producer: Dict[str, Tuple[str, object]] = {}
    for position, node in enumerate(model.graph.node):
        if any(name in dynamic for name in node.input):
            for name in node.output:
                if name:
                    dynamic.add(name)
                    producer[name] = (node_key(node, position), node)
    producers = network.producers()
    mapped_blobs = {network.source(blob) for blob in blobs.values()}  # group boundaries

    def group(blob: str) -> List[str]:
        first = producers.get(network.source(blob))
        if first is None:
            return []
        found, stack, seen = [first.name], list(first.bottoms), set()
        while stack:
            current = network.source(stack.pop())
            if current in seen or current in mapped_blobs:
                continue
            seen.add(current)
            layer = producers.get(current)
            if layer is None or layer.type in _NOT_COMPUTE:
                continue
            found.append(layer.name)
            stack.extend(layer.bottoms)
        return found

    result: Dict[str, List[str]] = {}
    for tensor, blob in blobs.items():
        if tensor in inputs or tensor not in producer:
            continue
        layers = group(blob)
        if not layers:
            continue
        stack, seen = [tensor], set()
        while stack:  # the ONNX nodes between the mapped tensors feeding this one and it
            current = stack.pop()
            if current in seen or current not in producer:
                continue
            seen.add(current)
            key, node = producer[current]
            entry = result.setdefault(key, [])
            entry.extend(name for name in layers if name not in entry)
            for name in node.input:
                if name in producer and name not in blobs:
                    stack.append(name)
    order = {key: position for position, key in
             enumerate(node_key(node, position) for position, node in enumerate(model.graph.node))}
    return {key: result[key] for key in sorted(result, key=lambda k: order.get(k, 0))}
