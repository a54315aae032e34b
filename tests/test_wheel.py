"""The wheel works outside the checkout: config tree and default model ship inside it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile

from conftest import REPO


def test_wheel_installs_and_runs_default_job_outside_checkout(tmp_path):
    source = tmp_path / "src"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(
        ".git", "outputs", "multirun", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(tmp_path / "dist"), str(source)], check=True)
    (wheel,) = (tmp_path / "dist").glob("parity-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for shipped in ("conf/config.yaml", "conf/target/ort_cpu.yaml", "conf/hydra/job_logging/parity.yaml",
                    "pipeline/assets/digits_cnn.onnx", "pipeline/assets/digits.npz", "stages/verify/__init__.py",
                    "pipeline/report/templates/report.html.j2", "pipeline/report/templates/report.md.j2",
                    "pipeline/report/templates/charts.svg.j2", "pipeline/report/templates/report.css"):
        assert shipped in names

    env_dir = tmp_path / "venv"
    venv.create(env_dir)  # without pip of its own (ensurepip took 7 s): this pip installs into it
    python = env_dir / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "--no-index",
                    str(wheel)], check=True)
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          capture_output=True, text=True, check=True).stdout.strip()
    # The dependencies come from this interpreter's site-packages through PYTHONPATH, which
    # (unlike --system-site-packages) does not run the editable install's import hook.
    env = {**os.environ, "PYTHONPATH": sysconfig.get_path("purelib"), "NO_COLOR": "1"}
    work = tmp_path / "elsewhere"
    work.mkdir()
    where = subprocess.run([str(python), "-c", "import pipeline, conf; print(pipeline.__file__, conf.__file__)"],
                           cwd=work, env=env, capture_output=True, text=True, check=True).stdout
    assert str(REPO) not in where and site in where

    helped = subprocess.run([str(env_dir / "bin" / "parity"), "--help"], cwd=work, env=env,
                            capture_output=True, text=True)
    assert helped.returncode == 0, helped.stderr
    assert "target: mnn_cpu, mnn_opencl, mnn_vulkan, ncnn_cpu, ncnn_vulkan, openvino_cpu, ort_cpu" in helped.stdout
    result = subprocess.run([str(env_dir / "bin" / "parity")], cwd=work, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "verdict: PASS" in result.stdout
    # the default precision=auto ships the fastest passing build of the embedded model
    assert "precision=auto shipped" in result.stdout
    assert list(work.glob("outputs/*/*/bundle/digits_cnn-ort_cpu-*/manifest.json"))

