"""Timing rounds that follow the model's latency, a spread measured longer before it is
called, and the tie rule (issue 37, item 1). Deterministic: scripted workers and a fake
clock, no assertion on a real timing."""

from __future__ import annotations

import itertools
import time
from types import SimpleNamespace

import numpy as np
import pytest

from pipeline.app.auto import choose
from pipeline.verification import metrics, speed


class Scripted:
    """A worker whose latency() answers from a script (a callable of the call number) and
    records what it was asked: the speed functions' view of a backend worker."""

    def __init__(self, script):
        self.script = script
        self.calls = []

    def latency(self, feeds, warmup, runs, min_ms=0.0):
        self.calls.append({"warmup": warmup, "runs": runs, "min_ms": min_ms})
        value = self.script(len(self.calls) - 1)
        return {"median_ms": value, "runs": runs, "total_ms": value * runs}


class Legacy:
    """A benchmark's worker: latency(feeds, warmup, runs) and nothing more."""

    def __init__(self, value):
        self.value = value

    def latency(self, feeds, warmup, runs):
        return {"median_ms": self.value}


class Stream:
    def __init__(self, mean_ms):
        self.mean_ms = mean_ms
        self.passes = 0

    def stream_load(self, samples):
        return len(samples)

    def stream(self):
        self.passes += 1
        return {"mean_ms": self.mean_ms}


def test_a_round_is_slices_of_time_sized_from_the_round_length():
    assert speed.plan(10, 0) == (1, 10)  # no round length: one slice of exactly timing_runs runs
    slices = int(np.ceil(20 / speed.SLICE_MS))
    assert speed.plan(10, 20) == (slices, int(np.ceil(10 / slices)))
    assert speed.plan(1, 20) == (slices, 1)
    assert speed.plan(400, 20)[1] * slices >= 400  # timing_runs stays the fewest runs of a round
    # a stream round: as many passes as fill the round, one when a pass is that long
    assert speed.passes({"fp32": 1.0, "int8": 2.0}, 20) == 20
    assert speed.passes({"fp32": 50.0}, 20) == 1
    assert speed.passes({"fp32": 1.0}, 0) == 1
    assert speed.passes({"fp32": 0.01}, 20) == speed.MAX_PASSES  # each pass is a call to the worker


def test_latency_runs_until_the_time_asked_has_passed(monkeypatch):
    """runs per round follow the model's latency: a 0.5 ms run fills 10 ms with 20 runs."""
    now = [0]  # microseconds

    def tick():
        return now[0] / 1e6

    def run(feeds):
        now[0] += 500

    monkeypatch.setattr(time, "perf_counter", tick)
    found = metrics.latency(run, {}, warmup=0, repeats=3, min_ms=10.0)
    assert found["runs"] in (20, 21) and found["total_ms"] == pytest.approx(found["runs"] * 0.5)
    assert found["median_ms"] == pytest.approx(0.5)
    assert metrics.latency(run, {}, warmup=0, repeats=3)["runs"] == 3  # no time asked: the count alone
    assert metrics.latency(run, {}, warmup=0, repeats=30, min_ms=1.0)["runs"] == 30  # the count stays the fewest


def test_judge_calls_a_tie_only_on_a_tight_spread():
    assert speed.judge([1.3, 1.4, 1.35, 1.5]) == "faster"
    assert speed.judge([0.6, 0.62, 0.65, 0.6]) == "slower"
    assert speed.judge([0.95, 1.0, 1.05, 1.02]) == "tie"
    # the default job's old int8 interval (0.45-1.26): no tie, undecided
    wide = [0.45, 1.26, 0.9, 1.1, 0.5, 1.2, 0.7]
    assert speed.spread(wide) > speed.TIGHT and speed.judge(wide) == "undecided"
    assert speed.judge(wide, tight=3.0) == "tie"
    assert speed.judge([]) == "undecided"
    # quartiles read at the rounds on or beyond them: with one round of four slower, a tie at best
    assert speed.judge([1.1, 1.1, 1.1, 0.95]) == "tie"
    assert speed.judge([1.2, 1.2, 1.2, 0.9]) == "undecided"  # 1.33 apart: not tight


def test_speedups_carry_the_spread_and_the_call():
    timings = {"fp32": {"round_medians_ms": [1.0] * 7},
               "int8": {"round_medians_ms": [2.0, 1.8, 2.1, 1.9, 2.0, 2.2, 1.9]},
               "mixed": {"round_medians_ms": [0.45, 1.26, 0.9, 1.1, 0.5, 1.2, 0.7]}}
    found = speed.speedups(timings)
    assert found["int8"]["call"] == "slower" and found["int8"]["spread"] <= speed.TIGHT
    assert found["mixed"]["call"] == "undecided" and found["mixed"]["spread"] > speed.TIGHT
    assert found["int8"]["faster"] is False


def test_rounds_are_slices_alternating_between_the_builds():
    steady = {"fp32": Scripted(lambda i: 1.0), "int8": Scripted(lambda i: 0.5)}
    found = speed.interleaved(steady, {}, rounds=5, runs=10, max_seconds=60, round_ms=20, tight=1.25)
    slices, fewest = speed.plan(10, 20)
    for worker in steady.values():
        first, warm, *timed = worker.calls
        assert first == {"warmup": speed.WARMUP, "runs": speed.FIT_RUNS, "min_ms": 0.0}  # their median sizes the rounds
        assert warm["min_ms"] == 20 and warm["runs"] == 10  # the warm-up lasts a round
        assert len(timed) == 5 * slices and all(c == {"warmup": 0, "runs": fewest, "min_ms": speed.SLICE_MS}
                                                for c in timed)
    assert found["int8"]["rounds"] == 5 and found["int8"]["runs_per_round"] == slices * fewest
    assert found["int8"]["lengthened"] == 0 and found["int8"]["slices_per_round"] == slices
    assert speed.speedups(found)["int8"]["speedup"] == 2.0


def test_without_a_round_length_the_old_count_rounds_and_a_benchmark_worker_still_work():
    found = speed.interleaved({"fp32": Legacy(1.0), "int8": Legacy(2.0)}, {}, rounds=4, runs=7, max_seconds=60)
    assert found["fp32"]["rounds"] == 4 and found["fp32"]["runs_per_round"] == 7
    assert speed.speedups(found)["int8"]["speedup"] == 0.5


def _noisy_then_steady(noisy_calls, seed):
    rng = np.random.default_rng(seed)
    return lambda i: float(np.exp(rng.normal(0, 1.0))) if i <= noisy_calls + 1 else 1.0  # + the first run


def test_a_wide_spread_is_measured_again_in_longer_rounds():
    slices, _ = speed.plan(10, 20)
    noisy = {"fp32": Scripted(lambda i: 1.0), "int8": Scripted(_noisy_then_steady(7 * slices, 1))}
    found = speed.interleaved(noisy, {}, rounds=7, runs=10, max_seconds=60, round_ms=20, tight=1.25)
    timing = found["int8"]
    assert timing["lengthened"] == 1 and timing["discarded_rounds"] == 7  # the short noisy rounds dropped
    assert timing["slices_per_round"] == 2 * slices and timing["rounds"] == 7
    assert speed.speedups(found)["int8"]["call"] == "tie"
    # noise that never settles: longer rounds at most MAX_LENGTHEN times, then reported as it is
    always = {"fp32": Scripted(lambda i: 1.0), "int8": Scripted(_noisy_then_steady(10 ** 9, 2))}
    found = speed.interleaved(always, {}, rounds=7, runs=10, max_seconds=60, round_ms=20, tight=1.25)
    assert found["int8"]["lengthened"] == speed.MAX_LENGTHEN
    assert found["int8"]["slices_per_round"] == slices * 2 ** speed.MAX_LENGTHEN
    assert speed.speedups(found)["int8"]["call"] == "undecided"


def test_only_an_undecided_pair_is_measured_longer():
    """Wide but clearly slower (every round 1.5x to 3x fp32's time) is decided: no longer rounds."""
    rng = np.random.default_rng(4)
    slow = {"fp32": Scripted(lambda i: 1.0), "int8": Scripted(lambda i: float(rng.uniform(1.5, 3.0)))}
    found = speed.interleaved(slow, {}, rounds=7, runs=10, max_seconds=60, round_ms=20, tight=1.05)
    assert found["int8"]["lengthened"] == 0 and speed.speedups(found)["int8"]["call"] == "slower"
    # the pairs weighed: each build against fp32 and against the fastest by median
    medians = {"fp32": [1.0] * 4, "int8": [0.5, 0.52, 0.51, 0.5], "mixed": [0.45, 0.6, 0.4, 0.62]}
    assert speed.undecided(medians, 1.25) == [("mixed", "int8")]
    assert speed.undecided(medians, 2.0) == []
    assert speed.undecided({"fp32": [1.0]}, 1.25) == []


def test_a_build_slow_enough_to_time_alone_gets_fewer_runs_a_round_within_the_time():
    """A run of 300 ms and one of 200 ms: 10 runs a round each would take 35 s over the
    seven rounds asked; with 10 s, 2 runs a round in one slice (no round length), all seven
    rounds (three at least: 6 runs a round where fewer rounds are asked)."""
    assert speed.fitted_runs(10, 10, [300.0, 200.0], rounds=7) == 2
    assert speed.fitted_runs(10, 10, [300.0, 200.0], rounds=2) == 6  # MIN_ROUNDS
    assert speed.fitted_runs(10, 10, [3000.0, 2000.0]) == 1  # at least one
    assert speed.fitted_runs(10, 10, [0.1, 0.05], rounds=7) == 10  # a fast model: unchanged
    slow = {"fp32": Scripted(lambda i: 300.0), "int8": Scripted(lambda i: 200.0)}
    found = speed.interleaved(slow, {}, rounds=7, runs=10, max_seconds=10, round_ms=20, tight=1.25)
    for worker in slow.values():
        first, warm, *timed = worker.calls
        assert warm == {"warmup": 0, "runs": 1, "min_ms": 0.0}
        assert len(timed) == 7 and all(c == {"warmup": 0, "runs": 2, "min_ms": 0.0} for c in timed)
    assert found["int8"]["runs_per_round"] == 2 and speed.speedups(found)["int8"]["speedup"] == 1.5


def test_the_warm_up_round_is_left_out_where_the_fitting_runs_lasted_a_round():
    """A 300 ms build whose rounds keep their 10 runs (a long budget): its fitting's six runs
    already lasted longer than a 20 ms round, so one warm-up run, not ten; a 0.1 ms build
    still warms up for a whole round (issue 37: a round's worth of runs of a tiny model)."""
    slow = {"fp32": Scripted(lambda i: 300.0), "int8": Scripted(lambda i: 200.0)}
    speed.interleaved(slow, {}, rounds=3, runs=10, max_seconds=1000, round_ms=20)
    assert all(worker.calls[1] == {"warmup": 0, "runs": 1, "min_ms": 20} for worker in slow.values())
    fast = {"fp32": Scripted(lambda i: 0.1), "int8": Scripted(lambda i: 0.05)}
    speed.interleaved(fast, {}, rounds=3, runs=10, max_seconds=1000, round_ms=20)
    assert all(worker.calls[1] == {"warmup": 0, "runs": 10, "min_ms": 20} for worker in fast.values())


def test_a_first_look_of_single_runs_is_not_fitted_and_warms_up_once():
    """The screening's first look (3 rounds of one run, no time budget): one warm-up run a
    build, then the rounds; no fitting runs (the segmenter's dynamic int8 ran 1.6 s a run,
    and its first look took 18 s with them, 8 s without). Warm workers skip the WARMUP runs."""
    workers = {"fp32": Scripted(lambda i: 200.0), "candidate": Scripted(lambda i: 900.0)}
    found = speed.interleaved(workers, {}, rounds=3, runs=1, max_seconds=0.0)
    for worker in workers.values():
        assert worker.calls == [{"warmup": 0, "runs": 1, "min_ms": 0.0}] * 4
    assert found["candidate"]["rounds"] == 3 and speed.speedups(found)["candidate"]["speedup_p75"] < 0.5
    warm = {"fp32": Scripted(lambda i: 200.0), "candidate": Scripted(lambda i: 300.0)}
    speed.interleaved(warm, {}, rounds=5, runs=10, max_seconds=3.0, round_ms=20, warm=True)
    assert all(worker.calls[0]["warmup"] == 0 for worker in warm.values())


def test_a_first_look_decides_a_far_slower_and_a_clearly_faster_candidate_only():
    """The screening stops at its first look where the candidate is under FAR_SLOWER x fp32
    or at least CLEARLY_FASTER x in its single runs; in between it takes its rounds."""
    from pipeline.app import screening

    def look(candidate_ms):
        workers = {"fp32": Scripted(lambda i: 200.0), "candidate": Scripted(lambda i: candidate_ms)}
        return screening.decided_at_first_look(speed.interleaved(workers, {}, rounds=3, runs=1, max_seconds=0.0))

    assert look(900.0) and look(100.0)  # 0.22x, 2x
    assert not look(200.0) and not look(180.0) and not look(300.0)  # 1x, 1.11x, 0.67x
    tiny = {"fp32": Scripted(lambda i: 1.08), "candidate": Scripted(lambda i: 0.21)}  # ncnn, a 0.1 ms CNN
    assert not screening.decided_at_first_look(speed.interleaved(tiny, {}, rounds=3, runs=1, max_seconds=0.0))


def test_a_build_timed_alone_takes_the_fewest_rounds_in_their_share_of_the_time():
    """fp32 with nothing beside it has no ratio to resolve: its latency from MIN_ROUNDS rounds,
    within timing_max_seconds' share for them (the segmenter's fp32 verify: 7 rounds, 10 s)."""
    validation = SimpleNamespace(timing_rounds=7, timing_max_seconds=10.0, timing_round_ms=20.0,
                                 timing_tight_spread=1.25, timing_runs=10, timing_processes=2)
    together, alone = speed.options(validation), speed.options(validation, alone=True)
    assert together["rounds"] == 7 and together["max_seconds"] == 10.0
    assert alone["rounds"] == speed.MIN_ROUNDS == 3 and alone["max_seconds"] == pytest.approx(10.0 * 3 / 7)
    assert {k: v for k, v in alone.items() if k not in ("rounds", "max_seconds")} == \
        {k: v for k, v in together.items() if k not in ("rounds", "max_seconds")}
    workers = {"fp32": Scripted(lambda i: 200.0)}
    found = speed.interleaved(workers, {}, **{**alone, "round_ms": 0.0, "runs": 2})
    assert found["fp32"]["rounds"] == 3 and speed.speedups(found) == {}


def test_the_time_budget_bounds_the_longer_rounds(monkeypatch):
    """A budget already spent: three rounds, and no longer rounds however wide the spread."""
    ticks = itertools.count()
    monkeypatch.setattr(speed, "time", SimpleNamespace(perf_counter=lambda: float(next(ticks))))  # 1 s a look
    noisy = {"fp32": Scripted(lambda i: 1.0), "int8": Scripted(_noisy_then_steady(10 ** 9, 3))}
    found = speed.interleaved(noisy, {}, rounds=7, runs=10, max_seconds=0.5, round_ms=20, tight=1.25)
    assert found["int8"]["rounds"] == 3 and found["int8"]["lengthened"] == 0
    assert speed.speedups(found)["int8"]["call"] != "tie"
    # a budget the first rounds fit in but not rounds twice as long: measured once
    found = speed.interleaved(noisy, {}, rounds=7, runs=10, max_seconds=12, round_ms=20, tight=1.25)
    assert found["int8"]["rounds"] == 7 and found["int8"]["lengthened"] == 0


def test_a_stream_round_holds_as_many_passes_as_fill_it():
    samples = [{"x": np.zeros(1)}] * 4
    workers = {"fp32": Stream(0.5), "int8": Stream(1.0)}  # a pass: 2 ms and 4 ms
    found = speed.stream_interleaved(workers, samples, rounds=3, max_seconds=60, round_ms=20, tight=1.25)
    assert found["fp32"]["slices_per_round"] == 10 and found["fp32"]["runs_per_round"] == 40  # calls a round
    assert workers["fp32"].passes == 1 + 3 * 10  # the warm-up pass, then 10 passes a round
    assert speed.speedups(found)["int8"]["speedup"] == 0.5


def _row(precision, rounds, size):
    return {"precision": precision, "verdict": "pass", "bytes": size, "cosine": 0.999,
            "latency": {"median_ms": float(np.median(rounds)), "p25_ms": float(np.percentile(rounds, 25)),
                        "p75_ms": float(np.percentile(rounds, 75)), "round_medians_ms": rounds}}


def test_auto_ships_the_higher_fidelity_build_when_the_timing_is_undecided():
    """int8 faster by its median and half the size, but its rounds swing from 0.45x to
    1.26x of fp32's: undecided, fp32 ships; the same median on tight rounds is a tie that
    the smaller build wins; clearly slower rounds ship fp32 as the fastest."""
    fp32 = _row("fp32", [1.0] * 7, 400)
    wide = _row("int8", [1 / r for r in (0.45, 1.26, 1.1, 1.05, 0.5, 1.2, 0.7)], 100)
    winner, why = choose({"fp32": fp32, "int8": wide})
    assert winner == "fp32" and "undecided" in why and "int8" in why
    tight = _row("int8", [0.98, 1.02, 0.99, 1.01, 1.0, 0.97, 1.03], 100)
    assert choose({"fp32": fp32, "int8": tight})[0] == "int8"
    slower = _row("int8", [1.5, 1.45, 1.55, 1.5, 1.6, 1.48, 1.52], 100)
    winner, why = choose({"fp32": fp32, "int8": slower})
    assert winner == "fp32" and why.startswith("fp32: the fastest build that passes")
    assert choose({"fp32": fp32, "int8": wide}, tight=3.0)[0] == "int8"  # a looser tie rule
