"""ncnn int8 (``precision=int8`` and ``mixed`` on the ncnn targets), written by parity.

ncnn quantizes with its own tools (``ncnn2table`` for the scales, ``ncnn2int8`` for the
model), which the pip wheels do not ship. parity writes ncnn's int8 format itself, from
the same Q/DQ model it builds for every backend out of the calibrate stage's table (and,
for mixed, the sensitivity stage's qtable: its ops have no Q/DQ and stay float):

1. ``split_qdq``: the Q/DQ model becomes a float model (each activation's
   QuantizeLinear -> DequantizeLinear pair removed, each dequantized weight stored as
   float) and, per quantized op (a Conv, Gemm or MatMul reading a dequantized activation
   and a dequantized constant weight), the activation's threshold: the largest magnitude
   its quantization range covers, i.e. the table's threshold (ncnn's int8 is symmetric).
2. pnnx converts the float model (ncnn.build), and the name mapping says which ncnn layer
   computes which ONNX op.
3. ``quantize_layers``: each quantized op's layer, where it is a Convolution,
   ConvolutionDepthWise or InnerProduct (the layers with int8 kernels that ncnn's own
   ncnn2int8 quantizes too), gets ncnn's int8 form (src/layer/convolution.cpp,
   convolutiondepthwise.cpp, innerproduct.cpp ``load_param`` / ``load_model``):

   - param ``8=`` (int8_scale_term): 2 for Convolution and InnerProduct (one weight
     scale per output channel), 1 for ConvolutionDepthWise (one per group);
   - in the bin, in the order ``load_model`` reads them: the weights as int8 (the 4-byte
     tag 0x000D4B38 of ModelBin's int8 data, then the values, padded to 4 bytes), the
     bias unchanged (fp32), the weight scales (fp32, 127 / max|w| per output channel or
     group) and the bottom blob scale (one fp32, 127 / threshold).

   ncnn quantizes the layer's input with the bottom scale, computes in int8 with int32
   sums and dequantizes the output to fp32 before the bias and the fused activation
   (ncnn rounds half away from zero and clamps to [-127, 127], as here). Layers of other
   types computing a quantized op (a MatMul that became a Gemm or MatMul layer) stay fp32:
   the session reports them as ops that ran in float although the build quantized them.
4. ``plan_requantize`` (on by default; ``target.int8_requantize=false`` turns it off):
   activations stay int8 between int8 layers, as ncnn2int8's ``fuse_requantize`` writes
   them (tools/quantize/ncnn2int8.cpp). A Convolution or ConvolutionDepthWise whose output
   only int8 Convolution / ConvolutionDepthWise layers read (directly, or through a Split
   whose every output such a layer reads, all with one bottom scale) gets int8_scale_term
   + 100 (101, 102) and, in the bin right after its bottom scale, the top blob scale: the
   readers' bottom scale. ncnn then requantizes its int32 sums (scale, bias, fused
   activation, round, clamp) straight to int8 instead of dequantizing to fp32, and the
   readers skip their quantize pass (an int8 input blob is taken as it is). An activation
   layer between them (pnnx leaves HardSwish, Clip, Sigmoid, Mish unfused) is first folded
   into the producer as its fused activation (param 9/10, as ncnnoptimize's
   fuse_convolution_activation does), so that the requantized value is the activation's
   output. An extracted requantized blob comes back as its int8 values: the session
   divides it by the top scale (``int8_blobs``).

Where the layers' weights are in the bin: a layer's weights follow the weights of every
layer before it, in the order of the param file, and only ncnn knows how much each layer
type reads. ``weight_offsets`` asks it: ncnn loads the param file cut just before the
layer, reading the bin through a counting DataReader; the bytes read are the offset.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np

# ncnn layer type -> (param of num_output, of bias_term, of weight_data_size, int8_scale_term
# written, whether there is one weight scale per group (param 7) rather than per output)
INT8_LAYERS = {
    "Convolution": (0, 5, 6, 2, False),
    "ConvolutionDepthWise": (0, 5, 6, 1, True),
    "InnerProduct": (0, 1, 2, 2, False),
}
INT8_SCALE_PARAM = 8
REQUANTIZE_TERM = 100  # int8_scale_term above 100: the layer outputs int8 (its top blob scale follows in the bin)
REQUANTIZE_LAYERS = ("Convolution", "ConvolutionDepthWise")  # ncnn2int8's fuse_requantize: producers and readers
ACTIVATION_PARAM, ACTIVATION_PARAMS = 9, -23310  # activation_type and the activation_params array (key 10)
DYNAMIC_WEIGHT_PARAM = 19  # Convolution* with the weight as a second input: nothing to quantize
INT8_TAG = 0x000D4B38  # ModelBin: int8 data follows
FP32_TAG = 0  # ModelBin: raw fp32 data follows (what pnnx writes with fp16=0)
QUANTIZED_OPS = ("Conv", "Gemm", "MatMul")  # ONNX ops whose int8 form ncnn may run
INT8_MAX = 127


# ----------------------------------------------------------------------------- Q/DQ model


def split_qdq(model) -> Tuple[object, Dict[str, dict]]:
    """(the float model, {quantized op: {"op_type", "input", "threshold", "weights"}}) of a
    Q/DQ model: Q -> DQ pairs removed (their consumers read the Q's input), dequantized
    constants stored as float. ``weights``: the op's dequantized weight values, sorted
    (layout-free, to tell apart layers computing ops of one group)."""
    import onnx
    from onnx import numpy_helper

    graph = model.graph
    constants = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    producers = {out: position for position, node in enumerate(graph.node) for out in node.output}
    rename: Dict[str, str] = {}  # a DequantizeLinear output -> the float tensor it stands for
    thresholds: Dict[str, float] = {}  # the same DQ output -> the threshold of its range
    dequantized: Dict[str, np.ndarray] = {}
    removed = set()  # positions of the Q/DQ nodes to remove
    for position, node in enumerate(graph.node):
        if node.op_type != "DequantizeLinear":
            continue
        scale, zero = _qparams(node, constants)
        quantize = producers.get(node.input[0])
        if node.input[0] in constants:
            axis = next((a.i for a in node.attribute if a.name == "axis"), 1)
            dequantized[node.output[0]] = _dequantize(constants[node.input[0]], scale, zero, axis)
        elif quantize is not None and graph.node[quantize].op_type == "QuantizeLinear":
            rename[node.output[0]] = graph.node[quantize].input[0]
            thresholds[node.output[0]] = _threshold(scale, zero, constants, node)
            removed.add(quantize)
        else:
            continue
        removed.add(position)
    quantized = {}
    kept = [node for position, node in enumerate(graph.node) if position not in removed]
    for position, node in enumerate(kept):  # named as in the float model (ncnn.node_key)
        if node.op_type in QUANTIZED_OPS and len(node.input) > 1 and node.input[0] in thresholds \
                and node.input[1] in dequantized:
            quantized[node.name or f"{node.op_type}_{position}"] = {
                "op_type": node.op_type, "input": rename[node.input[0]], "threshold": thresholds[node.input[0]],
                "weights": np.sort(np.abs(dequantized[node.input[1]].ravel()))}
    result = onnx.ModelProto()
    result.CopyFrom(model)
    _rewrite(result.graph, removed, rename, dequantized)
    return result, quantized


def _qparams(node, constants) -> Tuple[np.ndarray, np.ndarray]:
    scale = np.asarray(constants[node.input[1]], dtype=np.float64)
    zero = np.asarray(constants[node.input[2]]) if len(node.input) > 2 and node.input[2] else np.zeros((), np.int64)
    return scale, zero.astype(np.float64)


def _dequantize(values: np.ndarray, scale: np.ndarray, zero: np.ndarray, axis: int) -> np.ndarray:
    values = values.astype(np.float64)
    if scale.ndim == 1 and values.ndim > 1:
        shape = [1] * values.ndim
        shape[axis % values.ndim] = scale.size
        scale, zero = scale.reshape(shape), zero.reshape(shape)
    return ((values - zero) * scale).astype(np.float32)


def _threshold(scale: np.ndarray, zero: np.ndarray, constants, node) -> float:
    """The largest magnitude a per-tensor (u)int8 quantization covers: the calibration
    table's threshold (u8: the range [min, max] clipped to +-threshold)."""
    if scale.size != 1:
        raise ValueError(f"ncnn int8: activation {node.input[0]!r} is quantized per channel; ncnn takes one scale")
    dtype = constants[node.input[2]].dtype if len(node.input) > 2 and node.input[2] else np.dtype(np.uint8)
    low, high = (0, 255) if dtype == np.uint8 else (-128, 127)
    step, zero = float(scale.reshape(-1)[0]), float(zero.reshape(-1)[0])
    return max(abs((low - zero) * step), abs((high - zero) * step))


def _rewrite(graph, removed: set, rename: Dict[str, str], dequantized: Dict[str, np.ndarray]) -> None:
    """The graph without the removed Q/DQ nodes: their consumers read the float tensors,
    dequantized constants are initializers, graph outputs keep their names (Identity)."""
    from onnx import helper, numpy_helper

    outputs = {o.name for o in graph.output}
    kept = [node for position, node in enumerate(graph.node) if position not in removed]
    for node in kept:
        for index, name in enumerate(node.input):
            if name in rename:
                node.input[index] = rename[name]
    extra = [helper.make_node("Identity", [rename[name]], [name], name=f"{name}_identity")
             for name in outputs if name in rename]
    del graph.node[:]
    graph.node.extend([*kept, *extra])
    used = {name for node in graph.node for name in node.input}
    keep = [t for t in graph.initializer if t.name in used and t.name not in dequantized]
    del graph.initializer[:]
    graph.initializer.extend([*keep, *(numpy_helper.from_array(value, name) for name, value in dequantized.items()
                                       if name in used)])
    gone = set(rename) | {name for name in dequantized}
    infos = [v for v in graph.value_info if v.name not in gone]
    del graph.value_info[:]
    graph.value_info.extend(infos)


# ----------------------------------------------------------------------------- layers


def write(param_path: Path, bin_path: Path, layers: Dict[str, List[str]], quantized: Dict[str, dict],
          requantize: bool = True) -> dict:
    """The quantized ops' layers of the converted net in ncnn's int8 form, in place; the
    record of the build options: {"layers": {ncnn layer: ONNX op}, "quantized_ops": {ONNX
    op: op type}, "float": {ONNX op: why its layer stays fp32}, "scales": {layer: ...},
    "requantized": {layer: its top blob}, "fused": {activation layer: {"into": layer,
    "blob": the layer's former top blob}}} (``requantize``: plan_requantize)."""
    from pipeline.backends.ncnn import Param

    network = Param.read(param_path)
    data = Path(bin_path).read_bytes()
    wanted = {name for op in quantized for name in layers.get(op, [])}
    names = [layer.name for layer in network.layers if layer.type in INT8_LAYERS and layer.name in wanted]
    offsets = weight_offsets(network, data, names) if names else {}
    kinds = {layer.name: layer for layer in network.layers}

    def weights_of(name: str) -> Optional[np.ndarray]:
        found = layer_weights(kinds[name], data, offsets[name]) if name in offsets else None
        return None if found is None else np.sort(np.abs(found))

    chosen, floats = assign_layers(quantized, layers, network, weights_of)
    thresholds = {name: quantized[op]["threshold"] for name, op in chosen.items()}
    written, records = quantize_layers(network, data, offsets, thresholds)
    fused, tops = plan_requantize(network, records) if requantize else ({}, {})
    if tops:
        fused = fuse_activations(network, fused)
        written, records = quantize_layers(network, data, offsets, thresholds, tops)
    for name, op in chosen.items():
        if name not in records:
            floats[op] = "its weights are not fp32 in the bin pnnx wrote"
    network.write(param_path)
    Path(bin_path).write_bytes(written)
    producers = {layer.name: layer for layer in network.layers}
    return {"layers": {name: op for name, op in chosen.items() if name in records},
            "quantized_ops": {op: info["op_type"] for op, info in quantized.items()},
            "float": floats, "scales": records,
            "requantized": {name: producers[name].tops[0] for name in tops}, "fused": fused}



def assign_layers(quantized: Dict[str, dict], layers: Dict[str, List[str]], network,
                  weights_of) -> Tuple[Dict[str, str], Dict[str, str]]:
    """({ncnn layer: ONNX op} to quantize, {ONNX op: why it stays float}) for the quantized
    ops: each op's layer is the one of an int8 type among the layers the name mapping gives
    it (``layers``: options["layers"]); where several are, the one whose weights are the
    op's (``weights_of(layer)``: its weight values, sorted by magnitude)."""
    kinds = {layer.name: layer for layer in network.layers}
    chosen: Dict[str, str] = {}
    floats: Dict[str, str] = {}
    for op, info in quantized.items():
        candidates = [name for name in layers.get(op, []) if name in kinds and kinds[name].type in INT8_LAYERS
                      and not kinds[name].param(DYNAMIC_WEIGHT_PARAM)]
        if len(candidates) > 1:
            candidates = [name for name in candidates if _same_weights(weights_of(name), info["weights"])]
        candidates = [name for name in candidates if name not in chosen]
        if len(candidates) == 1:
            chosen[candidates[0]] = op
        elif not layers.get(op):
            floats[op] = "no ncnn layer mapped to this op"
        else:
            types = sorted({kinds[n].type for n in layers[op] if n in kinds})
            floats[op] = f"its ncnn layer has no int8 kernel ({', '.join(types)})" if not candidates else \
                "several ncnn layers could compute it"
    return chosen, floats


def _same_weights(found: Optional[np.ndarray], wanted: np.ndarray) -> bool:
    return found is not None and found.shape == wanted.shape and \
        bool(np.allclose(found, wanted, rtol=1e-5, atol=1e-7))


def layer_weights(layer, data: bytes, offset: int) -> Optional[np.ndarray]:
    """The fp32 weights of an int8-type layer at ``offset`` in the bin (None if not fp32)."""
    size = int(layer.param(INT8_LAYERS[layer.type][2]) or 0)
    tag = int.from_bytes(data[offset:offset + 4], "little")
    if tag != FP32_TAG or not size:
        return None
    return np.frombuffer(data, dtype="<f4", count=size, offset=offset + 4)


def quantize_layers(network, data: bytes, offsets: Dict[str, int], chosen: Dict[str, float],
                    tops: Optional[Dict[str, float]] = None) -> Tuple[bytes, dict]:
    """(the new bin, {layer: its record}) with the ``chosen`` layers ({name: threshold})
    in ncnn's int8 form; ``network`` (a Param) gets their int8_scale_term, in place. The
    layers of ``tops`` ({name: top blob scale}) requantize: int8_scale_term + 100, the
    top blob scale after the bottom blob scale (ncnn's load_model reads it last)."""
    kinds = {layer.name: layer for layer in network.layers}
    tops = tops or {}
    pieces, position, records = [], 0, {}
    for name in sorted(chosen, key=lambda n: offsets[n]):
        layer, threshold = kinds[name], float(chosen[name])
        outputs_param, bias_param, size_param, term, per_group = INT8_LAYERS[layer.type]
        outputs = int(layer.param(outputs_param) or 0)
        rows = int(layer.param(7) or 1) if per_group else outputs
        weights = layer_weights(layer, data, offsets[name])
        if weights is None or threshold <= 0 or not rows or weights.size % rows:
            continue
        start = offsets[name]
        end = start + 4 + 4 * weights.size + (4 * outputs if int(layer.param(bias_param) or 0) else 0)
        quantized, scales = _quantize_rows(weights.reshape(rows, -1))
        bottom_scale = INT8_MAX / threshold
        top = [float(tops[name])] if name in tops else []
        pieces += [data[position:start], INT8_TAG.to_bytes(4, "little"), quantized.tobytes(),
                   bytes(-quantized.size % 4), data[start + 4 + 4 * weights.size:end],
                   scales.astype("<f4").tobytes(), np.array([bottom_scale, *top], "<f4").tobytes()]
        position = end
        layer.set_param(INT8_SCALE_PARAM, term + (REQUANTIZE_TERM if top else 0))
        records[name] = {"type": layer.type, "threshold": threshold, "bottom_scale": bottom_scale,
                         "weight_scales": int(scales.size), **({"top_scale": top[0]} if top else {})}
    pieces.append(data[position:])
    return b"".join(pieces), records


def _quantize_rows(weights: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 per row: scale 127 / max|w| (0 for an all-zero row, as ncnn treats it),
    rounded half away from zero like ncnn's float2int8, clamped to [-127, 127]."""
    peak = np.abs(weights).max(axis=1).astype(np.float64)
    scales = np.where(peak > 0, INT8_MAX / np.where(peak > 0, peak, 1.0), 0.0).astype(np.float32)
    scaled = weights.astype(np.float64) * scales[:, None].astype(np.float64)
    rounded = np.sign(scaled) * np.floor(np.abs(scaled) + 0.5)
    return np.clip(rounded, -INT8_MAX, INT8_MAX).astype(np.int8), scales


# ----------------------------------------------------------------------------- requantize


def plan_requantize(network, records: Dict[str, dict]) -> Tuple[Dict[str, str], Dict[str, float]]:
    """({activation layer: the int8 layer it folds into}, {int8 layer: its top blob scale})
    for the int8 layers (``records``: quantize_layers') whose output stays int8: a
    Convolution or ConvolutionDepthWise, followed by nothing or by one foldable activation
    layer, whose output only int8 Convolution / ConvolutionDepthWise layers read, all with
    one bottom scale (ncnn2int8's fuse_requantize: directly or through one Split)."""
    readers = _readers(network)
    fused: Dict[str, str] = {}
    tops: Dict[str, float] = {}
    for layer in network.layers:
        if layer.name not in records or layer.type not in REQUANTIZE_LAYERS or len(layer.tops) != 1:
            continue
        activation = _activation_after(layer, readers)
        targets = _int8_readers((activation or layer).tops[0], readers, records)
        scales = {records[name]["bottom_scale"] for name in targets or []}
        if len(scales) == 1:
            tops[layer.name] = scales.pop()
            if activation is not None:
                fused[activation.name] = layer.name
    return fused, tops


def _readers(network) -> Dict[str, list]:
    found: Dict[str, list] = {}
    for layer in network.layers:
        for blob in layer.bottoms:
            found.setdefault(blob, []).append(layer)
    return found


def _activation_after(layer, readers):
    """The activation layer that can fold into ``layer`` (it has no fused activation and
    is the only reader of its output), or None."""
    users = readers.get(layer.tops[0], [])
    if int(layer.param(ACTIVATION_PARAM) or 0) or len(users) != 1:
        return None
    user = users[0]
    simple = len(user.bottoms) == 1 and len(user.tops) == 1 and not user.featmask
    return user if simple and fused_activation(user) is not None else None


def _int8_readers(blob: str, readers: Dict[str, list], records: Dict[str, dict]) -> Optional[List[str]]:
    """The int8 Convolution / ConvolutionDepthWise layers reading ``blob`` (through Splits),
    or None when anything else reads it (or nothing: a net output)."""
    found: List[str] = []
    for user in readers.get(blob) or [None]:
        if user is not None and user.type == "Split":
            below = [_int8_readers(top, readers, records) for top in user.tops]
            if any(names is None for names in below):
                return None
            found += [name for names in below for name in names]
        elif user is not None and user.name in records and user.type in REQUANTIZE_LAYERS and len(user.bottoms) == 1:
            found.append(user.name)
        else:
            return None
    return found


FLT_MAX = "3.40282347e+38"


def fused_activation(layer) -> Optional[List[str]]:
    """An activation layer as a convolution's fused activation (param 9 activation_type,
    array 10 activation_params), as ncnnoptimize's fuse_convolution_activation writes it;
    None for other layers (and a ReLU with a slope array)."""
    first, second = layer.param(0), layer.param(1)
    if layer.type == "ReLU":
        return ["9=1"] if float(first or 0) == 0 else ["9=2", f"{ACTIVATION_PARAMS}=1,{first}"]
    if layer.type == "Clip":
        return ["9=3", f"{ACTIVATION_PARAMS}=2,{first or '-' + FLT_MAX},{second or FLT_MAX}"]
    if layer.type in ("Sigmoid", "Mish"):
        return [f"9={4 if layer.type == 'Sigmoid' else 5}"]
    if layer.type == "HardSwish":
        return ["9=6", f"{ACTIVATION_PARAMS}=2,{first or '0.2'},{second or '0.5'}"]
    return None


def fuse_activations(network, fused: Dict[str, str]) -> Dict[str, dict]:
    """The activation layers of ``fused`` folded into their producers, in place:
    {activation layer: {"into": producer, "blob": the producer's former top blob}}."""
    layers = {layer.name: layer for layer in network.layers}
    done = {}
    for name, into in fused.items():
        activation, producer = layers[name], layers[into]
        done[name] = {"into": into, "blob": producer.tops[0]}
        producer.params = [t for t in producer.params if t.partition("=")[0] not in ("9", "10", str(ACTIVATION_PARAMS))]
        producer.params += fused_activation(activation)
        producer.tops = list(activation.tops)
    network.layers = [layer for layer in network.layers if layer.name not in fused]
    network.blob_count -= len(fused)
    network._producers = None
    return done


def remap_fused(mapping: dict, record: dict) -> None:
    """The build's name mapping after fuse_activations, in place: the ops an activation
    layer computed are computed by the layer it folded into; that layer's former output
    blob is gone (its tensor is no longer exposed, like a Conv output inside pnnx's convrelu)."""
    fused = record.get("fused") or {}
    gone = {info["blob"] for info in fused.values()}
    into = {name: info["into"] for name, info in fused.items()}
    mapping["layers"] = {op: list(dict.fromkeys(into.get(name, name) for name in names))
                         for op, names in (mapping.get("layers") or {}).items()}
    mapping["blobs"] = {tensor: blob for tensor, blob in (mapping.get("blobs") or {}).items() if blob not in gone}
    mapping["blob_aliases"] = {blob: tensor for blob, tensor in (mapping.get("blob_aliases") or {}).items()
                               if blob not in gone}


def int8_blobs(network, record: Optional[dict]) -> Dict[str, float]:
    """{blob: scale} of the blobs that hold int8 values when the build runs int8: the
    requantizing layers' outputs and the Split copies of them (value = int8 / scale)."""
    scales = (record or {}).get("scales") or {}
    readers = _readers(network)
    found: Dict[str, float] = {}
    pending = [(blob, scales[name]["top_scale"]) for name, blob in ((record or {}).get("requantized") or {}).items()
               if "top_scale" in scales.get(name, {})]
    while pending:
        blob, scale = pending.pop()
        found[blob] = scale
        pending += [(top, scale) for user in readers.get(blob, []) if user.type == "Split" for top in user.tops]
    return found


# ----------------------------------------------------------------------------- bin layout


def weight_offsets(network, data: bytes, names: List[str]) -> Dict[str, int]:
    """{layer: where its weights start in the bin}, for the layers ``names``: the bytes ncnn
    reads loading the param file cut just before each of them."""
    import ncnn

    index = {layer.name: i for i, layer in enumerate(network.layers)}
    found = {}
    for name in names:
        cut = index[name]
        prefix = network.layers[:cut]
        blobs = len({top for layer in prefix for top in layer.tops})
        text = "7767517\n{} {}\n{}\n".format(len(prefix), blobs, "\n".join(layer.line() for layer in prefix))
        net = ncnn.Net()
        for switch in ("use_vulkan_compute", "use_packing_layout", "use_winograd_convolution",
                       "use_sgemm_convolution"):
            setattr(net.opt, switch, False)
        net.opt.num_threads = 1
        reader = _CountingReader(data)
        try:
            if net.load_param_mem(text) != 0 or net.load_model(reader) != 0:
                raise RuntimeError(f"ncnn cannot load the layers before {name}")
        finally:
            net.clear()
        found[name] = reader.position
    return found


_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


@functools.lru_cache(maxsize=None)
def _reader_class():
    import ncnn

    class CountingReader(ncnn.DataReader):
        """A DataReader over bytes that counts what ncnn reads."""

        def __init__(self, data: bytes):
            super().__init__()
            self.data, self.position = data, 0

        def read(self, buffer, size: int) -> int:
            count = max(0, min(int(size), len(self.data) - self.position))
            ctypes.memmove(_capsule_pointer(buffer, None), self.data[self.position:self.position + count], count)
            self.position += count
            return count

    return CountingReader


def _CountingReader(data: bytes):  # noqa: N802 - a class made on first use (ncnn imported lazily)
    return _reader_class()(data)


# ----------------------------------------------------------------------------- what ran

# Layers doing a model's weighted arithmetic: a build is int8 when all of them run int8.
COMPUTE_LAYERS = (*INT8_LAYERS, "Gemm", "MatMul", "Deconvolution", "DeconvolutionDepthWise", "Convolution1D",
                  "ConvolutionDepthWise1D", "Convolution3D", "ConvolutionDepthWise3D", "Deconvolution1D",
                  "Deconvolution3D", "DeconvolutionDepthWise1D", "DeconvolutionDepthWise3D", "MultiHeadAttention",
                  "RNN", "LSTM", "GRU")


def runs_int8(layer, on_gpu: bool, opt) -> bool:
    """Whether ncnn runs this loaded layer (a ParamLayer of the net's param file) in int8:
    an int8-type layer with int8_scale_term set, on the CPU under the net's
    use_int8_inference (ncnn's x86/arm/generic forward: ``opt.use_int8_inference &&
    int8_scale_term``; the feature mask's no-int8 bit does not clear that switch), on
    Vulkan always (its create_pipeline takes the int8 path on int8_scale_term alone)."""
    if layer.type not in INT8_LAYERS or not int(layer.param(INT8_SCALE_PARAM) or 0):
        return False
    return on_gpu or bool(opt.use_int8_inference)


def read_back(rows: List[Tuple[str, str, str]], network, record: Optional[dict]) -> Optional[dict]:
    """For an int8/mixed build (``record``: its options["int8"]), from the session's
    (layer, device, precision) rows: the precision that ran (int8 when every compute
    layer runs int8, mixed when some run float, fp32 when none runs int8), a layer count
    text, and ``float_ops``: the ops the build quantized whose layer ran float ({ONNX op:
    op type}, verify's float-fallback check)."""
    if not record:
        return None
    types = {layer.name: layer.type for layer in network.layers}
    int8 = {name for name, _, precision in rows if precision == "int8"}
    compute = [name for name, _, _ in rows if types.get(name) in COMPUTE_LAYERS]
    ops = record.get("layers") or {}
    layer_of = {op: name for name, op in ops.items()}
    float_ops = {op: kind for op, kind in (record.get("quantized_ops") or {}).items() if layer_of.get(op) not in int8}
    floats = [name for name in compute if name not in int8]
    precision = ("mixed" if floats else "int8") if int8 else "fp32"
    terms = {layer.name: int(layer.param(INT8_SCALE_PARAM) or 0) for layer in network.layers}
    requantized = sum(1 for name in int8 if terms.get(name, 0) > REQUANTIZE_TERM)
    found = {"precision": precision, "float_ops": float_ops,
             "int8_layers": {name: ops.get(name) for name, _, p in rows if p == "int8"},
             "layers": f"int8: {len(int8)} of {len(compute)} compute layers"
                       + (f" ({requantized} output int8: requantize)" if requantized else "")}
    on_cpu = [name for name, device, p in rows if p == "int8" and device == "CPU"]
    if on_cpu and any(device == "VULKAN" for _, device, _ in rows):
        found["note"] = (f"{len(on_cpu)} int8 layers ran on the CPU, not on Vulkan (ncnn has no Vulkan int8 "
                         f"kernel for them, e.g. a non-zero pad value): {', '.join(on_cpu[:5])}")
    return found


VULKAN_INT8_SINCE = 20260617  # ncnn's Vulkan int8 kernels (Tencent/ncnn #6751); before, an int8 layer turned Vulkan off


def vulkan_int8_problem(version: str) -> Optional[str]:
    """Why this ncnn cannot run int8 on Vulkan (None: it can). Before its Vulkan int8
    kernels, ncnn's Net::load_param turned Vulkan off for the whole net on the first int8
    layer ("no int8 gpu support yet"): the build would run on the CPU."""
    release = version.rsplit(".", 1)[-1]
    if not (release.isdigit() and len(release) == 8) or int(release) >= VULKAN_INT8_SINCE:
        return None
    return (f"precision=int8/mixed on ncnn_vulkan needs ncnn {VULKAN_INT8_SINCE} or later (its Vulkan int8 kernels); "
            f"ncnn {version} turns Vulkan off for int8 layers: use target=ncnn_cpu or upgrade ncnn")
