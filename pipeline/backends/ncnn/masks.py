"""Per-layer feature masks: the layer names the mask search works on and ``apply_masks``,
which writes the masks as layer parameter 31 into a copy of the artifact."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Dict, List, Tuple

import numpy as np

from pipeline.backends.ncnn.common import FEATMASK_PARAM, PARAM_FILE, _ALIAS_LAYERS
from pipeline.backends.ncnn.param import Param, ParamLayer, _bin_name


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
