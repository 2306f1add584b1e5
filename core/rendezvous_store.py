"""The store a generation's gloo rendezvous waits on, which gives up when the generation is released.

A gloo group's rendezvous waits in the store for its peers' addresses, up to
the connect timeout (``rebuild_timeout_s``, 120 s): in the group's constructor
when gloo connects the full mesh up front, in the first collective that needs
a peer when it connects lazily (below). A member that dies between the
controller's ``go`` and its own address write leaves every other member
waiting there; the generation's end, which releases sockets and pending
collectives, does not reach a wait inside a constructor or a store read on
gloo's thread, and survivors would miss the controller's report deadline and
be fenced. c10d calls a ``dist.Store`` written in Python through its
trampoline, so this one waits in short slices and raises, naming the reason,
as soon as ``released()`` says the generation is over: the constructor or the
collective fails like any collective of a dead generation, and the member
reports again.

Waiting costs nothing on the normal path: a slice is a server-side wait that
returns as soon as the key is written. Only a stuck rendezvous pays, with one
c10d warning line per slice.

Each member writes one address record per group. How many it reads is
gloo's choice:

* By default gloo connects the full mesh while the group is built: each
  member waits for and reads every peer's record, O(N) store requests per
  member and O(N^2) for the store (a wait and a get each, through c10d's
  trampoline it cannot batch them with ``multi_get``).
* With ``TORCH_GLOO_LAZY_INIT`` it connects a pair the first time a
  collective needs it and reads that peer's record then, on its worker
  thread. A ring allreduce needs two peers and the dissemination barrier the
  migration runs after the rebuild 2 log2 N, so a member reads O(log N)
  records: 28 of 16,384. The wait for a peer moves from the constructor into
  the first collective, where it ends the same way, with the generation.

:func:`worker_environment` turns the lazy mode on for every worker and spare,
unless the user set it. A key a wait saw present is read directly, without
probing it again: keys under a generation's prefix are written once and never
removed while it is built.

Each record is O(1) bytes, not O(N): by default gloo's record carries one
8-byte pair identifier per rank of the group (2 GB read by each member of a
full mesh at 16,384 ranks); in the lazy mode, or with
``GLOO_ENABLE_RANK_AS_SEQUENCE_NUMBER``, it carries none, a peer's rank
identifying its connection instead. :func:`worker_environment` turns that on
too. It is sound because ranks are unique within a gloo context and every
``ProcessGroupGloo`` (torchpass's rebuilt transports and groups torch builds
alike) listens on a device of its own, and it must be the same on every
member of a group, which one launcher's environment gives.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from datetime import timedelta
from typing import Callable

import torch.distributed as dist

from .failures import ABANDONED_MARKER

__all__ = ["InterruptibleStore", "LAZY_CONNECT_ENV", "RANK_AS_SEQUENCE_ENV", "WAIT_SLICE_S", "worker_environment"]

RANK_AS_SEQUENCE_ENV = "GLOO_ENABLE_RANK_AS_SEQUENCE_NUMBER"
"""gloo's switch for address records without per-pair identifiers (read by gloo at every rendezvous)."""
LAZY_CONNECT_ENV = "TORCH_GLOO_LAZY_INIT"
"""c10d's switch for gloo groups that connect each pair on its first use (read whenever a group is built)."""


def worker_environment(env: Mapping[str, str]) -> dict[str, str]:
    """What a worker's environment needs for a gloo rendezvous of O(log N) records of O(1) bytes each:
    added only where unset (a user who wants the full mesh built up front sets ``TORCH_GLOO_LAZY_INIT=0``)."""
    return {name: "1" for name in (RANK_AS_SEQUENCE_ENV, LAZY_CONNECT_ENV) if name not in env}


WAIT_SLICE_S = 0.5
"""How long one slice of a rendezvous wait lasts: the delay between a generation's release and the wait's end."""


class InterruptibleStore(dist.Store):
    """``base`` with waits (and blocking gets) that end when ``released()`` turns true."""

    def __init__(self, base: dist.Store, released: Callable[[], bool], what: str, timeout: timedelta):
        super().__init__()
        self._base = base
        self._released = released
        self._what = what
        self._timeout = timeout
        self._present: set[str] = set()
        """Keys a wait saw present: a get of one reads it without probing again."""

    def _await(self, keys: list[str], timeout: timedelta | None) -> None:
        limit = (timeout or self._timeout).total_seconds()
        deadline = time.monotonic() + limit
        while not self._base.check(keys):
            if self._released():
                raise RuntimeError(f"{ABANDONED_MARKER}: {self._what}: the generation ended while waiting for peers")
            left = deadline - time.monotonic()
            if left <= 0:
                raise dist.DistStoreError(f"{self._what}: waited {limit:.0f} s for keys {keys} (Socket Timeout)")
            try:
                self._base.wait(keys, timedelta(seconds=min(WAIT_SLICE_S, left)))
            except dist.DistStoreError:
                continue  # a slice ran out: look at the release and the deadline again

    # ---- c10d's Store interface ----------------------------------------------------
    def set(self, key: str, value: bytes | str) -> None:
        self._base.set(key, value)

    def get(self, key: str) -> bytes:
        if key not in self._present:
            self._await([key], None)
        return self._base.get(key)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._await(keys, timeout)
        self._present.update(keys)

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
        self._timeout = timeout
