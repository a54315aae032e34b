"""ncnn's declarations (capabilities, files, feature mask bits, limits), whether ncnn and
pnnx are installed, the target checks and the runtime options a target gets."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import os
import platform
import sys
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np

from pipeline import shapes
from pipeline.errors import BackendUnavailable, ConfigError
from pipeline.backends.protocol import MEMORY_OPTION, Capabilities, memory_mode
from pipeline.precision import kinds


NAME = "ncnn"


def wait_passively() -> None:
    """libgomp's idle threads (ncnn's wheel uses libgomp) wait passively in this process and
    the processes it starts, unless the user chose a policy. A parity job runs ncnn workers
    side by side (verify's target and its fp32 baseline), and spinning threads on 2 cores
    then took 220-340 ms an inference instead of 0.3-0.4 ms, an int8 verify 65 s instead of 6.
    libgomp reads it when ncnn is first imported. A bundle served alone (parity-bundle, the
    bundle loader) keeps libgomp's default: a MobileNetV3's ncnn fp32 build ran 1.55 ms a
    call with it, 10.8 ms passively."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

VULKAN_DEVICE_TYPES = {0: "discrete GPU", 1: "integrated GPU", 2: "virtual GPU", 3: "CPU"}
NO_VULKAN_DEVICE = "no Vulkan device: install libvulkan1 and a driver such as mesa-vulkan-drivers"
PRECISIONS = ("fp32", "fp16", "bf16", "int8", "mixed")
RUNTIME_PRECISIONS = ("fp16", "bf16")  # runtime switches: build gets the fp32 ONNX model
QUANTIZED_PRECISIONS = tuple(filter(kinds.quantized, PRECISIONS))  # build gets parity's Q/DQ model (int8.py)
MEMORY_MODES = ("auto",)
X86_MACHINES = ("x86_64", "amd64", "i386", "i686", "x86")
DEVICES = ("CPU", "VULKAN")
CAPABILITIES = Capabilities(
    precisions=PRECISIONS, devices=DEVICES, memory_modes=MEMORY_MODES, runtime_precisions=RUNTIME_PRECISIONS,
    feature_masks=True, tuning=True, option_mapping=True, profiler=True, float_op_kinds=True, traces_at_shapes=True,
    device_identity=True, auto_candidates=("fp32", "fp16", "int8"))

PARAM_FILE, BIN_FILE = "model.param", "model.bin"
INSTALL_HINT = "pip install 'parity[ncnn]' (ncnn + pnnx)"

# ncnn layer feature mask bits (layer param 31, read as Layer::featmask in Net::load_param);
# what each bit turns off for that layer, from get_masked_option() in ncnn's src/net.cpp.
MASK_BITS = {
    "no_fp16_arithmetic": 1,  # use_fp16_arithmetic
    "no_fp16_storage": 2,  # use_fp16_storage and use_fp16_packed
    "no_bf16_storage": 4,  # use_bf16_storage and use_bf16_packed
    "no_int8": 8,  # use_int8_storage, use_int8_packed and use_int8_arithmetic
    "no_vulkan": 16,  # use_vulkan_compute (and use_tensor_storage): the layer runs on the CPU
    "no_sgemm": 32,  # use_sgemm_convolution
    "no_winograd": 64,  # use_winograd_convolution
    "no_threading": 128,  # num_threads = 1
}
FEATMASK_PARAM = 31

MATCH_TOLERANCE = 1e-3  # relative L2 error under which an ncnn blob reproduces an ONNX tensor
MATCH_SAMPLE = 8192  # positions per tensor compared by the name mapping
MATCH_RUNS = 3  # random inputs the name mapping compares on
PNNX_TIMEOUT_S = 600
MAP_TIMEOUT_S = 600
_NOT_COMPUTE = ("Input", "MemoryData")
_ALIAS_LAYERS = ("Split",)  # outputs are copies of the input blob
log = logging.getLogger("parity")

_PNNX_TYPES = {"float32": "f32", "float64": "f64", "float16": "f16", "uint8": "u8", "int8": "i8",
               "int32": "i32", "int64": "i64", "bool": "u8"}


# ----------------------------------------------------------------------------- protocol


def available() -> Tuple[bool, str]:
    try:
        import ncnn  # noqa: F401
    except ImportError:
        return False, f"ncnn is not installed: {INSTALL_HINT}"
    if pnnx_executable() is None:
        return False, f"ncnn is not installed: {INSTALL_HINT}"
    return True, ""


def versions() -> Dict[str, str]:
    import ncnn

    found = {"ncnn": getattr(ncnn, "__version__", "unknown")}
    try:
        found["pnnx"] = importlib.metadata.version("pnnx")
    except importlib.metadata.PackageNotFoundError:
        found["pnnx"] = "not installed"
    return found


def check_config(target, precision: str) -> Optional[str]:
    device = str(target.device).upper()
    fp16, bf16 = _halves(precision)
    if bf16 and device != "CPU":
        return "precision=bf16 on ncnn is CPU-only (bf16 storage); use target=ncnn_cpu"
    if precision in QUANTIZED_PRECISIONS and device == "VULKAN":
        from pipeline.backends.ncnn.int8_format import vulkan_int8_problem

        problem = vulkan_int8_problem(versions()["ncnn"])
        if problem:
            return problem
    switches = target.ncnn
    if switches.device_index < 0:
        return f"target.ncnn.device_index={switches.device_index}: must be >= 0"
    if fp16 and not (switches.fp16_storage or switches.fp16_packed or switches.fp16_arithmetic):
        return ("precision=fp16 with target.ncnn.fp16_storage, fp16_packed and fp16_arithmetic all false runs fp32; "
                "turn one on or use precision=fp32")
    return None


def _halves(precision: str) -> Tuple[bool, bool]:
    """(fp16, bf16): ncnn's two 16-bit floats, fp16 (storage, packed and arithmetic switches)
    and bf16 (storage only, on the CPU), told apart by fp16's narrow range."""
    return kinds.narrow(precision), kinds.half(precision) and not kinds.narrow(precision)


def float_op_kinds(target) -> List[str]:
    """Depthwise convolutions stay float in int8 builds where target.ncnn.int8_depthwise says
    so; null: on an x86 CPU, whose ncnn int8 depthwise kernel is a 128-bit SSE loop against
    an AVX/AVX-512 fp32 one (PP-OCR classifier: depthwise layers 0.34 ms fp32, 0.65 ms int8;
    docs/targets.md "ncnn int8")."""
    asked = target.ncnn.int8_depthwise
    if asked is None:
        asked = not (str(target.device).upper() == "CPU" and platform.machine().lower() in X86_MACHINES)
    return [] if asked else ["depthwise"]


def pnnx_executable() -> Optional[Path]:
    """The pnnx binary inside the pnnx wheel (found without importing pnnx, which imports torch)."""
    try:
        spec = importlib.util.find_spec("pnnx")
    except (ImportError, ValueError):
        spec = None
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        for name in ("pnnx.exe", "pnnx") if sys.platform == "win32" else ("pnnx",):
            path = Path(folder) / name
            if path.is_file() and os.access(path, os.X_OK):
                return path
    return None


def runtime_options(target, precision: str) -> dict:
    """ncnn Option switches for this target and precision (precision is a runtime choice)."""
    fp16, bf16 = _halves(precision)
    switches = target.ncnn
    return {
        "use_vulkan": str(target.device).upper() == "VULKAN",
        "device_index": int(switches.device_index),
        "threads": int(target.threads or 0),
        "use_fp16_storage": bool(fp16 and switches.fp16_storage),
        "use_fp16_packed": bool(fp16 and switches.fp16_packed),
        "use_fp16_arithmetic": bool(fp16 and switches.fp16_arithmetic),
        "use_bf16_storage": bf16,
        "use_int8_inference": precision in QUANTIZED_PRECISIONS,
        "layer_masks": {},
        MEMORY_OPTION: memory_mode(target),
    }


# ----------------------------------------------------------------------------- the model's graph


def _graph_inputs(model) -> List[Tuple[str, List[int], np.dtype]]:
    from onnx import helper

    initializers = {t.name for t in model.graph.initializer}
    ranges = shapes.recorded(model)
    found = []
    for value in model.graph.input:
        if value.name in initializers:
            continue
        tensor = value.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else -1 for d in tensor.shape.dim]
        if tensor.HasField("shape") and not dims:
            raise BackendUnavailable(
                f"ncnn cannot take scalar input {value.name!r}: pnnx's inputshape cannot write a 0-d shape and an "
                "ncnn Mat has at least one dimension; run this model on ort_cpu or openvino_cpu")
        if not dims or any(d <= 0 for d in dims):
            dims = _opt_dims(value.name, dims, ranges.get(value.name))
        if len(dims) >= 4 and dims[0] > 1:
            raise BackendUnavailable(
                f"ncnn runs one sample at a time (a Mat has no batch axis; pnnx drops the first dim of a "
                f"{len(dims)}-d input): input {value.name!r} {dims} has a fixed batch of {dims[0]}; export the model "
                "with batch 1 or a dynamic batch, or run it on ort_cpu or openvino_cpu")
        found.append((value.name, dims, np.dtype(helper.tensor_dtype_to_np_dtype(tensor.elem_type))))
    return found


def _opt_dims(name: str, dims: List[int], found) -> List[int]:
    """A dynamic input's shape for pnnx: its range's opt (pnnx traces at one shape; ncnn
    itself runs any). Without a range nothing says which shape to trace at."""
    if found is None:
        raise ConfigError(f"ncnn: input {name!r} has dynamic dims {dims} and no range: pnnx converts at given "
                          f"shapes; set model.input_shapes.{name}={{min: [...], opt: [...], max: [...]}}")
    return list(found.opt)


def dynamic_max_shapes(model, inputs) -> Optional[List[List[int]]]:
    """Every input's range max (``inputs``: _graph_inputs, whose dims stand where an input
    has no range) for pnnx's inputshape2, or None when no input is dynamic."""
    ranges = {name: found for name, found in shapes.recorded(model).items() if found}
    if not ranges:
        return None
    return [list(ranges[name].max) if name in ranges else dims for name, dims, _ in inputs]


# Where the Vulkan loader looks for driver manifests (ICDs) when no variable names them.
_ICD_FOLDERS = ("/etc/vulkan/icd.d", "/usr/local/share/vulkan/icd.d", "/usr/share/vulkan/icd.d",
                "~/.local/share/vulkan/icd.d")


def device_identity(device: str) -> str:
    """The Vulkan drivers the loader would find: each manifest's path and content (what
    decides whether VULKAN has a device here), read without starting Vulkan, which would
    cost every job a Vulkan instance in the parent process."""
    import ctypes.util
    import hashlib

    named = os.environ.get("VK_DRIVER_FILES") or os.environ.get("VK_ICD_FILENAMES")
    places = [Path(p).expanduser() for p in (named.split(os.pathsep) if named else _ICD_FOLDERS)]
    manifests = sorted(m for p in places for m in ([p] if p.suffix == ".json" else sorted(p.glob("*.json"))
                                                    if p.is_dir() else []) if m.is_file())
    digest = hashlib.sha256(str(ctypes.util.find_library("vulkan")).encode())
    for manifest in manifests:
        digest.update(str(manifest).encode() + manifest.read_bytes())
    return f"{device}: {len(manifests)} Vulkan driver manifest(s), {digest.hexdigest()[:16]}"
