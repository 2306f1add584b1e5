"""A TCP port to listen on, chosen so that no outgoing connection can take it first.

Asking the kernel for port 0 and closing the socket returns a port from the
ephemeral range, the same range the kernel hands to every outgoing
connection's local end. Between that probe and the real ``listen`` (another
process, seconds later), any connection made on the machine may be given the
same number and the listener fails with ``EADDRINUSE``: on a busy host running
gloo meshes this happens (seen in CI: a launcher could not host its store).
Ports below the ephemeral range are never assigned to outgoing connections, so
a port drawn there and found bindable stays free until someone binds it on
purpose.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST = 15000
"""Lowest port drawn: above the registered ports services commonly use (etcd 2379, Prometheus 9090, slurmctld 6817)."""
_TRIES = 64
"""Random draws before falling back to the kernel's choice; one in 64 bound by chance would already be a crowded host."""


def _ephemeral_low() -> int:
    try:
        return int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default, and the IANA range starts higher still (49152)


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def free_port(host: str = "127.0.0.1") -> int:
    """A port on ``host`` that is free now and outside the ephemeral range where the host allows one."""
    high = _ephemeral_low()
    rng = random.SystemRandom()
    if high - _LOWEST >= _TRIES:
        for _ in range(_TRIES):
            port = rng.randrange(_LOWEST, high)
            if _bindable(host, port):
                return port
    with socket.socket() as s:  # a host whose ephemeral range starts too low leaves only the kernel's choice
        s.bind((host, 0))
        return s.getsockname()[1]
