"""Per-layer int8 sensitivity (the TPU-MLIR method, made fast).

For every quantizable op and every threshold method, only that op is quantized and the
loss is 1 - cosine of the network outputs (per sample, averaged over samples and outputs).
Nothing is rebuilt or re-run whole per trial:

- the float activations are computed once, in chunks of ops (bounded memory): for each op
  its inputs, its output and the tensors still alive after it;
- the op alone is run as a single-node model on its fake-quantized inputs and weights,
  and its output is fake-quantized: that is the op in int8;
- a screen keeps the methods with the best SQNR at the op's own output, and only those
  are measured in full, by running just the part of the graph downstream of the op (a
  suffix model fed the alive tensors) on all samples in one batch.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np
import onnx
from onnx import numpy_helper

from pipeline.precision.calibration.auto import BLOCK_VALUES, fake_quantize
from pipeline.precision.calibration.measure import output_agreement
from pipeline.precision.calibration.single_node import elem_type, node_session, session
from pipeline.precision.calibration.statistics import BatchRunner, free_reshape_batch
from pipeline.data import unpack
from pipeline.environment import own_threads
from pipeline.precision.gemm_outputs import float_output_gemms
from pipeline.precision.quantize import WEIGHTED_OPS, QdqSettings, settings_float_ops

WEIGHT_AXIS = {"Conv": 0, "ConvTranspose": 1, "MatMul": 1}
CHUNK_OPS = 16  # ops whose float activations are fetched together
MAX_WORKERS = 4  # ops searched at once (threads; ONNX Runtime releases the GIL while it runs)
# The op screen ranks every op on the samples that hold SCREEN_INPUT_VALUES input values, at least
# SCREEN_SAMPLES of them (an op's SQNR over millions of values): on the real-size segmenter (307 200
# a sample) 4 of its 8 chose 30 of the same 32 worst ops in 27 s against 77 s; a small model keeps all
SCREEN_INPUT_VALUES, SCREEN_SAMPLES = 1 << 20, 4


@dataclass
class Trial:
    op: str
    op_type: str
    method: str
    op_sqnr_db: Optional[float]  # at the op's own output: the screen
    loss: Optional[float] = None  # 1 - cosine of the network outputs; None: screened out
    sqnr_db: Optional[float] = None  # of the network outputs
    metric_drop: Optional[float] = None  # the task metric's drop (``score``), when one is given


def output_loss(reference: Sequence[np.ndarray], actual: Sequence[np.ndarray]) -> tuple:
    """(1 - cosine averaged over samples and outputs, SQNR in dB over everything)."""
    agreement = output_agreement(reference, actual)
    return agreement["loss"], agreement["sqnr_db"]


def quantizable_ops(model: onnx.ModelProto, candidates: Dict[str, dict], op_types=WEIGHTED_OPS) -> List[int]:
    """Indices of the nodes the int8 build quantizes and that have thresholds for their inputs."""
    initializers = {t.name for t in model.graph.initializer}
    found = []
    for index, node in enumerate(model.graph.node):
        activations = [i for i in node.input if i and i not in initializers]
        if node.op_type in op_types and activations and all(i in candidates for i in activations):
            found.append(index)
    return found


HEAD_DEPTH = 2  # an output head: an op at most this many ops before a graph output


class Stopped(Exception):
    """per_layer was told to stop (``stop``) before it ranked every op."""


def per_layer(model: onnx.ModelProto, candidates: Dict[str, Dict[str, dict]], feeds: Dict[str, np.ndarray],
              count: int, methods: Sequence[str], settings: QdqSettings = QdqSettings(),
              screen: int = 2, progress: Optional[Callable[[int], None]] = None,
              scorer_for: Optional[Callable[[List[np.ndarray]], Optional[Callable]]] = None,
              ranked: Optional[int] = None, stop: Optional[Callable[..., bool]] = None) -> List[Trial]:
    """Every (op, method) trial; screen = methods measured in full per op (0: all);
    ``scorer_for(reference)``: given the float outputs (in graph order), a ``score(outputs)``
    giving the task metric's drop, or None without a metric. ``ranked``: with more ops than
    this, only the ``ranked`` ops whose int8 output is worst at the op itself (op-level SQNR,
    ``op_screen``, on the first ``screen_samples``) are measured in full on every
    sample; the others' trials keep their screened op SQNR, loss None.
    ``stop()``: asked before each chunk of ops, and ``stop(ops left)`` after each op once
    every worker finished one; Stopped is raised where it says so (the deadline of
    precision.budget_s: a ranking cut half-way ranks nothing, so it stops as soon as the
    rest is projected past the deadline)."""
    nodes = list(model.graph.node)
    outputs = [o.name for o in model.graph.output]
    reference = BatchRunner(model, outputs, count).run(feeds, count)
    reference = [reference[name] for name in outputs]
    score = scorer_for(reference) if scorer_for else None
    always = set(settings_float_ops(model, settings))  # float in every mixed model: nothing to rank
    ops = [i for i in quantizable_ops(model, candidates, settings.quantize_ops) if nodes[i].name not in always]
    trials: List[Trial] = []
    # One op per core at a time, each in single-threaded sessions: the op's trials are small
    # graphs on a small batch, where ORT's intra-op threads cost more than they give.
    with ThreadPoolExecutor(max_workers=workers()) as pool:
        if ranked is not None and len(ops) > ranked:
            few = screen_samples(feeds, count)
            screened = op_screen(model, ops, candidates, first_samples(feeds, count, few), few, methods, settings,
                                 pool)
            worst = sorted(ops, key=lambda i: _best_sqnr(screened[i]))[:ranked]
            worst += [i for i in output_heads(model, ops) if i not in worst]  # cheap: little graph after them
            trials += [trial for i in ops if i not in worst for trial in screened[i]]
            if progress:
                progress(len(ops) - len(worst))
            ops = sorted(worst)
        done, width = 0, workers()
        for start in range(0, len(ops), CHUNK_OPS):
            if stop is not None and stop():
                raise Stopped(f"the ranking stopped after {done} of {len(ops)} ops")
            chunk = ops[start:start + CHUNK_OPS]
            needed = sorted({t for i in chunk for t in _op_tensors(model, i) | _alive_after(model, i)})
            runner = BatchRunner(model, needed, count)
            floats = runner.run(feeds, count)
            # the model takes no plain batch (a batch of 1 baked in, a batch axis other than 0): nor do its suffixes
            one_by_one = not runner.batch_on_axis0
            jobs = [pool.submit(_trials_for_op, model, nodes[index], index, candidates, floats, reference, methods,
                                settings, screen, count, one_by_one, runner.shapes, score) for index in chunk]
            for job in jobs:
                trials += job.result()
                done += 1
                if progress:
                    progress(1)
                # the rest projected from the ops done once every worker finished one: will it finish in time
                if stop is not None and width <= done < len(ops) and stop(len(ops) - done):
                    for pending in jobs:
                        pending.cancel()
                    raise Stopped(f"the ranking stopped after {done} of {len(ops)} ops: the rest, at the "
                                  "pace so far, would pass the deadline")
    return trials


def output_heads(model: onnx.ModelProto, ops: List[int], depth: int = HEAD_DEPTH) -> List[int]:
    """The ops of ``ops`` whose output reaches a graph output through at most ``depth`` other
    ops (a Sigmoid, a Resize): their error goes to the outputs undiluted, where an op-level
    SQNR says little about the task (the fused logits of a segmenter, quantized to 8 bits,
    flip pixels near the map's threshold), and their full measure runs almost no graph."""
    nodes = list(model.graph.node)
    producer = {out: index for index, node in enumerate(nodes) for out in node.output}
    start = [producer[o.name] for o in model.graph.output if o.name in producer]
    return _nearest(ops, start, lambda i: [producer[name] for name in nodes[i].input if name in producer], depth)


def input_stems(model: onnx.ModelProto, ops: List[int], depth: int = HEAD_DEPTH) -> List[int]:
    """The ops of ``ops`` that read a graph input through at most ``depth`` other ops (a
    normalization, a pad), the first of ``ops`` on each path: they quantize the raw input, and
    their error passes through the whole network (on ONNX Runtime with 7-bit weights the
    segmenter's search kept its first convolution float)."""
    nodes = list(model.graph.node)
    readers: Dict[str, List[int]] = {}
    for index, node in enumerate(nodes):
        for name in node.input:
            readers.setdefault(name, []).append(index)
    initializers = {t.name for t in model.graph.initializer}
    start = [i for value in model.graph.input if value.name not in initializers for i in readers.get(value.name, [])]
    return _nearest(ops, start, lambda i: [r for out in nodes[i].output for r in readers.get(out, [])], depth)


def _nearest(ops: List[int], start: List[int], step, depth: int) -> List[int]:
    """The ops of ``ops`` met walking from the nodes ``start`` through ``step`` (node index ->
    the next ones) past at most ``depth`` other nodes, stopping at the first of ``ops`` on
    each path."""
    wanted, found, frontier = set(ops), set(), start
    for _ in range(depth + 1):
        found.update(i for i in frontier if i in wanted)
        frontier = [j for i in frontier if i not in wanted for j in step(i)]
    return sorted(found)


def workers() -> int:
    return min(MAX_WORKERS, own_threads())


def op_screen(model: onnx.ModelProto, ops: List[int], candidates, feeds, count: int, methods: Sequence[str],
              settings: QdqSettings, pool) -> Dict[int, List[Trial]]:
    """Per op, its trials with only the op-level SQNR measured (the op alone in int8 against
    its float output): a single-node run per method, no suffix. What the full measure costs
    grows with the graph after each op; this stays small."""
    nodes = list(model.graph.node)
    found: Dict[int, List[Trial]] = {}
    for start in range(0, len(ops), CHUNK_OPS):
        chunk = ops[start:start + CHUNK_OPS]
        needed = sorted({t for i in chunk for t in _op_tensors(model, i)})
        floats = BatchRunner(model, needed, count).run(feeds, count)
        jobs = {index: pool.submit(_op_trials, model, nodes[index], candidates, floats, methods, settings)
                for index in chunk}
        found.update({index: [trial for trial, _ in job.result()] for index, job in jobs.items()})
    return found


def screen_samples(feeds: Dict[str, np.ndarray], count: int) -> int:
    """How many of ``count`` packed samples the op screen runs (SCREEN_INPUT_VALUES)."""
    per_sample = max(1, sum(np.size(values) for values in feeds.values()) // max(count, 1))
    return min(count, max(SCREEN_SAMPLES, SCREEN_INPUT_VALUES // per_sample))


def first_samples(feeds: Dict[str, np.ndarray], count: int, few: int) -> Dict[str, np.ndarray]:
    """The first ``few`` of ``count`` packed samples (pipeline.data.pack's form)."""
    return {name: values[:len(values) // count * few] for name, values in feeds.items()}


def _best_sqnr(trials: List[Trial]) -> float:
    """The op's best op-level SQNR over its methods (inf where no error was measured)."""
    return max((t.op_sqnr_db if t.op_sqnr_db is not None else math.inf) for t in trials)


def _op_trials(model, node, candidates, floats, methods, settings: QdqSettings) -> List[tuple]:
    """(Trial with its op-level SQNR, the op's int8 output) per method: the op alone run on
    its fake-quantized inputs and weights, its output fake-quantized where the build does."""
    initializers = {t.name: t for t in model.graph.initializer}
    graph_outputs = {o.name for o in model.graph.output}
    single = node_session(model, node)
    float_feeds = {name: floats[name] if name in floats else numpy_helper.to_array(initializers[name])
                   for name in _node_inputs(node)}
    expected = floats[node.output[0]]
    float_gemms = float_output_gemms(model, settings) if node.op_type == "Gemm" else set()
    trials = []
    for method in methods:
        quantized_feeds = dict(float_feeds)
        for name in node.input:
            if name in candidates:
                quantized_feeds[name] = fake_quantize(floats[name], candidates[name][method], settings.activations)
            elif name in initializers and _is_weight(node, name):
                quantized_feeds[name] = fake_quantize_weight(float_feeds[name], node, settings)
        output = single.run(None, quantized_feeds)[0]
        if settings.quantizes_output(node.op_type) and node.output[0] in candidates and \
                node.output[0] not in graph_outputs and node.name not in float_gemms:
            output = fake_quantize(output, candidates[node.output[0]][method], settings.activations)
        trials.append((Trial(node.name, node.op_type, method, _sqnr(expected, output)), output))
    return trials


def _trials_for_op(model, node, index, candidates, floats, reference, methods, settings: QdqSettings,
                   screen, count, one_by_one: bool, input_shapes: Dict[str, List[int]], score=None) -> List[Trial]:
    trials = _op_trials(model, node, candidates, floats, methods, settings)
    ranked = sorted(trials, key=lambda t: -(t[0].op_sqnr_db if t[0].op_sqnr_db is not None else math.inf))
    measured = ranked if screen <= 0 else ranked[:screen]
    suffix = _suffix_session(model, index, one_by_one)
    for trial, output in measured:
        alive = {name: floats[name] for name in _alive_after(model, index)}
        alive[node.output[0]] = output
        produced = _run_batched(suffix, {i.name: alive[i.name] for i in suffix.get_inputs()}, count, one_by_one,
                                input_shapes) if suffix else []
        by_name = dict(zip([o.name for o in suffix.get_outputs()], produced)) if suffix else {}
        actual = [by_name.get(name, alive.get(name)) for name in [o.name for o in model.graph.output]]
        trial.loss, trial.sqnr_db = output_loss(reference, actual)
        trial.metric_drop = score(actual) if score else None
    return [trial for trial, _ in trials]


def _run_batched(suffix, feeds: Dict[str, np.ndarray], count: int, one_by_one: bool = False,
                 input_shapes: Optional[Dict[str, List[int]]] = None) -> List[np.ndarray]:
    """All samples in one run, or one at a time when the graph has a batch of 1 baked in.
    One at a time, the feeds are the samples' tensors concatenated (BatchRunner): sample i
    is the i-th of ``count`` equal slices of axis 0, which is not always a batch axis (a
    transformer's [tokens, channels] tensor); graph inputs get back their own shape
    (``input_shapes``: a scalar stays a scalar)."""
    if not one_by_one:
        try:
            values = suffix.run(None, feeds)
            if all(v.ndim and v.shape[0] == count for v in values):
                return values
        except Exception:  # noqa: BLE001 - e.g. a Reshape to a fixed batch of 1
            pass
    rows = [suffix.run(None, unpack(feeds, i, count, input_shapes or {})) for i in range(count)]
    return [np.concatenate([np.atleast_1d(row[j]) for row in rows]) for j in range(len(rows[0]))]


def fake_quantize_weight(weight: np.ndarray, node: onnx.NodeProto, settings: QdqSettings) -> np.ndarray:
    """Symmetric int8 per output channel or per tensor (7-bit with reduce_range), dequantized."""
    axis = WEIGHT_AXIS.get(node.op_type, 0)
    if node.op_type == "Gemm":
        axis = 0 if any(a.name == "transB" and a.i for a in node.attribute) else 1
    limit = 63 if settings.reduce_range else 127
    reduce_axes = tuple(a for a in range(weight.ndim) if a != axis or not settings.per_channel)
    scale = np.max(np.abs(weight), axis=reduce_axes, keepdims=True) / limit
    scale = np.where(scale > 0, scale, 1.0)
    return (np.clip(np.round(weight / scale), -limit, limit) * scale).astype(weight.dtype)


def _is_weight(node: onnx.NodeProto, name: str) -> bool:
    return node.op_type in ("Conv", "ConvTranspose", "Gemm", "MatMul") and list(node.input).index(name) == 1


def _node_inputs(node: onnx.NodeProto) -> List[str]:
    return [i for i in node.input if i]


def _op_tensors(model: onnx.ModelProto, index: int) -> set:
    initializers = {t.name for t in model.graph.initializer}
    node = model.graph.node[index]
    return {i for i in node.input if i and i not in initializers} | {node.output[0]}


def _alive_after(model: onnx.ModelProto, index: int) -> set:
    """Tensors computed up to node ``index`` (or graph inputs) that later nodes or the
    graph outputs still need."""
    initializers = {t.name for t in model.graph.initializer}
    produced = {i.name for i in model.graph.input if i.name not in initializers}
    for node in model.graph.node[:index + 1]:
        produced.update(o for o in node.output if o)
    later = {i for node in model.graph.node[index + 1:] for i in node.input if i}
    later |= {o.name for o in model.graph.output}
    return produced & later


def _sqnr(expected: np.ndarray, actual: np.ndarray) -> Optional[float]:
    """In float64, a block at a time (whole-tensor float64 copies cost the op screen 16 s)."""
    expected, actual = np.ravel(expected), np.ravel(actual)
    noise = signal = 0.0
    for start in range(0, expected.size, BLOCK_VALUES):
        wanted = expected[start:start + BLOCK_VALUES].astype(np.float64)
        error = wanted - actual[start:start + BLOCK_VALUES]
        noise += float(np.dot(error, error))
        signal += float(np.dot(wanted, wanted))
    return 10 * math.log10(signal / noise) if noise and signal else None


def _suffix_session(model: onnx.ModelProto, index: int, one_by_one: bool):
    """The graph after node ``index``, fed the tensors alive at that point (None when the
    node is the last one); unless ``one_by_one``, with Reshapes freed to take a batch."""
    later = list(model.graph.node[index + 1:])
    if not later:
        return None
    alive = sorted(_alive_after(model, index))
    used = {i for node in later for i in node.input}
    inputs = [onnx.helper.make_tensor_value_info(name, elem_type(model, name), None) for name in alive
              if name in used]
    produced = {o for node in later for o in node.output}
    outputs = [o for o in model.graph.output if o.name in produced]
    weights = [t for t in model.graph.initializer if t.name in used]
    suffix = onnx.helper.make_model(onnx.helper.make_graph(later, "suffix", inputs, outputs, initializer=weights),
                                    opset_imports=list(model.opset_import))
    suffix.ir_version = model.ir_version
    for value in suffix.graph.input:
        value.type.tensor_type.ClearField("shape")
    if one_by_one:
        return session(suffix, tiny=True)
    batched = onnx.ModelProto()
    batched.CopyFrom(suffix)
    free_reshape_batch(batched)
    try:
        return session(batched, tiny=True)
    except Exception:  # noqa: BLE001 - a Reshape whose leading 1 is not the batch (PP-OCRv4 rec)
        return session(suffix, tiny=True)  # _run_batched then runs the samples one at a time


def best_method_table(model: onnx.ModelProto, table: Dict[str, dict], candidates, ranking) -> Dict[str, dict]:
    """The calibration table with each op's tensors at the op's best method; where ops share
    a tensor, the more sensitive op's choice wins."""
    updated = dict(table)
    nodes = {n.name: n for n in model.graph.node}
    for row in reversed(ranking):
        node = nodes[row["op"]]
        for name in list(node.input) + list(node.output):
            if name in candidates and row["method"] in candidates[name]:
                updated[name] = candidates[name][row["method"]]
    return updated


def float_op_rows(float_ops: List[str], ranking: List[dict], curve: List[dict], costs: dict,
                  priced=None) -> List[dict]:
    """Each float op with its accuracy (loss when only it is int8; gain: what putting it
    back to int8 cost the final set, where the prune measured it) and latency cost: its
    kernels', and where the runtime's conversions are priced (latency.Boundary) what its
    staying float costs in conversions in the final set (negative where it saves some)."""
    losses = {r["op"]: r["loss"] for r in ranking}
    gains = {p["kept"]: p["gain"] for p in curve if p.get("kept")}
    rows = [{"op": op, "loss": losses.get(op), "gain": gains.get(op), "cost_ms": costs.get(op)} for op in float_ops]
    if priced is not None:
        for row in rows:
            row["conversions_ms"] = round(priced.ms(float_ops) - priced.ms([o for o in float_ops if o != row["op"]]), 4)
    return rows


SMALL_INPUT = 8  # a float op reading 8x fewer values than the largest one's saves too little to measure


def quantized_inputs_back(measure, table, float_ops: List[str], summary: dict, step: str) -> List[str]:
    """The float ops given back the quantized inputs their int8 selves read (keep_in_float's
    quantized_inputs), largest input first, each kept while the target holds and time is left;
    an op whose model it leaves unchanged (its producer int8 anyway) or whose input is small
    (SMALL_INPUT) is not measured. On ONNX Runtime a float head behind a residual Add then reads
    one dequantized tensor instead of running the Add in float between layout transposes (the
    real-size segmenter as an AVX2 CPU: docs/sensitivity.md). ``measure``: stages/sensitivity.py's
    _MixedMeasure; ``step``: how its deadline names the next one."""
    models, kept, tried = measure.models(table), [], []
    nodes = len(models.build(float_ops).graph.node)  # the current model's: a trial that adds none changes nothing
    for op in _largest_inputs_first(measure.prepared, float_ops):
        trial = [*kept, op]
        built = models.build(float_ops, trial)
        trial_nodes = len(built.graph.node)
        if trial_nodes == nodes:
            continue
        if measure.no_time(step):
            break
        result = measure(table, float_ops, trial, built)
        tried.append({"op": op, "kept": measure.meets(result), **result})
        if measure.meets(result):
            kept, nodes, summary["mixed"] = trial, trial_nodes, {k: result[k] for k in summary["mixed"]}
    summary.update({"quantized_inputs": kept, "inputs_given_back": tried} if tried else {})
    return kept


def _largest_inputs_first(model: onnx.ModelProto, ops: List[str]) -> List[str]:
    """``ops`` by the size of their first input (the model's recorded shapes), largest first,
    without those SMALL_INPUT times smaller than the largest; an op of unknown size stays, last."""
    dims = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim]
            for v in [*model.graph.value_info, *model.graph.input]}
    first = {node.name: node.input[0] for node in model.graph.node if node.name in ops and node.input}
    sizes = {op: int(np.prod(dims[first[op]])) if all(d > 0 for d in dims.get(first.get(op), [0])) else 0
             for op in ops}
    largest = max(sizes.values(), default=0)
    return [op for op in sorted(ops, key=lambda op: -sizes[op]) if not sizes[op] or sizes[op] * SMALL_INPUT >= largest]
