"""Train the real-size salient-object segmenter and write ``tests/assets/u2netp_320.onnx``.

Why: issue 55. The 96x96 stand-in (14 convolutions, scripts/train_segmenter.py) shows
nothing of a real segmenter's cost nor of int8's speed. This one has the U^2-Net-p
architecture (Qin et al., "U^2-Net: Going Deeper with Nested U-Structure for Salient
Object Detection", 2020; the small "p" variant: 16 middle / 64 outer channels per RSU
block): six encoder stages RSU7, RSU6, RSU5, RSU4, RSU4F, RSU4F with ceil-mode pooling
between them, five decoder stages, a side map per stage resized at run time to the
input, a 1x1 fused map: 119 convolutions, 1.1 M parameters, 7 sigmoid outputs, served at
[1, 3, 320, 320]. Written here from the paper's description.

Training is brief (fully convolutional: trained on 128x128 crops, served at 320x320) on
the real photos bundled in scikit-image, labelled by the saliency rule of
scripts/train_segmenter.py. Then batch norms are folded and the outlier channel is
planted the way scripts/train_segmenter.py does: a channel of the first RSU's first
inner conv (320x320) becomes a saturated folded batch norm (~228 everywhere); its two
consumer convs take a small centre-tap weight on it and that much off their bias, so the
float function is unchanged while a per-tensor int8 range of that activation is set by 228.

Deterministic (fixed seeds); 4-6 minutes on 2 CPU cores.

Run:  pip install torch==2.13.0 scikit-image && python scripts/train_u2netp.py
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
sys.path.insert(0, str(ROOT / "scripts"))
import segmenter_data  # noqa: E402  (the photos the tests use)
from train_segmenter import export, iou, normalize, saliency_label, up_like  # noqa: E402

SERVED, TRAINED = 320, 128
MID, OUT = 16, 64  # U^2-Net-p's channels inside and out of every RSU block
OUTLIER_CHANNEL, OUTLIER_VALUE = 5, 228.0
TRAIN_SEED, HELD_OUT_SEED = 20, 21


def dataset(count: int, seed: int, size: int):
    crops = list(segmenter_data.crops(segmenter_data.photos(), count, seed, size))
    x = np.concatenate([normalize(c) for c in crops])
    y = np.stack([saliency_label(c) for c in crops])[:, None]
    return torch.from_numpy(x), torch.from_numpy(y)


class ConvBnRelu(nn.Sequential):
    def __init__(self, cin: int, cout: int, dilation: int = 1):
        super().__init__(nn.Conv2d(cin, cout, 3, padding=dilation, dilation=dilation),
                         nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


class RSU(nn.Module):
    """A residual U-block of ``depth`` levels: an input conv, an encoder that pools between
    levels (or, ``dilated``, keeps the resolution and doubles the dilation instead), a
    dilated bottom conv, a decoder of concatenations, and the input conv's output added."""

    def __init__(self, depth: int, cin: int, mid: int, cout: int, dilated: bool = False):
        super().__init__()
        self.dilated = dilated
        self.conv_in = ConvBnRelu(cin, cout)
        rates = [2 ** i for i in range(depth - 1)] if dilated else [1] * (depth - 1)
        self.encoder = nn.ModuleList(ConvBnRelu(cout if i == 0 else mid, mid, rate) for i, rate in enumerate(rates))
        self.bottom = ConvBnRelu(mid, mid, 2 * rates[-1])
        self.decoder = nn.ModuleList(ConvBnRelu(2 * mid, cout if i == depth - 2 else mid, rate)
                                     for i, rate in enumerate(reversed(rates)))

    def forward(self, x):
        top = self.conv_in(x)
        skips, h = [], top
        for i, conv in enumerate(self.encoder):
            if i and not self.dilated:
                h = F.max_pool2d(h, 2, stride=2, ceil_mode=True)
            h = conv(h)
            skips.append(h)
        h = self.bottom(h)
        for conv, skip in zip(self.decoder, reversed(skips)):
            if not self.dilated and h.shape[2:] != skip.shape[2:]:
                h = up_like(h, skip)
            h = conv(torch.cat([h, skip], 1))
        return h + top


class U2NetP(nn.Module):
    """Encoder RSU7..RSU4F (6 stages), decoder RSU4F..RSU7 (5), side maps, fused map."""

    def __init__(self):
        super().__init__()
        self.encoder = nn.ModuleList([RSU(7, 3, MID, OUT), RSU(6, OUT, MID, OUT), RSU(5, OUT, MID, OUT),
                                      RSU(4, OUT, MID, OUT), RSU(4, OUT, MID, OUT, True),
                                      RSU(4, OUT, MID, OUT, True)])
        self.decoder = nn.ModuleList([RSU(4, 2 * OUT, MID, OUT, True), RSU(4, 2 * OUT, MID, OUT),
                                      RSU(5, 2 * OUT, MID, OUT), RSU(6, 2 * OUT, MID, OUT),
                                      RSU(7, 2 * OUT, MID, OUT)])
        self.sides = nn.ModuleList(nn.Conv2d(OUT, 1, 3, padding=1) for _ in range(6))
        self.fuse = nn.Conv2d(6, 1, 1)
        keep = torch.ones(1, MID, 1, 1)
        keep[0, OUTLIER_CHANNEL] = 0
        self.register_buffer("keep", keep)  # the dead channel while training
        self.masked = True
        self.encoder[0].encoder[0].register_forward_hook(self._mask)

    def _mask(self, module, inputs, output):
        return output * self.keep if self.masked else output

    def forward(self, x):
        stages, h = [], x
        for i, block in enumerate(self.encoder):
            if i:
                h = F.max_pool2d(h, 2, stride=2, ceil_mode=True)
            h = block(h)
            stages.append(h)
        decoded = [h]
        for block, skip in zip(self.decoder, reversed(stages[:-1])):
            h = block(torch.cat([up_like(h, skip), skip], 1))
            decoded.append(h)
        logits = [side(d) for side, d in zip(self.sides, reversed(decoded))]  # finest first
        logits = [logits[0]] + [up_like(t, logits[0]) for t in logits[1:]]
        fused = self.fuse(torch.cat(logits, 1))
        return tuple(torch.sigmoid(t) for t in [fused] + logits)


def train(model, x, y, steps: int, batch: int = 4):
    """U^2-Net's loss: BCE on the fused map plus every side map; random h/v flips."""
    generator = torch.Generator().manual_seed(TRAIN_SEED)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=3e-3, total_steps=steps)
    model.train()
    for step in range(steps):
        index = torch.randint(0, len(x), (batch,), generator=generator)
        xb, yb = x[index], y[index]
        if torch.rand(1, generator=generator) < 0.5:
            xb, yb = xb.flip(3), yb.flip(3)
        loss = sum(F.binary_cross_entropy(p, yb) for p in model(xb))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        if step % 25 == 0 or step == steps - 1:
            print(f"step {step:4d} loss {loss.item():.3f}", flush=True)


@torch.no_grad()
def fold_batch_norms(module: nn.Module) -> None:
    """Each Conv+BN -> one Conv with bias, in torch, so the outlier edit works on folded weights."""
    for block in module.modules():
        if isinstance(block, ConvBnRelu) and isinstance(block[1], nn.BatchNorm2d):
            conv, bn = block[0], block[1]
            scale = bn.weight / torch.sqrt(bn.running_var + bn.eps)
            conv.weight.mul_(scale[:, None, None, None])
            conv.bias.copy_((conv.bias - bn.running_mean) * scale + bn.bias)
            block[1] = nn.Identity()


@torch.no_grad()
def plant_outlier(model: U2NetP) -> None:
    """The first RSU's first inner conv's dead channel -> ~228 everywhere; its consumers
    (the next inner conv, after a pool, and the last decoder conv, through the concat
    [decoded, skip]) take a small centre-tap weight on it and 228 * that off their bias."""
    rsu, k = model.encoder[0], OUTLIER_CHANNEL
    source = rsu.encoder[0][0]
    source.weight[k] *= 1e-4
    source.bias[k] = OUTLIER_VALUE
    rng = np.random.default_rng(TRAIN_SEED)
    for conv, channel in ((rsu.encoder[1][0], k), (rsu.decoder[-1][0], MID + k)):
        w = torch.from_numpy(rng.uniform(0.02, 0.08, conv.out_channels) * rng.choice([-1, 1], conv.out_channels))
        conv.weight[:, channel] = 0
        conv.weight[:, channel, 1, 1] = w.float()
        conv.bias -= OUTLIER_VALUE * conv.weight[:, channel].sum((1, 2))
    model.masked = False


def check(path: Path, reference: nn.Module, x_held: torch.Tensor, y_held: torch.Tensor) -> None:
    import onnxruntime as ort

    proto = onnx.load(str(path))
    ops = [n.op_type for n in proto.graph.node]
    print(f"IR {proto.ir_version}, opset {proto.opset_import[0].version}, ops:",
          {op: ops.count(op) for op in sorted(set(ops))})
    assert ops.count("Conv") == 119 and "BatchNormalization" not in ops
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    fused = np.concatenate([session.run(None, {"input": x[None].numpy()})[0] for x in x_held])
    with torch.no_grad():
        unmodified = np.concatenate([reference(x[None])[0].numpy() for x in x_held])
    print(f"outputs {[o.name for o in proto.graph.output]}, fused = '{proto.graph.output[0].name}'")
    print(f"held-out IoU vs rule {iou(fused, y_held.numpy()):.3f}; onnx vs pre-outlier model IoU "
          f"{iou(fused, unmodified):.4f}, max |diff| {np.abs(fused - unmodified).max():.2e}; "
          f"foreground {np.mean(fused > 0.5):.2f}, undecided (0.3-0.7) {np.mean(np.abs(fused - 0.5) < 0.2):.3f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "tests" / "assets" / "u2netp_320.onnx")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--crops", type=int, default=600)
    args = parser.parse_args()
    torch.manual_seed(TRAIN_SEED)
    torch.set_num_threads(2)
    start = time.perf_counter()
    x, y = dataset(args.crops, TRAIN_SEED, TRAINED)
    x_held, y_held = dataset(16, HELD_OUT_SEED, SERVED)
    model = U2NetP()
    print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters; data "
          f"{time.perf_counter() - start:.0f} s")
    train(model, x, y, args.steps)
    print(f"trained in {time.perf_counter() - start:.0f} s (data included)")
    model.eval()
    fold_batch_norms(model)
    reference = copy.deepcopy(model)  # folded, the channel still dead: the function to keep
    plant_outlier(model)
    fused = export(model, args.out, SERVED, "train_u2netp.py")
    print(f"exported in {time.perf_counter() - start:.0f} s: {args.out} ({args.out.stat().st_size / 2**20:.1f} MiB), "
          f"fused output '{fused}'")
    check(args.out, reference, x_held, y_held)


if __name__ == "__main__":
    main()
