"""A real Slurm cluster of two nodes on this machine, for the launcher tests: its own munge daemon (own key and
socket), a slurmctld and two slurmd (nodes n1 and n2, both 127.0.0.1 on ports of their own), all in a
temporary directory and stopped at the end. Needs root (slurmd starts jobs as their user) and the Debian
packages slurmctld, slurmd, slurm-client and munge (``scripts/install_os_deps.sh``, run by ``make test``);
``missing()`` says what is absent, for a skip that names it."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from unbroken.control.store.netif import free_port

NODES = ("n1", "n2")
# Attempts at starting the Slurm daemons, each on other ports: a port found free can be taken before the
# daemon binds it (by another test's listener), and the daemon then exits with "Address already in use".
PORT_ATTEMPTS = 3
DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "sinfo", "srun")


def missing() -> str | None:
    """Why a cluster cannot be started here, or None."""
    if os.geteuid() != 0:
        return "slurmd must run as root to start jobs, and these tests do not run as root"
    absent = [name for name in DAEMONS if shutil.which(name) is None and not Path("/usr/sbin", name).exists()]
    if absent:
        return f"Slurm is not installed ({', '.join(absent)} missing; scripts/install_os_deps.sh installs it)"
    return None


def _quiet_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports free a moment ago (``free_port``: below the kernel's ephemeral range)."""
    ports: list[int] = []
    while len(ports) < count:
        port = free_port()
        if port not in ports:
            ports.append(port)
    return ports


def _binary(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


class SlurmCluster:
    """``with SlurmCluster(tmp) as c:`` then ``subprocess.run(["sbatch", ...], env=c.env)``."""

    def __init__(self, root: Path, cpus_per_node: int = 2) -> None:
        self.root = root
        self.cpus = cpus_per_node
        self.procs: list[subprocess.Popen[bytes]] = []
        self.conf = root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}

    def _start(self, *cmd: str, log: str) -> subprocess.Popen[bytes]:
        out = open(self.root / log, "ab")  # noqa: SIM115 - the daemon owns it
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=self.env)
        self.procs.append(proc)
        return proc

    def __enter__(self) -> SlurmCluster:
        r = self.root
        for d in ("munge", *(f"spool{n}" for n in NODES)):
            (r / d).mkdir(parents=True, exist_ok=True)
        os.chmod(r / "munge", 0o700)
        key = r / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)
        munge_socket = r / "munge" / "munge.socket"
        self._start(
            _binary("munged"),
            "--foreground",
            "--force",
            f"--socket={munge_socket}",
            f"--key-file={key}",
            f"--pid-file={r / 'munge' / 'munged.pid'}",
            f"--log-file={r / 'munge' / 'munged.log'}",
            f"--seed-file={r / 'munge' / 'munged.seed'}",
            log="munged.out",
        )
        deadline = time.monotonic() + 20
        while not munge_socket.exists():
            if time.monotonic() > deadline:
                raise RuntimeError(f"munged did not start: {(r / 'munged.out').read_text()[-2000:]}")
            time.sleep(0.05)
        for attempt in range(1, PORT_ATTEMPTS + 1):
            if self._start_slurm(attempt, munge_socket):
                return self
        self.__exit__(None, None, None)
        raise RuntimeError(f"the Slurm daemons lost their ports to other processes {PORT_ATTEMPTS} times; logs in {r}")

    def _start_slurm(self, attempt: int, munge_socket: Path) -> bool:
        """Start slurmctld and the slurmds on fresh ports and wait until every node is idle: True when they are,
        False when a daemon exited because its port was taken meanwhile (the caller tries again on other
        ports). Any other failure stops every daemon and raises, with the daemons' logs."""
        r = self.root
        state = r / f"state{attempt}"
        state.mkdir()
        ports = _quiet_ports(1 + len(NODES))
        nodes = "\n".join(
            f"NodeName={n} NodeHostname=localhost NodeAddr=127.0.0.1 Port={p} CPUs={self.cpus} State=UNKNOWN"
            for n, p in zip(NODES, ports[1:], strict=True)
        )
        self.conf.write_text(
            f"""ClusterName=unbrokentest
SlurmctldHost=localhost
SlurmUser=root
SlurmdUser=root
SlurmctldPort={ports[0]}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket}
StateSaveLocation={state}
SlurmdSpoolDir={r}/spool%n
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd-%n.pid
SlurmctldLogFile={r}/slurmctld.log
SlurmdLogFile={r}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
{nodes}
PartitionName=debug Nodes={",".join(NODES)} Default=YES OverSubscribe=YES MaxTime=INFINITE State=UP
"""
        )
        daemons = {
            "slurmctld": self._start(
                _binary("slurmctld"), "-D", "-i", "-f", str(self.conf), log=f"slurmctld-{attempt}.out"
            )
        }
        for n in NODES:
            daemons[f"slurmd-{n}"] = self._start(
                _binary("slurmd"), "-D", "-N", n, "-f", str(self.conf), log=f"slurmd-{n}-{attempt}.out"
            )
        deadline = time.monotonic() + 60
        while True:
            for name, proc in daemons.items():
                if proc.poll() is not None:
                    log = (r / f"{name}-{attempt}.out").read_text(errors="replace")
                    self._stop(list(daemons.values()))
                    if "Address already in use" in log:
                        return False
                    self.__exit__(None, None, None)
                    raise RuntimeError(f"{name} exited with {proc.returncode}: {log[-2000:]}")
            states = subprocess.run(
                ["sinfo", "-h", "-N", "-o", "%N %t"], env=self.env, capture_output=True, text=True, timeout=30
            ).stdout.split()
            if states.count("idle") == len(NODES):
                return True
            if time.monotonic() > deadline:
                self.__exit__(None, None, None)
                logs = " | ".join(
                    f"{name}: "
                    + " / ".join((r / f"{name}-{attempt}.out").read_text(errors="replace").splitlines()[-3:])
                    for name in daemons
                )
                raise RuntimeError(f"the Slurm nodes did not come up: sinfo says {states}; {logs}")
            time.sleep(0.2)

    def _stop(self, procs: list[subprocess.Popen[bytes]]) -> None:
        for p in reversed(procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in reversed(procs):
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs = [p for p in self.procs if p not in procs]

    def __exit__(self, *exc: object) -> None:
        self._stop(list(self.procs))
