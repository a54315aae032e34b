"""The one context both report templates render: the report dict as a list of blocks.

``build_context`` is the only place the report dict is read; report.md and report.html
are two renderings of what it returns (pipeline/report/render.py), so they show the same
sections in the same order. Every section is optional: a section whose key is missing or
None is skipped.
"""

from __future__ import annotations

from pipeline.report.formatting import as_dict, as_list
from pipeline.report.sections_run import (build_section, calibration_section, data_section, environment_section,
                                          model_section, preflight_section, profile_section, sensitivity_section,
                                          stages_section, tuning_section)
from pipeline.report.sections_verify import (auto_section, diagnosis_section, header_section, layerwise_section,
                                             recommendations_section, report_title, verification_section)


def build_context(report: dict) -> dict:
    """What the templates get: ``title`` (the HTML page's) and ``blocks``."""
    blocks = build_document(report)  # a TypeError for anything but a dict
    return {"title": report_title(report), "blocks": blocks}


def build_document(report: dict) -> list:
    """The report as a list of blocks, shared by both renderers."""
    if not isinstance(report, dict):
        raise TypeError(f"report must be a dict, got {type(report).__name__}")
    blocks = header_section(report)
    if isinstance(report.get("auto"), dict):
        blocks += auto_section(report["auto"])
    if isinstance(report.get("verify"), dict):
        verify = report["verify"]
        blocks += verification_section(verify)
        if isinstance(verify.get("layerwise"), dict):
            blocks += layerwise_section(verify["layerwise"])
        if isinstance(verify.get("recommendations"), (list, tuple)):
            blocks += recommendations_section(list(verify["recommendations"]))
        if isinstance(verify.get("diagnosis"), dict):
            blocks += diagnosis_section(verify["diagnosis"])
    if isinstance(report.get("profile"), dict):
        blocks += profile_section(report["profile"])
    if isinstance(report.get("stages"), (list, tuple)):
        blocks += stages_section(list(report["stages"]))
    model, convert = as_dict(report.get("model")), as_dict(report.get("convert"))
    if model or convert:
        blocks += model_section(model, convert)
    if convert.get("preflight") is not None:
        blocks += preflight_section(as_list(convert["preflight"]))
    if isinstance(report.get("calibration"), dict):
        blocks += calibration_section(report["calibration"])
    if isinstance(report.get("sensitivity"), dict) and not as_dict(
            report["sensitivity"]).get("skipped", "").startswith("precision"):
        blocks += sensitivity_section(report["sensitivity"])
    if isinstance(report.get("data"), dict):
        blocks += data_section(report["data"])
    if isinstance(report.get("build"), dict):
        blocks += build_section(report["build"])
    if isinstance(report.get("tuning"), dict):
        blocks += tuning_section(report["tuning"])
    if isinstance(report.get("environment"), dict):
        blocks += environment_section(report["environment"])
    return blocks

