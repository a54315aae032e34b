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
2. pnnx converts the float model (ncnn.conversion.build), and the name mapping says which ncnn layer
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
4. ``plan_requantize`` (on by default; ``target.ncnn.int8_requantize=false`` turns it off):
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

This module writes the int8 model (steps 1, 3 and 4); ``int8_format`` holds the format's
constants, ``weight_offsets`` and the read-back of what ran int8 (``runs_int8``, ``read_back``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np

from pipeline.precision.calibration.input_means import dequantize

from pipeline.backends.ncnn.int8_format import (
    ACTIVATION_PARAM, ACTIVATION_PARAMS, DYNAMIC_WEIGHT_PARAM, FLT_MAX, FP32_TAG, INT8_LAYERS, INT8_MAX,
    INT8_SCALE_PARAM, INT8_TAG, QUANTIZED_OPS, REQUANTIZE_LAYERS, REQUANTIZE_TERM, weight_offsets)
from pipeline.backends.ncnn.int8_format import (  # noqa: F401 - int8 names used elsewhere
    COMPUTE_LAYERS, read_back, runs_int8, vulkan_int8_problem)

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
            dequantized[node.output[0]] = dequantize(constants[node.input[0]], scale, zero, axis).astype(np.float32)
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
    from pipeline.backends.ncnn.param import Param

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
