"""Tiny backends for tests/test_worker.py: ``settings["behaviour"]`` picks what ``run`` does."""

from __future__ import annotations

import ctypes
import os
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np


CAPABILITIES = SimpleNamespace(idle_threads_spin=True)  # behaviour "spin": a worker speed._turn pauses


class Session:
    inputs = ["x"]
    outputs = ["y"]

    def __init__(self, settings: dict):
        self.behaviour = settings["behaviour"]
        self.settings = settings
        self.calls = 0
        if self.behaviour == "spin":  # a thread that never sleeps, as an idle runtime's pool threads spin
            threading.Thread(target=_spin, daemon=True).start()

    def run(self, feeds: dict) -> dict:
        self.calls += 1
        if self.behaviour == "count":  # how many samples it was given
            return {"y": feeds["x"] * 2, "calls": np.array(self.calls)}
        if self.behaviour == "raise_second" and self.calls == 2:
            raise ValueError("the second sample is bad")
        if self.behaviour == "raise_tenth" and self.calls == 10:
            raise ValueError("the tenth sample is bad")
        if self.behaviour == "abort":
            os.abort()
        if self.behaviour == "noisy_abort":
            os.write(2, b"worker_backends: about to abort\n")
            os.abort()
        if self.behaviour == "segfault":
            ctypes.string_at(0)
        if self.behaviour == "hang":
            while True:
                time.sleep(60)
        if self.behaviour == "raise":
            raise ValueError("bad input shape\nsecond line")
        if self.behaviour == "raise_nested":  # how OpenVINO words its errors
            raise RuntimeError("Exception from src/inference/src/cpp/core.cpp:117:\n"
                               "Exception from src/inference/src/dev/plugin.cpp:54:\nResource temporarily unavailable\n")
        if self.behaviour == "allocate":
            block = np.ones(self.settings["mb"] << 20, dtype=np.uint8)
            return {"y": np.array([block.size])}
        return {"y": feeds["x"] * 2}

    def effective(self) -> dict:
        return {"device": "CPU", "precision": "fp32", "pid": os.getpid()}


def _spin() -> None:
    while True:
        pass


def load(artifact_dir: Path, settings: dict) -> Session:
    if settings["behaviour"] == "load_raise":
        raise RuntimeError(f"cannot read {Path(artifact_dir) / 'model.bin'}")
    if settings["behaviour"] == "load_once":  # a second process of the same build fails to load
        marker = Path(settings["marker"])
        if marker.exists():
            raise RuntimeError("loaded once already")
        marker.touch()
    return Session(settings)
