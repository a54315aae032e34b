"""Run reports: the report dict (assemble.py) and its Markdown/HTML renderings (render.py)."""

from pipeline.report.render import render_markdown, render_html
