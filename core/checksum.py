"""Integrity checksums of state bytes: CRC32C in hardware, spread over threads, each chunk's CRC computed once.

:func:`crc32c` is the one checksum torchpass keeps state bytes honest with, on
the wire (every transfer chunk) and in fingerprints (replicas compared before
one is copied from). It is the ``crc32c`` package (ICRAR): SSE4.2 / ARMv8
CRC instructions, the GIL released for buffers from 32 KiB on, and any
buffer accepted, tensor memory included. Measured on this project's 2-core
machine over 4 MiB chunks: ~13 GB/s on one thread and ~26 GB/s on two, against
~2.4 GB/s a thread for ``zlib.crc32``. The other maintained candidate,
``google-crc32c`` 1.9, did ~6.7 GB/s on one thread and no more on two: it keeps
the GIL for the whole call (a second Python thread ran 5% of its time during a
512 MiB checksum, against ~80% beside ``crc32c``), and it refuses memoryview
and bytearray arguments, the way transfers hold tensor memory.

State is checksummed in *chunks* on a grid (:func:`chunk_grid`): the unit a
transfer sends, verifies and resends. A :class:`CrcTable` belongs to one copy
of state whose bytes no longer change (a snapshot, a buddy copy held for
another rank, the live state while it is published for a migration); it
computes each chunk's CRC at most once, on a process-wide pool of threads
(below :data:`INLINE_BYTES`, on the thread that asks), and remembers the ones
verified on receipt, so a copy that is sent again, or fingerprinted and then
sent, is never read twice for its checksums.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
from collections.abc import Iterable, Sequence

import crc32c as _crc32c

__all__ = ["CHUNK_BYTES", "INLINE_BYTES", "THREADS", "Chunk", "Crc", "CrcTable", "KnownCrc", "chunk_grid", "crc32c", "submit"]

Chunk = tuple[int, int, int]
"""A tensor index, a byte offset into that tensor, a byte length."""

CHUNK_BYTES = 4 << 20
"""The default chunk size (as ``transfer_chunk_bytes``'s in the config): 4 MiB keeps the checksum hidden behind the socket while a
corrupted chunk costs little to resend, and is large enough that handing a chunk to a
checksum thread costs nothing measurable."""


def crc32c(data: memoryview | bytes) -> int:
    """The CRC32C (Castagnoli) of ``data``: hardware instructions, the GIL released from 32 KiB on."""
    return _crc32c.crc32c(data)


THREADS = min(4, len(os.sched_getaffinity(0)))
"""Checksum threads per process: one per core this process may run on, at most 4, which at
~13 GB/s each outrun any socket a transfer sees; more would only take cores from training."""

INLINE_BYTES = 32 << 10
"""Below this a checksum runs on the thread that asks for it: ``crc32c`` keeps the GIL for buffers
under 32 KiB, so a checksum thread could not run beside the caller anyway, and the hand-off
(~20-50 µs measured here, a queue and a wake-up each way) costs more than the checksum (~2 µs)."""

_pool: concurrent.futures.ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _forget_pool() -> None:
    # A forked child (a data loader worker) inherits the pool but not its threads.
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_pool)


class KnownCrc:
    """A CRC already computed: what a small buffer's checksum and a chunk verified on receipt give.

    A ``Future`` would do, but builds a ``Condition`` (and its lock) for a value that is
    already there, two a received chunk: a fetch of 1,000 tensors of 4 KiB took 42-47 ms
    with them and 32-35 ms without."""

    __slots__ = ("value",)

    def __init__(self, value: int):
        self.value = value

    def result(self) -> int:
        return self.value


Crc = concurrent.futures.Future[int] | KnownCrc
"""A chunk's CRC: computing on a checksum thread, or known; ``result()`` gives it."""


def submit(data: memoryview) -> Crc:
    """:func:`crc32c` of ``data`` on the process's :data:`THREADS` checksum threads.

    Both ends of a transfer checksum here: a sender's lookahead and a receiver's
    verification spread over these threads instead of one helper thread each.
    Buffers under :data:`INLINE_BYTES` are checksummed on the calling thread instead.
    """
    if data.nbytes < INLINE_BYTES:
        return KnownCrc(crc32c(data))
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(max_workers=THREADS, thread_name_prefix="torchpass-crc")
    return _pool.submit(crc32c, data)


def chunk_grid(sizes: Sequence[int], chunk_bytes: int, indices: Iterable[int] | None = None) -> list[Chunk]:
    """The chunks of the tensors ``indices`` (all when None), whose byte sizes are ``sizes``, ``chunk_bytes`` at most each."""
    out = []
    for i in range(len(sizes)) if indices is None else indices:
        for off in range(0, sizes[i], chunk_bytes):
            out.append((i, off, min(chunk_bytes, sizes[i] - off)))
    return out


class CrcTable:
    """The CRC32C of each chunk of one copy of state whose bytes no longer change.

    ``views`` are the copy's tensors as flat bytes, in manifest order. A chunk's CRC
    is computed at most once (:meth:`crc`), or recorded once its bytes were verified
    on receipt (:meth:`recompute`, then :meth:`record`); :attr:`checksummed` counts
    the bytes this table put through :func:`crc32c`, which is how a caller proves a
    copy was read once for its checksums.
    """

    def __init__(self, views: Sequence[memoryview]):
        self.views = views
        """The copy's tensors as flat bytes: what a sender reads and a receiver receives into."""
        self._crcs: dict[Chunk, Crc] = {}
        self._lock = threading.Lock()
        self._checksummed = 0

    @property
    def checksummed(self) -> int:
        """Bytes this table has put through :func:`crc32c` so far (chunks verified again after a failure count again)."""
        with self._lock:
            return self._checksummed

    def view(self, chunk: Chunk) -> memoryview:
        """The bytes of ``chunk``, in place."""
        index, offset, length = chunk
        return self.views[index][offset : offset + length]

    def crc(self, chunk: Chunk) -> Crc:
        """The CRC of ``chunk``: already known, or computed now (:func:`submit`)."""
        with self._lock:
            future = self._crcs.get(chunk)
            if future is None:
                future = self._crcs[chunk] = submit(self.view(chunk))
                self._checksummed += chunk[2]
            return future

    def recompute(self, chunk: Chunk) -> Crc:
        """The CRC of the bytes of ``chunk`` now in place, computed anew: bytes just received, to verify."""
        with self._lock:
            self._checksummed += chunk[2]
        return submit(self.view(chunk))

    def record(self, chunk: Chunk, crc: int) -> None:
        """Take ``crc`` as the CRC of ``chunk``: its bytes were verified against it on receipt."""
        with self._lock:
            self._crcs[chunk] = KnownCrc(crc)
