"""A real Slurm cluster on this machine for the tests: munged, slurmctld and one slurmd per Slurm node.

Debian's ``slurm-wlm`` and ``munge`` (``.ci/run`` installs them when absent). Every
daemon runs in the foreground as a child of the test process, as root (slurmd
needs it), from a private directory: its own munge key and socket, its own
``slurm.conf`` naming this host as the controller and the Slurm nodes the test
asks for, each a ``slurmd -N NAME`` on its own port of 127.0.0.1. Nothing is
written outside that directory, so a machine's own Slurm (if any) is untouched;
clients reach this cluster through ``SLURM_CONF``.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from torchpass.core.free_port import free_port

DAEMONS = ("munged", "slurmctld", "slurmd", "sinfo", "scontrol", "srun")


def require_slurm() -> None:
    """Skip unless the daemons are installed and this runs as root (CI has both: ``.ci/run``)."""
    missing = [d for d in DAEMONS if shutil.which(d) is None and not Path(f"/usr/sbin/{d}").exists()]
    if missing:
        pytest.skip(f"Slurm is not installed ({', '.join(missing)} missing): apt-get install slurm-wlm munge")
    if os.geteuid() != 0:
        pytest.skip("slurmd runs as root")


def _exe(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


@dataclass
class SlurmCluster:
    root: Path
    nodes: list[str]
    procs: list[subprocess.Popen] = field(default_factory=list)

    @property
    def env(self) -> dict[str, str]:
        """The environment a client of this cluster (and a job started by its srun) needs."""
        return {**os.environ, "SLURM_CONF": str(self.root / "slurm.conf")}

    def run(self, *args: str, timeout: float = 30.0) -> str:
        done = subprocess.run(list(args), env=self.env, capture_output=True, text=True, timeout=timeout)
        assert done.returncode == 0, f"{' '.join(args)}: {done.stderr}"
        return done.stdout

    def states(self) -> dict[str, str]:
        out = self.run("sinfo", "--noheader", "--Node", "--Format", "NodeList:|,StateComplete:|")
        return dict(line.strip().rstrip("|").split("|", 1) for line in out.splitlines() if line.strip())

    def resume_all(self) -> None:
        """Every node back to service (a test's drains and reservations undone) for the next test."""
        for res in self.run("scontrol", "show", "reservation", "--oneliner").splitlines():
            if res.startswith("ReservationName="):
                self.run("scontrol", "delete", f"reservation={res.split()[0].split('=', 1)[1]}")
        for node, state in self.states().items():
            if "drain" in state or "fail" in state:
                self.run("scontrol", "update", f"nodename={node}", "state=resume")

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.terminate()
        for p in reversed(self.procs):
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def start_cluster(root: Path, nodes: list[str]) -> SlurmCluster:
    """munged, slurmctld and a slurmd per node, each node idle when this returns."""
    require_slurm()
    root.mkdir(parents=True, exist_ok=True)
    for d in ("munge", "state", "log", "run"):
        (root / d).mkdir(mode=0o700, exist_ok=True)
    key = root / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    sock = root / "munge" / "munge.sock"
    host = socket.gethostname().split(".", 1)[0]
    lines = [
        "ClusterName=torchpass-test",
        f"SlurmctldHost={host}(127.0.0.1)",
        f"SlurmctldPort={free_port()}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        f"AuthInfo=socket={sock}",
        f"StateSaveLocation={root / 'state'}",
        f"SlurmdSpoolDir={root / 'spool-%n'}",
        f"SlurmctldPidFile={root / 'run' / 'slurmctld.pid'}",
        f"SlurmdPidFile={root / 'run' / 'slurmd-%n.pid'}",
        f"SlurmctldLogFile={root / 'log' / 'slurmctld.log'}",
        f"SlurmdLogFile={root / 'log' / 'slurmd-%n.log'}",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "SchedulerType=sched/builtin",
        "SelectType=select/linear",
        "ReturnToService=2",
        "MpiDefault=none",
        "SlurmdTimeout=300",  # slurmds on a loaded 2-core runner answer late; a test never waits for DOWN
        *(f"NodeName={n} NodeHostname={host} NodeAddr=127.0.0.1 Port={free_port()} CPUs=2 State=UNKNOWN" for n in nodes),
        "PartitionName=main Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
    ]
    (root / "slurm.conf").write_text("\n".join(lines) + "\n")
    cluster = SlurmCluster(root, list(nodes))
    log = open(root / "log" / "daemons.out", "w")

    def start(*cmd: str) -> None:
        cluster.procs.append(subprocess.Popen(list(cmd), env=cluster.env, stdout=log, stderr=subprocess.STDOUT))

    start(
        _exe("munged"), "--foreground", "--force", f"--socket={sock}", f"--key-file={key}",
        f"--log-file={root / 'log' / 'munged.log'}", f"--pid-file={root / 'run' / 'munged.pid'}", f"--seed-file={root / 'munge' / 'seed'}",
    )  # fmt: skip
    _wait(lambda: sock.exists(), "munged's socket", cluster)
    start(_exe("slurmctld"), "-D", "-i")
    _wait(lambda: _answers(cluster), "slurmctld", cluster)
    for n in nodes:
        start(_exe("slurmd"), "-D", "-N", n)
    _wait(lambda: all(s.startswith("idle") for s in cluster.states().values()), "every slurmd to register", cluster)
    return cluster


def _answers(cluster: SlurmCluster) -> bool:
    return subprocess.run(["scontrol", "ping"], env=cluster.env, capture_output=True).returncode == 0


def _wait(ready, what: str, cluster: SlurmCluster, timeout: float = 60.0) -> None:
    deadline = time.time() + timeout
    while not ready():
        dead = [p.args[0] for p in cluster.procs if p.poll() is not None]
        if dead or time.time() > deadline:
            cluster.stop()
            logs = "\n".join(f.read_text(errors="replace")[-1500:] for f in sorted((cluster.root / "log").glob("*")))
            raise AssertionError(f"Slurm test cluster: {what} not ready (exited: {dead}):\n{logs}")
        time.sleep(0.2)
