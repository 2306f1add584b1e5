"""Where a rank's buddy copy goes in a generation, from the addresses every rank publishes.

Every rank publishes ``rankinfo/<r>`` (node, transfer-server address, worker
id, generation) once it has attached and each time it enters a generation,
before it reports ready; so once a generation's ``go`` is out, every member's
record is that generation's, and a resolver waits past any older one. The buddy pairs are a pure function of the
placement (:func:`~torchpass.core.topology.assign_buddies`): every rank
computes the same ones without a coordinator, and a rank that resolves its
target also learns whose copies it holds (it drops any other).

Bound: resolving waits until every rank has published. At start-up a rank can
die before it publishes; the wait then ends with the generation (the fault
ends it), in slices of ``poll_s``, and the rank pushes nothing that
generation: the migration that follows resolves again.
"""

from __future__ import annotations

import json
import threading
from datetime import timedelta

import torch.distributed as dist

from .buddy import BuddyKeeper
from .control import Keys, put
from .rendezvous_store import WAIT_SLICE_S
from .topology import Placement, assign_buddies
from .transfer import Address

__all__ = ["BuddyRouting", "GenerationEnded"]


class GenerationEnded(Exception):
    """The generation ended before every rank had published its address."""


class BuddyRouting:
    """This rank's buddy target per generation (see the module docstring)."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, poll_s: float = WAIT_SLICE_S):
        self._store = store
        self._rank = rank
        self._world_size = world_size
        self._poll = timedelta(seconds=poll_s)
        self._resolved: tuple[int, Address | None] | None = None

    def publish(self, node: int, address: Address, wid: str, generation: int) -> None:
        """Publish this rank's record for ``generation``."""
        info = {"node": node, "addr": list(address), "wid": wid, "generation": generation}
        put(self._store, Keys.rankinfo(self._rank), info)

    def target(self, generation: int, ending: threading.Event, keeper: BuddyKeeper) -> Address | None:
        """The address of this rank's buddy in ``generation`` (None on a one-rank world).

        Raises :class:`GenerationEnded` when ``ending`` is set before every rank published.
        """
        if self._resolved is None or self._resolved[0] != generation:
            infos = self._published(generation, ending)
            buddies = assign_buddies(Placement({r: info["node"] for r, info in enumerate(infos)}))
            mine = buddies[self._rank]
            target: Address | None = None if mine == self._rank else tuple(infos[mine]["addr"])  # type: ignore[assignment]
            keeper.forget_holdings_except({r for r, b in buddies.items() if b == self._rank and r != self._rank})
            self._resolved = (generation, target)
        return self._resolved[1]

    def _published(self, generation: int, ending: threading.Event) -> list[dict]:
        """Every rank's record for ``generation``, once all are there.

        A record of an earlier generation is waited past: it is either one its rank
        has not rewritten yet, or a genuine old record a stranger wrote back (the
        seal binds the key, and this key is rewritten every generation), and an
        old placement would send the copy to a process that no longer holds the rank.
        """
        keys = [Keys.rankinfo(r) for r in range(self._world_size)]
        while True:
            if self._store.check(keys):
                infos = [json.loads(self._store.get(k)) for k in keys]
                if any(info["generation"] > generation for info in infos):
                    raise GenerationEnded(f"a rank already published for a generation after {generation}")
                if all(info["generation"] == generation for info in infos):
                    return infos
            if ending.is_set():
                raise GenerationEnded(f"generation {generation} ended before every rank published its address")
            try:
                self._store.wait(keys, self._poll)
            except dist.DistStoreError:
                continue  # a slice ran out (a stopped store ends the process through its watchdog)
            if self._store.check(keys):
                ending.wait(self._poll.total_seconds())  # all there, one of them old: wait is no wait
