"""What a run ran on: package versions, CPU and platform (recorded in every manifest)."""

from __future__ import annotations

import os
import platform
import sys
from functools import lru_cache
from importlib import metadata
from pathlib import Path
from typing import List, Optional

import pipeline

PACKAGES = ("numpy", "onnx", "onnxruntime", "openvino", "hydra-core", "omegaconf", "rich", "Pillow", "ncnn", "pnnx", "MNN")
ISA_CAPS = ("ONEDNN_MAX_CPU_ISA", "OV_CPU_MAX_ISA")  # the most oneDNN (OpenVINO's CPU plugin) dispatches
VNNI_FLAGS = frozenset({"avx512_vnni", "avx_vnni", "amx_int8"})  # int8 dot products without 16-bit saturation
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
    found = {"model": model, "machine": platform.machine(), "flags": [f for f in CPU_FLAGS if f in flags]}
    caps = {name: os.environ[name] for name in ISA_CAPS if os.environ.get(name, "").strip()}
    if caps:  # kernels capped below what the flags offer: timings and int8 choices are the cap's
        found["isa_cap"] = caps
    return found


def int8_vnni(backend: Optional[str] = None) -> bool:
    """Whether ``backend``'s int8 kernels have VNNI here: the CPU has it and, for OpenVINO,
    no ISA cap holds its oneDNN below it (ONNX Runtime's kernels ignore the cap)."""
    info = cpu()
    if backend == "openvino" and any(_below_vnni(cap) for cap in info.get("isa_cap", {}).values()):
        return False
    return bool(VNNI_FLAGS & set(info["flags"]))


# oneDNN's ISA levels in order, and the level each CPU flag needs: what a cap leaves OpenVINO
ISA_LEVELS = ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX512_CORE", "AVX512_CORE_VNNI", "AVX512_CORE_BF16",
              "AVX512_CORE_FP16", "AVX512_CORE_AMX")
FLAG_LEVELS = {"avx": "AVX", "avx2": "AVX2", "fma": "AVX2", "f16c": "AVX2", "avx_vnni": "AVX2_VNNI",
               "avx512f": "AVX512_CORE", "avx512bw": "AVX512_CORE", "avx512_vnni": "AVX512_CORE_VNNI",
               "avx512_bf16": "AVX512_CORE_BF16", "avx512_fp16": "AVX512_CORE_FP16", "amx_tile": "AVX512_CORE_AMX",
               "amx_bf16": "AVX512_CORE_AMX", "amx_int8": "AVX512_CORE_AMX"}


def kernel_flags(backend: Optional[str] = None) -> List[str]:
    """The CPU flags ``backend``'s kernels may use here: for OpenVINO, those at or below an
    ISA cap (ONEDNN_MAX_CPU_ISA=AVX2 on a BF16 CPU leaves no native bf16: OpenVINO then
    reports no BF16 capability and runs a bf16 request in f32); ONNX Runtime ignores the cap."""
    flags = list(cpu()["flags"])
    if backend != "openvino":
        return flags
    for cap in cpu().get("isa_cap", {}).values():
        level = cap.strip().upper()
        if level in ISA_LEVELS:
            top = ISA_LEVELS.index(level)
            flags = [f for f in flags if f not in FLAG_LEVELS or ISA_LEVELS.index(FLAG_LEVELS[f]) <= top]
    return flags


def _below_vnni(cap: str) -> bool:
    """oneDNN's ISA names: SSE41, AVX, AVX2, AVX2_VNNI, AVX512_CORE, AVX512_CORE_VNNI,
    AVX512_CORE_BF16, AVX512_CORE_FP16, AVX512_CORE_AMX...; every one from BF16 up has VNNI."""
    cap = cap.strip().upper()
    return cap not in ("ALL", "DEFAULT") and not any(mark in cap for mark in ("VNNI", "BF16", "FP16", "AMX"))


def fingerprint() -> str:
    """A short hash of what makes timings and compiled kernels machine-specific: the CPU
    model, its architecture and its instruction-set flags (the ones parity records)."""
    import hashlib
    import json

    return hashlib.sha256(json.dumps(cpu(), sort_keys=True).encode()).hexdigest()[:16]


_SIDE_BY_SIDE = {"jobs": 1}


def share_cores(jobs: int) -> None:
    """This process is one of ``jobs`` sweep jobs running side by side on this machine."""
    _SIDE_BY_SIDE["jobs"] = max(1, jobs)


def jobs_side_by_side() -> int:
    return _SIDE_BY_SIDE["jobs"]


def own_threads() -> int:
    """Threads for parity's own work (calibration passes, the sensitivity search): the
    cores this process may use, shared out between the jobs running side by side. The
    targets' sessions keep the threads their runtime settings ask for."""
    return max(1, cores() // _SIDE_BY_SIDE["jobs"])


def cores() -> int:
    """The cores this process may use (its affinity mask, e.g. a SLURM allocation)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def describe() -> dict:
    return {"versions": versions(), "cpu": cpu(), "fingerprint": fingerprint(), "platform": platform.platform(),
            "python_executable": sys.executable,
            "cores": {"available": cores(), "jobs_side_by_side": jobs_side_by_side(), "own_threads": own_threads()}}
