"""ONNX Runtime: the reference backend, and the ``ort_cpu`` target."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np

NAME = "onnxruntime"
PRECISIONS = ("fp32",)
MEMORY_MODES = ("auto",)
DEVICES = ("CPU",)

_ONNX_FLOAT_TYPES = {1: "fp32", 10: "fp16", 16: "bf16"}


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
        return {"device": device, "precision": compute_precision(self._model_path)}


def compute_precision(model_path: Path) -> str:
    """The float type the model's weights are stored and computed in."""
    import onnx

    model = onnx.load(str(model_path), load_external_data=False)
    kinds = {_ONNX_FLOAT_TYPES[t.data_type] for t in model.graph.initializer if t.data_type in _ONNX_FLOAT_TYPES}
    if not kinds:
        return "fp32"
    return "fp32" if "fp32" in kinds and len(kinds) == 1 else "+".join(sorted(kinds))


def load(artifact_dir: Path, settings: dict) -> Session:
    options = settings.get("options", {})
    return Session(Path(artifact_dir) / settings["model"], settings.get("device", "CPU"), settings["precision"],
                   options.get("graph_optimization_level", "all"), options.get("intra_op_num_threads", 0))


def reference(model_path: Path) -> Session:
    """The fp32 reference: ONNX Runtime on the CPU with graph optimizations off."""
    return Session(model_path, graph_optimization_level="disabled")
