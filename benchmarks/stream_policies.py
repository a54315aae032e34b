"""What keeps int8's gain on a stream of shapes: fp32 vs int8 builds of all-MiniLM-L6-v2,
interleaved rounds, each round one pass over N sentences, under several serving policies
(natural lengths; padded with 0 ids and mask to a multiple of 8, 16, 32; one shape; on
OpenVINO also CPU_RUNTIME_CACHE_CAPACITY=0). A scratch probe kept for the record
(docs/targets.md, "Transformers"): it reads per-sample .npz sentences from
/tmp/minilm/npz/validation and the fp32 export /tmp/minilm/minilm.onnx (benchmarks/
transformers.py makes both kinds of file).

    python benchmarks/stream_policies.py N ROUNDS ort|ov '{"int8": "path/model.onnx"}'
"""
import glob, json, sys, time
import numpy as np

N = int(sys.argv[1]) if len(sys.argv) > 1 else 200
ROUNDS = int(sys.argv[2]) if len(sys.argv) > 2 else 7
files = sorted(glob.glob("/tmp/minilm/npz/validation/*.npz"))[:N]
natural = [{k: v for k, v in np.load(f).items()} for f in files]

def padded(sample, multiple):
    n = sample["input_ids"].shape[1]
    m = -(-n // multiple) * multiple
    return {k: np.pad(v, ((0, 0), (0, m - n))) for k, v in sample.items()}

def fixed(sample, length=32):
    return {k: np.resize(v, (1, length)) for k, v in sample.items()}

def ort_session(path, threads=0):
    import onnxruntime as ort
    o = ort.SessionOptions(); o.intra_op_num_threads = threads
    s = ort.InferenceSession(path, o, providers=["CPUExecutionProvider"])
    return lambda feeds: s.run(["sentence_embedding"], feeds)

def ov_session(path, config=None):
    import openvino as ov
    core = ov.Core()
    c = core.compile_model(core.read_model(path), "CPU", {"INFERENCE_PRECISION_HINT": "f32", **(config or {})})
    r = c.create_infer_request()
    return lambda feeds: r.infer(feeds)

def timed(runs, stream):
    order = list(runs); per = {k: [] for k in order}
    for k in order:
        for f in stream: runs[k](f)
    for i in range(ROUNDS):
        sh = i % len(order)
        for k in order[sh:] + order[:sh]:
            t = time.perf_counter()
            for f in stream: runs[k](f)
            per[k].append((time.perf_counter() - t) * 1000 / len(stream))
    return per

def report(label, per, base="fp32"):
    out = {}
    for k, v in per.items():
        if k == base: continue
        r = [b / t for b, t in zip(per[base], v)]
        out[k] = [float(x) for x in np.percentile(r, [50, 25, 75])]
    print(label, "fp32 %.3f ms" % np.median(per[base]), {k: "%.2fx (%.2f-%.2f)" % tuple(v) for k, v in out.items()}, flush=True)
    return out

if __name__ == "__main__":
    which = sys.argv[3]
    fp32 = "/tmp/minilm/minilm.onnx"
    models = json.loads(sys.argv[4])  # {name: path}
    streams = {"natural": natural, "pad8": [padded(s, 8) for s in natural], "pad16": [padded(s, 16) for s in natural],
               "pad32": [padded(s, 32) for s in natural], "one shape 1x32": [fixed(s) for s in natural]}
    print("lengths: distinct natural", len({s["input_ids"].shape for s in natural}), "pad8", len({s["input_ids"].shape for s in streams["pad8"]}), "pad16", len({s["input_ids"].shape for s in streams["pad16"]}))
    if which == "ort":
        runs = {"fp32": ort_session(fp32), **{k: ort_session(p) for k, p in models.items()}}
    else:
        cap = {"CPU_RUNTIME_CACHE_CAPACITY": 0}
        runs = {"fp32": ov_session(fp32), **{k: ov_session(p) for k, p in models.items()},
                **{k + " cache0": ov_session(p, cap) for k, p in models.items()}, "fp32 cache0": ov_session(fp32, cap)}
    for label, stream in streams.items():
        report(f"{which} {label}", timed(runs, stream))
