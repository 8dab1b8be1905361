"""A real single-node Slurm for tests: munged, slurmctld and slurmd under a temporary folder.

Follows shared/notes/slurm-single-node.md (Debian 12's Slurm 22.05 as root, no systemd): the
packages are installed with apt-get when missing; munged gets its own socket and slurmctld/slurmd
their own ports, state, spool and logs under the folder, so nothing of the machine's own Slurm
(if any) is touched; ``stop()`` ends the daemons by the PIDs in their pid files.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
DAEMONS = ("slurmctld", "slurmd", "munged", "sbatch", "squeue", "scontrol", "scancel")


def _which(name: str) -> str | None:
    return shutil.which(name) or next((p for p in (f"/usr/sbin/{name}", f"/usr/bin/{name}") if os.access(p, os.X_OK)), None)


def install_reason() -> str | None:
    """Install the Slurm packages if missing; the reason they cannot be, or None when they are there."""
    if all(_which(d) for d in DAEMONS):
        return None
    if os.geteuid() != 0:
        return "Slurm is not installed and installing it needs root (apt-get install slurmctld slurmd slurm-client munge)"
    if shutil.which("apt-get") is None:
        return "Slurm is not installed and this machine has no apt-get"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    command = ["apt-get", "install", "-y", "--no-install-recommends", *PACKAGES]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600, check=False)
    if result.returncode != 0:  # a stale package index: refresh once and retry
        subprocess.run(["apt-get", "update"], capture_output=True, text=True, env=env, timeout=600, check=False)
        result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600, check=False)
    if result.returncode != 0:
        last = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["no output"]
        return f"apt-get install {' '.join(PACKAGES)} failed: {last[0]}"
    missing = [d for d in DAEMONS if _which(d) is None]
    return f"installed, but {', '.join(missing)} not found" if missing else None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _alive(pid: int) -> bool:
    """A process that exited can linger in the process table here: read its state, not just its pid."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


class SlurmCluster:
    """One node (this machine, all its CPUs) in one default partition."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.conf = self.root / "slurm.conf"
        # munged runs as the munge user, which must reach its socket: pytest's temporary folders
        # are private to root, so munged gets its own short folder under the system temp dir.
        self.munge_dir = Path(tempfile.mkdtemp(prefix="glmpost-munge-"))
        self.socket = self.munge_dir / "munge.socket"
        self.pid_files = {
            "slurmd": self.root / "slurmd.pid",
            "slurmctld": self.root / "slurmctld.pid",
            "munged": self.munge_dir / "munged.pid",
        }

    @property
    def env(self) -> dict[str, str]:
        """The environment under which Slurm's client commands talk to this cluster."""
        sbin = "/usr/sbin:/sbin"
        return {**os.environ, "SLURM_CONF": str(self.conf), "PATH": f"{os.environ.get('PATH', '')}:{sbin}"}

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(list(args), capture_output=True, text=True, env=self.env, check=check, timeout=60)

    def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o755)  # munged needs every folder above its socket searchable
        for sub in ("state", "spool", "log"):
            (self.root / sub).mkdir(exist_ok=True)
        shutil.chown(self.munge_dir, "munge", "munge")
        os.chmod(self.munge_dir, 0o755)  # munged refuses a socket folder others cannot search
        munged = subprocess.run(
            ["runuser", "-u", "munge", "--", _which("munged"), f"--socket={self.socket}",
             f"--pid-file={self.pid_files['munged']}", f"--log-file={self.munge_dir / 'munged.log'}",
             f"--seed-file={self.munge_dir / 'munged.seed'}"],
            capture_output=True, text=True, timeout=60, check=False,
        )
        if munged.returncode != 0:
            raise RuntimeError(f"munged did not start: {munged.stderr.strip()}")
        host = socket.gethostname().split(".")[0]
        node = subprocess.run([_which("slurmd"), "-C"], capture_output=True, text=True, check=True).stdout.splitlines()[0]
        self.conf.write_text("\n".join([
            "ClusterName=glmposttest",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={_free_port()}",
            f"SlurmdPort={_free_port()}",
            "SlurmUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.socket}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "SchedulerParameters=batch_sched_delay=0",  # else ~3 s per job start
            "MinJobAge=600",  # finished jobs stay visible to scontrol (no accounting here)
            "ReturnToService=2",
            "MpiDefault=none",
            f"StateSaveLocation={self.root / 'state'}",
            f"SlurmdSpoolDir={self.root / 'spool'}",
            f"SlurmctldPidFile={self.pid_files['slurmctld']}",
            f"SlurmdPidFile={self.pid_files['slurmd']}",
            f"SlurmctldLogFile={self.root / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={self.root / 'log' / 'slurmd.log'}",
            f"{node} NodeAddr=127.0.0.1 State=UNKNOWN",  # exactly as `slurmd -C` prints this node
            f"PartitionName=test Nodes={host} Default=YES MaxTime=INFINITE State=UP",
        ]) + "\n")
        subprocess.run([_which("slurmctld"), "-i", "-f", str(self.conf)], check=True, env=self.env, timeout=60)
        subprocess.run([_which("slurmd"), "-f", str(self.conf)], check=True, env=self.env, timeout=60)
        deadline = time.time() + 60
        while time.time() < deadline:
            state = self.run("sinfo", "-h", "-o", "%t", check=False).stdout.strip()
            if state == "idle":
                return
            time.sleep(0.2)
        raise RuntimeError(f"the Slurm node did not become idle (sinfo: {state!r}); logs in {self.root / 'log'}")

    def job_states(self, job_id: str) -> list[str]:
        """JobState of a job (one per task of an array job), from ``scontrol -o show job``."""
        out = self.run("scontrol", "-o", "show", "job", str(job_id), check=False).stdout
        return [field.split("=", 1)[1] for line in out.splitlines() for field in line.split() if field.startswith("JobState=")]

    def stop(self) -> None:
        """Cancel what is left, then end slurmd, slurmctld and munged by the PIDs in their pid files."""
        if self.conf.exists() and _which("scancel"):
            self.run("scancel", "--user", "root", check=False)
        for name in ("slurmd", "slurmctld", "munged"):
            path = self.pid_files[name]
            try:
                pid = int(path.read_text().split()[0])
            except (FileNotFoundError, ValueError, IndexError):
                continue
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
            deadline = time.time() + 15
            while _alive(pid) and time.time() < deadline:
                time.sleep(0.1)
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(self.munge_dir, ignore_errors=True)
