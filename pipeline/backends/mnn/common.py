"""What the MNN modules share: the declarations (``CAPABILITIES`` and MNN's constants), MNN and
its converter/quantizer extension imported quietly, and the converted model's graph."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Tuple

import numpy as np

from pipeline.backends.protocol import Capabilities

NAME = "mnn"
CAPABILITIES = Capabilities(
    precisions=("fp32", "fp16", "int8", "mixed"), devices=("CPU", "OPENCL", "VULKAN"),
    memory_modes=("auto", "buffer", "image"),
    runtime_precisions=("fp16",),  # a session setting (BackendConfig precision), built from the fp32 model
    own_int8=("int8", "mixed"),  # built by MNN's quantizer (build_int8); mixed: the qtable's ops skipped
    tuning=True, option_mapping=True, profiler=True, device_identity=True,
    auto_candidates=("fp32", "fp16", "int8"))
GPU_DEVICES = CAPABILITIES.gpu_devices  # ("OPENCL", "VULKAN")
FORWARD_TYPES = {"CPU": 0, "OPENCL": 3, "VULKAN": 7}  # MNNForwardType
PRECISION_MODES = {"normal": 0, "high": 1, "low": 2}  # BackendConfig::PrecisionMode
CACHE_FILE = "tuning.cache"
MODEL = "model.mnn"
_COMPUTE_OPS = {"Convolution", "ConvolutionDepthwise", "Deconvolution", "DeconvolutionDepthwise", "MatMul",
                "BatchMatMul", "ConvInt8", "DepthwiseConvInt8", "InnerProduct"}
_MNN_PASSTHROUGH = {"ConvertTensor", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity"}


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


def run_tool(tool: str, argv: List[str], dst: Path, timeout_s: float, what: str) -> str:
    """``_tools.<tool>(argv)`` (MNN's converter or quantizer) in a child process writing ``dst``;
    returns what it printed. The tools can crash (the converter segfaults on a plain ONNX
    LSTM), leave callbacks on MNN's global executor and crash at interpreter exit after a
    good run: in a child, a crash is a RuntimeError naming the signal and the last lines
    printed, and parity's own process goes on."""
    from pipeline.worker import start_process

    log = Path(dst).with_name(Path(dst).name + ".log")
    child = start_process(_tool_child, (tool, list(argv), str(dst), str(log)), name=f"parity-mnn-{tool}")
    child.join(timeout_s)
    if child.is_alive():
        child.kill()
        child.join()
        raise RuntimeError(f"{what} did not finish in {timeout_s:g} s")
    text = log.read_text(errors="replace") if log.exists() else ""
    log.unlink(missing_ok=True)
    if child.exitcode != 0 or not Path(dst).is_file() or Path(dst).stat().st_size == 0:
        how = (f"signal {signal.Signals(-child.exitcode).name}" if child.exitcode and child.exitcode < 0
               else f"exit {child.exitcode}")
        raise RuntimeError(f"{what} failed ({how}): {_tail(text)}")
    return text


def _tool_child(tool: str, argv: List[str], dst: str, log: str) -> None:
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    import _tools  # MNN's converter/quantizer extension; never MNN.tools: its modules phone home

    getattr(_tools, tool)(argv)
    _flush_c_stdio()
    os._exit(0 if os.path.isfile(dst) else 3)


def _mnn():
    """The MNN module, imported quietly (it prints the CPU's features on import)."""
    if "MNN" not in sys.modules:
        with _captured():
            import MNN  # noqa: F401
    return sys.modules["MNN"]


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


def _tail(text: str, lines: int = 4) -> str:
    kept = [line.strip() for line in text.replace("\r", "\n").splitlines() if line.strip()]
    return " | ".join(kept[-lines:]) or "(no output)"


def write_json(path: Path, data) -> None:
    Path(path).write_text(json.dumps(data, indent=1, sort_keys=True))


def runtime_exists(device: str) -> bool:
    """Whether this MNN build has a runtime for the device (Interpreter.createRuntime
    answers per config; the pip wheel has the CPU only)."""
    mnn = _mnn()
    with _captured():
        _, exists = mnn.Interpreter.createRuntime([{"backend": FORWARD_TYPES[device]}])
    return bool(exists[0])


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


def device_identity(device: str) -> str:
    """Whether this MNN build has a runtime for the device now (the pip wheel: the CPU only)."""
    return f"{device}: {'a runtime' if runtime_exists(device) else 'no runtime'}"
