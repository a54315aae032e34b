"""Real English sentences that ship with every CPython: the text of the Python reference
documentation's topics (``pydoc_data.topics``, PSF licence). Tests, the tiny text model's
tokenizer (scripts/make_tiny_bert.py) and benchmarks/transformers.py read them offline."""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import List, Tuple

MARKUP = set("*`|=>{}[]\\")  # lines of code or tables, not prose


def sentences() -> List[str]:
    """Every prose sentence of the topics, in a fixed order, deduplicated."""
    from pydoc_data.topics import topics

    text = re.sub(r"\s+", " ", " ".join(topics[key] for key in sorted(topics)))
    found, seen = [], set()
    for sentence in re.split(r"(?<=[.!?])\s+", text):
        if (20 < len(sentence) < 400 and sentence[0].isupper() and not MARKUP & set(sentence)
                and sentence not in seen):
            seen.add(sentence)
            found.append(sentence)
    return found


def split(calibration: int, validation: int, seed: int = 0) -> Tuple[List[str], List[str]]:
    """Two disjoint random draws of sentences."""
    pool = sentences()
    if calibration + validation > len(pool):
        raise ValueError(f"{calibration + validation} sentences asked, {len(pool)} available")
    random.Random(seed).shuffle(pool)
    return pool[:calibration], pool[calibration:calibration + validation]


def write_folder(folder: Path, calibration: int, validation: int, seed: int = 0) -> Path:
    """``folder``/calibration.txt and validation.txt, one sentence a line (data.kind=text)."""
    cal, val = split(calibration, validation, seed)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "calibration.txt").write_text("\n".join(cal) + "\n", encoding="utf-8")
    (folder / "validation.txt").write_text("\n".join(val) + "\n", encoding="utf-8")
    return folder
