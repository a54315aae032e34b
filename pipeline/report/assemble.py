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
    None: the run's own precision."""
    verify = results["verify"].summary if "verify" in results else None
    convert = results["convert"].summary if "convert" in results else None
    warnings = list(verify["data"]["warnings"]) if verify else []
    calibration = _calibration(results)
    if calibration:
        warnings += [f"calibration: {w}" for w in calibration.get("warnings", []) if w not in warnings]
    if "sensitivity" in results and results["sensitivity"].summary.get("warning"):
        warnings.append(f"sensitivity: {results['sensitivity'].summary['warning']}")
    build = results["build"].summary if "build" in results else {}
    for name in (build.get("quantization") or {}).get("keep_float_not_found", []):
        warnings.append(f"precision.keep_float: op {name} is not in the prepared graph (folded into another op), "
                        "nothing to keep in float")
    if convert:  # fp16_overflow concerns half builds, or auto weighing one
        warnings += preflight_warnings(convert["preflight"],
                                       half=any(map(kinds.half, considered or [cfg.precision.kind])))
        warnings += [f"convert: output {m['output']!r} is declared {m['declared']} but the model returns "
                     f"{m['returned']}; runtime.yaml lists the declared shape"
                     for m in (convert.get("output_shapes") or {}).get("mismatches", [])]
    if verify:  # checks that warn (int8 ran partly in float) and a reference far from float64 truth
        warnings += [c["text"] for c in verify.get("checks") or [] if c["severity"] == "warning"]
        warnings += (verify.get("truth") or {}).get("warnings", [])
    if verify and (verify.get("speed") or {}).get("warning"):
        warnings.append(f"speed: {verify['speed']['warning']}")
    return {
        "schema_version": SCHEMA_VERSION,
        "parity_version": pipeline.__version__,
        "verdict": verify["verdict"] if verify else "unverified",
        "exit_code": verify["exit_code"] if verify else 0,
        "reasons": verify["reasons"] if verify else ["the verify stage was not run"],
        "warnings": warnings,
        "model": {"name": model_name(cfg), "path": str(Path(cfg.model.path).expanduser().resolve()),
                  "sha256": convert["source_sha256"] if convert else None},
        "target": {"name": cfg.target.name, "backend": cfg.target.backend.value, "device": cfg.target.device,
                   "threads": cfg.target.threads, "memory": cfg.target.memory.value,
                   "memory_mode": cfg.target.memory_mode},
        "precision": cfg.precision.kind,
        "stages": [{k: v for k, v in r.items() if k != "key"} for r in records],
        "convert": convert,
        "calibration": _calibration(results),
        "sensitivity": results["sensitivity"].summary if "sensitivity" in results else None,
        "build": results["build"].summary if "build" in results else None,
        "tuning": results["tune"].summary if "tune" in results else None,
        "data": verify["data"] if verify else None,
        "verify": verify,
        "profile": results["profile"].summary if "profile" in results else None,
        "environment": environment.describe(),
    }


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


def _calibration(results: Dict):
    """The calibrate stage's summary without the per-tensor method errors (kept in the stage folder)."""
    if "calibrate" not in results:
        return None
    return {k: v for k, v in results["calibrate"].summary.items() if k != "auto"}
