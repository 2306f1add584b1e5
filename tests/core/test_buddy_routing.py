"""BuddyRouting: buddy targets from published addresses, and a wait that ends with the generation."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from torchpass.core.buddy_routing import BuddyRouting, GenerationEnded


class Keeper:
    """Records what the routing tells a buddy keeper to keep."""

    def __init__(self) -> None:
        self.kept: set[int] | None = None

    def forget_holdings_except(self, sources: set[int]) -> None:
        self.kept = sources


@pytest.fixture
def store():
    server = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=10))
    yield server


def test_targets_pair_ranks_across_nodes(store):
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


def test_a_rank_that_never_published_ends_the_wait_with_the_generation(store):
    route = BuddyRouting(store, 0, 2, poll_s=0.1)
    route.publish(0, ("127.0.0.1", 9000), "w0", 0)
    ending = threading.Event()
    threading.Timer(0.5, ending.set).start()
    t0 = time.monotonic()
    with pytest.raises(GenerationEnded):
        route.target(0, ending, Keeper())
    assert time.monotonic() - t0 < 5  # not the store's 10 s timeout, and not forever


def test_an_old_generations_record_written_back_is_waited_past(store):
    """A genuine record replayed at its own key (a stranger copied it a generation ago) never places a copy."""
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
    routes = [BuddyRouting(store, r, 2, poll_s=0.1) for r in range(2)]
    routes[0].publish(0, ("127.0.0.1", 9000), "w0", 0)
    routes[1].publish(1, ("127.0.0.1", 9001), "w1", 1)
    with pytest.raises(GenerationEnded):
        routes[0].target(0, threading.Event(), Keeper())
