"""Advice tried before it is given: the keep-in-float candidates for a failing int8/mixed
build are ranked by their expected gain (each one's plain Q/DQ model on the reference
runtime, a few samples: ``screen``), then confirmed on the target best first: rebuilt like
the build, re-measured on the validation set against the same reference and judged with
the same thresholds, while the diagnosis budget lasts. Only a candidate that passes is
printed as advice, with the line that applies it; when none passes, one line says so and
what the best one reached, with nothing to apply (docs/verify.md, "Advice")."""

from __future__ import annotations

import logging
from typing import Callable, Dict, List, Optional

from pipeline.verification import speed
from pipeline.console import progress_bar
from pipeline.errors import BackendCrashed
from pipeline.verification.metrics import OutputStats
from pipeline.verification.recommend import QuantizedGraph

WORST_ROWS = 3  # layerwise tensors with the lowest cosine whose quantized producers are a candidate
LOSSES_WIDE = 3  # tensors adding the most error whose quantized producers are kept in float together
SHOWN = 3  # passing candidates given as advice (every trial is in the report's verify.advice_tried)
SCREEN_SAMPLES = 16  # validation samples each candidate is ranked on (reference runtime)
TIMING = {"rounds": 5, "runs": 5, "max_seconds": 2.0}
log = logging.getLogger("parity")


def candidates(advice: List[dict], layers: Optional[dict], graph: QuantizedGraph, output_ops: List[str],
               limit: int) -> List[List[str]]:
    """Op sets to keep in float, smallest first: what the evidence named (already traced
    to quantized ops), then the quantized producers of the tensors that add the most error
    (layerwise local losses: the first, the first LOSSES_WIDE, those with the outputs'
    producers, then twice as many with the worst tensors')."""
    found = [list(a["action"]["keep_float"]) for a in advice if a["action"].get("keep_float")]
    layers = layers or {}
    losses = [row["op"] for row in layers.get("local_losses") or [] if row["loss"] > 0]
    worst = [row["op"] for row in layers.get("worst") or [] if row.get("op")]
    wide = losses[:LOSSES_WIDE]
    for ops in (losses[:1], wide, wide + output_ops, losses[:2 * LOSSES_WIDE] + worst[:WORST_ROWS] + output_ops):
        found.append(_union(graph.producers(op) for op in ops))
    unique: List[List[str]] = []
    for keep in found:  # every quantized op in float is fp32, not advice for an int8 build
        if keep and set(keep) < graph.quantized and sorted(keep) not in [sorted(k) for k in unique]:
            unique.append(keep)
    return unique[:limit]


def _union(groups) -> List[str]:
    return list(dict.fromkeys(op for group in groups for op in group))


def screen(candidates_: List[List[str]], launch: Callable, reference, feeds: List[dict],
           needed: Optional[float] = None, build_cosine: Optional[float] = None) -> dict:
    """The candidates ranked by the cosine they are predicted to reach on the target:
    ``launch(keep) -> worker`` runs a plain Q/DQ model (``keep=[]``: the build itself, screened
    the same way) against ``reference`` on ``feeds``; a candidate's prediction is the build's
    measured ``build_cosine`` plus its gain over the build in the screening (the screening's
    own level, e.g. no weight rounding, cancels out). Those predicted to reach ``needed`` (the
    cosine threshold) first, fewest ops in float first (the least speed given up), then the
    rest, closest first. {"order", "cosine" ({"op,op": screened cosine}), "base" (the build's
    screened cosine), "predicted", "failed" (trials that could not run)}."""
    expected = [reference.run(f) for f in feeds]
    cosine, failed = {}, []
    for keep in [[], *candidates_]:
        try:
            cosine[",".join(keep)] = _screened_cosine(launch(keep), feeds, expected)
        except Exception as err:  # noqa: BLE001 - a candidate that cannot be built is a finding, not the verdict
            if keep:
                failed.append({"keep_float": keep, "error": f"{type(err).__name__}: {err}", "passed": False})
    base = cosine.pop("", None)
    predicted = {key: predict(found, base, build_cosine) for key, found in cosine.items()}

    def rank(keep):
        found = predicted[",".join(keep)]
        reaches = needed is not None and found >= needed
        return (not reaches, len(keep) if reaches else 0, -found)

    order = sorted((k for k in candidates_ if ",".join(k) in cosine), key=rank)
    return {"order": order, "cosine": cosine, "base": base, "predicted": predicted, "failed": failed}


def _screened_cosine(worker, feeds: List[dict], expected: List[dict]) -> float:
    stats: Dict[str, OutputStats] = {}
    for feed, wanted in zip(feeds, expected):
        actual = worker.run(feed)
        for name in wanted:
            if name in actual:
                stats.setdefault(name, OutputStats()).update(wanted[name], actual[name])
    worker.close()
    return min(s.result()["cosine"] for s in stats.values())


def predict(screened: float, base: Optional[float], build_cosine: Optional[float]) -> float:
    """The target cosine a candidate screened at ``screened`` should reach: the build's
    measured cosine plus the gain over the build screened the same way (``base``); without
    both, the screened cosine itself."""
    if base is None or build_cosine is None:
        return screened
    return min(1.0, build_cosine + screened - base)


def misprediction(trial: dict, build_cosine: float, needed: Optional[float]) -> Optional[str]:
    """A confirmed trial whose measured cosine differs from its prediction by more than the
    gap the build had to the threshold: the screening does not predict this target."""
    predicted = trial.get("predicted_cosine")
    if predicted is None or "cosine" not in trial or needed is None or needed <= build_cosine:
        return None
    if abs(trial["cosine"] - predicted) <= needed - build_cosine:
        return None
    return (f"keep_float=[{','.join(trial['keep_float'])}] was predicted to gain {predicted - build_cosine:+.6f} "
            f"in cosine and gained {trial['cosine'] - build_cosine:+.6f} on the target, where "
            f"{needed - build_cosine:.6f} was needed to pass")


def run(candidates_: List[List[str]], launch: Callable, reference, target, dataset, judge: Callable,
        scorer=None) -> List[dict]:
    """Each candidate built (``launch(keep_float) -> worker``), measured on every
    validation sample next to the others (``scorer``: the run's task metric, a fresh
    pipeline.verification.scoring.TaskScorer), judged (``judge(stats, build key) -> (reasons,
    cosine, task)``) and timed against the target build."""
    workers, tried = {}, []
    for keep in candidates_:
        try:
            workers[",".join(keep)] = (keep, launch(keep))
        except Exception as err:  # noqa: BLE001 - a candidate that cannot be built is a finding, not the verdict
            tried.append({"keep_float": keep, "error": f"{type(err).__name__}: {err}", "passed": False})
    stats: Dict[str, dict] = {key: {} for key in workers}
    with progress_bar() as progress:
        task = progress.add_task(f"advice trial {', '.join(workers)}", total=len(dataset.validation))
        for sample in dataset.validation:
            _measure_sample(sample, reference, workers, stats, scorer, tried)
            progress.advance(task)
    if scorer is not None:
        scorer.finish()
    sample = next(iter(dataset.validation), None)
    for key, (keep, worker) in workers.items():
        reasons, cosine, task = judge(stats[key], key, worker.effective())
        timing = _slower_ms(target, worker, sample.feeds) if sample is not None else None
        tried.append({"keep_float": keep, "passed": not reasons, "reasons": reasons, "cosine": cosine,
                      "task": task, "slower_ms": timing})
    return tried


def _measure_sample(sample, reference, workers: dict, stats: dict, scorer, tried: List[dict]) -> None:
    """One validation sample through the reference and every trial still running."""
    expected = reference.run(sample.feeds)
    _score(scorer, "reference", expected, expected, sample.label)
    for key, (keep, worker) in list(workers.items()):
        try:
            actual = worker.run(sample.feeds)
        except BackendCrashed as err:
            tried.append({"keep_float": keep, "error": str(err), "passed": False})
            del workers[key]
            continue
        for name in expected:
            if name in actual:
                stats[key].setdefault(name, OutputStats()).update(expected[name], actual[name])
        _score(scorer, key, expected, actual, sample.label)


def _score(scorer, build: str, expected: dict, actual: dict, label) -> None:
    if scorer is None:
        return
    mine, theirs = scorer.task_values(actual), scorer.task_values(expected)
    if mine is not None and theirs is not None and scorer.active(label, theirs):
        scorer.add(build, mine, theirs, label)


def _slower_ms(target, trial, feeds) -> Optional[float]:
    timings = speed.interleaved({"build": target, "trial": trial}, feeds, **TIMING)
    if any("error" in t for t in timings.values()):
        return None
    return timings["trial"]["median_ms"] - timings["build"]["median_ms"]


def improves(trial: dict, base: dict) -> bool:
    """Passes where the build failed, or gets closer on cosine without losing task accuracy."""
    if "error" in trial:
        return False
    if trial["passed"]:
        return True
    drop, base_drop = (trial.get("task") or {}).get("drop"), (base.get("task") or {}).get("drop")
    no_worse_task = drop is None or base_drop is None or drop <= base_drop + 1e-12
    return trial["cosine"] > base["cosine"] + 1e-6 and no_worse_task


def describe(trial: dict, user_keep: List[str]) -> str:
    """``keep_float=[Conv7] -> cosine 0.9962 (pass), 0.3 ms slower (apply: ...)``."""
    if "error" in trial:
        return f"keep_float=[{','.join(trial['keep_float'])}] -> could not be measured: {trial['error']}"
    task = trial.get("task")
    drop = ""
    if task:
        drop = (f", top-1 drop {task['drop'] * 100:.2f} pts" if task["metric"] == "top1"
                else f", {task['metric']} drop {task['drop']:.4g}")
    slower = trial.get("slower_ms")
    speed_text = "" if slower is None else f", {abs(slower):.2f} ms {'slower' if slower > 0 else 'faster'}"
    apply = ",".join(dict.fromkeys([*user_keep, *trial["keep_float"]]))
    return (f"keep_float=[{','.join(trial['keep_float'])}] -> cosine {trial['cosine']:.6f} "
            f"({'pass' if trial['passed'] else 'fail'}{drop}){speed_text} (apply: precision.keep_float=[{apply}])")


def advice(tried: List[dict], base: dict, user_keep: List[str]) -> List[dict]:
    """The recommendations: the passing trials, fewest ops in float first, each with the
    line that applies it; when none passed, one line saying what was tried and how close the
    best came, with nothing to apply (a failing trial is not advice)."""
    ranked = sorted((t for t in tried if "error" not in t),
                    key=lambda t: (not t["passed"], len(t["keep_float"]) if t["passed"] else 0, -t["cosine"]))
    found = [{"kind": "tried_keep_float", "text": describe(t, user_keep), "tried": True,
              "action": {"keep_float": list(dict.fromkeys([*user_keep, *t["keep_float"]]))},
              "measured": _measured(t)} for t in ranked if t["passed"]][:SHOWN]
    if found:
        return found
    best = max(ranked, key=lambda t: t["cosine"]) if ranked else None
    text = f"none of the {len(tried)} keep-in-float candidates confirmed on the target passed"
    if best is not None:
        reached = f"cosine {best['cosine']:.6f}" + (", no better than the build's" if not improves(best, base)
                                                     else f" against the build's {base['cosine']:.6f}")
        text += (f"; the closest, keep_float=[{','.join(best['keep_float'])}], reached {reached} and still fails: "
                 f"{'; '.join(best.get('reasons') or [])}")
    return [{"kind": "tried_none_passed", "text": text, "tried": True, "action": {"tried": len(tried)},
             "measured": _measured(best) if best else None}]


def _measured(trial: dict) -> Dict[str, object]:
    return {key: trial.get(key) for key in ("keep_float", "passed", "cosine", "task", "slower_ms", "reasons")}
