"""ONNX Runtime: the reference backend, and the ``ort_cpu`` target."""

from __future__ import annotations

import shutil
import tempfile
from collections import Counter
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np

NAME = "onnxruntime"
PRECISIONS = ("fp32", "fp16", "int8", "mixed")
MEMORY_MODES = ("auto",)
DEVICES = ("CPU",)

_ONNX_FLOAT_TYPES = {1: "fp32", 10: "fp16", 16: "bf16"}
_INTEGER_OPS = {"QLinearConv", "QLinearMatMul", "MatMulInteger", "ConvInteger", "QGemm", "MatMulIntegerToFloat",
                "DynamicQuantizeMatMul", "QLinearAdd", "QLinearMul", "QLinearConcat", "QLinearGlobalAveragePool"}
_FLOAT_COMPUTE_OPS = {"Conv", "Gemm", "MatMul", "ConvTranspose", "FusedConv", "FusedGemm", "FusedMatMul"}


def available() -> Tuple[bool, str]:
    try:
        import onnxruntime  # noqa: F401
    except ImportError as err:
        return False, f"onnxruntime cannot be imported ({err}): pip install onnxruntime"
    return True, ""


def versions() -> Dict[str, str]:
    import onnxruntime

    return {"onnxruntime": onnxruntime.__version__}


def build(onnx_path: Path, ir_dir: Optional[Path], out_dir: Path, target, precision: str) -> Tuple[List[str], dict]:
    shutil.copyfile(onnx_path, out_dir / "model.onnx")
    options = {"graph_optimization_level": "all", "intra_op_num_threads": target.threads}
    return ["model.onnx"], {"model": "model.onnx", "options": options}


class Session:
    def __init__(self, model_path: Path, device: str = "CPU", precision: str = "fp32",
                 graph_optimization_level: str = "all", intra_op_num_threads: int = 0):
        import onnxruntime as ort

        levels = {"disabled": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
                  "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
                  "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
                  "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL}
        options = ort.SessionOptions()
        options.graph_optimization_level = levels[graph_optimization_level]
        options.intra_op_num_threads = intra_op_num_threads
        options.log_severity_level = 3
        self._scratch = tempfile.TemporaryDirectory(prefix="parity-ort-")
        self._optimized = Path(self._scratch.name) / "optimized.onnx"
        options.optimized_model_filepath = str(self._optimized)  # what ORT really executes
        self._session = ort.InferenceSession(str(model_path), options, providers=["CPUExecutionProvider"])
        self._model_path = Path(model_path)
        self.inputs = [i.name for i in self._session.get_inputs()]
        self.outputs = [o.name for o in self._session.get_outputs()]

    def run(self, feeds: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
        values = self._session.run(self.outputs, feeds)
        return dict(zip(self.outputs, values))

    def effective(self) -> Dict[str, str]:
        providers = self._session.get_providers()
        device = "CPU" if providers and providers[0] == "CPUExecutionProvider" else providers[0]
        precision, layers = executed_precision(self._optimized)
        return {"device": device, "precision": precision, "layers": layers}


def executed_precision(optimized_path: Path) -> Tuple[str, str]:
    """Precision of the compute ops in the graph ORT executes after its optimizations:
    integer kernels (QLinearConv, MatMulInteger...) count as int8, float ones by their type."""
    import onnx

    model = onnx.load(str(optimized_path), load_external_data=False)
    types = {v.name: v.type.tensor_type.elem_type for v in list(model.graph.value_info) + list(model.graph.input)}
    types.update({t.name: t.data_type for t in model.graph.initializer})
    counts: Counter = Counter()
    for node in model.graph.node:
        if node.op_type in _INTEGER_OPS:
            counts["int8"] += 1
        elif node.op_type in _FLOAT_COMPUTE_OPS or node.op_type.startswith("Fused"):
            elem = types.get(node.input[1] if len(node.input) > 1 else node.input[0], 1)
            counts[_ONNX_FLOAT_TYPES.get(elem, "fp32")] += 1
    if not counts:
        return "fp32", ""
    layers = ", ".join(f"{k}: {v}" for k, v in sorted(counts.items()))
    return ("mixed" if "int8" in counts and len(counts) > 1 else counts.most_common(1)[0][0]), layers


def load(artifact_dir: Path, settings: dict) -> Session:
    options = settings.get("options", {})
    return Session(Path(artifact_dir) / settings["model"], settings.get("device", "CPU"), settings["precision"],
                   options.get("graph_optimization_level", "all"), options.get("intra_op_num_threads", 0))


def reference(model_path: Path) -> Session:
    """The fp32 reference: ONNX Runtime on the CPU with graph optimizations off."""
    return Session(model_path, graph_optimization_level="disabled")
