"""Every backend module satisfies the seam (pipeline/backends/protocol.py), and each declared
capability is backed by the functions it promises, and no such function is there undeclared."""

import dataclasses
import inspect

import pytest

from pipeline import backends
from pipeline.backends.protocol import PROMISED_FUNCTIONS, Backend, Capabilities, Session

NAMES = sorted(backends.MODULES)


def _holder(module, where: str):
    return module if where == "module" else module.Session


@pytest.mark.parametrize("name", NAMES)
def test_every_backend_module_satisfies_the_protocol(name):
    module = backends.spec(name)
    assert isinstance(module, Backend)
    assert module.NAME == name
    assert isinstance(module.CAPABILITIES, Capabilities)
    assert backends.capabilities(name) is module.CAPABILITIES
    for function in ("available", "versions", "check_config", "build", "load"):
        assert callable(getattr(module, function)), f"{name}.{function}"
    for method in ("run", "effective", "probe", "run_probe"):
        assert callable(getattr(module.Session, method, None)), f"{name}.Session.{method}"


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("field", sorted(PROMISED_FUNCTIONS))
def test_each_capability_is_backed_by_its_functions_and_only_then(name, field):
    module = backends.spec(name)
    where, functions = PROMISED_FUNCTIONS[field]
    declared = bool(getattr(module.CAPABILITIES, field))
    holder = _holder(module, where)
    for function in functions:
        present = callable(getattr(holder, function, None))
        assert present == declared, (f"{name}: {field}={getattr(module.CAPABILITIES, field)!r} but "
                                     f"{where} function {function} is {'present' if present else 'missing'}")


def test_the_promised_functions_name_capability_fields():
    fields = {f.name for f in dataclasses.fields(Capabilities)}
    assert set(PROMISED_FUNCTIONS) <= fields


@pytest.mark.parametrize("name", NAMES)
def test_declared_values_are_consistent(name):
    can = backends.capabilities(name)
    assert can.precisions and can.devices and can.memory_modes
    assert all(device == device.upper() for device in can.devices)
    assert set(can.own_int8) <= set(can.precisions) and set(can.runtime_precisions) <= set(can.precisions)
    assert not set(can.own_int8) & set(can.runtime_precisions)
    if can.measures_qdq or can.qdq_latency:  # measured on the Q/DQ model: the runtime builds from it
        assert not set(can.own_int8) & {"int8", "mixed"}
    assert set(can.gpu_devices) <= set(backends.GPU_DEVICES)


def test_capabilities_are_frozen_and_checked():
    can = backends.capabilities("onnxruntime")
    with pytest.raises(dataclasses.FrozenInstanceError):
        can.tuning = False
    with pytest.raises(ValueError, match="qdq_placement"):
        Capabilities(precisions=("fp32",), devices=("CPU",), qdq_placement="outputs")
    with pytest.raises(ValueError, match="own_int8"):
        Capabilities(precisions=("fp32",), devices=("CPU",), own_int8=("int8",))


def test_a_session_class_matches_the_session_protocol_shape():
    members = {name for name, _ in inspect.getmembers(Session) if not name.startswith("_")}
    assert {"run", "effective", "probe", "run_probe"} <= members
