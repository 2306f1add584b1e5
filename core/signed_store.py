"""The control-plane store with every value sealed under the job secret.

The c10d TCPStore accepts any client that reaches its port and keeps whatever
it is sent. Every torchpass process therefore talks to it through
:class:`SignedStore`, which seals each value it writes and opens each value it
reads:

* a sealed value is ``MAGIC | HMAC-SHA256(secret, "torchpass-store/" | key | 0 | value) | value``;
  binding the key means a record copied to another key (another generation's
  ``g/<g>/plan``, another mailbox slot, another rank's status) no longer opens;
* a value that does not open (unsigned, signed with another secret, or moved
  from another key) is treated as **absent**: ``check`` and ``wait`` do not see
  it, ``get`` waits for a genuine value to replace it, and a writer's
  ``compare_set`` on an empty key replaces it. Readers written for the plain
  store need no change, and a forged record can at most delay them, never
  steer them. Each one is counted and reported once per key through
  ``on_forged``;
* counters (``add``) stay plain: the store computes them, so they cannot be
  sealed. torchpass uses them only to learn *how many* sealed records to look
  for, and a forged count only makes a reader look for records that do not
  open.

Invariant: nothing read through this store was written by a process without
the secret. What it does not give: secrecy (values cross the network in
clear) and availability (the server still lets anyone overwrite or delete a
key; a forged overwrite of a record nobody rewrites delays its reader until
its deadline). See docs/design.md, section 12b.
"""

from __future__ import annotations

import hashlib
import hmac
import threading
import time
from datetime import timedelta
from typing import Callable

import torch.distributed as dist

__all__ = ["SignedStore", "FORGED", "MAGIC", "seal", "unseal"]

MAGIC = b"TPS1"
FORGED = "not sealed with the job secret"
"""Why a record was skipped when its value does not open (mailbox readers hand it to their ``on_bad``)."""
_MAC_BYTES = hashlib.sha256().digest_size
_FORGED_POLL_S = 0.05
"""How often a reader looks again at a key holding a value that does not open (only while one does)."""


def _mac(secret: bytes, key: str, value: bytes) -> bytes:
    return hmac.new(secret, b"torchpass-store/" + key.encode() + b"\0" + value, hashlib.sha256).digest()


def _bytes(value: bytes | str) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def seal(secret: bytes, key: str, value: bytes | str) -> bytes:
    raw = _bytes(value)
    return MAGIC + _mac(secret, key, raw) + raw


def unseal(secret: bytes, key: str, sealed: bytes) -> bytes | None:
    """The value inside ``sealed``, or None when it was not sealed for ``key`` under ``secret``."""
    head = len(MAGIC) + _MAC_BYTES
    if len(sealed) < head or sealed[: len(MAGIC)] != MAGIC:
        return None
    value = sealed[head:]
    return value if hmac.compare_digest(sealed[len(MAGIC) : head], _mac(secret, key, value)) else None


class SignedStore(dist.Store):
    """``base`` with every value sealed on write and opened on read (see the module docstring)."""

    def __init__(self, base: dist.Store, secret: bytes, on_forged: Callable[[str], None] | None = None):
        super().__init__()
        self._base = base
        self._secret = secret
        self._on_forged = on_forged
        self._lock = threading.Lock()
        self._reported: set[str] = set()
        self.forged = 0
        """Values read that did not open (each key reported once)."""
        self._timeout = timedelta(seconds=300)

    def _forged(self, key: str) -> None:
        with self._lock:
            self.forged += 1
            first = key not in self._reported
            self._reported.add(key)
        if first and self._on_forged is not None:
            self._on_forged(key)

    def _open(self, key: str, raw: bytes) -> bytes | None:
        value = unseal(self._secret, key, raw)
        if value is None:
            self._forged(key)
        return value

    # ---- c10d's Store interface ----------------------------------------------------
    def set(self, key: str, value: bytes | str) -> None:
        self._base.set(key, seal(self._secret, key, value))

    def multi_set(self, keys: list[str], values: list[bytes | str]) -> None:
        self._base.multi_set(keys, [seal(self._secret, k, v) for k, v in zip(keys, values)])

    def get(self, key: str) -> bytes:
        deadline = time.monotonic() + self._timeout.total_seconds()
        while True:
            value = self._open(key, self._base.get(key))
            if value is not None:
                return value
            self._sleep_or_raise(deadline, [key])
            self._base.wait([key], self._left(deadline))

    def multi_get(self, keys: list[str]) -> list[bytes]:
        raws = self._base.multi_get(keys)
        values = [self._open(k, raw) for k, raw in zip(keys, raws)]
        if any(v is None for v in values):
            # The caller checked these keys exist; one that does not open is missing to it.
            return [v if v is not None else self.get(k) for k, v in zip(keys, values)]
        return values  # type: ignore[return-value]

    def get_if_present(self, key: str) -> bytes | None:
        """The opened value of ``key``; None if it is absent or does not open. Two requests and one seal check,
        where ``check`` then ``get`` would take three and two."""
        if not self._base.check([key]):
            return None
        return self._open(key, self._base.get(key))

    def check(self, keys: list[str]) -> bool:
        if not self._base.check(keys):
            return False
        return all(self._open(k, raw) is not None for k, raw in zip(keys, self._base.multi_get(keys)))

    def holds_forged(self, key: str) -> bool:
        """Whether ``key`` holds a value that does not open (a reader sees it as absent)."""
        return self._base.check([key]) and self._open(key, self._base.get(key)) is None

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        deadline = time.monotonic() + (timeout or self._timeout).total_seconds()
        while True:
            self._base.wait(keys, self._left(deadline))
            if self.check(keys):
                return
            self._sleep_or_raise(deadline, keys)

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        """c10d's compare-and-set on opened values; a value that does not open counts as no value."""
        sealed = seal(self._secret, key, desired)
        want = _bytes(expected)
        for _ in range(8):
            raw = self._base.get(key) if self._base.check([key]) else None
            current = None if raw is None else self._open(key, raw)
            if current is None and want:
                return b""  # expected a value and there is none: nothing is set
            if current is not None and current != want:
                return current
            if self._base.compare_set(key, raw if raw is not None else b"", sealed) == sealed:
                return _bytes(desired)
            # Changed between the read and the swap: look again.
        raise dist.DistStoreError(f"compare_set on {key!r}: the value kept changing under it")

    def add(self, key: str, value: int) -> int:
        return self._base.add(key, value)

    def delete_key(self, key: str) -> bool:
        return self._base.delete_key(key)

    def num_keys(self) -> int:
        return self._base.num_keys()

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout = timeout
        self._base.set_timeout(timeout)

    # ---- helpers ---------------------------------------------------------------------
    @staticmethod
    def _left(deadline: float) -> timedelta:
        return timedelta(seconds=max(0.001, deadline - time.monotonic()))

    @staticmethod
    def _sleep_or_raise(deadline: float, keys: list[str]) -> None:
        if time.monotonic() + _FORGED_POLL_S > deadline:
            raise dist.DistStoreError(f"wait for keys {keys}: timed out (values there do not open under the job secret)")
        time.sleep(_FORGED_POLL_S)
