"""The control-plane benchmark's smallest configuration runs end to end (no timing asserted)."""

from __future__ import annotations

import ipaddress
import math
import socket
import threading
from datetime import timedelta

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import ProcessGroupGloo

from bench.control_plane import first_collective_peers, gloo_record, markdown, measure, rendezvous_key
from torchpass.core.comms import record_endpoint


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_one_migration_at_64_ranks() -> None:
    row = measure(64, _free_port())
    assert row["ranks"] == 64
    assert row["plan_bytes"] > 0
    assert 0 < row["controller_critical_s"] <= row["detect_s"] + row["plan_s"] + row["go_s"]
    assert row["critical_s"] == row["controller_critical_s"] + row["rendezvous_s"] + row["routing_s"]
    # Reading whole generations goes through batched requests: a handful of operations per phase.
    assert row["total_ops"] < 100
    # A member's buddy routing reads the job record, the plan and its target's record: no peer's but one.
    assert row["routing_ops"] < 10
    # gloo's lazy device: one record written, then the records of the 2 log2(64) - 1 = 11 peers the first
    # collectives connect to, each a wait and a read: up to 5 requests, as the interruptible wait checks
    # before it waits or reads and the seal's check reads the value to open it.
    assert len(first_collective_peers(row["ranks"] // 2, 64)) == 11
    assert 1 + 11 * 2 <= row["rendezvous_ops"] <= 1 + 11 * 5
    assert "| 64 |" in markdown([row])


class _Recording(dist.Store):
    """A store that logs what it is asked, in order: (operation, key, value bytes)."""

    def __init__(self, base: dist.Store) -> None:
        super().__init__()
        self._base = base
        self.log: list[tuple[str, str, int]] = []

    def set(self, key: str, value: bytes) -> None:
        self.log.append(("set", key, len(value)))
        self._base.set(key, value)

    def get(self, key: str) -> bytes:
        value = self._base.get(key)
        self.log.append(("get", key, len(value)))
        return value

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self.log += [("wait", key, 0) for key in keys]
        self._base.wait(keys, timeout or timedelta(seconds=30))

    def check(self, keys: list[str]) -> bool:
        return self._base.check(keys)


def test_the_simulated_rendezvous_is_the_one_gloo_does() -> None:
    """What the bench replays for a member (write its record, then wait for and read the records of the peers its
    first collectives connect to, in order, at gloo's record size) is what ``ProcessGroupGloo`` on a lazy device asks
    of its store for a barrier then an allreduce (``Migration._go_live``'s barrier, then the first step)."""
    size = 8
    server = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=30), wait_for_workers=False)
    stores = [_Recording(dist.TCPStore("127.0.0.1", server.port, 1, False, timeout=timedelta(seconds=30))) for _ in range(size)]
    built: dict[int, list[tuple[str, str, int]]] = {}
    reduced: dict[int, list[float]] = {}

    def member(r: int) -> None:
        options = ProcessGroupGloo._Options()
        options._devices = [ProcessGroupGloo.create_default_device(lazy_init=True)]
        options._timeout = timedelta(seconds=30)
        group = ProcessGroupGloo(stores[r], r, size, options)
        built[r] = list(stores[r].log)
        group.barrier().wait()
        t = torch.ones(2)
        group.allreduce([t]).wait()
        reduced[r] = t.tolist()

    threads = [threading.Thread(target=member, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert reduced == {r: [float(size)] * 2 for r in range(size)}
    # Building writes the rank's record and waits for nobody.
    assert built == {r: [("set", rendezvous_key(r), len(gloo_record(r)))] for r in range(size)}
    record = len(gloo_record(0))
    for r in range(size):
        peers = first_collective_peers(r, size)
        assert len(peers) == 2 * int(math.log2(size)) - 1
        reads = [step for p in peers for step in (("wait", rendezvous_key(p), 0), ("get", rendezvous_key(p), record))]
        assert stores[r].log == [("set", rendezvous_key(r), record), *reads], r


def test_a_simulated_record_names_its_rank_s_address_as_gloo_s_do() -> None:
    """The tap a member's rendezvous goes through reads the address in every record (``comms.record_endpoint``)."""
    assert record_endpoint(gloo_record(5)) == (ipaddress.ip_address("127.0.0.1"), 20005)
