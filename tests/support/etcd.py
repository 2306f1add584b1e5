"""A real etcd cluster for the tests: Debian's ``etcd-server`` 3.4, N members on loopback, data in a temp dir.

``.ci/run`` installs the package when it is absent; tests that need it skip with the reason when ``etcd``
is not on the PATH (a developer machine without it).
"""

from __future__ import annotations

import base64
import json
import secrets
import shutil
import signal
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from torchpass.core.free_port import free_port

ETCD = shutil.which("etcd")


USER, PASSWORD = "trainer", "s3cret pass"
"""The user ``auth_cluster`` lets write under /torchpass/ only, and its password (in ``<folder>/password``)."""


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def auth_cluster(folder: Path) -> "EtcdCluster":
    """A started cluster with authentication on, whose ``USER`` may read and write under /torchpass/ only."""
    cluster = EtcdCluster(folder).start()
    cluster.enable_auth(USER, PASSWORD, "/torchpass/")
    (folder / "password").write_text(PASSWORD + "\n")
    return cluster


@dataclass
class EtcdCluster:
    """``members`` etcd processes; ``url`` is the ``--store`` value naming them all."""

    folder: Path
    members: int = 3
    host: str = "127.0.0.1"
    """The address the members listen on: a test host's (``tests/support/netns.py``) to put them on a host of their own."""
    on_host: list[str] = field(default_factory=list)
    """The command prefix that runs a member on that host (``Hosts.prefix``); empty: on this machine."""
    client_ports: list[int] = field(default_factory=list)
    procs: list[subprocess.Popen | None] = field(default_factory=list)
    _commands: list[list[str]] = field(default_factory=list)

    @property
    def url(self) -> str:
        return "etcd://" + ",".join(f"{self.host}:{p}" for p in self.client_ports)

    def start(self) -> "EtcdCluster":
        assert ETCD is not None, "etcd is not installed (apt-get install etcd-server)"
        peer_ports = [free_port() for _ in range(self.members)]
        self.client_ports = [free_port() for _ in range(self.members)]
        cluster = ",".join(f"m{i}=http://{self.host}:{p}" for i, p in enumerate(peer_ports))
        for i in range(self.members):
            self._commands.append([
                *self.on_host, ETCD, "--name", f"m{i}", "--data-dir", str(self.folder / f"m{i}"),
                "--listen-client-urls", f"http://{self.host}:{self.client_ports[i]}",
                "--advertise-client-urls", f"http://{self.host}:{self.client_ports[i]}",
                "--listen-peer-urls", f"http://{self.host}:{peer_ports[i]}",
                "--initial-advertise-peer-urls", f"http://{self.host}:{peer_ports[i]}",
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
                with urllib.request.urlopen(f"http://{self.host}:{self.client_ports[i]}/health", timeout=2) as r:
                    if b'"true"' in r.read():
                        return
            except OSError:
                pass
            if time.time() > deadline:
                raise TimeoutError(f"etcd member m{i} not healthy after {timeout} s; log: {(self.folder / f'm{i}.log').read_text()[-2000:]}")
            time.sleep(0.1)

    def user_url(self, password_file: Path, path: str = "") -> str:
        """The --store URL naming ``USER`` and a file with a password (a job's own, with ``path`` as its prefix)."""
        return self.url.replace("etcd://", f"etcd://{USER}@") + f"{path}?password-file={password_file}"

    def enable_auth(self, user: str, password: str, prefix: str) -> None:
        """Turn etcd's authentication on, as an operator would with etcdctl: a ``root`` user, and ``user`` allowed to
        read and write the keys under ``prefix`` only (the role a job's launchers are given)."""
        end = prefix[:-1] + chr(ord(prefix[-1]) + 1)
        root_password = secrets.token_hex(8)
        for path, body in (
            ("role/add", {"name": "root"}),
            ("user/add", {"name": "root", "password": root_password}),
            ("user/grant", {"user": "root", "role": "root"}),
            ("role/add", {"name": "jobs"}),
            ("role/grant", {"name": "jobs", "perm": {"permType": "READWRITE", "key": _b64(prefix), "range_end": _b64(end)}}),
            ("user/add", {"name": user, "password": password}),
            ("user/grant", {"user": user, "role": "jobs"}),
            ("enable", {}),
        ):
            request = urllib.request.Request(
                f"http://{self.host}:{self.client_ports[0]}/v3/auth/{path}", json.dumps(body).encode(), {"Content-Type": "application/json"}
            )
            with urllib.request.urlopen(request, timeout=10) as r:
                r.read()

    def kill(self, i: int) -> None:
        proc = self.procs[i]
        if proc is not None:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            self.procs[i] = None

    def stop(self) -> None:
        for i in range(len(self.procs)):
            self.kill(i)
