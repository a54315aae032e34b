"""pipeline/worker.py: backend sessions in a child process, whose crashes, hangs and
errors come back as BackendCrashed while this (the parent) process carries on."""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from pipeline.errors import BackendCrashed, ExitCode
from pipeline.worker import BackendWorker, side_by_side

TESTS = "worker_backends"  # tests/ is on sys.path, and the spawned child gets the same sys.path
X = np.random.default_rng(0).standard_normal((2, 3, 4)).astype(np.float32)


def worker(behaviour: str, tmp_path, **kwargs) -> BackendWorker:
    kwargs.setdefault("timeout_s", 30)
    return BackendWorker(TESTS, tmp_path, {"behaviour": behaviour, **kwargs.pop("settings", {})},
                         label="test (target)", **kwargs)


def crash(behaviour: str, tmp_path, **kwargs) -> BackendCrashed:
    with worker(behaviour, tmp_path, **kwargs) as w:
        pid = w.effective()["pid"]
        with pytest.raises(BackendCrashed) as info:
            w.run({"x": X})
        assert not w.alive
        with pytest.raises(ProcessLookupError):  # the child is gone, and reaped
            os.kill(pid, 0)
        with pytest.raises(BackendCrashed) as again:  # a dead worker answers at once, the same way
            w.run({"x": X})
        assert str(again.value) == str(info.value)
    err = info.value
    assert "\n" not in str(err) and err.exit_code == ExitCode.BACKEND
    return err


def test_ok_round_trip(tmp_path):
    with worker("ok", tmp_path) as w:
        assert w.alive and (w.inputs, w.outputs) == (["x"], ["y"])
        y = w.run({"x": X})["y"]
        assert y.dtype == X.dtype and np.array_equal(y, X * 2)
        effective = w.effective()
        assert effective["device"] == "CPU" and effective["pid"] not in (None, os.getpid())
        timing = w.latency({"x": X}, warmup=1, repeats=5)
        assert timing["runs"] == 5 and 0 <= timing["min_ms"] <= timing["median_ms"] <= timing["max_ms"]
    assert not w.alive
    w.close()  # idempotent


def test_abort(tmp_path):
    err = crash("abort", tmp_path)
    assert err.kind == "crashed" and "SIGABRT" in str(err) and "run()" in str(err)
    assert str(err).startswith("backend crashed: test (target) crashed")


def test_noisy_abort_keeps_stderr(tmp_path):
    log = tmp_path / "logs" / "worker.log"
    err = crash("noisy_abort", tmp_path, log_path=log)
    assert "SIGABRT" in str(err)
    assert str(err).endswith("; last stderr: worker_backends: about to abort")
    assert err.stderr_tail[-1] == "worker_backends: about to abort"
    assert "about to abort" in log.read_text()  # a log_path given is kept


def test_segfault_then_restart(tmp_path):
    err = crash("segfault", tmp_path)
    assert err.kind == "crashed" and "SIGSEGV" in str(err)
    with worker("segfault", tmp_path) as w:
        with pytest.raises(BackendCrashed, match="SIGSEGV"):
            w.run({"x": X})
        w.start()  # a fresh child
        assert w.alive and w.effective()["device"] == "CPU"


def test_openvino_style_message(tmp_path):
    with worker("raise_nested", tmp_path) as w:
        with pytest.raises(BackendCrashed) as info:
            w.run({"x": X})
    assert str(info.value) == "backend crashed: test (target) run() raised RuntimeError: Resource temporarily unavailable"


def test_hang_times_out(tmp_path):
    started = time.monotonic()
    err = crash("hang", tmp_path, timeout_s=2)
    assert err.kind == "hung" and "no answer in 2 s" in str(err)
    assert time.monotonic() - started < 15


def test_python_error_keeps_the_worker(tmp_path):
    with worker("raise", tmp_path) as w:
        with pytest.raises(BackendCrashed) as info:
            w.run({"x": X})
        err = info.value
        assert err.kind == "error" and "ValueError: bad input shape" in err.detail
        assert str(err) == "backend crashed: test (target) run() raised ValueError: bad input shape"
        assert w.alive and w.effective()["device"] == "CPU"
        with pytest.raises(BackendCrashed, match="no_such_method"):
            w.call("no_such_method")
        assert w.alive


def test_load_error(tmp_path):
    w = worker("load_raise", tmp_path)
    with pytest.raises(BackendCrashed) as info:
        with w:
            pass
    err = info.value
    assert err.kind == "error" and "load() raised RuntimeError: cannot read" in str(err)
    assert not w.alive and not w.log_path.exists()  # cleaned up although __exit__ never ran
    with pytest.raises(BackendCrashed):
        w.run({"x": X})


def test_missing_module(tmp_path):
    with pytest.raises(BackendCrashed, match="ModuleNotFoundError"):
        BackendWorker("no_such_backend_module", tmp_path, {}, label="nothing").start()


def test_memory_limit(tmp_path):
    with worker("allocate", tmp_path, memory_mb=512, settings={"mb": 2048}) as w:
        with pytest.raises(BackendCrashed) as info:
            w.run({"x": X})
        assert info.value.kind == "memory" and "MemoryError: Unable to allocate" in str(info.value)
        assert w.alive


def relu_add_model(path):
    bias = numpy_helper.from_array(np.linspace(-1, 1, 4, dtype=np.float32), "bias")
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Add", ["r", "bias"], ["y"])], "relu_add",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3, 4])], [bias])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return np.maximum(X, 0) + numpy_helper.to_array(bias)


@pytest.mark.parametrize("memory_mb", [None, 4096])
def test_onnxruntime_same_as_in_process(tmp_path, memory_mb):
    from pipeline.backends import onnxruntime

    relu_add_model(tmp_path / "model.onnx")
    settings = {"model": "model.onnx", "precision": "fp32", "options": {}}
    expected = onnxruntime.load(tmp_path, settings).run({"x": X})
    with BackendWorker("pipeline.backends.onnxruntime", tmp_path, settings, label="onnxruntime (target)",
                       timeout_s=60, memory_mb=memory_mb) as w:
        assert (w.inputs, w.outputs) == (["x"], ["y"])
        got = w.run({"x": X})
        assert got.keys() == expected.keys() and np.array_equal(got["y"], expected["y"])
        assert w.effective()["device"] == "CPU"


@pytest.mark.parametrize("memory_mb", [None, 4096])
def test_openvino_matches_numpy(tmp_path, memory_mb):
    from pipeline.backends import openvino

    expected = relu_add_model(tmp_path / "model.onnx")
    openvino.convert(tmp_path / "model.onnx", tmp_path)
    settings = {"model": "model.xml", "precision": "fp32", "options": {"INFERENCE_PRECISION_HINT": "f32"},
                "outputs": []}
    with BackendWorker("pipeline.backends.openvino", tmp_path, settings, label="openvino (target)",
                       timeout_s=60, memory_mb=memory_mb) as w:
        got = w.run({"x": X})
        assert list(got) == w.outputs == ["y"]
        np.testing.assert_allclose(got["y"], expected, rtol=0, atol=1e-6)
        assert "CPU" in w.effective()["device"]


def test_side_by_side_keeps_order_and_stops_feeding_a_failed_worker(tmp_path):
    samples = [SimpleNamespace(feeds={"x": X + index}) for index in range(7)]
    with worker("count", tmp_path) as counted, worker("raise_second", tmp_path) as failing:
        answered = list(side_by_side({"counted": counted, "failing": failing}, samples, ahead=3))
        assert [sample for sample, _ in answered] == samples
        for index, (sample, answers) in enumerate(answered):
            assert np.array_equal(answers["counted"]["y"], sample.feeds["x"] * 2)
            assert int(answers["counted"]["calls"]) == index + 1
        failed = [answers["failing"] for _, answers in answered]
        assert isinstance(failed[1], BackendCrashed) and "second sample is bad" in str(failed[1])
        assert failed[2:] == [None] * 5  # given no sample after its failure
        assert int(counted.run({"x": X})["calls"]) == 8  # every sample run once, nothing else


def requests_of(counted: BackendWorker) -> list:
    """The sizes of the batches side_by_side sends ``counted``, in order (its run_each counted)."""
    requests = []
    run_each = counted.run_each
    counted.run_each = lambda batch: requests.append(len(batch)) or run_each(batch)
    return requests


def test_side_by_side_batches_samples_and_a_failure_inside_a_batch_keeps_the_answers_before_it(tmp_path):
    samples = [SimpleNamespace(feeds={"x": X + index}) for index in range(40)]
    with worker("count", tmp_path) as counted, worker("raise_tenth", tmp_path) as failing:
        requests = requests_of(counted)
        # a batch as long as it may be: 8 samples a request after the first
        answered = list(side_by_side({"counted": counted, "failing": failing}, samples, max_batch=8, batch_s=60))
        assert [sample for sample, _ in answered] == samples
        for index, (sample, answers) in enumerate(answered):
            assert np.array_equal(answers["counted"]["y"], sample.feeds["x"] * 2)
            assert int(answers["counted"]["calls"]) == index + 1
        assert sum(requests) == 40 and max(requests) == 8 and len(requests) < 10, requests
        failed = [answers["failing"] for _, answers in answered]
        assert all(np.array_equal(failed[i]["y"], samples[i].feeds["x"] * 2) for i in range(9))
        assert isinstance(failed[9], BackendCrashed) and "tenth sample is bad" in str(failed[9])
        assert failed[10:] == [None] * 30


def test_side_by_side_keeps_samples_of_large_tensors_one_a_request(tmp_path):
    """A batch holds at most about 1 MB of a sample's inputs and outputs, so what a worker
    keeps for a request does not show in the peak memory verify reads from it."""
    big = np.ones((1, 3, 224, 224), dtype=np.float32)  # 0.6 MB in, 0.6 MB out
    samples = [SimpleNamespace(feeds={"x": big + index}) for index in range(6)]
    with worker("count", tmp_path) as counted:
        requests = requests_of(counted)
        answered = list(side_by_side({"counted": counted}, samples, max_batch=8, batch_s=60))
        assert [int(answers["counted"]["calls"]) for _, answers in answered] == [1, 2, 3, 4, 5, 6]
        assert requests == [1] * 6


def test_side_by_side_closed_early_leaves_no_answer_in_flight(tmp_path):
    samples = [SimpleNamespace(feeds={"x": X + index}) for index in range(20)]
    with worker("count", tmp_path) as counted:
        answered = side_by_side({"counted": counted}, samples, ahead=4, max_batch=1)
        next(answered)
        answered.close()  # runs already given are awaited, the rest never start
        reply = counted.run({"x": -X})
        assert np.array_equal(reply["y"], -X * 2)  # its own answer, not a stale reply left in the pipe
        assert 2 <= int(reply["calls"]) <= 6  # after at most the sample yielded and 4 ahead


def test_the_fork_server_preloads_every_backend_module_and_no_runtime():
    """Workers fork from a server that imported parity's backend modules (their runtimes are
    imported in load): a backend added to pipeline/backends is preloaded too, and importing
    the preload in a fresh interpreter brings in no runtime, nor the config's OmegaConf and
    Hydra (a server starts in every job that verifies: 0.1 s of CPU each)."""
    import subprocess
    import sys

    from pipeline import backends
    from pipeline.worker import PRELOAD

    assert set(backends.MODULES.values()) <= set(PRELOAD)
    probe = ("import importlib, sys; from pipeline.worker import PRELOAD; [importlib.import_module(m) for m in PRELOAD];"
             "print(sorted(m for m in ('onnxruntime', 'openvino', 'ncnn', 'MNN', 'onnx', 'omegaconf', 'hydra') "
             "if m in sys.modules))")
    imported = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert imported.returncode == 0 and imported.stdout.strip() == "[]", imported.stdout + imported.stderr
