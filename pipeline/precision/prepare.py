"""The graph that gets calibrated and quantized (``prepare``): ONNX Runtime's quantization
pre-processing, then its contrib ops typed."""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger("parity")


def prepare(model_path: Path, out_path: Path) -> None:
    """The graph that gets calibrated and quantized: ONNX Runtime's quantization
    pre-processing at its basic level (constant folding, BatchNorm folded into Conv),
    which keeps standard ONNX ops only. Symbolic shape inference is skipped: it fails on
    some exported models (shared/findings.md) and convert already inferred shapes. A
    float16 model is widened to float32 first, its float16 inputs and outputs kept by
    casts (pipeline/precision/float32.py): the quantizer cannot type its own casts otherwise."""
    import onnx
    from onnxruntime.quantization.shape_inference import quant_pre_process

    from pipeline.precision import float32

    original = onnx.load(str(model_path))
    if float32.has_float16(original):
        onnx.save(float32.widened(original), str(out_path))
        model_path = out_path
    quant_pre_process(str(model_path), str(out_path), skip_symbolic_shape=True)
    from pipeline.precision.fp16 import name_nodes

    model = _typed_contrib_outputs(onnx.load(str(out_path)))
    name_nodes(model)
    used = {node.domain or "" for node in model.graph.node}
    kept = [o for o in model.opset_import if (o.domain or "") in used | {""}]
    del model.opset_import[:]
    model.opset_import.extend(kept)
    onnx.save(model, str(out_path))


def _typed_contrib_outputs(model):
    """ONNX's shape inference leaves the outputs of ONNX Runtime's own ops (com.microsoft:
    SkipLayerNormalization, Gelu, written by its transformer optimizer) untyped, and the
    quantizer then finds no range for the tensors after them; ONNX Runtime's symbolic
    shape inference knows them. Kept only where it succeeds (it fails on some exported
    models, shared/findings.md)."""
    if all(node.domain in ("", "ai.onnx") for node in model.graph.node):
        return model
    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

    try:
        return SymbolicShapeInference.infer_shapes(model, auto_merge=True) or model
    except Exception as err:  # noqa: BLE001 - its failures are bare exceptions of every kind
        log.info("symbolic shape inference failed on the contrib ops (%s); their outputs stay untyped", err)
        return model
