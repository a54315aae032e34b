"""Tests for pipeline.report.junit: the report's verification as JUnit XML."""

from __future__ import annotations

import copy
import xml.etree.ElementTree as ET

import pytest

from pipeline.report import junit_xml, write_junit
from tests.test_report_render import full_report
from tests.test_report_render_diagnosis import crash_report

SUITE = "parity.ort_cpu.fp32"


def parse(text: str):
    """(root, the one testsuite, {case name: case element})"""
    root = ET.fromstring(text.encode("utf-8"))
    assert root.tag == "testsuites"
    suites = root.findall("testsuite")
    assert len(suites) == 1
    suite = suites[0]
    cases = suite.findall("testcase")
    names = [c.get("name") for c in cases]
    assert len(set(names)) == len(names), names
    # the counts on the suite (and the root) are the counts of its cases
    failures = sum(1 for c in cases if c.find("failure") is not None)
    errors = sum(1 for c in cases if c.find("error") is not None)
    for element in (root, suite):
        assert element.get("tests") == str(len(cases))
        assert element.get("failures") == str(failures)
        assert element.get("errors") == str(errors)
    return root, suite, {c.get("name"): c for c in cases}


def counts(suite) -> tuple:
    return int(suite.get("tests")), int(suite.get("failures")), int(suite.get("errors"))


def failure(case, tag: str = "failure") -> str:
    element = case.find(tag)
    assert element is not None, f"{case.get('name')} has no <{tag}>"
    return element.get("message")


def test_passing_report():
    _, suite, cases = parse(junit_xml(full_report()))
    assert suite.get("name") == SUITE
    assert list(cases) == [
        "logits: no NaN/Inf", "logits: min_cosine >= 0.9999",
        "probs: no NaN/Inf", "probs: min_cosine >= 0.9999",
        "top1 drop <= 0.01", "top1 drop 95 % interval within 0.01", "requested device and precision ran",
        "compared at least one output on at least one sample"]
    assert counts(suite) == (8, 0, 0)
    assert cases["logits: min_cosine >= 0.9999"].get("classname") == f"{SUITE}.outputs"
    assert cases["top1 drop <= 0.01"].get("classname") == f"{SUITE}.task"
    assert all(c.find("failure") is None and c.find("error") is None for c in cases.values())
    props = {p.get("name"): p.get("value") for p in suite.find("properties")}
    assert props["model"] == "digits_cnn" and props["verdict"] == "pass" and props["exit_code"] == "0"
    assert suite.get("time") == "1.234"  # the verify stage's wall time


def test_every_set_threshold_is_a_case():
    report = full_report()
    report["verify"]["outputs"][0]["thresholds"] = {"min_cosine": 0.995, "max_abs_error": 1e-5,
                                                    "max_mean_abs_error": 1e-6, "min_sqnr_db": 30.0}
    _, suite, cases = parse(junit_xml(report))
    for name in ("logits: min_cosine >= 0.995", "logits: max_abs_error <= 1e-05",
                 "logits: max_mean_abs_error <= 1e-06", "logits: min_sqnr_db >= 30"):
        assert name in cases and cases[name].find("failure") is None
    assert counts(suite) == (11, 0, 0)
    # identical outputs: SQNR None is infinite and passes
    report["verify"]["outputs"][1]["thresholds"]["min_sqnr_db"] = 200.0
    _, suite, cases = parse(junit_xml(report))
    assert cases["probs: min_sqnr_db >= 200"].find("failure") is None


def test_failing_thresholds_report():
    report = full_report()
    report["verdict"], report["exit_code"] = "fail", 3
    out = report["verify"]["outputs"][0]
    out["thresholds"] = {"min_cosine": 0.995, "max_abs_error": 1e-6, "max_mean_abs_error": None,
                         "min_sqnr_db": None}
    out["metrics"].update(cosine=0.912345, nan=2, inf=1)
    out["passed"] = False
    report["verify"]["task"].update(drop=0.05, target=0.935, passed=False)
    _, suite, cases = parse(junit_xml(report))
    assert counts(suite) == (9, 4, 0)
    assert failure(cases["logits: no NaN/Inf"]) == "2 NaN and 1 Inf values in the output"
    assert failure(cases["logits: min_cosine >= 0.995"]) == "cosine 0.912345 < 0.995"
    assert failure(cases["logits: max_abs_error <= 1e-06"]) == "max_abs 3e-06 > 1e-06"
    assert failure(cases["top1 drop <= 0.01"]) == "top1 dropped 5.00 points (0.9850 -> 0.9350), allowed 0.01"
    assert cases["probs: min_cosine >= 0.9999"].find("failure") is None
    assert "logits: max_mean_abs_error <= None" not in cases  # unset thresholds are not cases
    assert cases["logits: min_cosine >= 0.995"].find("failure").get("type") == "threshold"


def test_an_uncertain_drop_is_skipped_with_the_warning_or_fails_when_required():
    report = full_report()
    report["verify"]["task"].update(uncertain=True, samples_to_resolve=800)
    _, suite, cases = parse(junit_xml(report))
    case = cases["top1 drop 95 % interval within 0.01"]
    assert case.find("failure") is None and "about 800 samples would resolve it" in case.find("skipped").get("message")
    report["verify"]["task"]["require_confidence"] = True
    _, suite, cases = parse(junit_xml(report))
    assert "[0, 0.015]" in failure(cases["top1 drop 95 % interval within 0.01"]) and counts(suite) == (8, 1, 0)


def test_nan_metric_never_passes():
    report = full_report()
    report["verify"]["outputs"][0]["metrics"]["cosine"] = float("nan")
    _, suite, cases = parse(junit_xml(report))
    assert failure(cases["logits: min_cosine >= 0.9999"]) == "cosine nan < 0.9999"
    assert counts(suite) == (8, 1, 0)


def test_stage_verdict_the_cases_do_not_explain_still_fails():
    report = full_report()
    report["verify"]["outputs"][1].update(passed=False, failures=["a check this file does not know"])
    _, suite, cases = parse(junit_xml(report))
    assert failure(cases["probs: passed"]) == "a check this file does not know"
    assert counts(suite) == (9, 1, 0)


def test_device_precision_mismatch_follows_the_verdict_reasons():
    report = full_report()
    _, _, cases = parse(junit_xml(report))
    assert cases["requested device and precision ran"].find("failure") is None
    report["verify"]["reasons"] = ["requested device GPU but CPU ran", "requested precision mixed but fp32 ran",
                                   "output logits: cosine 0.9 < 0.995"]
    _, _, cases = parse(junit_xml(report))
    case = cases["requested device and precision ran"]
    assert case.get("classname") == f"{SUITE}.backend"
    assert failure(case) == "requested device GPU but CPU ran; requested precision mixed but fp32 ran"


@pytest.mark.parametrize("change, message", [
    ({"outputs": []}, "no outputs were compared"),
    ({"samples": 0}, "no validation samples were compared"),
    ({"samples": 0, "outputs": [], "task": None},
     "no outputs were compared; no validation samples were compared"),
])
def test_zero_comparison_report(change, message):
    report = full_report()
    report["verify"].update(change)
    _, suite, cases = parse(junit_xml(report))
    case = cases["compared at least one output on at least one sample"]
    assert case.get("classname") == f"{SUITE}.verify"
    assert failure(case) == message
    assert int(suite.get("failures")) == 1 and int(suite.get("errors")) == 0


def test_no_verify_stage_fails_rather_than_passing_on_nothing():
    for verify in (None, {}):
        report = full_report()
        report["verify"] = verify
        _, suite, cases = parse(junit_xml(report))
        assert counts(suite) == (1, 1, 0)
        assert failure(cases["compared at least one output on at least one sample"]) == "the verify stage did not run"
    _, suite, _ = parse(junit_xml({}))
    assert suite.get("name") == "parity.unknown.unknown"


def test_missing_output_is_a_failure():
    report = full_report()
    report["verify"]["missing_outputs"] = ["boxes"]
    _, suite, cases = parse(junit_xml(report))
    assert failure(cases["boxes: produced by the target"]) == "output boxes was not produced by the target"
    assert counts(suite) == (9, 1, 0)


def test_crash_report():
    report = crash_report()
    report["verify"]["crash"]["stderr_tail"].append("\x1b[31mred\x1b[0m and a bell \x07 and a NUL \x00")
    text = junit_xml(report)
    _, suite, cases = parse(text)  # control characters from stderr must not break the XML
    case = cases["backend openvino crashed"]
    assert case.get("classname") == f"{SUITE}.backend"
    error = case.find("error")
    assert error.get("message") == "the worker process died with SIGSEGV"
    assert error.get("type") == "crashed"
    assert "Segmentation fault (core dumped) <here> & ```x```" in error.text
    assert "red and a bell  and a NUL " in error.text
    assert int(suite.get("errors")) == 1
    # a crash before anything was compared: the error and the nothing-compared failure
    report["verify"] = {"crash": {"kind": "hung", "backend": "tensorrt", "detail": "no answer in 600 s"}}
    _, suite, cases = parse(junit_xml(report))
    assert counts(suite) == (2, 1, 1)
    assert failure(cases["backend tensorrt hung"], "error") == "no answer in 600 s"
    assert failure(cases["compared at least one output on at least one sample"]) == (
        "no outputs were compared; no validation samples were compared")


def test_write_junit_and_determinism(tmp_path):
    report = crash_report()
    path = tmp_path / "ci" / "junit.xml"
    write_junit(report, path)
    text = path.read_text(encoding="utf-8")
    assert text.startswith('<?xml version="1.0" encoding="utf-8"?>')
    assert text == junit_xml(copy.deepcopy(report))
    ET.parse(path)  # a file ElementTree reads back
    with pytest.raises(TypeError):
        junit_xml(None)


def test_escaping_of_names():
    report = full_report()
    report["verify"]["outputs"][0]["name"] = 'a<b>&"c"'
    _, _, cases = parse(junit_xml(report))
    assert 'a<b>&"c": no NaN/Inf' in cases
