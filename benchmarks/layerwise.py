"""Layerwise-compare figures on the real PP-OCR text-direction classifier (int8 vs the
fp32 reference, 30 samples), next to the reference figures of the issue.

    python benchmarks/layerwise.py

Prints the layerwise time (the verify stage's own measure), the peak memory of the
`parity` process and of its largest worker process, and the size of the side file.
Reference: Polygraphy's `--onnx-outputs mark all` wrote 71 MB of JSON for this model and
ranked nothing (figure from the issue, measured on the same model)."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from calibration import classifier_args, last_report, parity, write_dataset  # benchmarks/calibration.py

POLYGRAPHY_SIDE_MB = 71.0


def peak_run(args, cwd: Path):
    """(peak RSS of the parity process, of its largest child) in MiB."""
    code = ("import resource, sys; from pipeline.cli import main; sys.argv = ['parity'] + sys.argv[1:]\n"
            "try:\n    main()\nfinally:\n"
            "    print('PEAK_KB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,"
            " resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr)")
    result = subprocess.run([sys.executable, "-c", code, *map(str, args)], cwd=cwd, capture_output=True, text=True)
    own, child = result.stderr.rsplit("PEAK_KB", 1)[1].split()[:2]
    return int(own) / 1024, int(child) / 1024, result


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="parity-bench-layerwise-") as scratch:
        work = Path(scratch)
        data = write_dataset(work / "textlines", calibration=100, validation=30)
        base = [*classifier_args(data, 100, 30), "precision=int8", "target=ort_cpu"]
        prepared = parity([*base, "pipeline.stages=[convert,calibrate,build]"], work)  # cached for the next run
        assert prepared.returncode == 0, prepared.stderr
        own, child, result = peak_run([*base, "validation.layerwise=always", "validation.layerwise_samples=30",
                                       "pipeline.stages=[convert,calibrate,build,verify]"], work)
        report = last_report(work)
        layers = report["verify"]["layerwise"]
        run = sorted((work / "outputs").glob("*/*_*"))[-1]
        side = run / "stages" / "verify" / layers["side_file"]
        workers = 3  # reference, target, fp32 side-by-side build
        print("== layerwise compare: PP-OCR cls, int8 (ort_cpu) vs fp32 reference, 30 samples ==")
        print(f"  tensors compared {layers['compared']}, not exposed {len(layers['not_exposed'])}, "
              f"unmappable {len(layers['unmappable'])}")
        print(f"  layerwise time: {layers['seconds']:.2f} s                     (target <= 10 s)")
        print(f"  peak RSS: parity {own:.0f} MiB, largest worker {child:.0f} MiB, "
              f"bound for all {workers} workers at once {own + workers * child:.0f} MiB   (target <= 1024 MiB)")
        print(f"  side file: {side.stat().st_size / 1e6:.3f} MB            "
              f"(target < 10 MB; Polygraphy mark all: {POLYGRAPHY_SIDE_MB:.0f} MB, no ranking)")
        culprit = layers["first_divergence"]
        print(f"  first divergence at layer_min_cosine {layers['threshold']}: "
              + (f"{culprit['op']} ({culprit['op_type']}, cosine {culprit['cosine']:.4f})" if culprit else "none"))
        print(f"  verdict {report['verdict']} (exit {result.returncode}), output cosine "
              f"{report['verify']['outputs'][0]['metrics']['cosine']:.5f}")
        print(json.dumps({"seconds": layers["seconds"], "peak_parity_mib": round(own), "peak_worker_mib": round(child),
                          "side_file_mb": round(side.stat().st_size / 1e6, 3)}))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    main()
