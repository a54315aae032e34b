"""Float noise: a task drop that float reordering alone produces, not a fault of the build.

Two fp32 runtimes (or one runtime with other graph optimizations) sum in other orders, so
their outputs differ in the last bits. A metric that thresholds or ranks those outputs
(a sigmoid map binarized at 0.5, an argmax over near-tied logits) turns a few of those
last-bit differences into decisions: a handful of pixels flip and IoU drops by 4e-06.
Judged against an allowed drop of 0 that is a FAIL on every target, and a real fault (a
map wrong on one backend) could no longer be told from it.

A failing drop of a build at the reference's own precision (fp32) is float noise when
1. every output agrees with the reference at float level: no output check failed, and
   the task output's worst sample (a pair metric's: both outputs') keeps a cosine of at
   least FLOAT_COSINE (a broken map, even on one sample, falls far below it), and
2. the drop is what flipped decisions at the boundary produce: its bootstrap interval
   reaches 0 (a few samples moved, the rest are equal), or the drop itself is at most
   NOISE_DROP (a few boundary pixels on every sample).
Such a build passes, and its task result says why (``float_noise``). Nothing else
changes: a build at a lower precision is judged by its own allowed drop as before."""

from __future__ import annotations

from typing import List, Optional

from pipeline.precision import kinds

FLOAT_COSINE = 0.99999  # float reordering: cosine 0.999998 (ncnn vs ONNX Runtime) and closer
NOISE_DROP = 1e-3  # a tenth of a point of the metric: far below any drop a fault causes
REFERENCE_PRECISION = kinds.REFERENCE


def judged(task: Optional[dict], outputs: List[dict], precision: str) -> Optional[dict]:
    """``task`` with a failing drop that is float noise turned into a pass, ``float_noise``
    saying why; any other task unchanged (the same dict)."""
    if not task or task.get("passed", True) or precision != REFERENCE_PRECISION or task["max_drop"] < 0:
        return task  # a negative allowed drop asks the build to beat the reference: noise never does
    why = _why(task, outputs)
    if why is None:
        return task
    passed = dict(task, passed=True, float_noise=why, uncertain=False)
    passed.pop("reason", None)
    return passed


def _why(task: dict, outputs: List[dict]) -> Optional[str]:
    """The reason the drop is float noise, or None when it may be a fault."""
    if any(output["failures"] for output in outputs):
        return None
    names = task.get("outputs") or [task["output"]]  # a pair metric's two: the worse of them
    found = [o.get("metrics", {}).get("min_sample_cosine") for o in outputs if o["name"] in names]
    worst = None if not found or None in found else min(found)
    if worst is None or worst < FLOAT_COSINE:
        return None
    interval = task.get("interval")
    if interval and interval[0] <= 0.0:
        boundary = f"its 95 % interval [{interval[0]:.3g}, {interval[1]:.3g}] reaches 0"
    elif task["drop"] <= NOISE_DROP:
        boundary = f"it is at most {NOISE_DROP:g}"
    else:
        return None
    return (f"float noise: a fp32 build whose outputs agree with the reference at float level (worst sample "
            f"cosine {worst:.7f} >= {FLOAT_COSINE}); the drop {task['drop']:.3g} comes from decisions at the "
            f"metric's boundary that float reordering flips, and {boundary}")
