"""Control-plane reads that must stay cheap at scale: batched multi-key requests and lazily read mirrors."""

from __future__ import annotations

import enum
from datetime import timedelta

import torch.distributed as dist

from torchpass.core.control import STORE_BATCH, Heartbeat, Keys, _to_json, check_all, gather, multi_get, put_object
from torchpass.core.controller import _StoreMirrors
from torchpass.core.rng import capture_rng, rng_digest
from torchpass.core.free_port import free_port


def _store() -> dist.TCPStore:
    port = free_port()
    return dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))


class _Counting:
    """Counts the store operations issued through it."""

    def __init__(self, store: dist.Store):
        self.store = store
        self.ops = 0

    def check(self, keys: list[str]) -> bool:
        self.ops += 1
        return self.store.check(keys)

    def get(self, key: str) -> bytes:
        self.ops += 1
        return self.store.get(key)


def _no_bad_records(key: str, why: str) -> None:
    raise AssertionError(f"unexpected bad record {key}: {why}")


def test_batched_reads_span_several_requests() -> None:
    store = _store()
    n = 2 * STORE_BATCH + 3
    keys = [Keys.heartbeat(f"w{i}") for i in range(n)]
    store.multi_set(keys, [_to_json(Heartbeat(float(i), i, 0, "train")) for i in range(n)])
    assert check_all(store, keys)
    assert not check_all(store, keys + ["tp/missing"])
    assert multi_get(store, keys)[-1] == _to_json(Heartbeat(float(n - 1), n - 1, 0, "train"))
    beats = gather(store, keys, Heartbeat)
    assert [hb.step for hb in beats] == list(range(n))
    assert gather(store, keys[:2], dict) == [
        {"t": 0.0, "step": 0, "generation": 0, "phase": "train", "seq": 0},
        {"t": 1.0, "step": 1, "generation": 0, "phase": "train", "seq": 0},
    ]
    assert gather(store, [], Heartbeat) == []


def test_mirrors_are_read_only_for_the_ranks_asked_about() -> None:
    store = _store()
    rng = capture_rng()
    for version in (4, 5):
        put_object(store, Keys.mirror(7, version % 3), {"version": version, "rng": rng, "data": None})
    counting = _Counting(store)
    mirrors = _StoreMirrors(counting, world_size=1024, on_bad_record=_no_bad_records)  # type: ignore[arg-type]
    assert counting.ops == 0
    assert mirrors[7].versions == {4: rng_digest(rng), 5: rng_digest(rng)}
    assert mirrors.get(3) is None
    assert mirrors.get(5000) is None
    ops = counting.ops
    assert mirrors[7].versions.keys() == {4, 5}  # cached: no further reads
    assert counting.ops == ops <= 12


class _NotAllowed(enum.Enum):
    """A type safe_pickle refuses to load (a framework's enum in a provider's small state, say)."""

    VALUE = "value"


def test_an_unloadable_mirror_is_a_missing_one_and_is_reported() -> None:
    """The controller's planner must not die on a mirror record it may not load: that rank has no mirror."""
    store = _store()
    put_object(store, Keys.mirror(2, 0), {"version": 4, "rng": capture_rng(), "data": None, "extra": _NotAllowed.VALUE})
    bad: list[tuple[str, str]] = []
    mirrors = _StoreMirrors(store, world_size=4, on_bad_record=lambda key, why: bad.append((key, why)))
    assert mirrors.get(2) is None and 2 not in list(mirrors)
    assert len(bad) == 1 and bad[0][0] == "the small-state mirror of rank 2" and "_NotAllowed" in bad[0][1], bad
