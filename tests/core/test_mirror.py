"""The small-state mirror writes each distinct record once, keeps its durability promise, and compares bits."""

from __future__ import annotations

import secrets
from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist

from torchpass.core.control import Keys, StoreAddress, read_mirror
from torchpass.core.mirror import SmallStateMirror, identical
from torchpass.core.rng import capture_rng
from torchpass.core.free_port import free_port


@pytest.fixture
def address() -> StoreAddress:
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    yield StoreAddress("127.0.0.1", port, secrets.token_bytes(32))
    del server


def _record(position: int) -> dict:
    return {"rng": capture_rng(), "data": {"epoch": 0, "position": position}, "buffers": torch.arange(3.0)}


def test_a_record_identical_to_the_last_one_of_its_version_is_not_queued_again(address: StoreAddress) -> None:
    mirror = SmallStateMirror(address, rank=0)
    mirror.submit(4, _record(8), durable=True)
    mirror.flush(10)
    written = mirror._submitted
    mirror.submit(4, _record(8))  # the next step's start record, nothing drawn since the backward's
    assert mirror._submitted == written
    mirror.submit(4, _record(9))  # the data moved: a new record
    assert mirror._submitted == written + 1
    mirror.flush(10)
    store = address.connect()
    assert read_mirror(store, 0)[4]["data"]["position"] == 9


def test_an_identical_record_asked_for_durably_is_waited_for(address: StoreAddress) -> None:
    mirror = SmallStateMirror(address, rank=1)
    mirror.submit(2, _record(3))
    mirror.submit(2, _record(3), durable=True)
    mirror.flush(10)  # returns only once it is in the store
    store = address.connect()
    assert store.check([Keys.mirror(1, 2 % 3)])


@pytest.mark.parametrize(
    "a, b",
    [
        (torch.tensor([0.0]), torch.tensor([-0.0])),
        (torch.tensor(float("nan")), torch.tensor(float("-nan"))),
        (0.0, -0.0),
        (torch.tensor([1, 2], dtype=torch.int32), torch.tensor([1, 2], dtype=torch.int64)),
        (np.zeros(2, dtype=np.float32), np.zeros(2, dtype=np.float64)),
        ((1, 2), [1, 2]),
        ({"a": 1}, {"a": 1, "b": 2}),
    ],
)
def test_identical_tells_apart_what_differs_in_bits_or_type(a: object, b: object) -> None:
    assert not identical(a, b)


def test_identical_holds_for_equal_bits() -> None:
    nan = torch.tensor([float("nan"), 1.0])
    assert identical({"t": nan, "x": (1.5, b"rng"), "n": np.arange(3)}, {"t": nan.clone(), "x": (1.5, b"rng"), "n": np.arange(3)})
    assert identical(torch.tensor(2.0), torch.tensor(2.0))  # zero-dimensional


class _IdleMirror(SmallStateMirror):
    """A mirror whose thread is never scheduled (as on a machine busier than its cores)."""

    def run(self) -> None:
        return


def test_flush_writes_a_durable_record_itself_when_the_thread_has_not_taken_it(address: StoreAddress) -> None:
    mirror = _IdleMirror(address, rank=2)
    mirror.submit(6, _record(1))
    mirror.submit(7, _record(2), durable=True)
    mirror.flush(10)
    records = read_mirror(address.connect(), 2)
    assert records[6]["data"]["position"] == 1 and records[7]["data"]["position"] == 2
