"""Every config schema of parity, in one place: the dataclasses registered in Hydra's
ConfigStore (``parity_schema`` at the root, each backend's target schema under
``schema/target``), so composition rejects unknown keys and wrong enum values; ``plain``
turns them back into plain data (cache keys, reports). Checks a schema cannot express are
in pipeline/config/validation.py, resolvers in pipeline/config/resolvers.py."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from enum import Enum
from typing import Any, Dict, List, Optional

from pipeline.precision import kinds

MISSING = "???"  # OmegaConf's MISSING (a value the user must give), without importing OmegaConf


class Backend(Enum):
    onnxruntime = "onnxruntime"
    openvino = "openvino"
    ncnn = "ncnn"
    mnn = "mnn"


# precision.name: every config precision of pipeline/precision/kinds.py's table (fp32, fp16,
# bf16, int8, mixed: their facts are there), then auto (every precision the target builds,
# the fastest that passes: pipeline/app/auto.py)
Precision = Enum("Precision", [(name, name) for name in (*kinds.CONFIG_NAMES, kinds.AUTO)], module=__name__)


class CalibrationMethod(Enum):
    max = "max"
    percentile = "percentile"
    kl = "kl"
    mse = "mse"
    auto = "auto"


class QuantType(Enum):
    int8 = "int8"
    uint8 = "uint8"


class ActivationRanges(Enum):
    """int8: where activation ranges come from (precision.activation_ranges)."""
    static = "static"  # the calibration table's, fixed in the model
    dynamic = "dynamic"  # each call's own, computed at run time (backends declaring dynamic_int8)


class Selection(Enum):
    target = "target"
    top_n = "top_n"


class Layerwise(Enum):
    off = "off"
    on_fail = "on_fail"
    always = "always"


class Baselines(Enum):
    full = "full"  # every validation sample, compared and scored beside the build
    timed = "timed"  # timed, and run on one sample per input shape for their peak memory


class Tuning(Enum):
    """MNN GPU backends: how much to tune kernels at load (ScheduleConfig.mode bits)."""
    none = "none"
    fast = "fast"
    normal = "normal"
    heavy = "heavy"
    wide = "wide"


class TuningLevel(Enum):
    """The tune stage: how many runtime settings to try and how long to measure each."""
    none = "none"
    fast = "fast"
    normal = "normal"
    heavy = "heavy"


class Objective(Enum):
    latency = "latency"  # median time of one batch-1 inference
    throughput = "throughput"  # inferences per second with concurrent requests


class MnnPrecision(Enum):
    high = "high"
    normal = "normal"
    low = "low"


class MemoryMode(Enum):
    auto = "auto"
    buffer = "buffer"
    image = "image"


class TargetMemory(Enum):
    """target.memory: what each runtime is asked to do with memory (docs/targets.md, "Memory
    modes"); low maps to the settings of its runtime measured to lower the peak."""
    default = "default"  # the runtime's own defaults
    low = "low"


class DataKind(Enum):
    tensors = "tensors"
    images = "images"
    random = "random"
    custom = "custom"  # any file, read by data.preprocess._target_
    text = "text"  # texts tokenized by data.tokenizer (pipeline/data/text.py)


class Color(Enum):
    rgb = "rgb"
    bgr = "bgr"
    gray = "gray"


class Layout(Enum):
    nchw = "nchw"
    nhwc = "nhwc"


@dataclass
class ModelConfig:
    path: str = MISSING  # the ONNX file
    name: Optional[str] = None  # bundle and report name; default: the file's stem
    # per input: a fixed shape [1,3,224,224] or a range {min: [...], opt: [...], max: [...]}
    # (pipeline/shapes.py); a dynamic input not named here takes the data's shapes
    input_shapes: Dict[str, Any] = field(default_factory=dict)
    min_opset: int = 13  # models below are upgraded to this opset


@dataclass
class PreprocessConfig:
    # [height, width]; null or "fixed": the model input's (its range's opt when dynamic);
    # "limit_side": long side at most `side` (PaddleOCR det: 960), aspect kept; "height":
    # height `side` (default: the model's), width by aspect (PaddleOCR rec). multiple_of:
    # limit_side rounds both sides to it, height rounds the width up to it
    resize: Any = None
    side: Optional[int] = None
    multiple_of: int = 1
    keep_aspect: bool = False  # resize to fit, then pad bottom/right
    pad_value: float = 0.0  # in normalized units (after mean/std)
    color: Color = Color.rgb
    scale: float = 255.0  # x = (pixel / scale - mean) / std
    mean: List[float] = field(default_factory=lambda: [0.0])
    std: List[float] = field(default_factory=lambda: [1.0])
    layout: Layout = Layout.nchw
    # data.kind=custom: module.callable taking a file path, returning the input arrays
    # (a dict by input name, or one array); path: a folder added to sys.path for it
    _target_: Optional[str] = None
    path: Optional[str] = None


@dataclass
class DataConfig:
    kind: DataKind = DataKind.tensors
    path: Optional[str] = None  # directory, or an .npz file (tensors only)
    # null: every sample found, up to the cap below (a warning says when the cap cuts)
    calibration_size: Optional[int] = None
    validation_size: Optional[int] = None
    calibration_cap: int = 500
    validation_cap: int = 2000
    labels: str = "labels.csv"  # per split directory: "sample,class" rows
    seed: int = 0  # random data only
    low: float = 0.0  # random data only
    high: float = 1.0  # random data only
    preprocess: PreprocessConfig = field(default_factory=PreprocessConfig)
    # data.kind=text: a Hugging Face tokenizer.json, and the tokens a text is truncated to
    tokenizer: Optional[str] = None
    max_length: Optional[int] = None


@dataclass
class TargetConfig:
    """What every target has; a backend with options of its own extends it with one group
    named after the backend (target.ncnn.*, target.mnn.*, target.openvino.*)."""

    name: str = MISSING
    backend: Backend = MISSING
    device: str = "CPU"
    threads: int = 0  # 0: the runtime's default
    # default | low: low maps to the runtime's own memory settings (docs/targets.md, "Memory modes")
    memory: TargetMemory = TargetMemory.default

    @property
    def memory_mode(self) -> str:
        """The GPU memory mode asked for ("auto" where the backend has no such choice)."""
        return "auto"

    @property
    def auto_masks(self) -> bool:
        """Whether a failing fp16 build searches per-layer feature masks (backends with masks)."""
        return False


class OpenvinoHint(Enum):
    latency = "LATENCY"
    throughput = "THROUGHPUT"


@dataclass
class NcnnOptions:
    device_index: int = 0  # Vulkan: which GPU
    # precision=fp16: the three switches of ncnn's fp16 path
    fp16_storage: bool = True
    fp16_packed: bool = True
    fp16_arithmetic: bool = True
    # precision=fp16: when the plain build fails verification, search per-layer feature
    # masks (31=...) on the culprit layers and keep the smallest set that passes
    auto_masks: bool = True
    # precision=int8/mixed: keep activations int8 between consecutive int8 convolutions
    # (int8_scale_term + 100, ncnn's requantize; docs/targets.md "ncnn")
    int8_requantize: bool = True
    # precision=int8/mixed: depthwise convolutions in int8 too; null: not on an x86 CPU,
    # where ncnn's int8 depthwise kernel is slower than its fp32 one (docs/targets.md)
    int8_depthwise: Optional[bool] = None


@dataclass
class MnnOptions:
    memory_mode: MemoryMode = MemoryMode.auto  # GPU devices: buffer or image memory (OpenCL)
    tuning: Tuning = Tuning.none  # GPU devices: kernel tuning at load, cached in the bundle
    precision: Optional[MnnPrecision] = None  # BackendConfig precision; null: fp32 high, fp16 low


@dataclass
class OpenvinoOptions:
    # PERFORMANCE_HINT and NUM_STREAMS the build compiles with; null: OpenVINO's default
    # (the tune stage searches both when tuning.level is not none)
    performance_hint: Optional[OpenvinoHint] = None
    num_streams: Optional[int] = None


@dataclass
class NcnnTarget(TargetConfig):
    ncnn: NcnnOptions = field(default_factory=NcnnOptions)

    @property
    def auto_masks(self) -> bool:
        return self.ncnn.auto_masks


@dataclass
class MnnTarget(TargetConfig):
    mnn: MnnOptions = field(default_factory=MnnOptions)

    @property
    def memory_mode(self) -> str:
        return self.mnn.memory_mode.value


@dataclass
class OpenvinoTarget(TargetConfig):
    openvino: OpenvinoOptions = field(default_factory=OpenvinoOptions)


# Each backend's target schema: conf/target/*.yaml extend it (defaults: /schema/target/<backend>).
TARGET_SCHEMAS = {Backend.onnxruntime: TargetConfig, Backend.openvino: OpenvinoTarget,
                  Backend.ncnn: NcnnTarget, Backend.mnn: MnnTarget}
# Flat target keys of parity before the option groups: a one-line hint where one is used.
MOVED_TARGET_KEYS = {
    "memory_mode": "target.mnn.memory_mode", "tuning": "target.mnn.tuning", "mnn_precision": "target.mnn.precision",
    **{key: f"target.ncnn.{key}" for key in ("device_index", "fp16_storage", "fp16_packed", "fp16_arithmetic",
                                              "auto_masks", "int8_requantize")}}


@dataclass
class PrecisionConfig:
    @property
    def kind(self) -> str:
        """The precision's name as text ("fp32", "int8", "auto", ...)."""
        return self.name.value

    name: Precision = MISSING
    min_cosine: float = 0.9999  # the default threshold for builds at this precision
    max_metric_drop: float = 0.0  # the default allowed task-metric drop
    task_min_cosine: Optional[float] = None  # the task output's cosine floor when a task metric gates; null: min_cosine
    layer_min_cosine: float = 0.9999  # layerwise: an intermediate tensor below this diverges
    # int8 builds only:
    activations: QuantType = QuantType.uint8  # u8 activations x s8 weights: the x86 VNNI kernels
    # static: ranges from the calibration table, fixed in the model; dynamic: each call quantizes
    # activations over their own range at run time (ONNX Runtime's DynamicQuantizeLinear, no
    # calibration; backends declaring dynamic_int8, precision=int8 only: docs/targets.md)
    activation_ranges: ActivationRanges = ActivationRanges.static
    per_channel: bool = True  # per-channel weight scales for Conv/Gemm/MatMul
    # Op types whose activation inputs (and weights) are quantized; every other op runs in
    # float between them (docs/calibration.md: placement).
    quantize_ops: List[str] = field(default_factory=lambda: ["Conv", "ConvTranspose", "Gemm", "MatMul"])
    # Also quantize those ops' outputs. null: per backend (ONNX Runtime yes: it fuses
    # DQ -> op -> Q into its int8 kernels; OpenVINO no: it quantizes from the inputs).
    quantize_outputs: Optional[bool] = None
    # Op types that only move or clamp values (Relu, Clip, MaxPool, Resize, Concat), given Q/DQ
    # around them too so that int8 flows through them from one quantized op to the next
    # instead of dequantizing and requantizing at each; never a decision of the mixed search.
    # null: per backend (ONNX Runtime with uint8 activations: those four; docs/calibration.md).
    passthrough_ops: Optional[List[str]] = None
    # SiLU / Swish activations (x * Sigmoid(x), x made by a quantized op: YOLO's) quantized
    # too, Sigmoid and Mul each with its own calibrated range, so that int8 flows from one
    # convolution to the next; other Sigmoids and Muls (a detector's decode) stay float.
    # null: per backend (ONNX Runtime with quantized outputs; docs/calibration.md).
    quantize_swish: Optional[bool] = None
    # Also quantize MatMuls whose two inputs are activations (attention's Q K^T and
    # probabilities x V); false keeps them float, as NNCF's and ONNX Runtime's transformer
    # handling does (docs/calibration.md: Transformers).
    quantize_activation_matmuls: bool = False
    # 7-bit weights: u8 x s8 kernels saturate on x86 CPUs without VNNI. null: on for such CPUs.
    reduce_range: Optional[bool] = None
    # Restore each quantized op's per-channel output mean measured on the calibration data
    # (docs/calibration.md: bias correction).
    bias_correction: bool = True
    # Round each quantized op's int8 weights against its calibration inputs (GPTQ-style
    # error compensation) instead of to the nearest step (docs/calibration.md).
    weight_rounding: bool = True
    # SmoothQuant before static int8 (docs/calibration.md: Transformers): activation outlier
    # channels of the MatMul/Gemm inputs moved into their weights. null: off; an alpha in
    # [0, 1]; auto: the alpha (or none) measured best at the outputs on calibration samples,
    # searched only where a normalization (LayerNorm) feeds a MatMul/Gemm with a constant weight.
    smoothing: Optional[str] = "auto"
    # Outlier activation channels of a convolutional network scaled down in the Conv making
    # them and up in the Convs reading them (cross-layer equalization), kept where the int8
    # model does better with it (pipeline/precision/equalization.py)
    equalization: bool = True
    # Keep in float the quantized ops that are not faster in int8 than in fp32 on this
    # machine, each measured by the target's own runtime (docs/calibration.md: placement).
    int8_where_faster: bool = False
    # Ops (ONNX node names) kept in fp32 in fp16, int8 and mixed builds, on top of what the
    # pre-flight or the sensitivity search chose: how a verify recommendation is applied.
    keep_float: List[str] = field(default_factory=list)
    # precision=auto only: the precisions tried (null: the target backend's AUTO_CANDIDATES)
    candidates: Optional[List[str]] = None
    # precision=auto only: seconds the candidates may take; once spent, the candidates not yet
    # tried are named as cut and the best of those tried ships (null: no budget)
    budget_s: Optional[float] = 300.0
    # precision=auto only: time each candidate against fp32 before verifying it and leave one
    # measurably slower unverified; false verifies every candidate, however slow
    screen: bool = True

    @property
    def dynamic_ranges(self) -> bool:
        """int8 whose activations are quantized per call at run time: no calibration table."""
        return self.activation_ranges is ActivationRanges.dynamic and kinds.dynamic_variant(self.kind) is not None


@dataclass
class CalibrationConfig:
    method: CalibrationMethod = CalibrationMethod.auto
    percentile: float = 99.99
    bins: int = 2048  # histogram of |x|
    quantized_levels: int = 128  # KL: levels of the quantized distribution
    kl_max_clipped: Optional[float] = 0.001  # KL: skip candidates clipping more; null: plain KL
    min_samples: int = 32  # fewer calibration samples are warned about
    batch_size: int = 16  # samples per inference during statistics, where the model allows it
    auto_samples: int = 4  # samples kept to compare methods for method=auto
    table: Optional[str] = None  # import this TPU-MLIR calibration table instead of computing one
    # Model inputs already carry the data's own quantization (8-bit images...): clipping them
    # corrupts every later tensor, and KL on their spiky histograms clips hard. null: use method.
    inputs: Optional[CalibrationMethod] = CalibrationMethod.max


@dataclass
class SensitivityConfig:
    """precision=mixed: the per-layer search for the ops that stay in float."""

    methods: List[str] = field(default_factory=lambda: ["kl", "max", "percentile", "mse"])
    select: Selection = Selection.target
    # select=target: output cosine to reach; null: validation.min_cosine (what verify checks)
    expected_cos: Optional[float] = None
    # select=target: task-metric (metric group) drop allowed; null: validation.max_metric_drop
    max_drop: Optional[float] = None
    top_n: int = 5  # select=top_n: this many of the most sensitive ops stay float
    samples: int = 8  # validation samples the per-layer ranking measures on (the selection: all of them)
    screen: int = 2  # methods measured in full per op after the SQNR screen (0: all)
    max_float_ops: int = 32  # select=target gives up beyond this many float ops
    # ops measured in full (each op int8 alone, the rest of the graph run on its output):
    # with more quantizable ops than this, the ones whose int8 output is worst at the op
    # itself (op-level SQNR) only; null: max_float_ops (no more ops can stay float anyway)
    max_ranked: Optional[int] = None
    # select=target: weigh each op's accuracy against its latency cost on the target (ONNX
    # Runtime, OpenVINO: per-op profiles of the fp32 and int8 builds); false: accuracy alone
    latency_aware: bool = True
    # select=target: before the per-layer ranking, int8 with the output heads float (the
    # weighted ops a graph output reads through at most two others); where that meets the
    # target it is the selection, and no ranking is paid for (docs/sensitivity.md)
    heads_first: bool = True
    # plain int8's figures where its build is known to fail on accuracy ({metric_drop, cosine}):
    # the search does not measure it again before heads first. precision=auto sets it on its
    # mixed candidate from the int8 candidate's verify of the same build; {}: measured here
    int8_failed: Dict[str, Any] = field(default_factory=dict)


@dataclass
class TuningConfig:
    """The tune stage (stages/tune.py): runtime settings measured on this machine, the
    fastest that still passes the validation thresholds written to runtime.yaml."""

    level: TuningLevel = TuningLevel.none  # none: keep the build's settings
    objective: Objective = Objective.latency
    warmup: Optional[int] = None  # runs before measuring a candidate; null: the level's
    repeats: Optional[int] = None  # measured runs per candidate; null: the level's
    noise: float = 0.03  # candidates within this fraction of the best (or its spread) tie
    verify_samples: int = 16  # validation samples each chosen setting is re-verified on
    # backends that can move between devices (ncnn Vulkan <-> CPU): the other devices allowed
    devices: List[str] = field(default_factory=list)


@dataclass
class OutputThresholds:
    min_cosine: Optional[float] = None
    max_abs_error: Optional[float] = None
    max_mean_abs_error: Optional[float] = None
    min_sqnr_db: Optional[float] = None
    # integer and boolean outputs: the share of samples whose values all match (null: every one)
    min_agreement: Optional[float] = None


DIAGNOSIS_KEYS = ("layerwise", "layerwise_samples", "layer_min_cosine", "advice_trials", "diagnosis_budget",
                  "diagnosis_min_seconds")


@dataclass
class ValidationConfig:
    min_cosine: Optional[float] = 0.9999  # null: gate on the task metric (and the other thresholds) alone
    max_abs_error: Optional[float] = None
    max_mean_abs_error: Optional[float] = None
    min_sqnr_db: Optional[float] = None
    max_metric_drop: float = 0.0  # the task metric's allowed drop (top1: 0.01 = 1 point), docs/metrics.md
    # with a task metric scored, the task output's cosine gate is this floor (null: min_cosine)
    task_min_cosine: Optional[float] = None
    # a passing drop whose 95 % bootstrap interval reaches past max_metric_drop: a warning, or (true) a failure
    require_confidence: bool = False
    task_output: Optional[str] = None  # output holding class scores; default: the first
    outputs: Dict[str, OutputThresholds] = field(default_factory=dict)  # per-output overrides
    # Layerwise comparison of every intermediate tensor: off, when the verdict fails, always.
    layerwise: Layerwise = Layerwise.on_fail
    layerwise_samples: int = 30  # the first N validation samples
    layer_min_cosine: float = 0.9999
    # Every backend run of verify is a worker process: a crash or hang fails the verdict.
    worker_timeout_s: float = 600.0  # per request (load, one sample, one latency measure)
    worker_memory_mb: Optional[int] = None  # address-space limit of a worker; null: none
    # The build's peak resident memory (verify.memory: its own worker process, load and run) may
    # be at most this many MB, else the verdict fails (exit 3); null: measured, not gated
    max_memory_mb: Optional[float] = None
    # int8 ran partly (quantized ops the runtime has no int8 kernel for ran float): a warning, or a failing check
    fail_on_float_fallback: bool = False
    # The side-by-side baselines (fp32 on the target; plain int8 beside mixed): full (every
    # validation sample, compared), timed (timed and their memory read only); null: full,
    # and timed for precision=auto's candidates, which verify fp32 only when it could ship
    baselines: Optional[Baselines] = None
    advice_trials: int = 4  # keep-in-float candidates a failing int8/mixed verify builds and measures (0: none)
    # A failing verdict's diagnosis (layerwise, advice trials) may take this multiple of the
    # check's own time, and at least diagnosis_min_seconds (docs/verify.md, "Diagnosis budget")
    diagnosis_budget: float = 1.0
    diagnosis_min_seconds: float = 5.0
    # Speed: fp32, plain int8 and the shipped build timed interleaved in rounds (docs/verify.md).
    min_speedup: Optional[float] = None  # shipped build vs fp32; null: a slow build is a warning only
    timing_rounds: int = 7
    timing_runs: int = 10  # the fewest runs of one sample per build and round
    timing_max_seconds: float = 10.0  # no new round after this (3 rounds at least)
    timing_round_ms: float = 20.0  # a build's round lasts at least this: 5 ms slices of as many runs as fit
    timing_tight_spread: float = 1.25  # per-round ratios within p75/p25 <= this: tight (a tie can be called)
    # Builds of a short run (under 10 ms) are timed in this many processes each, rounds in turn:
    # two processes of the same build differ by more than one process's rounds (docs/verify.md)
    timing_processes: int = 2
    # Speed as served: when the validation samples differ in input shape, every build also
    # runs the first N of them in their order, one call each at its own shape (0: off)
    timing_stream_samples: int = 100
    # A build whose accuracy checks fail is timed too (its speed beside fp32 in the report);
    # null: true, and false for precision=auto's candidates, whose table gives the screening's speed
    time_failing: Optional[bool] = None

    def cosine_gate(self, task_gated: bool) -> Optional[float]:
        """The cosine an output must reach: task_min_cosine for the output a scored task
        metric judges (when set), else min_cosine; none with min_cosine null (no cosine gate)."""
        if self.min_cosine is None or not task_gated or self.task_min_cosine is None:
            return self.min_cosine
        return self.task_min_cosine

    @property
    def baselines_compared(self) -> bool:
        """Whether the side-by-side baselines run every validation sample, compared."""
        return self.baselines != Baselines.timed

    @property
    def times_failing(self) -> bool:
        return self.time_failing is not False

    def judged(self) -> dict:
        """The keys a verdict depends on, without how a failing one is diagnosed: what a
        stored measurement of a build (verify) or a tuned setting (tune) is keyed by. The
        memory budget judges a measured peak and changes no measurement: left out too."""
        return {k: v for k, v in vars(self).items() if k not in DIAGNOSIS_KEYS and k != "max_memory_mb"}

    def thresholds_for(self, output: str, task_output: Optional[str] = None) -> OutputThresholds:
        """``output``'s thresholds; ``task_output``: the output a scored task metric judges,
        whose cosine is gated at task_min_cosine (a floor) where that is set."""
        base = OutputThresholds(self.cosine_gate(output == task_output), self.max_abs_error,
                                self.max_mean_abs_error, self.min_sqnr_db)
        override = self.outputs.get(output)
        if override is None:
            return base
        keys = [f.name for f in fields(OutputThresholds)]
        return OutputThresholds(**{key: getattr(override, key) if getattr(override, key) is not None
                                   else getattr(base, key) for key in keys})


@dataclass
class PackageConfig:
    name: Optional[str] = None  # default: <model>-<target>-<precision>
    archive: bool = True  # also write <bundle>.tar.gz


@dataclass
class ProfileConfig:
    """The profile stage: per-layer times of the built artifact on its backend."""

    runs: int = 20  # profiled runs of the first validation sample, after the warm-up
    warmup: int = 3
    top: int = 10  # layers the report shows
    max_seconds: float = 5.0  # fewer runs (one at least) once profiling took this long
    startup_rounds: int = 1  # with a compile cache: cold vs warm start-up, median of this many (0: not measured)
    worker_timeout_s: float = 600.0  # each request to the profiling worker
    worker_memory_mb: Optional[int] = None  # memory limit of the profiling worker; null: none


# The stages in the order they run, one module each in stages/ (pipeline.stages lists a subset).
STAGE_NAMES = ("convert", "calibrate", "sensitivity", "build", "tune", "verify", "profile", "package")


@dataclass
class PipelineConfig:
    stages: List[str] = field(default_factory=lambda: list(STAGE_NAMES))
    cache: bool = True
    cache_dir: str = "outputs/.cache"


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    target: TargetConfig = field(default_factory=TargetConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)
    sensitivity: SensitivityConfig = field(default_factory=SensitivityConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    tuning: TuningConfig = field(default_factory=TuningConfig)
    package: PackageConfig = field(default_factory=PackageConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    # the task metric (conf/metric, docs/metrics.md): instantiated from _target_ with the
    # other keys; output, path, higher_is_better and needs_labels are read by parity
    metric: Dict[str, Any] = field(default_factory=dict)


def plain(obj):
    """A config dataclass as JSON-able data (enums by value)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, Enum):
        return obj.value
    if isinstance(obj, dict):
        return {str(k): plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [plain(v) for v in obj]
    return obj
