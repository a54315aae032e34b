"""Recommendations: a concrete fix named from the evidence of one verify run.

Each recommendation is data and text: ``{"kind", "text", "action"}``. ``action`` is
what a later stage or the user can apply as it is, e.g. ``{"keep_float": [ops]}`` (an
fp16 block list, a qtable, ncnn layers to mask), ``{"precision_hint": "f32"}`` or
``{"calibration": {tensor: method}}``."""

from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Set

from pipeline.precision import kinds

FP16_MAX = 65504.0
OPENVINO_HINTS = {"fp32": "f32", "fp16": "f16", "bf16": "bf16"}
CLIPPED_TOO_MUCH = 0.001  # a threshold that clips more than 0.1 % of values is suspect
# Without calibration statistics (an imported table): a threshold this far below the
# reference's own peak on the validation samples is suspect.
THRESHOLD_BELOW_PEAK = 0.25


class QuantizedGraph:
    """Which ops of a model a build quantizes, and the quantized ops that feed an op
    through the float ops in between: what precision.keep_float can change."""

    def __init__(self, model, quantize_ops: Iterable[str], float_ops: Iterable[str] = (),
                 present: Optional[Set[str]] = None):
        """``present``: the op names the quantizer saw (the prepared graph, BatchNorm folded),
        when ``model`` is the converted model that layerwise names ops by."""
        nodes = list(model.graph.node)
        self.op_types = {node.name: node.op_type for node in nodes}
        self.quantize_ops = list(quantize_ops)
        self.quantized: Set[str] = {node.name for node in nodes
                                    if node.op_type in self.quantize_ops and node.name not in set(float_ops)
                                    and (present is None or node.name in present)}
        self._producer: Dict[str, object] = {out: node for node in nodes for out in node.output}
        self._inputs = {node.name: list(node.input) for node in nodes}

    def op_of(self, tensor: str) -> Optional[str]:
        node = self._producer.get(tensor)
        return node.name if node is not None else None

    def producers(self, op: Optional[str]) -> List[str]:
        """``op`` itself when it is quantized, else the nearest quantized ops upstream."""
        if op is None:
            return []
        if op in self.quantized:
            return [op]
        found, seen, stack = [], set(), list(self._inputs.get(op, []))
        while stack:
            tensor = stack.pop()
            node = self._producer.get(tensor)
            if node is None or node.name in seen:
                continue
            seen.add(node.name)
            if node.name in self.quantized:
                found.append(node.name)
            else:
                stack.extend(node.input)
        order = {name: index for index, name in enumerate(self.op_types)}
        return sorted(found, key=lambda name: -order[name])  # nearest first

    def not_quantized_line(self, op: str) -> str:
        producers = self.producers(op)
        feeds = (f"its quantized producers are {', '.join(producers)} (keep those in float instead)" if producers
                 else "no quantized op feeds it")
        return f"{op} is not quantized in this build: quantize_ops=[{', '.join(self.quantize_ops)}]; {feeds}"


def recommend(precision: str, backend: str, requested: dict, effective: dict,
              layerwise: Optional[dict], calibration: Optional[dict],
              graph: Optional[QuantizedGraph] = None, truth: Optional[dict] = None) -> List[dict]:
    found = _fallbacks(precision, backend, requested, effective)
    if layerwise and layerwise.get("ran"):
        origin, culprit = layerwise.get("nan_origin"), layerwise.get("first_divergence")
        if origin:
            found.append(_nan_origin(origin, precision))
        if culprit and not (origin and culprit["tensor"] == origin["tensor"]):
            found.append(_divergence(culprit, precision, (calibration or {}).get("tensors", {}), truth))
    if graph is not None and kinds.quantized(precision):
        for advice in found:  # int8 builds can only keep their quantized ops in float
            keep = advice["action"].get("keep_float")
            traced = list(dict.fromkeys(p for op in keep or [] for p in graph.producers(op)))
            if keep and traced != keep:
                untraced = ", ".join(op for op in keep if op not in graph.quantized)
                advice["text"] += (f"; this build does not quantize {untraced}: the quantized ops feeding it are "
                                   f"{', '.join(traced)}" if traced else f"; this build does not quantize {untraced}")
            if keep:
                advice["action"]["keep_float"] = traced
    for advice in found:
        keep = advice["action"].get("keep_float")
        if keep and kinds.keeps_float(precision):
            advice["text"] += f" (apply: precision.keep_float=[{','.join(keep)}])"
    return found


def _fallbacks(precision: str, backend: str, requested: dict, effective: dict) -> List[dict]:
    found = []
    ran, device = str(effective.get("precision", "")), str(effective.get("device", ""))
    if requested.get("device") and device and requested["device"].lower() not in device.lower():
        found.append({"kind": "device_fallback",
                      "text": f"requested {requested['device']} but {device} ran: check that the device and its "
                              "driver are visible to the runtime, or target the device that ran",
                      "action": {"device": requested["device"]}})
    if precision == kinds.REFERENCE and kinds.half(ran):
        hint = OPENVINO_HINTS[precision] if backend == "openvino" else precision
        found.append({"kind": "precision_fallback",
                      "text": f"backend ran {ran} where fp32 was requested: set the precision hint "
                              f"(OpenVINO INFERENCE_PRECISION_HINT={hint})",
                      "action": {"precision_hint": hint}})
    elif kinds.half(precision) and ran == kinds.REFERENCE:
        found.append({"kind": "precision_unsupported",
                      "text": f"{precision} was requested but the backend ran fp32: this device has no native "
                              f"{precision} for these layers; ship precision=fp32 here, or {precision} on a "
                              "device that runs it",
                      "action": {"precision": "fp32"}})
    return found


def _nan_origin(origin: dict, precision: str) -> dict:
    peak = origin.get("reference_max_abs") or 0.0
    keep = [origin["op"], *origin.get("consumers", [])]
    if precision == kinds.REFERENCE:  # nothing to keep in fp32: the kernel or the conversion is wrong
        return {"kind": "kernel_nan",
                "text": f"the first NaN/Inf appears at op {origin['op']} ({origin['op_type']}, tensor "
                        f"{origin['tensor']}, reference max {peak:.3g}) in an fp32 build: this backend's "
                        f"{origin['op_type']} kernel, or its conversion of the ops before it that it does not "
                        "expose, is wrong on this model; inspect them, report it upstream, or ship a target "
                        "that passes",
                "action": {"inspect": [origin["op"]], "tensor": origin["tensor"]}}
    # fp16 overflow is advised on every precision but plain int8 (quantized, nothing searched into float)
    if peak > FP16_MAX and (not kinds.quantized(precision) or kinds.searched(precision)):
        return {"kind": "fp16_overflow",
                "text": f"tensor {origin['tensor']} overflows fp16 (max {peak:.3g} > {FP16_MAX:g}) at op "
                        f"{origin['op']} ({origin['op_type']}): keep {' and '.join(keep)} in fp32",
                "action": {"keep_float": keep, "tensor": origin["tensor"]}}
    return {"kind": "nan_origin",
            "text": f"the first NaN/Inf appears at op {origin['op']} ({origin['op_type']}, tensor "
                    f"{origin['tensor']}, reference max {peak:.3g}): keep {origin['op']} in fp32 and check its "
                    "inputs for out-of-range values",
            "action": {"keep_float": [origin["op"]], "tensor": origin["tensor"]}}


def _divergence(culprit: dict, precision: str, table: dict, truth: Optional[dict] = None) -> dict:
    op, tensor = culprit["op"], culprit["tensor"]
    where = f"first divergence at {culprit['op_type']} {op} (tensor {tensor}, cosine {culprit['cosine']:.4f})"
    if kinds.quantized(precision):
        peaks = {tensor: culprit.get("reference_max_abs"),
                 **{i["tensor"]: i.get("reference_max_abs") for i in culprit.get("inputs", [])}}
        clipping = _worst_clipping(peaks, table)
        if clipping:
            name, entry, how = clipping
            method = entry.get("method") if entry.get("method") not in (None, "unknown") else "imported"
            # int8 builds quantize a tensor where its consumers read it (Conv/Gemm inputs): they stay float too
            keep = list(dict.fromkeys([op, *(culprit.get("consumers", []) if name == tensor else [])]))
            return {"kind": "int8_threshold",
                    "text": f"{where}: the int8 threshold of {name} ({method}, "
                            f"{entry['threshold']:.4g}) {how}: use the percentile or mse threshold for it, "
                            f"or keep {' and '.join(keep)} in float",
                    "action": {"calibration": {name: "mse" if entry.get("method") != "mse" else "percentile"},
                               "keep_float": keep}}
        return {"kind": "int8_sensitive",
                "text": f"{where}: keep {op} in float (precision=mixed puts it in the qtable)",
                "action": {"keep_float": [op]}}
    if kinds.half(precision):
        return {"kind": "float_precision",
                "text": f"{where}: keep {op} in fp32", "action": {"keep_float": [op]}}
    as_close = [o for o in ((truth or {}).get("outputs") or {}).values() if o["target_as_close"]]
    if as_close:  # the reference is no closer to the exact result: no kernel to blame
        return {"kind": "reference_imprecise",
                "text": f"{where}: {as_close[0]['verdict']} (float64 run, {as_close[0]['samples']} samples), so "
                        f"{culprit['op_type']} is not wrong beyond float32 rounding; the model is "
                        "ill-conditioned in float32 here: compute it in float64, reformulate it, or set "
                        "validation.min_cosine to what float32 reaches",
                "action": {"inspect": [op]}}
    return {"kind": "kernel_mismatch",
            "text": f"{where}: this backend's {culprit['op_type']} kernel disagrees with the reference at fp32; "
                    "compare its attributes with the backend's supported set, or report it upstream",
            "action": {"inspect": [op]}}


def _worst_clipping(peaks: dict, table: dict):
    """(tensor, table entry, what it clips) of the threshold that clips most, if any clips too much."""
    suspects = []
    for name, peak in peaks.items():
        entry = table.get(name)
        if entry is None:
            continue
        if entry.get("clipped") is not None:
            if entry["clipped"] > CLIPPED_TOO_MUCH:
                suspects.append((entry["clipped"], name, entry,
                                 f"clips {entry['clipped'] * 100:.2f}% of its calibration values"))
        elif peak and entry["threshold"] < THRESHOLD_BELOW_PEAK * peak:
            suspects.append((1 - entry["threshold"] / peak, name, entry,
                             f"is {entry['threshold'] / peak * 100:.1f}% of the peak {peak:.4g} the reference "
                             "reaches on the validation samples"))
    if not suspects:
        return None
    _, name, entry, how = max(suspects, key=lambda item: item[0])
    return name, entry, how
