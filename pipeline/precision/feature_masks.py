"""Automatic per-layer feature masks for ncnn fp16 builds (the seed case: x*x ->
ReduceSum overflows fp16 on Vulkan, fixed by ``31=16`` on the reduction and its
consumer).

When the plain fp16 build fails its outputs' thresholds, the candidate layers are the
ops the evidence names: the NaN/Inf origin and its consumers, the first divergence's
region (layerwise comparison against the fp32 reference) and the fp16 pre-flight's
block list. For each mask in order of cost (keep the layer on the GPU in fp32 first,
then move it to the CPU), every candidate layer gets the mask; when that fails, the set
grows along the overflow path (each masked layer's consumers, a step at a time, each step
re-verified: the ``+1e-8`` Add between a reduction and its Sqrt carries the overflowing
sum on); when that passes,
layers are dropped one at a time while the build still passes (greedy: the result is
a minimal set, not necessarily the smallest of all). Every candidate is re-verified in
a worker process: on lavapipe some masks crash shader compilation or give wrong values,
and a crash is a failed candidate, never the end of the build."""

from __future__ import annotations

import logging
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

from pipeline.errors import BackendCrashed
from pipeline.verification.metrics import output_failures
from pipeline.worker import BackendWorker

log = logging.getLogger("parity")

NO_FP16 = 1 | 2  # no fp16 arithmetic, no fp16 storage: the layer stays on its device in fp32
NO_VULKAN = 16  # the layer runs on the CPU
MASKS = {"VULKAN": (NO_FP16, NO_VULKAN), "CPU": (NO_FP16,)}
MASK_MEANING = {NO_FP16: "fp32 on its device (no fp16 storage/arithmetic)", NO_VULKAN: "CPU (no Vulkan)"}


@dataclass
class Judge:
    """Runs a candidate artifact on the samples in a worker and checks its outputs against
    the reference outputs with the run's thresholds."""

    module: str
    samples: List[dict]
    expected: List[dict]
    thresholds_for: Callable
    timeout_s: float = 600.0
    trials: List[dict] = field(default_factory=list)

    def __call__(self, artifact_dir: Path, settings: dict, masks: Dict[str, int]) -> bool:
        started = time.perf_counter()
        try:
            with BackendWorker(self.module, artifact_dir, settings, label=f"ncnn candidate {masks or 'no masks'}",
                               timeout_s=self.timeout_s) as worker:
                reasons = output_failures(worker.run, self.samples, self.expected, self.thresholds_for)
        except BackendCrashed as err:
            reasons = [str(err)]
        self.trials.append({"masks": dict(masks), "passed": not reasons, "reasons": reasons[:3],
                            "seconds": round(time.perf_counter() - started, 3)})
        log.info("feature masks %s: %s", masks or "none", "pass" if not reasons else reasons[0])
        return not reasons


@dataclass
class Outcome:
    masks: Dict[str, int]
    passed: bool
    candidates: List[str]


def search(artifact_dir: Path, settings: dict, layers: Sequence[str], device: str, judge: Judge,
           apply_masks: Callable, consumers: Optional[Dict[str, List[str]]] = None) -> Outcome:
    """The minimal set of masked ``layers`` (ncnn layer names, most likely first) that
    passes ``judge``; ``apply_masks(artifact_dir, settings, masks, out_dir)`` writes a
    candidate and returns (files, settings). When masking them all fails, the set grows
    along the overflow path (``consumers``: ncnn layer -> the layers reading its outputs),
    one step of consumers at a time, at most EXTEND_STEPS steps, each step re-verified: an
    overflowing value also overflows where the next unmasked fp16 layer reads it."""

    def passes(masks: Dict[str, int]) -> bool:
        with tempfile.TemporaryDirectory(prefix="parity-masks-") as scratch:
            _, candidate = apply_masks(artifact_dir, settings, masks, Path(scratch))
            return judge(Path(scratch), candidate, masks)

    tried = list(layers)
    for mask in MASKS.get(device, MASKS["CPU"]):
        found = _passing_set(list(layers), mask, passes, consumers or {})
        if found is None:
            continue
        tried = list(dict.fromkeys([*tried, *found]))
        chosen = {layer: mask for layer in found}
        for layer in reversed(found):  # least likely culprits (the extension first) are dropped first
            trial = {name: value for name, value in chosen.items() if name != layer}
            if trial and passes(trial):
                chosen = trial
        return Outcome(chosen, True, tried)
    return Outcome({}, False, tried)


EXTEND_STEPS = 2  # consumer steps the masked set may grow by along the overflow path


def _passing_set(layers: List[str], mask: int, passes: Callable, consumers: Dict[str, List[str]]) -> Optional[List[str]]:
    """``layers`` grown by their consumers until masking them all with ``mask`` passes, or None."""
    for step in range(EXTEND_STEPS + 1):
        if layers and passes({layer: mask for layer in layers}):
            return layers
        grown = list(dict.fromkeys([*layers, *(c for layer in layers for c in consumers.get(layer, []))]))
        if step == EXTEND_STEPS or grown == layers:
            return None
        layers = grown
    return None


def candidate_ops(layerwise: Optional[dict], preflight_block: Sequence[str]) -> List[str]:
    """ONNX ops to mask, most likely first: the NaN/Inf origin and its consumers, the
    first divergence's region, then the pre-flight's block list."""
    ops: List[str] = []
    if layerwise and layerwise.get("ran"):
        origin, culprit = layerwise.get("nan_origin"), layerwise.get("first_divergence")
        if origin:
            ops += [origin["op"], *origin.get("consumers", [])]
        if culprit:
            ops += list(reversed(culprit.get("region", [culprit["op"]])))
    ops += list(preflight_block)
    return list(dict.fromkeys(ops))
