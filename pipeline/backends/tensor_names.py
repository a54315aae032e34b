"""Backend tensor names -> ONNX tensor names (no runtime or onnx import: worker processes
that only need the names stay light)."""

from __future__ import annotations

QDQ_SUFFIXES = ("_DequantizeLinear_Output", "_QuantizeLinear_Output")
# ONNX Runtime renames the tensors of the fp16 Cast pairs it removes on CPUs without fp16 kernels
RENAMING_PREFIXES = ("InsertedPrecisionFreeCast_",)


def onnx_name(backend_name: str) -> str:
    """The ONNX tensor a backend's tensor name stands for (x_QuantizeLinear_Output -> x)."""
    for prefix in RENAMING_PREFIXES:
        if backend_name.startswith(prefix):
            backend_name = backend_name[len(prefix):]
    for suffix in QDQ_SUFFIXES:
        if backend_name.endswith(suffix):
            return backend_name[: -len(suffix)]
    return backend_name
