"""A session of an MNN model (``load``): run, probe, profile and what really ran."""

from __future__ import annotations

import json
import platform
import re
import shutil
import tempfile
from collections import Counter
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np

from pipeline.backends.mnn.common import (
    _captured, _COMPUTE_OPS, FORWARD_TYPES, _mnn, _mnn_graph, _mnn_root, PRECISION_MODES, runtime_exists)
from pipeline.backends.mnn.options import MEMORY_LOW_HINTS, schedule_config
from pipeline.backends.protocol import memory_low
from pipeline.precision import kinds

# getSessionInfo(BACKENDS) -> device; 13 is MNN_FORWARD_CPU_EXTENSION (the CPU backend with x86/ARM extensions)
BACKEND_NAMES = {0: "CPU", 1: "METAL", 2: "CUDA", 3: "OPENCL", 4: "AUTO", 5: "NN", 6: "OPENGL", 7: "VULKAN",
                 13: "CPU"}
SESSION_INFO_BACKENDS = 2  # Interpreter::SessionInfoCode
# MNN's ErrorCode (include/MNN/ErrorCode.hpp): what a failed run says beyond its number
ERROR_CODES = {1: "OUT_OF_MEMORY", 2: "NOT_SUPPORT: an op this backend does not run",
               3: "COMPUTE_SIZE_ERROR: MNN could not compute an op's output shape (a loop or LSTM it cannot "
                  "size, a shape it does not support)", 4: "NO_EXECUTION", 5: "INVALID_VALUE",
               10: "INPUT_DATA_ERROR", 20: "TENSOR_NOT_SUPPORT"}


class Session:
    def __init__(self, model_path: Path, options: dict, inputs: Optional[List[dict]] = None,
                 outputs: Optional[List[dict]] = None, artifact_dir: Optional[Path] = None,
                 persist_cache: bool = False):
        mnn = self._mnn = _mnn()
        self._model_path = Path(model_path)
        self._options = dict(options)
        self._artifact_dir = Path(artifact_dir) if artifact_dir else self._model_path.parent
        self._scratch = tempfile.TemporaryDirectory(prefix="parity-mnn-")
        self._interpreter = mnn.Interpreter(str(self._model_path))
        self._cache = None
        if self._options.get("cache_file"):
            # the bundle's tuning cache is read from a scratch copy, so that a run never rewrites the bundle
            bundled = self._artifact_dir / self._options["cache_file"]
            self._cache = bundled if persist_cache else Path(self._scratch.name) / self._options["cache_file"]
            if not persist_cache and bundled.is_file():
                shutil.copyfile(bundled, self._cache)
            if self._cache.is_file():
                self._interpreter.setCacheFile(str(self._cache))
            else:
                with _captured():  # MNN complains that the (new) cache file cannot be read
                    self._interpreter.setCacheFile(str(self._cache))
        if memory_low(self._options):  # target.memory=low: hints are set before the session exists
            for hint, value in MEMORY_LOW_HINTS.items():
                self._interpreter.setSessionHint(hint, value)
        self._session = self._interpreter.createSession(schedule_config(self._options))
        self._cache_pending = self._cache is not None
        self._probe = None
        self._last_feeds: Optional[Dict[str, np.ndarray]] = None
        self._effective: Optional[dict] = None
        have_inputs = self._interpreter.getSessionInputAll(self._session)
        have_outputs = self._interpreter.getSessionOutputAll(self._session)
        self._input_specs = {spec["name"]: spec for spec in inputs or []}
        self._output_specs = {spec["name"]: spec for spec in outputs or []}
        self.inputs = [n for n in self._input_specs if n in have_inputs] or sorted(have_inputs)
        wanted = list(self._output_specs) or sorted(have_outputs)
        missing = [name for name in wanted if name not in have_outputs]
        if missing:
            raise RuntimeError(f"the MNN model {self._model_path.name} has no output {missing[0]!r} (MNN's quantizer "
                               f"drops an output that another op also reads); its outputs: {', '.join(have_outputs)}")
        self.outputs = wanted
        self._tensor_map = None
        map_name = self._options.get("tensor_map")
        if map_name and (self._artifact_dir / map_name).is_file():
            self._tensor_map = json.loads((self._artifact_dir / map_name).read_text())

    def remove_scratch(self) -> None:
        """Remove the scratch folder (the copy of the bundle's tuning cache)."""
        self._scratch.cleanup()

    # -- running

    def run(self, feeds: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
        self._execute(self._session, feeds)
        self._last_feeds = feeds
        if self._cache_pending:
            self._interpreter.updateCacheFile(self._session, 0)
            self._cache_pending = False
        return {name: self._read(self._session, name, self._onnx_shape(name)) for name in self.outputs}

    def _execute(self, session, feeds: Dict[str, np.ndarray]) -> None:
        self._set_inputs(session, feeds)
        code = self._interpreter.runSession(session)
        if code != 0:
            raise _run_error("runSession", code)

    def _set_inputs(self, session, feeds: Dict[str, np.ndarray]) -> None:
        """Copy the feeds into the session's inputs, resizing the session first when a
        shape differs from the one it was prepared for."""
        mnn = self._mnn
        unknown = [name for name in feeds if name not in self.inputs]
        missing = [name for name in self.inputs if name not in feeds]
        if unknown or missing:  # MNN would run on whatever an unfed input last held
            raise ValueError(f"feeds must be exactly the model's inputs ({', '.join(self.inputs)}); "
                             f"unknown: {unknown}, missing: {missing}")
        tensors = {name: self._interpreter.getSessionInput(session, name) for name in feeds}
        resized = False
        for name, value in feeds.items():
            if tuple(tensors[name].getShape()) != tuple(np.shape(value)):
                self._interpreter.resizeTensor(tensors[name], tuple(int(d) for d in np.shape(value)))
                resized = True
        if resized:
            self._interpreter.resizeSession(session)
        for name, value in feeds.items():
            tensor = tensors[name]
            halide, dtype = self._types(tensor)
            array = np.ascontiguousarray(value, dtype=dtype)
            tensor.copyFrom(mnn.Tensor(tuple(array.shape), halide, array, mnn.Tensor_DimensionType_Caffe))

    def _types(self, tensor):
        mnn = self._mnn
        kind = tensor.getDataType()
        for halide, dtype in ((mnn.Halide_Type_Float, np.float32), (mnn.Halide_Type_Int, np.int32),
                              (mnn.Halide_Type_Int64, np.int64), (mnn.Halide_Type_Uint8, np.uint8),
                              (mnn.Halide_Type_Double, np.float64)):
            if kind == halide:
                return halide, dtype
        return mnn.Halide_Type_Float, np.float32

    def _read(self, session, name: str, shape: Optional[List[int]]) -> np.ndarray:
        """A session tensor as a host float32 array (MNN may hold NC4HW4 internally: the
        copy to a host tensor converts it to NCHW), in the ONNX shape when it is known."""
        mnn = self._mnn
        tensor = self._interpreter.getSessionOutput(session, name)
        dims = tuple(int(d) for d in tensor.getShape()) or (1,)
        halide, dtype = self._types(tensor)
        layout = (mnn.Tensor_DimensionType_Tensorflow
                  if tensor.getDimensionType() == mnn.Tensor_DimensionType_Tensorflow
                  else mnn.Tensor_DimensionType_Caffe)
        host = mnn.Tensor(dims, halide, np.zeros(dims, dtype=dtype), layout)
        tensor.copyToHostTensor(host)
        array = np.array(host.getNumpyData(), dtype=np.float32).reshape(dims)
        if shape and int(np.prod(shape)) == array.size:
            array = array.reshape(shape)
        return array

    def _onnx_shape(self, name: str) -> Optional[List[int]]:
        spec = self._output_specs.get(name, {})
        shape = spec.get("shape")
        if shape and all(isinstance(d, int) and d > 0 for d in shape):
            return list(shape)
        return None

    def example_feeds(self) -> Dict[str, np.ndarray]:
        """Seeded random inputs in the session's current input shapes."""
        rng = np.random.default_rng(0)
        feeds = {}
        for name in self.inputs:
            tensor = self._interpreter.getSessionInput(self._session, name)
            spec = self._input_specs.get(name, {})
            shape = [d if isinstance(d, int) and d > 0 else 1 for d in (spec.get("shape") or tensor.getShape())]
            _, dtype = self._types(tensor)
            value = rng.standard_normal(shape) if np.issubdtype(dtype, np.floating) else np.zeros(shape)
            feeds[name] = value.astype(dtype)
        return feeds

    # -- layerwise

    def probe(self, names: List[str]) -> dict:
        """Expose these ONNX tensors: a second session of the same model and config with
        them as ``saveTensors`` (kept from memory reuse, readable by name). Only tensors
        the build's tensor map calls faithful are exposed (fused ones hold another
        tensor's values); without a map, only tensors alone in their MNN op's group."""
        graph = _mnn_graph(self._model_path)
        if self._tensor_map is not None:
            faithful = self._tensor_map.get("faithful", {})
        else:
            groups = Counter(_mnn_root(graph, name) for name in graph if graph[name]["activation"])
            faithful = {name: {"shape": None} for name in graph
                        if graph[name]["activation"] and groups[_mnn_root(graph, name)] == 1}
        exposed = [name for name in names if name in faithful and name in graph and graph[name]["float"]]
        self._probe = None
        if exposed:
            session = self._interpreter.createSession(schedule_config(self._options, exposed))
            self._probe = (session, {name: (faithful[name] or {}).get("shape") for name in exposed})
        tensors = sorted(name for name, info in graph.items() if info["activation"])
        return {"exposed": exposed, "tensors": tensors}

    def run_probe(self, feeds: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
        if self._probe is None:
            return {}
        session, shapes = self._probe
        self._execute(session, feeds)
        return {name: self._read(session, name, shape) for name, shape in shapes.items()}

    # -- profile

    def profile(self, feeds: Dict[str, np.ndarray], runs: int, warmup: int = 1,
                nodes: Optional[dict] = None, budget_s: Optional[float] = None) -> dict:
        """Per-op times from MNN's per-op callbacks (runSessionWithCallBackInfo) on a second
        session of the same model and config: the wall time between an op's before and after
        callback, which includes a few microseconds of Python callback overhead per op.
        ``nodes``: the converted model's index (pipeline.profiling.Nodes.to_json());
        ``budget_s``: stop early (after one counted run at least) once it is spent."""
        import time

        from pipeline import profiling

        session = self._interpreter.createSession(schedule_config(self._options))
        timer, started, wall = profiling.Timer(), [0.0], 0.0
        counting = [False]

        def before(tensors, info):
            started[0] = time.perf_counter()
            return True

        def after(tensors, info):
            elapsed = (time.perf_counter() - started[0]) * 1000.0
            if counting[0]:
                kind = str(info.getType())
                timer.add(info.getName(), elapsed, kind.split(" [", 1)[0].strip(),
                          "DT_INT8" if "DT_INT8" in kind else None)
            return True

        plan = profiling.Runs(runs, warmup, budget_s)
        for counted in plan:
            counting[0] = counted
            self._set_inputs(session, feeds)
            begun = time.perf_counter()
            code = self._interpreter.runSessionWithCallBackInfo(session, before, after)
            wall += (time.perf_counter() - begun) if counting[0] else 0.0
            if code != 0:
                raise _run_error("runSessionWithCallBackInfo", code)
        runs = plan.counted
        layers = timer.layers(profiling.Nodes(nodes), runs, lambda name: _mnn_candidates(name, timer.info[name][0]))
        kind = int(self._interpreter.getSessionInfo(session, SESSION_INFO_BACKENDS))
        return profiling.result("MNN per-op callbacks (runSessionWithCallBackInfo): wall time between each op's "
                                "callbacks, Python callback overhead included; whole run: the callback run",
                                runs, warmup, layers, wall * 1000.0 / runs,
                                {"device": BACKEND_NAMES.get(kind, f"type {kind}")}, plan.note())

    # -- what ran

    def backend_type(self) -> int:
        return int(self._interpreter.getSessionInfo(self._session, SESSION_INFO_BACKENDS))

    def effective(self) -> Dict[str, str]:
        if self._effective is None:
            self._effective = self._measure()
        return dict(self._effective)

    def _measure(self) -> dict:
        kind = self.backend_type()
        device = BACKEND_NAMES.get(kind, f"type {kind}")
        feeds = self._last_feeds if self._last_feeds is not None else self.example_feeds()
        ops = self._op_census(feeds)
        mode = self._options.get("precision", "high")
        float_precision, float_note = "fp32", ""
        if mode != "high":
            float_precision, float_note = self._float_precision(feeds, mode, device)
        counts, int8_ops, float_ops = Counter(), [], {}
        onnx_of = (self._tensor_map or {}).get("ops", {})  # quantized builds: MNN op -> ONNX node
        for name, op_type, int8 in ops:
            if op_type in _COMPUTE_OPS:
                counts["int8" if int8 else float_precision] += 1
                if int8:
                    int8_ops.append(onnx_of.get(name, name))
                else:
                    float_ops[onnx_of.get(name, name)] = op_type
        if counts:
            precision = kinds.from_op_counts(counts) or counts.most_common(1)[0][0]
        else:
            precision = float_precision
        result = {"device": device, "precision": precision,
                  "layers": ", ".join(f"{k}: {v}" for k, v in sorted(counts.items())),
                  "runtime_options": self._memory_read_back()}
        if counts["int8"]:  # the compute ops by what they ran, named as the ONNX nodes they compute
            result.update({"int8_ops": int8_ops, "float_ops": float_ops})
        notes = [note for note in (fallback_reason(self), float_note) if note]
        if notes:
            result["note"] = "; ".join(notes)
        return result

    def _memory_read_back(self) -> dict:
        """target.memory and MNN's own count of the session's memory (getSessionInfo(MEMORY),
        MB): the hints themselves cannot be read back from MNN."""
        low = memory_low(self._options)
        found = {"memory": "low" if low else "default",
                 "winograd_memory_level": 0 if low else "MNN's default (3)"}
        try:
            found["session_memory_mb"] = round(float(self._interpreter.getSessionInfo(self._session, 0)), 2)
        except Exception:  # noqa: BLE001 - an MNN build without the info code
            pass
        return found

    def _op_census(self, feeds) -> List[Tuple[str, str, bool]]:
        """(op name, op type, ran in int8) of every op the session executes, from MNN's per-op
        callback; MNN names the type of an op run in int8 e.g. "Convolution [ DT_INT8 ]"."""
        ops: List[Tuple[str, str, bool]] = []

        def after(tensors, info):
            kind = str(info.getType())
            ops.append((str(info.getName()), kind.split(" [", 1)[0].strip(), "DT_INT8" in kind))
            return True

        self._set_inputs(self._session, feeds)
        code = self._interpreter.runSessionWithCallBackInfo(self._session, lambda tensors, info: True, after)
        if code != 0:
            raise _run_error("runSessionWithCallBackInfo", code)
        return ops

    def _float_precision(self, feeds, mode: str, device: str) -> Tuple[str, str]:
        """low/normal: MNN computes fp16 only where the device has fp16 arithmetic. Same
        model, same inputs, precision=high: bit-identical outputs mean fp32 ran."""
        ours = [self._read(self._session, name, None) for name in self.outputs]
        high_options = {**self._options, "precision_mode": PRECISION_MODES["high"]}
        session = self._interpreter.createSession(schedule_config(high_options))
        self._execute(session, feeds)
        theirs = [self._read(session, name, None) for name in self.outputs]
        if all(np.array_equal(a, b, equal_nan=True) for a, b in zip(ours, theirs)):
            where = (f"this {platform.machine()} CPU computed fp32 (MNN's CPU backend has fp16 arithmetic only on "
                     "ARMv8.2+ CPUs)" if device == "CPU" else f"the {device} device computed fp32")
            return "fp32", (f"precision={mode} requested; outputs are bit-identical to a precision=high session: "
                            f"{where}")
        return "fp16", f"precision={mode}: outputs differ from a precision=high session of the same model"


_MNN_INSERTED = {"Raster", "FloatToInt8", "Int8ToFloat", "ConvertTensor"}  # layout and int8 conversions


def _mnn_candidates(name: str, op_type: str) -> List[str]:
    """ONNX names an MNN op stands for: MNN names ops after their output tensor, adds
    ``_raster_N`` to the layout and int8 conversions it inserts before an op (and to some ops
    it splits, e.g. GlobalAveragePool's Pooling) and ``__matmul_converted`` to a Gemm it
    rewrote as a Convolution."""
    if op_type in _MNN_INSERTED:
        return []
    return [re.sub(r"(_raster_\d+|__matmul_converted)+$", "", name)]


def _run_error(call: str, code: int) -> RuntimeError:
    """A failed MNN run with the name of its error code."""
    return RuntimeError(f"MNN {call} returned error code {code}"
                        + (f" ({ERROR_CODES[code]})" if code in ERROR_CODES else ""))


def fallback_reason(session: Session) -> str:
    """Why the session does not run on the requested device ("" when it does)."""
    requested = session._options.get("backend", "CPU")
    ran = BACKEND_NAMES.get(session.backend_type(), "?")
    if ran == requested:
        return ""
    if requested in FORWARD_TYPES and not runtime_exists(requested):
        return (f"this MNN build ({_mnn().version()}) has no {requested} backend (Interpreter.createRuntime finds "
                f"no {requested} runtime): MNN ran the session on the {ran}")
    return f"{requested} was requested but MNN's session runs on the {ran}"


def load(artifact_dir: Path, settings: dict) -> Session:
    options = dict(settings.get("options") or {})
    if "forward_type" not in options:  # settings written by hand: the device decides
        device = str(settings.get("device", "CPU")).upper()
        options.update({"backend": device, "forward_type": FORWARD_TYPES.get(device, 0)})
    return Session(Path(artifact_dir) / settings["model"], options, settings.get("inputs"), settings.get("outputs"),
                   artifact_dir=Path(artifact_dir))
