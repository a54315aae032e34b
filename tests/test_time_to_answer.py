"""Time to the answer (issue 26): one calibration for int8 and mixed, a build verified once,
the diagnosis of a failing verdict within its budget, advice ranked on the reference runtime
and never a failing trial as a line to apply, and calibration=auto's tables measured on one
fake-quantized model that quantizes exactly as the build does."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper

from conftest import read_report, run_cli, run_dirs

# every job here watches what the stage cache serves or a cold diagnosis: each keeps its own cache
from pipeline.verification import trials
from pipeline.precision.calibration import fake_quant, tables
from pipeline.precision.quantize import QdqSettings, quantize_static_qdq

STAGES = "pipeline.stages=[convert,calibrate,sensitivity,build,verify]"


def stage_status(report: dict) -> dict:
    return {s["stage"]: s["status"] for s in report["stages"]}


def test_int8_and_mixed_share_one_calibration(tmp_path):
    first = run_cli(["precision=int8", "pipeline.stages=[convert,calibrate]"], tmp_path, shared_cache=False)
    assert first.returncode == 0, first.stdout + first.stderr
    second = run_cli(["precision=mixed", "pipeline.stages=[convert,calibrate]"], tmp_path, shared_cache=False)
    assert second.returncode == 0, second.stdout + second.stderr
    int8, mixed = (read_report(run) for run in run_dirs(tmp_path))
    assert stage_status(int8)["calibrate"] == "computed" and stage_status(mixed)["calibrate"] == "cached"
    # the search's every-method entries are there for both
    assert (run_dirs(tmp_path)[-1] / "stages" / "calibrate" / "candidates.json").is_file()
    # a change that matters still recomputes
    third = run_cli(["precision=mixed", "pipeline.stages=[convert,calibrate]", "calibration=kl"], tmp_path, shared_cache=False)
    assert third.returncode == 0 and stage_status(read_report(run_dirs(tmp_path)[-1]))["calibrate"] == "computed"


def test_a_build_verified_before_is_not_measured_again(tmp_path):
    args = ["precision=int8", "pipeline.stages=[convert,calibrate,build,verify]"]
    first = run_cli(args, tmp_path, shared_cache=False)
    assert first.returncode == 0, first.stdout + first.stderr
    # a diagnosis setting is not what the measurement depends on: served, stage table says cached
    again = run_cli([*args, "validation.advice_trials=2", "validation.layerwise_samples=5"], tmp_path, shared_cache=False)
    assert again.returncode == 0, again.stdout + again.stderr
    before, after = (read_report(run) for run in run_dirs(tmp_path))
    assert stage_status(before)["verify"] == "computed" and stage_status(after)["verify"] == "cached"
    assert after["verify"]["diagnosis"]["measurement"] == "reused from the cache"
    assert after["verify"]["outputs"] == before["verify"]["outputs"]
    # a threshold is: measured again
    stricter = run_cli([*args, "validation.min_cosine=0.5"], tmp_path, shared_cache=False)
    assert stricter.returncode == 0, stricter.stdout + stricter.stderr
    third = read_report(run_dirs(tmp_path)[-1])
    assert stage_status(third)["verify"] == "computed"
    assert third["verify"]["diagnosis"]["measurement"] == "measured"


def test_the_diagnosis_stops_at_its_budget(tmp_path):
    """int8 cannot meet cosine 0.999999 on the digits model; with no time for a diagnosis,
    layerwise stops at once and no trial starts: what was cut is reported and printed, and
    nothing unconfirmed is given as a line to apply."""
    result = run_cli(["precision=int8", STAGES, "validation.min_cosine=0.999999", "validation.task_min_cosine=null",
                      "validation.diagnosis_budget=0", "validation.diagnosis_min_seconds=0"], tmp_path, shared_cache=False)
    assert result.returncode == 3, result.stdout + result.stderr
    verify = read_report(run_dirs(tmp_path)[-1])["verify"]
    diagnosis = verify["diagnosis"]
    assert diagnosis["ran"] and diagnosis["budget_seconds"] == 0
    assert diagnosis["cut"] and any("advice trials" in c or "layerwise" in c for c in diagnosis["cut"])
    assert verify["advice_tried"] == []
    assert all("(apply:" not in a["text"] for a in verify["recommendations"])
    assert "cut by the budget" in result.stdout


def test_a_diagnosis_starts_no_step_after_its_budget(tmp_path):
    """The default budget on a failing int8 build: every step but the last one started
    within the budget, so the diagnosis overruns it by at most one step."""
    result = run_cli(["precision=int8", STAGES, "validation.min_cosine=0.999999", "validation.task_min_cosine=null",
                      "validation.diagnosis_min_seconds=3"], tmp_path, shared_cache=False)
    assert result.returncode == 3, result.stdout + result.stderr
    diagnosis = read_report(run_dirs(tmp_path)[-1])["verify"]["diagnosis"]
    steps = [s["seconds"] for s in diagnosis["steps"]]
    assert diagnosis["ran"] and steps
    assert sum(steps[:-1]) <= diagnosis["budget_seconds"] + 0.5
    assert "diagnosis:" in result.stdout


class _Outputs:
    """A worker answering with fixed outputs (what trials.screen reads of a worker)."""

    def __init__(self, value: float):
        self.value = value

    def run(self, feeds):
        return {"y": np.array([1.0, self.value], dtype=np.float32)}

    def close(self):
        pass


def test_screening_ranks_what_reaches_the_threshold_fewest_ops_first():
    close = {"a": 0.03, "a,b": 0.01, "a,b,c": 0.0, "d": 5.0}  # the second output's value per candidate
    launch = lambda keep: _Outputs(close[",".join(keep)])  # noqa: E731
    found = [["a", "b", "c"], ["d"], ["a"], ["a", "b"]]
    ranked = trials.screen(found, launch, _Outputs(0.0), [{}], needed=0.9997)
    # a,b and a,b,c reach 0.9997: the smaller first; then the rest, closest first
    assert ranked["order"] == [["a", "b"], ["a", "b", "c"], ["a"], ["d"]]
    assert ranked["cosine"]["d"] < ranked["cosine"]["a"] < 0.9997


def test_screening_predicts_the_target_from_the_gain_over_the_build_screened_the_same_way():
    """The build is screened with its candidates (keep_float=[]): a candidate's prediction is
    the build's measured cosine plus its gain in the screening, not its screened cosine."""
    close = {"": 0.05, "a": 0.02, "b": 0.049}
    launch = lambda keep: _Outputs(close[",".join(keep)])  # noqa: E731
    ranked = trials.screen([["b"], ["a"]], launch, _Outputs(0.0), [{}], needed=0.999, build_cosine=0.99)
    assert ranked["order"] == [["a"], ["b"]] and ranked["base"] == pytest.approx(_cosine(0.05))
    assert ranked["predicted"]["a"] == pytest.approx(0.99 + _cosine(0.02) - _cosine(0.05))
    assert ranked["predicted"]["a"] < 0.999 < ranked["cosine"]["a"]  # screened alone it would "pass"
    trial = {"keep_float": ["a"], "cosine": 0.9901, "predicted_cosine": 0.995}
    assert trials.misprediction(trial, 0.99, needed=0.999) is None  # off by less than the gap to pass
    assert "was predicted to gain +0.005000 in cosine and gained +0.000100" in trials.misprediction(
        trial, 0.99, needed=0.992)


def _cosine(value: float) -> float:
    return 1.0 / float(np.sqrt(1.0 + value * value))


def test_a_failing_trial_is_never_a_line_to_apply():
    tried = [{"keep_float": ["conv1"], "passed": False, "cosine": 0.99, "reasons": ["output y: cosine 0.99 < 0.999"],
              "task": None, "slower_ms": 0.1}]
    (advice,) = trials.advice(tried, {"cosine": 0.98, "task": None}, [])
    assert advice["kind"] == "tried_none_passed" and "keep_float" not in advice["action"]
    assert "(apply:" not in advice["text"] and "cosine 0.990000" in advice["text"]
    passing = [{**tried[0], "passed": True, "reasons": []}]
    (advice,) = trials.advice(passing, {"cosine": 0.98, "task": None}, [])
    assert advice["action"]["keep_float"] == ["conv1"] and "(apply: precision.keep_float=[conv1])" in advice["text"]


@pytest.mark.parametrize("activations", ["uint8", "int8"])
def test_the_fake_quantized_model_quantizes_as_the_build(classifier_qdq, activations):
    """Every activation's scale and zero point equal those ONNX Runtime's quantizer writes
    into the build (a zero point one off on a symmetric range changed rec's cosine by 0.03),
    and its outputs match the build's run without fusions, but for its int32 biases (the first
    difference is at a Conv whose inputs and weights agree: 4e-4 in cosine at the output)."""
    prepared, _, samples = classifier_qdq
    table = _table(prepared, samples)
    settings = QdqSettings(activations=activations, quantize_outputs=True)
    built = quantize_static_qdq(prepared, table, settings)
    model = fake_quant.FakeQuantModel(prepared, table, settings)
    ranges = model._ranges(table)
    constants = {t.name: numpy_helper.to_array(t) for t in built.graph.initializer}
    checked = 0
    for node in built.graph.node:
        if node.op_type == "QuantizeLinear" and node.input[0] not in constants and node.input[0] in model.tensors:
            name = node.input[0]
            assert float(constants[node.input[1]]) == pytest.approx(float(ranges[f"{name}__fq_scale"]), rel=1e-6)
            assert int(constants[node.input[2]]) == int(ranges[f"{name}__fq_zero"]), name
            checked += 1
    assert checked == len(model.tensors) > 10
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(built.SerializeToString(), options, providers=["CPUExecutionProvider"])
    expected = np.concatenate([session.run(None, s)[0] for s in samples])
    (actual,) = model.run(table, samples)[0]
    cosine = float(expected.ravel() @ actual.ravel() / (np.linalg.norm(expected) * np.linalg.norm(actual)))
    assert cosine > 0.999


def _table(prepared: onnx.ModelProto, samples) -> dict:
    import tempfile
    from pathlib import Path

    from pipeline.precision.calibration import statistics
    from pipeline.data import Sample

    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "prepared.onnx"
        onnx.save(prepared, str(path))
        stats = statistics.collect(path, [Sample(str(i), s) for i, s in enumerate(samples)], len(samples), 512, 8, 0)
    return tables.build_table(stats.histograms, "percentile")


class _Accuracy:
    """The mixed model's cosine as a sum of what each float op gives back (what the
    selection reads of a measurement), counting the whole-model measurements made."""

    def __init__(self, gains: dict, base: float, target: float):
        self.gains, self.base, self.target, self.calls = gains, base, target, 0

    def __call__(self, table, float_ops):
        self.calls += 1
        return {"cosine": self.base + sum(self.gains.get(op, 0.0) for op in float_ops), "metric_drop": None}

    def no_time(self, step):  # no deadline here
        return None

    @property
    def goal(self):  # (cosine, task-metric drop)
        return self.target, 0.01

    def meets(self, result):
        return result["cosine"] >= self.target


def test_the_selection_finds_the_float_set_in_a_few_measurements():
    """32 ranked ops, three of which (ranked 5th, 17th and 30th) reach the target together:
    the prefix is found by doubling and halving (10 measurements, not 30), then pruned."""
    from pipeline.precision.calibration.selection import select_for_target

    ranking = [{"op": f"op{i}", "loss": 1.0 / (i + 1)} for i in range(32)]
    measure = _Accuracy({"op4": 0.002, "op16": 0.002, "op29": 0.002}, base=0.990, target=0.9959)
    float_ops, curve = select_for_target(measure, {}, ranking, 32, {}, {})
    assert sorted(float_ops) == ["op16", "op29", "op4"]
    assert measure.meets(measure({}, float_ops))
    added = [p["float_ops"] for p in curve if p.get("added")]
    assert added[:5] == [1, 2, 4, 8, 16] and len(added) <= 11 and max(added) == 32
    # never met: the best point measured is kept
    measure = _Accuracy({"op4": 0.001}, base=0.990, target=0.999)
    float_ops, curve = select_for_target(measure, {}, ranking, 32, {}, {})
    assert "op4" in float_ops and curve[-1].get("kept_best")


def test_the_prune_tries_only_ops_whose_int8_gain_is_measurable():
    """With costs, the prune skips ops giving back under 1 % of all ops' int8 gain (each
    trial is a whole-model run): they stay float. An op slower in int8 is still tried, and
    with every op float each one is."""
    from pipeline.precision.calibration.selection import select_for_target

    ranking = [{"op": op, "loss": 0.01} for op in ("big", "tiny", "slow", "needed")]
    costs = {"big": 5.0, "tiny": 0.01, "slow": -0.2, "needed": 1.0}
    # equal losses: the cheapest join first (slow, tiny, needed); "needed" alone meets the target
    measure = _Accuracy({"needed": 0.01}, base=0.99, target=0.9999)
    float_ops, curve = select_for_target(measure, {}, ranking, 4, costs, {})
    tried = [p.get("kept") or p.get("removed") for p in curve if p.get("kept") or p.get("removed")]
    assert tried == ["needed", "slow"]  # tiny (0.01 ms of 5.81) is not worth a whole-model run
    assert sorted(float_ops) == ["needed", "tiny"]
    # with every op float, each one is tried (else the mixed build would be the fp32 model)
    measure = _Accuracy({"needed": 0.01}, base=0.99, target=0.9999)
    three = {op: costs[op] for op in ("tiny", "slow", "needed")}
    float_ops, curve = select_for_target(measure, {}, ranking[1:], 3, three, {})
    assert float_ops == ["needed"]
