"""MNN: the ``mnn_cpu``, ``mnn_opencl`` and ``mnn_vulkan`` targets (pip ``mnn``).

Conversion calls MNN's converter function ``_tools.mnnconvert([...])`` in a child process: the
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

The package's modules: ``common`` (the declarations, MNN imported quietly, the model's
graph), ``options`` (runtime.yaml's options, target checks, the tuning space), ``conversion``
(ONNX -> MNN, the fp32/fp16 build), ``int8`` (MNN's own quantizer: int8 and mixed),
``names`` (MNN tensor and op names -> ONNX names) and ``session`` (``load``, ``Session``).
"""

from __future__ import annotations

from pipeline.backends.mnn.common import (  # noqa: F401 - the backend's names
    NAME, CAPABILITIES, GPU_DEVICES, FORWARD_TYPES, PRECISION_MODES, CACHE_FILE, MODEL, available,
    versions, write_json, runtime_exists, device_identity)
from pipeline.backends.mnn.options import (  # noqa: F401 - the backend's names
    GPU_TUNING, GPU_MEMORY, DEFAULT_PRECISION, check_config, gpu_mode, session_options, tuning_space,
    with_options, schedule_config)
from pipeline.backends.mnn.conversion import (  # noqa: F401 - the backend's names
    TENSOR_MAP, MODEL_UUID, convert, fix_model_uuid, build)
from pipeline.backends.mnn.int8 import (  # noqa: F401 - the backend's names
    FEATURE_METHODS, AUTO_CANDIDATES, IGNORES_SKIP, EVAL_SAMPLES, QUANTIZE_TIMEOUT_S, build_int8, _candidates,
    skipped_ops, write_samples, quantizer_config, quantize)
from pipeline.backends.mnn.names import (  # noqa: F401 - the backend's names
    MAX_FUSED, tensor_map, onnx_ops, op_census)
from pipeline.backends.mnn.session import (  # noqa: F401 - the backend's names
    BACKEND_NAMES, SESSION_INFO_BACKENDS, Session, fallback_reason, load)
