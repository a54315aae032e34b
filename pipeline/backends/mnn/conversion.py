"""ONNX -> MNN with the converter function, and the fp32/fp16 build (``build``)."""

from __future__ import annotations

import hashlib
import re
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np

from pipeline.backends.mnn.common import CACHE_FILE, MODEL, run_tool, runtime_exists, write_json
from pipeline.backends.mnn.options import session_options
from pipeline.backends.mnn.session import Session
from pipeline.backends.mnn.names import onnx_ops, tensor_map

TENSOR_MAP = "tensors.json"
CONVERT_TIMEOUT_S = 1800
# MNN's own LSTM/GRU/RNN ops: by default the converter rewrites them as While loops, which
# MNN 3.6.1 cannot size ("Compute Shape Error for While", a GRU, a 2-layer or bidirectional
# LSTM) or crashes converting (a one-layer ONNX LSTM, SIGSEGV); with this flag all of them
# convert and match ONNX Runtime within 2.1e-7 (docs/targets.md, "MNN")
RNN_AS_IS = ("--useOriginRNNImpl",)
# Net.mnn_uuid: a random UUID the converter writes (a flatbuffer string: 4-byte length 36, text, NUL)
MODEL_UUID = re.compile(rb"\x24\x00\x00\x00([0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})\x00")


def convert(onnx_path: Path, mnn_path: Path, timeout_s: float = CONVERT_TIMEOUT_S) -> str:
    """ONNX -> MNN with the converter function (no console script, no network), in a child
    process (common.run_tool). Converts in a scratch folder and moves the model into place;
    returns the converter's log."""
    with tempfile.TemporaryDirectory(prefix="parity-mnn-") as scratch:
        converted = Path(scratch) / MODEL
        log = run_tool("mnnconvert", ["mnnconvert", "-f", "ONNX", "--modelFile", str(onnx_path), "--MNNModel",
                                      str(converted), "--bizCode", "parity", *RNN_AS_IS], converted, timeout_s,
                       f"MNN's converter on {Path(onnx_path).name}")
        fix_model_uuid(converted)
        shutil.move(str(converted), str(mnn_path))
    return log


def fix_model_uuid(path: Path) -> None:
    """Replace the random model UUID MNN's converter writes by one derived from the rest of
    the file (same length), so that the same ONNX model gives the same bytes. Left alone
    unless exactly one UUID string is found."""
    data = Path(path).read_bytes()
    found = list(MODEL_UUID.finditer(data))
    if len(found) != 1:
        return
    start, end = found[0].span(1)
    digest = hashlib.sha256(data[:start] + data[end:]).digest()
    fixed = str(uuid.UUID(bytes=digest[:16], version=4)).encode()
    Path(path).write_bytes(data[:start] + fixed + data[end:])


def build(onnx_path: Path, ir_dir: Optional[Path], out_dir: Path, target, precision: str) -> Tuple[List[str], dict]:
    out_dir = Path(out_dir)
    convert(Path(onnx_path), out_dir / MODEL)
    return _finish(Path(onnx_path), out_dir, target, precision, {})


def _finish(onnx_path: Path, out_dir: Path, target, precision: str, extra: dict,
            converted: Optional[Path] = None, feeds: Optional[Dict[str, np.ndarray]] = None) -> Tuple[List[str], dict]:
    """Options, the tensor map and (GPU) the tuning cache next to out_dir/model.mnn;
    ``converted``: the fp32 MNN model a quantized model.mnn was made from; ``feeds``: a
    sample to run it on, for the map of its compute ops to ONNX nodes (``ops``, which
    verify's read-back of the ops that ran int8 and float names them by)."""
    options = session_options(target, precision)
    found = tensor_map(onnx_path, out_dir / MODEL, converted)
    if feeds is not None:
        found["ops"] = onnx_ops(out_dir / MODEL, onnx_path, feeds)
    write_json(out_dir / TENSOR_MAP, found)
    options["tensor_map"] = TENSOR_MAP
    options.update(extra)
    files = [MODEL, TENSOR_MAP]
    if "cache_file" in options and _warm_cache(out_dir, options):
        files.append(CACHE_FILE)
    return files, {"model": MODEL, "options": options}


def _warm_cache(out_dir: Path, options: dict) -> bool:
    """GPU targets: load once on the GPU so that MNN writes its tuned kernels to the cache
    file kept in the bundle. Nothing to do where this MNN build has no such backend."""
    if not runtime_exists(options["backend"]):
        return False
    session = Session(out_dir / MODEL, options, artifact_dir=out_dir, persist_cache=True)
    session.run(session.example_feeds())
    del session
    return (out_dir / CACHE_FILE).is_file()
