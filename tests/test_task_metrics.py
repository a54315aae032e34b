"""Task metrics (pipeline/task_metrics.py, conf/metric): the built-ins on their own, a
custom metric from a file outside the package, the metric gating real models (the
PP-OCRv4 recognizer with metric=ctc on rendered text lines, the PP-OCRv4 detector with
metric=map_iou), `parity-bundle run` on a PNG, and data sizes that follow the data."""

from __future__ import annotations

import functools
import importlib.resources
import subprocess
import sys

import numpy as np
import onnx
import pytest

from conftest import read_report, run_cli, single_bundle
from side_by_side import SIDE_BY_SIDE_ENV, Jobs, new_run, selected, stages
from textlines import FONTS, NEEDS_FONTS_SKIPPED, render, write_dataset

from pipeline.config.schemas import DataConfig, DataKind
from pipeline.data import TensorSpec, open_dataset
from pipeline.task_metrics import CTC, MapIoU, MetricError, Regression, char_accuracy, load_metric
from pipeline.verification.scoring import TaskScorer

MODELS = importlib.resources.files("rapidocr_onnxruntime") / "models"
REC = MODELS / "ch_PP-OCRv4_rec_infer.onnx"
DET = MODELS / "ch_PP-OCRv4_det_infer.onnx"
CLS = MODELS / "ch_ppocr_mobile_v2.0_cls_infer.onnx"
LINES = ("parity", "deploy model", "runtime 2026", "verify", "bundle", "tensor layer", "accuracy", "Quick fox",
         "lazy dog", "ONNX", "calibration", "OpenVINO")
needs_fonts = pytest.mark.skipif(NEEDS_FONTS_SKIPPED, reason="needs Debian's fonts-dejavu-core (installed by .ci/run)")


# --- the built-ins ------------------------------------------------------------------------

def one_hot(steps, classes=5):
    return np.eye(classes, dtype=np.float32)[steps][np.newaxis]  # [1, steps, classes]


def test_ctc_greedy_decoding_merges_repeats_and_drops_blanks():
    ctc = CTC(["a", "b", " ", "c"], blank=0)
    assert ctc.decode(one_hot([1, 1, 0, 1, 2, 2, 3, 0, 4])) == "aab c"
    batch = np.stack([one_hot([1, 2, 0]), one_hot([4, 4, 4])])
    scores = ctc(batch, batch, ["ab", "cat"])
    assert scores.tolist() == [1.0, pytest.approx(1 - 2 / 3)]
    assert char_accuracy("", "") == 1.0 and char_accuracy("kitten", "sitting") == pytest.approx(1 - 3 / 7)
    assert ctc.extras(batch, batch, ["ab", "c"])["exact_match"].tolist() == [1.0, 1.0]
    assert ctc(batch, batch, None).tolist() == [1.0, 1.0]  # no labels: the reference's text
    with pytest.raises(MetricError, match="6 classes but the charset has 4 symbols"):
        ctc.decode_batch(np.zeros((1, 1, 3, 6)))


def test_ctc_strips_surrounding_spaces_by_default_and_can_fold_case():
    """PaddleOCR's recognizer emits a leading space on some lines and its post-processing
    strips it: so does metric=ctc unless metric.strip=false; metric.casefold=true compares
    case-insensitively."""
    symbols = ["a", "b", " ", "C"]
    batch = np.stack([one_hot([3, 1, 2, 0]), one_hot([4, 1, 0, 0])])  # " ab", "Ca"
    labels = ["ab ", "ca"]
    assert CTC(symbols).decode_batch(batch) == ["ab", "Ca"]
    assert CTC(symbols)(batch, batch, labels).tolist() == [1.0, 0.5]
    assert CTC(symbols, strip=False)(batch, batch, labels).tolist() == [pytest.approx(1 / 3), 0.5]
    assert CTC(symbols, casefold=True)(batch, batch, labels).tolist() == [1.0, 1.0]
    assert CTC(symbols, casefold=True).extras(batch, batch, labels)["exact_match"].tolist() == [1.0, 1.0]
    assert CTC(symbols, ignore_space=True)(one_hot([1, 3, 2])[np.newaxis], None, ["a b "]).tolist() == [1.0]
    metric = load_metric({"_target_": "pipeline.task_metrics.CTC", "charset": symbols, "strip": False})
    assert metric.score.strip is False


def test_ctc_decodes_as_paddleocr_does():
    """parity's decoding against rapidocr's port of PaddleOCR's CTCLabelDecode (its output
    stripped) on the recognizer's own charset: the same texts, hence the same accuracy."""
    from rapidocr_onnxruntime.ch_ppocr_rec.utils import CTCLabelDecode

    metadata = {p.key: p.value for p in onnx.load(str(REC), load_external_data=False).metadata_props}
    characters = metadata["character"].splitlines()
    paddle = CTCLabelDecode(character=list(characters))
    ours = CTC([*characters, " "])
    rng = np.random.default_rng(5)
    space = len(characters) + 1  # PaddleOCR appends the space after the charset
    steps = rng.integers(0, 40, size=(32, 40))
    steps[:, :3] = space  # leading spaces, as the recognizer emits on some lines
    scores = np.eye(len(characters) + 2, dtype=np.float32)[steps]
    theirs = [text.strip() for text, _ in paddle(scores)]
    assert ours.decode_batch(scores) == theirs


def test_ctc_charset_file_keeps_a_space_line(tmp_path):
    charset = tmp_path / "keys.txt"
    charset.write_text("a\nb\n \n", encoding="utf-8")
    assert CTC(str(charset)).symbols == ["a", "b", " "]
    with pytest.raises(MetricError, match="cannot be read"):
        CTC(str(tmp_path / "missing.txt"))


def test_map_iou_and_regression():
    out = np.zeros((2, 1, 4, 4), dtype=np.float32)
    ref = np.zeros_like(out)
    out[0, 0, :2] = 0.9
    ref[0, 0, :1] = 0.9
    assert MapIoU(0.3)(out, ref, None).tolist() == [0.5, 1.0]  # 4 of 8 pixels; both empty: 1
    values = np.array([[1.0], [3.0]])
    assert Regression("mae")(values, values, ["2", 2]).tolist() == [1.0, 1.0]
    rmse = Regression("rmse")
    assert rmse.aggregate(rmse(values, values, [1, 5])) == pytest.approx(np.sqrt(2))
    with pytest.raises(MetricError, match="allowed: mae, rmse"):
        Regression("mape")


def test_map_iou_per_page_or_pooled():
    """Per page, a small page's miss counts as much as a large page's hit; pooled, pages
    weigh by their area (all intersections over all unions). The scorer aggregates, and
    bootstraps, either way."""
    out = np.zeros((2, 1, 10, 10), dtype=np.float32)
    ref = np.zeros_like(out)
    ref[0, 0, :, :] = 0.9  # a full page, found
    out[0, 0, :, :] = 0.9
    ref[1, 0, 0, :2] = 0.9  # two pixels, missed
    per_page, pooled = MapIoU(0.3), MapIoU(0.3, pooled=True)
    assert per_page(out, ref, None).tolist() == [1.0, 0.0] and per_page.weights(out, ref, None) is None
    assert pooled.weights(out, ref, None).tolist() == [100.0, 2.0]
    for metric, expected in ((per_page, 0.5), (pooled, 100 / 102)):
        scorer = TaskScorer(load_metric({"_target_": "pipeline.task_metrics.MapIoU", "pooled": metric.pooled}), "y")
        for index in range(2):
            scorer.add("reference", ref[index], ref[index], None)
            scorer.add("build", out[index], ref[index], None)
        scorer.finish()
        task = scorer.result("build", 1.0)
        assert task["target"] == pytest.approx(expected) and task["reference"] == 1.0
        assert task["interval"][0] <= task["drop"] <= task["interval"][1]


def test_a_lower_is_better_metric_drops_when_it_rises():
    scorer = TaskScorer(load_metric({"_target_": "pipeline.task_metrics.Regression"}), "y")
    for label, value in ((1.0, 1.5), (2.0, 2.0)):
        scorer.active(label)
        scorer.add("reference", np.array([label]), np.array([label]), label)
        scorer.add("int8", np.array([value]), np.array([label]), label)
    scorer.finish()
    task = scorer.result("int8", max_drop=0.1)
    assert (task["reference"], task["target"], task["drop"], task["passed"]) == (0.0, 0.25, 0.25, False)
    assert "regression rose by 0.25" in task["reason"]


# --- a custom metric from a file outside the package --------------------------------------------

CUSTOM = '''
import numpy as np

LOADS = []


def confidence(outputs, reference, labels, floor=0.0):
    """Top score of each sample, at least floor."""
    return np.maximum(outputs.reshape(len(outputs), -1).max(axis=1), floor)


confidence.higher_is_better = False  # declared on the function, kept when its keys are bound


class Distance:
    higher_is_better = False

    def __init__(self, scale=1.0):
        LOADS.append(scale)
        self.scale = scale

    def __call__(self, outputs, reference, labels):
        return self.scale * np.abs(outputs - reference).reshape(len(outputs), -1).mean(axis=1)


def raises(outputs, reference, labels):
    raise ValueError("the user's bug")


def wrong_shape(outputs, reference, labels):
    return np.zeros((len(outputs), 2))


def nan(outputs, reference, labels):
    return np.full(len(outputs), np.nan)
'''


@pytest.fixture(scope="module")
def custom_metrics(tmp_path_factory):
    folder = tmp_path_factory.mktemp("user_code")
    (folder / "usermetrics.py").write_text(CUSTOM)
    return folder


def test_custom_function_and_class_load_through_hydra(custom_metrics):
    function = load_metric({"_target_": "usermetrics.confidence", "path": str(custom_metrics), "floor": 0.5})
    assert function.name == "confidence" and not function.higher_is_better
    assert function(np.array([[0.2, 0.1], [0.9, 0.3]]), None, None).tolist() == [0.5, 0.9]
    distance = load_metric({"_target_": "usermetrics.Distance", "path": str(custom_metrics), "scale": 2.0,
                            "output": "y"})
    assert (distance.output, distance.higher_is_better) == ("y", False)
    assert distance(np.ones((3, 1)), np.zeros((3, 1)), None).tolist() == [2.0, 2.0, 2.0]


def test_loading_a_custom_metric_loads_no_model(custom_metrics):
    """What instantiating costs: the user's module and numpy, not a runtime or a model."""
    code = (f"import sys; from pipeline.task_metrics import load_metric; "
            f"load_metric({{'_target_': 'usermetrics.Distance', 'path': {str(custom_metrics)!r}}}); "
            "print(sorted(m for m in ('onnxruntime', 'openvino', 'ncnn', 'MNN', 'onnx') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


@pytest.mark.parametrize("target, message", [
    ("usermetrics.raises", "metric raises raised ValueError: the user's bug"),
    ("usermetrics.wrong_shape", "metric wrong_shape: returned scores of shape (2, 2) for a batch of 2 samples"),
    ("usermetrics.nan", "metric nan: returned nan for sample 0 of the batch"),
])
def test_a_broken_metric_is_one_line_naming_it(custom_metrics, target, message):
    metric = load_metric({"_target_": target, "path": str(custom_metrics)})
    with pytest.raises(MetricError, match=message.replace("(", r"\(").replace(")", r"\)")):
        metric(np.zeros((2, 3)), np.zeros((2, 3)), None)


def test_a_metric_that_cannot_be_imported_is_a_config_error():
    with pytest.raises(MetricError, match="cannot import 'nowhere.metric'.*metric.path"):
        load_metric({"_target_": "nowhere.metric"})
    with pytest.raises(MetricError, match="unexpected keyword argument 'treshold'"):
        load_metric({"_target_": "pipeline.task_metrics.MapIoU", "treshold": 0.5})


@pytest.fixture(scope="module")
def cli_jobs(request, custom_metrics, tmp_path_factory):
    """The module's `parity` jobs, each in its own folder, submitted up front (when the
    first test needs one) and run side by side; the tests read their results."""
    jobs = Jobs()
    if selected(request, "test_custom_metric_on_the_cli"):
        jobs.submit("custom", functools.partial(custom_metric_runs, custom_metrics, tmp_path_factory.mktemp("custom")))
    ocr_jobs = {"rec": (recognizer_run, "test_recognizer_with_ctc_text_labels_and_the_bundle_reads_a_png"),
                "det": (detector_runs, "test_detector_int8_gated_on_map_iou"),
                "cls": (classifier_run, "test_classifier_bundle_runs_a_png_and_rejects_bad_inputs")}
    for name, (job, test) in ocr_jobs.items():
        if not NEEDS_FONTS_SKIPPED and selected(request, test):
            try:
                ocr = request.getfixturevalue("ocr")
            except Exception:  # noqa: BLE001 - the OCR tests meet the error in their own setup; the others run
                break
            jobs.submit(name, functools.partial(job, ocr))
    if selected(request, "test_custom_preprocess_reads_text_files_in_verify_and_in_the_bundle"):
        jobs.submit("preprocess", functools.partial(custom_preprocess_run, tmp_path_factory.mktemp("preprocess")))
    if selected(request, "test_the_mixed_search_keeps_ops_float_for_the_task_metric"):
        jobs.submit("search", functools.partial(mixed_search_runs, custom_metrics, tmp_path_factory.mktemp("search")))
    yield jobs
    jobs.close()


def custom_metric_runs(custom_metrics, cwd):
    """The digits job judged by the user's Distance ((completed process, run folder)), with
    a metric that raises and one that returns NaN ({name: completed process}), and with a
    metric that cannot be imported (completed process)."""
    verified = [stages("convert", "build", "verify")]
    distance = new_run(["precision=fp32", "metric=custom", "metric._target_=usermetrics.Distance",
                        f"metric.path={custom_metrics}", "+metric.scale=10", "validation.max_metric_drop=0.01",
                        *verified], cwd, env=SIDE_BY_SIDE_ENV)
    broken = {target: run_cli(["precision=fp32", "metric=custom", f"metric._target_=usermetrics.{target}",
                               f"metric.path={custom_metrics}", *verified], cwd, env=SIDE_BY_SIDE_ENV)
              for target in ("raises", "nan")}
    missing = run_cli(["metric=custom", "metric._target_=usermetrics.missing", f"metric.path={custom_metrics}"], cwd,
                      env=SIDE_BY_SIDE_ENV)
    return distance, broken, missing


def test_custom_metric_on_the_cli(cli_jobs):
    """The digits job judged by a user's metric (a class outside the package, lower is
    better), shown in the report; then a metric that raises: exit 2, one line, no traceback."""
    (result, run_dir), broken, missing = cli_jobs["custom"]
    assert result.returncode == 0, result.stdout + result.stderr
    task = read_report(run_dir)["verify"]["task"]
    assert (task["metric"], task["higher_is_better"], task["labeled"]) == ("Distance", False, True)
    assert task["reference"] == 0.0 and task["target"] < 1e-3 and task["passed"]
    for target, message in (("raises", "metric raises raised ValueError: the user's bug"),
                            ("nan", "metric nan: returned nan for sample 0")):
        result = broken[target]
        assert result.returncode == 2, result.stdout + result.stderr
        assert message in result.stderr and "Traceback" not in result.stderr + result.stdout
    result = missing
    assert result.returncode == 2 and "cannot import 'usermetrics.missing'" in result.stderr, result.stderr


# --- real models: the PP-OCRv4 recognizer and detector ----------------------------------------------

def write_lines(folder, lines, start=0):
    """One PNG per text line, labels.csv 'sample,text'."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = ["sample,label"]
    for index, text in enumerate(lines):
        name = f"{index:03d}.png"
        render(text, 28 + (index + start) % 6, FONTS[(index + start) % 2]).save(folder / name)
        rows.append(f"{name},{text}")
    (folder / "labels.csv").write_text("\n".join(rows) + "\n", encoding="utf-8")


@pytest.fixture(scope="module")
def ocr(tmp_path_factory):
    """A user config directory for the recognizer, the detector and the classifier, with
    rendered text lines (labels: the texts) and the recognizer's charset file, written
    from the model's own metadata (PaddleOCR's 'character' list, then the space)."""
    root = tmp_path_factory.mktemp("ocr")
    write_lines(root / "lines" / "calibration", LINES[:4], start=3)
    write_lines(root / "lines" / "validation", LINES)
    metadata = {p.key: p.value for p in onnx.load(str(REC), load_external_data=False).metadata_props}
    (root / "charset.txt").write_text(metadata["character"] + "\n \n", encoding="utf-8")
    conf = root / "conf"
    for group in ("model", "data"):
        (conf / group).mkdir(parents=True)
    (conf / "model" / "rec.yaml").write_text(f"path: {REC}\nname: rec\ninput_shapes:\n  x: [1, 3, 48, 320]\n")
    (conf / "model" / "det.yaml").write_text(f"path: {DET}\nname: det\ninput_shapes:\n  x: [1, 3, 64, 64]\n")
    (conf / "model" / "cls.yaml").write_text(f"path: {CLS}\nname: cls\ninput_shapes:\n  x: [1, 3, 48, 192]\n")
    (conf / "data" / "lines.yaml").write_text(
        f"kind: images\npath: {root / 'lines'}\n"
        "preprocess:\n  keep_aspect: true\n  color: bgr\n  mean: [0.5]\n  std: [0.5]\n")
    write_dataset(root / "rotated", calibration=4, validation=8)  # labels: 0 upright, 1 rotated
    (conf / "data" / "rotated.yaml").write_text(
        f"kind: images\npath: {root / 'rotated'}\n"
        "preprocess:\n  keep_aspect: true\n  color: bgr\n  mean: [0.5]\n  std: [0.5]\n")
    (conf / "data" / "det_lines.yaml").write_text(
        f"kind: images\npath: {root / 'lines'}\n"
        "preprocess:\n  keep_aspect: true\n  mean: [0.485, 0.456, 0.406]\n  std: [0.229, 0.224, 0.225]\n")
    return root


def run_ocr(cwd, ocr, *overrides):
    """``parity --config-dir OCR/conf OVERRIDES`` in ``cwd``: (completed process, run folder)."""
    cwd.mkdir(parents=True, exist_ok=True)
    return new_run(["--config-dir", ocr / "conf", *overrides], cwd, env=SIDE_BY_SIDE_ENV)


def recognizer_run(ocr):
    return run_ocr(ocr / "jobs" / "rec", ocr, "model=rec", "data=lines", "precision=fp32", "metric=ctc",
                   f"metric.charset={ocr / 'charset.txt'}", "validation.min_cosine=null",
                   "pipeline.stages=[convert,calibrate,build,verify,package]")


@needs_fonts
def test_recognizer_with_ctc_text_labels_and_the_bundle_reads_a_png(ocr, cli_jobs):
    result, run_dir = cli_jobs["rec"]
    assert result.returncode == 0, result.stdout + result.stderr
    report = read_report(run_dir)
    task = report["verify"]["task"]
    assert (task["metric"], task["labeled"], task["samples"]) == ("ctc", True, len(LINES))
    assert task["reference"] > 0.9 and task["extras"]["exact_match"]["reference"] >= 0.75, task
    assert task["drop"] == pytest.approx(0.0, abs=1e-9) and task["agreement"] == 1.0
    assert report["verify"]["outputs"][0]["thresholds"]["min_cosine"] is None  # gated on the task metric
    assert "ctc: reference" in result.stdout
    assert report["data"]["splits"]["validation"]["used"] == f"used {len(LINES)} of {len(LINES)}"
    bundle = single_bundle(run_dir)
    assert (bundle / "charset.txt").is_file()
    render("deploy model", 30, FONTS[0]).save(ocr / "page.png")
    ran = run_cli(["run", bundle, ocr / "page.png", "--output", ocr / "out.npz"], ocr, program="parity-bundle")
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "decoded softmax_11.tmp_0 (ctc): deploy model" in ran.stdout
    with np.load(ocr / "out.npz") as saved:
        assert saved["softmax_11.tmp_0"].shape == (1, 40, 6625)


def detector_runs(ocr):
    """The detector at int8, then at fp32 with an impossible gate (one folder: one convert)."""
    common = ["model=det", "data=det_lines", "metric=map_iou", "validation.min_cosine=null",
              "validation.layerwise=off", "pipeline.stages=[convert,calibrate,build,verify]"]
    cwd = ocr / "jobs" / "det"
    # not what this tests: int8's build refinements, which parity measures on these 4 calibration
    # lines and keeps neither of
    refinements = ["precision.weight_rounding=false", "precision.bias_correction=false"]
    return (run_ocr(cwd, ocr, *common, "precision=int8", "calibration=max", "validation.max_metric_drop=0.5",
                    *refinements),
            run_ocr(cwd, ocr, *common, "precision=fp32", "validation.max_metric_drop=-0.01"))  # an impossible gate


@needs_fonts
def test_detector_int8_gated_on_map_iou(cli_jobs):
    """int8 on the detector, judged by the IoU of its binarized map with the reference's:
    with validation.min_cosine=null the task metric alone decides."""
    (result, run_dir), impossible = cli_jobs["det"]
    assert result.returncode == 0, result.stdout + result.stderr
    verify = read_report(run_dir)["verify"]
    task = verify["task"]
    assert (task["metric"], task["labeled"], task["reference"]) == ("map_iou", True, 1.0)
    assert 0.5 < task["target"] <= 1.0 and task["agreement"] is None
    assert verify["comparison"]["fp32"]["task_metric"] > task["target"] - 0.01  # the side-by-side table has it
    result, run_dir = impossible
    assert result.returncode == 3, result.stdout + result.stderr
    assert "task metric map_iou dropped" in result.stdout


def classifier_run(ocr):
    return run_ocr(ocr / "jobs" / "cls", ocr, "model=cls", "data=rotated", "precision=fp32",
                   "pipeline.stages=[convert,calibrate,build,verify,package]")


@needs_fonts
def test_classifier_bundle_runs_a_png_and_rejects_bad_inputs(ocr, cli_jobs):
    result, run_dir = cli_jobs["cls"]
    assert result.returncode == 0, result.stdout + result.stderr
    assert read_report(run_dir)["verify"]["task"]["metric"] == "top1"
    bundle = single_bundle(run_dir)
    page = ocr / "rotated" / "validation" / "000.png"  # upright
    ran = run_cli(["run", bundle, page], ocr, program="parity-bundle")
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "(top1): class 0" in ran.stdout
    (ocr / "page.npy").write_bytes(page.read_bytes())  # a PNG under a NumPy name
    (ocr / "notes.txt").write_text("hello")
    for given, message in ((ocr / "page.npy", "is not a NumPy .npy file"),
                           (ocr / "notes.txt", "unsupported file type '.txt'"),
                           (ocr / "missing.png", "does not exist"), (ocr, "is not a file")):
        ran = run_cli(["run", bundle, given], ocr, program="parity-bundle")
        assert ran.returncode == 2, (given, ran.stdout + ran.stderr)
        assert message in ran.stderr and len(ran.stderr.strip().splitlines()) == 1, ran.stderr
    ran = run_cli(["run", bundle, page, "--output", ocr], ocr, program="parity-bundle")
    assert ran.returncode == 2 and "is a folder; give a file name" in ran.stderr, ran.stderr


# --- data sizes follow the data ----------------------------------------------------------------

def test_sizes_default_to_every_sample_up_to_the_cap(tmp_path):
    spec = TensorSpec("x", [1, 2], "float32")
    for split in ("calibration", "validation"):
        (tmp_path / split).mkdir()
        for index in range(5):
            np.save(tmp_path / split / f"{index}.npy", np.full((1, 2), index, dtype=np.float32))
    data = open_dataset(DataConfig(kind=DataKind.tensors, path=str(tmp_path), validation_cap=3), [spec])
    assert (len(data.calibration), len(data.validation)) == (5, 3)
    assert data.summary()["splits"]["validation"]["used"] == "used 3 of 5"
    assert any("used 3 of 5 samples (data.validation_cap)" in w for w in data.warnings)
    sized = open_dataset(DataConfig(kind=DataKind.tensors, path=str(tmp_path), validation_size=8), [spec])
    assert len(sized.validation) == 5 and "validation: 5 samples found, 8 requested" in sized.warnings


# --- a custom preprocess: any file, read by the user's function, everywhere -----------------------

READER = '''
import numpy as np


def read_digit(path):
    """An 8x8 digit written as 64 numbers in a text file: the model's input."""
    values = np.loadtxt(path, dtype=np.float32)
    if values.size != 64:
        raise ValueError(f"expected 64 numbers, got {values.size}")
    return values.reshape(1, 1, 8, 8)
'''


def digit_texts():
    from pipeline.config.resolvers import asset_path

    with np.load(asset_path("digits.npz")) as digits:
        return digits["validation/input"][:12], digits["validation/labels"][:12]


def custom_preprocess_run(tmp_path):
    """The digits as text files in tmp_path/data, read by the user's digitreader.read_digit
    in tmp_path/code: (completed process, run folder, tmp_path)."""
    images, labels = digit_texts()
    for split, rows in (("calibration", range(4)), ("validation", range(12))):
        (tmp_path / "data" / split).mkdir(parents=True)
        for index in rows:
            np.savetxt(tmp_path / "data" / split / f"{index:02d}.txt", images[index].reshape(8, 8))
        (tmp_path / "data" / split / "labels.csv").write_text(
            "sample,label\n" + "".join(f"{index:02d}.txt,{labels[index]}\n" for index in rows))
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "digitreader.py").write_text(READER)
    result, run_dir = new_run(["precision=fp32", "data.kind=custom", f"data.path={tmp_path / 'data'}",
                               "data.preprocess._target_=digitreader.read_digit",
                               f"data.preprocess.path={tmp_path / 'code'}",
                               stages("convert", "build", "verify", "package")],
                              tmp_path, env=SIDE_BY_SIDE_ENV)
    return result, run_dir, tmp_path


def test_custom_preprocess_reads_text_files_in_verify_and_in_the_bundle(cli_jobs, tmp_path):
    _, labels = digit_texts()
    result, run_dir, folder = cli_jobs["preprocess"]
    assert result.returncode == 0, result.stdout + result.stderr
    report = read_report(run_dir)
    assert report["verify"]["task"]["samples"] == 12 and report["verify"]["task"]["reference"] > 0.9
    assert report["data"]["splits"]["calibration"]["used"] == "used 4 of 4"
    bundle = single_bundle(run_dir)
    ran = run_cli(["run", bundle, folder / "data" / "validation" / "03.txt"], tmp_path, program="parity-bundle")
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert f"(top1): class {labels[3]}" in ran.stdout
    (tmp_path / "short.txt").write_text("1 2 3")
    ran = run_cli(["run", bundle, tmp_path / "short.txt"], tmp_path, program="parity-bundle")
    assert ran.returncode == 2 and "preprocess digitreader.read_digit raised ValueError" in ran.stderr, ran.stderr
    assert len(ran.stderr.strip().splitlines()) == 1


def mixed_search_runs(custom_metrics, cwd):
    """The search with no task metric, then with the user's Distance (one folder: one
    calibration): ((completed process, run folder), the same)."""
    search = ["precision=mixed", "sensitivity.expected_cos=0.5", "sensitivity.heads_first=false", "validation.min_cosine=null",
              "validation.max_metric_drop=1", "pipeline.stages=[convert,calibrate,sensitivity]"]
    return (new_run([*search, "metric=none"], cwd, env=SIDE_BY_SIDE_ENV),
            new_run([*search, "metric=custom", "metric._target_=usermetrics.Distance", f"metric.path={custom_metrics}",
                     "sensitivity.max_drop=1e-7"], cwd, env=SIDE_BY_SIDE_ENV))


def test_the_mixed_search_keeps_ops_float_for_the_task_metric(cli_jobs):
    """sensitivity.select=target with a cosine target plain int8 meets: with no task
    metric nothing stays float; with a metric whose drop int8 exceeds, ops do."""
    (result, run_dir), (with_metric, metric_run_dir) = cli_jobs["search"]
    assert result.returncode == 0, result.stdout + result.stderr
    plain = read_report(run_dir)["sensitivity"]
    assert plain["skipped"] and plain["int8"]["metric_drop"] is None
    result = with_metric
    assert result.returncode == 0, result.stdout + result.stderr
    mixed = read_report(metric_run_dir)["sensitivity"]
    assert mixed["int8"]["metric_drop"] > 1e-7 and "skipped" not in mixed
    assert mixed["float_ops"] and mixed["curve"][0]["metric_drop"] is not None


def test_report_shows_the_configured_metric_in_the_side_by_side_table():
    from pipeline.report import render_markdown

    task = {"metric": "ctc", "output": "y", "samples": 3, "reference": 0.99, "target": 0.98, "drop": 0.01,
            "agreement": 0.9, "max_drop": 0.02, "passed": True, "extras": {"exact_match": {"reference": 0.9,
                                                                                          "target": 0.8}}}
    comparison = {"fp32": {"cosine": 1.0, "task_metric": 0.99, "top1": None, "bytes": 2048},
                  "int8": {"cosine": 0.98, "task_metric": 0.98, "top1": None, "bytes": 1024}}
    md = render_markdown({"verdict": "pass", "verify": {"samples": 3, "outputs": [], "task": task,
                                                        "comparison": comparison}})
    assert "| build | cosine | ctc |" in md
    assert "| INT8 | 0.980000 | 0.9800 |" in md and "exact_match: reference 0.9000, target 0.8000" in md
