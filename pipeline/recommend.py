"""Recommendations: a concrete fix named from the evidence of one verify run.

Each recommendation is data and text: ``{"kind", "text", "action"}``. ``action`` is
what a later stage or the user can apply as it is, e.g. ``{"keep_float": [ops]}`` (an
fp16 block list, a qtable, ncnn layers to mask), ``{"precision_hint": "f32"}`` or
``{"calibration": {tensor: method}}``."""

from __future__ import annotations

from typing import List, Optional

FP16_MAX = 65504.0
FLOAT_PRECISIONS = {"fp16": "fp16", "bf16": "bf16"}
OPENVINO_HINTS = {"fp32": "f32", "fp16": "f16", "bf16": "bf16"}
APPLIES_KEEP_FLOAT = ("fp16", "int8", "mixed")  # builds that honour precision.keep_float
CLIPPED_TOO_MUCH = 0.001  # a threshold that clips more than 0.1 % of values is suspect
# Without calibration statistics (an imported table): a threshold this far below the
# reference's own peak on the validation samples is suspect.
THRESHOLD_BELOW_PEAK = 0.25


def recommend(precision: str, backend: str, requested: dict, effective: dict,
              layerwise: Optional[dict], calibration: Optional[dict]) -> List[dict]:
    found = _fallbacks(precision, backend, requested, effective)
    if layerwise and layerwise.get("ran"):
        origin, culprit = layerwise.get("nan_origin"), layerwise.get("first_divergence")
        if origin:
            found.append(_nan_origin(origin, precision))
        if culprit and not (origin and culprit["tensor"] == origin["tensor"]):
            found.append(_divergence(culprit, precision, (calibration or {}).get("tensors", {})))
    for advice in found:
        keep = advice["action"].get("keep_float")
        if keep and precision in APPLIES_KEEP_FLOAT:
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
    if precision == "fp32" and ran in FLOAT_PRECISIONS:
        hint = OPENVINO_HINTS["fp32"] if backend == "openvino" else "fp32"
        found.append({"kind": "precision_fallback",
                      "text": f"backend ran {ran} where fp32 was requested: set the precision hint "
                              f"(OpenVINO INFERENCE_PRECISION_HINT={hint})",
                      "action": {"precision_hint": hint}})
    elif precision in FLOAT_PRECISIONS and ran == "fp32":
        found.append({"kind": "precision_unsupported",
                      "text": f"{precision} was requested but the backend ran fp32: this device has no native "
                              f"{precision} for these layers; ship precision=fp32 here, or {precision} on a "
                              "device that runs it",
                      "action": {"precision": "fp32"}})
    return found


def _nan_origin(origin: dict, precision: str) -> dict:
    peak = origin.get("reference_max_abs") or 0.0
    keep = [origin["op"], *origin.get("consumers", [])]
    if peak > FP16_MAX and precision in ("fp16", "bf16", "mixed", "fp32"):
        return {"kind": "fp16_overflow",
                "text": f"tensor {origin['tensor']} overflows fp16 (max {peak:.3g} > {FP16_MAX:g}) at op "
                        f"{origin['op']} ({origin['op_type']}): keep {' and '.join(keep)} in fp32",
                "action": {"keep_float": keep, "tensor": origin["tensor"]}}
    return {"kind": "nan_origin",
            "text": f"the first NaN/Inf appears at op {origin['op']} ({origin['op_type']}, tensor "
                    f"{origin['tensor']}, reference max {peak:.3g}): keep {origin['op']} in fp32 and check its "
                    "inputs for out-of-range values",
            "action": {"keep_float": [origin["op"]], "tensor": origin["tensor"]}}


def _divergence(culprit: dict, precision: str, table: dict) -> dict:
    op, tensor = culprit["op"], culprit["tensor"]
    where = f"first divergence at {culprit['op_type']} {op} (tensor {tensor}, cosine {culprit['cosine']:.4f})"
    if precision in ("int8", "mixed"):
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
    if precision in FLOAT_PRECISIONS:
        return {"kind": "float_precision",
                "text": f"{where}: keep {op} in fp32", "action": {"keep_float": [op]}}
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
