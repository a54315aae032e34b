"""Train the small default digits CNN and write the embedded assets.

Trains a tiny CNN on scikit-learn's bundled 8x8 digits dataset (no download)
and writes, into ``--out`` (default: ``pipeline/assets`` at the repo root):

* ``digits_cnn.onnx`` -- input ``input`` float32 [1, 1, 8, 8] (pixels / 16),
  output ``logits`` float32 [1, 10]; opset 17, IR version 8.  The graph is
  written by hand with ``onnx.helper`` from the trained weights.
* ``digits.npz`` -- ``calibration/input`` (64 training samples),
  ``validation/input`` and ``validation/labels`` (200 held-out samples).

The script is deterministic (fixed seeds, single thread) and finishes by
checking with onnxruntime that the ONNX model matches the torch model.

Run:  pip install torch scikit-learn  (trained here with torch 2.14.1) && python scripts/train_digits.py
"""
import argparse
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

SEED = 0
N_VAL = 200
N_CALIB = 64
DEFAULT_OUT = Path(__file__).resolve().parent.parent / "pipeline" / "assets"
# Wide enough that int8 is measurably faster than fp32 on ONNX Runtime's CPU kernels with
# AVX2 alone (issue 46: 8/16/32 ran int8 at 0.65x, 32/64/256 at 1.1-1.6x, 32/128/256 at 1.6-2.2x
# with random weights, 2 loaded cores) and still about 2 MB in the package. conv3 (128 -> 128)
# quadruples the work of a call (0.04-0.06 ms -> 0.14 ms as an AVX2 CPU): with less, the gain of
# int8 moved by 1.26-1.44x from one timing to the next (issue 57, docs/benchmarks.md).
CONV1, CONV2, CONV3, HIDDEN = 32, 128, 128, 256


def load_split():
    """Fixed stratified split of the digits data, scaled to [0, 1], NCHW."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = (digits.images / 16.0).astype(np.float32)[:, None, :, :]
    y = digits.target.astype(np.int64)
    return train_test_split(x, y, test_size=N_VAL, random_state=SEED, stratify=y)


def build_onnx(w):
    """ONNX graph for the CNN from a dict of numpy weights (onnx + numpy only)."""
    inits = [numpy_helper.from_array(np.ascontiguousarray(v, dtype=np.float32), k)
             for k, v in sorted(w.items())]
    conv = dict(kernel_shape=[3, 3], pads=[1, 1, 1, 1], strides=[1, 1])
    nodes = [
        helper.make_node("Conv", ["input", "conv1.weight", "conv1.bias"], ["conv1_out"], name="conv1", **conv),
        helper.make_node("Relu", ["conv1_out"], ["relu1_out"], name="relu1"),
        helper.make_node("Conv", ["relu1_out", "conv2.weight", "conv2.bias"], ["conv2_out"], name="conv2", **conv),
        helper.make_node("Relu", ["conv2_out"], ["relu2_out"], name="relu2"),
        helper.make_node("Conv", ["relu2_out", "conv3.weight", "conv3.bias"], ["conv3_out"], name="conv3", **conv),
        helper.make_node("Relu", ["conv3_out"], ["relu3_out"], name="relu3"),
        helper.make_node("MaxPool", ["relu3_out"], ["pool1_out"], name="pool1",
                         kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Flatten", ["pool1_out"], ["flatten_out"], name="flatten", axis=1),
        helper.make_node("Gemm", ["flatten_out", "fc1.weight", "fc1.bias"], ["fc1_out"], name="fc1", transB=1),
        helper.make_node("Relu", ["fc1_out"], ["relu4_out"], name="relu4"),
        helper.make_node("Gemm", ["relu4_out", "fc2.weight", "fc2.bias"], ["logits"], name="fc2", transB=1),
    ]
    graph = helper.make_graph(
        nodes, "digits_cnn",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, 1, 8, 8])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 10])],
        initializer=inits,
    )
    model = helper.make_model(graph, producer_name="parity-train-digits",
                              opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8  # onnxruntime here rejects the onnx.helper default
    model = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    onnx.checker.check_model(model, full_check=True)
    return model


def train(x_tr, y_tr, epochs=40, batch=32, lr=3e-3):
    import torch
    from torch import nn

    torch.manual_seed(SEED)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    net = nn.Sequential(
        nn.Conv2d(1, CONV1, 3, padding=1), nn.ReLU(),
        nn.Conv2d(CONV1, CONV2, 3, padding=1), nn.ReLU(),
        nn.Conv2d(CONV2, CONV3, 3, padding=1), nn.ReLU(),
        nn.MaxPool2d(2), nn.Flatten(),
        nn.Linear(CONV3 * 4 * 4, HIDDEN), nn.ReLU(),
        nn.Linear(HIDDEN, 10),
    )
    opt = torch.optim.Adam(net.parameters(), lr=lr)
    loss_fn = nn.CrossEntropyLoss()
    xt, yt = torch.from_numpy(x_tr), torch.from_numpy(y_tr)
    gen = torch.Generator().manual_seed(SEED)
    net.train()
    for _ in range(epochs):
        for idx in torch.randperm(len(xt), generator=gen).split(batch):
            opt.zero_grad()
            loss_fn(net(xt[idx]), yt[idx]).backward()
            opt.step()
    net.eval()
    names = ["conv1", "conv2", "conv3", "fc1", "fc2"]
    layers = [m for m in net if isinstance(m, (nn.Conv2d, nn.Linear))]
    weights = {}
    for name, layer in zip(names, layers):
        weights[f"{name}.weight"] = layer.weight.detach().numpy().copy()
        weights[f"{name}.bias"] = layer.bias.detach().numpy().copy()

    def predict(x):
        with torch.no_grad():
            return net(torch.from_numpy(x)).numpy()

    return weights, predict


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory")
    args = ap.parse_args()

    x_tr, x_val, y_tr, y_val = load_split()
    t0 = time.perf_counter()
    weights, predict = train(x_tr, y_tr)
    print(f"train time: {time.perf_counter() - t0:.1f} s")
    train_acc = (predict(x_tr).argmax(1) == y_tr).mean()
    val_logits = predict(x_val)
    val_acc = (val_logits.argmax(1) == y_val).mean()
    print(f"train accuracy: {train_acc:.4f} ({len(y_tr)} samples)")
    print(f"val accuracy:   {val_acc:.4f} ({len(y_val)} samples)")
    if val_acc < 0.95:
        raise SystemExit(f"FAIL: validation accuracy {val_acc:.4f} < 0.95")

    args.out.mkdir(parents=True, exist_ok=True)
    onnx_path, npz_path = args.out / "digits_cnn.onnx", args.out / "digits.npz"
    onnx.save(build_onnx(weights), onnx_path)
    np.savez_compressed(npz_path, **{
        "calibration/input": x_tr[:N_CALIB],
        "validation/input": x_val,
        "validation/labels": y_val,
    })
    print(f"wrote {onnx_path} ({onnx_path.stat().st_size} bytes)")
    print(f"wrote {npz_path} ({npz_path.stat().st_size} bytes)")

    import onnxruntime as ort

    sess = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    ort_logits = np.concatenate([sess.run(["logits"], {"input": x_val[i:i + 1]})[0]
                                 for i in range(len(x_val))])
    diff = float(np.abs(ort_logits - val_logits).max())
    print(f"onnxruntime vs torch: max abs logit diff {diff:.2e}")
    if not diff < 1e-4 or not (ort_logits.argmax(1) == val_logits.argmax(1)).all():
        raise SystemExit(f"FAIL: onnxruntime disagrees with torch (max abs diff {diff:.2e})")


if __name__ == "__main__":
    main()
