"""parity: declarative deployment of one ONNX model to many inference runtimes."""

import os
import sys

__version__ = "0.1.0"

# No telemetry, nothing written into $HOME: every parity process (the CLIs and the spawned
# workers, which import this package before any runtime) opts out here, before a runtime is
# imported. Checked by tests/test_openvino_truth.py (fresh $HOME, no network lookups).
# - `import openvino` imports its converter (openvino.tools.ovc), which sends a usage event
#   through the openvino_telemetry package (a DNS lookup, files under ~/intel) unless a
#   consent file in $HOME opts out. OpenVINO (and NNCF) fall back to a no-op stub when that
#   package cannot be imported: it is made unimportable.
# - ONNX Runtime (1.31, Linux) keeps a device id and an event store under
#   ~/.cache/Microsoft/DeveloperTools/.onnxruntime unless ORT_DISABLE_TELEMETRY is set
#   when it is imported (also inherited by every child process).
sys.modules["openvino_telemetry"] = None
os.environ["ORT_DISABLE_TELEMETRY"] = "1"
