"""Test hosts with their own network stacks: Linux network namespaces joined by veth pairs on a bridge.

Each host is a namespace with one interface, ``eth0``, its own address on a private /24 and its own loopback;
the bridge in the test's namespace joins them and has an address too, so the test process reaches every host
(the store, the state servers) the way an operator's machine on that network would. Faults only a network
produces: a host's link taken down (its NIC failed, or a partition isolates it) and brought back. Created and
torn down by the tests (``ip`` from iproute2; needs root, which CI has); names carry a random tag so test runs
side by side never collide.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
from dataclasses import dataclass, field

IP = shutil.which("ip")


def usable() -> str | None:
    """Why the tests cannot make namespaces here, or None when they can."""
    if IP is None:
        return "iproute2's ip is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"tpprobe{secrets.token_hex(2)}"
    made = subprocess.run([IP, "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    subprocess.run([IP, "netns", "del", probe], check=True)
    return None


def _ip(*args: str) -> None:
    done = subprocess.run([IP or "ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


@dataclass
class Hosts:
    """``count`` hosts, ``addrs[i]`` the address of host ``i``; ``prefix(i)`` runs a command on it."""

    count: int
    tag: str = field(default_factory=lambda: secrets.token_hex(2))
    addrs: list[str] = field(default_factory=list)
    bridge_addr: str = ""

    def __post_init__(self) -> None:
        subnet = f"10.{secrets.randbelow(200) + 20}.{secrets.randbelow(250) + 1}"
        self.addrs = [f"{subnet}.{i + 1}" for i in range(self.count)]
        self.bridge_addr = f"{subnet}.254"

    def ns(self, i: int) -> str:
        return f"tp{self.tag}h{i}"

    def veth(self, i: int) -> str:
        """The host-side end of host ``i``'s cable: taking it down cuts the host off."""
        return f"tp{self.tag}v{i}"

    @property
    def bridge(self) -> str:
        return f"tp{self.tag}br"

    def up(self) -> "Hosts":
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.bridge_addr}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for i in range(self.count):
            ns, veth, peer = self.ns(i), self.veth(i), f"tp{self.tag}p{i}"
            _ip("netns", "add", ns)
            _ip("link", "add", veth, "type", "veth", "peer", "name", peer)
            _ip("link", "set", peer, "netns", ns)
            _ip("link", "set", veth, "master", self.bridge)
            _ip("link", "set", veth, "up")
            _ip("-n", ns, "link", "set", peer, "name", "eth0")
            _ip("-n", ns, "addr", "add", f"{self.addrs[i]}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        return self

    def prefix(self, i: int) -> list[str]:
        """Run a command on host ``i``; gloo binds to its ``eth0`` (what a user sets on a machine with several NICs)."""
        return [IP or "ip", "netns", "exec", self.ns(i), "env", "GLOO_SOCKET_IFNAME=eth0"]

    def link(self, i: int, up: bool) -> None:
        _ip("link", "set", self.veth(i), "up" if up else "down")

    def pids(self, i: int) -> list[int]:
        out = subprocess.run([IP or "ip", "netns", "pids", self.ns(i)], capture_output=True, text=True, check=True).stdout
        return [int(p) for p in out.split()]

    def kill_all(self, i: int) -> list[int]:
        """SIGKILL every process on host ``i`` (the machine lost power); returns their PIDs."""
        pids = self.pids(i)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass  # exited meanwhile
        return pids

    def down(self) -> None:
        for i in range(self.count):
            self.kill_all(i)
            subprocess.run([IP or "ip", "netns", "del", self.ns(i)], capture_output=True)
        subprocess.run([IP or "ip", "link", "del", self.bridge], capture_output=True)
