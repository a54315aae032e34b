"""Run reports: the report dict (assemble.py), its Markdown/HTML renderings from the
Jinja2 templates in templates/ (render.py, over context.py's blocks) and its JUnit XML
for CI dashboards (junit.py). ``write_reports`` writes report.json, report.md and
report.html into a folder."""

from pipeline.report.junit import junit_xml, write_junit
from pipeline.report.render import render_html, render_markdown, write_reports
