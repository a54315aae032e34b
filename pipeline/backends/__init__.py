"""One module per runtime, each behind the same small protocol.

Module-level constants describe what a backend can do (importing the runtime is
deferred to the functions, so that config validation stays fast and a missing
optional runtime is reported, not crashed on):

    NAME, PRECISIONS, MEMORY_MODES, DEVICES
    available() -> (bool, reason)
    check_config(target, precision) -> None or a one-line problem   (optional)
    versions() -> {package: version}
    build(onnx_path, ir_dir, out_dir, target, precision) -> (artifact files, settings)
    load(artifact_dir, settings) -> Session

A Session has ``inputs`` / ``outputs`` (names), ``run(feeds) -> {name: array}`` and
``effective() -> {"device": ..., "precision": ...}``: what really ran; and, for the
layerwise comparison, ``probe(names) -> {"exposed": [...], "tensors": [...]}`` and
``run_probe(feeds) -> {onnx name: float32 array}`` (see pipeline/layerwise.py).
``settings`` are runtime.yaml's: backend-specific values live under ``options``.
"""

from __future__ import annotations

import importlib
from types import ModuleType

MODULES = {
    "onnxruntime": "pipeline.backends.onnxruntime",
    "openvino": "pipeline.backends.openvino",
    "ncnn": "pipeline.backends.ncnn",
    "mnn": "pipeline.backends.mnn",
}


def spec(name: str) -> ModuleType:
    return importlib.import_module(MODULES[name])


def own_quantizer(backend: ModuleType, precision: str) -> bool:
    """Whether the backend builds this precision with the runtime's own offline quantizer
    (``build_int8``, for the precisions in its ``OWN_QUANTIZER``, int8 by default) rather
    than from parity's Q/DQ model."""
    return hasattr(backend, "build_int8") and precision in getattr(backend, "OWN_QUANTIZER", ("int8",))
