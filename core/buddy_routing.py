"""Where a rank's buddy copy goes in a generation, in a constant number of store operations per rank.

The buddy pairs are a pure function of the placement, the node of every rank
(:func:`~torchpass.core.topology.assign_buddies`), and every rank learns the
placement of its generation without reading its peers' records:

* generation 0: the launch placement, rank r on node ``r // nproc_per_node``
  (``Placement.contiguous``), with ``nproc_per_node`` from the ``job`` record,
  which node 0's controller writes before any worker starts (read once per process);
* generation g >= 1: the launch placement with the ranks that ``g/<g>/plan``
  lists in ``Plan.moved`` (every member not on the node that launched its
  rank); every member of g entered g through that plan, and it is O(moves) in size.

Steps of :meth:`BuddyRouting.target` for generation g:

1. the placement of g (above: one read of the plan, none at generation 0);
2. ``assign_buddies`` of it gives this rank's target t, and the ranks that
   send their copies here;
3. wait for t's record ``rankinfo/<t>`` of generation g and take its address;
4. forget every held copy but those of the ranks found in step 2.

Every rank publishes ``rankinfo/<r>`` (transfer-server address, worker id,
node, generation) once it has attached and each time it enters a generation,
before it reports ready; so once a generation's ``go`` is out, the target's
record is that generation's.

Invariants:

* a copy never goes to an address of an older generation: an older record is
  waited past (its rank has not rewritten it yet, or a stranger wrote a
  genuine old record back: the seal binds the key, and this key is rewritten
  every generation), and a newer one ends the wait (this rank's generation is over);
* a rank keeps exactly the copies its generation's placement sends to it,
  and drops the others only once its own target is known;
* the wait ends with the generation: at start-up a target can die before it
  publishes; the wait then ends when the fault ends the generation, in slices
  of ``poll_s``, and the rank pushes nothing that generation: the migration
  that follows resolves again.

Cost per rank and generation: one read of the plan and one of the target's
record (a check and a get each), whatever the world size; the placement is
computed locally (linear in the ranks, no store traffic).
"""

from __future__ import annotations

import json
import threading
from datetime import timedelta

import torch.distributed as dist

from .buddy import BuddyKeeper
from .control import Keys, Plan, put
from .rendezvous_store import WAIT_SLICE_S
from .topology import Placement, assign_buddies
from .transfer import Address

__all__ = ["BuddyRouting", "GenerationEnded"]


class GenerationEnded(Exception):
    """The generation ended before this rank's buddy had published its address."""


class BuddyRouting:
    """This rank's buddy target per generation (see the module docstring)."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, poll_s: float = WAIT_SLICE_S):
        self._store = store
        self._rank = rank
        self._world_size = world_size
        self._poll = timedelta(seconds=poll_s)
        self._nproc_per_node: int | None = None
        """From the job record, read at the first resolution (it never changes)."""
        self._resolved: tuple[int, Address | None] | None = None

    def publish(self, node: int, address: Address, wid: str, generation: int) -> None:
        """Publish this rank's record for ``generation`` (``node`` and ``wid`` are there for people reading the store)."""
        info = {"node": node, "addr": list(address), "wid": wid, "generation": generation}
        put(self._store, Keys.rankinfo(self._rank), info)

    def target(self, generation: int, ending: threading.Event, keeper: BuddyKeeper) -> Address | None:
        """The address of this rank's buddy in ``generation`` (None on a one-rank world).

        Raises :class:`GenerationEnded` when ``ending`` is set before the buddy published.
        """
        if self._resolved is None or self._resolved[0] != generation:
            buddies = assign_buddies(self._placement(generation, ending))
            mine = buddies[self._rank]
            target = None if mine == self._rank else self._address(mine, generation, ending)
            keeper.forget_holdings_except({r for r, b in buddies.items() if b == self._rank and r != self._rank})
            self._resolved = (generation, target)
        return self._resolved[1]

    def _placement(self, generation: int, ending: threading.Event) -> Placement:
        """Every rank's node in ``generation``: the launch placement, with the plan's moves after generation 0."""
        if self._nproc_per_node is None:
            job = json.loads(self._read(Keys.job, ending, "the job record"))
            self._nproc_per_node = int(job["nproc_per_node"])
        moved: dict[int, int] = {}
        if generation > 0:
            plan = Plan(**json.loads(self._read(Keys.plan(generation), ending, f"the plan of generation {generation}")))
            moved = {int(r): node for r, node in plan.moved.items()}
        return Placement.contiguous(self._world_size, self._nproc_per_node, moved)

    def _address(self, target: int, generation: int, ending: threading.Event) -> Address:
        """Rank ``target``'s address once its record is of ``generation``."""
        what = f"rank {target}'s address for generation {generation}"
        while True:
            info = json.loads(self._read(Keys.rankinfo(target), ending, what))
            if info["generation"] == generation:
                return tuple(info["addr"])  # type: ignore[return-value]
            if info["generation"] > generation:
                raise GenerationEnded(f"rank {target} already published for generation {info['generation']} > {generation}")
            # An older record: look again in a slice (waiting on the key returns at once, it exists).
            if ending.wait(self._poll.total_seconds()):
                raise GenerationEnded(f"generation {generation} ended before {what} was published")

    def _read(self, key: str, ending: threading.Event, what: str) -> bytes:
        """The value at ``key`` once it exists; waits in slices of ``poll_s`` and gives up when ``ending`` is set."""
        while not self._store.check([key]):
            if ending.is_set():
                raise GenerationEnded(f"the generation ended before {what} was there")
            try:
                self._store.wait([key], self._poll)
            except dist.DistStoreError:
                continue  # a slice ran out (a stopped store ends the process through its watchdog)
        return self._store.get(key)
