"""SignedStore: values sealed under the job secret; anything else is, to every reader, not there."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from torchpass.core.control import Heartbeat, Keys, Mailbox, Plan, Report, get, put, signed, try_get
from torchpass.core.signed_store import SignedStore, seal

from tests.support.secret import SECRET
from torchpass.core.free_port import free_port

OTHER = b"somebody-elses-secret-0000000"



@pytest.fixture
def server() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))


def _client(server: dist.TCPStore, secret: bytes = SECRET) -> SignedStore:
    base = dist.TCPStore("127.0.0.1", server.port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=10))
    return signed(base, secret, timedelta(seconds=3))


def test_a_sealed_record_round_trips(server):
    store = _client(server)
    plan = Plan(generation=3, target_version=7, joins={"1": "n0-s0"}, ranks={}, addresses={}, cause="test")
    put(store, Keys.plan(3), plan)
    assert get(_client(server), Keys.plan(3), Plan) == plan
    assert server.get(Keys.plan(3))[:4] == b"TPS1"  # what a stranger sees on the wire is sealed


@pytest.mark.parametrize(
    "forge",
    [
        lambda key, value: value,  # unsigned
        lambda key, value: seal(OTHER, key, value),  # signed with another secret
        lambda key, value: seal(SECRET, Keys.plan(1), value),  # a genuine record of generation 1, replayed at generation 3
    ],
    ids=["unsigned", "wrong-secret", "replayed-from-another-generation"],
)
def test_a_forged_record_is_absent_to_readers_until_the_genuine_one_replaces_it(server, forge):
    store = _client(server)
    forged = Plan(generation=3, target_version=0, joins={"0": "attacker"}, ranks={}, addresses={}, cause="forged")
    genuine = Plan(generation=3, target_version=7, joins={"1": "n0-s0"}, ranks={}, addresses={}, cause="genuine")
    raw = dist.TCPStore("127.0.0.1", server.port, is_master=False, wait_for_workers=False)
    import json
    import dataclasses

    raw.set(Keys.plan(3), forge(Keys.plan(3), json.dumps(dataclasses.asdict(forged)).encode()))
    assert not store.check([Keys.plan(3)])
    with pytest.raises(dist.DistStoreError):
        store.wait([Keys.plan(3)], timedelta(seconds=0.3))
    threading.Timer(0.3, lambda: put(_client(server), Keys.plan(3), genuine)).start()
    assert get(store, Keys.plan(3), Plan, timeout=10) == genuine  # the reader waited past the forgery
    assert store.forged >= 1


class _Counting(dist.Store):
    """A base store that counts the requests it forwards."""

    def __init__(self, base: dist.Store):
        super().__init__()
        self.base, self.requests = base, 0

    def check(self, keys):
        self.requests += 1
        return self.base.check(keys)

    def get(self, key):
        self.requests += 1
        return self.base.get(key)

    def multi_get(self, keys):
        self.requests += 1
        return self.base.multi_get(keys)

    def set(self, key, value):
        self.base.set(key, value)


def test_a_try_get_reads_a_present_value_in_two_requests_and_an_absent_or_forged_one_as_none(server):
    counting = _Counting(dist.TCPStore("127.0.0.1", server.port, is_master=False, wait_for_workers=False))
    store = SignedStore(counting, SECRET)
    beat = Heartbeat(t=1.5, step=9, generation=0, phase="train", seq=4)
    put(_client(server), Keys.heartbeat("n0-a0"), beat)
    counting.requests = 0
    assert try_get(store, Keys.heartbeat("n0-a0"), Heartbeat) == beat
    assert counting.requests == 2  # check, get: the value's seal is checked once, on the value read
    assert try_get(store, Keys.heartbeat("n0-a1"), Heartbeat) is None
    dist.TCPStore("127.0.0.1", server.port, is_master=False, wait_for_workers=False).set(Keys.heartbeat("n0-a2"), b'{"seq": 99}')
    assert try_get(store, Keys.heartbeat("n0-a2"), Heartbeat) is None and store.forged == 1


def test_compare_set_on_an_empty_key_replaces_a_forged_value(server):
    store = _client(server)
    dist.TCPStore("127.0.0.1", server.port, is_master=False, wait_for_workers=False).set(Keys.end(4), b"forged: stop the job")
    assert store.compare_set(Keys.end(4), "", "rank 1: lost") == b"rank 1: lost"
    assert store.compare_set(Keys.end(4), "", "second reason") == b"rank 1: lost"  # the first genuine reason stays
    assert store.get(Keys.end(4)) == b"rank 1: lost"


def test_a_forged_mailbox_entry_is_skipped_and_the_genuine_ones_read(server):
    store = _client(server)
    raw = dist.TCPStore("127.0.0.1", server.port, is_master=False, wait_for_workers=False)
    box = Mailbox(store, Keys.events, missing_after_s=0.2)
    box.post(Report("drain", rank=1))
    n = raw.add(f"{Keys.events}/seq", 1)  # a stranger appends a migrate request, unsigned
    raw.set(f"{Keys.events}/{n}", b'{"kind": "migrate", "rank": 0}')
    box.post(Report("exit", rank=2))
    reader = Mailbox(_client(server), Keys.events, missing_after_s=0.2)
    bad: list[str] = []
    seen = list(reader.drain(Report, lambda key, why: bad.append(key)))
    time.sleep(0.3)
    seen += list(reader.drain(Report, lambda key, why: bad.append(key)))
    assert [(r.kind, r.rank) for r in seen] == [("drain", 1), ("exit", 2)]
    assert bad == [f"{Keys.events}/{n}"]


def test_counters_stay_plain(server):
    store = _client(server)
    assert store.add("tp/g/0/status_count", 1) == 1
    assert _client(server).add("tp/g/0/status_count", 0) == 1
