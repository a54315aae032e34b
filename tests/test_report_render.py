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


def layerwise_data(points: int = 71, not_exposed: int = 14, unmappable: int = 3) -> dict:
    """verify["layerwise"] as the verify stage writes it after a failed fp16 run."""
    depth = []
    for i in range(points):
        cosine = 0.99999 - i * 1e-7 if i < 5 else (0.42 + 0.001 * i if i < 40 else 0.995)
        depth.append({"index": i * 2, "tensor": f"t{i}", "op": f"Op_{i}", "cosine": cosine,
                      "passed": cosine >= 0.99})
    worst = [{"tensor": f"t{i}", "op": f"Op_{i}", "op_type": "Conv" if i % 2 else "Relu", "index": i * 2,
              "cosine": 0.42 + 0.001 * i, "max_abs": 3.1 - 0.01 * i, "sqnr_db": 1.5 + i,
              "nan": 0, "inf": 0, "passed": False} for i in range(5, 15)]
    return {
        "mode": "on_fail", "ran": True, "reason": "verification failed", "samples": 30, "seconds": 3.2,
        "compared": points,
        "not_exposed": [f"hidden_{i}" for i in range(not_exposed)],
        "unmappable": [f"ov_internal_{i}" for i in range(unmappable)],
        "depth": depth,
        "worst": worst,
        "first_divergence": {"tensor": "t5", "op": "Op_5", "op_type": "Conv",
                             "attributes": {"kernel_shape": [3, 3], "group": 1, "auto_pad": "NOTSET"},
                             "cosine": 0.42, "max_abs": 3.1, "threshold": 0.99,
                             "inputs": [{"tensor": "t4", "cosine": 0.9999986}, {"tensor": "w5", "cosine": 0.5}],
                             "region": ["Relu_4", "Op_5"]},
        "nan_origin": {"tensor": "s", "op": "ReduceSum_3", "op_type": "ReduceSum", "nan": 0, "inf": 12,
                       "reference_max_abs": 3.2e5},
        "side_file": "layerwise.json.gz",
        "threshold": 0.99,
    }


RECOMMENDATIONS = [
    {"kind": "fp16_overflow",
     "text": "tensor s overflows fp16 (max 3.2e5 > 65504) at op ReduceSum_3: keep ReduceSum_3 and Sqrt_4 in fp32",
     "action": {"keep_float": ["ReduceSum_3", "Sqrt_4"]}},
    {"kind": "threshold", "text": "the per-output cosine threshold 0.9999 is tighter than fp16 allows"},
]


def layerwise_report() -> dict:
    report = failing_report()
    report["schema_version"] = 1
    verify = report["verify"]
    verify["layerwise"] = layerwise_data()
    verify["recommendations"] = copy.deepcopy(RECOMMENDATIONS)
    verify["outputs"][0]["min_tolerances"] = {"abs": 1.2e-3, "rel": 4.5e-2}
    verify["outputs"][1]["min_tolerances"] = {"abs": 0.0, "rel": 0.0}
    return report


def crash_report() -> dict:
    report = layerwise_report()
    report["verify"]["crash"] = {
        "kind": "crashed", "backend": "openvino", "detail": "the worker process died with SIGSEGV",
        "stderr_tail": ["[ INFO ] loading model", "Segmentation fault (core dumped) <here> & ```x```"]}
    return report


def _section(md: str, heading: str) -> str:
    """The Markdown text from a `## heading` to the next `## ` heading."""
    start = md.index(heading)
    end = md.find("\n## ", start + len(heading))
    return md[start:] if end < 0 else md[start:end]


def test_layerwise_section_markdown():
    md = render_markdown(layerwise_report())
    assert md.index("## Verification") < md.index("## Layerwise comparison") < md.index("## Stages")
    section = _section(md, "## Layerwise comparison")
    assert "- **mode:** on_fail" in section
    assert "- **why:** verification failed" in section
    assert "- **samples:** 30" in section and "- **seconds:** 3.20" in section
    assert "- **tensors compared:** 71" in section
    assert "- **per-tensor min cosine:** 0.990000" in section
    # long name lists: the count and the first ten names
    assert ("- **not exposed by the backend:** 14: " + ", ".join(f"hidden_{i}" for i in range(10))
            + ", … (+4 more)") in section
    assert "hidden_10" not in md
    assert "- **backend tensors without an ONNX name:** 3: ov_internal_0, ov_internal_1, ov_internal_2" in section
    assert "layerwise.json.gz" in section
    # first divergence: culprit op, type, attributes, input cosines, region
    divergence = section[section.index("### First divergence"):]
    assert "- **op:** Op_5" in divergence and "- **op type:** Conv" in divergence
    assert "- **cosine:** 0.420000 (threshold 0.990000)" in divergence
    assert "- **attributes:** kernel_shape=[3, 3], group=1, auto_pad=NOTSET" in divergence
    assert "- **region:** Relu_4 → Op_5" in divergence
    assert "| t4 | 0.999999 |" in divergence and "| w5 | 0.500000 |" in divergence
    # the NaN/Inf origin is its own block
    origin = section[section.index("### First NaN/Inf"):]
    assert "- **op:** ReduceSum_3" in origin and "- **Inf:** 12" in origin
    assert "- **reference max abs:** 3.2e+05" in origin
    # worst tensors: ten rows, worst first
    worst = section[section.index("### Worst 10 tensors"):]
    rows = [line for line in worst.splitlines() if re.match(r"\| t\d", line)]
    assert len(rows) == 10
    assert rows[0] == "| t5 | Op_5 | Conv | 10 | 0.425000 | 3.05 | 6.5 | 0 | 0 | FAIL |"
    assert "<svg" not in md


def test_layerwise_markdown_stays_short_for_a_big_network():
    """A CI job summary / PR comment: no per-tensor dump beyond the ten worst."""
    small = render_markdown(layerwise_report())
    report = layerwise_report()
    report["verify"]["layerwise"] = layerwise_data(points=2000, not_exposed=800, unmappable=600)
    md = render_markdown(report)
    assert len(md) - len(small) < 200  # only the counts grow
    assert "t1999" not in md and "t40 " not in md and "hidden_11" not in md and "ov_internal_10" not in md
    assert "800: hidden_0" in md and "(+790 more)" in md and "(+590 more)" in md
    page = render_html(report)
    parse(page)
    assert "<title>t39 (Op_39): cosine 0.459000</title>" in page  # tooltips of flagged points
    assert "t1999" not in page  # passing tensors are only a line


def test_layerwise_chart_in_html():
    page = render_html(layerwise_report())
    parse(page)
    start = page.index('aria-label="per-tensor cosine along the network"')
    chart = page[start:page.index("</svg>", start)]
    assert 'width="900"' in page[start - 200:start]
    assert "threshold 0.990000" in chart and 'stroke-dasharray="6 4"' in chart  # reference line
    assert "35 below" in chart
    assert chart.count('class="flagged"') == 35
    assert "<title>t5 (Op_5): cosine 0.425000</title>" in chart
    assert "first divergence: Op_5" in chart
    # x is the topological index (0, 2, 4, ... 140), not the list position
    xs = [float(x) for x in re.findall(r'<circle cx="([\d.]+)"', chart)]
    assert len(xs) == 71 and xs == sorted(xs)
    assert ">140</text>" in chart or ">150</text>" in chart
    for label in ("Worst 10 tensors", "First divergence", "First NaN/Inf"):
        assert f"<h3>{label}</h3>" in page
    assert '<tr class="row-fail"><td>w5</td><td>0.500000</td></tr>' in page
    assert "<tr><td>t4</td><td>0.999999</td></tr>" in page


def test_line_chart_x_values_and_marker():
    chart = svg_line_chart([1.0, 0.5, 0.9], x_values=[0, 10, 20], title="t", x_label="x", y_label="y",
                           threshold=0.8, flag_below=True, point_labels=["a", "b<", "c"], mark_x=(10, "here"))
    parse(chart)
    cxs = [float(x) for x in re.findall(r'<circle cx="([\d.]+)"', chart)]
    assert cxs[1] - cxs[0] == pytest.approx(cxs[2] - cxs[1])
    assert chart.count('class="flagged"') == 1 and "<title>b&lt;</title>" in chart
    assert ">here</text>" in chart and "1 below" in chart
    plain = svg_line_chart([1.0, 0.5, 0.9], title="t", x_label="x", y_label="y", threshold=0.8)
    assert 'class="flagged"' not in plain and "below" not in plain


def test_layerwise_not_run_and_clean_runs():
    report = full_report()
    report["verify"]["layerwise"] = {"mode": "on_fail", "ran": False, "reason": "verification passed"}
    md = render_markdown(report)
    assert "## Layerwise comparison" in md
    assert "not run (on_fail mode): verification passed" in md
    assert "### Worst" not in md and "per-tensor cosine" not in render_html(report)
    clean = layerwise_data()
    clean["first_divergence"] = None
    clean["nan_origin"] = None
    report["verify"]["layerwise"] = clean
    md = render_markdown(report)
    assert "no tensor fell below the per-tensor threshold" in md
    assert "### First divergence" not in md and "### First NaN/Inf" not in md
    page = render_html(report)
    parse(page)
    assert "first divergence:" not in page


def test_minimum_tolerances_table():
    md = render_markdown(layerwise_report())
    verification = _section(md, "## Verification")
    assert "### Minimum tolerances that would pass" in verification
    assert "| output | abs tolerance | rel tolerance |" in verification
    assert "| logits | 0.0012 | 0.045 |" in verification
    assert "| probs | 0 | 0 |" in verification
    assert "Minimum tolerances" not in render_markdown(full_report())
    page = render_html(layerwise_report())
    assert "<tr><td>logits</td><td>0.0012</td><td>0.045</td></tr>" in page


def test_recommendations_section():
    report = layerwise_report()
    md = render_markdown(report)
    section = _section(md, "## Recommendations")
    assert md.index("## Layerwise comparison") < md.index("## Recommendations") < md.index("## Stages")
    assert f"- {RECOMMENDATIONS[0]['text']}" in section
    assert f"- {RECOMMENDATIONS[1]['text']}" in section
    page = render_html(report)
    assert '<ul class="recommendations"><li>tensor s overflows fp16' in page
    report["verify"]["recommendations"] = []
    assert "## Recommendations" not in render_markdown(report)
    report["verify"]["recommendations"] = [{"text": "<b>bold</b>"}, "plain", None]
    page = render_html(report)
    parse(page)
    assert "<li>&lt;b&gt;bold&lt;/b&gt;</li><li>plain</li></ul>" in page


def test_crash_block_near_the_top():
    report = crash_report()
    md = render_markdown(report)
    assert md.index("## ⚠ Backend openvino crashed") < md.index("## Verification")
    assert md.index("FAIL") < md.index("## ⚠ Backend openvino crashed")
    assert "- **detail:** the worker process died with SIGSEGV" in md
    # the stderr tail is a fenced block, fenced longer than any backtick run in it
    assert "````text\n[ INFO ] loading model\nSegmentation fault (core dumped) <here> & ```x```\n````" in md
    page = render_html(report)
    parse(page)
    assert ('<pre class="stderr">[ INFO ] loading model\n'
            "Segmentation fault (core dumped) &lt;here&gt; &amp; ```x```</pre>") in page
    assert page.index("Backend openvino crashed") < page.index("<h2>Verification</h2>")
    report["verify"]["crash"] = {"kind": "hung", "backend": "tensorrt", "stderr_tail": []}
    md = render_markdown(report)
    assert "## ⚠ Backend tensorrt hung (stopped after the time limit)" in md and "```" not in md
    report["verify"]["crash"] = None
    assert "Backend" not in render_markdown(report)


def test_long_stderr_tail_is_cut():
    report = crash_report()
    report["verify"]["crash"]["stderr_tail"] = [f"line {i} " + "x" * 1000 for i in range(100)]
    md = render_markdown(report)
    assert "stderr (last 40 lines)" in md
    assert "line 59 " not in md and "line 60 " in md and "line 99 " in md
    assert max(len(line) for line in md.splitlines()) <= 400


def test_schema_version_is_shown():
    assert "report schema 1" in render_markdown(layerwise_report())
    assert "report schema" not in render_markdown(full_report())


def test_new_sections_are_deterministic_and_well_formed():
    report = crash_report()
    assert render_markdown(report) == render_markdown(copy.deepcopy(report))
    assert render_html(report) == render_html(copy.deepcopy(report))
    check_table_columns(render_markdown(report))


@pytest.mark.parametrize("key", ["layerwise", "recommendations", "crash"])
def test_new_verify_keys_missing_or_none_or_partial(key):
    for value in (None, {}, [], {"ran": True}, [{}], {"depth": [{}], "worst": [{}], "first_divergence": {}},
                  {"ran": True, "depth": [{"cosine": None}, {"index": "x", "cosine": float("nan")}],
                   "first_divergence": {"inputs": [{}], "attributes": {"a": None}}, "nan_origin": {}},
                  {"ran": True, "depth": [{"index": 3, "cosine": 0.5}], "threshold": 0.9,
                   "first_divergence": {"tensor": "nowhere"}}):
        report = crash_report()
        report["verify"][key] = copy.deepcopy(value)
        md = render_markdown(report)
        parse(render_html(report))
        assert md.startswith("# parity report:")
