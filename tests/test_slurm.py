"""A sweep on a real SLURM cluster: munged, slurmctld and slurmd (Debian's slurm-wlm and
munge; .ci/run installs them) started for the session as a one-node cluster on this
machine, and `parity -m hydra/launcher=submitit_slurm ...` run on it as a user runs it.
Without the daemons the test skips; with CI set it fails instead."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from conftest import read_report, run_cli

PROGRAMS = ("munged", "slurmctld", "slurmd", "sinfo", "sbatch", "squeue", "scancel")
SEARCH_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])


def _program(name: str) -> str:
    return shutil.which(name, path=SEARCH_PATH) or ""


def _skip_or_fail(message: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _slurm_conf(folder: Path) -> str:
    """One node, this machine as `slurmd -C` describes it, reached on 127.0.0.1; no
    accounting (no slurmdbd), no cgroups."""
    node = subprocess.run([_program("slurmd"), "-C"], capture_output=True, text=True, check=True).stdout
    node = node.splitlines()[0]  # NodeName=<host> CPUs=... RealMemory=...
    host = node.split()[0].split("=", 1)[1]
    return "\n".join([
        "ClusterName=parity", f"SlurmctldHost={host}(127.0.0.1)",
        f"SlurmctldPort={_free_port()}", f"SlurmdPort={_free_port()}",
        "AuthType=auth/munge", "CredType=cred/munge", f"AuthInfo=socket={folder}/munge/munge.socket",
        "SlurmUser=root", "SlurmdUser=root", "MailProg=/bin/true", "MpiDefault=none", "ReturnToService=2",
        f"StateSaveLocation={folder}/state", f"SlurmdSpoolDir={folder}/spool",
        f"SlurmctldPidFile={folder}/slurmctld.pid", f"SlurmdPidFile={folder}/slurmd.pid",
        f"SlurmctldLogFile={folder}/slurmctld.log", f"SlurmdLogFile={folder}/slurmd.log",
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
        "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU",
        "AccountingStorageType=accounting_storage/none", "JobAcctGatherType=jobacct_gather/none",
        "JobCompType=jobcomp/none",
        f"{node} NodeAddr=127.0.0.1 State=UNKNOWN",
        "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP", ""])


def _start_munged(folder: Path) -> None:
    """munged with its own key and socket, so that nothing of this machine's is touched."""
    munge = folder / "munge"
    munge.mkdir(mode=0o755)  # the socket's folder must be searchable by all
    (munge / "munge.key").write_bytes(os.urandom(1024))
    (munge / "munge.key").chmod(0o600)
    subprocess.run([_program("munged"), "--force", f"--socket={munge}/munge.socket",
                    f"--key-file={munge}/munge.key", f"--pid-file={munge}/munged.pid",
                    f"--log-file={munge}/munged.log", f"--seed-file={munge}/munged.seed"], check=True)


def _wait_for_idle_node(env: dict, folder: Path, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        states = subprocess.run([_program("sinfo"), "-h", "-o", "%T"], env=env, capture_output=True, text=True)
        if states.stdout.split() == ["idle"]:
            return
        time.sleep(0.2)
    logs = "".join(path.read_text()[-2000:] for path in (folder / "slurmctld.log", folder / "slurmd.log")
                   if path.exists())
    pytest.fail(f"the SLURM node did not become idle in {seconds} s: {states.stdout}{states.stderr}\n{logs}")


def _stop(pid_files) -> None:
    """SIGTERM to every daemon, then wait until they have all exited."""
    pids = []
    for pid_file in pid_files:
        try:
            pids.append(int(pid_file.read_text()))
            os.kill(pids[-1], signal.SIGTERM)
        except (OSError, ValueError):
            pass
    deadline = time.monotonic() + 10
    while pids and time.monotonic() < deadline:
        pids = [pid for pid in pids if _running(pid)]
        time.sleep(0.05)


def _running(pid: int) -> bool:
    """Not gone and not a zombie (the daemons are orphans: init may reap them late)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """The environment (SLURM_CONF) of a one-node SLURM cluster running on this machine."""
    missing = [name for name in PROGRAMS if not _program(name)]
    if missing:
        _skip_or_fail(f"no SLURM here ({', '.join(missing)} not found): "
                      "`apt-get install slurm-wlm munge` (.ci/run does)")
    if os.geteuid() != 0:
        _skip_or_fail("a one-node SLURM cluster needs root (slurmd runs the jobs as their user)")
    folder = tmp_path_factory.mktemp("slurm")
    for name in ("state", "spool"):
        (folder / name).mkdir()
    (folder / "slurm.conf").write_text(_slurm_conf(folder))
    (folder / "cgroup.conf").write_text("CgroupPlugin=autodetect\n")  # read by slurmd; no cgroup plugin is used
    env = {**os.environ, "SLURM_CONF": str(folder / "slurm.conf")}
    try:
        _start_munged(folder)
        for daemon in ("slurmctld", "slurmd"):
            subprocess.run([_program(daemon), "-f", str(folder / "slurm.conf")], env=env, check=True)
        _wait_for_idle_node(env, folder)
        yield env
    finally:
        jobs = subprocess.run([_program("squeue"), "-h", "-o", "%i"], env=env, capture_output=True, text=True)
        if jobs.stdout.split():
            subprocess.run([_program("scancel"), *jobs.stdout.split()], env=env)
        _stop([folder / "slurmd.pid", folder / "slurmctld.pid"])
        _stop([folder / "munge" / "munged.pid"])


def test_sweep_on_a_slurm_cluster(tmp_path, slurm_cluster):
    """Two jobs, each a SLURM job: both pass, each leaves its run folder and reports, the
    sweep writes its summary and exits 0. submitit's failing sacct polls (no accounting
    storage) are said once, as one line."""
    started = time.monotonic()
    result = run_cli(["-m", "hydra/launcher=submitit_slurm", "hydra.launcher.timeout_min=5",
                      "precision=fp32", "target=ort_cpu,openvino_cpu"], tmp_path, env=slurm_cluster, timeout=180)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    (sweep,) = (tmp_path / "multirun").glob("*/*")
    summary = json.loads((sweep / "sweep.json").read_text())
    assert summary["exit_code"] == 0
    assert sorted(job["dir"] for job in summary["jobs"]) == ["target=openvino_cpu", "target=ort_cpu"]
    for job in summary["jobs"]:
        assert job["verdict"] == "pass", job
        assert read_report(sweep / job["dir"])["verdict"] == "pass"
        assert json.loads((sweep / job["dir"] / "job.json").read_text())["exit_code"] == 0
    assert all((sweep / name).is_file() for name in ("sweep.md", "sweep.html", "junit.xml"))
    assert "sweep: 2 jobs, exit code 0" in result.stdout

    # each job ran as a SLURM job: submitit's log of it names its SLURM job id
    logs = sorted((sweep / ".submitit").glob("*/*_log.out"))
    assert len(logs) == 2 and all("JobEnvironment(job_id=" in log.read_text() for log in logs), logs
    assert "Bypassing sacct error" not in output
    assert output.count("sacct fails on this cluster") == 1, output
    print(f"SLURM sweep of 2 jobs: {time.monotonic() - started:.1f} s")
