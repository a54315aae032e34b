"""int8 and mixed with MNN's own offline quantizer (``build_int8``)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

import numpy as np

from pipeline.backends.mnn.common import _mnn_graph, MODEL, PRECISION_MODES, run_tool, write_json
from pipeline.backends.mnn.session import Session
from pipeline.backends.mnn.names import onnx_ops, op_census
from pipeline.backends.mnn.conversion import convert, _finish

# parity's calibration methods -> MNN's feature_quantize_method (MNN offers KL, ADMM and EMA)
FEATURE_METHODS = {
    "kl": ("KL", "same method: KL divergence of the activation histogram (model inputs: max)"),
    "percentile": ("KL", "MNN has no percentile method; KL is the closest (it also clips the histogram's tail)"),
    "mse": ("ADMM", "MNN's ADMM minimizes the squared quantization error of each activation"),
    "max": ("EMA", "MNN has no plain max-range method; EMA (moving-average min/max ranges) is the closest"),
}
AUTO_CANDIDATES = ("KL", "ADMM", "EMA")
# measured (MNN 3.6.1, digits model): EMA quantizes the ops skip_quant_op_names names; KL and ADMM keep them float
IGNORES_SKIP = ("EMA",)
EVAL_SAMPLES = 8  # calibration samples the quantized candidates are compared on
QUANTIZE_TIMEOUT_S = 3600
REFERENCE_OPTIONS = {"backend": "CPU", "forward_type": 0, "precision_mode": PRECISION_MODES["high"]}


def build_int8(onnx_path: Path, out_dir: Path, target, calibration: List[Dict[str, np.ndarray]],
               method: str, float_ops: Sequence[str] = ()) -> Tuple[List[str], dict]:
    """int8 with MNN's offline quantizer: symmetric int8 weights per channel (MAX_ABS),
    activations per tensor with MNN's feature_quantize_method mapped from parity's method
    (``FEATURE_METHODS``; auto quantizes with KL, ADMM and EMA and keeps the model whose
    outputs agree best with the fp32 MNN model on the first calibration samples).
    ``float_ops`` (precision=mixed): ONNX nodes kept float, given to the quantizer as
    ``skip_quant_op_names``; a candidate that still ran one of them in int8 is refused."""
    if not calibration:
        raise ValueError("MNN's quantizer needs calibration samples")
    out_dir = Path(out_dir)
    with tempfile.TemporaryDirectory(prefix="parity-mnn-int8-") as scratch:
        scratch = Path(scratch)
        fp32 = scratch / "fp32.mnn"
        convert(Path(onnx_path), fp32)
        samples_dir = write_samples(calibration, scratch / "samples")
        skip, unmapped = skipped_ops(onnx_ops(fp32, Path(onnx_path), calibration[0]), float_ops)
        candidates, reason = _candidates(method, _has_batchnorm(fp32), bool(skip))
        eval_feeds = calibration[:EVAL_SAMPLES]
        fp32_session = Session(fp32, REFERENCE_OPTIONS)
        outputs = [{"name": name} for name in fp32_session.outputs]
        reference = _outputs_of(fp32_session, eval_feeds)
        scores, failures = {}, {}
        for candidate in candidates:
            path = scratch / f"int8_{candidate}.mnn"
            write_json(scratch / f"{candidate}.json", quantizer_config(samples_dir, calibration, candidate, skip))
            try:
                quantize(fp32, path, scratch / f"{candidate}.json")
                _check_skipped(path, skip, calibration[0])
                scores[candidate] = _cosine(reference, _outputs_of(Session(path, REFERENCE_OPTIONS, outputs=outputs),
                                                                   eval_feeds))
            except RuntimeError as err:  # a crash, an op not skipped, an output lost (one NMS also reads)
                failures[candidate] = str(err)
        if not scores:
            raise RuntimeError("; ".join(f"{m}: {e}" for m, e in failures.items()))
        chosen = max(scores, key=lambda m: scores[m])
        shutil.move(str(scratch / f"int8_{chosen}.mnn"), str(out_dir / MODEL))
        quantization = {"tool": "MNN offline quantization (_tools.mnnquant, the quantized.out tool)",
                        "method": method, "feature_quantize_method": chosen,
                        "mapping": reason, "weight_quantize_method": "MAX_ABS",
                        "weights": "int8 symmetric, per channel", "activations": "int8 symmetric, per tensor",
                        "samples": len(calibration), "input_type": "sequence (parity's calibration tensors as text)",
                        "output_cosine_vs_fp32": {m: round(s, 6) for m, s in scores.items()},
                        "cosine_samples": len(eval_feeds)}
        if float_ops:
            quantization.update({"float_ops": list(float_ops), "skip_quant_op_names": skip,
                                 "float_ops_not_in_mnn": unmapped})
        if failures:
            quantization["failed"] = failures
        return _finish(Path(onnx_path), out_dir, target, "int8", {"quantization": quantization}, converted=fp32,
                       feeds=calibration[0])


def _candidates(method: str, has_batchnorm: bool, skipping: bool) -> Tuple[List[str], str]:
    """MNN's feature methods to quantize with, and why."""
    if method == "auto":
        candidates = list(AUTO_CANDIDATES)
        reason = "auto: each of MNN's methods quantized the model; kept the best output cosine vs fp32"
    else:
        mapped, reason = FEATURE_METHODS[method]
        candidates = [mapped]
    if has_batchnorm:  # MNN's quantizer switches to EMA itself
        candidates = ["EMA"]
        reason += "; the converted model keeps BatchNorm ops, for which MNN's quantizer always uses EMA"
    if skipping:
        kept = [c for c in candidates if c not in IGNORES_SKIP]
        if not kept:
            from pipeline.errors import ConfigError

            fix = ("the model keeps BatchNorm ops, which force EMA: use precision=int8" if has_batchnorm
                   else "use calibration.method=kl, percentile, mse or auto")
            raise ConfigError(f"precision=mixed on MNN: its EMA quantizer ignores skip_quant_op_names and cannot keep "
                              f"the qtable's ops float ({fix})")
        if kept != candidates:
            reason += "; mixed: EMA left out (it ignores skip_quant_op_names)"
        candidates = kept
    return candidates, reason


def skipped_ops(ops: Dict[str, str], float_ops: Sequence[str]) -> Tuple[List[str], List[str]]:
    """(the MNN ops computing the ONNX nodes in ``float_ops``: skip_quant_op_names, the
    nodes no MNN op computes)."""
    wanted = set(float_ops)
    skip = sorted(name for name, node in ops.items() if node in wanted)
    mapped = set(ops.values())
    return skip, [node for node in float_ops if node not in mapped]


def _check_skipped(mnn_path: Path, skip: List[str], feeds: Dict[str, np.ndarray]) -> None:
    """The quantized model runs every skipped op in float (read back from MNN's per-op tags)."""
    if not skip:
        return
    still = sorted({name for name, _, int8 in op_census(mnn_path, feeds) if int8 and name in skip})
    if still:
        raise RuntimeError(f"MNN's quantizer ignored skip_quant_op_names: {', '.join(still)} ran in int8")


def write_samples(calibration: List[Dict[str, np.ndarray]], folder: Path) -> Path:
    """One folder per sample with ``<input>.txt`` (the values, C order, one row per last
    axis) and ``input.json`` (the shapes): MNN's quantizer input_type "sequence"."""
    folder.mkdir(parents=True)
    for index, feeds in enumerate(calibration):
        sample = folder / f"{index:06d}"
        sample.mkdir()
        shapes = []
        for name, value in feeds.items():
            if "/" in name or os.sep in name or name in ("", ".", ".."):
                raise ValueError(f"input {name!r}: MNN's quantizer reads <input>.txt files and cannot take this name")
            array = np.asarray(value, dtype=np.float32)
            rows = array.reshape(-1, array.shape[-1]) if array.ndim > 1 else array.reshape(1, -1)
            np.savetxt(sample / f"{name}.txt", rows, fmt="%.9g")
            shapes.append({"name": name, "shape": [int(d) for d in array.shape]})
        write_json(sample / "input.json", {"inputs": shapes})
    return folder


def quantizer_config(samples_dir: Path, calibration: List[Dict[str, np.ndarray]], feature_method: str,
                     skip: Sequence[str] = ()) -> dict:
    """MNN's quantizer config (tools/quantization calibration.cpp reads these keys);
    ``skip``: MNN op names left float (skip_quant_op_names, matched against the op names
    of a session of the fp32 model)."""
    first = calibration[0]
    return {"path": str(samples_dir), "used_sample_num": len(calibration), "skip_quant_op_names": list(skip),
            "feature_quantize_method": feature_method, "weight_quantize_method": "MAX_ABS",
            "feature_clamp_value": 127, "weight_clamp_value": 127, "quant_bits": 8,
            "batch_size": 1,  # the sequence reader fills one sample per batch
            "input_type": "sequence",
            "inputs": [{"name": name, "shape": [int(d) for d in np.shape(value)]} for name, value in first.items()]}


def quantize(src: Path, dst: Path, config: Path, timeout_s: float = QUANTIZE_TIMEOUT_S) -> None:
    """Run MNN's quantizer in a child process (common.run_tool)."""
    run_tool("mnnquant", ["mnnquant", str(src), str(dst), str(config)], Path(dst), timeout_s, "MNN's quantizer")


def _has_batchnorm(mnn_path: Path) -> bool:
    return any(info["op"] == "BatchNorm" for info in _mnn_graph(mnn_path).values())


def _outputs_of(session: Session, feeds_list: List[Dict[str, np.ndarray]]) -> List[np.ndarray]:
    """The session's outputs on each feed, flattened; a quantized model's session is opened
    with the fp32 model's outputs, which it may outnumber (an LSTM's states come out of
    MNN's quantizer as outputs)."""
    return [np.concatenate([v.ravel() for v in session.run(feeds).values()]) for feeds in feeds_list]


def _cosine(reference: List[np.ndarray], actual: List[np.ndarray]) -> float:
    ref = np.concatenate(reference).astype(np.float64)
    out = np.concatenate(actual).astype(np.float64)
    if not np.isfinite(out).all():
        return float("-inf")
    denominator = float(np.linalg.norm(ref) * np.linalg.norm(out))
    return float(ref @ out / denominator) if denominator else (1.0 if not ref.any() and not out.any() else 0.0)
