"""A real etcd cluster for the tests: Debian's ``etcd-server`` 3.4, N members on loopback, data in a temp dir.

``.ci/run`` installs the package when it is absent; tests that need it skip with the reason when ``etcd``
is not on the PATH (a developer machine without it).
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from torchpass.core.free_port import free_port

ETCD = shutil.which("etcd")


@dataclass
class EtcdCluster:
    """``members`` etcd processes; ``url`` is the ``--store`` value naming them all."""

    folder: Path
    members: int = 3
    client_ports: list[int] = field(default_factory=list)
    procs: list[subprocess.Popen | None] = field(default_factory=list)
    _commands: list[list[str]] = field(default_factory=list)

    @property
    def url(self) -> str:
        return "etcd://" + ",".join(f"127.0.0.1:{p}" for p in self.client_ports)

    def start(self) -> "EtcdCluster":
        assert ETCD is not None, "etcd is not installed (apt-get install etcd-server)"
        peer_ports = [free_port() for _ in range(self.members)]
        self.client_ports = [free_port() for _ in range(self.members)]
        cluster = ",".join(f"m{i}=http://127.0.0.1:{p}" for i, p in enumerate(peer_ports))
        for i in range(self.members):
            self._commands.append([
                ETCD, "--name", f"m{i}", "--data-dir", str(self.folder / f"m{i}"),
                "--listen-client-urls", f"http://127.0.0.1:{self.client_ports[i]}",
                "--advertise-client-urls", f"http://127.0.0.1:{self.client_ports[i]}",
                "--listen-peer-urls", f"http://127.0.0.1:{peer_ports[i]}",
                "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer_ports[i]}",
                "--initial-cluster", cluster, "--initial-cluster-state", "new", "--initial-cluster-token", self.folder.name,
                "--heartbeat-interval", "50", "--election-timeout", "500",
            ])  # fmt: skip
        for i in range(self.members):
            self.procs.append(self._spawn(i))
        for i in range(self.members):
            self.wait_healthy(i)
        return self

    def _spawn(self, i: int) -> subprocess.Popen:
        log = open(self.folder / f"m{i}.log", "a")
        return subprocess.Popen(self._commands[i], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_healthy(self, i: int, timeout: float = 30.0) -> None:
        deadline = time.time() + timeout
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.client_ports[i]}/health", timeout=2) as r:
                    if b'"true"' in r.read():
                        return
            except OSError:
                pass
            if time.time() > deadline:
                raise TimeoutError(f"etcd member m{i} not healthy after {timeout} s; log: {(self.folder / f'm{i}.log').read_text()[-2000:]}")
            time.sleep(0.1)

    def kill(self, i: int) -> None:
        proc = self.procs[i]
        if proc is not None:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            self.procs[i] = None

    def stop(self) -> None:
        for i in range(len(self.procs)):
            self.kill(i)
