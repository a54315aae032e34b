"""The report's diagnosis sections: layerwise probes, recommendations and a crash, in
Markdown and HTML (split from test_report_render.py)."""

from __future__ import annotations

import copy
import re

import pytest

from pipeline.report import render_html, render_markdown
from pipeline.report.render import svg_line_chart
from tests.test_report_render import check_table_columns, failing_report, full_report, parse


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


def test_the_console_prints_a_diagnosis_whose_op_names_look_like_markup():
    """A PyTorch-exported op name (/enc2/enc2.0/Conv) in brackets reads as a closing markup
    tag to rich; the diagnosis line must print it as text, not end the job in an error."""
    import io

    from rich.console import Console

    from pipeline.report.summary import _diagnosis_lines

    out = io.StringIO()
    diagnosis = {"ran": True, "seconds": 4.5, "budget_seconds": 5.0, "measurement": "measured",
                 "screened": [{"keep_float": ["/enc2/enc2.0/Conv"], "predicted_cosine": 0.999,
                               "measured_cosine": 0.9991}], "cut": ["trial [/dec1/Conv]: not started"]}
    _diagnosis_lines(Console(file=out, width=200), diagnosis)
    assert "keep_float=[/enc2/enc2.0/Conv]: predicted cosine 0.999000, measured 0.999100" in out.getvalue()
    assert "trial [/dec1/Conv]: not started" in out.getvalue()
