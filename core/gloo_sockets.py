"""Which connected sockets of this process belong to one gloo group, told from its address records.

Releasing a generation (:mod:`torchpass.core.comms`) shuts down its gloo
groups' sockets, because that is the only thing that wakes a gloo operation
blocked on a hung or departed peer. gloo does not say which sockets are its
own, and with ``TORCH_GLOO_LAZY_INIT`` it opens them long after the group was
built, on its worker threads, during the first collective that needs each peer
(see :func:`torchpass.core.rendezvous_store.worker_environment`). So the group
is identified by what it published and read instead:

* every ``ProcessGroupGloo`` listens on a device of its own, and writes that
  listener's socket address into its address record (store key
  ``<device>/<rank>``) when it is built;
* before it connects to a peer, gloo reads that peer's record.

:class:`EndpointNotingStore` sits between gloo and the rendezvous store and keeps
both kinds of address (:class:`Endpoints`). A connected socket is the group's
if its local address is one of the group's listeners (accepted from a peer) or
its peer address is the listener of a peer the group read (opened towards it).
Nothing else in the process can match: a listener's address is bound by one
socket only, and a peer's device listener accepts only that group's pairs. The
state server's, the store's and the user's own sockets are never touched.

A record is gloo's ``tcp::Rank``: the host name and the device address, each
after its ``size_t`` length, then the pair identifiers; the device address
starts with a ``sockaddr_storage`` (family, port, IPv4 or IPv6 address).
"""

from __future__ import annotations

import os
import re
import socket
import struct
import threading
from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist

__all__ = ["Connection", "Endpoint", "Endpoints", "EndpointNotingStore", "connected", "listener_of", "shut_down"]

Endpoint = tuple[str, int]
"""A socket address as (host, port), as ``getsockname`` and ``getpeername`` start it."""

RECORD_KEY = re.compile(r"\d+/\d+")
"""gloo's key for a rank's address record, below the group's prefix: ``<device index>/<rank>``."""

_SIZE_T = struct.Struct("=Q")


def listener_of(record: bytes) -> Endpoint:
    """The device listener's address in a gloo address record (a ``tcp::Rank``); ValueError if it is not one."""
    try:
        (host_len,) = _SIZE_T.unpack_from(record, 0)
        offset = _SIZE_T.size + host_len
        (addr_len,) = _SIZE_T.unpack_from(record, offset)
        address = record[offset + _SIZE_T.size : offset + _SIZE_T.size + addr_len]
        (family,) = struct.unpack_from("=H", address, 0)
        (port,) = struct.unpack_from("!H", address, 2)
    except struct.error as exc:
        raise ValueError(f"not a gloo address record ({len(record)} bytes): {exc}") from exc
    if family == socket.AF_INET:
        return socket.inet_ntop(socket.AF_INET, address[4:8]), port
    if family == socket.AF_INET6:
        return socket.inet_ntop(socket.AF_INET6, address[8:24]), port
    raise ValueError(f"not a gloo address record: address family {family}")


@dataclass
class Endpoints:
    """The listeners one gloo group wrote (its own) and read (its peers'); filled from gloo's threads."""

    own: set[Endpoint] = field(default_factory=set)
    peers: set[Endpoint] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, key: str, record: bytes, *, own: bool) -> None:
        if not RECORD_KEY.fullmatch(key):
            return
        endpoint = listener_of(record)
        with self._lock:
            (self.own if own else self.peers).add(endpoint)

    def owns(self, local: Endpoint, peer: Endpoint) -> bool:
        """Whether a connection with these addresses is one of the group's (accepted, or opened towards a peer)."""
        with self._lock:
            return local in self.own or peer in self.peers


class EndpointNotingStore(dist.Store):
    """``base`` as gloo's rendezvous uses it, noting the listener of every address record written or read."""

    def __init__(self, base: dist.Store, endpoints: Endpoints):
        super().__init__()
        self._base = base
        self.endpoints = endpoints

    def set(self, key: str, value: bytes | str) -> None:
        self._base.set(key, value)
        self.endpoints.add(key, value.encode() if isinstance(value, str) else bytes(value), own=True)

    def get(self, key: str) -> bytes:
        value = self._base.get(key)
        self.endpoints.add(key, value, own=False)
        return value

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        if timeout is None:
            self._base.wait(keys)
        else:
            self._base.wait(keys, timeout)

    def check(self, keys: list[str]) -> bool:
        return self._base.check(keys)

    def add(self, key: str, value: int) -> int:
        return self._base.add(key, value)

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        return self._base.compare_set(key, expected, desired)

    def delete_key(self, key: str) -> bool:
        return self._base.delete_key(key)

    def num_keys(self) -> int:
        return self._base.num_keys()

    def set_timeout(self, timeout: timedelta) -> None:
        self._base.set_timeout(timeout)


@dataclass(frozen=True)
class Connection:
    """A connected socket of this process: its ``/proc/self/fd`` link (the socket's inode) and both addresses."""

    fd: int
    link: str
    local: Endpoint
    peer: Endpoint


def connected() -> list[Connection]:
    """The connected sockets of this process now (listeners and unconnected sockets left out)."""
    out = []
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # closed since the listing
        if not link.startswith("socket:"):
            continue
        try:
            probe = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue  # closed since the readlink
        try:
            local, peer = probe.getsockname(), probe.getpeername()
        except OSError:
            continue  # a listening or unconnected socket: gloo crashes if its listener is shut down
        finally:
            probe.close()
        if isinstance(local, tuple) and isinstance(peer, tuple):  # inet sockets only, not unix ones
            out.append(Connection(fd, link, local[:2], peer[:2]))
    return out


def shut_down(connections: list[Connection], endpoints: Endpoints) -> int:
    """Shut down, both ways, each of ``connections`` that belongs to the group of ``endpoints``; returns how many.

    A connection gloo opens after ``connections`` was listed is not among them:
    its operation is failed by the release all the same (:mod:`torchpass.core.pending_work`).
    """
    count = 0
    for conn in connections:
        if not endpoints.owns(conn.local, conn.peer):
            continue
        try:
            if os.readlink(f"/proc/self/fd/{conn.fd}") != conn.link:
                continue  # closed and the fd reused since the listing: not the group's any more
            probe = socket.socket(fileno=os.dup(conn.fd))
        except OSError:
            continue  # closed since the listing
        try:
            probe.shutdown(socket.SHUT_RDWR)
            count += 1
        except OSError:
            pass  # already shut down by the peer
        finally:
            probe.close()
    return count
