"""Run a command as on an AVX2-only x86 CPU, on a CPU that has more (AVX-512, VNNI, AMX).

    python benchmarks/avx2_only.py COMMAND [ARG...]
    e.g. python benchmarks/avx2_only.py python benchmarks/int8_graph_speed.py

The issues' figures are set on an AVX2-only CPU (a 2-core AMD EPYC without VNNI); ONNX
Runtime's MLAS has no switch to cap its kernels, and OpenVINO's (ONEDNN_MAX_CPU_ISA) does
not reach ONNX Runtime or /proc/cpuinfo. This preloads native/avx2_only.c: the command and
every process it starts see CPUID and /proc/cpuinfo without AVX-512, AVX-VNNI, AVX10 and AMX,
so every runtime dispatches the kernels an AVX2-only CPU runs (8-bit products summed in 16
bits without VNNI, FMA3 float kernels), natively. What it cannot change: the cores, caches
and clock of this CPU, so absolute times are this CPU's, and ratios between builds are the
figures. Needs Linux on x86_64 with CPUID faulting (the `cpuid_fault` flag; Intel since Ivy
Bridge, AMD since Zen 4, passed through by KVM and Firecracker) and gcc.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

SOURCE = Path(__file__).resolve().parent / "native" / "avx2_only.c"
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "parity-benchmarks"


PRESENTED = "an AVX2-only CPU as every process sees it (benchmarks/avx2_only.py)"


class Unavailable(RuntimeError):
    """This machine cannot present an AVX2-only CPU: the reason and what would."""


def library() -> Path:
    """The preload library, compiled once per source version into the user's cache."""
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        raise Unavailable(f"an AVX2-only CPU can be presented on Linux x86_64 only, not {platform.system()} "
                          f"{platform.machine()}")
    if "cpuid_fault" not in Path("/proc/cpuinfo").read_text().split():
        raise Unavailable("this CPU (or its hypervisor) has no CPUID faulting (no `cpuid_fault` in /proc/cpuinfo): "
                          "run on an AVX2-only machine instead")
    compiler = shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        raise Unavailable("no C compiler: install gcc (Debian: apt-get install gcc)")
    source = SOURCE.read_bytes()
    built = CACHE / f"avx2_only-{hashlib.sha256(source).hexdigest()[:12]}.so"
    if not built.exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        partial = built.with_suffix(f".{os.getpid()}.tmp")
        done = subprocess.run([compiler, "-O2", "-shared", "-fPIC", "-o", str(partial), str(SOURCE), "-ldl"],
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise Unavailable(f"{compiler} could not build {SOURCE.name}: {done.stderr.strip()[-500:]}")
        partial.replace(built)
    return built


def environment(base: dict | None = None) -> dict:
    """``base`` (os.environ by default) with the preload added: for subprocesses."""
    env = dict(os.environ if base is None else base)
    env["LD_PRELOAD"] = " ".join(filter(None, [str(library()), env.get("LD_PRELOAD", "")]))
    return env


def isa_environment(isa: str, base: dict | None = None) -> tuple:
    """(the environment for subprocesses timed at ``isa``, what it holds, in words): "native"
    as it is; "AVX2" as an AVX2-only CPU where this machine can present one, else with only
    OpenVINO's oneDNN capped to AVX2 (ONNX Runtime then runs this CPU's own kernels)."""
    env = dict(os.environ if base is None else base)
    if isa == "native":
        return env, "native"
    try:
        return environment(env), PRESENTED
    except Unavailable as error:
        return env, _capped(env, isa, error)


def become(isa: str) -> str:
    """For a script that loads its runtimes in-process: at "AVX2", start it again as on an
    AVX2-only CPU (once; the preload cannot reach a process already running), or cap
    OpenVINO's oneDNN where this machine cannot present one. Returns what holds, in words."""
    if isa == "native":
        return "native"
    try:
        preload = str(library())
    except Unavailable as error:
        return _capped(os.environ, isa, error)
    if preload not in os.environ.get("LD_PRELOAD", "").split():
        os.execvpe(sys.executable, [sys.executable, *sys.orig_argv[1:]], environment())
    return PRESENTED


def _capped(env, isa: str, error: Unavailable) -> str:
    """The fallback where no AVX2-only CPU can be presented: OpenVINO's oneDNN capped in ``env``."""
    env.update(ONEDNN_MAX_CPU_ISA=isa, OV_CPU_MAX_ISA=isa)
    return f"OpenVINO's oneDNN capped to {isa} only ({error})"


def seen_flags(env: dict) -> str:
    """The CPU flags parity records when run with ``env``."""
    done = subprocess.run([sys.executable, "-c", "from pipeline.environment import cpu; print(' '.join(cpu()['flags']))"],
                          capture_output=True, text=True, env=env)
    return done.stdout.strip() or done.stderr.strip()[-200:]


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    try:
        env = environment()
    except Unavailable as error:
        print(f"avx2_only: {error}", file=sys.stderr)
        return 3
    try:
        os.execvpe(argv[0], argv, env)  # the command's own exit status, a signal's included
    except FileNotFoundError:
        print(f"avx2_only: no such command: {argv[0]}", file=sys.stderr)
        return 127


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
