"""``load`` and ``Session``: an ncnn Net run with parity's names, its profile and what
really ran; Vulkan released at exit."""

from __future__ import annotations

import atexit
import weakref
from collections import Counter
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from pipeline.backends.ncnn.common import (
    MASK_BITS, NO_VULKAN_DEVICE, PARAM_FILE, VULKAN_DEVICE_TYPES, _ALIAS_LAYERS, _NOT_COMPUTE)
from pipeline.backends.ncnn.fingerprints import _ncnn_shape
from pipeline.backends.ncnn.options import CPU_FP32_NOTE, SPEED_SWITCHES, _set_options, cpu_fp16_storage
from pipeline.backends.ncnn.param import Param, _bin_name
from pipeline.precision import kinds


def load(artifact_dir: Path, settings: dict) -> "Session":
    return Session(Path(artifact_dir), settings)


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

        from pipeline.backends.ncnn import int8 as ncnn_int8

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
        # inputs with a dynamic dim: outputs take the sample's size, not the build's shapes
        self._dynamic = any(0 in list(spec.get("shape") or []) for spec in settings.get("inputs") or [])

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
                if shape is not None and self._dynamic and int(np.prod(shape)) != value.size:
                    shape = _at_own_size(shape, value)
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
        from pipeline.backends.ncnn.int8_format import runs_int8

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
        from pipeline.backends.ncnn import int8 as ncnn_int8

        rows = self.layer_devices()
        devices = Counter(device for _, device, _ in rows)
        precisions = Counter(precision for _, _, precision in rows)
        reduced = [p for p in kinds.HALF if precisions.get(p)]
        precision = max(reduced, key=lambda p: precisions[p]) if reduced else kinds.REFERENCE
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
                                      **{s: bool(getattr(opt, s)) for s in SPEED_SWITCHES},
                                      "memory": str(self._options.get("memory", "default"))}}
        if int8:
            result.update(float_ops=int8["float_ops"], int8_layers=int8["int8_layers"])
            if int8.get("note"):
                result["note"] = int8["note"]
        if device == "VULKAN":
            result.update(self._vulkan_device())
        if self._options_vulkan and not self._gpu_count:
            result["note"] = NO_VULKAN_DEVICE
        elif precision == kinds.REFERENCE and (opt.use_fp16_storage or opt.use_fp16_packed or opt.use_fp16_arithmetic):
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


def _at_own_size(recorded: list, value: np.ndarray) -> Optional[list]:
    """An output of a dynamic-shape run in the ONNX rank: the Mat's own shape, with the
    leading batch of 1 ncnn drops put back; None (kept as ncnn gives it) otherwise."""
    if len(recorded) == value.ndim + 1 and recorded[0] == 1:
        return [1, *value.shape]
    return list(value.shape) if len(recorded) == value.ndim else None
