"""precision=auto, the default: every candidate built, verified and timed side by side, the
fastest passing one shipped (pipeline/auto.py)."""

from __future__ import annotations

import pytest

from conftest import read_report, run_cli, run_dirs, single_bundle
from pipeline.auto import choose


@pytest.fixture(scope="module")
def auto_run(tmp_path_factory):
    """`parity` with no arguments: the embedded digits model on ort_cpu, precision=auto."""
    cwd = tmp_path_factory.mktemp("auto")
    result = run_cli([], cwd, default_precision=None)
    return cwd, result


def test_the_default_ships_the_fastest_passing_candidate(auto_run):
    cwd, result = auto_run
    assert result.returncode == 0, result.stdout + result.stderr
    run_dir = run_dirs(cwd)[-1]
    report = read_report(run_dir)
    section = report["auto"]
    rows = {row["precision"]: row for row in section["candidates"]}
    assert list(rows) == ["fp32", "int8", "mixed"]  # ONNX Runtime's candidates; fp16 has no CPU kernels
    assert all(row["verdict"] == "pass" for row in rows.values())
    # every passing build timed in the same interleaved rounds as fp32
    assert all(row["latency"]["rounds"] >= 3 and row["latency"]["median_ms"] > 0 for row in rows.values())
    assert all("speedup" in row for p, row in rows.items() if p != "fp32")
    # the rule, re-applied to the measured rows, gives what was shipped
    assert section["chosen"] == choose(rows)[0] and section["why"] == choose(rows)[1]
    if all(row["speedup"]["speedup_p75"] < 1.0 for p, row in rows.items() if p != "fp32"):
        assert section["chosen"] == "fp32"  # int8 measured slower than fp32 here: fp32 ships
    shipped = section["chosen"]
    assert report["precision"] == shipped and report["verify"]["effective"]["precision"] in (shipped, "int8")
    assert single_bundle(run_dir).name == f"digits_cnn-ort_cpu-{shipped}"
    assert f"precision=auto shipped {shipped}" in result.stdout
    assert "precision=auto candidates" in result.stdout
    assert "## precision=auto" in (run_dir / "report.md").read_text()
    # the candidates share the cached work: one convert for all, calibrate reused by mixed
    assert {s["stage"]: s["status"] for s in report["stages"]}["verify"] == "cached"
    for precision in rows:
        assert (run_dir / "candidates" / precision / "stages" / "verify" / "result.json").is_file()


def test_nothing_passes_fails_with_the_closest_candidate(tmp_path):
    """No build can match ONNX Runtime's fp32 to 1e-12 on OpenVINO: the run fails with the
    reasons of the candidate closest to passing, and says so."""
    result = run_cli(["precision=auto", "target=openvino_cpu", "precision.candidates=[fp32,int8]",
                      "+validation.outputs={logits:{max_abs_error:1e-12}}"], tmp_path)
    assert result.returncode == 3, result.stdout + result.stderr
    report = read_report(run_dirs(tmp_path)[-1])
    assert report["auto"]["chosen"] == "fp32" and report["auto"]["why"].startswith("no candidate passes: fp32")
    assert report["verdict"] == "fail" and report["reasons"][0].startswith("output logits: max abs error")
    assert {row["verdict"] for row in report["auto"]["candidates"]} == {"fail"}


def test_a_candidate_the_target_cannot_build_is_a_config_error(tmp_path):
    result = run_cli(["precision=auto", "precision.candidates=[fp32,bf16]"], tmp_path)
    assert result.returncode == 2
    assert "precision.candidates: target ort_cpu cannot build 'bf16'" in result.stderr
    assert "Traceback" not in result.stderr


def _row(precision, median, p25, p75, size, verdict="pass"):
    return {"precision": precision, "verdict": verdict, "bytes": size, "cosine": 0.999,
            "latency": {"median_ms": median, "p25_ms": p25, "p75_ms": p75}}


def test_choose_ties_go_to_the_smaller_then_the_higher_precision():
    rows = {"fp32": _row("fp32", 10.0, 9.5, 10.5, 400), "int8": _row("int8", 5.0, 4.8, 5.2, 100),
            "mixed": _row("mixed", 5.1, 4.9, 5.3, 150)}
    assert choose(rows)[0] == "int8"
    rows["mixed"]["bytes"] = 100  # same size, same speed within the spread: the higher precision
    assert choose(rows)[0] == "mixed"
    rows["int8"]["verdict"] = rows["mixed"]["verdict"] = "fail"
    assert choose(rows)[0] == "fp32"
    rows["fp32"]["latency"]["median_ms"] = 2.0  # fastest now, and the only one passing
    assert choose(rows)[0] == "fp32"
