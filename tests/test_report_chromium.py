"""The HTML report in a real browser: headless Chromium loads it, the DOM it builds has
the verdict banner and the SVG charts with a size, and a screenshot is not blank.

Screenshots are kept as test artifacts in $PARITY_TEST_ARTIFACTS (default:
test-artifacts/ under the repository root). Without Chromium the tests skip, except
on CI (the CI variable set), where they fail: .ci/run installs it.
"""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from pipeline.report import render_html
from tests.test_report_render import full_report
from tests.test_report_render_diagnosis import crash_report, layerwise_report

REPO = Path(__file__).resolve().parents[1]
WINDOW = (1280, 2000)
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
GREEN, RED = (0x1A, 0x7F, 0x37), (0xCF, 0x22, 0x2E)  # .verdict-pass / .verdict-fail backgrounds
BLUE = (0x09, 0x69, 0xDA)  # chart series colour
# Run after the page has loaded: record the laid-out size of the banner and of every chart
# on <body>, so that --dump-dom carries what the browser really drew (the report itself has
# no script; only the copy the test loads does).
MEASURE = """<script>
document.body.setAttribute("data-measured", JSON.stringify(
  Array.from(document.querySelectorAll(".banner, svg.chart")).map(function (e) {
    var r = e.getBoundingClientRect();
    return {tag: e.tagName.toLowerCase(), label: e.getAttribute("aria-label") || e.className,
            width: r.width, height: r.height};
  })));
</script>"""


def chromium_binary() -> str:
    """The browser to use ($PARITY_CHROMIUM or the first on PATH); skip or, on CI, fail without one."""
    found = os.environ.get("PARITY_CHROMIUM") or next(filter(None, map(shutil.which, BROWSERS)), None)
    if found:
        return found
    message = ("headless Chromium not found (looked for $PARITY_CHROMIUM and " + ", ".join(BROWSERS)
               + " on PATH): install it with `apt-get install chromium` (.ci/run does)")
    if os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no"):
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


def artifacts_dir() -> Path:
    folder = Path(os.environ.get("PARITY_TEST_ARTIFACTS") or REPO / "test-artifacts")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def chromium(binary: str, profile: Path, *args: str) -> subprocess.CompletedProcess:
    # --no-sandbox: the sandbox cannot start as root in a container; a fresh --user-data-dir:
    # no shared profile (and no lock) between runs; --disable-dev-shm-usage: containers have a
    # 64 MiB /dev/shm and Debian's wrapper script does not always add the flag itself.
    command = [binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
               "--no-first-run", "--hide-scrollbars", f"--user-data-dir={profile}", *args]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=90)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"Chromium did not finish in 90 s: {' '.join(command)}\n{err.stderr or ''}")
    assert result.returncode == 0, f"{' '.join(command)} -> {result.returncode}\n{result.stderr[-3000:]}"
    return result


class DomParser(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.svgs: list = []
        self.banners: list = []
        self.body: dict = {}
        self._banner_depth = 0
        self._depth = 0

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self._depth += 1
        if tag == "svg":
            self.svgs.append(attrs)
        if tag == "body":
            self.body = attrs
        if tag == "div" and "banner" in (attrs.get("class") or "").split():
            self.banners.append({"class": attrs["class"], "text": ""})
            self._banner_depth = self._depth

    def handle_endtag(self, tag):
        if self._banner_depth and self._depth == self._banner_depth:
            self._banner_depth = 0
        self._depth -= 1

    def handle_data(self, data):
        if self._banner_depth:
            self.banners[-1]["text"] += data


def check_in_browser(binary: str, page: str, name: str, tmp_path: Path, verdict: str,
                     charts: list) -> Image.Image:
    """Load the page, check the DOM and the layout, save and check a screenshot."""
    html_file = tmp_path / f"{name}.html"
    html_file.write_text(page, encoding="utf-8")
    measured_file = tmp_path / f"{name}.measured.html"
    measured_file.write_text(page.replace("</body>", MEASURE + "\n</body>"), encoding="utf-8")

    dom = chromium(binary, tmp_path / "profile-dom", "--dump-dom", measured_file.as_uri()).stdout
    parser = DomParser()
    parser.feed(dom)
    parser.close()
    label = {"pass": "PASS", "fail": "FAIL"}[verdict]
    assert len(parser.banners) == 1, dom[:2000]
    assert parser.banners[0]["class"] == f"banner verdict-{verdict}"
    assert parser.banners[0]["text"].startswith(label)
    labels = [svg.get("aria-label") for svg in parser.svgs]
    assert labels == charts
    for svg in parser.svgs:
        assert float(svg["width"]) > 0 and float(svg["height"]) > 0, svg
        assert svg.get("viewbox") or svg.get("viewBox"), svg
    layout = json.loads(parser.body.get("data-measured") or "null")
    assert layout, "the measuring script did not run: " + dom[:500]
    assert [box["label"] for box in layout[1:]] == charts
    for box in layout:
        assert box["width"] > 100 and box["height"] > 30, box  # drawn, not collapsed

    screenshot = artifacts_dir() / f"report-{name}.png"
    screenshot.unlink(missing_ok=True)
    chromium(binary, tmp_path / "profile-shot", f"--screenshot={screenshot}",
             f"--window-size={WINDOW[0]},{WINDOW[1]}", html_file.as_uri())
    assert screenshot.is_file() and screenshot.stat().st_size > 0, f"no screenshot at {screenshot}"
    image = Image.open(screenshot).convert("RGB")
    assert image.size == WINDOW
    colours = image.getcolors(maxcolors=image.size[0] * image.size[1])
    assert len(colours) > 1, f"{screenshot} is blank"
    assert count_near(image, GREEN if verdict == "pass" else RED) > 5000, "no verdict banner in the screenshot"
    return image


def count_near(image: Image.Image, colour: tuple, tolerance: int = 6) -> int:
    """Pixels within ``tolerance`` of ``colour`` in every channel."""
    pixels = np.asarray(image, dtype=np.int16)
    return int((np.abs(pixels - np.array(colour, dtype=np.int16)) <= tolerance).all(axis=-1).sum())


def test_rendered_report_with_layerwise_data_in_chromium(tmp_path):
    binary = chromium_binary()
    report = crash_report()
    image = check_in_browser(binary, render_html(report), "layerwise", tmp_path, "fail", [
        "logits: per-sample cosine", "logits: per-sample max abs error",
        "probs: per-sample cosine", "probs: per-sample max abs error",
        "per-tensor cosine along the network", "stage wall time"])
    assert count_near(image, BLUE) > 50  # the per-sample charts are within the first 2000 px


def test_passing_report_in_chromium(tmp_path):
    binary = chromium_binary()
    check_in_browser(binary, render_html(full_report()), "pass", tmp_path, "pass", [
        "logits: per-sample cosine", "logits: per-sample max abs error",
        "probs: per-sample cosine", "probs: per-sample max abs error", "stage wall time"])


def test_report_of_a_real_run_in_chromium(default_run, tmp_path):
    binary = chromium_binary()
    _, run_dir, _ = default_run
    page = (run_dir / "report.html").read_text(encoding="utf-8")
    charts = [html.unescape(c) for c in re.findall(r'<svg class="chart"[^>]*aria-label="([^"]*)"', page)]
    assert "stage wall time" in charts and any("per-sample cosine" in c for c in charts)
    check_in_browser(binary, page, "default-run", tmp_path, "pass", charts)
