"""Tests for pipeline.report.render: Markdown and self-contained HTML reports."""

from __future__ import annotations

import copy
import re
from html.parser import HTMLParser

import pytest

from pipeline.report import render_html, render_markdown
from pipeline.report.render import nice_ticks, svg_bar_chart, svg_line_chart, tick_labels

VOID_TAGS = {"meta", "br", "hr", "img", "input", "link", "col", "area", "base", "wbr", "source"}


def full_report() -> dict:
    cosines = [0.99999, 0.999985, 0.999992, 0.99998, 0.999999]
    max_abs = [1e-6, 2e-6, 1.5e-6, 3e-6, 5e-7]
    return {
        "parity_version": "0.1.0",
        "verdict": "pass",
        "exit_code": 0,
        "reasons": [],
        "warnings": ["random data: no labels, task metric skipped"],
        "model": {"name": "digits_cnn", "path": "/abs/digits_cnn.onnx",
                  "sha256": "ab12cd34ef56ab12cd34ef56ab12cd34ef56ab12cd34ef56ab12cd34ef56abcd"},
        "target": {"name": "ort_cpu", "backend": "onnxruntime", "device": "CPU", "threads": 0,
                   "memory_mode": "auto"},
        "precision": "fp32",
        "stages": [
            {"stage": "convert", "status": "computed", "seconds": 0.41, "computed_seconds": 0.41},
            {"stage": "build", "status": "cached", "seconds": 0.01, "computed_seconds": 0.2},
            {"stage": "verify", "status": "computed", "seconds": 1.234, "computed_seconds": 1.234},
        ],
        "convert": {
            "source": "/abs/digits_cnn.onnx",
            "source_sha256": "ab12cd34ef56ab12cd34ef56ab12cd34ef56ab12cd34ef56ab12cd34ef56abcd",
            "opset": {"from": 11, "to": 13},
            "ir_version": {"from": 7, "to": 8},
            "nodes": 9,
            "op_types": {"Conv": 2, "Relu": 3, "Gemm": 1, "Flatten": 1, "MaxPool": 2},
            "inputs": [{"name": "input", "shape": [1, 1, 8, 8], "dtype": "float32"}],
            "outputs": [{"name": "logits", "shape": [1, 10], "dtype": "float32"},
                        {"name": "probs", "shape": [1, 10], "dtype": "float32"}],
            "fixed_shapes": {"x": {"from": ["?", 3, 48, "?"], "to": [1, 3, 48, 192]}},
            "preflight": [{"tensor": "bn.var", "check": "fp16_overflow", "count": 1,
                           "detail": "max |x| 9.8e7 > 65504", "severity": "warning"}],
        },
        "build": {"backend": "openvino", "files": ["model.xml", "model.bin"],
                  "options": {"INFERENCE_PRECISION_HINT": "f32"}},
        "data": {"kind": "tensors", "warnings": [],
                 "splits": {"calibration": {"samples": 64, "source": "random", "labeled": False},
                            "validation": {"samples": 200, "source": "/data/val.npz", "labeled": True}}},
        "verify": {
            "samples": 5,
            "requested": {"device": "CPU", "precision": "fp32"},
            "effective": {"device": "CPU", "precision": "fp32", "layers": "fp32: 4"},
            "outputs": [
                {"name": "logits", "passed": True, "failures": [],
                 "thresholds": {"min_cosine": 0.9999, "max_abs_error": None,
                                "max_mean_abs_error": None, "min_sqnr_db": None},
                 "metrics": {"cosine": 0.99999, "min_sample_cosine": 0.99998, "max_abs": 3e-6,
                             "mean_abs": 1.234e-7, "rel_l2": 4.56e-7, "sqnr_db": 140.2, "nan": 0,
                             "inf": 0, "reference_nan": 0, "reference_inf": 0, "elements": 50},
                 "per_sample": {"cosine": cosines, "max_abs": max_abs}},
                {"name": "probs", "passed": True, "failures": [],
                 "thresholds": {"min_cosine": 0.9999},
                 "metrics": {"cosine": 1.0, "min_sample_cosine": 1.0, "max_abs": 0.0,
                             "mean_abs": 0.0, "rel_l2": 0.0, "sqnr_db": None, "nan": 0, "inf": 0},
                 "per_sample": {"cosine": [1.0] * 5, "max_abs": [0.0] * 5}},
            ],
            "task": {"metric": "top1", "output": "logits", "reference": 0.985, "target": 0.98,
                     "drop": 0.005, "agreement": 0.995, "max_drop": 0.01, "passed": True,
                     "interval": [0.0, 0.015], "agreement_interval": [0.985, 1.0], "confidence": 0.95,
                     "resamples": 1000, "uncertain": False, "require_confidence": False},
        },
        "environment": {"versions": {"python": "3.11.7", "onnx": "1.23.2", "onnxruntime": "1.22.0"},
                        "cpu": {"model": "AMD EPYC 7B13", "flags": ["avx2", "f16c", "fma"]},
                        "platform": "Linux-6.1-x86_64"},
    }


def failing_report() -> dict:
    report = full_report()
    report["verdict"] = "fail"
    report["exit_code"] = 1
    report["reasons"] = ["logits: cosine 0.912345 < 0.9999", "precision mismatch: requested fp16, ran fp32"]
    out = report["verify"]["outputs"][0]
    out["passed"] = False
    out["failures"] = ["min_cosine", "max_abs_error"]
    out["metrics"]["cosine"] = 0.912345
    out["metrics"]["nan"] = 3
    report["verify"]["requested"]["precision"] = "fp16"
    return report


class StrictParser(HTMLParser):
    """Checks that every non-void element is closed in the right order."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.stack: list = []
        self.errors: list = []
        self.tags: list = []
        self.urls: list = []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        self.urls += [v for k, v in attrs if k in ("href", "src", "xlink:href") and v]
        if tag not in VOID_TAGS:
            self.stack.append(tag)

    def handle_startendtag(self, tag, attrs):
        self.tags.append(tag)

    def handle_endtag(self, tag):
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"unexpected </{tag}>, open: {self.stack[-3:]}")
        else:
            self.stack.pop()


def parse(page: str) -> StrictParser:
    parser = StrictParser()
    parser.feed(page)
    parser.close()
    assert parser.errors == []
    assert parser.stack == [], f"unclosed tags: {parser.stack}"
    return parser


def test_full_report_markdown_has_all_sections_and_values():
    md = render_markdown(full_report())
    assert md.startswith("# parity report: digits_cnn on ort_cpu (fp32)\n")
    assert "PASS" in md and "exit code 0" in md
    for heading in ("## Verification", "## Stages", "## Model & conversion", "## Pre-flight findings",
                    "## Data", "## Build", "## Environment"):
        assert heading in md
    for name in ("logits", "probs"):
        assert f"| {name} | PASS |" in md
    assert "0.999990" in md  # cosine, 6 decimals
    assert "0.999980" in md  # min sample cosine
    assert "1.23e-07" in md  # mean abs, %.3g
    assert "4.56e-07" in md  # rel L2
    assert "140.2" in md
    assert "1.23 " in md or "| 1.23 |" in md  # seconds, %.2f
    assert "11 → 13" in md and "7 → 8" in md
    assert "[?, 3, 48, ?]" in md and "[1, 3, 48, 192]" in md
    assert "ab12cd34ef56…" in md
    assert "fp16_overflow" in md and "max \\|x\\| 9.8e7 > 65504" in md  # pipe escaped in cell
    assert "random data: no labels" in md
    assert "INFERENCE_PRECISION_HINT" in md and "model.bin" in md
    assert "AMD EPYC 7B13" in md and "avx2 f16c fma" in md
    assert ("| top1 | logits | 0.9850 | 0.9800 | 0.0050 | [0.0000, 0.0150] | 0.0100 | 0.9950 | [0.9850, 1.0000] "
            "| PASS |") in md
    uncertain = full_report()
    uncertain["verify"]["task"].update(uncertain=True, samples_to_resolve=800)
    assert "about 800 validation samples would resolve it" in render_markdown(uncertain)
    assert "0.999980 (sample 3)" in md  # worst per-sample cosine
    assert "<svg" not in md


def test_markdown_tables_have_consistent_columns():
    check_table_columns(render_markdown(full_report()))


def check_table_columns(md: str) -> None:
    lines = md.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith("|"):
            block = []
            while i < len(lines) and lines[i].startswith("|"):
                block.append(lines[i])
                i += 1
            widths = {len(re.findall(r"(?<!\\)\|", row)) for row in block}
            assert len(widths) == 1, block
        i += 1


def test_full_report_html_is_well_formed_self_contained_with_charts():
    page = render_html(full_report())
    parser = parse(page)
    assert page.startswith("<!DOCTYPE html>")
    assert "<svg" in page
    assert parser.tags.count("svg") == 5  # 2 outputs x 2 per-sample charts + stage bar chart
    assert "polyline" in parser.tags and "rect" in parser.tags
    assert "http://" not in page and "https://" not in page
    assert parser.urls == []
    assert "<script" not in page.lower()
    assert "<link" not in page.lower() and "@import" not in page and "url(" not in page
    assert 'class="banner verdict-pass"' in page
    for name in ("logits", "probs"):
        assert f"<td>{name}</td>" in page
    assert "0.999990" in page and "140.2" in page
    assert "stage wall time" in page and "cached" in page
    assert "logits: per-sample cosine" in page and "logits: per-sample max abs error" in page


def test_failing_report_shows_fail_and_reasons():
    report = failing_report()
    md = render_markdown(report)
    page = render_html(report)
    parse(page)
    assert "FAIL" in md and "exit code 1" in md
    assert "### Reasons" in md
    for reason in report["reasons"]:
        assert f"- {reason}" in md
        assert reason.replace("<", "&lt;") in page
    assert "| logits | FAIL | 0.912345 |" in md
    assert "min_cosine; max_abs_error" in md
    assert "⚠ MISMATCH" in md
    assert "| precision | fp16 | fp32 | ⚠ MISMATCH |" in md
    assert 'class="banner verdict-fail"' in page and ">FAIL<" in page
    assert '<tr class="row-fail"><td>logits</td>' in page
    assert '<tr class="row-mismatch"><td>precision</td>' in page
    assert "3 (reference" not in md and "| 3 |" in md


def test_unverified_report_is_grey():
    report = {"verdict": "unverified", "exit_code": 0, "reasons": ["the verify stage was not run"]}
    md = render_markdown(report)
    page = render_html(report)
    parse(page)
    assert "UNVERIFIED" in md and "the verify stage was not run" in md
    assert 'class="banner verdict-unverified"' in page and "UNVERIFIED" in page
    odd = render_html({"verdict": "error\" onclick=\"x"})
    parse(odd)
    assert 'class="banner verdict-other"' in odd and "onclick=\"" not in odd


def test_dynamic_strings_are_escaped():
    report = full_report()
    evil = "<script>alert(1)</script>"
    report["model"]["name"] = evil
    report["verify"]["outputs"][0]["name"] = evil
    report["warnings"] = [evil]
    report["build"]["options"] = {evil: evil}
    report["environment"]["versions"]["x<y"] = '"quoted" & <b>'
    page = render_html(report)
    parse(page)
    assert "<script" not in page.lower()
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "<title>parity report: &lt;script&gt;" in page
    assert "&quot;quoted&quot; &amp; &lt;b&gt;" in page
    assert "<b>" not in page
    # the SVG chart title carries the output name too: escaped there as well
    assert "&lt;script&gt;alert(1)&lt;/script&gt;: per-sample cosine" in page


def test_markdown_escapes_pipes_and_newlines_in_cells():
    report = full_report()
    report["verify"]["outputs"][0]["name"] = "a|b\nc"
    md = render_markdown(report)
    assert "| a\\|b c | PASS |" in md


def test_none_sqnr_renders_as_infinite():
    report = full_report()
    md = render_markdown(report)
    page = render_html(report)
    assert "∞ (identical)" in md
    assert "<td>∞ (identical)</td>" in page
    assert "| probs | PASS | 1.000000 | 1.000000 | 0 | 0 | 0 | ∞ (identical) |" in md
    # a report without the key at all is "n/a", not infinite
    del report["verify"]["outputs"][1]["metrics"]["sqnr_db"]
    assert "| probs | PASS | 1.000000 | 1.000000 | 0 | 0 | 0 | n/a |" in render_markdown(report)


@pytest.mark.parametrize("key", ["verify", "stages", "convert", "build", "data", "environment",
                                 "model", "target", "precision", "reasons", "warnings", "verdict",
                                 "exit_code", "parity_version"])
def test_missing_or_none_sections_do_not_crash(key):
    for value in ("missing", None):
        report = full_report()
        if value == "missing":
            del report[key]
        else:
            report[key] = None
        md = render_markdown(report)
        parse(render_html(report))
        assert md.startswith("# parity report:")


def test_sections_are_skipped_when_missing():
    report = full_report()
    for key in ("verify", "stages", "build", "data", "environment"):
        report[key] = None
    del report["convert"]
    md = render_markdown(report)
    for heading in ("## Verification", "## Stages", "## Pre-flight findings", "## Data", "## Build",
                    "## Environment"):
        assert heading not in md
    assert "## Model & conversion" in md  # still has the model block
    assert "<svg" not in render_html(report)


def test_minimal_and_partial_dicts_do_not_crash():
    for report in ({}, {"verify": {}}, {"verify": {"outputs": [{}], "task": None}},
                   {"verify": {"outputs": [{"name": "y", "per_sample": {"cosine": [], "max_abs": []}}]}},
                   {"verify": {"outputs": [{"name": "y", "per_sample": {"cosine": [float("nan"), None, 0.5]}}]}},
                   {"stages": [{"stage": "convert"}, {}]},
                   {"convert": {"preflight": []}}, {"convert": {"opset": 13}},
                   {"data": {"splits": {"validation": None}}}, {"environment": {"cpu": None}}):
        md = render_markdown(report)
        parse(render_html(report))
        assert md.startswith("# parity report: unknown model on unknown target (?)")
    assert "no findings" in render_markdown({"convert": {"preflight": []}})
    with pytest.raises(TypeError):
        render_markdown(None)


def test_non_finite_per_sample_values_are_counted_not_drawn():
    report = {"verify": {"outputs": [{"name": "y", "per_sample": {
        "cosine": [0.5, float("nan"), 0.75], "max_abs": [0.1, float("inf"), 0.2]}}]}}
    page = render_html(report)
    parse(page)
    assert "1 non-finite not drawn" in page
    assert "nan" not in re.sub(r"<text[^>]*>[^<]*</text>", "", page.split("<svg", 1)[1]).lower()
    assert "| y | 3 | 0.500000 (sample 0) | 0.2 (sample 2) | 2 |" in render_markdown(report)


def test_output_is_deterministic():
    report = full_report()
    assert render_markdown(report) == render_markdown(copy.deepcopy(report))
    assert render_html(report) == render_html(copy.deepcopy(report))
    failing = failing_report()
    assert render_html(failing) == render_html(failing)


def test_stage_chart_colours_cached_stages_differently():
    page = render_html(full_report())
    chart = page[page.index("stage wall time"):]
    chart = chart[:chart.index("</svg>")]
    fills = re.findall(r'<rect x="\d+" y="\d+" width="[\d.]+" height="18" fill="(#[0-9a-f]{6})"', chart)
    assert len(fills) == 3
    assert fills[0] == fills[2] != fills[1]  # build is cached
    assert ">computed</text>" in chart and ">cached</text>" in chart


def test_svg_helpers_directly():
    bar = svg_bar_chart(["a", "b"], [1.0, None], title="t", x_label="s")
    parse(bar)
    assert bar.count("<rect") == 2 and "n/a" in bar
    line = svg_line_chart([1.0, 1.0, 1.0], title="flat", x_label="i", y_label="v")
    parse(line)
    assert "<polyline" in line and line.count("<circle") == 3
    empty = svg_line_chart([], title="none", x_label="i", y_label="v")
    parse(empty)
    assert "no finite values" in empty and "<polyline" not in empty


def test_nice_ticks_cover_range_and_labels_differ():
    for lo, hi in ((0.0, 1.234), (0.99998, 0.99999), (0.0, 3e-6), (5.0, 5.0), (0.0, 0.0), (-2.0, 7.0)):
        ticks, step = nice_ticks(lo, hi)
        tolerance = step * 1e-6  # ticks are k * step: allow float rounding of the product
        assert ticks[0] <= lo + tolerance and ticks[-1] >= hi - tolerance
        assert 2 <= len(ticks) <= 12
        labels = tick_labels(ticks, step)
        assert len(set(labels)) == len(labels), labels
    ticks, step = nice_ticks(0, 2, integer=True)
    assert step == 1 and tick_labels(ticks, step) == ["0", "1", "2"]


# ---------------------------------------------------------------------------
# Layerwise comparison, minimum tolerances, recommendations, backend crashes


def test_compiled_templates_are_kept_in_the_cache_and_read_back_the_same(tmp_path):
    """A job keeps the report templates' compiled code in its stage cache (compiling took
    0.1 s of each job); a new process renders from it what it renders without it, and a
    folder that cannot be made is no error."""
    import json
    import subprocess
    import sys

    script = ("import json, sys; from pathlib import Path; from pipeline.report import render;"
              "folder = sys.argv[1]; folder and render.keep_compiled_templates(Path(folder));"
              "print(json.dumps([render.render_markdown(json.loads(sys.argv[2])),"
              "render.render_html(json.loads(sys.argv[2]))]))")
    report = json.dumps(full_report())
    (tmp_path / "a file").write_text("")

    def rendered(folder: str):
        done = subprocess.run([sys.executable, "-c", script, folder, report], capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    plain = rendered("")
    cache = tmp_path / "cache" / "templates"
    assert rendered(str(cache)) == plain and len(list(cache.glob("*.cache"))) >= 2  # written
    assert rendered(str(cache)) == plain  # read back
    assert rendered(str(tmp_path / "a file" / "templates")) == plain
