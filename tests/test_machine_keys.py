"""A stage cache shared between machines or runs (PARITY_CACHE_DIR, a CI cache) never
serves a measurement taken elsewhere: the stages that run something here (ON_MACHINE) hold
the CPU, whether the target's runtime loads and the target's device in their keys."""

from __future__ import annotations

import builtins

import stages
from conftest import composed
from pipeline.config.validation import validate


def _target(name):
    return validate(composed(f"target={name}", "precision=fp32")).target


def test_a_vulkan_target_names_the_drivers_the_loader_finds(monkeypatch, tmp_path):
    target = _target("ncnn_vulkan")
    with_drivers = stages.machine(target)
    monkeypatch.setenv("VK_ICD_FILENAMES", str(tmp_path / "no-driver.json"))
    monkeypatch.setenv("VK_DRIVER_FILES", str(tmp_path / "no-driver.json"))
    without = stages.machine(target)
    assert without["device"] != with_drivers["device"] and without["device"].startswith("VULKAN: 0 Vulkan driver")
    assert without["cpu"] == with_drivers["cpu"]
    # the CPU-only part (the sensitivity search's) does not name the device
    assert "device" not in stages.machine(target, with_device=False)


def test_a_cpu_target_holds_the_cpu_and_whether_its_runtime_loads(monkeypatch):
    found = stages.machine(_target("ort_cpu"))
    assert set(found) == {"cpu", "runtime"} and found["runtime"] == "loads"
    real_import = builtins.__import__

    def no_ncnn(name, *args, **kwargs):
        if name == "ncnn":
            raise ImportError("No module named ncnn (hidden by the test)")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_ncnn)
    missing = stages.machine(_target("ncnn_cpu"))
    assert "ncnn is not installed" in missing["runtime"]


def test_the_stages_that_run_here_declare_it():
    declared = {name: getattr(stages.load(name), "ON_MACHINE", None) for name in
                ("convert", "calibrate", "sensitivity", "build", "tune", "verify", "profile", "package")}
    assert declared == {"convert": None, "calibrate": None, "sensitivity": "cpu", "build": "device",
                        "tune": "device", "verify": "device", "profile": "device", "package": None}
