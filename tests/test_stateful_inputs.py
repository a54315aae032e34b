"""Stateful models with a scalar input (the silero-vad pattern): `input` [batch, samples],
`state` [2, batch, hidden] (its batch on axis 1), a scalar int64 `sr` choosing an `If`
branch, an LSTM started from the state; outputs the score and the new state.

Every target either runs it or refuses it in one line (exit 2 or 4), never exit 1 or a
traceback; scalars stay 0-d in what is fed; calibration batches on each input's own batch
axis. Also here: data whose dtype differs from the model input's (a warning per input, or
exit 2 when the cast would change values), and a compile cache ONNX Runtime cannot write or read back."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from conftest import read_report, run_cli, run_dirs

SAMPLES, HIDDEN, COUNT = 32, 8, 8
TRACEBACK = "Traceback (most recent call last)"


def stateful_model(path: Path) -> Path:
    """If(sr == 16000) picks one of two MatMuls over the input; an LSTM runs one step from
    (h0, c0) = split(state); output = sigmoid(h @ head), stateN = concat(h, c)."""
    rng = np.random.default_rng(0)

    def branch(name: str, scale: float):
        weight = (rng.normal(0, 0.3, (SAMPLES, SAMPLES)) * scale).astype(np.float32)
        return helper.make_graph([helper.make_node("MatMul", ["input", f"w_{name}"], [f"feat_{name}"])], name, [],
                                 [helper.make_tensor_value_info(f"feat_{name}", TensorProto.FLOAT, ["batch", SAMPLES])],
                                 initializer=[numpy_helper.from_array(weight, f"w_{name}")])

    constants = {"sr16k": np.array(16000, np.int64), "axis0": np.array([0], np.int64),
                 "halves": np.array([1, 1], np.int64),
                 "W": rng.normal(0, 0.3, (1, 4 * HIDDEN, SAMPLES)).astype(np.float32),
                 "R": rng.normal(0, 0.3, (1, 4 * HIDDEN, HIDDEN)).astype(np.float32),
                 "head": rng.normal(0, 0.5, (HIDDEN, 1)).astype(np.float32)}
    nodes = [
        helper.make_node("Equal", ["sr", "sr16k"], ["is16k"], name="is16k"),
        helper.make_node("If", ["is16k"], ["feat"], name="pick_rate", then_branch=branch("then", 1.0),
                         else_branch=branch("else", 0.5)),
        helper.make_node("Unsqueeze", ["feat", "axis0"], ["seq"], name="to_sequence"),
        helper.make_node("Split", ["state", "halves"], ["h0", "c0"], name="split_state", axis=0),
        helper.make_node("LSTM", ["seq", "W", "R", "", "", "h0", "c0"], ["Y", "Y_h", "Y_c"], name="lstm",
                         hidden_size=HIDDEN),
        helper.make_node("Concat", ["Y_h", "Y_c"], ["stateN"], name="new_state", axis=0),
        helper.make_node("Squeeze", ["Y_h", "axis0"], ["hidden"], name="last_hidden"),
        helper.make_node("MatMul", ["hidden", "head"], ["logit"], name="head"),
        helper.make_node("Sigmoid", ["logit"], ["output"], name="score"),
    ]
    graph = helper.make_graph(
        nodes, "stateful_vad",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", SAMPLES]),
         helper.make_tensor_value_info("state", TensorProto.FLOAT, [2, "batch", HIDDEN]),
         helper.make_tensor_value_info("sr", TensorProto.INT64, [])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["batch", 1]),
         helper.make_tensor_value_info("stateN", TensorProto.FLOAT, [2, "batch", HIDDEN])],
        initializer=[numpy_helper.from_array(value, name) for name, value in constants.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, str(path))
    return path


def stateful_data(path: Path, input_dtype=np.float32, sr_values=None) -> Path:
    """Per split: input [N, 1, samples], state [N, 2, 1, hidden] (a sample each), sr [N]."""
    rng = np.random.default_rng(1)
    arrays = {}
    for split in ("calibration", "validation"):
        arrays[f"{split}/input"] = rng.uniform(-1, 1, (COUNT, 1, SAMPLES)).astype(input_dtype)
        arrays[f"{split}/state"] = rng.uniform(-0.5, 0.5, (COUNT, 2, 1, HIDDEN)).astype(np.float32)
        arrays[f"{split}/sr"] = np.asarray(sr_values if sr_values is not None else [16000] * COUNT)
    np.savez(path, **arrays)
    return path


@pytest.fixture(scope="module")
def stateful(tmp_path_factory):
    folder = tmp_path_factory.mktemp("stateful")
    return folder, stateful_model(folder / "vad.onnx"), stateful_data(folder / "vad.npz")


def run_stateful(stateful, *overrides, data=None):
    folder, model, default_data = stateful
    cwd = folder / "runs"
    cwd.mkdir(exist_ok=True)
    before = set(run_dirs(cwd))
    result = run_cli([f"model.path={model}", f"data.path={data or default_data}", f"data.calibration_size={COUNT}",
                      f"data.validation_size={COUNT}", *overrides], cwd)
    output = result.stdout + result.stderr
    assert TRACEBACK not in output, output
    assert result.returncode != 1, output
    new = sorted(set(run_dirs(cwd)) - before)
    return result, (new[-1] if new else None)


# --- the CLI on every target --------------------------------------------------------------------

@pytest.mark.parametrize("target,precision", [("ort_cpu", "fp32"), ("ort_cpu", "int8"), ("ort_cpu", "mixed"),
                                              ("openvino_cpu", "fp32"), ("openvino_cpu", "mixed")])
def test_stateful_model_passes(stateful, target, precision):
    result, run_dir = run_stateful(stateful, f"target={target}", f"precision={precision}")
    assert result.returncode == 0, result.stdout + result.stderr
    report = read_report(run_dir)
    assert report["verify"]["verdict"] == "pass"
    inputs = {spec["name"]: spec for spec in report["convert"]["inputs"]}
    # the scalar stays a scalar, the batch dim of the state is fixed on axis 1
    assert inputs["sr"]["shape"] == [] and inputs["sr"]["batch_axis"] is None
    assert inputs["state"]["shape"] == [2, 1, HIDDEN] and inputs["state"]["batch_axis"] == 1
    assert report["convert"]["fixed_shapes"]["state"] == {"from": [2, "batch", HIDDEN], "to": [2, 1, HIDDEN]}
    if precision != "fp32":  # calibration stacked the samples on each input's batch axis
        calibration = report["calibration"]
        assert calibration["batch_size"] > 1, calibration
        assert calibration["batching"] == "samples stacked on each input's batch axis", calibration


def test_ncnn_refuses_the_scalar_input_in_one_line(stateful):
    result, _ = run_stateful(stateful, "target=ncnn_cpu", "precision=fp32")
    assert result.returncode == 4, result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("parity:")]
    assert len(lines) == 1 and "ncnn cannot take scalar input 'sr'" in lines[0], result.stderr


# --- what is fed and how samples batch ------------------------------------------------------------

def test_scalars_stay_scalars_and_batches_follow_the_batch_axis(stateful, tmp_path):
    from pipeline.precision.calibration.statistics import BatchRunner, activation_names
    from pipeline.config.schemas import DataConfig
    from pipeline.data import open_dataset, pack, stack
    from pipeline.model import batch_axes, record_batch_axes, signature

    _, model_path, data = stateful
    model = onnx.load(str(model_path))
    assert batch_axes(model) == {"input": 0, "state": 1, "sr": None}
    specs = [spec if spec.name == "sr" else type(spec)(spec.name, [2, 1, HIDDEN] if spec.name == "state"
                                                       else [1, SAMPLES], spec.dtype, spec.batch_axis)
             for spec in signature(model)]
    dataset = open_dataset(DataConfig(path=str(data), calibration_size=COUNT, validation_size=COUNT), specs)
    samples = [sample.feeds for sample in dataset.calibration]
    assert all(s["sr"].shape == () and s["sr"].dtype == np.int64 for s in samples)
    batch = stack(samples[:3], specs)
    assert batch["state"].shape == (2, 3, HIDDEN) and batch["input"].shape == (3, SAMPLES) and batch["sr"].shape == ()
    assert stack([samples[0], {**samples[1], "sr": np.array(8000)}], specs) is None  # a shared input differs
    # the calibration runner: a batch on axis 1 gives the same values as one sample at a time
    record_batch_axes(model, batch_axes(model))  # as convert does before fixing the dims
    for value in model.graph.input:
        for dim in value.type.tensor_type.shape.dim:
            if dim.dim_param:
                dim.Clear()
                dim.dim_value = 1
    names = activation_names(model)
    batched, single = BatchRunner(model, names, 4), BatchRunner(model, names, 1)
    together, alone = batched.run(pack(samples), COUNT), single.run(pack(samples), COUNT)
    assert batched.batch_size == 4 and not batched.note and not batched.batch_on_axis0
    for name in names:
        np.testing.assert_allclose(together[name], alone[name], rtol=1e-5, atol=1e-6)


def test_compile_cache_that_onnxruntime_cannot_write_is_left_out(tmp_path):
    """An If whose branches disagree on the output type: ONNX Runtime's type inference
    raises while compiling; the build goes on without a compile cache."""
    from pipeline.release import compile_cache
    from pipeline.backends import onnxruntime as backend

    then = helper.make_graph([helper.make_node("Identity", ["x"], ["a"])], "then", [],
                             [helper.make_tensor_value_info("a", TensorProto.FLOAT, [1, 4])])
    other = helper.make_graph([helper.make_node("Cast", ["x"], ["b"], to=TensorProto.INT64)], "else", [],
                              [helper.make_tensor_value_info("b", TensorProto.INT64, [1, 4])])
    graph = helper.make_graph(
        [helper.make_node("Greater", ["s", "zero"], ["c"]),
         helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other)], "bad_if",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4]),
         helper.make_tensor_value_info("s", TensorProto.FLOAT, [])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
        initializer=[numpy_helper.from_array(np.array(0, np.float32), "zero")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8),
              str(tmp_path / "model.onnx"))
    settings = {"model": "model.onnx", "files": ["model.onnx"], "options": {"graph_optimization_level": "all"}}
    assert compile_cache.write(backend, tmp_path, settings) is None
    assert compile_cache.CACHE_FIELD not in settings
    assert not (tmp_path / compile_cache.FOLDER).exists()


def test_compile_cache_that_onnxruntime_cannot_read_back_is_left_out(tmp_path):
    """An If whose two branches each hold a Conv: on an x86 CPU with AVX2, ONNX Runtime's NCHWc
    layout gives each branch a reorder named 'reorder_token_0' and writes an optimized graph it
    then refuses to load ("not in SSA form"): the fp32 timing workers of precision=auto crashed on
    it and the job shipped a build slower than fp32. A cache is kept only where it loads back."""
    from pipeline.backends import onnxruntime as backend
    from pipeline.environment import cpu
    from pipeline.release import compile_cache

    from test_hazards_models import conv_if_model

    conv_if_model(tmp_path / "model.onnx")
    settings = {"model": "model.onnx", "files": ["model.onnx"], "options": {"graph_optimization_level": "all"}}
    written = compile_cache.write(backend, tmp_path, settings)
    if written is not None:  # a CPU without the NCHWc layout: the cache holds, and loads as a bundle loads it
        session = backend.Session(tmp_path / "model.onnx", cached_model=tmp_path / compile_cache.FOLDER /
                                  backend.CACHED_MODEL)
        assert "avx2" not in cpu().get("flags", []) and session is not None
        return
    assert compile_cache.CACHE_FIELD not in settings and not (tmp_path / compile_cache.FOLDER).exists()
    feeds = {"x": np.random.default_rng(0).uniform(-1, 1, (1, 3, 16, 16)).astype(np.float32)}
    assert backend.Session(tmp_path / "model.onnx").run(feeds)["y"].shape == (1, 4, 16, 16)  # loads without one


# --- data whose dtype differs from the model input's ------------------------------------------------

def test_other_dtypes_are_cast_with_one_warning_per_input(stateful):
    folder = stateful[0]
    data = stateful_data(folder / "wide.npz", input_dtype=np.float64, sr_values=np.full(COUNT, 16000, np.int32))
    result, run_dir = run_stateful(stateful, "target=ort_cpu", "precision=fp32", "validation.layerwise=off",
                                   "pipeline.stages=[convert,build,verify]", data=data)
    assert result.returncode == 0, result.stdout + result.stderr
    log = (run_dir / "parity.log").read_text()
    assert log.count("model input 'input' is float32 but the data is float64") == 1, log
    assert log.count("model input 'sr' is int64 but the data is int32") == 1, log
    assert "model input 'state'" not in log


def test_a_cast_that_changes_values_is_exit_2(stateful):
    folder = stateful[0]
    data = stateful_data(folder / "fraction.npz", sr_values=np.full(COUNT, 16000.5))
    result, _ = run_stateful(stateful, "target=ort_cpu", "precision=fp32", data=data)
    assert result.returncode == 2, result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("parity:")]
    assert len(lines) == 1, result.stderr
    for phrase in ("model input 'sr' is int64", "float64", "non-integer values"):
        assert phrase in lines[0], lines[0]
