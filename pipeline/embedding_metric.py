"""metric=embedding's old path, kept for imports made before pipeline/metrics/: everything is
re-exported from pipeline.metrics.embedding."""

from pipeline.metrics.embedding import ROWS, TIE, Embedding  # noqa: F401
