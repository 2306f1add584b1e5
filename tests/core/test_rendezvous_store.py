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
from torchpass.core.rendezvous_store import RANK_AS_SEQUENCE_ENV, InterruptibleStore, worker_environment

from tests.support.harness import free_port
from tests.support.recording_store import RecordingStore


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


def test_a_key_a_wait_saw_is_read_without_probing_it_again(port: int) -> None:
    """gloo's wait-then-get per peer record: one probe and one read, not two probes."""
    recording = RecordingStore(_client(port, "g4/"))
    store = InterruptibleStore(recording, lambda: False, "building group 'x' of generation 4", timedelta(seconds=5))
    recording.set("0", b"address")
    recording.set("1", b"address")
    recording.log.clear()
    store.wait(["0"])
    assert store.get("0") == b"address"
    assert [op for op, _, _ in recording.log] == ["check", "get"]
    recording.log.clear()
    # A key no wait saw is probed first, so a get of a missing key stays interruptible.
    assert store.get("1") == b"address"
    assert [op for op, _, _ in recording.log] == ["check", "get"]
    with pytest.raises(dist.DistStoreError, match="waited 1 s"):
        InterruptibleStore(recording, lambda: False, "x", timedelta(seconds=1)).get("never")


def _record_bytes(port: int, prefix: str, size: int) -> int:
    """Bytes of the address record rank 0 writes when a ``size``-rank gloo group is built (ranks as threads)."""
    stores = [RecordingStore(_client(port, prefix)) for _ in range(size)]

    def rank(r: int) -> None:
        store = InterruptibleStore(stores[r], lambda: False, f"building group {prefix!r}", timedelta(seconds=60))
        ProcessGroupGloo(store, r, size, timedelta(seconds=60)).allreduce([torch.ones(1)]).wait()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    (nbytes,) = [n for op, _, n in stores[0].log if op == "set"]
    return nbytes


def test_with_the_workers_environment_a_gloo_address_record_does_not_grow_with_the_group(port: int, monkeypatch) -> None:
    """gloo's default record has an 8-byte pair identifier per rank; the launcher's environment removes them."""
    name, value = RANK_AS_SEQUENCE_ENV, worker_environment({})[RANK_AS_SEQUENCE_ENV]
    assert name not in worker_environment({name: "0"}), "a value the user set is kept"
    monkeypatch.delenv(name, raising=False)
    assert _record_bytes(port, "d2/", 2) + 8 == _record_bytes(port, "d3/", 3)
    monkeypatch.setenv(name, value)
    assert _record_bytes(port, "s2/", 2) == _record_bytes(port, "s3/", 3)
