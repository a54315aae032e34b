"""What a run ran on: package versions, CPU and platform (recorded in every manifest)."""

from __future__ import annotations

import platform
import sys
from functools import lru_cache
from importlib import metadata
from pathlib import Path

import pipeline

PACKAGES = ("numpy", "onnx", "onnxruntime", "openvino", "hydra-core", "omegaconf", "rich", "Pillow", "ncnn", "pnnx", "MNN")
CPU_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16",
             "avx512_fp16", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8", "neon", "asimd", "fphp", "asimdhp")


@lru_cache(maxsize=1)
def versions() -> dict:
    found = {"python": platform.python_version(), "parity": pipeline.__version__}
    for package in PACKAGES:
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            pass
    return found


@lru_cache(maxsize=1)
def cpu() -> dict:
    model, flags = None, set()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model is None:
                model = value.strip()
            if key.strip() in ("flags", "Features") and not flags:
                flags = set(value.split())
    # platform.processor() runs `uname -p` in a subprocess on Linux: only when cpuinfo names no model
    model = model or platform.processor() or platform.machine()
    return {"model": model, "machine": platform.machine(), "flags": [f for f in CPU_FLAGS if f in flags]}


@lru_cache(maxsize=1)
def fingerprint() -> str:
    """A short hash of what makes timings and compiled kernels machine-specific: the CPU
    model, its architecture and its instruction-set flags (the ones parity records)."""
    import hashlib
    import json

    return hashlib.sha256(json.dumps(cpu(), sort_keys=True).encode()).hexdigest()[:16]


def describe() -> dict:
    return {"versions": versions(), "cpu": cpu(), "fingerprint": fingerprint(), "platform": platform.platform(),
            "python_executable": sys.executable}
