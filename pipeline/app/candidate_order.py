"""precision=auto's candidates and the order they are tried in: the backend's list (or
precision.candidates), fp32 first as every candidate's speed reference, mixed right after
int8 (it is built only where int8 fails), bf16 verified after the int8 candidates
(DEFERRED), and int8_dynamic after int8, or last on a convolutional network."""

from __future__ import annotations

from pathlib import Path
from typing import List

from omegaconf import DictConfig, OmegaConf

import conf
from pipeline import backends
from pipeline.errors import ConfigError
from pipeline.precision import kinds

PRECISION_FILES = Path(conf.__file__).parent / "precision"
REFERENCE = kinds.REFERENCE


def ordered(requested: List[str], cfg: DictConfig) -> List[str]:
    """The order the candidates are tried in (see the module's docstring)."""
    return dynamic_where_it_pays(in_order(with_reference(requested)), cfg)


def candidates(run_cfg) -> List[str]:
    """precision.candidates, or the backend's declared auto_candidates (those it builds on
    this CPU), with int8_dynamic right after int8 where the backend declares dynamic_int8
    (on a convolutional network it is tried last: dynamic_where_it_pays)."""
    backend = backends.spec(run_cfg.target.backend.value)
    if run_cfg.precision.activation_ranges.value == "dynamic":
        raise ConfigError(f"precision.activation_ranges=dynamic: precision=auto tries static and dynamic int8 itself "
                          "(candidates int8 and int8_dynamic); choose among them with precision.candidates")
    dynamic = [kinds.dynamic_variant(p) for p in backend.CAPABILITIES.precisions if kinds.dynamic_variant(p)] \
        if backend.CAPABILITIES.dynamic_int8 else []  # int8_dynamic
    if run_cfg.precision.candidates:
        wanted = list(run_cfg.precision.candidates)
        allowed = [*backend.CAPABILITIES.precisions, *dynamic]
        unknown = [p for p in wanted if p not in allowed]
        if unknown:
            raise ConfigError(f"precision.candidates: target {run_cfg.target.name} cannot build {unknown[0]!r}; "
                              f"allowed: {', '.join(allowed)}")
        return wanted
    from pipeline.environment import kernel_flags

    wanted = list(backend.CAPABILITIES.auto_candidates)
    if run_cfg.target.device.upper() == "CPU":  # bf16 only where the kernels compute it (elsewhere it is emulated)
        wanted = [p for p in wanted if not kinds.emulated(p, kernel_flags(backend.NAME))]
    for variant in dynamic:  # right after static int8
        if kinds.config_name(variant) in wanted:
            wanted.insert(wanted.index(kinds.config_name(variant)) + 1, variant)
    return wanted


def in_order(wanted: List[str]) -> List[str]:
    """mixed after int8: it is built only when int8 fails."""
    for part in [p for p in wanted if kinds.partial_of(p) in wanted]:
        if wanted.index(part) < wanted.index(kinds.partial_of(part)):
            wanted = [p for p in wanted if p != part]
            wanted.insert(wanted.index(kinds.partial_of(part)) + 1, part)
    return wanted


# dynamic int8 runs a quantized Conv as ConvInteger, whose kernels have no fused int8 path in
# ONNX Runtime: 0.15-0.37x fp32 on every convolutional network measured (the segmenter, PP-OCRv4
# det and rec, the digits CNN; docs/time.md), where a MatMul's MatMulInteger ran 1.6x
CONVOLUTIONS = ("Conv", "ConvTranspose")


def dynamic_where_it_pays(order: List[str], cfg: DictConfig) -> List[str]:
    """int8_dynamic last (after mixed, where the budget may cut it) on a model whose
    quantizable ops are mostly convolutions; as it is elsewhere."""
    dynamic = [p for p in order if kinds.dynamic(p)]
    if not dynamic or not _mostly_convolutions(cfg):
        return order
    return [*(p for p in order if p not in dynamic), *dynamic]


def _mostly_convolutions(cfg: DictConfig) -> bool:
    """Whether more than half of the model's quantizable ops (precision.quantize_ops) are
    convolutions; False where the model cannot be read (convert says why)."""
    import onnx

    try:
        nodes = onnx.load(str(Path(cfg.model.path).expanduser()), load_external_data=False).graph.node
    except Exception:  # noqa: BLE001 - the fp32 candidate's convert reports what is wrong with it
        return False
    ops = cfg.precision.get("quantize_ops") or OmegaConf.load(PRECISION_FILES / "int8.yaml").quantize_ops
    quantizable = [node.op_type for node in nodes if node.op_type in set(ops)]
    return sum(op in CONVOLUTIONS for op in quantizable) * 2 > len(quantizable)


def with_reference(wanted: List[str]) -> List[str]:
    """fp32 is always built: the speed-ups are against it (not shipped unless a candidate)."""
    return wanted if REFERENCE in wanted else [REFERENCE, *wanted]


# bf16 runs only on CPUs whose int8 has VNNI or AMX, where int8 mostly runs faster (PP-OCRv4
# rec on openvino_cpu: bf16 1.54x fp32 and failing, int8 1.95x passing; bf16's verify took 14 s)
DEFERRED = ("bf16",)


def deferrable(order: List[str]) -> set:
    """The candidates of DEFERRED with a quantized candidate after them in ``order``."""
    return {p for i, p in enumerate(order) if p in DEFERRED and any(kinds.quantized(q) for q in order[i + 1:])}
