"""precision=auto, the default: every candidate built, verified and timed side by side, the
fastest passing one shipped (pipeline/app/auto.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import composed, cpu_note, read_report, run_cli, run_dirs, single_bundle
from pipeline.artifacts import read_json
from pipeline.verification import speed

from pipeline.app.auto import CUT, SLOWER, UNVERIFIED, _fp32_could_ship, _timed_by_verify, choose
from pipeline.app.screening import SCREEN_SLOWER
from stages.results import VerifySummary

REPO = Path(__file__).resolve().parents[1]


def test_the_default_ships_the_fastest_passing_candidate(auto_default_run):
    cwd, result = auto_default_run
    assert result.returncode == 0, result.stdout + result.stderr
    run_dir = run_dirs(cwd)[-1]
    report = read_report(run_dir)
    section = report["auto"]
    rows = all_rows = {row["precision"]: row for row in section["candidates"]}
    # ONNX Runtime's candidates (fp16 has no CPU kernels): int8 with static and with dynamic activation
    # ranges; int8_dynamic last, as on every model whose quantizable ops are mostly convolutions (3 of 5)
    assert list(rows) == ["fp32", "int8", "mixed", "int8_dynamic"]
    # each int8 build is timed against fp32 before it is verified: measurably slower (as
    # int8_dynamic, quantizing at run time) it is reported so and never verified, else it is verified
    for precision in ("int8", "int8_dynamic"):
        row, verify = rows[precision], run_dir / "candidates" / precision / "stages" / "verify"
        assert row["verdict"] in ("pass", SLOWER), row
        assert verify.exists() == (row["verdict"] == "pass")
        if row["verdict"] == SLOWER:
            assert row["speedup"]["speedup_p75"] < SCREEN_SLOWER and "not verified" in row["reasons"][0]
    # fp32 is every candidate's speed reference, verified only when it could ship
    fp32_verified = rows["fp32"]["verdict"] == "pass"
    assert fp32_verified or rows["fp32"]["not_verified"].startswith("not verified: a faster build passes")
    assert (run_dir / "candidates" / "fp32" / "stages" / "verify").exists() == fp32_verified
    # a candidate that cannot win is not built: with int8 passing, plain int8 meets the mixed
    # target (the mixed build would be the int8 build); with int8 slower than fp32, mixed is too
    assert not (run_dir / "candidates" / "mixed").exists()
    if rows["int8"]["verdict"] == "pass":
        assert rows["mixed"]["verdict"] == "same build as int8" and rows["mixed"]["not_built"].startswith("int8 passes")
        assert rows["mixed"].get("speedup") == rows["int8"].get("speedup")  # the build's final timing, not a copy
    else:
        assert rows["mixed"]["verdict"] == "not built" and "int8 is slower than fp32" in rows["mixed"]["reasons"][0]
    passing = {p: row for p, row in rows.items() if row["verdict"] == "pass"}
    if len(passing) > 1:  # every passing build timed in the same interleaved rounds as fp32
        assert all(row["latency"]["rounds"] >= 3 and row["latency"]["median_ms"] > 0 for row in passing.values())
    # the rule, re-applied to the measured rows, gives what was shipped
    assert section["chosen"] == choose(all_rows)[0] and section["why"] == choose(all_rows)[1]
    if set(passing) == {"fp32"}:
        assert "not verified (slower than fp32)" in section["why"]
    shipped = section["chosen"]
    # the default model is made for int8 to pass with the task kept and to ship faster than fp32
    # (benchmarks/auto_stability.py: int8 in 4 runs of 4, 1.11-1.37x on 2 AVX2 cores); what ships
    # follows the timing (the rule above), and a timing inside a loaded test run decides nothing
    # (one core busy beside it: fp32 shipped in 1 run of 4, int8 timed at 0.94x), so this test
    # holds int8 to being timed against fp32 and, verified, passing; the figure to the benchmark
    assert rows["int8"]["speedup"]["speedup"] > 0 and rows["int8"]["verdict"] in ("pass", SLOWER), f"{cpu_note()}: {rows}"
    assert shipped in ("fp32", "int8") and rows[shipped]["verdict"] == "pass", f"{cpu_note()}: {rows}"
    built_as = "int8" if shipped == "int8_dynamic" else shipped  # precision=int8, activation_ranges=dynamic
    assert report["precision"] == built_as and report["verify"]["effective"]["precision"] in (built_as, "int8")
    assert single_bundle(run_dir).name == f"digits_cnn-ort_cpu-{shipped}"  # -int8_dynamic apart from -int8
    assert f"precision=auto shipped {shipped}" in result.stdout
    assert "precision=auto candidates" in result.stdout
    assert "## precision=auto" in (run_dir / "report.md").read_text()
    assert section["budget"]["seconds"] == 300 and section["budget"]["cut"] == []
    # the shipped run reuses its candidate's verification
    assert {s["stage"]: s["status"] for s in report["stages"]}["verify"] == "cached"
    # beside a candidate fp32 is timed and its memory read, not run over the validation set
    # (validation.baselines=timed): that would be its verification, paid only when it could ship
    if shipped != "fp32":
        fp32_row = report["verify"]["comparison"]["fp32"]
        assert fp32_row["compared"] is False and fp32_row["cosine"] is None and fp32_row["latency"]["rounds"] >= 3
        memory = report["verify"]["memory"]
        assert memory["baseline_samples"] == 1 and memory["fp32"]["run_peak_mb"] > 0 and memory["samples"] > 1
        assert "not compared" in (run_dir / "report.md").read_text()
    # one reference pass: what the first verify did not find stored (the process that fills the
    # store ahead may not have finished) it ran and stored; every later verify reads every sample
    verified = [p for p in ("fp32", "int8", "int8_dynamic") if rows[p]["verdict"] == "pass"]
    answered = {p: read_json(run_dir / "candidates" / p / "stages" / "verify" / "result.json")["summary"]["reference"]
                for p in verified}
    samples = report["verify"]["samples"]
    assert all(sum(found.values()) == samples for found in answered.values())
    assert all(answered[p] == {"from_store": samples, "run": 0} for p in verified[1:])
    # ... and those later verifies start no reference worker at all
    log = (run_dir / "parity.log").read_text()
    assert log.count("every reference answer is in its store: the reference starts only") >= len(verified) - 1



def test_a_ci_log_holds_the_candidate_table_whole(auto_default_run):
    """stdout to a pipe with no COLUMNS (a CI log): rich laid tables out in 80 columns and
    cut `int8_dynamic` to `int8_d…` and a verdict to `cut by`; now every name, number and
    verdict reads back whole."""
    _, result = auto_default_run
    assert "\u2026" not in result.stdout, result.stdout
    lines = result.stdout.splitlines()
    start = lines.index("precision=auto candidates")
    header = lines[start + 1].split()
    assert header[:2] == ["precision", "cosine"] and header[-1] == "verdict", lines[start + 1]
    rows = {line.split()[0]: line for line in lines[start + 3:start + 7]}
    assert set(rows) == {"fp32", "int8", "int8_dynamic", "mixed"}, rows
    assert rows["int8"].rstrip().endswith(("pass (shipped)", "pass", "fail")), rows["int8"]


def test_a_ci_log_holds_each_log_record_on_one_line(auto_default_run):
    """stderr to a pipe (a CI log): rich wrapped a record at 80 columns ("1.8" ending one
    line, "s)" the next) and padded each line with spaces; now a record is one plain line."""
    cwd, result = auto_default_run
    lines = result.stderr.splitlines()
    records = [line for line in lines if line.startswith(("INFO ", "WARNING "))]
    assert records and len(records) == len(lines), result.stderr
    assert not any(line != line.rstrip() for line in lines), result.stderr
    log = (run_dirs(cwd)[-1] / "parity.log").read_text()
    assert all(f"] {line.split(maxsplit=1)[1]}" in log for line in records)
    assert any(len(line) > 80 for line in records), records  # one at least that rich wrapped


def test_the_gain_benchmark_times_the_default_jobs_builds_again_from_a_ci_log(auto_default_run, tmp_path):
    """Issue 57, item 4: benchmarks/default_gain.py, as CI runs it (CI=true, stdout to a file),
    times the shipped bundle and fp32's build again, each in its own process through its
    runtime.yaml, and prints that figure beside the one the job printed and whether it lies in
    the printed interval. What it reads on a given CPU is the benchmark's figure
    (docs/benchmarks.md): here, on whatever CPU runs the suite, the tool itself is checked."""
    cwd, result = auto_default_run
    assert result.returncode == 0, result.stdout + result.stderr
    run_dir = run_dirs(cwd)[0]  # the job's own run (a later test reruns it)
    row = {r["precision"]: r for r in read_report(run_dir)["auto"]["candidates"]}
    shipped = read_report(run_dir)["auto"]["chosen"]
    log = tmp_path / "gain.txt"
    with log.open("w") as out:
        done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "default_gain.py"), "--run", str(run_dir),
                               "--rounds", "3", "--images", "20"], stdout=out, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "CI": "true"}, cwd=tmp_path)
    text = log.read_text()
    assert done.returncode == 0, text + done.stderr
    assert text.startswith("CPU: ") and "; flags: " in text.splitlines()[0], text  # the flags the figure holds for
    assert f"shipped: {shipped}" in text and "cold default job" not in text
    if shipped == "fp32":  # a loaded machine's timing can ship fp32 (test_the_default_ships_...)
        assert "fp32 shipped with no speed-up measured" in text
        return
    assert f"printed speed-up vs fp32:   {speed.speedup_text(row[shipped]['speedup'])} (the next round's 90 % range" \
        in text, text
    independent = re.search(r"independent timing: +(\d+\.\d+)x \((\d+\.\d+)-(\d+\.\d+)\); fp32 (\d+\.\d+) ms, "
                            + shipped + r" (\d+\.\d+) ms a call, 3 rounds x 20 calls", text)
    assert independent and all(float(v) > 0 for v in independent.groups()), text
    assert re.search(r"inside the printed interval: (yes|no); the intervals overlap: (yes|no)", text), text


def test_a_rerun_starts_no_process_ahead_of_a_full_reference_store(auto_default_run):
    """The reference's answers were all stored by the first run: the rerun reads them and
    starts no process to fill the store ahead (it cost a process start per auto job)."""
    cwd, first = auto_default_run
    assert first.returncode == 0, first.stdout + first.stderr
    result = run_cli([], cwd, default_precision=None, quick=False, shared_cache=False)  # the first's cache
    assert result.returncode == 0, result.stdout + result.stderr
    log = (run_dirs(cwd)[-1] / "parity.log").read_text()
    assert "the reference's answers are all stored, none run ahead" in log

def test_the_budget_cuts_the_candidates_not_started_and_names_them(tmp_path):
    """precision.budget_s: once spent, no candidate starts (fp32, the reference, always
    does: 0 builds fp32 alone); each cut one is named in the table and in the why line."""
    result = run_cli(["precision.budget_s=0"], tmp_path, default_precision=None)
    assert result.returncode == 0, result.stdout + result.stderr
    section = read_report(run_dirs(tmp_path)[-1])["auto"]
    rows = {row["precision"]: row for row in section["candidates"]}
    assert section["chosen"] == "fp32" and rows["fp32"]["verdict"] == "pass"
    assert section["budget"]["cut"] == ["int8", "mixed", "int8_dynamic"]
    assert all(rows[p]["verdict"] == CUT and "precision.budget_s=0 s" in rows[p]["reasons"][0]
               for p in ("int8", "int8_dynamic", "mixed"))
    assert "cut by precision.budget_s: int8, mixed, int8_dynamic" in section["why"]
    assert "cut by the budget" in result.stdout


def test_fp32_is_verified_only_when_it_could_ship():
    """fp32 is built and timed as the speed reference; its full verification is paid for only
    when no other candidate passes or it would win the timing if it passed."""
    fp32 = {**_row("fp32", 10.0, 9.5, 10.5, 400), "verdict": UNVERIFIED}
    fast_int8 = _row("int8", 5.0, 4.8, 5.2, 100)
    assert not _fp32_could_ship({"fp32": fp32, "int8": fast_int8}, ["fp32", "int8"], 1.25)
    slow_int8 = _row("int8", 20.0, 19.0, 21.0, 100)
    assert _fp32_could_ship({"fp32": fp32, "int8": slow_int8}, ["fp32", "int8"], 1.25)
    failing = {**fast_int8, "verdict": "fail"}
    assert _fp32_could_ship({"fp32": fp32, "int8": failing}, ["fp32", "int8"], 1.25)
    assert not _fp32_could_ship({"fp32": fp32, "int8": slow_int8}, ["int8"], 1.25)  # not a candidate
    # a timing that crashed (ONNX Runtime refusing its own optimized graph): the passing builds have
    # no latency, nothing is known faster, so fp32 is verified and, passing too, ships as the closest
    untimed = {**fast_int8, "latency": {"error": "backend crashed"}}
    assert _fp32_could_ship({"fp32": fp32, "int8_dynamic": untimed}, ["fp32", "int8_dynamic"], 1.25)
    rows = {"fp32": {**fp32, "verdict": "pass", "latency": {"error": "backend crashed"}}, "int8_dynamic": untimed,
            "int8": {**untimed, "verdict": "fail", "reasons": ["requested precision int8 but fp32 ran"]}}
    winner, why = choose(rows)
    assert winner == "fp32" and why.startswith("fp32: fp32, int8_dynamic pass and none has a timing"), why
    assert "failed: int8" in why


def test_one_candidate_against_fp32_takes_its_verify_timing_instead_of_a_second_one():
    """int8 alone passing: its verify timed it interleaved with fp32 on one sample, which is
    what auto's timing would do; several passing candidates, or a stream, are timed again."""
    latency = {p: _row(p, ms, ms - 0.5, ms + 0.5, 100)["latency"] for p, ms in (("fp32", 10.0), ("int8", 5.0))}
    speedup = {"speedup": 2.0, "speedup_p25": 1.9, "speedup_p75": 2.1, "faster": True, "spread": 1.1, "call": "faster"}
    verify = VerifySummary.from_json({"speed": {"judged_on": None},
                                      "comparison": {"fp32": {"latency": latency["fp32"]},
                                                     "int8": {"latency": latency["int8"], "speedup": speedup}}})
    outcomes = {"fp32": SimpleNamespace(verify=None), "int8": SimpleNamespace(verify=verify)}
    tried = {"fp32": {"verdict": UNVERIFIED}, "int8": {"verdict": "pass"}}
    assert _timed_by_verify(outcomes, ["fp32", "int8"], tried)
    assert tried["int8"]["latency"] is latency["int8"] and tried["fp32"]["latency"] is latency["fp32"]
    assert tried["int8"]["speedup"] == speedup and "int8's verify" in tried["int8"]["timed_on"]
    assert choose({"int8": tried["int8"]})[0] == "int8"
    outcomes["bf16"] = SimpleNamespace(verify=verify)
    assert not _timed_by_verify(outcomes, ["fp32", "int8", "bf16"], {**tried, "bf16": {}})
    verify.speed["judged_on"] = "stream"
    assert not _timed_by_verify(outcomes, ["fp32", "int8"], {"fp32": {}, "int8": {}})


def test_nothing_passes_fails_with_the_closest_candidate(tmp_path):
    """No build can match ONNX Runtime's fp32 to 1e-12 on OpenVINO: the run fails with the
    reasons of the candidate closest to passing, and says so."""
    result = run_cli(["precision=auto", "target=openvino_cpu", "precision.candidates=[fp32,int8]",
                      "+validation.outputs={logits:{max_abs_error:1e-12}}"], tmp_path, shared_cache=False)
    assert result.returncode == 3, result.stdout + result.stderr
    report = read_report(run_dirs(tmp_path)[-1])
    assert report["auto"]["chosen"] == "fp32" and report["auto"]["why"].startswith("no candidate passes: fp32")
    assert report["verdict"] == "fail" and report["reasons"][0].startswith("output logits: max abs error")
    assert {row["verdict"] for row in report["auto"]["candidates"]} == {"fail"}
    # candidates are verified for their verdict alone; only the outcome is diagnosed, on the
    # measurement its candidate made (not measured again)
    run_dir = run_dirs(tmp_path)[-1]
    for precision in ("fp32", "int8"):
        candidate = read_json(run_dir / "candidates" / precision / "stages" / "verify" / "result.json")["summary"]
        assert candidate["layerwise"]["ran"] is False and candidate["advice_tried"] == []
        assert candidate["diagnosis"]["ran"] is False
    verify = report["verify"]
    assert verify["layerwise"]["ran"] and verify["diagnosis"]["ran"]
    assert verify["diagnosis"]["measurement"] == "reused from the cache"
    assert {s["stage"]: s["status"] for s in report["stages"]}["verify"] == "computed"  # the diagnosis ran


def test_a_candidate_the_target_cannot_build_is_a_config_error(tmp_path):
    result = run_cli(["precision=auto", "precision.candidates=[fp32,bf16]"], tmp_path)
    assert result.returncode == 2
    assert "precision.candidates: target ort_cpu cannot build 'bf16'" in result.stderr
    assert "Traceback" not in result.stderr


def _row(precision, median, p25, p75, size, verdict="pass"):
    rounds = [p25, median, median, p75]  # per-round medians, in round order
    return {"precision": precision, "verdict": verdict, "bytes": size, "cosine": 0.999,
            "latency": {"median_ms": median, "p25_ms": p25, "p75_ms": p75, "round_medians_ms": rounds}}


def test_bf16_waits_for_the_int8_candidates_and_is_not_verified_once_one_passes_faster():
    from pipeline.app.auto import _settle_deferred
    from pipeline.app.candidate_order import deferrable as _deferrable
    from pipeline.app.budget import Budget

    assert _deferrable(["fp32", "bf16", "int8", "mixed"]) == {"bf16"}
    assert _deferrable(["fp32", "bf16"]) == set() and _deferrable(["fp32", "int8", "bf16"]) == set()

    def screened(p25, median, p75, verdict):
        return {"verdict": verdict, "speedup": {"speedup": median, "speedup_p25": p25, "speedup_p75": p75}}

    budget = Budget(300.0)
    budget.deferred = {"bf16"}
    tried = {"fp32": {"verdict": UNVERIFIED}, "bf16": screened(1.4, 1.5, 1.6, UNVERIFIED),
             "int8": screened(1.5, 2.0, 2.2, "fail")}
    _settle_deferred(tried, budget)  # int8 failed: bf16 could still ship
    assert budget.deferred == {"bf16"} and "not_verified" not in tried["bf16"]
    tried["mixed"] = screened(1.55, 1.7, 1.9, "pass")  # passes, but its p25 is under bf16's p75: bf16 may win
    _settle_deferred(tried, budget)
    assert budget.deferred == {"bf16"}
    tried["mixed"] = screened(1.65, 1.8, 1.9, "pass")
    _settle_deferred(tried, budget)
    assert budget.deferred == set()
    assert tried["bf16"]["not_verified"] == "not verified: mixed passes and runs faster (1.80x fp32 against 1.60x at most)"


def test_bf16_is_verified_after_int8_and_only_where_it_could_ship(tmp_path):
    """openvino_cpu's bf16 (every CPU: OpenVINO computes it in f32 where the CPU has no BF16)
    is built and screened in its turn and timed against int8's preview; where int8 would run
    no faster it is verified at once (int8 and mixed then built only if it fails), else after
    int8 and only when no passing candidate outran it on the screening; its row keeps the
    screening's speed-up and the preview's either way."""
    result = run_cli(["precision=auto", "target=openvino_cpu", "precision.candidates=[fp32,bf16,int8]"], tmp_path)
    assert result.returncode in (0, 3), result.stdout[-3000:] + result.stderr[-3000:]
    run_dir = run_dirs(tmp_path)[-1]
    rows = {row["precision"]: row for row in read_report(run_dir)["auto"]["candidates"]}
    bf16, int8 = rows["bf16"], rows["int8"]
    assert "speedup_p75" in bf16["speedup"]
    # (the rows' speed-ups are the final timing's; the rule reads the screening's: unit test above)
    bf16_verify = run_dir / "candidates" / "bf16" / "stages" / "verify"
    int8_verify = run_dir / "candidates" / "int8" / "stages" / "verify"
    if bf16["verdict"] == SLOWER:
        return
    preview = bf16["int8_preview"]
    assert (run_dir / "previews" / "int8" / "stages" / "build").is_dir()
    if preview["speedup_p25"] <= 1.0:  # int8 would run no faster than bf16: bf16 verified first
        assert bf16["cosine"] is not None
        if bf16["verdict"] == "pass":
            assert int8["verdict"] == "not built" and int8["outrun_by"] == "bf16" and not int8_verify.exists()
        else:
            assert bf16_verify.stat().st_mtime <= int8_verify.stat().st_mtime
    elif bf16["verdict"] == UNVERIFIED:
        assert int8["verdict"] == "pass" and bf16.get("cosine") is None
        assert bf16["not_verified"].startswith("not verified: int8 passes and runs faster")
    else:
        assert bf16["cosine"] is not None  # verified at the end
        assert bf16_verify.stat().st_mtime >= int8_verify.stat().st_mtime


def test_mixed_is_not_built_after_an_int8_that_fails_no_faster_than_fp32():
    """mixed is int8 with some ops float, no faster than it: after an int8 that failed and ran
    no faster than fp32 in three rounds of four it could at best tie fp32, which a tie ships;
    after one faster in three rounds of four, or passing, or not timed, it is decided as before."""
    from pipeline.app.auto import _decided_by_whole

    def failed(p25):
        return {"int8": {"verdict": "fail", "speedup": {"speedup": 1.03, "speedup_p25": p25, "speedup_p75": 1.08}}}

    row = _decided_by_whole("mixed", failed(0.99))
    assert row["verdict"] == "not built" and row["reasons"] == [
        "not built: int8 was not faster than fp32 in three rounds of four (1.03x, rounds 0.99-1.08x), and mixed is "
        "int8 with some ops in float"]
    assert _decided_by_whole("mixed", failed(1.01)) is None
    assert _decided_by_whole("mixed", {"int8": {"verdict": "fail"}}) is None  # not timed: searched
    assert _decided_by_whole("int8", failed(0.9)) is None and _decided_by_whole("mixed", {}) is None
    assert _decided_by_whole("mixed", {"int8": {"verdict": "pass", "speedup": {"speedup_p25": 0.9}}})["same_as"] == "int8"


def test_choose_ties_go_to_the_smaller_then_the_higher_precision():
    rows = {"fp32": _row("fp32", 10.0, 9.5, 10.5, 400), "int8": _row("int8", 5.0, 4.8, 5.2, 100),
            "mixed": _row("mixed", 5.1, 4.7, 5.3, 150)}  # faster than int8 in its first round
    assert choose(rows)[0] == "int8"
    rows["mixed"]["bytes"] = 100  # same size, same speed within the spread: the higher precision
    assert choose(rows)[0] == "mixed"
    rows["int8"]["verdict"] = rows["mixed"]["verdict"] = "fail"
    assert choose(rows)[0] == "fp32"
    rows["fp32"]["latency"]["median_ms"] = 2.0  # fastest now, and the only one passing
    assert choose(rows)[0] == "fp32"


def test_choose_a_tie_is_not_won_on_a_size_one_percent_smaller():
    """An LSTM keyword spotter (its weights not quantized by int8_dynamic) and a recommender
    whose embedding table stays float: the reduced build as fast as fp32 and 1 % smaller.
    fp32 ships, closer to the model's numbers; 10 % smaller is smaller."""
    rows = {"fp32": _row("fp32", 10.0, 9.5, 10.5, 890_000), "int8_dynamic": _row("int8_dynamic", 9.95, 9.4, 10.6, 880_000)}
    winner, why = choose(rows)
    assert winner == "fp32" and "closer to the model's numbers than int8_dynamic" in why
    rows["int8_dynamic"]["bytes"] = 800_000
    winner, why = choose(rows)
    assert winner == "int8_dynamic" and "smaller than fp32" in why


def test_no_build_passes_and_one_of_nan_is_neither_the_closest_nor_the_fastest_failing():
    """ncnn on a GroupNorm audio net: fp16 all NaN (cosine 0 now, 1.000000 before) and 3.7x
    fast, int8 at cosine 0.31: int8 comes closest and is the fastest failing worth naming."""
    rows = {"fp32": {**_row("fp32", 10.0, 9.5, 10.5, 90, "fail"), "cosine": 0.0003},
            "fp16": {**_row("fp16", 2.7, 2.6, 9.8, 90, "fail"), "cosine": 0.0, "speedup": {"speedup": 3.70}},
            "int8": {**_row("int8", 9.5, 9.4, 14.0, 90, "fail"), "cosine": 0.3085, "speedup": {"speedup": 1.05}}}
    for row in rows.values():
        row["reasons"] = ["output scores: cosine below 0.98"]
    winner, why = choose(rows)
    assert winner == "int8" and "the fastest failing: int8 at 1.05x fp32" in why and "fp16 at" not in why


def test_no_build_passes_and_the_precisions_fail_alike_fp32_is_shown():
    """ncnn on a bidirectional GRU text classifier: its conversion is wrong at fp32 already
    (cosine 0.295141) and fp16 fails the same way (0.295182): fp32's run is the one shown, not
    fp16's, whose advice was to keep an op in fp32. Farther apart, the closest still ships."""
    rows = {"fp32": {**_row("fp32", 10.0, 9.5, 10.5, 90, "fail"), "cosine": 0.295141},
            "fp16": {**_row("fp16", 9.0, 8.5, 9.5, 90, "fail"), "cosine": 0.295182}}
    for row in rows.values():
        row["reasons"] = ["output logits: cosine below 0.999"]
    winner, why = choose(rows)
    assert winner == "fp32" and why.startswith("no candidate passes, fp32 included: the precisions fail alike")
    rows["fp16"]["cosine"] = 0.5
    winner, why = choose(rows)
    assert winner == "fp16" and why.startswith("no candidate passes: fp16 comes closest")


def test_the_shipped_line_says_why_when_every_candidate_not_built_shares_one_reason():
    rows = {"fp32": _row("fp32", 10.0, 9.5, 10.5, 400)}
    for precision in ("int8", "int8_dynamic"):
        rows[precision] = {"precision": precision, "verdict": "not built", "reasons": [
            "config error: precision=int8: the model is quantized already (2 QuantizeLinear): parity builds it as given"]}
    assert "; not built (the model is quantized already (2 QuantizeLinear)): int8, int8_dynamic" in choose(rows)[1]
    rows["int8_dynamic"]["reasons"] = ["backend unavailable: int8_dynamic: ONNX Runtime's dynamic quantizer failed: x"]
    assert "; not built: int8, int8_dynamic" in choose(rows)[1]  # two reasons: the rows hold them


def test_choose_ties_go_first_to_the_build_that_keeps_more_of_the_task():
    """A BERT-style classifier (docs/benchmarks.md): static int8 and int8_dynamic as fast, the
    dynamic one smaller but flipping 2 of 300 decisions: the static one ships, and says why."""
    rows = {"fp32": _row("fp32", 10.0, 9.5, 10.5, 400), "int8": _row("int8", 5.0, 4.8, 5.2, 110),
            "int8_dynamic": _row("int8_dynamic", 4.95, 4.7, 5.3, 80)}
    rows["int8"]["metric_drop"], rows["int8_dynamic"]["metric_drop"] = 0.0, 2 / 300
    winner, why = choose(rows)
    assert winner == "int8" and "keeps more of the task than int8_dynamic" in why
    rows["int8_dynamic"]["metric_drop"] = 0.0  # the same task kept: the smaller ships, as before
    assert choose(rows)[0] == "int8_dynamic"


def test_choose_never_ships_a_build_slower_in_three_rounds_of_four_on_size():
    fp32 = _row("fp32", 10.0, 9.0, 11.0, 400)
    int8 = _row("int8", 10.5, 9.5, 11.5, 100)  # overlapping quartiles, but each round slower
    int8["latency"]["round_medians_ms"] = [9.5, 10.5, 10.5, 11.5]
    fp32["latency"]["round_medians_ms"] = [9.0, 10.0, 10.0, 11.0]
    assert choose({"fp32": fp32, "int8": int8})[0] == "fp32"
    int8["latency"]["round_medians_ms"] = [8.9, 10.5, 10.5, 11.5]  # as fast in one round of four: a tie
    assert choose({"fp32": fp32, "int8": int8})[0] == "int8"


ALL_TARGETS = ["ort_cpu", "openvino_cpu", "ncnn_cpu", "ncnn_vulkan", "mnn_cpu", "mnn_opencl", "mnn_vulkan"]
GPU_ONLY = ("mnn_opencl", "mnn_vulkan")  # MNN's pip wheel has no OpenCL / Vulkan backend: the fallback verdict


def test_every_target_works_with_its_defaults_and_the_sweep_names_each_winner(tmp_path):
    """`parity target=T` with nothing else, for every target, as one sweep (two jobs at a time): exit 0 wherever
    the target's device exists (ncnn_vulkan runs on Mesa's lavapipe), the device-fallback
    verdict where it does not; the summary matrix names what each target shipped."""
    import json

    result = run_cli(["-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", f"target={','.join(ALL_TARGETS)}"],
                     tmp_path, default_precision=None, timeout=900)
    (summary_file,) = (tmp_path / "multirun").glob("*/*/sweep.json")
    jobs = {job["target"]: job for job in json.loads(summary_file.read_text())["jobs"]}
    assert set(jobs) == set(ALL_TARGETS), result.stdout + result.stderr
    for target, job in jobs.items():
        if target in GPU_ONLY and job["exit_code"] == 4:
            assert job["reason"].startswith("requested device"), job
            # the first verified candidate finds the device missing, and no other precision is built after
            # it; a candidate screened slower than fp32 is not verified (fp32's own verify then finds it)
            order = read_report(summary_file.parent / job["dir"])["auto"]["candidates"]
            verified = [row for row in order if row["precision"] != "fp32" and row["verdict"] == "fail"]
            assert len(verified) <= 1, order
            for row in verified:
                assert row["reasons"][0].startswith("requested device"), row
            after = order[order.index(verified[0]) + 1:] if verified else []
            assert all(row["verdict"] == "not built" and "requested device" in row["reasons"][0]
                       for row in after), order
            assert all(row["verdict"] in ("slower than fp32", "not built", "fail") for row in order[1:]), order
            continue
        assert job["exit_code"] == 0 and job["verdict"] == "pass", job
        assert job["auto"]["chosen"] in ("fp32", "fp16", "bf16", "int8", "mixed", "int8_dynamic")
        assert job["bundle"].endswith(f"-{target}-{job['auto']['chosen']}")
        assert f"shipped {job['auto']['chosen']}" in (summary_file.parent / "sweep.md").read_text()
    assert result.returncode == max(job["exit_code"] for job in jobs.values())


@pytest.mark.parametrize("overrides", [("target=ncnn_vulkan", "precision=fp16"),  # the fp16 mask search
                                       ("target=mnn_cpu", "precision=int8"),  # the runtime's own quantizer
                                       ("target=ort_cpu", "precision=mixed")])
def test_the_shipped_run_reuses_its_candidates_stages_up_to_build(overrides):
    """auto verifies a candidate without the diagnosis (layerwise, advice trials), then runs
    the winner with it: every stage before verify must have the same cache key in both, or the
    final run builds the winner again (it did on MNN and ncnn, the key holding all of validation)."""
    from pipeline.app.auto import _candidate_stages
    from pipeline.config.validation import validate
    from stages import build, calibrate, convert, sensitivity, tune

    run = validate(composed(*overrides))
    candidate = _candidate_stages(run)
    assert candidate.validation.layerwise != run.validation.layerwise  # the two runs do differ
    for stage in (convert, calibrate, sensitivity, build, tune):
        assert stage.key_config(candidate) == stage.key_config(run), stage.NAME


def test_a_failing_candidate_keeps_its_speed_and_the_shipped_line_names_the_fastest_failing(tmp_path):
    """int8 fails a cosine gate it cannot meet: its row still has the speed-up measured before
    its verify (what a looser threshold would buy), and the shipped line names it with why."""
    result = run_cli(["metric=none", "validation.min_cosine=0.999999", "precision.candidates=[fp32,int8]"], tmp_path,
                     default_precision=None)
    assert result.returncode == 0, result.stdout + result.stderr
    section = read_report(run_dirs(tmp_path)[-1])["auto"]
    rows = {row["precision"]: row for row in section["candidates"]}
    assert section["chosen"] == "fp32" and rows["int8"]["verdict"] == "fail", rows
    assert rows["int8"]["speedup"]["speedup"] > 0 and rows["int8"]["timed_on"].endswith("before verification")
    assert f"the fastest failing: int8 at {rows['int8']['speedup']['speedup']:.2f}x fp32 (" in section["why"]
    assert "cosine" in section["why"].split("the fastest failing: int8")[1]
    # its verify left the timing out (validation.time_failing=false for auto's candidates)
    verify = read_json(Path(rows["int8"]["run_folder"]) / "stages" / "verify" / "result.json")
    speed = verify["summary"]["speed"]
    assert "not_timed" in speed and not speed["speedups"], speed
    assert verify["summary"]["comparison"]["int8"]["latency"] is None
