"""Bad models, bad data and bad overrides: each run exits 2 with one clear line on stderr,
never a traceback, and leaves the bundle of an earlier good run in the same folder intact.

One good default run is made first in a scratch folder; then every bad run is made in that
same folder (once, by the module fixture ``bad_runs``); each case is then judged in its own
test, and a last test checks that nothing under the good run's folder changed."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from conftest import REPO, run_cli, run_dirs, single_bundle

ASSET_MODEL = REPO / "pipeline" / "assets" / "digits_cnn.onnx"
ASSET_DATA = REPO / "pipeline" / "assets" / "digits.npz"
TRACEBACK = "Traceback (most recent call last)"


# --- helpers ---------------------------------------------------------------------------

def error_message(stderr: str, program: str = "parity") -> list:
    """The user-facing error: the line starting '<program>:' and whatever follows it
    (log lines of the stages that ran before come first and are not part of it)."""
    lines = stderr.rstrip("\n").splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith(f"{program}:")]
    assert len(starts) == 1, f"expected exactly one '{program}:' line on stderr, got:\n{stderr}"
    return lines[starts[0]:]


def assert_clean_error(result, phrases, code=2, program="parity") -> str:
    output = result.stdout + result.stderr
    assert TRACEBACK not in output, output
    assert result.returncode == code, f"exit {result.returncode}, expected {code}:\n{output}"
    message = error_message(result.stderr, program)
    assert len(message) <= 2, f"error message is {len(message)} lines:\n" + "\n".join(message)
    text = " ".join(message)
    for phrase in phrases:
        assert phrase in text, f"{phrase!r} not in the error message: {text!r}"
    return text


def snapshot(root: Path) -> dict:
    """Every path under root: directories as None, files as (sha256, size, mtime_ns)."""
    state = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if path.is_dir():
            state[rel] = None
        else:
            stat = path.stat()
            state[rel] = (hashlib.sha256(path.read_bytes()).hexdigest(), stat.st_size, stat.st_mtime_ns)
    return state


# --- the bad inputs, built as real files ----------------------------------------------------

def _external_data_model(folder: Path) -> Path:
    """Y = X + W, with W stored as external data at '../outside.bin' (one level above the model)."""
    model_dir = folder / "ext_model"
    model_dir.mkdir()
    weights = np.arange(4, dtype=np.float32).reshape(1, 4)
    (folder / "outside.bin").write_bytes(weights.tobytes())
    w = numpy_helper.from_array(weights, "W")
    onnx.external_data_helper.set_external_data(w, location="../outside.bin", offset=0, length=weights.nbytes)
    w.ClearField("raw_data")
    graph = helper.make_graph(
        [helper.make_node("Add", ["X", "W"], ["Y"])], "add_external",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [1, 4])],
        initializer=[w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    path = model_dir / "model.onnx"
    path.write_bytes(model.SerializeToString())  # onnx.save would try to rewrite the external data
    assert onnx.load(str(path), load_external_data=False).graph.initializer[0].data_location == TensorProto.EXTERNAL
    return path


def _tensor_dir(folder: Path, make) -> Path:
    """A data directory with validation/ and calibration/ folders of .npy samples."""
    for split in ("validation", "calibration"):
        (folder / split).mkdir(parents=True)
        for index, array in enumerate(make(split)):
            np.save(folder / split / f"sample{index}.npy", array)
    return folder


def _digits(split: str, count: int = 3):
    with np.load(ASSET_DATA) as archive:
        return [archive[f"{split}/input"][i:i + 1].copy() for i in range(count)]


def _with_nan(split: str):
    samples = _digits(split)
    if split == "validation":
        samples[1][0, 0, 3, 4] = np.nan
    return samples


def build_cases(root: Path) -> dict:
    """case id -> (overrides, phrases the error message must contain)."""
    source = ASSET_MODEL.read_bytes()
    models = root / "models"
    models.mkdir()
    (models / "empty.onnx").write_bytes(b"")
    (models / "truncated.onnx").write_bytes(source[: len(source) // 2])
    (models / "text.onnx").write_text("this is not a model, just text\nsecond line\n")
    # A serialized TensorProto: valid protobuf bytes, but not an ONNX ModelProto.
    tensor = numpy_helper.from_array(np.ones((2, 2), dtype=np.float32), "weights")
    (models / "tensor.onnx").write_bytes(tensor.SerializeToString())
    # TensorProto(dims=[2, 2]) is b"\x08\x02\x08\x02", which does parse as a ModelProto
    # (field 1 = ir_version) that has no graph at all.
    parses = TensorProto(dims=[2, 2]).SerializeToString()
    onnx.load_from_string(parses)  # precondition: it really parses
    (models / "parses_as_model.onnx").write_bytes(parses)
    external = _external_data_model(models)

    data = root / "data"
    data.mkdir()
    bad_shape = _tensor_dir(data / "bad_shape", lambda split: [np.zeros((1, 1, 7, 7), np.float32)] * 2)
    empty = data / "empty"
    empty.mkdir()
    nan = _tensor_dir(data / "nan", _with_nan)

    return {
        "missing_model": (["model.path=/does/not/exist.onnx"],
                          ["input error", "model.path", "/does/not/exist.onnx", "does not exist"]),
        # precision=auto: the same one line, not wrapped in "no candidate could be built" for every candidate
        "missing_model_auto": (["model.path=/does/not/exist.onnx", "precision=auto"],
                               ["parity: input error: model.path: /does/not/exist.onnx does not exist"]),
        "zero_byte_model": ([f"model.path={models / 'empty.onnx'}"],
                            ["model.path", "empty.onnx", "is empty (0 bytes)"]),
        "truncated_model": ([f"model.path={models / 'truncated.onnx'}"],
                            ["model.path", "truncated.onnx", "cannot be parsed as ONNX", "truncated"]),
        "text_model": ([f"model.path={models / 'text.onnx'}"],
                       ["model.path", "text.onnx", "is a text file, not an ONNX model"]),
        "tensorproto_model": ([f"model.path={models / 'tensor.onnx'}"],
                              ["model.path", "tensor.onnx", "not a model"]),
        "protobuf_parses_but_no_graph": ([f"model.path={models / 'parses_as_model.onnx'}"],
                                         ["model.path", "parses_as_model.onnx", "not a complete ONNX model"]),
        "external_data_outside": ([f"model.path={external}"],
                                  ["model.path", "../outside.bin", "'W'", "points outside the model's directory",
                                   "refusing"]),
        "data_shape_mismatch": ([f"data.path={bad_shape}"],
                                ["data", "sample0.npy", "[1, 1, 7, 7]", "expects [1, 1, 8, 8]", "'input'"]),
        "empty_data_dir": ([f"data.path={empty}"],
                           ["data.path", str(empty), "contains no .npy/.npz files"]),
        "nan_in_data": ([f"data.path={nan}"],
                        ["data", str(nan / "validation" / "sample1.npy"), "NaN"]),
        "input_shapes_unknown_input": (["+model.input_shapes.nope=[1,1,8,8]"],
                                       ["model.input_shapes", "no input 'nope'", "inputs: input"]),
        # Without Hydra's '+', the override is refused at composition time: still exit 2, one line.
        "input_shapes_unknown_input_no_plus": (["model.input_shapes.nope=[1,1,8,8]"],
                                               ["config error", "model.input_shapes.nope"]),
    }


CASE_IDS = [
    "missing_model", "missing_model_auto", "zero_byte_model", "truncated_model", "text_model", "tensorproto_model",
    "protobuf_parses_but_no_graph", "external_data_outside", "data_shape_mismatch", "empty_data_dir",
    "nan_in_data", "input_shapes_unknown_input", "input_shapes_unknown_input_no_plus",
]


# --- fixtures ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def good_run(tmp_path_factory):
    """A good default run in the folder every bad run later uses, and its state right after
    (from the suite's stage cache, with its short timing: what it measured is not read)."""
    cwd = tmp_path_factory.mktemp("bad_inputs")
    result = run_cli([], cwd)
    assert result.returncode == 0, result.stdout + result.stderr
    (run_dir,) = run_dirs(cwd)
    bundle = single_bundle(run_dir)
    assert (bundle / "model.onnx").is_file() and (bundle / "manifest.json").is_file()
    return cwd, run_dir, snapshot(run_dir)


@pytest.fixture(scope="module")
def bad_runs(good_run, tmp_path_factory):
    """Every bad case run once, in the good run's folder: id -> (overrides, phrases, result, new run dirs)."""
    cwd, _, _ = good_run
    cases = build_cases(tmp_path_factory.mktemp("bad_inputs_files"))
    assert sorted(cases) == sorted(CASE_IDS)
    outcomes = {}
    for case in CASE_IDS:
        overrides, phrases = cases[case]
        before = set(run_dirs(cwd))
        result = run_cli(overrides, cwd)
        outcomes[case] = (overrides, phrases, result, sorted(set(run_dirs(cwd)) - before))
    return outcomes


# --- tests ---------------------------------------------------------------------------------

@pytest.mark.parametrize("case", CASE_IDS)
def test_bad_input_exits_2_with_one_clear_line(bad_runs, case):
    overrides, phrases, result, new_dirs = bad_runs[case]
    assert_clean_error(result, phrases)
    assert "verdict:" not in result.stdout, result.stdout  # stopped before any verdict
    for run_dir in new_dirs:
        assert not (run_dir / "bundle").exists(), f"{overrides} left a bundle in {run_dir}"
        assert not (run_dir / "report.json").exists(), f"{overrides} left a report in {run_dir}"


def test_bad_runs_leave_the_earlier_run_untouched(good_run, bad_runs):
    cwd, run_dir, before = good_run
    assert len(bad_runs) == len(CASE_IDS)
    assert run_dir in run_dirs(cwd)
    after = snapshot(run_dir)
    assert sorted(after) == sorted(before), "files were added to or removed from the earlier run folder"
    changed = [path for path in before if after[path] != before[path]]
    assert not changed, f"changed under the earlier run folder: {changed}"
    # ... and the earlier bundle still checks out against its manifest.
    result = run_cli(["verify", single_bundle(run_dir)], cwd, program="parity-bundle")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "match the manifest" in result.stdout
