"""Which launcher runs the controller, on an etcd store: one at a time, chosen by an etcd lease.

With node 0's ``TCPStore`` the controller lives and dies with node 0. On an etcd
cluster the job's state outlives any launcher, so the controller can move:

1. **Campaign.** Each launcher of the job asks, once per tick while it does not
   hold it, for the key ``Keys.controller``: one transaction creates it,
   attached to a lease of ``controller_lease_s`` seconds, only if no key is
   there. Node 0 campaigns before it writes the job, so it is the first
   controller; the others start campaigning once the job exists.
2. **Hold.** The holder renews its lease every third of its TTL from a thread
   of its own, so a slow controller tick (a large plan, a slow disk) does not
   lose it; a renewal that finds the lease expired, or none that succeeds
   within the TTL, ends the holding.
3. **Fence.** The key's create revision is the fencing token. The controller
   writes through ``EtcdStore.guarded(Keys.controller, token)``: every write
   is a transaction that also compares the key's create revision with the
   token. Once the key is gone or recreated by another launcher, the old
   controller's writes are refused (``GuardLost``) and it steps down, even if
   it has not noticed its lease expire yet (a paused process, a partition).
4. **Take over.** When the holder dies or is cut off, etcd deletes the key when
   the lease expires (at most ``controller_lease_s`` after its last renewal);
   the next campaign wins and the new controller continues from the state the
   old one wrote (``Keys.controller_state``, see ``Controller.snapshot``).

Invariants: once a launcher holds the key, no write of an earlier holder
commits (etcd's linearizable transactions and the monotonic create
revision); a successor starts from the state its predecessor wrote at the end
of its last complete tick, so it repeats at most that predecessor's last tick
(see ``core/controller.py`` for why that repetition is harmless).

Requires of the training loop: nothing; workers never talk to the controller
directly, only through the store.
"""

from __future__ import annotations

import json
import threading
import time

import torch.distributed as dist

from .control import Keys
from .etcd_store import EtcdStore

__all__ = ["ControllerLease"]


class ControllerLease:
    """One launcher's candidacy for the controller (see the module docstring)."""

    def __init__(self, store: EtcdStore, node: int, ttl_s: int):
        self._store = store
        self._node = node
        self._ttl_s = ttl_s
        self._lease = 0
        self.token = 0
        """The create revision of the key this launcher holds (0: it holds none): the fencing token."""
        self._lost = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.lost_because = ""
        """Why the holding ended, for the launcher's message."""

    @property
    def held(self) -> bool:
        return self.token != 0 and not self._lost.is_set()

    def campaign(self) -> bool:
        """Try once to become the controller; True when this launcher holds the lease (now or already)."""
        if self.token:
            return self.held
        lease = self._store.grant_lease(self._ttl_s)
        token = self._store.create(Keys.controller, json.dumps({"node": self._node, "t": time.time()}), lease)
        if not token:
            self._store.revoke_lease(lease)
            return False
        self._lease, self.token = lease, token
        self._thread = threading.Thread(target=self._keep, name="torchpass-controller-lease", daemon=True)
        self._thread.start()
        return True

    def free(self) -> bool:
        """Whether nobody holds the controller now (one read: what a launcher checks before it campaigns)."""
        return not self._store.check([Keys.controller])

    def holder(self) -> int | None:
        """The node whose launcher holds the controller now (None: nobody, between two holders)."""
        raw = self._store.check([Keys.controller]) and self._store.get(Keys.controller)
        return int(json.loads(raw)["node"]) if raw else None

    def guarded(self) -> EtcdStore:
        """The job's store as the holder must write it: refused once another launcher holds the key."""
        assert self.token, "guarded() before campaign() won"
        return self._store.guarded(Keys.controller, self.token)

    def _keep(self) -> None:
        interval = self._ttl_s / 3
        last_ok = time.monotonic()
        while not self._stop.wait(interval):
            try:
                ttl = self._store.refresh_lease(self._lease)
            except dist.DistError as exc:
                # No member answered: the lease lives on in etcd until its TTL runs out, and so does the holding.
                if time.monotonic() - last_ok >= self._ttl_s:
                    self._end(f"no etcd member renewed the controller's lease for {self._ttl_s} s ({exc})")
                    return
                continue
            if ttl <= 0:
                self._end("the controller's lease expired before it was renewed (this launcher was paused or cut off)")
                return
            last_ok = time.monotonic()

    def _end(self, why: str) -> None:
        self.lost_because = why
        self._lost.set()

    def resign(self) -> None:
        """Give the lease up at the job's end (its key goes with it)."""
        self._stop.set()
        if self.token and not self._lost.is_set():
            self._store.revoke_lease(self._lease)
        self._lost.set()
