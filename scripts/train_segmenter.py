"""Train the tiny salient-object segmenter and write ``pipeline/assets/segmenter.onnx``.

Why: the tests need a real segmentation model shaped like U^2-Net-p (the family behind
rembg's u2netp), not a classifier: encoder stages of Conv3x3+BN+ReLU with ceil-mode
max pooling, a dilated bottleneck instead of more pooling (RSU-4F style), decoder
stages that resize to their skip's size at run time (Shape -> ... -> Resize in the
graph), side outputs resized to the input size, and a fused map (1x1 conv over the side
logits); every output is a sigmoid map [1, 1, 96, 96], named by number as
``torch.onnx.export`` names unnamed outputs (U^2-Net's own export has '1959').

Data: square crops of the real photos bundled in scikit-image (tests/segmenter_data.py),
labelled by a classic saliency rule (centre-surround Lab colour contrast), with flips.
Input ``input`` [1, 3, 96, 96]: RGB / 255 normalized with ImageNet mean/std.

The outlier channel, made the way real models get one: one channel of the first encoder
stage (enc1, 96x96) is dead during training; after training and batch-norm folding it
becomes a saturated folded batch norm (weights ~0, bias 228), so that activation is
~228 everywhere while its other channels stay far below. Its two consumer convs (enc2
after the pool, dec1 through the skip) keep a small nonzero weight on it, at the
kernel's centre tap only (a 1x1 consumer: no zero-padding border effect), and have
228 * that weight taken off their bias: the function is unchanged in float, but a
per-tensor int8 range of that activation is set by 228.

Deterministic (fixed seeds); about 2 minutes on 2 CPU cores. Ends by checking the ONNX
with onnxruntime: outputs vs torch, held-out IoU, the outlier activation per channel.

Run:  pip install torch==2.13.0 scikit-image && python scripts/train_segmenter.py
"""
import argparse
import copy
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import torch
import torch.nn as nn
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
import segmenter_data  # noqa: E402  (the photos the tests use)

SIZE = 96
WIDTHS = (8, 16, 32)  # channels at 96x96, 48x48, 24x24 and 12x12: thin where pixels are many
OUTLIER_CHANNEL, OUTLIER_VALUE = 5, 228.0  # enc1's channel 5 becomes ~228 everywhere
TRAIN_SEED, HELD_OUT_SEED = 10, 11  # crops disjoint in seed from the test data's (1, 2)


# --- data ------------------------------------------------------------------------

def saliency_label(rgb: np.ndarray) -> np.ndarray:
    """The rule the model learns (1 = salient): centre-surround colour contrast, the Lab
    distance between the image blurred at sigma 2 and at sigma 12, smoothed at sigma 3,
    above Otsu's threshold clipped to [10, 18] Lab units. Local enough for a tiny CNN to
    learn in 2 minutes; the clipped Otsu keeps most crops' foreground within 10-60 %."""
    from skimage import color, filters

    lab = color.rgb2lab(rgb / 255.0)
    centre, surround = filters.gaussian(lab, 2, channel_axis=-1), filters.gaussian(lab, 12, channel_axis=-1)
    contrast = filters.gaussian(np.linalg.norm(centre - surround, axis=-1), 3)
    return (contrast > np.clip(filters.threshold_otsu(contrast), 10, 18)).astype(np.float32)


def normalize(rgb: np.ndarray) -> np.ndarray:
    """uint8 HWC -> float32 NCHW, as parity's data.preprocess does with ImageNet mean/std."""
    x = (rgb.astype(np.float32) / 255.0 - np.float32(segmenter_data.MEAN)) / np.float32(segmenter_data.STD)
    return x.transpose(2, 0, 1)[None]


def dataset(count: int, seed: int):
    crops = list(segmenter_data.crops(segmenter_data.photos(), count, seed, SIZE))
    x = np.concatenate([normalize(c) for c in crops])
    y = np.stack([saliency_label(c) for c in crops])[:, None]
    return torch.from_numpy(x), torch.from_numpy(y)


# --- model -----------------------------------------------------------------------

def cbr(cin: int, cout: int, dilation: int = 1) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=dilation, dilation=dilation, bias=False),
                         nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


def up_like(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """U^2-Net's _upsample_like: the size is read from the tensor (a run-time Resize)."""
    return F.interpolate(x, size=like.shape[2:], mode="bilinear", align_corners=False)


class TinyU2NetP(nn.Module):
    """enc1 96 -> enc2 48 -> enc3 24 -> dilated bottleneck 12 -> dec3 24 -> dec2 48 -> dec1 96;
    side maps from dec1, dec2, dec3 and the bottleneck; outputs (fused, side1..side4)."""

    def __init__(self, widths=WIDTHS):
        super().__init__()
        a, b, c = widths
        self.pool = nn.MaxPool2d(2, stride=2, ceil_mode=True)
        self.enc1, self.enc2, self.enc3 = cbr(3, a), cbr(a, b), cbr(b, c)
        self.bottleneck = nn.Sequential(cbr(c, c), cbr(c, c, 2), cbr(c, c, 4))
        self.dec3, self.dec2, self.dec1 = cbr(2 * c, c), cbr(c + b, b), cbr(b + a, a)
        self.sides = nn.ModuleList(nn.Conv2d(ch, 1, 3, padding=1) for ch in (a, b, c, c))
        self.fuse = nn.Conv2d(4, 1, 1)
        keep = torch.ones(1, a, 1, 1)
        keep[0, OUTLIER_CHANNEL] = 0
        self.register_buffer("keep", keep)  # the dead channel while training
        self.masked = True

    def forward(self, x):
        e1 = self.enc1(x)
        if self.masked:
            e1 = e1 * self.keep
        e2 = self.enc2(self.pool(e1))
        e3 = self.enc3(self.pool(e2))
        b = self.bottleneck(self.pool(e3))
        d3 = self.dec3(torch.cat([up_like(b, e3), e3], 1))
        d2 = self.dec2(torch.cat([up_like(d3, e2), e2], 1))
        d1 = self.dec1(torch.cat([up_like(d2, e1), e1], 1))
        logits = [self.sides[0](d1)] + [up_like(s(t), d1) for s, t in zip(self.sides[1:], (d2, d3, b))]
        fused = self.fuse(torch.cat(logits, 1))
        return tuple(torch.sigmoid(t) for t in [fused] + logits)


# --- training --------------------------------------------------------------------

def train(model, x, y, steps: int, batch: int = 16):
    """U^2-Net's loss: BCE on the fused map plus every side map; random h/v flips."""
    generator = torch.Generator().manual_seed(TRAIN_SEED)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1e-2, total_steps=steps)
    model.train()
    for step in range(steps):
        index = torch.randint(0, len(x), (batch,), generator=generator)
        xb, yb = x[index], y[index]
        flips = torch.rand(2, generator=generator)
        if flips[0] < 0.5:
            xb, yb = xb.flip(3), yb.flip(3)
        if flips[1] < 0.5:
            xb, yb = xb.flip(2), yb.flip(2)
        loss = sum(F.binary_cross_entropy(p, yb) for p in model(xb))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        if step % 200 == 0 or step == steps - 1:
            print(f"step {step:4d} loss {loss.item():.3f}", flush=True)


def iou(pred: np.ndarray, truth: np.ndarray) -> float:
    """Mean per-image IoU of the maps binarized at 0.5."""
    a, b = pred > 0.5, truth > 0.5
    inter, union = (a & b).sum((1, 2, 3)), (a | b).sum((1, 2, 3))
    return float(np.mean(np.where(union > 0, inter / np.maximum(union, 1), 1.0)))


# --- export: folded batch norm, the outlier channel ---------------------------------

@torch.no_grad()
def fold_batch_norms(model: nn.Module) -> None:
    """Each Conv+BN -> one Conv with bias (what an eval-mode export does), in torch, so the
    outlier edit below works on the folded weights."""
    for block in model.modules():
        if isinstance(block, nn.Sequential) and len(block) == 3 and isinstance(block[1], nn.BatchNorm2d):
            conv, bn = block[0], block[1]
            scale = bn.weight / torch.sqrt(bn.running_var + bn.eps)
            folded = nn.Conv2d(conv.in_channels, conv.out_channels, 3, padding=conv.padding,
                               dilation=conv.dilation, bias=True)
            folded.weight.copy_(conv.weight * scale[:, None, None, None])
            folded.bias.copy_(bn.bias - bn.running_mean * scale)
            block[0], block[1] = folded, nn.Identity()


@torch.no_grad()
def plant_outlier(model: TinyU2NetP) -> None:
    """enc1's dead channel -> a saturated folded BN (~228 everywhere); its consumers take
    a small centre-tap weight on it and 228 * that weight off their bias."""
    k = OUTLIER_CHANNEL
    enc1 = model.enc1[0]
    enc1.weight[k] *= 1e-4  # gamma ~ 0: the input barely moves it
    enc1.bias[k] = OUTLIER_VALUE
    rng = np.random.default_rng(TRAIN_SEED)
    skip = model.dec1[0].in_channels - enc1.out_channels  # dec1 reads cat(up(d2), e1)
    for conv, channel in ((model.enc2[0], k), (model.dec1[0], skip + k)):
        w = torch.from_numpy(rng.uniform(0.02, 0.08, conv.out_channels) * rng.choice([-1, 1], conv.out_channels))
        conv.weight[:, channel] = 0
        conv.weight[:, channel, 1, 1] = w.float()
        conv.bias -= OUTLIER_VALUE * conv.weight[:, channel].sum((1, 2))
    model.masked = False


def export(model: nn.Module, path: Path, size: int = SIZE, producer: str = "train_segmenter.py") -> str:
    """TorchScript exporter, opset 17, no output names (numbered, as U^2-Net's); IR <= 10
    for onnxruntime. Returns the fused output's name (the first output)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.onnx.export(model.eval(), torch.zeros(1, 3, size, size), str(path), input_names=["input"],
                      opset_version=17, dynamo=False)
    proto = onnx.load(str(path))
    proto.ir_version = min(proto.ir_version, 8)
    proto.producer_name = f"parity scripts/{producer}"
    onnx.checker.check_model(proto)
    onnx.save(proto, str(path))
    return proto.graph.output[0].name


# --- checks ------------------------------------------------------------------------

def check(path: Path, reference: nn.Module, x_held: torch.Tensor, y_held: torch.Tensor) -> None:
    """onnxruntime: the ONNX matches the unmodified (pre-outlier) model, its held-out IoU,
    op counts, and enc1's activation per channel on every test photo."""
    import onnxruntime as ort

    proto = onnx.load(str(path))
    ops = [n.op_type for n in proto.graph.node]
    print(f"IR {proto.ir_version}, opset {proto.opset_import[0].version}, ops:",
          {op: ops.count(op) for op in sorted(set(ops))})
    assert "BatchNormalization" not in ops
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    fused = np.concatenate([session.run(None, {"input": x[None].numpy()})[0] for x in x_held])
    with torch.no_grad():
        unmodified = reference(x_held)[0].numpy()
    print(f"outputs {[o.name for o in proto.graph.output]}, fused = '{proto.graph.output[0].name}'")
    print(f"held-out IoU vs rule: onnx {iou(fused, y_held.numpy()):.3f}; onnx vs pre-outlier model: "
          f"IoU {iou(fused, unmodified):.4f}, max |diff| {np.abs(fused - unmodified).max():.2e}; "
          f"foreground {np.mean(fused > 0.5):.2f} (per image {np.percentile((fused > 0.5).mean((1, 2, 3)), [10, 90])})")

    first_conv = next(n for n in proto.graph.node if n.op_type == "Conv" and n.input[0] == "input")
    relu = next(n for n in proto.graph.node if n.op_type == "Relu" and n.input[0] == first_conv.output[0])
    name = relu.output[0]
    probe = onnx.load(str(path))
    probe.graph.output.append(onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None))
    session = ort.InferenceSession(probe.SerializeToString(), providers=["CPUExecutionProvider"])
    images = segmenter_data.photos()
    samples = [normalize(c) for seed in (segmenter_data.CALIBRATION_SEED, segmenter_data.VALIDATION_SEED)
               for c in segmenter_data.crops(images, 32, seed, SIZE)]
    acts = np.concatenate([session.run([name], {"input": s})[0] for s in samples])
    high, low = acts.max((0, 2, 3)), acts.min((0, 2, 3))
    others = np.delete(high, OUTLIER_CHANNEL)
    print(f"enc1 activation '{name}' (Conv '{first_conv.name}' -> Relu), max per channel over "
          f"{len(samples)} test crops:\n  {np.round(high, 1).tolist()}")
    print(f"  channel {OUTLIER_CHANNEL}: min {low[OUTLIER_CHANNEL]:.3f} max {high[OUTLIER_CHANNEL]:.3f}; "
          f"other channels' max {others.max():.1f}")
    assert abs(low[OUTLIER_CHANNEL] - OUTLIER_VALUE) < 1 and abs(high[OUTLIER_CHANNEL] - OUTLIER_VALUE) < 1
    assert others.max() < 72


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=segmenter_data.MODEL)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--crops", type=int, default=1200)
    args = parser.parse_args()
    torch.manual_seed(TRAIN_SEED)
    torch.set_num_threads(2)
    start = time.perf_counter()
    x, y = dataset(args.crops, TRAIN_SEED)
    x_held, y_held = dataset(200, HELD_OUT_SEED)
    print(f"data: {len(x)} training, {len(x_held)} held-out crops, foreground {y.mean():.2f} "
          f"({time.perf_counter() - start:.0f} s)")
    model = TinyU2NetP()
    train(model, x, y, args.steps)
    print(f"trained in {time.perf_counter() - start:.0f} s (data included)")
    model.eval()
    fold_batch_norms(model)
    reference = copy.deepcopy(model)  # folded, the channel still dead: the function to keep
    plant_outlier(model)
    fused = export(model, args.out)
    print(f"trained and exported in {time.perf_counter() - start:.0f} s: {args.out} "
          f"({args.out.stat().st_size / 1024:.0f} KiB), fused output '{fused}'")
    check(args.out, reference, x_held, y_held)


if __name__ == "__main__":
    main()
