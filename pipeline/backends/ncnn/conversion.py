"""ONNX -> ncnn: pnnx run in a scratch folder, its failures explained, the build."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np

from pipeline.backends.ncnn.common import (
    BIN_FILE, INSTALL_HINT, PARAM_FILE, PNNX_TIMEOUT_S, QUANTIZED_PRECISIONS, _PNNX_TYPES, _graph_inputs,
    dynamic_max_shapes,
    pnnx_executable, runtime_options)
from pipeline.backends.ncnn.names import _map_isolated
from pipeline.backends.ncnn.param import Param, ParamLayer


def build(onnx_path: Path, ir_dir: Optional[Path], out_dir: Path, target, precision: str) -> Tuple[List[str], dict]:
    """int8/mixed: ``onnx_path`` is parity's Q/DQ model; pnnx converts it without its Q/DQ
    nodes and the quantized ops' layers are written in ncnn's int8 form (int8.py)."""
    import onnx

    from pipeline.backends.ncnn import int8 as ncnn_int8

    from pipeline.precision import float32

    model = onnx.load(str(onnx_path))
    if float32.has_float16(model):  # pnnx reads float16 ops as unknown layers ("cannot convert op Conv")
        model = float32.widened(model, keep_io=False)
    quantized = None
    if precision in QUANTIZED_PRECISIONS:
        model, quantized = ncnn_int8.split_qdq(model)
    model = conv1d_as_2d(model)
    inputs = _graph_inputs(model)
    with tempfile.TemporaryDirectory(prefix="parity-pnnx-") as scratch:
        source = Path(scratch) / "model.onnx"
        param_path, bin_path, model = _converted(source, inputs, model)
        mapping = _map_isolated(source, param_path, bin_path, model)
        if quantized is not None:
            mapping["int8"] = ncnn_int8.write(param_path, bin_path, mapping.get("layers") or {}, quantized,
                                              requantize=target.ncnn.int8_requantize)
            ncnn_int8.remap_fused(mapping, mapping["int8"])
        out_dir = Path(out_dir)
        shutil.copyfile(param_path, out_dir / PARAM_FILE)
        shutil.copyfile(bin_path, out_dir / BIN_FILE)
    options = {**runtime_options(target, precision), **mapping}
    return [PARAM_FILE, BIN_FILE], {"model": PARAM_FILE, "options": options}


def conv1d_as_2d(model):
    """Each Conv of a 3-D weight (Conv1d) as a 1 x k Conv2d between an Unsqueeze and a Squeeze,
    its weight reshaped [O, I, 1, k], its name and output tensor kept: ncnn's Convolution has
    int8 kernels and packed fp32 ones where its Convolution1D has neither. A wav2vec 2.0-style
    speech front-end (7 Conv1d of 512 channels) on x86: fp32 1.55x, int8 2.91x the Convolution1D
    fp32 build (as an AVX2 CPU 1.67x and 2.03x). Unnamed nodes are named first as reports name
    them (fingerprints.node_key), so that their names do not move with the nodes added. Returns
    ``model`` itself where it has no Conv1d."""
    from onnx import helper, numpy_helper

    from pipeline.backends.ncnn.fingerprints import node_key

    weights = {t.name: t for t in model.graph.initializer}
    users: Dict[str, int] = {}
    for node in model.graph.node:
        for name in node.input:
            users[name] = users.get(name, 0) + 1
    flat = {position for position, node in enumerate(model.graph.node)
            if node.op_type == "Conv" and len(node.input) > 1 and node.input[1] in weights
            and len(weights[node.input[1]].dims) == 3 and users[node.input[1]] == 1}
    if not flat:
        return model
    result = _with_axis_2(model)
    initializers = {t.name: t for t in result.graph.initializer}
    nodes = []
    for position, node in enumerate(result.graph.node):
        node.name = node_key(node, position)
        if position not in flat:
            nodes.append(node)
            continue
        weight = initializers[node.input[1]]
        weight.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(weight)[:, :, None, :], weight.name))
        source, target = f"{node.input[0]}__{node.name}__2d", f"{node.output[0]}__2d"
        nodes += [helper.make_node("Unsqueeze", [node.input[0], AXIS_2], [source], name=f"{node.name}__to_2d"),
                  _as_2d(node, source, target),
                  helper.make_node("Squeeze", [target, AXIS_2], [node.output[0]], name=f"{node.name}__to_1d")]
    del result.graph.node[:]
    result.graph.node.extend(_kept_2d(nodes, result.graph))
    return result


def _without_shapes_of(graph, tensors: set) -> None:
    """``graph``'s value_info less ``tensors``: their rank changed (a converted model's recorded
    3-D shapes made pnnx's ONNX Runtime session refuse a Conv reading a 4-D tensor)."""
    kept = [info for info in graph.value_info if info.name not in tensors]
    del graph.value_info[:]
    graph.value_info.extend(kept)


AXIS_2 = "parity_axis_2"  # the axes of the Unsqueeze/Squeeze pairs the two rewrites put around a 1-D op
# ops that compute each element alone: between two Conv1d's 2-D forms they run on the 4-D tensor
ELEMENTWISE = {"Relu", "Sigmoid", "Tanh", "Erf", "Div", "Mul", "Add", "Sub", "Clip", "LeakyRelu", "HardSigmoid",
               "HardSwish", "Neg", "Abs", "Elu", "Selu", "Softplus", "Gelu", "Sqrt", "Exp", "Pow"}


def _kept_2d(nodes: list, graph) -> list:
    """``nodes`` without a Squeeze (of a Conv1d's 2-D form) and the Unsqueezes after it where
    only elementwise ops with scalar other inputs lie between them: those run on the 4-D tensor.
    Each such pair was an ncnn Squeeze and ExpandDims layer copying the tensor: on the speech
    front-end, 5.0 ms of a 50 ms int8 run (as an AVX2 CPU)."""
    from onnx import numpy_helper

    scalars = {t.name for t in graph.initializer if int(np.prod(t.dims)) == 1} | {
        node.output[0] for node in nodes if node.op_type == "Constant" and node.attribute
        and node.attribute[0].name == "value" and numpy_helper.to_array(node.attribute[0].t).size == 1}
    outputs, readers = {o.name for o in graph.output}, _readers(nodes)
    for squeeze in [n for n in nodes if n.op_type == "Squeeze" and list(n.input[1:]) == [AXIS_2]]:
        region = _elementwise_region(readers, squeeze.output[0], scalars, outputs)
        if region is None:
            continue
        inner, unsqueezes = region
        _without_shapes_of(graph, {name for node in inner for name in node.output})
        for node in inner:
            node.input[:] = [squeeze.input[0] if name == squeeze.output[0] else name for name in node.input]
        renamed = {u.output[0]: u.input[0] for u in unsqueezes}
        for node in nodes:
            node.input[:] = [renamed.get(name, name) for name in node.input]
        dropped = {id(squeeze), *map(id, unsqueezes)}
        nodes = [node for node in nodes if id(node) not in dropped]
        readers = _readers(nodes)
    return nodes


def _readers(nodes: list) -> Dict[str, list]:
    """Each tensor's reading nodes."""
    readers: Dict[str, list] = {}
    for node in nodes:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    return readers


def _elementwise_region(readers: Dict[str, list], start: str, scalars: set, outputs: set):
    """(elementwise nodes reached from ``start``, the AXIS_2 Unsqueezes that end them), or None
    where anything else reads a tensor of the region or a graph output is one."""
    tensors, inner, ends, queue = {start}, [], [], [start]
    while queue:
        for node in readers.get(queue.pop(), []):
            if node.op_type == "Unsqueeze" and list(node.input[1:]) == [AXIS_2]:
                ends.append(node)
            elif node.op_type in ELEMENTWISE:
                if node not in inner:
                    inner.append(node)
                    tensors.update(node.output)
                    queue.extend(node.output)
            else:
                return None
    reads_outside = any(name not in tensors and name not in scalars for node in inner for name in node.input if name)
    if not ends or reads_outside or tensors & outputs:
        return None
    return inner, ends


def _with_axis_2(model):
    """A copy of ``model`` with the initializer AXIS_2 ([2])."""
    import onnx
    from onnx import numpy_helper

    result = onnx.ModelProto()
    result.CopyFrom(model)
    if AXIS_2 not in {t.name for t in result.graph.initializer}:
        result.graph.initializer.append(numpy_helper.from_array(np.array([2], np.int64), AXIS_2))
    return result


def _as_2d(node, source: str, target: str):
    """A Conv1d node's 1 x k Conv2d form, reading ``source`` and writing ``target``."""
    from onnx import helper

    attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    one = {"kernel_shape": lambda k: [1, *k], "strides": lambda s: [1, *s], "dilations": lambda d: [1, *d],
           "pads": lambda p: [0, p[0], 0, p[1]]}
    changed = {name: one[name](value) if name in one else value for name, value in attributes.items()}
    return helper.make_node("Conv", [source, *node.input[1:]], [target], name=node.name, **changed)


class UnconvertedOps(RuntimeError):
    """pnnx left ops that ncnn has no layer for (``ops``: pnnx's names, e.g. nn.InstanceNorm1d)."""

    def __init__(self, message: str, ops: List[str]):
        super().__init__(message)
        self.ops = ops


def _converted(source: Path, inputs, model) -> tuple:
    """(param, bin, the model they were converted from): ``model`` saved as ``source`` and
    converted; where pnnx stops at InstanceNorm1d, again with instance_norms_as_2d. Only
    then: pnnx fuses a GroupNorm of fewer groups than channels (Reshape, InstanceNormalization,
    Reshape) into ncnn's GroupNorm, which the rewrite would break into three layers."""
    import onnx

    onnx.save(model, str(source))
    try:
        return (*_convert(source, inputs, model), model)
    except UnconvertedOps as err:
        widened = instance_norms_as_2d(model)
        if "nn.InstanceNorm1d" not in err.ops or widened is model:
            raise
    onnx.save(widened, str(source))
    return (*_convert(source, inputs, widened), widened)


def instance_norms_as_2d(model):
    """Each InstanceNormalization of a [N, C, L] tensor (GroupNorm with a group per channel, as
    wav2vec 2.0's feature encoder has after its first Conv1d, or InstanceNorm1d) run on
    [N, C, 1, L] between an Unsqueeze and a Squeeze: pnnx converts InstanceNorm2d to ncnn's
    InstanceNorm and stops at InstanceNorm1d ("cannot convert op nn.InstanceNorm1d"); the
    same normalization, in ONNX Runtime bit for bit. Returns ``model`` itself where it has none."""
    import onnx
    from onnx import helper

    norms = [node for node in model.graph.node if node.op_type == "InstanceNormalization"]
    if not norms:
        return model
    typed = onnx.shape_inference.infer_shapes(model).graph
    ranks = {v.name: len(v.type.tensor_type.shape.dim) for v in [*typed.value_info, *typed.input]
             if v.type.tensor_type.HasField("shape")}
    flat = [node for node in norms if ranks.get(node.input[0]) == 3]
    if not flat:
        return model
    result = _with_axis_2(model)
    # a Conv1d's 2-D form's output (conv1d_as_2d) is read before its Squeeze: pnnx crashed
    # (SIGSEGV, "Duplicate definition of name") on a Squeeze followed by an Unsqueeze
    squeezed = {node.output[0]: node.input[0] for node in result.graph.node
                if node.op_type == "Squeeze" and list(node.input[1:]) == [AXIS_2]}
    names = {node.name for node in flat}
    nodes = []
    for node in result.graph.node:
        if node.name not in names:
            nodes.append(node)
            continue
        source, target = node.input[0], node.output[0]
        widened = onnx.NodeProto()
        widened.CopyFrom(node)
        widened.input[0], widened.output[0] = squeezed.get(source, f"{source}__2d"), f"{target}__2d"
        if source not in squeezed:
            nodes.append(helper.make_node("Unsqueeze", [source, AXIS_2], [widened.input[0]], name=f"{node.name}__to_2d"))
        nodes += [widened, helper.make_node("Squeeze", [widened.output[0], AXIS_2], [target], name=f"{node.name}__to_1d")]
    del result.graph.node[:]
    result.graph.node.extend(nodes)
    return result


def _convert(source: Path, inputs, model) -> Tuple[Path, Path]:
    """pnnx in the scratch folder of ``source``; the ncnn param and bin it wrote."""
    executable = pnnx_executable()
    if executable is None:
        raise RuntimeError(f"pnnx is not installed: {INSTALL_HINT}")
    def written(all_dims):
        return ",".join("[" + ",".join(str(d) for d in dims) + "]" + _PNNX_TYPES.get(dtype.name, "f32")
                        for dims, (_, _, dtype) in zip(all_dims, inputs))

    command = [str(executable), source.name, f"inputshape={written([dims for _, dims, _ in inputs])}", "fp16=0",
               "device=cpu", "optlevel=2"]
    largest = dynamic_max_shapes(model, inputs)
    if largest:  # a second shape: pnnx keeps the dims that differ dynamic instead of folding them
        command.append(f"inputshape2={written(largest)}")
    try:
        done = subprocess.run(command, cwd=source.parent, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              timeout=PNNX_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired as err:
        raise RuntimeError(f"pnnx did not finish converting the model in {PNNX_TIMEOUT_S} s") from err
    log = done.stdout.decode(errors="replace")
    (source.parent / "pnnx.log").write_text(log)
    param_path, bin_path = source.with_suffix(".ncnn.param"), source.with_suffix(".ncnn.bin")
    todo = [line.split(None, 1)[1].strip() for line in log.splitlines() if line.startswith("todo ")]
    if done.returncode != 0 or not param_path.exists() or not bin_path.exists():
        raise RuntimeError(_pnnx_failure(done.returncode, log, todo))
    network = Param.read(param_path)
    unknown = _unknown_layers(network)
    if unknown:
        named = ", ".join(f"{layer.type} ({_onnx_node_for(layer, source, model)})" for layer in unknown)
        noun = "op" if len(unknown) == 1 else "ops"
        why = " with the input range's dynamic dims (a fixed model.input_shapes converts it static)" if largest else ""
        raise UnconvertedOps(f"pnnx cannot convert {noun} {named}{why}: ncnn has no such layer",
                             [layer.type for layer in unknown])
    return param_path, bin_path


def _pnnx_failure(returncode: int, log: str, todo: List[str]) -> str:
    if returncode < 0:
        import signal

        try:
            status = f"crashed ({signal.Signals(-returncode).name})"
        except ValueError:
            status = f"crashed (signal {-returncode})"
    elif returncode > 128:
        status = f"crashed (exit status {returncode})"
    else:
        status = f"failed (exit status {returncode})"
    if todo:
        return f"pnnx cannot convert op {', '.join(dict.fromkeys(todo))}: pnnx {status}"
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    reason = next((line for line in reversed(lines)
                   if any(word in line.lower() for word in ("error", "failed", "invalid", "not supported",
                                                            "unsupported"))), lines[-1] if lines else "")
    return f"pnnx {status} converting the model: {reason}".rstrip(": ")


def _unknown_layers(network: Param) -> List[ParamLayer]:
    import ncnn

    return [layer for layer in network.layers if ncnn.layer_to_index(layer.type) < 0]


def _onnx_node_for(layer: ParamLayer, source: Path, model) -> str:
    """The ONNX node pnnx left unconverted: pnnx names the layer after its node in its
    simplified ONNX model (``Det_1``); the node's rank among the simplified model's nodes
    of that op type is its rank among the original model's."""
    import onnx

    simplified = source.with_suffix(".pnnxsim.onnx")
    originals = [node for node in model.graph.node if node.op_type == layer.type]
    rank = None
    if simplified.exists():
        try:
            nodes = [n for n in onnx.load(str(simplified), load_external_data=False).graph.node
                     if n.op_type == layer.type]
            rank = next((i for i, n in enumerate(nodes) if n.name == layer.name), None)
            if len(nodes) != len(originals):
                rank = None
        except Exception:  # noqa: BLE001 - only names the node in an error message
            rank = None
    if rank is None and len(originals) == 1:
        rank = 0
    if rank is None:
        return f"ncnn layer {layer.name}"
    position = list(model.graph.node).index(originals[rank])
    return f"node {originals[rank].name or f'{layer.type}_{position}'}"
