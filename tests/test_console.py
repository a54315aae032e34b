"""A console a person reads (issue 46 item 5): the stage lines of a job go to the run
folder's parity.log, not the console (on a terminal one live line shows the candidate and
stage); precision=auto's candidate table fits 100 columns with its markers whole; the fp16
pre-flight warning only where an fp16 or bf16 build is made or weighed."""

from __future__ import annotations

import re

import pytest

from conftest import TINY_BERT, run_cli, run_dirs, text_args

STAGE_LINE = re.compile(r"stage \w+: (running|computed|cached)")
FP16_WARNING = "warning: pre-flight: <Constant>: max |x| 3.4e+38 > 65504"  # tiny BERT's attention mask constant


@pytest.fixture(scope="module")
def warm_default(tmp_path_factory):
    """`parity` as a user types it (precision=auto), twice in one folder at 100 columns: the
    second run reads every candidate's stages from outputs/.cache. (cwd, first, second)."""
    cwd = tmp_path_factory.mktemp("warm")
    first = run_cli([], cwd, default_precision=None, env={"COLUMNS": "100"}, shared_cache=False)
    second = run_cli([], cwd, default_precision=None, env={"COLUMNS": "100"}, shared_cache=False)
    return cwd, first, second


def test_on_a_terminal_one_live_line_says_the_candidate_and_stage(warm_default):
    """rich's live display, as a terminal gets it (TTY_COMPATIBLE/TTY_INTERACTIVE: stderr
    taken for one): frames of one line on stderr, none of them a log line; stdout the same."""
    cwd, _, second = warm_default
    live = run_cli([], cwd, default_precision=None, env={"COLUMNS": "100", "TTY_COMPATIBLE": "1",
                                                        "TTY_INTERACTIVE": "1"}, shared_cache=False)
    assert live.returncode == 0, live.stdout + live.stderr
    frames = re.findall(r"parity: precision=auto: [^\x1b\r\n]*\(\d+ s\)", live.stderr)
    assert frames and all(re.fullmatch(r"parity: precision=auto: (candidate \w+ \(\d of 4\)|timing [^·]*|"
                                       r"verifying fp32|shipping \w+)( · (stage \w+|timing against fp32))? "
                                       r"\(\d+ s\)", f) for f in frames), frames
    assert not STAGE_LINE.search(live.stderr) and "INFO" not in live.stderr, live.stderr
    plain = re.sub(r"\x1b\[[0-9;]*m", "", live.stdout)  # a terminal gets colour
    assert "precision=auto candidates" in plain and "parity:" not in plain


def test_a_warm_job_prints_no_stage_lines_and_parity_log_keeps_them(warm_default):
    cwd, first, second = warm_default
    assert first.returncode == 0 and second.returncode == 0, second.stdout + second.stderr
    console = second.stdout + second.stderr
    assert not re.search(r"INFO .*stage .*cached", console), console
    assert not STAGE_LINE.search(console) and "precision=auto: candidate" not in console, console
    log = (run_dirs(cwd)[-1] / "parity.log").read_text()
    cached = re.findall(r"\[parity\.progress\]\[INFO\] stage (\w+): cached in", log)
    # every candidate's stages, then the shipped run's: convert more than once
    assert cached.count("convert") >= 2 and {"build", "verify"} <= set(cached), log
    assert "precision=auto: candidate int8" in log
    # the cold run too: its stage lines went to its own parity.log only
    assert not STAGE_LINE.search(first.stdout + first.stderr)
    assert "stage calibrate: computed" in (run_dirs(cwd)[0] / "parity.log").read_text()


def test_the_candidate_table_fits_100_columns_with_its_markers_whole(warm_default):
    _, _, second = warm_default
    lines = second.stdout.splitlines()
    start = lines.index("precision=auto candidates")
    table = lines[start:next(i for i, line in enumerate(lines) if line.startswith("precision=auto shipped"))]
    assert all(len(line.rstrip()) <= 100 for line in table), "\n".join(table)
    shipped = re.search(r"precision=auto shipped (\w+)", second.stdout).group(1)
    # each row: its first line and the lines a wrapped cell goes on in (they start blank)
    body = table[next(i for i, line in enumerate(table) if line.startswith("─")) + 1:]
    rows: dict = {}
    for line in body:
        if line.strip() and not line.startswith(" "):
            rows[line.split()[0]] = [line]
        elif line.strip():
            rows[list(rows)[-1]].append(line)
    assert set(rows) == {"fp32", "int8", "int8_dynamic", "mixed"}, "\n".join(table)
    assert re.search(r"\(shipped\)", "\n".join(rows[shipped])), "\n".join(table)
    assert not any("(shipped)" in line for p, row in rows.items() if p != shipped for line in row)
    # fp32 is the reference of every speed-up (the int8 candidates are timed against it); that
    # column never wraps: the first line holds the whole cell
    assert "1.00x (reference)" in rows["fp32"][0], "\n".join(table)
    # (a loaded machine can time fp32's two-thread calls far slower: CI once read int8 21.03x)
    for precision in ("int8", "int8_dynamic"):
        assert re.search(r"\d+\.\d\dx \(\d+\.\d\d-\d+\.\d\d\)", rows[precision][0]), "\n".join(table)
    assert not any("…" in line for line in table), "\n".join(table)  # nothing cut short


@pytest.fixture(scope="module")
def bert_jobs(sentence_folder, tmp_path_factory):
    """The tiny BERT (a constant of 3.4e38, beyond fp16's 65504) built as int8 and as fp16."""
    jobs = {}
    for precision in ("int8", "fp16"):
        cwd = tmp_path_factory.mktemp(f"bert_{precision}")
        jobs[precision] = run_cli([*text_args(sentence_folder), "metric=none", f"precision={precision}",
                                   "pipeline.stages=[convert,calibrate,build]"], cwd)
    return jobs


def test_the_fp16_preflight_warns_only_where_an_fp16_build_is_made(bert_jobs):
    assert TINY_BERT.is_file()
    int8, fp16 = bert_jobs["int8"], bert_jobs["fp16"]
    assert int8.returncode == 0 and fp16.returncode == 0, int8.stderr + fp16.stderr
    assert FP16_WARNING in fp16.stdout
    assert "65504" not in int8.stdout + int8.stderr
    assert "warning: calibration: only 12 calibration samples" in int8.stdout  # the other warnings stay


def test_preflight_warnings_leave_out_fp16_range_without_a_half_build():
    from pipeline.report.assemble import preflight_warnings

    findings = [{"tensor": "mask", "check": "fp16_overflow", "count": 1, "detail": "max |x| 3.4e+38 > 65504",
                 "severity": "warning"},
                {"tensor": "w", "check": "nan_inf", "count": 1, "detail": "1 NaN, 0 Inf", "severity": "error"}]
    assert preflight_warnings(findings, half=False) == ["pre-flight: w: 1 NaN, 0 Inf"]
    assert preflight_warnings(findings) == ["pre-flight: w: 1 NaN, 0 Inf", "pre-flight: mask: max |x| 3.4e+38 > 65504"]
