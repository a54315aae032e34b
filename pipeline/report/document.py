"""The blocks a report is made of: the context both templates render.

The section functions (sections_verify.py, sections_run.py) turn the report dict into a
flat list of these blocks, and pipeline/report/templates/ has one macro per block kind
for each format (blocks.md.j2, blocks.html.j2). A block holds finished text only: every
number is formatted, every choice (which row is red, which verdict colour) is made
here, so the Markdown and the HTML cannot disagree. A block's ``kind`` names its macro.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, List, Tuple

VERDICT_LABELS = {"pass": "PASS", "fail": "FAIL", "unverified": "UNVERIFIED"}
VERDICT_ICONS = {"pass": "🟢", "fail": "🔴", "unverified": "⚪"}


class Block:
    kind: ClassVar[str] = ""

    @property
    def in_markdown(self) -> bool:
        """False where the Markdown would be empty (charts, empty lists): the block is left out."""
        return True

    @property
    def in_html(self) -> bool:
        return True


@dataclass
class Heading(Block):
    level: int
    text: str
    kind: ClassVar[str] = "heading"


@dataclass
class Banner(Block):
    verdict: str  # "pass" | "fail" | "unverified" (anything else renders grey)
    detail: str
    kind: ClassVar[str] = "banner"

    @property
    def label(self) -> str:
        return VERDICT_LABELS.get(self.verdict, self.verdict.upper())

    @property
    def icon(self) -> str:
        return VERDICT_ICONS.get(self.verdict, "⚪")

    @property
    def css(self) -> str:
        """The banner's colour class: verdict-pass, -fail, -unverified or -other (grey)."""
        return "verdict-" + (self.verdict if self.verdict in VERDICT_LABELS else "other")


@dataclass
class Para(Block):
    text: str
    css: str = ""
    kind: ClassVar[str] = "para"


@dataclass
class Items(Block):
    items: List[str]
    css: str = ""
    kind: ClassVar[str] = "items"

    @property
    def in_markdown(self) -> bool:
        return bool(self.items)


@dataclass
class KeyValues(Block):
    pairs: List[Tuple[str, str]]
    kind: ClassVar[str] = "keyvalues"

    @property
    def in_markdown(self) -> bool:
        return bool(self.pairs)


@dataclass
class Table(Block):
    headers: List[str]
    rows: List[List[str]]
    row_classes: List[str] = field(default_factory=list)  # HTML only, one per row or empty
    kind: ClassVar[str] = "table"

    def row_class(self, index: int) -> str:
        return self.row_classes[index] if index < len(self.row_classes) else ""


@dataclass
class Charts(Block):
    charts: List[Any]  # chart layouts from pipeline/report/charts.py; HTML only
    kind: ClassVar[str] = "charts"

    @property
    def in_markdown(self) -> bool:
        return False

    @property
    def in_html(self) -> bool:
        return bool(self.charts)


@dataclass
class Pre(Block):
    lines: List[str]  # preformatted text: <pre> in HTML, a fenced code block in Markdown
    kind: ClassVar[str] = "pre"

    @property
    def fence(self) -> str:
        """A Markdown fence longer than any run of backticks in the text."""
        fence = "```"
        while any(fence in line for line in self.lines):
            fence += "`"
        return fence
