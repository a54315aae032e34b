"""MNN: the ``mnn_cpu``, ``mnn_opencl`` and ``mnn_vulkan`` targets (pip ``mnn``).

Conversion calls MNN's converter function ``_tools.mnnconvert([...])`` in-process: the
``mnnconvert`` console script and ``MNN.tools.mnnconvert.main()`` import a usage logger
that pip-installs a logging SDK and posts to the network, so nothing under ``MNN.tools``
is ever imported here. int8 uses MNN's own offline quantizer (``_tools.mnnquant``, the
``quantized.out`` tool) fed parity's calibration tensors as its "sequence" text input;
mixed is the same with the qtable's ONNX ops named in the quantizer's
``skip_quant_op_names`` (as the MNN ops they became), so that they stay float.

A session is an ``MNN.Interpreter`` session configured by ``runtime.yaml``'s options:

- ``forward_type``: MNNForwardType (CPU 0, OPENCL 3, VULKAN 7);
- ``precision``: BackendConfig precision (high 1, normal 0, low 2; fp32 -> high, fp16 -> low);
- CPU: ``numThread``; GPU: ``mode``, the MNNGpuMode bits (tuning NONE 1<<0, HEAVY 1<<1,
  WIDE 1<<2, NORMAL 1<<3, FAST 1<<4; memory BUFFER 1<<6, IMAGE 1<<7). ScheduleConfig
  keeps ``numThread`` and ``mode`` in one union, so the GPU mode travels as numThread;
- GPU: ``cache_file``, MNN's tuning cache (Interpreter.setCacheFile/updateCacheFile) kept
  in the bundle when the build machine has the GPU backend.

What really ran is read back, not assumed: the session's main backend type
(``getSessionInfo(BACKENDS)``; the pip wheel has only the CPU backend and silently runs
a GPU request on the CPU), the int8 kernels (MNN tags the ops it runs in int8
``"Convolution [ DT_INT8 ]"`` in its per-op callback) and, for low/normal precision, a
bitwise comparison with a precision=high session of the same model (identical outputs:
the device computed fp32; x86 CPUs have no fp16 arithmetic in MNN's CPU backend).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import multiprocessing
import os
import platform
import re
import shutil
import signal
import sys
import tempfile
import uuid
from collections import Counter
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from pipeline.backends.protocol import Capabilities

NAME = "mnn"
CAPABILITIES = Capabilities(
    precisions=("fp32", "fp16", "int8", "mixed"), devices=("CPU", "OPENCL", "VULKAN"),
    memory_modes=("auto", "buffer", "image"),
    runtime_precisions=("fp16",),  # a session setting (BackendConfig precision), built from the fp32 model
    own_int8=("int8", "mixed"),  # built by MNN's quantizer (build_int8); mixed: the qtable's ops skipped
    tuning=True, option_mapping=True, profiler=True)
GPU_DEVICES = CAPABILITIES.gpu_devices  # ("OPENCL", "VULKAN")

FORWARD_TYPES = {"CPU": 0, "OPENCL": 3, "VULKAN": 7}  # MNNForwardType
# getSessionInfo(BACKENDS) -> device; 13 is MNN_FORWARD_CPU_EXTENSION (the CPU backend with x86/ARM extensions)
BACKEND_NAMES = {0: "CPU", 1: "METAL", 2: "CUDA", 3: "OPENCL", 4: "AUTO", 5: "NN", 6: "OPENGL", 7: "VULKAN",
                 13: "CPU"}
GPU_TUNING = {"none": 1 << 0, "heavy": 1 << 1, "wide": 1 << 2, "normal": 1 << 3, "fast": 1 << 4}  # MNNGpuMode
GPU_MEMORY = {"auto": 0, "buffer": 1 << 6, "image": 1 << 7}
PRECISION_MODES = {"normal": 0, "high": 1, "low": 2}  # BackendConfig::PrecisionMode
# int8 and mixed: the precision of the float parts between int8 ops
DEFAULT_PRECISION = {"fp32": "high", "fp16": "low", "int8": "high", "mixed": "high"}
SESSION_INFO_BACKENDS = 2  # Interpreter::SessionInfoCode
CACHE_FILE = "tuning.cache"
TENSOR_MAP = "tensors.json"
MODEL = "model.mnn"
# Net.mnn_uuid: a random UUID the converter writes (a flatbuffer string: 4-byte length 36, text, NUL)
MODEL_UUID = re.compile(rb"\x24\x00\x00\x00([0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})\x00")

# parity's calibration methods -> MNN's feature_quantize_method (MNN offers KL, ADMM and EMA)
FEATURE_METHODS = {
    "kl": ("KL", "same method: KL divergence of the activation histogram (model inputs: max)"),
    "percentile": ("KL", "MNN has no percentile method; KL is the closest (it also clips the histogram's tail)"),
    "mse": ("ADMM", "MNN's ADMM minimizes the squared quantization error of each activation"),
    "max": ("EMA", "MNN has no plain max-range method; EMA (moving-average min/max ranges) is the closest"),
}
AUTO_CANDIDATES = ("KL", "ADMM", "EMA")
# measured (MNN 3.6.1, digits model): EMA quantizes the ops skip_quant_op_names names; KL and ADMM keep them float
IGNORES_SKIP = ("EMA",)
EVAL_SAMPLES = 8  # calibration samples the quantized candidates are compared on
QUANTIZE_TIMEOUT_S = 3600

_COMPUTE_OPS = {"Convolution", "ConvolutionDepthwise", "Deconvolution", "DeconvolutionDepthwise", "MatMul",
                "BatchMatMul", "ConvInt8", "DepthwiseConvInt8", "InnerProduct"}
_MNN_PASSTHROUGH = {"ConvertTensor", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity"}
_ONNX_PASSTHROUGH = {"Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity", "Dropout"}
_FLOAT_ELEM_TYPES = {1, 10, 11, 16}  # ONNX float, float16, double, bfloat16
_ONNX_COMPUTE = {"Conv", "ConvTranspose", "Gemm", "MatMul"}  # what MNN's compute ops stand for
MAX_FUSED = 6  # single-input ops between a fused MNN op's name and the ONNX op it computes


# ---------------------------------------------------------------- runtime imports


@contextlib.contextmanager
def _captured():
    """Point fd 1 and 2 at a temporary file while MNN's C++ code prints (its import, the
    converter and the quantizer write progress to stdout); yields a dict whose "text" holds
    what was printed once the block ends."""
    result = {"text": ""}
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    with tempfile.TemporaryFile() as sink:
        saved = (os.dup(1), os.dup(2))
        try:
            os.dup2(sink.fileno(), 1)
            os.dup2(sink.fileno(), 2)
            yield result
        finally:
            _flush_c_stdio()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
            sink.seek(0)
            result["text"] = sink.read().decode(errors="replace")


def _flush_c_stdio() -> None:
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None).fflush(None)


def _mnn():
    """The MNN module, imported quietly (it prints the CPU's features on import)."""
    if "MNN" not in sys.modules:
        with _captured():
            import MNN  # noqa: F401
    return sys.modules["MNN"]


def _tools():
    """MNN's converter/quantizer extension. Never MNN.tools: its modules phone home."""
    if "_tools" not in sys.modules:
        with _captured():
            import _tools  # noqa: F401
    return sys.modules["_tools"]


def available() -> Tuple[bool, str]:
    try:
        _mnn()
    except ImportError:
        return False, "MNN is not installed: pip install 'parity[mnn]'"
    except OSError as err:  # a wheel whose shared libraries cannot load
        return False, f"MNN cannot be loaded ({err}): pip install --force-reinstall 'parity[mnn]'"
    return True, ""


def versions() -> Dict[str, str]:
    return {"mnn": str(_mnn().version())}


# ---------------------------------------------------------------- configuration


def _value(field) -> Optional[str]:
    return None if field is None else str(getattr(field, "value", field))


def check_config(target, precision: str) -> Optional[str]:
    device = target.device.upper()
    memory, tuning = _value(target.memory_mode) or "auto", _value(target.tuning) or "none"
    if memory != "auto" and device not in GPU_DEVICES:
        return f"target.memory_mode={memory} needs an MNN GPU device (OPENCL or VULKAN)"
    if memory != "auto" and device == "VULKAN":
        return (f"target.memory_mode={memory}: MNN's Vulkan backend has no runtime memory mode (it is chosen when "
                "MNN is built, MNN_VULKAN_IMAGE); use target.memory_mode=auto")
    if tuning != "none" and device not in GPU_DEVICES:
        return f"target.tuning={tuning} needs an MNN GPU device (OPENCL or VULKAN)"
    if tuning in ("normal", "fast") and device == "VULKAN":
        return f"target.tuning={tuning} is OpenCL-only in MNN; MNN's Vulkan backend takes none, heavy or wide"
    if target.threads and device in GPU_DEVICES:
        return (f"target.threads={target.threads}: MNN GPU sessions carry the GPU mode where CPU sessions carry "
                "the thread count (ScheduleConfig union); use target.threads=0")
    asked = _value(getattr(target, "mnn_precision", None))
    if precision == "fp32" and asked == "low":
        return "target.mnn_precision=low computes in fp16 where the device can: precision=fp32 needs high or normal"
    if precision == "fp16" and asked == "high":
        return "target.mnn_precision=high computes in fp32: precision=fp16 needs low or normal"
    return None


def gpu_mode(tuning: str = "none", memory_mode: str = "auto") -> int:
    """ScheduleConfig.mode for MNN's GPU backends: one tuning bit, plus a memory bit
    (none for auto: MNN picks buffer or image itself)."""
    return GPU_TUNING[tuning] | GPU_MEMORY[memory_mode]


def session_options(target, precision: str) -> dict:
    """runtime.yaml options of a session for this target and parity precision."""
    device = target.device.upper()
    mnn_precision = _value(getattr(target, "mnn_precision", None)) or DEFAULT_PRECISION[precision]
    options = {"backend": device, "forward_type": FORWARD_TYPES[device], "precision": mnn_precision,
               "precision_mode": PRECISION_MODES[mnn_precision]}
    if device in GPU_DEVICES:
        tuning, memory = _value(target.tuning) or "none", _value(target.memory_mode) or "auto"
        options.update({"tuning": tuning, "memory_mode": memory, "mode": gpu_mode(tuning, memory),
                        "cache_file": CACHE_FILE})
    elif target.threads:
        options["numThread"] = int(target.threads)
    return options


def tuning_space(settings: dict, level: str, objective: str, devices: List[str]) -> List[Tuple[str, list]]:
    """CPU: the thread count. GPU: the kernel-tuning mode and (OpenCL) the memory mode,
    where the device exists: a memory mode can change numerics (MNN on AMD OpenCL in IMAGE
    mode), which the tune stage's re-verification catches."""
    from pipeline.tuning import current_first, thread_counts

    options = settings.get("options", {})
    device = str(options.get("backend", "CPU")).upper()
    if device not in GPU_DEVICES:
        return [("numThread", thread_counts(int(options.get("numThread", 0) or 0)))]
    modes = ["none", "fast", "normal", "heavy"] if device == "OPENCL" else ["none", "heavy", "wide"]
    knobs = [("tuning", current_first(options.get("tuning", "none"), modes[:2] if level == "fast" else modes))]
    if device == "OPENCL":
        knobs.append(("memory_mode", current_first(options.get("memory_mode", "auto"), ["auto", "buffer", "image"])))
    return knobs


def with_options(settings: dict, changes: dict) -> dict:
    """GPU modes are bits of one ScheduleConfig field: recompute it."""
    options = {**settings.get("options", {}), **changes}
    if "mode" in options:
        options["mode"] = gpu_mode(options.get("tuning", "none"), options.get("memory_mode", "auto"))
    if options.get("numThread") == 0:
        options.pop("numThread")
    if "memory_mode" in changes:
        settings["memory_mode"] = changes["memory_mode"]
    settings["options"] = options
    return settings


def schedule_config(options: dict, save_tensors: Sequence[str] = ()) -> dict:
    """The dict MNN.Interpreter.createSession takes (precision as an int: MNN prints a
    line for every session created with a precision string)."""
    config = {"backend": int(options.get("forward_type", 0)),
              "precision": int(options.get("precision_mode", PRECISION_MODES["high"]))}
    if "mode" in options:
        config["numThread"] = int(options["mode"])  # ScheduleConfig: union { numThread; mode; }
    elif options.get("numThread"):
        config["numThread"] = int(options["numThread"])
    if save_tensors:
        config["saveTensors"] = tuple(save_tensors)
    return config


# ---------------------------------------------------------------- build


def convert(onnx_path: Path, mnn_path: Path) -> str:
    """ONNX -> MNN with the converter function (no console script, no network). Converts
    in a scratch folder and moves the model into place; returns the converter's log."""
    with tempfile.TemporaryDirectory(prefix="parity-mnn-") as scratch:
        converted = Path(scratch) / MODEL
        tools = _tools()
        with _captured() as log:
            tools.mnnconvert(["mnnconvert", "-f", "ONNX", "--modelFile", str(onnx_path), "--MNNModel",
                              str(converted), "--bizCode", "parity"])
        if not converted.is_file() or converted.stat().st_size == 0:
            raise RuntimeError(f"MNN's converter wrote no model for {Path(onnx_path).name}: {_tail(log['text'])}")
        fix_model_uuid(converted)
        shutil.move(str(converted), str(mnn_path))
    return log["text"]


def fix_model_uuid(path: Path) -> None:
    """Replace the random model UUID MNN's converter writes by one derived from the rest of
    the file (same length), so that the same ONNX model gives the same bytes. Left alone
    unless exactly one UUID string is found."""
    data = Path(path).read_bytes()
    found = list(MODEL_UUID.finditer(data))
    if len(found) != 1:
        return
    start, end = found[0].span(1)
    digest = hashlib.sha256(data[:start] + data[end:]).digest()
    fixed = str(uuid.UUID(bytes=digest[:16], version=4)).encode()
    Path(path).write_bytes(data[:start] + fixed + data[end:])


def _tail(text: str, lines: int = 4) -> str:
    kept = [line.strip() for line in text.replace("\r", "\n").splitlines() if line.strip()]
    return " | ".join(kept[-lines:]) or "(no output)"


def build(onnx_path: Path, ir_dir: Optional[Path], out_dir: Path, target, precision: str) -> Tuple[List[str], dict]:
    out_dir = Path(out_dir)
    convert(Path(onnx_path), out_dir / MODEL)
    return _finish(Path(onnx_path), out_dir, target, precision, {})


def _finish(onnx_path: Path, out_dir: Path, target, precision: str, extra: dict,
            converted: Optional[Path] = None, feeds: Optional[Dict[str, np.ndarray]] = None) -> Tuple[List[str], dict]:
    """Options, the tensor map and (GPU) the tuning cache next to out_dir/model.mnn;
    ``converted``: the fp32 MNN model a quantized model.mnn was made from; ``feeds``: a
    sample to run it on, for the map of its compute ops to ONNX nodes (``ops``, which
    verify's read-back of the ops that ran int8 and float names them by)."""
    options = session_options(target, precision)
    found = tensor_map(onnx_path, out_dir / MODEL, converted)
    if feeds is not None:
        found["ops"] = onnx_ops(out_dir / MODEL, onnx_path, feeds)
    write_json(out_dir / TENSOR_MAP, found)
    options["tensor_map"] = TENSOR_MAP
    options.update(extra)
    files = [MODEL, TENSOR_MAP]
    if "cache_file" in options and _warm_cache(out_dir, options):
        files.append(CACHE_FILE)
    return files, {"model": MODEL, "options": options}


def write_json(path: Path, data) -> None:
    Path(path).write_text(json.dumps(data, indent=1, sort_keys=True))


def runtime_exists(device: str) -> bool:
    """Whether this MNN build has a runtime for the device (Interpreter.createRuntime
    answers per config; the pip wheel has the CPU only)."""
    mnn = _mnn()
    with _captured():
        _, exists = mnn.Interpreter.createRuntime([{"backend": FORWARD_TYPES[device]}])
    return bool(exists[0])


def _warm_cache(out_dir: Path, options: dict) -> bool:
    """GPU targets: load once on the GPU so that MNN writes its tuned kernels to the cache
    file kept in the bundle. Nothing to do where this MNN build has no such backend."""
    if not runtime_exists(options["backend"]):
        return False
    session = Session(out_dir / MODEL, options, artifact_dir=out_dir, persist_cache=True)
    session.run(session.example_feeds())
    del session
    return (out_dir / CACHE_FILE).is_file()


# ---------------------------------------------------------------- tensor names


def tensor_map(onnx_path: Path, mnn_path: Path, converted: Optional[Path] = None) -> dict:
    """Which ONNX tensors the MNN model holds, and which it does not faithfully.

    MNN's converter keeps ONNX tensor names, but a fused op writes its result under the
    names along its chain: with Gemm -> Relu fused, MNN's tensor "fc1_out" holds
    relu(fc1_out). Tensors of the MNN model that lead (through layout-only ops) to the
    same computing op form a group; within a group only the ONNX tensors of the latest
    ONNX op hold their own values. ``converted``: for a quantized model, the converter's
    fp32 model it was made from; the map is made on it and a quantized tensor is kept
    only where it is produced like its fp32 namesake (MNN's EMA quantizer rebuilds the
    graph and names tensors after ops: its "conv1_out" holds relu1_out's values)."""
    if converted is not None:
        return _restricted(tensor_map(onnx_path, converted), _mnn_graph(converted), _mnn_graph(mnn_path))
    import onnx

    model = onnx.load(str(onnx_path), load_external_data=False)
    producers, order = _onnx_producers(model.graph)
    shapes, types = _onnx_shapes(model)
    graph_mnn = _mnn_graph(mnn_path)
    groups: Dict[str, List[str]] = {}
    for name in producers:
        if name in graph_mnn and graph_mnn[name]["float"] and (types.get(name) or 1) in _FLOAT_ELEM_TYPES:
            groups.setdefault(_mnn_root(graph_mnn, name), []).append(name)
    faithful, fused = {}, {}
    for root, members in groups.items():
        roots = {name: _onnx_root(producers, name) for name in members}
        latest = max(roots.values(), key=lambda r: order.get(r, -1))
        for name in members:
            problem = _unfaithful(name, roots[name], latest, graph_mnn, root, shapes)
            if problem:
                fused[name] = problem
            else:
                faithful[name] = {"shape": shapes.get(name)}
    return {"format": 1, "faithful": faithful, "fused": fused,
            "mnn_tensors": sorted(name for name, info in graph_mnn.items() if info["activation"])}


def _onnx_producers(graph) -> Tuple[dict, Dict[str, int]]:
    """({tensor computed from the inputs: its producing node}, {tensor: the node's index})."""
    initializers = {t.name for t in graph.initializer}
    dynamic = {i.name for i in graph.input if i.name not in initializers}
    producers, order = {}, {}
    for index, node in enumerate(graph.node):
        if any(name in dynamic for name in node.input):
            for name in node.output:
                if name:
                    dynamic.add(name)
                    producers[name], order[name] = node, index
    return producers, order


def _onnx_shapes(model) -> Tuple[Dict[str, List[int]], Dict[str, int]]:
    """({tensor: static shape}, {tensor: ONNX element type}), shapes inferred where ONNX can."""
    from onnx import shape_inference

    graph = model.graph
    shapes, types = {}, {}
    try:
        inferred = shape_inference.infer_shapes(model)
        infos = list(inferred.graph.value_info) + list(inferred.graph.output) + list(inferred.graph.input)
    except Exception:  # noqa: BLE001 - shapes only refine the map
        infos = list(graph.value_info) + list(graph.output) + list(graph.input)
    for info in infos:
        tensor_type = info.type.tensor_type
        types[info.name] = tensor_type.elem_type
        dims = tensor_type.shape.dim
        if dims and all(d.HasField("dim_value") and d.dim_value > 0 for d in dims):
            shapes[info.name] = [int(d.dim_value) for d in dims]
    return shapes, types


def _onnx_root(producers: dict, name: str) -> str:
    """The tensor a chain of value-preserving ONNX ops (Reshape, Identity, ...) starts from."""
    seen = set()
    while name in producers and producers[name].op_type in _ONNX_PASSTHROUGH and name not in seen:
        seen.add(name)
        name = producers[name].input[0]
    return name


def _unfaithful(name: str, onnx_root: str, latest: str, graph_mnn: Dict[str, dict], root: str,
                shapes: Dict[str, List[int]]) -> Optional[str]:
    """Why MNN's tensor ``name`` does not hold the ONNX tensor's values, or None when it does."""
    if onnx_root != latest:
        return (f"MNN computes it in one op ({graph_mnn[root]['op']}) with {latest}: "
                f"the tensor holds {latest}'s values")
    mnn_size = graph_mnn[name]["size"]
    if name in shapes and mnn_size and int(np.prod(shapes[name])) != mnn_size:
        return f"MNN's tensor has {mnn_size} elements, ONNX's {int(np.prod(shapes[name]))}"
    return None


def _restricted(found: dict, before: Dict[str, dict], after: Dict[str, dict]) -> dict:
    faithful, fused = {}, dict(found["fused"])
    for name, info in found["faithful"].items():
        same = (name in after and after[name]["float"] and after[name]["size"] == before[name]["size"]
                and before[_mnn_root(before, name)]["op"] == after[_mnn_root(after, name)]["op"])
        if same:
            faithful[name] = info
        elif name in after:
            fused[name] = "the quantized model's tensor of this name is produced by a different op than the fp32 one"
    return {"format": 1, "faithful": faithful, "fused": fused,
            "mnn_tensors": sorted(name for name, info in after.items() if info["activation"])}


def _mnn_graph(mnn_path: Path) -> Dict[str, dict]:
    """The MNN model's tensors: producing op type, inputs, float or not, element count."""
    mnn = _mnn()
    found = {}
    with _captured():  # MNN prints a line for every tensor whose shape depends on the inputs
        variables = mnn.expr.load_as_dict(str(mnn_path))
        for name, var in variables.items():
            try:
                op = var.op_type
                inputs = [v.name for v in var.inputs]
                is_float = var.dtype == mnn.expr.dtype.float
                shape = list(var.shape)
            except Exception:  # noqa: BLE001 - a variable MNN cannot describe is left out
                continue
            size = int(np.prod(shape)) if shape and all(isinstance(d, int) and d > 0 for d in shape) else None
            found[name] = {"op": op, "inputs": inputs, "float": bool(is_float), "size": size,
                           "activation": bool(is_float) and op not in ("Const", "Input")}
    return found


def _mnn_root(graph: Dict[str, dict], name: str) -> str:
    seen = set()
    while name in graph and graph[name]["op"] in _MNN_PASSTHROUGH and graph[name]["inputs"] and name not in seen:
        seen.add(name)
        name = graph[name]["inputs"][0]
    return name


# ---------------------------------------------------------------- int8


def build_int8(onnx_path: Path, out_dir: Path, target, calibration: List[Dict[str, np.ndarray]],
               method: str, float_ops: Sequence[str] = ()) -> Tuple[List[str], dict]:
    """int8 with MNN's offline quantizer: symmetric int8 weights per channel (MAX_ABS),
    activations per tensor with MNN's feature_quantize_method mapped from parity's method
    (``FEATURE_METHODS``; auto quantizes with KL, ADMM and EMA and keeps the model whose
    outputs agree best with the fp32 MNN model on the first calibration samples).
    ``float_ops`` (precision=mixed): ONNX nodes kept float, given to the quantizer as
    ``skip_quant_op_names``; a candidate that still ran one of them in int8 is refused."""
    if not calibration:
        raise ValueError("MNN's quantizer needs calibration samples")
    out_dir = Path(out_dir)
    with tempfile.TemporaryDirectory(prefix="parity-mnn-int8-") as scratch:
        scratch = Path(scratch)
        fp32 = scratch / "fp32.mnn"
        convert(Path(onnx_path), fp32)
        samples_dir = write_samples(calibration, scratch / "samples")
        skip, unmapped = skipped_ops(onnx_ops(fp32, Path(onnx_path), calibration[0]), float_ops)
        candidates, reason = _candidates(method, _has_batchnorm(fp32), bool(skip))
        eval_feeds = calibration[:EVAL_SAMPLES]
        reference = _outputs_of(fp32, eval_feeds)
        scores, failures = {}, {}
        for candidate in candidates:
            path = scratch / f"int8_{candidate}.mnn"
            write_json(scratch / f"{candidate}.json", quantizer_config(samples_dir, calibration, candidate, skip))
            try:
                quantize(fp32, path, scratch / f"{candidate}.json")
                _check_skipped(path, skip, calibration[0])
            except RuntimeError as err:
                failures[candidate] = str(err)
                continue
            scores[candidate] = _cosine(reference, _outputs_of(path, eval_feeds))
        if not scores:
            raise RuntimeError("; ".join(f"{m}: {e}" for m, e in failures.items()))
        chosen = max(scores, key=lambda m: scores[m])
        shutil.move(str(scratch / f"int8_{chosen}.mnn"), str(out_dir / MODEL))
        quantization = {"tool": "MNN offline quantization (_tools.mnnquant, the quantized.out tool)",
                        "method": method, "feature_quantize_method": chosen,
                        "mapping": reason, "weight_quantize_method": "MAX_ABS",
                        "weights": "int8 symmetric, per channel", "activations": "int8 symmetric, per tensor",
                        "samples": len(calibration), "input_type": "sequence (parity's calibration tensors as text)",
                        "output_cosine_vs_fp32": {m: round(s, 6) for m, s in scores.items()},
                        "cosine_samples": len(eval_feeds)}
        if float_ops:
            quantization.update({"float_ops": list(float_ops), "skip_quant_op_names": skip,
                                 "float_ops_not_in_mnn": unmapped})
        if failures:
            quantization["failed"] = failures
        return _finish(Path(onnx_path), out_dir, target, "int8", {"quantization": quantization}, converted=fp32,
                       feeds=calibration[0])


def _candidates(method: str, has_batchnorm: bool, skipping: bool) -> Tuple[List[str], str]:
    """MNN's feature methods to quantize with, and why."""
    if method == "auto":
        candidates = list(AUTO_CANDIDATES)
        reason = "auto: each of MNN's methods quantized the model; kept the best output cosine vs fp32"
    else:
        mapped, reason = FEATURE_METHODS[method]
        candidates = [mapped]
    if has_batchnorm:  # MNN's quantizer switches to EMA itself
        candidates = ["EMA"]
        reason += "; the converted model keeps BatchNorm ops, for which MNN's quantizer always uses EMA"
    if skipping:
        kept = [c for c in candidates if c not in IGNORES_SKIP]
        if not kept:
            from pipeline.errors import ConfigError

            fix = ("the model keeps BatchNorm ops, which force EMA: use precision=int8" if has_batchnorm
                   else "use calibration.method=kl, percentile, mse or auto")
            raise ConfigError(f"precision=mixed on MNN: its EMA quantizer ignores skip_quant_op_names and cannot keep "
                              f"the qtable's ops float ({fix})")
        if kept != candidates:
            reason += "; mixed: EMA left out (it ignores skip_quant_op_names)"
        candidates = kept
    return candidates, reason


def onnx_ops(mnn_path: Path, onnx_path: Path, feeds: Dict[str, np.ndarray]) -> Dict[str, str]:
    """{MNN op name: ONNX node} for the compute ops of an MNN model, run once on ``feeds``
    (op names exist only in a session), mapped as the per-op profile maps them."""
    from pipeline import profiling

    nodes = profiling.Nodes.load(onnx_path)
    found = {}
    for name, op_type, _ in op_census(mnn_path, feeds):
        if op_type in _COMPUTE_OPS:
            node = nodes.layer(name, op_type, None, 0.0, _mnn_candidates(name, op_type))["onnx_node"]
            if node is not None:
                found[name] = _computing(nodes, node)
    return found


def _computing(nodes, node: str) -> str:
    """The Conv/Gemm/MatMul upstream of a node through single-input ops: MNN runs a MatMul
    and the bias Add after it as one Convolution named after the Add (PP-OCR's classifier)."""
    current = node
    for _ in range(MAX_FUSED):
        if nodes.types.get(current) in _ONNX_COMPUTE:
            return current
        inputs = nodes.inputs.get(current, [])
        current = nodes.producers.get(inputs[0]) if len(inputs) == 1 else None
        if current is None:
            break
    return node


def skipped_ops(ops: Dict[str, str], float_ops: Sequence[str]) -> Tuple[List[str], List[str]]:
    """(the MNN ops computing the ONNX nodes in ``float_ops``: skip_quant_op_names, the
    nodes no MNN op computes)."""
    wanted = set(float_ops)
    skip = sorted(name for name, node in ops.items() if node in wanted)
    mapped = set(ops.values())
    return skip, [node for node in float_ops if node not in mapped]


def _check_skipped(mnn_path: Path, skip: List[str], feeds: Dict[str, np.ndarray]) -> None:
    """The quantized model runs every skipped op in float (read back from MNN's per-op tags)."""
    if not skip:
        return
    still = sorted({name for name, _, int8 in op_census(mnn_path, feeds) if int8 and name in skip})
    if still:
        raise RuntimeError(f"MNN's quantizer ignored skip_quant_op_names: {', '.join(still)} ran in int8")


def write_samples(calibration: List[Dict[str, np.ndarray]], folder: Path) -> Path:
    """One folder per sample with ``<input>.txt`` (the values, C order, one row per last
    axis) and ``input.json`` (the shapes): MNN's quantizer input_type "sequence"."""
    folder.mkdir(parents=True)
    for index, feeds in enumerate(calibration):
        sample = folder / f"{index:06d}"
        sample.mkdir()
        shapes = []
        for name, value in feeds.items():
            if "/" in name or os.sep in name or name in ("", ".", ".."):
                raise ValueError(f"input {name!r}: MNN's quantizer reads <input>.txt files and cannot take this name")
            array = np.asarray(value, dtype=np.float32)
            rows = array.reshape(-1, array.shape[-1]) if array.ndim > 1 else array.reshape(1, -1)
            np.savetxt(sample / f"{name}.txt", rows, fmt="%.9g")
            shapes.append({"name": name, "shape": [int(d) for d in array.shape]})
        write_json(sample / "input.json", {"inputs": shapes})
    return folder


def quantizer_config(samples_dir: Path, calibration: List[Dict[str, np.ndarray]], feature_method: str,
                     skip: Sequence[str] = ()) -> dict:
    """MNN's quantizer config (tools/quantization calibration.cpp reads these keys);
    ``skip``: MNN op names left float (skip_quant_op_names, matched against the op names
    of a session of the fp32 model)."""
    first = calibration[0]
    return {"path": str(samples_dir), "used_sample_num": len(calibration), "skip_quant_op_names": list(skip),
            "feature_quantize_method": feature_method, "weight_quantize_method": "MAX_ABS",
            "feature_clamp_value": 127, "weight_clamp_value": 127, "quant_bits": 8,
            "batch_size": 1,  # the sequence reader fills one sample per batch
            "input_type": "sequence",
            "inputs": [{"name": name, "shape": [int(d) for d in np.shape(value)]} for name, value in first.items()]}


def quantize(src: Path, dst: Path, config: Path, timeout_s: float = QUANTIZE_TIMEOUT_S) -> None:
    """Run MNN's quantizer in a spawned child process: it can crash, it leaves callbacks on
    MNN's global executor, and it segfaults at interpreter exit after a successful run
    (the child leaves with os._exit)."""
    log = Path(dst).with_suffix(".log")
    context = multiprocessing.get_context("spawn")
    child = context.Process(target=_quantize_child, args=(str(src), str(dst), str(config), str(log)), daemon=True)
    child.start()
    child.join(timeout_s)
    if child.is_alive():
        child.kill()
        child.join()
        raise RuntimeError(f"MNN's quantizer did not finish in {timeout_s:g} s")
    text = log.read_text(errors="replace") if log.exists() else ""
    if child.exitcode != 0 or not Path(dst).is_file() or Path(dst).stat().st_size == 0:
        how = (f"signal {signal.Signals(-child.exitcode).name}" if child.exitcode and child.exitcode < 0
               else f"exit {child.exitcode}")
        raise RuntimeError(f"MNN's quantizer failed ({how}): {_tail(text)}")


def _quantize_child(src: str, dst: str, config: str, log: str) -> None:
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    import _tools

    _tools.mnnquant(["mnnquant", src, dst, config])
    _flush_c_stdio()
    os._exit(0 if os.path.isfile(dst) else 3)


def _has_batchnorm(mnn_path: Path) -> bool:
    return any(info["op"] == "BatchNorm" for info in _mnn_graph(mnn_path).values())


def op_census(mnn_path: Path, feeds: Dict[str, np.ndarray]) -> List[Tuple[str, str, bool]]:
    """(op name, type, ran in int8) of every op a CPU session of the model runs."""
    session = Session(mnn_path, {"backend": "CPU", "forward_type": 0, "precision_mode": PRECISION_MODES["high"]})
    return session._op_census(feeds)


def _outputs_of(mnn_path: Path, feeds_list: List[Dict[str, np.ndarray]]) -> List[np.ndarray]:
    session = Session(mnn_path, {"backend": "CPU", "forward_type": 0, "precision_mode": PRECISION_MODES["high"]})
    return [np.concatenate([v.ravel() for v in session.run(feeds).values()]) for feeds in feeds_list]


def _cosine(reference: List[np.ndarray], actual: List[np.ndarray]) -> float:
    ref = np.concatenate(reference).astype(np.float64)
    out = np.concatenate(actual).astype(np.float64)
    if not np.isfinite(out).all():
        return float("-inf")
    denominator = float(np.linalg.norm(ref) * np.linalg.norm(out))
    return float(ref @ out / denominator) if denominator else (1.0 if not ref.any() and not out.any() else 0.0)


# ---------------------------------------------------------------- sessions


class Session:
    def __init__(self, model_path: Path, options: dict, inputs: Optional[List[dict]] = None,
                 outputs: Optional[List[dict]] = None, artifact_dir: Optional[Path] = None,
                 persist_cache: bool = False):
        mnn = self._mnn = _mnn()
        self._model_path = Path(model_path)
        self._options = dict(options)
        self._artifact_dir = Path(artifact_dir) if artifact_dir else self._model_path.parent
        self._scratch = tempfile.TemporaryDirectory(prefix="parity-mnn-")
        self._interpreter = mnn.Interpreter(str(self._model_path))
        self._cache = None
        if self._options.get("cache_file"):
            # the bundle's tuning cache is read from a scratch copy, so that a run never rewrites the bundle
            bundled = self._artifact_dir / self._options["cache_file"]
            self._cache = bundled if persist_cache else Path(self._scratch.name) / self._options["cache_file"]
            if not persist_cache and bundled.is_file():
                shutil.copyfile(bundled, self._cache)
            if self._cache.is_file():
                self._interpreter.setCacheFile(str(self._cache))
            else:
                with _captured():  # MNN complains that the (new) cache file cannot be read
                    self._interpreter.setCacheFile(str(self._cache))
        self._session = self._interpreter.createSession(schedule_config(self._options))
        self._cache_pending = self._cache is not None
        self._probe = None
        self._last_feeds: Optional[Dict[str, np.ndarray]] = None
        self._effective: Optional[dict] = None
        have_inputs = self._interpreter.getSessionInputAll(self._session)
        have_outputs = self._interpreter.getSessionOutputAll(self._session)
        self._input_specs = {spec["name"]: spec for spec in inputs or []}
        self._output_specs = {spec["name"]: spec for spec in outputs or []}
        self.inputs = [n for n in self._input_specs if n in have_inputs] or sorted(have_inputs)
        wanted = list(self._output_specs) or sorted(have_outputs)
        missing = [name for name in wanted if name not in have_outputs]
        if missing:
            raise RuntimeError(f"the MNN model has no output {missing[0]!r}; its outputs: {', '.join(have_outputs)}")
        self.outputs = wanted
        self._tensor_map = None
        map_name = self._options.get("tensor_map")
        if map_name and (self._artifact_dir / map_name).is_file():
            self._tensor_map = json.loads((self._artifact_dir / map_name).read_text())

    # -- running

    def run(self, feeds: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
        self._execute(self._session, feeds)
        self._last_feeds = feeds
        if self._cache_pending:
            self._interpreter.updateCacheFile(self._session, 0)
            self._cache_pending = False
        return {name: self._read(self._session, name, self._onnx_shape(name)) for name in self.outputs}

    def _execute(self, session, feeds: Dict[str, np.ndarray]) -> None:
        self._set_inputs(session, feeds)
        code = self._interpreter.runSession(session)
        if code != 0:
            raise RuntimeError(f"MNN runSession returned error code {code}")

    def _set_inputs(self, session, feeds: Dict[str, np.ndarray]) -> None:
        """Copy the feeds into the session's inputs, resizing the session first when a
        shape differs from the one it was prepared for."""
        mnn = self._mnn
        unknown = [name for name in feeds if name not in self.inputs]
        missing = [name for name in self.inputs if name not in feeds]
        if unknown or missing:  # MNN would run on whatever an unfed input last held
            raise ValueError(f"feeds must be exactly the model's inputs ({', '.join(self.inputs)}); "
                             f"unknown: {unknown}, missing: {missing}")
        tensors = {name: self._interpreter.getSessionInput(session, name) for name in feeds}
        resized = False
        for name, value in feeds.items():
            if tuple(tensors[name].getShape()) != tuple(np.shape(value)):
                self._interpreter.resizeTensor(tensors[name], tuple(int(d) for d in np.shape(value)))
                resized = True
        if resized:
            self._interpreter.resizeSession(session)
        for name, value in feeds.items():
            tensor = tensors[name]
            halide, dtype = self._types(tensor)
            array = np.ascontiguousarray(value, dtype=dtype)
            tensor.copyFrom(mnn.Tensor(tuple(array.shape), halide, array, mnn.Tensor_DimensionType_Caffe))

    def _types(self, tensor):
        mnn = self._mnn
        kind = tensor.getDataType()
        for halide, dtype in ((mnn.Halide_Type_Float, np.float32), (mnn.Halide_Type_Int, np.int32),
                              (mnn.Halide_Type_Int64, np.int64), (mnn.Halide_Type_Uint8, np.uint8),
                              (mnn.Halide_Type_Double, np.float64)):
            if kind == halide:
                return halide, dtype
        return mnn.Halide_Type_Float, np.float32

    def _read(self, session, name: str, shape: Optional[List[int]]) -> np.ndarray:
        """A session tensor as a host float32 array (MNN may hold NC4HW4 internally: the
        copy to a host tensor converts it to NCHW), in the ONNX shape when it is known."""
        mnn = self._mnn
        tensor = self._interpreter.getSessionOutput(session, name)
        dims = tuple(int(d) for d in tensor.getShape()) or (1,)
        halide, dtype = self._types(tensor)
        layout = (mnn.Tensor_DimensionType_Tensorflow
                  if tensor.getDimensionType() == mnn.Tensor_DimensionType_Tensorflow
                  else mnn.Tensor_DimensionType_Caffe)
        host = mnn.Tensor(dims, halide, np.zeros(dims, dtype=dtype), layout)
        tensor.copyToHostTensor(host)
        array = np.array(host.getNumpyData(), dtype=np.float32).reshape(dims)
        if shape and int(np.prod(shape)) == array.size:
            array = array.reshape(shape)
        return array

    def _onnx_shape(self, name: str) -> Optional[List[int]]:
        spec = self._output_specs.get(name, {})
        shape = spec.get("shape")
        if shape and all(isinstance(d, int) and d > 0 for d in shape):
            return list(shape)
        return None

    def example_feeds(self) -> Dict[str, np.ndarray]:
        """Seeded random inputs in the session's current input shapes."""
        rng = np.random.default_rng(0)
        feeds = {}
        for name in self.inputs:
            tensor = self._interpreter.getSessionInput(self._session, name)
            spec = self._input_specs.get(name, {})
            shape = [d if isinstance(d, int) and d > 0 else 1 for d in (spec.get("shape") or tensor.getShape())]
            _, dtype = self._types(tensor)
            value = rng.standard_normal(shape) if np.issubdtype(dtype, np.floating) else np.zeros(shape)
            feeds[name] = value.astype(dtype)
        return feeds

    # -- layerwise

    def probe(self, names: List[str]) -> dict:
        """Expose these ONNX tensors: a second session of the same model and config with
        them as ``saveTensors`` (kept from memory reuse, readable by name). Only tensors
        the build's tensor map calls faithful are exposed (fused ones hold another
        tensor's values); without a map, only tensors alone in their MNN op's group."""
        graph = _mnn_graph(self._model_path)
        if self._tensor_map is not None:
            faithful = self._tensor_map.get("faithful", {})
        else:
            groups = Counter(_mnn_root(graph, name) for name in graph if graph[name]["activation"])
            faithful = {name: {"shape": None} for name in graph
                        if graph[name]["activation"] and groups[_mnn_root(graph, name)] == 1}
        exposed = [name for name in names if name in faithful and name in graph and graph[name]["float"]]
        self._probe = None
        if exposed:
            session = self._interpreter.createSession(schedule_config(self._options, exposed))
            self._probe = (session, {name: (faithful[name] or {}).get("shape") for name in exposed})
        tensors = sorted(name for name, info in graph.items() if info["activation"])
        return {"exposed": exposed, "tensors": tensors}

    def run_probe(self, feeds: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
        if self._probe is None:
            return {}
        session, shapes = self._probe
        self._execute(session, feeds)
        return {name: self._read(session, name, shape) for name, shape in shapes.items()}

    # -- profile

    def profile(self, feeds: Dict[str, np.ndarray], runs: int, warmup: int = 1,
                nodes: Optional[dict] = None, budget_s: Optional[float] = None) -> dict:
        """Per-op times from MNN's per-op callbacks (runSessionWithCallBackInfo) on a second
        session of the same model and config: the wall time between an op's before and after
        callback, which includes a few microseconds of Python callback overhead per op.
        ``nodes``: the converted model's index (pipeline.profiling.Nodes.to_json());
        ``budget_s``: stop early (after one counted run at least) once it is spent."""
        import time

        from pipeline import profiling

        session = self._interpreter.createSession(schedule_config(self._options))
        timer, started, wall = profiling.Timer(), [0.0], 0.0
        counting = [False]

        def before(tensors, info):
            started[0] = time.perf_counter()
            return True

        def after(tensors, info):
            elapsed = (time.perf_counter() - started[0]) * 1000.0
            if counting[0]:
                kind = str(info.getType())
                timer.add(info.getName(), elapsed, kind.split(" [", 1)[0].strip(),
                          "DT_INT8" if "DT_INT8" in kind else None)
            return True

        plan = profiling.Runs(runs, warmup, budget_s)
        for counted in plan:
            counting[0] = counted
            self._set_inputs(session, feeds)
            begun = time.perf_counter()
            code = self._interpreter.runSessionWithCallBackInfo(session, before, after)
            wall += (time.perf_counter() - begun) if counting[0] else 0.0
            if code != 0:
                raise RuntimeError(f"MNN runSessionWithCallBackInfo returned error code {code}")
        runs = plan.counted
        layers = timer.layers(profiling.Nodes(nodes), runs, lambda name: _mnn_candidates(name, timer.info[name][0]))
        kind = int(self._interpreter.getSessionInfo(session, SESSION_INFO_BACKENDS))
        return profiling.result("MNN per-op callbacks (runSessionWithCallBackInfo): wall time between each op's "
                                "callbacks, Python callback overhead included; whole run: the callback run",
                                runs, warmup, layers, wall * 1000.0 / runs,
                                {"device": BACKEND_NAMES.get(kind, f"type {kind}")}, plan.note())

    # -- what ran

    def backend_type(self) -> int:
        return int(self._interpreter.getSessionInfo(self._session, SESSION_INFO_BACKENDS))

    def effective(self) -> Dict[str, str]:
        if self._effective is None:
            self._effective = self._measure()
        return dict(self._effective)

    def _measure(self) -> dict:
        kind = self.backend_type()
        device = BACKEND_NAMES.get(kind, f"type {kind}")
        feeds = self._last_feeds if self._last_feeds is not None else self.example_feeds()
        ops = self._op_census(feeds)
        mode = self._options.get("precision", "high")
        float_precision, float_note = "fp32", ""
        if mode != "high":
            float_precision, float_note = self._float_precision(feeds, mode, device)
        counts, int8_ops, float_ops = Counter(), [], {}
        onnx_of = (self._tensor_map or {}).get("ops", {})  # quantized builds: MNN op -> ONNX node
        for name, op_type, int8 in ops:
            if op_type in _COMPUTE_OPS:
                counts["int8" if int8 else float_precision] += 1
                if int8:
                    int8_ops.append(onnx_of.get(name, name))
                else:
                    float_ops[onnx_of.get(name, name)] = op_type
        if counts:
            precision = "mixed" if "int8" in counts and len(counts) > 1 else counts.most_common(1)[0][0]
        else:
            precision = float_precision
        result = {"device": device, "precision": precision,
                  "layers": ", ".join(f"{k}: {v}" for k, v in sorted(counts.items()))}
        if counts["int8"]:  # the compute ops by what they ran, named as the ONNX nodes they compute
            result.update({"int8_ops": int8_ops, "float_ops": float_ops})
        notes = [note for note in (fallback_reason(self), float_note) if note]
        if notes:
            result["note"] = "; ".join(notes)
        return result

    def _op_census(self, feeds) -> List[Tuple[str, str, bool]]:
        """(op name, op type, ran in int8) of every op the session executes, from MNN's per-op
        callback; MNN names the type of an op run in int8 e.g. "Convolution [ DT_INT8 ]"."""
        ops: List[Tuple[str, str, bool]] = []

        def after(tensors, info):
            kind = str(info.getType())
            ops.append((str(info.getName()), kind.split(" [", 1)[0].strip(), "DT_INT8" in kind))
            return True

        self._set_inputs(self._session, feeds)
        code = self._interpreter.runSessionWithCallBackInfo(self._session, lambda tensors, info: True, after)
        if code != 0:
            raise RuntimeError(f"MNN runSessionWithCallBackInfo returned error code {code}")
        return ops

    def _float_precision(self, feeds, mode: str, device: str) -> Tuple[str, str]:
        """low/normal: MNN computes fp16 only where the device has fp16 arithmetic. Same
        model, same inputs, precision=high: bit-identical outputs mean fp32 ran."""
        ours = [self._read(self._session, name, None) for name in self.outputs]
        high_options = {**self._options, "precision_mode": PRECISION_MODES["high"]}
        session = self._interpreter.createSession(schedule_config(high_options))
        self._execute(session, feeds)
        theirs = [self._read(session, name, None) for name in self.outputs]
        if all(np.array_equal(a, b, equal_nan=True) for a, b in zip(ours, theirs)):
            where = (f"this {platform.machine()} CPU computed fp32 (MNN's CPU backend has fp16 arithmetic only on "
                     "ARMv8.2+ CPUs)" if device == "CPU" else f"the {device} device computed fp32")
            return "fp32", (f"precision={mode} requested; outputs are bit-identical to a precision=high session: "
                            f"{where}")
        return "fp16", f"precision={mode}: outputs differ from a precision=high session of the same model"


_MNN_INSERTED = {"Raster", "FloatToInt8", "Int8ToFloat", "ConvertTensor"}  # layout and int8 conversions


def _mnn_candidates(name: str, op_type: str) -> List[str]:
    """ONNX names an MNN op stands for: MNN names ops after their output tensor, adds
    ``_raster_N`` to the layout and int8 conversions it inserts before an op (and to some ops
    it splits, e.g. GlobalAveragePool's Pooling) and ``__matmul_converted`` to a Gemm it
    rewrote as a Convolution."""
    if op_type in _MNN_INSERTED:
        return []
    return [re.sub(r"(_raster_\d+|__matmul_converted)+$", "", name)]


def fallback_reason(session: Session) -> str:
    """Why the session does not run on the requested device ("" when it does)."""
    requested = session._options.get("backend", "CPU")
    ran = BACKEND_NAMES.get(session.backend_type(), "?")
    if ran == requested:
        return ""
    if requested in FORWARD_TYPES and not runtime_exists(requested):
        return (f"this MNN build ({_mnn().version()}) has no {requested} backend (Interpreter.createRuntime finds "
                f"no {requested} runtime): MNN ran the session on the {ran}")
    return f"{requested} was requested but MNN's session runs on the {ran}"


def load(artifact_dir: Path, settings: dict) -> Session:
    options = dict(settings.get("options") or {})
    if "forward_type" not in options:  # settings written by hand: the device decides
        device = str(settings.get("device", "CPU")).upper()
        options.update({"backend": device, "forward_type": FORWARD_TYPES.get(device, 0)})
    return Session(Path(artifact_dir) / settings["model"], options, settings.get("inputs"), settings.get("outputs"),
                   artifact_dir=Path(artifact_dir))
