"""The small-state mirror: a rank's RNG streams, data position and per-rank extras, written to the store.

Whoever takes a lost rank over needs its small state at the version the
migration resumes from, and only the rank itself had it. The runtime submits
a record at each step start (version k-1) and when each backward begins
(version k, made durable before the rank's next collective: see
``Runtime.backward_started``); this thread writes them off the training thread,
one store key per version slot (``MIRROR_SLOTS`` of them), newest first wins.
A durable record the thread has not taken by the time the collective comes is
written by the training thread itself (``flush``).
Records must hold copies, never live tensors: they are serialized here (as
:mod:`~torchpass.core.safe_pickle`, which readers load without running code)
while the training thread goes on.
"""

from __future__ import annotations

import struct
import threading
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from .control import MIRROR_SLOTS, Keys, StoreAddress, put_object

__all__ = ["SmallStateMirror"]


class SmallStateMirror(threading.Thread):
    """Writes small-state records to the store off the training thread, one key per version slot.

    A version's step-start record is written after its end-of-backward record and
    replaces it (same slot), so the exact record wins whenever it exists. A
    record identical to the last one submitted for its version (the common case:
    nothing drew from a generator between a step's backward and the next step's
    start) is not written again: half the store writes and serializations.
    ``submit(..., durable=True)`` marks a record that must be in the store before
    the rank's next collective (see ``Runtime.backward_started``); ``flush`` waits
    for it, usually without blocking because the write overlapped backward compute.
    """

    def __init__(self, address: StoreAddress, rank: int):
        super().__init__(name="torchpass-mirror", daemon=True)
        self._store = address.connect()
        self._direct = address.connect()
        """The training thread's own connection, for the records it writes itself (see ``flush``)."""
        self._rank = rank
        self._cv = threading.Condition()
        self._pending: dict[int, tuple[int, dict[str, Any]]] = {}
        self._submitted = 0
        self._written = 0
        self._durable = 0
        self._writing = False
        """A batch is being written (by the thread or by ``flush``)."""
        self._last: tuple[int, int, dict[str, Any]] | None = None
        """(version, submission number, record) of the last record submitted."""
        self.error: BaseException | None = None
        self.start()

    def submit(self, version: int, record: dict[str, Any], durable: bool = False) -> None:
        """Queue ``record`` for ``version`` (called by the training thread only)."""
        with self._cv:
            if self._last is not None and self._last[0] == version and identical(self._last[2], record):
                # Already queued or written: at most its durability is new.
                if durable:
                    self._durable = max(self._durable, self._last[1])
                return
            self._submitted += 1
            self._last = (version, self._submitted, record)
            # A newer record for the same slot supersedes an unwritten older one.
            self._pending[version % MIRROR_SLOTS] = (self._submitted, {**record, "version": version})
            if durable:
                self._durable = self._submitted
            self._cv.notify_all()

    def flush(self, timeout: float) -> None:
        """Return once the last durable record is in the store.

        Records the thread has not taken yet are written here, on the caller's own
        connection: on a busy machine the thread may not be scheduled before the
        collective this flush guards, and waiting for it would put a wake-up on the
        step's critical path. A batch the thread is writing is waited for, so two
        writes of one slot never race.
        """
        deadline = time.monotonic() + timeout
        with self._cv:
            while self._written < self._durable and self.error is None:
                if self._pending and not self._writing:
                    batch = self._take()
                    break
                if not self._cv.wait(deadline - time.monotonic()) and time.monotonic() >= deadline:
                    raise RuntimeError(f"torchpass: mirroring this rank's RNG state to the store took over {timeout:.0f} s")
            else:
                batch = []
        if batch:
            self._write(self._direct, batch)
        if self.error is not None:
            raise RuntimeError(f"torchpass: mirroring this rank's RNG state failed: {self.error}") from self.error

    def run(self) -> None:
        while self.error is None:
            with self._cv:
                self._cv.wait_for(lambda: bool(self._pending) and not self._writing)
                batch = self._take()
            self._write(self._store, batch)

    def _take(self) -> list[tuple[int, tuple[int, dict[str, Any]]]]:
        """Take every pending record, oldest first, for the caller to write (under the lock)."""
        batch = sorted(self._pending.items(), key=lambda item: item[1][0])
        self._pending.clear()
        self._writing = True
        return batch

    def _write(self, store: dist.Store, batch: list[tuple[int, tuple[int, dict[str, Any]]]]) -> None:
        try:
            for slot, (_, record) in batch:
                put_object(store, Keys.mirror(self._rank, slot), record)
        except BaseException as exc:  # surfaced to the training thread by flush()
            with self._cv:
                self.error = exc
                self._writing = False
                self._cv.notify_all()
            return
        with self._cv:
            self._written = max(self._written, batch[-1][1][0])
            self._writing = False
            self._cv.notify_all()


def identical(a: Any, b: Any) -> bool:
    """Whether two small-state records hold the same values (tensors compared bit for bit)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and _same_bits(a, b)
    if isinstance(a, float) and isinstance(b, float):
        return struct.pack("<d", a) == struct.pack("<d", b)  # -0.0 and NaNs are told apart as bits
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(identical(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(identical(x, y) for x, y in zip(a, b))
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    return type(a) is type(b) and a == b


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape or a.device != b.device:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))
