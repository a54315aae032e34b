"""ncnn's Option switches from runtime.yaml's options, and the tuning space."""

from __future__ import annotations

from typing import List, Tuple

from pipeline.backends.protocol import memory_low


_OPTION_FIELDS = {"use_fp16_storage": "use_fp16_storage", "use_fp16_packed": "use_fp16_packed",
                  "use_fp16_arithmetic": "use_fp16_arithmetic", "use_bf16_storage": "use_bf16_storage"}


# Speed switches of ncnn's Option the tune stage measures; unset ones keep ncnn's default (on).
SPEED_SWITCHES = ("use_winograd_convolution", "use_sgemm_convolution", "use_packing_layout", "lightmode")
# target.memory=low (docs/targets.md, "Memory modes"): no Winograd and no im2col-sgemm
# convolution, whose transformed weights and unfolded inputs are the largest buffers of a
# convolution network (PP-OCRv4 det 640x960: fp32 327 -> 210 MB, int8 378 -> 249 MB, at 1.3x and
# 1.6x the latency; either one off alone moves the work to the other: Winograd off 408 MB). Light mode (blobs freed as soon as
# they are consumed) is ncnn's default already. Tried and not kept: the packing layout off
# (363 MB); pool allocators for blobs and workspace emptied after each run (-6 to -11 % alone,
# worse than without them once Winograd and sgemm are off: int8 285 MB).
MEMORY_LOW = {"use_winograd_convolution": False, "use_sgemm_convolution": False}


def _set_options(opt, options: dict) -> None:
    opt.use_vulkan_compute = bool(options.get("use_vulkan", False))
    for key, field in _OPTION_FIELDS.items():
        setattr(opt, field, bool(options.get(key, False)))
    opt.use_bf16_packed = bool(options.get("use_bf16_storage", False))
    opt.use_int8_inference = bool(options.get("use_int8_inference", False))
    for switch in SPEED_SWITCHES:
        if switch in options:
            setattr(opt, switch, bool(options[switch]))
    if memory_low(options):  # wins over a tuned switch
        for switch, value in MEMORY_LOW.items():
            setattr(opt, switch, value)
    threads = int(options.get("threads", 0) or 0)
    if threads > 0:
        opt.num_threads = threads


def tuning_space(settings: dict, level: str, objective: str, devices: List[str]) -> List[Tuple[str, list]]:
    """Threads, the convolution/layout switches (normal, heavy) and, where tuning.devices
    allows, the other device (Vulkan <-> CPU)."""
    from pipeline.tuning import current_first, thread_counts

    options = settings.get("options", {})
    knobs = []
    device = str(settings.get("device", "CPU")).upper()
    others = [d.upper() for d in devices if d.upper() != device]
    if others:
        knobs.append(("device", current_first(device, others)))
    knobs.append(("threads", thread_counts(int(options.get("threads", 0) or 0))))
    if level != "fast":
        knobs += [(switch, current_first(bool(options.get(switch, True)), [True, False])) for switch in SPEED_SWITCHES
                  if not (memory_low(options) and switch in MEMORY_LOW)]  # target.memory=low decides these
    return knobs


def with_options(settings: dict, changes: dict) -> dict:
    """``device`` moves the session between Vulkan and the CPU; the rest are options."""
    changes = dict(changes)
    if "device" in changes:
        settings["device"] = str(changes.pop("device")).upper()
        settings["options"]["use_vulkan"] = settings["device"] == "VULKAN"
    settings["options"].update(changes)
    return settings


CPU_FP32_NOTE = ("ncnn's CPU path on this machine has no fp16 arithmetic and keeps activations fp32 (its Net casts "
                 "activations to fp16 only on ARM with asimdhp and RISC-V with zfh); use_fp16_storage at most stores "
                 "some layers' weights in fp16, which is storage, not execution precision")


def cpu_fp16_storage() -> bool:
    """Whether ncnn's CPU layers get fp16 activations under use_fp16_storage here: ncnn's
    NetPrivate::convert_layout (src/net.cpp) casts a blob to fp16 for a layer with
    support_fp16_storage only when built for ARM82 and the CPU has asimdhp (or RISC-V with
    zfh); x86 has no such path (only InnerProduct & co. keep fp16 weights, computed in fp32)."""
    import platform

    import ncnn

    if platform.machine().lower().startswith("riscv"):
        return True  # the binding has no zfh query; ncnn's RVV path casts when the CPU has zfh
    return bool(ncnn.cpu_support_arm_asimdhp())
