"""The report model: one JSON-able dict built from the stage results of a run.
Renderers (render.py) turn it into Markdown and HTML."""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Optional

import pipeline
from pipeline import environment
from pipeline.config.schemas import RunConfig
from pipeline.precision import kinds


SCHEMA_VERSION = 1  # report.json layout: docs/report.md, docs/report.schema.json


def model_name(cfg: RunConfig) -> str:
    return cfg.model.name or Path(cfg.model.path).stem


def assemble(cfg: RunConfig, records: List[dict], results: Dict, considered: Optional[List[str]] = None) -> dict:
    """``considered``: the precisions the job built or weighed (precision=auto's candidates);
    None: the run's own precision. ``results``: the stages' results, their typed summaries
    (stages/results.py) read by attribute and written as their JSON."""
    summaries = {name: result.summary for name, result in results.items()}
    verify, convert = summaries.get("verify"), summaries.get("convert")
    report = {
        "schema_version": SCHEMA_VERSION,
        "parity_version": pipeline.__version__,
        "verdict": verify.verdict if verify else "unverified",
        "exit_code": verify.exit_code if verify else 0,
        "reasons": verify.reasons if verify else ["the verify stage was not run"],
        "warnings": _warnings(cfg, summaries, considered),
        "model": {"name": model_name(cfg), "path": str(Path(cfg.model.path).expanduser().resolve()),
                  "sha256": convert.source_sha256 if convert else None},
        "target": {"name": cfg.target.name, "backend": cfg.target.backend.value, "device": cfg.target.device,
                   "threads": cfg.target.threads, "memory": cfg.target.memory.value,
                   "memory_mode": cfg.target.memory_mode},
        "precision": cfg.precision.kind,
        "stages": [{k: v for k, v in r.items() if k != "key"} for r in records],
        "convert": _json(convert),
        "calibration": summaries["calibrate"].report() if "calibrate" in summaries else None,
    }
    verified = _json(verify)
    return {**report, "sensitivity": _json(summaries.get("sensitivity")), "build": _json(summaries.get("build")),
            "tuning": _json(summaries.get("tune")), "data": verify.data if verify else None, "verify": verified,
            "profile": _json(summaries.get("profile")), "environment": environment.describe()}


def _json(summary) -> Optional[dict]:
    return summary.to_json() if summary is not None else None


def _warnings(cfg: RunConfig, summaries: Dict, considered: Optional[List[str]]) -> List[str]:
    """The report's warnings, in the order of the stages that raised them (verify's data first)."""
    verify, convert = summaries.get("verify"), summaries.get("convert")
    warnings = verify.data_warnings if verify else []
    if "calibrate" in summaries:
        warnings += [f"calibration: {w}" for w in summaries["calibrate"].warnings or [] if w not in warnings]
    if "sensitivity" in summaries and summaries["sensitivity"].warning:
        warnings.append(f"sensitivity: {summaries['sensitivity'].warning}")
    quantization = summaries["build"].quantization if "build" in summaries else None
    for name in (quantization.keep_float_not_found if quantization else None) or []:
        warnings.append(f"precision.keep_float: op {name} is not in the prepared graph (folded into another op), "
                        "nothing to keep in float")
    if convert:  # fp16_overflow concerns half builds, or auto weighing one
        warnings += preflight_warnings(convert.preflight,
                                       half=any(map(kinds.half, considered or [cfg.precision.kind])))
        warnings += [f"convert: output {m['output']!r} is declared {m['declared']} but the model returns "
                     f"{m['returned']}; runtime.yaml lists the declared shape" for m in convert.shape_mismatches]
    if verify:  # checks that warn (int8 ran partly in float) and a reference far from float64 truth
        warnings += verify.check_warnings
    if verify and verify.speed_warning:
        warnings.append(f"speed: {verify.speed_warning}")
    return warnings


PREFLIGHT_SAID = {"nan_inf": "hold NaN or Inf", "fp16_overflow": "exceed fp16's range",
                  "fp32_denormal": "hold float32 denormals (slow on CPUs)"}
PREFLIGHT_LISTED = 3  # findings of one kind named one per line; more are summed up in one


def preflight_warnings(findings: List[dict], half: bool = True) -> List[str]:
    """One line per warning finding; a kind found in many tensors (a model's weights full
    of denormals) is one line naming the first few, the report lists them all. Without
    ``half`` (no fp16 or bf16 build made or weighed) constants beyond fp16's range warn of
    nothing: the report's pre-flight table still lists them."""
    lines = []
    for check, said in PREFLIGHT_SAID.items():
        if check == "fp16_overflow" and not half:
            continue
        found = [f for f in findings if f["check"] == check and f["severity"] != "info"]
        if len(found) <= PREFLIGHT_LISTED:
            lines += [f"pre-flight: {f['tensor']}: {f['detail']}" for f in found]
        else:
            named = ", ".join(f["tensor"] for f in found[:PREFLIGHT_LISTED])
            lines.append(f"pre-flight: {len(found)} tensors {said}: {named}, ... (every one in the report's "
                         "convert pre-flight table)")
    return lines
