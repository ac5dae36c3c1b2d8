"""A real single-node Slurm cluster for the tests: munge, slurmctld and slurmd started as root
without systemd, configured in a temporary directory through ``SLURM_CONF``.

The node ``localhost`` declares 128 CPUs and 8 GPUs (``SlurmdParameters=config_overrides``; the
GPUs are character devices made with ``mknod``, major 195 as NVIDIA's), so that GPU scripts can be
checked with ``sbatch --test-only`` while CPU jobs really run on the 2 cores.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "sinfo")


def why_not() -> str | None:
    """The reason a cluster cannot be started here, or ``None``."""
    missing = [d for d in DAEMONS if shutil.which(d) is None
               and not Path(f"/usr/sbin/{d}").exists()]
    if missing:
        return (f"Slurm/munge binaries missing ({', '.join(missing)}): apt-get install slurmctld "
                "slurmd slurm-client munge (.ci/run does it)")
    if os.geteuid() != 0:
        return "starting slurmctld/slurmd/munged needs root"
    if not Path("/etc/munge/munge.key").exists():
        return "no /etc/munge/munge.key (reinstall munge or run mungekey -c)"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sbin(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


CONF = """\
ClusterName=mfsdptest
SlurmctldHost=localhost
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd.log
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
MpiDefault=none
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
GresTypes=gpu
NodeName=localhost NodeAddr=127.0.0.1 CPUs=128 Gres=gpu:8 State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
"""


class Cluster:
    """Start with :meth:`start`, stop with :meth:`stop`; ``env`` has ``SLURM_CONF`` set."""

    def __init__(self, directory: Path):
        self.dir = directory
        self.env = dict(os.environ, SLURM_CONF=str(directory / "slurm.conf"))

    def run(self, *cmd: str, timeout: float = 60, **kw) -> subprocess.CompletedProcess:
        """Run a Slurm client command against this cluster."""
        return subprocess.run(list(cmd), env=self.env, capture_output=True, text=True,
                              timeout=timeout, **kw)

    def start(self) -> None:
        d = self.dir
        for sub in ("state", "spool", "dev"):
            (d / sub).mkdir(parents=True, exist_ok=True)
        for i in range(8):
            dev = d / "dev" / f"nvidia{i}"
            if not dev.exists():
                os.mknod(dev, 0o666 | 0o020000, os.makedev(195, i))  # S_IFCHR
        (d / "slurm.conf").write_text(CONF.format(d=d, ctld_port=_free_port(), d_port=_free_port()))
        (d / "gres.conf").write_text(f"NodeName=localhost Name=gpu File={d}/dev/nvidia[0-7]\n")
        if subprocess.run(["munge", "-n"], capture_output=True).returncode != 0:
            Path("/run/munge").mkdir(parents=True, exist_ok=True)
            shutil.chown("/run/munge", "munge", "munge")
            subprocess.run(["runuser", "-u", "munge", "--", _sbin("munged")], check=True)
        subprocess.run([_sbin("slurmctld")], env=self.env, check=True, timeout=30)
        subprocess.run([_sbin("slurmd"), "-N", "localhost"], env=self.env, check=True, timeout=30)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            out = self.run("sinfo", "-h", "-N", "-o", "%T").stdout.strip()
            if out.startswith("idle") or out.startswith("mixed"):
                return
            time.sleep(0.5)
        raise RuntimeError(f"the node never became idle (sinfo: {out!r}); logs:\n"
                           + self.log_tail())

    def log_tail(self) -> str:
        """The end of both daemons' logs (for failure messages)."""
        parts = []
        for name in ("slurmctld.log", "slurmd.log"):
            path = self.dir / name
            if path.exists():
                parts.append(f"--- {name}\n" + "\n".join(path.read_text().splitlines()[-15:]))
        return "\n".join(parts)

    def stop(self) -> None:
        """Shut both daemons down (munged stays: other clusters may use it)."""
        self.run("scontrol", "shutdown", timeout=30)
        for pid_file in ("slurmd.pid", "slurmctld.pid"):
            path = self.dir / pid_file
            deadline = time.monotonic() + 10
            while path.exists() and time.monotonic() < deadline:
                time.sleep(0.2)
