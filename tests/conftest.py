"""Shared fixtures: the CLIs run as a user runs them, in a subprocess, in a scratch folder."""

from __future__ import annotations

import compileall
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import pipeline  # noqa: F401 - its telemetry opt-out also covers the tests' own openvino/onnxruntime imports
from pipeline.backends.ncnn.common import wait_passively

# the suite runs ncnn in its own processes too, two test modules side by side, as a parity job's
# workers run: libgomp's threads wait passively there, as in a job
wait_passively()

REPO = Path(__file__).resolve().parents[1]


# The precision a `parity` test job runs when its arguments name none: the suite's jobs
# were written for one build each (mixed: calibrate, sensitivity and FLOAT / INT8 / MIX in
# verify); the real default, precision=auto (every candidate built and timed), is tested
# as such in tests/test_auto.py with default_precision=None.
TEST_PRECISION = "precision=mixed"


# One stage cache for the session's jobs (PARITY_CACHE_DIR): a stage whose inputs, config
# and code another test's job already ran is served from it, as a second run of a user's
# job is. Tests that watch the cache itself, a stage's cold cost or its "computed" status
# pass shared_cache=False and get their folder's own outputs/.cache. Workers of
# `pytest -n` share it too (the stage cache locks an entry while one job computes it).
SHARED_CACHE: list = []


def pytest_sessionstart(session):
    # Every job is a new process that imports parity's modules; where PYTHONDONTWRITEBYTECODE
    # is set (as on the CI image) each one compiled them again: 0.2-0.6 s per process.
    for package in ("pipeline", "stages", "conf"):
        compileall.compile_dir(REPO / package, quiet=1)
    factory = session.config._tmp_path_factory
    if os.environ.get("PYTEST_XDIST_WORKER"):  # pytest -n: one cache for all the run's workers
        shared = factory.getbasetemp().parent / "stage-cache"
        shared.mkdir(exist_ok=True)
        SHARED_CACHE.append(shared)
    else:
        SHARED_CACHE.append(factory.mktemp("stage-cache"))


# Tests read what a job decides and records, not how fast it ran: a job times its builds in
# three short rounds and profiles two runs, unless the test passes quick=False (it reads the
# timing or profile settings themselves) or sets a key itself.
QUICK_TIMING = ["validation.timing_rounds=3", "validation.timing_round_ms=5", "validation.timing_runs=3",
                "validation.timing_max_seconds=1", "validation.timing_processes=1"]
QUICK_PROFILE = ["profile.runs=2", "profile.warmup=1", "profile.startup_rounds=1"]
_NOT_A_JOB = ("--help", "--cfg", "-c", "--info", "-i", "--shell-completion", "-sc")


# pytest -n N: a job always runs beside the other workers' jobs, so its BLAS threads get its
# share of the cores (as a job beside another does in tests/side_by_side.py)
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
BESIDE_OTHER_WORKERS = ({"OPENBLAS_NUM_THREADS": str(max(1, len(os.sched_getaffinity(0)) // WORKERS))}
                        if WORKERS > 1 else {})


def _with_quick_settings(args: list) -> list:
    if any(a in _NOT_A_JOB for a in args):
        return args
    given = {a.split("=")[0].lstrip("+~") for a in args}
    return [*args, *(o for o in QUICK_TIMING + QUICK_PROFILE if o.split("=")[0] not in given)]


def run_cli(args, cwd, program="parity", timeout=300, env=None,
            default_precision=TEST_PRECISION, shared_cache=True, quick=True) -> subprocess.CompletedProcess:
    """Run `parity ARGS` (or `parity-bundle`) through the installed console script."""
    script = Path(sys.executable).parent / program  # the console script pip installed
    args = [str(a) for a in args]
    if program == "parity":
        args = parity_args(args, default_precision, quick)
    return subprocess.run([str(script), *args], cwd=cwd, env=cli_env(env, shared_cache), capture_output=True,
                          text=True, timeout=timeout)


def parity_args(args: list, default_precision=TEST_PRECISION, quick=True) -> list:
    """``args`` as run_cli gives them to `parity`: the suite's precision unless one is set,
    and its short timing."""
    if default_precision and not any(a.split("=")[0].lstrip("+~") == "precision"
                                     for a in args) and "--help" not in args:
        args = [*args, default_precision]
    return _with_quick_settings(args) if quick else args


def cli_env(env=None, shared_cache=True) -> dict:
    """The environment run_cli runs a command in."""
    shared = {"PARITY_CACHE_DIR": str(SHARED_CACHE[0])} if shared_cache and SHARED_CACHE else {}
    inherited = {k: v for k, v in os.environ.items() if k not in ("HYDRA_FULL_ERROR", "PARITY_CACHE_DIR")}
    return {**inherited, "COLUMNS": "200", "NO_COLOR": "1", **shared, **BESIDE_OTHER_WORKERS, **(env or {})}


def cpu_note() -> str:
    """The CPU's int8-relevant flags, for the failure message of an assertion whose figure
    depends on the int8 kernels (VNNI kernels round otherwise than AVX2's)."""
    from pipeline.environment import cpu

    return f"CPU {cpu()['model']}: flags {' '.join(cpu()['flags'])}"


def composed(*overrides):
    """The config `parity OVERRIDES` composes to, in this process (what `parity ... --cfg
    job` prints, without a process per config)."""
    from hydra import compose, initialize_config_dir

    from pipeline.app.cli import CONFIG_DIR
    from pipeline.config import resolvers

    resolvers.register()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def run_dirs(cwd: Path):
    return sorted((Path(cwd) / "outputs").glob("*/*_*"))


def single_bundle(run_dir: Path) -> Path:
    bundles = [p for p in (run_dir / "bundle").iterdir() if p.is_dir()]
    assert len(bundles) == 1, bundles
    return bundles[0]


def read_report(run_dir: Path) -> dict:
    """The run's report.json, validated against docs/report.schema.json (so every report a
    test reads is checked against the documented schema)."""
    import jsonschema

    report = json.loads((run_dir / "report.json").read_text())
    jsonschema.validate(report, _report_schema(), cls=jsonschema.Draft202012Validator)
    return report


def _report_schema() -> dict:
    if not _SCHEMA:
        _SCHEMA.update(json.loads((REPO / "docs" / "report.schema.json").read_text()))
    return _SCHEMA


_SCHEMA: dict = {}


def run_default_job(cwd: Path):
    """`parity` with no arguments in an empty folder: (cwd, run folder, completed process)."""
    # as a user runs it, its profile and timing in full; tests read its statuses and its own cache
    result = run_cli([], cwd, shared_cache=False, quick=False)
    assert result.returncode == 0, result.stdout + result.stderr
    (run_dir,) = run_dirs(cwd)
    return cwd, run_dir, result


def model_copy(model):
    """A copy of an onnx.ModelProto for a test to change, ``model`` left as it was."""
    import onnx

    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    return copy


def ort_qdq_settings(*quantize_ops: str):
    """QdqSettings as an int8 build resolves them for ONNX Runtime with the config's defaults
    (uint8 activations, per-channel 7-bit weights, pass-through ops and SiLUs per backend)."""
    from types import SimpleNamespace

    from pipeline.precision.quantize import QdqSettings

    return QdqSettings.resolve(SimpleNamespace(
        activations=SimpleNamespace(value="uint8"), per_channel=True, reduce_range=True, quantize_ops=list(quantize_ops),
        quantize_outputs=None, quantize_activation_matmuls=False, passthrough_ops=None, quantize_swish=None),
        "onnxruntime")


def run_with_outputs(model, names, samples) -> list:
    """Each sample's feeds through a copy of ``model`` whose graph outputs are ``names``
    (intermediate tensors too), on ONNX Runtime's CPU provider: one {name: array} a sample."""
    import onnx
    import onnxruntime as ort

    copy = model_copy(model)
    del copy.graph.output[:]
    copy.graph.output.extend(onnx.helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None) for n in names)
    session = ort.InferenceSession(copy.SerializeToString(), providers=["CPUExecutionProvider"])
    return [dict(zip(names, session.run(names, feeds))) for feeds in samples]


@pytest.fixture(scope="session")
def default_run(tmp_path_factory):
    """The default job, run once for the session."""
    return run_default_job(tmp_path_factory.mktemp("default"))


@pytest.fixture(scope="session")
def auto_default_run(tmp_path_factory):
    """`parity` with no arguments, as a user types it (precision=auto, the embedded digits
    model on ort_cpu), run once for the session: (cwd, completed process). With the default
    timing (not the suite's quick one): its test asserts what ships, and on a loaded 2-core
    AVX2 machine three 5 ms rounds left int8 (1.04-1.46x fp32 on a quiet one) undecided
    against fp32, which then shipped. Its stdout goes to a pipe with no COLUMNS, as in a CI log.
    In a stage cache of its own, as a first job has: in the shared one, a `pytest -n` worker that
    ran the same job first left every stage cached and nothing logged (a test reads the log)."""
    cwd = tmp_path_factory.mktemp("auto")
    return cwd, run_cli([], cwd, default_precision=None, quick=False, env={"COLUMNS": ""}, shared_cache=False)


@pytest.fixture(scope="session")
def classifier_qdq(tmp_path_factory):
    """The PP-OCR text-direction classifier prepared, 16 rendered text lines and its QDQ
    model (max thresholds, quantized inputs only): the real model of the bias-correction
    and weight-rounding tests."""
    import importlib.resources
    import random

    import onnx

    from pipeline.precision.calibration import statistics, tables
    from pipeline.data import Sample
    from pipeline.precision.prepare import prepare
    from pipeline.precision.quantize import QdqSettings, quantize_static_qdq
    from textlines import FONTS, WORDS, line_tensor

    folder = tmp_path_factory.mktemp("cls-qdq")
    source = importlib.resources.files("rapidocr_onnxruntime") / "models" / "ch_ppocr_mobile_v2.0_cls_infer.onnx"
    model = onnx.version_converter.convert_version(onnx.load(str(source)), 13)
    for dim, size in zip(model.graph.input[0].type.tensor_type.shape.dim, (1, 3, 48, 192)):
        dim.Clear()
        dim.dim_value = size
    onnx.save(model, str(folder / "model.onnx"))
    prepare(folder / "model.onnx", folder / "prepared.onnx")
    rng = random.Random(3)
    samples = [{"x": line_tensor(rng.choice(WORDS), rng.randint(26, 34), rng.choice(FONTS))} for _ in range(16)]
    stats = statistics.collect(folder / "prepared.onnx", [Sample(str(i), s) for i, s in enumerate(samples)],
                               len(samples), 512, 8, 0)
    prepared = onnx.load(str(folder / "prepared.onnx"))
    quantized = quantize_static_qdq(prepared, tables.build_table(stats.histograms, "max"),
                                    QdqSettings(quantize_outputs=False))
    return prepared, quantized, samples


@pytest.fixture(scope="session")
def tiny_bert_tensors(tmp_path_factory):
    """pipeline/assets/tiny_bert.onnx's inputs for 12 calibration and 20 validation real
    sentences (tests/sentences.py), one .npz a sentence ([1, its own length] int64 each of
    input_ids, attention_mask, token_type_ids) in calibration/ and validation/: the
    tensors layout, for tests that do not go through data.kind=text."""
    import numpy as np
    from tokenizers import Tokenizer

    from sentences import split

    tokenizer = Tokenizer.from_file(str(REPO / "pipeline" / "assets" / "tiny_bert.tokenizer.json"))
    folder = tmp_path_factory.mktemp("tiny_bert_tensors")
    for name, texts in zip(("calibration", "validation"), split(12, 20, seed=2)):
        (folder / name).mkdir()
        for index, text in enumerate(texts):
            encoding = tokenizer.encode(text)
            np.savez(folder / name / f"{index:03d}.npz", **{
                key: np.array([values], dtype=np.int64) for key, values in (
                    ("input_ids", encoding.ids), ("attention_mask", encoding.attention_mask),
                    ("token_type_ids", encoding.type_ids))})
    return folder


TINY_BERT = REPO / "pipeline" / "assets" / "tiny_bert.onnx"
TINY_BERT_TOKENIZER = REPO / "pipeline" / "assets" / "tiny_bert.tokenizer.json"


def text_args(folder) -> list:
    """The tiny sentence embedder on a folder of texts (data.kind=text), as a user writes it."""
    return [f"model.path={TINY_BERT}", "data.kind=text", f"data.path={folder}", f"data.tokenizer={TINY_BERT_TOKENIZER}"]


@pytest.fixture(scope="session")
def sentence_folder(tmp_path_factory):
    """calibration.txt (12) and validation.txt (24): real sentences at their natural lengths."""
    from sentences import write_folder

    return write_folder(tmp_path_factory.mktemp("sentences"), 12, 24, seed=1)

