"""The controller's election on a real 3-member etcd cluster (with and without etcd's authentication): one
holder at a time, a dead holder's lease expires and another launcher takes over, and a holder that lost the key
can no longer write (fencing)."""

from __future__ import annotations

import time
import uuid
from datetime import timedelta
from typing import Iterator

import pytest
import torch.distributed as dist

from torchpass.core.control import Keys
from torchpass.core.controller_election import ControllerLease
from torchpass.core.etcd_store import EtcdStore, GuardLost, job_url, parse_etcd_url

from tests.support.etcd import ETCD, EtcdCluster, auth_cluster

TTL_S = 2


@pytest.fixture(scope="module", params=["open", "auth"])
def cluster(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EtcdCluster, str]]:
    """A cluster, and the URL a job names it by: without authentication, or as a user allowed under /torchpass/."""
    if ETCD is None:
        pytest.skip("etcd is not installed here (.ci/run installs Debian's etcd-server)")
    folder = tmp_path_factory.mktemp("etcd")
    if request.param == "open":
        c = EtcdCluster(folder).start()
        url = c.url
    else:
        c = auth_cluster(folder)
        url = c.user_url(folder / "password")
    yield c, url
    c.stop()


@pytest.fixture
def store(cluster: tuple[EtcdCluster, str]) -> EtcdStore:
    return EtcdStore(parse_etcd_url(job_url(cluster[1], uuid.uuid4().hex)), timedelta(seconds=10))


def test_one_holder_at_a_time_and_the_holder_is_named(store: EtcdStore) -> None:
    first, second = ControllerLease(store, 0, TTL_S), ControllerLease(store, 1, TTL_S)
    assert first.campaign() and first.held
    assert not second.campaign() and not second.held
    assert second.holder() == 0
    time.sleep(TTL_S * 1.5)  # renewed by its thread: still the holder past its TTL
    assert first.held and not second.campaign()
    first.resign()
    assert second.holder() is None and second.campaign() and second.holder() == 1
    second.resign()


def test_a_holder_that_stops_renewing_is_replaced_and_fenced(store: EtcdStore) -> None:
    old, new = ControllerLease(store, 0, TTL_S), ControllerLease(store, 1, TTL_S)
    assert old.campaign()
    old_writes = old.guarded()
    old_writes.set("k", b"old")  # the holder writes
    old._stop.set()  # its renewals stop, as when its launcher is paused or cut off
    deadline = time.monotonic() + 10 * TTL_S
    while not new.campaign():
        assert time.monotonic() < deadline, "the lease of a holder that stopped renewing never expired"
        time.sleep(0.1)
    took_over = time.monotonic()
    assert new.token > old.token
    new.guarded().set("k", b"new")
    # The old holder has not noticed anything, yet none of its writes commits any more.
    for write in (
        lambda: old_writes.set("k", b"stale"),
        lambda: old_writes.add("n", 1),
        lambda: old_writes.compare_set("k", b"new", b"stale"),
        lambda: old_writes.multi_set(["k"], [b"stale"]),
        lambda: old_writes.delete_key("k"),
    ):
        with pytest.raises(GuardLost):
            write()
    assert store.get("k") == b"new" and not store.check(["n"])
    assert isinstance(GuardLost("x"), dist.DistStoreError)  # a store error to whoever does not know fencing
    print(f"[election] taken over {took_over - deadline + 10 * TTL_S:.2f} s after renewals stopped (TTL {TTL_S} s)")
    new.resign()


def test_guarded_writes_keep_the_store_semantics(store: EtcdStore) -> None:
    lease = ControllerLease(store, 0, TTL_S)
    assert lease.campaign()
    s = lease.guarded()
    assert s.add("c", 2) == 2 and s.add("c", 3) == 5
    assert s.compare_set("x", "", "first") == b"first"
    assert s.compare_set("x", "wrong", "second") == b"first"  # its own comparison failed: c10d's answer, no GuardLost
    assert s.compare_set("missing", "wrong", "v") == b"wrong"
    assert s.delete_key("x") and not s.delete_key("x")
    assert store.check([Keys.controller])
    lease.resign()
    assert not store.check([Keys.controller])
