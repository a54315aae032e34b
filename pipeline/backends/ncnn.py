"""ncnn: the ``ncnn_cpu`` and ``ncnn_vulkan`` targets (pnnx converts, ncnn runs).

Build
    The fp32 ONNX model (input shapes fixed by the convert stage) is converted by the
    ``pnnx`` executable of the pnnx wheel (called directly: ``import pnnx`` imports torch)
    in a scratch folder, with ``fp16=0`` so that the weights stay fp32 on disk: precision
    is a runtime option of ncnn (``RUNTIME_PRECISIONS``), never baked into the artifact.
    Only ``model.ncnn.param`` / ``model.ncnn.bin`` are kept, as ``model.param`` /
    ``model.bin``. pnnx writes an op it cannot lower into the ncnn param under the ONNX op
    type (e.g. a ``Det`` layer) and prints ``todo Det``; ncnn would refuse to load it, so
    build checks every layer type against ncnn's registry (``ncnn.layer_to_index``) and
    raises ``pnnx cannot convert op Det (node /x/Det_7)``; the ONNX node is found through
    pnnx's simplified ONNX (``model.pnnxsim.onnx``, whose node names such as ``Det_1`` are
    the ncnn layer names) by the op's rank among the model's nodes of that type.

    int8 / mixed: build gets parity's Q/DQ model (made from the calibration table, the
    qtable's ops without Q/DQ); pnnx converts it without its Q/DQ nodes and the layers of
    the quantized ops are written in ncnn's own int8 format (ncnn_int8.py). ``effective()``
    reads back which layers run int8 (``int8_layers``) and the quantized ops whose layer
    runs float (``float_ops``, verify's float-fallback check).

Names: ncnn blob <-> ONNX tensor, ncnn layer <-> ONNX node
    pnnx renames everything (blobs become numbers, layers ``convrelu_0``...) and has no
    option that keeps ONNX names; its intermediate files (``model.pnnx.param``,
    ``model.pnnx.onnx``, ``model.pnnxsim.onnx``) are renamed too. What is stable:

    - graph inputs and outputs: pnnx names them ``in0, in1...`` and ``out0, out1...`` in the
      ONNX graph's input and output order;
    - intermediate tensors, by value: at build time ``MATCH_RUNS`` deterministic random
      inputs (standard normal; |x| when that makes the reference outputs NaN/Inf) run
      through ONNX Runtime (fp32, optimizations off, every activation an output) and
      through the converted net on the CPU in fp32 (every blob extracted). An ncnn blob
      stands for the ONNX tensors with the same element count whose values it reproduces
      in every run (relative L2 error <= ``MATCH_TOLERANCE`` on a fixed sample of
      ``MATCH_SAMPLE`` positions, and norms agreeing); per ONNX tensor the blob of the same
      shape (batch axis dropped) ranks first, then the smallest error. When a blob
      reproduces a tensor and one computed from it through a value-changing op (a Conv's
      output that happened to be >= 0 and its Relu: seen on an 8-channel SE block of the
      PP-OCR classifier), it stands for the computed one only; through value-preserving
      ops (Reshape, Flatten, Identity...) it stands for all. Tensors are compared through
      small fingerprints, so the mapping holds one tensor at a time, not the model's
      activations. ``Split`` outputs are copies of their input blob and ``MemoryData`` /
      constant-only blobs are no activations: neither is matched. A tensor that ncnn fused
      away (a Conv's output inside ``convrelu``, the ``Add/Clip/Mul/Div`` of a HardSwish)
      has no blob and is reported as not exposed; a blob that reproduces no ONNX tensor
      (pnnx's own rewrites, e.g. the ``x*1.2`` it puts before a HardSigmoid) keeps its
      ncnn name (unmappable); a second blob holding a mapped tensor's values in another
      layout (an InnerProduct's output before a Reshape) is a ``blob_alias``.
      Where values coincide along a chain (``s + 1e-8`` equals ``s`` in fp32: the
      Reduction's and the Add's blobs both reproduce both tensors), ``resolve_by_structure``
      pairs blobs and tensors by graph order before the rule above.
      Measured: digits CNN 6 of 9 ONNX activations exposed (the Conv and Gemm outputs
      are fused with their Relu), every blob mapped; PP-OCR classifier 111 of 239 (not:
      Conv before BatchNorm, HardSwish internals, shape arithmetic), 9 blobs unmappable,
      every ONNX node with its layer.
    - layers, from the blob mapping: an ONNX node whose output has a blob maps to the ncnn
      layer computing that blob (the first blob holding its values); nodes between mapped
      tensors (the fused ones) map to the layer of the nearest mapped tensor they feed.
      ``options["layers"]`` lists, per ONNX node, that layer first, then the ncnn layers
      without a mapped output that feed it (the group computing the node);
      ``layer_map`` gives the first.

    The mapping runs in a child Python process (a crash of ncnn on a freshly converted
    net must not end the build); if it fails, only inputs and outputs are mapped and
    ``options["mapping_error"]`` says why. Everything is recorded in the build settings
    (runtime.yaml ``options``): ``inputs``, ``outputs`` and ``blobs`` (ONNX name -> ncnn
    blob), ``blob_aliases``, ``shapes`` (ONNX shapes, to restore the batch axis ncnn
    drops) and ``layers``.

Runtime
    ``options`` carry ncnn's Option switches: ``use_vulkan``, ``device_index``,
    ``threads``, the fp16 switches (only for precision fp16, per the target's
    ``fp16_storage`` / ``fp16_packed`` / ``fp16_arithmetic``), ``use_bf16_storage`` (bf16,
    CPU only) and ``layer_masks`` ({ncnn layer: feature mask}, written by ``apply_masks``
    as layer parameter ``31=`` in the param file; ncnn's ``Net::load_param`` reads it into
    ``Layer::featmask`` and ``get_masked_option`` in src/net.cpp masks the Option per
    layer, see MASK_BITS; a layer masked off Vulkan is re-created as a CPU layer).

    ``effective()`` reads back what ncnn runs, after ``Net::load_param`` has sanitized the
    Option: Vulkan is turned off without a valid device, fp16/bf16 switches the device
    lacks are dropped. A layer runs on Vulkan when the net still uses Vulkan, the loaded
    layer has a Vulkan implementation (``support_vulkan``) and its mask has no bit 16.
    Its precision: on Vulkan fp16 when fp16 storage/packed or arithmetic is on (mask
    permitting), bf16 for bf16 storage, else fp32; on the CPU bf16 when bf16 storage is
    on and the layer supports it, fp16 when fp16 storage is on, the layer supports it and
    ncnn casts activations to fp16 on this CPU (``cpu_fp16_storage``: ARM asimdhp; x86
    keeps activations and arithmetic fp32 and at most stores InnerProduct weights in fp16,
    which is storage: reported fp32 with ``CPU_FP32_NOTE``), else fp32. The reported precision is fp16/bf16 when any layer runs so (a
    masked layer is a deliberate exception), ``device`` VULKAN when any layer runs there,
    and ``layers`` counts the compute layers per device and lists the masks.

Vulkan: ncnn creates its GPU instance on first use; ``atexit`` releases every session's
net, then calls ``ncnn.destroy_gpu_instance()`` (the instance must outlive the nets).
"""

from __future__ import annotations

import atexit
import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import weakref
from collections import Counter
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from pipeline.backends.protocol import Capabilities

# ncnn's wheel uses libgomp, whose idle threads spin by default: two ncnn workers side by
# side (verify's target and its fp32 baseline) on a 2-core machine then took 220-340 ms an
# inference instead of 0.3-0.4 ms, and an int8 verify 65 s instead of 6. libgomp reads this
# when ncnn is first imported, which is always after this module.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

NAME = "ncnn"
VULKAN_DEVICE_TYPES = {0: "discrete GPU", 1: "integrated GPU", 2: "virtual GPU", 3: "CPU"}
NO_VULKAN_DEVICE = "no Vulkan device: install libvulkan1 and a driver such as mesa-vulkan-drivers"
PRECISIONS = ("fp32", "fp16", "bf16", "int8", "mixed")
RUNTIME_PRECISIONS = ("fp16", "bf16")  # runtime switches: build gets the fp32 ONNX model
QUANTIZED_PRECISIONS = ("int8", "mixed")  # build gets parity's Q/DQ model (ncnn_int8.py)
MEMORY_MODES = ("auto",)
DEVICES = ("CPU", "VULKAN")
CAPABILITIES = Capabilities(
    precisions=PRECISIONS, devices=DEVICES, memory_modes=MEMORY_MODES, runtime_precisions=RUNTIME_PRECISIONS,
    feature_masks=True, tuning=True, option_mapping=True, profiler=True)

PARAM_FILE, BIN_FILE = "model.param", "model.bin"
INSTALL_HINT = "pip install 'parity[ncnn]' (ncnn + pnnx)"

# ncnn layer feature mask bits (layer param 31, read as Layer::featmask in Net::load_param);
# what each bit turns off for that layer, from get_masked_option() in ncnn's src/net.cpp.
MASK_BITS = {
    "no_fp16_arithmetic": 1,  # use_fp16_arithmetic
    "no_fp16_storage": 2,  # use_fp16_storage and use_fp16_packed
    "no_bf16_storage": 4,  # use_bf16_storage and use_bf16_packed
    "no_int8": 8,  # use_int8_storage, use_int8_packed and use_int8_arithmetic
    "no_vulkan": 16,  # use_vulkan_compute (and use_tensor_storage): the layer runs on the CPU
    "no_sgemm": 32,  # use_sgemm_convolution
    "no_winograd": 64,  # use_winograd_convolution
    "no_threading": 128,  # num_threads = 1
}
FEATMASK_PARAM = 31

MATCH_TOLERANCE = 1e-3  # relative L2 error under which an ncnn blob reproduces an ONNX tensor
MATCH_SAMPLE = 8192  # positions per tensor compared by the name mapping
MATCH_RUNS = 3  # random inputs the name mapping compares on
PNNX_TIMEOUT_S = 600
MAP_TIMEOUT_S = 600
_NOT_COMPUTE = ("Input", "MemoryData")
_ALIAS_LAYERS = ("Split",)  # outputs are copies of the input blob
log = logging.getLogger("parity")

_PNNX_TYPES = {"float32": "f32", "float64": "f64", "float16": "f16", "uint8": "u8", "int8": "i8",
               "int32": "i32", "int64": "i64", "bool": "u8"}


# ----------------------------------------------------------------------------- protocol


def available() -> Tuple[bool, str]:
    try:
        import ncnn  # noqa: F401
    except ImportError:
        return False, f"ncnn is not installed: {INSTALL_HINT}"
    if pnnx_executable() is None:
        return False, f"ncnn is not installed: {INSTALL_HINT}"
    return True, ""


def versions() -> Dict[str, str]:
    import ncnn

    found = {"ncnn": getattr(ncnn, "__version__", "unknown")}
    try:
        found["pnnx"] = importlib.metadata.version("pnnx")
    except importlib.metadata.PackageNotFoundError:
        found["pnnx"] = "not installed"
    return found


def check_config(target, precision: str) -> Optional[str]:
    device = str(target.device).upper()
    if precision == "bf16" and device != "CPU":
        return "precision=bf16 on ncnn is CPU-only (bf16 storage); use target=ncnn_cpu"
    if precision in QUANTIZED_PRECISIONS and device == "VULKAN":
        from pipeline.backends.ncnn_int8 import vulkan_int8_problem

        problem = vulkan_int8_problem(versions()["ncnn"])
        if problem:
            return problem
    if precision == "fp16" and not (target.fp16_storage or target.fp16_packed or target.fp16_arithmetic):
        return ("precision=fp16 with target.fp16_storage, fp16_packed and fp16_arithmetic all false runs fp32; "
                "turn one on or use precision=fp32")
    return None


def pnnx_executable() -> Optional[Path]:
    """The pnnx binary inside the pnnx wheel (found without importing pnnx, which imports torch)."""
    try:
        spec = importlib.util.find_spec("pnnx")
    except (ImportError, ValueError):
        spec = None
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        for name in ("pnnx.exe", "pnnx") if sys.platform == "win32" else ("pnnx",):
            path = Path(folder) / name
            if path.is_file() and os.access(path, os.X_OK):
                return path
    return None


def runtime_options(target, precision: str) -> dict:
    """ncnn Option switches for this target and precision (precision is a runtime choice)."""
    fp16 = precision == "fp16"
    bf16 = precision == "bf16"
    return {
        "use_vulkan": str(target.device).upper() == "VULKAN",
        "device_index": int(getattr(target, "device_index", 0) or 0),
        "threads": int(target.threads or 0),
        "use_fp16_storage": bool(fp16 and target.fp16_storage),
        "use_fp16_packed": bool(fp16 and target.fp16_packed),
        "use_fp16_arithmetic": bool(fp16 and target.fp16_arithmetic),
        "use_bf16_storage": bf16,
        "use_int8_inference": precision in QUANTIZED_PRECISIONS,
        "layer_masks": {},
    }


def build(onnx_path: Path, ir_dir: Optional[Path], out_dir: Path, target, precision: str) -> Tuple[List[str], dict]:
    """int8/mixed: ``onnx_path`` is parity's Q/DQ model; pnnx converts it without its Q/DQ
    nodes and the quantized ops' layers are written in ncnn's int8 form (ncnn_int8.py)."""
    import onnx

    from pipeline.backends import ncnn_int8

    model = onnx.load(str(onnx_path))
    quantized = None
    if precision in QUANTIZED_PRECISIONS:
        model, quantized = ncnn_int8.split_qdq(model)
    inputs = _graph_inputs(model)
    with tempfile.TemporaryDirectory(prefix="parity-pnnx-") as scratch:
        scratch = Path(scratch)
        source = scratch / "model.onnx"
        onnx.save(model, str(source))
        param_path, bin_path = _convert(source, inputs, model)
        mapping = _map_isolated(source, param_path, bin_path, model)
        if quantized is not None:
            requantize = bool(getattr(target, "int8_requantize", True))
            mapping["int8"] = ncnn_int8.write(param_path, bin_path, mapping.get("layers") or {}, quantized,
                                              requantize=requantize)
            ncnn_int8.remap_fused(mapping, mapping["int8"])
        out_dir = Path(out_dir)
        shutil.copyfile(param_path, out_dir / PARAM_FILE)
        shutil.copyfile(bin_path, out_dir / BIN_FILE)
    options = {**runtime_options(target, precision), **mapping}
    return [PARAM_FILE, BIN_FILE], {"model": PARAM_FILE, "options": options}


def load(artifact_dir: Path, settings: dict) -> "Session":
    return Session(Path(artifact_dir), settings)


# ----------------------------------------------------------------------------- masks


def layer_map(artifact_dir: Path, settings: dict) -> Dict[str, str]:
    """{ONNX node name: the ncnn layer that computes it} (best effort: fused nodes map to
    the layer they were fused into; nodes with no mapped tensor downstream are absent)."""
    layers = settings.get("options", {}).get("layers", {})
    return {node: names[0] for node, names in layers.items() if names}


def layer_consumers(artifact_dir: Path, settings: dict) -> Dict[str, List[str]]:
    """{ncnn layer: the compute layers reading its outputs} (through Splits), for the mask
    search to follow an overflowing value downstream."""
    network = Param.read(Path(artifact_dir) / settings.get("model", PARAM_FILE))
    readers: Dict[str, List[ParamLayer]] = {}
    for layer in network.layers:
        for blob in layer.bottoms:
            readers.setdefault(blob, []).append(layer)
    result: Dict[str, List[str]] = {}
    for layer in network.layers:
        found, stack = [], list(layer.tops)
        while stack:
            for reader in readers.get(stack.pop(), []):
                if reader.type in _ALIAS_LAYERS:
                    stack.extend(reader.tops)
                elif reader.name not in found:
                    found.append(reader.name)
        result[layer.name] = found
    return result


def apply_masks(artifact_dir: Path, settings: dict, masks: Dict[str, int], out_dir: Path) -> Tuple[List[str], dict]:
    """Copy the artifact into ``out_dir`` with exactly these per-layer feature masks
    ({ncnn layer name: mask}, see MASK_BITS) as layer parameter 31 in the param file;
    masks already in the artifact and not in ``masks`` are removed, a mask of 0 removes
    one. The settings returned record them in ``options["layer_masks"]``."""
    artifact_dir, out_dir = Path(artifact_dir), Path(out_dir)
    param_name = settings.get("model", PARAM_FILE)
    network = Param.read(artifact_dir / param_name)
    known = {layer.name for layer in network.layers}
    unknown = [name for name in masks if name not in known]
    if unknown:
        raise ValueError(f"apply_masks: no ncnn layer {unknown[0]!r} in {param_name}")
    for name, value in masks.items():
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or not 0 <= int(value) < 256:
            raise ValueError(f"apply_masks: mask {value!r} for layer {name!r} is not an integer in 0..255")
    wanted = {name: int(value) for name, value in masks.items() if int(value)}
    for layer in network.layers:
        layer.set_param(FEATMASK_PARAM, wanted.get(layer.name))
    out_dir.mkdir(parents=True, exist_ok=True)
    network.write(out_dir / param_name)
    bin_name = _bin_name(param_name)
    if (artifact_dir / bin_name).resolve() != (out_dir / bin_name).resolve():
        shutil.copyfile(artifact_dir / bin_name, out_dir / bin_name)
    options = {**settings.get("options", {}), "layer_masks": wanted}
    return [param_name, bin_name], {**settings, "options": options}


# ----------------------------------------------------------------------------- param file


class ParamLayer:
    """One layer line of an ncnn param file: type, name, bottoms, tops and k=v tokens."""

    def __init__(self, line: str):
        tokens = line.split()
        self.type, self.name = tokens[0], tokens[1]
        bottoms, tops = int(tokens[2]), int(tokens[3])
        self.bottoms = tokens[4:4 + bottoms]
        self.tops = tokens[4 + bottoms:4 + bottoms + tops]
        self.params = tokens[4 + bottoms + tops:]

    def param(self, key: int) -> Optional[str]:
        for token in self.params:
            k, _, v = token.partition("=")
            if k == str(key):
                return v
        return None

    def set_param(self, key: int, value: Optional[int]) -> None:
        self.params = [t for t in self.params if t.partition("=")[0] != str(key)]
        if value is not None:
            self.params.append(f"{key}={value}")

    @property
    def featmask(self) -> int:
        value = self.param(FEATMASK_PARAM)
        return int(value) if value else 0

    def line(self) -> str:
        head = f"{self.type:<24} {self.name:<24} {len(self.bottoms)} {len(self.tops)}"
        return " ".join([head, *self.bottoms, *self.tops, *self.params])


class Param:
    """An ncnn text param file (magic, counts, one line per layer)."""

    def __init__(self, text: str):
        lines = [line for line in text.splitlines() if line.strip()]
        if not lines or lines[0].strip() != "7767517":
            raise ValueError("not an ncnn param file (magic 7767517 missing)")
        self.layers = [ParamLayer(line) for line in lines[2:]]
        self.blob_count = int(lines[1].split()[1])
        self._producers: Optional[Dict[str, ParamLayer]] = None

    @classmethod
    def read(cls, path: Path) -> "Param":
        return cls(Path(path).read_text())

    def write(self, path: Path) -> None:
        body = "\n".join(layer.line() for layer in self.layers)
        Path(path).write_text(f"7767517\n{len(self.layers)} {self.blob_count}\n{body}\n")

    def producers(self) -> Dict[str, ParamLayer]:
        if self._producers is None:
            self._producers = {top: layer for layer in self.layers for top in layer.tops}
        return self._producers

    def source(self, blob: str) -> str:
        """The blob a Split output copies (followed through chains of Splits)."""
        producers = self.producers()
        while blob in producers and producers[blob].type in _ALIAS_LAYERS:
            blob = producers[blob].bottoms[0]
        return blob

    def dynamic_blobs(self) -> List[str]:
        """Blobs that depend on an Input, in layer order (constants left out)."""
        dynamic: List[str] = []
        seen = set()
        for layer in self.layers:
            if layer.type == "Input" or any(b in seen for b in layer.bottoms):
                for top in layer.tops:
                    seen.add(top)
                    dynamic.append(top)
        return dynamic


def _bin_name(param_name: str) -> str:
    return param_name[: -len(".param")] + ".bin" if param_name.endswith(".param") else BIN_FILE


# ----------------------------------------------------------------------------- conversion


def _graph_inputs(model) -> List[Tuple[str, List[int], np.dtype]]:
    from onnx import helper

    initializers = {t.name for t in model.graph.initializer}
    found = []
    for value in model.graph.input:
        if value.name in initializers:
            continue
        tensor = value.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else -1 for d in tensor.shape.dim]
        if tensor.HasField("shape") and not dims:
            from pipeline.errors import BackendUnavailable

            raise BackendUnavailable(
                f"ncnn cannot take scalar input {value.name!r}: pnnx's inputshape cannot write a 0-d shape and an "
                "ncnn Mat has at least one dimension; run this model on ort_cpu or openvino_cpu")
        if not dims or any(d <= 0 for d in dims):
            raise ValueError(f"ncnn build: input {value.name!r} has dynamic or unknown dims {dims}; "
                             "fix them first (model.input_shapes)")
        found.append((value.name, dims, np.dtype(helper.tensor_dtype_to_np_dtype(tensor.elem_type))))
    return found


def _convert(source: Path, inputs, model) -> Tuple[Path, Path]:
    """pnnx in the scratch folder of ``source``; the ncnn param and bin it wrote."""
    executable = pnnx_executable()
    if executable is None:
        raise RuntimeError(f"pnnx is not installed: {INSTALL_HINT}")
    shapes = ",".join("[" + ",".join(str(d) for d in dims) + "]" + _PNNX_TYPES.get(dtype.name, "f32")
                      for _, dims, dtype in inputs)
    command = [str(executable), source.name, f"inputshape={shapes}", "fp16=0", "device=cpu", "optlevel=2"]
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
        raise RuntimeError(f"pnnx cannot convert {noun} {named}: ncnn has no such layer")
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


# ----------------------------------------------------------------------------- name mapping


def node_key(node, position: int) -> str:
    """An ONNX node's name as parity's reports give it (pipeline.layerwise.Graph)."""
    return node.name or f"{node.op_type}_{position}"


class _Fingerprint:
    """What the name mapping compares of a tensor over the mapping runs: its shape, and per
    run its norm and the values at a fixed sample of positions."""

    def __init__(self):
        self.size: Optional[int] = None
        self.shape: Tuple[int, ...] = ()
        self.nonfinite = 0
        self.norms: List[float] = []
        self.samples: List[np.ndarray] = []

    def add(self, value: np.ndarray) -> None:
        flat = np.asarray(value, dtype=np.float64).reshape(-1)
        if self.size is None:
            self.size, self.shape = flat.size, tuple(int(d) for d in np.shape(value))
        elif flat.size != self.size:
            self.size = -1  # not one tensor: matches nothing
        finite = np.isfinite(flat)
        self.nonfinite += int(flat.size - finite.sum())
        flat = np.where(finite, flat, 0.0)
        self.norms.append(float(np.linalg.norm(flat)))
        self.samples.append(flat[_positions(flat.size)])

    def error(self, other: "_Fingerprint") -> float:
        """The worst relative L2 error of ``self`` against ``other`` over the runs, on the
        sampled positions (inf: no match; a tensor that is zero in every run matches nothing)."""
        if self.size != other.size or self.size in (None, -1) or len(self.norms) != len(other.norms) \
                or self.nonfinite != other.nonfinite or not any(other.norms):
            return float("inf")
        worst = 0.0
        for norm, other_norm, sample, other_sample in zip(self.norms, other.norms, self.samples, other.samples):
            if abs(norm - other_norm) > 2 * MATCH_TOLERANCE * other_norm:
                return float("inf")
            scale = np.linalg.norm(other_sample)
            difference = np.linalg.norm(sample - other_sample)
            if scale == 0:
                if difference:
                    return float("inf")
                continue
            worst = max(worst, float(difference / scale))
        return worst


_POSITIONS: Dict[int, np.ndarray] = {}


def _positions(size: int) -> np.ndarray:
    if size not in _POSITIONS:
        if size <= MATCH_SAMPLE:
            _POSITIONS[size] = np.arange(size)
        else:
            _POSITIONS[size] = np.sort(np.random.default_rng(size).choice(size, MATCH_SAMPLE, replace=False))
    return _POSITIONS[size]


def _squeezed(shape: Sequence[int]) -> Tuple[int, ...]:
    return tuple(d for d in shape if d != 1)


def _ncnn_shape(onnx_shape: Sequence[int]) -> Tuple[int, ...]:
    shape = tuple(onnx_shape)
    return shape[1:] if len(shape) > 1 and shape[0] == 1 else shape


def _match_inputs(inputs, rng) -> Dict[str, np.ndarray]:
    feeds = {}
    for name, dims, dtype in inputs:
        if np.issubdtype(dtype, np.floating):
            feeds[name] = rng.standard_normal(dims).astype(dtype)
        else:
            feeds[name] = np.zeros(dims, dtype=dtype)
    return feeds


def _onnx_fingerprints(model, runs: List[Dict[str, np.ndarray]],
                       budget: int = 256 << 20) -> Tuple[Dict[str, _Fingerprint], Dict[str, list]]:
    """Fingerprints and shapes of every float activation of the ONNX model, by ONNX Runtime
    (fp32, optimizations off), in sessions whose outputs stay under ``budget`` bytes."""
    import onnx
    import onnxruntime as ort

    from pipeline.backends.onnxruntime import untimed_options
    from pipeline.layerwise import dynamic_outputs, element_counts

    initializers = {t.name for t in model.graph.initializer}
    inputs = [i.name for i in model.graph.input if i.name not in initializers]
    names = list(dict.fromkeys(dynamic_outputs(model.graph.node, inputs)))
    counts = element_counts(model)  # chunking only
    groups, current, size = [], [], 0
    for name in names:
        nbytes = 4 * counts.get(name, 1 << 20)
        if current and size + nbytes > budget:
            groups.append(current)
            current, size = [], 0
        current.append(name)
        size += nbytes
    groups += [current] if current else []
    prints: Dict[str, _Fingerprint] = {}
    shapes: Dict[str, list] = {}
    options = untimed_options()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    with tempfile.TemporaryDirectory(prefix="parity-ncnn-map-") as scratch:
        for number, group in enumerate(groups):
            probe = onnx.ModelProto()
            probe.CopyFrom(model)
            del probe.graph.output[:]
            probe.graph.output.extend(onnx.ValueInfoProto(name=name) for name in group)
            path = Path(scratch) / f"probe{number}.onnx"
            onnx.save(probe, str(path))
            session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
            for feeds in runs:
                for name, value in zip(group, session.run(group, feeds)):
                    value = np.asarray(value)
                    if np.issubdtype(value.dtype, np.floating) and value.size:
                        prints.setdefault(name, _Fingerprint()).add(value)
                        shapes.setdefault(name, [int(d) for d in value.shape])
            del session
    return {name: p for name, p in prints.items() if len(p.norms) == len(runs)}, shapes


def _ncnn_fingerprints(param_path: Path, bin_path: Path, network: Param, runs: List[Dict[str, np.ndarray]],
                       input_blobs: Dict[str, str]) -> Dict[str, _Fingerprint]:
    """Fingerprints of every activation blob of the converted net, on the CPU in fp32."""
    import ncnn

    net = ncnn.Net()
    _set_options(net.opt, {"use_vulkan": False})
    producers = network.producers()
    blobs = [blob for blob in network.dynamic_blobs()
             if blob in producers and producers[blob].type not in (*_ALIAS_LAYERS, "Input")]
    prints: Dict[str, _Fingerprint] = {}
    try:
        if net.load_param(str(param_path)) != 0 or net.load_model(str(bin_path)) != 0:
            raise RuntimeError("ncnn cannot load the param/bin pnnx wrote")
        for feeds in runs:
            extractor = net.create_extractor()
            extractor.set_light_mode(False)
            held = []
            for onnx_name, blob in input_blobs.items():
                value = feeds[onnx_name]
                array = np.ascontiguousarray(value.reshape(_ncnn_shape(value.shape)), dtype=np.float32)
                held.append(array)
                extractor.input(blob, ncnn.Mat(array))
            for blob in blobs:
                code, mat = extractor.extract(blob)
                value = np.array(mat, dtype=np.float32) if code == 0 else None
                if value is not None and value.size:
                    prints.setdefault(blob, _Fingerprint()).add(value)
            extractor.clear()
            del extractor, held
    finally:
        net.clear()
    return {blob: p for blob, p in prints.items() if len(p.norms) == len(runs)}


# ops whose output holds their input's values in the same order
_VALUE_PRESERVING = {"Identity", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Dropout"}


def _computed_downstream(model, floats: set):
    """A function: tensor -> the float tensors computed from it through at least one op
    that changes values (a Relu that happened to see no negative input is such an op);
    shape computations (Shape -> ... -> a Reshape's shape input) are not followed."""
    consumers: Dict[str, list] = {}
    for node in model.graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)

    def successors(tensor: str):
        return [(output, node.op_type in _VALUE_PRESERVING) for node in consumers.get(tensor, [])
                for output in node.output if output in floats]

    return _cached_walk(successors)


def map_names(model, param_path: Path, bin_path: Path) -> dict:
    """ONNX <-> ncnn names of the converted net: the ``inputs``, ``outputs``, ``blobs``,
    ``blob_aliases``, ``shapes`` and ``layers`` entries of the build options (module docstring)."""
    network = Param.read(param_path)
    graph_inputs = _graph_inputs(model)
    blob_names = {top for layer in network.layers for top in layer.tops}
    inputs = {name: f"in{i}" for i, (name, _, _) in enumerate(graph_inputs)}
    outputs = {value.name: f"out{i}" for i, value in enumerate(model.graph.output)}
    missing = [blob for blob in [*inputs.values(), *outputs.values()] if blob not in blob_names]
    if missing:
        raise RuntimeError(f"pnnx's ncnn model has no blob {missing[0]!r} for the ONNX model's "
                           f"{len(inputs)} inputs and {len(outputs)} outputs")
    rng = np.random.default_rng(0)
    runs = [_match_inputs(graph_inputs, rng) for _ in range(MATCH_RUNS)]
    onnx_prints, shapes = _onnx_fingerprints(model, runs)
    if any(onnx_prints[name].nonfinite for name in outputs if name in onnx_prints):
        runs = [{name: (np.abs(value) if np.issubdtype(value.dtype, np.floating) else value)
                 for name, value in feeds.items()} for feeds in runs]  # e.g. a Log or Sqrt of the input
        onnx_prints, shapes = _onnx_fingerprints(model, runs)
    ncnn_prints = _ncnn_fingerprints(param_path, bin_path, network, runs, inputs)
    for name, dims, _ in graph_inputs:
        shapes[name] = list(dims)

    order = {blob: i for i, blob in enumerate(network.dynamic_blobs())}
    downstream = _computed_downstream(model, set(onnx_prints))
    best: Dict[str, Tuple[tuple, str]] = {}  # onnx tensor -> (rank, blob)
    reproduces: Dict[str, Tuple[tuple, str]] = {}  # blob -> (rank, onnx tensor)
    candidates = _value_matches(ncnn_prints, onnx_prints, shapes, order)
    resolved = resolve_by_structure({blob: set(m) for blob, m in candidates.items()}, downstream,
                                    _ncnn_downstream(network))
    for blob, matches in candidates.items():
        matches = {name: rank for name, rank in matches.items() if name in resolved[blob]}
        # a blob equal to a tensor and to one computed from it holds the computed one
        # (ncnn's fused convrelu holds the Relu's output even where the Conv's is >= 0)
        dropped = [name for name in matches if any(other in matches for other in downstream(name))]
        for name in dropped:
            del matches[name]
        for name, rank in matches.items():
            if name not in best or rank < best[name][0]:
                best[name] = (rank, blob)
            if blob not in reproduces or rank < reproduces[blob][0]:
                reproduces[blob] = (rank, name)
    blobs = {name: blob for name, (_, blob) in best.items()}
    blobs.update(outputs)  # inputs and outputs by position, whatever their values
    blobs.update(inputs)
    ordered = {name: blobs[name] for name in [*inputs, *_topological(model, blobs), *outputs] if name in blobs}
    chosen = set(ordered.values())
    # blobs holding the same values as a mapped tensor in another layout (before a Reshape)
    aliases = {blob: name for blob, (_, name) in sorted(reproduces.items(), key=lambda i: order.get(i[0], 0))
               if blob not in chosen and name in ordered}
    computed = dict(ordered)  # the first blob holding each tensor's values: its layer computes it
    for blob, name in aliases.items():
        if order.get(blob, 0) < order.get(computed[name], 0):
            computed[name] = blob
    layers = _map_layers(model, network, computed, set(inputs))
    return {"inputs": inputs, "outputs": outputs, "blobs": ordered, "blob_aliases": aliases,
            "shapes": {name: shapes[name] for name in ordered if name in shapes}, "layers": layers}


def _value_matches(ncnn_prints, onnx_prints, shapes, order) -> Dict[str, Dict[str, tuple]]:
    """{blob: {ONNX tensor it reproduces: rank}}; rank: shape differs, squeezed shape
    differs, error, the blob's position (smaller is better)."""
    by_size: Dict[int, List[str]] = {}
    for name, fingerprint in onnx_prints.items():
        by_size.setdefault(fingerprint.size, []).append(name)
    candidates = {}
    for blob, fingerprint in ncnn_prints.items():
        matches = {}
        for name in by_size.get(fingerprint.size, []):
            error = fingerprint.error(onnx_prints[name])
            if error <= MATCH_TOLERANCE:
                wanted = _ncnn_shape(shapes[name])
                matches[name] = (fingerprint.shape != wanted, _squeezed(fingerprint.shape) != _squeezed(wanted),
                                 error, order.get(blob, 0))
        candidates[blob] = matches
    return candidates


_VALUE_PRESERVING_LAYERS = {"Reshape", "Flatten", "Squeeze", "ExpandDims", "Noop", "Dropout", *_ALIAS_LAYERS}


def _ncnn_downstream(network: Param):
    """A function: blob -> the blobs computed from it through at least one ncnn layer that
    changes values (the ncnn side of _computed_downstream)."""
    consumers: Dict[str, list] = {}
    for layer in network.layers:
        for blob in layer.bottoms:
            consumers.setdefault(blob, []).append(layer)

    def successors(blob: str):
        return [(top, layer.type in _VALUE_PRESERVING_LAYERS) for layer in consumers.get(blob, []) for top in layer.tops]

    return _cached_walk(successors)


def _cached_walk(successors):
    """A function: node -> the nodes reached from it through at least one step that changes
    values; ``successors(node)`` gives (next node, whether that step preserves values)."""
    cache: Dict[str, set] = {}

    def downstream(start: str) -> set:
        if start not in cache:
            found, seen, stack = set(), set(), [(start, False)]
            while stack:
                current, changed = stack.pop()
                if (current, changed) in seen:
                    continue
                seen.add((current, changed))
                if changed:
                    found.add(current)
                stack.extend((after, changed or not preserves) for after, preserves in successors(current))
            cache[start] = found
        return cache[start]

    return downstream


def resolve_by_structure(matches: Dict[str, set], onnx_downstream, ncnn_downstream) -> Dict[str, set]:
    """Value matches made unambiguous by graph order. Where blobs reproduce a tensor *and*
    tensors computed from it (``x + 1e-8`` equals ``x`` in fp32: the reduction's blob and the
    Add's blob both match both tensors), the blobs and tensors of such a chain are ranked by
    how many value-changing ops of the chain precede them (in ncnn and in ONNX) and paired
    rank for rank, aligned at the end: ops ncnn fused away (a Conv's output inside
    ``convrelu``) have no blob and are the earlier ones of their group, so the first blob
    takes the later tensor. {blob: ONNX tensors} in, the same with those chains resolved out."""
    chained = {blob: {name for name in names if any(other in onnx_downstream(name) or name in onnx_downstream(other)
                                                    for other in names if other != name)}
               for blob, names in matches.items()}
    resolved = {blob: set(names) for blob, names in matches.items()}
    for blobs, tensors in _chains(chained):
        tensor_rank = {t: sum(t in onnx_downstream(o) for o in tensors if o != t) for t in tensors}
        blob_rank = {b: sum(b in ncnn_downstream(o) for o in blobs if o != b) for b in blobs}
        offset = max(0, max(tensor_rank.values()) - max(blob_rank.values()))
        for blob in blobs:
            keep = {t for t in chained[blob] if tensor_rank[t] == blob_rank[blob] + offset}
            if keep:
                resolved[blob] = (matches[blob] - chained[blob]) | keep
    return resolved


def _chains(chained: Dict[str, set]) -> List[Tuple[List[str], set]]:
    """Groups of blobs whose chained tensors overlap, with the union of those tensors."""
    groups: List[Tuple[List[str], set]] = []
    for blob, tensors in chained.items():
        if not tensors:
            continue
        joined = [g for g in groups if g[1] & tensors]
        merged = ([blob] + [b for g in joined for b in g[0]], set(tensors).union(*(g[1] for g in joined)))
        groups = [g for g in groups if g not in joined] + [merged]
    return groups


def _map_isolated(source: Path, param_path: Path, bin_path: Path, model) -> dict:
    """map_names in a child Python process: ncnn running a freshly converted net must not
    be able to take the build down. If the child dies or fails, only the inputs and outputs
    (named by position) are mapped and ``mapping_error`` says why."""
    result_path = source.parent / "mapping.json"
    command = [sys.executable, "-c", "import sys; from pipeline.backends.ncnn import _mapping_main; _mapping_main()",
               str(source), str(param_path), str(bin_path), str(result_path)]
    root = str(Path(__file__).resolve().parents[2])  # the folder holding the pipeline package
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    try:
        done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=MAP_TIMEOUT_S,
                              env=env, check=False)
        if done.returncode == 0 and result_path.exists():
            return json.loads(result_path.read_text())
        lines = [line for line in done.stdout.decode(errors="replace").splitlines() if line.strip()]
        status = f"signal {-done.returncode}" if done.returncode < 0 else f"exit status {done.returncode}"
        reason = f"the mapping process ended with {status}" + (f": {lines[-1].strip()}" if lines else "")
    except subprocess.TimeoutExpired:
        reason = f"the mapping process did not finish in {MAP_TIMEOUT_S} s"
    log.warning("ncnn: ONNX <-> ncnn names of intermediate tensors not mapped (%s); inputs and outputs only",
                reason)
    inputs = {name: f"in{i}" for i, (name, _, _) in enumerate(_graph_inputs(model))}
    outputs = {value.name: f"out{i}" for i, value in enumerate(model.graph.output)}
    return {"inputs": inputs, "outputs": outputs, "blobs": {**inputs, **outputs}, "blob_aliases": {},
            "shapes": {}, "layers": {}, "mapping_error": reason}


def _mapping_main() -> None:
    """Child entry of _map_isolated: argv = onnx, param, bin, result json."""
    import onnx

    source, param_path, bin_path, result_path = sys.argv[1:5]
    result = map_names(onnx.load(source), Path(param_path), Path(bin_path))
    Path(result_path).write_text(json.dumps(result))


def _topological(model, names) -> List[str]:
    from pipeline.layerwise import dynamic_outputs

    initializers = {t.name for t in model.graph.initializer}
    inputs = [i.name for i in model.graph.input if i.name not in initializers]
    return [name for name in dynamic_outputs(model.graph.node, inputs) if name in names]


def _map_layers(model, network: Param, blobs: Dict[str, str], inputs: set) -> Dict[str, List[str]]:
    """{ONNX node: [ncnn layers]}: the layer producing the blob of the node's nearest
    mapped tensor (its own output, or the first mapped tensor it feeds), then the layers
    without a mapped output that feed that layer (one group computes the node)."""
    initializers = {t.name for t in model.graph.initializer}
    dynamic = set(inputs) | {i.name for i in model.graph.input if i.name not in initializers}
    producer: Dict[str, Tuple[str, object]] = {}
    for position, node in enumerate(model.graph.node):
        if any(name in dynamic for name in node.input):
            for name in node.output:
                if name:
                    dynamic.add(name)
                    producer[name] = (node_key(node, position), node)
    producers = network.producers()
    mapped_blobs = {network.source(blob) for blob in blobs.values()}  # group boundaries

    def group(blob: str) -> List[str]:
        first = producers.get(network.source(blob))
        if first is None:
            return []
        found, stack, seen = [first.name], list(first.bottoms), set()
        while stack:
            current = network.source(stack.pop())
            if current in seen or current in mapped_blobs:
                continue
            seen.add(current)
            layer = producers.get(current)
            if layer is None or layer.type in _NOT_COMPUTE:
                continue
            found.append(layer.name)
            stack.extend(layer.bottoms)
        return found

    result: Dict[str, List[str]] = {}
    for tensor, blob in blobs.items():
        if tensor in inputs or tensor not in producer:
            continue
        layers = group(blob)
        if not layers:
            continue
        stack, seen = [tensor], set()
        while stack:  # the ONNX nodes between the mapped tensors feeding this one and it
            current = stack.pop()
            if current in seen or current not in producer:
                continue
            seen.add(current)
            key, node = producer[current]
            entry = result.setdefault(key, [])
            entry.extend(name for name in layers if name not in entry)
            for name in node.input:
                if name in producer and name not in blobs:
                    stack.append(name)
    order = {key: position for position, key in
             enumerate(node_key(node, position) for position, node in enumerate(model.graph.node))}
    return {key: result[key] for key in sorted(result, key=lambda k: order.get(k, 0))}


# ----------------------------------------------------------------------------- runtime

_OPTION_FIELDS = {"use_fp16_storage": "use_fp16_storage", "use_fp16_packed": "use_fp16_packed",
                  "use_fp16_arithmetic": "use_fp16_arithmetic", "use_bf16_storage": "use_bf16_storage"}


# Speed switches of ncnn's Option the tune stage measures; unset ones keep ncnn's default (on).
SPEED_SWITCHES = ("use_winograd_convolution", "use_sgemm_convolution", "use_packing_layout", "lightmode")


def _set_options(opt, options: dict) -> None:
    opt.use_vulkan_compute = bool(options.get("use_vulkan", False))
    for key, field in _OPTION_FIELDS.items():
        setattr(opt, field, bool(options.get(key, False)))
    opt.use_bf16_packed = bool(options.get("use_bf16_storage", False))
    opt.use_int8_inference = bool(options.get("use_int8_inference", False))
    for switch in SPEED_SWITCHES:
        if switch in options:
            setattr(opt, switch, bool(options[switch]))
    threads = int(options.get("threads", 0) or 0)
    if threads > 0:
        opt.num_threads = threads


def tuning_space(settings: dict, level: str, objective: str, devices: List[str]) -> List[Tuple[str, list]]:
    """Threads, the convolution/layout switches (normal, heavy) and, where tuning.devices
    allows, the other device (Vulkan <-> CPU)."""
    from pipeline.tuning import current_first, thread_counts

    options = settings.get("options", {})
    knobs = []
    device = str(settings.get("device", "CPU")).upper()
    others = [d.upper() for d in devices if d.upper() != device]
    if others:
        knobs.append(("device", current_first(device, others)))
    knobs.append(("threads", thread_counts(int(options.get("threads", 0) or 0))))
    if level != "fast":
        knobs += [(switch, current_first(bool(options.get(switch, True)), [True, False])) for switch in SPEED_SWITCHES]
    return knobs


def with_options(settings: dict, changes: dict) -> dict:
    """``device`` moves the session between Vulkan and the CPU; the rest are options."""
    changes = dict(changes)
    if "device" in changes:
        settings["device"] = str(changes.pop("device")).upper()
        settings["options"]["use_vulkan"] = settings["device"] == "VULKAN"
    settings["options"].update(changes)
    return settings


CPU_FP32_NOTE = ("ncnn's CPU path on this machine has no fp16 arithmetic and keeps activations fp32 (its Net casts "
                 "activations to fp16 only on ARM with asimdhp and RISC-V with zfh); use_fp16_storage at most stores "
                 "some layers' weights in fp16, which is storage, not execution precision")


def cpu_fp16_storage() -> bool:
    """Whether ncnn's CPU layers get fp16 activations under use_fp16_storage here: ncnn's
    NetPrivate::convert_layout (src/net.cpp) casts a blob to fp16 for a layer with
    support_fp16_storage only when built for ARM82 and the CPU has asimdhp (or RISC-V with
    zfh); x86 has no such path (only InnerProduct & co. keep fp16 weights, computed in fp32)."""
    import platform

    import ncnn

    if platform.machine().lower().startswith("riscv"):
        return True  # the binding has no zfh query; ncnn's RVV path casts when the CPU has zfh
    return bool(ncnn.cpu_support_arm_asimdhp())


_SESSIONS: "weakref.WeakSet[Session]" = weakref.WeakSet()
_GPU_USED = False


def _release_all() -> None:
    """At exit: every net first, then ncnn's GPU instance (never under a live net)."""
    for session in list(_SESSIONS):
        session.close()
    if _GPU_USED:
        try:
            import ncnn

            ncnn.destroy_gpu_instance()
        except Exception:  # noqa: BLE001 - the process is ending
            pass


atexit.register(_release_all)


class Session:
    def __init__(self, artifact_dir: Path, settings: dict):
        import ncnn

        from pipeline.backends import ncnn_int8

        global _GPU_USED
        options = dict(settings.get("options", {}))
        self._options = options
        self._param_path = Path(artifact_dir) / settings.get("model", PARAM_FILE)
        self._bin_path = Path(artifact_dir) / _bin_name(settings.get("model", PARAM_FILE))
        self._network = Param.read(self._param_path)
        self._inputs: Dict[str, str] = dict(options.get("inputs") or {})
        self._outputs: Dict[str, str] = dict(options.get("outputs") or {})
        if not self._inputs or not self._outputs:
            raise ValueError("ncnn settings lack options.inputs/outputs (the ONNX -> ncnn name mapping of build)")
        self._blobs: Dict[str, str] = {**dict(options.get("blobs") or {}), **self._outputs, **self._inputs}
        self._shapes: Dict[str, list] = dict(options.get("shapes") or {})
        for spec in list(settings.get("inputs") or []) + list(settings.get("outputs") or []):
            self._shapes.setdefault(spec["name"], list(spec["shape"]))
        self.inputs, self.outputs = list(self._inputs), list(self._outputs)

        self._net = ncnn.Net()
        _set_options(self._net.opt, options)
        self._gpu_count = 0
        self._options_vulkan = bool(options.get("use_vulkan"))
        if options.get("use_vulkan"):
            _GPU_USED = True
            self._gpu_count = ncnn.get_gpu_count()
            index = int(options.get("device_index", 0) or 0)
            if self._gpu_count and not 0 <= index < self._gpu_count:
                raise ValueError(f"device_index {index}: ncnn sees {self._gpu_count} Vulkan device(s)")
            if self._gpu_count:
                self._net.set_vulkan_device(index)
        if self._net.load_param(str(self._param_path)) != 0:
            raise RuntimeError(f"ncnn cannot load {self._param_path.name}")
        if self._net.load_model(str(self._bin_path)) != 0:
            raise RuntimeError(f"ncnn cannot load {self._bin_path.name}")
        self._probed: List[str] = []
        # blobs a requantizing int8 layer writes as int8 (ncnn_int8.int8_blobs): extracted, divided by their scale
        runs_int8 = self._net.opt.use_int8_inference or self._net.opt.use_vulkan_compute
        self._int8_blobs = ncnn_int8.int8_blobs(self._network, options.get("int8")) if runs_int8 else {}
        _SESSIONS.add(self)

    # -- running

    def _extractor(self, feeds: Dict[str, np.ndarray], keep_all: bool):
        """An extractor fed with ``feeds``, and the arrays its input Mats point into (keep
        them alive while it runs)."""
        import ncnn

        missing = [name for name in self.inputs if name not in feeds]
        if missing:
            raise KeyError(f"missing input {missing[0]!r}")
        extractor = self._net.create_extractor()
        if keep_all:
            extractor.set_light_mode(False)
        held = []
        for name in self.inputs:
            value = np.asarray(feeds[name])
            array = np.ascontiguousarray(value.reshape(_ncnn_shape(value.shape)), dtype=np.float32)
            held.append(array)
            if extractor.input(self._inputs[name], ncnn.Mat(array)) != 0:
                extractor.clear()
                raise RuntimeError(f"ncnn refused input {name!r} (blob {self._inputs[name]})")
        return extractor, held

    def _extract(self, feeds: Dict[str, np.ndarray], names: Sequence[str], keep_all: bool) -> Dict[str, np.ndarray]:
        extractor, held = self._extractor(feeds, keep_all)
        try:
            results = {}
            for name in names:
                blob = self._blobs[name]
                code, mat = extractor.extract(blob)
                if code != 0:
                    raise RuntimeError(f"ncnn could not compute blob {blob} ({name}): error {code}")
                value = np.array(mat, dtype=np.float32)
                if blob in self._int8_blobs:  # ncnn casts an int8 blob to float without its scale
                    value = value / np.float32(self._int8_blobs[blob])
                shape = self._shapes.get(name)
                if shape is not None:
                    if int(np.prod(shape)) != value.size:
                        raise ValueError(f"ncnn blob {blob} has {value.size} values, ONNX tensor {name!r} "
                                         f"{shape} needs {int(np.prod(shape))}")
                    value = value.reshape(shape)
                results[name] = value
            del held
            return results
        finally:
            extractor.clear()
            del extractor

    def run(self, feeds: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
        return self._extract(feeds, self.outputs, keep_all=False)

    def profile(self, feeds: Dict[str, np.ndarray], runs: int, warmup: int = 1,
                nodes: Optional[dict] = None, budget_s: Optional[float] = None) -> dict:
        """Per-layer times by incremental extraction: ncnn's Python API has no per-layer
        timer (NCNN_BENCHMARK is a build option the wheel lacks), but an extractor computes
        only what an extracted blob needs and, with light mode off, keeps it. Extracting
        every layer's output in param order (type 1: no layout or fp16 conversion) computes
        one layer per call; the cost of extracting the same blob again (call overhead only)
        is taken off. Light mode off makes in-place layers work on a copy of their input; on
        Vulkan every layer is submitted, waited for and downloaded on its own, overhead that
        a plain run pays once: such per-layer times overstate the GPU's share. ``nodes``: the
        converted model's index (pipeline.profiling.Nodes.to_json()); ``budget_s``: stop
        early (after one counted run at least) once it is spent."""
        import time

        from pipeline import profiling

        plan = profiling.Runs(runs, warmup, budget_s)
        timer = self._layer_times(feeds, plan)
        runs, plain = plan.counted, 0
        started = time.perf_counter()
        while plain < runs and not (plain and plan.spent()):
            self.run(feeds)
            plain += 1
        plain_ms = (time.perf_counter() - started) * 1000.0 / plain
        computes: Dict[str, List[str]] = {}
        for node, names in (self._options.get("layers") or {}).items():
            for name in names:
                computes.setdefault(name, []).append(node)
        note = None if computes else \
            f"no ncnn layer <-> ONNX node map in the build: {self._options.get('mapping_error', 'not recorded')}"
        rows = timer.layers(profiling.Nodes(nodes), runs, lambda name: computes.get(name, []))
        effective = self.effective()
        device = {key: effective[key] for key in ("device", "device_name", "device_type") if key in effective}
        return profiling.result("ncnn incremental extraction: one Extractor.extract per layer in param order, call "
                                "overhead taken off; whole run: a plain run", runs, warmup, rows, plain_ms, device,
                                note, plan.note())

    def _layer_times(self, feeds: Dict[str, np.ndarray], plan):
        """A profiling.Timer of every layer over the counted runs of ``plan`` (profiling.Runs)
        of incremental extraction; a run the time budget runs out in is given up (thousands
        of small extractions are what a loaded machine slows down most)."""
        from pipeline import profiling

        layers = [layer for layer in self._network.layers if layer.type != "Input" and layer.tops]
        kernels = {name: f"{device} {precision}" for name, device, precision in self.layer_devices()}
        timer = profiling.Timer()
        for counted in plan:
            times = self._incremental_run(feeds, layers, plan if counted and plan.counted > 1 else None)
            if times is None:
                plan.abandon()
                break
            for layer, spent in times if counted else ():
                timer.add(layer.name, spent, layer.type, kernels.get(layer.name, "CPU fp32"))
        return timer

    def _incremental_run(self, feeds: Dict[str, np.ndarray], layers, plan) -> Optional[list]:
        """[(layer, ms)] of one run extracting every layer's output in turn, or None when
        ``plan``'s budget is spent before the run ends."""
        import time

        extractor, held = self._extractor(feeds, keep_all=True)
        times = []
        try:
            for layer in layers:
                started = time.perf_counter()
                code, _ = extractor.extract(layer.tops[0], 1)
                computed = time.perf_counter()
                extractor.extract(layer.tops[0], 1)  # computed already: the call's own cost
                again = time.perf_counter()
                if code != 0:
                    raise RuntimeError(f"ncnn could not compute layer {layer.name}: error {code}")
                times.append((layer, max(0.0, (computed - started) - (again - computed)) * 1000.0))
                if plan is not None and plan.spent():
                    return None
        finally:
            extractor.clear()
            del extractor, held
        return times

    def probe(self, names: List[str]) -> dict:
        """The ONNX tensors of ``names`` that have an ncnn blob; ``tensors``: the ONNX
        names all activation blobs map to (blobs that map to none: their ncnn names)."""
        self._probed = [name for name in names if name in self._blobs and name not in self._inputs]
        aliases = dict(self._options.get("blob_aliases") or {})
        mapped = {self._network.source(blob) for blob in [*self._blobs.values(), *aliases]}
        producers = self._network.producers()
        unmapped = [blob for blob in self._network.dynamic_blobs()
                    if blob not in mapped and producers[blob].type not in (*_ALIAS_LAYERS, "Input")]
        tensors = sorted({name for name in self._blobs if name not in self._inputs} | set(unmapped))
        return {"exposed": list(self._probed), "tensors": tensors}

    def run_probe(self, feeds: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
        return self._extract(feeds, self._probed, keep_all=True)

    # -- what ran

    def layer_devices(self) -> List[Tuple[str, str, str]]:
        """(ncnn layer, device, precision) of every compute layer, as ncnn runs them."""
        from pipeline.backends.ncnn_int8 import runs_int8

        opt = self._net.opt
        vulkan = bool(opt.use_vulkan_compute)
        params = {layer.name: layer for layer in self._network.layers}
        rows = []
        for layer in self._net.layers():
            if layer.type in _NOT_COMPUTE:
                continue
            mask = params[layer.name].featmask if layer.name in params else 0
            on_gpu = vulkan and bool(layer.support_vulkan) and not mask & MASK_BITS["no_vulkan"]
            if layer.name in params and runs_int8(params[layer.name], on_gpu, opt):
                rows.append((layer.name, "VULKAN" if on_gpu else "CPU", "int8"))
                continue
            fp16_storage = (opt.use_fp16_storage or opt.use_fp16_packed) and not mask & MASK_BITS["no_fp16_storage"]
            fp16_math = opt.use_fp16_arithmetic and not mask & MASK_BITS["no_fp16_arithmetic"]
            bf16 = opt.use_bf16_storage and not mask & MASK_BITS["no_bf16_storage"]
            if on_gpu:
                precision = "fp16" if fp16_storage or fp16_math else "bf16" if bf16 else "fp32"
            else:
                cpu_fp16 = fp16_storage and layer.support_fp16_storage and cpu_fp16_storage()
                precision = "bf16" if bf16 and layer.support_bf16_storage else "fp16" if cpu_fp16 else "fp32"
            rows.append((layer.name, "VULKAN" if on_gpu else "CPU", precision))
        return rows

    def effective(self) -> Dict[str, str]:
        from pipeline.backends import ncnn_int8

        rows = self.layer_devices()
        devices = Counter(device for _, device, _ in rows)
        precisions = Counter(precision for _, _, precision in rows)
        reduced = [p for p in ("fp16", "bf16") if precisions.get(p)]
        precision = max(reduced, key=lambda p: precisions[p]) if reduced else "fp32"
        device = "VULKAN" if devices.get("VULKAN") else "CPU"
        layers = ", ".join(f"{name.lower()}: {devices[name]}" for name in ("VULKAN", "CPU") if devices.get(name))
        int8 = ncnn_int8.read_back(rows, self._network, self._options.get("int8"))
        if int8:
            precision, layers = int8["precision"], f"{layers}; {int8['layers']}"
        masked = {layer.name: layer.featmask for layer in self._network.layers if layer.featmask}
        if masked:
            layers += " (masked: " + ", ".join(f"{name}={mask}" for name, mask in masked.items()) + ")"
        opt = self._net.opt
        result = {"device": device, "precision": precision, "layers": layers,
                  "runtime_options": {"threads": opt.num_threads, "use_int8_inference": bool(opt.use_int8_inference),
                                      **{s: bool(getattr(opt, s)) for s in SPEED_SWITCHES}}}
        if int8:
            result.update(float_ops=int8["float_ops"], int8_layers=int8["int8_layers"])
            if int8.get("note"):
                result["note"] = int8["note"]
        if device == "VULKAN":
            result.update(self._vulkan_device())
        if self._options_vulkan and not self._gpu_count:
            result["note"] = NO_VULKAN_DEVICE
        elif precision == "fp32" and (opt.use_fp16_storage or opt.use_fp16_packed or opt.use_fp16_arithmetic):
            result["note"] = CPU_FP32_NOTE
        return result

    def _vulkan_device(self) -> Dict[str, str]:
        """The Vulkan device's name and kind (ncnn's GpuInfo.type: 0 discrete, 1 integrated,
        2 virtual, 3 cpu): Mesa's lavapipe is a Vulkan driver running on the CPU."""
        import ncnn

        info = ncnn.get_gpu_info(int(self._options.get("device_index", 0) or 0))
        return {"device_name": str(info.device_name()), "device_type": VULKAN_DEVICE_TYPES.get(info.type(), "unknown")}

    def close(self) -> None:
        net = getattr(self, "_net", None)
        if net is not None:
            net.clear()
            self._net = None
        _SESSIONS.discard(self)
