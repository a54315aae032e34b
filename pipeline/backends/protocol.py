"""The backend seam: what a backend module provides (``Backend``), what its sessions
provide (``Session``) and what it declares it can do (``Capabilities``).

No runtime is imported here: config validation reads the declarations of every backend
without loading one. docs/architecture.md "The backend seam" walks through adding one.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Dict, List, Optional, Protocol, Tuple, runtime_checkable

if TYPE_CHECKING:  # importing numpy would slow config validation down
    import numpy as np

# Every device name a target may give that runs on a GPU (sweep.py compares them with the
# CPU; a backend's own GPU devices are its ``devices`` among these: ``Capabilities.gpu_devices``).
GPU_DEVICES = ("VULKAN", "OPENCL", "GPU", "CUDA", "METAL")

QDQ_PLACEMENTS = ("inputs_and_outputs", "inputs")


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do, as data: stages and helpers ask these, never ``hasattr``.
    A field that promises a function (named in brackets) is True exactly when the module
    (or its Session) has that function; tests/test_backend_protocol.py checks both ways."""

    precisions: Tuple[str, ...]  # precision.name values a target may ask for
    devices: Tuple[str, ...]  # target.device values (upper case)
    memory_modes: Tuple[str, ...] = ("auto",)  # target.memory_mode values
    # precisions that are session switches: build gets convert's fp32 model for them
    runtime_precisions: Tuple[str, ...] = ()
    # precisions built by the runtime's own offline quantizer [build_int8] rather than
    # from parity's Q/DQ model (int8 and mixed of MNN)
    own_int8: Tuple[str, ...] = ()
    # where parity's Q/DQ model puts Q/DQ when precision.quantize_outputs is null:
    # "inputs_and_outputs" (ONNX Runtime fuses DQ -> op -> Q into int8 kernels) or "inputs"
    # (int8 from quantized op inputs alone, OpenVINO's low-precision transformations)
    qdq_placement: str = "inputs_and_outputs"
    # op types that move or clamp values which the runtime runs on quantized tensors when
    # parity's Q/DQ model surrounds them (precision.passthrough_ops=null): ONNX Runtime's
    # uint8 MaxPool and Resize, QLinearConcat, a Relu folded into the Q before it
    qdq_passthrough: Tuple[str, ...] = ()
    # SiLU (x * Sigmoid(x) after a quantized op) run on quantized tensors when parity's Q/DQ
    # model surrounds its Sigmoid and Mul with their own ranges (precision.quantize_swish=null):
    # ONNX Runtime's QLinearSigmoid and QLinearMul
    qdq_swish: bool = False
    # int8 with activations quantized per call at run time (precision.activation_ranges=dynamic):
    # build gets parity's dynamic model (pipeline/precision/dynamic.py: int8 weights, the
    # runtime's DynamicQuantizeLinear -> MatMulInteger / ConvInteger), no calibration
    dynamic_int8: bool = False
    # runs parity's Q/DQ ONNX model as it is, so that sensitivity.latency_aware measures
    # per-op costs on it (build + load + Session.profile of an fp32 and an int8 model)
    qdq_latency: bool = False
    # sensitivity measures the mixed candidates on this runtime instead of the reference
    # [run_model(model, feeds, count, outputs), given all the samples in one call]
    measures_qdq: bool = False
    # convert writes the runtime's own IR next to model.onnx [convert_ir(onnx_path, out_dir)
    # -> (xml, bin) names]; build then gets it (ir_dir) for float precisions
    ir: bool = False
    # the runtime's converter makes fp16 from the prepared fp32 graph itself (named here,
    # recorded in build's summary; parity's fp16 block list is recorded, not applied);
    # None: parity's fp16 conversion (pipeline/precision/fp16.py) unless fp16 is a runtime precision
    fp16_converter: Optional[str] = None
    # the converter traces the model at given input shapes (pnnx): a dynamic input whose
    # range the data decides is given the data's range for the build (StageContext.traceable)
    traces_at_shapes: bool = False
    # per-layer feature masks, searched by build for fp16 when the plain build fails
    # [layer_map, layer_consumers, apply_masks]
    feature_masks: bool = False
    # a compile cache written at build time [write_compile_cache(artifact_dir, settings, folder)]
    compile_cache: bool = False
    # runtime settings the tune stage searches [tuning_space(settings, level, objective, devices)]
    tuning: bool = False
    # an option that is more than a key of runtime.yaml's options [with_options(settings, changes)]
    option_mapping: bool = False
    # kinds of quantized op its int8 builds keep in float, where its int8 kernel for them is
    # slower than its float one [float_op_kinds(target) -> kinds of pipeline.precision.quantize.OP_KINDS]
    float_op_kinds: bool = False
    # per-layer times by ONNX node [Session.profile(feeds, runs, warmup, nodes, max_seconds)]
    profiler: bool = False
    # concurrent requests for throughput [Session.parallel_runners() -> [run, ...]]
    parallel_runners: bool = False
    # precision=auto's default candidates: the precisions that can be faster than fp32 on
    # this runtime (bf16 on a CPU device only where the CPU computes bf16: pipeline/app/auto.py)
    auto_candidates: Tuple[str, ...] = ("fp32",)
    # an idle session's threads spin after a run (ONNX Runtime's pool, tens of ms): verify's
    # timing pauses its workers while another build is timed (pipeline/verification/speed.py)
    idle_threads_spin: bool = False
    # an int8 Conv of fewer output channels than this (or off a multiple of 8) runs on a slower
    # kernel: the int8 build widens it with zero filters and slices its output (precision/narrow_convs.py)
    qdq_conv_block: int = 0
    # a float op reading a tensor its int8 producers could hand over quantized runs faster
    # reading it so (ONNX Runtime: the int8 region stays NHWC, one DequantizeLinear replaces a
    # float Add of two dequantized inputs): the mixed search tries it (stages/sensitivity.py)
    float_reads_int8: bool = False
    # passes over a tensor's elements one conversion between its int8 and float regions
    # takes, in units of its own QuantizeLinear pass (0: not priced; the mixed search then
    # counts edges): ONNX Runtime dequantizes, transposes NHWC -> NCHW and reorders to NCHWc
    # (pipeline/precision/calibration/latency.py)
    conversion_passes: int = 0
    # names what a GPU device of its targets resolves to on this machine now, without
    # loading a model (a stage cache key's part) [device_identity(device) -> str]
    device_identity: bool = False

    def __post_init__(self):
        if self.qdq_placement not in QDQ_PLACEMENTS:
            raise ValueError(f"qdq_placement={self.qdq_placement!r}; allowed: {', '.join(QDQ_PLACEMENTS)}")
        for field in ("runtime_precisions", "own_int8", "auto_candidates"):
            if not set(getattr(self, field)) <= set(self.precisions):
                raise ValueError(f"{field}: {getattr(self, field)} not all in precisions {self.precisions}")

    @property
    def gpu_devices(self) -> Tuple[str, ...]:
        return tuple(device for device in self.devices if device in GPU_DEVICES)


# capability field -> (where the function lives: "module" or "session", its names)
PROMISED_FUNCTIONS: Dict[str, Tuple[str, Tuple[str, ...]]] = {
    "own_int8": ("module", ("build_int8",)),
    "measures_qdq": ("module", ("run_model",)),
    "ir": ("module", ("convert_ir",)),
    "feature_masks": ("module", ("layer_map", "layer_consumers", "apply_masks")),
    "compile_cache": ("module", ("write_compile_cache",)),
    "tuning": ("module", ("tuning_space",)),
    "option_mapping": ("module", ("with_options",)),
    "float_op_kinds": ("module", ("float_op_kinds",)),
    "device_identity": ("module", ("device_identity",)),
    "profiler": ("session", ("profile",)),
    "parallel_runners": ("session", ("parallel_runners",)),
}


@runtime_checkable
class Session(Protocol):
    """A loaded artifact. ``inputs`` / ``outputs`` are the ONNX names."""

    inputs: List[str]
    outputs: List[str]

    def run(self, feeds: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]: ...

    def effective(self) -> Dict[str, object]:
        """What really ran: {"device": ..., "precision": ..., ...}."""

    def probe(self, names: List[str]) -> dict:
        """Layerwise comparison (pipeline/verification/layerwise.py): {"exposed": [...], "tensors": [...]}."""

    def run_probe(self, feeds: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
        """{ONNX tensor name: float32 array} for the names ``probe`` exposed."""

    # Optional: ``remove_scratch()`` removes the session's temporary folder; a worker calls it
    # before it ends without the interpreter's teardown (pipeline/worker.py, _exit_now).


@runtime_checkable
class Backend(Protocol):
    """A backend module (pipeline/backends/<name>.py or package). Importing it must not
    import the runtime: ``available`` reports a missing one."""

    NAME: str
    CAPABILITIES: Capabilities

    def available(self) -> Tuple[bool, str]: ...

    def versions(self) -> Dict[str, str]: ...

    def check_config(self, target, precision: str) -> Optional[str]:
        """A combination of the target's settings this backend cannot run (exit 2), or None."""

    def build(self, onnx_path: Path, ir_dir: Optional[Path], out_dir: Path, target,
              precision: str) -> Tuple[List[str], dict]:
        """(artifact files, settings): runtime.yaml's ``model`` and ``options``."""

    def load(self, artifact_dir: Path, settings: dict) -> Session: ...


def importable(package: str) -> Tuple[bool, str]:
    """``available()`` for a backend whose runtime is the one pip package ``package``:
    imported only when asked, so reading the declarations still imports no runtime."""
    try:
        importlib.import_module(package)
    except ImportError as err:
        return False, f"{package} cannot be imported ({err}): pip install {package}"
    return True, ""


# target.memory (docs/targets.md, "Memory modes"): runtime.yaml's ``options.memory`` carries it
# from the build to every load (verify's workers, parity-bundle run); each backend maps ``low``
# to its runtime's own settings where it loads, ``default`` leaves the runtime's defaults.
MEMORY_OPTION = "memory"
MEMORY_MODES = ("default", "low")


def memory_mode(target) -> str:
    """target.memory as text ("default" for a target without the key)."""
    value = getattr(target, "memory", None)
    return str(getattr(value, "value", value) or "default")


def memory_low(options: dict) -> bool:
    """Whether runtime.yaml's options ask for the low memory mode."""
    return str((options or {}).get(MEMORY_OPTION, "default")) == "low"
