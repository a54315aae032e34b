"""data.kind=text: texts tokenized by a real WordPiece tokenizer (tiny_bert.tokenizer.json)
fill a real BERT sentence embedder's inputs by name; the CLI verifies over them, packages
the tokenizer, and ``parity-bundle run`` takes a sentence or a text file. Bad input is one
line and exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml

import sentences
from conftest import REPO, read_report, run_cli, run_dirs, single_bundle
from pipeline.config.schemas import DataConfig, DataKind
from pipeline.data import TensorSpec, open_dataset
from pipeline.errors import ConfigError, ExitCode, InputError
from pipeline.data import text as text_data

ASSETS = REPO / "pipeline" / "assets"
MODEL = ASSETS / "tiny_bert.onnx"
TOKENIZER = ASSETS / "tiny_bert.tokenizer.json"
INPUTS = [("input_ids", "int64"), ("attention_mask", "int64"), ("token_type_ids", "int64")]
TRACEBACK = "Traceback (most recent call last)"
SENTENCE = "The trailing comma is required only to create a single tuple."
CALIBRATION, VALIDATION = 8, 12


def tokenizer():
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(TOKENIZER))


def specs(dtype: str = "int64"):
    return [TensorSpec(name, [1, 0], dtype) for name, _ in INPUTS]


def text_config(path, **values) -> DataConfig:
    return DataConfig(kind=DataKind.text, path=str(path), tokenizer=str(TOKENIZER), **values)


# --- the functions ----------------------------------------------------------------------

def test_inputs_are_filled_by_name_at_natural_length():
    expected = tokenizer().encode(SENTENCE)
    feeds = text_data.Encoder(TOKENIZER, None, list(reversed(INPUTS)))(SENTENCE)
    assert list(feeds) == ["token_type_ids", "attention_mask", "input_ids"]
    assert feeds["input_ids"].tolist() == [expected.ids]
    assert feeds["attention_mask"].tolist() == [expected.attention_mask]
    assert feeds["token_type_ids"].tolist() == [expected.type_ids]
    assert all(a.shape == (1, len(expected.ids)) and a.dtype == np.int64 for a in feeds.values())
    assert len(expected.ids) > 8  # no padding, and long enough for the truncation test


def test_max_length_truncates_and_int32_inputs_get_int32():
    encode = text_data.Encoder(TOKENIZER, 8, [("input_ids", "int32"), ("attention_mask", "int32")])
    feeds = encode(SENTENCE)
    full = tokenizer().encode(SENTENCE).ids
    assert feeds["input_ids"].dtype == np.int32 and feeds["attention_mask"].dtype == np.int32
    assert feeds["input_ids"].shape == (1, 8)
    assert feeds["input_ids"][0, :7].tolist() == full[:7]  # the start kept, [SEP] last
    assert feeds["input_ids"][0, -1] == full[-1]
    assert encode("Short.")["input_ids"].shape[1] < 8  # a short text stays short: no padding


def test_folder_dataset(tmp_path):
    folder = sentences.write_folder(tmp_path / "texts", CALIBRATION, VALIDATION)
    (folder / "validation.txt").write_text("\n\n" + (folder / "validation.txt").read_text())  # blank lines skipped
    dataset = open_dataset(text_config(folder), specs())
    assert (len(dataset.calibration), len(dataset.validation)) == (CALIBRATION, VALIDATION)
    assert dataset.kind == "text"
    assert set(dataset.files) == {folder / "calibration.txt", folder / "validation.txt", TOKENIZER}
    first = next(iter(dataset.validation))
    line = (folder / "validation.txt").read_text().splitlines()[2]
    assert first.name == "validation.txt:3"
    assert first.feeds["input_ids"].tolist() == [tokenizer().encode(line).ids]
    lengths = {s.feeds["input_ids"].shape[1] for s in dataset.validation}
    assert len(lengths) > 1  # each text at its own length


def test_jsonl_file_is_split_first_calibration_size_then_the_rest(tmp_path):
    cal, val = sentences.split(4, 6)
    path = tmp_path / "texts.jsonl"
    path.write_text("\n".join(json.dumps({"text": t, "id": i}) for i, t in enumerate(cal + val)) + "\n\n")
    dataset = open_dataset(text_config(path, calibration_size=4), specs())
    assert [s.name for s in dataset.calibration] == [f"texts.jsonl:{i}" for i in range(1, 5)]
    assert [s.name for s in dataset.validation] == [f"texts.jsonl:{i}" for i in range(5, 11)]
    assert next(iter(dataset.validation)).feeds["input_ids"].tolist() == [tokenizer().encode(val[0]).ids]
    # null calibration_size: the first half calibrates
    half = open_dataset(text_config(path), specs())
    assert (len(half.calibration), len(half.validation)) == (5, 5)


def test_txt_file_split_and_its_errors(tmp_path):
    path = tmp_path / "texts.txt"
    path.write_text("\n".join(sum(sentences.split(3, 3), [])))
    dataset = open_dataset(text_config(path, calibration_size=2), specs())
    assert (len(dataset.calibration), len(dataset.validation)) == (2, 4)
    with pytest.raises(InputError, match="holds 6 texts and the first 6 calibrate"):
        open_dataset(text_config(path, calibration_size=6), specs())
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"words": "no text"}\n')
    with pytest.raises(InputError, match=r"bad.jsonl:2: expected an object with a \"text\""):
        open_dataset(text_config(bad, calibration_size=1), specs())
    with pytest.raises(InputError, match="does not exist"):
        open_dataset(text_config(tmp_path / "missing.txt"), specs())


def test_an_input_the_tokenizer_cannot_fill_is_named(tmp_path):
    folder = sentences.write_folder(tmp_path / "texts", 2, 2)
    inputs = [TensorSpec("input_ids", [1, 0], "int64"), TensorSpec("pixel_values", [1, 3], "float32")]
    with pytest.raises(InputError) as err:
        open_dataset(text_config(folder), inputs)
    assert "'pixel_values'" in str(err.value) and "input_ids, attention_mask, token_type_ids" in str(err.value)
    assert err.value.exit_code == ExitCode.USAGE


def test_tokenizers_not_installed_is_a_config_error(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "tokenizers", None)  # import tokenizers -> ImportError
    with pytest.raises(ConfigError, match=r"pip install 'parity\[text\]'"):
        text_data.load_tokenizer(TOKENIZER)


# --- the CLI, as a user runs it ------------------------------------------------------------

def parity(args, cwd, **kwargs):
    return run_cli(args, cwd, default_precision="precision=fp32", **kwargs)


def text_args(folder, tokenizer_path=TOKENIZER, model=MODEL):
    return [f"model.path={model}", "data.kind=text", f"data.path={folder}", f"data.tokenizer={tokenizer_path}",
            "metric=none", "precision=fp32", "target=ort_cpu"]


def one_line_error(result, phrases, program="parity"):
    output = result.stdout + result.stderr
    assert TRACEBACK not in output, output
    assert result.returncode == 2, output
    lines = [line for line in result.stderr.splitlines() if line.startswith(f"{program}:")]  # (stage logs aside)
    assert len(lines) == 1 and result.stderr.rstrip().endswith(lines[0].rstrip()), result.stderr
    for phrase in phrases:
        assert phrase in lines[0], (phrase, lines[0])


def stage_status(run_dir: Path) -> dict:
    report = read_report(run_dir)  # checked against docs/report.schema.json
    return {record["stage"]: record["status"] for record in report["stages"]}


@pytest.fixture(scope="module")
def text_run(tmp_path_factory):
    """One fp32 run on the tiny BERT over 8 + 12 sentences, its tokenizer a copy (the
    cache test changes it): (cwd, tokenizer copy, run folder, completed process)."""
    cwd = tmp_path_factory.mktemp("text")
    sentences.write_folder(cwd / "texts", CALIBRATION, VALIDATION)
    copy = cwd / "tokenizer.json"
    copy.write_bytes(TOKENIZER.read_bytes())
    result = parity(text_args(cwd / "texts", copy), cwd, shared_cache=False)  # the cache test reads its statuses
    assert result.returncode == 0, result.stdout + result.stderr
    (run_dir,) = run_dirs(cwd)
    return cwd, copy, run_dir, result


def test_cli_verifies_over_the_texts_and_packages_the_tokenizer(text_run):
    cwd, copy, run_dir, result = text_run
    assert f"verify: ort_cpu fp32 vs ONNX Runtime fp32 ({VALIDATION} samples)" in result.stdout, result.stdout
    assert "verdict: PASS (exit 0)" in result.stdout
    report = read_report(run_dir)
    assert report["data"]["kind"] == "text"
    bundle = single_bundle(run_dir)
    manifest = json.loads((bundle / "manifest.json").read_text())
    import hashlib

    assert manifest["files"]["tokenizer.json"]["sha256"] == hashlib.sha256(copy.read_bytes()).hexdigest()
    record = yaml.safe_load((bundle / "runtime.yaml").read_text())["preprocess"]
    assert record["kind"] == "text" and record["tokenizer"] == "tokenizer.json" and record["max_length"] is None
    assert record["fills"] == {"input_ids": "ids", "attention_mask": "attention_mask", "token_type_ids": "type_ids"}


def embedding(text: str) -> np.ndarray:
    import onnxruntime as ort

    encoding = tokenizer().encode(text)
    feeds = {name: np.asarray([getattr(encoding, text_data.FILLED[name])], dtype=np.int64) for name, _ in INPUTS}
    session = ort.InferenceSession(str(MODEL), providers=["CPUExecutionProvider"])
    return session.run(["sentence_embedding"], feeds)[0]


def test_bundle_runs_a_sentence(text_run):
    cwd, _, run_dir, _ = text_run
    bundle = single_bundle(run_dir)
    result = run_cli(["run", bundle, SENTENCE, "--output", "one.npz"], cwd, program="parity-bundle")
    assert result.returncode == 0, result.stdout + result.stderr
    ids = tokenizer().encode(SENTENCE).ids
    assert f"input_ids_out: shape [1, {len(ids)}] int64" in result.stdout, result.stdout
    assert "sentence_embedding: shape [1, 64] float32" in result.stdout
    with np.load(cwd / "one.npz") as saved:
        assert saved["input_ids_out"].tolist() == [ids]
        np.testing.assert_allclose(saved["sentence_embedding"], embedding(SENTENCE), atol=1e-5)


def test_bundle_runs_each_line_of_a_text_file(text_run):
    cwd, _, run_dir, _ = text_run
    bundle = single_bundle(run_dir)
    texts = sentences.split(2, 0, seed=5)[0]
    (cwd / "few.txt").write_text(f"{texts[0]}\n\n{texts[1]}\n")
    result = run_cli(["run", bundle, "few.txt", "--output", "few.npz"], cwd, program="parity-bundle")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "few.txt:1 " in result.stdout and "few.txt:3 " in result.stdout, result.stdout
    assert result.stdout.count("sentence_embedding: shape [1, 64]") == 2
    with np.load(cwd / "few.npz") as saved:
        assert sorted(k for k in saved.files if k.endswith("sentence_embedding")) == \
            ["1/sentence_embedding", "3/sentence_embedding"]
        np.testing.assert_allclose(saved["3/sentence_embedding"], embedding(texts[1]), atol=1e-5)
    missing = run_cli(["run", bundle, "nothere.txt"], cwd, program="parity-bundle")
    one_line_error(missing, ["nothere.txt does not exist"], "parity-bundle")


def test_a_changed_tokenizer_is_not_served_from_the_cache(text_run):
    cwd, copy, first_run, _ = text_run
    assert stage_status(first_run)["verify"] == "computed"
    copy.write_text(json.dumps(json.loads(copy.read_text()), indent=1))  # the same tokenizer, other bytes
    changed = parity(text_args(cwd / "texts", copy), cwd, shared_cache=False)
    assert changed.returncode == 0, changed.stdout + changed.stderr
    status = stage_status(run_dirs(cwd)[-1])
    assert status["convert"] == "cached" and status["verify"] == "computed", status
    again = parity(text_args(cwd / "texts", copy), cwd, shared_cache=False)
    assert again.returncode == 0, again.stdout + again.stderr
    assert stage_status(run_dirs(cwd)[-1])["verify"] == "cached"


def test_bundle_without_a_tokenizer_refuses_text(tmp_path):
    result = parity(["metric=none", "pipeline.stages=[convert,build,package]"], tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    bundle = single_bundle(run_dirs(tmp_path)[0])
    refused = run_cli(["run", bundle, "a sentence to embed"], tmp_path, program="parity-bundle")
    one_line_error(refused, ["a sentence to embed", "no tokenizer", "data.kind=text"], "parity-bundle")


def pixel_model(path: Path) -> Path:
    """A model with input_ids and an input no tokenizer fills (pixel_values)."""
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Cast", ["input_ids"], ["ids_float"], to=TensorProto.FLOAT),
         helper.make_node("ReduceSum", ["ids_float"], ["ids_sum"], keepdims=1),
         helper.make_node("Mul", ["pixel_values", "ids_sum"], ["scores"])],
        "pixels_and_ids",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, "sequence"]),
         helper.make_tensor_value_info("pixel_values", TensorProto.FLOAT, [1, 3])],
        [helper.make_tensor_value_info("scores", TensorProto.FLOAT, [1, 3])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def test_cli_input_errors_are_one_line_exit_2(tmp_path):
    folder = sentences.write_folder(tmp_path / "texts", 2, 3)
    cases = [
        (text_args(folder, model=pixel_model(tmp_path / "pixels.onnx")),
         ["model input 'pixel_values' cannot be filled from text", "input_ids, attention_mask, token_type_ids"]),
        (text_args(folder, tmp_path / "none.json"), ["data.tokenizer", "none.json does not exist"]),
        (text_args(tmp_path / "absent"), ["data.path", "absent does not exist"]),
        ([a for a in text_args(folder) if not a.startswith("data.tokenizer")],
         ["data.kind=text", "data.tokenizer"]),
        ([*text_args(folder), "data.max_length=0"], ["data.max_length=0", ">= 1"]),
    ]
    for args, phrases in cases:
        one_line_error(parity(args, tmp_path), phrases)


def test_tokenizers_not_installed_is_one_line_exit_2(tmp_path):
    shadow = tmp_path / "shadow" / "tokenizers"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError(\"No module named 'tokenizers'\")\n")
    folder = sentences.write_folder(tmp_path / "texts", 2, 3)
    result = parity(text_args(folder), tmp_path, env={"PYTHONPATH": str(tmp_path / "shadow")})
    one_line_error(result, ["tokenizers", "pip install 'parity[text]'"])
