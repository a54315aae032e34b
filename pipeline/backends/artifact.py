"""One way to build: a model made into a backend's artifact folder, its files and the runtime
settings a loader needs (runtime.yaml's). The build stage makes the shipped artifact and the
baselines verify runs beside it (fp32, plain int8 beside mixed) with it, and verify's advice
trials their candidate builds: a change to how a build is made reaches every one of them
(StageContext.build_into is the stages' way in)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import yaml

from pipeline.errors import BackendUnavailable, ConfigError, ParityError, first_line, target_cannot

RUNTIME = "runtime.yaml"
# runtime.yaml's layout: what a loader gives the runtime (backend, device, model files, the
# session options under ``options``, inputs, outputs), apart from what parity records about
# the build (manifest.json, the reports). A loader refuses a layout newer than it knows.
# 2: an input may carry ``served``, the one shape the data fed a dynamic input without a range.
RUNTIME_FORMAT = 2


@dataclass(frozen=True)
class OwnQuantizer:
    """Made by the runtime's own offline quantizer (Capabilities.own_int8, ``build_int8``) from
    convert's fp32 model: parity's calibration samples, calibration.method, the ops kept float."""

    samples: List[Dict] = field(repr=False)
    method: str
    float_ops: Sequence[str] = ()


def build(backend, model: Path, folder: Path, target, precision: str, signature: dict, ir_dir: Optional[Path] = None,
          quantizer: Optional[OwnQuantizer] = None, dynamic: bool = False) -> dict:
    """runtime.yaml's settings of ``model`` (an ONNX file, or with ``ir_dir`` convert's IR beside
    it) built into ``folder`` by ``backend`` for ``target`` at ``precision``; ``signature``:
    convert's ``inputs`` and ``outputs``; ``dynamic``: int8 with activation ranges computed per
    call. ``files`` names the artifact's files in ``folder``."""
    files, settings = _own_int8(backend, model, folder, target, precision, quantizer) if quantizer is not None \
        else _converted(backend, model, ir_dir, folder, target, precision)
    return {
        "format": RUNTIME_FORMAT,
        "backend": backend.NAME,
        "target": target.name,
        "device": target.device.upper(),
        "precision": precision,
        **({"activation_ranges": "dynamic"} if dynamic else {}),
        "memory_mode": target.memory_mode,
        "model": settings["model"],
        "files": files,
        "options": settings.get("options", {}),
        "inputs": signature["inputs"],
        "outputs": signature["outputs"],
    }


def _converted(backend, model: Path, ir_dir: Optional[Path], folder: Path, target, precision: str) -> Tuple[list, dict]:
    """The backend's build of the model; a converter that rejects or crashes on it is this
    target's limitation: exit 4, one line naming what it could not convert."""
    try:
        return backend.build(model, ir_dir, folder, target, precision)
    except ParityError:
        raise
    except RuntimeError as err:  # pnnx, MNN's converter and OpenVINO's frontend raise these; a bug of ours stays 1
        raise target_cannot(target.name, "build", err) from err


def _own_int8(backend, model: Path, folder: Path, target, precision: str, quantizer: OwnQuantizer) -> Tuple[list, dict]:
    """int8 through the backend's own offline quantizer, fed parity's calibration samples,
    the ops named to keep float (mixed: the qtable's and precision.keep_float)."""
    if not quantizer.samples:
        raise ConfigError(f"precision={precision} on {backend.NAME} needs calibration samples "
                          "(data.calibration_size > 0)")
    try:
        return backend.build_int8(model, folder, target, quantizer.samples, quantizer.method,
                                  float_ops=list(quantizer.float_ops))
    except ConfigError:  # a quantizer setting that cannot build this precision
        raise
    except Exception as err:  # noqa: BLE001 - the runtime's quantizer refused the model
        raise BackendUnavailable(f"{precision}: {backend.NAME}'s quantizer failed: {first_line(err)}") from err


def write(folder: Path, runtime: dict) -> None:
    (Path(folder) / RUNTIME).write_text(yaml.safe_dump(runtime, sort_keys=False))


def read(folder: Path) -> dict:
    return yaml.safe_load((Path(folder) / RUNTIME).read_text())


def size(folder: Path, runtime: dict) -> int:
    """The artifact's bytes (its files, not runtime.yaml)."""
    return sum((Path(folder) / name).stat().st_size for name in runtime["files"])
