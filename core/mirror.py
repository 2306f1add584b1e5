"""The small-state mirror: a rank's RNG streams, data position and per-rank extras, written to the store.

Whoever takes a lost rank over needs its small state at the version the
migration resumes from, and only the rank itself had it. The runtime submits
a record at each step start (version k-1) and when each backward begins
(version k, made durable before the rank's next collective: see
``Runtime.backward_started``); this thread writes them off the training thread,
one store key per version slot (``MIRROR_SLOTS`` of them), newest first wins.
Records must hold copies, never live tensors: they are serialized here (as
:mod:`~torchpass.core.safe_pickle`, which readers load without running code)
while the training thread goes on.
"""

from __future__ import annotations

import threading
from typing import Any

from .control import MIRROR_SLOTS, Keys, StoreAddress, put_object

__all__ = ["SmallStateMirror"]


class SmallStateMirror(threading.Thread):
    """Writes small-state records to the store off the training thread, one key per version slot.

    A version's step-start record is written after its end-of-backward record and
    replaces it (same slot), so the exact record wins whenever it exists.
    ``submit(..., durable=True)`` marks a record that must be in the store before
    the rank's next collective (see ``Runtime.backward_started``); ``flush`` waits
    for it, usually without blocking because the write overlapped backward compute.
    """

    def __init__(self, address: StoreAddress, rank: int):
        super().__init__(name="torchpass-mirror", daemon=True)
        self._store = address.connect()
        self._rank = rank
        self._cv = threading.Condition()
        self._pending: dict[int, tuple[int, dict[str, Any]]] = {}
        self._submitted = 0
        self._written = 0
        self._durable = 0
        self.error: BaseException | None = None
        self.start()

    def submit(self, version: int, record: dict[str, Any], durable: bool = False) -> None:
        with self._cv:
            self._submitted += 1
            # A newer record for the same slot supersedes an unwritten older one.
            self._pending[version % MIRROR_SLOTS] = (self._submitted, {**record, "version": version})
            if durable:
                self._durable = self._submitted
            self._cv.notify_all()

    def flush(self, timeout: float) -> None:
        """Return once the last durable record is in the store."""
        with self._cv:
            if self._written >= self._durable:
                return
            if not self._cv.wait_for(lambda: self._written >= self._durable or self.error is not None, timeout):
                raise RuntimeError(f"torchpass: mirroring this rank's RNG state to the store took over {timeout:.0f} s")
        if self.error is not None:
            raise RuntimeError(f"torchpass: mirroring this rank's RNG state failed: {self.error}") from self.error

    def run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: bool(self._pending))
                batch = sorted(self._pending.items(), key=lambda item: item[1][0])
                self._pending.clear()
            try:
                for slot, (_, record) in batch:
                    put_object(self._store, Keys.mirror(self._rank, slot), record)
            except BaseException as exc:  # surfaced to the training thread by flush()
                with self._cv:
                    self.error = exc
                    self._cv.notify_all()
                return
            with self._cv:
                self._written = max(self._written, batch[-1][1][0])
                self._cv.notify_all()
