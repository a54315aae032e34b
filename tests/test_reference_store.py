"""The reference's answers stored once per model, data and machine
(pipeline/verification/reference_store.py): what verify reads instead of running the
reference again, and what precision=auto fills ahead at the lowest priority."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time

import numpy as np

from pipeline.config.schemas import DataConfig
from pipeline.data import TensorSpec, open_dataset
from pipeline.verification import reference_store
from pipeline.verification.reference_store import Ahead, ReferenceStore, fill
from pipeline.worker import BackendWorker
from test_worker import relu_add_model

REFERENCE = "pipeline.backends.onnxruntime"
SETTINGS = {"model": "model.onnx", "precision": "fp32",
            "options": {"graph_optimization_level": "disabled", "allow_spinning": False}}


def test_a_sample_comes_back_as_stored_with_its_types(tmp_path):
    store = ReferenceStore(tmp_path / "store")
    outputs = {"scores": np.random.default_rng(0).random((1, 5), np.float32),
               "ids": np.array([[3, 1]], np.int64), "mask": np.array([True, False]), "softmax_11.tmp_0": np.ones(2)}
    assert store.get(0) is None and not store.has(0)
    store.put(0, outputs)
    found = store.get(0)
    assert list(found) == list(outputs)
    assert all(found[k].dtype == v.dtype and np.array_equal(found[k], v) for k, v in outputs.items())
    assert not [p for p in (tmp_path / "store").iterdir() if p.name.startswith(".")]  # no temporary left


def test_answer_reads_what_is_stored_and_keeps_what_it_ran(tmp_path):
    store, runs = ReferenceStore(tmp_path / "store"), []

    def run(feeds):
        runs.append(feeds)
        return {"y": feeds["x"] * 2}

    first = store.answer(4, {"x": np.ones(3)}, run)
    again = ReferenceStore(tmp_path / "store").answer(4, {"x": np.zeros(3)}, run)  # another verify, same store
    assert len(runs) == 1 and np.array_equal(again["y"], first["y"]) and (store.served, store.ran) == (0, 1)


def test_the_store_stops_at_its_budget_and_skips_what_needs_pickling(tmp_path, monkeypatch):
    monkeypatch.setattr(reference_store, "MAX_BYTES", 100)
    store = ReferenceStore(tmp_path / "store")
    store.put(0, {"y": np.zeros(10, np.float32)})  # 40 bytes
    store.put(1, {"y": np.zeros(20, np.float32)})  # 80 more: over the budget
    assert store.has(0) and not store.has(1) and store.full
    texts = ReferenceStore(tmp_path / "texts")
    texts.put(0, {"label": np.array(["a", "b"], dtype=object)})
    assert texts.get(0) is None and texts.full


def test_an_unreadable_sample_is_not_an_answer(tmp_path):
    store = ReferenceStore(tmp_path / "store")
    store.folder.mkdir()
    (store.folder / "0.npz").write_bytes(b"not a zip")
    assert store.get(0) is None
    answer = store.answer(0, {"x": np.ones(2)}, lambda feeds: {"y": feeds["x"] + 1})  # run, and written again
    assert np.array_equal(store.get(0)["y"], answer["y"]) and (store.served, store.ran) == (0, 1)


def _data(tmp_path):
    rng = np.random.default_rng(1)
    np.savez(tmp_path / "data.npz", **{"calibration/x": rng.standard_normal((4, 2, 3, 4)).astype(np.float32),
                                       "validation/x": rng.standard_normal((6, 2, 3, 4)).astype(np.float32)})
    relu_add_model(tmp_path / "model.onnx")
    inputs = [TensorSpec(name="x", shape=[2, 3, 4], dtype="float32", batch_axis=None)]
    return DataConfig(path=str(tmp_path / "data.npz")), inputs


def test_fill_stores_what_the_reference_worker_answers_bit_for_bit(tmp_path):
    data, inputs = _data(tmp_path)
    store = ReferenceStore(tmp_path / "store")
    fill(str(store.folder), REFERENCE, str(tmp_path), SETTINGS, data, inputs, multiprocessing.Event())
    samples = list(open_dataset(data, inputs).validation)
    with BackendWorker(REFERENCE, tmp_path, SETTINGS, label="reference", timeout_s=60) as live:
        for index, sample in enumerate(samples):
            expected = live.run(sample.feeds)
            assert np.array_equal(store.get(index)["y"], expected["y"])
    assert not store.has(len(samples))


def test_ahead_fills_in_a_low_priority_process_and_stops_when_asked(tmp_path):
    data, inputs = _data(tmp_path)
    store = ReferenceStore(tmp_path / "store")
    ahead = Ahead(store, REFERENCE, tmp_path, SETTINGS, data, inputs)
    ahead._process.join(60)  # six samples: it finishes on its own
    assert all(store.has(index) for index in range(6))
    ahead.stop()
    ahead.stop()  # idempotent
    stopped = ReferenceStore(tmp_path / "stopped")
    early = Ahead(stopped, REFERENCE, tmp_path, SETTINGS, data, inputs)
    early.stop()  # at once: whatever it stored is whole
    assert all(stopped.get(index) is not None for index in range(6) if stopped.has(index))


def test_stopping_a_starved_process_waits_about_one_reference_run(tmp_path):
    """A process ahead that gets no CPU (here: stopped by a signal; on a loaded machine: nice
    19) is killed after about one reference run, not after STOP_S."""
    data, inputs = _data(tmp_path)
    ahead = Ahead(ReferenceStore(tmp_path / "store"), REFERENCE, tmp_path, SETTINGS, data, inputs)
    os.kill(ahead._process.pid, signal.SIGSTOP)
    started = time.monotonic()
    ahead.stop(run_s=0.2)
    assert time.monotonic() - started < reference_store.STOP_MARGIN_S + 3.0 < reference_store.STOP_S
    assert ahead._process is None


def _niceness_after_lowering(path: str) -> None:
    reference_store.with_lowest_priority()
    with open(path, "w") as out:
        out.write(str(os.nice(0)))


def test_the_process_ahead_takes_only_idle_cores(tmp_path):
    from pipeline.worker import start_process

    start_process(_niceness_after_lowering, (str(tmp_path / "nice"),), "test").join(30)
    assert int((tmp_path / "nice").read_text()) == 19
