"""BuddyRouting: buddy targets from the placement and one published address, and a wait that ends with the generation."""

from __future__ import annotations

import threading
import time
from collections import Counter
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist

from torchpass.core.buddy_routing import BuddyRouting, GenerationEnded
from torchpass.core.control import Keys, Plan, put


class Keeper:
    """Records what the routing tells a buddy keeper to keep."""

    def __init__(self) -> None:
        self.kept: set[int] | None = None

    def forget_holdings_except(self, sources: set[int]) -> None:
        self.kept = sources


class CountingStore:
    """Delegates to a store and counts the operations issued through it, by kind."""

    def __init__(self, store: dist.Store) -> None:
        self._store = store
        self.ops: Counter[str] = Counter()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._store, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.ops[name] += 1
            return attr(*args, **kwargs)

        return counted


@pytest.fixture
def store():
    server = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=10))
    yield server


def _job(store: dist.Store, nproc_per_node: int) -> None:
    """The job record the controller writes before any worker starts (the routing reads ranks per node)."""
    put(store, Keys.job, {"nproc_per_node": nproc_per_node})


def _plan(store: dist.Store, generation: int, moved: dict[int, int] | None = None) -> None:
    plan = Plan(generation, 0, {}, {}, {}, "test", moved={str(r): n for r, n in (moved or {}).items()})
    put(store, Keys.plan(generation), plan)


def test_targets_pair_ranks_across_nodes(store):
    _job(store, 2)
    routes = [BuddyRouting(store, r, 4) for r in range(4)]
    for r, route in enumerate(routes):
        route.publish(r // 2, ("127.0.0.1", 9000 + r), f"w{r}", 0)
    keepers = [Keeper() for _ in routes]
    targets = [route.target(0, threading.Event(), keeper) for route, keeper in zip(routes, keepers)]
    ports = [t[1] for t in targets]
    # Every copy leaves its node, and every rank holds exactly the copies sent to it.
    for r, port in enumerate(ports):
        assert (port - 9000) // 2 != r // 2
    for r, keeper in enumerate(keepers):
        assert keeper.kept == {s for s, port in enumerate(ports) if port == 9000 + r}


def test_targets_follow_the_moves_of_the_generations_plan(store):
    """Rank 1 moved to node 2 (a spare there took it over): node 2 joins the ring, and copies follow."""
    _job(store, 2)
    _plan(store, 1, {1: 2})
    routes = [BuddyRouting(store, r, 4) for r in range(4)]
    for r, route in enumerate(routes):
        route.publish(2 if r == 1 else r // 2, ("127.0.0.1", 9100 + r), f"w{r}-g1", 1)
    keepers = [Keeper() for _ in routes]
    ports = [route.target(1, threading.Event(), keeper)[1] - 9100 for route, keeper in zip(routes, keepers)]
    # Nodes 0: [0], 1: [2, 3], 2: [1]: the ring 0 -> 1 -> 2 -> 0.
    assert ports == [2, 0, 1, 1]
    assert [k.kept for k in keepers] == [{1}, {2, 3}, {0}, set()]


def test_store_operations_per_rank_do_not_grow_with_the_world():
    """A rank reads the plan and its target's record: the same operations at 4 ranks and at 64."""
    counts = {}
    for world in (4, 64):
        # One store per world: a fresh key space, as in a job of that size.
        server = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=10))
        counting = CountingStore(server)
        route = BuddyRouting(counting, 0, world)
        _job(server, 2)
        for g in (1, 2):
            _plan(server, g)
            for r in range(world):
                BuddyRouting(server, r, world).publish(r // 2, ("127.0.0.1", 9000 + r), f"w{r}", g)
            # The first resolution also reads the job record, once per process: count the next generation's.
            counting.ops.clear()
            assert route.target(g, threading.Event(), Keeper()) == ("127.0.0.1", 9002)
        counts[world] = counting.ops
    assert counts[4] == counts[64], counts
    assert sum(counts[64].values()) <= 4, counts  # a check and a get each for the plan and the target's record


def test_a_rank_that_never_published_ends_the_wait_with_the_generation(store):
    _job(store, 1)
    route = BuddyRouting(store, 0, 2, poll_s=0.1)
    route.publish(0, ("127.0.0.1", 9000), "w0", 0)
    ending = threading.Event()
    threading.Timer(0.5, ending.set).start()
    t0 = time.monotonic()
    with pytest.raises(GenerationEnded):
        route.target(0, ending, Keeper())
    assert time.monotonic() - t0 < 5  # not the store's 10 s timeout, and not forever


def test_a_held_copy_is_kept_when_the_generation_ends_before_the_target_is_known(store):
    _job(store, 1)
    keeper = Keeper()
    ending = threading.Event()
    ending.set()
    with pytest.raises(GenerationEnded):
        BuddyRouting(store, 0, 2, poll_s=0.1).target(0, ending, keeper)
    assert keeper.kept is None


def test_an_old_generations_record_written_back_is_waited_past(store):
    """A genuine record replayed at its own key (a stranger copied it a generation ago) never places a copy."""
    _job(store, 2)
    _plan(store, 1)
    routes = [BuddyRouting(store, r, 4, poll_s=0.1) for r in range(4)]
    for r, route in enumerate(routes):
        route.publish(r // 2, ("127.0.0.1", 9000 + r), f"w{r}", 0)
    old = store.get("tp/rankinfo/3")
    for r, route in enumerate(routes):
        route.publish(r // 2, ("127.0.0.1", 9100 + r), f"w{r}-g1", 1)
    store.set("tp/rankinfo/3", old)
    threading.Timer(0.4, routes[3].publish, args=(1, ("127.0.0.1", 9103), "w3-g1", 1)).start()
    t0 = time.monotonic()
    target = routes[1].target(1, threading.Event(), Keeper())
    assert time.monotonic() - t0 >= 0.3, "resolved from the replayed record"
    assert target == ("127.0.0.1", 9103)


def test_a_record_of_a_later_generation_ends_the_wait(store):
    _job(store, 1)
    routes = [BuddyRouting(store, r, 2, poll_s=0.1) for r in range(2)]
    routes[0].publish(0, ("127.0.0.1", 9000), "w0", 0)
    routes[1].publish(1, ("127.0.0.1", 9001), "w1", 1)
    with pytest.raises(GenerationEnded):
        routes[0].target(0, threading.Event(), Keeper())
