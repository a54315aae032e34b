"""Render a parity report dict as Markdown or as a self-contained HTML page, from the
Jinja2 templates in pipeline/report/templates/.

The report dict is read once, into one context (pipeline/report/context.py: the page
title and a flat list of blocks); ``report.md.j2`` and ``report.html.j2`` render that
same context, one macro per block kind (``blocks.md.j2``, ``blocks.html.j2``), and the
HTML's charts are SVG written by the macros of ``charts.svg.j2`` from the layouts of
pipeline/report/charts.py. The sweep summary (pipeline/release/sweep.py) is rendered by the
same templates from its own blocks.

The HTML page has inline CSS and inline SVG, no JavaScript and no external resources.
HTML and SVG templates are autoescaped, the way ``html.escape`` escapes (``&quot;``,
``&#x27;``), so every dynamic string is escaped. Output is deterministic: same report
in, byte-identical text out (no timestamps, no randomness; dicts are shown in the
order they were given).
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any, Union

import jinja2
from markupsafe import Markup

from pipeline.artifacts import write_json
from pipeline.report.charts import bar_chart, line_chart, nice_ticks, tick_labels  # noqa: F401 (tick helpers: public here)
from pipeline.report.context import build_context

TEMPLATES = Path(__file__).with_name("templates")


@jinja2.pass_eval_context
def _escape(eval_ctx: Any, value: Any) -> Any:
    """Every value an autoescaped template prints, escaped as html.escape does (markupsafe
    would write &#34; and &#39;); Markup (a macro's output) is already escaped."""
    if eval_ctx.autoescape and not isinstance(value, Markup):
        return Markup(html.escape(str(value), quote=True))
    return value


def _md_text(text: Any) -> str:
    return str(text).replace("\r", " ").replace("\n", " ")


def _md_cell(text: Any) -> str:
    return _md_text(text).replace("|", "\\|")


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATES),
        autoescape=jinja2.select_autoescape(enabled_extensions=("html.j2", "svg.j2"), default_for_string=True),
        finalize=_escape, trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True,
        undefined=jinja2.StrictUndefined)
    env.filters.update(md=_md_text, md_cell=_md_cell, f1=lambda value: f"{value:.1f}")
    return env


ENV = _environment()


class _TemplateCodeCache(jinja2.FileSystemBytecodeCache):
    """Compiled templates kept in a folder; a folder that refuses the write (read-only,
    full) only means they are compiled again next time."""

    def dump_bytecode(self, bucket) -> None:
        try:
            super().dump_bytecode(bucket)
        except OSError:
            pass


def keep_compiled_templates(folder: Path) -> None:
    """Keep the report templates' compiled code in ``folder`` (the stage cache's): compiling
    them took 0.1 s of every job that writes a report, rendering after that 0.025 s."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return
    ENV.bytecode_cache = _TemplateCodeCache(str(folder))


def render_markdown(report: dict) -> str:
    """The report as a Markdown document (tables, no charts)."""
    return ENV.get_template("report.md.j2").render(build_context(report))


def render_html(report: dict) -> str:
    """The report as one self-contained HTML page (inline CSS and SVG, no scripts)."""
    return ENV.get_template("report.html.j2").render(build_context(report))


def markdown_document(blocks: list) -> str:
    """Document blocks as Markdown (shared by run and sweep reports)."""
    return ENV.get_template("report.md.j2").render(blocks=blocks)


def html_document(title: str, blocks: list) -> str:
    """Document blocks as one self-contained HTML page (shared by run and sweep reports)."""
    return ENV.get_template("report.html.j2").render(title=title, blocks=blocks)


def write_reports(report: dict, folder: Union[str, Path]) -> None:
    """The one writer of a report's files: ``report.json`` (the report dict itself) and its
    two renderings, ``report.md`` and ``report.html``, built from one context."""
    folder = Path(folder)
    write_json(folder / "report.json", report)
    context = build_context(report)
    (folder / "report.md").write_text(ENV.get_template("report.md.j2").render(context))
    (folder / "report.html").write_text(ENV.get_template("report.html.j2").render(context))


def svg_bar_chart(*args: Any, **kwargs: Any) -> str:
    """A bar chart as SVG text: ``charts.bar_chart``'s layout through its macro."""
    return str(ENV.get_template("charts.svg.j2").module.bar_chart(bar_chart(*args, **kwargs)))


def svg_line_chart(*args: Any, **kwargs: Any) -> str:
    """A line chart as SVG text: ``charts.line_chart``'s layout through its macro."""
    return str(ENV.get_template("charts.svg.j2").module.line_chart(line_chart(*args, **kwargs)))
