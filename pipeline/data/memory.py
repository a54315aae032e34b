"""What a run's data will take in memory, said before it is loaded (issue 28): the
calibration and validation inputs are held in memory while calibrate and verify run, so
their size is the samples times one sample's input bytes. A run whose explicit sample
counts cannot fit in the memory available is refused up front (exit 2, with the
estimate and a count that fits) instead of dying minutes later; without explicit counts
(every sample found, up to the caps) it is a warning. A MemoryError that happens anyway is
exit 5 (pipeline/errors.py: environment_fault)."""

from __future__ import annotations

import logging
import math
from typing import Optional, Sequence

import numpy as np

from pipeline.errors import ConfigError, available_memory_bytes

log = logging.getLogger("parity")

HEADROOM = 0.5  # of the memory available: the runtimes, the model and the outputs need the rest
_said: set = set()


def sample_bytes(inputs: Sequence) -> int:
    """One sample's input bytes (TensorSpec-like: shape, dtype; a range's max shape; other
    unknown dims count as 1)."""
    return sum(int(np.prod([max(int(d), 1) for d in _largest(spec)] or [1])) * np.dtype(spec.dtype).itemsize
               for spec in inputs)


def _largest(spec) -> Sequence[int]:
    found = getattr(spec, "range", None)
    return found["max"] if found else spec.shape


def check(data, inputs: Sequence, available: Optional[int] = None) -> None:
    """ConfigError when data.calibration_size + data.validation_size samples of ``inputs``
    cannot fit in HEADROOM of the available memory; a warning when the caps (sizes left
    null) might not."""
    available = available_memory_bytes() if available is None else available
    per_sample = sample_bytes(inputs)
    if not available or not per_sample:
        return
    explicit = data.calibration_size is not None and data.validation_size is not None
    count = ((data.calibration_size if data.calibration_size is not None else data.calibration_cap)
             + (data.validation_size if data.validation_size is not None else data.validation_cap))
    needed, budget = count * per_sample, HEADROOM * available
    if needed <= budget:
        return
    fits = int(math.floor(budget / per_sample))
    text = (f"the data would take about {_gib(needed)} in memory ({count} samples x {_gib(per_sample)} of input "
            f"each) with {_gib(available)} available")
    if explicit or per_sample > budget:
        raise ConfigError(f"{text}: lower data.calibration_size and data.validation_size (about {fits} samples fit "
                          "in all), or give smaller model.input_shapes")
    if text not in _said:
        _said.add(text)
        log.warning("%s if the data holds that many samples (data.calibration_cap, data.validation_cap): "
                    "set data.validation_size and data.calibration_size to what fits", text)


def _gib(count: float) -> str:
    return f"{count / 2**30:.2f} GiB" if count >= 2**27 else f"{count / 2**20:.1f} MiB"
