"""benchmarks/avx2_only.py: a command run as on an AVX2-only CPU sees no AVX-512, VNNI or AMX,
in CPUID (what runtimes dispatch on) and /proc/cpuinfo (what parity records), and loses
nothing else: its own SIGSEGV handler still runs, a crash still ends it, ONNX Runtime's output
is the same."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import avx2_only  # noqa: E402

MASKED = ("avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx512_fp16", "avx_vnni", "amx_tile", "amx_bf16",
          "amx_int8")
HAS_FAULTING = "cpuid_fault" in Path("/proc/cpuinfo").read_text().split() if Path("/proc/cpuinfo").exists() else False


def run_masked(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "benchmarks" / "avx2_only.py"), sys.executable, "-c", code],
                          capture_output=True, text=True, timeout=120)


def test_unavailable_says_why_where_the_cpu_cannot_fault_cpuid():
    if HAS_FAULTING:
        assert avx2_only.library().exists()
        return
    with pytest.raises(avx2_only.Unavailable, match="CPUID faulting|Linux x86_64"):
        avx2_only.library()
    done = run_masked("print(1)")
    assert done.returncode == 3 and done.stderr.startswith("avx2_only: ")


needs_faulting = pytest.mark.skipif(not HAS_FAULTING, reason="this CPU has no CPUID faulting (the test above checks "
                                                             "the error)")


@needs_faulting
def test_runtimes_and_parity_see_an_avx2_only_cpu():
    native = subprocess.run([sys.executable, "-c", "from pipeline.environment import cpu; print(cpu()['flags'])"],
                            capture_output=True, text=True, check=True).stdout
    done = run_masked("import json; from pipeline.environment import cpu\n"
                      "from numpy._core._multiarray_umath import __cpu_features__ as f\n"
                      "print(json.dumps({'flags': cpu()['flags'], 'numpy_avx512f': f['AVX512F'], "
                      "'numpy_avx2': f['AVX2']}))")
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert not set(MASKED) & set(seen["flags"]) and seen["numpy_avx512f"] is False
    assert ("avx2" in seen["flags"]) == ("avx2" in native) and seen["numpy_avx2"] == ("avx2" in native)
    assert set(seen["flags"]) <= set(eval(native))


@needs_faulting
def test_a_programs_own_segv_handler_and_crashes_still_work():
    handled = run_masked("import signal, os, sys\n"
                         "signal.signal(signal.SIGSEGV, lambda *a: (print('handled', flush=True), os._exit(7)))\n"
                         "os.kill(os.getpid(), signal.SIGSEGV)")
    assert handled.returncode == 7 and handled.stdout.strip() == "handled"
    crashed = run_masked("import ctypes; ctypes.string_at(0)")
    assert crashed.returncode == -signal.SIGSEGV


@needs_faulting
def test_onnx_runtime_gives_the_same_output_on_its_avx2_kernels():
    code = ("import numpy as np, onnxruntime as ort\n"
            "s = ort.InferenceSession('pipeline/assets/digits_cnn.onnx', providers=['CPUExecutionProvider'])\n"
            "x = np.random.default_rng(0).random((1, *s.get_inputs()[0].shape[1:]), dtype=np.float32)\n"
            "print(repr(s.run(None, {s.get_inputs()[0].name: x})[0].tolist()))")
    native = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    masked = subprocess.run([sys.executable, str(REPO / "benchmarks" / "avx2_only.py"), sys.executable, "-c", code],
                            capture_output=True, text=True, cwd=REPO, timeout=120)
    assert masked.returncode == 0, masked.stderr
    assert abs(np.array(eval(masked.stdout)) - np.array(eval(native.stdout))).max() < 1e-4


@needs_faulting
def test_a_script_becomes_avx2_only_once(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(f"import os, sys; sys.path.insert(0, {str(REPO / 'benchmarks')!r})\n"
                      "from avx2_only import become\n"
                      "print(become(sys.argv[1]), os.getpid())\n"
                      "from pipeline.environment import cpu; print(' '.join(cpu()['flags']))\n")
    done = subprocess.run([sys.executable, str(script), "AVX2"], capture_output=True, text=True, timeout=120)
    said, flags = done.stdout.splitlines()
    assert said.startswith("an AVX2-only CPU") and not set(MASKED) & set(flags.split())
    native = subprocess.run([sys.executable, str(script), "native"], capture_output=True, text=True, timeout=120)
    assert native.stdout.splitlines()[0].startswith("native ")


def test_isa_avx2_falls_back_to_capping_openvino_only_where_the_cpu_cannot_be_presented(monkeypatch):
    def unavailable():
        raise avx2_only.Unavailable("no CPUID faulting here")

    monkeypatch.setattr(avx2_only, "library", unavailable)
    env, how = avx2_only.isa_environment("AVX2", {"PATH": "/bin"})
    assert env["ONEDNN_MAX_CPU_ISA"] == env["OV_CPU_MAX_ISA"] == "AVX2" and "LD_PRELOAD" not in env
    assert how == "OpenVINO's oneDNN capped to AVX2 only (no CPUID faulting here)"
    assert avx2_only.isa_environment("native", {"PATH": "/bin"}) == ({"PATH": "/bin"}, "native")


@needs_faulting
def test_a_handler_installed_with_signal_keeps_cpuid_masked_and_still_runs(tmp_path):
    """glibc's signal() reaches its own sigaction past the preload's: the preload takes it too,
    so a CPUID after it is still answered (not a crash) and the program's handler still runs."""
    source = tmp_path / "program.c"
    source.write_text("#include <signal.h>\n#include <stdio.h>\n#include <unistd.h>\n#include <cpuid.h>\n"
                      "static void on(int s) { printf(\"handled %d\\n\", s); fflush(stdout); _exit(7); }\n"
                      "int main(void) { unsigned a, b, c, d; signal(SIGSEGV, on); __cpuid_count(7, 0, a, b, c, d);\n"
                      "  printf(\"avx512f %u\\n\", (b >> 16) & 1); fflush(stdout); raise(SIGSEGV); return 0; }\n")
    subprocess.run(["gcc", "-o", str(tmp_path / "program"), str(source)], check=True)
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "avx2_only.py"), str(tmp_path / "program")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 7 and done.stdout.split("\n")[:2] == ["avx512f 0", f"handled {int(signal.SIGSEGV)}"]
