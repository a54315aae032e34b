"""parity: declarative deployment of one ONNX model to many inference runtimes."""

__version__ = "0.1.0"
