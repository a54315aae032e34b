"""Gemm biases as ONNX Runtime's quantizer takes them with per-channel weights: a bias of one
row broadcast over the output is rewritten as the (N,) vector it equals."""

from __future__ import annotations

from typing import Dict, List

import numpy as np


def gemm_bias_fixes(model) -> List[tuple]:
    """Gemm ops whose bias C is an initializer of shape (1, N), (1, 1), (1,) or () with the
    weight an initializer: (op name, bias name, old shape, N). C is broadcast to (M, N), so
    a C with one row is the same as the (N,) vector, the one shape ONNX Runtime's
    quantizer handles with per-channel weights (it raises on the others, ORT 1.31)."""
    initializers = {t.name: t for t in model.graph.initializer}
    found = []
    for node in model.graph.node:
        if node.op_type != "Gemm" or len(node.input) < 3 or node.input[1] not in initializers \
                or node.input[2] not in initializers:
            continue
        dims = list(initializers[node.input[2]].dims)
        transposed = any(a.name == "transB" and a.i for a in node.attribute)
        weight = list(initializers[node.input[1]].dims)
        columns = weight[0] if transposed else weight[-1]
        one_row = (len(dims) == 2 and dims[0] == 1 and dims[1] in (1, columns)) or dims in ([], [1])
        if one_row and len(weight) == 2 and dims != [columns]:
            found.append((node.name, node.input[2], dims, columns))
    return found


def flatten_gemm_bias(model) -> None:
    """Rewrite the biases gemm_bias_fixes finds as (N,) vectors, in place (a bias another
    node also reads gets a copy of its own)."""
    from onnx import numpy_helper

    initializers = {t.name: t for t in model.graph.initializer}
    readers: Dict[str, int] = {}
    for node in model.graph.node:
        for name in node.input:
            readers[name] = readers.get(name, 0) + 1
    nodes = {node.name: node for node in model.graph.node}
    for op, bias, _, columns in gemm_bias_fixes(model):
        values = numpy_helper.to_array(initializers[bias]).reshape(-1)
        name = bias if readers[bias] == 1 else f"{bias}_{op}_vector"
        flat = numpy_helper.from_array(np.broadcast_to(values, (columns,)).copy(), name)
        if name == bias:
            initializers[bias].CopyFrom(flat)
        else:
            model.graph.initializer.append(flat)
        nodes[op].input[2] = name
