"""The sensitivity search and precision=mixed through the CLI."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from conftest import read_report, run_cli, run_dirs, single_bundle
from pipeline.precision.calibration.tables import from_tpu_mlir_qtable, to_tpu_mlir_qtable


def fragile_model(path):
    """conv2's output has one channel 1000x the others; conv3 scales it back down, so the
    network output depends on the small channels that per-tensor int8 wipes out there."""
    rng = np.random.default_rng(3)
    w1 = rng.normal(0, 0.5, (4, 1, 3, 3)).astype(np.float32)
    w2 = rng.normal(0, 0.5, (4, 4, 3, 3)).astype(np.float32)
    w2[0] *= 1000.0
    w3 = rng.normal(0, 0.5, (2, 4, 3, 3)).astype(np.float32)
    w3[:, 0] *= 1e-3
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w1"], ["a"], name="conv1", pads=[1, 1, 1, 1]),
         helper.make_node("Relu", ["a"], ["b"], name="relu1"),
         helper.make_node("Conv", ["b", "w2"], ["c"], name="conv2", pads=[1, 1, 1, 1]),
         helper.make_node("Conv", ["c", "w3"], ["y"], name="conv3", pads=[1, 1, 1, 1])],
        "fragile", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, 8, 8])],
        initializer=[numpy_helper.from_array(w, n) for w, n in ((w1, "w1"), (w2, "w2"), (w3, "w3"))])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def sensitivity_summary(run_dir):
    return json.loads((run_dir / "stages" / "sensitivity" / "result.json").read_text())["summary"]


def test_fragile_layer_ranks_first_and_stays_float(tmp_path):
    """The search itself: equalization, which would move the outlier channel into conv3's
    weights and let plain int8 pass (the next test), is off."""
    model = fragile_model(tmp_path / "fragile.onnx")
    result = run_cli([f"model.path={model}", "data=random", "precision=mixed", "calibration=max",
                      "precision.equalization=false", "sensitivity.heads_first=false"], tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    run_dir = run_dirs(tmp_path)[-1]
    summary = sensitivity_summary(run_dir)
    ranking = [row["op"] for row in summary["ranking"]]
    assert set(ranking[:2]) == {"conv2", "conv3"}  # both quantize the fragile tensor
    assert summary["ranking"][0]["loss"] > 10 * summary["ranking"][-1]["loss"]
    assert summary["int8"]["cosine"] < 0.999 <= summary["mixed"]["cosine"]
    assert set(summary["float_ops"]) <= {"conv2", "conv3"} and summary["float_ops"]
    qtable = (run_dir / "stages" / "sensitivity" / "qtable.txt").read_text()
    assert from_tpu_mlir_qtable(qtable) == summary["float_ops"]
    report = read_report(run_dir)
    assert report["verify"]["verdict"] == "pass"
    assert report["verify"]["effective"]["precision"] == "mixed"


def test_equalization_moves_the_fragile_channel_and_plain_int8_meets_the_target(tmp_path):
    """conv2's outlier channel scaled down in conv2 and up in conv3 (pipeline/precision/
    equalization.py): the int8 model does better, plain int8 meets the mixed target, and
    the search is skipped."""
    model = fragile_model(tmp_path / "fragile.onnx")
    result = run_cli([f"model.path={model}", "data=random", "precision=mixed", "calibration=max"], tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    run_dir = run_dirs(tmp_path)[-1]
    equalized = read_report(run_dir)["calibration"]["equalization"]
    assert equalized["applied"] is True
    assert [(p["producer"], p["consumers"], p["channels"]) for p in equalized["outlier_pairs"]] == \
        [("conv2", ["conv3"], [0])]
    scores = equalized["candidates"]
    assert scores[f"alpha {equalized['alpha']:g}"]["loss"] < scores["none"]["loss"]
    summary = sensitivity_summary(run_dir)
    assert summary["skipped"] == "plain int8 already meets the target" and summary["int8"]["cosine"] >= 0.999


def tokens_model(path):
    """A sample's [1, 4, 8] input becomes [4 tokens, 8 channels] (axis 0 is not a batch)
    for two MatMuls, then [1, 4, 8] again: no batch fits, and a batch of tensors
    concatenated sample after sample has 4 rows per sample (PP-OCRv4's recognizer)."""
    rng = np.random.default_rng(5)
    w1, w2 = (rng.normal(0, 0.5, (8, 8)).astype(np.float32) for _ in range(2))
    shapes = [np.array(s, np.int64) for s in ([4, 8], [1, 4, 8])]
    graph = helper.make_graph(
        [helper.make_node("Reshape", ["x", "tokens"], ["t"], name="to_tokens"),
         helper.make_node("MatMul", ["t", "w1"], ["a"], name="mm1"),
         helper.make_node("Relu", ["a"], ["b"], name="relu"),
         helper.make_node("MatMul", ["b", "w2"], ["c"], name="mm2"),
         helper.make_node("Reshape", ["c", "back"], ["y"], name="to_sample")],
        "tokens", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8])],
        initializer=[numpy_helper.from_array(v, n) for v, n in ((w1, "w1"), (w2, "w2"), (shapes[0], "tokens"),
                                                                 (shapes[1], "back"))])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def test_search_runs_samples_one_by_one_when_axis_0_is_not_a_batch(tmp_path):
    model = tokens_model(tmp_path / "tokens.onnx")
    result = run_cli([f"model.path={model}", "data=random", "precision=mixed", "sensitivity=top_n",
                      "sensitivity.top_n=1"], tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    summary = sensitivity_summary(run_dirs(tmp_path)[-1])
    assert sorted(row["op"] for row in summary["ranking"]) == ["mm1", "mm2"]
    assert all(0 <= row["loss"] < 0.1 for row in summary["ranking"])
    assert len(summary["float_ops"]) == 1


@pytest.mark.parametrize("target", ["ort_cpu", "openvino_cpu"])
def test_mixed_bundle_passes_on_both_targets(tmp_path, target):
    # int8 alone reaches a cosine of 0.99999 on the digits model: the target is past it
    result = run_cli(["precision=mixed", f"target={target}", "sensitivity.expected_cos=0.999997",
                      "sensitivity.heads_first=false"], tmp_path)  # the search itself
    assert result.returncode == 0, result.stdout + result.stderr
    run_dir = run_dirs(tmp_path)[-1]
    summary = sensitivity_summary(run_dir)
    assert summary["float_ops"] and "skipped" not in summary
    assert summary["mixed"]["cosine"] >= 0.999997
    # latency-aware: each ranked op's cost measured on the target's own runtime, each float op's in the report
    costs = json.loads((run_dir / "stages" / "sensitivity" / "costs.json").read_text())
    assert set(costs["ops"]) == {r["op"] for r in summary["ranking"]}
    assert ("OpenVINO" if target == "openvino_cpu" else "ONNX Runtime") in costs["measured_by"]
    assert all(c["fp32_ms"] > 0 for c in costs["ops"].values())  # every op found in the fp32 profile
    # timed as the build runs it: on ONNX Runtime its pass-through Relus folded (narrow Convs widened)
    assert (costs["int8_as_built"]["relus_folded"] > 0) == (target == "ort_cpu"), costs["int8_as_built"]
    # each op's input and output elements at the sample's shape; ONNX Runtime's conversions
    # priced by its own int8 run's quantize layers (OpenVINO's: counted as edges)
    assert all(isinstance(n, int) and n > 0 for c in costs["ops"].values() for n in c["elements"]), costs["ops"]
    priced = summary["latency"]["conversions"]
    if target == "ort_cpu":
        assert costs["quantize_ms_per_melement"] > 0 and priced.startswith("priced"), (costs, priced)
    else:
        assert priced == "counted as edges"
    details = summary["float_op_details"]
    assert [d["op"] for d in details] == summary["float_ops"]
    assert all(d["cost_ms"] == costs["ops"][d["op"]]["cost_ms"] for d in details)
    assert "Ops kept in float" in (run_dir / "report.md").read_text()
    # priced conversions: each float op's share in the report's table (ONNX Runtime only)
    assert all(("conversions_ms" in d) == (target == "ort_cpu") for d in details), details
    assert ("conversions ms" in (run_dir / "report.md").read_text()) == (target == "ort_cpu")
    verify = read_report(run_dir)["verify"]
    assert verify["verdict"] == "pass" and verify["effective"]["precision"] == "mixed"
    assert "float_ops" in read_report(run_dir)["build"]["quantization"]


class _SumOfLosses:
    """A stand-in for the whole-model measure, to test the selection's logic alone: the
    output cosine is 1 - the summed losses of the ops left int8."""

    def __init__(self, losses, goal):
        self.losses, self.target, self.calls = losses, goal, 0
        self.goal = (goal, 0.01)  # (cosine, task-metric drop)

    def __call__(self, table, float_ops):
        self.calls += 1
        return {"cosine": 1 - sum(v for op, v in self.losses.items() if op not in float_ops), "metric_drop": None}

    def no_time(self, step):  # no deadline here
        return None

    def meets(self, result):
        return result["cosine"] >= self.target


def test_latency_aware_selection_keeps_the_cheap_op_that_is_enough():
    """A (most sensitive, 5 ms) or B (0.1 ms) alone meets the target: by accuracy alone A
    stays float, latency-aware B does; with both, the prune drops the costlier first."""
    from pipeline.precision.calibration.selection import select_for_target

    losses = {"A": 0.05, "B": 0.04, "C": 0.001}
    ranking = [{"op": op, "loss": loss} for op, loss in losses.items()]
    costs = {"A": 5.0, "B": 0.1, "C": 0.1}
    measure = _SumOfLosses(losses, goal=1 - 0.052)
    assert select_for_target(measure, {}, ranking, 8, {}, {})[0] == ["A"]
    float_ops, curve = select_for_target(measure, {}, ranking, 8, costs, {})
    assert float_ops == ["B"] and curve[0]["cost_ms"] == 0.1
    # a tighter goal needs A and B; starting from both, nothing can go
    measure = _SumOfLosses(losses, goal=1 - 0.0015)
    float_ops, curve = select_for_target(measure, {}, ranking, 8, costs, {})
    assert sorted(float_ops) == ["A", "B"] and [p.get("kept") for p in curve if p.get("kept")] == ["A", "B"]
    assert {p["kept"]: round(p["gain"], 6) for p in curve if p.get("kept")} == {"A": 0.05, "B": 0.04}
    # an op next to a float op closes an island: it is preferred to an equal one that opens another
    neighbours = {"B": ["C", "D"], "C": ["B"], "D": ["B"], "A": []}
    losses = {"A": 0.01, "B": 0.05, "C": 0.01, "D": 0.0}
    ranking = [{"op": op, "loss": loss} for op, loss in losses.items()]
    measure = _SumOfLosses(losses, goal=1 - 0.015)
    float_ops, _ = select_for_target(measure, {}, ranking, 8, {"A": 1.0, "B": 1.0, "C": 1.0, "D": 1.0}, neighbours)
    assert float_ops[:2] == ["B", "C"]


def test_search_measures_verify_cosine_and_starts_from_the_better_table(tmp_path):
    """The selection's cosine is the one verify gates on (all samples together): on the same
    samples it equals verify's int8 baseline; and the curve starts from whichever table, the
    per-op best methods or calibrate's, does better with no op in float."""
    result = run_cli(["precision=mixed", "sensitivity.expected_cos=0.999997", "data.validation_size=30",
                      "sensitivity.samples=30"], tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    run_dir = run_dirs(tmp_path)[-1]
    summary = sensitivity_summary(run_dir)
    verify = read_report(run_dir)["verify"]
    assert summary["int8"]["cosine"] == pytest.approx(verify["comparison"]["int8"]["cosine"], abs=1e-7)
    per_op, plain = summary["per_op_methods"]["cosine"], summary["int8"]["cosine"]
    assert summary["table"] == ("per-op methods" if per_op >= plain else "calibrate")
    table = json.loads((run_dir / "stages" / "sensitivity" / "calibration.json").read_text())["tensors"]
    calibrated = json.loads((run_dir / "stages" / "calibrate" / "calibration.json").read_text())["tensors"]
    assert (table == calibrated) == (summary["table"] == "calibrate")


def test_search_skips_itself_when_int8_meets_the_target(tmp_path):
    result = run_cli(["precision=mixed"], tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    run_dir = run_dirs(tmp_path)[-1]
    summary = sensitivity_summary(run_dir)
    assert summary["skipped"] == "plain int8 already meets the target"
    assert json.loads((run_dir / "stages" / "sensitivity" / "qtable.json").read_text())["float_ops"] == []
    assert read_report(run_dir)["verify"]["effective"]["precision"] == "int8"


def test_top_n_keeps_exactly_n_ops_float(tmp_path):
    result = run_cli(["precision=mixed", "sensitivity=top_n", "sensitivity.top_n=2"], tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    summary = sensitivity_summary(run_dirs(tmp_path)[-1])
    assert summary["float_ops"] == [row["op"] for row in summary["ranking"][:2]]
    model = onnx.load(str(single_bundle(run_dirs(tmp_path)[-1]) / "model.onnx"))
    float_nodes = {n.name for n in model.graph.node if n.name in summary["float_ops"]}
    assert float_nodes == set(summary["float_ops"])


def test_qtable_round_trip_and_errors():
    text = to_tpu_mlir_qtable(["conv2", "fc1"])
    assert text.splitlines()[0].startswith("#")
    assert from_tpu_mlir_qtable(text) == ["conv2", "fc1"]
    with pytest.raises(ValueError, match="line 2"):
        from_tpu_mlir_qtable("# op_name quantize_mode\nconv2\n")


def test_unknown_search_method_is_a_config_error(tmp_path):
    result = run_cli(["precision=mixed", "sensitivity.methods=[kl,entropy]"], tmp_path)
    assert result.returncode == 2 and "sensitivity.methods" in result.stderr


def test_with_more_ops_than_max_ranked_only_the_worst_by_op_sqnr_are_measured_in_full(tmp_path):
    """The search's cost follows sensitivity.max_ranked, not the op count: the other ops get
    their op-level SQNR alone (a single-node run), stay int8, and the summary says so. Here
    the two ops quantizing the fragile tensor are the two worst at the op itself."""
    model = fragile_model(tmp_path / "fragile.onnx")
    result = run_cli([f"model.path={model}", "data=random", "precision=mixed", "calibration=max",
                      "precision.equalization=false", "sensitivity.max_ranked=2", "sensitivity.heads_first=false"],
                     tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    run_dir = run_dirs(tmp_path)[-1]
    summary = sensitivity_summary(run_dir)
    assert {row["op"] for row in summary["ranking"]} == {"conv2", "conv3"}
    assert summary["op_screen"].startswith("1 of 3 ops were ranked by their op-level SQNR alone")
    losses = json.loads((run_dir / "stages" / "sensitivity" / "losses.json").read_text())
    conv1 = [t for t in losses if t["op"] == "conv1"]
    assert conv1 and all(t["loss"] is None and t["op_sqnr_db"] is not None for t in conv1)
    worst_kept = min(max(t["op_sqnr_db"] for t in losses if t["op"] == op) for op in ("conv2", "conv3"))
    assert max(t["op_sqnr_db"] for t in conv1) > worst_kept
    assert set(summary["float_ops"]) <= {"conv2", "conv3"} and summary["float_ops"]
    assert read_report(run_dir)["verify"]["verdict"] == "pass"


def test_the_ops_just_before_an_output_are_always_measured_in_full():
    """U^2-Net-p's fused logits (one Conv, then Sigmoid) quantized to 8 bits flip pixels near
    the map's threshold (keeping that one Conv float took map IoU from 0.970 to 0.980 of fp32's),
    while its op-level SQNR ranked it among the best: the op screen measures every output head
    in full, the fuse and the six side convs (through a Sigmoid, or a Resize and a Sigmoid)."""
    from pipeline.precision.calibration.sensitivity import output_heads
    from segmenter_data import REAL_MODEL

    model = onnx.load(str(REAL_MODEL))
    nodes = list(model.graph.node)
    convs = [i for i, node in enumerate(nodes) if node.op_type == "Conv"]
    heads = {nodes[i].name for i in output_heads(model, convs)}
    assert heads == {"/fuse/Conv", *(f"/sides.{i}/Conv" for i in range(6))}, heads
    assert output_heads(model, convs, depth=1) != output_heads(model, convs)  # the sides behind a Resize
    from pipeline.precision.calibration.sensitivity import input_stems

    assert [nodes[i].name for i in input_stems(model, convs)] == ["/encoder.0/conv_in/conv_in.0/Conv"]


class _MeetsWith:
    """A stand-in for the whole-model measure: meets the target exactly when ``enough`` are
    all float; records the float-op sets it measured."""

    def __init__(self, enough):
        self.enough, self.measured, self.always_float = set(enough), [], []

    def __call__(self, table, float_ops):
        self.measured.append(list(float_ops))
        return {"cosine": 1.0 if self.enough <= set(float_ops) else 0.5, "metric_drop": None}

    def no_time(self, step):  # no deadline here
        return None

    def meets(self, result):
        return result["cosine"] >= 0.99


def test_heads_first_measures_the_output_heads_float_before_any_ranking(tmp_path):
    """The output heads (conv3 here: it writes the graph output) in float, measured first,
    then with the input stems (conv1: it reads the graph input) float too: the first that
    meets the target is the selection; where neither does, [] (the search follows); off, or
    select=top_n, nothing is measured."""
    from pipeline.precision.calibration import sensitivity as search
    from stages.sensitivity import _heads_first

    model = onnx.load(str(fragile_model(tmp_path / "fragile.onnx")))
    ops = search.quantizable_ops(model, {"x": {}, "b": {}, "c": {}})
    cfg = SimpleNamespace(sensitivity=SimpleNamespace(heads_first=True, select=SimpleNamespace(value="target"),
                                                      max_float_ops=32))
    tries = {"heads_first": ["conv3"], "heads_and_stems": ["conv3", "conv1"]}  # conv1 reads the input
    for enough, expected in ((["conv3"], ["conv3"]), (["conv1"], ["conv3", "conv1"]), (["conv2"], [])):
        measure, summary = _MeetsWith(enough), {}
        assert _heads_first(cfg, measure, {}, model, ops, summary) == expected
        measured = [tries["heads_first"]] if expected == ["conv3"] else list(tries.values())
        assert measure.measured == measured and summary["heads_first"]["met"] is (expected == ["conv3"])
        assert summary.get("heads_and_stems", {}).get("met", False) is (expected == ["conv3", "conv1"])
    for setting, select in ((False, "target"), (True, "top_n")):
        cfg.sensitivity.heads_first, cfg.sensitivity.select = setting, SimpleNamespace(value=select)
        measure = _MeetsWith(["conv3"])
        assert _heads_first(cfg, measure, {}, model, ops, {}) == [] and measure.measured == []
    cfg.sensitivity.heads_first, cfg.sensitivity.select = True, SimpleNamespace(value="target")
    measure, summary = _MeetsWith(["conv1"]), {}  # the deadline leaves room for one measure
    measure.no_time = lambda step: f"cut by precision.budget_s: {step}" if measure.measured else None
    assert _heads_first(cfg, measure, {}, model, ops, summary) == [] and measure.measured == [["conv3"]]
    assert summary["cut"] == summary["heads_and_stems"]["cut"] == \
        "cut by precision.budget_s: the mixed search's heads and stems measure"


def test_heads_that_met_are_given_back_to_int8_one_at_a_time_while_the_target_holds():
    """After heads_first meets, each head but the last is given back to int8 in graph order,
    kept float only where the target fails without it (the real-size segmenter on an AMX Xeon:
    7 heads float, mixed at 1.40x fp32; 3 after the give-back, 1.47x); the deadline stops it
    with the set measured so far."""
    from pipeline.precision.calibration.selection import prune

    heads = ["side5", "side4", "side3", "side2", "side1", "side0", "fuse"]
    measure = _MeetsWith(["side0", "fuse"])
    kept, given = prune(measure, {}, heads, {"cosine": 1.0}, {}, [], order=heads[:-1])
    assert kept == ["side0", "fuse"]
    assert [g.get("removed") or g.get("kept") for g in given] == ["side5", "side4", "side3", "side2", "side1", "side0"]
    assert [g["float_ops"] for g in given if "removed" in g] == [6, 5, 4, 3, 2]
    measure = _MeetsWith(["side0", "fuse"])
    measure.no_time = lambda step: f"cut by precision.budget_s: {step}" if len(measure.measured) >= 2 else None
    kept, given = prune(measure, {}, heads, {"cosine": 1.0}, {}, [], order=heads[:-1])
    assert kept == ["side3", "side2", "side1", "side0", "fuse"] and len(given) == 2


def test_a_mixed_job_whose_heads_are_not_enough_runs_the_search_after_them(tmp_path):
    """The fragile model with the defaults: conv3 alone float, or with conv1, does not reach
    the target (conv2's output is still quantized), so the ranking runs and keeps its choice; the
    report says which way heads_first went."""
    model = fragile_model(tmp_path / "fragile.onnx")
    result = run_cli([f"model.path={model}", "data=random", "precision=mixed", "calibration=max",
                      "precision.equalization=false"], tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    run_dir = run_dirs(tmp_path)[-1]
    summary = sensitivity_summary(run_dir)
    assert summary["heads_first"]["float_ops"] == ["conv3"] and summary["heads_first"]["met"] is False
    assert summary["heads_and_stems"]["float_ops"] == ["conv3", "conv1"] and not summary["heads_and_stems"]["met"]
    assert summary["ranking"] and "conv2" in summary["float_ops"] and summary["trials"] > 0
    assert "input stems in float (2 ops, sensitivity.heads_first)" in (run_dir / "report.md").read_text()


def test_a_search_told_that_int8_fails_goes_to_the_heads_without_measuring_it(tmp_path):
    """sensitivity.int8_failed (precision=auto: its int8 candidate's verify of the same build):
    the search takes those figures for plain int8 and measures the heads first. The target is
    set at cosine 0.7, which plain int8 (0.71) would meet here had it been measured: the
    search trusts the verify that failed it, and the heads (0.78) are the selection."""
    model = fragile_model(tmp_path / "fragile.onnx")
    result = run_cli([f"model.path={model}", "data=random", "precision=mixed", "calibration=max",
                      "precision.equalization=false", "sensitivity.expected_cos=0.7",
                      "+sensitivity.int8_failed.cosine=0.5"], tmp_path)
    assert result.returncode == 3, result.stdout + result.stderr  # verify's own 0.995 fails the heads' 0.78
    run_dir = run_dirs(tmp_path)[-1]
    summary = sensitivity_summary(run_dir)
    assert summary["int8"] == {"cosine": 0.5, "from": "the int8 candidate's verify"}, summary
    assert summary["heads_first"]["met"] and summary["float_ops"] == ["conv3"], summary
    assert "a measure with 0 ops float" not in (run_dir / "parity.log").read_text()


def test_auto_tells_mixed_that_int8_failed_only_where_it_failed_on_accuracy():
    from omegaconf import OmegaConf

    from pipeline.app.auto import _known_failing_whole

    def told(checks, verdict="fail", user=None):
        raw = OmegaConf.create({"sensitivity": {"int8_failed": user or {}}})
        row = {"verdict": verdict, "metric_drop": 0.0186, "cosine": 0.9998}
        outcome = SimpleNamespace(verify=SimpleNamespace(checks=[{"check": c, "severity": "fail"} for c in checks]))
        _known_failing_whole(raw, "mixed", ({"int8": row}, {}, {"int8": outcome}))
        return OmegaConf.to_container(raw.sensitivity.int8_failed)

    assert told(["task"]) == {"metric_drop": 0.0186, "cosine": 0.9998}
    assert told(["accuracy", "task"]) == {"metric_drop": 0.0186, "cosine": 0.9998}
    assert told(["task", "memory"]) == {} and told(["float_fallback"]) == {} and told([], "pass") == {}
    assert told(["task"], user={"cosine": 0.1}) == {"cosine": 0.1}  # the user's own stands


def test_the_search_reads_the_reference_answers_verify_stored(tmp_path):
    """The mixed search's fp32 outputs come from verify's reference store where it holds every
    validation sample (precision=auto fills it during int8's candidate): stacked as the
    search's own run stacks them; a missing sample or output leaves the search to compute them."""
    from pipeline.data import pack
    from pipeline.precision.calibration.statistics import BatchRunner
    from pipeline.verification.reference_store import ReferenceStore
    fragile_model(tmp_path / "m.onnx")
    model = onnx.load(str(tmp_path / "m.onnx"))
    name, outputs = model.graph.input[0].name, [o.name for o in model.graph.output]
    shape = [d.dim_value or 1 for d in model.graph.input[0].type.tensor_type.shape.dim]
    rng = np.random.default_rng(0)
    samples = [{name: rng.normal(0, 1, shape).astype(np.float32)} for _ in range(5)]
    store = ReferenceStore(tmp_path / "store")
    runner = BatchRunner(model, outputs, 1)
    for index, feeds in enumerate(samples):
        store.put(index, runner.run(feeds, 1))
    own = BatchRunner(model, outputs, 5).run(pack(samples), 5)
    stored = store.stacked(5, outputs)
    for output in outputs:
        np.testing.assert_allclose(stored[output], own[output], rtol=1e-6, atol=1e-6)
    assert store.stacked(6, outputs) is None  # sample 5 was never answered
    assert store.stacked(5, [*outputs, "not an output"]) is None


def residual_head_model(path):
    """Conv A -> Relu -> Conv B and Conv C, summed (a residual Add) into the head H, the output.
    B and C leave channel 0 at zero, where H's filter has one weight 100x the rest: per-channel
    int8 rounds H's other weights to the big one's step (the output is lost), while H in float
    reading the Add's output quantized loses nothing (channel 0 is zero either way)."""
    rng = np.random.default_rng(5)
    wb, wc = rng.normal(0, 0.3, (8, 8, 3, 3)).astype(np.float32), rng.normal(0, 0.3, (8, 8, 1, 1)).astype(np.float32)
    wb[0], wc[0] = 0.0, 0.0
    wh = rng.normal(0, 0.3, (1, 8, 3, 3)).astype(np.float32)
    wh[0, 0, 1, 1] = 100.0
    weights = {"wa": rng.normal(0, 0.3, (8, 1, 3, 3)).astype(np.float32), "wb": wb, "wc": wc, "wh": wh}
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "wa"], ["a"], name="A", pads=[1, 1, 1, 1]),
         helper.make_node("Relu", ["a"], ["r"], name="relu"),
         helper.make_node("Conv", ["r", "wb"], ["b"], name="B", pads=[1, 1, 1, 1]),
         helper.make_node("Conv", ["r", "wc"], ["c"], name="C"),
         helper.make_node("Add", ["b", "c"], ["s"], name="add"),
         helper.make_node("Conv", ["s", "wh"], ["y"], name="H", pads=[1, 1, 1, 1])],
        "residual_head", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 16, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1, 16, 16])],
        initializer=[numpy_helper.from_array(w, n) for n, w in weights.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def test_on_onnx_runtime_a_float_head_reads_its_input_quantized_where_the_target_holds(tmp_path):
    """The search's last step on ort_cpu (Capabilities.float_reads_int8): H, float after heads
    first, is measured reading the residual Add's output quantized, keeps it, and the build
    and its report say so: ONNX Runtime then runs the Add int8."""
    model = residual_head_model(tmp_path / "residual_head.onnx")
    result = run_cli([f"model.path={model}", "data=random", "precision=mixed", "target=ort_cpu"], tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    run_dir = run_dirs(tmp_path)[-1]
    summary = sensitivity_summary(run_dir)
    assert summary["heads_first"]["met"] and summary["int8"]["cosine"] < summary["expected_cos"]
    assert summary["float_ops"] == ["H"] and summary["quantized_inputs"] == ["H"]
    assert [(t["op"], t["kept"]) for t in summary["inputs_given_back"]] == [("H", True)]
    qtable = json.loads((run_dir / "stages" / "sensitivity" / "qtable.json").read_text())
    assert qtable["quantized_inputs"] == ["H"]
    report = read_report(run_dir)
    assert report["build"]["quantization"]["quantized_inputs"] == ["H"] and report["verdict"] == "pass"
    built = onnx.load(str(run_dir / "stages" / "build" / "model.onnx"))
    producer = {out: node for node in built.graph.node for out in node.output}
    head = next(node for node in built.graph.node if node.name == "H")
    assert producer[head.input[0]].op_type == "DequantizeLinear"
    assert producer[producer[head.input[0]].input[0]].op_type == "QuantizeLinear"
    assert "float ops reading their inputs quantized, as int8 gives them: H kept" in \
        (run_dir / "report.md").read_text()


def test_the_base_table_is_the_one_that_spends_less_of_the_task_metric(monkeypatch):
    """With a task metric scored, the per-op methods' table is the base where its metric drop
    is smaller, though its cosine is lower (the real-size segmenter on ort_cpu: map IoU drop
    0.0154 against calibrate's 0.0194 at cosine 0.99989 against 0.99990); without one, cosine
    decides as before."""
    from stages import sensitivity

    per_op_table = {"per-op": True}
    monkeypatch.setattr(sensitivity.search, "best_method_table", lambda *args: per_op_table)

    def base(per_op: dict, calibrated: dict, goal: tuple) -> str:
        class Measure:
            def __init__(self):
                self.goal, self.no_time = goal, (lambda step, new_table=False: None)

            def __call__(self, table, float_ops):
                return per_op

        summary = {}
        chosen = sensitivity._base_table(Measure(), None, ({"calibrate": True}, calibrated), [], [], summary)
        assert summary["table"] == ("per-op methods" if chosen is per_op_table else "calibrate")
        return summary["table"]

    task_goal = (0.98, 0.01)
    assert base({"cosine": 0.99989, "metric_drop": 0.0154}, {"cosine": 0.99990, "metric_drop": 0.0194},
                task_goal) == "per-op methods"
    assert base({"cosine": 0.99990, "metric_drop": 0.0194}, {"cosine": 0.99989, "metric_drop": 0.0154},
                task_goal) == "calibrate"
    cosine_goal = (0.995, 0.01)
    assert base({"cosine": 0.99989, "metric_drop": None}, {"cosine": 0.99990, "metric_drop": None},
                cosine_goal) == "calibrate"
    assert base({"cosine": 0.99991, "metric_drop": None}, {"cosine": 0.99990, "metric_drop": None},
                cosine_goal) == "per-op methods"


def test_priced_conversions_count_each_crossing_tensor_once():
    """latency.Boundary: a float op's input counts where an int8 op upstream makes it, its
    output where an int8 op downstream reads it; a neighbour joining the float set closes that
    crossing. Chain A -> B -> C: B float alone converts its input and output."""
    from pipeline.precision.calibration.latency import Boundary

    up = {"A": [], "B": ["A"], "C": ["B"]}
    down = {"A": ["B"], "B": ["C"], "C": []}
    priced = Boundary(up, down, {"A": (10, 100), "B": (100, 1000), "C": (1000, 1)}, ms_per_element=0.001)
    assert priced.ms(["B"]) == pytest.approx(1.1)  # B's 100 inputs (A is int8) and its 1000 outputs (C is)
    assert priced.ms(["A", "B"]) == pytest.approx(1.0)  # A reads the graph input: only B's output crosses
    assert priced.ms(["A", "B", "C"]) == 0.0  # all float: nothing converts
    assert priced.added_ms(["B"], "C") == pytest.approx(-1.1 + 0.1)  # closes B's output, opens C's input


def test_priced_selection_prefers_the_op_whose_tensors_are_small():
    """Two ops of equal loss and kernel cost: counting edges they are alike (rank order
    decides), priced by the elements their conversions move, the one on small tensors joins
    first and alone meets the target (the real-size segmenter: the first convolution, -2.2 ms
    by its kernels, made int8 17 ms slower through its 64 x 320 x 320 output)."""
    from pipeline.precision.calibration.latency import Boundary
    from pipeline.precision.calibration.selection import joining_order, select_for_target

    losses = {"big": 0.04, "small": 0.04}
    ranking = [{"op": op, "loss": loss} for op, loss in losses.items()]
    costs = {"big": 0.1, "small": 0.1}
    neighbours = {"big": ["x"], "small": ["y"]}
    priced = Boundary({"big": ["x"], "small": ["y"]}, {"big": ["x"], "small": ["y"]},
                      {"big": (6_553_600, 6_553_600), "small": (25_600, 25_600)}, ms_per_element=1.4e-6)
    assert joining_order(ranking, 8, costs, neighbours) == ["big", "small"]
    assert joining_order(ranking, 8, costs, neighbours, priced) == ["small", "big"]
    float_ops, curve = select_for_target(_SumOfLosses(losses, goal=1 - 0.045), {}, ranking, 8, costs, neighbours,
                                          priced)
    assert float_ops == ["small"]
    assert curve[0]["cost_ms"] == pytest.approx(0.1 + 2 * 25_600 * 1.4e-6, abs=1e-4)  # its kernel and conversions


def test_a_selection_that_never_meets_the_target_keeps_the_set_closest_to_it():
    """Closest as the gate counts (the task metric's drop first where one is scored), not the
    highest cosine: {A, B} drops the metric by 0.012 at cosine 0.998, {A} by 0.03 at 0.999."""
    from pipeline.precision.calibration.selection import select_for_target

    class Measure:
        goal = (0.99, 0.01)

        def __call__(self, table, float_ops):
            both = set(float_ops) == {"A", "B"}
            return {"cosine": 0.998 if both else 0.999, "metric_drop": 0.012 if both else 0.03}

        def meets(self, result):
            return result["cosine"] >= 0.99 and result["metric_drop"] <= 0.01

        def no_time(self, step):
            return None

    ranking = [{"op": "A", "loss": 0.2}, {"op": "B", "loss": 0.1}]
    float_ops, curve = select_for_target(Measure(), {}, ranking, 8, {}, {})
    assert sorted(float_ops) == ["A", "B"] and curve[-1]["kept_best"]
