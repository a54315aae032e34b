"""One module per runtime, each behind the same small protocol (pipeline/backends/protocol.py).

A backend module has ``NAME``, ``CAPABILITIES`` (a ``Capabilities``: what it can do, as
data; stages ask ``capabilities(name)``, never ``hasattr``) and the functions of
``protocol.Backend``; importing the runtime is deferred to the functions, so that config
validation stays fast and a missing optional runtime is reported, not crashed on:

    available() -> (bool, reason)
    check_config(target, precision) -> None or a one-line problem (exit 2)
    versions() -> {package: version}
    build(onnx_path, ir_dir, out_dir, target, precision) -> (artifact files, settings)
    load(artifact_dir, settings) -> Session

A Session has ``inputs`` / ``outputs`` (names), ``run(feeds) -> {name: array}`` and
``effective() -> {"device": ..., "precision": ...}``: what really ran; and, for the
layerwise comparison, ``probe(names) -> {"exposed": [...], "tensors": [...]}`` and
``run_probe(feeds) -> {onnx name: float32 array}`` (see pipeline/verification/layerwise.py). The
functions a capability promises (``build_int8``, ``write_compile_cache``, ``tuning_space``,
``Session.profile``, ...) are listed in ``protocol.PROMISED_FUNCTIONS``.
``settings`` are runtime.yaml's: backend-specific values live under ``options``.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from pipeline.backends.protocol import GPU_DEVICES, Backend, Capabilities, Session  # noqa: F401 - the seam's names

MODULES = {
    "onnxruntime": "pipeline.backends.onnxruntime",
    "openvino": "pipeline.backends.openvino",
    "ncnn": "pipeline.backends.ncnn",
    "mnn": "pipeline.backends.mnn",
}
REFERENCE = "onnxruntime"  # verify's reference runs on it (fp32, graph optimizations off)


def spec(name: str) -> ModuleType:
    return importlib.import_module(MODULES[name])


def capabilities(name: str) -> Capabilities:
    """What the backend ``name`` declares it can do."""
    return spec(name).CAPABILITIES


def float_op_kinds(backend: ModuleType, target) -> list:
    """Kinds of quantized op (pipeline.precision.quantize.OP_KINDS) the backend's int8 builds keep in
    float for this target; none unless it declares ``float_op_kinds``."""
    return list(backend.float_op_kinds(target)) if backend.CAPABILITIES.float_op_kinds else []


def own_quantizer(backend: ModuleType, precision: str) -> bool:
    """Whether the backend builds this precision with the runtime's own offline quantizer
    (``build_int8``, for the precisions in ``CAPABILITIES.own_int8``) rather than from
    parity's Q/DQ model."""
    return precision in backend.CAPABILITIES.own_int8
