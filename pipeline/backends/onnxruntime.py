"""ONNX Runtime: the reference backend, and the ``ort_cpu`` target."""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from collections import Counter
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np

from pipeline import shapes
from pipeline.backends.protocol import MEMORY_OPTION, Capabilities, importable, memory_low, memory_mode
from pipeline.precision import kinds

NAME = "onnxruntime"
CAPABILITIES = Capabilities(
    precisions=("fp32", "fp16", "int8", "mixed"), devices=("CPU",),
    qdq_placement="inputs_and_outputs", qdq_passthrough=("Relu", "Clip", "MaxPool", "Resize", "Concat"), qdq_swish=True,
    qdq_latency=True, dynamic_int8=True, idle_threads_spin=True, qdq_conv_block=16, float_reads_int8=True, conversion_passes=4,
    compile_cache=True, tuning=True, profiler=True, float_op_kinds=True,
    auto_candidates=("fp32", "int8", "mixed"))

_ONNX_FLOAT_TYPES = {1: "fp32", 10: "fp16", 16: "bf16"}
_INTEGER_OPS = {"QLinearConv", "QLinearMatMul", "MatMulInteger", "ConvInteger", "QGemm", "MatMulIntegerToFloat",
                "DynamicQuantizeMatMul", "QLinearAdd", "QLinearMul", "QLinearConcat", "QLinearGlobalAveragePool"}
# a dynamic int8 build's run-time activation quantizers (DynamicQuantizeMatMul also computes: int8 above)
_DYNAMIC_QUANTIZERS = {"DynamicQuantizeLinear", "DynamicQuantizeMatMul"}
_FLOAT_COMPUTE_OPS = {"Conv", "Gemm", "MatMul", "ConvTranspose", "FusedConv", "FusedGemm", "FusedMatMul"}


def available() -> Tuple[bool, str]:
    return importable("onnxruntime")


def versions() -> Dict[str, str]:
    import onnxruntime

    return {"onnxruntime": onnxruntime.__version__}


def check_config(target, precision: str) -> Optional[str]:
    return None  # every combination validate accepts runs


def float_op_kinds(target) -> List[str]:
    """ConvTransposes stay float in int8 builds: ONNX Runtime's CPU provider has no int8
    ConvTranspose kernel (onnxruntime issue 8988), so one between Q/DQ pairs runs float with
    the activation and weights dequantized around it. A 256x192 pose estimator's three
    ConvTransposes float: int8 1.25x fp32 against 1.09x as an AVX2 CPU (docs/model_families.md)."""
    return ["conv_transpose"]


def build(onnx_path: Path, ir_dir: Optional[Path], out_dir: Path, target, precision: str) -> Tuple[List[str], dict]:
    shutil.copyfile(onnx_path, out_dir / "model.onnx")
    options = {"graph_optimization_level": "all", "intra_op_num_threads": target.threads,
               MEMORY_OPTION: memory_mode(target)}
    return ["model.onnx"], {"model": "model.onnx", "options": options}


# Runtime options a bundle's runtime.yaml may set (the tune stage measures them), with
# the values ONNX Runtime uses when they are not set.
OPTION_DEFAULTS = {"graph_optimization_level": "all", "intra_op_num_threads": 0, "inter_op_num_threads": 0,
                   "execution_mode": "sequential", "enable_mem_pattern": True, "enable_cpu_mem_arena": True,
                   "allow_spinning": True}
SPINNING = "session.intra_op.allow_spinning"
CACHED_MODEL = "model.optimized.onnx"  # compile cache: the graph after ONNX Runtime's optimizations
# target.memory=low (docs/targets.md, "Memory modes"): no memory pattern. With it, ONNX Runtime
# plans one block per input shape after the first run while its arena keeps the first run's
# chunks: PP-OCRv4 det 640x960 fp32 225 -> 202 MB, int8 263 -> 200 MB (benchmarks/memory.py).
# Tried and not kept: the arena off as well (det 392 MB), arena shrinkage after each run (rec
# +18 MB), initializers outside the arena, no pre-packing (no change).
MEMORY_LOW = {"enable_mem_pattern": False}


def session_options(options: dict, optimized_path: Optional[Path] = None):
    """ONNX Runtime SessionOptions from runtime.yaml's options."""
    import onnxruntime as ort

    levels = {"disabled": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
              "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
              "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
              "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL}
    chosen = {**OPTION_DEFAULTS, **{k: v for k, v in options.items() if k in OPTION_DEFAULTS},
              **(MEMORY_LOW if memory_low(options) else {})}
    result = ort.SessionOptions()
    result.graph_optimization_level = levels[chosen["graph_optimization_level"]]
    result.intra_op_num_threads = int(chosen["intra_op_num_threads"])
    result.inter_op_num_threads = int(chosen["inter_op_num_threads"])
    result.execution_mode = (ort.ExecutionMode.ORT_PARALLEL if chosen["execution_mode"] == "parallel"
                             else ort.ExecutionMode.ORT_SEQUENTIAL)
    result.enable_mem_pattern = bool(chosen["enable_mem_pattern"])
    result.enable_cpu_mem_arena = bool(chosen["enable_cpu_mem_arena"])
    result.log_severity_level = 3
    result.add_session_config_entry(SPINNING, "1" if chosen["allow_spinning"] else "0")
    if optimized_path is not None:
        result.optimized_model_filepath = str(optimized_path)
    return result


def sample_parallel_options():
    """untimed_options for a session that ``run_each`` calls from several threads at once,
    one thread per call: ONNX Runtime hardly spreads one small sample over two threads
    (PP-OCRv4 rec, 27 ms on one or two), while two samples at once on two cores took 0.65 s
    for what one at a time on two threads took 1.05 s (its fake-quantized model, 20 lines)."""
    from pipeline.environment import own_threads

    options = untimed_options()
    if own_threads() > 1:
        options.intra_op_num_threads = 1
    return options


def sample_parallel_session(model, entries: Optional[Dict[str, str]] = None):
    """An ONNX Runtime CPU session of ``model`` (a ModelProto) for ``run_each``, quiet, with
    these session config entries."""
    import onnxruntime as ort

    options = sample_parallel_options()
    options.log_severity_level = 4
    for key, value in (entries or {}).items():
        options.add_session_config_entry(key, value)
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def run_each(session, names, feeds: list) -> list:
    """``session.run(names, f)`` for each feeds dict, in order; with a session of
    sample_parallel_options, several at once (ONNX Runtime's run is thread-safe)."""
    from pipeline.environment import own_threads

    workers = min(own_threads(), len(feeds))
    if workers < 2:
        return [session.run(names, f) for f in feeds]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(lambda f: session.run(names, f), feeds))


def untimed_options():
    """SessionOptions for sessions parity runs for their values and never times
    (calibration passes, the sensitivity search, layerwise probes, the reference): no
    spin-waiting, and this job's share of the cores when sweep jobs run side by side.
    ONNX Runtime's pool threads spin after every run by default, which burns a core that
    a concurrent job of a sweep could use (docs/sweeps.md)."""
    import onnxruntime as ort

    from pipeline.environment import jobs_side_by_side, own_threads

    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.add_session_config_entry(SPINNING, "0")
    if jobs_side_by_side() > 1:
        options.intra_op_num_threads = own_threads()
    return options


def fastest_run(session, feeds: dict, runs: int) -> float:
    """Seconds of the fastest of ``runs`` runs of ``feeds`` after one warm-up run: a rough
    look at one model's speed (the budget's probe, a build's screen), not a timing."""
    import time

    session.run(None, feeds)
    found = []
    for _ in range(runs):
        started = time.perf_counter()
        session.run(None, feeds)
        found.append(time.perf_counter() - started)
    return min(found)


def write_compile_cache(artifact_dir: Path, settings: dict, folder: Path) -> None:
    """ONNX Runtime's optimized graph for these options, loaded later with the graph
    optimizations off. Layout rewrites of level "all" (NCHWc) depend on the CPU: the
    cache key carries the machine's fingerprint."""
    import onnxruntime as ort

    options = session_options(settings.get("options", {}), folder / CACHED_MODEL)
    ort.InferenceSession(str(Path(artifact_dir) / settings["model"]), options, providers=["CPUExecutionProvider"])
    # read back as Session reads it: ONNX Runtime 1.31 writes an If whose two branches both got
    # an NCHWc reorder as one it cannot load ("not in SSA form": 'reorder_token_0' twice); a
    # cache that fails here is never made (compile_cache.write: the artifact loads without one)
    again = session_options({**settings.get("options", {}), "graph_optimization_level": "disabled"})
    ort.InferenceSession(str(folder / CACHED_MODEL), again, providers=["CPUExecutionProvider"])


class Session:
    def __init__(self, model_path: Path, device: str = "CPU", precision: str = "fp32",
                 graph_optimization_level: str = "all", intra_op_num_threads: int = 0, *,
                 options: Optional[dict] = None, cached_model: Optional[Path] = None, cache_status: str = "none",
                 opt_shapes: Optional[Dict[str, Tuple[int, ...]]] = None):
        import onnxruntime as ort

        options = {**(options or {}), "graph_optimization_level": graph_optimization_level,
                   "intra_op_num_threads": intra_op_num_threads}
        self._scratch = tempfile.TemporaryDirectory(prefix="parity-ort-")
        self._optimized = Path(self._scratch.name) / "optimized.onnx"
        # what ORT really executes; from a compile cache, the optimized graph is run as it is
        executed = options if cached_model is None else {**options, "graph_optimization_level": "disabled"}
        self._executed = (Path(cached_model or model_path), executed)  # a profiling session runs the same
        self._session = ort.InferenceSession(str(cached_model or model_path),
                                             session_options(executed, self._optimized),
                                             providers=["CPUExecutionProvider"])
        self._model_path = Path(model_path)
        self._level = graph_optimization_level
        self._memory = "low" if memory_low(options) else "default"
        self._cache_status = cache_status
        self._probe = None
        self.inputs = [i.name for i in self._session.get_inputs()]
        self.outputs = [o.name for o in self._session.get_outputs()]
        self._at_opt = (opt_shapes, self._static_at_opt(options, opt_shapes)) if opt_shapes else None

    def _static_at_opt(self, options: dict, opt_shapes: Dict[str, Tuple[int, ...]]):
        """A dynamic model's second session with its inputs' free dims fixed at the range's
        opt shape (ONNX Runtime's free dimension overrides, by the dims' names): with static
        shapes it plans memory once and folds the shape arithmetic. Rec int8 at opt ran 0.90x
        fp32 with dynamic dims (benchmarks/dynamic.py)."""
        import onnxruntime as ort

        fixed = session_options(options)
        for value in self._session.get_inputs():
            for dim, size in zip(value.shape, opt_shapes.get(value.name, ())):
                if isinstance(dim, str):
                    fixed.add_free_dimension_override_by_name(dim, int(size))
        return ort.InferenceSession(str(self._model_path), fixed, providers=["CPUExecutionProvider"])

    def remove_scratch(self) -> None:
        """Remove the scratch folder (the optimized graph, profiles, probe models)."""
        self._scratch.cleanup()

    def run(self, feeds: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
        session = self._session
        if self._at_opt is not None and shapes.at_shapes(feeds, self._at_opt[0]):
            session = self._at_opt[1]
        return dict(zip(self.outputs, session.run(self.outputs, feeds)))

    def profile(self, feeds: Dict[str, np.ndarray], runs: int, warmup: int = 1,
                nodes: Optional[dict] = None, budget_s: Optional[float] = None) -> dict:
        """Per-node times from ONNX Runtime's profiler, in a second session with the same
        options plus enable_profiling (its trace goes to the scratch folder). Nodes are the
        executed graph's (fusions, NCHWc and int8 kernels); the warm-up runs do not count.
        ``nodes``: the converted model's index (pipeline.profiling.Nodes.to_json());
        ``budget_s``: stop early (after one counted run at least) once it is spent."""
        import onnxruntime as ort

        from pipeline import profiling

        path, executed = self._executed
        options = session_options(executed)
        options.enable_profiling = True
        options.profile_file_prefix = str(Path(self._scratch.name) / "profile")
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        plan = profiling.Runs(runs, warmup, budget_s)
        for _ in plan:
            session.run(self.outputs, feeds)
        trace = Path(session.end_profiling())
        events = json.loads(trace.read_text())
        trace.unlink()
        windows = sorted((e["ts"], e["ts"] + e["dur"], e["dur"]) for e in events
                         if e.get("cat") == "Session" and e.get("name") == "model_run")[-plan.counted:]
        timer = profiling.Timer()
        for event in events:
            name = event.get("name", "")
            if event.get("cat") != "Node" or not name.endswith("_kernel_time") or \
                    not any(start <= event["ts"] <= end for start, end, _ in windows):
                continue
            node = name[: -len("_kernel_time")]
            op_type = event.get("args", {}).get("op_name", "?")
            timer.add(node, event["dur"] / 1000.0, op_type, f"NCHWc {op_type}" if node.endswith("_nchwc") else op_type)
        index = profiling.Nodes(nodes)
        layers = timer.layers(index, len(windows), lambda node: _ort_candidates(node, timer.info[node][0], index))
        run_ms = sum(dur for _, _, dur in windows) / 1000.0 / len(windows) if windows else None
        providers = session.get_providers()
        device = "CPU" if providers and providers[0] == "CPUExecutionProvider" else providers[0]
        return profiling.result("ONNX Runtime profiler (SessionOptions.enable_profiling): kernel time of each node "
                                "of the executed graph; whole run: model_run", len(windows), warmup, layers, run_ms,
                                {"device": device}, plan.note())

    def probe(self, names: List[str]) -> dict:
        """Prepare to expose these ONNX tensors. What runs is the graph this session
        executes (fusions, int8 kernels) up to ORT's extended level: the layout-only
        NCHWc rewrite of level "all" is left out, it changes layouts, not values."""
        import onnx
        import onnxruntime as ort

        model = onnx.load(str(self._graph_for_probe()))
        mapping, tensors = map_tensors(model.graph, names)
        if not mapping:
            self._probe = (None, {})
            return {"exposed": [], "tensors": tensors}
        del model.graph.output[:]
        model.graph.output.extend(onnx.ValueInfoProto(name=m.tensor) for m in mapping.values())
        path = Path(self._scratch.name) / "probe.onnx"
        onnx.save(model, str(path), save_as_external_data=True, location="probe.onnx.data")
        options = untimed_options()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        self._probe = (ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"]), mapping)
        return {"exposed": list(mapping), "tensors": tensors}

    def run_probe(self, feeds: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
        session, mapping = self._probe
        values = session.run([m.tensor for m in mapping.values()], feeds)
        return {name: m.dequantize(value) for (name, m), value in zip(mapping.items(), values)}

    def _graph_for_probe(self) -> Path:
        if self._level == "disabled":
            return self._model_path
        import onnxruntime as ort

        path = Path(self._scratch.name) / "executed.onnx"
        if not path.exists():
            options = ort.SessionOptions()
            options.graph_optimization_level = (ort.GraphOptimizationLevel.ORT_ENABLE_BASIC if self._level == "basic"
                                                else ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED)
            options.optimized_model_filepath = str(path)
            options.log_severity_level = 3
            ort.InferenceSession(str(self._model_path), options, providers=["CPUExecutionProvider"])
        return path

    def effective(self) -> Dict[str, str]:
        providers = self._session.get_providers()
        device = "CPU" if providers and providers[0] == "CPUExecutionProvider" else providers[0]
        precision, layers, float_ops, dynamic = executed_precision(self._optimized)
        float_ops = _model_op_names(float_ops, self._model_path) if float_ops else float_ops
        found = {"device": device, "precision": precision, "layers": layers, "float_ops": float_ops,
                 "compile_cache": self._cache_status, "runtime_options": self._read_back()}
        if dynamic:  # every float op of a dynamic build is its quantizer's choice, none a fallback
            found.update(float_ops={}, float_ops_by_build=float_ops, activation_ranges="dynamic",
                         dynamic_quantizers=dynamic)
        if self._at_opt is not None:  # a dynamic model: the static copy at the range's opt
            found["static_copy_at"] = {name: shapes.shape_text(shape) for name, shape in self._at_opt[0].items()}
        return found

    def _read_back(self) -> dict:
        """The session options ONNX Runtime holds (a compile-cache session runs the cached,
        already optimized graph with its own optimizations off)."""
        held = self._session.get_session_options()
        return {"graph_optimization_level": self._level if self._cache_status != "hit" else
                f"{self._level} (cached graph)", "intra_op_num_threads": held.intra_op_num_threads,
                "inter_op_num_threads": held.inter_op_num_threads, "execution_mode": held.execution_mode.name,
                "enable_mem_pattern": held.enable_mem_pattern, "enable_cpu_mem_arena": held.enable_cpu_mem_arena,
                "allow_spinning": held.get_session_config_entry(SPINNING) != "0", "memory": self._memory}


def _ort_candidates(node: str, op_type: str, index) -> List[str]:
    """The ONNX name an executed node stands for. ORT names what it rewrites after the
    original: "fused fc1" (FusedGemm), "conv1_token_3" (a layout or int8 rewrite),
    "relu1_out_nchwc" (the NCHWc Conv computing tensor relu1_out); what it inserts gets a
    name of its own ("ReorderOutput_token_5"), which resolves to nothing; a node the model
    left unnamed becomes "Flatten_257" (ORT's own numbering): the model's only unnamed
    node of that type, if it has one. A dynamic int8 build's integer op is "<node>_quant"."""
    name = node[len("fused "):] if node.startswith("fused ") else node
    name = re.sub(r"(_token_\d+)+$", "", name)
    name = name[: -len("_nchwc")] if name.endswith("_nchwc") else name
    if name.endswith("_quant") and not index.resolve([name]):  # a dynamic int8 build's "<node>_quant"
        name = name[: -len("_quant")]
    if not index.resolve([name]) and re.fullmatch(rf"{re.escape(op_type)}_\d+", name):
        return [found] if (found := index.only_unnamed(op_type)) else []
    return [name]


def _model_op_names(ops: Dict[str, str], model_path: Path) -> Dict[str, str]:
    """Executed-graph op names as the loaded model's op names, resolved as the profiler
    resolves its layers (pipeline.profiling.Nodes): an NCHWc Conv named after the tensor it
    computes ("batch_norm_32.tmp_2_nchwc"), past an activation fused into it (a Conv then
    Sigmoid computes the Sigmoid's output), is the Conv."""
    from pipeline import profiling

    index = profiling.Nodes.load(model_path)
    named = {}
    for name, kind in ops.items():
        node = index.layer(name, kind, None, 0.0, _ort_candidates(name, kind, index))["onnx_node"]
        named[node or name] = kind
    return named


def executed_precision(optimized_path: Path) -> Tuple[str, str, Dict[str, str], int]:
    """Precision of the compute ops in the graph ORT executes after its optimizations:
    integer kernels (QLinearConv, MatMulInteger, a dynamic build's DynamicQuantizeMatMul and
    MatMulIntegerToFloat...) count as int8, float ones by their type; the float compute ops
    by ONNX name ({name: op type}: verify tells an op the build kept in float from one ORT
    has no int8 kernel for, such as ConvTranspose); and how many run-time activation
    quantizers (DynamicQuantizeLinear, DynamicQuantizeMatMul) a dynamic int8 build runs."""
    import onnx

    model = onnx.load(str(optimized_path), load_external_data=False)
    types = {v.name: v.type.tensor_type.elem_type for v in list(model.graph.value_info) + list(model.graph.input)}
    types.update({t.name: t.data_type for t in model.graph.initializer})
    counts: Counter = Counter()
    float_ops: Dict[str, str] = {}
    dynamic = sum(node.op_type in _DYNAMIC_QUANTIZERS for node in model.graph.node)
    for node in model.graph.node:
        if node.op_type in _INTEGER_OPS:
            counts["int8"] += 1
        elif node.op_type in _FLOAT_COMPUTE_OPS or node.op_type.startswith("Fused"):
            elem = types.get(node.input[1] if len(node.input) > 1 else node.input[0], 1)
            counts[_ONNX_FLOAT_TYPES.get(elem, "fp32")] += 1
            name = re.sub(r"(_token_\d+|/\w+Fusion/)+$", "", node.name.removeprefix("fused "))  # MatMulScaleFusion
            float_ops[name] = node.op_type.removeprefix("Fused")
    if not counts:
        return "fp32", "", {}, dynamic
    layers = ", ".join(f"{k}: {v}" for k, v in sorted(counts.items()))
    return (kinds.from_op_counts(counts) or counts.most_common(1)[0][0]), layers, \
        (float_ops if counts["int8"] else {}), dynamic


# Where the output scale and zero point of a quantized op are among its inputs.
_OUTPUT_QPARAMS = {"QuantizeLinear": (1, 2), "QLinearConv": (6, 7), "QLinearMatMul": (6, 7), "QLinearAdd": (6, 7),
                   "QLinearMul": (6, 7), "QGemm": (7, 8), "QLinearGlobalAveragePool": (3, 4),
                   "QLinearAveragePool": (3, 4), "QLinearSigmoid": (3, 4), "QLinearLeakyRelu": (3, 4),
                   "QLinearSoftmax": (3, 4), "QLinearConcat": (0, 1), "QLinearReduceMean": (3, 4)}
# Ops that move quantized values without changing their scale.
_QPARAM_PASSTHROUGH = {"MaxPool", "Reshape", "Flatten", "Transpose", "Squeeze", "Unsqueeze", "Identity", "Slice",
                       "Gather", "Split", "Resize", "DepthToSpace", "SpaceToDepth", "NhwcMaxPool"}


class _Mapped:
    """A tensor of the executed graph standing for an ONNX tensor, with its dequantization."""

    def __init__(self, tensor: str, scale=None, zero_point=None):
        self.tensor, self.scale, self.zero_point = tensor, scale, zero_point

    def dequantize(self, value: np.ndarray) -> np.ndarray:
        if self.scale is None:
            return np.asarray(value, dtype=np.float32)
        return ((value.astype(np.float32) - self.zero_point) * self.scale).astype(np.float32)


def map_tensors(graph, names: List[str]):
    """For each wanted ONNX name, the executed graph's tensor holding it (the dequantized
    value first, then the quantized one, then the float one), and the ONNX names all of
    the executed graph's activations map to."""
    from onnx import numpy_helper

    from pipeline.verification.layerwise import dynamic_outputs
    from pipeline.backends.tensor_names import onnx_name

    constants = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    producers = {out: node for node in graph.node for out in node.output}
    initializers = set(constants)
    activations = dynamic_outputs(graph.node, [i.name for i in graph.input if i.name not in initializers])
    by_base: Dict[str, List[str]] = {}
    for tensor in activations:
        by_base.setdefault(onnx_name(tensor), []).append(tensor)
    mapping = {}
    for name in names:
        options = sorted(by_base.get(name, []), key=lambda t: (not t.endswith("_DequantizeLinear_Output"),
                                                               not t.endswith("_QuantizeLinear_Output")))
        for tensor in options:
            if tensor.endswith("_QuantizeLinear_Output") or _is_quantized_output(producers.get(tensor)):
                qparams = _output_qparams(tensor, producers, constants)
                if qparams is None:
                    continue
                mapping[name] = _Mapped(tensor, *qparams)
            else:
                mapping[name] = _Mapped(tensor)
            break
    return mapping, sorted(by_base)


def _is_quantized_output(node) -> bool:
    if node is None or node.op_type not in _OUTPUT_QPARAMS:
        return False
    scale_at = _OUTPUT_QPARAMS[node.op_type][0]
    return len(node.input) > scale_at and bool(node.input[scale_at])  # QGemm without y_scale gives float


def _output_qparams(tensor: str, producers, constants, depth: int = 0):
    node = producers.get(tensor)
    if node is None or depth > 32:
        return None
    if node.op_type in _OUTPUT_QPARAMS:
        scale_at, zero_at = _OUTPUT_QPARAMS[node.op_type]
        if len(node.input) <= scale_at or node.input[scale_at] not in constants:
            return None
        zero = constants.get(node.input[zero_at]) if len(node.input) > zero_at else None
        return (np.float32(constants[node.input[scale_at]]),
                np.float32(zero) if zero is not None else np.float32(0))
    if node.op_type in _QPARAM_PASSTHROUGH:
        return _output_qparams(node.input[0], producers, constants, depth + 1)
    return None


def load(artifact_dir: Path, settings: dict) -> Session:
    from pipeline.release import compile_cache

    options = settings.get("options", {})
    folder, status = compile_cache.usable(artifact_dir, settings, NAME, versions())
    return Session(Path(artifact_dir) / settings["model"], settings.get("device", "CPU"), settings["precision"],
                   options.get("graph_optimization_level", "all"), options.get("intra_op_num_threads", 0),
                   options=options, cached_model=folder / CACHED_MODEL if folder else None, cache_status=status,
                   opt_shapes=shapes.opt_shapes(settings.get("inputs", [])))


def tuning_space(settings: dict, level: str, objective: str, devices: List[str]) -> List[Tuple[str, list]]:
    """Runtime options the tune stage tries, each with its values (the current one first)."""
    from pipeline.tuning import current_first, thread_counts

    options = {**OPTION_DEFAULTS, **settings.get("options", {})}
    knobs = [("intra_op_num_threads", thread_counts(options["intra_op_num_threads"]))]
    if level != "fast":
        knobs += [("graph_optimization_level", ["all", "extended", "basic"]),
                  ("execution_mode", ["sequential", "parallel"]),
                  ("enable_mem_pattern", [True, False]), ("enable_cpu_mem_arena", [True, False]),
                  ("allow_spinning", [True, False])]
    if memory_low(options):  # target.memory=low decides these
        knobs = [(name, values) for name, values in knobs if name not in MEMORY_LOW]
    return [(name, current_first(options[name], values)) for name, values in knobs]


def reference(model_path: Path) -> Session:
    """The fp32 reference: ONNX Runtime on the CPU with graph optimizations off."""
    return Session(model_path, graph_optimization_level="disabled")
