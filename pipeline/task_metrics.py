"""The task metrics' old home, kept so that every path to them still resolves: bundles made
before pipeline/metrics/ record ``_target_: pipeline.task_metrics.Top1`` (and CTC, MapIoU,
Regression, Embedding, Detection) in their runtime.yaml, and code imports ``load_metric``
from here. Everything is re-exported from pipeline.metrics; new code imports that."""

from pipeline.metrics import *  # noqa: F401,F403 - the re-exports
from pipeline.metrics import __all__ as _metrics_names
from pipeline.verification.sample_groups import per_sample  # noqa: F401 - stages/sensitivity.py imports it here

__all__ = [*_metrics_names, "per_sample"]
