"""The report's Memory section (verify.memory, docs/verify.md "Memory"): the shipped build's
peak resident memory next to fp32's on the same backend, the same build with
target.memory=default when it ran with low, and the budget. A missing or malformed part
gives fewer blocks, never an error."""

from __future__ import annotations

from pipeline.report.document import Heading, Para, Table
from pipeline.report.formatting import as_dict, fmt_number


def memory_section(verify: dict) -> list:
    memory = as_dict(verify.get("memory"))
    if not memory:
        return []
    blocks: list = [Heading(3, "Memory")]
    if not memory.get("measured"):
        return blocks + [Para(f"not measured: {memory.get('reason')}")]
    shipped = str(as_dict(verify.get("requested")).get("precision") or "this build")
    rows = [_row(f"{shipped} (target.memory={memory.get('mode', 'default')})", memory)]
    if memory.get("default_mode"):
        rows.append(_row(f"{shipped}, same build with target.memory=default", as_dict(memory["default_mode"])))
    if memory.get("fp32"):
        rows.append(_row("fp32 on the same backend", as_dict(memory["fp32"])))
    rows += [_row(f"{name} on the same backend", as_dict(found))
             for name, found in as_dict(memory.get("baselines")).items() if found]
    blocks.append(Table(["build", "load peak MB", "run peak MB", "peak MB"], rows))
    low = as_dict(memory.get("low"))
    if low.get("text"):
        blocks.append(Para(str(low["text"])))
    budget = as_dict(verify.get("judged_with")).get("max_memory_mb")
    if budget is not None:
        over = (memory.get("peak_mb") or 0) > budget
        blocks.append(Para(f"validation.max_memory_mb {budget:g} MB: peak {fmt_number(memory.get('peak_mb'), '.1f')} "
                           f"MB is {'above it (the verdict fails)' if over else 'within it'}"))
    blocks.append(Para(str(memory.get("method") or ""), css="muted"))
    return blocks


def _row(label: str, found: dict) -> list:
    return [label, *(fmt_number(found.get(key), ".1f") for key in ("load_peak_mb", "run_peak_mb", "peak_mb"))]
