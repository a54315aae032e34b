"""Task metrics: what a user's model is for, measured on the validation set for the fp32
reference and every build, as the Hydra ``metric`` config group (docs/metrics.md). One
module a task, numpy only:

- ``base``: the interface, ``TaskMetric`` (a metric as parity uses it), the checks;
- ``loading``: a metric from its config, its files, its bundle record;
- ``classification`` (``top1``), ``maps`` (``map_iou``), ``text`` (``ctc``),
  ``regression``, ``embedding`` (nearest neighbours), ``detection`` (boxes after NMS).

``metric._target_`` names a built-in here (``pipeline.metrics.Top1``); the old paths
(``pipeline.task_metrics.Top1``, which bundles made before the folder record in their
runtime.yaml) re-export the same classes.
"""

from pipeline.metrics.base import (BATCH, CHARSET_FILE, PARITY_KEYS, MetricError, TaskMetric, check_records,
                                   check_scores, output_names)
from pipeline.metrics.classification import (EMBEDDING_NAMES, TIE_ATOL, TIE_RTOL, UNLABELED_TOP1, Top1,
                                             class_scores, tie_agreement)
from pipeline.metrics.detection import Detection
from pipeline.metrics.embedding import Embedding
from pipeline.metrics.loading import BUILTIN_NAMES, bundle_record, files, load_metric
from pipeline.metrics.maps import MapIoU
from pipeline.metrics.regression import Regression
from pipeline.metrics.text import CTC, char_accuracy, edit_distance, read_charset

__all__ = ["BATCH", "BUILTIN_NAMES", "CHARSET_FILE", "CTC", "Detection", "EMBEDDING_NAMES", "Embedding", "MapIoU",
           "MetricError", "PARITY_KEYS", "Regression", "TIE_ATOL", "TIE_RTOL", "TaskMetric", "Top1", "UNLABELED_TOP1",
           "bundle_record", "char_accuracy", "check_records", "check_scores", "class_scores", "edit_distance", "files",
           "load_metric", "output_names", "read_charset", "tie_agreement"]
