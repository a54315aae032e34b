"""Run reports: the report dict (assemble.py), its Markdown/HTML renderings (render.py)
and its JUnit XML for CI dashboards (junit.py)."""

from pipeline.report.junit import junit_xml, write_junit
from pipeline.report.render import render_markdown, render_html
