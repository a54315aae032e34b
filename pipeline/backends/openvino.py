"""OpenVINO: the ``openvino_cpu`` target (IR model, explicit precision hint)."""

from __future__ import annotations

import shutil
from collections import Counter
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np

from pipeline import shapes
from pipeline.backends.protocol import MEMORY_OPTION, Capabilities, importable, memory_low, memory_mode
from pipeline.errors import first_line
from pipeline.precision import kinds

NAME = "openvino"
CAPABILITIES = Capabilities(
    precisions=("fp32", "fp16", "bf16", "int8", "mixed"), devices=("CPU",),
    qdq_placement="inputs", qdq_latency=True, measures_qdq=True, ir=True,
    fp16_converter="openvino save_model(compress_to_fp16=True)",
    compile_cache=True, tuning=True, option_mapping=True, profiler=True, parallel_runners=True,
    auto_candidates=("fp32", "bf16", "int8", "mixed"))

# Without an explicit hint the CPU plugin runs bf16 on CPUs that have it (shared/findings.md).
PRECISION_HINTS = {"fp32": "f32", "bf16": "bf16", "fp16": "f16", "int8": "f32", "mixed": "f32"}  # int8: f32 between quantized ops
# Every spelling OpenVINO reads back (Type.get_type_name(), str(Type), option values) -> parity's names.
_PARITY_PRECISIONS = {"f32": "fp32", "float32": "fp32", "fp32": "fp32", "f16": "fp16", "float16": "fp16",
                      "fp16": "fp16", "bf16": "bf16", "bfloat16": "bf16", "u8": "int8", "uint8": "int8",
                      "i8": "int8", "int8": "int8"}
_READ_BACK = ("PERFORMANCE_HINT", "NUM_STREAMS", "INFERENCE_NUM_THREADS", "INFERENCE_PRECISION_HINT")
# target.memory=low (docs/targets.md, "Memory modes"): one stream, one set of intermediate
# buffers (PP-OCRv4 det fp32 640x960: 246 MB with PERFORMANCE_HINT=THROUGHPUT's 2 streams on 2
# cores, 186 MB with one; OpenVINO's default hint, LATENCY, runs one already: 211 -> 207 MB).
# Tried and not kept (no change): weights memory-mapped or not (ENABLE_MMAP, on by default),
# CPU_RUNTIME_CACHE_CAPACITY=0, INFERENCE_NUM_THREADS=1.
MEMORY_LOW = {"NUM_STREAMS": 1}


def compile_config(options: dict) -> dict:
    """runtime.yaml's options as OpenVINO's compile config: target.memory mapped to its
    properties (low wins over a tuned NUM_STREAMS), parity's own key dropped."""
    config = {key: value for key, value in options.items() if key != MEMORY_OPTION}
    return {**config, **(MEMORY_LOW if memory_low(options) else {})}
_COMPUTE_LAYERS = {"Convolution", "FullyConnected", "MatMul", "Deconvolution", "GroupConvolution"}


def available() -> Tuple[bool, str]:
    return importable("openvino")


def versions() -> Dict[str, str]:
    import openvino

    return {"openvino": openvino.get_version()}


def convert(onnx_path: Path, out_dir: Path, fp16_weights: bool = False) -> List[str]:
    """ONNX -> IR through Core.read_model (the ovc converter path sends telemetry)."""
    import openvino as ov

    model = ov.Core().read_model(str(onnx_path))
    _bound_dynamic_dims(model, onnx_path)
    ov.save_model(model, str(out_dir / "model.xml"), compress_to_fp16=fp16_weights)
    return ["model.xml", "model.bin"]


def _bound_dynamic_dims(model, onnx_path: Path) -> None:
    """Dynamic dims get the bounds of model.input_shapes' range (recorded by convert):
    OpenVINO plans memory for bounded dims; dims the data decides stay unbounded."""
    import onnx
    import openvino as ov

    ranges = {name: found for name, found in
              shapes.recorded(onnx.load(str(onnx_path), load_external_data=False)).items() if found}
    bounded = {}
    for port in model.inputs:
        found = ranges.get(port.get_any_name())
        if found is not None and port.get_partial_shape().rank.get_length() == len(found.min):
            bounded[port.get_any_name()] = ov.PartialShape(
                [ov.Dimension(low) if low == high else ov.Dimension(low, high) for low, high in zip(found.min, found.max)])
    if bounded:
        model.reshape(bounded)


def check_config(target, precision: str) -> Optional[str]:
    streams = target.openvino.num_streams
    if streams is not None and streams < 1:
        return f"target.openvino.num_streams={streams}: must be >= 1 (null: OpenVINO's default)"
    if streams is not None and streams > 1 and memory_mode(target) == "low":
        return (f"target.openvino.num_streams={streams} and target.memory=low: low runs one stream "
                "(docs/targets.md, \"Memory modes\"); drop one of them")
    return None


def convert_ir(onnx_path: Path, out_dir: Path) -> List[str]:
    """convert's IR of the float model: (xml, bin) names in out_dir."""
    return convert(onnx_path, out_dir)


def build(onnx_path: Path, ir_dir: Optional[Path], out_dir: Path, target, precision: str) -> Tuple[List[str], dict]:
    """The IR from convert when there is one, else converted here (e.g. a QDQ int8 model)."""
    if ir_dir is None:
        convert(onnx_path, out_dir, fp16_weights=kinds.narrow(precision))
    else:
        for name in ("model.xml", "model.bin"):
            shutil.copyfile(ir_dir / name, out_dir / name)
    options = {"INFERENCE_PRECISION_HINT": PRECISION_HINTS[precision]}
    if target.threads:
        options["INFERENCE_NUM_THREADS"] = target.threads
    if target.openvino.performance_hint is not None:
        options["PERFORMANCE_HINT"] = target.openvino.performance_hint.value
    if target.openvino.num_streams is not None:
        options["NUM_STREAMS"] = target.openvino.num_streams
    if memory_mode(target) != "default":  # parity's own key: the default leaves options a pure compile config
        options[MEMORY_OPTION] = memory_mode(target)
    return ["model.xml", "model.bin"], {"model": "model.xml", "options": options}


BLOB = "model.blob"  # compile cache: the compiled model as CompiledModel.export_model writes it


def write_compile_cache(artifact_dir: Path, settings: dict, folder: Path) -> None:
    """The compiled model as CompiledModel.export_model writes it (what OpenVINO's CACHE_DIR
    model cache stores for it). Loading imports it directly: a CACHE_DIR lookup first reads
    the model and hashes its whole serialized graph, most of a cached start-up for a small
    model (PP-OCR classifier: 70 ms through CACHE_DIR, 28 ms imported, 117 ms compiled)."""
    import openvino as ov

    core = ov.Core()
    # at the served shapes, as the loader compiles it first (Session)
    model = _read_at(core, Path(artifact_dir) / settings["model"], shapes.served_shapes(settings.get("inputs", [])))
    compiled = core.compile_model(model, settings.get("device", "CPU"), compile_config(settings.get("options", {})))
    (folder / BLOB).write_bytes(compiled.export_model().getvalue())


def _read_at(core, path: Path, served: Optional[Dict[str, Tuple[int, ...]]]):
    """The IR at ``path``, reshaped to the served shapes where there are."""
    model = core.read_model(str(path))
    if served:
        model.reshape({name: list(shape) for name, shape in served.items()})
    return model


class Session:
    def __init__(self, model_path: Path, device: str, options: dict, output_names: List[str],
                 cache_dir: Optional[Path] = None, cache_status: str = "none",
                 opt_shapes: Optional[Dict[str, Tuple[int, ...]]] = None,
                 served: Optional[Dict[str, Tuple[int, ...]]] = None):
        """``opt_shapes``: a range's opt, compiled as a second, static copy beside the dynamic
        model; ``served``: the one shape the data fed a dynamic model without a range, compiled
        static as the model itself, the dynamic one only when another shape comes (its memory
        and compile time are paid only then)."""
        import openvino as ov

        core = ov.Core()
        self._memory = "low" if memory_low(options) else "default"
        options = compile_config(options)
        self._core, self._model_path, self._device, self._options = core, Path(model_path), device, dict(options)
        self._served, self._dynamic = served or None, None
        self._compiled, model = None, None
        if cache_dir is not None:
            try:
                with open(cache_dir / BLOB, "rb") as blob:
                    self._compiled = core.import_model(blob.read(), device, dict(options))
            except Exception as err:  # noqa: BLE001 - a blob this runtime rejects: compile instead
                cache_status = f"miss: OpenVINO rejected the cached blob ({first_line(err)})"
        if self._compiled is None:
            model = self._read()
            self._compiled = core.compile_model(model, device, dict(options))
        self._cache_status = cache_status
        self._probe = None
        self._request = self._compiled.create_infer_request()
        self._at_opt = self._static_at_opt(opt_shapes, model) if opt_shapes else None
        self.inputs = [_pick_name(i.get_names(), []) for i in self._compiled.inputs]
        self.outputs = [_pick_name(o.get_names(), output_names) for o in self._compiled.outputs]

    def _static_at_opt(self, opt_shapes: Dict[str, Tuple[int, ...]], model=None):
        """A dynamic model's second compiled copy with every input fixed at its range's opt
        shape: (the shapes, the request, its output ports). The CPU plugin's dynamic-shape
        kernels cost ~15 % at a given shape (benchmarks/dynamic.py); inputs at opt, the shape
        the range names as the common one, run the static copy. ``model``: the one read for
        the dynamic compile, if any (reshaped in a clone, not read again)."""
        model = model.clone() if model is not None else self._core.read_model(str(self._model_path))
        model.reshape({name: list(shape) for name, shape in opt_shapes.items()})
        compiled = self._core.compile_model(model, self._device, dict(self._options))
        return opt_shapes, compiled.create_infer_request(), list(compiled.outputs)

    def _read(self):
        """The IR, at the served shapes where there are."""
        return _read_at(self._core, self._model_path, self._served)

    def _dynamic_model(self):
        """(request, output ports) of the dynamic model, compiled on its first use."""
        if self._dynamic is None:
            compiled = self._core.compile_model(self._core.read_model(str(self._model_path)), self._device,
                                                dict(self._options))
            self._dynamic = (compiled.create_infer_request(), list(compiled.outputs))
        return self._dynamic

    def run(self, feeds: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
        if self._at_opt is not None and shapes.at_shapes(feeds, self._at_opt[0]):
            result = self._at_opt[1].infer(feeds)
            return {name: np.array(result[port]) for name, port in zip(self.outputs, self._at_opt[2])}
        if self._served and not shapes.at_shapes(feeds, self._served):
            request, ports = self._dynamic_model()
            result = request.infer(feeds)
            return {name: np.array(result[port]) for name, port in zip(self.outputs, ports)}
        result = self._request.infer(feeds)
        return {name: np.array(result[port]) for name, port in zip(self.outputs, self._compiled.outputs)}

    def probe(self, names: List[str]) -> dict:
        """Prepare to expose these ONNX tensors as extra model outputs (by tensor name; for
        int8 IRs the dequantized value of x_DequantizeLinear_Output stands for x). Extra
        outputs keep the tensors alive, which can stop some fusions around them."""
        from pipeline.backends.tensor_names import onnx_name

        model = self._read()
        ports, tensors = {}, set()
        for port, name in _activation_ports(model):
            base = onnx_name(name)
            tensors.add(base)
            rank = 0 if name.endswith("_DequantizeLinear_Output") else 1 if name == base else 2
            if base in names and port.get_element_type().is_real() and rank < ports.get(base, (3, None))[0]:
                ports[base] = (rank, port, name)
        exposed = [name for name in names if name in ports]
        model.add_outputs([ports[name][1] for name in exposed])
        compiled = self._core.compile_model(model, self._device, self._options)
        self._probe = (compiled.create_infer_request(), [(name, compiled.output(ports[name][2])) for name in exposed])
        return {"exposed": exposed, "tensors": sorted(tensors)}

    def run_probe(self, feeds: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
        request, outputs = self._probe
        result = request.infer(feeds)
        return {name: np.array(result[port], dtype=np.float32) for name, port in outputs}

    def profile(self, feeds: Dict[str, np.ndarray], runs: int, warmup: int = 1,
                nodes: Optional[dict] = None, budget_s: Optional[float] = None) -> dict:
        """Per-layer times from OpenVINO's PERF_COUNT on a second compiled model with the
        same options: ``get_profiling_info`` after each run gives every executed layer of
        the compiled (runtime) model, its exec type (the kernel, e.g. brgconv_avx512_amx_I8)
        and real time; the runtime model's ``originalLayersNames`` name the IR ops it fused.
        ``nodes``: the converted model's index (pipeline.profiling.Nodes.to_json());
        ``budget_s``: stop early (after one counted run at least) once it is spent."""
        import time

        from pipeline import profiling

        model = self._read()
        compiled = self._core.compile_model(model, self._device, {**self._options, "PERF_COUNT": True})
        request = compiled.create_infer_request()
        timer, wall, plan = profiling.Timer(), 0.0, profiling.Runs(runs, warmup, budget_s)
        for counted in plan:
            started = time.perf_counter()
            request.infer(feeds)
            if not counted:
                continue
            wall += time.perf_counter() - started
            for info in request.get_profiling_info():
                if info.status == info.Status.EXECUTED:
                    timer.add(info.node_name, info.real_time.total_seconds() * 1000.0, info.node_type, info.exec_type)
        original = {op.get_friendly_name(): op.get_rt_info()["originalLayersNames"].astype(str)
                    for op in compiled.get_runtime_model().get_ordered_ops()}
        runs = plan.counted
        layers = timer.layers(profiling.Nodes(nodes), runs,
                              lambda name: [n for n in original.get(name, name).split(",") if n])
        device = ",".join(compiled.get_property("EXECUTION_DEVICES"))
        return profiling.result("OpenVINO PERF_COUNT (InferRequest.get_profiling_info): real time and exec type of "
                                "each executed layer; whole run: wall time of infer()", runs, warmup, layers,
                                wall * 1000.0 / runs, {"device": device}, plan.note())

    def effective(self) -> Dict[str, object]:
        """Device and the precision the compiled model really runs in, read back from it: its
        INFERENCE_PRECISION_HINT and the data type each compute layer computes on (never the
        weights' storage type); a note says why when a requested float hint was not honoured."""
        compiled = self._compiled
        read_back = _option_text(compiled.get_property("INFERENCE_PRECISION_HINT"))
        hint = parity_precision(read_back)
        counts = _layer_precisions(compiled.get_runtime_model())
        precision = kinds.from_op_counts(counts) or (hint if hint in counts or not counts
                                                     else counts.most_common(1)[0][0])
        found = {"device": ",".join(compiled.get_property("EXECUTION_DEVICES")), "precision": precision,
                 "layers": ", ".join(f"{k}: {v}" for k, v in sorted(counts.items())),
                 "compile_cache": self._cache_status,
                 "runtime_options": {**{name: _option_text(compiled.get_property(name)) for name in _READ_BACK},
                                     "memory": self._memory}}
        # a dynamic model: compiled at the served shape (the dynamic one on demand), or a static
        # copy compiled at the range's opt
        static = self._served or (self._at_opt[0] if self._at_opt is not None else None)
        if static:
            found["static_copy_at"] = {name: shapes.shape_text(shape) for name, shape in static.items()}
        note = self._hint_note(read_back, precision, found["layers"])
        return {**found, "note": note} if note else found

    def _hint_note(self, read_back: str, precision: str, layers: str) -> str:
        """Why the float precision asked through INFERENCE_PRECISION_HINT is not what ran."""
        asked = self._options.get("INFERENCE_PRECISION_HINT")
        if asked is None or kinds.quantized(precision) or parity_precision(asked) == precision:
            return ""
        if parity_precision(read_back) == precision:
            capabilities = self._core.get_property(self._device, "OPTIMIZATION_CAPABILITIES")
            why = (f"; {self._device} OPTIMIZATION_CAPABILITIES: {', '.join(capabilities)}"
                   + ("" if asked != "f16" or "FP16" in capabilities else " (no native f16 arithmetic here)"))
            return f"OpenVINO compiled INFERENCE_PRECISION_HINT={asked} as {read_back}{why}"
        return f"OpenVINO kept INFERENCE_PRECISION_HINT={asked} but its compute layers ran {layers}"

    def parallel_runners(self) -> list:
        """One infer request per request the compiled model runs best with (throughput)."""
        count = max(1, int(self._compiled.get_property("OPTIMAL_NUMBER_OF_INFER_REQUESTS")))
        outputs = list(zip(self.outputs, self._compiled.outputs))

        def runner(request):
            return lambda feeds: {name: request.infer(feeds)[port] for name, port in outputs}

        return [runner(self._compiled.create_infer_request()) for _ in range(count)]


def parity_precision(value) -> str:
    """A precision OpenVINO reports (an ov.Type such as <Type: 'float32'>, or a name such as
    'f32' or 'bfloat16') in parity's names: fp32, fp16, bf16, int8; any other as its name."""
    name = value.get_type_name() if hasattr(value, "get_type_name") else str(value)
    return _PARITY_PRECISIONS.get(name.strip().lower(), name)


def _option_text(value) -> str:
    """An option read back from OpenVINO as the text that sets it (a Type as 'f32', not <Type: 'float32'>)."""
    if hasattr(value, "get_type_name"):
        return value.get_type_name()
    return ",".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)


def _layer_precisions(runtime_model) -> Counter:
    """How many compute layers of the compiled (runtime) model compute in each precision: the
    type of each one's data input. Not rt_info's runtimePrecision, which also counts weights:
    a Convolution with fp16-compressed weights reads f16 there while its kernel is
    brgconv_avx512_f32 on f32 data (the weights are decompressed). Integer math (an i32
    MatMul on indices) is no precision choice and is left out."""
    counts: Counter = Counter()
    for op in runtime_model.get_ordered_ops():
        if op.get_rt_info()["layerType"].astype(str) in _COMPUTE_LAYERS and op.inputs():
            precision = parity_precision(op.input(0).get_element_type())
            if precision in CAPABILITIES.precisions:
                counts[precision] += 1
    return counts


def _activation_ports(model):
    """(output port, tensor name) of every op that depends on a model input."""
    dynamic = set()
    for op in model.get_ordered_ops():
        kind = op.get_type_name()
        if kind == "Parameter" or any(i.get_source_output().get_node().get_friendly_name() in dynamic
                                      for i in op.inputs()):
            dynamic.add(op.get_friendly_name())
            if kind not in ("Parameter", "Result"):
                for port in op.outputs():
                    for name in port.get_names():
                        yield port, name


def _pick_name(names, preferred: List[str]) -> str:
    for name in preferred:
        if name in names:
            return name
    return sorted(names)[0]


def load(artifact_dir: Path, settings: dict) -> Session:
    from pipeline.release import compile_cache

    outputs = [o["name"] for o in settings.get("outputs", [])]
    folder, status = compile_cache.usable(artifact_dir, settings, NAME, versions())
    inputs = settings.get("inputs", [])
    served = shapes.served_shapes(inputs)
    return Session(Path(artifact_dir) / settings["model"], settings.get("device", "CPU"),
                   settings.get("options", {}), outputs, cache_dir=folder, cache_status=status,
                   opt_shapes=None if served else shapes.opt_shapes(inputs), served=served)


def tuning_space(settings: dict, level: str, objective: str, devices: List[str]) -> List[Tuple[str, list]]:
    """Compile options the tune stage tries (never the precision hint: precision is the
    config's); None leaves an option to OpenVINO."""
    from pipeline.tuning import current_first, thread_counts

    options = settings.get("options", {})
    threads = [None if count == 0 else count for count in thread_counts(options.get("INFERENCE_NUM_THREADS", 0))]
    hints = current_first(options.get("PERFORMANCE_HINT"), [None, "LATENCY", "THROUGHPUT"])
    knobs = [("PERFORMANCE_HINT", hints)] if objective == "throughput" else []
    knobs.append(("INFERENCE_NUM_THREADS", list(dict.fromkeys(threads))))
    if level != "fast":
        if objective != "throughput":
            knobs.append(("PERFORMANCE_HINT", hints))
        knobs.append(("NUM_STREAMS", current_first(options.get("NUM_STREAMS"), [None, 1, 2])))
    if memory_low(options):  # target.memory=low decides these
        knobs = [(name, values) for name, values in knobs if name not in MEMORY_LOW]
    return knobs


def with_options(settings: dict, changes: dict) -> dict:
    """Options set to None are left to OpenVINO (removed)."""
    options = {**settings.get("options", {}), **changes}
    settings["options"] = {key: value for key, value in options.items() if value is not None}
    return settings


def run_model(model, feeds: Dict[str, np.ndarray], count: int, outputs: List[str]) -> Dict[str, np.ndarray]:
    """An in-memory ONNX model (e.g. a mixed candidate of the sensitivity search) compiled
    for the CPU in f32 between its quantized ops, as a built int8 IR runs, and fed ``count``
    samples (packed: pipeline.data.pack) one at a time: what OpenVINO makes of exactly that
    Q/DQ placement."""
    import openvino as ov

    from pipeline.environment import own_threads

    core = ov.Core()
    compiled = core.compile_model(core.read_model(model.SerializeToString(), b""), "CPU",
                                  {"INFERENCE_PRECISION_HINT": "f32", "INFERENCE_NUM_THREADS": own_threads()})
    request = compiled.create_infer_request()
    ports = {name: _output_port(compiled, name) for name in outputs}
    from pipeline.data import unpack

    fixed = {port.get_any_name(): list(port.get_shape()) for port in compiled.inputs  # a scalar stays 0-d
             if port.get_partial_shape().is_static}
    rows = []
    for index in range(count):
        result = request.infer(unpack(feeds, index, count, fixed))
        rows.append({name: np.atleast_1d(np.array(result[port])) for name, port in ports.items()})
    return {name: np.concatenate([row[name] for row in rows]) for name in outputs}


def _output_port(compiled, name: str):
    for port in compiled.outputs:
        if name in port.get_names():
            return port
    raise KeyError(f"OpenVINO's compiled model has no output {name!r}")
