"""Every stage's cache key (and every memo's) for each target x precision on the default
model, as the runner stores them: a refactor that changes no result leaves them
byte-identical. Runs convert .. build for each pair in a fresh cache, with the code's own
hash pinned (PARITY_CODE_VERSION: every key holds it, and a refactor changes it).

    python scripts/cache_keys.py > before.json   # ... change the code ...
    python scripts/cache_keys.py > after.json && diff before.json after.json
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STAGES = "[convert,calibrate,sensitivity,build]"


def keys_of(target: str, precision: str, scratch: Path) -> dict:
    cache, run = scratch / f"cache-{target}-{precision}", scratch / f"run-{target}-{precision}"
    done = subprocess.run([sys.executable, "-m", "pipeline", f"target={target}", f"precision={precision}",
                           f"pipeline.cache_dir={cache}", f"pipeline.stages={STAGES}", f"hydra.run.dir={run}"],
                          cwd=scratch, capture_output=True, text=True, check=False,
                          env={**os.environ, "PARITY_CODE_VERSION": "pinned"})
    entries = sorted(str(p.relative_to(cache)) for p in cache.glob("*/*") if p.is_dir()) if cache.is_dir() else []
    return {"exit": done.returncode, "entries": entries}


def main() -> None:
    targets = sorted(p.stem for p in (REPO / "conf" / "target").glob("*.yaml"))
    precisions = sorted(p.stem for p in (REPO / "conf" / "precision").glob("*.yaml"))
    with tempfile.TemporaryDirectory(prefix="parity-keys-") as scratch:
        found = {f"{t} {p}": keys_of(t, p, Path(scratch)) for t in targets for p in precisions}
    json.dump(found, sys.stdout, indent=1, sort_keys=True)
    print()


if __name__ == "__main__":
    main()
