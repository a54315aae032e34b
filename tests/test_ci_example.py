"""The example CI job (examples/ci/parity-gate.yml), step by step as GitHub Actions runs
it: its shell steps run here with bash against a model repo made of the embedded digits
model and data (the install and the actions steps, which need GitHub, are skipped)."""

from __future__ import annotations

import importlib.resources
import os
import re
import subprocess
from pathlib import Path

import yaml

from conftest import QUICK_PROFILE, QUICK_TIMING, SHARED_CACHE

REPO = Path(__file__).resolve().parents[1]
WORKFLOW = REPO / "examples" / "ci" / "parity-gate.yml"


def model_repo(root: Path) -> None:
    assets = importlib.resources.files("pipeline") / "assets"
    (root / "conf" / "model").mkdir(parents=True)
    (root / "conf" / "data").mkdir(parents=True)
    (root / "conf" / "model" / "cls.yaml").write_text(f"path: {assets / 'digits_cnn.onnx'}\nname: cls\n")
    (root / "conf" / "data" / "cls.yaml").write_text(
        f"kind: tensors\npath: {assets / 'digits.npz'}\ncalibration_size: 32\nvalidation_size: 64\n")


def run_steps(root: Path, extra_override: str = "") -> dict:
    """Run the workflow's shell steps in order (``extra_override`` appended to the sweep's
    command line); returns {step name: exit code}."""
    steps = yaml.safe_load(WORKFLOW.read_text())["jobs"]["parity"]["steps"]
    outputs, summary = root / "github_output", root / "step_summary"
    env = {**os.environ, "NO_COLOR": "1", "GITHUB_OUTPUT": str(outputs), "GITHUB_STEP_SUMMARY": str(summary)}
    codes = {}
    for step in steps:
        if "run" not in step or step["name"] == "Install parity":
            continue
        script = step["run"]
        if "steps.sweep.outputs.exit_code" in script:
            recorded = dict(line.split("=", 1) for line in outputs.read_text().split())
            script = re.sub(r"\$\{\{\s*steps\.sweep\.outputs\.exit_code\s*\}\}", recorded["exit_code"], script)
        # the suite's shared stage cache and short timing, as every test job (conftest.run_cli)
        script = script.replace("pipeline.cache_dir=parity-cache", f"pipeline.cache_dir={SHARED_CACHE[0]}")
        script = script.replace("hydra.sweep.dir=sweep", " ".join(["hydra.sweep.dir=sweep", *QUICK_TIMING,
                                                                     *QUICK_PROFILE, extra_override]))
        assert "${{" not in script, script
        codes[step["name"]] = subprocess.run(["bash", "-e", "-c", script], cwd=root, env=env,
                                             capture_output=True, text=True, timeout=600).returncode
    return codes


def test_example_ci_job_sweeps_publishes_the_matrix_and_gates(tmp_path):
    model_repo(tmp_path)
    codes = run_steps(tmp_path)
    assert codes["Sweep"] == 0
    assert codes["Gate on the sweep's exit code (the worst of its jobs)"] == 0
    summary = (tmp_path / "step_summary").read_text()
    assert "# parity sweep" in summary and "| ort_cpu |" in summary and "| openvino_cpu |" in summary
    assert "6 of 6 jobs passed" in summary
    assert (tmp_path / "sweep" / "junit.xml").is_file()
    assert (tmp_path / "release" / "release.json").is_file()


def test_example_ci_job_fails_the_gate_when_a_configuration_fails(tmp_path):
    model_repo(tmp_path)
    # int8 cannot meet an fp32-grade cosine (the task floor off: top-1 alone would pass it); the
    # failing jobs' diagnosis is another test's (tests/test_time_to_answer.py): no budget for it here
    codes = run_steps(tmp_path, "validation.min_cosine=0.9999999 validation.task_min_cosine=null "
                                "validation.diagnosis_budget=0 validation.diagnosis_min_seconds=0")
    assert codes["Sweep"] == 0  # the step records the code; the gate step fails the job
    assert codes["Gate on the sweep's exit code (the worst of its jobs)"] == 3
    summary = (tmp_path / "step_summary").read_text()
    assert "2 of 6 jobs passed" in summary and "fail (exit 3)" in summary
