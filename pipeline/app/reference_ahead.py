"""precision=auto's process ahead: the reference's answers on the validation set filled into
its store (pipeline/verification/reference_store.py) at the lowest CPU priority while the
first candidate calibrates and builds (docs/verify.md, "One reference pass")."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

from pipeline.app.runner import RunOutcome
from pipeline.console import PROGRESS
from pipeline.errors import ParityError

progress_log = logging.getLogger(PROGRESS)


class ReferenceAhead:
    """The reference's answers on the validation set, filled into its store by a process of
    the lowest priority from the first candidate's convert until the first verify
    (pipeline/verification/reference_store.py): started once, stopped by the caller."""

    def __init__(self):
        self.running = None
        self.started = False

    def start(self, checked, built: RunOutcome) -> None:
        if self.started or not checked.pipeline.cache or "convert" not in built.results:
            return
        self.started = True
        from pipeline.artifacts import hash_tree
        from pipeline.data import TensorSpec, open_dataset
        from pipeline.verification.reference_store import Ahead, ReferenceStore, store_key
        from stages import REFERENCE_MODULE, reference_settings

        convert = built.results["convert"]
        inputs = [TensorSpec(**spec) for spec in convert.summary.inputs]
        settings = reference_settings(convert)
        try:
            dataset = open_dataset(checked.data, inputs)
        except ParityError:  # the candidate's verify says what is wrong with the data
            return
        hashes = {path: digest for path, digest in hash_tree(convert.out_dir).items() if path != "result.json"}
        store = ReferenceStore.of(Path(checked.pipeline.cache_dir).expanduser(),
                                  store_key(hashes, checked.data, dataset.files, settings))
        if store.holds(len(dataset.validation)):  # a rerun: nothing to fill
            progress_log.info("precision=auto: the reference's answers are all stored, none run ahead")
            return
        self.running = Ahead(store, REFERENCE_MODULE, convert.out_dir, settings, checked.data, inputs)

    def stop(self, run_s: Optional[float] = None) -> None:
        """``run_s``: one reference run's estimated seconds (the budget's probe), else None."""
        if self.running is not None:
            self.running.stop(run_s)
            self.running = None
