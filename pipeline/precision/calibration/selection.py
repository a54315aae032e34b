"""The latency-aware selection of the mixed search's float set (stages/sensitivity.py runs it):
the shortest prefix of a joining order that meets the target, then a prune. ``measure`` is
the stage's whole-model measure (called with a table and float ops; ``meets``, ``no_time``
and ``goal``); docs/sensitivity.md, "Selection"."""

from __future__ import annotations

import statistics
from typing import Dict, List, Optional

from pipeline.precision.calibration import latency

NEXT = "the selection's next measure"
EDGE_WEIGHT = 1.0  # a new edge between an int8 chain and a float island costs about a median op (latency-aware)
FLOOR_SHARE = 0.01  # no op is taken to cost less than 1 % of all the ops' costs


def spent(result: dict, goal: tuple) -> float:
    """How much of the target's budget a whole-model measure spends, as badness counts it: the
    cosine's loss over its budget plus the task metric's drop over the allowed drop, so that
    two tables are compared by what the gate checks (the task metric first where one is scored)."""
    cos, max_drop = goal
    used = (1.0 - result["cosine"]) / max(1.0 - cos, 1e-9)
    if result.get("metric_drop") is not None:
        used += max(result["metric_drop"], 0.0) / max(max_drop, 1e-9)
    return used


def select_for_target(measure, table, ranking, max_float_ops: int, costs: dict,
                      neighbours: Dict[str, List[str]], priced: Optional[latency.Boundary] = None):
    """The shortest prefix of the joining order that meets the target, then every op dropped
    whose removal keeps it. Without costs, ops join in rank order and the least sensitive go
    first in the prune. With per-op costs (latency-aware), the op joining next is the one
    with the most loss per millisecond it gives back (an op next to a float op costs less:
    no new edge between an int8 chain and a float island), and the prune tries the costliest
    op first. The order does not depend on what is measured, so the prefix is found by
    doubling its length until the target is met, then halving the interval (a few whole-model
    measurements instead of one per op: each compiles and runs the model on every validation
    sample). Real int8 kernels do not always improve as ops go back to float (measured: the
    curve is not monotonic on this CPU): the prune removes what the search over-took, and
    when the target is never met the point measured closest to it (``spent``) is kept. Returns (float ops,
    curve); a prune trial that had to keep its op records the op's measured gain (cosine
    with the op float minus with it int8). ``priced``: the runtime's conversions, counted in
    each op's cost where given (latency.Boundary), else new edges are."""
    order = joining_order(ranking, max_float_ops, costs, neighbours, priced)
    if not order or measure.no_time(NEXT):
        return [], []
    measured: Dict[int, dict] = {}

    def at(length: int) -> dict:
        if length not in measured:
            measured[length] = measure(table, order[:length])
        return measured[length]

    failing, length = 0, 1
    while not measure.meets(at(length)) and length < len(order) and not measure.no_time(NEXT):
        failing, length = length, min(2 * length, len(order))
    if measure.meets(at(length)):
        while length - failing > 1 and not measure.no_time(NEXT):
            middle = (failing + length) // 2
            failing, length = (failing, middle) if measure.meets(at(middle)) else (middle, length)
    curve = [{"float_ops": k, "added": order[k - 1], "cost_ms": latency.estimate_ms(order[:k], costs, priced),
              **measured[k]} for k in sorted(measured)]
    if not measure.meets(measured[length]):
        best = min(measured, key=lambda k: spent(measured[k], measure.goal))
        curve.append({**measured[best], "float_ops": best, "added": None, "kept_best": True})
        return order[:best], curve
    return prune(measure, table, order[:length], measured[length], costs, curve, priced=priced)


def joining_order(ranking, max_float_ops: int, costs: dict, neighbours: Dict[str, List[str]],
                   priced: Optional[latency.Boundary] = None) -> List[str]:
    """The ops in the order they join the float set (at most max_float_ops)."""
    float_ops: List[str] = []
    remaining = list(ranking)
    edge_ms = EDGE_WEIGHT * statistics.median(costs.values()) if costs else 0.0
    floor_ms = FLOOR_SHARE * sum(costs.values())
    while remaining and len(float_ops) < max_float_ops:
        row = max(remaining, key=lambda r: latency.value_per_ms(r, float_ops, costs, neighbours, edge_ms, floor_ms,
                                                                      priced)) \
            if costs else remaining[0]
        remaining.remove(row)
        float_ops.append(row["op"])
    return float_ops


def prune(measure, table, float_ops: List[str], current: dict, costs: dict, curve: List[dict],
           order: Optional[List[str]] = None, priced: Optional[latency.Boundary] = None):
    """Drop every op whose removal still meets the target, one at a time (costliest first
    with costs, else the last joined first). With costs, an op whose int8 gain is under
    FLOOR_SHARE of all ops' is not tried: it stays float (PP-OCRv4 rec: 16 of 23 trials,
    2.6 % of int8's gain); an op slower in int8 is still tried, last. Removing halves at
    once was tried: on PP-OCRv4 rec most halves failed together and it took more
    measurements than this (42 vs 30, docs/sensitivity.md). ``order``: the ops to try, in
    turn, instead. An op's cost counts the conversions its leaving the set saves where they
    are ``priced``. (float ops, curve)"""
    own = {op: costs.get(op, 0.0) + (priced.ms(float_ops) - priced.ms([o for o in float_ops if o != op])
                                     if priced else 0.0) for op in float_ops}
    order = order if order is not None else (sorted(float_ops, key=lambda op: -own[op]) if costs
                                             else list(reversed(float_ops[:-1])))
    if costs and len(float_ops) < len(costs):  # with every op float each is tried, else the build is fp32
        floor_ms = FLOOR_SHARE * sum(costs.values())
        order = [op for op in order if not 0.0 <= own.get(op, 0.0) < floor_ms]
    for op in order:
        if measure.no_time(NEXT):
            break
        trial = [o for o in float_ops if o != op]
        result = measure(table, trial)
        if measure.meets(result):
            float_ops, current = trial, result
            curve.append({"float_ops": len(float_ops), "removed": op,
                          "cost_ms": latency.estimate_ms(float_ops, costs, priced), **result})
        else:
            curve.append({"float_ops": len(float_ops), "kept": op, "gain": current["cosine"] - result["cosine"],
                          **{f"without_{k}": v for k, v in result.items()}})
    return float_ops, curve
