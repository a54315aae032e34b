"""The mean_min_max range estimator: per-sample min/max collected in the streaming
calibration pass (batched or not), averaged over samples."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from pipeline.precision.calibration import statistics, tables, thresholds
from pipeline.data import Sample


@pytest.mark.parametrize("batch_size", [1, 4])
def test_per_sample_ranges_are_averaged_over_samples(tmp_path, batch_size):
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"], name="relu")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 6])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 6])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 10
    onnx.save(model, str(tmp_path / "m.onnx"))
    rng = np.random.default_rng(0)
    values = [rng.normal(0, 1, (1, 6)).astype(np.float32) for _ in range(7)]
    values[3][0, 0] = 40.0  # one outlier sample
    stats = statistics.collect(tmp_path / "m.onnx", [Sample(str(i), {"x": v}) for i, v in enumerate(values)],
                               len(values), 64, batch_size, 0)
    low, high = stats.sample_ranges["x"]
    assert low == pytest.approx(np.mean([v.min() for v in values]), rel=1e-5)
    assert high == pytest.approx(np.mean([v.max() for v in values]), rel=1e-5)
    assert stats.sample_ranges["y"][1] == pytest.approx(np.mean([max(v.max(), 0) for v in values]), rel=1e-5)
    entry = tables.table_entry(stats.histograms["x"], "mean_min_max", sample_range=stats.sample_ranges["x"])
    assert entry["threshold"] == pytest.approx(max(abs(low), abs(high)), rel=1e-6)
    assert entry["threshold"] < stats.histograms["x"].abs_max / 3  # the outlier counts by its share only
    assert (entry["min"], entry["max"]) == (low, high)
    # saved and loaded with the statistics; without per-sample ranges the estimator is max
    stats.save(tmp_path)
    assert statistics.Statistics.load(tmp_path).sample_ranges == stats.sample_ranges
    assert thresholds.compute(stats.histograms["x"], "mean_min_max") == stats.histograms["x"].abs_max
