"""ncnn: the ``ncnn_cpu`` and ``ncnn_vulkan`` targets (pnnx converts, ncnn runs).

Build
    The fp32 ONNX model (input shapes fixed by the convert stage) is converted by the
    ``pnnx`` executable of the pnnx wheel (called directly: ``import pnnx`` imports torch)
    in a scratch folder, with ``fp16=0`` so that the weights stay fp32 on disk: precision
    is a runtime option of ncnn (``RUNTIME_PRECISIONS``), never baked into the artifact.
    Only ``model.ncnn.param`` / ``model.ncnn.bin`` are kept, as ``model.param`` /
    ``model.bin``. pnnx writes an op it cannot lower into the ncnn param under the ONNX op
    type (e.g. a ``Det`` layer) and prints ``todo Det``; ncnn would refuse to load it, so
    build checks every layer type against ncnn's registry (``ncnn.layer_to_index``) and
    raises ``pnnx cannot convert op Det (node /x/Det_7)``; the ONNX node is found through
    pnnx's simplified ONNX (``model.pnnxsim.onnx``, whose node names such as ``Det_1`` are
    the ncnn layer names) by the op's rank among the model's nodes of that type.

    int8 / mixed: build gets parity's Q/DQ model (made from the calibration table, the
    qtable's ops without Q/DQ); pnnx converts it without its Q/DQ nodes and the layers of
    the quantized ops are written in ncnn's own int8 format (``int8``). ``effective()``
    reads back which layers run int8 (``int8_layers``) and the quantized ops whose layer
    runs float (``float_ops``, verify's float-fallback check).

Names: ncnn blob <-> ONNX tensor, ncnn layer <-> ONNX node
    pnnx renames everything (blobs become numbers, layers ``convrelu_0``...) and has no
    option that keeps ONNX names; its intermediate files (``model.pnnx.param``,
    ``model.pnnx.onnx``, ``model.pnnxsim.onnx``) are renamed too. What is stable:

    - graph inputs and outputs: pnnx names them ``in0, in1...`` and ``out0, out1...`` in the
      ONNX graph's input and output order;
    - intermediate tensors, by value: at build time ``MATCH_RUNS`` deterministic random
      inputs (standard normal; |x| when that makes the reference outputs NaN/Inf) run
      through ONNX Runtime (fp32, optimizations off, every activation an output) and
      through the converted net on the CPU in fp32 (every blob extracted). An ncnn blob
      stands for the ONNX tensors with the same element count whose values it reproduces
      in every run (relative L2 error <= ``MATCH_TOLERANCE`` on a fixed sample of
      ``MATCH_SAMPLE`` positions, and norms agreeing); per ONNX tensor the blob of the same
      shape (batch axis dropped) ranks first, then the smallest error. When a blob
      reproduces a tensor and one computed from it through a value-changing op (a Conv's
      output that happened to be >= 0 and its Relu: seen on an 8-channel SE block of the
      PP-OCR classifier), it stands for the computed one only; through value-preserving
      ops (Reshape, Flatten, Identity...) it stands for all. Tensors are compared through
      small fingerprints, so the mapping holds one tensor at a time, not the model's
      activations. ``Split`` outputs are copies of their input blob and ``MemoryData`` /
      constant-only blobs are no activations: neither is matched. A tensor that ncnn fused
      away (a Conv's output inside ``convrelu``, the ``Add/Clip/Mul/Div`` of a HardSwish)
      has no blob and is reported as not exposed; a blob that reproduces no ONNX tensor
      (pnnx's own rewrites, e.g. the ``x*1.2`` it puts before a HardSigmoid) keeps its
      ncnn name (unmappable); a second blob holding a mapped tensor's values in another
      layout (an InnerProduct's output before a Reshape) is a ``blob_alias``.
      Where values coincide along a chain (``s + 1e-8`` equals ``s`` in fp32: the
      Reduction's and the Add's blobs both reproduce both tensors), ``resolve_by_structure``
      pairs blobs and tensors by graph order before the rule above.
      Measured: digits CNN 6 of 9 ONNX activations exposed (the Conv and Gemm outputs
      are fused with their Relu), every blob mapped; PP-OCR classifier 111 of 239 (not:
      Conv before BatchNorm, HardSwish internals, shape arithmetic), 9 blobs unmappable,
      every ONNX node with its layer.
    - layers, from the blob mapping: an ONNX node whose output has a blob maps to the ncnn
      layer computing that blob (the first blob holding its values); nodes between mapped
      tensors (the fused ones) map to the layer of the nearest mapped tensor they feed.
      ``options["layers"]`` lists, per ONNX node, that layer first, then the ncnn layers
      without a mapped output that feed it (the group computing the node);
      ``layer_map`` gives the first.

    The mapping runs in a child Python process (a crash of ncnn on a freshly converted
    net must not end the build); if it fails, only inputs and outputs are mapped and
    ``options["mapping_error"]`` says why. Everything is recorded in the build settings
    (runtime.yaml ``options``): ``inputs``, ``outputs`` and ``blobs`` (ONNX name -> ncnn
    blob), ``blob_aliases``, ``shapes`` (ONNX shapes, to restore the batch axis ncnn
    drops) and ``layers``.

Runtime
    ``options`` carry ncnn's Option switches: ``use_vulkan``, ``device_index``,
    ``threads``, the fp16 switches (only for precision fp16, per the target's
    ``fp16_storage`` / ``fp16_packed`` / ``fp16_arithmetic``), ``use_bf16_storage`` (bf16,
    CPU only) and ``layer_masks`` ({ncnn layer: feature mask}, written by ``apply_masks``
    as layer parameter ``31=`` in the param file; ncnn's ``Net::load_param`` reads it into
    ``Layer::featmask`` and ``get_masked_option`` in src/net.cpp masks the Option per
    layer, see MASK_BITS; a layer masked off Vulkan is re-created as a CPU layer).

    ``effective()`` reads back what ncnn runs, after ``Net::load_param`` has sanitized the
    Option: Vulkan is turned off without a valid device, fp16/bf16 switches the device
    lacks are dropped. A layer runs on Vulkan when the net still uses Vulkan, the loaded
    layer has a Vulkan implementation (``support_vulkan``) and its mask has no bit 16.
    Its precision: on Vulkan fp16 when fp16 storage/packed or arithmetic is on (mask
    permitting), bf16 for bf16 storage, else fp32; on the CPU bf16 when bf16 storage is
    on and the layer supports it, fp16 when fp16 storage is on, the layer supports it and
    ncnn casts activations to fp16 on this CPU (``cpu_fp16_storage``: ARM asimdhp; x86
    keeps activations and arithmetic fp32 and at most stores InnerProduct weights in fp16,
    which is storage: reported fp32 with ``CPU_FP32_NOTE``), else fp32. The reported precision is fp16/bf16 when any layer runs so (a
    masked layer is a deliberate exception), ``device`` VULKAN when any layer runs there,
    and ``layers`` counts the compute layers per device and lists the masks.

Vulkan: ncnn creates its GPU instance on first use; ``atexit`` releases every session's
net, then calls ``ncnn.destroy_gpu_instance()`` (the instance must outlive the nets).

The package's modules: ``common`` (the declarations, the target checks, the runtime options
a target gets, the model's graph inputs), ``param`` (the param file read and written),
``options`` (ncnn's Option switches, the tuning space), ``conversion`` (pnnx, the build),
``fingerprints`` and ``names`` (the name mapping: tensors compared by value, blobs and layers
paired with ONNX tensors and nodes), ``masks`` (the layer names the mask search works on,
``apply_masks``), ``session`` (``load``, ``Session``) and ``int8`` / ``int8_format`` (parity's
writer of ncnn's int8 format, and what ran int8).
"""

from __future__ import annotations

from pipeline.backends.ncnn.common import (  # noqa: F401 - the backend's names
    NAME, VULKAN_DEVICE_TYPES, NO_VULKAN_DEVICE, PRECISIONS, RUNTIME_PRECISIONS, QUANTIZED_PRECISIONS,
    MEMORY_MODES, DEVICES, CAPABILITIES, PARAM_FILE, BIN_FILE, INSTALL_HINT, MASK_BITS, FEATMASK_PARAM,
    MATCH_TOLERANCE, MATCH_SAMPLE, MATCH_RUNS, PNNX_TIMEOUT_S, MAP_TIMEOUT_S, available, versions, check_config,
    pnnx_executable, runtime_options, float_op_kinds, device_identity)
from pipeline.backends.ncnn.param import (  # noqa: F401 - the backend's names
    ParamLayer, Param)
from pipeline.backends.ncnn.options import (  # noqa: F401 - the backend's names
    SPEED_SWITCHES, tuning_space, with_options, CPU_FP32_NOTE, cpu_fp16_storage)
from pipeline.backends.ncnn.conversion import (  # noqa: F401 - the backend's names
    build)
from pipeline.backends.ncnn.fingerprints import (  # noqa: F401 - the backend's names
    node_key)
from pipeline.backends.ncnn.names import (  # noqa: F401 - the backend's names
    map_names, resolve_by_structure)
from pipeline.backends.ncnn.masks import (  # noqa: F401 - the backend's names
    layer_map, layer_consumers, apply_masks)
from pipeline.backends.ncnn.session import (  # noqa: F401 - the backend's names
    load, Session)
