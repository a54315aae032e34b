"""runtime.yaml's MNN options: the checks of a target, the session options, the tune stage's
space and MNN's ScheduleConfig."""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

from pipeline.backends.mnn.common import CACHE_FILE, FORWARD_TYPES, GPU_DEVICES, PRECISION_MODES
from pipeline.backends.protocol import MEMORY_OPTION, memory_mode
from pipeline.precision import kinds

GPU_TUNING = {"none": 1 << 0, "heavy": 1 << 1, "wide": 1 << 2, "normal": 1 << 3, "fast": 1 << 4}  # MNNGpuMode
GPU_MEMORY = {"auto": 0, "buffer": 1 << 6, "image": 1 << 7}
# int8 and mixed: the precision of the float parts between int8 ops
DEFAULT_PRECISION = {"fp32": "high", "fp16": "low", "int8": "high", "mixed": "high"}
# target.memory=low (docs/targets.md, "Memory modes"): Interpreter.setSessionHint before the
# session is created, WINOGRAD_MEMORY_LEVEL (3) = 0, the fewest Winograd unit candidates (PP-OCRv4
# det 640x960: fp32 172 -> 169 MB, int8 173 -> 168 MB, MNN's own count of the session's memory
# 96.0 -> 93.6 MB; rec and cls within 1 MB). Not reachable or not kept: BackendConfig.memory
# (pymnn's createSession reads no such key: Memory_Low changed nothing), MEM_ALLOCATOR_TYPE (2)
# = 1 (253 MB instead of 162), the session modes Memory_Collect/Memory_Cache (no change).
WINOGRAD_MEMORY_LEVEL = 3  # Interpreter::HintMode
MEMORY_LOW_HINTS = {WINOGRAD_MEMORY_LEVEL: 0}


def _value(field) -> Optional[str]:
    return None if field is None else str(getattr(field, "value", field))


def check_config(target, precision: str) -> Optional[str]:
    device = target.device.upper()
    memory, tuning = _value(target.mnn.memory_mode) or "auto", _value(target.mnn.tuning) or "none"
    if memory != "auto" and device not in GPU_DEVICES:
        return f"target.mnn.memory_mode={memory} needs an MNN GPU device (OPENCL or VULKAN)"
    if memory != "auto" and device == "VULKAN":
        return (f"target.mnn.memory_mode={memory}: MNN's Vulkan backend has no runtime memory mode (it is chosen when "
                "MNN is built, MNN_VULKAN_IMAGE); use target.mnn.memory_mode=auto")
    if tuning != "none" and device not in GPU_DEVICES:
        return f"target.mnn.tuning={tuning} needs an MNN GPU device (OPENCL or VULKAN)"
    if tuning in ("normal", "fast") and device == "VULKAN":
        return f"target.mnn.tuning={tuning} is OpenCL-only in MNN; MNN's Vulkan backend takes none, heavy or wide"
    if target.threads and device in GPU_DEVICES:
        return (f"target.threads={target.threads}: MNN GPU sessions carry the GPU mode where CPU sessions carry "
                "the thread count (ScheduleConfig union); use target.threads=0")
    asked = _value(target.mnn.precision)
    if precision == kinds.REFERENCE and asked == "low":
        return "target.mnn.precision=low computes in fp16 where the device can: precision=fp32 needs high or normal"
    if kinds.half(precision) and asked == "high":  # MNN's one half float: fp16
        return "target.mnn.precision=high computes in fp32: precision=fp16 needs low or normal"
    return None


def gpu_mode(tuning: str = "none", memory_mode: str = "auto") -> int:
    """ScheduleConfig.mode for MNN's GPU backends: one tuning bit, plus a memory bit
    (none for auto: MNN picks buffer or image itself)."""
    return GPU_TUNING[tuning] | GPU_MEMORY[memory_mode]


def session_options(target, precision: str) -> dict:
    """runtime.yaml options of a session for this target and parity precision."""
    device = target.device.upper()
    mnn_precision = _value(target.mnn.precision) or DEFAULT_PRECISION[precision]
    options = {"backend": device, "forward_type": FORWARD_TYPES[device], "precision": mnn_precision,
               "precision_mode": PRECISION_MODES[mnn_precision], MEMORY_OPTION: memory_mode(target)}
    if device in GPU_DEVICES:
        tuning, memory = _value(target.mnn.tuning) or "none", _value(target.mnn.memory_mode) or "auto"
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
