"""A metric from its config (the ``metric`` group, through ``hydra.utils.instantiate``), the
files its results depend on, and the record a bundle keeps of it. A built-in is known by
its class, whichever path names it (``pipeline.metrics.Top1`` or an old bundle's
``pipeline.task_metrics.Top1``)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

from pipeline.metrics.base import CHARSET_FILE, PARITY_KEYS, MetricError, TaskMetric, output_names
from pipeline.metrics.classification import Top1
from pipeline.metrics.embedding import Embedding
from pipeline.metrics.maps import MapIoU
from pipeline.metrics.regression import Regression
from pipeline.metrics.text import CTC, read_charset

# a built-in's name in reports where the config gives none (embedding: the share of samples
# keeping their nearest neighbour)
BUILTIN_NAMES = ((Top1, "top1"), (MapIoU, "map_iou"), (CTC, "ctc"), (Regression, "regression"), (Embedding, "nn@1"))


def load_metric(config: Optional[Dict[str, Any]], root: Optional[str] = None) -> Optional[TaskMetric]:
    """The configured metric (``metric`` group) through ``hydra.utils.instantiate``, or
    None for ``metric=none``. A class is instantiated with the config's other keys; a
    function is the metric itself (its keys bound as keyword arguments). ``root``:
    the folder relative files (a charset) are read from, for bundles. Imports the
    metric's code only: no model is loaded."""
    config = dict(config or {})
    if not config.get("_target_"):
        return None
    path = str(config["_target_"])
    if config.get("path"):
        folder = str(Path(config["path"]).expanduser().resolve())
        if folder not in sys.path:
            sys.path.insert(0, folder)
    target = _imported(config.get("name") or path.rsplit(".", 1)[-1], path)
    name = config.get("name") or _short_name(target, path)
    arguments = {key: value for key, value in config.items() if key not in PARITY_KEYS}
    if target is CTC and root:
        arguments.setdefault("root", root)
    score = _instantiate(name, target, arguments)

    def declared(key: str, default: bool) -> bool:  # the config, else the metric (instance, then class/function)
        value = config.get(key)
        return bool(getattr(score, key, getattr(target, key, default)) if value is None else value)

    names = output_names(config.get("output"))
    return TaskMetric(name=name, score=score, output=names[0] if names else None,
                      higher_is_better=declared("higher_is_better", True),
                      needs_labels=declared("needs_labels", False), config=config,
                      set_level=declared("set_level", False), names=names)


def _imported(name: str, target: str):
    """The class or function ``metric._target_`` names, or a one-line MetricError."""
    from hydra.utils import get_object

    try:
        return get_object(target)
    except Exception as err:  # noqa: BLE001 - ImportError, AttributeError...: the user's path
        raise MetricError(f"metric {name}: cannot import {target!r} ({_cause(err)}); "
                          "set metric._target_ to module.callable and metric.path to the folder holding "
                          "the module") from None


def _instantiate(name: str, target, arguments: Dict[str, Any]):
    """A class instantiated with the config's keys; a function as it is, its keys bound."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    plain = {**arguments, "_convert_": "all"}  # lists and dicts as Python's, not OmegaConf's
    try:
        if isinstance(target, type):
            return instantiate(plain)
        if not callable(target):
            raise MetricError(f"metric {name}: {arguments['_target_']!r} is not callable")
        return instantiate({**plain, "_partial_": True}) if len(arguments) > 1 else target
    except InstantiationException as err:
        own = _metric_error(err)  # the metric's own account (a charset it cannot read)
        raise MetricError(f"metric {name}: {own.args[0] if own else _cause(err)}") from None


def _metric_error(err: Optional[BaseException]) -> Optional[MetricError]:
    while err is not None and not isinstance(err, MetricError):
        err = err.__cause__ or err.__context__
    return err


def _cause(err: BaseException) -> str:
    while err.__cause__ is not None:
        err = err.__cause__
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__


def _short_name(target, path: str) -> str:
    """A built-in's report name (``BUILTIN_NAMES``), else the callable's own name."""
    return next((name for builtin, name in BUILTIN_NAMES if target is builtin), path.rsplit(".", 1)[-1])


def files(config: Optional[Dict[str, Any]]) -> List[Path]:
    """Files a metric's results depend on, for cache keys: a charset file and the
    source file of a custom metric's module."""
    config = config or {}
    found = []
    charset = config.get("charset")
    if isinstance(charset, str) and Path(charset).expanduser().is_file():
        found.append(Path(charset).expanduser())
    target = str(config.get("_target_") or "")
    if config.get("path") and "." in target:
        module = Path(config["path"]).expanduser() / (target.rsplit(".", 1)[0].replace(".", "/") + ".py")
        if module.is_file():
            found.append(module)
    return found


def bundle_record(config: Optional[Dict[str, Any]], folder: Path) -> Optional[Dict[str, Any]]:
    """The metric as a bundle's runtime.yaml records it (``parity-bundle run`` decodes
    outputs with it): a charset file is copied into the bundle as CHARSET_FILE."""
    if not config or not config.get("_target_"):
        return None
    record = dict(config)
    charset = record.get("charset")
    if isinstance(charset, str) and charset:
        (Path(folder) / CHARSET_FILE).write_text("\n".join(read_charset(charset)) + "\n", encoding="utf-8")
        record["charset"] = CHARSET_FILE
    if record.get("path"):
        record["path"] = str(Path(record["path"]).expanduser().resolve())
    return record
