"""How a build is judged against the reference: output metrics, task metrics and their
confidence, speed, the verdict, and the diagnosis of a failing one (layerwise probes, the
float64 truth, advice and its trials)."""
