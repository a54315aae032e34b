"""The task metrics as a folder (pipeline/metrics/, one module a task): the paths before it
still resolve to the same classes, so a bundle whose runtime.yaml records an old
``_target_`` (pipeline.task_metrics.Top1, ...) loads its metric as parity-bundle run does."""

from __future__ import annotations

import numpy as np
import pytest
import yaml

from pipeline import metrics
from pipeline.release.bundle import runtime_settings

BUILTINS = {"Top1": {}, "MapIoU": {}, "CTC": {"charset": ["a", "b"]}, "Regression": {}, "Embedding": {},
            "Detection": {"name": "detection_f1"}}


@pytest.mark.parametrize("name", BUILTINS)
def test_an_old_target_is_the_new_class_under_the_same_name(name):
    old = metrics.load_metric({"_target_": f"pipeline.task_metrics.{name}", **BUILTINS[name]})
    new = metrics.load_metric({"_target_": f"pipeline.metrics.{name}", **BUILTINS[name]})
    assert type(old.score) is type(new.score) is getattr(metrics, name)
    assert old.name == new.name and old.higher_is_better == new.higher_is_better


def test_an_old_bundles_runtime_yaml_still_loads_its_metric(tmp_path):
    """runtime.yaml as a ctc bundle made before the folder wrote it: the charset copied in
    as charset.txt, read relative to the bundle; the decoded text as before."""
    (tmp_path / "charset.txt").write_text("a\nb\n")
    record = {"_target_": "pipeline.task_metrics.CTC", "output": None, "charset": "charset.txt", "blank": 0,
              "strip": True, "casefold": False, "ignore_space": False}
    (tmp_path / "runtime.yaml").write_text(yaml.safe_dump({"backend": "onnxruntime", "metric": record}))
    metric = metrics.load_metric(runtime_settings(tmp_path).get("metric"), root=str(tmp_path))
    assert metric.name == "ctc" and isinstance(metric.score, metrics.CTC)
    assert metric.hook("decode")(np.eye(3)[[1, 1, 0, 2]][np.newaxis]) == "ab"
    detector = {"_target_": "pipeline.task_metrics.Detection", "name": "detection_f1", "format": "nms", "conf": 0.25}
    rows = np.array([[[10, 10, 50, 50, 0.9, 2]]], dtype=np.float32)
    assert '"class": 2' in metrics.load_metric(detector).hook("decode")(rows)


def test_the_old_modules_re_export_what_was_imported_from_them():
    from pipeline import detection_metric, embedding_metric, task_metrics
    from pipeline.metrics import detection, embedding

    for name in ("Detection", "f1", "matches", "ranked_ap", "average_precision", "decode", "nms", "recognise"):
        assert getattr(detection_metric, name) is getattr(detection, name)
    assert embedding_metric.Embedding is embedding.Embedding
    for name in ("load_metric", "files", "bundle_record", "MetricError", "TaskMetric", "BATCH", "check_scores",
                 "per_sample", "char_accuracy", "tie_agreement", "class_scores", "UNLABELED_TOP1", "TIE_RTOL"):
        assert hasattr(task_metrics, name), name
