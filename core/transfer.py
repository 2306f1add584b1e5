"""Replica -> receiver state transfer: chunked, pipelined, checksummed, over plain TCP.

The transfer runs on sockets rather than on the freshly rebuilt gloo groups:
gloo was measured at ~0.5 GB/s for the first GiB on a new group against
~5 GB/s for a warm loopback socket, and a migration always runs cold.

Protocol, per connection (after the handshake, every message is an 8-byte length then a body):

0. both ends prove they hold the job secret (:mod:`~torchpass.core.handshake`)
   before any other byte: a process without it reads no state and pushes no
   buddy copy; manifests travel as :mod:`~torchpass.core.safe_pickle`, which
   cannot run code when loaded, and every frame is checked against the
   receiver's buffers before a byte lands;
1. the receiver asks a source for its :class:`~torchpass.core.manifest.Manifest`
   at an expected version (and, when verifying replicas, for its fingerprint);
2. it allocates buffers and deals the chunks out over all sources, which then
   stream frames ``(tensor index, offset, length, crc32c)`` + payload straight
   from the published tensors; the receiver ``recv_into``s the destination
   memory, so received bytes are never copied again;
3. every received chunk's CRC32C is checked while the next ones arrive;
   chunks that fail are requested again, up to ``retries`` rounds, after which
   the transfer fails: a receiver never resumes on unverified bytes.

Checksums run on the process's checksum threads, one per core up to 4, those of
chunks under 32 KiB on the thread that needs them
(:mod:`~torchpass.core.checksum`): the source asks for CRCs a few chunks ahead
of the socket, the receiver verifies behind it, and hardware CRC32C (~13 GB/s a
thread here) and socket I/O release the GIL, so the checksum never bounds the
transfer. A published copy keeps its chunk CRCs (:class:`~torchpass.core.checksum.CrcTable`):
each is computed once however often the copy is fingerprinted or sent, and a
buddy copy's are the ones its holder verified on receipt.
"""

from __future__ import annotations

import collections
import concurrent.futures
import itertools
import json
import math
import mmap
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from . import handshake, safe_pickle
from .checksum import CHUNK_BYTES, Chunk, Crc, CrcTable, chunk_grid
from .manifest import Captured, Manifest, TensorEntry, fingerprint, tensor_bytes

__all__ = ["Address", "HolderLink", "ReceivePool", "Source", "StateServer", "TransferError", "TransferStats", "fetch_state"]

Address = tuple[str, int]
Source = tuple[Address, str]
"""An address and the name of the copy to read there."""
_FRAME = struct.Struct("!IQII")
_END = 0xFFFFFFFF
_SOCKET_BUFFER = 8 << 20
_LOOKAHEAD = 8
"""Chunks whose CRCs a sender asks for ahead of the socket: enough to keep every checksum
thread busy while one chunk drains, few enough that streams served at once share the threads."""
_BATCH_BYTES = 1 << 20
"""A sender gathers consecutive frames into one system call until their payloads reach this (a
4 MiB chunk reaches it by itself): enough that a state of many small tensors crosses in a few
sends, small enough that the first bytes leave while later CRCs are still computed."""
_BATCH_BUFFERS = 128
"""At most this many buffers (headers and payloads) in one ``sendmsg``, well under the kernel's ``IOV_MAX`` (1024)."""
MAX_MESSAGE_BYTES = 1 << 30
"""The largest request, reply or manifest a peer may announce: a manifest lists one entry per tensor
(~100 bytes each), so this leaves room for millions of tensors while a bad length cannot claim all memory."""


class TransferError(RuntimeError):
    """A state transfer failed; the receiver must not resume on the state it holds."""


@dataclass
class TransferStats:
    """What one fetch or push moved, checksummed, and how long it took."""

    nbytes: int = 0
    """Bytes that crossed the sockets, resends included."""
    seconds: float = 0.0
    chunks: int = 0
    """Chunks in the first round."""
    resent_chunks: int = 0
    sources: list[str] = field(default_factory=list)
    """Where a fetch read from (``host:port/copy``); empty for a push."""
    checksummed: int = 0
    """Bytes this end put through CRC32C: a receiver verifies every byte it receives (resends
    included), a pusher computes each chunk's CRC once and reuses it for resends."""

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


def _send_msg(sock: socket.socket, body: bytes) -> None:
    sock.sendall(len(body).to_bytes(8, "little") + body)


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    while len(view):
        n = sock.recv_into(view)
        if n == 0:
            raise ConnectionError("peer closed the connection mid-transfer")
        view = view[n:]


def _recv_msg(sock: socket.socket) -> bytes:
    header = bytearray(8)
    _recv_exact(sock, memoryview(header))
    length = int.from_bytes(header, "little")
    if length > MAX_MESSAGE_BYTES:
        raise TransferError(f"the peer announced a {length}-byte message; at most {MAX_MESSAGE_BYTES} are accepted")
    body = bytearray(length)
    _recv_exact(sock, memoryview(body))
    return bytes(body)


def _tune(sock: socket.socket, timeout: float | None = None) -> None:
    # A Python-level socket timeout turns every recv into poll+recv of a few KB;
    # kernel-level SO_RCVTIMEO/SO_SNDTIMEO bound a hung peer at full speed.
    sock.settimeout(None)
    if timeout is not None:
        tv = struct.pack("ll", int(timeout), int((timeout % 1) * 1e6))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SOCKET_BUFFER)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _SOCKET_BUFFER)


def _send_frames(
    conn: socket.socket,
    table: CrcTable,
    chunks: Sequence[Chunk],
    corrupt: Callable[[Chunk, memoryview], bytes | None] | None = None,
) -> int:
    """Stream ``chunks`` of ``table``'s copy with their CRC32Cs, asked for :data:`_LOOKAHEAD` chunks ahead.

    Frames go out in batches (:func:`_send_batch`): each header in the same system call as its
    payload, and consecutive small frames together."""
    upcoming = iter(chunks)
    ahead = collections.deque((chunk, table.crc(chunk)) for chunk in itertools.islice(upcoming, _LOOKAHEAD))
    sent = 0
    batch: list[bytes | memoryview] = []
    batched = 0
    while ahead:
        chunk, crc = ahead.popleft()
        following = next(upcoming, None)
        if following is not None:
            ahead.append((following, table.crc(following)))
        view = table.view(chunk)
        payload = corrupt(chunk, view) if corrupt else None
        batch += [_FRAME.pack(*chunk, crc.result()), payload if payload is not None else view]
        batched += chunk[2]
        sent += chunk[2]
        if batched >= _BATCH_BYTES or len(batch) >= _BATCH_BUFFERS:
            _send_batch(conn, batch)
            batch, batched = [], 0
    _send_batch(conn, [*batch, _FRAME.pack(_END, 0, 0, 0)])
    return sent


def _send_batch(conn: socket.socket, buffers: list[bytes | memoryview]) -> None:
    """Send ``buffers`` in order, in as few system calls as the socket takes them.

    A frame's 20-byte header sent on its own leaves as a packet of its own (``TCP_NODELAY``)
    and wakes the receiver for it; a state of many small tensors paid that per tensor."""
    views = [memoryview(b).cast("B") for b in buffers]
    while views:
        n = conn.sendmsg(views)
        while views and n >= views[0].nbytes:
            n -= views[0].nbytes
            views.pop(0)
        if n:
            views[0] = views[0][n:]


def _receive_frames(sock: socket.socket, table: CrcTable, bad: list[Chunk]) -> int:
    """Receive frames into ``table``'s copy until the end marker; appends the chunks failing their CRC to ``bad``.

    Each chunk is verified on the checksum threads while the next ones arrive (one under
    :data:`~torchpass.core.checksum.INLINE_BYTES` before the next is read); one
    that matches becomes the copy's known CRC for that chunk.
    """
    checks: list[tuple[Chunk, int, Crc]] = []
    header = bytearray(_FRAME.size)
    received = 0
    try:
        while True:
            _recv_exact(sock, memoryview(header))
            index, offset, length, crc = _FRAME.unpack(header)
            if index == _END:
                break
            if index >= len(table.views) or offset + length > len(table.views[index]):
                raise TransferError(f"a frame for bytes {offset}..{offset + length} of tensor {index} lies outside the manifest")
            chunk = (index, offset, length)
            _recv_exact(sock, table.view(chunk))
            checks.append((chunk, crc, table.recompute(chunk)))
            received += length
    finally:
        # Checksum threads read the destination: none may still be at it once this returns.
        concurrent.futures.wait([computed for _, _, computed in checks if isinstance(computed, concurrent.futures.Future)])
    for chunk, crc, computed in checks:
        if computed.result() == crc:
            table.record(chunk, crc)
        else:
            bad.append(chunk)
    return received


def _check_chunks(manifest: Manifest, chunks: Sequence[Chunk]) -> None:
    """Refuse requested chunks that lie outside ``manifest`` (a payload shorter than its frame would desynchronize the stream)."""
    for index, offset, length in chunks:
        if not 0 <= index < len(manifest.entries) or offset < 0 or length < 0 or offset + length > manifest.entries[index].nbytes:
            raise TransferError(f"requested bytes {offset}..{offset + length} of tensor {index} lie outside the manifest")


def _load_manifest(raw: bytes) -> Manifest:
    """A peer's manifest, rebuilt without running code and checked before anything is allocated from it."""
    try:
        manifest = safe_pickle.loads(raw)
    except (safe_pickle.ForbiddenObject, ValueError, TypeError, EOFError, AttributeError) as exc:
        raise TransferError(f"the peer sent a manifest that cannot be loaded safely: {exc}") from None
    if not isinstance(manifest, Manifest):
        raise TransferError(f"the peer sent a {type(manifest).__name__} where a manifest belongs")
    for e in manifest.entries:
        dtype = getattr(torch, str(e.dtype), None) if isinstance(e, TensorEntry) else None
        if (
            not isinstance(dtype, torch.dtype)
            or not all(isinstance(n, int) and n >= 0 for n in e.shape)
            or e.nbytes != math.prod(e.shape) * dtype.itemsize
        ):
            raise TransferError(f"the peer's manifest has an inconsistent entry {str(e)[:200]}")
    return manifest


HeldCallback = Callable[[int, Captured], None]


class StateServer:
    """Serves the copies of state a rank has published, and receives buddy copies pushed to it.

    Copies are named: ``live`` (the rank's current state), ``snapshot`` (its own
    consistent copies of earlier versions) and ``held:<rank>`` (a buddy copy of
    another rank's state). A receiver asks for a copy by name and version.

    Each published copy keeps its chunk CRCs (the copy's own, such as a held copy's
    verified on receipt, or a new table): fingerprints and sends of it share them.
    ``chunk_bytes`` is the grid a ``live`` copy is checksummed on as soon as it is
    published, off the migration's critical path: the job's transfer chunk size, so
    the receivers' fingerprint requests and chunk requests find every CRC ready.

    ``corrupt`` is a chaos hook: it may return altered payload bytes for a chunk
    (``torchpass`` chaos scenarios and the transfer tests use it); the CRC sent
    is always that of the true bytes, so corruption is what the receiver sees.
    """

    def __init__(
        self,
        *,
        secret: bytes,
        host: str = "127.0.0.1",
        corrupt: Callable[[Chunk, memoryview], bytes | None] | None = None,
        on_held: HeldCallback | None = None,
        hold_into: Callable[[int, Manifest], list[torch.Tensor]] | None = None,
        chunk_bytes: int = CHUNK_BYTES,
    ):
        self._listener = socket.create_server((host, 0), backlog=64)
        self.address: Address = (host, self._listener.getsockname()[1])
        self._copies: dict[tuple[str, int], Captured] = {}
        """Published copies, each with its CRC table."""
        self._chunk_bytes = chunk_bytes
        self._lock = threading.Lock()
        self._corrupt = corrupt
        self._on_held = on_held
        self._hold_into = hold_into
        self._closed = False
        self._secret = secret
        self.served_bytes = 0
        self.refused = 0
        """Connections closed because the client did not prove the job secret."""
        threading.Thread(target=self._accept_loop, name="torchpass-state-server", daemon=True).start()

    def publish(self, captured: Captured | None, copy: str = "live") -> None:
        """Serve ``captured`` as ``copy`` at its version (tensors must not change while published).

        Publishing ``None`` withdraws every version of ``copy``.
        """
        with self._lock:
            for key in [k for k in self._copies if k[0] == copy and (captured is None or copy == "live")]:
                del self._copies[key]
            if captured is not None:
                served = Captured(captured.manifest, captured.tensors, captured.checksums())
                self._copies[(copy, captured.manifest.version)] = served
                if copy == "live":
                    # Survivors publish while they wait for the plan: checksum then, so a
                    # receiver checking replicas against each other, then fetching, does not wait.
                    assert served.crcs is not None
                    for chunk in chunk_grid([e.nbytes for e in captured.manifest.entries], self._chunk_bytes):
                        served.crcs.crc(chunk)

    def withdraw(self, copy: str, version: int) -> None:
        """Stop serving ``copy`` at ``version`` (its buffers are about to be reused)."""
        with self._lock:
            self._copies.pop((copy, version), None)

    def fingerprint(self, copy: str, version: int, classes: set[str] | None = None, chunk_bytes: int = CHUNK_BYTES) -> str:
        """The :func:`~torchpass.core.manifest.fingerprint` of a published copy, from (and into) its CRC table."""
        return fingerprint(self._lookup(copy, version), classes, chunk_bytes=chunk_bytes)

    def close(self) -> None:
        self._closed = True
        self._listener.close()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # listener closed
            _tune(conn)
            threading.Thread(target=self._serve, args=(conn,), name="torchpass-state-conn", daemon=True).start()

    def _lookup(self, copy: str, version: int) -> Captured:
        with self._lock:
            captured = self._copies.get((copy, version))
            have = sorted(v for c, v in self._copies if c == copy)
        if captured is None:
            raise TransferError(f"this rank has no {copy!r} copy at version {version} (it has versions {have})")
        return captured

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                handshake.accept(conn, self._secret)
            except (handshake.HandshakeError, OSError) as exc:
                self.refused += 1
                if self.refused == 1:  # later ones are counted, not logged: a scanner must not flood the log
                    print(f"[torchpass] state server {self.address[0]}:{self.address[1]}: refused a connection: {exc}", flush=True)
                return
            while True:
                try:
                    request = json.loads(_recv_msg(conn))
                except (ConnectionError, OSError, ValueError, TransferError):
                    return  # the peer went away or sent nonsense; nothing to clean up beyond the socket
                op = request.get("op")
                if op == "bye":
                    return
                try:
                    if op == "hold":
                        # A pusher that dies mid-copy leaves the slot incomplete; it is never installed.
                        self._receive_hold(conn, int(request["src"]), _load_manifest(_recv_msg(conn)))
                        continue
                    captured = self._lookup(request.get("copy", "live"), int(request["version"]))
                    if op == "manifest":
                        _send_msg(conn, b"ok" + safe_pickle.dumps(captured.manifest))
                    elif op == "fingerprint":
                        classes = set(request["classes"]) if request.get("classes") is not None else None
                        digest = fingerprint(captured, classes, chunk_bytes=int(request["chunk_bytes"]))
                        _send_msg(conn, b"ok" + digest.encode())
                    elif op == "chunks":
                        chunks = [(int(i), int(o), int(n)) for i, o, n in request["chunks"]]
                        _check_chunks(captured.manifest, chunks)
                        _send_msg(conn, b"ok")
                        assert captured.crcs is not None  # every published copy has its table
                        self.served_bytes += _send_frames(conn, captured.crcs, chunks, self._corrupt)
                    else:
                        _send_msg(conn, b"er" + f"unknown request {op!r}".encode())
                except TransferError as exc:
                    _send_msg(conn, b"er" + str(exc).encode())
                except (ConnectionError, OSError):
                    return  # the peer died mid-request; a half-received copy is dropped

    def _receive_hold(self, conn: socket.socket, src: int, manifest: Manifest) -> None:
        if self._hold_into is None or self._on_held is None:
            raise TransferError("this rank does not hold buddy copies")
        tensors = self._hold_into(src, manifest)
        # The held copy keeps the CRCs verified on receipt: serving it later reads it for nothing else.
        table = CrcTable([tensor_bytes(t) for t in tensors])
        _send_msg(conn, b"ok")
        while True:
            bad: list[Chunk] = []
            _receive_frames(conn, table, bad)
            if not bad:
                # Recorded before the acknowledgement: once the pusher's gate opens, this
                # rank reports the copy as held (a migration may ask the very next moment).
                self._on_held(src, Captured(manifest, tensors, table))
            _send_msg(conn, json.dumps({"bad": bad}).encode())
            if not bad:
                break


class _SourceConnection:
    def __init__(self, address: Address, timeout: float, secret: bytes):
        self.sock = socket.create_connection(address, timeout=timeout)
        _tune(self.sock, timeout)
        self.address = address
        try:
            handshake.connect(self.sock, secret)
        except (handshake.HandshakeError, OSError) as exc:
            self.sock.close()
            raise TransferError(f"{address[0]}:{address[1]}: {exc}") from None

    def request(self, body: dict[str, Any]) -> bytes:
        _send_msg(self.sock, json.dumps(body).encode())
        reply = _recv_msg(self.sock)
        if reply[:2] != b"ok":
            raise TransferError(f"source {self.address[0]}:{self.address[1]}: {reply[2:].decode()}")
        return reply[2:]

    def receive_chunks(self, copy: str, chunks: list[Chunk], version: int, table: CrcTable, bad: list[Chunk]) -> int:
        """Stream ``chunks`` into ``table``'s copy; appends chunks failing their CRC to ``bad``."""
        self.request({"op": "chunks", "copy": copy, "version": version, "chunks": chunks})
        return _receive_frames(self.sock, table, bad)

    def close(self) -> None:
        try:
            _send_msg(self.sock, json.dumps({"op": "bye"}).encode())
        except OSError:
            pass  # the source may already be gone; the connection is being dropped anyway
        self.sock.close()


class ReceivePool:
    """Pre-faulted memory a receiver carves its buffers from.

    ``mmap`` with ``MAP_POPULATE`` has the kernel fault every page in at
    allocation, off the migration's critical path when a spare does it while it
    waits. Buffers are handed out sequentially; a request past the end falls back
    to ordinary (lazily faulted) memory.
    """

    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        self._map = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE)
        self._storage = torch.frombuffer(self._map, dtype=torch.uint8)
        self._used = 0

    def take(self, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
        nbytes = math.prod(shape) * dtype.itemsize
        start = -(-self._used // 64) * 64  # 64-byte alignment for vectorized kernels
        if start + nbytes > self.nbytes:
            return torch.empty(tuple(shape), dtype=dtype)
        self._used = start + nbytes
        return self._storage[start : start + nbytes].view(dtype).view(tuple(shape))


def _destinations(manifest: Manifest, into: Captured | None, pool: ReceivePool | None) -> list[torch.Tensor]:
    own = {}
    if into is not None:
        own = {e.name: t for e, t in zip(into.manifest.entries, into.tensors)}
    out = []
    for e in manifest.entries:
        dtype = getattr(torch, e.dtype)
        mine = own.get(e.name)
        if mine is not None and mine.dtype == dtype and tuple(mine.shape) == e.shape:
            out.append(mine)
        elif pool is not None:
            out.append(pool.take(dtype, e.shape))
        else:
            out.append(torch.empty(e.shape, dtype=dtype))
    return out


def _deal(chunks: list[Chunk], n: int) -> list[list[Chunk]]:
    """Split chunks into ``n`` byte-balanced contiguous runs (contiguous keeps reads sequential)."""
    total = sum(c[2] for c in chunks)
    out: list[list[Chunk]] = [[] for _ in range(n)]
    acc = 0
    for c in chunks:
        out[min(n - 1, acc * n // max(total, 1))].append(c)
        acc += c[2]
    return out


def fetch_state(
    sources: Sequence[Source],
    version: int,
    *,
    chunk_bytes: int = CHUNK_BYTES,
    retries: int = 3,
    timeout: float = 60.0,
    verify_replicas: bool = False,
    state_classes: set[str] | None = None,
    into: Captured | None = None,
    pool: "ReceivePool | None" = None,
    secret: bytes,
) -> tuple[Manifest, list[torch.Tensor], TransferStats]:
    """Fetch the state at ``version`` from ``sources`` (replicas of each other), striped over all of them.

    A source is an address and the name of the copy it serves there (``live``,
    ``snapshot``, ``held:<rank>``); copies of replicas at one version are bitwise equal.

    Only the tensors of ``state_classes`` are fetched (all when None); the others
    come back as empty placeholders the caller fills from elsewhere. Entries that
    match a tensor of ``into`` (the receiver's own capture: same name, dtype and
    shape) are received in place; the rest land in ``pool`` or fresh memory.
    Receiving into memory that was never touched costs a page fault per 4 KiB
    (measured here: ~0.3-0.9 GB/s against ~2.5 GB/s into touched memory), which
    is why spares pre-fault a pool while they wait. Replicas' fingerprints
    (``verify_replicas``) are taken on the ``chunk_bytes`` grid, which the
    chunks requested next share: each source reads its bytes once for both.
    """
    if not sources:
        raise TransferError("no source to fetch state from")
    start = time.perf_counter()
    conns = [_SourceConnection(a, timeout, secret) for a, _ in sources]
    copies = [copy for _, copy in sources]
    try:
        manifest = _load_manifest(conns[0].request({"op": "manifest", "copy": copies[0], "version": version}))
        if verify_replicas and len(conns) > 1:
            classes = sorted(state_classes) if state_classes else None
            with concurrent.futures.ThreadPoolExecutor(len(conns)) as pool_:
                answers = pool_.map(
                    lambda cc: cc[0].request(
                        {"op": "fingerprint", "copy": cc[1], "version": version, "classes": classes, "chunk_bytes": chunk_bytes}
                    ),
                    zip(conns, copies),
                )
                prints = {f"{c.address[0]}:{c.address[1]}/{copy}": a.decode() for (c, copy), a in zip(zip(conns, copies), answers)}
            if len(set(prints.values())) != 1:
                raise TransferError(f"replicas disagree on the state at version {version}: fingerprints {prints}")
        wanted = [i for i, e in enumerate(manifest.entries) if state_classes is None or e.state_class in state_classes]
        tensors = _destinations(manifest, into, pool)
        table = CrcTable([tensor_bytes(t) for t in tensors])
        pending = chunk_grid([e.nbytes for e in manifest.entries], chunk_bytes, wanted)
        stats = TransferStats(chunks=len(pending), sources=[f"{a[0]}:{a[1]}/{copy}" for a, copy in sources])
        for attempt in range(retries + 1):
            bad: list[Chunk] = []
            errors: list[BaseException] = []
            received = [0] * len(conns)

            def run(i: int, work: list[Chunk]) -> None:
                try:
                    received[i] = conns[i].receive_chunks(copies[i], work, version, table, bad)
                except Exception as exc:  # surfaced below with the source's address
                    errors.append(TransferError(f"source {conns[i].address}: {exc}"))
                except BaseException as exc:  # an interrupt (this thread's share): surfaced below as it is
                    errors.append(exc)

            shares = [(i, work) for i, work in enumerate(_deal(pending, len(conns))) if work]
            # This thread reads the first share itself: with one source no thread is
            # started at all, whose start-up a small transfer would feel.
            threads = [threading.Thread(target=run, args=share, name="torchpass-fetch", daemon=True) for share in shares[1:]]
            for t in threads:
                t.start()
            if shares:
                run(*shares[0])
            for t in threads:
                t.join()
            if errors:
                raise errors[0]
            stats.nbytes += sum(received)
            if attempt:
                stats.resent_chunks += len(pending)
            if not bad:
                break
            pending = sorted(bad)
        else:
            raise TransferError(
                f"{len(pending)} chunk(s) still failed their checksum after {retries} resend round(s); "
                f"first: tensor {manifest.entries[pending[0][0]].name!r} at byte {pending[0][1]}"
            )
        stats.seconds = time.perf_counter() - start
        stats.checksummed = table.checksummed
        return manifest, tensors, stats
    finally:
        for c in conns:
            c.close()


class HolderLink:
    """A pusher's authenticated connection to the rank holding its buddy copies, kept from one push to the next.

    Opening one per push cost a TCP connect, the handshake's two round trips and a thread
    started on the holder, each a wake-up of another process on a loaded machine, and all
    of it inside the window the push gate waits on (a buddy copy every step of a ~50 ms step,
    4 ranks on 2 cores: 2.8-3.2 ms in that gate, 2.0-2.5 ms with the connection kept). The
    holder serves any number of pushes on one connection.
    A push that fails drops the connection, and the next push opens a new one: a holder
    that is gone fails that push too, so nothing is retried here (the caller's gate gives
    the version up, see :mod:`~torchpass.core.buddy`)."""

    def __init__(self, timeout: float, secret: bytes):
        self._timeout = timeout
        self._secret = secret
        self._conn: _SourceConnection | None = None

    def push(self, address: Address, src: int, captured: Captured, *, chunk_bytes: int, retries: int) -> TransferStats:
        """Send ``captured`` (a buddy copy of rank ``src``, unchanging while it is sent) to the holder at ``address``.

        The connection kept to ``address`` carries it (opened first, or replaced when the holder
        moved). The holder verifies every chunk and asks again for the ones that fail, up to
        ``retries`` rounds; it installs the copy only once every chunk is verified. Each chunk's
        CRC is computed once, on the bytes as first sent, and reused for a resend: bytes that
        changed since fail again rather than travel with a new checksum. The stats count the
        bytes sent, resends included, and checksummed.
        """
        if self._conn is not None and self._conn.address != address:
            self.close()
        if self._conn is None:
            self._conn = _SourceConnection(address, self._timeout, self._secret)
        try:
            return _push(self._conn, src, captured, chunk_bytes=chunk_bytes, retries=retries)
        except BaseException:
            self._conn.sock.close()
            self._conn = None
            raise

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


def _push(conn: _SourceConnection, src: int, captured: Captured, *, chunk_bytes: int, retries: int) -> TransferStats:
    start = time.perf_counter()
    address = conn.address
    table = captured.checksums()
    before = table.checksummed
    _send_msg(conn.sock, json.dumps({"op": "hold", "src": src, "version": captured.manifest.version}).encode())
    _send_msg(conn.sock, safe_pickle.dumps(captured.manifest))
    reply = _recv_msg(conn.sock)
    if reply[:2] != b"ok":
        raise TransferError(f"holder {address[0]}:{address[1]}: {reply[2:].decode()}")
    pending = chunk_grid([e.nbytes for e in captured.manifest.entries], chunk_bytes)
    stats = TransferStats(chunks=len(pending))
    for attempt in range(retries + 1):
        stats.nbytes += _send_frames(conn.sock, table, pending)
        if attempt:
            stats.resent_chunks += len(pending)
        pending = [(int(i), int(o), int(n)) for i, o, n in json.loads(_recv_msg(conn.sock))["bad"]]
        if not pending:
            stats.seconds = time.perf_counter() - start
            stats.checksummed = table.checksummed - before
            return stats
    raise TransferError(f"buddy copy of rank {src}: {len(pending)} chunk(s) still corrupt after {retries} resends")
