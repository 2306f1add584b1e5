"""InterruptibleStore: a gloo rendezvous waiting for a dead peer ends when its generation is released."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch.distributed import ProcessGroupGloo

from torchpass.core.failures import ABANDONED_MARKER, is_comm_error
from torchpass.core.rendezvous_store import InterruptibleStore

from tests.support.harness import free_port


@pytest.fixture
def port():
    port = free_port()
    master = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    yield port
    del master


def _client(port: int, prefix: str) -> dist.Store:
    return dist.PrefixStore(prefix, dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False))


def test_a_rendezvous_missing_a_peer_gives_up_when_released(port: int) -> None:
    """Rank 1 never publishes its address (it died after 'go'): without the release rank 0 waits 60 s."""
    released = threading.Event()
    store = InterruptibleStore(_client(port, "g1/"), released.is_set, "building group 'x' of generation 1", timedelta(seconds=60))
    threading.Timer(1.0, released.set).start()
    t0 = time.monotonic()
    with pytest.raises(RuntimeError) as err:
        ProcessGroupGloo(store, 0, 2, timedelta(seconds=60))
    assert ABANDONED_MARKER in str(err.value) and is_comm_error(str(err.value))
    assert time.monotonic() - t0 < 10, "the wait did not end with the release"


def test_a_rendezvous_still_connects_and_reduces(port: int) -> None:
    results: dict[int, list[float]] = {}

    def rank(r: int) -> None:
        store = InterruptibleStore(_client(port, "g2/"), lambda: False, "building group 'x' of generation 2", timedelta(seconds=60))
        group = ProcessGroupGloo(store, r, 2, timedelta(seconds=60))
        t = torch.full((3,), float(r + 1))
        group.allreduce([t]).wait()
        results[r] = t.tolist()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == {0: [3.0, 3.0, 3.0], 1: [3.0, 3.0, 3.0]}


def test_a_wait_past_its_deadline_is_a_store_timeout(port: int) -> None:
    store = InterruptibleStore(_client(port, "g3/"), lambda: False, "building group 'x' of generation 3", timedelta(seconds=1))
    with pytest.raises(dist.DistStoreError, match="waited 1 s"):
        store.wait(["never"])
