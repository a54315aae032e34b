"""ncnn's int8 format: the layer parameters, where a layer's weights are in the bin
(asked of ncnn through a counting DataReader) and which layers really ran int8."""

from __future__ import annotations

import ctypes
import functools
from typing import Dict, List, Optional, Tuple

from pipeline.precision import kinds


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


FLT_MAX = "3.40282347e+38"


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
    int8 = {name for name, _, precision in rows if kinds.quantized(precision)}
    compute = [name for name, _, _ in rows if types.get(name) in COMPUTE_LAYERS]
    ops = record.get("layers") or {}
    layer_of = {op: name for name, op in ops.items()}
    float_ops = {op: kind for op, kind in (record.get("quantized_ops") or {}).items() if layer_of.get(op) not in int8}
    floats = [name for name in compute if name not in int8]
    precision = kinds.from_op_counts({"int8": len(int8), kinds.REFERENCE: len(floats)}) or kinds.REFERENCE
    terms = {layer.name: int(layer.param(INT8_SCALE_PARAM) or 0) for layer in network.layers}
    requantized = sum(1 for name in int8 if terms.get(name, 0) > REQUANTIZE_TERM)
    found = {"precision": precision, "float_ops": float_ops,
             "int8_layers": {name: ops.get(name) for name, _, p in rows if kinds.quantized(p)},
             "layers": f"int8: {len(int8)} of {len(compute)} compute layers"
                       + (f" ({requantized} output int8: requantize)" if requantized else "")}
    on_cpu = [name for name, device, p in rows if kinds.quantized(p) and device == "CPU"]
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
