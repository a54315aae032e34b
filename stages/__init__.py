"""The pipeline's stages, one module each.

A stage module defines:

    NAME        the stage's name in ``pipeline.stages``
    CACHEABLE   whether the runner may reuse an earlier run's output
    ON_MACHINE  (optional) "cpu" or "device": the stage runs something on this machine, so its
                cache key holds the CPU (and the target's device): stages.machine
    key_config(cfg) -> dict          the config the output depends on
    external_files(ctx) -> [Path]    files outside the run that it reads (hashed)
    run(ctx) -> StageResult

A stage reads what earlier stages produced through ``ctx.results`` (never by importing
another stage) and writes only into ``ctx.out_dir``. A cached result is keyed by the
stage's config, its inputs and ``code_version()``: no version number to remember to bump.
"""

from __future__ import annotations

import hashlib
import importlib
import os
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from types import ModuleType
from typing import Callable, Dict, List, Optional, Tuple

from pipeline import backends, environment
from pipeline.precision import kinds
from pipeline.artifacts import atomic_directory, cache_lock, sha256_json
from pipeline.config.schemas import RunConfig
from stages.results import ConvertSummary, Shape

COMPLETE = ".complete"


@lru_cache(maxsize=1)
def code_version() -> str:
    """A hash of parity's own code (every .py file of pipeline/ and stages/, paths and
    contents): part of every stage cache and memo key, so that a result computed by other
    code is never reused. Coarser than per stage on purpose: what a stage's output depends on
    reaches far into pipeline/ (quantizer, backends, metrics), and a missed dependency is a
    stale cache where a rerun costs only time. PARITY_CODE_VERSION pins it
    (scripts/cache_keys.py compares the rest of the keys across a refactor)."""
    import pipeline

    if os.environ.get("PARITY_CODE_VERSION"):
        return os.environ["PARITY_CODE_VERSION"]

    digest = hashlib.sha256()
    for package in (Path(pipeline.__file__).parent, Path(__file__).parent):
        for path in sorted(package.rglob("*.py")):
            digest.update(path.relative_to(package.parent).as_posix().encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


@dataclass
class StageResult:
    out_dir: Path
    files: Dict[str, str] = field(default_factory=dict)  # artifact role -> path relative to out_dir
    summary: Shape = field(default_factory=Shape)  # the stage's typed summary (stages/results.py)
    cache: bool = True  # False: a result that must not be reused (e.g. a backend crashed)
    reused: bool = False  # computed from work stored earlier (ctx.memo), nothing measured again

    def path(self, role: str) -> Path:
        return self.out_dir / self.files[role]

    def to_json(self) -> dict:
        summary = self.summary.to_json() if isinstance(self.summary, Shape) else self.summary
        return {"files": self.files, "summary": summary}


@dataclass
class StageContext:
    cfg: RunConfig
    run_dir: Path
    out_dir: Path
    results: Dict[str, StageResult]  # earlier stages of this run, by name
    records: List[dict]  # timing records of earlier stages
    cache_root: Optional[Path] = None  # the stage cache, when enabled
    # each earlier stage's files and their sha256 (result.json left out), as the runner
    # hashed them for the cache keys; empty without a cache
    output_hashes: Dict[str, dict] = field(default_factory=dict)
    _data_ranges: Dict[tuple, dict] = field(default_factory=dict, repr=False)  # data_ranges, read once

    def inputs(self) -> list:
        """The converted model's inputs (TensorSpec: shape, dtype, batch axis, range)."""
        from pipeline.data import TensorSpec

        return [TensorSpec(**spec) for spec in self.converted().inputs]

    def converted(self) -> ConvertSummary:
        """The convert stage's summary: the model's signature, pre-flight."""
        return self.results["convert"].summary

    def dataset(self):
        """The run's calibration and validation data, checked against the converted model's inputs."""
        from pipeline.data import memory
        from pipeline.data import open_dataset

        inputs = self.inputs()
        memory.check(self.cfg.data, inputs)  # before a byte is loaded (pipeline/data/memory.py)
        return open_dataset(self.cfg.data, inputs)

    def traceable(self, backend: ModuleType, onnx_path: Path, folder: Path) -> Path:
        """``onnx_path`` for the backend's converter: unchanged, or, for a converter that traces
        at fixed shapes (pnnx) and an input whose range the data decides, a copy in ``folder``
        with the data's range recorded (calibration and validation samples)."""
        import onnx

        from pipeline import shapes

        if not backend.CAPABILITIES.traces_at_shapes:
            return onnx_path
        model = onnx.load(str(onnx_path), load_external_data=False)
        ranges = shapes.recorded(model)
        undecided = [name for name, found in ranges.items() if found is None]
        if not undecided:
            return onnx_path
        found = self.data_ranges(undecided)
        if not found:  # no samples (random data is refused earlier): the converter says what it needs
            return onnx_path
        model = onnx.load(str(onnx_path))
        shapes.record(model, {**ranges, **found})
        traced = Path(folder) / "model.traced.onnx"
        onnx.save(model, str(traced))
        return traced

    def data_ranges(self, names: List[str]) -> dict:
        """The named inputs' ranges over the calibration and validation samples
        (shapes.of_samples), read once per stage: the converter's trace and runtime.yaml's
        served shapes both ask."""
        from pipeline import shapes

        key = tuple(sorted(names))
        if key not in self._data_ranges:
            data = self.dataset()
            self._data_ranges[key] = shapes.of_samples(
                (s.feeds for part in (data.calibration, data.validation) for s in part), list(key))
        return self._data_ranges[key]

    def served_inputs(self) -> List[dict]:
        """convert's inputs for runtime.yaml, where a dynamic input without a range is fed at
        one shape by every calibration and validation sample (a detector exported with dynamic
        axes, served at 320x320) given that shape as ``served``: the backends compile a static
        copy for it as for a range's opt (shapes.opt_shapes); the dims stay dynamic."""
        inputs = [dict(spec) for spec in self.converted().inputs]
        undecided = [spec["name"] for spec in inputs if 0 in spec["shape"] and not spec.get("range")]
        if not undecided:
            return inputs
        found = self.data_ranges(undecided)
        for spec in inputs:
            one = found.get(spec["name"])
            if one is not None and one.min == one.max:
                spec["served"] = list(one.opt)
        return inputs

    def build_into(self, folder: Path, backend: ModuleType, precision: str, model: Optional[Path],
                   ir_dir: Optional[Path] = None, own_float_ops: Optional[List[str]] = None,
                   dynamic: bool = False) -> Tuple[dict, Optional[dict]]:
        """The one way a stage builds (pipeline/backends/artifact.py): ``model`` (an ONNX file,
        or with ``ir_dir`` convert's IR) made into ``folder`` by the target's ``backend`` at
        ``precision``, traced at the data's range where the converter needs one (traceable);
        ``own_float_ops``: by the runtime's own quantizer from convert's model instead, these
        ops kept float. (runtime.yaml's settings, the ranges it was traced at or None)."""
        import onnx

        from pipeline import shapes
        from pipeline.backends import artifact

        signature = {"inputs": self.served_inputs(), "outputs": self.converted().outputs}
        if own_float_ops is not None:
            quantizer = artifact.OwnQuantizer([sample.feeds for sample in self.dataset().calibration],
                                              self.cfg.calibration.method.value, own_float_ops)
            return artifact.build(backend, self.results["convert"].path("model"), folder, self.cfg.target, precision,
                                  signature, quantizer=quantizer), None
        traced = self.traceable(backend, model, folder)
        runtime = artifact.build(backend, traced, folder, self.cfg.target, precision, signature, ir_dir,
                                 dynamic=dynamic)
        if traced == model:
            return runtime, None
        ranges = shapes.recorded(onnx.load(str(traced), load_external_data=False))
        traced.unlink()
        return runtime, {name: found.to_json() for name, found in ranges.items()}

    def memo(self, name: str, material: dict, produce: Callable[[Path], None]) -> Tuple[Path, bool]:
        """A folder holding what ``produce(folder)`` writes, reused from the cache when the
        same ``material`` (JSON) produced it before: for work a stage shares between its
        config variants (e.g. calibration statistics for every threshold method).
        Returns (folder, reused)."""
        return memo(self.cache_root, self.out_dir, name, material, produce)


def machine(target, with_device: bool = True) -> dict:
    """What work run on this machine depends on beyond its inputs (a stage's ON_MACHINE, a
    memo's material): the CPU (int8 kernels and speed differ between CPUs), whether the
    target's runtime loads here and, with_device, the target's device as its backend finds
    it now, so that a cache restored on another machine, a runtime uninstalled or a driver
    gone never serves another machine's measurement."""
    device = target.device.upper()
    backend = backends.spec(target.backend.value)
    found = {"cpu": environment.fingerprint(), "runtime": backend.available()[1] or "loads"}
    if with_device and device != "CPU" and backend.CAPABILITIES.device_identity:
        found["device"] = backend.device_identity(device)
    return found


def memo(cache_root: Optional[Path], out_dir: Path, name: str, material: dict,
         produce: Callable[[Path], None]) -> Tuple[Path, bool]:
    """StageContext.memo for callers outside a stage (precision=auto's screening timing):
    without a cache, ``produce`` writes into a fresh folder under ``out_dir``."""
    key = _memo_key(name, material)
    if cache_root is None:
        folder = out_dir / f"{name}-{key}"
        folder.mkdir(parents=True, exist_ok=True)
        produce(folder)
        return folder, False
    entry = cache_root / "memo" / name / key
    with cache_lock(cache_root, "memo", f"{name}-{key}"):  # a sweep's parallel jobs compute it once
        if (entry / COMPLETE).is_file():
            return entry, True
        with atomic_directory(entry, replace=True) as temp:
            produce(temp)
            (temp / COMPLETE).touch()
    return entry, False


def peek(cache_root: Optional[Path], name: str, material: dict) -> Optional[Path]:
    """The folder ``memo`` would reuse for this material, or None where nothing produced it yet."""
    if cache_root is None:
        return None
    entry = cache_root / "memo" / name / _memo_key(name, material)
    return entry if (entry / COMPLETE).is_file() else None


def _memo_key(name: str, material: dict) -> str:
    return sha256_json({"memo": name, "code": code_version(), "material": material})[:32]


REFERENCE_MODULE = backends.MODULES[backends.REFERENCE]  # THE reference: ONNX Runtime


def reference_settings(convert: StageResult) -> dict:
    """The fp32 reference every comparison uses: ONNX Runtime on the converted model with
    graph optimizations off (a loader's runtime.yaml for the convert stage's folder)."""
    return {"model": convert.files["model"], "precision": "fp32", "options": {"graph_optimization_level": "disabled",
                                                                             "allow_spinning": False}}


def deployable(results: Dict[str, StageResult]) -> StageResult:
    """The stage whose folder holds the artifact to verify and ship, with its runtime.yaml:
    tune's when it changed the runtime settings, else build's."""
    tuned = results.get("tune")
    return tuned if tuned is not None and "runtime" in tuned.files else results["build"]


BASELINES = "baselines"  # the build stage's folder of the builds verify runs beside the artifact


def baselines(cfg: RunConfig) -> List[str]:
    """The precisions verify runs beside the build on the same backend (TPU-MLIR's FLOAT /
    INT8 / MIX table): fp32 for every other precision, and plain int8 for mixed. The build
    stage makes them (baselines/<precision>/, with their runtime.yaml) the way it makes the
    artifact, where verify runs (pipeline.stages with it: none otherwise); verify loads them."""
    if "verify" not in cfg.pipeline.stages:
        return []
    precision = cfg.precision.kind
    return [name for name in (None if precision == kinds.REFERENCE else kinds.REFERENCE, kinds.partial_of(precision))
            if name]


def baseline_role(precision: str) -> str:
    """The build stage's result role of a baseline's runtime.yaml."""
    return f"baseline_{precision}"


def load(name: str) -> ModuleType:
    return importlib.import_module(f"stages.{name}")
