"""Rebuildable process groups: stable group objects over a replaceable transport.

Frameworks cache process-group objects everywhere (DDP's C++ reducer,
DeepSpeed's ``groups`` globals and ZeRO optimizers, megatron-core's
``parallel_state`` and layers, FSDP2's mesh info, DeviceMesh) and functional
collectives resolve groups by name through c10d's registry. Rebinding all of
those after a failure is fragile, so torchpass never replaces a group object:
every group of a migratable job is a :class:`RebuildableProcessGroup`, a Python
subclass of ``torch.distributed.ProcessGroup`` whose identity, name, rank and
size stay fixed for the life of the process, and which forwards each
collective to an *inner* gloo group that is rebuilt per generation.

Protocol (driven by :mod:`torchpass.core.runtime`):

1. ``install()`` registers the ``torchpass`` c10d backend and maps requests for
   ``gloo`` onto it, so ``init_process_group("gloo")``, ``new_group`` and
   ``DeviceMesh`` all create rebuildable groups without code changes.
2. A group is *live* (forwarding to its generation's inner gloo group) or
   *local*. A hot spare runs the training script's set-up in local mode: its
   collectives complete at once as if every peer held the same data as the
   spare, because whatever they compute is overwritten by the state transfer.
3. ``release()`` (any thread) refuses the transport's new connections, shuts
   down its sockets and abandons its pending collectives. gloo has no abort that
   wakes a pending operation (measured: ``ProcessGroupGloo.abort()`` and
   ``shutdown()`` return at once while the pending collective stays blocked
   until the peer's socket closes), so this is how survivors blocked on a hung
   or migrating peer are released within milliseconds instead of the
   process-group timeout. A closed socket alone is not enough: gloo never
   signals an operation whose message was in transfer, so every live
   collective's ``Work`` is one of :mod:`torchpass.core.pending_work`'s, which
   the release fails.
4. ``rebuild_all(store, generation)`` builds, in group-creation order, a fresh
   inner gloo group for every rebuildable group on the store prefix of the new
   generation. Creation order is the same on every rank (``new_group`` is a
   collective call), so the rebuild cannot deadlock.
5. ``hold(True)`` makes every group answer locally while keeping its live
   transport, until ``hold(False)``: for a rank that recovered from a failure
   inside code the framework runs between steps (a logging barrier, say),
   whose remaining collectives no peer will issue, because the new generation
   resumes at the next step.

Lazy connect. An inner group is built on a lazy gloo device: its constructor
writes this rank's address record (``<device>/<rank>``: host, listening
address) and returns; a pair reads its peer's record and connects the first
time a collective uses it, from gloo's threads. Building costs one store
write, and the usual collectives read O(log N) records (a barrier and a ring
allreduce: 2 log2 N - 1; the full mesh read all N, 81,921 store operations per
rank at 16,384 ranks). A peer whose record is missing is waited for through an
:class:`~.rendezvous_store.InterruptibleStore`, which gives up when the
transport is released; a connect to a peer that does not answer is bounded by
the connect timeout, and the release cuts it short.

How a release finds the sockets. gloo opens them at any time, so they are told
by address, not by when they appeared: the group's store (``_RecordTap``) notes
the listening address in the record gloo writes (this transport's listener) and
in every record gloo reads (a peer's listener, noted before gloo connects to
it). A socket of the process is the transport's when its local address is the
transport's listener (a connection a peer opened) or its destination is a
noted peer (one this rank opened, connected or still being set up).

Release, in order: (a) under the lock the record reads take, the transport is
marked released; from then on a read fails, so no connection of it begins;
(b) every socket of it open now is shut down; (c) its pending collectives are
abandoned; (d) the graveyard scans again, 10 ms after the release and then
less often, shutting down each socket of it that appeared since (a connection
whose record was read just before (a), gloo's new attempt at a connection that
(b) cut short, a peer's late connection to the listener), until nothing of it
is in flight in gloo and none of its connection attempts may be tried again.
A peer's connection to the listener arriving after that is shut down by that
peer's own release; no operation of this transport reads or writes it.

Invariants: rank numbering and group membership never change; a group object
is never replaced; an inner group that was released is never used again and
begins no connection after its release (gloo may still finish or retry one
begun before: (d) shuts those down). A release never shuts down a listener
(gloo aborts the process when its listener fails), a socket to the store or of
the state server (``exclude_ports``), or a socket to a peer that a transport
not released has read: a listening address of an older generation can be
another listener's only once that listener closed, and then only the newer
transport connects to it.
C++ code that bypasses the Python object and calls the registered c10d backend
directly sees the first live generation's gloo group, which fails loudly once
released rather than computing on a stale membership.
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket
import struct
import threading
import time
import weakref
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch._C._distributed_c10d import (
    AllgatherOptions,
    AllreduceCoalescedOptions,
    AllreduceOptions,
    AllToAllOptions,
    BarrierOptions,
    BroadcastOptions,
    FakeProcessGroup,
    GatherOptions,
    ProcessGroupGloo,
    ReduceOp,
    ReduceOptions,
    ReduceScatterOptions,
    ScatterOptions,
    _create_work_from_future,
)

from . import job_secret
from .failures import ABANDONED_MARKER
from .pending_work import PendingWork
from .rendezvous_store import InterruptibleStore
from .signed_store import SignedStore

__all__ = [
    "BACKEND_NAME",
    "RebuildableProcessGroup",
    "groups",
    "hold",
    "install",
    "rebuild_all",
    "record_endpoint",
    "release_generation",
    "rendezvous_store",
    "set_local_mode_default",
]

BACKEND_NAME = "torchpass"

_registry_lock = threading.Lock()
_registry: list[weakref.ReferenceType["RebuildableProcessGroup"]] = []
# Connections that are never gloo's: to the store, and accepted by the state server.
_not_gloo_peer_ports: set[int] = set()
_not_gloo_local_ports: set[int] = set()


def exclude_ports(*, peer: int | None = None, local: int | None = None) -> None:
    """Declare connections (to ``peer`` port, or accepted on ``local`` port) that a release must never touch."""
    if peer is not None:
        _not_gloo_peer_ports.add(peer)
    if local is not None:
        _not_gloo_local_ports.add(local)
_local_by_default = False
_installed = False
before_collective: Callable[[], None] | None = None
"""Called before every live collective (the runtime makes pending mirror records durable)."""


def set_local_mode_default(local: bool) -> None:
    """Make groups created from now on start in local mode (a spare running its set-up)."""
    global _local_by_default
    _local_by_default = local


def groups() -> list["RebuildableProcessGroup"]:
    """Live rebuildable groups of this process, in creation order."""
    with _registry_lock:
        alive = [g for g in (ref() for ref in _registry) if g is not None]
    return sorted(alive, key=lambda g: g.creation_index)


# ---- a transport's sockets, told by address -------------------------------------------------

Endpoint = tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]
"""A TCP endpoint: (IP address, port)."""

_RECORD_KEY = re.compile(r"\d+/(\d+)")
"""gloo's key for a rank's address record, ``<device index>/<rank>`` (a transport has one device)."""
_TCP_SYN_SENT = 0x02
"""The state ``/proc/net/tcp`` gives a socket whose connection is being set up."""


def record_endpoint(record: bytes) -> Endpoint:
    """The listening address in a gloo tcp address record (``gloo::transport::tcp::Rank::bytes``).

    The record holds the host name and the device's address, each after its length
    (a native ``size_t``), then the pair identifiers (none with a lazy device); the
    address is a ``sockaddr_storage`` followed by a sequence number.
    """
    (name_len,) = struct.unpack_from("=Q", record, 0)
    at = 8 + name_len
    (addr_len,) = struct.unpack_from("=Q", record, at)
    at += 8
    if addr_len < 28 or len(record) < at + addr_len:
        raise ValueError(f"not a gloo address record ({len(record)} bytes, address of {addr_len})")
    (family,) = struct.unpack_from("=H", record, at)
    port = int.from_bytes(record[at + 2 : at + 4], "big")
    if family == socket.AF_INET:
        return ipaddress.IPv4Address(record[at + 4 : at + 8]), port
    if family == socket.AF_INET6:
        return ipaddress.IPv6Address(record[at + 8 : at + 24]), port
    raise ValueError(f"a gloo address record of address family {family}")


def _endpoint(address: tuple[Any, ...]) -> Endpoint:
    """An endpoint from ``getsockname()``/``getpeername()`` (an IPv6 host may carry a ``%scope``)."""
    return ipaddress.ip_address(address[0].split("%")[0]), address[1]


def _proc_endpoint(text: str) -> Endpoint:
    """An endpoint as ``/proc/net/tcp`` prints it: the address as native 32-bit words in hex, ``:``, the port."""
    host, port = text.split(":")
    raw = b"".join(struct.pack("=I", int(host[i : i + 8], 16)) for i in range(0, len(host), 8))
    return ipaddress.ip_address(raw), int(port, 16)


def _connecting_remotes() -> dict[str, Endpoint]:
    """Socket link (``socket:[inode]``) -> destination, for this network namespace's connections being set up.

    ``getpeername()`` fails for such a socket; the kernel's table still names the destination.
    """
    out: dict[str, Endpoint] = {}
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(path):
            continue  # a kernel without IPv6
        with open(path) as table:
            rows = table.read().splitlines()[1:]
        for row in rows:
            fields = row.split()
            if int(fields[3], 16) == _TCP_SYN_SENT:
                out[f"socket:[{fields[9]}]"] = _proc_endpoint(fields[2])
    return out


@dataclass(frozen=True)
class _TcpSocket:
    """A connected or connecting TCP socket of this process, as one scan saw it."""

    fd: int
    link: str
    """The fd's link, ``socket:[inode]``: tells this socket from a later one on the same fd."""
    local: Endpoint
    remote: Endpoint | None
    """None for a socket neither connected nor connecting (a connect that failed)."""
    connecting: bool
    """Its connection is being set up; gloo tries a connect that fails again (up to 3 times)."""


def _tcp_sockets() -> list[_TcpSocket]:
    """This process's TCP sockets, listeners left out (gloo aborts the process when its listener fails)."""
    out = []
    connecting: dict[str, Endpoint] | None = None
    for name in os.listdir("/proc/self/fd"):
        try:
            # The duplicate pins what the fd refers to now: the link and the probe describe one socket.
            dup = os.dup(int(name))
        except OSError:
            continue  # closed since the listing
        link = os.readlink(f"/proc/self/fd/{dup}")
        if not link.startswith("socket:"):
            os.close(dup)
            continue
        with socket.socket(fileno=dup) as probe:
            if probe.family not in (socket.AF_INET, socket.AF_INET6) or probe.type != socket.SOCK_STREAM:
                continue
            if probe.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                continue
            local = _endpoint(probe.getsockname())
            try:
                remote: Endpoint | None = _endpoint(probe.getpeername())
                pending = False
            except OSError:  # ENOTCONN: a connect in progress, or one that failed
                if connecting is None:
                    connecting = _connecting_remotes()
                remote = connecting.get(link)
                pending = remote is not None
        out.append(_TcpSocket(int(name), link, local, remote, pending))
    return out


def _shut_down(sock: _TcpSocket) -> bool:
    """Shut down ``sock`` if its fd still refers to it; whether it was shut down now."""
    try:
        dup = os.dup(sock.fd)
    except OSError:
        return False  # closed since the scan
    with socket.socket(fileno=dup) as probe:
        if os.readlink(f"/proc/self/fd/{dup}") != sock.link:
            return False  # closed since the scan, and the fd reused
        try:
            probe.shutdown(socket.SHUT_RDWR)
        except OSError:  # ENOTCONN: the peer or gloo ended it first
            return False
    return True


class _Endpoints:
    """Where one transport listens and where the peers it connects to listen, from the address records its
    gloo group writes and reads (see ``_RecordTap``), and whether it was released."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.listener: Endpoint | None = None
        self.peers: set[Endpoint] = set()
        self.released = False

    def owns(self, sock: _TcpSocket, peers: set[Endpoint], newer: set[Endpoint]) -> bool:
        """Whether ``sock`` is this transport's: accepted by its listener, or opened to a peer it read.

        ``newer``: the peers of transports not released. A peer's listening address can be another
        listener's only after that peer's listener closed; the newer transport that reads it owns it.
        """
        if sock.local == self.listener:
            return True
        return (
            sock.remote in peers
            and sock.remote not in newer
            and sock.remote[1] not in _not_gloo_peer_ports
            and sock.local[1] not in _not_gloo_local_ports
        )


class _RecordTap(dist.Store):
    """The store a transport's gloo group meets through.

    It notes the listening address in each address record gloo writes (its own)
    or reads (a peer's, read right before gloo connects to that peer), and
    refuses the reads once the transport is released, so no connection of a
    released transport begins. Holds no reference to the transport: the gloo
    group holds this store, and a cycle through C++ would never be collected.
    """

    def __init__(self, base: dist.Store, rank: int, endpoints: _Endpoints, released: Callable[[], bool], what: str):
        super().__init__()
        self._base = base
        self._rank = rank
        self._endpoints = endpoints
        self._released = released
        self._what = what

    def set(self, key: str, value: bytes) -> None:
        match = _RECORD_KEY.fullmatch(key)
        if match is not None and int(match.group(1)) == self._rank:
            self._endpoints.listener = record_endpoint(value)
        self._base.set(key, value)

    def get(self, key: str) -> bytes:
        value = self._base.get(key)
        if _RECORD_KEY.fullmatch(key) is not None:
            peer = record_endpoint(value)
            # Under the lock a release takes: a read either counts among the release's peers or fails.
            with self._endpoints.lock:
                if self._released():
                    raise RuntimeError(f"{ABANDONED_MARKER}: {self._what}: the transport was released")
                self._endpoints.peers.add(peer)
        return value

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
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


def rendezvous_store(
    store: dist.Store,
    rank: int,
    released: Callable[[], bool],
    what: str,
    connect_timeout: timedelta,
    endpoints: _Endpoints | None = None,
) -> dist.Store:
    """The store a transport's gloo group meets through: ``store`` under an interruptible wait and the record tap.

    ``released`` ends the waits and refuses the record reads; ``endpoints`` receives the addresses noted.
    """
    noted = endpoints if endpoints is not None else _Endpoints()
    return _RecordTap(InterruptibleStore(store, released, what, connect_timeout), rank, noted, released, what)


_live_lock = threading.Lock()
_live: "weakref.WeakSet[_Transport]" = weakref.WeakSet()
"""Every transport not yet destroyed, for the peers the unreleased ones read (see ``_Endpoints.owns``)."""


def _claimed_by_unreleased() -> set[Endpoint]:
    with _live_lock:
        live = list(_live)
    claimed: set[Endpoint] = set()
    for transport in live:
        with transport.endpoints.lock:
            if not transport.endpoints.released:
                claimed |= transport.endpoints.peers
    return claimed


class _Transport:
    """One generation's inner gloo group, which connects to each peer on first use, and its sockets."""

    def __init__(
        self,
        name: str,
        store: dist.Store,
        rank: int,
        size: int,
        generation: int,
        connect_timeout: timedelta,
        op_timeout: timedelta,
    ):
        endpoints = self.endpoints = _Endpoints()

        def released() -> bool:
            return endpoints.released or _released_through >= generation

        what = f"connecting group {name!r} of generation {generation}"
        self.store = rendezvous_store(store, rank, released, what, connect_timeout, endpoints)
        options = ProcessGroupGloo._Options()
        # A lazy device: the constructor writes this rank's record and nothing else; each pair
        # reads its peer's record and connects on first use (O(log N) peers for the usual collectives).
        options._devices = [ProcessGroupGloo.create_default_device(lazy_init=True)]
        options._timeout = connect_timeout  # bounds a lazy connect and its wait for the peer's record
        self.backend = ProcessGroupGloo(self.store, rank, size, options)
        if endpoints.listener is None:
            raise RuntimeError(f"torchpass: {what}: gloo wrote no address record; its sockets could not be told apart")
        self.backend._set_default_timeout(op_timeout)
        self.group = dist.ProcessGroup(store, rank, size)
        self.group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, self.backend)
        self.group._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
        self.pending = PendingWork(name)
        self._reap_lock = threading.Lock()
        self._shut: set[str] = set()
        """Links of the sockets shut down that are still open (gloo keeps a pair's fd until the pair goes)."""
        self._retrying: set[str] = set()
        """Of those, the connections being set up when shut down: gloo may try each again with a new socket."""
        with _live_lock:
            _live.add(self)

    @property
    def released(self) -> bool:
        return self.endpoints.released

    def release(self, reason: str) -> int:
        """Refuse new connections, shut down the sockets, fail the pending collectives; returns the sockets shut down.

        Idempotent. The graveyard shuts down whatever socket of it appears later, until it is settled.
        """
        with self.endpoints.lock:
            if self.endpoints.released:
                return 0
            self.endpoints.released = True
        count = self.reap(_tcp_sockets())
        self.pending.abandon(reason)
        _graveyard.bury(self)
        return count

    def reap(self, sockets: list[_TcpSocket]) -> int:
        """Shut down the sockets of this transport in ``sockets`` not shut down before; returns how many."""
        # Read after the scan: a newer transport notes a peer before it opens a socket to it.
        newer = _claimed_by_unreleased()
        with self.endpoints.lock:
            peers = set(self.endpoints.peers)
        count = 0
        with self._reap_lock:
            open_now = {s.link for s in sockets}
            self._shut &= open_now
            self._retrying &= open_now
            for sock in sockets:
                if sock.link in self._shut or not self.endpoints.owns(sock, peers, newer):
                    continue
                count += _shut_down(sock)
                self._shut.add(sock.link)
                if sock.connecting:
                    self._retrying.add(sock.link)
        return count

    def settled(self) -> bool:
        """Whether nothing of this released transport can open a socket any more: gloo has none of its operations
        in flight (a connection begins inside one) and none of its connection attempts may be tried again."""
        with self._reap_lock:
            retrying = bool(self._retrying)
        return self.pending.quiet() and not retrying


class _Graveyard:
    """Released transports, kept until nothing of theirs can run or connect any more, then let go.

    A release shuts down the sockets a transport has at that moment; a few can
    appear after it: a connection whose peer record was read just before the
    release (gloo opens the socket right after the read), gloo's new attempt at
    a connection the release cut short (up to 3), and a peer's connection to
    this transport's listener. So the graveyard scans again at every sweep, soon
    after a release and then less often, shutting each one down, until the
    transport is settled (``_Transport.settled``).

    Dropping a transport's last reference destroys its gloo group, closing its
    sockets and ending its threads, but gloo's destructor waits for operations
    still running. An operation whose message was in transfer when its sockets
    were shut down is never signalled by gloo (the pair signals queued operations,
    not the one being read or written) and ends only at gloo's own timeout, the
    group's ``timeout``: its transport stays here until then. The sweeper runs
    only while the graveyard holds anything; otherwise a transport that went
    quiet after the last migration would stay for the rest of the job.
    """

    FIRST_SWEEP_S = 0.01
    """The first sweep after a release, or after a sweep that found a socket: connections racing a release
    appear within microseconds of it, gloo's new attempts right after the previous one failed."""
    SWEEP_INTERVAL_S = 1.0
    """The longest wait between sweeps (each waits twice the previous one up to this); only while not empty."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._buried: list[_Transport] = []
        self._interval = self.FIRST_SWEEP_S
        self._sweeper: threading.Thread | None = None

    def bury(self, transport: _Transport) -> None:
        with self._lock:
            if not transport.settled():
                self._buried.append(transport)
            self._interval = self.FIRST_SWEEP_S
            if self._buried and (self._sweeper is None or not self._sweeper.is_alive()):
                self._sweeper = threading.Thread(target=self._sweep, name="torchpass-graveyard", daemon=True)
                self._sweeper.start()

    def _sweep(self) -> None:
        while True:
            with self._lock:
                interval = self._interval
            time.sleep(interval)
            with self._lock:
                buried = list(self._buried)
            sockets = _tcp_sockets()
            found = sum(transport.reap(sockets) for transport in buried)
            del buried
            with self._lock:
                # A settled transport's gloo group is destroyed here, outside the training thread.
                self._buried = [t for t in self._buried if not t.settled()]
                self._interval = self.FIRST_SWEEP_S if found else min(2 * self._interval, self.SWEEP_INTERVAL_S)
                if not self._buried:
                    self._sweeper = None
                    return


_graveyard = _Graveyard()


def _completed(result: Any) -> dist.Work:
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(result)
    return _create_work_from_future(fut)


def _reduce_local(tensors: list[torch.Tensor], op: Any, size: int) -> list[torch.Tensor]:
    """Reduce as if ``size`` peers held these tensors: SUM multiplies, PRODUCT raises to the power."""
    for t in tensors:
        if t.dtype == torch.bool:
            continue
        if op == ReduceOp.SUM:
            t.mul_(size)
        elif op == ReduceOp.PRODUCT:
            t.pow_(size)
    return tensors


def _fill_lists(outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    for outs, inp in zip(outputs, inputs):
        for out in outs:
            out.copy_(inp)
    return outputs


def _gather_into(output: torch.Tensor, input: torch.Tensor, size: int) -> list[torch.Tensor]:
    output.copy_(input.reshape(1, -1).expand(size, -1).reshape(output.shape))
    return [output]


def _exchange_local(
    output: torch.Tensor, input: torch.Tensor, out_splits: list[int], in_splits: list[int], rank: int, size: int
) -> list[torch.Tensor]:
    """All-to-all as if every peer held this rank's input: each peer sends its chunk for this rank."""
    in_sizes = in_splits or [input.shape[0] // size] * size
    out_sizes = out_splits or [output.shape[0] // size] * size
    mine = input.split(in_sizes)[rank]
    if all(n == mine.shape[0] for n in out_sizes):
        for chunk in output.split(out_sizes):
            chunk.copy_(mine)
    else:
        # Uneven splits have no consistent fiction; the values are overwritten by the
        # state transfer anyway, so zeros keep the spare deterministic.
        output.zero_()
    return [output]


class RebuildableProcessGroup(dist.ProcessGroup):
    """A c10d group whose transport can be released and rebuilt without replacing the object."""

    def __init__(self, rank: int, size: int, name: str, global_ranks: Sequence[int], op_timeout: timedelta):
        super().__init__(rank, size)
        self._rank = rank
        self._size = size
        self._name = name
        self.global_ranks = list(global_ranks)
        self._op_timeout = op_timeout
        self._transport: _Transport | None = None
        self._registered_store: dist.Store | None = None
        """The rendezvous store of the c10d-registered backend (see ``connect``)."""
        self.generation = -1
        self._scripted_broadcasts: list[torch.Tensor] = []
        with _registry_lock:
            self.creation_index = len(_registry)
            _registry.append(weakref.ref(self))

    # ---- identity -------------------------------------------------------
    def getBackendName(self) -> str:
        # c10d maps this name to the registered backend type it looks up (DDP's
        # logger does): the fake placeholder of a never-live spare is CUSTOM.
        return "gloo" if self.generation >= 0 else BACKEND_NAME

    @property
    def group_name(self) -> str:
        return self._name

    def _set_group_name(self, name: str) -> None:
        self._name = name

    def getGroupName(self) -> str:
        return self._name

    def setGroupName(self, name: str) -> None:
        self._name = name

    @property
    def is_local(self) -> bool:
        return self._transport is None

    def _get_backend(self, device: Any) -> Any:
        return self._transport.backend if self._transport is not None else super()._get_backend(device)

    def __repr__(self) -> str:
        mode = "local" if self.is_local else f"generation {self.generation}"
        return f"RebuildableProcessGroup(name={self._name!r}, rank={self._rank}/{self._size}, {mode})"

    # ---- lifecycle ------------------------------------------------------
    def connect(self, store: dist.Store, generation: int, connect_timeout: timedelta) -> None:
        """Build this generation's transport; the previous one must have been released (the graveyard has it)."""
        transport = _Transport(self._name, store, self._rank, self._size, generation, connect_timeout, self._op_timeout)
        if self._transport is None and self.generation < 0:
            # The first live transport becomes the c10d-registered backend (see module docstring). gloo
            # calls its store from Python for each lazy connect: the store lives as long as the backend.
            self._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, transport.backend)
            self._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
            self._registered_store = transport.store
        # The generation first: a late release_generation of the previous one must not take this transport.
        self.generation = generation
        self._transport = transport
        if _released_through >= generation:
            # The monitor ended this generation while it was being built, before this group
            # was on it: release it here, as release_generation would have.
            transport.release(f"generation {generation} ended")

    def go_local(self) -> None:
        """Answer collectives locally (a spare before it joins)."""
        if self._transport is not None:
            self._transport.release("the group went local")
        self._transport = None
        if self.generation < 0:
            fake = FakeProcessGroup._create_internal(self._rank, self._size)
            self._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.CUSTOM, fake)
            self._set_default_backend(dist.ProcessGroup.BackendType.CUSTOM)

    def release(self) -> int:
        """Unblock any pending collective on the current transport; safe from any thread."""
        transport = self._transport
        if transport is None or transport.released:
            return 0
        return transport.release(f"generation {self.generation} ended")

    def script_broadcasts(self, payloads: Sequence[torch.Tensor]) -> None:
        """In local mode, make the next broadcasts deliver ``payloads`` as if sent by the root.

        Used to hand a joining rank the result of a set-up broadcast the survivors
        performed long ago (DDP's bucket layout), without involving them.
        """
        self._scripted_broadcasts.extend(payloads)

    # ---- dispatch -------------------------------------------------------
    # Each collective forwards to the live transport, or runs its local-mode
    # fiction: every peer is assumed to hold exactly what this rank holds.
    def _run(self, name: str, args: tuple[Any, ...], local: Callable[[], Any]) -> dist.Work:
        transport = self._transport
        if transport is not None and not _held:
            if before_collective is not None:
                before_collective()
            return transport.pending.run(lambda: getattr(transport.group, name)(*args))
        return _completed(local())

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        opts = opts if isinstance(opts, AllreduceOptions) else _allreduce_opts(opts)
        return self._run("allreduce", (tensors, opts), lambda: _reduce_local(tensors, opts.reduceOp, self._size))

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        opts = opts or AllreduceCoalescedOptions()
        return self._run("allreduce_coalesced", (tensors, opts), lambda: _reduce_local(tensors, opts.reduceOp, self._size))

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> dist.Work:
        return self._run("allgather", (outputs, inputs, opts or AllgatherOptions()), lambda: _fill_lists(outputs, inputs))

    def allgather_coalesced(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> dist.Work:
        def local() -> list[list[torch.Tensor]]:
            # outputs[r][j] receives input j of rank r; every rank holds these inputs.
            for per_rank in outputs:
                for out, inp in zip(per_rank, inputs):
                    out.copy_(inp)
            return outputs

        return self._run("allgather_coalesced", (outputs, inputs, opts or AllgatherOptions()), local)

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> dist.Work:
        return self._run("_allgather_base", (output, input, opts or AllgatherOptions()), lambda: _gather_into(output, input, self._size))

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> dist.Work:
        return self._run("all_gather_single", (output, input, opts or AllgatherOptions()), lambda: _gather_into(output, input, self._size))

    def allgather_into_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> dist.Work:
        return self._run(
            "allgather_into_tensor_coalesced",
            (outputs, inputs, opts or AllgatherOptions()),
            lambda: [_gather_into(o, i, self._size) for o, i in zip(outputs, inputs)],
        )

    def all_gather_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> dist.Work:
        return self._run(
            "all_gather_single_coalesced",
            (outputs, inputs, opts or AllgatherOptions()),
            lambda: [_gather_into(o, i, self._size) for o, i in zip(outputs, inputs)],
        )

    def reduce_scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None) -> dist.Work:
        opts = opts or ReduceScatterOptions()

        def local() -> list[torch.Tensor]:
            for out, ins in zip(outputs, inputs):
                out.copy_(ins[self._rank])
            return _reduce_local(outputs, opts.reduceOp, self._size)

        return self._run("reduce_scatter", (outputs, inputs, opts), local)

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> dist.Work:
        opts = opts or ReduceScatterOptions()
        return self._run("_reduce_scatter_base", (output, input, opts), lambda: self._scatter_into(output, input, opts.reduceOp))

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> dist.Work:
        opts = opts or ReduceScatterOptions()
        return self._run("reduce_scatter_single", (output, input, opts), lambda: self._scatter_into(output, input, opts.reduceOp))

    def reduce_scatter_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> dist.Work:
        opts = opts or ReduceScatterOptions()
        return self._run(
            "reduce_scatter_tensor_coalesced",
            (outputs, inputs, opts),
            lambda: [self._scatter_into(o, i, opts.reduceOp) for o, i in zip(outputs, inputs)],
        )

    def reduce_scatter_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> dist.Work:
        opts = opts or ReduceScatterOptions()
        return self._run(
            "reduce_scatter_single_coalesced",
            (outputs, inputs, opts),
            lambda: [self._scatter_into(o, i, opts.reduceOp) for o, i in zip(outputs, inputs)],
        )

    def _scatter_into(self, output: torch.Tensor, input: torch.Tensor, op: Any) -> list[torch.Tensor]:
        output.copy_(input.reshape(self._size, -1)[self._rank].reshape(output.shape))
        return _reduce_local([output], op, self._size)

    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor, out_splits: list[int], in_splits: list[int], opts: Any = None) -> dist.Work:
        args = (output, input, out_splits, in_splits, opts or AllToAllOptions())
        return self._run("alltoall_base", args, lambda: _exchange_local(output, input, out_splits, in_splits, self._rank, self._size))

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, out_splits: list[int], in_splits: list[int], opts: Any = None) -> dist.Work:
        args = (output, input, out_splits, in_splits, opts or AllToAllOptions())
        return self._run("all_to_all_single", args, lambda: _exchange_local(output, input, out_splits, in_splits, self._rank, self._size))

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> dist.Work:
        return self._run("alltoall", (outputs, inputs, opts or AllToAllOptions()), lambda: [o.copy_(inputs[self._rank]) for o in outputs])

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        def local() -> list[torch.Tensor]:
            if self._scripted_broadcasts:
                tensors[0].copy_(self._scripted_broadcasts.pop(0).reshape(tensors[0].shape))
            return tensors

        return self._run("broadcast", (tensors, opts or BroadcastOptions()), local)

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        opts = opts or ReduceOptions()
        return self._run("reduce", (tensors, opts), lambda: _reduce_local(tensors, opts.reduceOp, self._size))

    def gather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> dist.Work:
        return self._run("gather", (outputs, inputs, opts or GatherOptions()), lambda: _fill_lists(outputs, inputs * len(outputs)))

    def scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None) -> dist.Work:
        def local() -> list[torch.Tensor]:
            if inputs and inputs[0]:
                outputs[0].copy_(inputs[0][self._rank])
            return outputs

        return self._run("scatter", (outputs, inputs, opts or ScatterOptions()), local)

    def send(self, tensors: list[torch.Tensor], dst_rank: int, tag: int = 0) -> dist.Work:
        return self._run("send", (tensors, dst_rank, tag), lambda: tensors)

    def recv(self, tensors: list[torch.Tensor], src_rank: int, tag: int = 0) -> dist.Work:
        return self._run("recv", (tensors, src_rank, tag), lambda: tensors)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> dist.Work:
        return self._run("recv_anysource", (tensors, tag), lambda: tensors)

    def barrier(self, opts: Any = None) -> dist.Work:
        return self._run("barrier", (opts or BarrierOptions(),), lambda: [])

    def monitored_barrier(self, *args: Any) -> None:
        transport = self._transport
        if transport is not None:
            transport.group.monitored_barrier(*args)

    def _start_coalescing(self, device: torch.device) -> None:
        transport = self._transport
        if transport is not None:
            transport.group._start_coalescing(device)

    def _end_coalescing(self, device: torch.device) -> dist.Work:
        transport = self._transport
        if transport is None:
            return _completed([])
        return transport.pending.run(lambda: transport.group._end_coalescing(device))


def _allreduce_opts(op: Any) -> AllreduceOptions:
    opts = AllreduceOptions()
    if op is not None:
        opts.reduceOp = op
    return opts


def _create(dist_opts: Any, backend_options: Any) -> RebuildableProcessGroup:
    del backend_options  # gloo options are fixed by torchpass; the group timeout is honoured below
    timeout = dist_opts.timeout if isinstance(dist_opts.timeout, timedelta) else timedelta(seconds=float(dist_opts.timeout))
    group = RebuildableProcessGroup(
        dist_opts.group_rank,
        dist_opts.group_size,
        dist_opts.group_id,
        list(dist_opts.global_ranks_in_group) or list(range(dist_opts.group_size)),
        timeout,
    )
    if _local_by_default:
        group.go_local()
    else:
        # Generation 0 meets through torch's default store: in a worker, sealed like every torchpass value.
        secret = job_secret.worker_secret()
        group.connect(SignedStore(dist_opts.store, secret) if secret else dist_opts.store, 0, timeout)
    return group


_REWRITES = {"gloo": BACKEND_NAME, "cpu:gloo": BACKEND_NAME, BACKEND_NAME: BACKEND_NAME}
# "fake" groups never communicate (TorchTitan uses them for size-1 mesh dimensions):
# there is nothing to rebuild, so they stay as they are.
_KEEP = ("undefined", "fake")


def _rewrite_backend(backend: Any) -> Any:
    if backend is None:
        return None
    key = str(backend).lower()
    if key in _KEEP:
        return backend
    if key in _REWRITES:
        return _REWRITES[key]
    raise RuntimeError(
        f"torchpass: process groups on backend {str(backend)!r} cannot be rebuilt; this release supports "
        f"'gloo' (CPU). Launch without torchpass, or train on CPU with gloo."
    )


def install() -> None:
    """Register the ``torchpass`` backend and route gloo group creation to it (idempotent)."""
    global _installed
    if _installed:
        return
    dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=["cpu"])
    dist.Backend.default_device_backend_map["cpu"] = BACKEND_NAME
    original: Callable[..., Any] = c10d._new_process_group_helper

    def _new_process_group_helper(group_size, group_rank, global_ranks_in_group, backend, *args, **kwargs):
        return original(group_size, group_rank, global_ranks_in_group, _rewrite_backend(backend), *args, **kwargs)

    c10d._new_process_group_helper = _new_process_group_helper
    _installed = True


def release_generation(generation: int) -> int:
    """Release the transports of ``generation`` and older (monitor thread, on a generation's end).

    A transport of a newer generation is left alone: the main thread may already
    have rebuilt by the time a slow monitor gets here.
    """
    global _released_through
    with _released_lock:
        _released_through = max(_released_through, generation)
    return sum(g.release() for g in groups() if g.generation <= generation)


_released_lock = threading.Lock()
_released_through = -1
"""The newest generation released in this process: a rebuild of it gives up waiting for peers."""


def rebuild_all(base_store: dist.Store, generation: int, connect_timeout: timedelta) -> list[str]:
    """Give every group a transport for ``generation``; returns the group names in build order.

    Building one writes this rank's address record and waits for nobody: each
    connection to a peer is made on first use, waiting for that peer's record
    through an :class:`~.rendezvous_store.InterruptibleStore`, so a member that
    dies before it publishes its address ends the generation, and that ends the
    waits.
    """
    names = []
    for group in groups():
        group.release()
        group.connect(dist.PrefixStore(f"torchpass/pg/{generation}/{group.group_name}/", base_store), generation, connect_timeout)
        names.append(group.group_name)
    return names


_held = False


def hold(held: bool) -> None:
    """Answer every group's collectives locally (``True``) or on its transport again (step 5 of the protocol)."""
    global _held
    _held = held


def go_local_all() -> None:
    for group in groups():
        group.go_local()


def group_signature() -> list[tuple[str, list[int]]]:
    """(name, global ranks) of every group, in creation order: must match across a rank's incarnations."""
    return [(g.group_name, g.global_ranks) for g in groups()]

