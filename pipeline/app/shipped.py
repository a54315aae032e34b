"""Which of precision=auto's candidates ships, and the one line that says why: the
fastest that passes, ties and undecided timings settled (docs/config.md, "precision=auto"),
then the candidates that did not pass, by why, and the fastest failing build."""

from __future__ import annotations

import re
from typing import Dict, List, Optional, Tuple

from pipeline.app.budget import CUT
from pipeline.app.screening import SLOWER
from pipeline.errors import BackendCrashed, BackendUnavailable, ConfigError, InputError
from pipeline.precision import kinds
from pipeline.verification import speed

NOT_BUILT = "not built"
UNVERIFIED = "not verified"
LABELLED = (ConfigError, InputError, BackendUnavailable, BackendCrashed)  # their str() starts "<label>: "
SIZE_EDGE = 0.9  # among builds as fast, one is the smaller only at 90 % of the other's size or less


def choose(rows: Dict[str, dict], tight: float = speed.TIGHT) -> Tuple[Optional[str], str]:
    """(the precision to ship, one line saying why). Each passing build is judged against
    the fastest by median on their per-round ratios (speed.judge): slower drops out; a tie
    (tight spread) goes to the build keeping more of the task, the smaller (by SIZE_EDGE),
    the higher precision; a build the timing left undecided (wide spread after the budget)
    makes the highest-fidelity build among the fastest, its ties and the undecided ones
    ship, never the smaller on a guess."""
    passing = [p for p, r in rows.items() if r["verdict"] == "pass" and "median_ms" in (r.get("latency") or {})]
    if not passing:
        built = [p for p, r in rows.items() if r.get("cosine") is not None]
        if not built:
            return None, "no candidate was built"
        best = max(built, key=lambda p: rows[p]["cosine"])
        untimed = [p for p, r in rows.items() if r["verdict"] == "pass"]
        if len(untimed) == 1:  # one passing build, nothing timed
            return untimed[0], f"{untimed[0]} is the only candidate that passes" + _not_passing(rows)
        if untimed:  # a timing that did not complete (a worker crashed): nothing is known to be faster
            winner = min(untimed, key=kinds.FIDELITY.index)
            return winner, (f"{winner}: {', '.join(untimed)} pass and none has a timing, so the build closest to the "
                            "model's numbers ships" + _not_passing(rows))
        if _fails_alike(rows, best):
            return kinds.REFERENCE, (f"no candidate passes, fp32 included: the precisions fail alike (output cosine "
                                     f"fp32 {rows[kinds.REFERENCE]['cosine']:.6f}, {best} {rows[best]['cosine']:.6f}), "
                                     "so the conversion or the runtime is wrong at fp32 already; fp32's reasons and "
                                     "recommendations follow" + _not_passing(rows))
        return best, (f"no candidate passes: {best} comes closest (output cosine {rows[best]['cosine']:.6f}); "
                      "its reasons and recommendations follow" + _not_passing(rows))
    latency = {p: rows[p]["latency"] for p in passing}
    fastest = min(passing, key=lambda p: latency[p]["median_ms"])
    calls = {p: _against(latency[p], latency[fastest], tight) for p in passing if p != fastest}
    tied = [fastest, *[p for p, (call, _) in calls.items() if call in ("tie", "faster")]]
    undecided = [p for p, (call, _) in calls.items() if call == "undecided"]
    if undecided:
        winner = min(tied + undecided, key=kinds.FIDELITY.index)
        spreads = ", ".join(f"{p} p75/p25 {calls[p][1]:.2f}" for p in undecided)
        why = (f"{winner}: the timing could not tell {', '.join(undecided)} from {fastest} (spread of per-round "
               f"ratios above {tight:g} after the timing budget: {spreads}): undecided, so the build closest to the "
               f"model's numbers ships")
    else:
        winner = min(_as_small(_kept_most(tied, rows), rows), key=kinds.FIDELITY.index)
        if winner == fastest:
            why = f"{winner}: the fastest build that passes ({_ratio(rows[winner])})"
            if len(tied) > 1:
                why += f", and {_tie_edge(winner, tied, rows)}"
        else:
            why = (f"{winner}: as fast as {fastest} within the timing spread ({_ratio(rows[winner])} against "
                   f"{_ratio(rows[fastest])}), and {_tie_edge(winner, tied, rows)}")
    others = ", ".join(f"{p} {_ratio(rows[p])}" for p in passing if p != winner)
    return winner, why + (f"; other passing: {others}" if others else "") + _not_passing(rows)


def _fastest_failing(rows: Dict[str, dict]) -> str:
    """The fastest verified build that failed, its speed-up and what it lost against what is
    allowed: what a looser threshold would buy (never a build with nothing of its outputs
    right, cosine 0: an output all NaN runs fast)."""
    failed = [(p, r) for p, r in rows.items() if r["verdict"] == "fail" and not r.get("same_as")
              and (r.get("speedup") or {}).get("speedup") and (r.get("cosine") is None or r["cosine"] > 0)]
    if not failed:
        return ""
    precision, row = max(failed, key=lambda item: item[1]["speedup"]["speedup"])
    lost = next((reason for reason in row.get("reasons") or []), "")
    return f"; the fastest failing: {precision} at {_ratio(row)}" + (f" ({lost})" if lost else "")


ALIKE_COSINE = 1e-3  # a failing build no closer to the model than fp32 by this much fails as fp32 does


def _fails_alike(rows: Dict[str, dict], best: str) -> bool:
    """fp32 was built and fails, and the closest failing build is no closer than ALIKE_COSINE:
    fp32 is then the one to show (ncnn's GRU text classifier: fp32 at cosine 0.295141 and
    fp16 at 0.295182 fail the same way, and fp16's run told the user to keep an op in fp32)."""
    reference = rows.get(kinds.REFERENCE) or {}
    return best != kinds.REFERENCE and reference.get("verdict") == "fail" and reference.get("cosine") is not None \
        and rows[best]["cosine"] - reference["cosine"] < ALIKE_COSINE


def _not_passing(rows: Dict[str, dict]) -> str:
    """The candidates that did not pass, by why: failed, not verified, slower, cut."""
    outrun = next((r for r in rows.values() if r.get("outrun_by")), None)  # int8_preview.outrun
    why = (f"{outrun['outrun_by']} passes and int8's preview ran no faster: "
           f"{rows[outrun['outrun_by']]['int8_preview']['speedup']:.2f}x it") if outrun else _not_built_why(rows)
    not_built = "not built" + (f" ({why})" if why else "")
    groups = (("failed", lambda r: r["verdict"] not in ("pass", UNVERIFIED, SLOWER, CUT, NOT_BUILT)
               and not r.get("same_as")),
              (not_built, lambda r: r["verdict"] == NOT_BUILT),
              ("not verified (could not ship)", lambda r: r["verdict"] == UNVERIFIED),
              ("not verified (slower than fp32)", lambda r: r["verdict"] == SLOWER),
              ("cut by precision.budget_s", lambda r: r["verdict"] == CUT))
    found = [(label, [p for p, r in rows.items() if belongs(r)]) for label, belongs in groups]
    return "".join(f"; {label}: {', '.join(names)}" for label, names in found if names) + _fastest_failing(rows)


def _not_built_why(rows: Dict[str, dict]) -> str:
    """The one reason every candidate not built shares, its first clause ("the model is
    quantized already (21 DequantizeLinear, 13 QuantizeLinear)"), or "" where they differ."""
    found = {_first_clause(r) for r in rows.values() if r["verdict"] == NOT_BUILT}
    return found.pop() if len(found) == 1 else ""


def _first_clause(row: dict) -> str:
    """A not-built row's reason without its labels (the error's kind, the precision)."""
    reason = (row.get("reasons") or [""])[0]
    for label in (NOT_BUILT, *(kind.label for kind in LABELLED)):
        reason = reason.removeprefix(label + ": ")
    reason = re.sub(rf"^(precision=)?({'|'.join(kinds.KINDS)}): ", "", reason)  # "precision=int8: ", "int8: "
    return reason.split("; ")[0].split(": ")[0]


def _against(candidate: dict, fastest: dict, tight: float) -> Tuple[str, float]:
    """(speed.judge's word on ``candidate`` against the fastest build, the spread it read)
    from their per-round medians: a build slower in three rounds of four never wins on
    size, and a tie needs a tight spread. Without round medians: a tie when the median is
    within the fastest's p75."""
    ratios = [best / mine for mine, best in zip(candidate.get("round_medians_ms") or [],
                                                fastest.get("round_medians_ms") or []) if mine > 0]
    if not ratios:
        return ("tie" if candidate["median_ms"] <= fastest["p75_ms"] else "slower"), 1.0
    return speed.judge(ratios, tight), speed.spread(ratios)


def _task_lost(row: dict) -> float:
    """The task drop a build measured (0 without a task metric): a speed tie goes to the least."""
    return round(max(float(row.get("metric_drop") or 0.0), 0.0), 9)


def _kept_most(tied: List[str], rows: Dict[str, dict]) -> List[str]:
    """The builds among ``tied`` that lost the least of the task."""
    least = min(_task_lost(rows[p]) for p in tied)
    return [p for p in tied if _task_lost(rows[p]) == least]


def _as_small(builds: List[str], rows: Dict[str, dict]) -> List[str]:
    """The smallest of ``builds`` and those within SIZE_EDGE of it: a build 1 % smaller (an
    LSTM's int8_dynamic beside fp32, an embedding table left float) buys nothing worth the
    numbers it changes, so among these the higher precision ships."""
    smallest = min(rows[p].get("bytes") or 0 for p in builds)
    return [p for p in builds if (rows[p].get("bytes") or 0) * SIZE_EDGE <= smallest]


def _tie_edge(winner: str, tied: List[str], rows: Dict[str, dict]) -> str:
    """What decided against each build of the same speed: the task kept, then size, then precision."""
    kept = _kept_most(tied, rows)
    small = _as_small(kept, rows)
    worse = [p for p in tied if p not in kept]
    larger = [p for p in kept if p not in small]
    same = [p for p in small if p != winner]
    edges = ((worse, "keeps more of the task than"), (larger, "smaller than"), (same, "closer to the model's numbers than"))
    return " and ".join(f"{text} {', '.join(found)}" for found, text in edges if found)


def _ratio(row: dict) -> str:
    up = row.get("speedup")
    return f"{up['speedup']:.2f}x fp32" if up else "the reference"
