"""Every precision and its facts, in one place: what the stages, backends, auto, the sweep
and the report ask about a precision (quantized or not, calibrated or not, the width and
range of its float, what it is a part of, how close to the model's own numbers it stays)
they ask here, by name. No other module compares a precision's name as text
(tests/test_precision_kinds.py); adding a precision is one entry in ``KINDS`` (and its
``conf/precision/<name>.yaml``, and the backends that build it: docs/architecture.md).

Two names are not builds: ``AUTO`` (precision=auto tries the others) and ``REFERENCE``
(fp32, the precision every build is compared with and timed against). A name outside the
table (auto, or an empty one from a backend that said nothing) has none of the facts: the
predicates answer False for it. Imports nothing of parity: config, backends and their
worker processes all read it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, FrozenSet, List, Mapping, Optional, Tuple

AUTO = "auto"  # precision=auto: every precision the target builds, the fastest that passes (pipeline/app/auto.py)
REFERENCE = "fp32"  # the model's own precision: every build is compared with it and timed against it


@dataclass(frozen=True)
class Kind:
    name: str
    # auto's tie-break (in speed and size), lower first: the build closer to the model's own numbers wins
    fidelity: int
    float_bits: int = 32  # the width of its float ops (and of the float between int8 ops)
    # its float's range ends at 65504 (IEEE half: 5 exponent bits), not at fp32's 3.4e38 as
    # bf16's does: values beyond it overflow, so calibration's pre-flight looks for them and
    # parity converts the graph itself, keeping their ops fp32 (pipeline/precision/fp16.py)
    narrow: bool = False
    quantized: bool = False  # int8 ops: a Q/DQ model (or the runtime's quantizer), int8 between float ops
    calibrated: bool = False  # the calibrate stage runs for it (int8 thresholds; fp16: the pre-flight statistics)
    keeps_float: bool = False  # precision.keep_float applies: the ops it names stay fp32 in its build
    # the quantized precision it is a part of: its build keeps some of that one's int8 ops in
    # float (mixed: int8's, chosen by the sensitivity search). It shares that one's calibration,
    # is tried after it and is that build when the search keeps nothing in float; a backend
    # running that one with ops in float reports it (int8 "ran partly": mixed)
    partial_of: Optional[str] = None
    # a precision=auto candidate, not a config precision: built as precision.name=``config``
    # with activation ranges computed per call (precision.activation_ranges=dynamic, no calibration)
    config: Optional[str] = None
    # x86 CPU flags with which a CPU computes it natively; without them ``not_native`` says what runs,
    # and an ``emulated`` one is slower than fp32, so precision=auto leaves it out on such a CPU
    native_flags: FrozenSet[str] = frozenset()
    not_native: str = ""
    emulated: bool = False


# In the order they are listed (the sweep's columns, the config's enum).
KINDS: Dict[str, Kind] = {kind.name: kind for kind in (
    Kind("fp32", fidelity=0),
    Kind("fp16", fidelity=2, float_bits=16, narrow=True, calibrated=True, keeps_float=True,
         native_flags=frozenset({"avx512_fp16", "amx_fp16"}),
         not_native="this CPU has no native fp16 arithmetic: the runtime computes an fp16 request in bf16 or fp32"),
    Kind("bf16", fidelity=1, float_bits=16, native_flags=frozenset({"avx512_bf16", "amx_bf16"}), emulated=True,
         not_native="this CPU has no native bf16 arithmetic (avx512_bf16 or AMX): bf16 is emulated"),
    Kind("int8", fidelity=5, quantized=True, calibrated=True, keeps_float=True),
    Kind("mixed", fidelity=3, quantized=True, calibrated=True, keeps_float=True, partial_of="int8"),
    # each call's activations get their own range, none clipped by a calibrated one: closer than static int8
    Kind("int8_dynamic", fidelity=4, quantized=True, keeps_float=True, config="int8"),
)}
CONFIG_NAMES: Tuple[str, ...] = tuple(name for name, kind in KINDS.items() if kind.config is None)
FIDELITY: Tuple[str, ...] = tuple(sorted(KINDS, key=lambda name: KINDS[name].fidelity))
HALF: Tuple[str, ...] = tuple(name for name, kind in KINDS.items() if kind.float_bits == 16)


def of(name: str) -> Kind:
    """The facts of a precision the table has (KeyError for any other name)."""
    return KINDS[name]


def _fact(name: str, field: str):
    kind = KINDS.get(name)
    return getattr(kind, field) if kind is not None else None


def quantized(name: str) -> bool:
    return bool(_fact(name, "quantized"))


def calibrated(name: str) -> bool:
    return bool(_fact(name, "calibrated"))


def half(name: str) -> bool:
    """A 16-bit float (fp16, bf16)."""
    return _fact(name, "float_bits") == 16


def narrow(name: str) -> bool:
    """A float whose range ends far below fp32's (fp16): see ``Kind.narrow``."""
    return bool(_fact(name, "narrow"))


def keeps_float(name: str) -> bool:
    return bool(_fact(name, "keeps_float"))


def reduced(name: str) -> bool:
    """A precision of the table other than the reference: a build that exists to be faster than fp32."""
    return name in KINDS and name != REFERENCE


def partial_of(name: str) -> Optional[str]:
    """The quantized precision this one keeps some ops of in float (mixed: int8), or None."""
    return _fact(name, "partial_of")


def searched(name: str) -> bool:
    """Its ops kept in float are searched layer by layer (the sensitivity stage: mixed)."""
    return partial_of(name) is not None


def partial(name: str) -> Optional[str]:
    """The precision that is this one with some of its int8 ops in float (int8: mixed), or None."""
    return next((other for other, kind in KINDS.items() if kind.partial_of == name), None)


def ran_partly(requested: str, ran: str) -> bool:
    """A backend asked for ``requested`` reports ``ran``, that precision with some ops in
    float (int8 asked, mixed ran): a fallback of some ops, not another precision."""
    part = partial(requested)
    return part is not None and ran == part


def with_partial(name: str) -> List[str]:
    """What a build of ``name`` keeping some quantized ops in float may report: the whole
    precision and its partial one (int8 or mixed: int8, mixed); ``[name]`` for any other."""
    whole = partial_of(name) or name
    return [whole, partial(whole)] if partial(whole) else [name]


def config_name(name: str) -> str:
    """The precision.name (and conf/precision file) a build of ``name`` is configured with."""
    return _fact(name, "config") or name


def dynamic(name: str) -> bool:
    """A candidate built with activation ranges computed per call (int8_dynamic)."""
    return _fact(name, "config") is not None


def dynamic_variant(name: str) -> Optional[str]:
    """The name of precision ``name`` with activation ranges computed per call (int8:
    int8_dynamic), or None where it has none (precision.activation_ranges=dynamic is then refused)."""
    return next((other for other, kind in KINDS.items() if kind.config == name), None)


def build_name(name: str, dynamic_ranges: bool) -> str:
    """How a build is named where static and dynamic int8 must be told apart (bundles)."""
    return (dynamic_variant(name) or name) if dynamic_ranges else name


def native(name: str, cpu_flags) -> bool:
    """Whether an x86 CPU with these flags computes the precision natively (True where no flag is needed)."""
    flags = _fact(name, "native_flags")
    return not flags or bool(flags & set(cpu_flags))


def emulated(name: str, cpu_flags) -> bool:
    """Emulated, slower than fp32, on a CPU with these flags (bf16 without avx512_bf16 or AMX)."""
    return bool(_fact(name, "emulated")) and not native(name, cpu_flags)


def listed_order(name: str) -> Tuple[int, str]:
    """A sort key: the config precisions in the table's order, any other name after them by name."""
    return (CONFIG_NAMES.index(name) if name in CONFIG_NAMES else 99, name)


def from_op_counts(counts: Mapping[str, int]) -> Optional[str]:
    """What a build ran, named from its compute ops counted by precision (int8 ops as int8):
    a quantized precision alone is itself, beside float ops its partial one (int8: mixed);
    None where no op ran quantized (the backend names the float that ran)."""
    ran = [name for name, count in counts.items() if count]
    whole = next((name for name in ran if quantized(name)), None)
    if whole is None:
        return None
    return (partial(whole) or whole) if len(ran) > 1 else whole
