"""precision.budget_s as a promise (pipeline/app/budget.py): a candidate whose estimate from
a one-sample probe does not fit in what is left is not started, and says what it would have
cost. The job on the real-size segmenter (U^2-Net-p at 320x320) is this suite's one job on
that model: its int8 and mixed candidates are estimated beyond a 20 s budget."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import numpy as np
import pytest

from pipeline import deadline
from pipeline.app.budget import (CALIBRATE_RUNS, CLOSING_S, COST_RUNS, CUT, FP32_FIXED_S, MIXED_RUNS, PROFILE_MAX_S,
                                 PROFILE_RUNS, REFINE_RUNS, TIMING_WARMUP, VERIFY_RUNS, Budget)
from conftest import composed, read_report, run_cli, run_dirs
from segmenter_data import REAL_FUSED_OUTPUT, REAL_MODEL

COUNTS = {"calibration": 16, "validation": 40, "sensitivity": 8, "quantized_ops": 119}


def _probed(seconds: float, budget_s: float = 300.0) -> Budget:
    budget = Budget(budget_s)
    budget.probe_s, budget.counts = seconds, dict(COUNTS)
    return budget


def test_estimates_grow_with_samples_ops_and_the_probe():
    budget = _probed(0.2)
    int8 = budget.estimate("int8")
    assert int8 == pytest.approx(((CALIBRATE_RUNS + REFINE_RUNS) * 16 + COST_RUNS["int8"][1] * 40) * 0.2)
    assert budget.estimate("fp16") == pytest.approx(VERIFY_RUNS * 40 * 0.2)
    assert budget.estimate("mixed") > int8  # the search: half the graph per op and ranking sample
    assert _probed(0.4).estimate("int8") == pytest.approx(2 * int8)
    wider = _probed(0.2)
    wider.counts["quantized_ops"] = 2 * COUNTS["quantized_ops"]
    assert wider.estimate("mixed") > budget.estimate("mixed")
    assert Budget(300).estimate("int8") is None  # no probe, no estimate: the candidate starts


def test_a_candidate_that_does_not_fit_is_cut_ahead_and_says_what_it_would_cost():
    budget = _probed(0.2, budget_s=100.0)
    assert budget.fits("fp16") is None  # 32 s of 100
    too_long = budget.fits("int8")
    assert too_long == pytest.approx(((CALIBRATE_RUNS + REFINE_RUNS) * 16 + COST_RUNS["int8"][1] * 40) * 0.2)  # 94 s
    row = budget.cut_ahead("int8", too_long)
    assert row["verdict"] == CUT and row["estimate_s"] == round(too_long, 1)
    assert row["reasons"][0].startswith(f"not tried: estimated {too_long:.0f} s (one sample's fp32 run 200 ms")
    assert "of precision.budget_s=100 s left" in row["reasons"][0]
    assert _probed(0.2, budget_s=None).fits("mixed") is None  # no budget: everything starts


def test_mixed_pays_for_calibration_only_where_int8_did_not_run_and_heads_first_is_three_passes():
    """mixed reuses int8's calibration and refined all-int8 model where int8's candidate ran
    (cut: it calibrates and refines itself); with sensitivity.heads_first the search is estimated as three whole-model passes
    over the validation set (the ranking after them is cut by the deadline where it does not
    fit), far below the per-layer ranking over 119 ops."""
    budget = _probed(0.2)
    alone = budget.estimate("mixed")
    budget.ran.add("int8")
    after_int8 = budget.estimate("mixed")
    assert alone - after_int8 == pytest.approx((CALIBRATE_RUNS + REFINE_RUNS) * 16 * 0.2)
    budget.counts["heads_first"] = True
    heads = budget.estimate("mixed")  # int8 ran and failed: its verify stands for plain int8
    assert heads == pytest.approx((2 * 40 + MIXED_RUNS * 40) * 0.2)
    assert heads < after_int8 / 2
    budget.ran.discard("int8")
    assert budget.estimate("mixed") - heads == pytest.approx((40 + (CALIBRATE_RUNS + REFINE_RUNS) * 16) * 0.2)
    budget.counts["timing_s"] = 10.0  # a verify that may pass times its build: seconds, not runs
    assert budget.estimate("mixed") - heads == pytest.approx((40 + (CALIBRATE_RUNS + REFINE_RUNS) * 16) * 0.2 + 12)


def test_what_candidates_took_corrects_the_later_estimates():
    budget = _probed(0.1)
    first = budget.estimate("int8")
    budget.took(first, 2 * first)  # twice what the counts said
    assert budget.correction() == pytest.approx(2.0)
    assert budget.estimate("fp16") == pytest.approx(2 * VERIFY_RUNS * 40 * 0.1)
    assert "x2.00 from the candidates so far" in budget.describe()
    assert budget.record({})["correction"] == 2.0


def test_the_probe_times_one_sample_on_onnx_runtime():
    budget = Budget(300)
    x = np.random.default_rng(0).normal(0, 1, (1, 3, 320, 320)).astype(np.float32)
    budget.probe(REAL_MODEL, {"input": x}, 2, dict(COUNTS))
    assert 0.001 < budget.probe_s < 30 and budget.counts == COUNTS


@pytest.fixture(scope="module")
def real_size_job(tmp_path_factory):
    """The real-size segmenter's default job with a 20 s budget, 4 + 4 photos at 320x320."""
    from segmenter_data import CALIBRATION_SEED, MEAN, REAL_SIZE, STD, VALIDATION_SEED, crops, photos

    cwd = tmp_path_factory.mktemp("real-size-budget")
    images = photos()

    def normalized(seed):
        return np.stack([((c / 255.0 - np.array(MEAN)) / np.array(STD)).transpose(2, 0, 1).astype(np.float32)
                         for c in crops(images, 4, seed, REAL_SIZE)])

    np.savez(cwd / "photos.npz", **{"calibration/input": normalized(CALIBRATION_SEED),
                                    "validation/input": normalized(VALIDATION_SEED)})
    result = run_cli([f"model.path={REAL_MODEL}", "data.kind=tensors", f"data.path={cwd / 'photos.npz'}",
                      "metric=map_iou", f"metric.output='{REAL_FUSED_OUTPUT}'", "precision.budget_s=20",
                      "precision.candidates=[fp32,int8,mixed]", "target.threads=2"],
                     cwd, default_precision=None, timeout=600)
    return result, run_dirs(cwd)[-1]


def test_the_real_size_job_keeps_its_budget_and_names_what_was_cut(real_size_job):
    result, run_dir = real_size_job
    assert result.returncode == 0, result.stdout + result.stderr
    section = read_report(run_dir)["auto"]
    rows = {row["precision"]: row for row in section["candidates"]}
    assert section["chosen"] == "fp32" and rows["fp32"]["verdict"] == "pass"
    assert section["budget"]["cut"] == ["int8", "mixed"]
    assert section["budget"]["probe_ms"] > 1 and set(section["budget"]["estimates_s"]) == {"int8", "mixed"}
    for precision in ("int8", "mixed"):
        assert rows[precision]["seconds"] < 1, rows[precision]
        assert rows[precision]["reasons"][0].startswith("not tried: estimated "), rows[precision]
        left = float(rows[precision]["reasons"][0].split(" s left")[0].rsplit(", ", 1)[1].split(" s of")[0])
        # cut while time was left, by an estimate that did not fit in it once the closing steps were set
        # aside (a fast CPU: 19.9 s against 17 s left; an AMX one: 13.4 s against 18 s, 6 of them set aside)
        assert 0 < left < 20 and rows[precision]["estimate_s"] > left - rows[precision]["reserved_s"], rows[precision]
        assert " s of it set aside for the closing steps" in rows[precision]["reasons"][0]
    assert "cut by precision.budget_s: int8, mixed" in section["why"]


def test_the_real_size_fp32_verify_runs_the_float64_check_only_within_its_time(real_size_job):
    """ONNX Runtime has no float64 Conv; ONNX's NumPy evaluator took 25 s a sample on this model,
    3 s with parity's matrix-product ops (pipeline/verification/float64_ops.py). Where 30x the
    reference's float32 run would pass the check's 6 s (this machine's speed decides) it is not
    run and says why; where it runs, the reference agrees with float64 (float32 rounding only)."""
    from pipeline.verification.truth import BUDGET_S

    _, run_dir = real_size_job
    truth = read_report(run_dir)["verify"]["truth"]
    if not truth["ran"]:
        assert truth["reason"].startswith("not run: ONNX Runtime has no float64 kernel"), truth
        assert f"over the check's {BUDGET_S:g} s" in truth["reason"], truth
        return
    assert truth["engine"] == "onnx.reference float64" and 1 <= truth["samples"] <= 4, truth
    assert all(found["reference_cosine"] > 0.9999 for found in truth["outputs"].values()), truth


def test_the_closing_steps_are_set_aside_and_the_deadline_follows():
    budget = _probed(0.2, budget_s=100.0)
    closing = min(PROFILE_RUNS * 0.2, PROFILE_MAX_S) + CLOSING_S  # the shipped build's profile and package
    assert budget.reserve() == pytest.approx(2 * 40 * 0.2 + FP32_FIXED_S + closing)  # and fp32's verify, should it ship
    assert budget.deadline() == pytest.approx(budget.started + 100.0 - budget.reserve())
    assert budget.run_s() == pytest.approx(0.2)
    assert Budget(100.0).run_s() is None and Budget(None).deadline() is None  # nothing is cut then


def test_a_step_is_cut_only_when_its_estimate_passes_the_deadline():
    assert deadline.cut("anything", 1e9) is None  # no deadline outside precision=auto
    with deadline.until(time.monotonic() + 60.0, run_s=0.1):
        assert deadline.cut("a short step", 100) is None  # 10 s of 60
        why = deadline.cut("calibrate's equalization", 1000)
        assert why.startswith("cut by precision.budget_s: calibrate's equalization estimated 100 s "
                              "(1000 runs of 100 ms), ") and why.endswith("s left")
        assert not deadline.passed()
    assert deadline.current() is None  # restored after the block
    with deadline.until(time.monotonic() - 1.0, run_s=0.1):
        assert deadline.passed()


def test_a_loop_stops_before_a_step_as_long_as_its_longest_would_pass_the_deadline(monkeypatch):
    """deadline.loop_stop: asked before each step; the time between two asks is a step. With
    25 s left and a 10 s step the loop goes on, with 8 s left it stops (the deadline has not
    passed yet: a check of passed() alone would start a step ending 2 s past it)."""
    now = [1000.0]
    monkeypatch.setattr(deadline.time, "monotonic", lambda: now[0])
    assert not deadline.loop_stop()()  # no deadline: never stops
    with deadline.until(1035.0, run_s=0.1):
        stop = deadline.loop_stop()
        assert not stop()  # 35 s left, no step timed yet
        now[0] += 10.0
        assert not stop()  # a 10 s step, 25 s left
        now[0] += 17.0
        assert stop() and not deadline.passed()  # the longest step is 17 s, 8 s left


def test_a_loop_worth_nothing_cut_stops_once_its_rest_is_projected_past_the_deadline(monkeypatch):
    """The mixed search's ranking (a ranking cut half-way ranks nothing) tells the check how
    many steps are left: after two steps of 7 s, 23 left and 100 s to go stop it at once (a
    512x512 U-Net ranked 16 of 23 ops in 110 s to be cut); with 10 left they fit and it goes on."""
    now = [1000.0]
    monkeypatch.setattr(deadline.time, "monotonic", lambda: now[0])
    for left, stops in ((23, True), (10, False)):
        now[0] = 1000.0
        with deadline.until(1114.0, run_s=0.1):
            stop = deadline.loop_stop()
            assert not stop(left + 2)  # nothing measured yet
            now[0] += 14.0
            assert stop(left) is stops  # 100 s left: 14 s for 2 steps, 7 s a step x 23 = 161 s, x 10 = 70 s


def test_a_started_candidate_cuts_the_steps_that_would_not_fit_and_caches_none_of_them(tmp_path):
    """int8 with a deadline 1 s away and runs estimated at 5 s: equalization, weight
    rounding and bias correction are not started, each says why; the stages they belong to
    are not cached, so a later job with time computes them."""
    from pipeline.app.runner import run_pipeline
    from pipeline.config.validation import validate

    run = validate(composed("precision=int8", f"pipeline.cache_dir={tmp_path / 'cache'}"))
    with deadline.until(time.monotonic() + 1.0, run_s=5.0):
        cut = run_pipeline(run, tmp_path / "cut", until="build")
    equalization = cut.results["calibrate"].summary.equalization
    assert equalization["cut"].startswith("cut by precision.budget_s: calibrate's equalization estimated")
    quantization = cut.results["build"].summary.quantization
    for step in ("weight_rounding", "bias_correction"):
        assert getattr(quantization, step)["cut"].startswith(f"cut by precision.budget_s: build's "
                                                             f"{step.replace('_', ' ')} estimated"), step
        assert not quantization.refined(step)
    again = run_pipeline(run, tmp_path / "again", until="build")  # no deadline: computed, not served the cut
    status = {record["stage"]: record["status"] for record in again.records}
    assert (status["convert"], status["calibrate"], status["build"]) == ("cached", "computed", "computed")
    assert "cut" not in again.results["calibrate"].summary.equalization
    assert all("cut" not in summary for _, summary in again.results["build"].summary.quantization.refinements())


def test_the_mixed_search_ranks_nothing_it_has_no_time_for(tmp_path):
    """precision=mixed with its first whole-model measure estimated past the deadline: nothing
    is measured or ranked, the qtable is empty (the int8 build) and says why; not cached."""
    from pipeline.app.runner import run_pipeline
    from pipeline.config.validation import validate

    run = validate(composed("precision=mixed", "sensitivity.select=top_n", "sensitivity.top_n=2",
                            f"pipeline.cache_dir={tmp_path / 'cache'}"))
    candidate = tmp_path / "job" / "candidates" / "mixed"  # as precision=auto lays out a job's run folder
    with deadline.until(time.monotonic() + 1.0, run_s=5.0):
        cut = run_pipeline(run, candidate, until="sensitivity")
    searched = cut.results["sensitivity"]
    assert searched.summary.to_json()["cut"].startswith("cut by precision.budget_s: the mixed search's "
                                                        "measure of plain int8 estimated")
    assert "int8" not in searched.summary.to_json()  # not measured
    assert json.loads(searched.path("qtable").read_text())["float_ops"] == []
    # precision=auto runs a built candidate's folder again through verify: the cut search
    # serves it in place instead of being computed again past the deadline
    rerun = run_pipeline(run, candidate, until="sensitivity")
    assert rerun.records[-1]["status"] == "cached"
    assert rerun.results["sensitivity"].summary.to_json()["cut"] == searched.summary.to_json()["cut"]
    # and the shipped run in the job's run folder is served the candidate's, copied: it ships what was verified
    shipped = run_pipeline(run, tmp_path / "job", until="sensitivity")
    assert shipped.records[-1]["status"] == "cached"
    assert shipped.results["sensitivity"].summary.to_json()["cut"] == searched.summary.to_json()["cut"]
    assert (tmp_path / "job" / "stages" / "sensitivity" / "qtable.json").read_text() == \
        searched.path("qtable").read_text()
    again = run_pipeline(run, tmp_path / "again", until="sensitivity")
    assert again.records[-1]["status"] == "computed"
    assert json.loads(again.results["sensitivity"].path("qtable").read_text())["float_ops"]  # top 2 float


class _Measured:
    """A stand-in for the search's whole-model measure (no runtime involved: the selection's
    own loop is what is tested): the target is met with 5 or more ops float."""

    def __init__(self):
        self.calls = []

    def __call__(self, table, float_ops):
        self.calls.append(len(float_ops))
        return {"cosine": 0.9 + 0.01 * len(float_ops), "metric_drop": None}

    goal = (0.95, 0.01)  # (cosine, task-metric drop)

    def meets(self, result):
        return result["cosine"] >= 0.95

    def no_time(self, step):
        return "cut" if deadline.passed() else None


def test_the_selection_stops_at_the_deadline_with_the_best_set_measured():
    from pipeline.precision.calibration.selection import select_for_target

    ranking = [{"op": f"op{i}"} for i in range(16)]
    measure = _Measured()
    float_ops, _ = select_for_target(measure, {}, ranking, 16, {}, {})
    assert len(float_ops) == 5 and len(measure.calls) > 3  # doubled to 8, halved to 5, pruned
    late = _Measured()  # past the deadline: no measure is started
    with deadline.until(time.monotonic() - 1.0, run_s=0.1):
        assert select_for_target(late, {}, ranking, 16, {}, {}) == ([], [])
    assert late.calls == []
    stopped = _Measured()  # the deadline passes after the first measure: the best set measured stands
    stopped.no_time = lambda step: "cut" if stopped.calls else None
    float_ops, curve = select_for_target(stopped, {}, ranking, 16, {}, {})
    assert stopped.calls == [1] and float_ops == ["op0"] and curve[-1]["kept_best"]


def test_a_ranking_the_deadline_passes_during_ranks_nothing(monkeypatch):
    """The per-layer ranking asks the deadline before each chunk of ops (search.per_layer's
    ``stop``): where it passed half-way, the search keeps nothing float and says why."""
    from pipeline.precision.calibration import sensitivity as search
    from stages import sensitivity

    asked = {}

    def stopped(*args, **kwargs):
        raise search.Stopped("the ranking stopped after 8 of 62 ops")

    monkeypatch.setattr(search, "per_layer", lambda *args, **kwargs: asked.update(kwargs) or stopped())
    monkeypatch.setattr(sensitivity, "progress_bar", lambda: __import__("contextlib").nullcontext(
        type("P", (), {"add_task": lambda self, *a, **k: 0, "advance": lambda self, *a: None})()))
    monkeypatch.setattr(sensitivity, "_settings", lambda cfg: None)
    cfg = SimpleNamespace(sensitivity=SimpleNamespace(methods=["max"], screen=2))
    summary = {}
    with deadline.until(time.monotonic() + 60.0, run_s=0.001):
        monkeypatch.setattr(sensitivity, "ranked_ops", lambda cfg: 8)
        got = sensitivity._ranked_in_time(cfg, None, {}, ({}, None, 4), 62,
                                          type("M", (), {"always_float": []})(), summary)
    assert got is None and callable(asked["stop"])
    assert summary["cut"] == summary["skipped"] == ("cut by precision.budget_s: the deadline passed during the mixed "
                                                    "search's per-layer ranking (the ranking stopped after 8 of 62 ops)")


def test_the_reserve_for_fp32s_verify_is_its_answers_its_timing_and_what_every_verify_costs():
    """fp32's verify runs its own answers, and the reference's until a candidate's verify
    stored them, times fp32 and starts its workers; a screening's fp32 timing on the target
    replaces the probe (OpenVINO capped to AVX2 ran det 736's fp32 slower than ONNX Runtime's)."""
    budget = _probed(0.1)
    budget.counts.update(timing_s=10.0, alone_timing_s=10.0 * 3 / 7)  # fp32 is timed alone: 3 rounds of 7
    closing = min(PROFILE_RUNS * 0.1, PROFILE_MAX_S) + CLOSING_S
    timing = TIMING_WARMUP * 10.0 * 3 / 7
    assert budget.reserve() - closing == pytest.approx(40 * (0.1 + 0.1) + timing + FP32_FIXED_S)
    deadline_before = budget.deadline()
    budget.verified(5.0)  # the candidate's verify stored the reference's answers
    assert budget.reserve() - closing == pytest.approx(40 * 0.1 + timing + FP32_FIXED_S)
    assert budget.deadline() == pytest.approx(deadline_before + 40 * 0.1)
    budget.verified(5.0, fp32_run_s=0.3)  # fp32 ran 0.3 s a sample on the target in its screening
    assert budget.reserve() - closing == pytest.approx(40 * 0.3 + timing + FP32_FIXED_S)
    budget.passed = True  # a candidate passed (bf16 on openvino_cpu): fp32 cannot ship, its verify is not set aside
    assert budget.reserve() == pytest.approx(closing)


def test_another_candidates_verify_is_set_aside_as_the_slowest_so_far():
    """A deferred candidate's verify, or a started one's own: 4 runs a sample, or the slowest
    verify measured (a failing one's with the timing it left out)."""
    budget = _probed(0.001)
    budget.passed = True
    assert budget.verify_estimate() == pytest.approx(VERIFY_RUNS * 40 * 0.001)
    budget.verified(20.0)
    assert budget.verify_estimate() == 20.0
    budget.verified(10.0, timing_left_out=15.0)  # untimed: another's verify would time its build
    assert budget.verify_estimate() == pytest.approx(10.0 + TIMING_WARMUP * 15.0)
    closing = budget.reserve()
    budget.deferred.add("bf16")
    assert budget.reserve() == pytest.approx(closing + budget.verify_estimate())
    assert budget.deadline(own_verify=True) == pytest.approx(budget.deadline() - budget.verify_estimate())


def test_a_tables_refinement_counts_only_in_the_estimate_of_a_step_that_measures_a_new_table():
    """The mixed search estimates its next whole-model measure from the slowest so far; a
    table's refinement (weight rounding, bias correction) runs once a table, so it is left out
    of that figure and added, at the refinement's own seconds (also when they came from the
    cache), only where a step measures a new table. On PP-OCRv4 det a 20 s refinement inside
    the per-op methods' measure cut the selection's 7 s measures with 23 s left."""
    from pipeline.config.validation import validate
    from pipeline.data import pack
    from stages.sensitivity import _MixedMeasure
    from test_quantize import _branchy_model, _table

    model = _branchy_model()
    rng = np.random.default_rng(0)
    samples = [{"x": rng.uniform(-1, 1, (1, 3, 16, 16)).astype(np.float32)} for _ in range(4)]

    def refine(quantized):
        time.sleep(0.5)  # a refinement computed here, its steps' own seconds from a cache
        return quantized, {"weight_rounding": {"enabled": True, "applied": True, "seconds": 20.0},
                           "bias_correction": {"enabled": False}}

    measure = _MixedMeasure(model, pack(samples), None, 4, validate(composed("precision=mixed")), refine)
    table = _table(model, samples[0])
    started = time.perf_counter()
    measure(table, [])  # the table's first model: refined
    took = time.perf_counter() - started
    assert measure.refine_s == 20.0 and measure.refinements == {"weight_rounding": True}
    assert 0 < measure.seconds <= took - 0.5
    measure(table, ["E"])  # the same table: derived from its refined model, no refinement
    with deadline.until(time.monotonic() + 15.0, run_s=0.001):
        assert measure.no_time("the selection's next measure") is None
        why = measure.no_time("the per-op methods' measure", new_table=True)
    assert why.startswith("cut by precision.budget_s: the per-op methods' measure estimated 20 s (the slowest "
                          "measure so far and the last table's refinement), "), why
